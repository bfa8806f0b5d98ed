"""The sm_90a decode (cuda/fattn_decode_tma.cu, kernel "decode-tma") without a GPU: when auto
runs it, its launch shape and workspace, and its work split (the kernel's arithmetic, mirrored
here). Its results on the device: tests/test_gpu_hopper.py."""
from __future__ import annotations

import pytest

from ggml_attn import decode_tma_shape as dt
from ggml_attn import dispatch
from ggml_attn.dtypes import GGML_TYPE_BF16, GGML_TYPE_F16, GGML_TYPE_F32, GGML_TYPE_Q4_0, GGML_TYPE_Q8_0


def _f(**kw):
    from ggml_attn.dispatch import DECODE_TMA_MIN_WORK, CallFacts
    base = dict(n_batch=1, gqa=4, n_kv=4096, head_dim_k=128, head_dim_v=128, kv_type=GGML_TYPE_F16, arch="sm_90",
                work_tiles=DECODE_TMA_MIN_WORK, mask_tiles="masked")
    base.update(kw)
    return CallFacts(**base)


def test_constants_mirror_the_kernel():
    """decode_tma_shape's copies of the sm_90a decode's constants (cuda/decode_tma_common.cuh;
    the whole-rows stage's cells, cuda/fattn_decode_rows.cu)."""
    import re
    from pathlib import Path
    src = Path(__file__).resolve().parents[1] / "cuda"
    cu = {m[1]: int(m[2]) for f in ("decode_tma_common.cuh", "fattn_decode_rows.cu")
          for m in re.finditer(r"constexpr int (\w+) = (\d+);", (src / f).read_text())}
    mine = {"ROWS": dt.ROWS, "CONSUMERS": dt.CONSUMERS, "HALF": dt.ROWS_HALF}
    assert {k: cu.get(k) for k in mine} == mine
    assert dt.THREADS == 32 * (dt.CONSUMERS + 1)


def test_auto_runs_it_where_decode_tc_would_on_sm90():
    from ggml_attn.dispatch import best_kernel
    for kw in ({}, dict(kv_type=GGML_TYPE_BF16), dict(n_batch=4), dict(gqa=8, n_batch=2), dict(mask_tiles="masked")):
        c = best_kernel("auto", _f(**kw))
        assert c.kernel == "decode-tma" and "sm_90a" in c.reason, kw


def test_auto_keeps_decode_tc_elsewhere():
    """Another architecture, other head sizes, sinks/softcap/ALiBi, calls with less work than
    DECODE_TMA_MIN_WORK, or than DECODE_TMA_MIN_WORK_EVEN when the split cuts the groups on
    their boundaries (or not known), unaligned K/V; prefill shapes stay prefill kernels."""
    from ggml_attn.dispatch import DECODE_TMA_MIN_WORK, DECODE_TMA_MIN_WORK_EVEN, best_kernel
    for kw in (dict(arch="sm_80"), dict(arch=""), dict(head_dim_k=64, head_dim_v=64), dict(plain=False),
               dict(work_tiles=DECODE_TMA_MIN_WORK - 1, mask_tiles="plain"),
               dict(work_tiles=DECODE_TMA_MIN_WORK - 1),
               dict(work_tiles=DECODE_TMA_MIN_WORK_EVEN - 1, work_even=True), dict(work_tiles=0)):
        assert best_kernel("auto", _f(**kw)).kernel == "decode-tc", kw
    # groups cut on their boundaries (no mask, or a plan whose counts allow it): from the lower threshold on
    for mt in ("none", "masked"):
        c = best_kernel("auto", _f(work_tiles=DECODE_TMA_MIN_WORK_EVEN, work_even=True, mask_tiles=mt))
        assert c.kernel == "decode-tma" and "boundaries" in c.reason
    assert DECODE_TMA_MIN_WORK_EVEN < DECODE_TMA_MIN_WORK
    assert best_kernel("auto", _f(kv_aligned=False)).kernel == "reference"
    assert best_kernel("auto", _f(n_batch=512)).kernel.startswith("prefill")


