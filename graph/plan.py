"""Per-ubatch plan: everything that depends only on the ubatch and the cache, built once and
reused by every layer (FlashInfer's plan/run split).

A plan places the ubatch in the cache (cells, ``n_kv``), builds its mask and the map of live
(query tile, KV tile) pairs that a kernel has to visit. Shapes:

* ``mask``: numpy order ``(n_stream, 1, n_tps, n_kv)`` F16 = ggml ``[n_kv, n_tps, 1, n_stream]``.
* ``row_idx``: int64 ``(n_tokens,)`` global cache rows (``stream * kv_size + cell``) of the
  ubatch rows, the ``ggml_set_rows`` index input.
* ``visible``: bool numpy ``(n_stream, n_tps, n_kv)``, the mask's finite cells;
* ``tiles.live``: bool numpy ``(n_stream, n_q_tiles, n_kv_tiles)`` (built from ``visible`` on
  first use).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .kv_cache import KVCache, SlotInfo
from .mask import build_mask
from .split import UBatch

__all__ = ["TileMap", "UBatchPlan", "plan_ubatch", "dry_run_plans", "apply_plan", "tile_map", "MAP_Q_TILE",
           "MAP_KV_TILE"]

# the host tile map's tiles (the split cost model's unit, graph/auto.py); the kernels tile by their
# own sizes (ggml_attn/variants.py KV_TILE: 64 cells) on the device's map (ggml_attn/cuda_plan.py)
MAP_Q_TILE = 64    # query rows per tile (FlashInfer's 64-row prefill tile)
MAP_KV_TILE = 256  # KV cells per tile (llama.cpp's CUDA mask scan granularity)


@dataclass(frozen=True)
class TileMap:
    """Which (query tile, KV tile) blocks hold at least one visible cell.

    live        bool ``(n_stream, n_q_tiles, n_kv_tiles)``.
    q_tile, kv_tile   tile sizes (rows, cells).
    """

    live: np.ndarray
    q_tile: int
    kv_tile: int

    @property
    def n_total(self) -> int:
        return int(self.live.size)

    @property
    def n_live(self) -> int:
        """Tiles a kernel that skips every fully masked tile visits."""
        return int(self.live.sum())

    @property
    def n_tail_skip(self) -> int:
        """Tiles visited by a kernel that only skips the fully masked *tail* of each query
        tile's KV range (llama.cpp's CUDA kernels)."""
        any_live = self.live.any(axis=2)
        last = self.live.shape[2] - np.argmax(self.live[:, :, ::-1], axis=2)
        return int(np.where(any_live, last, 0).sum())


def tile_map(visible: np.ndarray, q_tile: int = MAP_Q_TILE, kv_tile: int = MAP_KV_TILE) -> TileMap:
    """Tile map of a bool visibility array ``(n_stream, n_tps, n_kv)``."""
    ns, nq, nk = visible.shape
    tq, tk = -(-nq // q_tile), -(-nk // kv_tile)
    if nk != tk * kv_tile:  # pad the cells to whole KV tiles (never visible)
        visible = np.concatenate([visible, np.zeros((ns, nq, tk * kv_tile - nk), dtype=bool)], axis=2)
    rows = visible.reshape(ns, nq, tk, kv_tile).any(axis=3)  # (ns, nq, tk): row sees the KV tile
    if nq == 1:  # one row per stream (a decode step)
        live = rows
    elif tq == 1:  # one query tile
        live = rows.any(axis=1, keepdims=True)
    else:
        if nq != tq * q_tile:
            rows = np.concatenate([rows, np.zeros((ns, tq * q_tile - nq, tk), dtype=bool)], axis=1)
        live = rows.reshape(ns, tq, q_tile, tk).any(axis=2)
    return TileMap(live, q_tile, kv_tile)


@dataclass(eq=False)
class UBatchPlan:
    """The plan of one ubatch (see module doc); ``kernel_plan`` is free for a device backend
    to attach its own per-ubatch data (e.g. ``cuda_backend.make_plan``)."""

    ubatch: UBatch
    slot: SlotInfo
    n_kv: int
    mask: np.ndarray
    row_idx: np.ndarray
    visible: np.ndarray          # bool (n_stream, n_tps, n_kv): the mask's finite cells
    q_tile: int = MAP_Q_TILE
    kv_tile: int = MAP_KV_TILE
    kernel_plan: object = field(default=None)

    @property
    def tiles(self) -> TileMap:
        """The host tile map of :attr:`visible` (built on first use: only ``auto``'s cost model
        and :meth:`describe` read it; device kernels build their own from the mask)."""
        t = self.__dict__.get("_tiles")
        if t is None:
            t = self.__dict__["_tiles"] = tile_map(self.visible, self.q_tile, self.kv_tile)
        return t

    @property
    def n_stream(self) -> int:
        return self.slot.n_stream

    @property
    def n_tps(self) -> int:
        return self.ubatch.n_tokens // self.slot.n_stream

    def describe(self) -> dict:
        ub = self.ubatch
        return {"mode": ub.mode, "shape": ub.shape_str, "n_tokens": ub.n_tokens, "n_pad": ub.n_pad,
                "seq_ids": f"{ub.seq_ids[0]}..{ub.seq_ids[-1]}" if len(ub.seq_ids) > 1 else str(ub.seq_ids[0]),
                "n_stream": self.n_stream, "n_kv": self.n_kv, "kv_tiles_live": self.tiles.n_live,
                "kv_tiles_tail": self.tiles.n_tail_skip, "kv_tiles_total": self.tiles.n_total}


def plan_ubatch(cache: KVCache, ub: UBatch, *, causal: bool = True, n_swa: int = 0, alibi: bool = False,
                q_tile: int = MAP_Q_TILE, kv_tile: int = MAP_KV_TILE) -> UBatchPlan:
    """Place ``ub`` in ``cache`` and build its mask and tile map. Atomic: when anything fails
    (``KVCacheFullError`` when it does not fit, or any later error) the cache is unchanged.
    Free its pads with ``cache.free_pads(plan.slot)`` once every layer has run."""
    with cache.transaction():
        slot = cache.place(ub)
        n_kv = cache.n_kv(slot, ub)
        mask, vis = build_mask(cache, ub, slot, n_kv, causal=causal, n_swa=n_swa, alibi=alibi,
                               return_visible=True)
        return UBatchPlan(ub, slot, n_kv, mask, slot.row_indices(cache.kv_size), vis, q_tile, kv_tile)


def dry_run_plans(cache: KVCache, ubatches: list[UBatch], **plan_kw) -> list[UBatchPlan]:
    """Plan every ubatch in turn (pads freed after each) and put the cache's cells back as they
    were: what the batch *would* do, without touching K/V. Raises ``KVCacheFullError`` (cache
    unchanged) when a ubatch does not fit."""
    snap = cache._snapshot()
    try:
        plans = []
        for ub in ubatches:
            p = plan_ubatch(cache, ub, **plan_kw)
            cache.free_pads(p.slot)
            plans.append(p)
        return plans
    finally:
        cache._restore(snap)


def apply_plan(cache: KVCache, plan: UBatchPlan) -> UBatchPlan:
    """Put a dry-run plan into ``cache`` instead of planning its ubatch again: the ubatch occupies
    the plan's cells; its mask, tile map and ``n_kv`` are reused as they are. Valid only on the
    cell state the plan was made on: ``dry_run_plans`` (or ``auto.choose_split``) on this cache,
    nothing changed since but the plans before it, applied in order with their pads freed --
    then ``plan_ubatch`` would place the ubatch in the same cells and build the same mask.
    A cell of the plan that is occupied (a stale plan) raises ``ValueError``. Atomic like
    ``plan_ubatch``; free the pads with ``cache.free_pads(plan.slot)`` as usual."""
    for st, cells in zip(plan.slot.streams, plan.slot.cells):
        if (cache.pos[st, cells] >= 0).any():
            raise ValueError(f"stale plan for {plan.ubatch!r}: its cells in KV stream {st} are occupied")
    with cache.transaction():
        cache.apply_ubatch(plan.slot, plan.ubatch)
    return plan
