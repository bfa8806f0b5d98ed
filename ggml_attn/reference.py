"""numpy reference of ``ggml_flash_attn_ext``.

All arrays here are in **numpy axis order** (the reverse of ggml's ``ne[0..3]``):

    q     (ne3, n_head,    n_batch, head_dim_k)   ggml q    [head_dim_k, n_batch, n_head,    ne3]
    k     (ne3, n_head_kv, n_kv,    head_dim_k)   ggml k    [head_dim_k, n_kv,    n_head_kv, ne3]
    v     (ne3, n_head_kv, n_kv,    head_dim_v)   ggml v    [head_dim_v, n_kv,    n_head_kv, ne3]
    mask  (ne33, ne32, n_rows >= n_batch, n_kv)   ggml mask [n_kv, n_rows, ne32, ne33]
    sinks (n_head,)
    out   (ne3, n_batch, n_head,    head_dim_v)   ggml res  [head_dim_v, n_head,  n_batch,   ne3]

K/V may be given as float arrays or, with ``kv_type``, as ggml storage arrays
(F16 ``float16``, BF16 ``uint16`` bits). The math runs in ``dtype`` (float64 for tests).
"""
from __future__ import annotations

import math

import numpy as np

from .dtypes import GGML_TYPE_F32, to_float
from .variants import CELL_LIST_THREADS


def alibi_slopes(n_head: int, max_bias: float) -> np.ndarray:
    """ALiBi slope per query head, float64 ``(n_head,)``; all ones when ``max_bias == 0``."""
    if max_bias <= 0.0:
        return np.ones(n_head, dtype=np.float64)
    n_head_log2 = 1 << int(math.floor(math.log2(n_head)))
    m0 = 2.0 ** (-max_bias / n_head_log2)
    m1 = 2.0 ** (-(max_bias / 2.0) / n_head_log2)
    h = np.arange(n_head)
    return np.where(h < n_head_log2, m0 ** (h + 1), m1 ** (2 * (h - n_head_log2) + 1))


def attend_group(q, k, v, mask_rows, slopes, sinks, scale: float, logit_softcap: float,
                 dtype=np.float64) -> np.ndarray:
    """Attention of ``g`` query heads that share one KV head, numpy order.

    q ``(g, n_batch, head_dim_k)``, k ``(n_kv, head_dim_k)``, v ``(n_kv, head_dim_v)``, mask_rows ``(g, n_batch, n_kv)``
    or None, slopes ``(g,)``, sinks ``(g,)`` or None; ``scale`` already divided by the softcap.
    Returns ``(g, n_batch, head_dim_v)`` in ``dtype``.

    Non-finite values behave as in ggml's scalar CPU kernel, which walks the cells of a row with
    a running max that starts at -inf (its online softmax, here in closed form):

    * a cell whose mask is -inf is skipped: nothing K or V hold there reaches the output
      (NaN, inf: a KV cache's unused cells are uninitialised memory);
    * a NaN logit at a visible cell (NaN in q, k or the mask, ``inf * 0`` in q.k) -> NaN row;
    * one +inf logit (a +inf mask cell, inf in q or k) -> that cell's V, every other weight 0;
      two or more -> NaN row;
    * a -inf logit at a visible cell weighs 0, except at the row's first visible cell -> NaN;
    * non-finite V at a visible cell enters as ``weight * v`` (``0 * inf`` = NaN);
    * a sink is folded in after the cells as ggml does (NaN sink -> NaN row);
    * a row with no visible cell gives zeros.
    """
    with np.errstate(all="ignore"):  # inf - inf, 0 * inf: handled below, no warnings
        v = np.asarray(v, dtype=dtype)
        logits = np.matmul(np.asarray(q, dtype=dtype), np.asarray(k, dtype=dtype).T) * dtype(scale)
        if logit_softcap != 0.0:
            logits = dtype(logit_softcap) * np.tanh(logits)
        m = None if mask_rows is None else np.asarray(mask_rows, dtype=dtype)
        if np.isfinite(logits.sum()):  # every q.k finite: the common case, fast path
            if m is not None:
                logits = logits + np.asarray(slopes, dtype=dtype)[:, None, None] * m  # masked: -inf
            row_max = logits.max(axis=-1, keepdims=True)
            if not (np.isnan(row_max).any() or (row_max == np.inf).any()):  # no NaN/+inf mask cell
                p = np.exp(logits - np.where(np.isfinite(row_max), row_max, 0.0))  # masked: 0
                acc = np.matmul(p, v)
                if not np.isfinite(acc).all():  # non-finite V somewhere (0 * NaN at a masked cell)
                    acc = _weighted_values(p, v, None if m is None else m != -np.inf)
                return _normalize(acc, p.sum(axis=-1, keepdims=True), row_max, sinks, None, dtype)
            logits = np.matmul(np.asarray(q, dtype=dtype), np.asarray(k, dtype=dtype).T) * dtype(scale)
            if logit_softcap != 0.0:
                logits = dtype(logit_softcap) * np.tanh(logits)
        visible = None
        if m is not None:
            visible = m != -np.inf
            logits = logits + np.asarray(slopes, dtype=dtype)[:, None, None] * m
            # a masked cell is skipped: whatever q.k gave there (NaN from garbage K) is dropped
            logits = np.where(visible, logits, -np.inf)
        row_max = logits.max(axis=-1, keepdims=True)  # NaN when a visible logit is NaN
        nan_row = np.isnan(row_max)
        plus = row_max == np.inf
        if plus.any():
            is_inf = logits == np.inf
            nan_row |= plus & (is_inf.sum(axis=-1, keepdims=True) > 1)
        # the first visible cell: its logit -inf -> exp(-inf - (-inf)) = NaN in ggml's running max
        if visible is None:
            first = logits[..., :1]
            has_visible = np.ones_like(nan_row)
        else:
            idx = np.argmax(visible, axis=-1)[..., None]
            first = np.take_along_axis(logits, idx, axis=-1)
            has_visible = np.take_along_axis(visible, idx, axis=-1)
        nan_row |= has_visible & (first == -np.inf)
        p = np.exp(logits - np.where(np.isfinite(row_max), row_max, 0.0))  # masked cells: 0
        if plus.any():
            p = np.where(plus, is_inf.astype(dtype), p)
        acc = _weighted_values(p, v, visible)
        return _normalize(acc, p.sum(axis=-1, keepdims=True), row_max, sinks, nan_row, dtype)