def test_facts_say_when_the_split_is_even(monkeypatch):
    """CallFacts.work_even: without a mask (every group alike) unless the groups are too many
    for the blocks; with a mask only from the plan's live counts, and only when they balance."""
    import numpy as np
    from ggml_attn import cuda_launch as L
    monkeypatch.setattr(L, "num_sms", lambda: 132)
    sh = L.AttnDims(128, 128, 1, 32, 8, 16, 4096, GGML_TYPE_F16, 1, 16)
    assert dispatch.call_facts(sh).work_even
    assert not dispatch.call_facts(sh, mask_tiles="masked").work_even, "a mask without counts: not known"
    assert dispatch.call_facts(sh, mask_tiles="masked", live_counts={4: np.full(16, 64)}).work_even
    ragged = np.array([8, 128, 40, 77, 100, 16, 64, 90, 30, 120, 12, 55, 80, 128, 9, 70])
    assert not dispatch.call_facts(sh, mask_tiles="masked", live_counts={4: ragged}).work_even
    assert not dispatch.call_facts(sh, mask_tiles="masked", live_counts={64: np.full(16, 64)}).work_even, "another tile size"
    monkeypatch.setattr(L, "DECODE_TMA_ALIGN", 0)
    assert not dispatch.call_facts(sh).work_even


def test_facts_count_the_live_tiles_of_a_plan(monkeypatch):
    """With the plan's counts, work_tiles is the live work: a 32k decode whose first 1/8 is live
    is a 4k decode's work (decode-tc's), not a 32k one's."""
    import numpy as np
    from ggml_attn import cuda_launch as L
    from ggml_attn.dispatch import best_kernel
    monkeypatch.setattr(L, "num_sms", lambda: 132)
    sh = L.AttnDims(128, 128, 1, 32, 8, 1, 32768, GGML_TYPE_F16)
    assert dispatch.call_facts(sh, mask_tiles="masked").work_tiles == 8 * 512
    f = dispatch.call_facts(sh, arch="sm_90", mask_tiles="masked", live_counts={4: np.array([64])})
    assert f.work_tiles == 8 * 64 and best_kernel("auto", f).kernel == "decode-tc"
    f = dispatch.call_facts(sh, arch="sm_90", mask_tiles="masked", live_counts={4: np.array([512])})
    assert f.work_tiles == 8 * 512 and best_kernel("auto", f).kernel == "decode-tma"
    assert dispatch.call_facts(sh, live_counts={4: np.array([0])}).work_tiles == 8, "an empty list is one unit"


def test_by_name_says_why_not(monkeypatch):
    from ggml_attn import dispatch
    assert dispatch.best_kernel("decode-tma", _f(n_batch=64)).kernel == "decode-tma"
    for kw, words in ((dict(arch="sm_89"), "compute capability 9.0"), (dict(head_dim_k=256, head_dim_v=256), "D 128"),
                      (dict(kv_type=GGML_TYPE_F32), "f16/bf16"), (dict(plain=False), "sinks")):
        with pytest.raises(ValueError, match=words):
            dispatch.best_kernel("decode-tma", _f(**kw))
    work = dispatch.DECODE_TMA_MIN_WORK
    monkeypatch.setattr(dispatch, "DECODE_TMA_MIN_WORK", 1 << 62)   # by name only
    monkeypatch.setattr(dispatch, "DECODE_TMA_MIN_WORK_EVEN", 1 << 62)
    assert dispatch.best_kernel("auto", _f(work_tiles=work)).kernel == "decode-tc"


def test_facts_count_the_work_of_decode_tc_groups():
    """work_tiles: streams x query tiles of 16 / pack tokens x head groups x KV tiles."""
    from ggml_attn.dispatch import call_facts as facts
    from ggml_attn.validate import AttnDims
    assert facts(AttnDims(128, 128, 1, 32, 8, 64, 32768, GGML_TYPE_F16)).work_tiles == 64 * 1 * 8 * 512
    assert facts(AttnDims(128, 128, 5, 32, 8, 2, 100, GGML_TYPE_F16)).work_tiles == 2 * 2 * 8 * 2
    assert facts(AttnDims(128, 128, 1, 4, 4, 1, 64, GGML_TYPE_F16)).work_tiles == 1 * 1 * 4 * 1   # GQA 1: pack 1


