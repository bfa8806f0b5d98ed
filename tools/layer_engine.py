"""The GPU engine of one layer-parallel rank (``-sm layer``): ``cuda_engine.CudaEngine`` with the
rank's contiguous range of layers, their weights and KV cache (``graph/pipe.py``), the
activations received from rank ``r - 1`` and sent to rank ``r + 1`` per ubatch (NCCL send/recv
on the engine's stream).

The weights are made as the one-GPU engine makes them (same generator, same seed), then the
rank keeps its layers' and drops the rest, so N ranks compute the one-GPU model. Rank 0 takes
the one-GPU engine's inputs; with ``--layer full`` rank ``r > 0`` takes the residual stream
received from rank ``r - 1`` instead; with ``--layer attn`` every rank reads the shared random
Q/K/V and the handover only keeps the pipeline order (``graph/pipe.py``). ``synchronize()``
and the timer's end drain the pipeline first (the last rank's token to rank 0), so rank 0's
timers cover every rank's work. The tool's timer is rank 0's stream; NCCL time goes to the rank context as
``tp_engine``'s timer does.
"""
from __future__ import annotations

import numpy as np

from .cuda_engine import CudaEngine
from ggml_attn.graph.engine import _NoStream
from .tp_engine import _RankTimer


class LayerCudaEngine(CudaEngine):
    """Rank ``cfg.tp.rank`` of ``cfg.tp.n_rank`` (``multi_gpu.RankContext``, ``mode="layer"``);
    ``cache`` holds the rank's layers only."""

    def __init__(self, cfg, cache):
        from ggml_attn.graph.pipe import LayerShard
        self.tp = cfg.tp
        self.layers = self.tp.layers(cfg.model.n_layer)
        self.shard = LayerShard(self.tp.rank, self.tp.n_rank, self.layers)
        self.comm = self.tp.comm()   # collective: every rank builds its engine at the same point
        self._token = None
        self._received = None   # this ubatch's input from rank r - 1 (rank r > 0)
        super().__init__(cfg, cache)

    def _make_weights(self, rng):
        full = super()._make_weights(rng)
        return full[self.layers.start:self.layers.stop]

    def inputs(self, plan):
        """Rank 0 (and ``--layer attn``): the one-GPU inputs. ``--layer full`` on rank ``r > 0``:
        rank ``r - 1``'s output, received by :meth:`_run`."""
        if self._received is not None and self.cfg.layer == "full":
            return (self._received,)
        return super().inputs(plan)

    def _run(self, entry, g, plan, fresh: bool) -> None:
        """Every ubatch, in pipeline order on the engine's stream: rank ``r > 0`` first receives
        rank ``r - 1``'s output (full: its input ``x``; attn: the previous rank's last attention
        output, waited for and not used), then computes; every rank but the last sends its
        output on."""
        self._received = None
        if not self.shard.first:
            n_tok = plan.ubatch.n_tokens
            width = self.m.n_embd if self.cfg.layer == "full" else self.m.n_head * self.m.head_dim_v
            self._received = self.xp.empty((n_tok, width), dtype=np.float32)
            self.comm.recv(self._received, self.shard.rank - 1)
        super()._run(entry, g, plan, fresh)
        if not self.shard.last:   # on the engine's stream, after the compute
            out = g.output(-1).reshape(plan.ubatch.n_tokens, -1)
            self.comm.send(self.xp.ascontiguousarray(out), self.shard.rank + 1)

    def drain(self) -> None:
        """The pipeline drain, queued on the engine's stream (no host wait): the last rank sends
        a token to rank 0, whose stream then waits for it -- so work queued on rank 0 after
        this (a timer's end event) follows every rank's work so far. Collective: every rank
        calls it at the same point."""
        s = self.shard
        if s.n_rank > 1 and (s.first or s.last):
            with self.stream if self.device else _NoStream():
                if self._token is None:
                    self._token = self.xp.zeros(1, dtype=np.float32)
                if s.last:
                    self.comm.send(self._token, 0)
                else:
                    self.comm.recv(self._token, s.n_rank - 1)

    def synchronize(self) -> None:
        self.drain()
        super().synchronize()

    def timer(self):
        # the drain before the end event: decode steps do not synchronize (Runner.decode(sync=
        # False)), so without it rank 0's timer would stop before the later ranks' layers ran
        return _RankTimer(super().timer(), self.comm, self.tp, before_end=self.drain)
