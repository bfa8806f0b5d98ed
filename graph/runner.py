"""Run a batch through the cache: split, plan each ubatch once, compute every layer, free pads.

Two ways to compute a ubatch, same inputs, same cache updates:

* ``compute="numpy"``: K/V rows written with ``KVCache.write_rows`` and attention by the
  numpy reference (``ggml_attn.reference``) on views of the cache; no ggml involved.
* ``compute="ggml"``: the ubatch graph from ``build.py`` (host graph on a numpy cache,
  device-resident graph on a CuPy cache), attention op ``fa`` (ours by default).

Results are per real token, in batch order.

A failed batch: everything that can be checked without touching the cache (the batch against
the cache, the split, room for every ubatch, the config's geometry, the graph options) is
checked before the first cell is claimed. Each ubatch then runs in a cache transaction: when
it fails -- graph build, an op error during compute, reading the results, Ctrl-C -- its cells
(positions, sequence sets, pad flags) and the stream heads are put back as they were, the
ubatches before it stay in the cache (as llama.cpp's decode keeps them and removes the failed
ubatch's positions), and :class:`BatchError` (or :class:`BatchInterrupted`, still a
``KeyboardInterrupt``) says which ubatches were applied and which tokens were not
(``.remaining``, a batch that continues the cache).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ggml_attn import reference

from .auto import choose_split
from .batch import Batch
from .kv_cache import KVCache
from .plan import UBatchPlan, apply_plan, plan_ubatch
from .qkv import AttnConfig, token_qkv
from .split import UBatch, split_ubatches

__all__ = ["BatchResult", "BatchError", "BatchInterrupted", "run_batch", "ubatch_inputs"]


@dataclass(eq=False)
class BatchResult:
    """out: float32 numpy ``(n_layer, n_tokens, n_head, D_v)``, batch order (real tokens only);
    plans: the plan of every ubatch, in order."""

    out: np.ndarray
    plans: list[UBatchPlan]

    @property
    def ubatches(self) -> list[UBatch]:
        return [p.ubatch for p in self.plans]


class _BatchFailure:
    """What a failed batch left: ``failed`` (index of the ubatch that failed), ``applied``
    (the plans of the ubatches before it, all in the cache), ``ubatches`` (every ubatch of the
    batch), ``remaining`` (a :class:`Batch` of the tokens not in the cache, batch order, or None
    when there are none), ``result`` (:class:`BatchResult` with the outputs of the applied
    ubatches' tokens; zeros elsewhere). The cause is ``__cause__``."""

    def _fill(self, failed, applied, ubatches, remaining, result):
        self.failed, self.applied, self.ubatches = failed, applied, ubatches
        self.remaining, self.result = remaining, result


class BatchError(_BatchFailure, RuntimeError):
    """A ubatch failed; the cache holds the ubatches before it and nothing of the failed one."""


class BatchInterrupted(_BatchFailure, KeyboardInterrupt):
    """Ctrl-C during a ubatch; the cache holds the ubatches before it and nothing of that one."""


def _failure(exc: BaseException, batch: Batch, ubs: list[UBatch], plans: list[UBatchPlan], out) -> BaseException:
    i = len(plans)
    done = np.zeros(batch.n_tokens, dtype=bool)
    for p in plans:
        idx = p.ubatch.token_idx
        done[idx[idx >= 0]] = True
    rest = np.flatnonzero(~done)
    remaining = None
    if rest.size:
        remaining = Batch(batch.tokens[rest], batch.positions[rest], tuple(batch.seq_ids[j] for j in rest))
    applied = f"ubatches 0..{i - 1} ({int(done.sum())} tokens)" if i else "no ubatch"
    cls = BatchInterrupted if isinstance(exc, KeyboardInterrupt) else BatchError
    what = "interrupted" if cls is BatchInterrupted else f"failed: {exc!r}"
    err = cls(f"ubatch {i} of {len(ubs)} {what}; the KV cache holds {applied} of this batch and nothing "
              f"of ubatch {i} (its cells are free again); {rest.size} token(s) not applied (.remaining)")
    err._fill(i, list(plans), list(ubs), remaining, BatchResult(out, list(plans)))
    return err


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

    The config is checked against the cache, the batch validated against the cache, split
    (``mode``; or the given ``ubatches``), and checked to fit (``KVCache.prepare``); any of
    these errors (``ValueError``, ``KVCacheFullError``, ``GraphBuildError``) leaves the cache
    unchanged. Each ubatch is planned once (cells, mask, tile map) and the plan reused by all
    layers (with ``auto``, the plans its choice dry-ran are applied, not made again); its pad
    cells are freed right after it. A ubatch that fails raises
    :class:`BatchError` / :class:`BatchInterrupted` with the cache holding exactly the ubatches
    before it (module docstring). ``fa`` and ``all_custom`` go to ``build.build_ubatch_graph``
    (``compute="ggml"`` only).
    """
    if compute not in ("numpy", "ggml"):
        raise ValueError(f"compute must be 'numpy' or 'ggml', got {compute!r}")
    # everything that can fail without touching the cache, before the first cell is claimed
    from .build import check_build_args, check_geometry  # noqa: PLC0415
    check_geometry(cache, cfg)
    if compute == "ggml":
        check_build_args(cache, cfg, fa=fa, all_custom=all_custom)
    if validate:
        cache.validate(batch)
    ubs, made = ubatches, None
    if ubs is None and mode == "auto":
        # auto dry-ran its choice on this cache: its plans are the ones to run (no second planning)
        choice = choose_split(batch, n_ubatch, cache=cache, cfg=cfg)
        ubs, made = choice.ubatches, choice.plans
    elif ubs is None:
        ubs = split_ubatches(batch, n_ubatch, mode)
    if made is None:
        cache.prepare(ubs)  # (auto's dry run already placed every ubatch one after another)
    out = np.zeros((cfg.n_layer, batch.n_tokens, cfg.n_head, cfg.d_v), dtype=np.float32)
    plans: list[UBatchPlan] = []
    for i, ub in enumerate(ubs):
        try:
            with cache.transaction():  # a failure puts this ubatch's cells back as they were
                plan = _run_ubatch(cache, ub, cfg, out, compute, fa, n_threads, all_custom,
                                   made[i] if made is not None else None)
        except BaseException as e:  # noqa: BLE001 - Ctrl-C included: it is re-raised as BatchInterrupted
            raise _failure(e, batch, ubs, plans, out) from e
        plans.append(plan)
    return BatchResult(out, plans)


def _run_ubatch(cache: KVCache, ub: UBatch, cfg: AttnConfig, out: np.ndarray, compute: str, fa,
                n_threads: int, all_custom, made: UBatchPlan | None = None) -> UBatchPlan:
    """Plan (or apply ``made``, a dry-run plan of ``ub``), compute every layer into ``out``
    (batch order), free the pads."""
    plan = apply_plan(cache, made) if made is not None else plan_ubatch(cache, ub, n_swa=cfg.n_swa, alibi=cfg.alibi)
    real = ~ub.is_pad
    dest = ub.token_idx[real]
    res = np.zeros((cfg.n_layer, int(real.sum()), cfg.n_head, cfg.d_v), dtype=np.float32)
    if compute == "ggml":
        from .build import build_ubatch_graph  # noqa: PLC0415
        g = build_ubatch_graph(cache, plan, cfg, fa=fa, all_custom=all_custom)
        try:
            ins = [ubatch_inputs(ub, il, cfg) for il in range(cfg.n_layer)]
            g.set_inputs(*[[cache.xp.asarray(x[j]) for x in ins] for j in range(3)])
            g.compute(n_threads)
            for il, o in enumerate(g.outputs()):
                o = o.get() if hasattr(o, "get") else o
                res[il] = o[real]
        finally:
            g.free()
    else:
        for il in range(cfg.n_layer):
            q, k, v = ubatch_inputs(ub, il, cfg)
            cache.write_rows(il, plan.slot, k.reshape(ub.n_tokens, -1), v.reshape(ub.n_tokens, -1))
            res[il] = _attend_numpy(cache, plan, il, q, cfg)[real]
    cache.free_pads(plan.slot)
    out[:, dest] = res  # only once the whole ubatch went through
    return plan
