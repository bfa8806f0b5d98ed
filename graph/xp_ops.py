"""The full block's dense ops as ggml custom ops over an array module ``xp`` (numpy or CuPy),
for all-custom (device-resident) graphs. On numpy each op is a few numpy calls (the CPU tests
check them against ggml's own ops); on CuPy the same math is fused into fewer launches -- one
cuBLAS GEMM per ``mul_mat`` (f16 in, f32 accumulate and out), two kernels per ``rms_norm``, one
per ``silu_mul`` -- checked against the host graph by tests/test_graph_device.py.

Every op's result memory and scratch is an array made at build time (``b.scratch``); the callback only runs
``xp`` functions with ``out=`` on arrays bound at build time: nothing is allocated while the
graph computes, nothing synchronizes (on CuPy each op launches work on the current stream).
Shapes at the function boundaries, ggml order ``[ne0, ne1]`` = numpy ``(ne1, ne0)``:

* :func:`mul_mat`: weight F16 numpy ``(n_out, n_in)`` = ggml ``[n_in, n_out]`` times
  ``h`` F32 ``[n_in, n_tokens]`` -> F32 ``[n_out, n_tokens]``; ``h`` is rounded to F16 first
  and the products summed in F32, as ggml's CPU ``mul_mat`` with an F16 weight does (numpy:
  the F16 product widened to F32; CuPy: F32 out of the GEMM);
* :func:`rms_norm`: F32 ``[n, n_tokens]`` -> F32, ``x / sqrt(mean(x^2) + eps)`` per token;
* :func:`silu_mul`: ``silu(g) * u``, F32 ``[n_ff, n_tokens]``;
* :func:`add_into`: ``x += y`` in place; the node's result is ``x``'s memory.

Each function takes the graph builder ``b`` (``build.GraphBuilder``) and tensors made by it,
and returns the result tensor. Errors inside a callback are recorded for the node like the
attention op's (``ggml_attn.op.record_error``) and raised after compute.
"""
from __future__ import annotations

import ctypes
import itertools
import threading

import ggml
import numpy as np

from ggml_attn import op as fa_op

__all__ = ["mul_mat", "rms_norm", "silu_mul", "add_into", "release"]

_calls: dict[int, object] = {}
_keys = itertools.count(1)
_lock = threading.Lock()


def _callback(dst_p, ith, nth, userdata):
    fa_op.run_custom_node(dst_p, ith, lambda d: _calls[int(userdata or 0)](), "xp op")


_CB = ggml.ggml_custom_op_t(_callback)


def release(keys) -> None:
    """Forget the callbacks of a freed graph."""
    with _lock:
        for k in keys:
            _calls.pop(k, None)


def _custom(b, fn, srcs, out_arr, name: str, *, alias=None):
    """A one-thread custom node with sources ``srcs`` (graph order), running ``fn()``; its result
    is ``out_arr`` (F32), or the memory of tensor ``alias`` when given."""
    with _lock:
        key = next(_keys)
        _calls[key] = fn
    b.op_keys.append(key)
    ne = list(reversed(out_arr.shape)) + [1] * (4 - out_arr.ndim)
    args = (ctypes.POINTER(ggml.ggml_tensor) * len(srcs))(*srcs)
    t = ggml.ggml_custom_4d(b.ctx, ggml.GGML_TYPE_F32, *ne, args, len(srcs), _CB, 1, ctypes.c_void_p(key))
    ggml.ggml_set_name(t, name.encode())
    return b.attach(t, out_arr)


def mul_mat(b, w: np.ndarray, h, name: str):
    """``w`` (xp F16 ``(n_out, n_in)``) x ``h`` (tensor F32 ``[n_in, n_tokens]``)."""
    xp = b.xp
    x = b.array(h)                                  # (n_tokens, n_in) F32
    n_tok, n_out = x.shape[0], w.shape[0]
    x16 = b.scratch(x.shape, np.float16)
    out = b.scratch((n_tok, n_out), np.float32)
    wt = w.T
    if xp is np:
        o16 = b.scratch((n_tok, n_out), np.float16)
        b.keep(o16)

        def run():
            xp.copyto(x16, x, casting="same_kind")
            xp.matmul(x16, wt, out=o16)
            xp.copyto(out, o16)
    else:   # one cuBLAS GEMM, f16 in, f32 out (CuPy's matmul refuses to run inside a CUDA-graph capture)
        gemm = _CublasGemm(w, x16, out)

        def run():
            xp.copyto(x16, x, casting="same_kind")
            gemm()
    b.keep(x16, w)
    return _custom(b, run, [h], out, name)


