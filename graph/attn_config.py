"""The geometry and attention parameters of a stack of attention layers (:class:`AttnConfig`):
what every module of the graph path takes, from the split's cost model to the graph builder."""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["AttnConfig"]


@dataclass(frozen=True)
class AttnConfig:
    """Geometry and attention parameters of a stack of ``n_layer`` attention layers.

    ``head_dim_k`` / ``head_dim_v``: the K and V head sizes (llama.cpp's n_embd_head_k / _v;
    ``head_dim_v`` None: ``head_dim_k``, resolved at construction). The scale defaults to
    ``1/sqrt(head_dim_k)``; ``max_bias > 0`` turns on ALiBi (the mask then
    carries ``-|p_cell - p_row|``); ``n_swa > 0`` is a sliding window; ``pos_limit > 0``: a
    batch with a position at or past it is refused (a model whose sliding-window layers run as
    dense ones, exact only below the window: gemma2); ``seed`` picks the Q/K/V hash.
    """

    n_layer: int = 1
    n_head: int = 2
    n_head_kv: int = 1
    head_dim_k: int = 16
    head_dim_v: int | None = None
    max_bias: float = 0.0
    logit_softcap: float = 0.0
    n_swa: int = 0
    pos_limit: int = 0
    seed: int = 0
    scale_override: float | None = None

    def __post_init__(self):
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim_k)   # (frozen)
        if self.n_head % self.n_head_kv:
            raise ValueError(f"n_head {self.n_head} is not a multiple of n_head_kv {self.n_head_kv}")
        if min(self.n_layer, self.n_head, self.n_head_kv, self.head_dim_k, self.head_dim_v) <= 0:
            raise ValueError("AttnConfig sizes must be positive")

    @property
    def scale(self) -> float:
        return self.scale_override if self.scale_override is not None else 1.0 / math.sqrt(self.head_dim_k)

    @property
    def alibi(self) -> bool:
        return self.max_bias > 0.0
