"""Batch validation and the ubatch splitters (llama.cpp's behaviour: llama_batch_allocr's split_simple / split_equal / split_seq)."""
import numpy as np
import pytest

from ggml_attn.graph import Batch, split_ubatches, validate_batch


def shapes(ubs):
    return [(u.n_seqs, u.n_seq_tokens) for u in ubs]


# ------------------------------------------------------------------ Batch
def test_from_lengths_layout_in_given_id_order():
    b = Batch.from_lengths([2, 3], seq_ids=[5, 1], start_pos={1: 7})
    assert b.primary_seq_ids.tolist() == [5, 5, 1, 1, 1]
    assert b.positions.tolist() == [0, 1, 7, 8, 9]
    assert b.unique_seq_ids == (1, 5)
    assert b.seq_token_counts() == {5: 2, 1: 3}


def test_from_sequences_keeps_tokens():
    b = Batch.from_sequences([[11, 12], [13]], seq_ids=[0, 1], start_pos=[3, 0])
    assert b.tokens.tolist() == [11, 12, 13]
    assert b.positions.tolist() == [3, 4, 0]


@pytest.mark.parametrize("kw, msg", [
    (dict(lengths=[1, 0]), "lengths\\[1\\] = 0"),
    (dict(lengths=[1, 2], seq_ids=[3, 3]), "distinct"),
    (dict(lengths=[1, 2], seq_ids=[0]), "2 lengths but 1 seq_ids"),
    (dict(lengths=[1], start_pos=[0, 1]), "start_pos has 2 entries"),
])
def test_from_lengths_errors(kw, msg):
    with pytest.raises(ValueError, match=msg):
        Batch.from_lengths(**kw)


def test_batch_structure_errors():
    with pytest.raises(ValueError, match="no sequence id"):
        Batch(np.array([1]), np.array([0]), ((),))
    with pytest.raises(ValueError, match="negative sequence id"):
        Batch(np.array([1]), np.array([0]), ((-1,),))
    with pytest.raises(ValueError, match="one entry per token"):
        Batch(np.array([1, 2]), np.array([0]), ((0,), (0,)))
    with pytest.raises(ValueError, match="at least one token"):
        Batch(np.array([], dtype=np.int32), np.array([], dtype=np.int32), ())


def test_validate_seq_id_range():
    b = Batch.from_lengths([1, 1], seq_ids=[0, 4])
    with pytest.raises(ValueError, match=r"seq_id\[1\] = 4 >= n_seq_max = 4"):
        validate_batch(b, 4, unified=True)
    validate_batch(b, 5, unified=True)


def test_validate_positions_continue_cache():
    b = Batch.from_lengths([2], seq_ids=[0], start_pos=5)
    validate_batch(b, 1, unified=True, seq_pos_max=lambda s: 4)
    with pytest.raises(ValueError, match="X = 6 .* Y = 5"):
        validate_batch(b, 1, unified=True, seq_pos_max=lambda s: 6)


def test_validate_positions_continuous_and_increasing():
    gap = Batch(np.zeros(2), np.array([0, 2]), ((0,), (0,)))
    with pytest.raises(ValueError, match="not continuous"):
        validate_batch(gap, 1, unified=True)
    back = Batch(np.zeros(2), np.array([1, 0]), ((0,), (0,)))
    with pytest.raises(ValueError, match="does not increase"):
        validate_batch(back, 1, unified=True)


def test_validate_coupled_refused_in_split_mode_with_hint():
    b = Batch(np.zeros(3), np.array([0, 1, 2]), ((0, 1), (0, 1), (0, 1)))
    validate_batch(b, 2, unified=True)
    with pytest.raises(ValueError, match=r"-kvu"):
        validate_batch(b, 2, unified=False)


def test_validate_incompatible_sets():
    b = Batch(np.zeros(3), np.array([0, 1, 2]), ((0, 1, 2), (0, 1), (1, 2)))
    with pytest.raises(ValueError, match="sequence 1 belongs to incompatible"):
        validate_batch(b, 3, unified=True)


