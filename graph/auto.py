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

Only candidates that can still win are dry-run: every candidate is split (cheap), and its
``n_ubatches``, ``rows`` and a floor of its ``kv_tiles`` -- every (stream, query tile) holding a
real row visits at least one tile, the one with the row's own cell; on a one-stream cache at
least every tile that holds an earlier cell of a row's sequence (:class:`_History`: a server's
decode rows see their whole history, whatever the split) -- give a lower bound of its cost
without placing anything. Candidates are dry-run in order of that bound; one whose
bound already exceeds the best exact cost (or equals it and comes later) is not planned, its
cost is reported as the bound (``StrategyCost.exact`` False). The choice is the same as when
everything is dry-run. With a ``cache``, the chosen split's dry-run plans come back in
``AutoChoice.plans``: placed, masked and tiled on exactly the cache state the batch will run
on, so a driver applies them (``plan.apply_plan``) instead of planning the ubatches again.
Fast path, no dry runs: when every sequence brings the same number of tokens (consecutive
ids, no shared tokens; e.g. every decode step) ``padded`` equals ``equal`` with no pads, so
``simple`` (unified) or ``equal`` (split) is chosen directly.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from . import split as _split
from .batch import Batch
from .kv_cache import KVCache
from .plan import MAP_Q_TILE, MAP_KV_TILE, UBatchPlan, dry_run_plans
from .attn_config import AttnConfig
from .split import UBatch

__all__ = ["CostModel", "StrategyCost", "AutoChoice", "choose_split", "candidates_for", "cost_of",
           "cost_floor", "split_ubatches"]


@dataclass(frozen=True)
class CostModel:
    """Per-layer cost constants, microseconds (see module doc)."""

    ubatch_us: float = 10.0
    row_us: float = 0.02
    tflops: float = 200.0
    skip: str = "all"  # "all": skip every fully masked KV tile; "tail": only the masked tail

    def tile_us(self, cfg: AttnConfig) -> float:
        flop = 2.0 * MAP_Q_TILE * MAP_KV_TILE * (cfg.head_dim_k + cfg.head_dim_v) * cfg.n_head
        return flop / (self.tflops * 1e12) * 1e6


@dataclass(frozen=True)
class StrategyCost:
    mode: str
    n_ubatches: int
    rows: int
    n_pad: int
    kv_tiles: int
    est_us: float
    exact: bool = True  # False: not dry-run; kv_tiles and est_us are lower bounds (cost_floor)

    def line(self) -> str:
        ge = "" if self.exact else ">= "
        return (f"{self.mode}: {self.n_ubatches} ubatch(es), {self.rows} rows ({self.n_pad} pad), "
                f"{ge}{self.kv_tiles} KV tiles -> {ge}{self.est_us:.1f} us")


@dataclass(frozen=True)
class AutoChoice:
    """The chosen ``mode``, its ubatches (each carrying ``reason``), every candidate's cost;
    ``plans``: the ubatches' dry-run plans on the given cache (None without a cache, or when
    the fast path chose without dry runs), for ``plan.apply_plan`` in order."""

    mode: str
    ubatches: list[UBatch]
    costs: list[StrategyCost]
    reason: str
    plans: list[UBatchPlan] | None = None


def candidates_for(unified: bool) -> tuple[str, ...]:
    return ("simple", "equal", "padded") if unified else ("equal", "seq", "padded")


def _est_us(n_ubatches: int, rows: int, tiles: int, cfg: AttnConfig, model: CostModel) -> float:
    """The cost model (module doc); non-decreasing in ``tiles``, so a tile floor gives a floor."""
    return cfg.n_layer * (n_ubatches * model.ubatch_us + rows * model.row_us + tiles * model.tile_us(cfg))


def cost_of(mode: str, plans: list[UBatchPlan], cfg: AttnConfig, model: CostModel) -> StrategyCost:
    rows = sum(p.ubatch.n_tokens for p in plans)
    n_pad = sum(p.ubatch.n_pad for p in plans)
    if model.skip == "all":
        tiles = sum(p.tiles.n_live for p in plans)
    elif model.skip == "tail":
        tiles = sum(p.tiles.n_tail_skip for p in plans)
    else:
        raise ValueError(f"CostModel.skip must be 'all' or 'tail', got {model.skip!r}")
    return StrategyCost(mode, len(plans), rows, n_pad, tiles, _est_us(len(plans), rows, tiles, cfg, model))


