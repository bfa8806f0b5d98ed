"""Layer-parallel ranks (llama.cpp's ``-sm layer``): contiguous layer ranges per rank, the
activations handed from rank ``r`` to rank ``r + 1`` once per ubatch.

Rank ``r`` of ``N`` owns global layers ``layer_ranges(n_layer, shares)[r]`` (llama.cpp's rule
for ``--tensor-split``: layer ``il`` goes to the first rank whose cumulative share exceeds
``il / n_layer``; 32 layers, ``-ts 1,1``: layers 0-15 on rank 0, 16-31 on rank 1). It holds:

* the KV cache of its layers only (:func:`layer_cache`: every head, the same cells as every
  other rank's, ``len(layers)`` layers; cache layer ``il - a`` is global layer ``il``);
* the weights of its layers (``weights[a:b]``).

Its graph is ``build.build_ubatch_graph(..., layers=range(a, b))``, the one builder. Per ubatch
(the plan -- split, cells, mask -- made identically on every rank, as head-parallel ranks do):

* ``layer="full"``: rank 0 takes the input ``x``; rank ``r > 0`` receives the residual stream
  ``x (n_tokens, n_embd)`` F32 from rank ``r - 1`` into its graph's input, computes its layers and
  sends its output to rank ``r + 1``; the last rank holds the final ``x``;
* ``layer="attn"``: layers do not depend on each other, but the pipeline order is kept: rank
  ``r > 0`` receives rank ``r - 1``'s last attention output ``(n_tokens, n_head * head_dim_v)`` before it
  computes (the same volume as ``x`` in a model with ``n_embd = n_head * head_dim_v``), and passes its
  own on, so a ubatch runs through the ranks one after another, as in the full block.

No all-reduce: one handover per ubatch per rank boundary, but for a single ubatch the ranks work
one after another (row mode, ``tp.py``: two all-reduces per layer, every rank busy on every
layer). Messages go through the communicator's ``send(arr, peer)`` / ``recv(arr, peer)``:
``tp.LocalGroup`` (threads of one process, the CPU tests) or ``tp.NcclComm`` (one process per
GPU, ``ncclSend``/``ncclRecv`` on the current stream).

:meth:`PipeRankEngine.synchronize` on several GPUs first *drains* the pipeline: the last rank
sends a one-element token to rank 0, which receives it on its stream, so that rank 0's stream
(its timers) ends only after the last rank finished every ubatch. Every rank must call it at
the same point (the tools do: ``Runner.decode`` ends with it on every rank).
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from . import build
from .engine import UntimedEngine
from .kv_cache import KVCache
from .shard import ShardError
from .tp import LockstepEngine, LocalGroup

__all__ = ["layer_ranges", "check_layer_split", "LayerShard", "layer_cache", "kv_layer_slice",
           "PipeRankEngine", "PipelineEngine"]


def _shares(shares, n_rank: int) -> list[Fraction]:
    vals = [1] * n_rank if shares is None or not len(shares) else list(shares)
    if len(vals) != n_rank:
        raise ShardError(f"layer split: {len(vals)} share(s) for {n_rank} ranks")
    try:
        fr = [Fraction(v) for v in vals]
    except (TypeError, ValueError):
        raise ShardError(f"layer split: shares must be numbers, got {vals}") from None
    if any(f < 0 for f in fr) or not any(fr):
        raise ShardError(f"layer split: shares must be non-negative and not all zero, got {vals}")
    return fr


def layer_ranges(n_layer: int, n_rank: int, shares=None) -> list[range]:
    """The global layers of each of ``n_rank`` ranks, contiguous and in rank order, split in
    proportion to ``shares`` (None: equal) as llama.cpp splits ``-ts``; :class:`ShardError` when a
    rank would get no layer (more ranks than layers, a zero or too small share)."""
    if n_rank < 1:
        raise ShardError(f"the number of ranks must be at least 1, got {n_rank}")
    if n_layer < 1:
        raise ShardError(f"n_layer must be at least 1, got {n_layer}")
    if n_rank > n_layer:
        raise ShardError(f"layer split: {n_rank} ranks but only {n_layer} layer(s); each rank needs a layer")
    fr = _shares(shares, n_rank)
    total = sum(fr)
    cum, acc = [], Fraction(0)
    for f in fr:
        acc += f
        cum.append(acc / total)
    owner = [next(r for r, c in enumerate(cum) if c > Fraction(il, n_layer)) for il in range(n_layer)]
    out = [range(owner.index(r), len(owner) - owner[::-1].index(r)) if r in owner else range(0) for r in range(n_rank)]
    empty = [r for r, rg in enumerate(out) if not len(rg)]
    if empty:
        raise ShardError(f"layer split of {n_layer} layers by shares {[float(f) for f in fr]}: rank(s) "
                         f"{empty} get no layer; give every rank a larger share or use fewer ranks")
    return out


def check_layer_split(n_layer: int, n_rank: int, shares=None) -> list[range]:
    """:func:`layer_ranges`, for callers that check before any rank starts."""
    return layer_ranges(n_layer, n_rank, shares)


@dataclass(frozen=True)
class LayerShard:
    """Rank ``rank`` of ``n_rank`` and its global ``layers``."""

    rank: int
    n_rank: int
    layers: range

    def __post_init__(self):
        if not 0 <= self.rank < self.n_rank:
            raise ShardError(f"rank {self.rank} is not in 0..{self.n_rank - 1}")

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.n_rank - 1


def layer_cache(layers: range, n_ctx: int, n_seq_max: int = 1, **kw) -> KVCache:
    """A rank's ``KVCache``: the cells of the full cache, every head, ``len(layers)`` layers;
    ``kw`` as ``KVCache`` (heads, head sizes, dtype, ``unified``, ``xp``; not ``n_layer``)."""
    if "n_layer" in kw:
        raise TypeError("layer_cache takes the layers, not n_layer")
    return KVCache(n_ctx, n_seq_max, n_layer=len(layers), **kw)


def kv_layer_slice(kv, layers: range):
    """The rank's slice of full K or V storage ``(n_layer, n_stream, kv_size, n_embd)``
    (``KVCache.k`` / ``.v``): what the rank's cache holds."""
    return kv[layers.start:layers.stop]


