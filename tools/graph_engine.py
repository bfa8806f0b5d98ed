"""The benchmarks' engine: ``ggml_attn.graph.engine.Engine`` (one ubatch graph of
``ggml_attn.graph.build`` per planned ubatch, kept and reused, replayed as CUDA graphs on the
GPU) made from a run's configuration, with the benchmarks' inputs and weights.

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

import numpy as np

from ggml_attn.graph.engine import Engine

SHARED_WEIGHTS_ABOVE = {"host": 1 << 30, "device": 16 << 30}


class GraphEngine(Engine):
    """``run_ubatch(plan)``, ``synchronize()``, ``timer()``, ``close()`` (``graph.driver``'s engine)."""

    flavour = "host"
    all_custom = None  # None: as the flavour (device: all-custom); True: all-custom host graph (tests)

    def __init__(self, cfg, cache):
        import ggml
        from ggml_attn import op
        from ggml_attn.graph import AttnConfig
        self.cfg, self.m = cfg, cfg.model
        m = self.m
        device = self.flavour == "device"
        self.xp = cache.xp
        self._saved_settings = op.settings()   # the op's process-wide settings, put back by close()
        if device:
            op.set_backend("cuda", cfg.kernel)
        else:
            op.set_backend("reference", cfg.kernel if cfg.kernel != "ggml" else "auto")
        attn_cfg = AttnConfig(n_layer=m.n_layer, n_head=m.n_head, n_head_kv=m.n_head_kv,
                              head_dim_k=m.head_dim_k, head_dim_v=m.head_dim_v or None,
                              logit_softcap=m.logit_softcap)
        self.attn_cfg = attn_cfg   # (the rank engines' _make_weights read it)
        rng = self.xp.random.default_rng(cfg.seed)  # on the device for the device flavour (fast)
        weights = self._make_weights(rng) if cfg.layer == "full" else None
        model = self._load_model() if cfg.layer == "model" else None
        super().__init__(cache, model.attn_config() if model is not None else attn_cfg, layer=cfg.layer,
                         model=model, weights=weights,
                         fa=ggml.ggml_flash_attn_ext if cfg.kernel == "ggml" else None,
                         flash_attn=cfg.flash_attn, n_threads=cfg.n_threads,
                         cuda_graph=bool(getattr(cfg, "cuda_graph", True)), device=device,
                         all_custom=self.all_custom)
        # random input values, sliced per ubatch; split_equal may give n_ubatch + 1 rows, and no
        # ubatch has more rows than the cache has cells (a -ub of 100000000 must not allocate them)
        self.pool_width = width = max(m.n_embd_q, m.n_embd, m.n_embd_k, m.n_embd_v)
        self.pool = rng.standard_normal(width * (min(cfg.n_ubatch, cache.n_ctx) + 1), dtype=np.float32)
        if device:
            self.xp.cuda.Device().synchronize()   # the pool, made on the default stream

    def _make_weights(self, rng):
        m = self.m

        def w(n_in, n_out):  # numpy (n_out, n_in) = ggml [n_in, n_out], N(0, 1/n_in)
            return (rng.standard_normal((n_out, n_in), dtype=np.float32) / np.sqrt(n_in)).astype(np.float16)

        shared = m.n_layer * m.layer_params() * 2 > SHARED_WEIGHTS_ABOVE[self.flavour]
        sets = [dict(wq=w(m.n_embd, m.n_embd_q), wk=w(m.n_embd, m.n_embd_k), wv=w(m.n_embd, m.n_embd_v),
                     wo=w(m.n_head * m.head_dim_v, m.n_embd), wg=w(m.n_embd, m.n_ff), wu=w(m.n_embd, m.n_ff),
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
        q = pool[: m.n_embd_q * n_tok].reshape(ns, m.n_head, plan.n_tps, m.head_dim_k).transpose(0, 2, 1, 3)
        return (q.reshape(n_tok, m.n_head, m.head_dim_k), pool[: m.n_embd_k * n_tok].reshape(n_tok, m.n_embd_k),
                pool[: m.n_embd_v * n_tok].reshape(n_tok, m.n_embd_v))

    def timer(self):
        from .common import CudaTimer, WallTimer
        return CudaTimer(self.stream) if self.device else WallTimer()

    def close(self) -> None:
        from ggml_attn import op
        super().close()
        saved, self._saved_settings = getattr(self, "_saved_settings", None), None
        if saved is not None:   # a CPU engine's "reference" must not outlive it (device graphs after it)
            op.set_backend(*saved)
