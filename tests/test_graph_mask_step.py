"""Masks stepped from the previous step's (graph/mask_step.py) equal the masks built from
scratch (mask.visible_cells + mask.mask_values, checked against references in
tests/test_graph_host_fastpaths.py), bit for bit, over random runs: decode steps of the same
sequences (the stepped case) mixed with prompts, changes of the active sequences, sequences
that are removed, copied (then diverge), kept, shifted, a cache that fills and wraps, failing
ubatches that roll back, pads, unified and split caches; ubatches placed by hand with
positions that jump back and forth; and the settings that never step (SWA, ALiBi, no causal).
"""
import numpy as np
import pytest

from ggml_attn.graph import Batch, KVCache, KVCacheFullError
from ggml_attn.graph import driver
from ggml_attn.graph import kv_changes
from ggml_attn.graph import mask as mask_mod
from ggml_attn.graph import mask_step
from ggml_attn.graph import plan as plan_mod
from ggml_attn.graph.attn_config import AttnConfig
from ggml_attn.graph.split import UBatch


def plain(cache, ub, slot, n_kv, *, causal=True, n_swa=0, alibi=False, dtype=np.float16):
    vis = mask_mod.visible_cells(cache, ub, slot, n_kv, causal=causal, n_swa=n_swa)
    return mask_mod.mask_values(cache, ub, slot, vis, alibi=alibi, dtype=dtype), vis


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
        np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


class Checked:
    """build_mask (as plan_ubatch calls it) checked against the plain path; counts the masks
    that were stepped."""

    def __init__(self, monkeypatch):
        self.n_masks = self.n_stepped = 0
        build_mask, next_step = plan_mod.build_mask, mask_step.next_step
        me = self

        def counted(*a, **kw):
            got = next_step(*a, **kw)
            me.n_stepped += got is not None
            return got

        def checked(cache, ub, slot, n_kv=None, **kw):
            got = build_mask(cache, ub, slot, n_kv, **kw)
            n_kv = n_kv if n_kv is not None else cache.n_kv(slot)
            kw.pop("return_visible", None)
            want_mask, want_vis = plain(cache, ub, slot, n_kv, **kw)
            mask, vis = got
            assert same_bits(mask, want_mask)
            assert vis.dtype == bool and np.array_equal(vis, want_vis)
            me.n_masks += 1
            return got

        monkeypatch.setattr(mask_step, "next_step", counted)
        monkeypatch.setattr(plan_mod, "build_mask", checked)


class _Fail(RuntimeError):
    pass


class _Engine:
    def __init__(self, rng, p_fail):
        self.rng, self.p_fail = rng, p_fail

    def run_ubatch(self, plan):
        if self.rng.random() < self.p_fail:
            raise _Fail("engine failure")