def _tile_floor(ub: UBatch, unified: bool) -> int:
    """(stream, query tile) pairs of ``ub`` that hold a real row. A real row always sees its own
    cell (placed with its position and sequence, causal, inside any window), so each such pair
    visits at least one KV tile, under ``skip="all"`` and ``"tail"`` alike."""
    ns = 1 if unified else ub.n_seqs_unq
    if ub.n_tokens % ns:
        return 0  # a layout the cache refuses; the dry run says so
    real = ~ub.is_pad.reshape(ns, -1)
    n_tps = real.shape[1]
    n_q = -(-n_tps // MAP_Q_TILE)
    padded = np.zeros((ns, n_q * MAP_Q_TILE), dtype=bool)
    padded[:, :n_tps] = real
    return int(padded.reshape(ns, n_q, MAP_Q_TILE).any(axis=2).sum())


class _History:
    """The KV tiles (MAP_KV_TILE cells) of a one-stream cache that hold the cells of each of
    ``seq_ids`` (a batch's sequences), with the least position of its cells in each:
    ``first[row[s], t]`` (int64 max where none). A real row
    of sequence s at position p sees every tile t with ``first[s, t] <= p`` -- a cell of its own
    sequence, not a pad, not after it -- wherever a split places the batch (placing adds cells,
    never moves them): a floor of a query tile's KV tiles. Causal masks without a window (the
    dry runs' masks; under a sliding window the cells may be out of reach)."""

    def __init__(self, cache: KVCache, seq_ids):
        ids = np.asarray(sorted(seq_ids), dtype=np.int64)
        self.row = np.full(cache.n_seq_max, -1, dtype=np.int64)   # sequence -> its row of first
        self.row[ids] = np.arange(ids.shape[0])
        cells = np.flatnonzero((cache.pos[0] >= 0) & ~cache.pad[0])
        sets = cache.seqs[0][cells]                     # (cells, n_seq_max) bool
        seqs = sets.argmax(axis=1)                      # a cell's sequence (most cells have one)
        shared = np.count_nonzero(sets, axis=1) > 1
        if shared.any():                                # the cells of several: one pair each
            r, s = np.nonzero(sets[shared])
            cells, seqs = np.concatenate([cells[~shared], cells[shared][r]]), np.concatenate([seqs[~shared], s])
        rows = self.row[seqs]
        cells, rows = cells[rows >= 0], rows[rows >= 0]   # (the batch's sequences only)
        n_tiles = max(1, -(-cache.kv_size // MAP_KV_TILE))
        self.first = np.full((max(1, ids.shape[0]), n_tiles), np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(self.first, (rows, cells // MAP_KV_TILE), cache.pos[0][cells].astype(np.int64))

    def tiles(self, ub: UBatch) -> int:
        """A floor of ``ub``'s live (query tile, KV tile) pairs on the one stream: per query tile
        holding a real row, the tiles its rows' histories hold (at least one)."""
        real = ~ub.is_pad
        if not real.any():
            return 0
        n_seq = self.first.shape[0]
        q = np.nonzero(real)[0] // MAP_Q_TILE                       # each real row's query tile
        key = q * n_seq + self.row[ub.primary_seq_ids[real]]       # (every real row's sequence is the batch's)
        last = np.full(int(q.max() + 1) * n_seq, -1, dtype=np.int64)
        np.maximum.at(last, key, ub.positions[real].astype(np.int64))   # (query tile, sequence): its last row
        k = np.nonzero(last >= 0)[0]
        seen = np.zeros((int(q.max() + 1), self.first.shape[1]), dtype=bool)
        np.logical_or.at(seen, k // n_seq, self.first[k % n_seq] <= last[k][:, None])
        return int(np.maximum(seen.sum(axis=1), np.bincount(q, minlength=seen.shape[0]) > 0).sum())


def cost_floor(mode: str, ubs: list[UBatch], unified: bool, cfg: AttnConfig, model: CostModel,
               history: _History | None = None) -> StrategyCost:
    """A lower bound of ``cost_of`` for ``ubs`` without placing or masking anything
    (``exact`` False): exact ubatch and row counts, the tile floor of :func:`_tile_floor` (with
    ``history``, a one-stream cache's: of :meth:`_History.tiles` where higher)."""
    rows = sum(u.n_tokens for u in ubs)
    n_pad = sum(u.n_pad for u in ubs)
    tiles = sum(max(_tile_floor(u, unified), history.tiles(u) if history is not None else 0) for u in ubs)
    return StrategyCost(mode, len(ubs), rows, n_pad, tiles, _est_us(len(ubs), rows, tiles, cfg, model), False)


def choose_split(batch: Batch, n_ubatch: int, *, cache: KVCache | None = None, cfg: AttnConfig | None = None,
                 model: CostModel | None = None, unified: bool | None = None, shape=None) -> AutoChoice:
    """Cost every candidate strategy for ``batch`` on ``cache`` (left unchanged) and pick the
    cheapest; candidates that cannot win are costed by their floor only (module doc). Without
    a cache a fresh one is assumed: split (llama.cpp's default) unless ``unified``, with room
    for the batch. ``cfg`` gives head sizes for the tile cost (default: 32 heads of 128).
    ``shape(ubatches) -> ubatches``: each candidate's ubatches as they will run (the driver's
    bucket pads, ``driver._bucketed``), costed and dry-run in that form -- so that the chosen
    plans are the ones that run, not planned twice -- or as split where that form does not fit
    the cache. Not applied on the fast path.
    With a cache, ``plans`` of the result are the chosen ubatches' dry-run plans on it."""
    n_ubatch = _split.check_n_ubatch(n_ubatch)
    cfg = cfg or AttnConfig(n_head=32, n_head_kv=8, head_dim_k=128)
    model = model or CostModel()
    if model.skip not in ("all", "tail"):
        raise ValueError(f"CostModel.skip must be 'all' or 'tail', got {model.skip!r}")
    if cache is not None and unified is not None and unified != cache.unified:
        raise ValueError(f"unified={unified} contradicts the cache (unified={cache.unified})")
    fast = _uniform_choice(batch, n_ubatch, cache.unified if cache is not None else bool(unified))
    if fast is not None:
        return fast
    given = cache is not None
    if cache is None:
        cache = _scratch_cache(batch, n_ubatch, bool(unified))
    modes = candidates_for(cache.unified)
    history = _History(cache, batch.unique_seq_ids) if given and cache.n_stream == 1 and cfg.n_swa <= 0 else None
    splits: dict[str, list[UBatch] | Exception] = {}
    plain: dict[str, list[UBatch]] = {}   # (the splits before ``shape``)
    costs: dict[str, StrategyCost] = {}
    for mode in modes:
        try:
            plain[mode] = splits[mode] = _split.split_ubatches(batch, n_ubatch, mode)
            if shape is not None:
                splits[mode] = shape(plain[mode])
        except (ValueError, RuntimeError) as e:  # e.g. coupled sequences
            splits[mode] = e
            costs[mode] = StrategyCost(mode, 0, 0, 0, 0, float("inf"))
            continue
        costs[mode] = cost_floor(mode, splits[mode], cache.unified, cfg, model, history)
    plans: dict[str, list[UBatchPlan]] = {}
    best: tuple[float, int] | None = None  # (exact cost, candidate index) of the best so far
    feasible = [m for m in modes if not isinstance(splits[m], Exception)]
    for mode in sorted(feasible, key=lambda m: (costs[m].est_us, modes.index(m))):
        if best is not None and (costs[mode].est_us, modes.index(mode)) > best:
            continue  # even its floor loses (or ties and comes later): no dry run
        try:
            plans[mode] = dry_run_plans(cache, splits[mode], n_swa=cfg.n_swa, alibi=cfg.alibi)
        except (ValueError, RuntimeError) as e:  # e.g. no room
            try:   # (shaped: the pads may be what did not fit; the plain split then, as it is)
                if splits[mode] is plain[mode]:
                    raise
                splits[mode] = plain[mode]
                plans[mode] = dry_run_plans(cache, splits[mode], n_swa=cfg.n_swa, alibi=cfg.alibi)
            except (ValueError, RuntimeError):
                splits[mode] = e
                costs[mode] = StrategyCost(mode, 0, 0, 0, 0, float("inf"))
                continue
        costs[mode] = cost_of(mode, plans[mode], cfg, model)
        rank = (costs[mode].est_us, modes.index(mode))
        if best is None or rank < best:
            best = rank
    if best is None:
        raise ValueError(f"no strategy can run this batch: {splits}")
    chosen = modes[best[1]]
    listed = [costs[m] for m in modes]
    top = costs[chosen]
    others = "; ".join(c.line() for c in listed if c is not top and c.est_us != float("inf"))
    reason = f"auto chose {top.line()}" + (f"; vs {others}" if others else "")
    ubs = [replace(u, reason=reason) for u in splits[chosen]]
    kept = [replace(p, ubatch=u) for p, u in zip(plans[chosen], ubs)] if given else None
    return AutoChoice(chosen, ubs, listed, reason, kept)


def split_ubatches(batch: Batch, n_ubatch: int, mode: str = "equal", **auto_kw) -> list[UBatch]:
    """Every split mode behind one call: ``auto`` asks :func:`choose_split` (extra keywords go
    to it), the others ``split.split_ubatches`` (extra keywords ignored). This is the
    ``split_ubatches`` that ``ggml_attn.graph`` exports."""
    if mode == "auto":
        return choose_split(batch, n_ubatch, **auto_kw).ubatches
    return _split.split_ubatches(batch, n_ubatch, mode)


def _uniform_choice(batch: Batch, n_ubatch: int, unified: bool) -> AutoChoice | None:
    """The choice without dry runs when the batch leaves nothing to choose (e.g. a decode step):
    no coupled tokens, every sequence brings the same number of tokens and the ids, in batch
    order of first appearance, are consecutive and ascending -- or, on a unified cache, one token
    each in any order, at most one query tile of rows (``simple``: the least of the cost model;
    the dry runs of a server's decode steps, ids in admission order, chose it every time and cost
    ~3 ms of host time a step: tools/dev/serve_structures.py). Then ``padded`` makes the same
    ubatches as ``equal`` with no pads and ``seq`` only more ubatches, so ``equal`` (llama.cpp's
    split) wins on a split cache, and ``simple`` (fewest ubatches, no pads) on a unified one.
    ``costs`` is empty (nothing was costed). None when the batch is not like that."""
    if batch.has_coupled or batch.n_tokens == 0:
        return None
    counts = batch.seq_token_counts()  # dict order = order of first appearance
    ids = list(counts)
    n = counts[ids[0]]
    if any(c != n for c in counts.values()):
        return None
    if n == 1 and unified and batch.n_tokens <= min(MAP_Q_TILE, n_ubatch):
        # a decode step on one buffer, its ids in any order (a server's generating requests):
        # simple makes one ubatch of one query tile, which visits the union of the KV tiles
        # its rows see -- no more than any other split's ubatches together -- with no pads
        reason = (f"auto chose simple without dry runs: {len(ids)} sequence(s) of one token each on a unified "
                  f"cache, no shared tokens: the fewest ubatches, no pads")
        ubs = [replace(u, reason=reason) for u in _split.split_ubatches(batch, n_ubatch, "simple")]
        return AutoChoice("simple", ubs, [], reason)
    if ids != list(range(ids[0], ids[0] + len(ids))):
        return None
    mode = "simple" if unified else "equal"
    reason = (f"auto chose {mode} without dry runs: {len(ids)} sequence(s) of {n} token(s) each, "
              f"consecutive ids, no shared tokens, so padded = equal with no pads")
    ubs = [replace(u, reason=reason) for u in _split.split_ubatches(batch, n_ubatch, mode)]
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
