"""``flash_attn_ext``: a drop-in for ``ggml_flash_attn_ext`` as a ggml custom op.

The op is a ``ggml_custom_4d`` node with sources ``[q, k, v, (mask), (sinks)]`` and the same
result as ggml's: F32 ``[head_dim_v, n_head, n_batch, ne3]`` (ggml order), i.e. permuted (0,2,1,3)
relative to q. When the node runs it picks the backend per call:

* device pointers (device-resident graphs: every tensor in GPU memory) -> CUDA kernels,
  launched by graph thread 0 with raw pointers;
* host pointers and a usable GPU -> the same kernels, staged through pinned buffers;
* otherwise -> numpy in float32 (:mod:`ggml_attn.cpu`: skips fully masked tiles), work
  split over the graph's threads.

Every error is caught in the callback, logged, the output filled with NaN (never left silently
unwritten), and recorded for that op node (:mod:`ggml_attn.runtime`: raised by
``compute_graph`` / ``raise_pending``; Ctrl-C stops the remaining op nodes of the compute).
"""
from __future__ import annotations

import collections
import ctypes
import itertools
import logging
import operator
import sys
import threading
import weakref
from dataclasses import dataclass

import ggml
import numpy as np

from . import cpu
from .dtypes import GGML_TYPE_F32
from .q8_out import check_arrays
from .runtime import (_check_ctx, _check_ptr, _interrupted, _node_addr, _single_threaded_blas, c_callback,
                      interrupted, record_error, register_node)
from .tensor import as_numpy, from_ggml
from .validate import check_flash_attn_args

log = logging.getLogger("ggml_attn")

#: backend names accepted by :func:`set_backend`
BACKENDS = ("auto", "reference", "cuda")


@dataclass(frozen=True)
class _OpParams:
    scale: float
    max_bias: float
    logit_softcap: float
    has_mask: bool
    has_sinks: bool


@dataclass(eq=False)
class _Spec:
    """What an op node carries from graph-build time (its ``userdata`` is the spec's id).

    Every node gets the fast path: its last bound CUDA call (``cuda_backend.BoundCall``),
    replayed while the data pointers, the stream and the settings stay the same.

    * A node built with ``plan=`` gets a spec of its own that holds the plan weakly (the caller
      owns the plan, as with FlashInfer's ``plan()``/``run()``); such specs are pruned once
      their plan is gone.
    * A node built without a plan gets an id of its own (:func:`_spec_id`: the shared spec of
      its parameters in the low 32 bits, a serial above) but no spec until its first call on
      device pointers binds one (:func:`_node_spec`): CPU-path nodes cost nothing. Its bound
      call builds its own tile map from the mask and rebuilds it on every replay
      (``Plan.refresher``): the mask's contents may change between computes. At most
      ``_MAX_NODE_SPECS`` such specs holding at most ``_MAX_NODE_BYTES`` of tile maps are kept
      (nothing says when a graph is freed): the oldest are dropped first, and a dropped node
      binds again on its next call."""
    params: _OpParams
    plan_ref: object = None      # weakref.ref to the build-time plan, or None
    bound: object = None         # the fast path's record of the node's last bound call, see _bind_and_launch
    call: object = None          # that call (cuda_backend.BoundCall), for inspection
    per_node: bool = False       # the spec of one node (keeps its bound call), not a shared one
    nbytes: int = 0              # device bytes its bound call holds of its own (a plan-less call's tile map)
    sid: int = 0                 # a plan-less node's id (its key in the registry)
    q8: object = None            # q8_out.Q8Out: the output's 8-bit form as well (flash_attn_ext's q8_out)


_specs: dict[int, _Spec] = {}
_shared_spec_ids: dict[_OpParams, int] = {}
_next_spec_id = itertools.count(1)
_next_node_serial = itertools.count(1)
_NODE_SHIFT = 32                  # a plan-less node's id: shared spec id | serial << _NODE_SHIFT
_node_spec_ids: collections.deque = collections.deque()   # plan-less nodes' specs, oldest first
_MAX_NODE_SPECS = 1 << 14
_MAX_NODE_BYTES = 256 << 20       # device bytes those specs' bound calls may hold (their tile maps)
_node_bytes = [0]
_registry_lock = threading.Lock()
_prune_at = [1024]   # per-node specs are pruned (dead plans) when the registry reaches this size

