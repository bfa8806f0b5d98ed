"""The decode step's host fast paths give what the plain computations give.

``KVCache`` remembers its whole-stream query answers until the cells change and searches free
cells from the head first; masks and tile maps are built for all streams at once; one-token
batches are split without the splitters' machinery. Here every answer is checked against the
straightforward computation (the code these replaced, kept below as the reference) on the cache
as it is at that moment, over long random runs: several sequences, unified and split KV,
every split mode, prompts and decode steps, sequence removal / copy / keep / shift, a cache
that fills up and wraps, sliding windows, ALiBi, pads, and ubatches that fail and roll back.
"""
import numpy as np
import pytest

from ggml_attn.graph import Batch, KVCache, KVCacheFullError, split_ubatches
from ggml_attn.graph import driver
from ggml_attn.graph import kv_cache as kv_mod
from ggml_attn.graph import mask as mask_mod
from ggml_attn.graph import plan as plan_mod
from ggml_attn.graph import split as split_mod
from ggml_attn.graph.kv_cache import SlotInfo
from ggml_attn.graph.kv_cells import KVCells
from ggml_attn.graph.attn_config import AttnConfig


# ------------------------------------------------------------------ the references
def ref_visible_cells(cache, ub, slot, n_kv, *, causal=True, n_swa=0):
    n_stream = slot.n_stream
    n_tps = ub.n_tokens // n_stream
    prim = ub.primary_seq_ids.reshape(n_stream, n_tps)
    prow = ub.positions.astype(np.int64).reshape(n_stream, n_tps)
    pad_row = ub.is_pad.reshape(n_stream, n_tps)
    out = np.zeros((n_stream, n_tps, n_kv), dtype=bool)
    for j, st in enumerate(slot.streams):
        pos_c = cache.pos[st, :n_kv].astype(np.int64)
        ok_c = (pos_c >= 0) & ~cache.pad[st, :n_kv]
        same_seq = cache.seqs[st, :n_kv][:, prim[j]].T
        vis = ok_c[None, :] & same_seq & ~pad_row[j][:, None]
        if causal:
            vis &= pos_c[None, :] <= prow[j][:, None]
        if n_swa > 0:
            vis &= (prow[j][:, None] - pos_c[None, :]) < n_swa
        out[j] = vis
    return out


def ref_build_mask(cache, ub, slot, n_kv, *, causal=True, n_swa=0, alibi=False, dtype=np.float16):
    vis = ref_visible_cells(cache, ub, slot, n_kv, causal=causal, n_swa=n_swa)
    if alibi:
        n_stream, n_tps = vis.shape[:2]
        prow = ub.positions.astype(np.float64).reshape(n_stream, n_tps)
        pos_c = np.stack([cache.pos[st, :n_kv] for st in slot.streams]).astype(np.float64)
        val = -np.abs(pos_c[:, None, :] - prow[:, :, None])
    else:
        val = 0.0
    return np.where(vis, val, -np.inf).astype(dtype)[:, None, :, :]


def ref_tile_map(visible, q_tile=plan_mod.MAP_Q_TILE, kv_tile=plan_mod.MAP_KV_TILE):
    ns, nq, nk = visible.shape
    tq, tk = -(-nq // q_tile), -(-nk // kv_tile)
    padded = np.zeros((ns, tq * q_tile, tk * kv_tile), dtype=bool)
    padded[:, :nq, :nk] = visible
    return padded.reshape(ns, tq, q_tile, tk, kv_tile).any(axis=(2, 4))


def ref_find_slot(cache, ub):
    streams, cells = [], []
    for st, rows in cache._ubatch_streams_of(ub):
        n = rows.shape[0]
        head = cache.head[st]
        if head > int(np.count_nonzero(cache.pos[st] >= 0)) + 2 * n:
            head = 0
        empty = np.flatnonzero(cache.pos[st] < 0)
        k = int(np.searchsorted(empty, head))
        free = np.concatenate((empty[k:], empty[:k]))
        if free.shape[0] < n:
            raise KVCacheFullError("full")
        streams.append(st)
        cells.append(free[:n].astype(np.int64))
    return SlotInfo(tuple(streams), tuple(cells))


def ref_seq_pos(cache, seq_id, largest):
    st = cache.seq_to_stream(seq_id)
    cells = np.flatnonzero(cache.seqs[st, :, seq_id] & ~cache.pad[st])
    if not cells.size:
        return -1
    p = cache.pos[st, cells]
    return int(p.max() if largest else p.min())


def ref_used_max_p1(cache, st):
    occ = np.flatnonzero(cache.pos[st] >= 0)
    return int(occ[-1]) + 1 if occ.size else 0


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
        np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


def same_slot(a, b):
    return a.streams == b.streams and len(a.cells) == len(b.cells) and all(
        x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a.cells, b.cells))


