"""The sm_90a decode's launch shape (cuda/fattn_decode_tma.cu): what the launch configuration
(cuda_launch.py) and the call binder (cuda_backend.py) need, and the kernel's work split
mirrored in Python (:func:`block_ranges`, for the tests).

Rows: the decode-tc layout -- 16 rows per group, the ``pack`` query heads of one KV head x
16 / pack tokens of one query tile of one stream (the plan's tile map for that query tile
size). Grid: persistent, one wave of ``blocks`` (the occupancy API's blocks per SM x SMs).
Work: the flattened (group, live KV tile) units, a group's units its pair's live tiles (at
least one; a pair is a (stream, query tile), its ``n_hg`` head groups have the same work). The
groups are numbered pair by pair, or (``Cfg.heads_first``: in the equal share, and under a cap
where every pair's units are the same) head group by head group, so that the blocks running at
the same time read neighbouring heads of the same cells: a quantized head's row (136 / 72 bytes)
shares its first and last 64-byte DRAM granule with the next head's, read once when both blocks
are at it (the unit ranges below are the same in either order).
Split: with a cap (FattnParams.work_cap, :func:`work_cap`) the groups are cut on their own
boundaries -- a group of at least ``cap`` units into ceil(units / cap) equal parts, one block
each, smaller groups packed floor(cap / units) to a block -- else block b takes an equal share
[b W / B, (b + 1) W / B) that cuts groups anywhere. Workspace: two partial slots per block (its
first and its last group), and one counter per group.
"""
from __future__ import annotations

import bisect
from typing import NamedTuple

import numpy as np

from .dtypes import GGML_TYPE_BF16, GGML_TYPE_F16, GGML_TYPE_Q4_0, GGML_TYPE_Q8_0
from .instances import VEC_KV_CTYPES, pick, template_expr

THREADS = 160      # four consumer warps and the producer warp (the f16/bf16 instances)
ROWS = 16          # rows of a group (one m16 tile)
CONSUMERS = 4
ROWS_HALF = 32     # cells of a whole-rows stage (drows::HALF)


class Cfg(NamedTuple):
    """One instance of cuda/fattn_decode_tma.cu's fattn_decode_tma template (:attr:`name`): head
    size, ring stages, K/V type as stored, consumer warps, and (q8_0/q4_0) whether the blocks are
    dequantized through a scratch tile per warp (else the MMAs' fragments are built from the raw
    box in registers), and whether its groups are walked heads first (module doc)."""
    d: int
    stages: int
    kv_type: int
    consumers: int = CONSUMERS
    scratch: bool = False
    whole: bool = True    # a warp per tile; False: the four warps on every tile, 16 cells each
    heads_first: bool = False
    row_heads: int = 0    # > 0: cuda/fattn_decode_rows.cu, whole cell rows of this many KV heads a box

    @property
    def threads(self) -> int:
        """The block: the consumer warps and a producer warp (the whole-rows instances: no producer
        warp, the consumers refill the ring)."""
        return 32 * (self.consumers + (0 if self.row_heads else 1))

    @property
    def name(self) -> str:
        """The instance's name expression (its own NVRTC program: kernels.decode_tma_variant)."""
        if self.row_heads:
            return template_expr("fattn_decode_rows", VEC_KV_CTYPES[self.kv_type], self.d, self.stages,
                                 self.consumers, self.row_heads)
        reg = self.kv_type in QUANT_TYPES and not self.scratch
        return template_expr("fattn_decode_tma", VEC_KV_CTYPES[self.kv_type], self.d, self.stages, self.whole,
                             self.consumers, reg, self.heads_first)


