"""The sparse path of prompt masks (``graph/mask.py`` ``_fast_mask``) gives the general path's
(``_general_mask``) bits and visibility, over random caches and ubatches: unified and split
caches, ragged prompts in every split mode, cells shared by several sequences (coupled tokens,
``seq_cp``), pad rows and pad cells, cells placed at random (out of position order), positions
out of order, removed and shifted sequences, sliding windows, ALiBi, causal or not, f16 / f32 /
f64, any ``n_kv``. And ``build_mask`` takes the sparse path for a plain prompt ubatch.
"""
import numpy as np
import pytest

from ggml_attn.graph import Batch, KVCache, KVCacheFullError, split_ubatches
from ggml_attn.graph import mask as mask_mod
from ggml_attn.graph import plan as plan_mod
from ggml_attn.graph.kv_cache import SlotInfo

MODES = ("simple", "equal", "seq", "padded")
DTYPES = (np.float16, np.float32, np.float64)


def bits(a):
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_same(fast, general, what):
    (fm, fv), (gm, gv) = fast, general
    assert fm.dtype == gm.dtype and fm.shape == gm.shape, what
    assert fv.dtype == gv.dtype == bool and fv.shape == gv.shape, what
    assert fm.flags.c_contiguous and fv.flags.c_contiguous, what
    assert np.array_equal(bits(fm), bits(gm)), what
    assert np.array_equal(fv, gv), what


def check_all(cache, ub, slot, rng, n_kw=6):
    """Both paths agree on ``ub`` for a few random settings and ``n_kv``s."""
    n_kvs = {cache.n_kv(slot), cache.kv_size, int(rng.integers(1, cache.kv_size + 1))}
    for n_kv in sorted(n_kvs):
        for _ in range(n_kw):
            kw = dict(causal=bool(rng.random() < 0.7),
                      n_swa=int(rng.choice([0, 0, 1, 3, 17, 200])),
                      alibi=bool(rng.random() < 0.3),
                      dtype=np.dtype(DTYPES[int(rng.integers(len(DTYPES)))]))
            what = (ub, slot.streams, n_kv, kw)
            assert_same(mask_mod._fast_mask(cache, ub, slot, n_kv, **kw),
                        mask_mod._general_mask(cache, ub, slot, n_kv, **kw), what)


def scattered(cache, slot, rng):
    """The slot's rows on random empty cells of its streams (in no order)."""
    cells = []
    for st, c in zip(slot.streams, slot.cells):
        free = np.flatnonzero(cache.pos[st] < 0)
        cells.append(rng.choice(free, size=c.shape[0], replace=False).astype(np.int64))
    return SlotInfo(slot.streams, tuple(cells))


def random_batch(cache, rng, n_seq, unified):
    """A prompt batch: some sequences, ragged lengths, continuing the cache (or not); in a
    unified cache at times tokens of several sequences, interleaved rows, shuffled positions."""
    k = int(rng.integers(1, n_seq + 1))
    seqs = sorted(rng.choice(n_seq, size=k, replace=False).tolist())
    if not unified:  # split caches take consecutive ids per ubatch
        seqs = list(range(seqs[0], seqs[0] + k))
    lengths = rng.integers(1, 90, size=k).tolist()
    start = cache.next_positions(seqs) if rng.random() < 0.8 else int(rng.integers(0, 50))
    b = Batch.from_lengths(lengths, seqs, start_pos=start)
    if not unified or rng.random() < 0.5:
        return b
    n = b.n_tokens
    order = rng.permutation(n) if rng.random() < 0.3 else np.arange(n)
    positions = b.positions[order].copy()
    if rng.random() < 0.3:
        positions = rng.permutation(positions)           # positions out of order
    ids = [b.seq_ids[i] for i in order]
    if rng.random() < 0.5 and n_seq > 1:                  # coupled tokens: cells of several sequences
        ids = [s + tuple(int(x) for x in rng.choice([t for t in range(n_seq) if t != s[0]],
                                                    size=int(rng.integers(0, 2)), replace=False))
               for s in ids]
    return Batch(b.tokens[order], positions, tuple(ids))


