"""Programmatic dependent launch (PDL, sm_90): a kernel launched with the driver's
``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` may start its blocks before the kernel
ahead of it in the stream has finished -- once every block of that kernel has called
``pdl_trigger()`` or exited (cuda/dense_common.cuh) -- and must call ``pdl_wait()`` before it
reads what that kernel wrote or writes what it reads. A CUDA-graph capture records the launch
as a programmatic edge. :class:`PdlLaunch` is :class:`kernels.BoundLaunch` launched so, through
``cuLaunchKernelEx`` (CuPy binds only ``cuLaunchKernel``); ``matmul_dispatch.GEMV_PDL`` says
where it is used.
"""
from __future__ import annotations

import ctypes

from .kernels import BoundLaunch

__all__ = ["PdlLaunch", "LaunchAttribute", "LaunchConfig", "PROGRAMMATIC_STREAM_SERIALIZATION"]

PROGRAMMATIC_STREAM_SERIALIZATION = 6   # CUlaunchAttributeID (cuda.h)


class LaunchAttribute(ctypes.Structure):
    """Mirror of ``CUlaunchAttribute`` (cuda.h): the id, padding to 8 bytes, a 64-byte value union
    (``value[0]``: programmaticStreamSerializationAllowed)."""
    _fields_ = [("id", ctypes.c_int32), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int32 * 16)]


class LaunchConfig(ctypes.Structure):
    """Mirror of ``CUlaunchConfig`` (cuda.h)."""
    _fields_ = [("gridDimX", ctypes.c_uint32), ("gridDimY", ctypes.c_uint32), ("gridDimZ", ctypes.c_uint32),
                ("blockDimX", ctypes.c_uint32), ("blockDimY", ctypes.c_uint32), ("blockDimZ", ctypes.c_uint32),
                ("sharedMemBytes", ctypes.c_uint32), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint32)]


_DRIVER: list = []   # [(cuLaunchKernelEx, cuGetErrorName)] once loaded


def _driver():
    if not _DRIVER:
        lib = ctypes.CDLL("libcuda.so.1")
        launch = lib.cuLaunchKernelEx
        launch.restype, launch.argtypes = ctypes.c_int, [ctypes.POINTER(LaunchConfig), ctypes.c_void_p,
                                                         ctypes.c_void_p, ctypes.c_void_p]
        name = lib.cuGetErrorName
        name.restype, name.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        _DRIVER.append((launch, name))
    return _DRIVER[0]


class PdlLaunch(BoundLaunch):
    """A :class:`BoundLaunch` whose kernel may overlap the stream's preceding one (the kernel
    calls ``pdl_wait()`` first where it depends on it); launched on CuPy's current stream, the
    configuration built once."""

    def __init__(self, fn, grid, block, *params):
        super().__init__(fn, grid, block, *params)
        self.attr = LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION)
        self.attr.value[0] = 1
        self.config = LaunchConfig(*grid, *block, fn.smem, None, ctypes.pointer(self.attr), 1)

    def __call__(self) -> None:
        launch, name = _driver()
        self.config.hStream = self._stream().ptr
        rc = launch(ctypes.byref(self.config), self.fn.func, ctypes.addressof(self.args), None)
        if rc:
            s = ctypes.c_char_p()
            name(rc, ctypes.byref(s))
            raise RuntimeError(f"cuLaunchKernelEx of {self.fn.name} (programmatic dependent launch) failed: "
                               f"{(s.value or b'?').decode()} ({rc})")
