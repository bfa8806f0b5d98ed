"""Quantized ggml types (Q8_0, Q4_0, IQ4_NL, ...) for K/V on the CPU path, through ggml's own
type traits: sizes, dequantization (``to_float``) and, for tests, quantization.

Only the CPU path reads quantized K/V; the CUDA kernels take F16/BF16.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .dtypes import STORAGE_DTYPES


@dataclass(frozen=True)
class TypeInfo:
    name: str
    blck_size: int     # elements per block
    type_size: int     # bytes per block
    quantized: bool
    has_to_float: bool

    def row_bytes(self, ne0: int) -> int:
        return ne0 // self.blck_size * self.type_size


@lru_cache(maxsize=None)
def type_info(ggml_type: int) -> TypeInfo | None:
    """ggml's traits of ``ggml_type``; None for an id ggml does not know."""
    import ggml
    if not 0 <= ggml_type < ggml.GGML_TYPE_COUNT:
        return None
    tr = ggml.ggml_get_type_traits(ggml_type).contents
    if not tr.type_name:
        return None
    return TypeInfo(tr.type_name.decode(), int(tr.blck_size), int(tr.type_size), bool(tr.is_quantized),
                    bool(tr.to_float))


def is_quantized_kv(ggml_type: int) -> bool:
    """A quantized type that ggml can dequantize (usable as K/V on the CPU path)."""
    info = type_info(ggml_type)
    return info is not None and info.quantized and info.has_to_float


def dequantize_rows(ptr: int, ggml_type: int, ne0: int, n_rows: int, row_stride: int) -> np.ndarray:
    """``n_rows`` rows of ``ne0`` elements at ``ptr`` (rows ``row_stride`` bytes apart) -> float32
    ``(n_rows, ne0)``. Works for any ggml type with ``to_float``, float types included."""
    import ggml
    info = type_info(ggml_type)
    out = np.empty((n_rows, ne0), dtype=np.float32)
    to_float = ggml.ggml_get_type_traits(ggml_type).contents.to_float
    dst = out.ctypes.data
    if row_stride == info.row_bytes(ne0):  # rows back to back: one call
        to_float(ctypes.c_void_p(ptr), ctypes.cast(dst, ctypes.POINTER(ctypes.c_float)), n_rows * ne0)
        return out
    for r in range(n_rows):
        to_float(ctypes.c_void_p(ptr + r * row_stride),
                 ctypes.cast(dst + r * ne0 * 4, ctypes.POINTER(ctypes.c_float)), ne0)
    return out


def quantize(x: np.ndarray, ggml_type: int) -> np.ndarray:
    """float rows ``(..., ne0)`` -> ``ggml_type`` blocks as uint8 ``(..., row_bytes)``."""
    import ggml
    if ggml_type in STORAGE_DTYPES:
        raise ValueError("quantize() is for quantized types; use dtypes.from_float")
    info = type_info(ggml_type)
    x = np.ascontiguousarray(x, dtype=np.float32)
    ne0 = x.shape[-1]
    if ne0 % info.blck_size:
        raise ValueError(f"row length {ne0} is not a multiple of {info.name}'s block size {info.blck_size}")
    n_rows = x.size // ne0
    out = np.empty(x.shape[:-1] + (info.row_bytes(ne0),), dtype=np.uint8)
    src = x.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    ggml.ggml_quantize_chunk(ggml_type, src, out.ctypes.data, 0, n_rows, ne0, None)
    return out


def q8_form(v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The 8-bit form the 8-bit-activation GEMV reads (cuda/q8x_quant.cuh, llama.cpp's q8_1
    rounding), bit for bit: F32 ``(n_tok, n_in)`` in numpy order, n_in a multiple of 32 -> int8
    ``q`` ``(n_tok, n_in)``, F32 ``d`` and ``s`` ``(n_tok, n_in / 32)``: per 32 values d = max|v| /
    127, q = round(v / d) (ties to even; 0 where d is 0), s the sum of the q."""
    v = np.asarray(v, dtype=np.float32)
    if v.ndim != 2 or v.shape[1] % 32:
        raise ValueError(f"q8_form takes (n_tok, n_in) with n_in a multiple of 32, got {v.shape}")
    blocks = v.reshape(v.shape[0], -1, 32)
    d = np.abs(blocks).max(axis=2) / np.float32(127)
    q = np.where(d[..., None] > 0, np.rint(blocks / np.where(d > 0, d, np.float32(1))[..., None]), 0).astype(np.int8)
    return q.reshape(v.shape), d, q.astype(np.int32).sum(axis=2).astype(np.float32)


def q8_activations(v: np.ndarray) -> np.ndarray:
    """The activations the 8-bit-activation GEMV multiplies (cuda/dense_q8x.cu's
    ``dense_quant_q8x``): F32 ``(n_tok, n_in)`` in numpy order, n_in a multiple of 32 -> float64
    ``(n_tok, n_in)`` of ``q * d`` per 32 values (:func:`q8_form`)."""
    q, d, _ = q8_form(v)
    return (q.reshape(q.shape[0], -1, 32).astype(np.float32) * d[..., None]).reshape(q.shape).astype(np.float64)