# The op runs FOR_TYPE's (a warp per tile); the others are A/B rows of tools/dev/gpu_bench.py
# ("split-s4": four warps on every tile, 16 cells each). On the H200 the three f16 ones were
# within 1% of each other from B=64 4k on (where auto runs the kernel); below, "s4" was 1-3%
# faster than "s6" and "split-s4" mixed (bench/results/2026-12-01-2783807.json).
CONFIGS = {
    "s6": Cfg(128, 6, GGML_TYPE_F16),
    "s6-bf16": Cfg(128, 6, GGML_TYPE_BF16),
    "s4": Cfg(128, 4, GGML_TYPE_F16),
    "split-s4": Cfg(128, 4, GGML_TYPE_F16, whole=False),
    # ggml's q8_0 / q4_0 blocks: one raw box per tile (quant_box). Through scratch: the consumer
    # warp dequantizes it into an f16 tile laid out as the f16 ring's (4 warps); in registers:
    # the fragments straight from the box, 7 warps ("r4": 4) and a deeper ring. Heads first
    # (module doc); "-pm": pair by pair, the order before (A/B rows). At B=64 32k on the H100 the
    # pair-by-pair order read 1.42x (q8_0) / 1.78x (q4_0) the cache's bytes from DRAM, at 78-82%
    # of its peak (bench/results/2026-12-06-695471d-h100-ncu-decode-quant/); heads first, device
    # time 2,245 -> 2,032 us (q8_0), 1,605 -> 1,343 (q4_0; f16 2,712), B=1 and B=16 unchanged
    # (bench/results/2026-12-06-4ecdc80-h100-quant-kv-heads-first/).
    "q8_0-scratch": Cfg(128, 8, GGML_TYPE_Q8_0, scratch=True, heads_first=True),
    "q4_0-scratch": Cfg(128, 12, GGML_TYPE_Q4_0, scratch=True, heads_first=True),
    "q8_0": Cfg(128, 11, GGML_TYPE_Q8_0, consumers=7, heads_first=True),
    "q4_0": Cfg(128, 20, GGML_TYPE_Q4_0, consumers=7, heads_first=True),
    "q8_0-r4": Cfg(128, 8, GGML_TYPE_Q8_0, heads_first=True),
    "q8_0-pm": Cfg(128, 11, GGML_TYPE_Q8_0, consumers=7),
    "q4_0-pm": Cfg(128, 20, GGML_TYPE_Q4_0, consumers=7),
    # Whole cell rows (cuda/fattn_decode_rows.cu): a block reads every KV head of its cells, a
    # consumer warp a head group, so each DRAM granule of the cache is read once (the per-head
    # boxes above share theirs with the neighbouring heads: 1.21x the cache's bytes at B=64 32k
    # heads first). 8 KV heads of 8 head groups (Llama's 8B and 70B); stages of 32 cells, 69.6 KB
    # (q8_0) / 36.9 KB (q4_0). A/B rows, not measured yet (bench/NOTES.md, #46).
    "q8_0-rows": Cfg(128, 3, GGML_TYPE_Q8_0, consumers=8, row_heads=8),
    "q4_0-rows": Cfg(128, 6, GGML_TYPE_Q4_0, consumers=8, row_heads=8),
}
FOR_TYPE = {GGML_TYPE_F16: "s6", GGML_TYPE_BF16: "s6-bf16", GGML_TYPE_Q8_0: "q8_0", GGML_TYPE_Q4_0: "q4_0"}
QUANT_TYPES = (GGML_TYPE_Q8_0, GGML_TYPE_Q4_0)   # the block types of the instances above
# The quantized instances where a call is one pair (one stream's query tile: a single sequence's
# decode step), from the measured rows: its few, long groups (B=1: 8 groups, each cut in parts
# over the wave) ran faster through scratch (4 consumer warps) than on the register path (7), and
# from B=16 on the register path won (H200 at 115bb1f, us, q8_0 scratch / register, q4_0 the same;
# bench/results/2026-12-05-115bb1f-h200-quant-kv/):
#   B=1 4k 16.3 / 22.6, 15.5 / 22.4;  B=1 32k 40.9 / 47.1, 38.9 / 46.0;
#   B=16 4k 62.3 / 57.4, 58.0 / 53.0;  B=64 32k 1716 / 1687, 1610 / 1239.
# On the H100 at 695471d, B=1 32k q8_0 under ncu: 51.0 / 59.7
# (bench/results/2026-12-06-695471d-h100-ncu-decode-quant/). Between 2 and 15 pairs nothing is
# measured: FOR_TYPE's.
FOR_ONE_PAIR = {GGML_TYPE_Q8_0: "q8_0-scratch", GGML_TYPE_Q4_0: "q4_0-scratch"}


