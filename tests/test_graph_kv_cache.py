"""KV cache (unified and split) and the ubatch mask."""
import numpy as np
import pytest

from ggml_attn.graph import Batch, KVCache, KVCacheFullError, build_mask, split_ubatches


def place_all(cache, batch, n_ubatch, mode):
    """Place every ubatch (pads freed after each); returns the (ubatch, slot) list."""
    out = []
    for ub in split_ubatches(batch, n_ubatch, mode):
        slot = cache.place(ub)
        out.append((ub, slot))
        cache.free_pads(slot)
    return out


def test_sizes_like_llama_cpp():
    c = KVCache(1000, 4, unified=False, n_head_kv=2, head_dim_k=8)
    assert (c.n_stream, c.kv_size) == (4, 256)  # PAD(PAD(1000,256)/4, 256)
    assert c.k.shape == (1, 4, 256, 16) and c.k.dtype == np.float16
    u = KVCache(1000, 4, unified=True)
    assert (u.n_stream, u.kv_size) == (1, 1024)
    s = KVCache(4096, 3, unified=False)
    assert s.kv_size == 1536  # 4096 // 3 = 1365 -> 1536


def test_bad_sizes():
    with pytest.raises(ValueError, match="positive"):
        KVCache(0, 1)
    with pytest.raises(ValueError, match="float16 or float32"):
        KVCache(256, 1, dtype=np.int8)


def test_slots_and_n_kv_unified():
    c = KVCache(1024, 4, unified=True)
    (ub, slot), = place_all(c, Batch.from_lengths([3, 5]), 512, "simple")
    assert slot.streams == (0,) and slot.cells[0].tolist() == list(range(8))
    assert c.n_kv(slot) == 256
    assert c.seq_pos_max(1) == 4 and c.seq_pos_min(1) == 0 and c.seq_pos_max(2) == -1
    assert c.next_positions([0, 1, 2]) == {0: 3, 1: 5, 2: 0}
    big = Batch.from_lengths([300], seq_ids=[2])
    (ub, slot), = place_all(c, big, 512, "simple")
    assert c.n_kv(slot) == 512


def test_split_streams_consecutive_and_n_kv_is_max_over_streams():
    c = KVCache(4 * 512, 4, unified=False)
    place_all(c, Batch.from_lengths([300], seq_ids=[1]), 512, "equal")
    ub = split_ubatches(Batch.from_lengths([1, 1], seq_ids=[0, 1], start_pos={1: 300}), 8, "equal")[0]
    slot = c.place(ub)
    assert slot.streams == (0, 1)
    assert c.n_kv(slot) == 512  # stream 1 uses 301 cells -> 512, stream 0 only 1
    rows = slot.row_indices(c.kv_size)
    assert rows.tolist() == [0, 512 + 300]


def test_split_refuses_bad_layouts():
    c = KVCache(1024, 4, unified=False)
    ub = split_ubatches(Batch.from_lengths([2, 3]), 512, "simple")[0]
    with pytest.raises(ValueError, match="equal number of rows"):
        c.find_slot(ub)
    ub = split_ubatches(Batch.from_lengths([2, 2]), 512, "simple")[0]
    ub2 = split_ubatches(Batch.from_lengths([1, 1], seq_ids=[0, 2]), 512, "seq")[0]
    c.find_slot(ub)  # rows of seq 0 then seq 1: acceptable
    assert c.find_slot(ub2).streams == (0,)
    bad = split_ubatches(Batch(np.zeros(2), np.array([0, 0]), ((0,), (2,))), 8, "simple")[0]
    with pytest.raises(ValueError, match="consecutive"):
        c.find_slot(bad)


