"""A model's weights for all-custom (device-resident) graphs: every matrix dequantized once to
F16 in the cache's array module (numpy or CuPy), RMS-norm weights folded into the matrices.

The device form of the llama block (``model_graph.py``) runs on ``xp_ops``' fused ops, whose
RMS norm has no weight: ``rms_norm(x) * g`` followed by ``W·`` is ``W' · rms_norm(x)`` with
``W' = W * g[None, :]`` (numpy order ``(n_out, n_in)``; ``g`` scales the input columns). So

* ``wq wk wv`` carry ``attn_norm``, ``wg wu`` carry ``ffn_norm``, ``output`` carries
  ``output_norm`` (the fold is done in float32, then rounded to F16 once);
* ``wo wd`` and the token embedding are the file's values as F16;
* a tied head (``output`` is ``token_embd``) gets a folded copy of its own: the embedding is
  read unscaled.

Memory (:attr:`DeviceWeights.nbytes`): 2 bytes per element of every matrix (``token_embd``,
``output`` when not tied, ``wq wk wv wo wg wu wd`` per layer), plus ``2 * n_vocab * n_embd``
for the head's copy when tied, plus 4 bytes per element of the F32 vectors kept (Q/K/V biases,
``rope_freqs``); the norm weights themselves are not kept. For llama-3-8B (untied, vocab
128256): 2 * 8.03e9 bytes = 16.1 GB.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["DeviceWeights", "fold_norm"]

_QKV, _FFN = ("wq", "wk", "wv"), ("wg", "wu")


def fold_norm(w, g, name: str):
    """F16 ``w * g[None, :]``, computed in float32 in ``w``'s array module (``w`` ``(n_out,
    n_in)`` of any float type, ``g`` float32 ``(n_in,)``, both numpy or both CuPy); ValueError
    when a product leaves F16's range."""
    out = (w.astype(np.float32) * g[None, :]).astype(np.float16)
    if not bool(np.isfinite(out).all()):
        big = float(np.abs(w.astype(np.float32) * g[None, :]).max())
        raise ValueError(f"{name}: the matrix times its RMS norm weight overflows F16 (max |w * g| = {big:.4g})")
    return out


@dataclass(eq=False)
class DeviceWeights:
    """The weights of one ``graph.model.Model`` in array module ``xp`` (module docstring).
    ``tok_embd`` F16 ``(n_vocab, n_embd)``; ``output`` F16 ``(n_vocab, n_embd)`` with
    ``output_norm`` folded; ``layers[il]``: ``wq wk wv`` (``attn_norm`` folded), ``wo``, ``wg wu``
    (``ffn_norm`` folded), ``wd`` F16 ``(n_out, n_in)``, and ``bq bk bv`` F32 where the model has
    them; ``rope_freqs`` F32 ``(rope_dim / 2,)`` or None."""

    xp: object
    tok_embd: object
    output: object
    layers: list[dict]
    rope_freqs: object = None
    tied_copy: bool = False     # output is a folded copy of token_embd
    _arrays: list = field(default_factory=list, repr=False)

    @classmethod
    def from_model(cls, model, xp=np) -> "DeviceWeights":
        """Dequantize, copy and fold every weight of ``model`` to ``xp`` (one matrix at a time: an
        F16 file's matrices go up as they are and are folded in ``xp``, others are dequantized to
        float32 on the host first). Build it once per model and array module (``Model.device_weights``)."""
        def to_xp(a):
            return xp.asarray(np.ascontiguousarray(a))

        def f32(w):
            return to_xp(w.to_float(np.float32))

        def to_fold(w):   # an F16 file's matrix uploads as it is (no float32 copy on the host)
            return to_xp(w.to_float(np.float16 if w.type_name == "F16" else np.float32))

        layers = []
        for il, lw in enumerate(model.layers):
            d = {}
            for keys, norm in ((_QKV, "attn_norm"), (_FFN, "ffn_norm")):
                g = f32(lw[norm])
                for k in keys:
                    d[k] = fold_norm(to_fold(lw[k]), g, lw[k].name)   # on the device for CuPy
            for k in ("wo", "wd"):
                d[k] = to_xp(lw[k].to_float(np.float16))
            for k in ("bq", "bk", "bv"):
                if k in lw:
                    d[k] = f32(lw[k])
            layers.append(d)
        out = fold_norm(to_fold(model.output), f32(model.output_norm), model.output.name)
        ff = None if model.rope_freqs is None else f32(model.rope_freqs)
        return cls(xp, to_xp(model.tok_embd.to_float(np.float16)), out, layers, ff, model.tied_output)

    def arrays(self) -> list:
        """Every array held, once."""
        arrs = [self.tok_embd, self.output, *(a for d in self.layers for a in d.values())]
        if self.rope_freqs is not None:
            arrs.append(self.rope_freqs)
        return arrs

    @property
    def nbytes(self) -> int:
        """Bytes held (module docstring: F16 matrices, the tied head's copy, F32 vectors)."""
        return sum(int(a.nbytes) for a in self.arrays())

    @staticmethod
    def expected_nbytes(model) -> int:
        """:attr:`nbytes` from the model's shapes alone (before building)."""
        hp = model.hp
        n = 2 * hp.n_vocab * hp.n_embd * 2        # token_embd + output (its own, or the tied copy)
        per_layer = 2 * (hp.n_embd * (hp.n_embd_q + 2 * hp.n_embd_kv) + hp.n_embd_q * hp.n_embd
                         + 3 * hp.n_embd * hp.n_ff)
        n += hp.n_layer * per_layer
        if "bq" in model.layers[0]:
            n += hp.n_layer * 4 * (hp.n_embd_q + 2 * hp.n_embd_kv)
        if model.rope_freqs is not None:
            n += 4 * int(np.prod(model.rope_freqs.ne))
        return n
