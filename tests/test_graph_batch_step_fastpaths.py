"""A decode step's batch fast paths (graph/batch.py: ``Batch.from_lengths`` of one token per
sequence, ``validate_batch`` of one token per sequence, and of one sequence id a token -- a
prompt; graph/kv_cache.py: remembered ``seq_pos_min/max`` answers) give what the general code
gives: the same batch, or the same error message, on random inputs."""
import numpy as np
import pytest

from ggml_attn.graph import Batch, KVCache
from ggml_attn.graph import batch as batch_mod


class Checked(Batch):  # a subclass takes the general, checked path
    pass


def fields(b):
    return (b.tokens.dtype, b.tokens.tolist(), b.tokens.flags.writeable, b.positions.dtype,
            b.positions.tolist(), b.positions.flags.writeable, b.seq_ids,
            [type(s) for ids in b.seq_ids for s in ids], type(b.tokens), type(b.positions))


def outcome(fn):
    try:
        return fields(fn())
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("seed", range(4))
def test_one_token_per_sequence_from_lengths_as_the_general_path(seed):
    rng = np.random.default_rng(seed)
    for _ in range(300):
        k = int(rng.integers(1, 70))
        ids = [int(x) for x in rng.choice(256, k, replace=False)]
        if rng.random() < 0.1:
            ids[-1] = ids[0]            # repeated id: refused
        if rng.random() < 0.05:
            ids[0] = -1
        kind = rng.integers(0, 4)
        start = (None if kind == 0 else int(rng.integers(0, 2**31)) if kind == 1
                 else {s: int(rng.integers(0, 2**31)) for s in ids} if kind == 2
                 else [int(rng.integers(0, 2**31)) for _ in ids])
        lengths = [1] * k
        assert outcome(lambda: Batch.from_lengths(lengths, ids, start)) == \
            outcome(lambda: Checked.from_lengths(lengths, ids, start))


def _validations(cases) -> list[str]:
    """validate_batch's outcome ("ok" or its message) for each ``(batch, n_seq_max, unified, top)``:
    the cache's last position of sequence s ``top[s]``, its first ``top[s] - 5``."""
    out = []
    for b, n_seq_max, unified, top in cases:
        try:
            batch_mod.validate_batch(b, n_seq_max, unified=unified, seq_pos_min=lambda s: top[s] - 5,
                                     seq_pos_max=lambda s: top[s])
            out.append("ok")
        except ValueError as e:
            out.append(str(e))
    return out


def _general(monkeypatch):
    monkeypatch.setattr(batch_mod, "_one_token_per_sequence", lambda b: None)
    monkeypatch.setattr(batch_mod, "_uncoupled_first_positions", lambda b, n: None)


@pytest.mark.parametrize("seed", range(4))
def test_decode_step_validation_as_the_general_path(monkeypatch, seed):
    rng = np.random.default_rng(seed)
    cases = []
    for _ in range(400):
        n_seq_max = int(rng.integers(1, 257))
        k = int(rng.integers(1, 20))
        ids = [int(x) for x in rng.choice(300, k, replace=False)]
        if rng.random() < 0.5:
            ids = [s % n_seq_max for s in ids]
        seq_ids = [(s,) for s in ids]
        if rng.random() < 0.1:   # a repeated id, or a coupled token: the general path
            seq_ids[-1] = seq_ids[0] if rng.random() < 0.5 else (ids[-1], ids[0])
            seq_ids = [tuple(dict.fromkeys(x)) for x in seq_ids]
        top = {s: int(rng.integers(-1, 50)) for s in range(300)}
        pos = [top[x[0]] + 1 + int(rng.random() < 0.1) * int(rng.integers(-3, 4)) for x in seq_ids]
        pos = [max(p, 0) for p in pos]
        b = Batch(np.zeros(k, np.int32), np.array(pos), tuple(seq_ids))
        unified = bool(rng.random() < 0.7)
        cases.append((b, n_seq_max, unified, top))

    fast = _validations(cases)
    _general(monkeypatch)
    slow = _validations(cases)
    assert fast == slow
    assert 50 < fast.count("ok") < len(fast) - 50