def test_launch_config_is_one_wave_of_decode_tc_rows(monkeypatch):
    """16 rows per group (pack heads x 16 / pack tokens), 160 threads, one block per SM times
    the occupancy (or DECODE_TMA_BLOCKS), no split; the instance of the call's K/V type; the
    work cap from the shapes, from the plan's counts, or 0 (equal shares)."""
    import numpy as np
    from ggml_attn import cuda_launch as L
    monkeypatch.setattr(L, "num_sms", lambda: 132)
    monkeypatch.setattr(L, "_occupancy", lambda *a: 1)
    sh = lambda kv_type=GGML_TYPE_F16: L.AttnDims(128, 128, 3, 32, 8, 2, 1000, kv_type)   # noqa: E731
    for kv_type, name in ((GGML_TYPE_F16, "fattn_decode_tma<__half, 128, 6, true, 4, false, false>"),
                          (GGML_TYPE_BF16, "fattn_decode_tma<__nv_bfloat16, 128, 6, true, 4, false, false>")):
        cfg = L.launch_config("decode-tma", sh(kv_type))
        # 2 streams x 8 KV heads = 16 groups of 16 tiles: 8 parts of 2 tiles each, 128 blocks
        assert cfg.name == name and cfg.block == dt.THREADS and cfg.grid == (128, 1, 1)
        assert cfg.work_cap == 2 and dt.blocks_needed([16, 16], 8, 2) == 128
        assert (cfg.pack, cfg.q_tile_tokens, cfg.n_q_tiles, cfg.n_kv_tiles, cfg.n_splits) == (4, 4, 1, 16, 1)
    cfg = L.launch_config("decode-tma", sh(), max_live={4: 16})
    assert cfg.work_cap == 0 and cfg.grid == (132, 1, 1), "a plan without counts: equal shares, one per slot"
    # a plan's counts (one mask plane for both streams: plane s % ne33)
    assert L.launch_config("decode-tma", sh(), max_live={4: 16}, live_counts={4: np.array([16])}).work_cap == 2
    # a short and a long stream (a mask plane each): the long one's groups in 15 parts of 7, the
    # short one's packed 7 to a block (122 blocks); too unequal for 16 streams: equal shares
    cfg = L.launch_config("decode-tma", sh(), max_live={4: 100}, live_counts={4: np.array([1, 100])})
    assert (cfg.work_cap, cfg.grid) == (7, (122, 1, 1))
    ragged = np.array([8, 128, 40, 77, 100, 16, 64, 90, 30, 120, 12, 55, 80, 128, 9, 70])
    assert L.launch_config("decode-tma", L.AttnDims(128, 128, 1, 32, 8, 16, 8192, GGML_TYPE_F16, 1, 16),
                           max_live={4: 128}, live_counts={4: ragged}).work_cap == 0
    monkeypatch.setattr(L, "DECODE_TMA_ALIGN", 0)
    assert L.launch_config("decode-tma", sh()).work_cap == 0 and L.launch_config("decode-tma", sh()).grid == (132, 1, 1)
    monkeypatch.setattr(L, "DECODE_TMA_ALIGN", 1)
    monkeypatch.setattr(L, "DECODE_TMA_BLOCKS", 3)
    cfg = L.launch_config("decode-tma", L.AttnDims(128, 128, 1, 32, 8, 1, 1000, GGML_TYPE_F16))
    assert cfg.grid[0] == dt.blocks_needed([16], 8, cfg.work_cap) <= 3
    monkeypatch.setattr(L, "DECODE_TMA_CONFIG", "s6-bf16")
    with pytest.raises(ValueError, match="another K/V type"):
        L.launch_config("decode-tma", L.AttnDims(128, 128, 1, 32, 8, 1, 1000, GGML_TYPE_F16))