def test_validate_coupled_diverged():
    b = Batch(np.zeros(1), np.array([5]), ((0, 1),))
    with pytest.raises(ValueError, match="diverged"):
        validate_batch(b, 2, unified=True, seq_pos_max=lambda s: 4,
                       seq_pos_min=lambda s: 0 if s == 0 else 2)


# --------------------------------------------------------------- splitters
def test_reference_case_equal_1_to_10():
    ubs = split_ubatches(Batch.from_lengths(range(1, 11)), 512, "equal")
    assert shapes(ubs) == [(n, 1) for n in range(10, 0, -1)]
    assert sum(u.n_tokens for u in ubs) == 55
    assert ubs[1].seq_ids == tuple(range(1, 10))


def test_reference_case_ten_prompts_of_100():
    ubs = split_ubatches(Batch.from_lengths([100] * 10), 512, "equal")
    assert shapes(ubs) == [(10, 51), (10, 49)]


def test_reference_case_reversed_ids_one_sequence_per_ubatch():
    b = Batch.from_lengths(range(1, 11), seq_ids=range(9, -1, -1))
    ubs = split_ubatches(b, 512, "equal")
    assert len(ubs) == 10
    assert all(u.n_seqs == 1 for u in ubs)
    assert [u.seq_ids for u in ubs] == [(s,) for s in range(9, -1, -1)]


def test_reference_case_padded_1_to_10():
    ubs = split_ubatches(Batch.from_lengths(range(1, 11)), 512, "padded")
    assert len(ubs) == 1
    u = ubs[0]
    assert (u.n_seqs, u.n_seq_tokens, u.n_tokens, u.n_pad) == (10, 10, 100, 45)
    assert u.seq_ids == tuple(range(10))
    # row block of sequence s: its s+1 real tokens then 9-s pads with continuing positions
    for s in range(10):
        rows = slice(10 * s, 10 * s + 10)
        assert u.is_pad[rows].tolist() == [False] * (s + 1) + [True] * (9 - s)
        assert u.positions[rows].tolist() == list(range(10))
        assert set(u.primary_seq_ids[rows].tolist()) == {s}


def test_padded_groups_by_id_not_batch_order():
    # equal needs 10 ubatches here; padded groups consecutive ids whatever the batch order
    b = Batch.from_lengths(range(1, 11), seq_ids=range(9, -1, -1))
    ubs = split_ubatches(b, 512, "padded")
    assert len(ubs) <= 2 and ubs[0].n_seqs >= 9


def test_padded_ten_prompts_of_100_needs_no_pads():
    ubs = split_ubatches(Batch.from_lengths([100] * 10), 512, "padded")
    assert shapes(ubs) == [(10, 51), (10, 49)]
    assert sum(u.n_pad for u in ubs) == 0


def test_padded_does_not_pad_a_long_prompt_with_many_short_ones():
    ubs = split_ubatches(Batch.from_lengths([200] + [5] * 10), 512, "padded")
    assert shapes(ubs) == [(1, 200), (10, 5)]


def test_padded_respects_n_ubatch_and_covers_every_token_once():
    rng = np.random.default_rng(0)
    for _ in range(30):
        lengths = rng.integers(1, 120, size=int(rng.integers(1, 20))).tolist()
        n_ubatch = int(rng.integers(1, 300))
        b = Batch.from_lengths(lengths, seq_ids=rng.permutation(len(lengths)))
        ubs = split_ubatches(b, n_ubatch, "padded")
        assert all(u.n_tokens <= n_ubatch for u in ubs)
        idx = np.concatenate([u.token_idx[~u.is_pad] for u in ubs])
        assert sorted(idx.tolist()) == list(range(b.n_tokens))


def test_simple_is_batch_order():
    b = Batch.from_lengths([3, 4], seq_ids=[1, 0])
    ubs = split_ubatches(b, 5, "simple")
    assert [u.token_idx.tolist() for u in ubs] == [[0, 1, 2, 3, 4], [5, 6]]
    assert ubs[0].n_seqs == 5 and ubs[0].n_seq_tokens == 1 and not ubs[0].equal_seqs


