"""The op's CPU backend: numpy attention that skips fully masked (query tile, KV tile) pairs.

Same math as :mod:`ggml_attn.reference` (it calls :func:`reference.attend_group` on the live
part of each query tile), so the float64 oracle and this backend cannot drift apart -- NaN/inf
included: a masked (-inf) cell never matters whatever K/V hold there, visible non-finite values
propagate as in ggml (see :func:`reference.attend_group`). A skipped tile holds no visible cell,
so skipping cannot change a result. Arrays
are numpy views of host ggml tensors (numpy order; see :func:`ggml_attn.tensor.as_numpy`).
"""
from __future__ import annotations

import numpy as np

from . import reference
from .dtypes import STORAGE_DTYPES, to_float
from .quant import dequantize_rows
from .tensor import TensorDesc, as_numpy
from .validate import AttnDims

ROW_TILE = 64   # query rows per tile
COL_TILE = 64   # KV cells per tile


F16_NEG_INF = 0xFC00  # bit pattern of -inf in float16


def visible_cells(mask: np.ndarray) -> np.ndarray:
    """bool, same shape: mask value other than -inf. An F16 mask is compared as its bits (10x
    faster than a float16 comparison, which numpy converts element by element)."""
    if mask.dtype == np.float16:
        return mask.view(np.uint16) != F16_NEG_INF
    return mask != -np.inf


def live_tiles(mask_rows: np.ndarray) -> np.ndarray:
    """``(n_row_tiles, n_col_tiles)`` bool: does any cell of the tile have a visible cell, i.e.
    a mask value other than -inf (NaN and +inf cells are visible: they reach the output as in
    ggml)?

    mask_rows: ``(g, n_batch, n_kv)`` (numpy order), the mask of every head of one group.
    """
    finite = visible_cells(mask_rows).any(axis=0)  # (n_batch, n_kv)
    n_b, n_kv = finite.shape
    pr, pc = -n_b % ROW_TILE, -n_kv % COL_TILE
    finite = np.pad(finite, ((0, pr), (0, pc)))
    return finite.reshape(finite.shape[0] // ROW_TILE, ROW_TILE, -1, COL_TILE).any(axis=(1, 3))


def _live_columns(live_row: np.ndarray, n_kv: int):
    """Column selector for one query tile: a slice when the live tiles are one run, else indices."""
    tiles = np.flatnonzero(live_row)
    if tiles.size == 0:
        return None
    if tiles[-1] - tiles[0] + 1 == tiles.size:
        return slice(tiles[0] * COL_TILE, min((tiles[-1] + 1) * COL_TILE, n_kv))
    cols = (tiles[:, None] * COL_TILE + np.arange(COL_TILE)).reshape(-1)
    return cols[cols < n_kv]


def attend_group_skipping(q, k, v, mask_rows, slopes, sinks, scale, logit_softcap, dtype=np.float32):
    """:func:`reference.attend_group` computed only over live tiles; same arguments/result.

    q ``(g, n_batch, head_dim_k)``, k ``(n_kv, head_dim_k)`` float, v ``(n_kv, head_dim_v)`` float, mask_rows
    ``(g, n_batch, n_kv)`` or None -> ``(g, n_batch, head_dim_v)``.
    """
    if mask_rows is None:
        return reference.attend_group(q, k, v, None, slopes, sinks, scale, logit_softcap, dtype)
    live = live_tiles(mask_rows)
    if live.all():
        return reference.attend_group(q, k, v, mask_rows, slopes, sinks, scale, logit_softcap, dtype)
    g, n_batch, _ = q.shape
    out = np.zeros((g, n_batch, v.shape[1]), dtype=dtype)
    n_kv = k.shape[0]
    for rt in range(live.shape[0]):
        cols = _live_columns(live[rt], n_kv)
        if cols is None:
            continue  # every row of the tile fully masked: zeros (a sink adds no value)
        rows = slice(rt * ROW_TILE, min((rt + 1) * ROW_TILE, n_batch))
        out[:, rows] = reference.attend_group(q[:, rows], k[cols], v[cols], mask_rows[:, rows][:, :, cols],
                                              slopes, sinks, scale, logit_softcap, dtype)
    return out


def kv_head_reader(desc: TensorDesc):
    """``read(stream, head) -> float32 (n_kv, D)`` for host K or V of any supported type."""
    if desc.type in STORAGE_DTYPES:
        arr = as_numpy(desc)  # (ne3, n_head_kv, n_kv, D)
        return lambda s, h: to_float(arr[s, h], desc.type)
    return lambda s, h: dequantize_rows(desc.ptr + s * desc.nb[3] + h * desc.nb[2], desc.type,
                                        desc.ne[0], desc.ne[1], desc.nb[1])


def flash_attn_ext_host(q: TensorDesc, k: TensorDesc, v: TensorDesc, mask: TensorDesc | None,
                        sinks: TensorDesc | None, dst: TensorDesc, dims: AttnDims, scale: float,
                        max_bias: float, logit_softcap: float, ith: int = 0, nth: int = 1,
                        stop=None) -> None:
    """Write attention of host tensors into ``dst`` (float32). Graph thread ``ith`` of ``nth``
    takes every nth (stream, KV head) group, so all threads together cover ``dst`` once.
    ``stop()`` (optional) is asked before each group: True returns at once (Ctrl-C)."""
    qa = as_numpy(q)    # (ne3, n_head, n_batch, head_dim_k)
    read_k, read_v = kv_head_reader(k), kv_head_reader(v)
    ma = as_numpy(mask) if mask is not None else None  # (ne33, ne32, rows, n_kv)
    sa = as_numpy(sinks).reshape(-1) if sinks is not None else None
    out = as_numpy(dst)  # (ne3, n_batch, n_head, head_dim_v)
    if logit_softcap != 0.0:
        scale = scale / logit_softcap
    slopes = reference.alibi_slopes(dims.n_head, max_bias)
    g = dims.gqa
    for pair in range(ith, dims.ne3 * dims.n_head_kv, nth):
        if stop is not None and stop():
            return
        s, hk = divmod(pair, dims.n_head_kv)
        hs = slice(hk * g, (hk + 1) * g)
        res = attend_group_skipping(
            qa[s, hs], read_k(s, hk), read_v(s, hk),
            reference.group_mask_rows(ma, s, range(hk * g, (hk + 1) * g), dims.n_batch),
            slopes[hs], None if sa is None else sa[hs], scale, logit_softcap, np.float32)
        out[s, :, hs, :] = res.transpose(1, 0, 2)
