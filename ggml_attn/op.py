"""``flash_attn_ext``: a drop-in for ``ggml_flash_attn_ext`` as a ggml custom op.

The op is a ``ggml_custom_4d`` node with sources ``[q, k, v, (mask), (sinks)]`` and the same
result as ggml's: F32 ``[D_v, n_head, n_batch, ne3]`` (ggml order), i.e. permuted (0,2,1,3)
relative to q. When the node runs it picks the backend per call:

* device pointers (device-resident graphs: every tensor in GPU memory) -> CUDA kernels,
  launched by graph thread 0 with raw pointers;
* host pointers and a usable GPU -> the same kernels, staged through pinned buffers;
* otherwise -> numpy in float32 (:mod:`ggml_attn.cpu`: skips fully masked tiles), work
  split over the graph's threads.

ggml ignores what a custom-op callback raises. Here every error is caught in the callback,
logged, the output filled with NaN (never left silently unwritten), and recorded **for that
op node** together with the thread that computes the graph (ggml's graph thread 0 is the
thread that called compute). :func:`compute_graph` raises the errors of the graph it computed,
and only those; :func:`raise_pending` does so for a graph computed some other way (given the
graph, or without it: the errors of the graphs this thread computed). An error never travels
to another graph or thread.

Ctrl-C: from the moment it is seen (by :class:`computing`'s SIGINT handler, or as a
``KeyboardInterrupt`` inside an op callback on the main thread) every remaining op node of that
thread's compute returns at once (output NaN), and ``KeyboardInterrupt`` is raised when the
compute returns.
"""
from __future__ import annotations

import collections
import ctypes
import itertools
import logging
import operator
import signal
import sys
import threading
import weakref
from dataclasses import dataclass

import ggml
import numpy as np

from . import cpu
from .dtypes import GGML_TYPE_F32
from .tensor import TensorDesc, as_numpy, from_ggml
from .validate import check_flash_attn_args

try:   # the C functions under the signal module: no enum conversions (~3 us a call less)
    from _signal import getsignal as _getsignal, signal as _setsignal
except ImportError:  # pragma: no cover - other Pythons
    _getsignal, _setsignal = signal.getsignal, signal.signal

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

# Errors recorded by op callbacks, per op node (the node tensor's address), and the thread that
# computes each node (its graph thread 0 is the thread that called ggml's compute).
_errors_lock = threading.Lock()
_node_errors: dict[int, list[tuple[str, BaseException]]] = {}
_node_owner: dict[int, int] = {}
_MAX_OWNERS = 1 << 16  # node -> thread entries kept for plain computes before they are pruned
# threads whose current compute was interrupted (Ctrl-C): their op nodes return at once until
# the interrupt is raised to them
_interrupted: set[int] = set()

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


def _spec_id(params: _OpParams, plan) -> int:
    """Register the build-time state of a new op node; returns its ``userdata`` id."""
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
        _specs[sid] = _Spec(params, weakref.ref(plan), per_node=True)
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


def _node_addr(tensor_p) -> int:
    return ctypes.addressof(tensor_p.contents)


def _graph_nodes(graph) -> list[int]:
    """Addresses of the graph's nodes, read as one array (two ctypes calls, not one per node)."""
    n = ggml.ggml_graph_n_nodes(graph)
    if n <= 0:
        return []
    arr = ctypes.c_void_p.from_buffer(ggml.ggml_graph_nodes(graph)).value   # the pointer's value
    return memoryview(ctypes.string_at(arr, 8 * n)).cast("Q").tolist()


def register_node(node: int, ith: int) -> int | None:
    """Called first by an op callback: graph thread 0 records itself as the node's owner (the
    thread computing the graph); returns the owner (None when not known yet)."""
    if ith == 0:
        me = threading.get_ident()
        if _node_owner.get(node) != me:
            if len(_node_owner) >= _MAX_OWNERS:  # plain computes only; compute_graph cleans up
                with _errors_lock:
                    for n in [n for n in list(_node_owner) if n not in _node_errors]:  # list(): atomic copy
                        del _node_owner[n]
            _node_owner[node] = me
        return me
    return _node_owner.get(node)


