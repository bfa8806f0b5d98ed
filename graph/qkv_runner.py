"""Run a batch through the cache with deterministic Q/K/V: ``driver.decode`` on one of two
engines, results per real token, in batch order.

Two ways to compute a ubatch, same inputs, same cache updates:

* ``compute="numpy"``: K/V rows written with ``KVCache.write_rows`` and attention by the
  numpy reference (``ggml_attn.reference``) on views of the cache; no ggml involved.
* ``compute="ggml"``: the ubatch graph from ``build.py`` (host graph on a numpy cache,
  device-resident graph on a CuPy cache), attention op ``fa`` (ours by default), on a
  :class:`QKVEngine` kept with the cache: graphs built once per structure and reused by later
  ubatches and calls.

Failures are the driver's (``driver.py``): everything that can be checked without touching the
cache (the batch against the cache, the split, room for every ubatch, the config's geometry,
the graph options) is checked before the first cell is claimed; a failed ubatch is rolled back
and raises :class:`BatchError` / :class:`BatchInterrupted` with the ubatches before it applied.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ggml_attn import reference

from . import driver
from .batch import Batch
from .driver import BatchError, BatchInterrupted, BatchResult
from .engine import Engine, UntimedEngine, kept_engine
from .kv_cache import KVCache
from .plan import UBatchPlan
from .attn_config import AttnConfig
from .qkv import token_qkv
from .split import UBatch

__all__ = ["BatchResult", "BatchError", "BatchInterrupted", "QKVEngine", "qkv_engine", "run_batch", "ubatch_inputs"]


def ubatch_inputs(ub: UBatch, layer: int, cfg: AttnConfig):
    """Q/K/V of the ubatch's rows for ``layer`` (``qkv.token_qkv``), ubatch row order."""
    return token_qkv(ub.primary_seq_ids, ub.positions, ub.is_pad, layer, cfg)


def _attend_numpy(cache: KVCache, plan: UBatchPlan, layer: int, q: np.ndarray, cfg: AttnConfig) -> np.ndarray:
    """Attention of one layer on the cache's host arrays; returns (n_tokens, n_head, head_dim_v) f32."""
    s0, s1, n_kv = plan.slot.s0, plan.slot.s1, plan.n_kv
    ns, n_tps = plan.n_stream, plan.n_tps
    k = np.asarray(cache.k[layer, s0:s1 + 1, :n_kv]).reshape(ns, n_kv, cfg.n_head_kv, cfg.head_dim_k)
    v = np.asarray(cache.v[layer, s0:s1 + 1, :n_kv]).reshape(ns, n_kv, cfg.n_head_kv, cfg.head_dim_v)
    q4 = q.reshape(ns, n_tps, cfg.n_head, cfg.head_dim_k).transpose(0, 2, 1, 3)
    out = reference.flash_attn_ext(q4, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), plan.mask,
                                   cfg.scale, cfg.max_bias, cfg.logit_softcap, dtype=np.float32)
    return out.reshape(plan.ubatch.n_tokens, cfg.n_head, cfg.head_dim_v)


class _NumpyEngine(UntimedEngine):
    """Engine of :func:`run_batch` with ``compute="numpy"``: deterministic Q/K/V
    (``ubatch_inputs``) through every layer, K/V written with ``KVCache.write_rows``, attention
    by the reference; ``run_ubatch`` returns float32 ``(n_layer, n_real, n_head, head_dim_v)`` of the
    real rows."""

    def __init__(self, cache: KVCache, cfg: AttnConfig):
        self.cache, self.cfg = cache, cfg

    def run_ubatch(self, plan: UBatchPlan) -> np.ndarray:
        cache, cfg, ub = self.cache, self.cfg, plan.ubatch
        real = ~ub.is_pad
        res = np.zeros((cfg.n_layer, int(real.sum()), cfg.n_head, cfg.head_dim_v), dtype=np.float32)
        for il in range(cfg.n_layer):
            q, k, v = ubatch_inputs(ub, il, cfg)
            cache.write_rows(il, plan.slot, k.reshape(ub.n_tokens, -1), v.reshape(ub.n_tokens, -1))
            res[il] = _attend_numpy(cache, plan, il, q, cfg)[real]
        return res


class QKVEngine(Engine):
    """Engine of :func:`run_batch` with ``compute="ggml"`` (``engine.Engine``, ``layer="attn"``):
    the ubatch's deterministic Q/K/V of every layer (``ubatch_inputs``) into a graph built once
    per structure and reused; ``run_ubatch`` returns float32 ``(n_layer, n_real, n_head, head_dim_v)``
    of the real rows. :func:`qkv_engine` keeps one per cache and config, so the calls of
    :func:`run_batch` (each decode step) reuse the graphs of the calls before. CUDA-graph replay
    is off (:attr:`CUDA_GRAPHS`, as ``model_runner.ModelEngine``'s)."""

    CUDA_GRAPHS = False
    inputs_once = False   # every ubatch brings its own Q/K/V

    def __init__(self, cache: KVCache, cfg: AttnConfig, *, fa=None, all_custom=None, n_threads: int = 2):
        super().__init__(cache, cfg, layer="attn", fa=fa, n_threads=n_threads, all_custom=all_custom,
                         shared_inputs=False, cuda_graph=self.CUDA_GRAPHS)

    def set_attn_inputs(self, g, plan) -> None:
        ins = [ubatch_inputs(plan.ubatch, il, self.attn_cfg) for il in range(self.attn_cfg.n_layer)]
        g.set_inputs(*[[self.xp.asarray(x[j]) for x in ins] for j in range(3)])

    def ubatch_result(self, g, plan) -> np.ndarray:
        real = ~plan.ubatch.is_pad
        res = np.empty((self.attn_cfg.n_layer, int(real.sum()), self.attn_cfg.n_head, self.attn_cfg.head_dim_v),
                       dtype=np.float32)
        for il, o in enumerate(g.outputs()):
            res[il] = (o.get() if hasattr(o, "get") else o)[real]
        return res


