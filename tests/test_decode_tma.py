"""The sm_90a decode (cuda/fattn_decode_tma.cu, kernel "decode-tma") without a GPU: when auto
runs it, its launch shape and workspace, and its schedule (the kernel's protocol, mirrored
here). Its results on the device: tests/test_gpu_decode_tma.py."""
from __future__ import annotations

import numpy as np
import pytest

from ggml_attn import decode_tma_shape as dt
from ggml_attn.dtypes import GGML_TYPE_BF16, GGML_TYPE_F16, GGML_TYPE_F32


def _f(**kw):
    from ggml_attn.dispatch import DECODE_TMA_MIN_WORK, CallFacts
    base = dict(n_batch=1, gqa=4, n_kv=4096, d_k=128, d_v=128, kv_type=GGML_TYPE_F16, arch="sm_90",
                work_tiles=DECODE_TMA_MIN_WORK)
    base.update(kw)
    return CallFacts(**base)


def test_auto_runs_it_where_decode_tc_would_on_sm90():
    from ggml_attn.dispatch import best_kernel
    for kw in ({}, dict(kv_type=GGML_TYPE_BF16), dict(n_batch=4), dict(gqa=8, n_batch=2), dict(mask_tiles="masked")):
        c = best_kernel("auto", _f(**kw))
        assert c.kernel == "decode-tma" and "sm_90a" in c.reason, kw


def test_auto_keeps_decode_tc_elsewhere():
    """Another architecture, other head sizes, sinks/softcap/ALiBi, calls with less work than
    DECODE_TMA_MIN_WORK (or not known), unaligned K/V; prefill shapes stay prefill kernels."""
    from ggml_attn.dispatch import DECODE_TMA_MIN_WORK, best_kernel
    for kw in (dict(arch="sm_80"), dict(arch=""), dict(d_k=64, d_v=64), dict(plain=False),
               dict(work_tiles=DECODE_TMA_MIN_WORK - 1), dict(work_tiles=0)):
        assert best_kernel("auto", _f(**kw)).kernel == "decode-tc", kw
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
    assert dispatch.best_kernel("auto", _f(work_tiles=work)).kernel == "decode-tc"


def test_facts_count_the_work_of_decode_tc_groups():
    """work_tiles: streams x query tiles of 16 / pack tokens x head groups x KV tiles."""
    from ggml_attn.cuda_launch import Shapes, facts
    assert facts(Shapes(128, 128, 1, 32, 8, 64, 32768, GGML_TYPE_F16)).work_tiles == 64 * 1 * 8 * 512
    assert facts(Shapes(128, 128, 5, 32, 8, 2, 100, GGML_TYPE_F16)).work_tiles == 2 * 2 * 8 * 2
    assert facts(Shapes(128, 128, 1, 4, 4, 1, 64, GGML_TYPE_F16)).work_tiles == 1 * 1 * 4 * 1   # GQA 1: pack 1


def test_launch_config_is_one_wave_of_decode_tc_rows(monkeypatch):
    """16 rows per group (pack heads x 16 / pack tokens), 160 threads, one block per SM times
    the occupancy (or DECODE_TMA_BLOCKS), no split; the instance of the call's K/V type."""
    from ggml_attn import cuda_launch as L
    monkeypatch.setattr(L, "num_sms", lambda: 132)
    monkeypatch.setattr(L, "_occupancy", lambda *a: 1)
    for kv_type, name in ((GGML_TYPE_F16, "fattn_decode_tma_d128"), (GGML_TYPE_BF16, "fattn_decode_tma_bf16_d128")):
        cfg = L.launch_config("decode-tma", L.Shapes(128, 128, 3, 32, 8, 2, 1000, kv_type))
        assert cfg.name == name and cfg.block == dt.THREADS and cfg.grid == (132, 1, 1)
        assert (cfg.pack, cfg.q_tile_tokens, cfg.n_q_tiles, cfg.n_kv_tiles, cfg.n_splits) == (4, 4, 1, 16, 1)
        assert cfg.smem == dt.smem_bytes(128, 6) <= 227 * 1024
    monkeypatch.setattr(L, "DECODE_TMA_BLOCKS", 3)
    assert L.launch_config("decode-tma", L.Shapes(128, 128, 1, 32, 8, 1, 1000, GGML_TYPE_F16)).grid == (3, 1, 1)
    monkeypatch.setattr(L, "DECODE_TMA_CONFIG", "s6-bf16")
    with pytest.raises(ValueError, match="another K/V type"):
        L.launch_config("decode-tma", L.Shapes(128, 128, 1, 32, 8, 1, 1000, GGML_TYPE_F16))


