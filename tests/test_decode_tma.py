"""The sm_90a decode (cuda/fattn_decode_tma.cu, kernel "decode-tma") without a GPU: when auto
runs it, its launch shape and workspace, and its work split (the kernel's arithmetic, mirrored
here). Its results on the device: tests/test_gpu_hopper.py."""
from __future__ import annotations

import pytest

from ggml_attn import decode_tma_shape as dt
from ggml_attn.dtypes import GGML_TYPE_BF16, GGML_TYPE_F16, GGML_TYPE_F32


def _f(**kw):
    from ggml_attn.dispatch import DECODE_TMA_MIN_WORK, CallFacts
    base = dict(n_batch=1, gqa=4, n_kv=4096, d_k=128, d_v=128, kv_type=GGML_TYPE_F16, arch="sm_90",
                work_tiles=DECODE_TMA_MIN_WORK)
    base.update(kw)
    return CallFacts(**base)


def test_constants_mirror_the_kernel():
    """decode_tma_shape's copies of cuda/fattn_decode_tma.cu's constants."""
    import re
    from pathlib import Path
    src = (Path(__file__).resolve().parents[1] / "cuda" / "fattn_decode_tma.cu").read_text()
    cu = {m[1]: int(m[2]) for m in re.finditer(r"constexpr int (\w+) = (\d+);", src)}
    mine = {"ROWS": dt.ROWS, "CONSUMERS": dt.CONSUMERS}
    assert {k: cu.get(k) for k in mine} == mine
    assert dt.THREADS == 32 * (dt.CONSUMERS + 1)


def test_auto_runs_it_where_decode_tc_would_on_sm90():
    from ggml_attn.dispatch import best_kernel
    for kw in ({}, dict(kv_type=GGML_TYPE_BF16), dict(n_batch=4), dict(gqa=8, n_batch=2), dict(mask_tiles="masked")):
        c = best_kernel("auto", _f(**kw))
        assert c.kernel == "decode-tma" and "sm_90a" in c.reason, kw


def test_auto_keeps_decode_tc_elsewhere():
    """Another architecture, other head sizes, sinks/softcap/ALiBi, calls with less work than
    DECODE_TMA_MIN_WORK with a mask or DECODE_TMA_MIN_WORK_UNMASKED without (or not known),
    unaligned K/V; prefill shapes stay prefill kernels."""
    from ggml_attn.dispatch import DECODE_TMA_MIN_WORK, DECODE_TMA_MIN_WORK_UNMASKED, best_kernel
    for kw in (dict(arch="sm_80"), dict(arch=""), dict(d_k=64, d_v=64), dict(plain=False),
               dict(work_tiles=DECODE_TMA_MIN_WORK - 1, mask_tiles="plain"),
               dict(work_tiles=DECODE_TMA_MIN_WORK - 1, mask_tiles="masked"),
               dict(work_tiles=DECODE_TMA_MIN_WORK_UNMASKED - 1), dict(work_tiles=0)):
        assert best_kernel("auto", _f(**kw)).kernel == "decode-tc", kw
    # without a mask (groups of equal work, blocks aligned to them) from the lower threshold on
    c = best_kernel("auto", _f(work_tiles=DECODE_TMA_MIN_WORK_UNMASKED))
    assert c.kernel == "decode-tma" and "no mask" in c.reason
    assert DECODE_TMA_MIN_WORK_UNMASKED < DECODE_TMA_MIN_WORK
    assert best_kernel("auto", _f(kv_aligned=False)).kernel == "reference"
    assert best_kernel("auto", _f(n_batch=512)).kernel.startswith("prefill")


def test_by_name_says_why_not(monkeypatch):
    from ggml_attn import dispatch
    assert dispatch.best_kernel("decode-tma", _f(n_batch=64)).kernel == "decode-tma"
    for kw, words in ((dict(arch="sm_89"), "compute capability 9.0"), (dict(d_k=256, d_v=256), "D 128"),
                      (dict(kv_type=GGML_TYPE_F32), "f16 or bf16"), (dict(plain=False), "sinks")):
        with pytest.raises(ValueError, match=words):
            dispatch.best_kernel("decode-tma", _f(**kw))
    work = dispatch.DECODE_TMA_MIN_WORK
    monkeypatch.setattr(dispatch, "DECODE_TMA_MIN_WORK", 1 << 62)   # by name only
    monkeypatch.setattr(dispatch, "DECODE_TMA_MIN_WORK_UNMASKED", 1 << 62)
    assert dispatch.best_kernel("auto", _f(work_tiles=work)).kernel == "decode-tc"


