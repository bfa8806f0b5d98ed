"""The decode loop: one batch through the KV cache, one planned ubatch at a time, on an engine.

:func:`decode` is what ``qkv_runner.run_batch`` and the CLI's ``Runner.decode`` both run, as
llama.cpp's ``llama_decode`` does: validate the batch against the cache -> split it into
ubatches (``auto`` included: its dry-run plans are applied as they are, nothing is planned
twice -- unless bucket pads changed the ubatches: then they are planned again, and ``auto``'s
costs did not count the pads) -> on a one-stream cache that coarsens shapes for graph reuse (``KVCache.coarse_n_kv``),
each ubatch padded to a bucket of rows (``split.pad_to_bucket``: a server's steps fall into a few
graph structures; not where the pads do not fit) -> check that every ubatch fits
(``KVCache.prepare``; a ``padded`` split whose pads alone do not fit runs as ``equal``,
:func:`_fit`) -> per ubatch, in a cache
transaction: plan (``plan_ubatch`` with the config's ``n_swa`` and ALiBi), ``engine.run_ubatch``,
free the pads.

An *engine* has ``run_ubatch(plan)`` (computes every layer of the planned ubatch; may return a
result, handed to ``on_done``), ``synchronize()``, ``timer()`` and ``close()``.

Failures: everything that can be checked without touching the cache (validation, split, room)
raises before the first cell is claimed (``on_error(stage, exc)`` may turn it into another
exception; stages ``"validate"``, ``"split"``, ``"prepare"``). A ubatch that fails -- planning,
compute, reading results, Ctrl-C -- has its cells (positions, sequence sets, pad flags) and
the stream heads put back as they were; the ubatches before it stay in the cache (as
llama.cpp's decode keeps them), and :class:`BatchError` (or :class:`BatchInterrupted`, still a
``KeyboardInterrupt``) says which ubatches were applied and which tokens were not
(``.remaining``, a batch that continues the cache).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .auto import choose_split, split_ubatches
from .batch import Batch
from .kv_cache import KVCache, KVCacheFullError
from .plan import UBatchPlan, apply_plan, plan_ubatch
from .attn_config import AttnConfig
from .split import UBatch, pad_to_bucket

__all__ = ["BatchResult", "BatchError", "BatchInterrupted", "decode", "split_batch"]


@dataclass(eq=False)
class BatchResult:
    """out: float32 numpy ``(n_layer, n_tokens, n_head, head_dim_v)``, batch order (real tokens only;
    None when the engine returns no outputs); plans: the plan of every ubatch, in order."""

    out: np.ndarray | None
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


def _stage(stage: str, on_error, fn):
    try:
        return fn()
    except (ValueError, KVCacheFullError) as e:
        mapped = on_error(stage, e) if on_error is not None else None
        if mapped is None:
            raise
        raise mapped from e


def split_batch(cache: KVCache | None, batch: Batch, n_ubatch: int, mode: str, cfg: AttnConfig | None = None):
    """``(ubatches, plans)``: ``auto`` on a cache asks for its choice and hands back the plans it
    dry-ran on the cache as it is now, bucket pads included (:func:`_bucketed`; None when it chose
    without dry runs, then the ubatches get their pads here); the other modes split only (plans
    None); ``padded`` on a cache whose room its pads exceed gives the split :func:`decode` runs
    instead (:func:`_fit`).
    Changes nothing."""
    ubs, plans = _split(cache, batch, n_ubatch, mode, cfg)
    if cache is None or plans is not None:   # (auto's plans are of its ubatches as decode runs them)
        return ubs, plans
    padded = _bucketed(cache, ubs, n_ubatch)   # (as decode runs them: bucket pads on the CUDA engines' caches)
    if padded is not ubs:
        try:
            cache.prepare(padded)
            return padded, None
        except KVCacheFullError:
            pass
    if mode == "padded":
        try:
            ubs = _fit(cache, batch, ubs, n_ubatch, mode)
        except KVCacheFullError:
            pass   # decode's prepare stage reports it
    return ubs, plans


def _split(cache, batch, n_ubatch, mode, cfg):
    if mode == "auto":
        # auto costs and dry-runs the ubatches with their bucket pads (without them where they
        # do not fit), so its plans run as they are: planned once, as the other modes' are
        choice = choose_split(batch, n_ubatch, cache=cache, cfg=cfg, shape=lambda ubs: _bucketed(cache, ubs, n_ubatch))
        return choice.ubatches, choice.plans
    return split_ubatches(batch, n_ubatch, mode), None


def _fit(cache: KVCache, batch: Batch, ubs: list[UBatch], n_ubatch: int, mode: str) -> list[UBatch]:
    """``ubs`` once they are found to fit the cache one after another (``KVCache.prepare``),
    the one place where a split meets the cache's room. A ``padded`` split whose pad rows do not
    fit (a padded ubatch holds its pad cells until it is done, so a cache with room for the real
    tokens can be short of them) gives way to the ``equal`` split of the same batch, which has no
    pads: a batch whose real tokens fit is never refused for its pads. Raises
    :class:`KVCacheFullError` when the real tokens do not fit."""
    try:
        cache.prepare(ubs)
        return ubs
    except KVCacheFullError as e:
        if mode != "padded" or not any(u.n_pad for u in ubs):
            raise
        why = e
    equal = split_ubatches(batch, n_ubatch, "equal")
    cache.prepare(equal)   # KVCacheFullError: the real tokens do not fit either
    note = f"padded: the pad rows do not fit the cache ({why}); the equal split instead, no pads"
    return [replace(u, reason=note) for u in equal]


def _bucketed(cache: KVCache, ubs: list[UBatch], n_ubatch: int) -> list[UBatch]:
    """``ubs`` with each ubatch padded to its bucket of rows (``split.pad_to_bucket``; at most
    ``n_ubatch`` rows) on a one-stream cache that coarsens shapes for graph reuse
    (``KVCache.coarse_n_kv``: the CUDA engines); ``ubs`` itself where none changes."""
    if not cache.coarse_n_kv or cache.n_stream != 1:
        return ubs
    out = [pad_to_bucket(u, cache.n_seq_max, lambda s: cache.seq_pos_max(s) + 1, n_ubatch) for u in ubs]
    return ubs if all(a is b for a, b in zip(out, ubs)) else out


def _fit_either(cache: KVCache, batch: Batch, ubs: list[UBatch], plain: list[UBatch], n_ubatch: int,
                mode: str) -> list[UBatch]:
    """``ubs`` where they fit the cache's room with their bucket pads (:func:`_bucketed`), else
    :func:`_fit` of ``plain``, the ubatches without them (a ``padded`` split's own fallback
    included)."""
    if ubs is not plain:
        try:
            cache.prepare(ubs)
            return ubs
        except KVCacheFullError:
            pass
    return _fit(cache, batch, plain, n_ubatch, mode)


def _check_pos_limit(batch: Batch, limit: int) -> None:
    if batch.n_tokens and int(batch.positions.max()) >= limit:
        first = int(batch.positions[batch.positions >= limit].min())
        raise ValueError(f"position {first} is past this model's sliding window ({limit} "
                         f"tokens): its window layers run as dense layers here, which is exact only for "
                         f"positions below {limit}")


def decode(cache: KVCache, batch: Batch, n_ubatch: int, mode: str, engine, cfg: AttnConfig, *,
           ubatches: list[UBatch] | None = None, validate: bool = True, on_error=None,
           before_ubatch=None, on_done=None, out=None) -> list[UBatchPlan]:
    """Run ``batch`` through ``engine``, updating ``cache`` (module docstring); returns the plan
    of every ubatch, in order. ``ubatches``: a split to use instead of ``mode``'s.
    ``before_ubatch()`` runs before each ubatch's transaction (e.g. a Ctrl-C check);
    ``on_done(plan, result)`` after a ubatch went through (its cells committed); ``out`` is
    what a :class:`BatchError`'s ``.result`` carries."""
    if validate:
        _stage("validate", on_error, lambda: cache.validate(batch))
    if cfg.pos_limit:   # (checked whether or not the caller validated the rest)
        _stage("validate", on_error, lambda: _check_pos_limit(batch, cfg.pos_limit))
    made, given = None, ubatches is not None
    plain = ubatches
    if not given:
        plain, made = _stage("split", on_error, lambda: _split(cache, batch, n_ubatch, mode, cfg))
        # (auto's plans are of its ubatches as they run: with their bucket pads, or without where
        # those did not fit; a split without plans gets its pads here)
        ubatches = plain if made is not None else _bucketed(cache, plain, n_ubatch)
    if made is None:  # (auto's dry run already placed every ubatch one after another)
        fit_mode = mode if not given else "given"   # a split the caller made is run as it is
        ubatches = _stage("prepare", on_error, lambda: _fit_either(cache, batch, ubatches, plain, n_ubatch, fit_mode))
    plans: list[UBatchPlan] = []
    for i, ub in enumerate(ubatches):
        try:
            if before_ubatch is not None:
                before_ubatch()
            with cache.transaction():  # a failure puts this ubatch's cells back as they were
                # place in the cache, mask and tile map: once per ubatch, for every layer
                plan = (apply_plan(cache, made[i]) if made is not None
                        else plan_ubatch(cache, ub, n_swa=cfg.n_swa, alibi=cfg.alibi))
                res = engine.run_ubatch(plan)
                cache.free_pads(plan.slot)
                if on_done is not None:
                    on_done(plan, res)
        except BaseException as e:  # noqa: BLE001 - Ctrl-C included: it is re-raised as BatchInterrupted
            raise _failure(e, batch, ubatches, plans, out) from e
        plans.append(plan)
    return plans