def test_seq_one_sequence_per_ubatch_in_batch_order_limited_by_n_ubatch():
    b = Batch.from_lengths([3, 2], seq_ids=[1, 0])
    ubs = split_ubatches(b, 2, "seq")
    assert [(u.seq_ids, u.n_tokens) for u in ubs] == [((1,), 2), ((1,), 1), ((0,), 2)]


def test_seq_takes_subsets_of_a_shared_prompt():
    b = Batch(np.zeros(4), np.array([0, 1, 2, 2]), ((0, 1), (0, 1), (0,), (1,)))
    ubs = split_ubatches(b, 10, "seq")
    assert [u.token_idx.tolist() for u in ubs] == [[0, 1, 2], [3]]


def test_equal_interleaved_batch_order_takes_tokens_per_sequence():
    # tokens of seq 0 and 1 interleaved in the batch: rows come out set-major
    b = Batch(np.zeros(4), np.array([0, 0, 1, 1]), ((0,), (1,), (0,), (1,)))
    (u,) = split_ubatches(b, 8, "equal")
    assert u.token_idx.tolist() == [0, 2, 1, 3]
    assert (u.n_seqs, u.n_seq_tokens) == (2, 2)


def test_equal_non_sequential_ids_split_apart():
    b = Batch.from_lengths([2, 2, 2], seq_ids=[0, 2, 3])
    assert [u.seq_ids for u in split_ubatches(b, 64, "equal")] == [(0,), (2, 3)]


def test_equal_quirk_more_sequences_than_n_ubatch():
    # llama.cpp collects sets until it holds more than n_ubatch of them
    ubs = split_ubatches(Batch.from_lengths([1] * 6), 4, "equal")
    assert shapes(ubs) == [(5, 1), (1, 1)]


@pytest.mark.parametrize("mode", ["equal", "padded"])
def test_per_stream_modes_refuse_coupled(mode):
    b = Batch(np.zeros(2), np.array([0, 1]), ((0, 1), (0, 1)))
    with pytest.raises(ValueError, match="-kvu"):
        split_ubatches(b, 8, mode)


def test_split_errors():
    b = Batch.from_lengths([1])
    with pytest.raises(ValueError, match="unknown split mode 'fast'"):
        split_ubatches(b, 8, "fast")
    with pytest.raises(ValueError, match="n_ubatch must be >= 1"):
        split_ubatches(b, 0, "simple")


@pytest.mark.parametrize("mode", ["simple", "equal", "seq", "padded", "auto"])
@pytest.mark.parametrize("bad", [True, False, 2.0, 8.5, "8", None])
def test_n_ubatch_must_be_a_real_int(mode, bad):
    """True is not 1 and 2.0 is not 2 (both were accepted), in every mode and batch size."""
    for b in (Batch.from_lengths([1]), Batch.from_lengths([3, 5])):
        with pytest.raises(ValueError, match="n_ubatch must be an integer"):
            split_ubatches(b, bad, mode)
    assert len(split_ubatches(Batch.from_lengths([3, 5]), np.int64(8), mode)) >= 1


@pytest.mark.parametrize("mode", ["simple", "equal", "seq", "padded"])
def test_every_mode_places_every_token_once_in_sequence_order(mode):
    rng = np.random.default_rng(1)
    for _ in range(20):
        lengths = rng.integers(1, 40, size=int(rng.integers(1, 12))).tolist()
        b = Batch.from_lengths(lengths, seq_ids=rng.permutation(len(lengths)))
        ubs = split_ubatches(b, int(rng.integers(1, 100)), mode)
        seen = np.concatenate([u.token_idx[~u.is_pad] for u in ubs])
        assert sorted(seen.tolist()) == list(range(b.n_tokens))
        # per sequence, tokens come in increasing position order across ubatches
        last = {}
        for u in ubs:
            for i in u.token_idx[~u.is_pad].tolist():
                s, p = b.seq_ids[i][0], int(b.positions[i])
                assert p == last.get(s, -1) + 1
                last[s] = p