def test_no_room_raises_and_leaves_cache_unchanged():
    c = KVCache(256, 2, unified=True)
    place_all(c, Batch.from_lengths([200]), 512, "simple")
    before = (c.pos.copy(), c.seqs.copy(), list(c.head))
    ubs = split_ubatches(Batch.from_lengths([40, 40], seq_ids=[0, 1], start_pos={0: 200}), 32, "simple")
    with pytest.raises(KVCacheFullError, match="no room"):
        c.prepare(ubs)
    assert np.array_equal(c.pos, before[0]) and np.array_equal(c.seqs, before[1]) and c.head == before[2]
    with pytest.raises(KVCacheFullError, match="stream 0"):
        c.find_slot(split_ubatches(Batch.from_lengths([57], seq_ids=[1]), 512, "simple")[0])
    assert np.array_equal(c.pos, before[0])


def test_prepare_accounts_for_freed_pads():
    # 10 streams of 256 cells; padded 1..10 needs 10 cells per stream during the ubatch only
    c = KVCache(2560, 10, unified=False)
    slots = c.prepare(split_ubatches(Batch.from_lengths(range(1, 11)), 512, "padded"))
    assert len(slots) == 1 and c.pos.max() == -1  # unchanged


@pytest.mark.parametrize("unified", [True, False])
def test_padded_runs_when_only_its_pads_do_not_fit(unified):
    """run_batch with a cache just large enough for the real tokens: the padded ubatch (2x200,
    197 pad rows; or 240 cells of sequence 0 plus 16 rows in its stream) does not fit, the batch
    still goes through (as the equal split, the same outputs), and the reason says so. A batch
    whose real tokens do not fit is still refused."""
    from ggml_attn.graph import AttnConfig, run_batch
    cfg = AttnConfig(n_layer=1, n_head=2, n_head_kv=1, head_dim_k=32)
    if unified:   # 256 cells: 203 real tokens fit, 400 padded rows do not
        first, batch = None, Batch.from_lengths([3, 200])
    else:         # 2 streams of 256: sequence 0 holds 250, gets 3 more (real 253) padded to 16 (266)
        first = Batch.from_lengths([250], seq_ids=[0])
        batch = Batch.from_lengths([3, 16], start_pos={0: 250})

    def cache():
        c = KVCache(256 if unified else 512, 2, unified=unified, n_head_kv=1, head_dim_k=32)
        if first is not None:
            run_batch(c, first, 512, "equal", cfg)
        return c
    c = cache()
    padded = split_ubatches(batch, 512, "padded")
    assert len(padded) == 1 and padded[0].n_pad > 0
    with pytest.raises(KVCacheFullError):
        c.prepare(padded)              # the pads are what does not fit
    got = run_batch(c, batch, 512, "padded", cfg)
    assert sum(p.ubatch.n_pad for p in got.plans) == 0
    assert all("pad rows do not fit" in p.ubatch.reason for p in got.plans)
    assert c.n_used(0) + (c.n_used(1) if not unified else 0) == batch.n_tokens + (250 if first else 0)
    ref = run_batch(cache(), batch, 512, "equal", cfg)
    np.testing.assert_array_equal(got.out, ref.out)
    too_many = Batch.from_lengths([60, 200]) if unified else Batch.from_lengths([7, 16], start_pos={0: 250})
    with pytest.raises(KVCacheFullError):
        run_batch(cache(), too_many, 512, "padded", cfg)


def test_seq_rm_cp_keep_add_unified():
    c = KVCache(256, 3, unified=True)
    place_all(c, Batch.from_lengths([4], seq_ids=[0]), 64, "simple")
    c.seq_cp(0, 1, 0, 2)  # share positions 0, 1
    assert c.seqs[0, :4, 1].tolist() == [True, True, False, False]
    c.seq_rm(0, 1, -1)  # seq 0 keeps position 0 only; cell 1 still has seq 1
    assert c.pos[0, :4].tolist() == [0, 1, -1, -1]
    assert c.seq_pos_max(0) == 0 and c.seq_pos_max(1) == 1
    assert c.head[0] == 2
    c.seq_add(1, 0, -1, 5)
    assert c.seq_pos_min(1) == 5 and c.seq_pos_max(1) == 6
    assert c.pos[0, 0] == 5  # the cell shared by 0 and 1 moved for both (one position per cell)
    c.seq_add(1, -1, -1, -10)  # drops below zero -> freed
    assert c.seq_pos_max(1) == -1 and c.used_max_p1(0) == 0
    place_all(c, Batch.from_lengths([2, 2], seq_ids=[0, 2]), 64, "simple")
    c.seq_keep(2)
    assert c.seq_pos_max(0) == -1 and c.seq_pos_max(2) == 1
    c.seq_rm(-1)
    assert c.used_max_p1(0) == 0


