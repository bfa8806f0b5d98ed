"""The engine ``driver.decode`` runs ubatches on: one ubatch graph of ``build.build_ubatch_graph``
per planned ubatch, built graphs kept and reused, and on a GPU replayed as CUDA graphs.

:class:`Engine` is the one place that decides whether a ubatch builds a graph, reuses one or
replays a capture: built graphs are kept per structure (``build.graph_key``: tokens, streams, KV
cells viewed, decode step or not; with ``layer="model"`` the output-row count too) and reused by
later ubatches of the same structure with only the plan loaded (``UBatchGraph.load_plan``: the
mask, row indices, K/V views moved to the ubatch's streams). On the device (a CuPy cache) a
structure seen twice -- a decode step's at once -- is captured as a CUDA graph
(``graph.capture``) and replayed from then on for the stream it was captured on (``cuda_graph``,
on by default); other streams compute it through ggml's graph loop. The kept graphs are an LRU
with room of their own for decode-step structures, so a prompt phase of many shapes does not
evict the decode steps' graphs.

What a ubatch computes (``layer``): ``"model"`` a real model's token ids to logits
(``model``: a ``graph.model.Model``; the batch being decoded is :attr:`Engine.batch`, the tokens
that get logits :attr:`Engine.logits`, and :meth:`Engine.run_ubatch` returns the ubatch's
``(token_idx, logits)``); ``"attn"`` / ``"full"`` stacks of attention or of the full block,
their inputs from :meth:`Engine.inputs` (a subclass's: the benchmarks' random pool).

``model_runner.run_model_batch`` and ``greedy``, ``qkv_runner.run_batch`` (``compute="ggml"``) and
the CLIs (``tools/graph_engine.py``) all run on it: the Python API reuses graphs as the CLIs do.
"""
from __future__ import annotations

import warnings
import weakref

import numpy as np

__all__ = ["Engine", "UntimedEngine", "MAX_GRAPHS", "GRAPH_BYTES", "graph_bytes_budget", "kept_engine", "out_of_device_memory",
           "out_rows_padded"]

# kept built graphs (host, device): in all, and of prompt (non-decode) structures; a prompt phase
# over per-stream KV walks through one structure per n_kv step (64 sequences of 128 tokens: 8), and
# a server's steps through many more: the sample trace (64 requests) made 106 structures with
# per-stream KV, 96 on a unified cache, and with room for 32 the per-stream run built 1,147 graphs
# (~30 ms of host time each for an 8B model graph). On the device the kept graphs are bounded by
# the bytes their builds took as well (GRAPH_BYTES; a graph holds one layer's intermediates, ~250 KB
# a token for an 8B model: a 64-token decode step ~16 MB, a 512-token prompt ubatch ~130 MB), prompt
# structures at most 3/4 of them, so that decode steps keep their room.
MAX_GRAPHS = {False: (4, 4), True: (256, 192)}
GRAPH_BYTES = {False: None, True: 2 << 30}
# On the device the bound grows to GRAPH_MEMORY_SHARE of the memory free when the first graph is
# kept (the weights and the cache are in by then; CuPy's pool's cached blocks count as free), at
# most GRAPH_BYTES_MAX, never below GRAPH_BYTES[True]: a server's trace at 12 requests/s on the 8B
# F16 file made ~110 structures (~3 GB at ~250 KB a token); under 2 GB its warmed-up pass still
# built ~40 of them, each ~30 ms inside a step, against ~10 with room for all
# (tools/dev/serve_structures.py; the H100's timed pass built 69: bench/NOTES.md, fifteenth session).
GRAPH_MEMORY_SHARE = 0.25
GRAPH_BYTES_MAX = 16 << 30


def graph_bytes_budget(xp) -> int:
    """The kept device graphs' bytes at most (the notes above): ``xp`` is CuPy, its current
    device the engine's."""
    free = int(xp.cuda.runtime.memGetInfo()[0]) + int(xp.get_default_memory_pool().free_bytes())
    return max(GRAPH_BYTES[True], min(GRAPH_BYTES_MAX, int(GRAPH_MEMORY_SHARE * free)))


def out_rows_padded(n: int) -> int:
    """The output (logits) rows a model ubatch with ``n`` of them computes: a power of two (0 and
    1 as they are), so that ubatches of 3, 5, 6 or 8 rows share one graph structure."""
    return n if n <= 1 else 1 << (n - 1).bit_length()