def config(kv_type: int, override: str = "", pairs: int = 0) -> str:
    """The CONFIGS key for K/V of ``kv_type`` in a call of ``pairs`` (streams x query tiles; 0:
    not known): ``override`` (cuda_launch.DECODE_TMA_CONFIG) when set, else FOR_ONE_PAIR's for a
    one-pair call of its types, else FOR_TYPE's. ValueError for an unknown key or one of another
    K/V type."""
    if not override and pairs == 1:
        override = FOR_ONE_PAIR.get(kv_type, "")
    return pick(CONFIGS, FOR_TYPE, kv_type, override, lambda c: c.kv_type, "sm_90a decode", "DECODE_TMA_CONFIG")


def quant_box(kv_type: int, d: int) -> tuple[int, int]:
    """(ROW, RB) of dtma::QuantTile: bytes of one head's row of blocks, and the raw box's inner
    side -- a box starts at the 16-byte boundary at or before head h's row (h * ROW rounded
    down: TMA boxes start 16-byte aligned), so RB covers ROW past the largest offset
    (h * ROW) % 16, 16 - gcd(ROW, 16), rounded up to 16 bytes; cell c's row sits at
    c * RB + (h * ROW) % 16 in a ring tile."""
    import math

    from .quant import type_info
    row = type_info(kv_type).row_bytes(d)
    off_max = 0 if row % 16 == 0 else 16 - math.gcd(row, 16)
    return row, -(-(row + off_max) // 16) * 16


def quant_why_not(t) -> str | None:
    """None when the quantized instances' producer can read K or V ``t`` (a TensorDesc, ggml
    order [D, n_kv, n_head_kv, ne3] of q8_0/q4_0) through :func:`quant_kv_map`, else why not:
    D 128, each cell's heads packed in its row (nb[2] = one head's row of blocks), the pointer
    and the cell and stream strides multiples of 16 (the TMA's rules)."""
    if t.type not in QUANT_TYPES or t.ne[0] != 128:
        return f"D 128 q8_0/q4_0 only (got D {t.ne[0]}, type {t.type})"
    row, _ = quant_box(t.type, t.ne[0])
    if t.nb[2] != row:
        return f"each cell's heads packed in its row (head stride {t.nb[2]}, a head's row {row} bytes)"
    if t.ptr % 16 or t.nb[1] % 16 or (t.ne[3] > 1 and t.nb[3] % 16):
        return "16-byte aligned pointer, cell and stream strides"
    return None


def rows_why_not(c: Cfg, n_head: int, n_head_kv: int, pack: int) -> str | None:
    """None when whole-rows instance ``c`` runs a call of ``n_head`` query heads over
    ``n_head_kv`` KV heads packed ``pack`` to a group, else why not: a consumer warp per head
    group, a box per cell row of exactly its KV heads."""
    if not c.row_heads:
        return None
    if n_head_kv != c.row_heads:
        return f"{c.row_heads} KV heads a cell row (the call has {n_head_kv})"
    if n_head // pack != c.consumers:
        return f"{c.consumers} head groups (the call has {n_head // pack}: {n_head} heads, {pack} a group)"
    return None


def quant_rows_map(t, l2_promotion: int = 0, heads: int = 0):
    """The TMA map of a q8_0/q4_0 K or V tensor (:func:`quant_why_not`) that the whole-rows
    instances read through: 8-byte elements x [a cell's row of every head (n_head_kv * ROW / 8),
    cells, 1, streams], box [the whole row and 2 elements past it (zeros: drows::RowTile's
    padding), 32 cells, 1, 1]; cells past n_kv read as 0. The row must be a multiple of 16 bytes
    (an even number of heads) and, padded, one box side (at most 256 elements); ``heads``: the
    instance's KV heads a row (Cfg.row_heads; 0: any), which the kernel's stage size counts."""
    from . import tma
    why = quant_why_not(t)
    row, _ = quant_box(t.type, t.ne[0])
    rb = t.ne[2] * row
    if why is None and heads and t.ne[2] != heads:
        why = f"the instance reads rows of {heads} KV heads, the tensor has {t.ne[2]}"
    if why is None and (rb % 16 or rb // 8 + 2 > 256):
        why = f"a cell's row of {t.ne[2]} heads is {rb} bytes: need a multiple of 16 up to 2032"
    if why is not None:
        raise ValueError(f"quantized whole-rows TMA map for K/V: {why}")
    nb3 = t.nb[3] if t.ne[3] > 1 else t.nb[1]
    return tma.encode_tiled(tma.DTYPE_U64, t.ptr, (rb // 8, t.ne[1], 1, t.ne[3]), (t.nb[1], t.nb[1], nb3),
                            (rb // 8 + 2, ROWS_HALF, 1, 1), tma.SWIZZLE_NONE, l2_promotion)


def whole_rows(name: str) -> bool:
    """True for a whole-rows instance's name (Cfg.row_heads: cuda/fattn_decode_rows.cu)."""
    return name.startswith("fattn_decode_rows<")


def kv_map_of(name: str):
    """The TMA map builder (tensor, l2_promotion) -> map of the quantized K/V of instance ``name``
    (a Cfg's name): whole rows of the instance's KV heads, or a head's box."""
    if not whole_rows(name):
        return quant_kv_map
    heads = next(c.row_heads for c in CONFIGS.values() if c.name == name)
    return lambda t, l2_promotion=0: quant_rows_map(t, l2_promotion, heads)


def quant_kv_map(t, l2_promotion: int = 0):
    """The TMA map of a q8_0/q4_0 K or V tensor (:func:`quant_why_not`) that the quantized
    instances' producer reads one raw box per tile through: bytes x [the heads' rows of a cell
    (n_head_kv * ROW), cells (n_kv), 1, streams (ne3)], box [RB, 64, 1, 1], not swizzled; head h's
    box starts at byte h * ROW rounded down to 16 (quant_box), its other bytes the neighbouring
    heads' (or zeros past the last); cells past n_kv read as 0."""
    from . import tma
    why = quant_why_not(t)
    if why is not None:
        raise ValueError(f"quantized TMA map for K/V: {why}")
    row, rb = quant_box(t.type, t.ne[0])
    nb3 = t.nb[3] if t.ne[3] > 1 else t.nb[1]
    return tma.encode_tiled(tma.DTYPE_U8, t.ptr, (t.ne[2] * row, t.ne[1], 1, t.ne[3]), (t.nb[1], t.nb[1], nb3),
                            (rb, 64, 1, 1), tma.SWIZZLE_NONE, l2_promotion)


def workspace_bytes(blocks: int, d: int, groups: int = 1) -> tuple[int, int]:
    """(bytes of the partial outputs, bytes in all): two slots of ``groups`` x ROWS x d f32 per
    block (a whole-rows instance's slot holds its head groups' rows), then their (max, sum) pairs
    (FattnParams.ws_o / ws_ml)."""
    o = 2 * blocks * groups * ROWS * d * 4
    return o, o + 2 * blocks * groups * ROWS * 8


def n_groups(n_head: int, pack: int, n_q_tiles: int, ne3: int) -> int:
    """Row groups of a call: the split counters the kernel counts in."""
    return ne3 * n_q_tiles * (n_head // pack)


def capped_blocks(units, n_hg, cap):
    """Blocks one pair's ``n_hg`` groups of ``units`` units each (>= 1; an int or a numpy array,
    elementwise) take under ``cap`` (>= 1): ceil(units / cap) parts per group when units >= cap,
    else the groups packed floor(cap / units) to a block. The kernel's ``capped_blocks``."""
    u = np.maximum(np.asarray(units, dtype=np.int64), 1)
    per = np.maximum(cap // u, 1)
    return np.where(u >= cap, n_hg * -(-u // cap), -(-n_hg // per))


def _layout(units: np.ndarray, n_hg: int):
    """(u, equal): each pair's units per group (>= 1, int64) and whether every pair's are the same
    (the kernel then cuts the call's groups as one list, across pairs)."""
    u = np.maximum(np.asarray(units, dtype=np.int64).reshape(-1), 1)
    return u, bool(u.size) and bool((u == u[0]).all())


def blocks_needed(units, n_hg: int, cap: int) -> int:
    """Blocks the call's work takes under ``cap``: every pair's groups as one list of equal groups
    when the pairs' units are equal (packed across pairs), else pair by pair."""
    u, equal = _layout(units, n_hg)
    if not u.size:
        return 0
    if equal:
        return int(capped_blocks(u[0], u.size * n_hg, cap))
    return int(capped_blocks(u, n_hg, cap).sum())


def max_load(units, n_hg: int, cap: int) -> int:
    """The most units one block takes under ``cap`` (its time, in units)."""
    u, equal = _layout(units, n_hg)
    if not u.size:
        return 0
    groups = u.size * n_hg if equal else n_hg
    per = np.minimum(np.maximum(cap // u, 1), groups)
    return int(np.where(u >= cap, -(-u // -(-u // cap)), per * u).max())


def work_cap(units, n_hg: int, slots: int, slack: float) -> int:
    """The cap for FattnParams.work_cap: the smallest whose blocks fit ``slots`` (the least load
    a block then takes), when that load is within ``slack`` times the equal share W / slots;
    else 0 (the equal share: when the pairs are too many to take a block each, or too unequal).
    ``units``: the live tiles of each pair (stream-major, query tiles fastest; numpy or list)."""
    u, equal = _layout(units, n_hg)
    if not u.size or slots < 1:
        return 0
    W = int(u.sum()) * n_hg
    hi = W if equal else int(u.max()) * n_hg   # one block for all, or one per pair
    if blocks_needed(u, n_hg, hi) > slots:
        return 0
    lo = max(1, -(-W // slots))
    while lo < hi:                           # blocks_needed does not grow with the cap
        mid = (lo + hi) // 2
        if blocks_needed(u, n_hg, mid) <= slots:
            hi = mid
        else:
            lo = mid + 1
    return lo if max_load(u, n_hg, lo) <= slack * W / slots else 0


def work_cap_equal(units: int, groups: int, slots: int, slack: float) -> int:
    """:func:`work_cap` for ``groups`` groups of ``units`` units each (every pair alike: no plan,
    or a plan whose pairs have the same live counts), in closed form: the cap is the units of
    one part of a group cut in q (q the most parts per group that fit: groups x q <= slots), or
    of ``per`` whole groups (per the fewest per block that fit)."""
    u = max(1, int(units))
    if groups < 1 or slots < 1:
        return 0
    q = slots // groups
    cap = -(-u // q) if q >= 1 else u * -(-groups // slots)
    W = u * groups
    load = -(-u // -(-u // cap)) if u >= cap else min(cap // u, groups) * u
    return cap if load <= slack * W / slots else 0


def block_ranges(units, n_hg: int, B: int, cap: int) -> list[tuple[int, int, int, int]]:
    """The kernel's split (Walk::start in cuda/fattn_decode_tma.cu), block by block: (first unit,
    end, b0, n_part) -- b0 >= 0: the block holds part b - b0 of one group cut in n_part parts
    whose blocks are b0 .. b0 + n_part - 1; -1: whole groups, or the equal share (cap 0, or a
    cap whose blocks do not fit B), where the merging block finds the parts by block_of."""
    u, equal = _layout(units, n_hg)
    W = int(u.sum()) * n_hg
    need = blocks_needed(u, n_hg, cap) if cap > 0 else B + 1
    out = []
    if need > B:
        return [(W * b // B, W * (b + 1) // B, -1, 0) for b in range(B)]
    # (units per group, groups, units before, blocks before) of each run cut alike
    runs = [(int(u[0]), u.size * n_hg, 0, 0)] if equal else []
    if not equal:
        ub = bb = 0
        for x in u:
            runs.append((int(x), n_hg, ub, bb))
            ub += int(x) * n_hg
            bb += int(capped_blocks(x, n_hg, cap))
    starts = [r[3] for r in runs]
    for b in range(B):
        if b >= need:
            out.append((W, W, -1, 0))
            continue
        x, groups, U, bb = runs[bisect.bisect_right(starts, b) - 1]
        k = b - bb
        if x >= cap:
            q = -(-x // cap)
            g, j = divmod(k, q)
            w0 = U + g * x
            out.append((w0 + x * j // q, w0 + x * (j + 1) // q, b - j if q > 1 else -1, q if q > 1 else 0))
        else:
            per = cap // x
            g0 = k * per
            out.append((U + g0 * x, U + min(g0 + per, groups) * x, -1, 0))
    return out
