"""Splitting a batch into ubatches: llama.cpp's three splitters and a padded one.

Pure functions of a :class:`~ggml_attn.graph.batch.Batch`; no tensors, no cache.

* ``simple``  - llama.cpp ``split_simple``: the next ``n_ubatch`` unused tokens in batch
  order, any sequences. What llama.cpp uses with a unified (one-stream) KV cache.
* ``equal``   - llama.cpp ``split_equal(n_ubatch, sequential=True)``: non-overlapping
  sequence sets with consecutive ids, one token per set per round until a set runs out
  or ``(n_seq_tokens + 1) * n_seqs > n_ubatch``. What llama.cpp uses with one KV stream
  per sequence. Prompts of different lengths therefore cost one ubatch per token of the
  shortest prompt.
* ``seq``     - llama.cpp ``split_seq``: one sequence set per ubatch.
* ``padded``  - llama.cpp RFC #15636: the sequences of a ubatch are padded
  to one length ``n_seq_tokens`` so per-stream KV takes prompts of different lengths
  together. Pad tokens are flagged (``UBatch.is_pad``); the cache and mask make sure they
  never influence a real token and the cache frees them right after the ubatch.

The token order inside a ubatch is llama.cpp's: for ``equal``/``seq``/``padded`` the tokens
of sequence set 0 first, then set 1, ... (each set contributes ``n_seq_tokens`` rows);
for ``simple`` batch order.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .batch import INT32_MAX, Batch, as_int, computed_once

__all__ = ["UBatch", "split_ubatches", "split_simple", "split_equal", "split_seq", "split_padded", "bucket_rows",
           "pad_to_bucket",
           "MODES", "SplitState", "check_n_ubatch"]

MODES = ("simple", "equal", "seq", "padded", "auto")
PADDED_KEEP_FRACTION = 0.9  # split_padded: keep more sequences while within 90% of the best score
PADDED_PAD_WEIGHT = 0.5     # split_padded: a pad row costs half a real row in the score
_REFUSE_COUPLED = ("equal", "padded")  # the splitters that refuse coupled tokens


@dataclass(frozen=True, eq=False)
class UBatch:
    """One ubatch.

    mode           the splitter that made it.
    token_idx      int64 ``(n_tokens,)``: index of each row's token in the batch, -1 for a pad.
    positions      int32 ``(n_tokens,)``: position of each row (pads continue their sequence).
    token_seq_ids  ``n_tokens`` tuples: the sequence ids of each row (a pad: its row's sequence).
    n_seqs         llama.cpp's ``n_seqs``: sequence sets in the ubatch (``equal``/``padded``),
                   1 (``seq``), or ``n_tokens`` (``simple``: one virtual set per token).
    equal_seqs     True when every set contributes ``n_seq_tokens`` consecutive rows.
    reason         free text (``auto`` says why it chose this split).
    """

    mode: str
    token_idx: np.ndarray
    positions: np.ndarray
    token_seq_ids: tuple[tuple[int, ...], ...]
    n_seqs: int
    equal_seqs: bool
    reason: str = field(default="")

    def __post_init__(self):
        n = int(self.token_idx.shape[0])
        if n == 0 or n % self.n_seqs:
            raise ValueError(f"ubatch of {n} tokens cannot hold {self.n_seqs} equal sequence sets")
        if self.positions.shape[0] != n or len(self.token_seq_ids) != n:
            raise ValueError("token_idx, positions and token_seq_ids need one entry per row")

    @property
    def n_tokens(self) -> int:
        return int(self.token_idx.shape[0])

    @property
    def n_seq_tokens(self) -> int:
        return self.n_tokens // self.n_seqs

    @property
    def is_pad(self) -> np.ndarray:
        """bool ``(n_tokens,)``: True for pad rows."""
        return self.token_idx < 0

    @computed_once
    def n_pad(self) -> int:
        """Pad rows (computed once)."""
        if self.token_idx.shape[0] <= 16:  # a few rows: counted in Python
            return sum(i < 0 for i in self.token_idx.tolist())
        return int(np.count_nonzero(self.token_idx < 0))

    @property
    def n_real(self) -> int:
        return self.n_tokens - self.n_pad

    @computed_once
    def has_coupled(self) -> bool:
        """True when some row belongs to more than one sequence (computed once)."""
        return any(len(ids) > 1 for ids in self.token_seq_ids)

    @computed_once
    def primary_seq_ids(self) -> np.ndarray:
        """int32 ``(n_tokens,)``: first sequence id of each row (computed once, read-only)."""
        out = np.array([ids[0] for ids in self.token_seq_ids], dtype=np.int32)
        out.setflags(write=False)
        return out

    @computed_once
    def decode_step(self) -> bool:
        """True when every row is a sequence set of its own (one token per sequence): a decode
        step, not a prompt chunk (computed once)."""
        ids = self.token_seq_ids
        return len(set(ids)) == len(ids)

    @computed_once
    def seq_ids(self) -> tuple[int, ...]:
        """Every sequence id in the ubatch, ascending (llama.cpp's ``seq_id_unq``)."""
        return tuple(sorted({s for ids in self.token_seq_ids for s in ids}))

    @property
    def n_seqs_unq(self) -> int:
        return len(self.seq_ids)

    @property
    def shape_str(self) -> str:
        """``n_seqs x n_seq_tokens`` as llama.cpp writes it (``simple``: ``1xN``)."""
        if not self.equal_seqs:
            return f"1x{self.n_tokens}"
        return f"{self.n_seqs}x{self.n_seq_tokens}"

    def __repr__(self) -> str:
        pad = f", {self.n_pad} pad" if self.n_pad else ""
        return f"UBatch({self.mode} {self.shape_str}, seqs {list(self.seq_ids)}{pad})"


class SplitState:
    """llama.cpp's split bookkeeping for one batch: which tokens are used, and the tokens
    of every distinct sequence set in batch order (``seq_set_map``)."""

    def __init__(self, batch: Batch):
        self.batch = batch
        self.seq_set = batch.seq_sets  # (cached by the batch, like seq_set_map: read-only here)
        self.primary = [ids[0] for ids in batch.seq_ids]
        self.seq_set_map: dict[frozenset[int], tuple[int, ...]] = batch.seq_set_tokens
        self.used = np.zeros(batch.n_tokens, dtype=bool)
        self._set_arrays: dict[frozenset[int], np.ndarray] = {}
        # per sequence set: a position in its token list before which every token is used (tokens
        # never become unused, so it stays true). split_equal starts its search there instead of
        # at 0, as llama.cpp's loop does: from 0 that loop is quadratic in a set's tokens (64
        # sequences of 4096 prompt tokens in 512-token ubatches: 67M steps, 14 s in Python)
        self.cursor: dict[frozenset[int], int] = {}

    @property
    def n_used(self) -> int:
        return int(self.used.sum())

    def set_tokens(self, seq_set: frozenset[int]) -> np.ndarray:
        """int64 token indices of ``seq_set`` in batch order (``seq_set_map`` as an array, cached)."""
        if seq_set not in self._set_arrays:
            self._set_arrays[seq_set] = np.array(self.seq_set_map[seq_set], dtype=np.int64)
        return self._set_arrays[seq_set]

    def first_unused(self) -> int:
        free = np.flatnonzero(~self.used)
        return int(free[0]) if free.size else -1

    def make(self, mode: str, idxs: list[int], n_seqs: int, equal_seqs: bool) -> UBatch:
        b = self.batch
        arr = np.array(idxs, dtype=np.int64)
        run = arr.size > 0 and bool((np.diff(arr) == 1).all())   # consecutive tokens: their ids are a slice
        seq_ids = b.seq_ids[idxs[0]:idxs[-1] + 1] if run else tuple(b.seq_ids[i] for i in idxs)
        return UBatch(mode, arr, b.positions[arr].astype(np.int32), seq_ids, n_seqs, equal_seqs)


def _refuse_coupled(state: SplitState, what: str) -> None:
    if state.batch.has_coupled:
        raise ValueError(f"{what} is not supported when the batch has coupled sequences "
                         "(tokens with several sequence ids); use unified KV (-kvu) and 'simple'")


def split_simple(state: SplitState, n_ubatch: int) -> UBatch | None:
    """Next ``n_ubatch`` unused tokens in batch order (``llama_batch_allocr::split_simple``)."""
    cur = state.first_unused()
    if cur < 0:
        return None
    idxs = []
    n = state.batch.n_tokens
    while True:
        idxs.append(cur)
        state.used[cur] = True
        cur += 1
        if cur >= n or len(idxs) >= n_ubatch:
            break
    return state.make("simple", idxs, len(idxs), False)


def split_equal(state: SplitState, n_ubatch: int, sequential: bool = True) -> UBatch | None:
    """``llama_batch_allocr::split_equal``, line for line.

    Sets are collected in batch order of their first unused token; with ``sequential`` a set
    is taken only if its primary id is the previous set's + 1. Note llama.cpp stops
    collecting only when it holds *more* than ``n_ubatch`` sets, so a batch of more than
    ``n_ubatch`` sequences gives a first ubatch of ``n_ubatch + 1`` tokens; this is kept.
    With ``sequential`` the sets come from :func:`_equal_sets_chain` (the same sets as the
    pass over every token, :func:`_equal_sets_scan`, in a few lookups).
    """
    if sequential:
        _refuse_coupled(state, "the sequential equal split")
    used = state.used
    cur_sets = _equal_sets_chain(state, n_ubatch) if sequential else _equal_sets_scan(state, n_ubatch, False)
    n_seqs = len(cur_sets)
    if n_seqs == 0:
        return None
    lists = [state.seq_set_map[cs] for cs in cur_sets]
    cur_idx = [state.cursor.get(cs, 0) for cs in cur_sets]
    for s in range(n_seqs):
        while used[lists[s][cur_idx[s]]]:
            cur_idx[s] += 1
    # llama.cpp's loop takes a token of every set a round, at least one round, and stops when a
    # set has none left or one more round would pass n_ubatch: so `rounds` rounds, each set's next
    # tokens in its list (after its cursor every token of a set is unused), taken as slices
    rounds = min(min(len(lists[s]) - cur_idx[s] for s in range(n_seqs)), max(1, n_ubatch // n_seqs))
    per_seq = [lists[s][cur_idx[s]:cur_idx[s] + rounds] for s in range(n_seqs)]
    idxs = [i for lst in per_seq for i in lst]
    used[idxs] = True
    for s in range(n_seqs):   # every token before the cursor is used now
        state.cursor[cur_sets[s]] = cur_idx[s] + rounds
    return state.make("equal", idxs, n_seqs, True)


def _equal_sets_scan(state: SplitState, n_ubatch: int, sequential: bool) -> list[frozenset[int]]:
    """split_equal's sets, collected as llama.cpp does: one pass over the unused tokens."""
    cur_sets: list[frozenset[int]] = []
    taken: set[int] = set()  # union of cur_sets: "overlaps no collected set" in O(|set|)
    last_seq_id = -1
    for i in np.flatnonzero(~state.used).tolist():
        add = taken.isdisjoint(state.seq_set[i])
        if sequential:
            add = add and (not cur_sets or state.primary[i] == last_seq_id + 1)
        if add:
            cur_sets.append(state.seq_set[i])
            taken.update(state.seq_set[i])
            last_seq_id = state.primary[i]
            if len(cur_sets) > n_ubatch:
                break
    return cur_sets


def _equal_sets_chain(state: SplitState, n_ubatch: int) -> list[frozenset[int]]:
    """The sets of :func:`_equal_sets_scan` with ``sequential`` on a batch without coupled
    tokens, without visiting every token: the pass takes the first unused token, then the
    first unused token after it of the next sequence id, and so on (any other token fails
    the ``primary == last + 1`` test), so each step looks up one sequence's tokens."""
    free = np.flatnonzero(~state.used)
    if not free.size:
        return []
    i = int(free[0])
    cur_sets = [state.seq_set[i]]
    nxt = state.primary[i] + 1
    while len(cur_sets) <= n_ubatch:
        key = frozenset((nxt,))
        if key not in state.seq_set_map:
            break
        toks = state.set_tokens(key)
        j = max(int(np.searchsorted(toks, i, side="right")), state.cursor.get(key, 0))
        while j < toks.size and state.used[toks[j]]:
            j += 1
        if j >= toks.size:
            break
        i = int(toks[j])
        cur_sets.append(key)
        nxt += 1
    return cur_sets


def split_seq(state: SplitState, n_ubatch: int) -> UBatch | None:
    """``llama_batch_allocr::split_seq``: tokens of the first unused token's sequence set and
    of its subsets, in batch order, up to ``n_ubatch``."""
    cur = state.first_unused()
    if cur < 0:
        return None
    if not state.batch.has_coupled:
        # every set is one sequence and its own only subset: the loop below takes the set's
        # unused tokens in batch order (none before ``cur``, the first unused token), up to
        # n_ubatch; the same without scanning the rest of the batch token by token
        toks = state.set_tokens(state.seq_set[cur])
        take = toks[~state.used[toks]][:n_ubatch]
        state.used[take] = True
        return state.make("seq", take.tolist(), 1, True)
    n = state.batch.n_tokens
    cur_set = state.seq_set[cur]
    idxs = []
    while True:
        idxs.append(cur)
        state.used[cur] = True
        if len(idxs) >= n_ubatch:
            break
        cur += 1
        while cur < n and (state.used[cur] or (cur_set & state.seq_set[cur]) != state.seq_set[cur]):
            cur += 1
        if cur == n:
            break
        cur_set = state.seq_set[cur]
    return state.make("seq", idxs, 1, True)


def split_padded(state: SplitState, n_ubatch: int) -> UBatch | None:
    """Equal-length rows by padding (llama.cpp RFC #15636 "pad_equal").

    Candidate sets: the single-sequence sets with unused tokens, by ascending id, starting
    at the smallest such id and running while ids stay consecutive (streams of a ubatch
    must be consecutive), at most ``n_ubatch`` of them. Unlike ``equal`` the batch order of
    the sequences does not matter, only their ids. For every prefix of ``k`` candidates the
    row length is ``L_k = min(longest remaining, n_ubatch // k)`` and it computes
    ``real_k = sum(min(remaining_i, L_k))`` real tokens and ``pad_k = k * L_k - real_k`` pads;
    its score is ``real_k - PADDED_PAD_WEIGHT * pad_k`` (weight 0.5). The largest ``k`` whose
    score is at least ``PADDED_KEEP_FRACTION`` (0.9) of the best score wins: taking more
    sequences together costs a little now and avoids ragged leftovers later (ten prompts of
    100 with ``n_ubatch`` 512 give 10x51 + 10x49, not 8x64 + ...). Each chosen sequence
    contributes ``min(remaining, L)`` real tokens; shorter ones are padded to ``L`` with pad
    rows whose positions continue the sequence.
    """
    _refuse_coupled(state, "the padded split")
    used = state.used
    remaining: dict[int, np.ndarray] = {}
    for cs in state.seq_set_map:
        c = state.cursor.get(cs, 0)   # every token of the set before it is used
        toks = state.set_tokens(cs)[c:]
        free = ~used[toks]
        if free.any():
            state.cursor[cs] = c + int(free.argmax())
            remaining[next(iter(cs))] = toks[free]
        else:
            state.cursor[cs] = c + toks.size
    if not remaining:
        return None
    s0 = min(remaining)
    cand = []
    while s0 + len(cand) in remaining and len(cand) < n_ubatch:
        cand.append(s0 + len(cand))
    # every prefix k = 1..len(cand) at once (numpy, [k, candidate]): row length L_k, real tokens
    # (each candidate's min(remaining, L_k), candidates past k left out) and pads
    rem = np.array([len(remaining[s]) for s in cand], dtype=np.int64)
    ks = np.arange(1, len(cand) + 1)
    Ls = np.minimum(np.maximum.accumulate(rem), n_ubatch // ks)
    inside = np.arange(len(cand))[None, :] < ks[:, None]
    reals = np.where(inside, np.minimum(rem[None, :], Ls[:, None]), 0).sum(axis=1)
    pads = ks * Ls - reals
    options = list(zip(ks.tolist(), Ls.tolist(), reals.tolist(), pads.tolist()))  # (k, L, real, pad)

    def score(o):
        return o[2] - PADDED_PAD_WEIGHT * o[3]
    best = max(score(o) for o in options)
    good = [o for o in options if score(o) >= PADDED_KEEP_FRACTION * best]
    k, L, _, _ = max(good, key=lambda o: (o[0], -o[3]))
    b = state.batch
    idxs: list[np.ndarray] = []
    pos: list[np.ndarray] = []
    sids: list[tuple[int, ...]] = []
    for s in cand[:k]:
        take = remaining[s][:L]
        used[take] = True
        last = int(b.positions[take[-1]])
        n_pad = L - len(take)
        if last + n_pad > INT32_MAX:
            raise ValueError(f"padded split: sequence {s} ends at position {last}; {n_pad} pad rows after it "
                             f"would pass the int32 maximum position {INT32_MAX} (use another split)")
        idxs += [take, np.full(n_pad, -1, dtype=np.int64)]
        pos += [b.positions[take].astype(np.int64), np.arange(last + 1, last + 1 + n_pad, dtype=np.int64)]
        sids.extend([(s,)] * L)
    return UBatch("padded", np.concatenate(idxs).astype(np.int64), np.concatenate(pos).astype(np.int32),
                  tuple(sids), k, True)


_SPLITTERS = {
    "simple": split_simple,
    "equal": lambda st, n: split_equal(st, n, sequential=True),
    "seq": split_seq,
    "padded": split_padded,
}


def check_n_ubatch(n_ubatch) -> int:
    """``n_ubatch`` as an int >= 1: a Python or numpy integer (``True`` and ``2.0`` are not
    ubatch sizes); ``ValueError`` naming it otherwise. Every splitter entry point checks with it."""
    n = as_int(n_ubatch, "n_ubatch")
    if n < 1:
        raise ValueError(f"n_ubatch must be >= 1, got {n}")
    return n


def split_ubatches(batch: Batch, n_ubatch: int, mode: str = "equal") -> list[UBatch]:
    """Split ``batch`` into ubatches of at most ``n_ubatch`` rows (pads included).

    mode  one of ``simple``, ``equal``, ``seq``, ``padded`` (see module doc). ``auto`` is
          decided per batch one layer up, by ``auto.py`` (``choose_split``, or its
          ``split_ubatches``, which takes every mode and is what ``ggml_attn.graph`` exports);
          this module knows nothing of it.
    Raises ``ValueError`` for ``auto``, an unknown mode, an ``n_ubatch`` that is not an integer
    >= 1 (:func:`check_n_ubatch`), coupled sequences
    with a per-stream mode, or when the splitter cannot place every token.
    """
    n_ubatch = check_n_ubatch(n_ubatch)
    if mode == "auto":
        raise ValueError("split mode 'auto' is chosen per batch by ggml_attn.graph.auto "
                         "(choose_split or auto.split_ubatches), not by split.split_ubatches")
    if mode not in _SPLITTERS:
        raise ValueError(f"unknown split mode {mode!r}; expected one of {MODES}")
    if batch.n_tokens == 1 and not (batch.has_coupled and mode in _REFUSE_COUPLED):
        return [_one_token(batch, mode)]
    return _split_all(batch, n_ubatch, mode)


def _one_token(batch: Batch, mode: str) -> UBatch:
    """The one ubatch every splitter makes of a one-token batch (a decode step of one
    sequence), without their bookkeeping: row 0 is token 0; one sequence set of one row."""
    return UBatch(mode, np.zeros(1, dtype=np.int64), batch.positions[:1].astype(np.int32),
                  batch.seq_ids[:1], 1, mode != "simple")


def _split_all(batch: Batch, n_ubatch: int, mode: str) -> list[UBatch]:
    """``mode``'s splitter, called until every token is placed."""
    state = SplitState(batch)
    fn = _SPLITTERS[mode]
    out = []
    while True:
        ub = fn(state, n_ubatch)
        if ub is None:
            break
        out.append(ub)
    if state.n_used < batch.n_tokens:
        raise ValueError(f"split {mode!r} placed {state.n_used} of {batch.n_tokens} tokens")
    return out


def bucket_rows(n: int) -> int:
    """The row count a ubatch of ``n`` rows is padded to where ubatches are bucketed
    (:func:`pad_to_bucket`): a power of two up to 4, a multiple of 8 up to 64, of 16 up to 256, of
    32 up to 1024, then of 64 -- at most 7 pad rows where the rows are a decode step's few (their
    matmuls read the same weights); past 64 (prompt ubatches, whose matmuls grow with their rows)
    at most 15 up to 256 rows (23% at 65), 31 up to 1024 (12% at 257), 63 past (6%)."""
    n = as_int(n, "n")
    if n < 1:
        raise ValueError(f"a ubatch has at least one row, got {n}")
    if n <= 4:
        return 1 << (n - 1).bit_length()
    step = 8 if n <= 64 else 16 if n <= 256 else 32 if n <= 1024 else 64
    return -(-n // step) * step


def pad_to_bucket(ub: UBatch, n_seq_max: int, next_pos, limit: int) -> UBatch:
    """``ub`` with pad rows up to :func:`bucket_rows` of its rows (at most ``limit`` rows, and not
    past it: the ubatch size), so that a server's steps -- a different number of generating
    sequences and prompt tokens each -- fall into a few graph structures (``build.graph_key``)
    instead of one per row count. A decode step (one row per sequence) stays one: each pad row is a
    sequence of its own, an id of ``0 .. n_seq_max - 1`` not in the ubatch, at its next position
    (``next_pos(seq_id)``: the cache's when the batch was split -- an earlier ubatch of the same
    batch may have placed that sequence there since: harmless, a pad cell is masked from every
    row and freed as a cell, whatever its position); with too few such ids it is not padded. Another ubatch's
    pad rows continue its last row's sequence. Pad rows are ``token_idx`` -1 (the cache and the
    mask keep them from every real row and free their cells after the ubatch, as ``padded``'s).
    Unchanged: a ubatch already at its bucket, one with coupled tokens, one of sequence sets of
    several rows (``equal`` / ``padded``'s prompt ubatches), or one whose bucket passes ``limit``."""
    n = ub.n_tokens
    k = min(bucket_rows(n), max(n, int(limit))) - n
    if k <= 0 or ub.n_seqs != n or any(len(ids) != 1 for ids in ub.token_seq_ids) \
            or (ub.equal_seqs and not ub.decode_step):
        return ub   # (sets of several rows each, equal / padded's: their shape stays)
    if ub.decode_step:
        used = set(ub.seq_ids)
        ids, pos = [], []
        for s in range(int(n_seq_max)):
            if len(ids) == k:
                break
            p = int(next_pos(s)) if s not in used else INT32_MAX + 1
            if p <= INT32_MAX:   # (a sequence at the last position takes none)
                ids.append(s)
                pos.append(p)
        if len(ids) < k:
            return ub
    else:
        last = ub.token_seq_ids[-1][0]
        p0 = int(ub.positions[[i for i, ids in enumerate(ub.token_seq_ids) if ids[0] == last]].max()) + 1
        if p0 + k - 1 > INT32_MAX:
            return ub
        ids, pos = [last] * k, list(range(p0, p0 + k))
    return UBatch(ub.mode, np.concatenate([ub.token_idx, np.full(k, -1, dtype=np.int64)]),
                  np.concatenate([ub.positions, np.asarray(pos, dtype=np.int32)]),
                  ub.token_seq_ids + tuple((s,) for s in ids), n + k, ub.equal_seqs, ub.reason)
