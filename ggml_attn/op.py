"""``flash_attn_ext``: a drop-in for ``ggml_flash_attn_ext`` as a ggml custom op.

The op is a ``ggml_custom_4d`` node with sources ``[q, k, v, (mask), (sinks)]`` and the same
result as ggml's: F32 ``[D_v, n_head, n_batch, ne3]`` (ggml order), i.e. permuted (0,2,1,3)
relative to q. When the node runs it picks the backend per call:

* device pointers (device-resident graphs, REFERENCE §6) -> CUDA kernels, launched by graph
  thread 0 with raw pointers;
* host pointers and a usable GPU -> the same kernels, staged through pinned buffers;
* otherwise -> numpy in float32 (:mod:`ggml_attn.cpu`: skips fully masked tiles), work
  split over the graph's threads.

ggml swallows exceptions raised in callbacks (REFERENCE §6). Here every error is caught in
the callback, logged, the output filled with NaN (never left silently unwritten), and
recorded; :func:`compute_graph` re-raises it after compute, and :func:`raise_pending` does
so for graphs computed some other way.
"""
from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass

import ggml
import numpy as np

from . import cpu
from .dtypes import GGML_TYPE_F32, STORAGE_DTYPES
from .tensor import TensorDesc, as_numpy, from_ggml
from .validate import check_flash_attn_args

log = logging.getLogger("ggml_attn")

#: backend names accepted by :func:`set_backend`
BACKENDS = ("auto", "reference", "cuda")


class FlashAttnError(RuntimeError):
    """An error raised inside the op's callback during ggml compute."""


@dataclass(frozen=True)
class _OpParams:
    scale: float
    max_bias: float
    logit_softcap: float
    has_mask: bool
    has_sinks: bool


# userdata id -> params. Deduplicated: graphs with the same settings share one entry, so the
# registry stays tiny however many graphs are built.
_params_by_id: dict[int, _OpParams] = {}
_id_by_params: dict[_OpParams, int] = {}
_registry_lock = threading.Lock()

_errors: list[BaseException] = []
_errors_lock = threading.Lock()

_settings = {"backend": "auto", "kernel": "auto"}

# mask data pointer -> the CUDA backend's per-ubatch plan (FlashInfer's plan/run): every layer's
# op of a ubatch finds the plan by its mask instead of rescanning the mask.
_active_plans: dict[int, object] = {}


class active_plans:
    """``with active_plans(plan, ...):`` compute -- ops whose mask is a plan's mask reuse it.

    The caller owns the plans' validity: the mask contents must not change inside the block.
    Ops with other masks (or outside the block) build their own plan per call.
    """

    def __init__(self, *plans):
        self._plans = [p for p in plans if p is not None]

    def __enter__(self):
        for p in self._plans:
            _active_plans[p.mask.ptr] = p
        return self

    def __exit__(self, *exc):
        for p in self._plans:
            if _active_plans.get(p.mask.ptr) is p:
                del _active_plans[p.mask.ptr]


def set_backend(backend: str = "auto", kernel: str = "auto") -> None:
    """Choose where the op runs: ``auto`` (CUDA when usable, else numpy), ``reference``
    (numpy always) or ``cuda`` (error when no GPU); ``kernel`` is passed to the CUDA backend
    (``auto``, ``prefill``, ``decode``, ``decode-tc``, ``reference``)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    _settings["backend"] = backend
    _settings["kernel"] = kernel


def _params_id(p: _OpParams) -> int:
    with _registry_lock:
        if p not in _id_by_params:
            _id_by_params[p] = len(_params_by_id) + 1
            _params_by_id[_id_by_params[p]] = p
        return _id_by_params[p]


def _record(exc: BaseException) -> None:
    with _errors_lock:
        _errors.append(exc)


def pending_errors() -> list[BaseException]:
    """Errors recorded by op callbacks since the last :func:`raise_pending` (not cleared)."""
    with _errors_lock:
        return list(_errors)


def raise_pending() -> None:
    """Raise :class:`FlashAttnError` for the first error recorded by an op callback, if any,
    and clear the record."""
    with _errors_lock:
        errs, _errors[:] = list(_errors), []
    if errs:
        for e in errs:
            if isinstance(e, KeyboardInterrupt):  # Ctrl-C inside a callback stays a Ctrl-C
                raise e
        more = f" (+{len(errs) - 1} more)" if len(errs) > 1 else ""
        raise FlashAttnError(f"flash_attn_ext failed during compute: {errs[0]!r}{more}") from errs[0]


def compute_graph(ctx, graph, n_threads: int = 1) -> None:
    """``ggml_graph_compute_with_ctx`` that raises what the op's callbacks recorded."""
    raise_pending()
    with _single_threaded_blas:  # held by this thread for the whole compute: no toggling per node
        status = ggml.ggml_graph_compute_with_ctx(ctx, graph, n_threads)
    raise_pending()
    if status != 0:
        raise FlashAttnError(f"ggml_graph_compute_with_ctx returned status {status}")