@pytest.mark.parametrize("kv_type", [GGML_TYPE_Q8_0, GGML_TYPE_Q4_0])
def test_quantized_instance_follows_the_calls_pairs(kv_type, monkeypatch):
    """One pair (one stream's one query tile: a sequence's decode token, or up to 4 of its
    tokens at GQA 4) runs the scratch instance, as measured faster there; two streams, or a
    second query tile, the register path; the knob overrides both; f16 is one instance."""
    from ggml_attn import cuda_launch as L
    monkeypatch.setattr(L, "num_sms", lambda: 132)
    monkeypatch.setattr(L, "_occupancy", lambda *a: 1)
    dims = lambda n_batch, ne3, t=kv_type: L.AttnDims(128, 128, n_batch, 32, 8, ne3, 4096, t)   # noqa: E731
    one, reg = dt.CONFIGS[dt.FOR_ONE_PAIR[kv_type]], dt.CONFIGS[dt.FOR_TYPE[kv_type]]
    assert one.scratch and not reg.scratch
    assert L.launch_config("decode-tma", dims(1, 1)).name == one.name
    assert L.launch_config("decode-tma", dims(4, 1)).name == one.name          # 4 tokens: one query tile
    assert L.launch_config("decode-tma", dims(5, 1)).name == reg.name          # two query tiles
    assert L.launch_config("decode-tma", dims(1, 2)).name == reg.name          # two streams
    assert L.launch_config("decode-tma", dims(1, 1, GGML_TYPE_F16)).name == dt.CONFIGS["s6"].name
    assert dt.config(kv_type) == dt.FOR_TYPE[kv_type]                          # pairs not known
    monkeypatch.setattr(L, "DECODE_TMA_CONFIG", dt.FOR_TYPE[kv_type])
    assert L.launch_config("decode-tma", dims(1, 1)).name == reg.name


@pytest.mark.parametrize("units,n_hg,slots,cap", [
    ([64] * 16, 8, 132, 64),      # B=16 4k: one group per block, 128 blocks
    ([512], 8, 132, 32),          # B=1 32k: 16 parts of 32 tiles per group
    ([64], 8, 132, 4),            # B=1 4k: 16 parts of 4
    ([64] * 64, 8, 132, 256),     # B=64 4k: four groups per block
    ([64] * 256, 8, 132, 1024),   # B=256 4k: sixteen, across pairs
    ([64, 128], 8, 132, 13),      # two streams of 4k and 8k: 5 and 10 parts of 13
    ([8, 128, 40, 77, 100, 16, 64, 90, 30, 120, 12, 55, 80, 128, 9, 70], 8, 132, 0),   # ragged: equal shares
    ([5, 9], 1, 1, 0),            # unequal pairs, more than the blocks: equal shares
])
def test_work_cap(units, n_hg, slots, cap):
    assert dt.work_cap(units, n_hg, slots, 1.15) == cap
    if cap:
        assert dt.blocks_needed(units, n_hg, cap) <= slots
        assert dt.blocks_needed(units, n_hg, cap - 1) > slots or cap == 1
        assert dt.max_load(units, n_hg, cap) <= 1.15 * sum(units) * n_hg / slots


def test_work_cap_equal_is_the_search_in_closed_form():
    import numpy as np
    rng = np.random.default_rng(1)
    for _ in range(2000):
        u, n_pairs, n_hg, slots = (int(rng.integers(1, 600)), int(rng.integers(1, 300)),
                                   int(rng.choice([1, 2, 4, 8])), int(rng.integers(1, 300)))
        assert dt.work_cap([u] * n_pairs, n_hg, slots, 1.15) == dt.work_cap_equal(u, n_pairs * n_hg, slots, 1.15)


def _check_ranges(units, n_hg, B, cap):
    """block_ranges partitions [0, W) in block order; under a cap whose blocks fit, each block
    holds whole groups or one part of one group, and a cut group's parts are the blocks b0 ..
    b0 + n_part - 1, in order, covering it."""
    import numpy as np
    u = [max(1, int(x)) for x in units]
    bounds = np.cumsum([0] + [x for x in u for _ in range(n_hg)])
    W = int(bounds[-1])
    r = dt.block_ranges(units, n_hg, B, cap)
    assert len(r) == B and r[0][0] == 0 and r[-1][1] == W
    assert all(a[1] == b[0] for a, b in zip(r, r[1:])) and all(w <= e for w, e, *_ in r)
    if cap <= 0 or dt.blocks_needed(units, n_hg, cap) > B:
        assert all(b0 == -1 for _, _, b0, _ in r), "equal shares"
        return
    on_bound = set(int(x) for x in bounds)
    for b, (w, e, b0, n_part) in enumerate(r):
        if w == e:
            continue
        if b0 < 0:
            assert w in on_bound and e in on_bound, (b, w, e)
            assert e - w <= max(cap, max(u)), "whole groups: at most the cap, or one group"
        else:
            g = int(np.searchsorted(bounds, w, side="right")) - 1
            gb, ge = int(bounds[g]), int(bounds[g + 1])
            assert gb <= w < e <= ge and n_part > 1 and b0 <= b < b0 + n_part
            parts = r[b0:b0 + n_part]
            assert parts[0][0] == gb and parts[-1][1] == ge and all(x[2] == b0 and x[3] == n_part for x in parts)
            assert e - w <= cap