class PipeRankEngine(UntimedEngine):
    """One layer-parallel rank as ``graph.driver``'s engine (on GPUs one per process with
    ``tp.NcclComm``; :class:`PipelineEngine` runs ``N`` on threads over a ``tp.LocalGroup``).

    ``cache``: the rank's cache (:func:`layer_cache`); ``cfg``: the full config; ``layers``: the
    rank's global layers; ``inputs(plan)``: the full inputs of a ubatch as ``tp.RankEngine`` takes
    them (``"attn"``: per global layer ``(q, k, v)``, of which the rank takes its layers';
    ``"full"``: ``x (n_tokens, n_embd)``, read by rank 0 only); ``weights``: every layer's (the
    rank keeps ``weights[a:b]``)."""

    def __init__(self, cache, cfg, rank: int, n_rank: int, comm, inputs, *, layers: range, layer: str = "attn",
                 weights=None, all_custom=None, n_threads: int = 1, fa=None):
        self.cache, self.cfg, self.comm, self.inputs, self.layer = cache, cfg, comm, inputs, layer
        self.shard = LayerShard(rank, n_rank, build.check_layers(cfg, layers))
        self.layers = self.shard.layers
        self.xp = cache.xp
        self.weights = list(weights[self.layers.start:self.layers.stop]) if layer == "full" else None
        self.all_custom, self.n_threads, self.fa = all_custom, n_threads, fa
        self._token = None

    def rank_inputs(self, ins):
        return ins if self.layer == "full" else list(ins)[self.layers.start:self.layers.stop]

    def _handover_buffer(self, g, n_tok: int):
        """What rank ``r - 1`` sends, received here: the graph's ``x`` (full) or a buffer of the
        previous rank's last attention output (attn)."""
        if self.layer == "full":
            return g.array(g.x_in)
        return self.xp.empty((n_tok, self.cfg.n_head * self.cfg.head_dim_v), dtype=np.float32)

    def run_ubatch(self, plan, ins=None):
        """``layer="attn"``: per layer of the rank the attention output ``(n_tokens, n_head, head_dim_v)``;
        ``"full"``: ``[x (n_tokens, n_embd)]`` after the rank's last layer (the model's output on
        the last rank). numpy arrays."""
        xp, s = self.xp, self.shard
        n_tok = plan.ubatch.n_tokens
        g = build.build_ubatch_graph(self.cache, plan, self.cfg, layer=self.layer, weights=self.weights,
                                     all_custom=self.all_custom, fa=self.fa, layers=self.layers)
        try:
            if self.layer == "full":
                if s.first:
                    ins = self.inputs(plan) if ins is None else ins
                    g.set_x(xp.asarray(np.asarray(ins, dtype=np.float32)))
            else:
                mine = self.rank_inputs(self.inputs(plan) if ins is None else ins)
                g.set_inputs(*[[xp.asarray(np.ascontiguousarray(x[j])) for x in mine] for j in range(3)])
            if not s.first:
                self.comm.recv(self._handover_buffer(g, n_tok), s.rank - 1)
            g.compute(self.n_threads)
            outs = g.outputs()[-1:] if self.layer == "full" else g.outputs()
            if not s.last:
                self.comm.send(xp.ascontiguousarray(outs[-1].reshape(n_tok, -1)), s.rank + 1)
            return [o.get() if hasattr(o, "get") else np.array(o, copy=True) for o in outs]
        finally:
            g.free()

    def drain(self) -> None:
        """The last rank's token to rank 0 (module doc); nothing with one rank."""
        s = self.shard
        if s.n_rank == 1:
            return
        if self._token is None:
            self._token = self.xp.zeros(1, dtype=np.float32)
        if s.last:
            self.comm.send(self._token, 0)
        elif s.first:
            self.comm.recv(self._token, s.n_rank - 1)

    def synchronize(self) -> None:
        self.drain()
        if self.xp is not np:
            self.xp.cuda.get_current_stream().synchronize()


