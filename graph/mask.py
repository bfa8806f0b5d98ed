"""The attention mask of a ubatch, in llama.cpp's layout (``set_input_kq_mask``).

ggml order ``[n_kv, n_tokens/n_stream, 1, n_stream]`` F16, i.e. numpy order
``(n_stream, 1, n_tps, n_kv)`` where ``n_stream`` is the ubatch's number of KV streams (1 for
a unified cache) and ``n_tps = n_tokens / n_stream`` its rows per stream. Row ``i`` of stream
``j`` is ubatch row ``j * n_tps + i``; column ``c`` is cell ``c`` of cache stream
``slot.streams[j]``. A cell is ``-inf`` for a row when it is empty, a pad cell, not of the
row's (primary) sequence, in the row's future (``p_cell > p_row``, when causal) or outside
the sliding window (``p_row - p_cell >= n_swa``, when ``n_swa > 0``); a pad row is ``-inf``
everywhere. Visible cells are 0, or ``-|p_cell - p_row|`` with ALiBi.

No padding of rows (current ggml takes the mask unpadded).
"""
from __future__ import annotations

import numpy as np

from . import mask_step
from .kv_cache import KVCache, SlotInfo
from .split import UBatch

__all__ = ["build_mask", "mask_values", "visible_cells"]


def visible_cells(cache: KVCache, ub: UBatch, slot: SlotInfo, n_kv: int, *, causal: bool = True,
                  n_swa: int = 0) -> np.ndarray:
    """bool numpy ``(n_stream, n_tps, n_kv)``: True where row may attend to cell.
    Call after ``cache.apply_ubatch(slot, ub)``. All streams at once (a few array operations
    per ubatch, whatever its number of streams and rows)."""
    n_stream, n_tps = _checked_shape(cache, ub, slot, n_kv)
    s0 = slot.streams[0]
    consecutive = slot.streams == tuple(range(s0, s0 + n_stream))  # (always, from find_slot)
    st = slice(s0, s0 + n_stream) if consecutive else np.asarray(slot.streams, dtype=np.intp)
    pos_c = cache.pos[st, :n_kv][:, None, :]                        # (n_stream, 1, n_kv) int32
    row_pos = ub.positions.reshape(n_stream, n_tps, 1)
    # occupied (pos >= 0) and, when causal, not after the row (pos <= row position)
    if causal and pos_c.dtype == np.int32 and row_pos.dtype == np.int32 and _min(row_pos) >= 0:
        # both in one unsigned compare: an empty cell's -1 reads 2**32-1, past every row
        out = pos_c.view(np.uint32) <= row_pos.view(np.uint32)     # (n_stream, n_tps, n_kv)
    else:
        out = pos_c >= 0
        if causal:
            out = out & (pos_c <= row_pos)
    out = out & ~cache.pad[st, :n_kv][:, None, :]                   # not a pad cell
    out = out & _same_sequence(cache, ub, slot, st, n_tps, n_kv)
    if out.shape[1] != n_tps:  # (no causal term and one sequence per stream)
        out = np.repeat(out, n_tps, axis=1)
    if ub.n_pad:
        out &= ~ub.is_pad.reshape(n_stream, n_tps, 1)
    if n_swa > 0:
        out &= (ub.positions.astype(np.int64).reshape(n_stream, n_tps, 1) - pos_c) < n_swa
    return out


def _same_sequence(cache: KVCache, ub: UBatch, slot: SlotInfo, st, n_tps: int, n_kv: int) -> np.ndarray:
    """bool, True where row (j, i) and cell c are of one sequence: ``seqs[streams[j], c,
    prim[j, i]]``; ``(n_stream, 1, n_kv)`` when every stream's rows share one primary id (a
    decode step, a split cache), else ``(n_stream, n_tps, n_kv)``."""
    n_stream = slot.n_stream
    prim = ub.primary_seq_ids.reshape(n_stream, n_tps)
    if ub.n_tokens <= _SMALL:
        one = all(len(set(row)) == 1 for row in prim.tolist())
    else:
        one = bool((prim == prim[:, :1]).all())
    if one:
        if n_stream == 1:
            return cache.seqs[slot.streams[0], :n_kv, int(prim[0, 0])][None, None, :]
        return cache.seqs[np.asarray(slot.streams, dtype=np.intp), :n_kv, prim[:, 0]][:, None, :]
    if n_stream == 1:   # each of the ubatch's few sequences' cells once, then one row per ubatch row
        ids, inv = np.unique(prim[0], return_inverse=True)
        return np.ascontiguousarray(cache.seqs[slot.streams[0], :n_kv][:, ids].T)[inv.reshape(-1)][None]
    return cache.seqs[np.asarray(slot.streams, dtype=np.intp)[:, None, None], np.arange(n_kv)[None, None, :],
                      prim[:, :, None]]


