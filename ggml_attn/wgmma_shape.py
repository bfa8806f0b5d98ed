"""The sm_90a prefill's launch shape (cuda/fattn_wgmma.cu, version 1) and the TMA maps its
producer reads K and V through: what the launch configuration (cuda_launch.py) and the call
binder (cuda_backend.py) need, apart from ggml_attn/hopper_prefill.py's direct launches (which
import the backend: this module must not).
"""
from __future__ import annotations

from typing import NamedTuple

from . import tma
from .dtypes import GGML_TYPE_BF16, GGML_TYPE_F16
from .instances import KV_CTYPES, pick, template_expr
from .tensor import TensorDesc

THREADS_WS = 384   # two consumer warpgroups and the producer warpgroup (cuda/fattn_wgmma.cuh)
Q_TILE_WS = 128    # query rows per block: tokens of one head, or Q_TILE_WS / pack tokens of pack heads
PACKS_WS = (1, 2, 4, 8)   # query heads per tile (a warp's 16 rows stay within one head)
# the instances' tile widths (D of cuda/fattn_wgmma.cu), and the head sizes (head_dim_k = head_dim_v) they run:
# a width, or a smaller multiple of 8 on the next width up (TMA reads K/V's columns past the head
# as zeros, Q is staged with zeros there): 40 on 64; 72, 80, 96, 112 on 128; 192 on 256
TILE_WIDTHS_WS = (64, 128, 256)
HEAD_SIZES_WS = (40, 64, 72, 80, 96, 112, 128, 192, 256)


def tile_width(d: int) -> int:
    """The tile width of the instance that runs head size ``d`` (one of HEAD_SIZES_WS): the
    smallest of TILE_WIDTHS_WS that holds it."""
    if d not in HEAD_SIZES_WS:
        raise ValueError(f"the wgmma prefill runs head sizes {HEAD_SIZES_WS}, got {d}")
    return next(w for w in TILE_WIDTHS_WS if w >= d)


class WsConfig(NamedTuple):
    """One instance of cuda/fattn_wgmma.cu's fattn_wgmma_ws template (:attr:`name`)."""
    stages: int        # K/V ring depth
    kv_type: int       # GGML_TYPE_F16 or GGML_TYPE_BF16 (Q and P staged in the same type)
    persistent: bool   # one block per SM walking the tiles, or one block per tile
    d: int = 128       # tile width (TILE_WIDTHS_WS): head sizes up to it (tile_width)
    q_tma: bool = False   # Q's f32 rows through a TMA map a tile ahead (q_map), not loaded per tile
    pingpong: bool = True  # the two consumer warpgroups take turns issuing their GEMMs
    diag: int = 0      # WS_DIAG's speed-of-light probes (wrong results by design), else 0
    softmax: int = 0   # the softmax's variant: SMX_* flags (cuda/fattn_wgmma.cuh WS_SMX_*), 0 the plain one
    epilogue: int = 0  # EPI_*: the rows stored by each thread, or through TMA (with q_tma)

    @property
    def name(self) -> str:
        """The instance's name expression (its own NVRTC program: kernels.wgmma_variant)."""
        return template_expr("fattn_wgmma_ws", KV_CTYPES[self.kv_type], self.d, self.stages, self.pingpong, self.diag,
                             self.persistent, self.q_tma, self.softmax, self.epilogue)


# WsConfig.softmax's flags (cuda/fattn_wgmma.cuh's WS_SMX_*): a row's reference maximum kept until
# passed by more than 2^8 (O / l unchanged), O's rescale skipped where no row of a warp moved it
SMX_LAZY = 1
# WsConfig.epilogue (the kernel's EPI): each thread stores its rows; the rows staged in Q's f32
# space and stored through o_map by TMA
EPI_STORE, EPI_TMA = 0, 1