def test_ubatch_seq_ids_computed_once_and_read_only():
    ub = split_ubatches(Batch.from_lengths([3, 2, 4], seq_ids=[2, 0, 1]), 512, "padded")[0]
    assert ub.primary_seq_ids is ub.primary_seq_ids and ub.seq_ids is ub.seq_ids
    assert ub.seq_ids == (0, 1, 2) and ub.primary_seq_ids.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    with pytest.raises(ValueError):
        ub.primary_seq_ids[0] = 5


def test_split_seq_without_coupled_tokens_matches_the_token_scan():
    """split_seq takes a sequence's unused tokens directly when no token is coupled; the result
    is the one of llama.cpp's token-by-token scan (forced here by flagging the batch coupled)."""
    rng = np.random.default_rng(1)
    for _ in range(200):
        lens = rng.integers(1, 40, int(rng.integers(1, 12)))
        order = np.repeat(np.arange(len(lens)), lens)
        rng.shuffle(order)  # interleaved sequences, any order
        seen: dict[int, int] = {}
        pos = []
        for s in order.tolist():
            pos.append(seen.get(s, 0))
            seen[s] = pos[-1] + 1
        batch = Batch(np.zeros(len(order), dtype=np.int32), np.array(pos, dtype=np.int32),
                      tuple((s,) for s in order.tolist()))
        n_ubatch = int(rng.integers(1, 64))
        direct = split_ubatches(batch, n_ubatch, "seq")
        batch.__dict__["has_coupled"] = True  # the general scan
        scanned = split_ubatches(batch, n_ubatch, "seq")
        assert [u.token_idx.tolist() for u in direct] == [u.token_idx.tolist() for u in scanned]
        assert [u.positions.tolist() for u in direct] == [u.positions.tolist() for u in scanned]
        assert [u.token_seq_ids for u in direct] == [u.token_seq_ids for u in scanned]


def _random_batch(rng, max_len: int, max_seqs: int, p_interleave: float) -> Batch:
    """One token per row, sequences of 1..max_len-1 tokens with ids in any order (maybe not
    from 0), their tokens interleaved in batch order with probability ``p_interleave``."""
    lens = rng.integers(1, max_len, int(rng.integers(1, max_seqs)))
    ids = rng.permutation(len(lens)) + int(rng.integers(0, 3))
    order = np.repeat(np.arange(len(lens)), lens)
    if rng.random() < p_interleave:
        rng.shuffle(order)
    seen: dict[int, int] = {}
    pos, sids = [], []
    for j in order.tolist():
        s = int(ids[j])
        pos.append(seen.get(s, 0))
        seen[s] = pos[-1] + 1
        sids.append((s,))
    return Batch(np.zeros(len(order), dtype=np.int32), np.array(pos, dtype=np.int32), tuple(sids))


def test_split_equal_set_chain_matches_the_token_scan(monkeypatch):
    """split_equal (sequential) collects its sets by lookups per sequence id; the ubatches are
    those of llama.cpp's pass over every unused token."""
    from ggml_attn.graph import split as split_mod

    rng = np.random.default_rng(2)
    for _ in range(200):
        batch = _random_batch(rng, 30, 14, 0.7)
        n_ubatch = int(rng.integers(1, 48))
        chained = split_ubatches(batch, n_ubatch, "equal")
        with monkeypatch.context() as m:
            m.setattr(split_mod, "_equal_sets_chain", lambda st, n: split_mod._equal_sets_scan(st, n, True))
            scanned = split_ubatches(batch, n_ubatch, "equal")
        assert [u.token_idx.tolist() for u in chained] == [u.token_idx.tolist() for u in scanned]
        assert [(u.n_seqs, u.token_seq_ids) for u in chained] == [(u.n_seqs, u.token_seq_ids) for u in scanned]