@pytest.mark.parametrize("seed", range(40))
def test_block_ranges_split_right_under_any_cap(seed):
    """Whatever the cap (the host's, or a stale one after a plan's refresh changed the counts),
    the split is right; with the host's cap the blocks fit."""
    import numpy as np
    rng = np.random.default_rng(seed)
    n_pairs = int(rng.integers(1, 40))
    units = rng.integers(0, 200, n_pairs) if seed % 3 else np.full(n_pairs, int(rng.integers(0, 200)))
    n_hg, B = int(rng.choice([1, 2, 4, 8])), int(rng.integers(1, 140))
    for cap in (dt.work_cap(units, n_hg, B, 1.15), dt.work_cap(units, n_hg, B, 100.0), 0,
                int(rng.integers(1, 300)), 1):
        _check_ranges(units, n_hg, B, cap)


def test_configs_name_their_template_instances():
    """Each CONFIGS entry's name is cuda/fattn_decode_tma.cu's template with the entry's K/V type,
    head size, ring depth, warp per tile, consumer warps and K/V path (registers unless through
    scratch), compiled in a program of its own; names are distinct."""
    from ggml_attn import kernels as K
    assert dt.CONFIGS["q8_0"].name == "fattn_decode_tma<fattn_q8_0, 128, 11, true, 7, true, true>"
    assert dt.CONFIGS["q4_0-scratch"].name == "fattn_decode_tma<fattn_q4_0, 128, 12, true, 4, false, true>"
    assert dt.CONFIGS["split-s4"].name == "fattn_decode_tma<__half, 128, 4, false, 4, false, false>"
    assert dt.CONFIGS["s6-bf16"].name == "fattn_decode_tma<__nv_bfloat16, 128, 6, true, 4, false, false>"
    names = [c.name for c in dt.CONFIGS.values()]
    assert len(set(names)) == len(names)
    for c in dt.CONFIGS.values():
        assert K.decode_tma_variant(c.name).names == (c.name,)
        assert c.threads == 32 * (c.consumers + (0 if c.row_heads else 1))
        assert c.whole or c.consumers == dt.CONSUMERS, "four warps per tile: the tile's four 16-cell parts"
    assert {v.names[0] for v in K.hopper_variants() if v.family == "decode-tma"} == set(names)


# ---- the kernel's work split, mirrored: block b takes units [b W / B, (b + 1) W / B) of the
# flattened (group, unit) list; a group with no live tile has one unit; a part of a group goes
# to slot 2 b (the block's first group) or 2 b + 1 (its last), and the merging block reads
# the slots of blocks block_of(first unit) .. block_of(last unit)
def _block_of(w, W, B):
    return ((w + 1) * B - 1) // W


