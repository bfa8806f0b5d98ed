"""The attention's output in the 8-bit form the 8-bit GEMVs read (``flash_attn_ext(q8_out=...)``).

A model's O projection multiplies the attention's output; where that GEMV runs on 8-bit
activations (graph/q8_matmul.py) the output is quantized first, one launch a layer. Asked for
its 8-bit form, the op writes it besides ``dst``: per 32 values ``d = max|v| / 127``, ``q =
round(v / d)`` (0 where d is 0, ties to even) and the sum of the q (cuda/q8x_quant.cuh, the bits
of ``dense_quant_q8x`` over ``dst``). Where the call runs the cell-list decode kernel over one
split, that kernel's epilogue makes it (``fattn_cells``' QO instances: no launch of its own);
every other call quantizes ``dst`` after the attention (``fattn_quant_q8x``, fattn_util.cu).

Arrays (numpy order, C-contiguous, device): ``xq`` int8 ``(n_rows, n)``, ``xd`` and ``xs`` F32
``(n_rows, n / 32)``, with ``n = head_dim_v * n_head`` (a multiple of 32) and ``n_rows = n_batch *
ne3``: dst's rows of ``[head_dim_v, n_head, n_batch, ne3]`` (ggml order) as ``(n_rows, n)``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["FUSE", "Q8Out", "check_arrays", "fused", "set_params", "quant_launch"]

#: fattn_cells' QO instances where a call fits them (False: every call quantizes in a launch of its
#: own -- the A/B of the fused epilogue)
FUSE = True
# (The QO epilogue quantizes a turn's group in that turn: the H100's one-token attention 5.88 ->
# 6.86 us, bench/results/2026-12-06-150d310-h100-attn-q8-out/. A second form, every turn's value
# first and the groups' reductions interleaved after, was correct and no faster end to end, tg128
# 327.2 -> 324.0 t/s: bench/results/2026-12-07-a2d3dc2-h100-q8out-epi2/; taken out.)


@dataclass(frozen=True)
class Q8Out:
    """Where a call writes its output's 8-bit form: device pointers of ``xq``, ``xd``, ``xs`` and
    the values they hold (``n_rows * n``)."""
    q: int
    d: int
    s: int
    n_values: int


def check_arrays(arrays, n_rows: int, n: int) -> Q8Out:
    """The :class:`Q8Out` of ``arrays`` = ``(xq, xd, xs)`` (CuPy arrays, module docstring) for an
    output of ``n_rows`` rows of ``n`` values; ValueError naming what does not fit."""
    if not isinstance(arrays, (tuple, list)) or len(arrays) != 3:
        raise ValueError(f"q8_out must be the three arrays (xq, xd, xs), got {type(arrays).__name__}")
    if n % 32:
        raise ValueError(f"q8_out: the output's rows hold {n} values (head_dim_v * n_head), not a multiple of 32")
    want = (("xq", np.int8, (n_rows, n)), ("xd", np.float32, (n_rows, n // 32)),
            ("xs", np.float32, (n_rows, n // 32)))
    for a, (name, dt, shape) in zip(arrays, want):
        data = getattr(a, "data", None)
        if not hasattr(data, "ptr"):
            raise ValueError(f"q8_out {name}: a device (CuPy) array, got {type(a).__name__}")
        if np.dtype(a.dtype) != dt or tuple(a.shape) != shape or not a.flags.c_contiguous:
            raise ValueError(f"q8_out {name}: {np.dtype(dt).name} {shape} C-contiguous, got "
                             f"{np.dtype(a.dtype).name} {tuple(a.shape)}"
                             f"{'' if a.flags.c_contiguous else ' (not C-contiguous)'}")
    return Q8Out(*(int(a.data.ptr) for a in arrays), n_rows * n)


def fused(kern: str, n_splits: int, head_dim_v: int) -> bool:
    """True where the call's kernel makes the 8-bit form itself: the cell-list kernel over one
    split (its QO instance; one split leaves the fields it borrows unused), whole 32-value groups
    in each head."""
    return FUSE and kern == "cells" and n_splits == 1 and head_dim_v % 32 == 0


def set_params(p, q8: Q8Out) -> None:
    """The QO instance's arrays in the fields one split leaves unused (cuda/fattn_cells.cu)."""
    p.ws_o, p.ws_ml, p.split_cnt = q8.q, q8.d, q8.s


def quant_launch(q8: Q8Out, dst_ptr: int, stream: int):
    """``fattn_quant_q8x`` over the call's ``dst`` on ``stream``, as a callable of no arguments."""
    import ctypes

    from . import kernels as K
    fn = K.get_function(K.util_variant(), "fattn_quant_q8x")
    groups = q8.n_values // 32
    return fn.bound((-(-groups // 8), 1, 1), (256, 1, 1), stream, ctypes.c_uint64(dst_ptr),
                    ctypes.c_int64(q8.n_values), ctypes.c_uint64(q8.q), ctypes.c_uint64(q8.d), ctypes.c_uint64(q8.s))