# ------------------------------------------------------------------ checked cache
class Checks:
    """Wraps the cache's queries and the plan's mask / tile map so that every answer given
    during a run is compared with the reference on the cache as it is then."""

    def __init__(self, monkeypatch):
        self.n = {"find_slot": 0, "seq_pos": 0, "used_max_p1": 0, "n_used": 0, "mask": 0, "tiles": 0}
        find_slot, seq_pos = KVCache.find_slot, KVCache._seq_pos
        used_max_p1, n_used = KVCache.used_max_p1, KVCells.n_used   # (the slot search asks the cells)
        build_mask, tile_map = plan_mod.build_mask, plan_mod.tile_map
        checks = self

        def find_slot_checked(cache, ub):
            try:
                want = ref_find_slot(cache, ub)
            except KVCacheFullError:
                with pytest.raises(KVCacheFullError):
                    find_slot(cache, ub)
                raise
            got = find_slot(cache, ub)
            assert same_slot(got, want), (got, want)
            checks.n["find_slot"] += 1
            return got

        def seq_pos_checked(cache, seq_id, largest):
            got = seq_pos(cache, seq_id, largest)
            assert got == ref_seq_pos(cache, seq_id, largest)
            checks.n["seq_pos"] += 1
            return got

        def used_checked(cache, st):
            got = used_max_p1(cache, st)
            assert got == ref_used_max_p1(cache, st)
            checks.n["used_max_p1"] += 1
            return got

        def n_used_checked(cells, st):
            got = n_used(cells, st)
            assert got == int(np.count_nonzero(cells.pos[st] >= 0))
            checks.n["n_used"] += 1
            return got

        def mask_checked(cache, ub, slot, n_kv=None, return_visible=False, **kw):
            got = build_mask(cache, ub, slot, n_kv, return_visible=return_visible, **kw)
            n_kv = n_kv if n_kv is not None else cache.n_kv(slot)
            want = ref_build_mask(cache, ub, slot, n_kv, **kw)
            if return_visible:
                got, vis = got
                assert np.array_equal(vis, ref_visible_cells(cache, ub, slot, n_kv, causal=kw.get("causal", True),
                                                             n_swa=kw.get("n_swa", 0)))
                got_all = (got, vis)
            else:
                got_all = got
            assert same_bits(got, want)
            checks.n["mask"] += 1
            return got_all

        def tiles_checked(visible, q_tile=plan_mod.MAP_Q_TILE, kv_tile=plan_mod.MAP_KV_TILE):
            got = tile_map(visible, q_tile, kv_tile)
            assert np.array_equal(got.live, ref_tile_map(visible, q_tile, kv_tile))
            assert got.live.dtype == bool
            checks.n["tiles"] += 1
            return got

        monkeypatch.setattr(KVCache, "find_slot", find_slot_checked)
        monkeypatch.setattr(KVCache, "_seq_pos", seq_pos_checked)
        monkeypatch.setattr(KVCache, "used_max_p1", used_checked)
        monkeypatch.setattr(KVCells, "n_used", n_used_checked)
        monkeypatch.setattr(plan_mod, "build_mask", mask_checked)
        monkeypatch.setattr(plan_mod, "tile_map", tiles_checked)


class _EngineFailure(RuntimeError):
    pass


class _Engine:
    """Computes nothing; fails now and then (the ubatch must roll back)."""

    def __init__(self, rng, p_fail):
        self.rng, self.p_fail = rng, p_fail

    def run_ubatch(self, plan):
        plan.tiles   # (built on first use: checked against the reference by Checks)
        if self.rng.random() < self.p_fail:
            raise _EngineFailure("engine failure")


