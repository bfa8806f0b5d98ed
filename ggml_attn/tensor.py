"""A ggml tensor described by plain numbers: data pointer, type, ``ne`` and ``nb``.

``TensorDesc`` is the currency between the ggml op (which reads it off a
``ggml_tensor``), the numpy reference (through :func:`as_numpy`) and the CUDA
launchers (which take the pointer and byte strides as kernel arguments).
``ne``/``nb`` are in **ggml order** (``ne[0]`` fastest), always 4 entries.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from .dtypes import STORAGE_DTYPES, TYPE_NAMES, TYPE_SIZES


def type_name(ggml_type: int) -> str:
    """Short name of a ggml type id (``f16``, ``q8_0``, ...)."""
    if ggml_type in TYPE_NAMES:
        return TYPE_NAMES[ggml_type]
    from .quant import type_info
    info = type_info(ggml_type)
    return info.name if info else f"type {ggml_type}"


@dataclass(frozen=True)
class TensorDesc:
    ptr: int                      # address of element (0,0,0,0): host or device
    type: int                     # ggml type id (dtypes.GGML_TYPE_*)
    ne: tuple[int, int, int, int]  # elements per dim, ggml order
    nb: tuple[int, int, int, int]  # bytes per step in each dim, ggml order
    name: str = ""

    @property
    def shape_str(self) -> str:
        return f"{self.name or 'tensor'}[{', '.join(map(str, self.ne))}] {type_name(self.type)}"

    def row_bytes(self) -> int:
        """Bytes of one contiguous row of ``ne[0]`` elements (quantized types included)."""
        if self.type in TYPE_SIZES:
            return TYPE_SIZES[self.type] * self.ne[0]
        from .quant import type_info
        return type_info(self.type).row_bytes(self.ne[0])

    def is_contiguous(self) -> bool:
        if self.type in TYPE_SIZES:
            expect = TYPE_SIZES[self.type]
            dims = range(4)
        else:  # quantized: rows are blocks; check the row strides only
            expect = self.row_bytes()
            dims = range(1, 4)
        for i in dims:
            if self.ne[i] > 1 and self.nb[i] != expect:
                return False
            expect *= self.ne[i]
        return True

    def nbytes_span(self) -> int:
        """Bytes from ``ptr`` to one past the last element (strides assumed non-negative)."""
        if any(n == 0 for n in self.ne):
            return 0
        if self.type in TYPE_SIZES:
            return sum((n - 1) * b for n, b in zip(self.ne, self.nb)) + TYPE_SIZES[self.type]
        return sum((n - 1) * b for n, b in zip(self.ne[1:], self.nb[1:])) + self.row_bytes()


def contiguous_nb(type_: int, ne) -> tuple[int, int, int, int]:
    """Byte strides of a contiguous tensor of ``type_`` with ggml-order ``ne``."""
    nb = [TYPE_SIZES[type_]]
    for n in ne[:3]:
        nb.append(nb[-1] * n)
    return tuple(nb)


def from_ggml(tensor, name: str = "") -> TensorDesc:
    """Describe a ``ggml_tensor_p`` (ggml-python). Raises if its type is not F32/F16/BF16."""
    t = tensor.contents
    ptr = t.data or 0
    return TensorDesc(int(ptr), int(t.type), tuple(int(x) for x in t.ne[:4]),
                      tuple(int(x) for x in t.nb[:4]), name or t.name.decode(errors="replace"))


def from_array(arr, ggml_type: int | None = None, name: str = "") -> TensorDesc:
    """Describe a numpy or CuPy array given in **numpy order** (slowest first, up to 4 dims).
    A quantized ``ggml_type`` takes uint8 rows ``(..., row_bytes)`` (as :func:`as_numpy` gives
    them): ``ne[0]`` is the row's values, ``nb[0]`` the block size in bytes."""
    if ggml_type is None:
        ggml_type = {np.dtype(v): k for k, v in STORAGE_DTYPES.items()}[np.dtype(arr.dtype)]
    shape = (1,) * (4 - arr.ndim) + tuple(arr.shape)
    strides = (0,) * (4 - arr.ndim) + tuple(arr.strides)
    ne = list(reversed(shape))
    nb = list(reversed(strides))
    elem = TYPE_SIZES.get(ggml_type)
    if elem is None:   # quantized blocks: uint8 rows of whole blocks
        from .quant import type_info
        info = type_info(ggml_type)
        if info is None or not info.quantized or np.dtype(arr.dtype) != np.uint8 or shape[3] % info.type_size:
            raise ValueError(f"a {type_name(ggml_type)} tensor is uint8 rows of whole blocks; got "
                             f"{arr.dtype} {tuple(arr.shape)}")
        ne[0], nb[0], elem = shape[3] // info.type_size * info.blck_size, info.type_size, info.type_size
        row_bytes = shape[3]
    else:
        row_bytes = ne[0] * elem
    # size-1 dims: give them the stride a contiguous tensor would have
    fixed = list(nb)
    for i in range(4):
        if ne[i] == 1:
            fixed[i] = elem if i == 0 else row_bytes if i == 1 else fixed[i - 1] * ne[i - 1]
    if hasattr(arr, "data") and hasattr(arr.data, "ptr"):
        ptr = int(arr.data.ptr)  # CuPy
    else:
        ptr = int(arr.ctypes.data)
    return TensorDesc(ptr, ggml_type, tuple(ne), tuple(fixed), name)


def as_numpy(desc: TensorDesc) -> np.ndarray:
    """Host tensor -> numpy view in numpy order (ne reversed) of its storage: F32/F16 as such,
    BF16 as uint16 bits, quantized types as uint8 rows ``(ne3, ne2, ne1, row_bytes)``."""
    if desc.ptr == 0:
        raise ValueError(f"{desc.shape_str} has no data")
    span = desc.nbytes_span()
    buf = (ctypes.c_uint8 * max(span, 1)).from_address(desc.ptr)
    if desc.type not in STORAGE_DTYPES:
        shape = tuple(reversed(desc.ne[1:])) + (desc.row_bytes(),)
        return np.ndarray(shape, np.uint8, buffer=buf, strides=tuple(reversed(desc.nb[1:])) + (1,))
    return np.ndarray(tuple(reversed(desc.ne)), np.dtype(STORAGE_DTYPES[desc.type]), buffer=buf,
                      strides=tuple(reversed(desc.nb)))
