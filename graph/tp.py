"""Head-parallel ranks in the ubatch graph: communicators, the all-reduce node, the per-rank
full block, and an engine that runs ``N`` ranks in lockstep in one process.

What each rank owns is ``shard.py``'s. A rank's graph is ``build.build_ubatch_graph`` on the
rank's cache (``shard.rank_cache``) with the rank's config (``shard.rank_config``):

* ``layer="attn"``: the plain attention layer; the rank's Q/K/V inputs are its heads' slices;
  no communication;
* ``layer="full"``: :func:`tp_full_layer` -- ``layers.full_layer`` with the rank's weight slices
  (``shard.shard_weights``) and one all-reduce node after the O projection and one after the
  FFN down projection (the row-parallel products are partial sums of the residual update).

The all-reduce node (:func:`allreduce_node`) is a custom op whose result is its source's memory:
it calls ``comm.allreduce(array)``, which must replace ``array`` in place with the sum of every
rank's array (the same result on every rank), as NCCL's ``ncclAllReduce`` with ``ncclSum`` does.

Communicators (``allreduce(arr)``, ``rank``, ``n_rank``, ``calls``, ``seconds``; and the
point-to-point ``send(arr, peer)`` / ``recv(arr, peer)`` of the layer-parallel handover,
``graph/pipe.py``: ``recv`` fills ``arr`` in place with what ``peer`` sent, messages between two
ranks arrive in the order they were sent):

* :class:`LocalGroup` / :class:`LocalComm`: ``N`` ranks of one process, each computing its graph
  on a thread of its own (:class:`LockstepEngine`); a call blocks until every rank arrived, then
  every rank writes the sum taken in rank order (bitwise the same on every rank). For tests on
  the CPU (numpy graphs, all-custom or host).
* :class:`NcclComm`: one rank per process and GPU over ``cupy.cuda.nccl``, in-place
  ``allReduce`` on the current CuPy stream; ``seconds`` is the GPU time between CUDA events
  around the calls (when ``timing`` is on and the stream is not being captured).

Engines (``graph.driver``'s interface): :class:`RankEngine`, one rank (on GPUs: one per process
with :class:`NcclComm`); :class:`LockstepEngine`, ``N`` of them on threads over a :class:`LocalGroup`.
The plan (split, cells, mask, row indices) is the same on every rank: :class:`LockstepEngine`
runs one plan through every rank's graph; separate processes plan on their own copy of the cell
metadata, which goes through the same steps and so makes the same plans.
"""
from __future__ import annotations

import queue
import threading
import time

import numpy as np

from . import build, xp_node
from .engine import UntimedEngine
from .layers import full_layer
from .shard import HeadShard, rank_config, shard_layer_weights, shard_rows

__all__ = ["LocalGroup", "LocalComm", "NcclComm", "nccl_available", "nccl_unique_id", "allreduce_node",
           "tp_full_layer", "build_rank_graph", "RankEngine", "LockstepEngine", "CommError"]


class CommError(RuntimeError):
    """A collective that cannot complete (a rank failed, a timeout)."""