def _random_run(rng, unified, n_seq, n_ctx, cfg, steps):
    c = KVCache(n_ctx, n_seq, unified=unified, n_head_kv=1, head_dim_k=4)
    eng = _Engine(rng, 0.05)
    modes = ("simple", "equal", "seq", "padded", "auto") if unified else ("equal", "seq", "padded", "auto")
    done = 0
    for _ in range(steps):
        r = rng.random()
        if r < 0.08:
            c.seq_rm(int(rng.integers(-1, n_seq)))
        elif r < 0.14:
            s = int(rng.integers(0, n_seq))
            c.seq_rm(s, int(max(c.seq_pos_max(s) - rng.integers(0, 6), 0)), -1)
        elif r < 0.18 and n_seq > 1:
            src, dst = (int(x) for x in rng.choice(n_seq, 2, replace=False))
            c.seq_rm(dst)
            c.seq_cp(src, dst)
        elif r < 0.20:
            c.seq_keep(int(rng.integers(0, n_seq)))
        elif r < 0.23:
            s = int(rng.integers(0, n_seq))
            c.seq_add(s, 0, -1, int(rng.integers(-4, 5)))
        else:
            k = int(rng.integers(1, n_seq + 1))
            seqs = sorted(int(x) for x in rng.choice(n_seq, k, replace=False))
            lengths = [1] * k if rng.random() < 0.7 else [int(x) for x in rng.integers(1, 20, k)]
            batch = Batch.from_lengths(lengths, seqs, start_pos=c.next_positions(seqs))
            mode = modes[int(rng.integers(0, len(modes)))]
            try:
                driver.decode(c, batch, int(rng.choice([1, 4, 64])), mode, eng, cfg)
                done += 1
            except driver.BatchError as e:  # only the engine may fail a ubatch here
                assert isinstance(e.__cause__, _EngineFailure), repr(e.__cause__)
            except (KVCacheFullError, ValueError):  # no room, or a split that does not fit the cache
                pass
    return done


@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize("n_swa,max_bias", [(0, 0.0), (5, 0.0), (0, 1.0), (7, 1.0)])
def test_fast_paths_match_the_reference_over_random_runs(monkeypatch, unified, n_swa, max_bias):
    checks = Checks(monkeypatch)
    cfg = AttnConfig(n_layer=1, n_head=2, n_head_kv=1, head_dim_k=4, n_swa=n_swa, max_bias=max_bias)
    rng = np.random.default_rng(hash((unified, n_swa, max_bias)) % 2**32)
    done = 0
    for n_seq, n_ctx in ((1, 256), (3, 512), (4, 1024)):
        done += _random_run(rng, unified, n_seq, n_ctx, cfg, 150)
    assert done > 100
    assert min(checks.n.values()) > 50, checks.n


def test_decode_steps_through_a_full_and_wrapping_cache(monkeypatch):
    """One sequence stepping through a 256-cell cache, its oldest cells dropped now and then:
    the free cells are found after the head, then again from cell 0."""
    checks = Checks(monkeypatch)
    cfg = AttnConfig(n_layer=1, n_head=2, n_head_kv=1, head_dim_k=4, n_swa=32)
    for unified in (True, False):
        c = KVCache(256, 2, unified=unified, n_head_kv=1, head_dim_k=4)
        eng = _Engine(np.random.default_rng(0), 0.0)
        full = 0
        for step in range(700):
            for s in (0, 1):
                b = Batch.from_lengths([1], [s], start_pos=c.next_positions([s]))
                try:
                    driver.decode(c, b, 512, "equal", eng, cfg)
                except (KVCacheFullError, ValueError):
                    full += 1
                    c.seq_rm(s, 0, c.seq_pos_max(s) - 40)
        assert full > 0
    assert checks.n["find_slot"] > 1000