@pytest.mark.parametrize("seed", range(4))
def test_prompt_validation_as_the_general_path(monkeypatch, seed):
    """Prompts of several sequences, their tokens interleaved or not, one id a token (the sorted
    check) or a coupled token now and then (the loop): the outcome of the general loop, whether
    every rule holds or a position repeats, jumps or goes back, an id passes n_seq_max, or a
    sequence does not continue the cache."""
    rng = np.random.default_rng(100 + seed)
    cases = []
    for _ in range(300):
        n_seq_max = int(rng.integers(1, 40))
        k = int(rng.integers(1, 8))
        ids = [int(x) for x in rng.choice(50, k, replace=False)]
        if rng.random() < 0.8:
            ids = [s % n_seq_max for s in dict.fromkeys(ids)]
            ids = list(dict.fromkeys(ids))
        top = {s: int(rng.integers(-1, 50)) for s in range(50)}
        lens = [int(rng.integers(1, 30)) for _ in ids]
        order = np.repeat(np.arange(len(ids)), lens)
        if rng.random() < 0.5:
            rng.shuffle(order)
        nxt = {s: top[s] + 1 + int(rng.random() < 0.1) for s in ids}
        pos, seq_ids = [], []
        for j in order.tolist():
            s = ids[j]
            pos.append(nxt[s])
            nxt[s] += 1 if rng.random() > 0.02 else int(rng.choice([0, 2, -1]))
            seq_ids.append((s,))
        if rng.random() < 0.05 and len(seq_ids) > 1:   # a coupled token: the loop decides
            seq_ids[0] = tuple(dict.fromkeys((seq_ids[0][0], seq_ids[-1][0])))
        b = Batch(np.zeros(len(pos), np.int32), np.array([max(p, 0) for p in pos]), tuple(seq_ids))
        cases.append((b, n_seq_max, bool(rng.random() < 0.7), top))

    fast = _validations(cases)
    _general(monkeypatch)
    slow = _validations(cases)
    assert fast == slow
    assert 30 < fast.count("ok") < len(fast) - 30


def test_remembered_sequence_positions_and_bad_ids():
    c = KVCache(256, 4, unified=True, n_head_kv=1, head_dim_k=4)
    assert c.seq_pos_max(1) == -1 and c.seq_pos_min(1) == -1
    for bad in (4, -1, 1.0, True, np.int64(7)):
        with pytest.raises(ValueError):
            c.seq_pos_max(bad)
    assert c.seq_pos_max(np.int64(1)) == -1


def test_seq_set_tokens_of_one_id_a_token_as_the_token_loop():
    """Batch.seq_set_tokens groups a batch without coupled tokens by sequence id (one set made a
    sequence); the sets, their order (of first appearance) and their tokens (in batch order) are
    the loop over every token's set's."""
    rng = np.random.default_rng(7)
    for _ in range(300):
        n = int(rng.integers(1, 80))
        b = Batch(np.zeros(n, np.int32), np.zeros(n, np.int32), tuple((int(s),) for s in rng.integers(0, 9, n)))
        want: dict = {}
        for i, s in enumerate(b.seq_sets):
            want.setdefault(s, []).append(i)
        assert list(b.seq_set_tokens.items()) == [(s, tuple(v)) for s, v in want.items()]
        assert all(type(i) is int for v in b.seq_set_tokens.values() for i in v)


def test_batch_view_as_the_checked_constructor():
    """Batch.view(i, j) (the CLIs' n_batch views) is the batch the checked constructor makes of the
    same slices, without checking them again; a subclass is built through its constructor; an
    empty or out-of-range view is refused."""
    rng = np.random.default_rng(11)
    for _ in range(100):
        lens = [int(x) for x in rng.integers(1, 40, int(rng.integers(1, 5)))]
        b = Batch.from_lengths(lens, start_pos=[int(x) for x in rng.integers(0, 1000, len(lens))])
        n = b.n_tokens
        i = int(rng.integers(0, n))
        j = int(rng.integers(i + 1, n + 1))
        v = b.view(i, j)
        assert type(v) is Batch and fields(v) == fields(Checked(b.tokens[i:j], b.positions[i:j], b.seq_ids[i:j]))
        c = Checked(b.tokens, b.positions, b.seq_ids).view(i, j)
        assert type(c) is Checked and fields(c) == fields(v)
    for i, j in ((3, 3), (-1, 2), (0, b.n_tokens + 1)):
        with pytest.raises(ValueError, match="a view of tokens"):
            b.view(i, j)
