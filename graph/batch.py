"""A batch of tokens: ids, positions and the sequence ids each token belongs to.

This module knows nothing about the KV cache or kernels. It mirrors the input side of
llama.cpp's ``llama_batch`` / ``llama_batch_allocr`` (src/llama-batch.cpp):

* every token has a position and one or more sequence ids; the first id is its
  *primary* id (llama.cpp's ``seq_id[i][0]``);
* a token with several ids is shared by ("couples") those sequences;
* :func:`validate_batch` runs llama.cpp's consistency checks against the state of a
  cache (positions must continue each sequence; ids below ``n_seq_max``; coupled
  sequences are refused when each sequence has its own KV stream).

All arrays are 1-D numpy arrays indexed by the token's place in the batch.

Bounds, as llama.cpp's types: token ids and positions are int32 (``llama_token``,
``llama_pos``): 0 .. 2**31-1; sequence ids are below :data:`MAX_SEQ` = 256 (LLAMA_MAX_SEQ) in
any cache. A value outside these bounds, or one that is not an integer (a float with a
fraction, NaN, a bool, a string), raises ``ValueError`` naming the argument -- never truncated
or wrapped.
"""
from __future__ import annotations

import math
from collections import abc
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

__all__ = ["Batch", "validate_batch", "MAX_SEQ", "INT32_MAX", "as_int", "int32_array", "computed_once"]

MAX_SEQ = 256            # llama.cpp's LLAMA_MAX_SEQ: sequences a cache may serve
INT32_MAX = 2**31 - 1    # largest token id / position (llama_token and llama_pos are int32)
_SMALL = 16              # arrays up to this size are checked in Python (cheaper than numpy's reductions)


class computed_once:
    """``functools.cached_property`` without its lock (Python 3.11 takes one on every first
    access, a few microseconds per decode step): the value goes to the instance's
    ``__dict__`` (frozen dataclasses included), which later reads find first."""

    def __init__(self, fn):
        self.fn, self.name, self.__doc__ = fn, fn.__name__, fn.__doc__

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.fn(obj)
        return value