# ------------------------------------------------------------------ communicators
class LocalGroup:
    """``n_rank`` in-process ranks that all-reduce by meeting at a barrier (one thread per rank)."""

    def __init__(self, n_rank: int, timeout: float = 120.0):
        if n_rank < 1:
            raise ValueError(f"n_rank must be at least 1, got {n_rank}")
        self.n_rank = n_rank
        self._barrier = threading.Barrier(n_rank, timeout=timeout)
        self.timeout = timeout
        self._bufs: list = [None] * n_rank
        self._mail: dict = {}                 # (src, dst) -> queue of sent copies, in order
        self._aborted = threading.Event()
        self.comms = [LocalComm(self, r) for r in range(n_rank)]

    def _wait(self) -> None:
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise CommError("local all-reduce: another rank failed or timed out") from None

    def abort(self) -> None:
        """Release every rank waiting in a collective or a receive (they raise :class:`CommError`)."""
        self._aborted.set()
        self._barrier.abort()

    def reset(self) -> None:
        self._barrier.reset()
        self._mail.clear()
        self._aborted.clear()

    def _box(self, src: int, dst: int) -> queue.Queue:
        return self._mail.setdefault((src, dst), queue.Queue())

    def send(self, src: int, dst: int, arr) -> None:
        """A copy of ``arr`` for ``dst`` (the sender may overwrite ``arr`` at once)."""
        self._box(src, dst).put(np.array(arr, copy=True))

    def recv(self, dst: int, src: int, arr):
        """``arr[...]`` = the next array ``src`` sent to ``dst`` (waits for it)."""
        box, t_end = self._box(src, dst), time.monotonic() + self.timeout
        while True:
            if self._aborted.is_set():
                raise CommError(f"local recv from rank {src}: another rank failed")
            try:
                got = box.get(timeout=0.05)
                break
            except queue.Empty:
                if time.monotonic() > t_end:
                    raise CommError(f"local recv from rank {src}: timed out") from None
        if got.shape != arr.shape:
            raise CommError(f"local recv from rank {src}: got shape {got.shape}, expected {arr.shape}")
        arr[...] = got
        return arr

    def allreduce(self, rank: int, arr):
        self._bufs[rank] = arr
        self._wait()                       # every rank's partial is there
        total = self._bufs[0].astype(arr.dtype, copy=True)
        for r in range(1, self.n_rank):    # rank order: the same sum, bit for bit, on every rank
            total += self._bufs[r]
        self._wait()                       # everyone has read every partial before anyone writes
        arr[...] = total
        return arr


class LocalComm:
    """Rank ``rank``'s handle on a :class:`LocalGroup` (``allreduce(arr)``: sum in place)."""

    def __init__(self, group: LocalGroup, rank: int):
        self.group, self.rank, self.n_rank = group, rank, group.n_rank
        self.calls, self.seconds = 0, 0.0

    def _timed(self, arr, fn, *args):
        t0 = time.perf_counter()
        fn(self.rank, *args)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return arr

    def allreduce(self, arr):
        return self._timed(arr, self.group.allreduce, arr)

    def send(self, arr, peer: int):
        return self._timed(arr, self.group.send, peer, arr)

    def recv(self, arr, peer: int):
        return self._timed(arr, self.group.recv, peer, arr)


def nccl_available() -> bool:
    """True when CuPy is importable and built with NCCL (``cupy.cuda.nccl.available``)."""
    try:
        from cupy.cuda import nccl  # noqa: PLC0415
    except Exception:  # noqa: BLE001 - no CuPy, no driver: no NCCL
        return False
    return bool(getattr(nccl, "available", False))


def nccl_unique_id():
    """A new NCCL unique id (rank 0 makes it and hands it to every rank; picklable)."""
    from cupy.cuda import nccl  # noqa: PLC0415
    return nccl.get_unique_id()