def test_split_equal_cursor_gives_llama_cpps_ubatches(monkeypatch):
    """split_equal starts each sequence set's search at the set's cursor (every token before it
    used) instead of at 0 as llama.cpp's loop does; the ubatches are the same as with the search
    from 0, for every mode that walks sets (random interleavings, ids not from 0)."""
    from ggml_attn.graph import split as split_mod

    class Forgetful(dict):   # a cursor that remembers nothing: every search starts at 0
        def __setitem__(self, key, value):
            pass

    rng = np.random.default_rng(5)
    for _ in range(150):
        batch = _random_batch(rng, 40, 12, 0.6)
        n_ubatch = int(rng.integers(1, 48))
        for mode in ("equal", "padded"):
            fast = split_ubatches(batch, n_ubatch, mode)
            init = split_mod.SplitState.__init__

            def forgetful_init(self, b, _init=init):
                _init(self, b)
                self.cursor = Forgetful()
            with monkeypatch.context() as m:
                m.setattr(split_mod.SplitState, "__init__", forgetful_init)
                slow = split_ubatches(batch, n_ubatch, mode)
            assert [u.token_idx.tolist() for u in fast] == [u.token_idx.tolist() for u in slow], mode
            assert [(u.n_seqs, u.token_seq_ids) for u in fast] == [(u.n_seqs, u.token_seq_ids) for u in slow]


def _equal_rounds_loop(state, n_ubatch: int):
    """split_equal's token loop as llama.cpp writes it (a token of every set a round, until a set
    runs out or one more round would pass n_ubatch, at least one round): the reference of the
    rounds split_equal takes as slices."""
    from ggml_attn.graph import split as split_mod
    split_mod._refuse_coupled(state, "the sequential equal split")
    cur_sets = split_mod._equal_sets_chain(state, n_ubatch)
    if not cur_sets:
        return None
    lists = [state.seq_set_map[cs] for cs in cur_sets]
    cur_idx = [0] * len(cur_sets)
    for s in range(len(cur_sets)):
        while state.used[lists[s][cur_idx[s]]]:
            cur_idx[s] += 1
    per_seq = [[] for _ in cur_sets]
    while not any(cur_idx[s] >= len(lists[s]) for s in range(len(cur_sets))):
        for s in range(len(cur_sets)):
            per_seq[s].append(lists[s][cur_idx[s]])
            state.used[lists[s][cur_idx[s]]] = True
            cur_idx[s] += 1
        if (len(per_seq[0]) + 1) * len(cur_sets) > n_ubatch:
            break
    return state.make("equal", [i for lst in per_seq for i in lst], len(cur_sets), True)


def test_split_equal_rounds_are_llama_cpps_token_loop(monkeypatch):
    """split_equal takes its rounds as slices of each set's tokens; the ubatches are those of
    llama.cpp's token-by-token loop (random interleavings, more sequences than n_ubatch included:
    its first ubatch of n_ubatch + 1 tokens), and a 512-token prompt is one ubatch of 512."""
    from ggml_attn.graph import split as split_mod
    rng = np.random.default_rng(23)
    for _ in range(200):
        batch = _random_batch(rng, 40, 20, 0.6)
        n_ubatch = int(rng.integers(1, 48))
        fast = split_ubatches(batch, n_ubatch, "equal")
        with monkeypatch.context() as m:
            m.setitem(split_mod._SPLITTERS, "equal", _equal_rounds_loop)
            slow = split_ubatches(batch, n_ubatch, "equal")
        assert [u.token_idx.tolist() for u in fast] == [u.token_idx.tolist() for u in slow]
        assert [(u.n_seqs, u.token_seq_ids, u.positions.tolist()) for u in fast] == \
            [(u.n_seqs, u.token_seq_ids, u.positions.tolist()) for u in slow]
    prompt = Batch.from_sequences([np.arange(512, dtype=np.int32)], [0])
    (ub,) = split_ubatches(prompt, 512, "equal")
    assert ub.token_idx.tolist() == list(range(512)) and ub.n_seqs == 1
