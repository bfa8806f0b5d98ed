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
    if n_kv > cache.kv_size:
        raise ValueError(f"n_kv {n_kv} exceeds kv_size {cache.kv_size}")
    n_stream = slot.n_stream
    if ub.n_tokens % n_stream:
        raise ValueError(f"{ub!r} has {ub.n_tokens} rows for {n_stream} streams")
    n_tps = ub.n_tokens // n_stream
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
    if n_stream == 1:
        return cache.seqs[slot.streams[0], :n_kv][:, prim[0]].T[None]
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
    (and their visibility) are handed out read-only."""
    if n_kv is None:
        n_kv = cache.n_kv(slot)
    dtype = np.dtype(dtype)
    step = mask_step.eligible(causal, n_swa, alibi, dtype)
    got = mask_step.next_step(cache, ub, slot, n_kv, dtype) if step else None
    if got is not None:
        mask, vis = got
    else:
        vis = visible_cells(cache, ub, slot, n_kv, causal=causal, n_swa=n_swa)
        mask = mask_values(cache, ub, slot, vis, alibi=alibi, dtype=dtype)
        if step:
            mask_step.remember(cache, ub, slot, mask, vis)
    return (mask, vis) if return_visible else mask


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