def _min(a: np.ndarray) -> int:
    return min(a.reshape(-1).tolist()) if a.size <= _SMALL else int(a.min())


_SMALL = 16  # arrays up to this size are looked at in Python (cheaper than numpy's reductions)
_NEG_INF_BITS: dict = {}  # float dtype -> the unsigned bits of -inf in it


def build_mask(cache: KVCache, ub: UBatch, slot: SlotInfo, n_kv: int | None = None, *,
               causal: bool = True, n_swa: int = 0, alibi: bool = False,
               dtype=np.float16, return_visible: bool = False):
    """The ubatch mask, numpy order ``(n_stream, 1, n_tps, n_kv)`` (= ggml
    ``[n_kv, n_tps, 1, n_stream]``), ``dtype`` (F16 by default); with ``return_visible``,
    ``(mask, visible)`` with :func:`visible_cells`' bool array. ``n_kv`` defaults to
    ``cache.n_kv(slot)``. Call after ``cache.apply_ubatch(slot, ub)``.

    Causal masks without SWA or ALiBi are kept for the next call on this cache, which
    recomputes only the cells that changed since when it can (``mask_step.py``); such masks
    (and their visibility) are handed out read-only. Other masks are built from scratch
    (:func:`_from_scratch`)."""
    if n_kv is None:
        n_kv = cache.n_kv(slot)
    dtype = np.dtype(dtype)
    step = mask_step.eligible(causal, n_swa, alibi, dtype)
    got = mask_step.next_step(cache, ub, slot, n_kv, dtype) if step else None
    if got is not None:
        mask, vis = got
    else:
        mask, vis = _from_scratch(cache, ub, slot, n_kv, causal=causal, n_swa=n_swa, alibi=alibi, dtype=dtype)
        if step:
            mask_step.remember(cache, ub, slot, mask, vis)
    return (mask, vis) if return_visible else mask


def _from_scratch(cache: KVCache, ub: UBatch, slot: SlotInfo, n_kv: int, *, causal: bool, n_swa: int,
                  alibi: bool, dtype: np.dtype):
    """``(mask, vis)`` of :func:`build_mask` without the previous step's: the one place that
    picks the path, :func:`_fast_mask` where :func:`_fast_applies`, else :func:`_general_mask`
    (both give the same bits)."""
    if _fast_applies(ub, slot, n_kv, dtype):
        return _fast_mask(cache, ub, slot, n_kv, causal=causal, n_swa=n_swa, alibi=alibi, dtype=dtype)
    return _general_mask(cache, ub, slot, n_kv, causal=causal, n_swa=n_swa, alibi=alibi, dtype=dtype)


def _general_mask(cache: KVCache, ub: UBatch, slot: SlotInfo, n_kv: int, *, causal: bool, n_swa: int,
                  alibi: bool, dtype: np.dtype):
    """``(mask, vis)`` from the dense ``(n_stream, n_tps, n_kv)`` visibility of every (row,
    cell) pair (:func:`visible_cells`, :func:`mask_values`): any ubatch, any dtype."""
    vis = visible_cells(cache, ub, slot, n_kv, causal=causal, n_swa=n_swa)
    return mask_values(cache, ub, slot, vis, alibi=alibi, dtype=dtype), vis


