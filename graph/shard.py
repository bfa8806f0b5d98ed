"""Head-parallel (tensor-parallel) sharding: what each of ``n_rank`` ranks owns.

Rank ``r`` of ``N`` (``N`` divides ``n_head_kv``) holds:

* KV heads ``[r*n_head_kv/N, (r+1)*n_head_kv/N)`` of every layer's K/V cache, and the query
  heads of those GQA groups, ``[r*n_head/N, (r+1)*n_head/N)`` (query head ``h`` reads KV head
  ``h // (n_head/n_head_kv)``, so a group never straddles two ranks): attention needs no
  communication;
* with the full block (``layers.full_layer``): the **column-parallel** slices of
  ``wq wk wv`` (its heads' output features) and ``wg wu`` (FFN columns
  ``[r*n_ff/N, (r+1)*n_ff/N)``), and the **row-parallel** slices of ``wo`` (its heads' input
  features) and ``wd`` (its FFN columns as inputs). Each rank's ``wo`` / ``wd`` product is a
  partial sum of the residual update; one all-reduce (sum) after each makes it whole on every
  rank (``tp.py``). Norms and the residual stream ``x [n_embd, n_tokens]`` are replicated.

Weight orders: the arrays are numpy order ``(n_out, n_in)`` = ggml ``[n_in, n_out]``
(``layers.full_layer``). Column-parallel = a slice of numpy axis 0 (ggml ``ne1``, output
rows); row-parallel = a slice of numpy axis 1 (ggml ``ne0``, the contiguous input dimension).
Slices are made contiguous (cuBLAS and ggml tensors need dense rows).

The cache of a rank is a ``KVCache`` of ``n_head_kv/N`` heads (``rank_cache``) with the same
cells as every other rank's: the ubatch plan (split, cells, mask, row indices) does not depend
on heads, so one plan serves every rank. ALiBi slopes depend on a head's global index and are
refused with ``N > 1`` (:class:`ShardError`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .kv_cache import KVCache
from .attn_config import AttnConfig

__all__ = ["ShardError", "HeadShard", "check_shardable", "rank_config", "rank_cache", "shard_weights",
           "kv_head_slice", "shard_rows", "COLUMN_PARALLEL", "ROW_PARALLEL"]

COLUMN_PARALLEL = ("wq", "wk", "wv", "wg", "wu")   # numpy axis 0 (output features) sliced
ROW_PARALLEL = ("wo", "wd")                         # numpy axis 1 (input features) sliced, then all-reduce


class ShardError(ValueError):
    """A geometry that cannot be split over the ranks asked for."""


def check_shardable(n_head: int, n_head_kv: int, n_rank: int, *, n_ff: int | None = None,
                    alibi: bool = False) -> None:
    """:class:`ShardError` unless ``n_rank`` ranks can split these heads (and FFN columns)."""
    if n_rank < 1:
        raise ShardError(f"the number of ranks must be at least 1, got {n_rank}")
    if n_head_kv % n_rank:
        raise ShardError(f"head-parallel split: n_head_kv {n_head_kv} is not divisible by {n_rank} ranks "
                         f"(each rank holds whole KV heads with their query groups)")
    if n_head % n_head_kv:
        raise ShardError(f"n_head {n_head} is not a multiple of n_head_kv {n_head_kv}")
    if n_ff is not None and n_ff % n_rank:
        raise ShardError(f"head-parallel split: n_ff {n_ff} is not divisible by {n_rank} ranks")
    if alibi and n_rank > 1:
        raise ShardError("ALiBi slopes depend on a head's global index; head-parallel ranks do not support "
                         "max_bias > 0")


@dataclass(frozen=True)
class HeadShard:
    """Rank ``rank`` of ``n_rank``: the heads, rows and columns it owns (ranges)."""

    rank: int
    n_rank: int

    def __post_init__(self):
        if not 0 <= self.rank < self.n_rank:
            raise ShardError(f"rank {self.rank} is not in 0..{self.n_rank - 1}")

    def _part(self, n: int) -> range:
        k = n // self.n_rank
        return range(self.rank * k, (self.rank + 1) * k)

    def kv_heads(self, n_head_kv: int) -> range:
        return self._part(n_head_kv)

    def q_heads(self, n_head: int) -> range:
        """Query heads of the rank's GQA groups (``n_head / n_rank`` consecutive heads)."""
        return self._part(n_head)

    def ff_cols(self, n_ff: int) -> range:
        return self._part(n_ff)

    def features(self, heads: range, head_dim_k: int) -> slice:
        """The features ``[h0*D, h1*D)`` of a head range (a row or column slice)."""
        return slice(heads.start * head_dim_k, heads.stop * head_dim_k)