def test_facts_count_the_work_of_decode_tc_groups():
    """work_tiles: streams x query tiles of 16 / pack tokens x head groups x KV tiles."""
    from ggml_attn.cuda_launch import Shapes, facts
    assert facts(Shapes(128, 128, 1, 32, 8, 64, 32768, GGML_TYPE_F16)).work_tiles == 64 * 1 * 8 * 512
    assert facts(Shapes(128, 128, 5, 32, 8, 2, 100, GGML_TYPE_F16)).work_tiles == 2 * 2 * 8 * 2
    assert facts(Shapes(128, 128, 1, 4, 4, 1, 64, GGML_TYPE_F16)).work_tiles == 1 * 1 * 4 * 1   # GQA 1: pack 1


def test_launch_config_is_one_wave_of_decode_tc_rows(monkeypatch):
    """16 rows per group (pack heads x 16 / pack tokens), 160 threads, one block per SM times
    the occupancy (without a plan aligned to the groups; or DECODE_TMA_BLOCKS), no split; the
    instance of the call's K/V type."""
    from ggml_attn import cuda_launch as L
    monkeypatch.setattr(L, "num_sms", lambda: 132)
    monkeypatch.setattr(L, "_occupancy", lambda *a: 1)
    for kv_type, name in ((GGML_TYPE_F16, "fattn_decode_tma_d128"), (GGML_TYPE_BF16, "fattn_decode_tma_bf16_d128")):
        cfg = L.launch_config("decode-tma", L.Shapes(128, 128, 3, 32, 8, 2, 1000, kv_type))
        # 2 streams x 8 KV heads = 16 groups of equal work: 128 blocks (8 parts each), not 132
        assert cfg.name == name and cfg.block == dt.THREADS and cfg.grid == (128, 1, 1)
        assert L.launch_config("decode-tma", L.Shapes(128, 128, 3, 32, 8, 2, 1000, kv_type),
                               max_live={4: 16}).grid == (132, 1, 1), "with a plan: one per slot"
        assert (cfg.pack, cfg.q_tile_tokens, cfg.n_q_tiles, cfg.n_kv_tiles, cfg.n_splits) == (4, 4, 1, 16, 1)
        assert cfg.smem == dt.smem_bytes(128, 6) <= 227 * 1024
    monkeypatch.setattr(L, "DECODE_TMA_ALIGN", 0)
    assert L.launch_config("decode-tma", L.Shapes(128, 128, 3, 32, 8, 2, 1000, GGML_TYPE_F16)).grid == (132, 1, 1)
    monkeypatch.setattr(L, "DECODE_TMA_ALIGN", 1)
    monkeypatch.setattr(L, "DECODE_TMA_BLOCKS", 3)
    assert L.launch_config("decode-tma", L.Shapes(128, 128, 1, 32, 8, 1, 1000, GGML_TYPE_F16)).grid == (3, 1, 1)
    monkeypatch.setattr(L, "DECODE_TMA_CONFIG", "s6-bf16")
    with pytest.raises(ValueError, match="another K/V type"):
        L.launch_config("decode-tma", L.Shapes(128, 128, 1, 32, 8, 1, 1000, GGML_TYPE_F16))


@pytest.mark.parametrize("slots,groups,want", [
    (132, 8, 128), (132, 128, 128), (132, 512, 128), (132, 32, 128), (132, 136, 132), (132, 264, 132),
    (132, 1, 132), (132, 7, 126), (132, 97, 132), (264, 128, 256), (10, 3, 9), (1, 5, 1), (132, 131, 131)])
def test_aligned_blocks(slots, groups, want):
    """The largest count within 0.9 of the slots that the groups divide or that divides them;
    else the slots. Block b's units [b W / B, (b + 1) W / B) then end on group boundaries or cut
    each group into equal parts."""
    b = dt.aligned_blocks(slots, groups)
    assert b == want and slots * 0.9 <= b <= slots
    if b != slots:
        W = groups * 64   # 64 tiles per group
        cuts = {b_ * W // b for b_ in range(b + 1)}
        per = W // groups
        assert all(c % per == 0 for c in cuts) or all(g * per in cuts for g in range(groups + 1))


def test_every_instance_fits_shared_memory():
    for name, d, stages, _ in dt.CONFIGS.values():
        assert dt.smem_bytes(d, stages) <= 227 * 1024, name


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