_settings = {"backend": "auto", "kernel": "auto"}
_settings_gen = [0]   # bumped by set_backend: bound calls of older settings are not replayed


def set_backend(backend: str = "auto", kernel: str = "auto") -> None:
    """Choose where the op runs: ``auto`` (CUDA when usable, else numpy), ``reference``
    (numpy always) or ``cuda`` (a usable GPU is checked here: ``RuntimeError`` when there is
    none); ``kernel`` is passed to the CUDA backend: ``auto`` (``dispatch.best_kernel`` picks),
    or one forced: ``prefill`` (tensor cores, mma.sync), ``prefill-wgmma`` (Hopper's wgmma and
    TMA: compute capability 9.0, D 128), ``decode`` (CUDA cores, split KV), ``decode-tc``
    (tensor-core GQA decode), ``decode-tma`` (Hopper's TMA decode: compute capability 9.0),
    ``cells`` (cell lists), ``reference`` (numpy on host copies) -- :data:`dispatch.KERNELS`. A
    forced kernel that cannot run a call is a ``ValueError`` at graph-build time naming why.
    Invalid names raise ``ValueError``; on any error the settings stay as they were."""
    from .dispatch import KERNELS  # noqa: PLC0415
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(kernel, str) or kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if backend == "cuda" and not gpu_available():
        raise RuntimeError(f"set_backend(backend='cuda'): no usable CUDA device/CuPy here ({_why_no_gpu()}); "
                           "use 'auto' or 'reference'")
    _settings["backend"] = backend
    _settings["kernel"] = kernel
    _settings_gen[0] += 1


def settings() -> tuple[str, str]:
    """The op's current (backend, kernel) settings (:func:`set_backend`)."""
    return _settings["backend"], _settings["kernel"]


def _why_no_gpu() -> str:
    try:
        from . import cuda_backend  # noqa: F401, PLC0415
    except ImportError as e:
        return f"the CUDA backend does not import: {e}"
    return "no CUDA device visible to CuPy"


def _spec_id(params: _OpParams, plan, q8=None) -> int:
    """Register the build-time state of a new op node; returns its ``userdata`` id. ``q8`` (with
    a plan only): the node's :class:`q8_out.Q8Out`."""
    with _registry_lock:
        if plan is None:   # the shared spec of these parameters, and a serial of this node
            sid = _shared_spec_ids.get(params)
            if sid is None:
                sid = _shared_spec_ids[params] = next(_next_spec_id)
                _specs[sid] = _Spec(params)
            return sid | (next(_next_node_serial) << _NODE_SHIFT)
        if len(_specs) >= _prune_at[0]:   # drop the specs of plans that are gone
            for i in [i for i, sp in _specs.items() if sp.plan_ref is not None and sp.plan_ref() is None]:
                del _specs[i]
            _prune_at[0] = max(1024, 2 * len(_specs))
        sid = next(_next_spec_id)
        _specs[sid] = _Spec(params, weakref.ref(plan), per_node=True, q8=q8)
        return sid


def _lookup_spec(userdata: int) -> _Spec | None:
    """The spec of a node's ``userdata``: its own, or (a plan-less node not bound yet, or whose
    spec was dropped) the shared spec of its parameters."""
    spec = _specs.get(userdata)
    if spec is None and userdata >> _NODE_SHIFT:
        spec = _specs.get(userdata & ((1 << _NODE_SHIFT) - 1))
    return spec


_OP_PARAMS_OFF = ggml.ggml_tensor.op_params.offset
_USERDATA_OFF = 16   # struct ggml_custom_op_params {fun; int n_tasks; void *userdata} in op_params


