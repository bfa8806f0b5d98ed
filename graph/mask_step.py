"""A decode step's mask from the previous step's: only the cells that changed are recomputed.

A decode step of the same sequences as the step before changes few cells (the cells it
occupies); every other cell keeps its visibility for every row, *provided* the rows moved
forward in position past nothing of their own sequence: with the causal rule (``mask.py``) a
cell of the row's sequence at position ``p_cell`` turns visible when ``p_prev < p_cell <= p_row``.
Each row's state carries ``bound``, an upper bound on the positions of its sequence's
(non-pad) cells within the mask's columns; when ``min(p_row, bound) <= p_prev`` no unchanged
cell can turn visible. The masks are exactly :func:`mask.build_mask`'s (tests compare them).

Taken only for causal masks without sliding window or ALiBi (whose values move with the row
position), float16/float32 masks, and a ubatch with the previous one's streams, rows per
stream, primary sequence ids and pad rows. Everything else (and a cache whose change log
started over, ``kv_changes.py``) builds from scratch.

Arrays (numpy order): ``vis`` bool ``(n_stream, n_tps, n_kv)``, ``mask`` ``(n_stream, 1,
n_tps, n_kv)`` of ``dtype`` (= ggml ``[n_kv, n_tps, 1, n_stream]``). The arrays handed out are
kept as the next step's starting point and so made read-only.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from .kv_cache import KVCache, SlotInfo
from .split import UBatch

__all__ = ["eligible", "next_step", "remember", "forget"]

_MAX_DIRTY_FRACTION = 4   # more than 1 / this of the kept columns changed: building from scratch is as cheap

_UNKNOWN = np.iinfo(np.int64).max  # a bound not known without a scan of the stream

_STATE: "weakref.WeakKeyDictionary[KVCache, _Step]" = weakref.WeakKeyDictionary()


@dataclass(eq=False)
class _Step:
    """The last mask built for a cache, and what it depends on."""

    mark: tuple[int, int]        # cache.changes.mark() when built
    streams: tuple[int, ...]
    dtype: np.dtype
    prim: np.ndarray             # int (n_stream, n_tps) primary sequence id of each row
    row_pad: np.ndarray          # bool (n_stream, n_tps)
    row_pos: np.ndarray          # int64 (n_stream, n_tps)
    bound: np.ndarray            # int64 (n_stream, n_tps): >= every position of the row's sequence
    vis: np.ndarray              # bool (n_stream, n_tps, n_kv)
    mask: np.ndarray             # dtype (n_stream, 1, n_tps, n_kv)


def eligible(causal: bool, n_swa: int, alibi: bool, dtype: np.dtype) -> bool:
    """Whether masks of these settings can be stepped (module doc)."""
    return causal and n_swa <= 0 and not alibi and dtype.kind == "f" and dtype.itemsize in (2, 4)


def forget(cache: KVCache) -> None:
    _STATE.pop(cache, None)


def _rows(ub: UBatch, slot: SlotInfo):
    n_stream = slot.n_stream
    n_tps = ub.n_tokens // n_stream
    return (ub.primary_seq_ids.reshape(n_stream, n_tps), ub.is_pad.reshape(n_stream, n_tps),
            ub.positions.astype(np.int64).reshape(n_stream, n_tps))


def _columns(cache: KVCache, slot: SlotInfo, prim, row_pad, row_pos, cols):
    """The causal visibility of the columns ``cols`` (int64 ``(n_cols,)`` or a slice; cells of
    each of the slot's streams): bool ``(n_stream, n_tps, n_cols)``, as ``mask.visible_cells``
    decides it; and per row the largest position among those cells of its sequence (non-pad;
    -1 if none), int64 ``(n_stream, n_tps)``."""
    if isinstance(cols, slice):
        get = lambda a: a[cols]                                            # noqa: E731
    else:
        get = lambda a: a.take(cols, axis=0)                               # noqa: E731
    vis, top = [], []
    for j, st in enumerate(slot.streams):
        pos_c = get(cache.pos[st]).astype(np.int64)                        # (n_cols,)
        live = (pos_c >= 0) & ~get(cache.pad[st])
        mine = get(cache.seqs[st]).take(prim[j], axis=1).T & live          # (n_tps, n_cols)
        vis.append(mine & (pos_c <= row_pos[j][:, None]) & ~row_pad[j][:, None])
        top.append((mine * (pos_c + 1)).max(axis=1, initial=0) - 1)       # (positions >= 0)
    return np.stack(vis), np.stack(top)


def _bits(vis: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``vis`` as mask values of ``dtype``: +0 where True, -inf where False (``mask.mask_values``)."""
    uint = np.uint16 if dtype.itemsize == 2 else np.uint32
    neg_inf = np.array([-np.inf], dtype=dtype).view(uint)[0]
    return ((vis.view(np.uint8) ^ 1).astype(uint) * neg_inf).view(dtype)


def next_step(cache: KVCache, ub: UBatch, slot: SlotInfo, n_kv: int, dtype: np.dtype):
    """``(mask, vis)`` of ``ub`` from the previous step's, or None when that does not apply
    (module doc). Call after ``cache.apply_ubatch(slot, ub)``, with :func:`eligible` settings."""
    prev = _STATE.get(cache)
    if prev is None or prev.streams != slot.streams or prev.dtype != dtype:
        return None
    n_stream = slot.n_stream
    if ub.n_tokens != prev.prim.size or ub.n_tokens % n_stream:
        return None
    changed = cache.changes.since(prev.mark)
    if changed is None:
        return None
    prim, row_pad, row_pos = _rows(ub, slot)
    if not (np.array_equal(prim, prev.prim) and np.array_equal(row_pad, prev.row_pad)):
        return None
    # no unchanged cell of a row's sequence may lie in (p_prev, p_row]
    if not bool(((row_pos >= prev.row_pos) & (np.minimum(row_pos, prev.bound) <= prev.row_pos) | row_pad).all()):
        return None
    n_old = min(prev.vis.shape[2], n_kv)
    wanted = set(slot.streams)
    parts = [c for st, c in changed if st in wanted]
    # (repeats are harmless: a repeated cell's pairs are written twice with the same values)
    dirty = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, np.int64)
    if dirty.shape[0] and dirty.max() >= n_old:
        dirty = dirty[dirty < n_old]
    if dirty.shape[0] * _MAX_DIRTY_FRACTION > n_old:
        return None
    n_tps = prim.shape[1]
    vis = np.empty((n_stream, n_tps, n_kv), dtype=bool)
    vis[:, :, :n_old] = prev.vis[:, :, :n_old]
    mask = np.empty((n_stream, 1, n_tps, n_kv), dtype=dtype)
    mask[..., :n_old] = prev.mask[..., :n_old]
    bound = prev.bound
    if n_kv > n_old:   # new columns: computed whole
        new, top = _columns(cache, slot, prim, row_pad, row_pos, slice(n_old, n_kv))
        vis[:, :, n_old:] = new
        mask[:, 0, :, n_old:] = _bits(new, dtype)
        bound = np.maximum(bound, top)
    if dirty.shape[0]:  # changed cells: only the (row, cell) pairs whose visibility flips are written
        new, top = _columns(cache, slot, prim, row_pad, row_pos, dirty)
        flip = np.flatnonzero(new != prev.vis.take(dirty, axis=2))      # in (n_stream, n_tps, n_dirty)
        at = flip // dirty.shape[0] * n_kv + dirty[flip % dirty.shape[0]]  # in (n_stream, n_tps, n_kv)
        val = new.reshape(-1)[flip]
        vis.reshape(-1)[at] = val
        mask.reshape(-1)[at] = _bits(val, dtype)
        bound = np.maximum(bound, top)
    mask.setflags(write=False)
    vis.setflags(write=False)
    _STATE[cache] = _Step(cache.changes.mark(), prev.streams, prev.dtype, prev.prim, prev.row_pad, row_pos,
                          bound, vis, mask)
    return mask, vis