class NcclComm:
    """One rank of an NCCL communicator (this process's current CuPy device).

    ``send(arr, peer)`` / ``recv(arr, peer)``: ``ncclSend`` / ``ncclRecv`` (NCCL 2.7+) on the
    current stream, the layer-parallel handover. ``allreduce(arr)``: in-place sum of a contiguous float32/float16 CuPy array over every rank,
    on the current stream (asynchronous, like any launch). With ``timing``, CUDA events around each
    call (skipped while the stream is captured); :meth:`nccl_seconds` synchronizes and sums them."""

    def __init__(self, rank: int, n_rank: int, uid, *, timing: bool = True):
        from cupy.cuda import nccl  # noqa: PLC0415
        self.nccl = nccl
        self.rank, self.n_rank = rank, n_rank
        self.comm = nccl.NcclCommunicator(n_rank, uid, rank)
        self.timing = timing
        self.calls = 0
        self.captured = 0   # calls made while the stream was captured: their replays are not timed
        self._events: list = []
        self._seconds = 0.0

    def _call(self, what: str, arr, launch):
        """``launch(dtype, stream_ptr)`` on the current stream, timed with events (``timing``)."""
        import cupy  # noqa: PLC0415
        if not arr.flags.c_contiguous:
            raise CommError(f"NCCL {what} needs a contiguous array")
        dtype = {np.dtype(np.float32): self.nccl.NCCL_FLOAT32,
                 np.dtype(np.float16): self.nccl.NCCL_FLOAT16}[np.dtype(arr.dtype)]
        stream = cupy.cuda.get_current_stream()
        capturing = _capturing(stream)
        timed = self.timing and not capturing
        self.captured += capturing
        if timed:
            e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
            e0.record(stream)
        launch(dtype, stream.ptr)
        if timed:
            e1.record(stream)
            self._events.append((e0, e1))
        self.calls += 1
        return arr

    def allreduce(self, arr):
        return self._call("all-reduce", arr, lambda dt, s: self.comm.allReduce(
            arr.data.ptr, arr.data.ptr, arr.size, dt, self.nccl.NCCL_SUM, s))

    def send(self, arr, peer: int):
        """``ncclSend`` of ``arr`` to rank ``peer`` on the current stream (stream-ordered: later
        work on the stream may overwrite ``arr``). The time includes waiting for ``peer``'s recv."""
        return self._call("send", arr, lambda dt, s: self.comm.send(arr.data.ptr, arr.size, dt, peer, s))

    def recv(self, arr, peer: int):
        """``ncclRecv`` from rank ``peer`` into ``arr`` on the current stream."""
        return self._call("recv", arr, lambda dt, s: self.comm.recv(arr.data.ptr, arr.size, dt, peer, s))

    @property
    def seconds(self) -> float:
        """GPU seconds spent in the timed all-reduces so far (synchronizes on their events)."""
        import cupy  # noqa: PLC0415
        for e0, e1 in self._events:
            e1.synchronize()
            self._seconds += cupy.cuda.get_elapsed_time(e0, e1) / 1e3
        self._events.clear()
        return self._seconds

    def close(self) -> None:
        if self.comm is not None:
            self.comm.destroy()
            self.comm = None


def _capturing(stream) -> bool:
    try:
        from cupy.cuda import runtime  # noqa: PLC0415
        return bool(runtime.streamIsCapturing(stream.ptr))
    except Exception:  # noqa: BLE001
        return False


# ------------------------------------------------------------------ graph pieces
def allreduce_node(b, t, comm, name: str):
    """A custom node after ``t`` (a tensor with an array of its own, F32): ``comm.allreduce`` of
    that array in place; the node's result is ``t``'s memory, summed over the ranks."""
    arr = b.array(t)

    def run():
        comm.allreduce(arr)
    return xp_node.custom(b, run, [t], arr, name)


def tp_full_layer(comm):
    """The full block of one rank (``layers.full_layer`` with the rank's heads and FFN columns),
    all-reducing the O projection's and the FFN down projection's partial sums. For
    ``build.build_ubatch_graph(..., layer="full", full_layer=tp_full_layer(comm))`` with the
    rank's ``cfg`` (``shard.rank_config``) and weights (``shard.shard_weights``)."""

    def layer(b, il: int, x):
        return full_layer(b, il, x, reduce=lambda b_, t, name: allreduce_node(b_, t, comm, name))

    return layer


def build_rank_graph(cache, plan, rank_cfg, comm, *, layer: str = "attn", weights=None, **kw):
    """One rank's ubatch graph: ``build.build_ubatch_graph`` on the rank's cache and config;
    ``layer="full"`` uses :func:`tp_full_layer` over ``comm`` and the rank's weight slices."""
    if layer == "full":
        kw["full_layer"] = tp_full_layer(comm)
    return build.build_ubatch_graph(cache, plan, rank_cfg, layer=layer, weights=weights, **kw)


# ------------------------------------------------------------------ in-process ranks
def _echo(e: BaseException) -> bool:
    """True for a rank's failure that only echoes another rank's (an aborted collective)."""
    while e is not None:
        if isinstance(e, CommError):
            return True
        e = e.__cause__
    return False