def rank_config(cfg: AttnConfig, n_rank: int) -> AttnConfig:
    """The per-rank config: ``n_head / N`` query and ``n_head_kv / N`` KV heads, everything else
    (layers, head sizes, scale, softcap, window, seed) as ``cfg``."""
    check_shardable(cfg.n_head, cfg.n_head_kv, n_rank, alibi=cfg.alibi)
    return replace(cfg, n_head=cfg.n_head // n_rank, n_head_kv=cfg.n_head_kv // n_rank,
                   scale_override=cfg.scale)


def rank_cache(n_rank: int, n_ctx: int, n_seq_max: int = 1, *, n_head_kv: int, **kw) -> KVCache:
    """A rank's ``KVCache``: the cells of the full cache (same ``n_ctx``, streams, ``kv_size``),
    ``n_head_kv / n_rank`` heads; ``kw`` as ``KVCache`` (layers, head sizes, dtype, ``xp``)."""
    if n_head_kv % n_rank:
        raise ShardError(f"head-parallel split: n_head_kv {n_head_kv} is not divisible by {n_rank} ranks")
    return KVCache(n_ctx, n_seq_max, n_head_kv=n_head_kv // n_rank, **kw)


def shard_rows(arr, shard: HeadShard, n_head: int, head_dim_k: int):
    """The rank's heads of per-token rows: ``arr (..., n_head * head_dim_k)`` or ``(..., n_head,
    head_dim_k)`` -> the same layout with only the rank's ``n_head / N`` heads (a view)."""
    heads = shard.q_heads(n_head)
    if arr.shape[-1] == n_head * head_dim_k:
        return arr[..., shard.features(heads, head_dim_k)]
    return arr[..., heads.start:heads.stop, :]


def kv_head_slice(kv, shard: HeadShard, n_head_kv: int, head_dim_k: int):
    """The rank's slice of full K or V storage ``(n_layer, n_stream, kv_size, n_head_kv * head_dim_k)``
    (``KVCache.k`` / ``.v``, numpy order): ``(..., n_head_kv/N * head_dim_k)`` -- what the rank's
    cache holds."""
    return kv[..., shard.features(shard.kv_heads(n_head_kv), head_dim_k)]


def shard_weights(w: dict, shard: HeadShard, cfg: AttnConfig, *, xp=np) -> dict:
    """One layer's full-block weights (``layers.full_layer``: keys ``wq wk wv wo wg wu wd``,
    numpy ``(n_out, n_in)``) -> the rank's slices, contiguous arrays of ``xp`` (same dtype).

    ``wq (n_head*D, n_embd)``: rows of the rank's query heads; ``wk wv``: rows of its KV heads;
    ``wo (n_embd, n_head*head_dim_v)``: columns of its query heads; ``wg wu (n_ff, n_embd)``: rows
    ``ff_cols``; ``wd (n_embd, n_ff)``: columns ``ff_cols``."""
    n_ff = int(w["wg"].shape[0])
    check_shardable(cfg.n_head, cfg.n_head_kv, shard.n_rank, n_ff=n_ff)
    q = shard.features(shard.q_heads(cfg.n_head), cfg.head_dim_k)
    kf = shard.features(shard.kv_heads(cfg.n_head_kv), cfg.head_dim_k)
    vf = shard.features(shard.kv_heads(cfg.n_head_kv), cfg.head_dim_v)
    of = shard.features(shard.q_heads(cfg.n_head), cfg.head_dim_v)
    ff = slice(shard.ff_cols(n_ff).start, shard.ff_cols(n_ff).stop)
    parts = {"wq": w["wq"][q], "wk": w["wk"][kf], "wv": w["wv"][vf], "wo": w["wo"][:, of],
             "wg": w["wg"][ff], "wu": w["wu"][ff], "wd": w["wd"][:, ff]}
    return {k: xp.ascontiguousarray(v) for k, v in parts.items()}


def shard_layer_weights(weights: list, shard: HeadShard, cfg: AttnConfig, *, xp=np) -> list:
    """:func:`shard_weights` of every layer; layers sharing one set keep sharing one slice."""
    done: dict = {}
    out = []
    for w in weights:
        s = done.get(id(w))
        if s is None:
            s = done[id(w)] = shard_weights(w, shard, cfg, xp=xp)
        out.append(s)
    return out


__all__.append("shard_layer_weights")
