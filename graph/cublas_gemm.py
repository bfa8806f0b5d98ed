"""One cuBLAS GEMM of F16 operands into F32 (``cublasGemmEx``) as a function of no arguments on
CuPy's current stream, through the C library so that it can be captured in a CUDA graph: the
GEMM step of ``xp_matmul``'s F16 matmuls and of the block weights' dequantize + cuBLAS path.
Shapes in numpy order."""
from __future__ import annotations

import ctypes

import numpy as np


class CublasGemm:
    """``out (n_tok, n_out) F32 (+)= x16 (n_tok, n_in) F16 @ w (n_out, n_in) F16ᵀ`` (numpy order,
    C-contiguous CuPy arrays) as one ``cublasGemmEx`` on the current stream, F32 accumulation.
    Column-major view: ``outᵀ (n_out x n_tok) = Aᵀ · B`` with A = w as an (n_in x n_out) matrix
    and B = x16 as (n_in x n_tok). Called through the C library (``_libcublas``): CuPy's own
    wrappers refuse to run while a CUDA graph is captured. The handle is CuPy's, with a
    workspace of its own (``_cublas_workspace``) so that nothing allocates during a capture."""

    def __init__(self, w, x16, out, beta: float = 0.0):
        n_out, n_in = w.shape
        assert x16.shape[1] == n_in and out.shape == (x16.shape[0], n_out)
        assert w.flags.c_contiguous and x16.flags.c_contiguous and out.flags.c_contiguous
        self._set(w.data.ptr, n_out, n_in, x16.data.ptr, x16.shape[0], out.data.ptr, n_out, beta)

    @classmethod
    def of_ptrs(cls, w: int, n_out: int, n_in: int, x16: int, n_tok: int, out: int, ldc: int, beta: float = 0.0):
        """The GEMM of device pointers: ``w`` F16 ``(n_out, n_in)``, ``x16`` F16 ``(n_tok, n_in)``
        (both C-contiguous) into ``out`` F32 ``(n_tok, n_out)`` whose rows are ``ldc`` floats apart
        (a block of columns of a wider output)."""
        g = cls.__new__(cls)
        g._set(w, n_out, n_in, x16, n_tok, out, ldc, beta)
        return g

    def _set(self, w, n_out, n_in, x16, n_tok, out, ldc, beta):
        from cupy.cuda import device  # noqa: PLC0415 (device graphs only)
        self.lib = _libcublas()
        self.handle = device.get_cublas_handle()
        _cublas_workspace(self.lib, self.handle)
        self.n_out, self.n_in, self.n_tok, self.ldc = n_out, n_in, n_tok, ldc
        self.ptrs = (w, x16, out)
        self.scal = np.array([1.0, beta], dtype=np.float32)   # alpha, beta (host pointer mode)

    def __call__(self):
        import cupy  # noqa: PLC0415
        lib, h, (a, bx, o) = self.lib, self.handle, self.ptrs
        _check(lib.cublasSetStream_v2(h, cupy.cuda.get_current_stream().ptr), "cublasSetStream")
        al = self.scal.ctypes.data
        _check(lib.cublasGemmEx(h, 1, 0, self.n_out, self.n_tok, self.n_in, al, a, 2, self.n_in, bx, 2,
                                self.n_in, al + 4, o, 0, self.ldc, 68, -1), "cublasGemmEx")


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with cuBLAS status {status}")


_LIB: list = []


def _libcublas():
    """The cuBLAS C library CuPy loaded (same soname), with the prototypes used here."""
    if not _LIB:
        from cupy_backends.cuda.libs import cublas  # noqa: F401, PLC0415 (loads the library)
        for name in ("libcublas.so.13", "libcublas.so.12"):
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        else:
            raise RuntimeError("libcublas.so.13/.12 not found (the one CuPy uses)")
        vp, i = ctypes.c_void_p, ctypes.c_int
        lib.cublasSetStream_v2.argtypes = [vp, vp]
        lib.cublasSetWorkspace_v2.argtypes = [vp, vp, ctypes.c_size_t]
        lib.cublasGemmEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
        _LIB.append(lib)
    return _LIB[0]


_WORKSPACES: dict = {}


def _cublas_workspace(lib, handle: int, nbytes: int = 32 << 20) -> None:
    """Give the cuBLAS handle a workspace once (kept for the process)."""
    if handle in _WORKSPACES:
        return
    import cupy  # noqa: PLC0415
    buf = cupy.empty(nbytes, dtype=cupy.uint8)
    _check(lib.cublasSetWorkspace_v2(handle, buf.data.ptr, nbytes), "cublasSetWorkspace")
    _WORKSPACES[handle] = buf