class _CublasGemm:
    """``out (n_tok, n_out) F32 = x16 (n_tok, n_in) F16 @ w (n_out, n_in) F16ᵀ`` (numpy order,
    C-contiguous CuPy arrays) as one ``cublasGemmEx`` on the current stream, F32 accumulation.
    Column-major view: ``outᵀ (n_out x n_tok) = Aᵀ · B`` with A = w as an (n_in x n_out) matrix
    and B = x16 as (n_in x n_tok). Called through the C library (``_libcublas``): CuPy's own
    wrappers refuse to run while a CUDA graph is captured. The handle is CuPy's, with a
    workspace of its own (``_cublas_workspace``) so that nothing allocates during a capture."""

    def __init__(self, w, x16, out):
        from cupy.cuda import device  # noqa: PLC0415 (device graphs only)
        self.lib = _libcublas()
        self.handle = device.get_cublas_handle()
        _cublas_workspace(self.lib, self.handle)
        self.n_out, self.n_in = w.shape
        self.n_tok = x16.shape[0]
        assert x16.shape[1] == self.n_in and out.shape == (self.n_tok, self.n_out)
        assert w.flags.c_contiguous and x16.flags.c_contiguous and out.flags.c_contiguous
        self.ptrs = (w.data.ptr, x16.data.ptr, out.data.ptr)
        self.scal = np.array([1.0, 0.0], dtype=np.float32)   # alpha, beta (host pointer mode)

    def __call__(self):
        import cupy  # noqa: PLC0415
        lib, h, (a, bx, o) = self.lib, self.handle, self.ptrs
        _check(lib.cublasSetStream_v2(h, cupy.cuda.get_current_stream().ptr), "cublasSetStream")
        al = self.scal.ctypes.data
        _check(lib.cublasGemmEx(h, 1, 0, self.n_out, self.n_tok, self.n_in, al, a, 2, self.n_in, bx, 2,
                                self.n_in, al + 4, o, 0, self.n_out, 68, -1), "cublasGemmEx")
        # 1/0: transpose A / not B; 2: CUDA_R_16F, 0: CUDA_R_32F; 68: CUBLAS_COMPUTE_32F; -1: default algo


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


def rms_norm(b, x_t, eps: float, name: str):
    xp = b.xp
    x = b.array(x_t)
    ms = b.scratch((x.shape[0], 1), np.float32)
    out = b.scratch(x.shape, np.float32)
    inv_n = np.float32(1.0 / x.shape[1])
    if xp is np:
        def run():
            xp.multiply(x, x, out=out)
            xp.sum(out, axis=1, keepdims=True, out=ms)
            xp.multiply(ms, inv_n, out=ms)
            xp.add(ms, np.float32(eps), out=ms)
            xp.sqrt(ms, out=ms)
            xp.divide(x, ms, out=out)
    else:   # two launches: the row sums of squares, then the scaling
        k = _fused()
        n, ms1 = x.shape[1], ms.reshape(-1)

        def run():
            k["sumsq"](x, axis=1, out=ms1)
            k["rms_scale"](x, ms1, n, inv_n, np.float32(eps), out)
    b.keep(ms)
    return _custom(b, run, [x_t], out, name)


_FUSED: dict = {}


def _fused() -> dict:
    """CuPy kernels that fuse the numpy steps of :func:`rms_norm` and :func:`silu_mul` (one or
    two launches instead of five or six; same math in F32)."""
    if not _FUSED:
        import cupy  # noqa: PLC0415
        _FUSED.update(
            sumsq=cupy.ReductionKernel("float32 x", "float32 y", "x * x", "a + b", "y = a", "0",
                                       "ggml_attn_xp_sumsq"),
            rms_scale=cupy.ElementwiseKernel(
                "float32 x, raw float32 ss, int64 n, float32 inv_n, float32 eps", "float32 y",
                "y = x / sqrtf(ss[i / n] * inv_n + eps);", "ggml_attn_xp_rms_scale"),
            silu_mul=cupy.ElementwiseKernel(
                "float32 g, float32 u", "float32 y", "y = g / (1.0f + expf(-g)) * u;", "ggml_attn_xp_silu_mul"),
        )
    return _FUSED


def silu_mul(b, g_t, u_t, name: str):
    xp = b.xp
    g, u = b.array(g_t), b.array(u_t)
    out = b.scratch(g.shape, np.float32)

    if xp is np:
        def run():
            xp.negative(g, out=out)
            xp.exp(out, out=out)
            xp.add(out, np.float32(1.0), out=out)
            xp.divide(g, out, out=out)
            xp.multiply(out, u, out=out)
    else:
        fused = _fused()["silu_mul"]

        def run():
            fused(g, u, out)
    return _custom(b, run, [g_t, u_t], out, name)


def add_into(b, x_t, y_t, name: str):
    """``x += y``; returns a node whose memory is ``x``'s (the residual stream, updated)."""
    xp = b.xp
    x, y = b.array(x_t), b.array(y_t)

    def run():
        xp.add(x, y, out=x)
    return _custom(b, run, [x_t, y_t], x, name)