def _normalize(acc, denom, row_max, sinks, nan_row, dtype):
    """Fold in the sinks as ggml does after the cells, divide by the weight sum (0 -> zeros),
    NaN where ``nan_row``. Shapes ``(g, n_batch, head_dim_v)`` / ``(g, n_batch, 1)``."""
    if sinks is not None:
        sink = np.asarray(sinks, dtype=dtype)[:, None, None]
        above = sink > row_max  # comparisons with NaN are False, as in C
        ms = np.where(above, np.exp(row_max - sink), 1.0)
        acc = np.where(above, acc * ms, acc)
        denom = denom * ms + np.where(above, 1.0, np.exp(sink - row_max))
    out = np.where(denom == 0, 0.0, acc / np.where(denom == 0, 1.0, denom))
    if nan_row is not None:
        out = np.where(nan_row, np.nan, out)
    return out.astype(dtype, copy=False)


def _weighted_values(p, v, visible):
    """``p @ v`` where a cell a row does not see contributes exactly 0 even if V is NaN/inf there
    (``0 * NaN`` would be NaN); a visible non-finite V enters as ``p * v``.
    p ``(g, n_batch, n_kv)``, v ``(n_kv, head_dim_v)``, visible bool like p or None (all visible)."""
    finite = np.isfinite(v)
    if finite.all():
        return np.matmul(p, v)
    acc = np.matmul(p, np.where(finite, v, 0.0))
    bad = np.flatnonzero(~finite.all(axis=1))
    if visible is not None:
        bad = bad[visible[..., bad].any(axis=(0, 1))]
    for j in bad:  # rare: non-finite V in a cell some row sees
        extra = p[..., j, None] * np.where(finite[j], 0.0, v[j])
        acc = acc + (extra if visible is None else np.where(visible[..., j, None], extra, 0.0))
    return acc


def group_mask_rows(mask: np.ndarray | None, stream: int, heads: range, n_batch: int):
    """Mask rows ``(len(heads), n_batch, n_kv)`` of ``stream`` for query ``heads``, broadcasting
    ggml's mask (numpy order ``(ne33, ne32, rows, n_kv)``) over streams and heads."""
    if mask is None:
        return None
    m = mask[stream % mask.shape[0]]
    return m[np.asarray(heads) % m.shape[0], :n_batch, :]