def random_op(cache, rng, n_seq):
    op = int(rng.integers(5))
    s = int(rng.integers(n_seq))
    try:
        if op == 0:
            t = int(rng.integers(n_seq))
            full = not cache.unified or rng.random() < 0.5
            p0, p1 = (-1, -1) if full else sorted(rng.integers(0, 150, size=2).tolist())
            cache.seq_cp(s, t, p0, p1)
        elif op == 1:
            p0, p1 = sorted(rng.integers(0, 200, size=2).tolist())
            cache.seq_rm(s, p0, p1)
        elif op == 2:
            cache.seq_add(s, int(rng.integers(0, 100)), -1, int(rng.integers(-60, 60)))
        elif op == 3 and rng.random() < 0.3:
            cache.seq_keep(s)
    except ValueError:
        pass


@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_fast_mask_is_the_general_mask(unified, seed):
    rng = np.random.default_rng(1000 * seed + unified)
    n_seq = int(rng.integers(1, 5))
    cache = KVCache(int(rng.integers(300, 1400)), n_seq, unified=unified, n_head_kv=1, head_dim_k=4,
                    coarse_n_kv=bool(rng.random() < 0.5))
    checked = 0
    for _ in range(12):
        b = random_batch(cache, rng, n_seq, unified)
        mode = str(rng.choice(MODES))
        try:
            ubatches = split_ubatches(b, int(rng.choice([7, 32, 128, 512])), mode)
        except ValueError:
            continue
        for ub in ubatches:
            try:
                slot = cache.find_slot(ub)
            except KVCacheFullError:
                cache.seq_rm(-1)
                break
            except ValueError:   # a layout the split cache refuses
                break
            if rng.random() < 0.4:
                slot = scattered(cache, slot, rng)
            cache.apply_ubatch(slot, ub)
            check_all(cache, ub, slot, rng)
            checked += 1
            if rng.random() < 0.8:  # else its pad cells stay for the next ubatches to skip
                cache.free_pads(slot)
        random_op(cache, rng, n_seq)
    assert checked >= 3


def test_fast_mask_edge_rows():
    """Pad rows only, rows of a sequence with no cell, a row before every cell of its sequence,
    n_kv past the used cells or below them."""
    cache = KVCache(512, 3, unified=True, n_head_kv=1, head_dim_k=4)
    b = Batch.from_lengths([40, 30], [0, 1])
    for ub in split_ubatches(b, 512, "simple"):
        cache.free_pads(plan_mod.plan_ubatch(cache, ub).slot)
    cache.seq_rm(1)
    # sequence 1 has no cell left; sequence 0's rows at positions before its cells
    b = Batch(np.zeros(20, np.int32), np.r_[np.arange(10), np.arange(10)].astype(np.int32),
              tuple([(1,)] * 10 + [(0,)] * 10))
    rng = np.random.default_rng(0)
    for mode in MODES:
        with pytest.raises(KeyError), cache.transaction():
            for ub in split_ubatches(b, 6, mode):
                slot = cache.place(ub)
                check_all(cache, ub, slot, rng, n_kw=10)
                for n_kv in (1, 17, 40, cache.kv_size):
                    for kw in ({}, {"causal": False}, {"n_swa": 2, "alibi": True}):
                        kw = {**dict(causal=True, n_swa=0, alibi=False, dtype=np.dtype(np.float16)), **kw}
                        assert_same(mask_mod._fast_mask(cache, ub, slot, n_kv, **kw),
                                    mask_mod._general_mask(cache, ub, slot, n_kv, **kw), (mode, n_kv, kw))
            raise KeyError