def qkv_engine(cache: KVCache, cfg: AttnConfig, *, fa=None, all_custom=None, n_threads: int = 2) -> QKVEngine:
    """The :class:`QKVEngine` of ``cache``, ``cfg``, ``fa`` and ``all_custom``, made on the first
    call and kept with the cache (``engine.kept_engine``: its graphs view the cache's memory and
    go with it). The config's ``seed`` picks only the inputs: one engine serves every seed."""
    e = kept_engine(cache, ("qkv", replace(cfg, seed=0), all_custom),
                    lambda: QKVEngine(cache, cfg, fa=fa, all_custom=all_custom, n_threads=n_threads),
                    fits=lambda e: e.fa is fa)   # (another op: graphs of their own)
    e.attn_cfg = cfg
    if not e.device:
        e.n_threads = n_threads
    e.follow_current_stream()
    return e


def run_batch(cache: KVCache, batch: Batch, n_ubatch: int, mode: str, cfg: AttnConfig | None = None, *,
              compute: str = "numpy", fa=None, n_threads: int = 2, validate: bool = True,
              ubatches: list[UBatch] | None = None, all_custom: bool | None = None, model=None,
              logits="last"):
    """Process ``batch`` through ``cfg.n_layer`` attention layers, updating ``cache``.

    With ``model`` (a ``graph.model.Model``, from ``graph.model.load_gguf``): the batch's token
    ids go through the real model instead (``model_runner.run_model_batch``; ``cfg`` is the
    model's, ``compute`` ggml graphs) and the result is a ``model_runner.ModelResult``: logits
    of the tokens ``logits`` asks for (``"last"``: each sequence's last token; ``"all"``).

    The config is checked against the cache, the batch validated against the cache, split
    (``mode``; or the given ``ubatches``), and checked to fit (``KVCache.prepare``); any of
    these errors (``ValueError``, ``KVCacheFullError``, ``GraphBuildError``) leaves the cache
    unchanged. Each ubatch is planned once (cells, mask, tile map) and the plan reused by all
    layers (with ``auto``, the plans its choice dry-ran are applied, not made again); its pad
    cells are freed right after it. A ubatch that fails raises
    :class:`BatchError` / :class:`BatchInterrupted` with the cache holding exactly the ubatches
    before it (``driver.py``). ``fa`` and ``all_custom`` go to ``build.build_ubatch_graph``
    (``compute="ggml"`` only).
    """
    from ggml_attn.runtime import check_n_threads  # noqa: PLC0415
    check_n_threads(n_threads)   # before any cell is claimed
    if model is not None:
        if ubatches is not None:
            raise ValueError("run_batch(model=...) splits the batch itself (mode); ubatches= is for Q/K/V runs")
        from .model_runner import run_model_batch  # noqa: PLC0415
        return run_model_batch(cache, batch, model, n_ubatch, mode, logits=logits, n_threads=n_threads, fa=fa,
                               validate=validate)
    if cfg is None:
        raise ValueError("run_batch needs cfg (an AttnConfig) or model")
    if compute not in ("numpy", "ggml"):
        raise ValueError(f"compute must be 'numpy' or 'ggml', got {compute!r}")
    # everything that can fail without touching the cache, before the first cell is claimed
    from .build import check_build_args, check_geometry  # noqa: PLC0415
    check_geometry(cache, cfg)
    if compute == "ggml":
        check_build_args(cache, cfg, fa=fa, all_custom=all_custom)
    elif not cache.float_storage:
        raise ValueError(f"compute='numpy' needs an f16/f32 KV cache; this one is K {cache.type_k} / "
                         f"V {cache.type_v} (compute='ggml' runs it)")
    out = np.zeros((cfg.n_layer, batch.n_tokens, cfg.n_head, cfg.head_dim_v), dtype=np.float32)

    def done(plan: UBatchPlan, res: np.ndarray) -> None:
        idx = plan.ubatch.token_idx
        out[:, idx[~plan.ubatch.is_pad]] = res  # only once the whole ubatch went through

    engine = qkv_engine(cache, cfg, fa=fa, all_custom=all_custom, n_threads=n_threads) if compute == "ggml" \
        else _NumpyEngine(cache, cfg)
    plans = driver.decode(cache, batch, n_ubatch, mode, engine, cfg, ubatches=ubatches, validate=validate,
                          on_done=done, out=out)
    return BatchResult(out, plans)