def test_query_answers_forget_every_change():
    """Every way the cells change (and a rolled-back transaction) is seen by the next query."""
    c = KVCache(512, 2, unified=True, n_head_kv=1, head_dim_k=4)

    def check():
        for s in (0, 1):
            assert c.seq_pos_max(s) == ref_seq_pos(c, s, True)
            assert c.seq_pos_min(s) == ref_seq_pos(c, s, False)
        assert c.used_max_p1(0) == ref_used_max_p1(c, 0)
        assert c.n_used(0) == int(np.count_nonzero(c.pos[0] >= 0))

    ub = split_ubatches(Batch.from_lengths([10, 4], [0, 1]), 512, "simple")[0]
    check()
    slot = c.place(ub)
    check()
    c.seq_add(0, 2, -1, 3)
    check()
    c.seq_cp(0, 1, 0, 5)
    check()
    c.seq_rm(1, 3, -1)
    check()
    c.seq_keep(0)
    check()
    snap = c._snapshot()
    c.seq_rm(-1)
    check()
    c._restore(snap)
    check()
    with pytest.raises(RuntimeError):
        with c.transaction():
            c.seq_rm(0)
            check()
            raise RuntimeError("undo")
    check()
    ub2 = split_ubatches(Batch.from_lengths([3], [1], start_pos=c.next_positions([1])), 512, "simple")[0]
    slot2 = c.find_slot(ub2)
    assert same_slot(slot2, ref_find_slot(c, ub2))
    c.head = [0]   # a new head list (Runner.clear): searched again
    assert same_slot(c.find_slot(ub2), ref_find_slot(c, ub2))
    c.head[0] = 7  # changed in place
    assert same_slot(c.find_slot(ub2), ref_find_slot(c, ub2))
    c.free_pads(slot)
    check()


def test_query_answers_carried_through_a_fill():
    """A small ubatch into empty cells updates the remembered answers instead of forgetting
    them; pad rows (in no sequence's range) and occupied target cells included."""
    for unified in (True, False):
        c = KVCache(512, 3, unified=unified, n_head_kv=1, head_dim_k=4)

        def warm_and_check():
            for s in range(3):
                assert c.seq_pos_max(s) == ref_seq_pos(c, s, True)
                assert c.seq_pos_min(s) == ref_seq_pos(c, s, False)
            for st in range(c.n_stream):
                assert c.used_max_p1(st) == ref_used_max_p1(c, st)
                assert c.n_used(st) == int(np.count_nonzero(c.pos[st] >= 0))

        warm_and_check()
        for lengths in ([3, 1, 2], [1, 1, 1], [2, 2, 5], [1, 1, 1]):
            b = Batch.from_lengths(lengths, [0, 1, 2], start_pos=c.next_positions([0, 1, 2]))
            for ub in split_ubatches(b, 6, "padded"):
                warm_and_check()
                slot = c.place(ub)
                warm_and_check()   # pads still in place
                c.free_pads(slot)
                warm_and_check()
        # a slot over occupied cells (not what find_slot gives): answers asked again
        ub = split_ubatches(Batch.from_lengths([1], [0], start_pos=c.next_positions([0])), 4, "equal")[0]
        slot = c.find_slot(ub)
        occupied = SlotInfo(slot.streams, (np.array([0], dtype=np.int64),))
        warm_and_check()
        c.apply_ubatch(occupied, ub)
        warm_and_check()


def test_sequence_positions_survive_freed_pads_and_other_sequences_removal():
    """Freeing a ubatch's pad cells (in no sequence's range) keeps every remembered sequence
    position, and removing one sequence keeps the others' (a server's step after step: no scan
    of every sequence's cells for the next positions); each kept answer equals a fresh one."""
    c = KVCache(1024, 4, unified=True, n_head_kv=1, head_dim_k=4, coarse_n_kv=True)
    b = Batch.from_lengths([5, 3, 7, 2], [0, 1, 2, 3])
    for ub in split_ubatches(b, 64, "simple"):
        c.free_pads(c.place(ub))
    step = Batch(np.array([1, 2, 3], dtype=np.int32), np.array([c.next_positions([s])[s] for s in (0, 2, 3)], dtype=np.int32),
                 ((0,), (2,), (3,)))
    ub = split_mod.pad_to_bucket(split_ubatches(step, 64, "simple")[0], 4, lambda s: c.seq_pos_max(s) + 1, 64)
    assert ub.n_pad == 1
    slot = c.place(ub)
    c.next_positions(range(4))   # (remembered)
    c.free_pads(slot)
    assert {("seq_pos", s, True) for s in range(4)} <= set(c.cells.memo)
    c.seq_rm(1)
    assert {("seq_pos", s, True) for s in (0, 2, 3)} <= set(c.cells.memo) and ("seq_pos", 1, True) not in c.cells.memo
    kept = {s: c.seq_pos_max(s) for s in range(4)}
    assert kept == {s: ref_seq_pos(c, s, True) for s in range(4)} == {0: 5, 1: -1, 2: 7, 3: 2}


