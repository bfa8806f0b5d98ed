"""The launches of the block matmuls with 8-bit activations (``cuda/dense_q8x.cu``, llama.cpp's
mmvq / mmq way): the activations quantized once to int8 per 32 values (:func:`quant_q8x_launch`),
then the GEMV (:func:`q8x_launches`, 1-16 tokens) or the tiled GEMM on int8 tensor cores
(:func:`gemm_q8_launch`) over ``model_device.QMatrix`` weights. ``xp_matmul`` calls them where
``matmul_dispatch.best_matmul`` says ``gemv-q8x`` or ``gemm-q8``.

Shapes in numpy order, C-contiguous CuPy arrays: ``x`` F32 ``(n_tok, n_in)``; ``xq`` int8
``(n_tok, n_in)``; ``xd`` (each 32 values' scale) and ``xs`` (their int8 sum) F32
``(n_tok, n_in / 32)``; outputs F32 ``(n_tok, n_out)``. Each function returns a function of no
arguments launching on CuPy's current stream (None where the arrays do not fit the kernel); the
caller keeps the arrays alive.
"""
from __future__ import annotations

import ctypes
import struct

import numpy as np

from .xp_node import then

__all__ = ["quant_q8x_launch", "q8x_launches", "q8_out_arrays", "gemm_q8_launch", "rows_aligned", "tile_grid",
           "splitk_sum_launch"]