class RankEngine(UntimedEngine):
    """One head-parallel rank as ``graph.driver``'s engine: builds and computes the rank's graph of
    each planned ubatch (:func:`build_rank_graph`) over ``comm``; ``run_ubatch`` returns host
    arrays (see :class:`LockstepEngine`, which runs ``N`` of these on threads; on GPUs one per
    process with :class:`NcclComm`).

    ``cache``: the rank's cache (``shard.rank_cache``); ``cfg``: the full config; ``inputs(plan)``:
    the full inputs of a ubatch, numpy order -- ``layer="attn"``: per layer ``(q, k, v)``
    ``(n_tokens, n_head, D)``, ``(n_tokens, n_head_kv, D)``, ``(n_tokens, n_head_kv, head_dim_v)``, of
    which the rank takes its heads; ``layer="full"``: ``x (n_tokens, n_embd)``. ``weights``: the
    full per-layer weights (``layer="full"``), sliced here (arrays of the cache's ``xp``)."""

    def __init__(self, cache, cfg, rank: int, n_rank: int, comm, inputs, *, layer: str = "attn", weights=None,
                 all_custom=None, n_threads: int = 1, fa=None):
        self.cache, self.cfg, self.comm, self.inputs, self.layer = cache, cfg, comm, inputs, layer
        self.shard = HeadShard(rank, n_rank)
        self.rank_cfg = rank_config(cfg, n_rank)
        self.xp = cache.xp
        self.weights = shard_layer_weights(weights, self.shard, cfg, xp=self.xp) if layer == "full" else None
        self.all_custom, self.n_threads, self.fa = all_custom, n_threads, fa

    def rank_inputs(self, ins):
        if self.layer == "full":
            return ins
        s, c = self.shard, self.cfg
        return [(shard_rows(q, s, c.n_head, c.head_dim_k),
                 shard_rows(k, s, c.n_head_kv, c.head_dim_k).reshape(k.shape[0], -1),
                 shard_rows(v, s, c.n_head_kv, c.head_dim_v).reshape(v.shape[0], -1)) for q, k, v in ins]

    def run_ubatch(self, plan, ins=None):
        """``layer="attn"``: per layer the rank's heads' attention output ``(n_tokens, n_head/N,
        head_dim_v)``; ``"full"``: ``[x (n_tokens, n_embd)]`` after the last layer. numpy arrays."""
        xp = self.xp
        mine = self.rank_inputs(self.inputs(plan) if ins is None else ins)
        g = build_rank_graph(self.cache, plan, self.rank_cfg, self.comm, layer=self.layer, weights=self.weights,
                             all_custom=self.all_custom, fa=self.fa)
        try:
            if self.layer == "full":
                g.set_x(xp.asarray(np.asarray(mine, dtype=np.float32)))
            else:
                g.set_inputs(*[[xp.asarray(np.ascontiguousarray(x[j])) for x in mine] for j in range(3)])
            g.compute(self.n_threads)
            outs = g.outputs()[-1:] if self.layer == "full" else g.outputs()
            return [o.get() if hasattr(o, "get") else np.array(o, copy=True) for o in outs]
        finally:
            g.free()

    def synchronize(self) -> None:
        if self.xp is not np:
            self.xp.cuda.get_current_stream().synchronize()