def userdata_of(node) -> int:
    """The ``userdata`` id of op node ``node`` (a ``ggml_tensor_p`` that :func:`flash_attn_ext`
    returned), read from its op params."""
    return ctypes.c_uint64.from_address(_node_addr(node) + _OP_PARAMS_OFF + _USERDATA_OFF).value


def spec_of(node) -> _Spec | None:
    """What op node ``node`` carries (:class:`_Spec`): its own spec once it has one."""
    return _lookup_spec(userdata_of(node))


def _node_spec(userdata: int, shared: _Spec) -> _Spec:
    """The own spec of plan-less node ``userdata``, made on its first bind (at most
    ``_MAX_NODE_SPECS`` kept, oldest dropped first)."""
    with _registry_lock:
        spec = _specs.get(userdata)
        if spec is None:
            spec = _specs[userdata] = _Spec(shared.params, per_node=True, sid=userdata)
            _node_spec_ids.append(userdata)
            _drop_oldest_node_specs()
        return spec


def _charge_node_spec(spec: _Spec, nbytes: int) -> None:
    """A plan-less node's bound call now holds ``nbytes`` of its own: drop the oldest other
    plan-less specs while all of them hold more than ``_MAX_NODE_BYTES``."""
    with _registry_lock:
        if _specs.get(spec.sid) is not spec:   # dropped meanwhile: it holds nothing here
            return
        _node_bytes[0] += nbytes - spec.nbytes
        spec.nbytes = nbytes
        _drop_oldest_node_specs(keep=spec)


def _drop_oldest_node_specs(keep: _Spec | None = None) -> None:
    """(registry lock held) Drop plan-less specs, oldest first, past the count or byte limit."""
    while _node_spec_ids and (len(_node_spec_ids) > _MAX_NODE_SPECS or _node_bytes[0] > _MAX_NODE_BYTES):
        sid = _node_spec_ids[0]
        old = _specs.get(sid)
        if old is not None and old is keep:
            break
        _node_spec_ids.popleft()
        if old is not None:
            del _specs[sid]
            _node_bytes[0] -= old.nbytes


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


def _maybe_device_pointer(ptr: int) -> bool:
    """:func:`_is_device_pointer` where no usable GPU backend is known (backend 'reference', or
    ``gpu_available()`` False): False without CuPy loaded (no CuPy array can exist then, and
    CuPy is not imported to ask) or when CUDA cannot answer."""
    if sys.modules.get("cupy") is None:
        return False
    return _is_device_pointer_safe(ptr)


def _choose(dims, gpu: bool, on_device: bool):
    """``dispatch.best_kernel`` for a call the GPU backend does not take whole: host data
    (the CPU path, or staged to a GPU kernel), or device data without a usable GPU (refused,
    named). Device data on the GPU backend is the backend's to decide (``cuda_plan.decide``)."""
    from .dispatch import best_kernel, call_facts  # noqa: PLC0415
    # the device's architecture: a forced sm_90a kernel (prefill-wgmma, decode-tma) can run only there
    f = call_facts(dims, arch=_device_arch() if gpu else "")
    return best_kernel(_settings["kernel"], f, backend=_settings["backend"], gpu=gpu, on_device=on_device)


_ARCHS: dict[int, str] = {}


def _device_arch() -> str:
    """``sm_XY`` of the current CUDA device, asked once per device ("" when CUDA cannot say)."""
    try:
        import cupy  # noqa: PLC0415
        dev = cupy.cuda.runtime.getDevice()
        arch = _ARCHS.get(dev)
        if arch is None:
            from . import kernels  # noqa: PLC0415
            arch = _ARCHS[dev] = kernels.device_arch()
        return arch
    except Exception:  # noqa: BLE001 - no device to ask: the kernels that need one are refused, named
        return ""


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


_current_stream = None   # () -> CuPy's current stream (cupy.cuda.get_current_stream, set when
#                          the first call is bound)
_value = operator.attrgetter("value")
_DATA_OFF = ggml.ggml_tensor.data.offset
_SRC_OFF = ggml.ggml_tensor.src.offset