def _q8_out_fits(out_q, mode: int, n_w: int, out) -> bool:
    """``out_q`` is :func:`q8_out_arrays`' for output ``out`` F32 ``(n_tok, rows)`` (rows whole
    32-row groups) of the gated mode or of the accumulate mode over one matrix (``n_w``), laid out
    as the kernel reads it."""
    n_tok, rows = out.shape
    if not (mode == 2 or (mode == 1 and n_w == 1)) or rows % 32 or len(out_q) != 6 or \
            not _q8_arrays_fit(out, *out_q[:3]):
        return False
    base = out_q[0].data.ptr
    return out_q[3].shape == (rows // 32,) and [a.data.ptr - base for a in out_q] == _q8_out_offsets(n_tok, rows)


def _q8_arrays_fit(x, xq, xd, xs) -> bool:
    """x F32 (n_tok, n_in), xq int8 (n_tok, n_in), xd / xs F32 (n_tok, n_in / 32) (numpy order),
    contiguous and 16-byte aligned: the GEMVs read xq, xd and xs by 16-, 8- and 16-byte loads."""
    n_tok, n_in = x.shape
    return bool(n_in % 32 == 0 and xq.shape == (n_tok, n_in) and xd.shape == (n_tok, n_in // 32)
                and xs.shape == xd.shape and all(a.flags.c_contiguous and a.data.ptr % 16 == 0 for a in (x, xq, xd, xs)))


def quant_q8x_launch(type_id: int, x, xq, xd, xs, *, norm_eps: float | None = None, norm_w=None):
    """``dense_quant_q8x`` (from the program of block type ``type_id``): ``x`` (times ``norm_w``,
    RMS-normalized with ``norm_eps``) into ``xq``, ``xd``, ``xs``; None where they do not fit."""
    from ggml_attn import kernels as K  # noqa: PLC0415
    if not _q8_arrays_fit(x, xq, xd, xs):
        return None
    n_tok, n_in = x.shape
    return K.BoundLaunch(
        K.get_function(K.dense_q8x_variant(type_id), "dense_quant_q8x"), (-(-n_in // 256), n_tok, 1), (256, 1, 1),
        ctypes.c_uint64(x.data.ptr), ctypes.c_int64(n_in), ctypes.c_uint64(0 if norm_w is None else norm_w.data.ptr),
        ctypes.c_float(0.0 if norm_eps is None else float(norm_eps)), ctypes.c_int32(n_in),
        ctypes.c_uint64(xq.data.ptr), ctypes.c_uint64(xd.data.ptr), ctypes.c_uint64(xs.data.ptr))


def q8x_launches(ws: list, x, outs: list, xq, xd, xs, *, mode: int, norm_eps: float | None = None, norm_w=None,
                 quantize: bool = True, form: str | None = None, out_q=None, out_norm=(None, None)):
    """The 8-bit-activation GEMV (the A/B path to ``xp_matmul.gemv_q_launch``, chosen by
    ``matmul_dispatch.best_matmul`` under ``Q8X_MAX_TOKENS``): ``x`` quantized by
    :func:`quant_q8x_launch` (not with ``quantize=False``: another group's launch did it), then
    one GEMV launch over ``QMatrix`` weights of one block type (modes and ``outs`` as
    ``gemv_q_launch``'s: 0 store, 1 accumulate, 2 gated into ``outs[0]``) in ``form`` (None:
    ``matmul_dispatch.gemv_q8x_form``'s; else ``kernels.Q8X_FORMS``' name, the benchmark's A/B).
    None where the arrays do not fit the form (all but the plain one need rows 16-byte aligned,
    the vector and ring ones their types: ``kernels.q8x_form_reads``; each form up to its instances' tokens).
    The vector form's rows run on two warps each where ``matmul_dispatch.gemv_q8x_split`` says so.
    The ring form's grid is one wave (``kernels.Q8X_ONE_WAVE``); the GEMV is launched with
    programmatic dependent launch where
    ``matmul_dispatch.gemv_pdl`` says so (ggml_attn/pdl.py). ``out_q`` (:func:`q8_out_arrays`;
    the gated mode, or the accumulate mode over one matrix; rows a multiple of 32; the vector and
    ring forms at one token, ``kernels.Q8X_QOUT_TOKENS``): the output in 8-bit form as well, made
    by the GEMV's warps as their rows' groups complete (``q8x_finish``) -- the next GEMV's ``xq``,
    ``xd``, ``xs`` (called with ``quantize=False``) without a quantization launch between; in the
    accumulate mode of the RMS-normalized output where ``out_norm`` is ``(g, eps)`` (weight F32
    ``(rows,)``)."""
    from ggml_attn import kernels as K  # noqa: PLC0415
    from ggml_attn.matmul_dispatch import gemv_pdl, gemv_q8x_form, gemv_q8x_gated_instance, gemv_q8x_split  # noqa: PLC0415
    from ggml_attn.pdl import PdlLaunch  # noqa: PLC0415
    n_tok, n_in = x.shape
    t = ws[0].type_id
    if len(ws) > 3 or len({w.type for w in ws}) != 1 or (mode == 2 and (len(ws) != 2 or ws[0].shape != ws[1].shape)) \
            or any(w.shape[1] != n_in for w in ws) or n_in % ws[0].layout.values or not _q8_arrays_fit(x, xq, xd, xs):
        return None
    if out_q is not None and not _q8_out_fits(out_q, mode, len(ws), outs[0]):
        return None
    g, eps = out_norm
    if g is not None and (g.shape != (outs[0].shape[1],) or g.dtype != np.float32 or not eps > 0.0):
        return None
    aligned = rows_aligned(ws)   # 16-byte units: cp.async's, the vector form's loads
    form = form or gemv_q8x_form(ws[0].type, aligned, n_tok)
    _, tokens, warps = K.Q8X_FORMS[form]
    if n_tok > max(tokens) or (form != "plain" and not aligned) or not K.q8x_form_reads(form, ws[0].type):
        return None
    if out_q is not None and (form not in K.Q8X_GATED_FORMS or n_tok > max(K.Q8X_QOUT_TOKENS)):
        return None
    quant = quant_q8x_launch(t, x, xq, xd, xs, norm_eps=norm_eps, norm_w=norm_w) if quantize else None
    p = K.GemvQ8Params()
    for i, w in enumerate(ws):
        o = outs[0] if mode == 2 else outs[i]
        p.seg[i].w, p.seg[i].out, p.seg[i].rows = w.blocks.data.ptr, o.data.ptr, int(w.shape[0])
    p.xq, p.xd, p.xs, p.row_bytes = xq.data.ptr, xd.data.ptr, xs.data.ptr, ws[0].row_bytes
    p.n_in, p.n_tok, p.n_seg, p.mode = n_in, n_tok, len(ws), mode
    rows = int(ws[0].shape[0]) if mode == 2 else sum(int(w.shape[0]) for w in ws)
    p.pdl = gemv_pdl()
    if out_q is not None:   # (segments the launch leaves free: the kernel's q8x_out)
        p.seg[2].w = out_q[0].data.ptr
        if g is not None:
            p.seg[1].w, p.seg[1].rows = g.data.ptr, struct.unpack("<i", struct.pack("<f", float(eps)))[0]
    split = gemv_q8x_split(ws[0].type, form, n_tok, rows, mode)   # (two warps a row)
    program = K.dense_q8x_variant(t) if out_q is None else K.dense_q8x_qout_variant(t)
    fn = K.get_function(program, K.q8x_name(t, n_tok, form, gated=gemv_q8x_gated_instance(mode, ws[0].type) and not split,
                                            split=split, qout=out_q is not None))
    blocks = -(-rows // (warps // 2 if split else warps))
    if form in K.Q8X_ONE_WAVE:   # one wave: its warps stream several rows each
        from ggml_attn.cuda_device import num_sms  # noqa: PLC0415
        blocks = min(blocks, num_sms() * max(1, fn.occupancy(32 * warps)))
    gemv = (PdlLaunch if p.pdl else K.BoundLaunch)(fn, (blocks, 1, 1), (32 * warps, 1, 1), p)
    return then(quant, gemv)


def q8_out_arrays(xp, n_tok: int, rows: int):
    """A GEMV's output in 8-bit form (:func:`q8x_launches`' ``out_q``): views of one zeroed
    buffer, each at a 16-byte boundary in this order (the kernel finds them from its address:
    ``cuda/dense_q8x.cu`` q8x_out): int8 ``(n_tok, rows)``; F32 scales and sums ``(n_tok, rows /
    32)``; uint32 counters of the rows stored in each 32-row group ``(rows / 32,)``; F32 sums of
    squares of each group ``(n_tok, rows / 32)`` and the uint32 count of the groups done ``(1,)``
    (the accumulate mode's RMS norm). Each launch leaves the counters zero."""
    offs = _q8_out_offsets(n_tok, rows)
    buf = xp.zeros(offs[-1] + 16, dtype=xp.uint8)
    g = rows // 32
    parts = [(xp.int8, (n_tok, rows)), (xp.float32, (n_tok, g)), (xp.float32, (n_tok, g)), (xp.uint32, (g,)),
             (xp.float32, (n_tok, g)), (xp.uint32, (1,))]
    return tuple(buf[o:o + int(np.prod(shape)) * np.dtype(dt).itemsize].view(dt).reshape(shape)
                 for o, (dt, shape) in zip(offs, parts))


def _q8_out_offsets(n_tok: int, rows: int) -> list[int]:
    """Byte offsets of :func:`q8_out_arrays`' parts in its buffer (the kernel's q8x_out)."""
    up = lambda n: -(-n // 16) * 16   # noqa: E731
    nq, ns, nc = up(n_tok * rows), up(n_tok * rows // 8), up(rows // 8)
    return [0, nq, nq + ns, nq + 2 * ns, nq + 2 * ns + nc, nq + 3 * ns + nc]


def rows_aligned(ws: list) -> bool:
    """Every row of the ``QMatrix`` weights ``ws`` starts 16-byte aligned (row_bytes a multiple of
    16, the blocks' pointer aligned): what the staged kernels' cp.async units need
    (``dense_gemv_q8x_s``, ``dense_gemm_q8``) and the vector GEMV's 16-byte loads (``dense_gemv_q8x_v``)."""
    return all(w.row_bytes % 16 == 0 and w.blocks.data.ptr % 16 == 0 for w in ws)


def gemm_q8_launch(w, xq, xd, xs, out, part, *, accumulate: bool = False):
    """``out (+)= w·x`` by ``dense_gemm_q8`` (int8 tensor cores on the blocks' integer form and
    activations ``xq`` / ``xd`` / ``xs`` that :func:`quant_q8x_launch` made) for a ``QMatrix``
    ``w`` ``(n_out, n_in)`` whose rows start 16-byte aligned (:func:`rows_aligned`); ``out`` F32
    ``(n_tokens, n_out)``; ``part`` F32 ``(splits, n_tokens, n_out)`` when
    ``kernels.gemm_q_grid(..., "dense_gemm_q8")`` splits ``n_in`` (the partial sums, added in order
    by ``dense_splitk_sum``), else None. ValueError for arrays that do not fit."""
    from ggml_attn import kernels as K  # noqa: PLC0415
    n_out, n_in = (int(d) for d in w.shape)
    n_tok = int(xq.shape[0])
    if xq.shape != (n_tok, n_in) or xd.shape != (n_tok, n_in // 32) or xs.shape != xd.shape or \
            out.shape != (n_tok, n_out) or not out.flags.c_contiguous or xq.data.ptr % 16 or n_in % 32:
        raise ValueError(f"dense_gemm_q8: activations {xq.shape} (16-byte aligned, scales {xd.shape}) and out "
                         f"{out.shape} for a {w.shape} weight")
    if not rows_aligned([w]):
        raise ValueError(f"dense_gemm_q8: {w.type} rows of {w.row_bytes} bytes are not 16-byte aligned")
    grid, k_chunk = tile_grid("dense_gemm_q8", w, n_tok, part)
    p = K.GemmQ8Params()
    p.w, p.xq, p.xd, p.xs = w.blocks.data.ptr, xq.data.ptr, xd.data.ptr, xs.data.ptr
    p.out, p.part = out.data.ptr, 0 if grid[2] == 1 else part.data.ptr
    p.row_bytes, p.rows, p.n_in, p.n_tok, p.k_chunk = w.row_bytes, n_out, n_in, n_tok, k_chunk
    p.mode = 1 if accumulate else 0
    bn = K.gemm_q8_bn(n_tok)   # the narrow tile up to its tokens (tile_grid's too)
    fn = K.get_function(K.dense_q8x_variant(w.type_id), f"dense_gemm_q8<{w.type_id}, {bn}>")   # its Q8gTile::SMEM
    return then(K.BoundLaunch(fn, grid, (K.GEMMQ8_THREADS, 1, 1), p),
                splitk_sum_launch(w.type_id, part, out, grid[2], p.mode) if grid[2] > 1 else None)


def tile_grid(kernel: str, w, n_tok: int, part, bn: int | None = None) -> tuple[tuple[int, int, int], int]:
    """``kernels.gemm_q_grid`` of tiled block GEMM ``kernel`` (``dense_gemm_q``, ``dense_gemm_q8``,
    ``dense_gemm_qs`` or ``dense_gemm_qr``; ``bn``: gemm_tiling's) over ``QMatrix`` ``w`` and ``n_tok`` tokens on this
    GPU; ValueError where it splits ``n_in`` and ``part`` is not the F32 ``(splits, n_tok, n_out)``
    array of the partial sums."""
    from ggml_attn import kernels as K  # noqa: PLC0415
    from ggml_attn.cuda_device import num_sms  # noqa: PLC0415
    n_out, n_in = (int(d) for d in w.shape)
    grid, k_chunk = K.gemm_q_grid(n_out, n_tok, n_in, num_sms(), kernel, bn)
    if grid[2] > 1 and (part is None or part.shape != (grid[2], n_tok, n_out)):
        raise ValueError(f"{kernel} splits n_in {grid[2]} ways: partial sums "
                         f"{(grid[2], n_tok, n_out)} needed, got {None if part is None else part.shape}")
    return grid, k_chunk


def splitk_sum_launch(type_id: int, part, out, splits: int, mode: int):
    """``dense_splitk_sum`` (in the ``dense_q`` program of block type ``type_id``): ``out`` (mode
    1: ``+=``) the sum of a split tiled GEMM's ``splits`` partial sums ``part`` F32 ``(splits,
    n_tokens, n_out)``, added in split order (the same result every run)."""
    from ggml_attn import kernels as K  # noqa: PLC0415
    total = int(out.size)
    return K.grid_launch(K.get_function(K.dense_q_variant(type_id), "dense_splitk_sum"), total,
                         ctypes.c_uint64(part.data.ptr), ctypes.c_uint64(out.data.ptr), ctypes.c_int64(total),
                         ctypes.c_int32(splits), ctypes.c_int32(mode))