def remember(cache: KVCache, ub: UBatch, slot: SlotInfo, mask: np.ndarray, vis: np.ndarray) -> None:
    """Keep ``(mask, vis)`` of ``ub`` (just built from scratch, :func:`eligible` settings) for
    the next step, each row's ``bound`` (module doc) its sequence's largest position in the
    cache when the cache remembers it (``KVCache.known_seq_pos_max``: the driver's batch checks
    asked for it), else unknown (that row may then step only in place). Makes both arrays
    read-only."""
    prim, row_pad, row_pos = _rows(ub, slot)
    if not cache.unified and any(cache.seq_to_stream(int(s)) != st
                                 for st, row in zip(slot.streams, prim) for s in set(row.tolist())):
        forget(cache)   # (never: a split cache's rows are in their sequence's stream)
        return
    top = {s: cache.known_seq_pos_max(s) for s in set(prim.reshape(-1).tolist())}
    bound = np.array([_UNKNOWN if top[s] is None else top[s] for s in prim.reshape(-1).tolist()],
                     dtype=np.int64).reshape(prim.shape)
    mask.setflags(write=False)
    vis.setflags(write=False)
    _STATE[cache] = _Step(cache.changes.mark(), tuple(slot.streams), np.dtype(mask.dtype), prim.copy(),
                          row_pad.copy(), row_pos, bound, vis, mask)