def test_every_instance_fits_shared_memory():
    for name, d, stages, _ in dt.CONFIGS.values():
        assert dt.smem_bytes(d, stages) <= 227 * 1024, name


# ---- the kernel's schedule, mirrored (cuda/fattn_decode_tma.cu, step produce): the call's
# units cut into chunks of C tiles per group, one region of chunks per block; the owner takes
# the first half of its region unasked, then one chunk at a time from the front (the low half
# of the region's counter); a block out of work takes from the back (the high half) of the
# region with the most left while it has a slot for its open run and a new one. Blocks run as
# generators stepped in a random order, one atomic operation per step.
SLOTS, MAX_CHUNK = dt.SLOTS, 4


def test_constants_mirror_the_kernel():
    """decode_tma_shape's copies (and this file's MAX_CHUNK) of cuda/fattn_decode_tma.cu's constants."""
    import re
    from pathlib import Path
    src = (Path(__file__).resolve().parents[1] / "cuda" / "fattn_decode_tma.cu").read_text()
    cu = {m[1]: int(m[2]) for m in re.finditer(r"constexpr int (\w+) = (\d+);", src)}
    mine = {"SLOTS": dt.SLOTS, "EVENTS": dt.EVENTS, "MERGE_BATCH": dt.MERGE_BATCH, "UNASKED_DIV": dt.UNASKED_DIV,
            "ROWS": dt.ROWS, "CONSUMERS": dt.CONSUMERS, "MAX_CHUNK": MAX_CHUNK}
    assert {k: cu.get(k) for k in mine} == mine