def flash_attn_ext(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None = None,
    scale: float = 1.0,
    max_bias: float = 0.0,
    logit_softcap: float = 0.0,
    sinks: np.ndarray | None = None,
    *,
    kv_type: int = GGML_TYPE_F32,
    dtype=np.float64,
) -> np.ndarray:
    """Attention exactly as ggml defines it; arrays in numpy order (module docstring).

    Returns ``(ne3, n_batch, n_head, head_dim_v)`` in ``dtype``. A query row whose every
    logit is masked gives zeros (a sink adds weight but no value). NaN/inf: a masked (-inf)
    cell never matters, visible non-finite values propagate as in ggml (:func:`attend_group`).
    """
    if kv_type != GGML_TYPE_F32:
        k, v = to_float(k, kv_type), to_float(v, kv_type)
    ne3, n_head, n_batch, head_dim_k = q.shape
    _, n_head_kv, n_kv, _ = k.shape
    head_dim_v = v.shape[3]
    if k.shape[0] != ne3 or v.shape[:3] != k.shape[:3] or k.shape[3] != head_dim_k or n_head % n_head_kv:
        raise ValueError(f"incompatible shapes q{q.shape} k{k.shape} v{v.shape}")
    gqa = n_head // n_head_kv
    if logit_softcap != 0.0:
        scale = scale / logit_softcap
    slopes = alibi_slopes(n_head, max_bias)
    out = np.zeros((ne3, n_batch, n_head, head_dim_v), dtype=dtype)
    for s in range(ne3):
        for hk in range(n_head_kv):
            heads = range(hk * gqa, (hk + 1) * gqa)
            res = attend_group(q[s, hk * gqa:(hk + 1) * gqa], k[s, hk], v[s, hk],
                               group_mask_rows(mask, s, heads, n_batch), slopes[hk * gqa:(hk + 1) * gqa],
                               None if sinks is None else np.asarray(sinks)[hk * gqa:(hk + 1) * gqa],
                               scale, logit_softcap, dtype)
            out[s, :, hk * gqa:(hk + 1) * gqa, :] = res.transpose(1, 0, 2)
    return out


def nmse(result: np.ndarray, expected: np.ndarray) -> float:
    """Normalized mean squared error as llama.cpp's test-backend-ops computes it:
    ``sum((result - expected)^2) / sum(expected^2)`` in float64; inf when the NaN/inf
    patterns of the two differ."""
    a = np.asarray(result, dtype=np.float64)
    b = np.asarray(expected, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch {a.shape} vs {b.shape}")
    fa, fb = np.isfinite(a), np.isfinite(b)
    if not np.array_equal(fa, fb) or not np.array_equal(np.isnan(a), np.isnan(b)):
        return math.inf
    if not np.array_equal(a[~fa], b[~fb], equal_nan=True):  # same NaN/inf at the same places
        return math.inf
    a, b = a[fa], b[fb]
    den = float(np.sum(b * b))
    num = float(np.sum((a - b) ** 2))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def cell_lists_host(mask: np.ndarray, n_batch: int | None = None, *, aligned: bool = True,
                    threads: int = CELL_LIST_THREADS) -> tuple[np.ndarray, np.ndarray]:
    """Host mirror of the plan's cell-list builder (cuda/fattn_util.cu fattn_cell_lists,
    ``cuda_plan.Plan.cell_lists``), step for step (passes of ``threads`` x 8 cells, each
    thread's 8-cell visibility bits, the block's exclusive scan, writes in cell order), on a
    numpy f16 mask [ne33, ne32, rows, n_kv] (numpy order): (cells int32 [ne33, ne32, n_batch,
    n_kv, 2] with -1 past each count, cnt int32 [ne33, ne32, n_batch]). ``aligned`` only picks
    the kernel's load path (16-byte loads or single cells); the result is the same."""
    m = np.asarray(mask, dtype=np.float16)
    ne33, ne32, rows, n_kv = m.shape
    n_batch = rows if n_batch is None else n_batch
    bits16 = m.view(np.uint16)
    cells = np.full((ne33, ne32, n_batch, n_kv, 2), -1, dtype=np.int32)
    cnt = np.zeros((ne33, ne32, n_batch), dtype=np.int32)
    for i33 in range(ne33):
        for i32 in range(ne32):
            for t in range(n_batch):
                row, out, base = bits16[i33, i32, t], cells[i33, i32, t], 0
                for c0 in range(0, n_kv, 8 * threads):
                    c = c0 + 8 * np.arange(threads)[:, None] + np.arange(8)[None, :]   # [thread, e]
                    b = np.where(c < n_kv, row[np.minimum(c, n_kv - 1)], np.uint16(0xFC00))
                    vis = b != 0xFC00                                                     # bits
                    n = vis.sum(axis=1)
                    start = base + np.cumsum(n) - n                                       # exclusive scan
                    for th in np.flatnonzero(n):
                        e = np.flatnonzero(vis[th])
                        pos = start[th] + np.arange(len(e))
                        out[pos, 0] = c[th, e]
                        out[pos, 1] = b[th, e].view(np.float16).astype(np.float32).view(np.int32)
                    base += int(n.sum())
                cnt[i33, i32, t] = base
    return cells, cnt