def test_query_answers_carried_through_large_fills():
    """Decode steps of many sequences (more rows than the per-cell Python path handles) and
    prompts up to and past the update limit into empty cells: the remembered answers after each
    fill equal fresh ones, and a decode step's next positions come from them."""
    from ggml_attn.graph import kv_cells as kvc
    n_seq = 40
    for unified in (True, False):
        c = KVCache(16384, n_seq, unified=unified, n_head_kv=1, head_dim_k=4)
        seqs = list(range(n_seq))

        def warm_and_check():
            for s in seqs:
                assert c.seq_pos_max(s) == ref_seq_pos(c, s, True)
                assert c.seq_pos_min(s) == ref_seq_pos(c, s, False)
            for st in range(c.n_stream):
                assert c.used_max_p1(st) == ref_used_max_p1(c, st)
                assert c.n_used(st) == int(np.count_nonzero(c.pos[st] >= 0))

        rng = np.random.default_rng(3)
        lengths = [int(x) for x in rng.integers(1, 20, n_seq)]
        big = [kvc._FILL_UPDATE_MAX + 9] + [1] * (n_seq - 1)   # one ubatch past the limit (unified)
        for lens in (lengths, [1] * n_seq, big, [1] * n_seq, [1] * n_seq):
            b = Batch.from_lengths(lens, seqs, start_pos=c.next_positions(seqs))
            for ub in split_ubatches(b, 512, "simple" if unified else "equal"):
                warm_and_check()
                slot = c.place(ub)
                warm_and_check()
                c.free_pads(slot)
                warm_and_check()
        # a large ubatch over occupied cells (not what find_slot gives): answers asked again
        b = Batch.from_lengths([24], [0], start_pos=c.next_positions([0]))
        ub = split_ubatches(b, 512, "simple" if unified else "equal")[0]
        slot = c.find_slot(ub)
        st = slot.streams[0]
        occupied = SlotInfo(slot.streams, (np.flatnonzero(c.pos[st] >= 0)[-24:].astype(np.int64),))
        warm_and_check()
        c.apply_ubatch(occupied, ub)
        warm_and_check()


def test_tile_map_odd_sizes():
    rng = np.random.default_rng(3)
    for shape in ((1, 1, 1), (2, 1, 300), (3, 70, 256), (1, 64, 512), (2, 129, 513), (1, 0, 256), (1, 5, 0)):
        vis = rng.random(shape) < 0.01
        for q_tile, kv_tile in ((64, 256), (16, 32), (1, 1), (7, 5)):
            got = plan_mod.tile_map(vis, q_tile, kv_tile).live
            assert got.dtype == bool and np.array_equal(got, ref_tile_map(vis, q_tile, kv_tile)), shape


