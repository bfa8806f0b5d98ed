"""The sm_90a decode's launch shape (cuda/fattn_decode_tma.cu): what the launch configuration
(cuda_launch.py) and the call binder (cuda_backend.py) need.

Rows: the decode-tc layout -- 16 rows per group, the ``pack`` query heads of one KV head x
16 / pack tokens of one query tile of one stream (the plan's tile map for that query tile
size). Grid: persistent, one wave of ``blocks`` (the occupancy API's blocks per SM x SMs;
without a plan aligned to the row groups, ``aligned_blocks``), each taking an equal share of
the flattened (group, live KV tile) work. Workspace: two partial
slots per block (its first and its last group), and one counter per group.
"""
from __future__ import annotations

import math

from .dtypes import GGML_TYPE_BF16, GGML_TYPE_F16
from .instances import pick

THREADS = 160      # four consumer warps and the producer warp
ROWS = 16          # rows of a group (one m16 tile)
CONSUMERS = 4
BOX_BYTES = 64 * 128   # one 64-cell x 64-element box of the kv_map (wgmma_shape.kv_map)
# instances (FATTN_DECODE_TMA_INSTANCE in cuda/fattn_decode_tma.cu): kernel, head size, ring
# stages, K/V type. The op runs FOR_TYPE's (a warp per tile, 6 stages); the others are A/B rows
# of tools/gpu_bench.py ("split-s4": four warps on every tile, 16 cells each). On the H200 the
# three were within 1% of each other from B=64 4k on (where auto runs the kernel); below, "s4"
# was 1-3% faster than "s6" and "split-s4" mixed (bench/results/2026-12-01-2783807.json).
CONFIGS = {
    "s6": ("fattn_decode_tma_d128", 128, 6, GGML_TYPE_F16),
    "s6-bf16": ("fattn_decode_tma_bf16_d128", 128, 6, GGML_TYPE_BF16),
    "s4": ("fattn_decode_tma_s4_d128", 128, 4, GGML_TYPE_F16),
    "split-s4": ("fattn_decode_tma_split_d128", 128, 4, GGML_TYPE_F16),
}
FOR_TYPE = {GGML_TYPE_F16: "s6", GGML_TYPE_BF16: "s6-bf16"}


def config(kv_type: int, override: str = "") -> str:
    """The CONFIGS key for K/V of ``kv_type``: ``override`` (cuda_launch.DECODE_TMA_CONFIG) when
    set, else FOR_TYPE's. ValueError for an unknown key or one of another K/V type."""
    return pick(CONFIGS, FOR_TYPE, kv_type, override, lambda c: c[3], "sm_90a decode", "DECODE_TMA_CONFIG")


def smem_bytes(d: int, stages: int) -> int:
    """dtma::smem_bytes<D, STAGES>() of cuda/fattn_decode_tma.cu: alignment slack, the K/V ring,
    the merge buffer, the warps' row maxima and sums, the ring's barriers, the flag."""
    return 1024 + stages * 2 * (d // 64) * BOX_BYTES + ROWS * d * 4 + CONSUMERS * ROWS * 2 * 4 + 2 * stages * 8 + 16


def workspace_bytes(blocks: int, d: int) -> tuple[int, int]:
    """(bytes of the partial outputs, bytes in all): two slots of ROWS x d f32 per block, then
    their (max, sum) pairs (FattnParams.ws_o / ws_ml)."""
    o = 2 * blocks * ROWS * d * 4
    return o, o + 2 * blocks * ROWS * 8


def n_groups(n_head: int, pack: int, n_q_tiles: int, ne3: int) -> int:
    """Row groups of a call: the split counters the kernel counts in."""
    return ne3 * n_q_tiles * (n_head // pack)


def aligned_blocks(slots: int, groups: int, min_fill: float = 0.9) -> int:
    """Persistent blocks for ``groups`` row groups of equal work (no plan) on ``slots``
    resident-block slots: the largest count >= ``min_fill`` x slots that ``groups`` divides or
    that divides ``groups`` -- block ranges then start and end on group boundaries or cut every
    group into the same number of parts (no block holds two parts, no group is split in two
    where it fits one block) -- else ``slots``. B=16 4k on 132 SMs: 128 groups, 128 blocks."""
    for b in range(slots, max(1, math.ceil(slots * min_fill)) - 1, -1):
        if groups % b == 0 or b % groups == 0:
            return b
    return slots