class LockstepEngine(UntimedEngine):
    """``N`` head-parallel ranks in one process (``graph.driver``'s engine interface): one plan
    per ubatch, run through every rank's :class:`RankEngine`, the graphs computed on one thread
    per rank and meeting in :class:`LocalGroup`'s all-reduces.

    ``caches[r]``: rank ``r``'s cache (``shard.rank_cache``; the driver plans on ``caches[0]``,
    the other caches' cells are not consulted); ``cfg``, ``inputs``, ``layer``, ``weights`` as
    :class:`RankEngine`. ``run_ubatch`` returns, per layer, the attention output of every head
    (the ranks' outputs concatenated, ``(n_tokens, n_head, head_dim_v)``), or for ``"full"`` the
    residual stream of each rank ``[x_rank0, x_rank1, ...]`` (all equal after the all-reduce).

    A rank still running ``timeout`` seconds after another rank ended is *stuck*: ``run_ubatch``
    raises :class:`CommError` naming it (instead of waiting for it) and the engine refuses new
    ubatches until that rank's thread has ended."""

    def __init__(self, caches, cfg, inputs, *, layer: str = "attn", weights=None, all_custom=True,
                 n_threads: int = 1, fa=None, timeout: float = 120.0):
        self.n_rank = len(caches)
        self.cfg, self.inputs, self.layer = cfg, inputs, layer
        self.group = LocalGroup(self.n_rank, timeout=timeout)
        self.ranks = [RankEngine(c, cfg, r, self.n_rank, self.group.comms[r], inputs, layer=layer, weights=weights,
                                 all_custom=all_custom, n_threads=n_threads, fa=fa) for r, c in enumerate(caches)]

    @property
    def weights(self):
        return [r.weights for r in self.ranks]

    def _run_rank(self, r: int, plan, ins, results: list, errors: list) -> None:
        try:
            results[r] = self.ranks[r].run_ubatch(plan, ins)
        except BaseException as e:  # noqa: BLE001 - reported by run_ubatch
            errors.append((r, e))
            self.group.abort()

    def run_ubatch(self, plan):
        self._check_stuck()
        ins = self.inputs(plan)
        results: list = [None] * self.n_rank
        errors: list = []
        threads = [threading.Thread(target=self._run_rank, args=(r, plan, ins, results, errors),
                                    name=f"{type(self).__name__}-rank{r}", daemon=True) for r in range(self.n_rank)]
        for t in threads:
            t.start()
        stuck = self._join(threads)
        if stuck:
            self.group.abort()   # nobody may wait for the stuck rank in a collective or a receive
            self._stuck = {r: threads[r] for r in stuck}
            names = ", ".join(f"rank {r}" for r in stuck)
            raise CommError(f"{names} did not finish the ubatch within the group timeout "
                            f"({self.group.timeout:g} s) after the other ranks ended: stuck; the ubatch "
                            f"is abandoned (this engine runs no other until it ends)")
        if errors:
            self.group.reset()
            errors.sort(key=lambda e: _echo(e[1]))   # the first cause, not the other ranks' echoes of it
            r, e = errors[0]
            raise CommError(f"rank {r} failed: {e!r}") from e
        return self._combine(results)

    def _join(self, threads) -> list[int]:
        """Wait for the ranks' threads; a rank still running ``group.timeout`` seconds after
        another rank ended (finished or failed) is stuck: the ranks of a lockstep ubatch end
        together, as a collective waits at most that long. Returns the stuck ranks' indices."""
        deadline = None
        while True:
            alive = [t for t in threads if t.is_alive()]
            if not alive:
                return []
            if deadline is None and len(alive) < len(threads):
                deadline = time.monotonic() + self.group.timeout
            if deadline is not None and time.monotonic() >= deadline:
                return [r for r, t in enumerate(threads) if t.is_alive()]
            wait = 0.1 if deadline is None else min(0.1, max(0.0, deadline - time.monotonic()))
            alive[0].join(wait)

    def _check_stuck(self) -> None:
        """A rank left stuck by an earlier ubatch may still write into its cache or meet the
        group: no new ubatch until it has ended (then the group is reset)."""
        stuck = getattr(self, "_stuck", None)
        if not stuck:
            return
        still = [r for r, t in stuck.items() if t.is_alive()]
        if still:
            raise CommError(f"{', '.join(f'rank {r}' for r in still)} is still stuck in an earlier ubatch; "
                            f"this engine cannot run another")
        self._stuck = {}
        self.group.reset()

    def _combine(self, results: list):
        """The ranks' results of one ubatch -> what ``run_ubatch`` returns."""
        if self.layer == "full":
            return [res[0] for res in results]
        return [np.concatenate([res[il] for res in results], axis=1) for il in range(self.cfg.n_layer)]