def _decode(c, eng, cfg, seqs, lengths, mode, n_ubatch):
    batch = Batch.from_lengths(lengths, seqs, start_pos=c.next_positions(seqs))
    try:
        driver.decode(c, batch, n_ubatch, mode, eng, cfg)
        return True
    except driver.BatchError as e:
        assert isinstance(e.__cause__, _Fail), repr(e.__cause__)
    except (KVCacheFullError, ValueError):
        s = seqs[0]   # full: drop the oldest half of a sequence
        c.seq_rm(s, 0, max(c.seq_pos_max(s) // 2, 1))
    return False


def _run(rng, unified, n_seq, n_ctx, cfg, steps):
    c = KVCache(n_ctx, n_seq, unified=unified, n_head_kv=1, head_dim_k=4)
    eng = _Engine(rng, 0.04)
    active = list(range(n_seq))
    for _ in range(steps):
        r = rng.random()
        if r < 0.03:
            c.seq_rm(int(rng.integers(-1, n_seq)))
        elif r < 0.06:
            s = int(rng.integers(0, n_seq))
            c.seq_rm(s, int(max(c.seq_pos_max(s) - rng.integers(0, 6), 0)), -1)
        elif r < 0.08 and n_seq > 1:   # copy, then both go on (they diverge)
            src, dst = (int(x) for x in rng.choice(n_seq, 2, replace=False))
            c.seq_rm(dst)
            c.seq_cp(src, dst)
        elif r < 0.09:
            c.seq_keep(int(rng.integers(0, n_seq)))
        elif r < 0.11:
            c.seq_add(int(rng.integers(0, n_seq)), 0, -1, int(rng.integers(-4, 5)))
        elif r < 0.14:
            k = int(rng.integers(1, n_seq + 1))
            active = sorted(int(x) for x in rng.choice(n_seq, k, replace=False))
        elif r < 0.18:   # a prompt chunk
            _decode(c, eng, cfg, active, [int(x) for x in rng.integers(1, 20, len(active))],
                    str(rng.choice(["simple", "padded"] if unified else ["equal", "padded"])), 64)
        else:            # a decode step of the active sequences
            _decode(c, eng, cfg, active, [1] * len(active), "simple" if unified else "equal", 512)
    return c


@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stepped_masks_equal_plain_masks_over_random_runs(monkeypatch, unified, seed):
    checks = Checked(monkeypatch)
    cfg = AttnConfig(n_layer=1, n_head=2, n_head_kv=1, head_dim_k=4)
    rng = np.random.default_rng([seed, unified])
    for n_seq, n_ctx in ((1, 256), (4, 512), (7, 1024), (16, 2048)):
        _run(rng, unified, n_seq, n_ctx, cfg, 250)
    assert checks.n_masks > 500
    assert checks.n_stepped > checks.n_masks // 6, (checks.n_stepped, checks.n_masks)


@pytest.mark.parametrize("n_swa,max_bias", [(5, 0.0), (0, 1.0), (7, 1.0)])
def test_swa_and_alibi_masks_are_never_stepped(monkeypatch, n_swa, max_bias):
    checks = Checked(monkeypatch)
    cfg = AttnConfig(n_layer=1, n_head=2, n_head_kv=1, head_dim_k=4, n_swa=n_swa, max_bias=max_bias)
    rng = np.random.default_rng(n_swa)
    for unified in (True, False):
        _run(rng, unified, 4, 512, cfg, 200)
    assert checks.n_masks > 100 and checks.n_stepped == 0


def _ub(seqs, positions, pad=None):
    n = len(seqs)
    idx = np.arange(n, dtype=np.int64)
    if pad:
        idx[np.asarray(pad)] = -1
    return UBatch("simple", idx, np.asarray(positions, dtype=np.int32), tuple((s,) for s in seqs), n, False)


@pytest.mark.parametrize("seed", range(6))
def test_hand_placed_rows_jumping_back_and_forth(monkeypatch, seed):
    """Rows of the same sequences at positions that mostly move forward a little, now and then
    skip ahead past the sequence's own cells or go back; pads; cells removed; explicit n_kv
    below and above the used range; masks of F16 and F32."""
    stepped = []
    next_step = mask_step.next_step
    monkeypatch.setattr(mask_step, "next_step", lambda *a: stepped.append(next_step(*a)) or stepped[-1])
    rng = np.random.default_rng(seed)
    n_seq = int(rng.integers(1, 6))
    c = KVCache(1024, n_seq, unified=True, n_head_kv=1, head_dim_k=4)
    rows, pos = [0], np.zeros(1, np.int64)
    for step in range(400):
        if rng.random() < 0.08:   # rows of distinct sequences, mostly
            rows = ([int(x) for x in rng.integers(0, n_seq, int(rng.integers(1, 9)))] if rng.random() < 0.5
                    else [int(x) for x in rng.permutation(n_seq)[:int(rng.integers(1, n_seq + 1))]])
            pos = rng.integers(0, 60, len(rows))
        elif rng.random() < 0.1:  # skip ahead (some rows)
            pos = pos + rng.integers(0, 30, len(rows)) * (rng.random(len(rows)) < 0.5)
        elif rng.random() < 0.05:  # go back; mostly with the sequences' later cells removed
            pos = rng.integers(0, 60, len(rows))
            if rng.random() < 0.7:
                for s_, p_ in zip(rows, pos.tolist()):
                    c.seq_rm(s_, p_, -1)
        else:
            pos = pos + rng.integers(0, 3, len(rows))
        if rng.random() < 0.05:
            c.seq_rm(int(rng.integers(0, n_seq)), int(rng.integers(0, 40)), -1)
        pad = [i for i in range(len(rows)) if rng.random() < 0.05]
        ub = _ub(rows, pos, pad)
        try:
            slot = c.place(ub)
        except KVCacheFullError:
            c.seq_rm(-1)
            continue
        if rng.random() < 0.8:   # what the driver's batch checks leave remembered (mask_step.remember)
            for s_ in rows:
                c.seq_pos_max(s_)
        n_kv = [None, None, None, 256, 768][int(rng.integers(0, 5))]
        dtype = np.float32 if rng.random() < 0.1 else np.float16
        mask, vis = mask_mod.build_mask(c, ub, slot, n_kv, dtype=dtype, return_visible=True)
        want_mask, want_vis = plain(c, ub, slot, n_kv if n_kv is not None else c.n_kv(slot), dtype=dtype)
        assert same_bits(mask, want_mask), step
        assert np.array_equal(vis, want_vis), step
        c.free_pads(slot)
    n = sum(x is not None for x in stepped)
    assert 30 < n < len(stepped) - 20, (n, len(stepped))


def test_a_cell_placed_by_a_stepped_mask_turns_visible_later():
    """Two rows of one sequence: the later row's cell is invisible to the earlier row; when that
    row then skips ahead past it, the cell turns visible (the step must notice: it is no
    changed cell any more)."""
    c = KVCache(512, 2, unified=True, n_head_kv=1, head_dim_k=4)
    stepped = []
    next_step = mask_step.next_step
    for rows, pos in (([0, 0], [0, 0]), ([0, 0], [1, 1]), ([0, 0], [2, 9]), ([0, 0], [12, 13])):
        ub = _ub(rows, pos)
        slot = c.place(ub)
        c.seq_pos_max(0)
        stepped.append(next_step(c, ub, slot, c.n_kv(slot), np.dtype(np.float16)) is not None)
        mask_step.forget(c) if not stepped[-1] else None
        mask, vis = mask_mod.build_mask(c, ub, slot, return_visible=True) if not stepped[-1] else \
            (mask_step._STATE[c].mask, mask_step._STATE[c].vis)
        want_mask, want_vis = plain(c, ub, slot, c.n_kv(slot))
        assert same_bits(mask, want_mask) and np.array_equal(vis, want_vis), (rows, pos)
    assert stepped == [False, True, True, False]


def test_stepping_a_decode_loop_and_read_only_arrays():
    """A plain decode loop of the same sequences steps every mask after the first; the masks
    handed out are read-only (they are the next step's starting point)."""
    c = KVCache(2048, 8, unified=True, n_head_kv=1, head_dim_k=4)
    cfg = AttnConfig(n_layer=1, n_head=2, n_head_kv=1, head_dim_k=4)
    seen = []

    class Eng:
        def run_ubatch(self, plan):
            seen.append(plan)

    seqs = list(range(8))
    driver.decode(c, Batch.from_lengths([5, 9, 1, 30, 2, 7, 7, 3], seqs), 512, "simple", Eng(), cfg)
    calls = []
    next_step = mask_step.next_step

    def counted(*a):
        got = next_step(*a)
        calls.append(got is not None)
        return got

    mask_step.next_step = counted
    try:
        for _ in range(40):
            driver.decode(c, Batch.from_lengths([1] * 8, seqs, start_pos=c.next_positions(seqs)), 512, "simple",
                          Eng(), cfg)
    finally:
        mask_step.next_step = next_step
    assert len(calls) == 40 and all(calls[1:])   # (the first step follows the prompt's rows)
    for p in seen[-40:]:
        assert not p.mask.flags.writeable and not p.visible.flags.writeable
        with pytest.raises(ValueError):
            p.mask[...] = 0


def test_cell_change_log():
    log = kv_changes.CellChanges()
    m0 = log.mark()
    log.add(0, np.array([3, 4]))
    log.add(1, np.array([True, False, True]))
    log.add(0, np.zeros(0, np.int64))
    got = log.since(m0)
    assert [(st, c.tolist()) for st, c in got] == [(0, [3, 4]), (1, [0, 2])]
    m1 = log.mark()
    assert log.since(m1) == []
    log.add(0, np.arange(kv_changes.LOG_CELLS + 1))
    assert log.since(m0) is None and log.since(m1) is None
    log.reset()
    m2 = log.mark()
    log.add(2, [7])
    assert [(st, c.tolist()) for st, c in log.since(m2)] == [(2, [7])]


def test_restore_and_rollback_are_logged():
    c = KVCache(512, 2, unified=True, n_head_kv=1, head_dim_k=4)
    ub = _ub([0, 1], [0, 0])
    c.place(ub)
    m = c.changes.mark()
    snap = c._snapshot()
    c._restore(snap)
    assert c.changes.since(m) is None
    m = c.changes.mark()
    with pytest.raises(RuntimeError):
        with c.transaction():
            c.place(_ub([0, 1], [1, 1]))
            m = c.changes.mark()  # a reader that looked after the change
            raise RuntimeError
    cells = np.unique(np.concatenate([x for _, x in c.changes.since(m)]))
    assert cells.tolist() == [2, 3]
