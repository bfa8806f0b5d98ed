"""The runtime of the project's ggml custom ops (the attention op, the KV store, the dense ops):
errors recorded per op node and raised after compute, Ctrl-C during a compute, the thread count
rule, ``compute_graph`` and the plan-and-compute every graph here goes through, BLAS held to one
thread while graph threads run numpy.

ggml ignores what a custom-op callback raises. Here every error is caught in the callback and
recorded **for that op node** together with the thread that computes the graph (ggml's graph
thread 0 is the thread that called compute). :func:`compute_graph` raises the errors of the
graph it computed, and only those; :func:`raise_pending` does so for a graph computed some other
way (given the graph, or without it: the errors of the graphs this thread computed). An error
never travels to another graph or thread.

Ctrl-C: from the moment it is seen (by :class:`computing`, which holds the SIGINT and SIGTERM
handlers during a compute on the main thread, or as a ``KeyboardInterrupt`` inside an op callback)
every remaining op node of that thread's compute returns at once, and ``KeyboardInterrupt`` is
raised when the compute returns: never inside a callback, where ctypes would drop it.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import itertools
import signal
import threading

import ggml
import numpy as np

try:   # the C functions under the signal module: no enum conversions (~3 us a call less)
    from _signal import getsignal as _getsignal, signal as _setsignal
except ImportError:  # pragma: no cover - other Pythons
    _getsignal, _setsignal = signal.getsignal, signal.signal


class FlashAttnError(RuntimeError):
    """An error raised inside the op's callback during ggml compute."""


# Errors recorded by op callbacks, per op node (the node tensor's address), and the thread that
# computes each node (its graph thread 0 is the thread that called ggml's compute).
_errors_lock = threading.Lock()
_node_errors: dict[int, list[tuple[str, BaseException]]] = {}
_node_owner: dict[int, int] = {}
_MAX_OWNERS = 1 << 16  # node -> thread entries kept for plain computes before they are pruned
# threads whose current compute was interrupted (Ctrl-C): their op nodes return at once until
# the interrupt is raised to them
_interrupted: set[int] = set()


# signals whose Python-level handlers :class:`computing` holds during a compute on the main thread
_HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def _signals_blocked():
    """SIGINT and SIGTERM blocked for this thread while the block runs (where the platform can):
    no Python-level handler runs between the handler swaps of :class:`computing`; a signal that
    came meanwhile is delivered when the block ends."""
    try:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD_SIGNALS)
    except (AttributeError, OSError, ValueError):   # no pthread_sigmask here
        old = None
    try:
        yield
    finally:
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


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

    On the main thread, while a Python-level handler is installed for SIGINT or SIGTERM
    (Python's default ``KeyboardInterrupt`` one, or a program's, such as the CLIs' flag), the
    compute holds it: a signal during the compute runs that handler, but what the handler raises
    is kept, the compute is marked interrupted (the remaining op nodes return at once, the one
    running stops at its next check) and the exception is raised when the compute returns. The
    handler runs between any two bytecodes, inside an op callback too, and an exception there
    cannot pass through ggml's C code: ctypes prints "Exception ignored on calling ctypes
    callback" and drops it, or the callback records it as an op error -- a second Ctrl-C (the
    CLIs' flag handler raises then) did that. Handlers that are not Python's (``SIG_DFL``,
    ``SIG_IGN``) are left alone."""

    def __init__(self, graph):
        _check_ptr(graph, "graph", ggml.ggml_cgraph, "ggml graph (ggml_cgraph pointer)")
        self.graph = graph
        self._held: dict = {}    # signal -> the Python handler the compute replaced
        self._deferred = None    # what a held handler raised during the compute

    def _on_signal(self, signum, frame):
        """The held handler, run so that nothing leaves: it may run inside an op callback."""
        try:
            handler = self._held.get(signum)
            if handler is not None:
                handler(signum, frame)
        except BaseException as e:  # noqa: BLE001 - raised when the compute returns
            if self._deferred is None:
                self._deferred = e.with_traceback(None)   # (its frames hold the callback's arrays)
            _interrupted.add(threading.get_ident())  # no lock: this runs between any two bytecodes

    def _hold_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        with _signals_blocked():   # all held or none: no handler runs between the swaps
            try:
                for sig in _HELD_SIGNALS:
                    handler = _getsignal(sig)
                    if callable(handler):
                        self._held[sig] = handler
                        _setsignal(sig, self._on_signal)
            except (ValueError, TypeError, OSError):  # not the main interpreter, no signals here
                self._give_back_signals()

    def _give_back_signals(self) -> None:
        if self._held:   # each handler back first, then forgotten: a signal meanwhile still reaches it
            with _signals_blocked():   # (one that comes now runs the program's handler after the swaps)
                for sig, handler in self._held.items():
                    _setsignal(sig, handler)
                self._held = {}

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
        self._deferred = None
        self._hold_signals()
        return self

    def __exit__(self, exc_type, exc, tb):
        deferred, self._deferred = self._deferred, None
        try:
            try:
                self._give_back_signals()
            except BaseException:   # a signal pending as the handlers came back: the program's handler raised
                with _errors_lock:   # (it wins, as an exception raised outside a callback does)
                    _interrupted.discard(threading.get_ident())
                    for n in self.nodes:
                        _node_errors.pop(n, None)
                raise
            if deferred is not None and (exc_type is None or not issubclass(exc_type, KeyboardInterrupt)):
                with _errors_lock:   # a signal's exception (Ctrl-C) outranks the op errors of the compute
                    _interrupted.discard(threading.get_ident())
                    for n in self.nodes:
                        _node_errors.pop(n, None)
                raise deferred
            if exc_type is None:
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
    """Compute ``graph`` (:func:`plan_and_compute`) and raise what the op's callbacks recorded for
    this graph: ``FlashAttnError`` (or ``KeyboardInterrupt`` after a Ctrl-C). ``ctx`` is the graph's
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