def test_seq_cp_across_streams_copies_data_full_range_only():
    c = KVCache(512, 2, unified=False, head_dim_k=4)
    (ub, slot), = place_all(c, Batch.from_lengths([3], seq_ids=[0]), 64, "equal")
    c.write_rows(0, slot, np.arange(12).reshape(3, 4), -np.arange(12).reshape(3, 4))
    with pytest.raises(ValueError, match="full range"):
        c.seq_cp(0, 1, 0, 2)
    c.seq_cp(0, 1)
    pos, k, v = c.sequence_contents(1)
    assert pos.tolist() == [0, 1, 2] and k.tolist() == np.arange(12).reshape(3, 4).tolist()
    assert np.array_equal(v, -k)


def test_padded_ubatch_pads_masked_then_freed_and_positions_continue():
    c = KVCache(2560, 10, unified=False)
    b = Batch.from_lengths(range(1, 11))
    c.validate(b)
    (ub,) = split_ubatches(b, 512, "padded")
    slot = c.place(ub)
    n_kv = c.n_kv(slot)
    mask = build_mask(c, ub, slot, n_kv)
    assert mask.shape == (10, 1, 10, 256) and mask.dtype == np.float16
    vis = np.isfinite(mask[:, 0])
    for s in range(10):
        n_real = s + 1
        cells = slot.cells[s]
        pad_cells = cells[n_real:]
        # every pad cell is -inf for every query of every stream
        assert not vis[s][:, pad_cells].any()
        # pad query rows are fully masked
        assert not vis[s, n_real:].any()
        # real rows: causal over the real cells of their own sequence
        for i in range(n_real):
            assert np.flatnonzero(vis[s, i]).tolist() == sorted(cells[: i + 1].tolist())
    assert c.free_pads(slot) == 45
    assert c.pad.sum() == 0 and all(c.n_used(s) == s + 1 for s in range(10))
    nxt = c.next_positions(range(10))
    assert nxt == {s: s + 1 for s in range(10)}
    dec = Batch.from_lengths([1] * 10, start_pos=nxt)
    c.validate(dec)
    (ub2,) = split_ubatches(dec, 512, "equal")
    slot2 = c.place(ub2)
    m2 = np.isfinite(build_mask(c, ub2, slot2)[:, 0, 0])
    assert [int(m2[s].sum()) for s in range(10)] == [s + 2 for s in range(10)]


def test_mask_unified_other_sequences_and_empty_cells():
    c = KVCache(512, 2, unified=True)
    (ub, slot), = place_all(c, Batch.from_lengths([2, 3]), 512, "simple")
    m = build_mask(c, ub, slot)
    assert m.shape == (1, 1, 5, 256)
    vis = np.isfinite(m[0, 0])
    expect = np.zeros((5, 256), bool)
    expect[0, 0] = True
    expect[1, :2] = True
    expect[2, 2] = True
    expect[3, 2:4] = True
    expect[4, 2:5] = True
    assert np.array_equal(vis, expect)
    assert (m[np.isfinite(m)] == 0).all()


def test_mask_swa_and_alibi():
    c = KVCache(512, 1, unified=True)
    (ub, slot), = place_all(c, Batch.from_lengths([6]), 512, "simple")
    m = build_mask(c, ub, slot, n_swa=3, alibi=True)[0, 0]
    assert np.isfinite(m[5]).nonzero()[0].tolist() == [3, 4, 5]
    assert m[5, 3:6].tolist() == [-2.0, -1.0, 0.0]
    mf = build_mask(c, ub, slot, causal=False)[0, 0]
    assert np.isfinite(mf[:, :6]).all() and not np.isfinite(mf[:, 6:]).any()


