"""The launches of the tiled block GEMMs on F16 tensor cores (``cuda/dense_q.cu``, ``cuda/dense_qw.cu``)
over ``model_device.QMatrix`` weights: :func:`gemm_q_launch` (one matrix: ``dense_gemm_q``, the
staged ``dense_gemm_qs`` / ``dense_gemm_qr`` / ``dense_gemm_qrm``, the wgmma ``dense_gemm_qw``
forms) and :func:`gemm_qrg_launch` (a gated FFN's gate and up matrices in one ``dense_gemm_qrg``
launch). ``xp_matmul`` calls them where ``matmul_dispatch`` routes a product to them.

Shapes in numpy order, C-contiguous CuPy arrays: ``x16`` F16 ``(n_tok, n_in)``; outputs F32
``(n_tok, n_out)``; partial sums F32 ``(splits, n_tok, n_out)`` (``dense_gemm_qrg``: ``(splits, 2,
n_tok, n_ff)``) where ``kernels.gemm_q_grid`` splits ``n_in``. Each function returns a function of
no arguments launching on CuPy's current stream; the caller keeps the arrays alive.
"""
from __future__ import annotations

import ctypes

import numpy as np

from .q8_matmul import rows_aligned, splitk_sum_launch, tile_grid
from .xp_node import dptr as _dptr, then as _then

__all__ = ["gemm_q_launch", "gemm_qrg_launch", "tile_counters"]


def _tile_done(kernel: str, grid, done) -> int:
    """The device address of the tile counters ``done`` (uint32, one a tile of ``grid``'s x and y,
    zero: :func:`tile_counters`) for a ``kernel`` launch that adds its splits itself, or 0 where
    ``done`` is None or the launch does not split. ValueError for counters that do not fit."""
    from ggml_attn import kernels as K  # noqa: PLC0415
    if done is None or grid[2] == 1:
        return 0
    if kernel not in K.GEMMQR_FAMILY:
        raise ValueError(f"{kernel} does not add its splits itself (dense_gemm_qr's family does)")
    if done.dtype != np.uint32 or not done.flags.c_contiguous or done.size < grid[0] * grid[1]:
        raise ValueError(f"{kernel}: {grid[0] * grid[1]} uint32 tile counters needed, got {done.size} {done.dtype}")
    return done.data.ptr


def tile_counters(b, grid):
    """Graph builder ``b``'s array of one zero uint32 counter a tile of ``grid`` (x and y), for a
    split launch that adds its splits itself (``matmul_dispatch.split_finish``): made and zeroed at
    build; each launch leaves it zero."""
    done = b.scratch((grid[0] * grid[1],), np.uint32)
    done.fill(0)
    b.keep(done)
    return done


