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


@dataclass(frozen=True)
class TensorDesc:
    ptr: int                      # address of element (0,0,0,0): host or device
    type: int                     # ggml type id (dtypes.GGML_TYPE_*)
    ne: tuple[int, int, int, int]  # elements per dim, ggml order
    nb: tuple[int, int, int, int]  # bytes per step in each dim, ggml order
    name: str = ""

    @property
    def shape_str(self) -> str:
        return f"{self.name or 'tensor'}[{', '.join(map(str, self.ne))}] {TYPE_NAMES.get(self.type, self.type)}"

    def is_contiguous(self) -> bool:
        size = TYPE_SIZES[self.type]
        expect = size
        for ne, nb in zip(self.ne, self.nb):
            if ne > 1 and nb != expect:
                return False
            expect *= ne
        return True

    def nbytes_span(self) -> int:
        """Bytes from ``ptr`` to one past the last element (strides assumed non-negative)."""
        if any(n == 0 for n in self.ne):
            return 0
        return sum((n - 1) * b for n, b in zip(self.ne, self.nb)) + TYPE_SIZES[self.type]


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
    """Describe a numpy or CuPy array given in **numpy order** (slowest first, up to 4 dims)."""
    if ggml_type is None:
        ggml_type = {np.dtype(v): k for k, v in STORAGE_DTYPES.items()}[np.dtype(arr.dtype)]
    shape = (1,) * (4 - arr.ndim) + tuple(arr.shape)
    strides = (0,) * (4 - arr.ndim) + tuple(arr.strides)
    ne = tuple(reversed(shape))
    nb = tuple(reversed(strides))
    # size-1 dims: give them the stride a contiguous tensor would have
    fixed = list(nb)
    for i in range(4):
        if ne[i] == 1:
            fixed[i] = (fixed[i - 1] * ne[i - 1]) if i else TYPE_SIZES[ggml_type]
    if hasattr(arr, "data") and hasattr(arr.data, "ptr"):
        ptr = int(arr.data.ptr)  # CuPy
    else:
        ptr = int(arr.ctypes.data)
    return TensorDesc(ptr, ggml_type, ne, tuple(fixed), name)


def as_numpy(desc: TensorDesc) -> np.ndarray:
    """Host tensor -> numpy view in numpy order (ne reversed), storage dtype (BF16 as uint16)."""
    if desc.ptr == 0:
        raise ValueError(f"{desc.shape_str} has no data")
    dtype = np.dtype(STORAGE_DTYPES[desc.type])
    span = desc.nbytes_span()
    buf = (ctypes.c_uint8 * max(span, 1)).from_address(desc.ptr)
    return np.ndarray(tuple(reversed(desc.ne)), dtype, buffer=buf,
                      strides=tuple(reversed(desc.nb)))