def as_int(value, name: str, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` as a Python int. ValueError naming ``name`` when it is not an integer (Python
    or numpy int; bools, floats and strings are refused) or outside ``[lo, hi]``."""
    if type(value) is int:  # the usual case, first (bool is not int here)
        v = value
    elif isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    else:
        v = int(value)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(f"{name} = {v} is outside [{lo if lo is not None else '-inf'}, "
                         f"{hi if hi is not None else 'inf'}]")
    return v


def _min(a: np.ndarray):
    """``a.min()`` of a non-empty array; in Python for a few values."""
    return min(a.reshape(-1).tolist()) if a.size <= _SMALL else a.min()


def int32_array(values, name: str, lo: int = 0, hi: int = INT32_MAX) -> np.ndarray:
    """1-D int32 array of ``values`` (ints, or floats with integral values: converted exactly).
    ValueError naming ``name[i]`` for the first value that is not an integer or is outside
    ``[lo, hi]``."""
    a = np.asarray(values)
    if a.dtype == object:  # Python ints beyond 64 bits, mixed types
        return np.array([as_int(x, f"{name}[{i}]", lo, hi) for i, x in enumerate(a.reshape(-1))],
                        dtype=np.int32)
    a = a.reshape(-1)
    if a.dtype == bool or a.dtype.kind not in "iuf":
        raise ValueError(f"{name} must be integers, got dtype {a.dtype}")
    if a.dtype.kind == "f":
        bad = ~np.isfinite(a) | (np.floor(a) != a)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"{name}[{i}] = {a[i]!r} is not an integer")
    if a.dtype.kind != "f" and a.shape[0] <= _SMALL:  # a few values (a decode step): Python's min/max
        v = a.tolist()
        if not v or (lo <= min(v) and max(v) <= hi):
            return a.astype(np.int32)
    out_of = (a < lo) | (a > hi)
    if out_of.any():
        i = int(np.argmax(out_of))
        v = int(a[i]) if a.dtype.kind != "f" else a[i]
        raise ValueError(f"{name}[{i}] = {v} is outside [{lo}, {hi}] (int32, as llama.cpp)")
    return a.astype(np.int32)


@dataclass(frozen=True, eq=False)
class Batch:
    """Tokens in batch order.

    tokens     int32 ``(n_tokens,)`` token ids (opaque to this package).
    positions  int32 ``(n_tokens,)`` position of each token in its sequence(s).
    seq_ids    tuple of ``n_tokens`` tuples of ints: the sequence ids of each token,
               primary id first, no repeats.
    """

    tokens: np.ndarray
    positions: np.ndarray
    seq_ids: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        tokens = int32_array(self.tokens, "tokens")
        positions = np.asarray(self.positions)
        if positions.dtype.kind in "iu" and positions.size and _min(positions) < 0:
            i = int(np.argmin(positions))
            raise ValueError(f"positions[{i}] = {int(positions[i])}: token {i} has a negative position")
        positions = int32_array(positions, "positions")
        seq_ids = tuple(tuple(as_int(s, f"seq_ids[{i}]") for s in ids) for i, ids in enumerate(self.seq_ids))
        n = tokens.shape[0]
        if n == 0:
            raise ValueError("a batch needs at least one token (n_tokens = 0)")
        if positions.shape[0] != n or len(seq_ids) != n:
            raise ValueError(
                f"tokens ({n}), positions ({positions.shape[0]}) and seq_ids ({len(seq_ids)}) "
                "must have one entry per token")
        for i, ids in enumerate(seq_ids):
            if not ids:
                raise ValueError(f"token {i} has no sequence id")
            if len(set(ids)) != len(ids):
                raise ValueError(f"token {i} lists a sequence id twice: seq_ids = {ids}")
            if min(ids) < 0:
                raise ValueError(f"token {i} has a negative sequence id: seq_ids = {ids}")
        tokens.setflags(write=False)
        positions.setflags(write=False)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "positions", positions)
        object.__setattr__(self, "seq_ids", seq_ids)

    # ------------------------------------------------------------------ views
    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @computed_once
    def primary_seq_ids(self) -> np.ndarray:
        """int32 ``(n_tokens,)``: the first sequence id of every token (computed once, read-only)."""
        out = np.array([ids[0] for ids in self.seq_ids], dtype=np.int32)
        out.setflags(write=False)
        return out

    @computed_once
    def seq_sets(self) -> tuple[frozenset[int], ...]:
        """The set of sequence ids of every token (llama.cpp's ``seq_set``; computed once)."""
        return tuple(frozenset(ids) for ids in self.seq_ids)

    @computed_once
    def seq_set_tokens(self) -> dict[frozenset[int], tuple[int, ...]]:
        """Token indices of every distinct sequence set, in batch order, sets in order of first
        appearance (llama.cpp's ``seq_set_map``; computed once, shared by every split of the
        batch -- do not modify)."""
        if not self.has_coupled:   # one id a token: keyed by the id, one set made a sequence
            by_id: dict[int, list[int]] = {}
            for i, ids in enumerate(self.seq_ids):
                by_id.setdefault(ids[0], []).append(i)
            return {frozenset((s,)): tuple(v) for s, v in by_id.items()}
        out: dict[frozenset[int], list[int]] = {}
        for i, s in enumerate(self.seq_sets):
            out.setdefault(s, []).append(i)
        return {s: tuple(v) for s, v in out.items()}

    @property
    def unique_seq_ids(self) -> tuple[int, ...]:
        """Every sequence id used in the batch, ascending."""
        return tuple(sorted({s for ids in self.seq_ids for s in ids}))

    @computed_once
    def has_coupled(self) -> bool:
        """True when some token belongs to more than one sequence."""
        return any(len(ids) > 1 for ids in self.seq_ids)

    def seq_token_counts(self) -> dict[int, int]:
        """Number of tokens of each sequence id (a shared token counts for each of its ids)."""
        out: dict[int, int] = {}
        for ids in self.seq_ids:
            for s in ids:
                out[s] = out.get(s, 0) + 1
        return out

    def seq_pos_range(self, seq_id: int) -> tuple[int, int]:
        """(min, max) position of ``seq_id`` in the batch; (-1, -1) when absent."""
        pos = [int(p) for p, ids in zip(self.positions, self.seq_ids) if seq_id in ids]
        return (min(pos), max(pos)) if pos else (-1, -1)

    def __repr__(self) -> str:
        counts = self.seq_token_counts()
        body = ", ".join(f"{s}:{counts[s]}" for s in sorted(counts))
        return f"Batch(n_tokens={self.n_tokens}, tokens per seq {{{body}}})"

    # ----------------------------------------------------------- constructors
    @classmethod
    def from_sequences(cls, token_lists: Sequence[Sequence[int]], seq_ids: Sequence[int] | None = None,
                       start_pos: int | Sequence[int] | Mapping[int, int] | None = None) -> "Batch":
        """Lay out ``token_lists[j]`` (the tokens of sequence ``seq_ids[j]``) one sequence
        after another, in the given order.

        seq_ids    default ``0 .. len(token_lists)-1``; must be distinct.
        start_pos  first position of each sequence: one int for all, one per sequence
                   (same order as ``seq_ids``), a mapping seq id -> position, or None
                   for 0 (use :meth:`KVCache.next_positions` to continue a cache).
        """
        n_seq = len(token_lists)
        if n_seq == 0:
            raise ValueError("from_sequences needs at least one sequence")
        ids = list(range(n_seq)) if seq_ids is None else [as_int(s, f"seq_ids[{j}]", 0) for j, s in enumerate(seq_ids)]
        if len(ids) != n_seq:
            raise ValueError(f"got {n_seq} token lists but {len(ids)} seq_ids")
        _distinct(ids)
        return cls._laid_out(token_lists, ids, _start_positions(start_pos, ids), True)

    @classmethod
    def _laid_out(cls, token_lists, ids: list[int], starts: list[int], check_tokens: bool) -> "Batch":
        """from_sequences' layout of checked ``ids`` (distinct ints >= 0, one per list) and
        ``starts`` (ints in 0 .. INT32_MAX); the token ids are checked as __post_init__ would
        when ``check_tokens`` (else they are known int32 values)."""
        tokens, positions, sids = [], [], []
        for j, (toks, s) in enumerate(zip(token_lists, ids)):
            toks = list(toks)
            if not toks:
                raise ValueError(f"sequence {s} (entry {j}) has no tokens")
            if check_tokens and any(isinstance(t, (bool, np.bool_)) for t in toks):
                raise ValueError(f"sequence {s} (entry {j}): {next(t for t in toks if isinstance(t, (bool, np.bool_)))!r}"
                                 f" is a bool, not a token id")
            if starts[j] + len(toks) - 1 > INT32_MAX:
                raise ValueError(f"start_pos {starts[j]} of sequence {s} + {len(toks)} tokens passes the int32 "
                                 f"maximum position {INT32_MAX}")
            tokens.extend(toks)
            positions.extend(range(starts[j], starts[j] + len(toks)))
            sids.extend([(s,)] * len(toks))
        if cls is not Batch:
            return cls(np.array(tokens), np.array(positions), tuple(sids))
        # what __post_init__ would check of positions (0 .. INT32_MAX) and sequence ids (one
        # per token, an int >= 0) holds by construction
        tokens = int32_array(np.array(tokens), "tokens") if check_tokens else np.array(tokens, dtype=np.int32)
        return cls._checked(tokens, np.array(positions, dtype=np.int32), tuple(sids))

    def view(self, i: int, j: int) -> "Batch":
        """Tokens ``i:j`` (0 <= i < j <= n_tokens) as a batch of their own, sharing this one's
        read-only arrays: every check of ``__post_init__`` holds for a slice of a batch that passed
        them (a subclass is built through its constructor)."""
        if not 0 <= i < j <= self.n_tokens:
            raise ValueError(f"a view of tokens {i}:{j} of a batch of {self.n_tokens}")
        if type(self) is not Batch:
            return type(self)(self.tokens[i:j], self.positions[i:j], self.seq_ids[i:j])
        return Batch._checked(self.tokens[i:j], self.positions[i:j], self.seq_ids[i:j])

    @classmethod
    def _checked(cls, tokens: np.ndarray, positions: np.ndarray, seq_ids: tuple) -> "Batch":
        """The batch of arrays that passed every check of ``__post_init__`` (int32, one entry
        per token, ids tuples of ints), without checking them again (taken, made read-only)."""
        b = object.__new__(cls)
        tokens.setflags(write=False)
        positions.setflags(write=False)
        object.__setattr__(b, "tokens", tokens)
        object.__setattr__(b, "positions", positions)
        object.__setattr__(b, "seq_ids", seq_ids)
        return b

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], seq_ids: Sequence[int] | None = None,
                     start_pos: int | Sequence[int] | Mapping[int, int] | None = None) -> "Batch":
        """``lengths[j]`` tokens of sequence ``seq_ids[j]``, laid out sequence by sequence
        in the given order. Token ids are synthetic (the position modulo 32000).
        ``seq_ids`` and ``start_pos`` as in :meth:`from_sequences`."""
        lengths = [as_int(n, f"lengths[{j}]") for j, n in enumerate(lengths)]
        for j, n in enumerate(lengths):
            if n <= 0:
                raise ValueError(f"lengths[{j}] = {n}: every sequence needs at least one token")
        ids = list(range(len(lengths))) if seq_ids is None else [as_int(s, f"seq_ids[{j}]", 0) for j, s in enumerate(seq_ids)]
        if len(ids) != len(lengths):
            raise ValueError(f"got {len(lengths)} lengths but {len(ids)} seq_ids")
        starts = _start_positions(start_pos, ids)
        if not lengths:
            raise ValueError("from_sequences needs at least one sequence")
        _distinct(ids)
        if cls is Batch and all(n == 1 for n in lengths):  # a decode step: what _laid_out makes of it
            return cls._checked(np.array([p % 32000 for p in starts], dtype=np.int32),
                                np.array(starts, dtype=np.int32), tuple((s,) for s in ids))
        token_lists = [[(p0 + t) % 32000 for t in range(n)] for n, p0 in zip(lengths, starts)]
        return cls._laid_out(token_lists, ids, starts, False)


def _distinct(ids: list[int]) -> None:
    if len(set(ids)) != len(ids):
        raise ValueError(f"seq_ids must be distinct, got {ids}")


def _start_positions(start_pos, ids: list[int]) -> list[int]:
    if start_pos is None:
        return [0] * len(ids)
    if isinstance(start_pos, (int, np.integer, bool, np.bool_, float, np.floating, str)):
        return [as_int(start_pos, "start_pos", 0, INT32_MAX)] * len(ids)
    if isinstance(start_pos, abc.Mapping):  # (typing.Mapping's isinstance is the same, slower)
        return [as_int(start_pos.get(s, 0), f"start_pos[seq {s}]", 0, INT32_MAX) for s in ids]
    starts = [as_int(p, f"start_pos[{j}]", 0, INT32_MAX) for j, p in enumerate(start_pos)]
    if len(starts) != len(ids):
        raise ValueError(f"start_pos has {len(starts)} entries for {len(ids)} sequences")
    return starts


def validate_batch(batch: Batch, n_seq_max: int, *, unified: bool,
                   seq_pos_min: Callable[[int], int] | None = None,
                   seq_pos_max: Callable[[int], int] | None = None) -> None:
    """llama.cpp's ``llama_batch_allocr::init`` checks; raises ``ValueError`` naming the bad value.

    n_seq_max    number of sequences the cache serves; ids must be below it.
    unified      False when each sequence has its own KV stream: coupled sequences
                 (a token with several ids) are refused there.
    seq_pos_min/seq_pos_max  the cache's smallest / largest position of a sequence, -1 when
                 it holds none (``KVCache.seq_pos_min/max``); None = empty cache.
    Checks: ids in ``[0, n_seq_max)``; a sequence the cache already holds continues at
    ``seq_pos_max + 1``; positions of a sequence are consecutive and increasing in batch
    order; the sequence sets of a sequence's tokens shrink along the batch (a shared prompt,
    then its own tokens: llama.cpp's "partial sequence sub-sets" rule, which its own code
    never triggers); coupled sequences have the same positions in the cache.
    """
    n_seq_max = as_int(n_seq_max, "n_seq_max")
    if not 0 < n_seq_max <= MAX_SEQ:
        raise ValueError(f"n_seq_max={n_seq_max} must be in [1, {MAX_SEQ}] (llama.cpp's LLAMA_MAX_SEQ)")
    pmax = seq_pos_max or (lambda s: -1)
    one = _one_token_per_sequence(batch)
    if one is not None and max(one) < n_seq_max:
        # a decode step: one token per sequence, no coupled tokens: only the continuation
        # check can fail (the loops below find nothing else), in the same order
        for s, p0 in zip(one, batch.positions.tolist()):
            x = pmax(s)
            if x >= 0 and p0 != x + 1:
                raise _not_continued(s, x, p0)
        return
    if not batch.has_coupled:   # one id a token (a prompt): the checks below without their token loop
        first = _uncoupled_first_positions(batch, n_seq_max)
        if first is not None:
            for s, p0 in first.items():
                x = pmax(s)
                if x >= 0 and p0 != x + 1:
                    raise _not_continued(s, x, p0)
            return
    for i, ids in enumerate(batch.seq_ids):
        for s in ids:
            if s >= n_seq_max:
                raise ValueError(f"invalid seq_id[{i}] = {s} >= n_seq_max = {n_seq_max}")
    if not unified and batch.has_coupled:
        i = next(i for i, ids in enumerate(batch.seq_ids) if len(ids) > 1)
        raise ValueError(
            f"token {i} belongs to sequences {batch.seq_ids[i]}: coupled sequences need one KV "
            "stream for all sequences; use unified KV (-kvu, KVCache(unified=True))")

    pmin = seq_pos_min or (lambda s: -1)
    seq_sets = batch.seq_sets
    cur_set: dict[int, frozenset[int]] = {}
    last_pos: dict[int, int] = {}
    first_pos: dict[int, int] = {}
    for i, (p, ids) in enumerate(zip(batch.positions.tolist(), batch.seq_ids)):
        for s in ids:
            prev = cur_set.get(s, seq_sets[i])
            if not seq_sets[i] <= prev:
                raise ValueError(
                    f"sequence {s} belongs to incompatible sequence sets: token {i} has {sorted(seq_sets[i])} "
                    f"after {sorted(prev)} (a sequence may only leave a shared prompt, not join another)")
            cur_set[s] = seq_sets[i]
            if s in last_pos and p <= last_pos[s]:
                raise ValueError(
                    f"sequence {s}: position {p} of token {i} does not increase (previous {last_pos[s]})")
            if s in last_pos and p != last_pos[s] + 1:
                raise ValueError(
                    f"sequence {s} positions are not continuous: token {i} has {p} after {last_pos[s]}")
            first_pos.setdefault(s, p)
            last_pos[s] = p
    for s, p0 in first_pos.items():
        x = pmax(s)
        if x >= 0 and p0 != x + 1:
            raise _not_continued(s, x, p0)
    for i, ids in enumerate(batch.seq_ids):
        for s1 in ids[1:]:
            s0 = ids[0]
            if pmin(s0) != pmin(s1) or pmax(s0) != pmax(s1):
                raise ValueError(
                    f"sequence {s1} is coupled to {s0} in the batch (token {i}) but they have "
                    "diverged in the cache")


def _one_token_per_sequence(batch: Batch) -> list[int] | None:
    """The sequence id of every token when each token has one id and no id repeats (a decode
    step), else None."""
    if batch.has_coupled:
        return None
    prim = _primary_ids(batch) if batch.n_tokens > _SMALL else None
    one = [x[0] for x in batch.seq_ids] if prim is None else prim.tolist()
    return one if len(set(one)) == len(one) else None


def _primary_ids(batch: Batch) -> np.ndarray | None:
    """``batch.primary_seq_ids``, or None where an id does not fit int32 (no valid id is that
    large: the token loops name it)."""
    try:
        return batch.primary_seq_ids
    except OverflowError:
        return None


def _uncoupled_first_positions(batch: Batch, n_seq_max: int) -> dict[int, int] | None:
    """For a batch whose tokens have one sequence id each: ``{sequence: its first position}`` in
    batch order of first appearance when every id is below ``n_seq_max`` and each sequence's
    positions go up by one along the batch (validate_batch's token loop would find nothing), else
    None (that loop then names the first bad token). Sorted by id (stable), not looped over."""
    seq = _primary_ids(batch)
    if seq is None or int(seq.max()) >= n_seq_max:
        return None
    order = np.argsort(seq, kind="stable")   # each sequence's tokens together, in batch order
    ids, pp = seq[order], batch.positions[order].astype(np.int64)
    starts = np.flatnonzero(np.concatenate(([True], ids[1:] != ids[:-1])))
    steps = pp[1:] - pp[:-1]
    steps[starts[1:] - 1] = 1   # (across a run's end: no rule)
    if (steps != 1).any():
        return None
    by_batch = starts[np.argsort(order[starts])]
    return dict(zip(ids[by_batch].tolist(), pp[by_batch].tolist()))


def _not_continued(s: int, x: int, p0: int) -> ValueError:
    return ValueError(f"sequence {s}: the cache ends at position X = {x} but the batch starts at Y = {p0}; "
                      "positions must continue the cache (Y = X + 1)")
