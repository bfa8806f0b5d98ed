"""Path ``gemm`` of the block matrices (``matmul_dispatch.best_matmul`` past the tiled GEMMs): per
chunk of a matrix's rows (``matmul_dispatch.dequant_chunk``: as many as the weights' F16 scratch
holds) one dequantization (``cuda/dense_q.cu`` dense_dequant_f16) into the scratch and one cuBLAS
GEMM (``cublas_gemm.CublasGemm``) reading it, on the caller's stream. (Running the
dequantizations on a second stream under the GEMMs, over two scratch slots, bought ~1% for 117 MB
more on an 8B model and was taken out: bench/NOTES.md, twenty-third session.)

Shapes are numpy order: a ``QMatrix`` ``(n_out, n_in)``, activations F16 ``(n_tokens, n_in)``,
outputs F32 ``(n_tokens, n_out)``.
"""
from __future__ import annotations

import ctypes

from .cublas_gemm import CublasGemm

__all__ = ["dequant_gemm_launches"]


def dequant_gemm_launches(w, x16, out, *, accumulate: bool = False) -> list[tuple]:
    """Path ``gemm`` of ``out (+)= w·x16`` (``QMatrix`` ``w`` ``(n_out, n_in)`` with its F16 ``scratch``,
    ``x16`` F16 ``(n_tokens, n_in)``, ``out`` F32 ``(n_tokens, n_out)``, C-contiguous): per chunk of rows
    (``matmul_dispatch.dequant_chunk``) the pair (dequantization into the scratch, cuBLAS GEMM into the
    chunk's columns of ``out``), functions of no arguments; the caller keeps the arrays. ValueError
    for a matrix without scratch or an ``out`` that does not fit."""
    from ggml_attn import kernels as K  # noqa: PLC0415
    from ggml_attn.matmul_dispatch import dequant_chunk  # noqa: PLC0415
    scratch = getattr(w, "scratch", None)
    (n_out, n_in), n_tok = (int(d) for d in w.shape), int(x16.shape[0])
    if scratch is None:
        raise ValueError(f"{w.type} matrix of shape {w.shape} on the GPU has no F16 scratch (DeviceWeights makes one)")
    if not out.flags.c_contiguous or out.shape != (n_tok, n_out):
        raise ValueError(f"output of shape {out.shape} for a {w.shape} weight and {n_tok} tokens")
    chunk = dequant_chunk(n_out, n_in, scratch.size)
    fn = K.get_function(K.dense_q_variant(w.type_id), f"dense_dequant_f16<{w.type_id}>")
    spans = [(r0, min(n_out, r0 + chunk)) for r0 in range(0, n_out, chunk)]
    return [(K.grid_launch(fn, (r1 - r0) * (n_in // 32), ctypes.c_uint64(w.blocks.data.ptr + r0 * w.row_bytes),
                           ctypes.c_uint64(scratch.data.ptr), ctypes.c_int64(w.row_bytes), ctypes.c_int32(n_in),
                           ctypes.c_int64(r1 - r0)),
             CublasGemm.of_ptrs(scratch.data.ptr, r1 - r0, n_in, x16.data.ptr, n_tok, out.data.ptr + 4 * r0, n_out,
                                beta=1.0 if accumulate else 0.0)) for r0, r1 in spans]