def test_mask_after_seq_rm_hides_removed_cells():
    c = KVCache(512, 1, unified=True)
    place_all(c, Batch.from_lengths([5]), 512, "simple")
    c.seq_rm(0, 3, -1)
    (ub, slot), = place_all(c, Batch.from_lengths([1], start_pos=3), 512, "simple")
    vis = np.isfinite(build_mask(c, ub, slot)[0, 0, 0])
    assert np.flatnonzero(vis).tolist() == [0, 1, 2, 3]  # cell 3 reused for the new position 3
    assert c.pos[0, 3] == 3


def test_coarse_pad_values():
    from ggml_attn.graph.kv_cache import coarse_pad
    assert [coarse_pad(n) for n in (1, 256, 300, 1024, 1100, 7424, 8192, 8448)] == \
        [256, 256, 512, 1024, 1280, 8192, 8192, 10240]
    for n in range(1, 40000, 37):
        p = coarse_pad(n)
        assert n <= p <= max(256, n * 1.25 + 256) and p % 256 == 0


def test_coarse_pad_takes_the_whole_cache_past_three_quarters():
    from ggml_attn.graph.kv_cache import coarse_pad
    assert [coarse_pad(n, 9072) for n in (300, 5000, 6000, 6804, 7536, 9000, 9072)] == \
        [512, 5120, 6144, 9072, 9072, 9072, 9072]
    for kv in (256, 1000, 4096, 9072, 40000):
        for n in range(1, kv + 1, 41):
            p = coarse_pad(n, kv)
            assert n <= p and (p == max(kv, n) or (p == coarse_pad(n) and 4 * p < 3 * kv))


@pytest.mark.parametrize("unified", [True, False])
def test_coarse_n_kv_changes_n_kv_not_results(unified):
    """A cache with coarse_n_kv attends over more (masked) cells and computes the same outputs
    (to f32 rounding: the prompt attends over the whole cache, which changes the numpy path's
    summation order), and keeps one n_kv over more decode steps."""
    from ggml_attn.graph import AttnConfig, run_batch
    from ggml_attn.graph.kv_cache import coarse_pad
    cfg = AttnConfig(n_layer=1, n_head=4, n_head_kv=2, head_dim_k=16)
    caches = [KVCache(4096, 3, unified=unified, n_layer=1, n_head_kv=2, head_dim_k=16, coarse_n_kv=c)
              for c in (False, True)]
    outs, n_kvs = [], []
    for c in caches:
        res = [run_batch(c, Batch.from_lengths([500, 300, 41]), 512, "simple" if unified else "equal", cfg)]
        for _ in range(40):
            b = Batch.from_lengths([1, 1, 1], start_pos=c.next_positions(range(3)))
            res.append(run_batch(c, b, 512, "simple" if unified else "equal", cfg))
        outs.append([r.out for r in res])
        n_kvs.append([p.n_kv for r in res for p in r.plans])
    for a, b in zip(*outs):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert all(c >= f and c == coarse_pad(c, caches[1].kv_size) for f, c in zip(*n_kvs))
    assert len(set(n_kvs[1])) <= len(set(n_kvs[0]))


def test_cache_types_are_ggmls():
    """The one list of cache types (ggml_attn.dtypes) names ggml's type ids and block sizes."""
    import ggml
    from ggml_attn import dtypes
    assert dtypes.CACHE_TYPES == ("f16", "bf16", "f32", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
    for name, tid in dtypes.CACHE_TYPE_IDS.items():
        assert tid == getattr(ggml, f"GGML_TYPE_{name.upper()}"), name
        assert dtypes.block_size(name) == ggml.ggml_blck_size(tid), name
        assert dtypes.TYPE_NAMES[tid] == name
