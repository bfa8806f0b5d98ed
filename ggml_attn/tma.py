"""TMA tensor maps (Hopper bulk tensor copies): ``cuTensorMapEncodeTiled`` through ctypes on
the driver library (CuPy has no binding). A map is 128 opaque bytes that a kernel takes by
value as a ``const __grid_constant__ TmaMap`` parameter (cuda/hopper_common.cuh) and hands to
``cp.async.bulk.tensor``.

Shapes are given innermost first, as ggml's ``ne`` (``dims[0]`` is the contiguous one);
``strides`` are the byte strides of dims 1.. (ggml's ``nb[1:]``).
"""
from __future__ import annotations

import ctypes

# CUtensorMapDataType (UINT8: raw bytes, ggml's quantized blocks; UINT64: rows of them too wide
# for a box side of 256 bytes)
DTYPE_U8, DTYPE_U64, DTYPE_F16, DTYPE_F32, DTYPE_BF16 = 0, 4, 6, 7, 9
_ELEM_BYTES = {DTYPE_U8: 1, DTYPE_U64: 8, DTYPE_F16: 2, DTYPE_F32: 4, DTYPE_BF16: 2}
# CUtensorMapSwizzle
SWIZZLE_NONE, SWIZZLE_32B, SWIZZLE_64B, SWIZZLE_128B = 0, 1, 2, 3
# CUtensorMapL2promotion: the L2 sector promotion of the copies' DRAM reads
L2_PROMOTION_NONE, L2_PROMOTION_64B, L2_PROMOTION_128B, L2_PROMOTION_256B = 0, 1, 2, 3


class TmaMap(ctypes.Structure):
    """CUtensorMap: 128 bytes, 64-byte aligned (ctypes copies it into the kernel's parameters)."""
    _fields_ = [("words", ctypes.c_uint64 * 16)]


def check_tiled(dtype: int, addr: int, dims, strides, box, swizzle: int = SWIZZLE_NONE) -> None:
    """The driver's rules for a tiled map, as errors that say which (the driver answers only
    CUDA_ERROR_INVALID_VALUE): rank 1-5, address 16-byte aligned, strides multiples of 16
    below 2^40 (in any order: a permuted view's strides need not grow), box sides 1-256, the
    box's inner side a multiple of 16 bytes (at most the swizzle span when swizzled)."""
    if dtype not in _ELEM_BYTES:
        raise ValueError(f"unsupported TMA element type {dtype}")
    rank = len(dims)
    if not 1 <= rank <= 5 or len(strides) != rank - 1 or len(box) != rank:
        raise ValueError(f"rank {rank}: need {rank - 1} strides and {rank} box sides, "
                         f"got {len(strides)} and {len(box)}")
    if addr % 16:
        raise ValueError(f"global address {addr:#x} is not 16-byte aligned")
    eb = _ELEM_BYTES[dtype]
    if any(d < 1 or d > 1 << 32 for d in dims):
        raise ValueError(f"dims {tuple(dims)} out of range 1..2^32")
    for i, st in enumerate(strides):   # any order of the dims (ggml's permuted views) is fine
        if st % 16 or not 0 < st < 1 << 40:
            raise ValueError(f"stride of dim {i + 1} is {st} bytes: must be a multiple of 16 in (0, 2^40)")
    if any(b < 1 or b > 256 for b in box):
        raise ValueError(f"box {tuple(box)}: sides must be 1..256")
    inner = box[0] * eb
    if inner % 16:
        raise ValueError(f"box inner side {box[0]} x {eb} bytes is not a multiple of 16")
    limit = {SWIZZLE_32B: 32, SWIZZLE_64B: 64, SWIZZLE_128B: 128}.get(swizzle)
    if limit is not None and inner > limit:
        raise ValueError(f"box inner side {inner} bytes exceeds the {limit}-byte swizzle span")


def encode_tiled(dtype: int, addr: int, dims, strides, box, swizzle: int = SWIZZLE_NONE,
                 l2_promotion: int = L2_PROMOTION_NONE) -> TmaMap:
    """A tiled tensor map over the tensor at device address ``addr``: ``dims`` elements per
    dimension (innermost first), ``strides`` bytes for dims 1.., ``box`` the elements one copy
    moves per dimension. Out-of-range elements of a box read as zeros."""
    check_tiled(dtype, addr, dims, strides, box, swizzle)
    rank = len(dims)
    fn = _driver().cuTensorMapEncodeTiled
    raw = ctypes.create_string_buffer(128 + 128)   # 64-byte aligned for the driver (cuda.h 13: 128)
    at = (ctypes.addressof(raw) + 127) & ~127
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    rc = fn(ctypes.c_void_p(at), ctypes.c_int(dtype), u32(rank), ctypes.c_void_p(addr),
            (u64 * rank)(*dims), (u64 * max(1, rank - 1))(*strides), (u32 * rank)(*box),
            (u32 * rank)(*([1] * rank)), ctypes.c_int(0), ctypes.c_int(swizzle), ctypes.c_int(l2_promotion),
            ctypes.c_int(0))
    if rc != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {rc}) for dims {tuple(dims)}, "
                           f"strides {tuple(strides)}, box {tuple(box)}")
    out = TmaMap()
    ctypes.memmove(ctypes.addressof(out), at, 128)
    return out


_LIB = None


def _driver():
    """libcuda (the driver the GPU's processes already load), its encode entry point typed."""
    global _LIB
    if _LIB is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuTensorMapEncodeTiled.restype = ctypes.c_int
        _LIB = lib
    return _LIB
