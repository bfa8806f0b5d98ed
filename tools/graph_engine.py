"""The benchmarks' engine: one ubatch graph of ``ggml_attn.graph.build`` per planned ubatch.

Both flavours build the same graph (``build.build_ubatch_graph``) through every layer:

* ``--layer attn``: Q ``q_cur [D, n_head, n_tokens]`` and the new K/V rows
  ``[n_embd_kv, n_tokens]`` are random inputs, one set shared by every layer;
* ``--layer full``: the block of ``graph/layers.py`` (RMS norm, Q/K/V projections from the
  residual stream, attention, O projection, RMS norm, gated FFN) with random F16 weights,
  numpy order ``(n_out, n_in)`` = ggml ``[n_in, n_out]``, kept here and handed to the builder;
* ``--layer model``: the model of a ``.gguf`` file with its own weights (``graph/model.py``,
  ``graph/model_graph.py``): token ids of the batch in, embedding, every block with RoPE, the
  output head on the rows llama.cpp computes logits for (each sequence's last token of the
  batch: ``model_runner.output_flags``); the runner hands the batch over (:attr:`batch`);

K/V rows go into the ``KVCache`` (the graph's store node) and attention reads its views:

* host (``--device cpu``): a host graph computed by ggml's CPU backend on ``-t`` threads;
  ``-fa on``: ``ggml_attn.flash_attn_ext`` (its numpy path), ``--kernel ggml``: ggml's
  ``ggml_flash_attn_ext``, ``-fa off``: ggml's ``mul_mat`` + ``soft_max_ext``. Every cache type
  of ``kv_types`` runs (quantized ones live in the cache's byte arrays, written by ``ggml_set_rows``);
* device (``--device cuda``): an all-custom graph over the CuPy cache and CuPy inputs/weights,
  ``ggml_attn.flash_attn_ext`` on the CUDA backend (``op.set_backend("cuda", kernel)``; the
  builder's per-ubatch kernel plan is reused by every layer), computed on one graph thread:
  the callbacks launch work on the current CuPy stream.

Weights: one set per layer while all layers' weights fit the flavour's limit, else one set
shared by all layers (the same matmul cost, less memory).
"""
from __future__ import annotations

import warnings

import numpy as np

SHARED_WEIGHTS_ABOVE = {"host": 1 << 30, "device": 16 << 30}