@pytest.mark.parametrize("unified", [True, False])
def test_mask_dtypes_and_no_causal(unified):
    c = KVCache(1024, 3, unified=unified, n_head_kv=1, head_dim_k=4)
    for lengths, seqs in (([5, 3, 9], [0, 1, 2]), ([1, 1, 1], [0, 1, 2]), ([7], [1]), ([1], [2]), ([20, 20], [0, 1])):
        b = Batch.from_lengths(lengths, seqs, start_pos=c.next_positions(seqs))
        for mode in ("padded", "equal", "seq"):
            for ub in split_ubatches(b, 4, mode):
                with pytest.raises(KeyError), c.transaction():  # cells put back: the next mode places them again
                    slot = c.place(ub)
                    n_kv = c.n_kv(slot)
                    for kw in ({}, {"causal": False}, {"dtype": np.float32}, {"alibi": True, "n_swa": 2},
                               {"dtype": np.float32, "alibi": True}, {"causal": False, "n_swa": 3},
                               {"dtype": np.float64}, {"n_kv": min(c.kv_size, n_kv + 256)}):
                        kw = dict(kw)
                        nk = kw.pop("n_kv", n_kv)
                        assert same_bits(mask_mod.build_mask(c, ub, slot, nk, **kw),
                                         ref_build_mask(c, ub, slot, nk, **kw)), (lengths, mode, kw)
                    raise KeyError
        for ub in split_ubatches(b, 4, "equal"):
            c.free_pads(c.place(ub))


def _ubatch_fields(ub):
    return (ub.mode, ub.token_idx.dtype, ub.token_idx.tolist(), ub.positions.dtype, ub.positions.tolist(),
            ub.token_seq_ids, ub.n_seqs, ub.equal_seqs, ub.reason)


@pytest.mark.parametrize("mode", ["simple", "equal", "seq", "padded"])
def test_one_token_split_is_the_splitters_split(mode):
    """A one-token batch skips the splitters; they would make the same ubatch (or refuse it)."""
    for seq_ids in ((0,), (3,), (2, 0), (1, 5, 4)):
        for pos in (0, 7, 2**31 - 1):
            b = Batch(np.array([pos % 32000]), np.array([pos]), (seq_ids,))
            for n_ubatch in (1, 512):
                try:
                    want = split_mod._split_all(b, n_ubatch, mode)
                except ValueError as e:
                    with pytest.raises(ValueError, match=str(e)[:30]):
                        split_mod.split_ubatches(b, n_ubatch, mode)
                    continue
                got = split_mod.split_ubatches(b, n_ubatch, mode)
                assert [_ubatch_fields(u) for u in got] == [_ubatch_fields(u) for u in want]


def ref_int32_array(values, name, lo=0, hi=2**31 - 1):
    from ggml_attn.graph.batch import as_int
    a = np.asarray(values)
    if a.dtype == object:
        return np.array([as_int(x, f"{name}[{i}]", lo, hi) for i, x in enumerate(a.reshape(-1))], dtype=np.int32)
    a = a.reshape(-1)
    if a.dtype == bool or a.dtype.kind not in "iuf":
        raise ValueError(f"{name} must be integers, got dtype {a.dtype}")
    if a.dtype.kind == "f":
        bad = ~np.isfinite(a) | (np.floor(a) != a)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"{name}[{i}] = {a[i]!r} is not an integer")
    out_of = (a < lo) | (a > hi)
    if out_of.any():
        i = int(np.argmax(out_of))
        v = int(a[i]) if a.dtype.kind != "f" else a[i]
        raise ValueError(f"{name}[{i}] = {v} is outside [{lo}, {hi}] (int32, as llama.cpp)")
    return a.astype(np.int32)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (a float32 cast at the int32 edge, both versions)
def test_int32_array_small_inputs_as_before():
    from ggml_attn.graph.batch import int32_array
    cases = [[], [0], [5], [-1], [2**31 - 1], [2**31], [3, -2, 7], [[1, 2], [3, 4]], list(range(16)),
             list(range(-1, 16)), [2**63 - 1], [1.0, 2.0], [1.5], [True], ["a"], [2**70]]
    dtypes = [None, np.int8, np.int32, np.int64, np.uint32, np.uint64, np.float32]
    for vals in cases:
        for dt in dtypes:
            for lo, hi in ((0, 2**31 - 1), (1, 10), (-5, 5)):
                try:
                    a = np.array(vals, dtype=dt)
                except (ValueError, OverflowError, TypeError):
                    continue
                try:
                    want = ref_int32_array(a, "x", lo, hi)
                except ValueError as e:
                    with pytest.raises(ValueError) as got:
                        int32_array(a, "x", lo, hi)
                    assert str(got.value) == str(e)
                    continue
                got = int32_array(a, "x", lo, hi)
                assert got.dtype == want.dtype and np.array_equal(got, want)
    with pytest.raises(ValueError, match="negative position"):
        Batch(np.array([1, 2]), np.array([4, -3]), ((0,), (0,)))