def _descs(dst_p, p: _OpParams):
    dst = dst_p.contents
    names = ["q", "k", "v"] + (["mask"] if p.has_mask else []) + (["sinks"] if p.has_sinks else [])
    src = {n: from_ggml(dst.src[i], n) for i, n in enumerate(names)}
    return (src["q"], src["k"], src["v"], src.get("mask"), src.get("sinks"), from_ggml(dst_p, "dst"))


def _is_device_pointer(ptr: int) -> bool:
    """True when ``ptr`` is CUDA device (or managed) memory; needs CuPy."""
    import cupy
    attrs = cupy.cuda.runtime.pointerGetAttributes(ptr)
    return attrs.type in (2, 3)  # cudaMemoryTypeDevice, cudaMemoryTypeManaged


def gpu_available() -> bool:
    """True when the CUDA backend can run here (CuPy importable and a device present)."""
    try:
        from . import cuda_backend
    except ImportError:
        return False
    return bool(cuda_backend.available())


def _use_cuda(q: TensorDesc, k: TensorDesc, v: TensorDesc) -> tuple[bool, bool]:
    """(run on CUDA, pointers are on the device) for this call."""
    backend = _settings["backend"]
    if backend == "reference":
        return False, False
    if not gpu_available():
        if backend == "cuda":
            raise RuntimeError("backend 'cuda' requested but no usable CUDA device/CuPy")
        return False, False
    on_device = _is_device_pointer(q.ptr)
    if k.type not in STORAGE_DTYPES or v.type not in STORAGE_DTYPES:  # quantized K/V: CPU only
        if on_device:
            raise ValueError(f"quantized K/V ({k.shape_str}, {v.shape_str}) are supported on the "
                             "CPU path only; keep them on the host or use f16/bf16")
        if backend == "cuda":
            raise ValueError("backend 'cuda' cannot run quantized K/V; use 'auto' or 'reference'")
        return False, False
    return True, on_device