def mask_values(cache: KVCache, ub: UBatch, slot: SlotInfo, vis: np.ndarray, *, alibi: bool = False,
                dtype=np.float16) -> np.ndarray:
    """The mask (numpy ``(n_stream, 1, n_tps, n_kv)``, ``dtype``) of the visibility ``vis``
    (:func:`visible_cells`): 0 (or ALiBi's ``-|p_cell - p_row|``) where visible, else -inf."""
    n_kv = vis.shape[2]
    dtype = np.dtype(dtype)
    if alibi:
        n_stream, n_tps = vis.shape[:2]
        prow = ub.positions.astype(np.float64).reshape(n_stream, n_tps)
        pos_c = np.stack([cache.pos[st, :n_kv] for st in slot.streams]).astype(np.float64)
        val = -np.abs(pos_c[:, None, :] - prow[:, :, None])
        mask = np.where(vis, val, -np.inf).astype(dtype)
    elif dtype.kind == "f" and dtype.itemsize in (2, 4):
        # the bits of -inf where not visible, of +0 where visible (the values np.where gives):
        # one integer multiply, ~8x faster than a table lookup for a decode step's 64 x 10k cells
        uint = np.uint16 if dtype.itemsize == 2 else np.uint32
        neg_inf = _NEG_INF_BITS.get(dtype)
        if neg_inf is None:
            neg_inf = _NEG_INF_BITS[dtype] = np.array([-np.inf], dtype=dtype).view(uint)[0]
        mask = ((vis.view(np.uint8) ^ 1).astype(uint) * neg_inf).view(dtype)
    else:
        mask = np.where(vis, 0.0, -np.inf).astype(dtype)
    return mask[:, None, :, :]


# ------------------------------------------------------------------ the sparse path
# A row sees only cells of its primary sequence, so the mask is -inf but for a few blocks: per
# stream, per group of rows of one sequence, the cells of that sequence sorted by position
# (a short list). With the causal rule a row sees a prefix of that list (cells with
# ``p_cell <= p_row``), with a sliding window a suffix of the prefix (``p_cell > p_row -
# n_swa``): an interval ``[lo, hi)`` of the sorted list, found by binary search. The mask is
# filled with -inf once and the intervals are written over it as blocks (rows x cells) where
# consecutive rows meet consecutive cells (cells placed in position order: the usual case),
# columns seen by every row of a block as plain slices, the staircase of the others by one
# comparison; else by fancy indexing.

_ROW_BLOCK = 128     # rows per block (the staircase of a causal block is about this wide)
_MAX_BLOCKS = 256    # (row block, cell run) pairs of a group past which it is written by fancy indexing
# the cost of a row group on the sparse path, in (row, cell) pairs of the dense path: a fixed
# part, and per cell of n_kv (the scan of the sequence's column of the cell-to-sequence table)
_GROUP_COST = 8192
_GROUP_SCAN = 4


def _fast_applies(ub: UBatch, slot: SlotInfo, n_kv: int, dtype: np.dtype) -> bool:
    """Whether :func:`_fast_mask` builds this mask: float masks (f16/f32/f64) whose row groups
    (runs of rows of one sequence: the prompt chunks) cost less there than the dense
    ``(n_tokens, n_kv)`` pairs of :func:`_general_mask` (not a decode step's rows, one per
    sequence, nor a few rows per sequence: ``tools/dev/mask_host_bench.py`` measured the costs)."""
    if dtype.kind != "f" or dtype.itemsize not in (2, 4, 8):
        return False
    prim = ub.primary_seq_ids
    n_groups = int(np.count_nonzero(prim[1:] != prim[:-1])) + slot.n_stream   # (at most)
    return n_groups * (_GROUP_COST + _GROUP_SCAN * n_kv) < ub.n_tokens * n_kv


def _checked_shape(cache: KVCache, ub: UBatch, slot: SlotInfo, n_kv: int) -> tuple[int, int]:
    """``(n_stream, n_tps)`` of the mask; ValueError when ``n_kv`` exceeds the cache or the
    rows do not divide over the streams."""
    if n_kv > cache.kv_size:
        raise ValueError(f"n_kv {n_kv} exceeds kv_size {cache.kv_size}")
    n_stream = slot.n_stream
    if ub.n_tokens % n_stream:
        raise ValueError(f"{ub!r} has {ub.n_tokens} rows for {n_stream} streams")
    return n_stream, ub.n_tokens // n_stream