class _NoStream:
    """``with``-able nothing (the host flavour has no stream)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Cached:
    """A built ubatch graph kept for reuse, and its CUDA graph once captured (for the first
    stream it was captured on: the launches hold that stream's K/V pointers)."""

    def __init__(self, graph, decode: bool):
        self.graph = graph
        self.replay = None
        self.replay_s0 = None
        self.decode = decode   # a decode step's structure (UBatch.decode_step)


class GraphEngine:
    """``run_ubatch(plan)``, ``synchronize()``, ``timer()``, ``close()`` (``graph.driver``'s engine)."""

    flavour = "host"
    all_custom = None  # None: as the flavour (device: all-custom); True: all-custom host graph (tests)
    full_layer = None  # the layer function of --layer full (None: graph/layers.py's full_layer)
    layers = None      # the global layers of the graph (None: all; a -sm layer rank: its range)

    def __init__(self, cfg, cache):
        import ggml
        from ggml_attn import op
        from ggml_attn.graph import AttnConfig
        self.cfg, self.cache, self.m = cfg, cache, cfg.model
        m = self.m
        self.device = self.flavour == "device"
        self.xp = cache.xp
        self._saved_settings = op.settings()   # the op's process-wide settings, put back by close()
        if self.device:
            op.set_backend("cuda", cfg.kernel)
        else:
            op.set_backend("reference", cfg.kernel if cfg.kernel != "ggml" else "auto")
        self.fa = ggml.ggml_flash_attn_ext if cfg.kernel == "ggml" else None
        self.attn_cfg = AttnConfig(n_layer=m.n_layer, n_head=m.n_head, n_head_kv=m.n_head_kv,
                                   head_dim=m.head_dim, head_dim_v=m.head_dim_v or None,
                                   logit_softcap=m.logit_softcap)
        self.n_threads = 1 if self.device else max(1, int(cfg.n_threads))
        rng = self.xp.random.default_rng(cfg.seed)  # on the device for the device flavour (fast)
        self.weights = self._make_weights(rng) if cfg.layer == "full" else None
        self.model = self._load_model() if cfg.layer == "model" else None
        self.batch = None       # --layer model: the batch being decoded (its token ids); set by the runner
        self.logits = "last"    # --layer model: which of its tokens get logits (model_runner.output_flags)
        self._want = (None, None, None)   # (batch, logits, their flags)
        self._n_out = 0         # --layer model: the current ubatch's real output rows (_model_rows)
        # random input values, sliced per ubatch; split_equal may give n_ubatch + 1 rows, and no
        # ubatch has more rows than the cache has cells (a -ub of 100000000 must not allocate them)
        self.pool_width = width = max(m.n_embd_q, m.n_embd, m.n_embd_k, m.n_embd_v)
        self.pool = rng.standard_normal(width * (min(cfg.n_ubatch, cache.n_ctx) + 1), dtype=np.float32)
        self._keep = None
        self._last_streams = None
        # built graphs by structure (LRU), and the stream the device flavour computes on: a
        # non-default stream of its own (CUDA graphs are captured on it; the timer and
        # synchronize() use it)
        self._graphs: dict = {}
        # built graphs kept: a prompt phase of many ubatch shapes must not evict the decode
        # steps' graphs (each rebuilt and captured again), so decode-step structures get room
        # of their own; other (prompt) graphs hold large activations and rarely repeat
        self.max_graphs = 32 if self.device else 4
        # a prompt phase over per-stream KV walks through one structure per n_kv step (64
        # sequences of 128 tokens: 8); fewer kept than that rebuilt every prompt ubatch
        self.max_other_graphs = 16 if self.device else 4
        self.cuda_graph = bool(getattr(cfg, "cuda_graph", True))
        self.captures = self.replays = 0
        self.stream = None
        if self.device:
            self.stream = self.xp.cuda.Stream(non_blocking=True)
            self.xp.cuda.Device().synchronize()   # weights, inputs, cache: made on the default stream

    def _make_weights(self, rng):
        m = self.m

        def w(n_in, n_out):  # numpy (n_out, n_in) = ggml [n_in, n_out], N(0, 1/n_in)
            return (rng.standard_normal((n_out, n_in), dtype=np.float32) / np.sqrt(n_in)).astype(np.float16)

        shared = m.n_layer * m.layer_params() * 2 > SHARED_WEIGHTS_ABOVE[self.flavour]
        sets = [dict(wq=w(m.n_embd, m.n_embd_q), wk=w(m.n_embd, m.n_embd_k), wv=w(m.n_embd, m.n_embd_v),
                     wo=w(m.n_head * m.d_v, m.n_embd), wg=w(m.n_embd, m.n_ff), wu=w(m.n_embd, m.n_ff),
                     wd=w(m.n_ff, m.n_embd))
                for _ in range(1 if shared else m.n_layer)]
        return [sets[0]] * m.n_layer if shared else sets

    def _load_model(self):
        from ggml_attn.graph.model import ModelError, load_gguf
        from .errors import UserError
        try:
            model = load_gguf(self.m.source)
        except ModelError as e:   # (RunConfig checked the file and its layer count: models.check_model_file)
            raise UserError(str(e)) from e
        return model

    def _model_rows(self, plan):
        """``(batch token ids, output rows of the ubatch, how many of them are real)`` for
        ``--layer model``: the rows padded to a power of two with copies of the last one, so that
        ubatches of 3, 5, 6 or 8 output rows (ragged prompts ending anywhere in a ubatch) share
        one graph structure (a model graph is ~30 ms of host time to build on the H200's host)."""
        from ggml_attn.graph.model_runner import output_flags, output_rows
        batch = self.batch
        if batch is None:
            raise RuntimeError("--layer model: the engine was not handed the batch (engine.batch)")
        if self._want[0] is not batch or self._want[1] is not self.logits:
            self._want = (batch, self.logits, output_flags(batch, self.logits))
        rows = output_rows(plan.ubatch, self._want[2])
        n = len(rows)
        if n > 1 and n & (n - 1):
            rows = np.concatenate([rows, np.full((1 << n.bit_length()) - n, rows[-1], dtype=rows.dtype)])
        return batch.tokens, rows, n

    def inputs(self, plan):
        """This ubatch's inputs from the pool, numpy order: ``x (n_tokens, n_embd)`` (full) or
        ``q (n_tokens, n_head, D)``, ``k (n_tokens, n_embd_k)``, ``v (n_tokens, n_embd_v)``; Q
        is read from the pool as ggml ``[D, n_tps, n_head, n_stream]``."""
        m, pool = self.m, self.pool
        n_tok, ns = plan.ubatch.n_tokens, plan.n_stream
        assert n_tok * self.pool_width <= pool.size, \
            f"{n_tok} rows overrun the input pool of {pool.size // self.pool_width} rows"
        if self.cfg.layer == "full":
            return (pool[: m.n_embd * n_tok].reshape(n_tok, m.n_embd),)
        q = pool[: m.n_embd_q * n_tok].reshape(ns, m.n_head, plan.n_tps, m.head_dim).transpose(0, 2, 1, 3)
        return (q.reshape(n_tok, m.n_head, m.head_dim), pool[: m.n_embd_k * n_tok].reshape(n_tok, m.n_embd_k),
                pool[: m.n_embd_v * n_tok].reshape(n_tok, m.n_embd_v))

    def run_ubatch(self, plan):
        """Compute ``plan`` (``ggml_attn.graph.UBatchPlan``) through every layer. ``--layer model``
        returns ``(token_idx, logits)``: int64 batch indices of the ubatch's tokens that got logits
        (``logits``' flags) and their logits, an ``xp`` float32 ``(n_out, n_vocab)`` the next ubatch
        of the same structure overwrites (read it on the engine's stream before then); other layers
        return None.

        Built graphs are kept per structure (``build.graph_key``: tokens, streams, KV cells
        viewed, decode step or not) and reused by later ubatches of the same structure -- decode steps, until
        ``n_kv`` crosses its next multiple of 256; the prompt ubatches of other streams -- with only the
        mask, row indices and K/V views' stream loaded. On the device, a structure seen twice -- a decode
        step's at once -- is captured as a CUDA graph (``graph.capture``) and replayed from then on for
        the stream it was captured on (``cuda_graph``, on by default); other streams compute it through
        ggml's graph loop."""
        with self.stream if self.device else _NoStream():   # building, loading, computing: one stream
            return self._run_ubatch(plan)

    def _run_ubatch(self, plan):
        from ggml_attn.graph import build
        cfg = self.cfg
        key = build.graph_key(plan)
        tokens = out_rows = None
        if self.model is not None:
            tokens, out_rows, self._n_out = self._model_rows(plan)
            key += (len(out_rows),)
        entry = self._graphs.pop(key, None) if cfg.flash_attn else None
        if entry is None:
            kw = dict(model=self.model, tokens=tokens, out_rows=out_rows) if self.model is not None else {}
            cfg_attn = self.model.attn_config() if self.model is not None else self.attn_cfg
            g = build.build_ubatch_graph(self.cache, plan, cfg_attn, fa=self.fa, layer=cfg.layer,
                                         weights=self.weights, flash_attn=cfg.flash_attn, shared_inputs=True,
                                         full_layer=self.full_layer, layers=self.layers,
                                         all_custom=self.device if self.all_custom is None else self.all_custom, **kw)
            entry = _Cached(g, plan.ubatch.decode_step)
            fresh = True
        else:
            entry.graph.load_plan(plan, tokens, out_rows)
            fresh = False
        g = entry.graph
        self._run(entry, g, plan, fresh)
        out = None
        if self.model is not None:
            out = (plan.ubatch.token_idx[out_rows[:self._n_out]].astype(np.int64), self._keep[1])
        if not cfg.flash_attn:
            if out is not None:   # the graph's memory goes now
                out = (out[0], self.xp.array(out[1], copy=True))
            g.free()
            return out
        self._graphs[key] = entry            # most recently used last
        others = [k for k, e in self._graphs.items() if not e.decode]
        while len(others) > self.max_other_graphs:   # oldest first
            self._graphs.pop(others.pop(0)).graph.free()
        while len(self._graphs) > self.max_graphs:
            self._graphs.pop(next(iter(self._graphs))).graph.free()
        return out

    def _run(self, entry, g, plan, fresh: bool) -> None:
        """Inputs, then a replay, a capture or a plain compute (on the engine's stream)."""
        cfg = self.cfg
        try:
            if cfg.layer == "full":
                g.set_x(self.inputs(plan)[0])          # every time: the graph adds into x in place
            elif fresh:
                g.set_inputs(*[[x] for x in self.inputs(plan)])   # the pool's rows: the same for every reuse
            if entry.replay is not None and entry.replay_s0 == plan.slot.s0:
                entry.replay.launch(self.stream)
                self.replays += 1
            elif self.device and self.cuda_graph and entry.replay is None and (not fresh or entry.decode):
                from ggml_attn.graph.capture import CaptureError, capture  # this step computes in the warm-up
                try:
                    entry.replay = capture(lambda: self._compute(g, refresh=True), self.stream)
                    entry.replay_s0 = plan.slot.s0
                    self.captures += 1
                except CaptureError as e:   # the warm-up's results stand; go on without graphs
                    self.cuda_graph = False
                    warnings.warn(f"{e}; running without CUDA graphs from here on", RuntimeWarning, stacklevel=2)
            else:
                self._compute(g, refresh=not fresh)
            # alive until the stream has used them (and for tests): mask, last output, kernel plan
            m, last = self.m, g.output(-1)
            if cfg.layer == "attn":  # [D_v, n_head, n_tps, n_stream] = numpy (ns, n_tps, n_head, D_v)
                last = last.reshape(plan.n_stream, plan.n_tps, m.n_head, m.d_v)
            elif cfg.layer == "model":   # the real output rows' logits (not the padding's)
                last = last[:self._n_out]
            self._keep = (g.array(g.mask_t), last, g.kernel_plan)
            self._last_streams = (plan.slot.s0, plan.n_stream)
        except BaseException:
            g.free()
            raise

    def _compute(self, g, refresh: bool) -> None:
        if refresh:
            g.refresh_kernel_plan()
        g.compute(self.n_threads)

    def synchronize(self) -> None:
        if self.device:
            self.stream.synchronize()

    def timer(self):
        from .common import CudaTimer, WallTimer
        return CudaTimer(self.stream) if self.device else WallTimer()

    def close(self) -> None:
        from ggml_attn import op
        for entry in self._graphs.values():
            entry.graph.free()
        self._graphs.clear()
        saved, self._saved_settings = getattr(self, "_saved_settings", None), None
        if saved is not None:   # a CPU engine's "reference" must not outlive it (device graphs after it)
            op.set_backend(*saved)
        self._keep = None
        self.weights = self.model = self.batch = None
        if self.stream is not None:
            self.stream.synchronize()
            self.stream = None
