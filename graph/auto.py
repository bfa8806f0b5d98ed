"""``auto``: pick the split strategy per batch from a cost model, and say why.

Every strategy the cache can run is planned on the side (``plan.dry_run_plans``: cells, masks
and tile maps, the cache left untouched) and costed per layer as

    n_ubatches * ubatch_us  +  rows * row_us  +  kv_tiles * tile_us

* ``rows``: query rows computed, pads included (projections and the rest of a layer pay for
  every row);
* ``kv_tiles``: (64-row query tile, 256-cell KV tile) pairs the attention kernel visits after
  masking: every live tile when the kernel skips all fully masked tiles (``skip="all"``,
  FlashInfer-style plans, the default), or everything up to the last live tile of each query
  tile (``skip="tail"``, as llama.cpp's CUDA kernels do);
* ``n_ubatches``: graph evaluations (launches, plan, and in a whole model one pass over the
  weights each).

The constants are estimates for one H200: a 64x256 tile of D=128 with 32
heads is 268 MFLOP, ~1.3 us at ~200 TFLOP/s; 10 us of fixed cost per ubatch and layer;
0.02 us per row and layer. Change them through :class:`CostModel`.

Candidates: ``simple``, ``equal``, ``padded`` on a unified cache; ``equal``, ``seq``,
``padded`` on a split cache. Ties go to the earlier candidate (llama.cpp's choice first).
Fast path, no dry runs: when every sequence brings the same number of tokens (consecutive
ids, no shared tokens; e.g. every decode step) ``padded`` equals ``equal`` with no pads, so
``simple`` (unified) or ``equal`` (split) is chosen directly.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .batch import Batch
from .kv_cache import KVCache
from .plan import Q_TILE, KV_TILE, UBatchPlan, dry_run_plans
from .qkv import AttnConfig
from .split import UBatch, split_ubatches

__all__ = ["CostModel", "StrategyCost", "AutoChoice", "choose_split", "candidates_for", "cost_of"]


@dataclass(frozen=True)
class CostModel:
    """Per-layer cost constants, microseconds (see module doc)."""

    ubatch_us: float = 10.0
    row_us: float = 0.02
    tflops: float = 200.0
    skip: str = "all"  # "all": skip every fully masked KV tile; "tail": only the masked tail

    def tile_us(self, cfg: AttnConfig) -> float:
        flop = 2.0 * Q_TILE * KV_TILE * (cfg.head_dim + cfg.d_v) * cfg.n_head
        return flop / (self.tflops * 1e12) * 1e6


@dataclass(frozen=True)
class StrategyCost:
    mode: str
    n_ubatches: int
    rows: int
    n_pad: int
    kv_tiles: int
    est_us: float

    def line(self) -> str:
        return (f"{self.mode}: {self.n_ubatches} ubatch(es), {self.rows} rows ({self.n_pad} pad), "
                f"{self.kv_tiles} KV tiles -> {self.est_us:.1f} us")


@dataclass(frozen=True)
class AutoChoice:
    """The chosen ``mode``, its ubatches (each carrying ``reason``), every candidate's cost."""

    mode: str
    ubatches: list[UBatch]
    costs: list[StrategyCost]
    reason: str


def candidates_for(unified: bool) -> tuple[str, ...]:
    return ("simple", "equal", "padded") if unified else ("equal", "seq", "padded")


def cost_of(mode: str, plans: list[UBatchPlan], cfg: AttnConfig, model: CostModel) -> StrategyCost:
    rows = sum(p.ubatch.n_tokens for p in plans)
    n_pad = sum(p.ubatch.n_pad for p in plans)
    if model.skip == "all":
        tiles = sum(p.tiles.n_live for p in plans)
    elif model.skip == "tail":
        tiles = sum(p.tiles.n_tail_skip for p in plans)
    else:
        raise ValueError(f"CostModel.skip must be 'all' or 'tail', got {model.skip!r}")
    est = cfg.n_layer * (len(plans) * model.ubatch_us + rows * model.row_us + tiles * model.tile_us(cfg))
    return StrategyCost(mode, len(plans), rows, n_pad, tiles, est)


