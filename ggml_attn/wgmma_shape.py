"""The sm_90a prefill's launch shape (cuda/fattn_wgmma.cu, version 1) and the TMA maps its
producer reads K and V through: what the launch configuration (cuda_launch.py) and the call
binder (cuda_backend.py) need, apart from ggml_attn/hopper_prefill.py's direct launches (which
import the backend: this module must not).
"""
from __future__ import annotations

from . import tma
from .dtypes import GGML_TYPE_BF16, GGML_TYPE_F16
from .instances import pick
from .tensor import TensorDesc

THREADS_WS = 384   # two consumer warpgroups and the producer warpgroup (cuda/fattn_wgmma.cuh)
Q_TILE_WS = 128    # query tokens per block (the plan's tile map for it)
CHUNK_WS = 128     # KV cells per step (two of the plan's 64-cell tiles)
# version 1's instances (FATTN_WS_INSTANCE in cuda/fattn_wgmma.cu): kernel, ring stages, K/V
# type, persistent blocks. The op runs WS_FOR_TYPE's (one block per SM walking the tiles
# heaviest first: on the H200 causal 2048 100.6 us against 110.8 for "pp" with one block per
# tile, causal 8192 1047.6 against 1078.7, 4096 without a mask 479.6 against 517.7;
# bench/results/2026-12-01-b69ab2e.json); the others are A/B rows of tools/dev/gpu_bench.py.
WS_CONFIGS = {
    "pp": ("fattn_wgmma_ws_d128", 3, GGML_TYPE_F16, False),
    "pp-bf16": ("fattn_wgmma_ws_bf16_d128", 3, GGML_TYPE_BF16, False),
    "pp-persistent": ("fattn_wgmma_ws_persistent_d128", 3, GGML_TYPE_F16, True),
    "pp-persistent-bf16": ("fattn_wgmma_ws_persistent_bf16_d128", 3, GGML_TYPE_BF16, True),
    "nopp": ("fattn_wgmma_ws_nopp_d128", 3, GGML_TYPE_F16, False),
    "s2": ("fattn_wgmma_ws_s2_d128", 2, GGML_TYPE_F16, False),
}
WS_FOR_TYPE = {GGML_TYPE_F16: "pp-persistent", GGML_TYPE_BF16: "pp-persistent-bf16"}
WS_DEFAULT = WS_FOR_TYPE[GGML_TYPE_F16]
# a speed-of-light probe of "pp" for tools/dev/gpu_bench.py (wrong results by design): no softmax
WS_DIAG = {"diag-nosoftmax": ("fattn_wgmma_ws_diag_nosoftmax_d128", 3, GGML_TYPE_F16, False)}


def ws_config(kv_type: int, override: str = "") -> str:
    """The WS_CONFIGS key the op runs for K/V of ``kv_type``: ``override`` (cuda_launch's
    WGMMA_CONFIG knob) when set, else WS_FOR_TYPE's. ValueError when that instance is for another
    K/V type or none exists."""
    return pick(WS_CONFIGS, WS_FOR_TYPE, kv_type, override, lambda c: c[2], "wgmma prefill", "WGMMA_CONFIG")


def smem_ws(stages: int) -> int:
    """ws::smem_bytes<128, STAGES>() of cuda/fattn_wgmma.cuh: alignment slack, the K/V ring, Q
    (128 x 128 halves), 5 mbarriers per stage (full and empty for K and V, V ready)."""
    return 1024 + 2 * stages * CHUNK_WS * 128 * 2 + 128 * 128 * 2 + 5 * stages * 8


def ws_q_tiles(n_batch: int) -> int:
    """Query tiles of Q_TILE_WS tokens per stream (the plan's tile map for them)."""
    return -(-n_batch // Q_TILE_WS)


def ws_grid(n_batch: int, n_head: int, ne3: int, persistent_blocks: int = 0) -> tuple[int, int, int]:
    """Version 1's grid: heads fastest, query tiles of 128 tokens (the kernel walks them in
    reverse: the longest causal rows first), streams; with ``persistent_blocks`` (the SM count)
    that many blocks at most, each walking every gridDim.x-th tile."""
    n_q_tiles = ws_q_tiles(n_batch)
    if persistent_blocks:
        return (max(1, min(persistent_blocks, n_head * n_q_tiles * ne3)), 1, 1)
    return (n_head, n_q_tiles, ne3)


def kv_map(t: TensorDesc, l2_promotion: int = tma.L2_PROMOTION_NONE) -> tma.TmaMap:
    """The TMA map of a K or V tensor (ggml order [D, n_kv, n_head_kv, ne3], f16 or bf16) that
    the sm_90a kernels' producers read 64 x 64 boxes through, 128-byte swizzled; cells past n_kv
    read as 0. ``l2_promotion``: tma.L2_PROMOTION_* of its DRAM reads."""
    dtype = {GGML_TYPE_F16: tma.DTYPE_F16, GGML_TYPE_BF16: tma.DTYPE_BF16}.get(t.type)
    if dtype is None:
        raise ValueError(f"TMA map for K/V: f16 or bf16 only, got type {t.type}")
    return tma.encode_tiled(dtype, t.ptr, tuple(t.ne), tuple(t.nb[1:]), (64, 64, 1, 1), tma.SWIZZLE_128B,
                            l2_promotion)