# version 1's instances: the op runs WS_FOR's (one block per SM walking the tiles heaviest first:
# on the H200 causal 2048 100.6 us against 110.8 for "pp" with one block per tile, causal 8192
# 1047.6 against 1078.7, 4096 without a mask 479.6 against 517.7;
# bench/results/2026-12-01-b69ab2e.json), with Q through TMA at D 64 and 128 ("-qtma"; at D 128
# its f32 rows leave room for 2 ring stages; D 256 has room for neither): causal 2048 92.5 us
# against 100.1 for "pp-persistent" (Q loaded by the consumers at each tile), causal 8192 996.8
# against 1034.8 (bench/results/2026-12-04-be0ea13-qtma.json); the other ones are A/B rows of
# tools/dev/gpu_bench.py.
F16, BF16 = GGML_TYPE_F16, GGML_TYPE_BF16
WS_CONFIGS = {
    "pp": WsConfig(3, F16, False),
    "pp-bf16": WsConfig(3, BF16, False),
    "pp-persistent": WsConfig(3, F16, True),
    "nopp": WsConfig(3, F16, False, pingpong=False),
    "s2": WsConfig(2, F16, False),
    "pp-persistent-qtma": WsConfig(2, F16, True, 128, True),
    "pp-persistent-qtma-bf16": WsConfig(2, BF16, True, 128, True),
    "pp-persistent-qtma-d64": WsConfig(3, F16, True, 64, True),
    "pp-persistent-qtma-bf16-d64": WsConfig(3, BF16, True, 64, True),
    "pp-persistent-d256": WsConfig(2, F16, True, 256),
    "pp-persistent-bf16-d256": WsConfig(2, BF16, True, 256),
    # #48's A/B rows (bench/NOTES.md, eighteenth session: on an H100 lazy 1-2% faster, otma 0.5-3.7%
    # at D 128 but 2% slower at D 64): the lazy reference maximum; the output through TMA stores.
    # Both together ("-lazy-otma") measured faster than "pp-persistent-qtma" on every tile-128 row
    # of an H100 at 4191ed9 (bench/results/2026-12-07-4191ed9-h100-wgmma-ab/, us): causal 2048 92.5
    # / 94.6, causal 8192 986.0 / 1013.8, 64/8 heads 4096 529.4 / 549.3, D 80 / 96 / 112 278.8 /
    # 283.1, 280.1 / 287.3, 281.7 / 291.4, 64 ragged prompts 128.0 / 132.8 (16 of them 41.3 / 40.8),
    # its GPU tests and the three sanitizers clean: the op's f16 instance of tile width 128.
    "pp-persistent-qtma-lazy": WsConfig(2, F16, True, 128, True, softmax=SMX_LAZY),
    "pp-persistent-qtma-d64-lazy": WsConfig(3, F16, True, 64, True, softmax=SMX_LAZY),
    "pp-persistent-qtma-lazy-otma": WsConfig(2, F16, True, 128, True, softmax=SMX_LAZY, epilogue=EPI_TMA),
    "pp-persistent-qtma-otma": WsConfig(2, F16, True, 128, True, epilogue=EPI_TMA),
    "pp-persistent-qtma-bf16-otma": WsConfig(2, BF16, True, 128, True, epilogue=EPI_TMA),
    # the f16 instance's two changes for bf16 (an A/B row, not measured: predicted as f16's 1.5-3.6%)
    "pp-persistent-qtma-bf16-lazy-otma": WsConfig(2, BF16, True, 128, True, softmax=SMX_LAZY, epilogue=EPI_TMA),
    "pp-persistent-qtma-d64-otma": WsConfig(3, F16, True, 64, True, epilogue=EPI_TMA),
}
_O_TMA = {c.name: c.epilogue != EPI_STORE for c in WS_CONFIGS.values()}
# the op's instance per (K/V type, tile width)
WS_FOR = {
    (GGML_TYPE_F16, 128): "pp-persistent-qtma-lazy-otma", (GGML_TYPE_BF16, 128): "pp-persistent-qtma-bf16",
    (GGML_TYPE_F16, 64): "pp-persistent-qtma-d64", (GGML_TYPE_BF16, 64): "pp-persistent-qtma-bf16-d64",
    (GGML_TYPE_F16, 256): "pp-persistent-d256", (GGML_TYPE_BF16, 256): "pp-persistent-bf16-d256",
}
WS_DEFAULT = WS_FOR[GGML_TYPE_F16, 128]
# speed-of-light probes for tools/dev/ (wrong results by design): "pp" without the softmax; the
# persistent instance with Q staged for a block's first tile only, and without the output stores
WS_DIAG = {"diag-nosoftmax": WsConfig(3, F16, False, diag=1),
           "diag-qonce": WsConfig(3, F16, True, diag=2),
           "diag-nostore": WsConfig(3, F16, True, diag=3),
           "diag-nostore-qtma": WsConfig(2, F16, True, 128, True, diag=3)}


def ws_config(kv_type: int, override: str = "", d: int = 128) -> str:
    """The WS_CONFIGS key the op runs for K/V of ``kv_type`` and head size ``d`` (its instance of
    tile_width(d)): ``override`` (cuda_launch's WGMMA_CONFIG knob) when set, else WS_FOR's.
    ValueError when that instance is for another K/V type or tile width, or none exists."""
    return pick(WS_CONFIGS, WS_FOR, (kv_type, tile_width(d)), override, lambda c: (c.kv_type, c.d),
                "wgmma prefill", "WGMMA_CONFIG")


