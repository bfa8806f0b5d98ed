"""A model's weights for all-custom (device-resident) graphs, in the cache's array module
(numpy or CuPy): matrices of ggml's block types (``ggml_attn.block_types``: Q4_0 .. Q6_K) stay in
their blocks, exactly the file's bytes (:class:`QMatrix`), or, on a GPU where :func:`keep_blocks`
says so (``GGML_ATTN_WEIGHTS=f16``: faster batched decode where the bytes fit), become F16 as float
matrices do: dequantized on the GPU, the RMS-norm weights folded in; other types (IQ*) are
dequantized to F16 at load (said once on stderr).

The device form of the llama block (``model_graph.py``) runs on ``xp_matmul``'s fused ops, which
take the block's RMS norm and its weight ``g`` (numpy order ``(n_in,)``): a :class:`QMatrix`
applies ``g`` to the normalized activations when it runs (its blocks cannot carry a fold);
an F16 matrix carries it from the load: ``rms_norm(x) * g`` followed by ``W·`` is
``W' · rms_norm(x)`` with ``W' = W * g[None, :]`` (numpy order ``(n_out, n_in)``), so

* ``wq wk wv`` carry ``attn_norm``, ``wg wu`` carry ``ffn_norm``, ``output`` carries
  ``output_norm`` (the fold is done in float32, then rounded to F16 once);
* ``wo wd`` and the token embedding are the file's values as F16;
* a tied F16 head (``output`` is ``token_embd``) gets a folded copy of its own: the embedding is
  read unscaled; a tied block head is the embedding's blocks, shared.

One graph shape for every weight type: the ops take the norm weight whatever the matrix; an F16
matrix just has nothing left to apply (:attr:`DeviceWeights.norms` holds ``g`` for the blocks).

Memory (:attr:`DeviceWeights.nbytes`, :meth:`DeviceWeights.bytes_by_type`): a block matrix
its file bytes; an F16 one 2 bytes per element (and the tied head's copy); 4 bytes per element
of the F32 vectors kept (norm weights, Q/K/V biases, ``rope_freqs``); plus, on a GPU holding
block matrices, one F16 scratch of the largest layer matrix (:attr:`DeviceWeights.scratch`:
GEMMs of many tokens dequantize a matrix into it, ``path_gemm``). For llama-3-8B as F16: 16.1 GB;
as Q4_K_M (4.6 GiB file): the file's tensor bytes, plus the 117 MB scratch.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from ggml_attn.block_types import block_layout, is_block_type

__all__ = ["DeviceWeights", "QMatrix", "fold_norm", "keep_blocks"]

_QKV, _FFN = ("wq", "wk", "wv"), ("wg", "wu")
# a layer's F32 vectors, where the model has them: biases, norm weights (qwen3's per-head Q/K norms,
# gemma2's norms of the attention's and the FFN's outputs)
_VECTORS = ("bq", "bk", "bv", "attn_norm", "ffn_norm", "q_norm", "k_norm", "attn_post_norm", "ffn_post_norm")


_STAGE_AHEAD = 1 << 30   # bytes of file read ahead of the matrix being folded (staged loads)
SCRATCH_MIN_ELEMENTS = 1 << 22   # F16 scratch of a GPU holding block matrices: at least this (and the largest layer matrix)
_RAW_TYPES = {"F16": np.float16, "F32": np.float32, "BF16": np.uint16}

# The form of block-type matrices on a GPU: "auto", "blocks" or "f16" ($GGML_ATTN_WEIGHTS). "auto"
# keeps them in their blocks, the file's bytes: on an H100 at 072905f
# (bench/results/2026-12-05-072905f-h100-side-by-side-q4km/) the 8B-shaped Q4_K_M file ran tg128
# 311.5 t/s in blocks against llama.cpp's 271.1 and batched B=1 S_TG 302 against the F16 form's 166,
# in a quarter of the memory; the F16 form ("f16": dequantized on the GPU at load, norms folded as
# for F16 files) ran batched S_TG 1.6-1.7x the blocks' at 16 and 64 sequences (cuBLAS against the
# tiled block GEMM), a choice for batched throughput where the F16 bytes fit.
WEIGHTS = os.environ.get("GGML_ATTN_WEIGHTS", "auto")
WEIGHT_FORMS = ("auto", "blocks", "f16")


def keep_blocks(model, xp) -> tuple[bool, str]:
    """(True: block-type matrices stay in their blocks on ``xp``; the reason): the one place
    that decides (:data:`WEIGHTS`). Host arrays keep them (the numpy device form multiplies by
    ggml's values); on a GPU "auto" keeps them too and "f16" makes them F16. ValueError for an
    unknown :data:`WEIGHTS`."""
    if WEIGHTS not in WEIGHT_FORMS:
        raise ValueError(f"GGML_ATTN_WEIGHTS={WEIGHTS!r}: expected one of {', '.join(WEIGHT_FORMS)}")
    if xp is np:
        return True, "host arrays"
    if not any(is_block_type(w.type_name) for _, w, _ in _jobs(model, True)):
        return True, "no block-type matrices"
    return WEIGHTS != "f16", f"GGML_ATTN_WEIGHTS={WEIGHTS}"


def _jobs(model, blocks: bool = True) -> list[tuple]:
    """Every matrix in file order of use: (key, Weight, norm Weight or None); key ``(il, name)``
    for a layer's, ``"tok_embd"`` / ``"output"`` for the others (``blocks``: block matrices stay
    in their blocks, so a tied block head is the embedding's, no job of its own)."""
    jobs = [("tok_embd", model.tok_embd, None)]
    for il, lw in enumerate(model.layers):
        jobs += [((il, k), lw[k], lw["attn_norm"]) for k in _QKV]
        jobs += [((il, "wo"), lw["wo"], None)]
        jobs += [((il, k), lw[k], lw["ffn_norm"]) for k in _FFN]
        jobs += [((il, "wd"), lw["wd"], None)]
    if not (blocks and model.tied_output and is_block_type(model.output.type_name)):   # a tied block head: the embedding's
        jobs.append(("output", model.output, model.output_norm))
    return jobs


def _raw_ok(w) -> bool:
    """``w``'s file bytes can go to the GPU as they are (a float or block type, at a known offset)."""
    return w.offset >= 0 and (w.type_name in _RAW_TYPES or is_block_type(w.type_name))


@dataclass(eq=False)
class QMatrix:
    """A matrix in its ggml blocks: ``blocks`` xp uint8 ``(n_out, row_bytes)``, the file's bytes;
    ``shape`` ``(n_out, n_in)`` numpy order (ggml ``[n_in, n_out]``); ``type`` a block type name;
    ``scratch``: on a GPU, the F16 room its GEMMs dequantize into (shared by a model's matrices)."""

    type: str
    shape: tuple
    blocks: object
    scratch: object = field(default=None, repr=False)   # the weights' F16 scratch (GPU GEMMs)
    _values: object = field(default=None, repr=False)

    @property
    def layout(self):
        return block_layout(self.type)

    @property
    def type_id(self) -> int:
        return self.layout.type_id

    @property
    def row_bytes(self) -> int:
        return int(self.blocks.shape[1])

    @property
    def nbytes(self) -> int:
        return int(self.blocks.nbytes)

    def values(self) -> np.ndarray:
        """float32 ``(n_out, n_in)``, ggml's dequantization (numpy blocks only: what the numpy
        device form multiplies by; made once)."""
        if self._values is None:
            from ggml_attn.quant import dequantize_rows   # noqa: PLC0415
            b = np.ascontiguousarray(self.blocks)
            self._values = dequantize_rows(b.ctypes.data, self.type_id, self.shape[1], self.shape[0], b.shape[1])
        return self._values

    def rows_launch(self, ids, out):
        """``out`` = rows ``ids`` of the matrix as F32, ggml's values (CuPy blocks): one
        ``dense_get_rows_q`` launch (``kernels.BoundLaunch``, on the current stream when
        called); ``ids`` int32 ``(n_ids,)`` in range, ``out`` F32 ``(n_ids, n_in)`` contiguous."""
        import ctypes   # noqa: PLC0415
        from ggml_attn import kernels as K   # noqa: PLC0415
        n_in, t = self.shape[1], self.type_id
        return K.grid_launch(K.get_function(K.dense_q_variant(t), f"dense_get_rows_q<{t}>"), ids.shape[0] * (n_in // 32),
                             ctypes.c_uint64(self.blocks.data.ptr), ctypes.c_uint64(ids.data.ptr),
                             ctypes.c_uint64(out.data.ptr), ctypes.c_int64(self.row_bytes), ctypes.c_int32(n_in),
                             ctypes.c_int64(ids.shape[0]))


def _raw_values(raw, w, xp):
    """The values of float weight ``w`` from its file bytes ``raw`` (``xp`` uint8), numpy order:
    F16 / F32 as they are, BF16 widened to float32."""
    shape = tuple(reversed(w.ne))
    vals = raw.view(_RAW_TYPES[w.type_name]).reshape(shape)
    if w.type_name == "BF16":
        vals = (vals.astype(np.uint32) << 16).view(np.float32)
    return vals


def _block_values(q: QMatrix, xp):
    """ggml's values of block matrix ``q`` as F32 ``(n_out, n_in)`` numpy order, on the GPU (every
    row gathered, :meth:`QMatrix.rows_launch`): what the host path gets from ggml's
    dequantization, so the F16 form folds and rounds as it does."""
    vals = xp.empty(q.shape, dtype=np.float32)
    q.rows_launch(xp.arange(q.shape[0], dtype=np.int32), vals)()
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
    """The weights of one ``graph.model.Model`` in array module ``xp`` (module docstring). Each
    matrix is a :class:`QMatrix` (block types) or an F16 array ``(n_out, n_in)``: ``tok_embd``
    ``(n_vocab, n_embd)``; ``output`` (``output_norm`` folded into an F16 one); ``layers[il]``:
    ``wq wk wv`` (``attn_norm`` folded into F16 ones), ``wo``, ``wg wu`` (``ffn_norm``), ``wd``,
    ``bq bk bv q_norm k_norm attn_post_norm ffn_post_norm`` F32 where the model has them, and ``attn_norm`` / ``ffn_norm`` F32 ``(n_embd,)``
    (what block matrices apply at run time); ``output_norm`` likewise; ``rope_freqs`` F32
    ``(rope_dim / 2,)`` or None; ``scratch``: F16 room for the largest layer matrix when a block
    matrix is on a GPU (None otherwise)."""

    xp: object
    tok_embd: object
    output: object
    layers: list[dict]
    rope_freqs: object = None
    tied_copy: bool = False     # output is a folded copy of token_embd
    output_norm: object = None
    scratch: object = None
    load_s: float = 0.0         # wall seconds from_model took (the file read, uploaded, folded)
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
        blocks, why = keep_blocks(model, xp)
        jobs = _jobs(model, blocks)
        up, t0 = None, time.perf_counter()
        if staged and any(_raw_ok(w) for _, w, _ in jobs):
            from .upload import FileUploader   # noqa: PLC0415
            up = FileUploader(model.path)
        try:
            dw = cls._build(model, xp, jobs, up, blocks, why)
            if xp is not np:
                xp.cuda.Device().synchronize()   # (the copies done: the time is the load's)
            dw.load_s = time.perf_counter() - t0
            return dw
        finally:
            if up is not None:
                up.close()

    @classmethod
    def _build(cls, model, xp, jobs, up, blocks: bool = True, why: str = "") -> "DeviceWeights":
        import collections
        import contextlib

        def to_xp(a):
            return xp.asarray(np.ascontiguousarray(a))

        def f32(w):
            return to_xp(w.to_float(np.float32))

        def vector(w):   # a norm weight already uploaded for a fold is the same array
            got = norms.get(w.name)
            return got if got is not None else f32(w)

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
                raw = None
                if pend is not None:
                    raw = pend.result()
                    ahead -= w.nbytes
                    fill()   # the next reads go out before this matrix is used
                if is_block_type(w.type_name):   # the file's bytes, as they are
                    raw = xp.asarray(w.data) if raw is None else raw
                    shape = tuple(reversed(w.ne))
                    q = QMatrix(w.type_name, shape, raw.reshape(shape[0], -1))
                    if blocks:
                        out[key] = q
                        continue
                    vals = _block_values(q, xp)   # ggml's values in F32, on the GPU; folded below
                else:
                    vals = None if raw is None else _raw_values(raw, w, xp)
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
            for k in _VECTORS:
                if k in lw:
                    d[k] = vector(lw[k])
            layers.append(d)
        ff = None if model.rope_freqs is None else f32(model.rope_freqs)
        output = out.get("output", out["tok_embd"])   # a tied block head: the embedding's blocks, shared
        tied_copy = model.tied_output and output is not out["tok_embd"]
        on = vector(model.output_norm)
        scratch = None
        blocks = [m for m in out.values() if isinstance(m, QMatrix)]
        if blocks and xp is not np:
            layer_max = max((m.shape[0] * m.shape[1] for k, m in out.items() if isinstance(m, QMatrix)
                             and isinstance(k, tuple)), default=0)
            scratch = xp.empty(max(layer_max, SCRATCH_MIN_ELEMENTS), dtype=np.float16)
            for m in blocks:
                m.scratch = scratch
        others = sorted({w.type_name for _, w, _ in jobs if not is_block_type(w.type_name)
                         and w.type_name not in _RAW_TYPES})
        as_f16 = sorted({w.type_name for _, w, _ in jobs if is_block_type(w.type_name)}) if not blocks else []
        if as_f16:   # said once per model and device, as the IQ types below
            print(f"ggml-attn: {model.path}: {', '.join(as_f16)} matrices as F16 on the device ({why}; "
                  f"the default, GGML_ATTN_WEIGHTS=auto, keeps them in their blocks)", file=sys.stderr)
        if others:   # said once per model and device: these weights take 2 bytes a value
            print(f"ggml-attn: {model.path}: {', '.join(others)} weights are dequantized to F16 on the device "
                  f"(no kernel reads their blocks)", file=sys.stderr)
        if up is not None:   # the temporaries were freed on the upload stream: give them back
            xp.get_default_memory_pool().free_all_blocks()
        return cls(xp, out["tok_embd"], output, layers, ff, tied_copy, on, scratch)

    def _members(self) -> list:
        """Every matrix and vector held, once (a tied head shares the embedding's)."""
        seen: dict = {}
        for m in [self.tok_embd, self.output, *(a for d in self.layers for a in d.values()),
                  self.output_norm, self.rope_freqs]:
            if m is not None:
                seen.setdefault(id(m), m)
        return list(seen.values())

    def arrays(self) -> list:
        """Every array held, once (a block matrix's blocks; the scratch not included)."""
        return [m.blocks if isinstance(m, QMatrix) else m for m in self._members()]

    @property
    def nbytes(self) -> int:
        """Bytes of the weights held (module docstring), the scratch not included."""
        return sum(int(a.nbytes) for a in self.arrays())

    def bytes_by_type(self) -> dict[str, int]:
        """Bytes held per kind, most first: each block type, ``F16`` matrices, ``F32`` vectors,
        and ``scratch`` (``-v`` prints it)."""
        count: dict[str, int] = {}
        for m in self._members():
            kind = m.type if isinstance(m, QMatrix) else ("F16" if m.dtype == np.float16 else "F32")
            count[kind] = count.get(kind, 0) + int(m.nbytes)
        if self.scratch is not None:
            count["scratch"] = int(self.scratch.nbytes)
        return dict(sorted(count.items(), key=lambda kv: -kv[1]))

    @staticmethod
    def expected_nbytes(model, blocks: bool = True) -> int:
        """:attr:`nbytes` from the model's tensors alone (before building): a block matrix its
        file bytes (``blocks=False``: 2 bytes a value, as F16), any other matrix 2 bytes a value
        (a tied F16 head twice), the F32 vectors."""
        def mat(w):
            return w.nbytes if blocks and is_block_type(w.type_name) else 2 * int(np.prod(w.ne, dtype=np.int64))
        n = mat(model.tok_embd)
        if not (blocks and model.tied_output and is_block_type(model.output.type_name)):
            n += mat(model.output)   # its own, or the tied F16 head's folded copy
        for lw in model.layers:
            n += sum(mat(lw[k]) for k in (*_QKV, *_FFN, "wo", "wd"))
            n += sum(4 * int(np.prod(lw[k].ne)) for k in _VECTORS if k in lw)
        n += 4 * int(np.prod(model.output_norm.ne))
        if model.rope_freqs is not None:
            n += 4 * int(np.prod(model.rope_freqs.ne))
        return n