def _data_cells(node: int, n_src: int) -> list:
    """Live views of the ``data`` fields of an op node's sources and result: reading
    ``.value`` reads the pointer as it is now (a node's sources never change after build)."""
    srcs = (ctypes.c_void_p * n_src).from_address(node + _SRC_OFF)
    return [ctypes.c_void_p.from_address(a + _DATA_OFF) for a in srcs] + \
        [ctypes.c_void_p.from_address(node + _DATA_OFF)]


def _tensor_p(addr: int):
    return ctypes.cast(addr, _TENSOR_P)


_TENSOR_P = ctypes.POINTER(ggml.ggml_tensor)


def _callback(dst, ith, nth, userdata):
    """The node's callback; ``dst`` is the node tensor's address (int), ``userdata`` its spec id."""
    spec = _specs.get(userdata)
    if spec is not None:
        fast = spec.bound
        if fast is not None and not _interrupted:
            # fast path: this node's bound call, while its data pointers, the stream and the
            # settings are the ones it was bound with -> launch (no validation, no planning)
            if ith:
                return
            cells, ptrs, launch, stream, gen = fast
            if (gen == _settings_gen[0] and stream == _current_stream().ptr and list(map(_value, cells)) == ptrs
                    and (spec.plan_ref is None or spec.plan_ref() is not None)):   # a plan's buffers
                # are what the call reads; a plan-less call rebuilds its own tile map first
                try:
                    launch()
                except BaseException as exc:  # noqa: BLE001 - recorded like any callback error
                    _failed(_tensor_p(dst), ith, exc)
                return
    else:
        spec = _lookup_spec(userdata)
    _callback_slow(_tensor_p(dst), ith, nth, spec, userdata)


def _failed(dst_p, ith: int, exc: BaseException) -> None:
    if isinstance(exc, KeyboardInterrupt):
        log.warning("flash_attn_ext: interrupted (Ctrl-C) in graph thread %d; the remaining op nodes "
                    "of this compute return at once", ith)
    else:
        log.error("flash_attn_ext failed in graph thread %d: %r", ith, exc, exc_info=True)
    record_error(_node_addr(dst_p), exc)
    _fill_nan(dst_p)


def _callback_slow(dst_p, ith, nth, spec, userdata: int):
    d = dst_p.contents
    node = ctypes.addressof(d)
    register_node(node, ith)
    if interrupted(node):  # Ctrl-C earlier in this compute: the remaining op nodes return at once
        if ith == 0:
            _fill_nan(dst_p)
        return
    try:
        if spec is None:
            raise RuntimeError("this op node's build-time state is gone: the plan passed to "
                               "flash_attn_ext(plan=...) was freed while its graph lived")
        p = spec.params
        plan = None
        if spec.plan_ref is not None:
            plan = spec.plan_ref()
            if plan is None:
                raise RuntimeError("the plan passed to flash_attn_ext(plan=...) at graph-build time "
                                   "was freed; keep it alive while the graph is computed")
        q, k, v, mask, sinks, dst = _descs(dst_p, p)
        dims = check_flash_attn_args(q, k, v, mask, sinks, p.max_bias, p.scale, p.logit_softcap)
        backend = _settings["backend"]
        gpu = backend != "reference" and gpu_available()
        # where the data is is asked whatever the settings: the numpy path reads host pointers,
        # and device memory handed to it is a segfault (a device graph computed with backend
        # 'reference', or while gpu_available() says no)
        on_device = _is_device_pointer(q.ptr) if gpu else _maybe_device_pointer(q.ptr)
        choice = None if on_device and (gpu or backend == "reference") else _choose(dims, gpu, on_device)
        if spec.q8 is not None and choice is not None:
            raise RuntimeError("flash_attn_ext(q8_out=...) runs on device graphs only (its arrays are "
                               "device memory); this call's tensors are on the host")
        if choice is None:   # device data: the GPU backend decides (the plan's decision, or its own)
            if ith != 0:
                return
            if not spec.per_node:   # a plan-less node: its own spec keeps its bound call
                spec = _node_spec(userdata, spec)
            # backend 'reference': the reference on host copies, whatever the kernel setting
            _bind_and_launch(spec, node, plan, q, k, v, mask, sinks, dst,
                             kernel="reference" if backend == "reference" else _settings["kernel"])
        elif choice.kernel != "cpu":   # host data for the GPU: staged through pinned buffers, where
            if ith != 0:               # the backend decides on the staged call's full facts (mask, plan)
                return
            from . import cuda_backend  # noqa: PLC0415
            cuda_backend.run_host_on_gpu(q, k, v, mask, sinks, dst, p.scale, p.max_bias, p.logit_softcap,
                                         kernel=_settings["kernel"])
        else:
            with _single_threaded_blas:
                cpu.flash_attn_ext_host(q, k, v, mask, sinks, dst, dims, p.scale, p.max_bias,
                                        p.logit_softcap, ith, nth, stop=lambda: interrupted(node))
    except BaseException as exc:  # noqa: BLE001 - ggml would swallow it; record and re-raise later
        _failed(dst_p, ith, exc)


