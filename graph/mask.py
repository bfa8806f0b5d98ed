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
    Call after ``cache.apply_ubatch(slot, ub)``. All streams at once (a few array operations
    per ubatch, whatever its number of streams and rows)."""
    if n_kv > cache.kv_size:
        raise ValueError(f"n_kv {n_kv} exceeds kv_size {cache.kv_size}")
    n_stream = slot.n_stream
    if ub.n_tokens % n_stream:
        raise ValueError(f"{ub!r} has {ub.n_tokens} rows for {n_stream} streams")
    n_tps = ub.n_tokens // n_stream
    s0 = slot.streams[0]
    prim = ub.primary_seq_ids.reshape(n_stream, n_tps, 1)
    prow = ub.positions.astype(np.int64).reshape(n_stream, n_tps, 1)
    if slot.streams == tuple(range(s0, s0 + n_stream)):  # consecutive streams (always, from find_slot)
        st = slice(s0, s0 + n_stream)
    else:
        st = np.asarray(slot.streams, dtype=np.intp)
    pos_c = cache.pos[st, :n_kv][:, None, :]                        # (n_stream, 1, n_kv) int32
    ok_c = (pos_c >= 0) & ~cache.pad[st, :n_kv][:, None, :]         # occupied, not a pad
    # row (j, i) and cell c are of one sequence: seqs[streams[j], c, prim[j, i]]
    if n_stream == 1:
        out = cache.seqs[s0, :n_kv][:, prim[0, :, 0]].T[None]       # (1, n_tps, n_kv)
    else:
        out = cache.seqs[np.asarray(slot.streams, dtype=np.intp)[:, None, None],
                         np.arange(n_kv)[None, None, :], prim]      # (n_stream, n_tps, n_kv)
    out &= ok_c
    if ub.n_pad:
        out &= ~ub.is_pad.reshape(n_stream, n_tps, 1)
    if causal:
        out &= pos_c <= prow
    if n_swa > 0:
        out &= (prow - pos_c) < n_swa
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
    dtype = np.dtype(dtype)
    if alibi:
        n_stream, n_tps = vis.shape[:2]
        prow = ub.positions.astype(np.float64).reshape(n_stream, n_tps)
        pos_c = np.stack([cache.pos[st, :n_kv] for st in slot.streams]).astype(np.float64)
        val = -np.abs(pos_c[:, None, :] - prow[:, :, None])
        mask = np.where(vis, val, -np.inf).astype(dtype)
    elif dtype.kind == "f":  # 0 and -inf straight in ``dtype`` (the same values)
        mask = np.where(vis, dtype.type(0.0), dtype.type(-np.inf))
    else:
        mask = np.where(vis, 0.0, -np.inf).astype(dtype)
    return mask[:, None, :, :]