def _fast_mask(cache: KVCache, ub: UBatch, slot: SlotInfo, n_kv: int, *, causal: bool, n_swa: int,
               alibi: bool, dtype: np.dtype):
    """``(mask, vis)`` as :func:`_general_mask` gives them (same bits), written per row group
    (section comment above): mask ``(n_stream, 1, n_tps, n_kv)`` of ``dtype``, vis bool
    ``(n_stream, n_tps, n_kv)``. Float ``dtype`` only."""
    n_stream, n_tps = _checked_shape(cache, ub, slot, n_kv)
    mask = np.empty((n_stream, n_tps, n_kv), dtype=dtype)
    mask.fill(-np.inf)
    vis = np.zeros((n_stream, n_tps, n_kv), dtype=bool)
    prim = ub.primary_seq_ids.reshape(n_stream, n_tps)
    row_pos = ub.positions.reshape(n_stream, n_tps)
    real = ~ub.is_pad.reshape(n_stream, n_tps) if ub.n_pad else None
    for j, st in enumerate(slot.streams):
        for seq, rows in _row_groups(prim[j], None if real is None else real[j]):
            cells, pc = _seq_cells(cache, st, seq, n_kv)
            if cells.shape[0] == 0:
                continue
            rp = row_pos[j, rows].astype(np.int64)
            hi = np.searchsorted(pc, rp, "right").astype(np.int32) if causal else None
            lo = np.searchsorted(pc, rp - n_swa, "right").astype(np.int32) if n_swa > 0 else None
            _write_group(mask[j], vis[j], rows, rp, cells, pc, lo, hi, alibi)
    return mask[:, None], vis


def _row_groups(prim: np.ndarray, real: np.ndarray | None) -> list[tuple[int, np.ndarray]]:
    """``[(seq, rows)]``: one stream's rows (``prim`` int ``(n_tps,)`` primary ids; ``real``
    bool ``(n_tps,)`` not a pad, None: no pads) in runs of one sequence (a sequence whose rows
    come in several runs has several groups), rows int64 ascending; pad rows in none (they
    see nothing)."""
    rows = np.arange(prim.shape[0]) if real is None else np.flatnonzero(real)
    ids = prim if real is None else prim[rows]
    n = ids.shape[0]
    if n == 0:
        return []
    cut = (np.flatnonzero(ids[1:] != ids[:-1]) + 1).tolist()
    starts, ends = [0] + cut, cut + [n]
    return list(zip(ids[starts].tolist(), (rows[a:b] for a, b in zip(starts, ends))))


def _seq_cells(cache: KVCache, st: int, seq: int, n_kv: int) -> tuple[np.ndarray, np.ndarray]:
    """``(cells, pos)`` int64 ``(m,)``: the cells among the first ``n_kv`` of stream ``st`` a row
    of ``seq`` may see whatever its position (of the sequence, occupied, not a pad), sorted by
    position (ties: by cell), and their positions."""
    cells = np.flatnonzero(cache.seqs[st, :n_kv, seq])
    pos = cache.pos[st, cells].astype(np.int64)
    ok = (pos >= 0) & ~cache.pad[st, cells]
    if not ok.all():
        cells, pos = cells[ok], pos[ok]
    if pos.shape[0] > 1 and not (pos[1:] >= pos[:-1]).all():
        order = np.argsort(pos, kind="stable")
        cells, pos = cells[order], pos[order]
    return cells, pos


def _runs(idx: np.ndarray, k0: int, k1: int) -> list[tuple[int, int]]:
    """``[(a, b)]``: ``k0:k1`` cut into the maximal pieces ``idx[a:b]`` of consecutive ascending
    integers (``idx`` int ``(m,)``)."""
    part = idx[k0:k1]
    cut = (np.flatnonzero(part[1:] != part[:-1] + 1) + (k0 + 1)).tolist()
    return list(zip([k0] + cut, cut + [k1]))


def _row_blocks(rows: np.ndarray) -> list[tuple[int, int]]:
    """``[(a, b)]``: ``rows`` (int ascending ``(n,)``) cut into runs of consecutive rows of at
    most ``_ROW_BLOCK``."""
    n = rows.shape[0]
    runs = [(0, n)] if int(rows[-1]) - int(rows[0]) == n - 1 else _runs(rows, 0, n)
    return [(a, min(a + _ROW_BLOCK, b)) for a0, b in runs for a in range(a0, b, _ROW_BLOCK)]


