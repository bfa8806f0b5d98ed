"""Run a batch through the cache: split, plan each ubatch once, compute every layer, free pads.

Two ways to compute a ubatch, same inputs, same cache updates:

* ``compute="numpy"``: K/V rows written with ``KVCache.write_rows`` and attention by the
  numpy reference (``ggml_attn.reference``) on views of the cache; no ggml involved.
* ``compute="ggml"``: the ubatch graph from ``build.py`` (host graph on a numpy cache,
  device-resident graph on a CuPy cache), attention op ``fa`` (ours by default).

Results are per real token, in batch order.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ggml_attn import reference

from .batch import Batch
from .kv_cache import KVCache
from .plan import UBatchPlan, plan_ubatch
from .qkv import AttnConfig, token_qkv
from .split import UBatch, split_ubatches

__all__ = ["BatchResult", "run_batch", "ubatch_inputs"]


@dataclass(eq=False)
class BatchResult:
    """out: float32 numpy ``(n_layer, n_tokens, n_head, D_v)``, batch order (real tokens only);
    plans: the plan of every ubatch, in order."""

    out: np.ndarray
    plans: list[UBatchPlan]

    @property
    def ubatches(self) -> list[UBatch]:
        return [p.ubatch for p in self.plans]


def ubatch_inputs(ub: UBatch, layer: int, cfg: AttnConfig):
    """Q/K/V of the ubatch's rows for ``layer`` (``qkv.token_qkv``), ubatch row order."""
    return token_qkv(ub.primary_seq_ids, ub.positions, ub.is_pad, layer, cfg)


def _attend_numpy(cache: KVCache, plan: UBatchPlan, layer: int, q: np.ndarray, cfg: AttnConfig) -> np.ndarray:
    """Attention of one layer on the cache's host arrays; returns (n_tokens, n_head, D_v) f32."""
    s0, s1, n_kv = plan.slot.s0, plan.slot.s1, plan.n_kv
    ns, n_tps = plan.n_stream, plan.n_tps
    k = np.asarray(cache.k[layer, s0:s1 + 1, :n_kv]).reshape(ns, n_kv, cfg.n_head_kv, cfg.head_dim)
    v = np.asarray(cache.v[layer, s0:s1 + 1, :n_kv]).reshape(ns, n_kv, cfg.n_head_kv, cfg.d_v)
    q4 = q.reshape(ns, n_tps, cfg.n_head, cfg.head_dim).transpose(0, 2, 1, 3)
    out = reference.flash_attn_ext(q4, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), plan.mask,
                                   cfg.scale, cfg.max_bias, cfg.logit_softcap, dtype=np.float32)
    return out.reshape(plan.ubatch.n_tokens, cfg.n_head, cfg.d_v)


def run_batch(cache: KVCache, batch: Batch, n_ubatch: int, mode: str, cfg: AttnConfig, *,
              compute: str = "numpy", fa=None, n_threads: int = 2, validate: bool = True,
              ubatches: list[UBatch] | None = None, all_custom: bool | None = None) -> BatchResult:
    """Process ``batch`` through ``cfg.n_layer`` attention layers, updating ``cache``.

    The batch is validated against the cache, split (``mode``; or the given ``ubatches``), and
    checked to fit (``KVCache.prepare``: on ``KVCacheFullError`` the cache is unchanged). Each
    ubatch is planned once (cells, mask, tile map) and the plan reused by all layers; its pad
    cells are freed right after it. ``fa`` and ``all_custom`` go to ``build.build_ubatch_graph``
    (``compute="ggml"`` only).
    """
    if compute not in ("numpy", "ggml"):
        raise ValueError(f"compute must be 'numpy' or 'ggml', got {compute!r}")
    if validate:
        cache.validate(batch)
    ubs = ubatches
    if ubs is None:
        auto_kw = {"cache": cache, "cfg": cfg} if mode == "auto" else {}
        ubs = split_ubatches(batch, n_ubatch, mode, **auto_kw)
    cache.prepare(ubs)
    out = np.zeros((cfg.n_layer, batch.n_tokens, cfg.n_head, cfg.d_v), dtype=np.float32)
    plans = []
    for ub in ubs:
        plan = plan_ubatch(cache, ub, n_swa=cfg.n_swa, alibi=cfg.alibi)
        real = ~ub.is_pad
        dest = ub.token_idx[real]
        if compute == "ggml":
            from .build import build_ubatch_graph  # noqa: PLC0415
            g = build_ubatch_graph(cache, plan, cfg, fa=fa, all_custom=all_custom)
            ins = [ubatch_inputs(ub, il, cfg) for il in range(cfg.n_layer)]
            g.set_inputs(*[[cache.xp.asarray(x[j]) for x in ins] for j in range(3)])
            g.compute(n_threads)
            for il, o in enumerate(g.outputs()):
                o = o.get() if hasattr(o, "get") else o
                out[il, dest] = o[real]
            g.free()
        else:
            for il in range(cfg.n_layer):
                q, k, v = ubatch_inputs(ub, il, cfg)
                cache.write_rows(il, plan.slot, k.reshape(ub.n_tokens, -1), v.reshape(ub.n_tokens, -1))
                out[il, dest] = _attend_numpy(cache, plan, il, q, cfg)[real]
        cache.free_pads(plan.slot)
        plans.append(plan)
    return BatchResult(out, plans)