def gemm_q_launch(w, x16, out, part, *, accumulate: bool = False, kernel: str = "dense_gemm_q",
                  bn: int | None = None, done=None):
    """``out (+)= w·x16`` by tiled block GEMM ``kernel`` (``cuda/dense_q.cu``, the blocks decoded tile
    by tile onto the F16 tensor cores: ``dense_gemm_q``, or ``dense_gemm_qs`` / ``dense_gemm_qr`` (and
    ``dense_gemm_qrm``, its wide tile over two row halves) /
    ``dense_gemm_qw`` -- the weights' rows and x staged by cp.async, rows 16-byte aligned:
    ``q8_matmul.rows_aligned``; ``dense_gemm_qr`` and ``dense_gemm_qw`` (wgmma, sm_90a; its
    forms ``kernels.GEMMQW_FORMS``: the 256-row tile ``dense_gemm_qw2`` for ``kernels.GEMMQW2_TYPES``,
    the half-precision decode ``dense_gemm_qwh`` / ``dense_gemm_qw2h``) for ``kernels.GEMMQR_TYPES``;
    ``bn`` its tile's tokens other than
    ``kernels.gemm_qs_bn``'s, the benchmark's A/B) for a ``QMatrix`` ``w`` (CuPy
    blocks, ``(n_out, n_in)``), ``x16`` F16 ``(n_tokens, n_in)`` and ``out`` F32 ``(n_tokens,
    n_out)``, both C-contiguous, ``x16`` 16-byte aligned (cp.async); ``part`` F32 ``(splits,
    n_tokens, n_out)`` when ``kernels.gemm_q_grid`` splits ``n_in`` (its partial sums, added in order
    by ``dense_splitk_sum``), else None; ``done``: where given for a split dense_gemm_qr / qrm
    launch, :func:`tile_counters`' array, and the launch adds its splits itself (the program with
    ``kernels.qr_finish_variant``; no ``dense_splitk_sum``). Returns a function of no arguments
    launching on the current stream; the caller keeps the arrays. ValueError for arrays that do not
    fit."""
    from ggml_attn import kernels as K  # noqa: PLC0415
    n_out, n_in = (int(d) for d in w.shape)
    n_tok = int(x16.shape[0])
    if x16.shape != (n_tok, n_in) or out.shape != (n_tok, n_out) or not (x16.flags.c_contiguous and
                                                                          out.flags.c_contiguous) or x16.data.ptr % 16:
        raise ValueError(f"{kernel}: x {x16.shape} and out {out.shape} for a {w.shape} weight "
                         "(C-contiguous, x 16-byte aligned)")
    staged, qw = kernel in ("dense_gemm_qs", *K.GEMMQR_KERNELS), kernel in K.GEMMQW_FORMS
    if (staged or qw) and not rows_aligned([w]):
        raise ValueError(f"{kernel}: {w.type} rows of {w.row_bytes} bytes are not 16-byte aligned")
    if (kernel in K.GEMMQR_KERNELS or qw) and w.type_id not in K.GEMMQR_TYPE_IDS:
        raise ValueError(f"{kernel}: no fragment decode of {w.type} blocks (it reads {', '.join(K.GEMMQR_TYPES)})")
    if qw and K.qw_instance(w.type_id, kernel) is None:
        raise ValueError(f"{kernel}: the stages of {w.type} rows do not fit (it reads {', '.join(K.GEMMQW2_TYPES)})")
    grid, k_chunk = tile_grid(kernel, w, n_tok, part, bn if staged else None)
    finish = _tile_done(kernel, grid, done)
    p = K.GemmQParams()
    p.tile_done = finish
    p.w, p.x, p.out, p.part = w.blocks.data.ptr, x16.data.ptr, out.data.ptr, 0 if grid[2] == 1 else part.data.ptr
    p.row_bytes, p.rows, p.n_in, p.n_tok, p.k_chunk = w.row_bytes, n_out, n_in, n_tok, k_chunk
    p.mode = 1 if accumulate else 0
    if staged:
        bn = K.gemm_qs_bn(n_tok, kernel) if bn is None else bn   # (tile_grid's tile)
        make = K.dense_qrm_variant if kernel == "dense_gemm_qrm" else K.dense_q_variant   # (qrm: a program of its own)
        variant = K.qr_finish_variant(make(w.type_id)) if finish else make(w.type_id)
        fn = K.get_function(variant, K.staged_instance(kernel, w.type_id, bn))   # its QsTile / QrTile::SMEM
        block = K.GEMMQS_THREADS
    elif qw:   # (QwTile::SMEM; 128- or 256-row tiles)
        fn = K.get_function(K.dense_qw_variant(w.type_id), K.qw_instance(w.type_id, kernel))
        block = K.GEMMQS_THREADS
    elif kernel == "dense_gemm_q":
        fn, block = K.get_function(K.dense_q_variant(w.type_id), f"dense_gemm_q<{w.type_id}>"), K.GEMMQ_THREADS
    else:
        raise ValueError(f"no F16 tiled block GEMM {kernel!r} (dense_gemm_q, dense_gemm_qs, dense_gemm_qr, "
                         f"{', '.join(K.GEMMQW_FORMS)})")
    return _then(K.BoundLaunch(fn, grid, (block, 1, 1), p),
                 splitk_sum_launch(w.type_id, part, out, grid[2], p.mode) if grid[2] > 1 and not finish else None)