def _write_group(mask: np.ndarray, vis: np.ndarray, rows: np.ndarray, rp: np.ndarray, cells: np.ndarray,
                 pc: np.ndarray, lo: np.ndarray | None, hi: np.ndarray | None, alibi: bool) -> None:
    """Make row ``rows[i]`` see ``cells[lo[i]:hi[i]]`` in one stream's ``mask`` (``(n_tps,
    n_kv)``, -inf where not yet written) and ``vis`` (bool ``(n_tps, n_kv)``, False there): 0,
    or with ``alibi`` ``-|pc - rp|``. rows int64 ``(n,)`` ascending, their positions ``rp``
    int64 ``(n,)``; cells and their positions ``pc`` int64 ``(m,)``, sorted by position;
    ``lo``, ``hi`` int32 ``(n,)``, None: 0, ``m``."""
    m = cells.shape[0]
    k0 = 0 if lo is None else int(lo.min())
    k1 = m if hi is None else int(hi.max())
    if k0 >= k1:
        return
    col_runs = _runs(cells, k0, k1)
    row_runs = _row_blocks(rows)
    if len(row_runs) * len(col_runs) > _MAX_BLOCKS:
        _write_scattered(mask, vis, rows, rp, cells, pc, lo, hi, k0, k1, alibi)
        return
    for a, b in row_runs:
        r0, r1 = int(rows[a]), int(rows[a]) + b - a
        lo_b = None if lo is None else lo[a:b]
        hi_b = None if hi is None else hi[a:b]
        lo_min, lo_max = (0, 0) if lo_b is None else (int(lo_b.min()), int(lo_b.max()))
        hi_min, hi_max = (m, m) if hi_b is None else (int(hi_b.min()), int(hi_b.max()))
        for ka, kb in col_runs:
            e0, e1 = max(ka, lo_min), min(kb, hi_max)
            if e0 >= e1:
                continue
            f0, f1 = max(e0, lo_max), min(e1, hi_min)   # [f0, f1): seen by every row of the block
            if f0 >= f1:
                f0 = f1 = e1
            for g0, g1, every in ((e0, f0, False), (f0, f1, True), (f1, e1, False)):
                if g0 >= g1:
                    continue
                c0 = int(cells[g0])
                cols = slice(c0, c0 + g1 - g0)
                m_blk = mask[r0:r1, cols]
                if every:
                    m_blk[...] = _alibi(rp[a:b], pc[g0:g1], mask.dtype) if alibi else 0
                    vis[r0:r1, cols] = True
                    continue
                seen = _interval(lo_b, hi_b, g0, g1)
                vis[r0:r1, cols] = seen
                if alibi:
                    np.copyto(m_blk, _alibi(rp[a:b], pc[g0:g1], mask.dtype), where=seen)
                else:
                    m_blk[seen] = 0


def _interval(lo: np.ndarray | None, hi: np.ndarray | None, g0: int, g1: int) -> np.ndarray:
    """bool ``(n, g1 - g0)``: ``lo[i] <= k < hi[i]`` for ``k`` in ``g0:g1`` (``lo``, ``hi`` int32
    ``(n,)``, None: no bound; one of them not None)."""
    k = np.arange(g0, g1, dtype=np.int32)
    seen = None if hi is None else k < hi[:, None]
    if lo is not None:
        seen = k >= lo[:, None] if seen is None else seen & (k >= lo[:, None])
    return seen


def _write_scattered(mask, vis, rows, rp, cells, pc, lo, hi, k0: int, k1: int, alibi: bool) -> None:
    """:func:`_write_group` (same arguments) by fancy indexing over the sorted cells ``k0:k1``."""
    if lo is None and hi is None:
        i, kk = np.divmod(np.arange(rows.shape[0] * (k1 - k0)), k1 - k0)
    else:
        i, kk = np.nonzero(_interval(lo, hi, k0, k1))
    kk += k0
    r, c = rows[i], cells[kk]
    vis[r, c] = True
    mask[r, c] = _alibi(rp[i], pc[kk], mask.dtype, outer=False) if alibi else 0


def _alibi(rp: np.ndarray, pc: np.ndarray, dtype: np.dtype, outer: bool = True) -> np.ndarray:
    """ALiBi values ``-|p_cell - p_row|`` of ``dtype`` as :func:`mask_values` computes them
    (float64, then cast): ``(len(rp), len(pc))`` (``outer``) or elementwise."""
    prow = rp.astype(np.float64)
    pcell = pc.astype(np.float64)
    d = pcell[None, :] - prow[:, None] if outer else pcell - prow
    return (-np.abs(d)).astype(dtype)
