"""A node's output in 8-bit form, handed from the GEMV that wrote it to the GEMVs that read it
next, so that no quantization launch runs between them (``matmul_dispatch.GEMV_QUANT_OUT``;
``cuda/dense_q8x.cu`` q8x_finish), or from the attention to the O projection
(``matmul_dispatch.ATTN_QUANT_OUT``, :func:`attention_arrays`; ggml_attn/q8_out.py): whether a
producer makes it and its arrays (:func:`arrays_for`), the graph builder's record of each node's (:func:`remember`,
``GraphBuilder.q8_forms``) and a reader's lookup (:func:`form_of`). ``xp_matmul`` calls them;
arrays as ``q8_matmul.q8_out_arrays``' (numpy order: int8 ``(n_tokens, rows)``, F32 scales and
sums ``(n_tokens, rows / 32)``).

The same for a node's output in F16, the input of the GEMMs past the GEMVs (cuBLAS, the tiled
block GEMMs): the gated FFN's element-wise product writes it beside its F32 result where the down
projection reads F16 next (:func:`f16_for`, :func:`remember_f16`, ``GraphBuilder.f16_forms``,
:func:`f16_of`), so that no cast launch runs between them.
"""
from __future__ import annotations

import ctypes

import numpy as np

from .model_device import QMatrix
from .q8_matmul import q8_out_arrays, rows_aligned

__all__ = ["matmul_choice", "arrays_for", "attention_arrays", "remember", "form_of", "reads_f16", "f16_for",
           "remember_f16", "f16_of"]


def matmul_choice(ws: list, n_tok: int):
    """``matmul_dispatch.best_matmul`` for weights ``ws`` of one type (F16 arrays or ``QMatrix``)
    at ``n_tok`` tokens."""
    from ggml_attn.matmul_dispatch import best_matmul  # noqa: PLC0415
    k = ws[0].type if isinstance(ws[0], QMatrix) else "F16"
    return best_matmul(k, n_tok, aligned=k == "F16" or rows_aligned(ws))


def arrays_for(b, ws: list, n_tok: int, rows: int):
    """``q8_out_arrays`` for a GEMV over ``ws[0]`` (``rows`` output rows) whose output the 8-bit
    GEMVs of ``ws[1:]`` read next, where ``matmul_dispatch.gemv_quant_out`` says so for them all
    at ``n_tok`` tokens (the instances with it: ``kernels.Q8X_QOUT_TOKENS``); else None."""
    from ggml_attn.kernels import Q8X_QOUT_TOKENS  # noqa: PLC0415
    from ggml_attn.matmul_dispatch import gemv_quant_out  # noqa: PLC0415
    if b.xp is np or not all(isinstance(w, QMatrix) for w in ws) or rows % 32 or n_tok > max(Q8X_QOUT_TOKENS):
        return None
    if not gemv_quant_out(matmul_choice([w], n_tok) for w in ws):   # (lazy: no choice made while it is off)
        return None
    return q8_out_arrays(b.xp, n_tok, rows)


def attention_arrays(b, w, n_tok: int, n: int):
    """``(xq, xd, xs)`` for the attention's output in 8-bit form (``flash_attn_ext``'s ``q8_out``,
    ggml_attn/q8_out.py: int8 ``(n_tok, n)``, F32 ``(n_tok, n / 32)`` twice, numpy order) where
    the O projection ``w`` reads it in the 8-bit GEMV at ``n_tok`` tokens
    (``matmul_dispatch.attn_quant_out``) on a device graph; else None."""
    from ggml_attn.matmul_dispatch import attn_quant_out  # noqa: PLC0415
    if b.xp is np or not isinstance(w, QMatrix) or n % 32 or not attn_quant_out(matmul_choice([w], n_tok)):
        return None
    return (b.scratch((n_tok, n), np.int8), b.scratch((n_tok, n // 32), np.float32),
            b.scratch((n_tok, n // 32), np.float32))


def remember(b, node, out_q, eps, g):
    """``node`` (returned), its output's 8-bit form ``out_q`` (of the RMS norm ``eps``, weight
    ``g``, or of none) kept with the graph and recorded for the GEMVs that read the node next
    (:func:`form_of`); nothing where ``out_q`` is None."""
    if out_q is not None:
        b.keep(*out_q)
        b.q8_forms[ctypes.addressof(node.contents)] = (out_q[:3], None if g is None else (float(eps), id(g)))
    return node


def form_of(b, h, eps, g):
    """``(xq, xd, xs)``: the 8-bit form of node ``h``'s output that its node made, where it is of
    the RMS norm this reader applies (``eps``, weight ``g``; None: none); else None."""
    if b.xp is np:
        return None
    form = b.q8_forms.get(ctypes.addressof(h.contents))
    if form is None or form[1] != (None if eps is None else (float(eps), id(g))):
        return None
    return form[0]


def reads_f16(ws: list, n_tok: int) -> bool:
    """Whether the GEMMs past the GEMVs (``xp_matmul``'s ``_matmuls`` / ``_qmatmuls``) of weights
    ``ws`` (F16 arrays or ``QMatrix``) at ``n_tok`` tokens read their input in F16 only: each block
    weight's path there (``matmul_dispatch.best_matmul`` with ``gemv=False``, as they ask) is not
    the 8-bit block GEMM (``gemm-q8``, which quantizes the F32 input); F16 weights always."""
    from ggml_attn.matmul_dispatch import best_matmul  # noqa: PLC0415
    return all(best_matmul(w.type, n_tok, gemv=False, aligned=rows_aligned([w])).path != "gemm-q8"
               for w in ws if isinstance(w, QMatrix))


def f16_for(b, reader, n_tok: int, shape: tuple):
    """An F16 array of ``shape`` (numpy order) for a node's output that weight ``reader``
    multiplies next on a device graph, where that product is a GEMM past the GEMVs
    (:func:`matmul_choice` not a GEMV) that reads F16 only (:func:`reads_f16`); else None."""
    if b.xp is np or reader is None or matmul_choice([reader], n_tok).path.startswith("gemv") or \
            not reads_f16([reader], n_tok):
        return None
    return b.scratch(shape, np.float16)


def remember_f16(b, node, out16):
    """``node`` (returned), its output's F16 form ``out16`` kept with the graph and recorded for
    the GEMM that reads the node next (:func:`f16_of`); nothing where ``out16`` is None."""
    if out16 is not None:
        b.keep(out16)
        b.f16_forms[ctypes.addressof(node.contents)] = out16
    return node


def f16_of(b, h):
    """The F16 form of node ``h``'s output that its node made, or None."""
    return None if b.xp is np else b.f16_forms.get(ctypes.addressof(h.contents))