def _bind_and_launch(spec: _Spec, node: int, plan, q, k, v, mask, sinks, dst, *, kernel: str) -> None:
    """Device pointers: bind the call (``cuda_backend.bind``) and launch it. A node with its
    own spec keeps the bound call for the fast path. A plan given at build time that does not
    fit the call's mask is an error; without one the backend builds a tile map per call."""
    global _current_stream
    from . import cuda_backend  # noqa: PLC0415
    if _current_stream is None:
        import cupy  # noqa: PLC0415
        _current_stream = cupy.cuda.get_current_stream
    p = spec.params
    if plan is not None and not plan.matches(mask, q.ne[1]):
        raise ValueError(f"the plan given to flash_attn_ext at graph-build time was made for another "
                         f"mask or n_batch (plan: {plan.mask.shape_str} at {plan.mask.ptr:#x}, "
                         f"n_batch={plan.n_batch}; call: {mask.shape_str if mask else None} at "
                         f"{mask.ptr if mask else 0:#x}, n_batch={q.ne[1]})")
    b = cuda_backend.bind(q, k, v, mask, sinks, dst, p.scale, p.max_bias, p.logit_softcap,
                          kernel=kernel, plan=plan, stream=_current_stream().ptr, q8=spec.q8)
    if spec.per_node:   # keep it (None while it cannot be replayed)
        spec.bound = fast_record(node, 3 + p.has_mask + p.has_sinks, b.launcher(), b.stream) \
            if b.replayable else None
        spec.call = b if b.replayable else None
        if plan is None:   # a plan-less node's spec: its tile map counts against the limit
            _charge_node_spec(spec, b.own_plan.nbytes if spec.call is not None and b.own_plan is not None else 0)
    b.launch()


def fast_record(node: int, n_src: int, launch, stream: int) -> tuple:
    """What the callback's fast path checks and runs for op node ``node`` (address) with
    ``n_src`` sources: live views of the data pointers, their values now, ``launch()`` (no
    arguments), the stream it launches on and the settings generation."""
    cells = _data_cells(node, n_src)
    return (cells, list(map(_value, cells)), launch, stream, _settings_gen[0])


_CALLBACK = c_callback(_callback)   # one for the whole process
_N_TASKS_ANY = -1  # GGML_N_TASKS_MAX: as many threads as the graph has


