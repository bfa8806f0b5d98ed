"""Element types shared by the reference, the op and the kernels.

numpy has no bfloat16, so BF16 data travels as ``uint16`` bit patterns
(the upper half of an IEEE float32), exactly as ggml stores it.
"""
from __future__ import annotations

import numpy as np

# ggml type ids (ggml.h, ggml 0.15.3); kept here so ``import ggml_attn.reference``
# does not need the ggml shared library.
GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1
GGML_TYPE_BF16 = 30
GGML_TYPE_Q4_0 = 2
GGML_TYPE_Q8_0 = 8

TYPE_NAMES = {GGML_TYPE_F32: "f32", GGML_TYPE_F16: "f16", GGML_TYPE_BF16: "bf16", GGML_TYPE_Q8_0: "q8_0",
              GGML_TYPE_Q4_0: "q4_0"}
TYPE_SIZES = {GGML_TYPE_F32: 4, GGML_TYPE_F16: 2, GGML_TYPE_BF16: 2}
# numpy storage dtype of each ggml type (BF16 as raw bits)
STORAGE_DTYPES = {GGML_TYPE_F32: np.float32, GGML_TYPE_F16: np.float16, GGML_TYPE_BF16: np.uint16}


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """BF16 bit patterns (uint16, any shape) -> float32 of the same shape."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise TypeError(f"bf16 data must be uint16 bit patterns, got {bits.dtype}")
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 (any shape) -> BF16 bit patterns (uint16), round to nearest even, NaN kept NaN."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


def to_float(data: np.ndarray, ggml_type: int) -> np.ndarray:
    """Storage array of ``ggml_type`` (see STORAGE_DTYPES) -> float32 array, same shape."""
    if ggml_type == GGML_TYPE_BF16:
        return bf16_to_f32(data)
    if ggml_type in (GGML_TYPE_F16, GGML_TYPE_F32):
        return np.asarray(data, dtype=np.float32)
    raise ValueError(f"unsupported ggml type {ggml_type}")


def from_float(x: np.ndarray, ggml_type: int) -> np.ndarray:
    """float array -> storage array of ``ggml_type`` (BF16 as uint16 bits), same shape."""
    if ggml_type == GGML_TYPE_BF16:
        return f32_to_bf16(x)
    if ggml_type in STORAGE_DTYPES:
        return np.asarray(x, dtype=STORAGE_DTYPES[ggml_type])
    raise ValueError(f"unsupported ggml type {ggml_type}")
