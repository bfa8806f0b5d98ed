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


_STAGE_AHEAD = 1 << 30   # bytes of file read ahead of the matrix being folded (staged loads)
_RAW_TYPES = {"F16": np.float16, "F32": np.float32, "BF16": np.uint16}


def _jobs(model) -> list[tuple]:
    """Every matrix in file order of use: (key, Weight, norm Weight or None); key ``(il, name)``
    for a layer's, ``"tok_embd"`` / ``"output"`` for the others."""
    jobs = [("tok_embd", model.tok_embd, None)]
    for il, lw in enumerate(model.layers):
        jobs += [((il, k), lw[k], lw["attn_norm"]) for k in _QKV]
        jobs += [((il, "wo"), lw["wo"], None)]
        jobs += [((il, k), lw[k], lw["ffn_norm"]) for k in _FFN]
        jobs += [((il, "wd"), lw["wd"], None)]
    jobs.append(("output", model.output, model.output_norm))
    return jobs


def _raw_ok(w) -> bool:
    """``w``'s file bytes can go to the GPU as they are (a float type, at a known offset)."""
    return w.offset >= 0 and w.type_name in _RAW_TYPES


def _raw_values(raw, w, xp):
    """The values of float weight ``w`` from its file bytes ``raw`` (``xp`` uint8), numpy order:
    F16 / F32 as they are, BF16 widened to float32."""
    shape = tuple(reversed(w.ne))
    vals = raw.view(_RAW_TYPES[w.type_name]).reshape(shape)
    if w.type_name == "BF16":
        vals = (vals.astype(np.uint32) << 16).view(np.float32)
    return vals


def fold_norm(w, g, name: str, *, check: bool = True):
    """F16 ``w * g[None, :]``, computed in float32 in ``w``'s array module (``w`` ``(n_out,
    n_in)`` of any float type, ``g`` float32 ``(n_in,)``, both numpy or both CuPy); ValueError
    when a product leaves F16's range (``check=False``: the caller checks the result)."""
    out = (w.astype(np.float32) * g[None, :]).astype(np.float16)
    if check and not bool(np.isfinite(out).all()):
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
    def from_model(cls, model, xp=np, *, staged: bool | None = None) -> "DeviceWeights":
        """Dequantize, copy and fold every weight of ``model`` to ``xp``. Build it once per model
        and array module (``Model.device_weights``).

        ``staged`` (default: on for CuPy): F16 / F32 / BF16 matrices go from the file to the GPU
        through pinned buffers (``upload.FileUploader``: reads and copies overlap, a window of
        ``_STAGE_AHEAD`` bytes ahead of the folds) and are converted and folded there; the other
        types are dequantized to float32 on the host first, one matrix at a time."""
        if staged is None:
            staged = xp is not np
        if staged and xp is np:
            raise ValueError("staged loading copies to a GPU: it needs xp=cupy")
        jobs = _jobs(model)
        up = None
        if staged and any(_raw_ok(w) for _, w, _ in jobs):
            from .upload import FileUploader   # noqa: PLC0415
            up = FileUploader(model.path)
        try:
            return cls._build(model, xp, jobs, up)
        finally:
            if up is not None:
                up.close()

    @classmethod
    def _build(cls, model, xp, jobs, up) -> "DeviceWeights":
        import collections
        import contextlib

        def to_xp(a):
            return xp.asarray(np.ascontiguousarray(a))

        def f32(w):
            return to_xp(w.to_float(np.float32))

        checks = []   # (device bool, weight, norm) of the staged folds, read once at the end
        queued = collections.deque()
        ahead = 0
        it = iter(jobs)
        out: dict = {}
        norms: dict = {}
        stream = contextlib.nullcontext() if up is None else xp.cuda.ExternalStream(up.stream.ptr)

        def fill():
            nonlocal ahead
            for job in it:
                w = job[1]
                pend = up.read(w.offset, w.nbytes) if up is not None and _raw_ok(w) else None
                queued.append((job, pend))
                ahead += w.nbytes if pend is not None else 0
                if ahead >= _STAGE_AHEAD:
                    return
        fill()
        with stream:
            while queued:
                (key, w, norm), pend = queued.popleft()
                if pend is not None:
                    raw = pend.result()
                    ahead -= w.nbytes
                    fill()   # the next reads go out before this matrix is folded
                    vals = _raw_values(raw, w, xp)
                else:
                    vals = None
                if norm is None:
                    if vals is None:
                        vals = to_xp(w.to_float(np.float16))
                    out[key] = vals if vals.dtype == np.float16 else vals.astype(np.float16)
                    continue
                g = norms.get(norm.name)
                if g is None:
                    g = norms[norm.name] = f32(norm)
                if vals is None:   # an F16 file's matrix uploads as it is (no float32 copy on the host)
                    vals = to_xp(w.to_float(np.float16 if w.type_name == "F16" else np.float32))
                    out[key] = fold_norm(vals, g, w.name)
                else:
                    out[key] = fold_norm(vals, g, w.name, check=False)
                    checks.append((xp.isfinite(out[key]).all(), w, norm))
        if checks:
            ok = xp.stack([c for c, _, _ in checks]).get()
            for (_, w, norm), good in zip(checks, ok):
                if not good:   # the first matrix that overflowed, measured again on the host
                    fold_norm(w.to_float(np.float32), norm.to_float(np.float32), w.name)
        layers = []
        for il, lw in enumerate(model.layers):
            d = {k: out[(il, k)] for k in (*_QKV, *_FFN, "wo", "wd")}
            for k in ("bq", "bk", "bv"):
                if k in lw:
                    d[k] = f32(lw[k])
            layers.append(d)
        ff = None if model.rope_freqs is None else f32(model.rope_freqs)
        if up is not None:   # the temporaries were freed on the upload stream: give them back
            xp.get_default_memory_pool().free_all_blocks()
        return cls(xp, out["tok_embd"], out["output"], layers, ff, model.tied_output)

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