def out_of_device_memory(e: BaseException) -> bool:
    """Whether ``e`` (or the error it was raised from, as :class:`capture.CaptureError` is) says
    the device ran out of memory: a ``MemoryError`` (CuPy's ``OutOfMemoryError``) or a CUDA
    runtime error of status 2 (``cudaErrorMemoryAllocation``, CuPy's ``CUDARuntimeError``)."""
    for x in (e, e.__cause__):
        if isinstance(x, MemoryError) or (type(x).__name__ == "CUDARuntimeError" and getattr(x, "status", None) == 2):
            return True
    return False


class UntimedEngine:
    """The rest of ``driver.decode``'s engine interface for engines that compute synchronously on
    the host's order and are not timed: ``synchronize`` and ``close`` do nothing, ``timer`` says
    so (a subclass overrides what it has)."""

    def synchronize(self) -> None:
        pass

    def timer(self):
        raise NotImplementedError(f"{type(self).__name__} is not timed")

    def close(self) -> None:
        pass


class _NoStream:
    """``with``-able nothing (the host has no stream)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Cached:
    """A built ubatch graph kept for reuse, and its CUDA graph once captured (for the first
    stream it was captured on: the launches hold that stream's K/V pointers)."""

    def __init__(self, graph, decode: bool, nbytes: int = 0):
        self.graph = graph
        self.replay = None
        self.replay_s0 = None
        self.decode = decode   # a decode step's structure (UBatch.decode_step)
        self.nbytes = nbytes   # device memory its build took (0 on the host)


class Engine:
    """``run_ubatch(plan)``, ``synchronize()``, ``close()`` over ``cache`` (module docstring).

    ``attn_cfg``: the attention stack (``AttnConfig``; a model's own for ``layer="model"``);
    ``weights`` (``"full"``): per layer, numpy order; ``fa``: another flash-attention op for host
    graphs (``ggml.ggml_flash_attn_ext``); ``flash_attn=False``: ggml's mul_mat + soft_max (host
    graphs, built per ubatch); ``device``: all-custom graphs on the cache's CuPy stream (default:
    when the cache is CuPy's); ``all_custom``: all-custom graphs on the host too (tests);
    ``n_threads``: the host's graph threads (the device computes on one)."""

    full_layer = None  # the layer function of "full" (None: graph/layers.py's full_layer)
    layers = None      # the global layers of the graph (None: all; a -sm layer rank: its range)
    inputs_once = True   # "attn": inputs set when a graph is built, the same for every reuse (a pool)

    def __init__(self, cache, attn_cfg, *, layer: str = "attn", model=None, weights=None, fa=None,
                 flash_attn: bool = True, n_threads: int = 1, cuda_graph: bool = True, device: bool | None = None,
                 all_custom: bool | None = None, shared_inputs: bool = True):
        self._cache = weakref.ref(cache)   # (an engine kept with its cache must not keep it alive)
        self.xp = cache.xp
        self.device = (self.xp is not np) if device is None else bool(device)
        self.attn_cfg, self.layer, self.model, self.weights, self.fa = attn_cfg, layer, model, weights, fa
        self.flash_attn = bool(flash_attn)
        self.all_custom = all_custom
        self.shared_inputs = shared_inputs
        self.n_threads = 1 if self.device else max(1, int(n_threads))
        self.batch = None       # layer "model": the batch being decoded (its token ids)
        self.logits = "last"    # layer "model": which of its tokens get logits (model_runner.output_flags)
        self._want = (None, None, None)   # (batch, logits, their flags)
        self._n_out = 0         # layer "model": the current ubatch's real output rows (_model_rows)
        self._keep = None       # alive until the stream has used them (and for tests): mask, last output, kernel plan
        self._last_streams = None
        self._graphs: dict = {}
        self.max_graphs, self.max_other_graphs = MAX_GRAPHS[self.device]
        self.max_graph_bytes = GRAPH_BYTES[self.device]   # (on the device: graph_bytes_budget at the first kept graph)
        self._bytes_sized = not self.device
        self.builds = 0         # graphs built (each a structure not kept: first seen, or evicted since)
        self.cuda_graph = bool(cuda_graph)
        self.captures = self.replays = 0
        self.stream = None
        if self.device:
            self.stream = self.xp.cuda.Stream(non_blocking=True)
            self.xp.cuda.Device().synchronize()   # weights, inputs, cache: made on the default stream

    @property
    def cache(self):
        """The KV cache the engine runs on (held weakly: RuntimeError once it was freed)."""
        c = self._cache()
        if c is None:
            raise RuntimeError("the engine's KV cache was freed")
        return c

    def follow_current_stream(self) -> None:
        """On the device: the engine's stream waits for what the caller's current stream has
        queued (cache writes made on it, e.g. ``KVCache.seq_cp`` across streams) before the
        engine's next launches; nothing on the host."""
        if self.device and self.stream is not None:
            self.stream.wait_event(self.xp.cuda.get_current_stream().record())

    def runs_to_steady(self, decode_step: bool) -> int:
        """How many runs of one ubatch structure until it runs as every later run of it will: on
        the device a prompt structure's second run captures it as a CUDA graph (or, without
        graphs, refreshes its kernel plan: the mask kernels' first use) and only its third
        replays; a decode step's first run captures it already; on the host the first run builds
        what later runs reuse. (What a benchmark's warm-up repeats: ``tools/bench.py``.)"""
        return 2 if self.device and self.flash_attn and not decode_step else 1

    # ------------------------------------------------------------ hooks
    def inputs(self, plan):
        """``layer="attn"``: ``(q (n_tokens, n_head, D), k (n_tokens, n_embd_k), v (n_tokens,
        n_embd_v))``; ``"full"``: ``(x (n_tokens, n_embd),)``; numpy order (a subclass's)."""
        raise NotImplementedError(f"layer {self.layer!r} needs inputs: a subclass of Engine gives them")

    def set_attn_inputs(self, g, plan) -> None:
        """``layer="attn"``: put :meth:`inputs` into graph ``g`` (one set for every layer)."""
        g.set_inputs(*[[x] for x in self.inputs(plan)])

    def ubatch_result(self, g, plan):
        """What :meth:`run_ubatch` returns for ``layer="attn"`` / ``"full"`` (None here; a
        subclass's: e.g. every layer's output, read from ``g`` before it is reused)."""
        return None

    def _model_rows(self, plan):
        """``(batch token ids, output rows of the ubatch, how many of them are real)`` for
        ``layer="model"``: the rows padded to a power of two with copies of the last one, so that
        ubatches of 3, 5, 6 or 8 output rows (ragged prompts ending anywhere in a ubatch) share
        one graph structure (a model graph is ~30 ms of host time to build on the H200's host)."""
        from .model_graph import output_flags, output_rows   # noqa: PLC0415
        batch = self.batch
        if batch is None:
            raise RuntimeError("layer 'model': the engine was not handed the batch (engine.batch)")
        if self._want[0] is not batch or self._want[1] is not self.logits:
            self._want = (batch, self.logits, output_flags(batch, self.logits))
        rows = output_rows(plan.ubatch, self._want[2])
        n = len(rows)
        if out_rows_padded(n) != n:
            rows = np.concatenate([rows, np.full(out_rows_padded(n) - n, rows[-1], dtype=rows.dtype)])
        return batch.tokens, rows, n

    # ------------------------------------------------------------ running
    def run_ubatch(self, plan):
        """Compute ``plan`` (``UBatchPlan``) through every layer (module docstring). ``layer="model"``
        returns ``(token_idx, logits)``: int64 batch indices of the ubatch's tokens that got logits
        (:attr:`logits`' flags) and their logits, an ``xp`` float32 ``(n_out, n_vocab)`` the next
        ubatch of the same structure overwrites (read it on the engine's stream before then);
        other layers return None."""
        with self.stream if self.device else _NoStream():   # building, loading, computing: one stream
            return self._run_ubatch(plan)

    def _run_ubatch(self, plan):
        from . import build   # noqa: PLC0415
        key = build.graph_key(plan)
        tokens = out_rows = None
        if self.model is not None:
            tokens, out_rows, self._n_out = self._model_rows(plan)
            key += (len(out_rows),)
        entry = self._graphs.pop(key, None) if self.flash_attn else None
        if entry is None:
            kw = dict(model=self.model, tokens=tokens, out_rows=out_rows) if self.model is not None else {}

            def make():
                return build.build_ubatch_graph(
                    self.cache, plan, self.attn_cfg, fa=self.fa, layer=self.layer, weights=self.weights,
                    flash_attn=self.flash_attn, shared_inputs=self.shared_inputs, full_layer=self.full_layer,
                    layers=self.layers, all_custom=self.device if self.all_custom is None else self.all_custom, **kw)
            g, nbytes = self._build(make)
            entry = _Cached(g, plan.ubatch.decode_step, nbytes)
            fresh = True
        else:
            try:
                entry.graph.load_plan(plan, tokens, out_rows)
            except BaseException:   # (taken out of the kept graphs above: freed, not leaked)
                entry.graph.free()
                raise
            fresh = False
        g = entry.graph
        self._run(entry, g, plan, fresh)
        try:
            if self.model is not None:
                out = (plan.ubatch.token_idx[out_rows[:self._n_out]].astype(np.int64), self._keep[1])
            else:
                out = self.ubatch_result(g, plan)
            if not self.flash_attn and self.model is not None:   # the graph's memory goes now
                out = (out[0], self.xp.array(out[1], copy=True))
        except BaseException:   # (taken out of the kept graphs: freed, not leaked)
            g.free()
            raise
        if not self.flash_attn:
            g.free()
            return out
        self._graphs[key] = entry            # most recently used last
        self._size_bytes_once()
        self._evict(self.max_graphs, self.max_other_graphs, self.max_graph_bytes)
        return out

    def _build(self, make):
        """``make()``'s graph and the device memory its build took from CuPy's pool (0 on the host;
        what the graph allocates later -- its attention calls' bound buffers at the first compute,
        a CUDA-graph capture -- is not counted: GRAPH_BYTES bounds the builds' memory). Out of
        memory with graphs kept, they are freed and the build tried once more
        (:meth:`_retry_out_of_memory`; CuPy's allocator gave its cached blocks back already)."""
        pool = self.xp.get_default_memory_pool() if self.device else None
        before = [0]

        def attempt():
            before[0] = pool.used_bytes() if pool is not None else 0
            return make()
        g = self._retry_out_of_memory(attempt, (self._drop_graphs,) if self._graphs else ())
        self.builds += 1
        return g, (max(0, pool.used_bytes() - before[0]) if pool is not None else 0)

    def _size_bytes_once(self) -> None:
        """On the device, the kept graphs' byte bound (:func:`graph_bytes_budget`), read when the
        first graph is kept."""
        if not self._bytes_sized:
            self.max_graph_bytes, self._bytes_sized = graph_bytes_budget(self.xp), True

    def _evict(self, max_all: int, max_other: int, max_bytes: int | None) -> None:
        """Free the least recently used kept graphs until at most ``max_all`` are kept and at most
        ``max_other`` of prompt structures, and (``max_bytes`` not None) their builds' bytes are
        at most ``max_bytes``, the prompt structures' at most 3/4 of it: prompt structures go
        first while they are over their share, then the oldest of any."""
        def over(entries, n_max, b_max):
            return len(entries) > n_max or (b_max is not None and sum(e.nbytes for _, e in entries) > b_max)
        while True:
            others = [(k, e) for k, e in self._graphs.items() if not e.decode]
            if others and over(others, max_other, None if max_bytes is None else max_bytes * 3 // 4):
                key = others[0][0]
            elif self._graphs and over(list(self._graphs.items()), max_all, max_bytes):
                key = next(iter(self._graphs))
            else:
                return
            self._graphs.pop(key).graph.free()

    def _run(self, entry, g, plan, fresh: bool) -> None:
        """Inputs, then a replay, a capture or a plain compute (on the engine's stream)."""
        try:
            if self.layer == "full":
                g.set_x(self.inputs(plan)[0])          # every time: the graph adds into x in place
            elif self.layer == "attn" and (fresh or not self.inputs_once):
                self.set_attn_inputs(g, plan)
            if entry.replay is not None and entry.replay_s0 == plan.slot.s0:
                self._retry_out_of_memory(lambda: entry.replay.launch(self.stream))
                self.replays += 1
            elif self.device and self.cuda_graph and entry.replay is None and (not fresh or entry.decode):
                from .capture import CaptureError, capture  # noqa: PLC0415 (this step computes in the warm-up)
                try:
                    entry.replay = self._retry_out_of_memory(
                        lambda: capture(lambda: self._compute(g, refresh=True), self.stream))
                    entry.replay_s0 = plan.slot.s0
                    self.captures += 1
                except CaptureError as e:   # the warm-up's results stand; go on without graphs
                    self.cuda_graph = False
                    warnings.warn(f"{e}; running without CUDA graphs from here on", RuntimeWarning, stacklevel=2)
            else:
                self._compute(g, refresh=not fresh)
            last = g.output(-1)
            if self.layer == "attn":  # [head_dim_v, n_head, n_tps, n_stream] = numpy (ns, n_tps, n_head, head_dim_v)
                c = self.attn_cfg
                last = last.reshape(plan.n_stream, plan.n_tps, c.n_head, c.head_dim_v)
            elif self.layer == "model":   # the real output rows' logits (not the padding's)
                last = last[:self._n_out]
            self._keep = (g.array(g.mask_t), last, g.kernel_plan)
            self._last_streams = (plan.slot.s0, plan.n_stream)
        except BaseException:
            g.free()
            raise

    def _retry_out_of_memory(self, call, rungs=None):
        """``call()``, tried again after each of ``rungs`` (functions that give memory back) while it
        runs out of memory (:func:`out_of_device_memory`); another error, or one past the last
        rung, propagates. Default rungs, on the device, for what allocates outside CuPy's
        allocator -- a CUDA graph's first launch uploads it (``cudaGraphUpload``), instantiating
        one allocates -- which cannot take the blocks CuPy's pool keeps for its own reuse: the
        pool's cached blocks, then the other kept graphs too (the one running is not among them:
        ``_run_ubatch`` took it out)."""
        if rungs is None:
            rungs = (self._free_pool, self._drop_graphs) if self.device else ()
        for release in (*rungs, None):
            try:
                return call()
            except Exception as e:  # noqa: BLE001 - only an out-of-memory is retried
                if release is None or not out_of_device_memory(e):
                    raise
            release()   # (outside the handler, whose traceback holds the failed attempt's arrays)

    def _free_pool(self) -> None:
        """CuPy's cached free blocks back to the device (nothing on the host)."""
        if self.device:
            self.xp.get_default_memory_pool().free_all_blocks()

    def _drop_graphs(self) -> None:
        """Every kept graph freed, and their memory back to the device."""
        self._evict(0, 0, 0)
        self._free_pool()

    def _compute(self, g, refresh: bool) -> None:
        if refresh:
            g.refresh_kernel_plan()
        g.compute(self.n_threads)

    def synchronize(self) -> None:
        if self.device:
            self.stream.synchronize()

    def timer(self):
        raise NotImplementedError("this engine is not timed (the CLIs' engines are)")

    def close(self) -> None:
        """Free the kept graphs and wait for the stream; the engine cannot run after."""
        for entry in self._graphs.values():
            entry.graph.free()
        self._graphs.clear()
        self._keep = None
        self.weights = self.model = self.batch = None
        if self.stream is not None:
            self.stream.synchronize()
            self.stream = None


MAX_KEPT_ENGINES = 4   # per cache: the engines of the last few (kind, config) asked for


def kept_engine(cache, key, make, fits=None):
    """The engine kept with ``cache`` under ``key`` (``make()`` builds it the first time, and again
    when ``fits(engine)`` says the kept one does not serve this call: it is closed): the
    library's entry points (``run_batch``, ``run_model_batch``, ``greedy``) reuse one engine, and
    its graphs, from call to call. Kept in the cache's own attribute and closed when the cache
    is freed (``weakref.finalize``; an engine holds its cache weakly, so nothing keeps the cache
    or its device memory alive); at most :data:`MAX_KEPT_ENGINES` per cache, the least recently
    used closed first."""
    engines = cache.__dict__.get("_engines")
    if engines is None:
        engines = cache.__dict__["_engines"] = {}
        weakref.finalize(cache, _close_all, engines)
    e = engines.pop(key, None)
    if e is not None and fits is not None and not fits(e):
        e.close()
        e = None
    if e is None:
        e = make()
    engines[key] = e   # most recently used last
    while len(engines) > MAX_KEPT_ENGINES:
        engines.pop(next(iter(engines))).close()
    return e


def _close_all(engines: dict) -> None:
    for e in list(engines.values()):
        e.close()
    engines.clear()
