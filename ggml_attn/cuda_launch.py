"""Launch configuration of the CUDA kernels: tile shape, packing, grid and KV split count per
call, from the validated shapes and the occupancy of the kernel instance. The dynamic shared
memory is not part of it: the instance's own, read from its compiled program where it is loaded
(``kernels.get_function``), so that configuring a call compiles nothing.

Every tuning knob of the backend lives here as a module global, read at call time: set
``ggml_attn.cuda_launch.<KNOB>`` (tools/dev/gpu_bench.py ``knobs``, tests); every set re-keys the
call cache (``knobs.py``), so calls configured before are configured again.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from . import kernels as K
from .cuda_device import available, num_sms
from .validate import AttnDims

# ---------------------------------------------------------------------------------------
# tuning knobs
# Waves of blocks wanted when the grid alone does not fill the GPU: decode splits the KV range
# until the grid covers this many waves of resident blocks (the occupancy API's count for the
# kernel, block size and shared memory), so that the last, partial wave costs little.
_WAVES = {"prefill": 1, "decode-tc": 1, "decode": 2, "cells": 1}
# ... except that a decode-tc call without a mask plan (every KV tile live and FULL) whose grid
# fills at least this fraction of one block per SM is not split: at B=16, 4k (128 blocks on
# 132 SMs) it took 70.2 us unsplit against 76.4 / 86.9 / 78.0 us with 2 / 3 / 4 splits (a
# combine pass and the workspace traffic, for 3% more SMs). With a plan the splits stay: a
# 64-sequence step over a unified cache (MASKED tiles, mask loads) ran 68 us unsplit against
# 56 split, and B=16 4k under a causal-style mask 95.6 unsplit against 80.2 split
# (bench/NOTES.md, "eighth session", "ninth session")
_NO_SPLIT_SM_FILL = {"decode-tc": 0.9}
# cell-list decode: at least this many list entries per KV split (fewer: the combine dominates)
CELLS_MIN_PER_SPLIT = 256
# cell-list decode: the fattn_cells instance (kernels.CellsTune: cells in flight per group, prefetch
# depth, launch-bounds minimum blocks per SM, most heads per block): the sweep's keeper by default
# (tools/dev/gpu_batched_attn_bench.py CELLS_SWEEP; bench/NOTES.md, "cells v2 sweep").
# $GGML_ATTN_CELLS_TUNE sets it at import (a CellsTune label, e.g. "u4-pf0").
def cells_tune_from_env() -> K.CellsTune:
    """The tune $GGML_ATTN_CELLS_TUNE names (the default when unset, or -- said once on stderr --
    when it names none: a bad value in the environment made every import, a CLI's --version
    included, end in a traceback)."""
    text = os.environ.get("GGML_ATTN_CELLS_TUNE", "")
    try:
        return K.CellsTune.parse(text)
    except ValueError as e:
        import sys
        print(f"ggml_attn: ignoring GGML_ATTN_CELLS_TUNE={text!r} ({e}); the default tune runs", file=sys.stderr)
        return K.CellsTune.parse("")


CELLS_TUNE = cells_tune_from_env()
# K/V ring depth of decode-tc: 2 stages (two blocks per SM at D 128) beat 3 (115.7 KB: one
# block per SM) at every decode size on the H200 (bench/NOTES.md, v7)
DECODE_TC_STAGES = 2
# query heads of one KV head packed into the rows of a 64-row prefill tile when the plan found
# a ragged batch (wide is False): K/V tiles shared by the packed heads and 16-token tiles that
# straddle fewer prompts; 4 took 16 / 64 short prompts from 42.9 / 173.4 to 39.5 / 158.0 us (v7)
PREFILL_PACK = 4
_MIN_TILES_PER_SPLIT = 4     # 256 KV cells: fewer makes the combine pass dominate
_MAX_SPLITS = 128            # <= FATTN_MAX_SPLITS in fattn_util.cu
_MAX_GRID_Y = 65535
# prefill switches to 128-row query tiles (MT = 2: 32 rows per warp, FA2 load order) from this
# many query tokens per stream on: half the shared-memory traffic per MMA of 64-row tiles
PREFILL_WIDE_MIN_BATCH = 256
# ... unless the plan finds fewer live KV tiles than this per 64-row query tile on average:
# ragged batches of short prompts (2-3 live tiles per query tile) ran 1.1-1.3x slower on the
# wide tiles on the H200 (bench/NOTES.md, v5), long causal prompts (8-130) 1.15-1.2x faster
PREFILL_WIDE_MIN_LIVE = 6.0

# Split-KV finish: True -- the attention kernel's last block of each row group merges the
# splits (one launch per call; LaunchConfig.fused_finish says which instances can); False -- a
# fattn_combine launch after the kernel. The launch is the default: on the H200 the fused merge,
# done by one block per row group, costs 0.6-3 us more device time than a combine kernel spread
# over one block per row (bench/NOTES.md, "Split finish"); it saves one launch of host time.
FUSED_SPLIT_FINISH = False

# Mask tiles without -inf: True -- the plan marks a MASKED tile FINITE when every cell < n_kv of
# it is finite and below 256 in magnitude (a bias mask: relative-position or random values), and
# the tensor-core kernels add its mask with no -inf select (cuda/fattn_mma.cu); False -- every
# MASKED tile takes the select. Read when a plan's tile map is built. On: a 4096-token prefill
# whose every tile is MASKED with such a mask took 952-958 us instead of 992-998 us on the H200
# (bench/NOTES.md, "eighth session"); other masks' tiles are never FINITE.
FINITE_MASK_TILES = True

# The sm_90a prefill's instance the op runs (a key of wgmma_shape.WS_CONFIGS for the call's K/V
# type and head size): "" -- wgmma_shape.WS_FOR's (persistent blocks); an A/B knob for the benchmark's
# rows of one-block-per-tile instances. Part of the call key.
WGMMA_CONFIG = ""
# The sm_90a prefill's query heads per 128-row tile when the plan found a ragged batch (wide is
# False; instances with Q through TMA, masks of one head plane, at most the call's power-of-2 part
# of gqa): as PREFILL_PACK for the mma.sync kernel, tiles of 128 / pack tokens straddle fewer
# prompts and the packed heads share each K/V chunk. 1: one head per tile always. Part of the call
# key. On the H200 (bench/results/2026-12-04-be0ea13-qtma.json, 32/8 heads, us, pack 1 / 2 / 4 /
# 8): 64 prompts of 16-200 tokens 142.8 / 130.6 / 139.4 / 139.1; 16 prompts 38.4 / 38.6 / 43.3 / 43.2
WGMMA_RAGGED_PACK = 2
# Persistent instances' block count: 0 = one per SM; a small count makes each block walk many
# tiles (the GPU tests' way to reach the cross-tile paths). Part of the call key.
WGMMA_PERSISTENT_BLOCKS = 0
# The sm_90a decode's instance (a key of decode_tma_shape.CONFIGS for the call's K/V type): "" --
# decode_tma_shape.config's choice (FOR_TYPE's, FOR_ONE_PAIR's for one pair); A/B rows of the
# benchmark otherwise. Part of the call key.
DECODE_TMA_CONFIG = ""
# The sm_90a decode's block count: 0 = one wave (occupancy x SMs); a small count makes blocks
# take parts of many groups (the GPU tests' way to reach the cross-block merges). Part of the call key.
# Fewer than one per SM did not pay on the H200 (bench/results/2026-12-02-e2ae076.json): 66
# blocks B=1 32k 47.9 us against 49.5, but B=64 4k 265 against 253 and B=64 32k 1909 against
# 1885; 99 blocks slower everywhere from B=16 (B=64 32k 2088).
DECODE_TMA_BLOCKS = 0
# The sm_90a decode's split: 1 -- groups cut on their own boundaries under a cap (equal parts
# of a large group, one block each; small groups packed whole) when that balances the blocks
# within DECODE_TMA_CAP_SLACK of an equal share (decode_tma_shape.work_cap, from the plan's
# live counts or, without a plan, the shapes); 0 -- always equal shares, groups cut anywhere and
# merged. Part of the call key. Without a plan (groups of equal work), cutting on the groups'
# boundaries took B=16 4k from 78.5 to 67.7 us and B=1 32k from 49.9 to 43.8
# (bench/results/2026-12-02-44509ed.json: the same split as this cap's, then from a block count).
DECODE_TMA_ALIGN = 1
# ... the most a block's load may exceed the equal share W / blocks by, as a factor: a cut on
# group boundaries saves the merges and the extra segments of the cut groups, an uneven load
# costs less than its excess while the GPU is bandwidth-bound (the blocks still streaming get
# the bandwidth of those done). Measured on the H200 (bench/results/2026-12-02-4ac7672.json,
# us, cut on boundaries / equal shares): B=16 4k under a causal-style plan, 1.03x the load,
# 72.0 / 76.6; 64 streams of 512-8192 cells, 1.33x, 315.6 / 346.8; 16 such streams, 1.43x
# (about one group per block), 122.5 / 102.0. Two points either side: a guess between them.
DECODE_TMA_CAP_SLACK = 1.35   # part of the call key
# The sm_90a decode's TMA maps' L2 promotion (tma.L2_PROMOTION_*: 0 none .. 3 256 bytes): none.
# 256 bytes was slower on the H200 at e5df101: B=64 32k 2040 us against 1844, B=16 4k 78.0
# against 73.7, B=1 32k 52.4 against 50.8 (bench/NOTES.md, the decode-tma table of 2026-12-01: that
# run's result file was not kept).
DECODE_TMA_L2_PROMOTION = 0


def decode_work(sh: AttnDims, live_counts: dict | None = None, masked: bool = False) -> tuple[int, bool]:
    """(work_tiles, work_even) of :class:`ggml_attn.dispatch.CallFacts`: the (16-row group, KV
    tile) pairs a decode call streams -- every KV tile of n_kv without the plan's live-tile
    counts per query tile size (``Plan.live_host``), the live ones (an empty list still one
    unit) with them -- and whether decode-tma's split would cut the groups on their own
    boundaries with balanced blocks (no mask, or counts that allow it: :func:`decode_tma_cap`)."""
    pack, tq = _group_rows(sh.gqa)
    n_q_tiles = -(-sh.n_batch // tq)
    counts = (live_counts or {}).get(tq)
    if counts is None:
        work = sh.ne3 * n_q_tiles * (sh.n_head // pack) * max(1, -(-sh.n_kv // K.KV_TILE))
    else:
        work = int(_pair_units(sh, n_q_tiles, counts).sum()) * (sh.n_head // pack)
    even = (counts is not None or not masked) and \
        decode_tma_cap(sh, pack, n_q_tiles, num_sms(), counts)[0] > 0
    return work, even


def _pair_units(sh: AttnDims, n_q_tiles: int, counts):
    """Work units (live tiles, at least one) of each (stream, query tile) pair, numpy int64
    [ne3 * n_q_tiles] stream-major, from the plan's counts [ne33 * n_q_tiles] (pair (s, qt)
    reads plane s % ne33)."""
    import numpy as np
    c = np.maximum(np.asarray(counts, dtype=np.int64).reshape(-1, n_q_tiles), 1)
    return c[np.arange(sh.ne3) % c.shape[0]].reshape(-1)


def decode_tma_cap(sh: AttnDims, pack: int, n_q_tiles: int, blocks: int, counts=None,
                   whole_rows: bool = False) -> tuple[int, int]:
    """(FattnParams.work_cap, blocks it keeps busy) of a decode-tma call on ``blocks`` blocks
    (decode_tma_shape.work_cap): the pairs' units from the plan's live counts (numpy
    [ne33 * n_q_tiles]; pair (s, qt) reads plane s % ne33), or every KV tile without a plan;
    (0, blocks) -- equal shares -- with DECODE_TMA_ALIGN off or when no cap balances.
    ``whole_rows``: a whole-rows instance's, whose pair is one group (every head group a unit)."""
    if not DECODE_TMA_ALIGN:
        return 0, blocks
    from . import decode_tma_shape as dt
    n_hg = 1 if whole_rows else sh.n_head // pack
    if counts is None:
        u, groups = max(1, -(-sh.n_kv // K.KV_TILE)), sh.ne3 * n_q_tiles * n_hg
        cap = dt.work_cap_equal(u, groups, blocks, DECODE_TMA_CAP_SLACK)
        return (cap, int(dt.capped_blocks(u, groups, cap))) if cap else (0, blocks)
    units = _pair_units(sh, n_q_tiles, counts)
    cap = dt.work_cap(units, n_hg, blocks, DECODE_TMA_CAP_SLACK)
    return (cap, dt.blocks_needed(units, n_hg, cap)) if cap else (0, blocks)


def _pow2_divisor(n: int) -> int:
    return n & -n


def _group_rows(gqa: int) -> tuple[int, int]:
    """decode-tc's and decode-tma's 16-row groups: (query heads of one KV head packed, tokens)."""
    pack = min(_pow2_divisor(gqa), 16)
    return pack, 16 // pack


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class LaunchConfig:
    kernel: str           # prefill | prefill-wgmma | decode | decode-tc | cells
    variant: K.Variant
    name: str             # name expression of the instance
    pack: int             # query heads per tile
    q_tile_tokens: int    # tokens per query tile (plan granularity)
    n_q_tiles: int
    n_kv_tiles: int
    n_splits: int
    block: int            # threads
    grid: tuple[int, int, int]
    rows: int = 0               # query rows (token, head) of one block
    work_cap: int = 0           # decode-tma: FattnParams.work_cap (decode_tma_cap)
    fused_finish: bool = True   # the instance merges its own splits (split_finish): the tensor-core
    # kernels' 64-row and decode tiles up to D_K 256; not the 128-row prefill tiles or larger
    # heads (at the register limit) nor the CUDA-core decode kernel (ptxas then caps it at 128 registers and
    # spills): fattn_combine finishes those

    def finishes_splits(self, smem: int) -> bool:
        """True when this launch's kernel merges its splits itself: an instance that can, and
        ``smem`` (the instance's dynamic shared memory, bytes: ``kernels.Kernel.smem``) holds the
        merge's per-split weights (``split_finish_floats``: rows x (n_splits + 2) + 2 floats)."""
        return self.fused_finish and 4 * (self.rows * (self.n_splits + 2) + 2) <= smem



def _split_count(base: int, slots: int, waves: int, n_kv_tiles: int) -> int:
    """KV splits for ``base`` blocks on ``slots`` resident-block slots: the smallest count that
    reaches ``waves`` waves, raised to the count whose last wave is fullest among those up to
    twice that (wave quantisation: 528 blocks on 264 slots run as 2 full waves, 530 as 3)."""
    if base >= slots * waves:
        return 1
    cap = max(1, min(_MAX_SPLITS, n_kv_tiles // _MIN_TILES_PER_SPLIT))
    want = min(-(-slots * waves // base), cap)
    best, best_eff = want, 0.0
    for n in range(want, min(2 * want, cap) + 1):
        blocks = base * n
        eff = blocks / (-(-blocks // slots) * slots)   # fraction of the last wave's slots used
        if eff > best_eff + 1e-9:
            best, best_eff = n, eff
    return best


def launch_config(kernel: str, sh: AttnDims, n_splits: int | None = None, *, ext: bool = False,
                  blocks_per_sm: int | None = None, wide: bool | None = None,
                  max_live: dict | None = None, max_cells: int | None = None,
                  live_counts: dict | None = None) -> LaunchConfig:
    """Tile shape, packing, grid and KV split count for ``kernel`` on shapes ``sh``.
    ``ext``: softcap or ALiBi in use (the tensor-core kernels' EXT instance).
    ``blocks_per_sm``: resident blocks per SM (default: the occupancy API on the current
    device, 2 without one; _NO_SPLIT_SM_FILL says when decode-tc is not split). ``wide``:
    the plan's verdict on 128-row prefill tiles (None: by n_batch alone). ``max_live``: the
    plan's most live KV tiles of any query tile, per tile size (the split count is sized from
    it instead of n_kv); ``max_cells``: the plan's longest cell list (kernel "cells": its split
    count is sized from it); ``live_counts``: the plan's live-tile counts per tile size
    (``Plan.live_host``: decode-tma's split follows them; a plan without them, i.e. ``max_live``
    given alone, gets equal shares)."""
    gqa_p2 = _pow2_divisor(sh.gqa)
    n_kv_tiles = max(1, -(-sh.n_kv // K.KV_TILE))
    if kernel == "prefill-wgmma":   # one fixed shape: 128-token blocks, no KV split
        from . import wgmma_shape as hp
        c = hp.WS_CONFIGS[hp.ws_config(sh.kv_type, WGMMA_CONFIG, sh.head_dim_k)]
        pack = min(gqa_p2, WGMMA_RAGGED_PACK) if wide is False and c.q_tma and sh.ne32 == 1 else 1
        grid = hp.ws_grid(sh.n_batch, sh.n_head, sh.ne3,
                          (WGMMA_PERSISTENT_BLOCKS or num_sms()) if c.persistent else 0, pack)
        return LaunchConfig(kernel, K.wgmma_variant(c.name), c.name, pack, hp.Q_TILE_WS // pack,
                            hp.ws_q_tiles(sh.n_batch, pack), n_kv_tiles, 1, hp.THREADS_WS, grid,
                            rows=hp.Q_TILE_WS, fused_finish=False)
    if kernel == "decode-tma":   # persistent: one wave over the flattened (group, live tile) work
        from . import decode_tma_shape as dt
        pack, tq = _group_rows(sh.gqa)
        n_q_tiles = -(-sh.n_batch // tq)
        key = dt.config(sh.kv_type, DECODE_TMA_CONFIG, sh.ne3 * n_q_tiles)
        c = dt.CONFIGS[key]
        why = dt.rows_why_not(c, sh.n_head, sh.n_head_kv, pack)
        if why is not None:
            raise ValueError(f"DECODE_TMA_CONFIG {key!r} cannot run this call: {why}")
        name = c.name
        variant = K.decode_tma_variant(name)
        blocks = DECODE_TMA_BLOCKS or (num_sms() * (blocks_per_sm or _occupancy(variant, name, c.threads)))
        # with a cap, only the blocks it keeps busy: idle blocks of a one-per-SM wave leave the
        # busy ones unevenly spread over the GPCs (132 blocks, 4 idle: B=64 32k 1877.6 us
        # against 1832.5 on 128; B=16 32k 476.4 against 466.1). A plan refreshed to more work
        # than these blocks fit under the cap runs on them in equal shares (the kernel's check).
        counts = (live_counts or {}).get(tq)
        cap, blocks = (0, blocks) if max_live is not None and counts is None else \
            decode_tma_cap(sh, pack, n_q_tiles, blocks, counts, whole_rows=c.row_heads > 0)
        return LaunchConfig(kernel, variant, name, pack, tq, n_q_tiles, n_kv_tiles, 1,
                            c.threads, (blocks, 1, 1), rows=dt.ROWS, fused_finish=False, work_cap=cap)
    if kernel == "prefill":
        want = _pow2_ceil(max(1, -(-64 // max(sh.n_batch, 1))))
        pack = min(gqa_p2, 16, max(want, PREFILL_PACK if wide is False else 1))
        mt = 2 if (pack == 1 and sh.n_batch >= PREFILL_WIDE_MIN_BATCH and wide is not False
                   and max(sh.head_dim_k, sh.head_dim_v) <= K.WIDE_MAX_HEAD) else 1
        tq = 64 * mt // pack
        st = 1 if mt == 2 else 2
        variant = K.mma_variant(sh.head_dim_k, sh.head_dim_v, sh.kv_type, ext)
        name = K.mma_name(sh.head_dim_k, sh.head_dim_v, sh.kv_type, 4, 1, mt, st, ext)
        block = 128
    elif kernel == "decode-tc":
        pack, tq = _group_rows(sh.gqa)
        variant = K.mma_variant(sh.head_dim_k, sh.head_dim_v, sh.kv_type, ext)
        name = K.mma_name(sh.head_dim_k, sh.head_dim_v, sh.kv_type, 1, 4, 1, DECODE_TC_STAGES, ext)
        block = 128
    elif kernel == "decode":
        allowed = K.vec_rows_allowed(sh.head_dim_k, sh.head_dim_v)
        rmax = max(allowed)
        pack = min(gqa_p2, rmax)
        need = pack * min(sh.n_batch, rmax // pack)
        rows = min(r for r in allowed if r >= need)
        tq = rows // pack
        variant = K.vec_variant(sh.head_dim_k, sh.head_dim_v, sh.kv_type)
        name = K.vec_name(sh.head_dim_k, sh.head_dim_v, sh.kv_type, rows)
        block = 128
    elif kernel == "cells":   # one token per block, R heads of one KV head sharing its cell list
        tune = CELLS_TUNE
        pack = min(gqa_p2, max(K.cells_rows_allowed(sh.head_dim_k, sh.head_dim_v, tune))) if sh.ne32 == 1 else 1
        tq = 1
        variant = K.cells_variant(sh.head_dim_k, sh.head_dim_v, sh.kv_type, tune)
        name = K.cells_name(sh.head_dim_k, sh.head_dim_v, sh.kv_type, pack, tune)
        block = 128
    else:
        raise ValueError(f"no launch configuration for kernel {kernel!r}")
    n_q_tiles = -(-sh.n_batch // tq)
    base = n_q_tiles * (sh.n_head // pack) * sh.ne3
    if n_splits is None:
        if blocks_per_sm is None:
            blocks_per_sm = _occupancy(variant, name, block)
        if kernel == "cells":   # list entries in units of 1/_MIN_TILES_PER_SPLIT of a split's minimum
            cells = sh.n_kv if max_cells is None else max_cells
            live = cells * _MIN_TILES_PER_SPLIT // CELLS_MIN_PER_SPLIT
        else:
            live = (max_live or {}).get(tq, n_kv_tiles)
        if max_live is None and base >= _NO_SPLIT_SM_FILL.get(kernel, float("inf")) * num_sms():
            n_splits = 1
        else:
            n_splits = _split_count(base, num_sms() * blocks_per_sm, _WAVES[kernel], max(1, live))
    n_splits = max(1, min(int(n_splits), n_kv_tiles, 256))
    if kernel in ("decode", "cells"):
        grid = (n_q_tiles, sh.n_head // pack, sh.ne3 * n_splits)
    else:   # tensor-core kernels: heads fastest, query tiles (reversed in the kernel) second
        if n_q_tiles > _MAX_GRID_Y:
            raise ValueError(f"n_batch {sh.n_batch} needs {n_q_tiles} query tiles of {tq} tokens "
                             f"for kernel {kernel!r}; at most {_MAX_GRID_Y}")
        grid = (sh.n_head // pack, n_q_tiles, sh.ne3 * n_splits)
    return LaunchConfig(kernel, variant, name, pack, tq, n_q_tiles, n_kv_tiles, n_splits,
                        block, grid, rows=tq * pack,
                        fused_finish=sh.head_dim_k <= 256 and (kernel == "decode-tc" or (kernel == "prefill" and mt == 1)))


_OCCUPANCY: dict[tuple, int] = {}


def _occupancy(variant: K.Variant, name: str, block: int) -> int:
    """Resident blocks per SM of one kernel instance at ``block`` threads and its own dynamic
    shared memory (occupancy API; 2 without a GPU)."""
    if not available():
        return 2
    import cupy
    key = (variant, name, block, cupy.cuda.runtime.getDevice())
    n = _OCCUPANCY.get(key)
    if n is None:
        n = max(1, K.get_function(variant, name).occupancy(block))
        _OCCUPANCY[key] = n
    return n


from .knobs import count_sets as _count_sets  # noqa: E402  (the module is complete now)

_count_sets(__name__)   # every knob set from outside re-keys the call cache (knobs.py)
