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

from .kv_cache import KVCache, SlotInfo
from .split import UBatch

__all__ = ["build_mask", "visible_cells"]


def visible_cells(cache: KVCache, ub: UBatch, slot: SlotInfo, n_kv: int, *, causal: bool = True,
                  n_swa: int = 0) -> np.ndarray:
    """bool numpy ``(n_stream, n_tps, n_kv)``: True where row may attend to cell.
    Call after ``cache.apply_ubatch(slot, ub)``."""
    if n_kv > cache.kv_size:
        raise ValueError(f"n_kv {n_kv} exceeds kv_size {cache.kv_size}")
    n_stream = slot.n_stream
    if ub.n_tokens % n_stream:
        raise ValueError(f"{ub!r} has {ub.n_tokens} rows for {n_stream} streams")
    n_tps = ub.n_tokens // n_stream
    prim = ub.primary_seq_ids.reshape(n_stream, n_tps)
    prow = ub.positions.astype(np.int64).reshape(n_stream, n_tps)
    pad_row = ub.is_pad.reshape(n_stream, n_tps)
    out = np.zeros((n_stream, n_tps, n_kv), dtype=bool)
    for j, st in enumerate(slot.streams):
        pos_c = cache.pos[st, :n_kv].astype(np.int64)
        ok_c = (pos_c >= 0) & ~cache.pad[st, :n_kv]
        same_seq = cache.seqs[st, :n_kv][:, prim[j]].T  # (n_tps, n_kv)
        vis = ok_c[None, :] & same_seq & ~pad_row[j][:, None]
        if causal:
            vis &= pos_c[None, :] <= prow[j][:, None]
        if n_swa > 0:
            vis &= (prow[j][:, None] - pos_c[None, :]) < n_swa
        out[j] = vis
    return out


def build_mask(cache: KVCache, ub: UBatch, slot: SlotInfo, n_kv: int | None = None, *,
               causal: bool = True, n_swa: int = 0, alibi: bool = False,
               dtype=np.float16) -> np.ndarray:
    """The ubatch mask, numpy order ``(n_stream, 1, n_tps, n_kv)`` (= ggml
    ``[n_kv, n_tps, 1, n_stream]``), ``dtype`` (F16 by default). ``n_kv`` defaults to
    ``cache.n_kv(slot)``. Call after ``cache.apply_ubatch(slot, ub)``."""
    if n_kv is None:
        n_kv = cache.n_kv(slot)
    vis = visible_cells(cache, ub, slot, n_kv, causal=causal, n_swa=n_swa)
    if alibi:
        n_stream, n_tps = vis.shape[:2]
        prow = ub.positions.astype(np.float64).reshape(n_stream, n_tps)
        pos_c = np.stack([cache.pos[st, :n_kv] for st in slot.streams]).astype(np.float64)
        val = -np.abs(pos_c[:, None, :] - prow[:, :, None])
    else:
        val = 0.0
    mask = np.where(vis, val, -np.inf).astype(dtype)
    return mask[:, None, :, :]