def test_batch_constructors_as_through_post_init():
    """from_sequences / from_lengths skip __post_init__'s checks of what they built; the batch
    (or the error) is the one the checked constructor gives."""
    class Checked(Batch):  # a subclass takes the checked path
        pass

    def fields(b):
        return (b.tokens.dtype, b.tokens.tolist(), b.tokens.flags.writeable, b.positions.dtype,
                b.positions.tolist(), b.positions.flags.writeable, b.seq_ids,
                [type(s) for ids in b.seq_ids for s in ids])

    rng = np.random.default_rng(9)
    for _ in range(200):
        k = int(rng.integers(1, 5))
        ids = [int(x) for x in rng.choice(8, k, replace=False)]
        lengths = [int(x) for x in rng.integers(1, 6, k)]
        start = [int(x) for x in rng.integers(0, 2**31 - 6, k)] if rng.random() < 0.5 else None
        assert fields(Batch.from_lengths(lengths, ids, start)) == fields(Checked.from_lengths(lengths, ids, start))
        toks = [[int(x) for x in rng.integers(0, 1000, n)] for n in lengths]
        assert fields(Batch.from_sequences(toks, ids, start)) == fields(Checked.from_sequences(toks, ids, start))
        assert fields(Batch.from_sequences(toks)) == fields(Checked.from_sequences(toks))
    for bad in ([[1, -2]], [[2**31]], [[1.5]], [["a"]], [[True]]):
        with pytest.raises(ValueError) as want:
            Checked.from_sequences(bad)
        with pytest.raises(ValueError) as got:
            Batch.from_sequences(bad)
        assert str(got.value) == str(want.value)
    # argument errors: the message of the check that comes first
    for args, kw in ((([], []), {}), (([1, 1], [0, 0]), {"start_pos": [0]}), (([1, 1], [0, 0]), {}),
                     (([1], [0]), {"start_pos": 2**31 - 1}), (([2], [0]), {"start_pos": 2**31 - 1}),
                     (([0], [0]), {}), (([1], [-1]), {}), (([1, 2], [0]), {}), (([1], [0]), {"start_pos": [-1]})):
        outcomes = []
        for cls in (Checked, Batch):
            try:
                outcomes.append(fields(cls.from_lengths(*args, **kw)))
            except ValueError as e:
                outcomes.append(str(e))
        assert outcomes[0] == outcomes[1], (args, kw, outcomes)


def ref_ubatch_streams(cache, ub):
    for ids in ub.token_seq_ids:
        for s in ids:
            cache._check_seq(s)
    if cache.unified:
        return [(0, np.arange(ub.n_tokens))]
    seq_unq = ub.seq_ids
    if any(len(ids) > 1 for ids in ub.token_seq_ids):
        raise ValueError("coupled")
    if ub.n_tokens % len(seq_unq):
        raise ValueError("equal")
    if list(seq_unq) != list(range(seq_unq[0], seq_unq[0] + len(seq_unq))):
        raise ValueError("consecutive")
    n_tps = ub.n_tokens // len(seq_unq)
    prim = ub.primary_seq_ids
    out = []
    for j, s in enumerate(seq_unq):
        rows = np.arange(j * n_tps, (j + 1) * n_tps)
        if not np.all(prim[rows] == s):
            raise ValueError("elsewhere")
        out.append((s, rows))
    return out