class _SingleThreadedBlas:
    """BLAS limited to one thread while any graph thread runs the numpy path.

    ggml's graph threads are OpenMP threads; OpenBLAS (pthreads build) called from inside an
    OpenMP region warns "Detect OpenMP Loop and this application may hang". Each graph thread
    already takes its own share of the work, so BLAS needs no threads of its own. The limit
    is process-wide, so it is reference-counted across the threads that hold it.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._users = 0
        self._limiter = None
        self._controller = None

    def __enter__(self):
        with self._lock:
            if self._users == 0:
                if self._controller is None:
                    from threadpoolctl import ThreadpoolController
                    self._controller = ThreadpoolController()
                self._limiter = self._controller.limit(limits=1, user_api="blas")
            self._users += 1

    def __exit__(self, *exc):
        with self._lock:
            self._users -= 1
            if self._users == 0:
                self._limiter.restore_original_limits()
                self._limiter = None


_single_threaded_blas = _SingleThreadedBlas()


def _fill_nan(dst_p) -> None:
    try:
        d = from_ggml(dst_p, "dst")
        if d.ptr and not _is_device_pointer_safe(d.ptr):
            as_numpy(d)[...] = np.nan
        elif d.ptr:
            import cupy
            n = d.nbytes_span() // 4
            mem = cupy.cuda.UnownedMemory(d.ptr, n * 4, None)
            cupy.ndarray((n,), cupy.float32, cupy.cuda.MemoryPointer(mem, 0)).fill(np.nan)
    except Exception:  # noqa: BLE001 - best effort, the original error is what matters
        log.exception("flash_attn_ext: could not poison the output after an error")


def _is_device_pointer_safe(ptr: int) -> bool:
    try:
        return _is_device_pointer(ptr)
    except Exception:  # noqa: BLE001
        return False


def _callback(dst_p, ith, nth, userdata):
    try:
        p = _params_by_id[int(userdata or 0)]
        q, k, v, mask, sinks, dst = _descs(dst_p, p)
        dims = check_flash_attn_args(q, k, v, mask, sinks, p.max_bias, p.scale, p.logit_softcap)
        use_cuda, on_device = _use_cuda(q, k, v)
        if use_cuda:
            if ith != 0:
                return
            from . import cuda_backend
            if on_device:
                plan = _active_plans.get(mask.ptr) if mask is not None else None
                if plan is not None and not plan.matches(mask, dims.n_batch):
                    plan = None
                cuda_backend.flash_attn_ext_device(q, k, v, mask, sinks, dst, p.scale, p.max_bias,
                                                   p.logit_softcap, kernel=_settings["kernel"], plan=plan)
            else:
                cuda_backend.flash_attn_ext_host(q, k, v, mask, sinks, dst, p.scale, p.max_bias,
                                                 p.logit_softcap, kernel=_settings["kernel"])
        else:
            with _single_threaded_blas:
                cpu.flash_attn_ext_host(q, k, v, mask, sinks, dst, dims, p.scale, p.max_bias,
                                        p.logit_softcap, ith, nth)
    except BaseException as exc:  # noqa: BLE001 - ggml would swallow it; record and re-raise later
        log.error("flash_attn_ext failed in graph thread %d: %r", ith, exc, exc_info=True)
        _record(exc)
        _fill_nan(dst_p)


# One callback object for the whole process: it can never be garbage-collected while a graph
# that uses it is alive (REFERENCE §6: dropping it segfaults).
_CALLBACK = ggml.ggml_custom_op_t(_callback)
_N_TASKS_ANY = -1  # GGML_N_TASKS_MAX: as many threads as the graph has


def flash_attn_ext(ctx, q, k, v, mask, scale: float, max_bias: float = 0.0,
                   logit_softcap: float = 0.0, sinks=None):
    """Drop-in for ``ggml.ggml_flash_attn_ext`` (+ ``ggml_flash_attn_ext_add_sinks``).

    Arguments are ggml-python tensors (``ggml_tensor_p``), ggml order:
    q F32 ``[D_k, n_batch, n_head, ne3]``, k/v F32/F16/BF16 (or a quantized type ggml can
    dequantize, CPU path only) ``[D, n_kv, n_head_kv, ne3]``,
    mask F16 ``[n_kv, >=n_batch, ne32, ne33]`` or None, sinks F32 ``[n_head]`` or None.
    Returns the F32 result tensor ``[D_v, n_head, n_batch, ne3]``. Bad inputs raise
    ``ValueError`` here, at graph-build time.
    """
    descs = [from_ggml(t, n) for t, n in ((q, "q"), (k, "k"), (v, "v"))]
    mask_d = from_ggml(mask, "mask") if mask is not None else None
    sinks_d = from_ggml(sinks, "sinks") if sinks is not None else None
    dims = check_flash_attn_args(*descs, mask_d, sinks_d, float(max_bias), float(scale), float(logit_softcap))
    params = _OpParams(float(scale), float(max_bias), float(logit_softcap), mask is not None, sinks is not None)
    srcs = [q, k, v] + ([mask] if mask is not None else []) + ([sinks] if sinks is not None else [])
    args = (ctypes.POINTER(ggml.ggml_tensor) * len(srcs))(*srcs)
    return ggml.ggml_custom_4d(ctx, GGML_TYPE_F32, *dims.out_ne, args, len(srcs),
                               _CALLBACK, _N_TASKS_ANY, ctypes.c_void_p(_params_id(params)))