def test_fast_mask_scattered_groups():
    """A group whose cells lie in more runs than the block limit (written by fancy indexing)
    and one just under it."""
    rng = np.random.default_rng(5)
    for n_tok in (600, 40):
        cache = KVCache(2048, 2, unified=True, n_head_kv=1, head_dim_k=4)
        b = Batch.from_lengths([n_tok, 30], [0, 1])
        for ub in split_ubatches(b, 1024, "simple"):
            slot = scattered(cache, cache.find_slot(ub), rng)
            cache.apply_ubatch(slot, ub)
        b = Batch.from_lengths([300], [0], start_pos=cache.next_positions([0]))
        (ub,) = split_ubatches(b, 512, "simple")
        slot = cache.place(ub)
        for kw in (dict(causal=True, n_swa=0), dict(causal=False, n_swa=0), dict(causal=True, n_swa=50),
                   dict(causal=False, n_swa=9)):
            for alibi in (False, True):
                kw2 = dict(kw, alibi=alibi, dtype=np.dtype(np.float32))
                assert_same(mask_mod._fast_mask(cache, ub, slot, cache.kv_size, **kw2),
                            mask_mod._general_mask(cache, ub, slot, cache.kv_size, **kw2), kw2)


def ragged_prompts(n_prompts=24, seed=1):
    lens = np.random.default_rng(seed).integers(16, 201, n_prompts).tolist()
    cache = KVCache(sum(lens) + n_prompts * 33 + 256, n_prompts, unified=True, n_head_kv=1, head_dim_k=4,
                    coarse_n_kv=True)
    return cache, split_ubatches(Batch.from_lengths(lens), 512, "simple")


@pytest.mark.parametrize("kw", [{}, {"n_swa": 64}, {"alibi": True}, {"causal": False}])
def test_plain_prompts_take_the_fast_path(monkeypatch, kw):
    """Plans of ragged prompts never call the general path, and their masks and visibility
    are the general path's."""
    general = mask_mod._general_mask

    def refused(*a, **k):
        raise AssertionError("general path taken")
    monkeypatch.setattr(mask_mod, "_general_mask", refused)
    cache, ubatches = ragged_prompts()
    assert len(ubatches) > 2
    for ub in ubatches:
        p = plan_mod.plan_ubatch(cache, ub, **kw)
        full = dict(causal=True, n_swa=0, alibi=False, dtype=np.dtype(np.float16))
        full.update(kw)
        assert_same((p.mask, p.visible), general(cache, ub, p.slot, p.n_kv, **full), kw)
        cache.free_pads(p.slot)


def test_decode_rows_take_the_general_path(monkeypatch):
    """One row per sequence over a small cache (a decode step not stepped from a previous
    mask): the dense path, cheaper there."""
    def refused(*a, **k):
        raise AssertionError("fast path taken")
    cache, ubatches = ragged_prompts(8)
    for ub in ubatches:
        cache.free_pads(plan_mod.plan_ubatch(cache, ub).slot)
    monkeypatch.setattr(mask_mod, "_fast_mask", refused)
    b = Batch.from_lengths([1] * 8, list(range(8)), start_pos=cache.next_positions(range(8)))
    (ub,) = split_ubatches(b, 512, "simple")
    slot = cache.place(ub)
    mask_mod.build_mask(cache, ub, slot, causal=True, n_swa=4)


def test_prompt_then_stepped_decode():
    """A causal prompt mask from the sparse path is kept (read-only) and the next decode steps
    step from it (``mask_step.py``) to the general path's masks."""
    cache, ubatches = ragged_prompts(6)
    p = None
    for ub in ubatches:
        p = plan_mod.plan_ubatch(cache, ub)
        cache.free_pads(p.slot)
    assert not p.mask.flags.writeable and not p.visible.flags.writeable
    for _ in range(3):
        b = Batch.from_lengths([1] * 6, list(range(6)), start_pos=cache.next_positions(range(6)))
        (ub,) = split_ubatches(b, 512, "simple")
        p = plan_mod.plan_ubatch(cache, ub)
        kw = dict(causal=True, n_swa=0, alibi=False, dtype=np.dtype(np.float16))
        assert_same((p.mask, p.visible), mask_mod._general_mask(cache, ub, p.slot, p.n_kv, **kw), "step")