class PipelineEngine(LockstepEngine):
    """``N`` layer-parallel ranks in one process (``graph.driver``'s engine interface): one plan per
    ubatch, run through every rank's :class:`PipeRankEngine` on a thread of its own, the
    activations handed over through a ``tp.LocalGroup``.

    ``caches[r]``: rank ``r``'s cache (:func:`layer_cache` of ``ranges[r]``; the driver plans on
    ``caches[0]``); ``ranges``: the ranks' layers (default :func:`layer_ranges` with ``shares``).
    ``run_ubatch`` returns, for ``"attn"``, the attention output of every layer in order (the
    ranks' lists joined), for ``"full"`` ``[x]`` of the last rank."""

    def __init__(self, caches, cfg, inputs, *, layer: str = "attn", weights=None, ranges=None, shares=None,
                 all_custom=True, n_threads: int = 1, fa=None, timeout: float = 120.0):
        self.n_rank = len(caches)
        self.cfg, self.inputs, self.layer = cfg, inputs, layer
        self.ranges = layer_ranges(cfg.n_layer, self.n_rank, shares) if ranges is None else list(ranges)
        if len(self.ranges) != self.n_rank:
            raise ShardError(f"{len(self.ranges)} layer ranges for {self.n_rank} caches")
        self.group = LocalGroup(self.n_rank, timeout=timeout)
        self.ranks = [PipeRankEngine(c, cfg, r, self.n_rank, self.group.comms[r], inputs, layers=self.ranges[r],
                                     layer=layer, weights=weights, all_custom=all_custom, n_threads=n_threads, fa=fa)
                      for r, c in enumerate(caches)]

    @property
    def weights(self):
        return [r.weights for r in self.ranks]

    def _combine(self, results: list):
        if self.layer == "full":
            return results[-1]
        return [o for res in results for o in res]