def gemm_qrg_launch(wg, wu, x16, out, out16, part, *, done=None):
    """``out = silu(wg·x16) * (wu·x16)``, and ``out16`` the same rounded to F16 where given, by one
    ``dense_gemm_qrg`` launch (``cuda/dense_q.cu``: ``dense_gemm_qrm``'s block with the gate's rows
    in one row half and the up's in the other, one x tile staged for both) for ``QMatrix`` ``wg``,
    ``wu`` (CuPy blocks, ``(n_ff, n_in)``, one type of ``kernels.GEMMQR_TYPES``, rows 16-byte
    aligned: ``q8_matmul.rows_aligned``), ``x16`` F16 ``(n_tokens, n_in)`` 16-byte aligned,
    ``out`` F32 and ``out16`` F16 (or None) ``(n_tokens, n_ff)``, all C-contiguous; ``part`` F32
    ``(splits, 2, n_tokens, n_ff)`` where ``kernels.gemm_q_grid`` splits ``n_in`` for
    ``dense_gemm_qrg`` (both products' partial sums, which ``dense_splitk_gated`` adds in split order
    and gates), else None; ``done`` as :func:`gemm_q_launch`'s (the split's sum and activation
    then by the launch's last block of each tile). Returns a function of no arguments launching on
    the current stream; the caller keeps the arrays. ValueError for arrays that do not fit."""
    from ggml_attn import kernels as K  # noqa: PLC0415
    from ggml_attn.cuda_device import num_sms  # noqa: PLC0415
    n_ff, n_in = (int(d) for d in wg.shape)
    n_tok = int(x16.shape[0])
    if wu.type != wg.type or tuple(wu.shape) != (n_ff, n_in) or wu.row_bytes != wg.row_bytes:
        raise ValueError(f"dense_gemm_qrg: gate {wg.type} {wg.shape} and up {wu.type} {wu.shape} differ")
    if wg.type_id not in K.GEMMQR_TYPE_IDS or not rows_aligned([wg, wu]):
        raise ValueError(f"dense_gemm_qrg: {wg.type} rows of {wg.row_bytes} bytes (it reads "
                         f"{', '.join(K.GEMMQR_TYPES)}, rows 16-byte aligned)")
    arrays = (x16, out) + ((out16,) if out16 is not None else ())
    if x16.shape != (n_tok, n_in) or out.shape != (n_tok, n_ff) or (out16 is not None and out16.shape != out.shape) \
            or not all(a.flags.c_contiguous for a in arrays) or x16.data.ptr % 16:
        raise ValueError(f"dense_gemm_qrg: x {x16.shape}, out {out.shape} and out16 "
                         f"{None if out16 is None else out16.shape} for {wg.shape} weights (C-contiguous, x 16-byte "
                         "aligned)")
    grid, k_chunk = K.gemm_q_grid(n_ff, n_tok, n_in, num_sms(), "dense_gemm_qrg")
    if grid[2] > 1 and (part is None or part.shape != (grid[2], 2, n_tok, n_ff)):
        raise ValueError(f"dense_gemm_qrg splits n_in {grid[2]} ways: partial sums {(grid[2], 2, n_tok, n_ff)} "
                         f"needed, got {None if part is None else part.shape}")
    finish = _tile_done("dense_gemm_qrg", grid, done)
    p = K.GemmQParams()
    p.tile_done = finish
    p.w, p.w2, p.x, p.out = wg.blocks.data.ptr, wu.blocks.data.ptr, x16.data.ptr, out.data.ptr
    p.out16, p.part = 0 if out16 is None else out16.data.ptr, 0 if grid[2] == 1 else part.data.ptr
    p.row_bytes, p.rows, p.n_in, p.n_tok, p.k_chunk = wg.row_bytes, n_ff, n_in, n_tok, k_chunk
    variant = K.qr_finish_variant(K.dense_qrg_variant(wg.type_id)) if finish else K.dense_qrg_variant(wg.type_id)
    fn = K.get_function(variant, K.staged_instance("dense_gemm_qrg", wg.type_id, K.gemm_qs_bn(n_tok, "dense_gemm_qrg")))
    total = n_tok * n_ff
    return _then(K.BoundLaunch(fn, grid, (K.GEMMQS_THREADS, 1, 1), p),
                 K.grid_launch(K.get_function(variant, "dense_splitk_gated"), total, ctypes.c_uint64(part.data.ptr),
                               ctypes.c_uint64(out.data.ptr), _dptr(out16), ctypes.c_int64(total),
                               ctypes.c_int32(grid[2])) if grid[2] > 1 and not finish else None)