def _chunks(units, B):
    """[(group, t0, t1)] of the call, group-major, and C."""
    C = min(MAX_CHUNK, max(1, sum(units) // (4 * B)))
    return [(g, t0, min(t0 + C, u)) for g, u in enumerate(units) for t0 in range(0, u, C)], C


def _block(b, B, chunks, ctr, out, steal, stats):
    N = len(chunks)
    size = lambda v: N * (v + 1) // B - N * v // B
    R0, k = N * b // B, size(b)
    n0, ns, run = k // dt.UNASKED_DIV, 0, None   # run: [group, units]

    def flush():
        nonlocal ns, run
        if run is not None:
            g, n = run
            whole = n == units_of[g]
            out.append((b, g, n, None if whole else b * SLOTS + ns))
            ns += not whole
            run = None

    def take(c):
        nonlocal run
        g, t0, t1 = chunks[c]
        stats["taken"].append(c)
        stats["by"].append((b, c))
        if run is not None and run[0] != g:
            flush()
        if run is None:
            run = [g, 0]
        run[1] += t1 - t0
        if t1 == units_of[g]:
            flush()

    units_of = stats["units"]
    c, lim = R0, R0 + n0
    while k > 0:
        if c == lim:
            yield
            x = ctr[b]
            ctr[b] = (x[0] + 1, x[1])
            if n0 + x[0] + x[1] >= k:
                break
            lim += 1
        take(c)
        c += 1
        if c == R0 + k:
            break
    flush()   # the kernel flushes its own region's run before it looks for other work
    while steal and ns + (run is not None) + 1 <= SLOTS:
        yield
        left = [size(v) - size(v) // dt.UNASKED_DIV - ctr[v][0] - ctr[v][1] for v in range(B)]
        best = max(left)
        if best <= 0:
            break
        v = max(i for i in range(B) if left[i] == best)   # the kernel's ties: the higher region
        yield
        x = ctr[v]
        ctr[v] = (x[0], x[1] + 1)
        if size(v) // dt.UNASKED_DIV + x[0] + x[1] >= size(v):
            continue
        take(N * v // B + size(v) - 1 - x[1])
    flush()


def _simulate(units, B, steal=True, seed=0, slow=()):
    """[(block, group, units, slot or None: whole)] of one launch; ``slow``: blocks stepped a
    tenth as often (slow SMs, whose regions the others empty)."""
    rng = np.random.default_rng(seed)
    chunks, C = _chunks(units, B)
    ctr = [(0, 0)] * B
    out, stats = [], {"taken": [], "by": [], "units": units}
    live = {b: _block(b, B, chunks, ctr, out, steal, stats) for b in range(B)}
    while live:
        ids = list(live)
        w = np.array([0.1 if b in slow else 1.0 for b in ids])
        b = ids[rng.choice(len(ids), p=w / w.sum())]
        try:
            next(live[b])
        except StopIteration:
            del live[b]
    return out, stats, chunks


@pytest.mark.parametrize("units,B", [([512] * 8, 132), ([64] * 8, 132), ([16] * 8, 5), ([3, 1, 1, 40, 2, 7], 4),
                                     ([1] * 50, 7), ([64] * 3, 2), ([5], 9), ([64] * 128, 132)])
@pytest.mark.parametrize("steal", [True, False])
def test_schedule_takes_each_chunk_once_and_bounds_the_parts(units, B, steal):
    for seed in range(3):
        out, stats, chunks = _simulate(units, B, steal, seed, slow=set(range(0, B, 3)))
        assert sorted(stats["taken"]) == list(range(len(chunks))), "every chunk once"
        for g, u in enumerate(units):
            runs = [(n, slot) for _, gg, n, slot in out if gg == g]
            assert sum(n for n, _ in runs) == u, "a group's runs cover its units"
            assert all(slot is None for _, slot in runs) == (len(runs) == 1), "whole iff alone"
            assert len(runs) <= max(u, 1), "the part list's capacity (max(n_kv_tiles, 1) >= chunks)"
        slots = [slot for *_, slot in out if slot is not None]
        assert len(slots) == len(set(slots)), "a slot holds one part"
        assert all(b * SLOTS <= sl < (b + 1) * SLOTS for b, _, _, sl in out if sl is not None), "the block's own slots"
        if not steal:   # the fixed split: a block's parts are those of its region's first and last group
            assert all(sum(1 for bb, *_, sl in out if bb == b and sl is not None) <= 2 for b in range(B))


def test_slow_blocks_lose_chunks_to_the_others():
    """A third of the blocks slow: the others take chunks from the backs of their regions (none
    from the owner's unasked first quarter); with steal off every block takes its own region."""
    units, B = [512] * 8, 132
    for steal in (True, False):
        _, stats, chunks = _simulate(units, B, steal, 0, slow=set(range(0, B, 3)))
        N = len(chunks)
        region = lambda c: max(v for v in range(B) if N * v // B <= c)
        foreign = [(b, c) for b, c in stats["by"] if region(c) != b]
        if steal:
            assert len(foreign) > N // 20
            assert all(c - N * region(c) // B >= (N * (region(c) + 1) // B - N * region(c) // B) // dt.UNASKED_DIV for _, c in foreign)
            assert all(region(c) % 3 == 0 for _, c in foreign[: len(foreign) // 2]), "mostly from the slow"
        else:
            assert not foreign


def test_workspace_and_counters():
    o, total = dt.workspace_bytes(132, 128, 8, 512)
    assert o == 8 * 132 * 16 * 128 * 4 and total == o + 8 * 132 * 16 * 8 + 8 * 512 * 4
    assert dt.workspace_bytes(5, 128, 3, 0)[1] == 8 * 5 * 16 * (128 * 4 + 8) + 3 * 4
    assert dt.n_groups(32, 4, 1, 16) == 128
    assert dt.counter_ints(128, 132) == 258 + 264 and dt.counter_ints(3, 5) == 8 + 10   # regions at an even index