def test_ubatch_streams_as_before():
    """The stream layout of a ubatch (and whether it is refused) as the per-row checks give it."""
    from ggml_attn.graph.split import UBatch
    rows = [[(0,)], [(3,)], [(2, 1)], [(4,)], [(-1,)], [(np.int64(1),)], [(True,)], [(1.0,)],
            [(0,), (1,)], [(1,), (0,)], [(0,), (2,)], [(0,), (0,), (1,)], [(0,), (1,), (1,), (0,)],
            [(0,), (0,), (1,), (1,)], [(0, 1), (1,)], [(2,)] * 20, [(0,)] * 10 + [(1,)] * 10,
            [(0,)] * 10 + [(1,)] * 9 + [(0,)]]
    for unified in (True, False):
        c = KVCache(1024, 4, unified=unified, n_head_kv=1, head_dim_k=4)
        for sids in rows:
            n = len(sids)
            ub = UBatch("equal", np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int32), tuple(sids), 1, True)
            try:
                want = ref_ubatch_streams(c, ub)
            except ValueError:
                with pytest.raises(ValueError):
                    c._ubatch_streams_of(ub)
                continue
            got = c._ubatch_streams_of(ub)
            assert [(s, r.tolist()) for s, r in got] == [(s, r.tolist()) for s, r in want], (unified, sids)
            assert [type(s) for s, _ in got] == [type(s) for s, _ in want]


def test_remembered_answers_do_not_pile_up():
    """Decode steps keep a handful of remembered answers, not one per ubatch ever planned."""
    cfg = AttnConfig(n_layer=1, n_head=2, n_head_kv=1, head_dim_k=4)
    for unified in (True, False):
        c = KVCache(4096, 2, unified=unified, n_head_kv=1, head_dim_k=4)
        eng = _Engine(np.random.default_rng(0), 0.0)
        for _ in range(300):
            for s in (0, 1):
                driver.decode(c, Batch.from_lengths([1], [s], start_pos=c.next_positions([s])), 512, "equal", eng, cfg)
        assert len(c._memo) <= 8, sorted(c._memo, key=str)


@pytest.mark.parametrize("roomy", [True, False])
def test_auto_runs_the_plans_it_dry_ran_with_bucket_pads(monkeypatch, roomy):
    """On a cache that pads each ubatch to a bucket of rows (``coarse_n_kv``: the CUDA engines'),
    auto costs and dry-runs the padded ubatches, so the plans it chose run as they are: a server's
    mixed step (decode tokens and a prompt) is planned once under auto, as under simple (it was
    dry-run without its pads and planned again with them), into the same ubatch, cells and mask. Where the pads do not fit (``roomy``
    False) auto chooses among the plain splits and the step runs them without pads, still
    planned once."""
    cfg = AttnConfig(n_head=2, n_head_kv=1, head_dim_k=4)
    prompts = [5, 3, 7, 2, 9] if roomy else [50, 50, 50, 50, 14]   # (not roomy: 214 + 42 = 256 cells)

    class NoEngine:
        def run_ubatch(self, plan):
            return None

    def mixed_step(mode):
        c = KVCache(256, 8, unified=True, n_head_kv=1, head_dim_k=4, coarse_n_kv=True)
        driver.decode(c, Batch.from_lengths(prompts, range(5)), 512, "simple", NoEngine(), cfg)
        nxt = c.next_positions(range(5))
        step = Batch.from_sequences([[7]] * 5 + [list(range(37))], list(range(6)),
                                    start_pos=[nxt[s] for s in range(5)] + [0])
        replanned = []
        real = driver.plan_ubatch
        monkeypatch.setattr(driver, "plan_ubatch", lambda *a, **k: replanned.append(1) or real(*a, **k))
        plans = driver.decode(c, step, 512, mode, NoEngine(), cfg)
        monkeypatch.setattr(driver, "plan_ubatch", real)
        return plans, len(replanned), c

    simple, n_simple, c_simple = mixed_step("simple")
    auto, n_auto, c_auto = mixed_step("auto")
    assert n_simple == len(simple) == 1
    assert n_auto == 0    # (not roomy: the plain split's own dry-run plans, its pads not fitting)
    assert [p.ubatch.n_tokens for p in auto] == [p.ubatch.n_tokens for p in simple] == [48 if roomy else 42]
    assert [p.ubatch.n_pad for p in auto] == [p.ubatch.n_pad for p in simple] == [6 if roomy else 0]
    for a, s in zip(auto, simple):
        assert a.n_kv == s.n_kv and np.array_equal(a.mask, s.mask)
        assert all(np.array_equal(x, y) for x, y in zip(a.slot.cells, s.slot.cells))
    assert np.array_equal(c_auto.pos, c_simple.pos) and c_auto.pad.sum() == 0