def record_error(node: int, exc: BaseException, what: str = "flash_attn_ext") -> None:
    """Record ``exc`` for op node ``node`` (its tensor's address); a ``KeyboardInterrupt``
    also stops the owner thread's remaining op nodes."""
    with _errors_lock:
        _node_errors.setdefault(node, []).append((what, exc))
        if isinstance(exc, KeyboardInterrupt):
            owner = _node_owner.get(node)
            _interrupted.add(owner if owner is not None else threading.get_ident())


def run_custom_node(node: int, ith: int, fn, what: str) -> None:
    """The body the project's other custom-op callbacks share (KV store, dense ops), for the
    node tensor at address ``node``: graph thread 0 runs ``fn()`` unless this compute was
    interrupted; an error is recorded for the node as the attention op's are (raised by
    :func:`computing` / :func:`raise_pending`)."""
    if ith != 0:
        return
    register_node(node, ith)
    if interrupted(node):
        return
    try:
        fn()
    except BaseException as e:  # noqa: BLE001  (ggml would swallow it)
        record_error(node, e, what=what)


def c_callback(fn):
    """``fn(node, ith, nth, userdata)`` as a ggml custom-op callback (``ggml_custom_op_t``)
    whose node and userdata arguments arrive as plain ints (``c_void_p``; userdata None when
    0): ctypes makes no pointer object per call. The callback object is kept for the life of
    the process: ggml holds only its raw address, and a collected one would crash the next
    compute of a graph that uses it."""
    raw = _C_CALLBACK_T(fn)
    _C_CALLBACKS.append(raw)
    return ctypes.cast(raw, ggml.ggml_custom_op_t)


_C_CALLBACK_T = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p)
_C_CALLBACKS: list = []


def interrupted(node: int) -> bool:
    """True when the compute that runs ``node`` was interrupted (Ctrl-C)."""
    owner = _node_owner.get(node)
    return owner is not None and owner in _interrupted


def _select(graph) -> list[int]:
    """Nodes with errors: those of ``graph``, or (None) those computed by this thread."""
    if graph is not None:
        _check_ptr(graph, "graph", ggml.ggml_cgraph, "ggml graph (ggml_cgraph pointer)")
        return [n for n in _graph_nodes(graph) if n in _node_errors]
    me = threading.get_ident()
    return [n for n in _node_errors if _node_owner.get(n, me) == me]


def pending_errors(graph=None) -> list[BaseException]:
    """Errors recorded by op callbacks and not raised yet: those of ``graph``'s op nodes, or
    (no graph) those of the graphs this thread computed. Not cleared."""
    with _errors_lock:
        return [e for n in _select(graph) for _, e in _node_errors[n]]


def raise_pending(graph=None) -> None:
    """Raise what op callbacks recorded and clear it: the errors of ``graph``'s op nodes, or
    (no graph) of the graphs this thread computed. ``KeyboardInterrupt`` when one of them was
    a Ctrl-C, else :class:`FlashAttnError` for the first error (``+N more``)."""
    me = threading.get_ident()
    with _errors_lock:
        errs = [pair for n in _select(graph) for pair in _node_errors.pop(n)]
        if any(isinstance(e, KeyboardInterrupt) for _, e in errs):
            _interrupted.discard(me)  # the interrupt is delivered now
    if errs:
        for _, e in errs:
            if isinstance(e, KeyboardInterrupt):  # Ctrl-C inside a callback stays a Ctrl-C
                raise e
        what, first = errs[0]
        more = f" (+{len(errs) - 1} more)" if len(errs) > 1 else ""
        raise FlashAttnError(f"{what} failed during compute: {first!r}{more}") from first


