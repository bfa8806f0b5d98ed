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
GGML_TYPE_Q4_1 = 3
GGML_TYPE_Q5_0 = 6
GGML_TYPE_Q5_1 = 7
GGML_TYPE_Q8_0 = 8
GGML_TYPE_IQ4_NL = 20

# llama.cpp's K/V cache types (-ctk / -ctv), its names in its order -> ggml type id: the one list
# of them (graph.kv_cache, the CLIs' flags and checks read it)
CACHE_TYPE_IDS = {"f16": GGML_TYPE_F16, "bf16": GGML_TYPE_BF16, "f32": GGML_TYPE_F32, "q8_0": GGML_TYPE_Q8_0,
                  "q4_0": GGML_TYPE_Q4_0, "q4_1": GGML_TYPE_Q4_1, "iq4_nl": GGML_TYPE_IQ4_NL,
                  "q5_0": GGML_TYPE_Q5_0, "q5_1": GGML_TYPE_Q5_1}
CACHE_TYPES = tuple(CACHE_TYPE_IDS)
FLOAT_CACHE_TYPES = ("f16", "bf16", "f32")          # one value per element
QUANT_BLOCK = 32                                    # values per block of the others (ggml_blck_size)
DEVICE_BLOCK_TYPES = ("q8_0", "q4_0")   # block types a CuPy cache holds (cuda/dense.cu dense_kv_store writes them)

TYPE_NAMES = {i: n for n, i in CACHE_TYPE_IDS.items()}
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


def block_size(type_name: str) -> int:
    """Values per block of cache type ``type_name``: 1 for f16/bf16/f32, :data:`QUANT_BLOCK` for
    q8_0, q4_0, q4_1, q5_0, q5_1 and iq4_nl (ggml's ``ggml_blck_size``; a test checks them)."""
    if type_name not in CACHE_TYPE_IDS:
        raise ValueError(f"{type_name!r} is not a cache type ({', '.join(CACHE_TYPES)})")
    return 1 if type_name in FLOAT_CACHE_TYPES else QUANT_BLOCK


def check_head_blocks(name: str, type_name, head_dim_k: int) -> None:
    """The one rule for a K or V cache type (``name``: ``type_k`` / ``type_v``): one of
    :data:`CACHE_TYPES`, and each head's row (``head_dim_k`` values) a whole number of the type's
    blocks, since attention reads K/V per head (a q8_0 row of two 48-wide heads holds three
    blocks, but the second head starts in the middle of one: ggml's op gave NaN rows).
    ``ValueError`` naming the argument, the type, the head size and the block size."""
    if not isinstance(type_name, str) or type_name not in CACHE_TYPE_IDS:
        raise ValueError(f"{name} {type_name!r} is not a cache type (allowed: {', '.join(CACHE_TYPES)})")
    blck = block_size(type_name)
    if head_dim_k % blck:
        raise ValueError(f"{name} {type_name}: head size {head_dim_k} is not a multiple of {blck}, the "
                         f"{type_name} block size (each head's row must be whole blocks)")