def flash_attn_ext(ctx, q, k, v, mask, scale: float, max_bias: float = 0.0,
                   logit_softcap: float = 0.0, sinks=None, *, plan=None, q8_out=None):
    """Drop-in for ``ggml.ggml_flash_attn_ext`` (+ ``ggml_flash_attn_ext_add_sinks``).

    ``plan``: optional ``cuda_backend.Plan`` of this mask (``cuda_backend.make_plan``, once per
    ubatch, shared by every layer's op). The node holds it weakly -- keep it alive while the
    graph is computed -- and, on device pointers, keeps its bound launch: a repeated compute
    with the same data pointers and stream relaunches it without re-validating or re-planning.
    Without a plan each device call builds its own tile map.

    ``q8_out``: ``(xq, xd, xs)`` device arrays (with ``plan=``, on device graphs): the result in
    the 8-bit form the 8-bit GEMVs read as well (ggml_attn/q8_out.py: layouts, and where the
    kernel makes it) -- the O projection's activations without a quantization of their own.

    Arguments are ggml-python tensors (``ggml_tensor_p``), ggml order:
    q F32 ``[head_dim_k, n_batch, n_head, ne3]``, k/v F32/F16/BF16 (or a quantized type ggml can
    dequantize, CPU path only) ``[D, n_kv, n_head_kv, ne3]``,
    mask F16 ``[n_kv, >=n_batch, ne32, ne33]`` or None, sinks F32 ``[n_head]`` or None.
    Returns the F32 result tensor ``[head_dim_v, n_head, n_batch, ne3]``. Bad inputs raise
    ``ValueError`` here, at graph-build time, naming the argument (a missing/NULL tensor or
    context, a non-number scale, shapes and types).
    """
    _check_ctx(ctx, "flash_attn_ext")
    for t, n in ((q, "q"), (k, "k"), (v, "v"), (mask, "mask"), (sinks, "sinks")):
        if t is None and n in ("mask", "sinks"):
            continue
        try:
            _check_ptr(t, n, ggml.ggml_tensor, "ggml tensor (ggml_tensor_p)")
        except ValueError as e:
            raise ValueError(f"flash_attn_ext: {e}") from None
    nums = {}
    for name, val in (("scale", scale), ("max_bias", max_bias), ("logit_softcap", logit_softcap)):
        if isinstance(val, bool) or not isinstance(val, (int, float, np.integer, np.floating)):
            raise ValueError(f"flash_attn_ext: {name} must be a number, got {val!r}")
        try:
            nums[name] = float(val)
        except OverflowError:   # an int past the float range (10**400)
            raise ValueError(f"flash_attn_ext: {name} must be a finite float, got {val!r:.40} "
                             f"(too large for a float)") from None
    scale, max_bias, logit_softcap = nums["scale"], nums["max_bias"], nums["logit_softcap"]
    descs = [from_ggml(t, n) for t, n in ((q, "q"), (k, "k"), (v, "v"))]
    mask_d = from_ggml(mask, "mask") if mask is not None else None
    sinks_d = from_ggml(sinks, "sinks") if sinks is not None else None
    dims = check_flash_attn_args(*descs, mask_d, sinks_d, max_bias, scale, logit_softcap)
    params = _OpParams(scale, max_bias, logit_softcap, mask is not None, sinks is not None)
    if plan is not None:
        if mask is None:
            raise ValueError("flash_attn_ext: plan= needs a mask (a plan is the tile map of a mask)")
        if not hasattr(plan, "matches") or (mask_d.ptr and not plan.matches(mask_d, dims.n_batch)):
            raise ValueError(f"flash_attn_ext: plan {plan!r:.80} was not made for this mask "
                             f"{mask_d.shape_str} with n_batch={dims.n_batch} (cuda_backend.make_plan)")
    q8 = None
    if q8_out is not None:
        if plan is None:
            raise ValueError("flash_attn_ext: q8_out= needs plan= (a node that writes an 8-bit form "
                             "keeps its own bound call, as a planned node does)")
        try:
            q8 = check_arrays(q8_out, dims.n_batch * dims.ne3, dims.head_dim_v * dims.n_head)
        except ValueError as e:
            raise ValueError(f"flash_attn_ext: {e}") from None
    srcs = [q, k, v] + ([mask] if mask is not None else []) + ([sinks] if sinks is not None else [])
    args = (ctypes.POINTER(ggml.ggml_tensor) * len(srcs))(*srcs)
    return ggml.ggml_custom_4d(ctx, GGML_TYPE_F32, *dims.out_ne, args, len(srcs),
                               _CALLBACK, _N_TASKS_ANY, ctypes.c_void_p(_spec_id(params, plan, q8)))
