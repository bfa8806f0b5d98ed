"""Deterministic Q/K/V for a token, from (sequence, position, layer) only.

A token's vectors do not depend on how it was batched, so every split strategy must give the
same attention output for it; that is what makes strategies comparable
(tests/test_graph_equivalence.py).
Values come from a counter-based hash (splitmix64), uniform in [-1, 1). Pad rows get
vectors from a different stream of the hash, ten times larger, so any leak of a pad into a
real token's result is visible.
"""
from __future__ import annotations

import numpy as np

from .attn_config import AttnConfig

__all__ = ["token_vectors", "token_qkv"]

_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xBF58476D1CE4E5B9)
_M3 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer, elementwise on uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + _M1
        x = (x ^ (x >> np.uint64(30))) * _M2
        x = (x ^ (x >> np.uint64(27))) * _M3
        return x ^ (x >> np.uint64(31))


def token_vectors(seq_ids, positions, layer: int, kind: int, n_vec: int, dim: int,
                  seed: int = 0) -> np.ndarray:
    """float32 ``(n_tokens, n_vec, dim)`` in [-1, 1), one value per (token, vector, element),
    a pure function of (seed, kind, layer, seq_id, position, vector, element)."""
    s = np.asarray(seq_ids, dtype=np.uint64).reshape(-1, 1)
    p = np.asarray(positions, dtype=np.uint64).reshape(-1, 1)
    with np.errstate(over="ignore"):
        key = _mix(np.uint64(seed) * np.uint64(1_000_003) + np.uint64(kind) * np.uint64(7919)
                   + np.uint64(layer) * np.uint64(104_729) + np.zeros_like(s))
        key = _mix(key ^ (s * np.uint64(0x100000001B3)))
        key = _mix(key ^ (p * np.uint64(0xC2B2AE3D27D4EB4F)))
        elem = np.arange(n_vec * dim, dtype=np.uint64).reshape(1, -1)
        bits = _mix(key + elem * np.uint64(0x632BE59BD9B4E019))
    u = (bits >> np.uint64(40)).astype(np.float64) / float(1 << 24)
    return (2.0 * u - 1.0).astype(np.float32).reshape(-1, n_vec, dim)


def token_qkv(seq_ids, positions, is_pad, layer: int, cfg: AttnConfig):
    """Q ``(n, n_head, head_dim_k)``, K ``(n, n_head_kv, head_dim_k)``, V ``(n, n_head_kv, head_dim_v)``,
    float32, numpy order, for rows with primary ``seq_ids`` / ``positions`` (int arrays
    ``(n,)``); rows where ``is_pad`` get the pad stream (x10)."""
    seq_ids = np.asarray(seq_ids)
    positions = np.asarray(positions)
    is_pad = np.asarray(is_pad, dtype=bool)
    out = []
    for kind, nv, d in ((1, cfg.n_head, cfg.head_dim_k), (2, cfg.n_head_kv, cfg.head_dim_k),
                        (3, cfg.n_head_kv, cfg.head_dim_v)):
        x = token_vectors(seq_ids, positions, layer, kind, nv, d, cfg.seed)
        if is_pad.any():
            x[is_pad] = 10.0 * token_vectors(seq_ids[is_pad], positions[is_pad], layer, kind + 16, nv, d,
                                             cfg.seed)
        out.append(x)
    return tuple(out)