class computing:
    """``with computing(graph): <any ggml compute of graph in this thread>`` -- drops errors
    left on the graph's op nodes by an earlier compute, registers the nodes to this thread,
    and on a normal exit raises what this compute's op callbacks recorded
    (:func:`raise_pending` with the graph). A Ctrl-C left pending by an earlier compute of
    this thread is raised on entry. :func:`compute_graph` uses it; so can callers of other
    compute functions (``ggml_backend_graph_compute``, ``ggml_graph_compute``).

    On the main thread, while Python's default SIGINT handler is installed, a Ctrl-C during
    the compute does not raise inside an op callback: ctypes drops an exception raised as a
    callback is entered (before its ``try``), so the interrupt could be lost. Instead the
    first Ctrl-C marks the compute interrupted (the remaining op nodes return at once) and
    ``KeyboardInterrupt`` is raised when the compute returns; a second one raises at once. A
    handler someone else installed is left alone."""

    def __init__(self, graph):
        _check_ptr(graph, "graph", ggml.ggml_cgraph, "ggml graph (ggml_cgraph pointer)")
        self.graph = graph
        self._sigint = False
        self._old_handler = None

    def _on_sigint(self, signum, frame):
        if self._sigint:  # a second Ctrl-C: now
            raise KeyboardInterrupt
        self._sigint = True
        _interrupted.add(threading.get_ident())  # no lock: this runs between any two bytecodes

    def _take_sigint(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            if _getsignal(signal.SIGINT) is signal.default_int_handler:
                _setsignal(signal.SIGINT, self._on_sigint)
                self._old_handler = signal.default_int_handler
        except (ValueError, TypeError, OSError):  # not the main interpreter, no signals here
            self._old_handler = None

    def _give_back_sigint(self) -> None:
        if self._old_handler is not None:
            _setsignal(signal.SIGINT, self._old_handler)
            self._old_handler = None

    def __enter__(self):
        me = threading.get_ident()
        if me in _interrupted:
            with _errors_lock:
                _interrupted.discard(me)
                for n in [n for n in _node_errors if _node_owner.get(n) == me]:
                    kept = [(w, e) for w, e in _node_errors[n] if not isinstance(e, KeyboardInterrupt)]
                    if kept:
                        _node_errors[n] = kept
                    else:
                        del _node_errors[n]
            raise KeyboardInterrupt
        self.nodes = nodes = _graph_nodes(self.graph)
        with _errors_lock:
            if _node_errors:
                for n in nodes:
                    _node_errors.pop(n, None)
            _node_owner.update(dict.fromkeys(nodes, me))
        self._sigint = False
        self._take_sigint()
        return self

    def __exit__(self, exc_type, exc, tb):
        self._give_back_sigint()
        try:
            if exc_type is None:
                if self._sigint:
                    with _errors_lock:
                        _interrupted.discard(threading.get_ident())
                        for n in self.nodes:
                            _node_errors.pop(n, None)
                    raise KeyboardInterrupt
                if _node_errors:
                    raise_pending(self.graph)
            else:  # an exception already propagates (e.g. Ctrl-C outside a callback): it wins
                with _errors_lock:
                    for n in self.nodes:
                        _node_errors.pop(n, None)
                    if issubclass(exc_type, KeyboardInterrupt):
                        _interrupted.discard(threading.get_ident())
        finally:
            with _errors_lock:
                if _node_errors:
                    for n in self.nodes:
                        if n not in _node_errors:
                            _node_owner.pop(n, None)
                else:   # the common case, in one C-level loop
                    collections.deque(map(_node_owner.pop, self.nodes, itertools.repeat(None)), maxlen=0)
        return False


def _check_ptr(value, name: str, ctype, what: str):
    """ValueError naming ``name`` unless ``value`` is a non-null ctypes pointer to ``ctype``."""
    if not isinstance(value, ctypes._Pointer) or (ctype is not None and value._type_ is not ctype):
        raise ValueError(f"{name} must be a {what}, got {value!r}")
    if not value:
        raise ValueError(f"{name} is a NULL {what}")


def _check_ctx(ctx, fn: str) -> None:
    if isinstance(ctx, bool) or not isinstance(ctx, (int, ctypes.c_void_p)) or not (
            ctx.value if isinstance(ctx, ctypes.c_void_p) else ctx):
        raise ValueError(f"{fn}: ctx must be a ggml context (from ggml_init), got {ctx!r}")


# ggml's CPU backend keeps per-thread state in arrays of GGML_MAX_N_THREADS (ggml.h); more
# threads crash (100000) or abort in libgomp (32768) instead of failing cleanly
MAX_THREADS = 512


def check_n_threads(n_threads, name: str = "n_threads") -> int:
    """The one rule for a thread count (``compute_graph`` and the CLIs' ``-t``): an integer
    (bool refused) in ``1 .. MAX_THREADS``; ``ValueError`` naming ``name`` otherwise."""
    if isinstance(n_threads, bool) or not isinstance(n_threads, (int, np.integer)):
        raise ValueError(f"{name} must be an integer >= 1, got {n_threads!r}")
    n = int(n_threads)
    if n < 1:
        raise ValueError(f"{name} must be at least 1, got {n}")
    if n > MAX_THREADS:
        raise ValueError(f"{name} {n} is more threads than ggml's CPU backend can run "
                         f"(at most {MAX_THREADS}, GGML_MAX_N_THREADS)")
    return n


def compute_graph(ctx, graph, n_threads: int = 1) -> None:
    """``ggml_graph_compute_with_ctx`` that raises what the op's callbacks recorded for this
    graph: ``FlashAttnError`` (or ``KeyboardInterrupt`` after a Ctrl-C). ``ctx`` is the graph's
    ggml context, ``graph`` a ``ggml_cgraph`` pointer, ``n_threads`` 1..:data:`MAX_THREADS`
    (:func:`check_n_threads`)."""
    _check_ctx(ctx, "compute_graph")
    try:
        _check_ptr(graph, "graph", ggml.ggml_cgraph, "ggml graph (ggml_cgraph pointer)")
    except ValueError as e:
        raise ValueError(f"compute_graph: {e}") from None
    try:
        n_threads = check_n_threads(n_threads)
    except ValueError as e:
        raise ValueError(f"compute_graph: {e}") from None
    with computing(graph):
        with _single_threaded_blas:  # held by this thread for the whole compute: no toggling per node
            status = plan_and_compute(graph, n_threads)
    if status != 0:
        raise FlashAttnError(f"ggml_graph_compute returned status {status}")


def plan_and_compute(graph, n_threads: int) -> int:
    """``ggml_graph_plan`` + ``ggml_graph_compute`` with a work buffer of our own, freed on return
    (``ggml_graph_compute_with_ctx`` takes a new one from the graph's context at every call, so
    recomputing a graph used the context up and then crashed); ggml's status. ``n_threads``:
    :func:`check_n_threads`'s rule (``ValueError``), for every graph computed here."""
    n_threads = check_n_threads(n_threads)   # (a huge count segfaulted in ggml's thread pool)
    cplan = ggml.ggml_graph_plan(graph, n_threads, None)
    work = None
    if cplan.work_size:
        work = np.empty(cplan.work_size, dtype=np.uint8)
        cplan.work_data = ctypes.cast(work.ctypes.data, ctypes.POINTER(ctypes.c_uint8))
    status = ggml.ggml_graph_compute(graph, ctypes.byref(cplan))
    del work
    return status


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


def _choose(q: TensorDesc, k: TensorDesc, v: TensorDesc, dims):
    """(``dispatch.Choice``, data on the device) for this call: ``dispatch.best_kernel`` with
    the op's settings. Where the data is is asked whatever the settings: the numpy path reads
    host pointers, and device memory handed to it is a segfault (a device graph computed with
    backend 'reference', or while ``gpu_available()`` says no)."""
    from .dispatch import CallFacts, best_kernel  # noqa: PLC0415
    backend = _settings["backend"]
    gpu = backend != "reference" and gpu_available()
    on_device = _is_device_pointer(q.ptr) if gpu else _maybe_device_pointer(q.ptr)
    # the device's architecture: a forced sm_90a kernel (prefill-wgmma, decode-tma) can run only there
    f = CallFacts(dims.n_batch, dims.gqa_ratio, dims.n_kv, dims.d_k, dims.d_v, k.type,
                  arch=_device_arch() if gpu else "", v_type=v.type if v.type != k.type else None)
    return best_kernel(_settings["kernel"], f, backend=backend, gpu=gpu, on_device=on_device), on_device


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


class _SingleThreadedBlas:
    """BLAS limited to one thread while any graph thread runs the numpy path, whichever Python
    thread computes the graph.

    ggml's graph threads are OpenMP threads; OpenBLAS (pthreads build) called from inside an
    OpenMP region warns "Detect OpenMP Loop and this application may hang", and runs its own
    threads on top of ggml's. Each graph thread already takes its own share of the work, so
    BLAS needs no threads of its own. The limit is process-wide, so it is reference-counted
    across the threads that hold it.

    threadpoolctl's ``limit()`` is not used for setting it: since threadpoolctl 3.6 a
    pthreads OpenBLAS only takes limits from the first thread that set one ("controlling
    thread") and silently ignores every other thread, so a graph computed from a worker thread
    after the main thread had computed one ran BLAS threaded (about 22x slower). The library's
    own set-threads function is called instead (threadpoolctl's unguarded
    ``_real_set_num_threads`` where it exists, else ``set_num_threads``), from any thread.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._users = 0
        self._libs = None
        self._saved: list = []

    def _blas_libs(self) -> list:
        if self._libs is None:
            from threadpoolctl import ThreadpoolController  # noqa: PLC0415
            self._libs = list(ThreadpoolController().select(user_api="blas").lib_controllers)
        return self._libs

    @staticmethod
    def _set(lib, n: int) -> None:
        setter = getattr(lib, "_real_set_num_threads", None) or lib.set_num_threads
        setter(n)

    def __enter__(self):
        with self._lock:
            if self._users == 0:
                self._saved = []
                for lib in self._blas_libs():
                    n = lib.get_num_threads()
                    if n is not None:
                        self._saved.append((lib, n))
                        if n != 1:
                            self._set(lib, 1)
            self._users += 1

    def __exit__(self, *exc):
        with self._lock:
            self._users -= 1
            if self._users == 0:
                for lib, n in self._saved:
                    if n != 1:
                        self._set(lib, n)
                self._saved = []


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
        choice, on_device = _choose(q, k, v, dims)
        if choice.kernel != "cpu":
            if ith != 0:
                return
            if on_device:   # backend 'reference': the reference on host copies, whatever the kernel setting
                if not spec.per_node:   # a plan-less node: its own spec keeps its bound call
                    spec = _node_spec(userdata, spec)
                _bind_and_launch(spec, node, plan, q, k, v, mask, sinks, dst,
                                 kernel="reference" if _settings["backend"] == "reference" else _settings["kernel"])
            else:
                from . import cuda_backend  # noqa: PLC0415
                cuda_backend.flash_attn_ext_host(q, k, v, mask, sinks, dst, p.scale, p.max_bias,
                                                 p.logit_softcap, kernel=_settings["kernel"])
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
                          kernel=kernel, plan=plan, stream=_current_stream().ptr)
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
                   logit_softcap: float = 0.0, sinks=None, *, plan=None):
    """Drop-in for ``ggml.ggml_flash_attn_ext`` (+ ``ggml_flash_attn_ext_add_sinks``).

    ``plan``: optional ``cuda_backend.Plan`` of this mask (``cuda_backend.make_plan``, once per
    ubatch, shared by every layer's op). The node holds it weakly -- keep it alive while the
    graph is computed -- and, on device pointers, keeps its bound launch: a repeated compute
    with the same data pointers and stream relaunches it without re-validating or re-planning.
    Without a plan each device call builds its own tile map.

    Arguments are ggml-python tensors (``ggml_tensor_p``), ggml order:
    q F32 ``[D_k, n_batch, n_head, ne3]``, k/v F32/F16/BF16 (or a quantized type ggml can
    dequantize, CPU path only) ``[D, n_kv, n_head_kv, ne3]``,
    mask F16 ``[n_kv, >=n_batch, ne32, ne33]`` or None, sinks F32 ``[n_head]`` or None.
    Returns the F32 result tensor ``[D_v, n_head, n_batch, ne3]``. Bad inputs raise
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
    srcs = [q, k, v] + ([mask] if mask is not None else []) + ([sinks] if sinks is not None else [])
    args = (ctypes.POINTER(ggml.ggml_tensor) * len(srcs))(*srcs)
    return ggml.ggml_custom_4d(ctx, GGML_TYPE_F32, *dims.out_ne, args, len(srcs),
                               _CALLBACK, _N_TASKS_ANY, ctypes.c_void_p(_spec_id(params, plan)))
