"""The GPU engine of one head-parallel rank (``-sm row``): ``cuda_engine.CudaEngine`` with the
rank's share of heads, weights and cache (``graph/shard.py``) and NCCL all-reduces in the full
block (``graph/tp.py``).

The weights are made as the one-GPU engine makes them (same generator, same seed), then sliced
and the full set dropped, so N ranks compute the one-GPU model. Inputs are the one-GPU engine's
inputs; ``--layer attn`` gives each rank its heads' slice of Q/K/V. The tool's timer is rank 0's
stream; it also accounts the GPU time inside all-reduces (CUDA events, ``NcclComm.seconds``)
into the rank context, printed at the end by ``multi_gpu.wrap``.
"""
from __future__ import annotations

from dataclasses import replace

from .cuda_engine import CudaEngine


class TPCudaEngine(CudaEngine):
    """Rank ``cfg.tp.rank`` of ``cfg.tp.n_rank`` (``multi_gpu.RankContext``)."""

    def __init__(self, cfg, cache):
        from ggml_attn.graph.shard import HeadShard, rank_config
        from ggml_attn.graph.tp import tp_full_layer
        self.tp = cfg.tp
        self.shard = HeadShard(self.tp.rank, self.tp.n_rank)
        self.full_model = cfg.model
        self.comm = self.tp.comm()   # collective: every rank builds its engine at the same point
        super().__init__(cfg, cache)
        self.full_attn_cfg = self.attn_cfg
        self.attn_cfg = rank_config(self.attn_cfg, self.tp.n_rank)
        n = self.tp.n_rank
        m = self.full_model
        self.m = replace(m, n_head=m.n_head // n, n_head_kv=m.n_head_kv // n, n_ff=m.n_ff // n)
        self.full_layer = tp_full_layer(self.comm)

    def _make_weights(self, rng):
        from ggml_attn.graph.shard import shard_layer_weights
        full = super()._make_weights(rng)
        return shard_layer_weights(full, self.shard, self.attn_cfg, xp=self.xp)

    def inputs(self, plan):
        from ggml_attn.graph.shard import shard_rows
        mine, self.m = self.m, self.full_model
        try:
            ins = super().inputs(plan)
        finally:
            self.m = mine
        if self.cfg.layer == "full":
            return ins
        c, s, n_tok = self.full_attn_cfg, self.shard, plan.ubatch.n_tokens
        q, k, v = ins
        return (shard_rows(q, s, c.n_head, c.head_dim_k),
                shard_rows(k.reshape(n_tok, c.n_head_kv, c.head_dim_k), s, c.n_head_kv, c.head_dim_k).reshape(n_tok, -1),
                shard_rows(v.reshape(n_tok, c.n_head_kv, c.head_dim_v), s, c.n_head_kv, c.head_dim_v).reshape(n_tok, -1))

    def timer(self):
        return _RankTimer(super().timer(), self.comm, self.tp)


class _RankTimer:
    """The engine's timer, also adding the all-reduce GPU time of the timed region to the rank;
    ``before_end()`` runs (on a normal exit) before the end event is recorded."""

    def __init__(self, timer, comm, tp, before_end=None):
        self.timer, self.comm, self.tp = timer, comm, tp
        self.before_end = before_end   # queued before the end event (-sm layer: the pipeline drain)
        self.ns = 0
        self.nccl_s = 0.0

    def __enter__(self):
        self.timer.__enter__()
        self._s0 = self.comm.seconds
        return self

    def __exit__(self, *exc):
        if exc[0] is None and self.before_end is not None:
            self.before_end()
        r = self.timer.__exit__(*exc)
        self.ns = self.timer.ns
        self.nccl_s = self.comm.seconds - self._s0
        self.tp.timed_ns += self.ns
        self.tp.nccl_s += self.nccl_s
        return r