def _walk(units, B):
    """{group: [(block, slot, first unit, end)]} as the kernel's blocks write them."""
    W = sum(units)
    begin = [sum(units[:g]) for g in range(len(units))]
    parts = {}
    for b in range(B):
        w, end = W * b // B, W * (b + 1) // B
        while w < end:
            g = max(i for i in range(len(units)) if begin[i] <= w)
            t = w - begin[g]
            e = min(units[g], t + end - w)
            slot = 2 * b + (0 if w == W * b // B else 1)
            parts.setdefault(g, []).append((b, slot, t, e))
            w += e - t
    return parts


@pytest.mark.parametrize("units,B", [([16] * 8, 132), ([16] * 8, 5), ([3, 1, 1, 40, 2, 7], 4),
                                     ([1] * 50, 7), ([64] * 3, 2), ([5], 9)])
def test_work_split_covers_each_group_once_and_merges_find_every_part(units, B):
    W = sum(units)
    parts = _walk(units, B)
    begin = [sum(units[:g]) for g in range(len(units))]
    slots = set()
    for g, ps in parts.items():
        covered = sorted((t, e) for _, _, t, e in ps)
        assert covered[0][0] == 0 and covered[-1][1] == units[g]
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))   # no gap, no overlap
        b_first, b_last = _block_of(begin[g], W, B), _block_of(begin[g] + units[g] - 1, W, B)
        owners = [b for b in range(b_first, b_last + 1) if W * (b + 1) // B > W * b // B]   # blocks with units
        assert sorted(b for b, *_ in ps) == owners
        if len(ps) > 1:   # the merger's slot of each part, as merge_parts' part_slot finds them
            dense = W >= B
            n_part = _block_of(begin[g] + units[g] - 1, W, B) - b_first + 1 if dense else units[g]
            blocks = [b_first + k if dense else _block_of(begin[g] + k, W, B) for k in range(n_part)]
            assert blocks == owners
            want = {2 * b + (1 if k == 0 and W * b // B < begin[g] else 0) for k, b in enumerate(blocks)}
            assert want == {s for _, s, _, _ in ps}
            assert not slots & want
            slots |= want
    assert set(parts) == set(range(len(units)))


def test_workspace_and_counters():
    o, total = dt.workspace_bytes(132, 128)
    assert o == 2 * 132 * 16 * 128 * 4 and total == o + 2 * 132 * 16 * 8
    assert dt.n_groups(32, 4, 1, 16) == 128


# ---- the whole-rows instances (cuda/fattn_decode_rows.cu)
def _rows_dims(n_batch=1, ne3=64, n_head=32, n_head_kv=8, kv_type=GGML_TYPE_Q8_0, n_kv=32768):
    from ggml_attn import cuda_launch as L
    return L.AttnDims(128, 128, n_batch, n_head, n_head_kv, ne3, n_kv, kv_type)


@pytest.mark.parametrize("key,kv_type,stages", [("q8_0-rows", GGML_TYPE_Q8_0, 3), ("q4_0-rows", GGML_TYPE_Q4_0, 6)])
def test_whole_rows_instances_launch_as_one_group_a_pair(key, kv_type, stages, monkeypatch):
    """A whole-rows instance: its template, 8 warps and no producer warp, and a pair's work one
    group (the cap sized on every head group a unit: decode_tma_cap's whole_rows), its workspace
    a slot of every head group's rows a block; not the op's default for its type."""
    from ggml_attn import cuda_launch as L
    from ggml_attn import variants as V
    c = dt.CONFIGS[key]
    ctype = "fattn_q8_0" if kv_type == GGML_TYPE_Q8_0 else "fattn_q4_0"
    assert c.name == f"fattn_decode_rows<{ctype}, 128, {stages}, 8, 8>" and c.threads == 256
    assert dt.whole_rows(c.name) and not dt.whole_rows(dt.CONFIGS[dt.FOR_TYPE[kv_type]].name)
    assert key not in (dt.FOR_TYPE[kv_type], dt.FOR_ONE_PAIR[kv_type])
    assert V.decode_tma_variant(c.name).source == "fattn_decode_rows.cu"
    assert V.decode_tma_variant(dt.CONFIGS["q8_0"].name).source == "fattn_decode_tma.cu"
    assert V.smem_expr(c.name) == f"&fattn_decode_rows_smem<{ctype}, 128, {stages}, 8, 8>"
    monkeypatch.setattr(L, "num_sms", lambda: 132)
    monkeypatch.setattr(L, "_occupancy", lambda *a: 1)
    monkeypatch.setattr(L, "DECODE_TMA_CONFIG", key)
    for ne3, n_kv in ((64, 32768), (16, 4096), (1, 32768)):
        sh = _rows_dims(ne3=ne3, kv_type=kv_type, n_kv=n_kv)
        cfg = L.launch_config("decode-tma", sh)
        assert cfg.name == c.name and cfg.block == 256 and cfg.pack == 4
        cap, blocks = L.decode_tma_cap(sh, 4, 1, 132, whole_rows=True)
        assert (cfg.work_cap, cfg.grid[0]) == (cap, blocks)
        u = -(-n_kv // 64)
        # one group a pair: the same cut as units of 8x the tiles' work would make of 8 groups
        assert cap == dt.work_cap_equal(u, ne3, 132, L.DECODE_TMA_CAP_SLACK) and blocks <= 132
    o, total = dt.workspace_bytes(132, 128, 8)
    assert (o, total) == (2 * 132 * 8 * 16 * 128 * 4, o + 2 * 132 * 8 * 16 * 8)
    assert dt.workspace_bytes(132, 128) == tuple(x // 8 for x in (o, total))


def test_whole_rows_instances_say_which_calls_they_cannot_run(monkeypatch):
    """The knob naming a whole-rows instance on a call of another head layout is a clear error:
    8 KV heads a cell row, a warp for each of 8 head groups."""
    from ggml_attn import cuda_launch as L
    monkeypatch.setattr(L, "num_sms", lambda: 132)
    monkeypatch.setattr(L, "_occupancy", lambda *a: 1)
    c = dt.CONFIGS["q8_0-rows"]
    assert dt.rows_why_not(c, 32, 8, 4) is None
    assert "8 KV heads" in dt.rows_why_not(c, 64, 16, 4)
    assert "8 head groups" in dt.rows_why_not(c, 64, 8, 4)      # GQA 8 packed 4: 16 groups
    assert dt.rows_why_not(dt.CONFIGS["q8_0"], 64, 16, 4) is None
    monkeypatch.setattr(L, "DECODE_TMA_CONFIG", "q8_0-rows")
    with pytest.raises(ValueError, match="q8_0-rows.*cannot run this call: 8 KV heads"):
        L.launch_config("decode-tma", _rows_dims(n_head=32, n_head_kv=4))
    with pytest.raises(ValueError, match="another K/V type"):
        L.launch_config("decode-tma", _rows_dims(kv_type=GGML_TYPE_Q4_0))


@pytest.mark.parametrize("kv_type,row", [(GGML_TYPE_Q8_0, 136), (GGML_TYPE_Q4_0, 72)])
def test_quant_rows_map_boxes_a_cells_whole_row(kv_type, row, monkeypatch):
    """The whole-rows map: 8-byte elements over a cell's row of every head (one box side), 32
    cells a box, the cache's cell and stream strides; rows that are not a multiple of 16 bytes
    (an odd head count) or wider than a box are refused before the driver is asked."""
    from ggml_attn import tma
    from ggml_attn.tensor import TensorDesc
    seen = []
    monkeypatch.setattr(tma, "encode_tiled", lambda *a: seen.append(a) or "map")
    nb1 = 8 * row + 16                                       # a cache view: rows 16 bytes apart
    t = TensorDesc(0x10000, kv_type, (128, 5000, 8, 3), (row // 4, nb1, row, nb1 * 5000))
    assert dt.kv_map_of(dt.CONFIGS["q8_0"].name) is dt.quant_kv_map
    assert dt.kv_map_of(dt.CONFIGS["q8_0-rows"].name)(t, 2) == "map"
    dtype, ptr, dims, strides, box, swz, promo = seen[0]
    assert (dtype, ptr, swz, promo) == (tma.DTYPE_U64, 0x10000, tma.SWIZZLE_NONE, 2)
    assert dims == (8 * row // 8, 5000, 1, 3) and strides == (nb1, nb1, nb1 * 5000)
    assert box == (8 * row // 8 + 2, dt.ROWS_HALF, 1, 1)      # the row and 16 bytes of zeros past it
    tma.check_tiled(dtype, ptr, dims, strides, box)          # the driver's rules, as the map asks
    odd = TensorDesc(0x10000, kv_type, (128, 5000, 3, 1), (row // 4, 3 * row + 8, row, 0))
    with pytest.raises(ValueError, match="multiple of 16"):
        dt.quant_rows_map(odd)
    wide = TensorDesc(0x10000, kv_type, (128, 5000, 32, 1), (row // 4, 32 * row, row, 0))
    with pytest.raises(ValueError, match="up to 2032"):
        dt.quant_rows_map(wide)
    four = TensorDesc(0x10000, kv_type, (128, 5000, 4, 1), (row // 4, 4 * row, row, 0))
    with pytest.raises(ValueError, match="rows of 8 KV heads, the tensor has 4"):
        dt.kv_map_of(dt.CONFIGS["q8_0-rows"].name)(four)
    assert len(seen) == 1
