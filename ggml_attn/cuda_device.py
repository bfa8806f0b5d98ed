"""The CUDA device as the backend sees it: whether one is usable, its SM count, and the raw
pointer of a stream argument. Cached per process; nothing here raises without a GPU.
"""
from __future__ import annotations

from . import kernels as K

_AVAILABLE: bool | None = None
_NUM_SMS: int | None = None


def available() -> bool:
    """True when CuPy imports and at least one CUDA device is visible. Cached; never raises."""
    global _AVAILABLE
    if _AVAILABLE is None:
        try:
            K.ensure_cuda_namespace()
            import cupy
            _AVAILABLE = cupy.cuda.runtime.getDeviceCount() > 0
        except Exception:
            _AVAILABLE = False
    return _AVAILABLE


def num_sms() -> int:
    global _NUM_SMS
    if _NUM_SMS is None:
        try:
            import cupy
            _NUM_SMS = int(cupy.cuda.Device().attributes["MultiProcessorCount"])
        except Exception:
            _NUM_SMS = 132
    return _NUM_SMS


def stream_ptr(stream) -> int:
    """Raw pointer of ``stream``: a CuPy/torch stream object, an int, or None (CuPy's current
    stream)."""
    if stream is None:
        import cupy
        return cupy.cuda.get_current_stream().ptr
    if isinstance(stream, int):
        return stream
    return int(stream.ptr)