def ws_q_tiles(n_batch: int, pack: int = 1) -> int:
    """Query tiles of Q_TILE_WS / pack tokens per stream (the plan's tile map for them)."""
    return -(-n_batch // (Q_TILE_WS // pack))


def ws_grid(n_batch: int, n_head: int, ne3: int, persistent_blocks: int = 0, pack: int = 1) -> tuple[int, int, int]:
    """Version 1's grid: head groups (``pack`` query heads) fastest, query tiles of 128 / pack
    tokens (the kernel walks them in reverse: the longest causal rows first), streams; with
    ``persistent_blocks`` (the SM count) that many blocks at most, each walking every
    gridDim.x-th tile."""
    n_q_tiles, n_hg = ws_q_tiles(n_batch, pack), n_head // pack
    if persistent_blocks:
        return (max(1, min(persistent_blocks, n_hg * n_q_tiles * ne3)), 1, 1)
    return (n_hg, n_q_tiles, ne3)


def q_map(q: TensorDesc, d: int, pack: int = 1) -> tma.TmaMap:
    """The TMA map of Q (ggml order [head_dim_k, n_batch, n_head, ne3], f32) that a QTMA instance of tile
    width ``d`` reads a warpgroup's 64 rows through, unswizzled: boxes of d values x tw tokens x
    64 / tw heads, tw = ws_rows_tokens(pack) for ``pack`` query heads per tile (ws_rows in
    cuda/fattn_wgmma.cuh); tokens past n_batch and values past head_dim_k (a head size padded to d) read
    as 0."""
    from .dtypes import GGML_TYPE_F32
    if q.type != GGML_TYPE_F32:
        raise ValueError(f"TMA map for Q: f32 only, got type {q.type}")
    tw = ws_rows_tokens(pack)
    return tma.encode_tiled(tma.DTYPE_F32, q.ptr, tuple(q.ne), tuple(q.nb[1:]), (d, tw, 64 // tw, 1))


def o_map(dst: TensorDesc, name: str, pack: int = 1) -> tma.TmaMap:
    """The dst map the instance ``name`` (a WsConfig.name) stores its output rows through: for an
    instance with the TMA epilogue (EPI_TMA), boxes of 32 values x 64 / tw heads x tw tokens (tw =
    ws_rows_tokens(pack): a warpgroup's 64 rows) of dst (ggml order [head_dim_v, n_head, n_batch,
    ne3], f32), 128-byte swizzled (cuda/fattn_wgmma.cuh wg_stage_rows); values past head_dim_v and
    tokens past n_batch are not written. Other instances take an unused map (zeros)."""
    if not _O_TMA.get(name, False):
        return tma.TmaMap()
    from .dtypes import GGML_TYPE_F32
    if dst.type != GGML_TYPE_F32:
        raise ValueError(f"TMA map for dst: f32 only, got type {dst.type}")
    tw = ws_rows_tokens(pack)
    return tma.encode_tiled(tma.DTYPE_F32, dst.ptr, tuple(dst.ne), tuple(dst.nb[1:]), (32, 64 // tw, tw, 1),
                            tma.SWIZZLE_128B)


def ws_rows_tokens(pack: int) -> int:
    """Tokens per head in a warpgroup's 64 rows (ws_rows): 64 for 1 or 2 query heads per tile,
    128 / pack for more."""
    if pack not in PACKS_WS:
        raise ValueError(f"query heads per tile: one of {PACKS_WS}, got {pack}")
    return 64 if pack <= 2 else Q_TILE_WS // pack


def kv_map(t: TensorDesc, l2_promotion: int = tma.L2_PROMOTION_NONE) -> tma.TmaMap:
    """The TMA map of a K or V tensor (ggml order [D, n_kv, n_head_kv, ne3], f16 or bf16) that
    the sm_90a kernels' producers read 64 x 64 boxes through, 128-byte swizzled; cells past n_kv
    read as 0. ``l2_promotion``: tma.L2_PROMOTION_* of its DRAM reads."""
    dtype = {GGML_TYPE_F16: tma.DTYPE_F16, GGML_TYPE_BF16: tma.DTYPE_BF16}.get(t.type)
    if dtype is None:
        raise ValueError(f"TMA map for K/V: f16 or bf16 only, got type {t.type}")
    return tma.encode_tiled(dtype, t.ptr, tuple(t.ne), tuple(t.nb[1:]), (64, 64, 1, 1), tma.SWIZZLE_128B,
                            l2_promotion)