def choose_split(batch: Batch, n_ubatch: int, *, cache: KVCache | None = None, cfg: AttnConfig | None = None,
                 model: CostModel | None = None, unified: bool | None = None) -> AutoChoice:
    """Cost every candidate strategy for ``batch`` on ``cache`` (left unchanged) and pick the
    cheapest. Without a cache a fresh one is assumed: split (llama.cpp's default) unless
    ``unified``, with room for the batch. ``cfg`` gives head sizes for the tile cost
    (default: 32 heads of 128)."""
    cfg = cfg or AttnConfig(n_head=32, n_head_kv=8, head_dim=128)
    model = model or CostModel()
    if model.skip not in ("all", "tail"):
        raise ValueError(f"CostModel.skip must be 'all' or 'tail', got {model.skip!r}")
    if cache is not None and unified is not None and unified != cache.unified:
        raise ValueError(f"unified={unified} contradicts the cache (unified={cache.unified})")
    fast = _uniform_choice(batch, n_ubatch, cache.unified if cache is not None else bool(unified))
    if fast is not None:
        return fast
    if cache is None:
        cache = _scratch_cache(batch, n_ubatch, bool(unified))
    costs, splits = [], {}
    for mode in candidates_for(cache.unified):
        try:
            ubs = split_ubatches(batch, n_ubatch, mode)
            plans = dry_run_plans(cache, ubs, n_swa=cfg.n_swa, alibi=cfg.alibi)
        except (ValueError, RuntimeError) as e:  # e.g. coupled sequences, no room
            costs.append(StrategyCost(mode, 0, 0, 0, 0, float("inf")))
            splits[mode] = e
            continue
        costs.append(cost_of(mode, plans, cfg, model))
        splits[mode] = ubs
    best = min(costs, key=lambda c: c.est_us)
    if best.est_us == float("inf"):
        raise ValueError(f"no strategy can run this batch: {splits}")
    others = "; ".join(c.line() for c in costs if c is not best and c.est_us != float("inf"))
    reason = f"auto chose {best.line()}" + (f"; vs {others}" if others else "")
    ubs = [replace(u, reason=reason) for u in splits[best.mode]]
    return AutoChoice(best.mode, ubs, costs, reason)


def _uniform_choice(batch: Batch, n_ubatch: int, unified: bool) -> AutoChoice | None:
    """The choice without dry runs when the batch leaves nothing to choose (e.g. a decode step):
    no coupled tokens, every sequence brings the same number of tokens and the ids, in batch
    order of first appearance, are consecutive and ascending. Then ``padded`` makes the same
    ubatches as ``equal`` with no pads and ``seq`` only more ubatches, so ``equal`` (llama.cpp's
    split) wins on a split cache, and ``simple`` (fewest ubatches, no pads) on a unified one.
    ``costs`` is empty (nothing was costed). None when the batch is not like that."""
    if batch.has_coupled or batch.n_tokens == 0:
        return None
    counts = batch.seq_token_counts()  # dict order = order of first appearance
    ids = list(counts)
    n = counts[ids[0]]
    if any(c != n for c in counts.values()) or ids != list(range(ids[0], ids[0] + len(ids))):
        return None
    mode = "simple" if unified else "equal"
    reason = (f"auto chose {mode} without dry runs: {len(ids)} sequence(s) of {n} token(s) each, "
              f"consecutive ids, no shared tokens, so padded = equal with no pads")
    ubs = [replace(u, reason=reason) for u in split_ubatches(batch, n_ubatch, mode)]
    return AutoChoice(mode, ubs, [], reason)


def _scratch_cache(batch: Batch, n_ubatch: int, unified: bool) -> KVCache:
    """A metadata-only-sized cache with room for ``batch`` (pads included)."""
    n_seq = max(batch.unique_seq_ids) + 1
    counts = batch.seq_token_counts()
    if unified:
        n_ctx = batch.n_tokens + n_ubatch
    else:
        n_ctx = n_seq * (2 * max(counts.values()) + 1)
    return KVCache(n_ctx, n_seq, unified=unified, n_head_kv=1, head_dim_k=1)
