"""The cells of a KV cache's streams (llama.cpp's ``src/llama-kv-cells.h``): for every cell a
position (-1 when empty), a set of sequence ids and a pad flag; a head per stream (where the
next search starts). :class:`KVCells` is host bookkeeping only (numpy); ``kv_cache.KVCache``
owns one and adds the geometry, the ubatch layout checks and the K/V storage.

Every change goes through :meth:`KVCells.touch` first, which

* records the cells' state in the open transaction (:meth:`KVCells.transaction`: a failed
  block gets every cell and head back),
* forgets the remembered answers of whole-stream queries (:attr:`KVCells.memo`:
  ``used_max_p1``, ``n_used``, ``seq_pos``, and the cache's slot searches), and
* logs the cells in :attr:`KVCells.changes` (for readers that keep derived data: ``mask_step.py``).

Arrays, numpy order: ``pos`` int32 ``(n_stream, kv_size)``, ``seqs`` bool ``(n_stream, kv_size,
n_seq_max)`` (dense: ``n_seq_max`` is capped by the cache), ``pad`` bool ``(n_stream, kv_size)``.
Sequence ids and positions reaching these methods were checked by the cache.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from .batch import INT32_MAX, as_int
from .kv_changes import CellChanges

__all__ = ["KVCells", "SMALL", "ubatch_streams"]

SMALL = 16   # ubatches up to this many rows are checked and accounted in Python
_FILL_UPDATE_MAX = 256   # ubatches up to this many rows update the remembered answers (answers_after_fill)
_NEAR = 256   # cells past a stream's head searched first for a ubatch's empty cells


class KVCells:
    """Positions, sequence sets, pad flags and heads of ``n_stream`` streams of ``kv_size``
    cells serving ``n_seq_max`` sequences (module docstring)."""

    def __init__(self, n_stream: int, kv_size: int, n_seq_max: int):
        self.n_stream, self.kv_size, self.n_seq_max = int(n_stream), int(kv_size), int(n_seq_max)
        self.pos = np.full((self.n_stream, self.kv_size), -1, dtype=np.int32)
        self.seqs = np.zeros((self.n_stream, self.kv_size, self.n_seq_max), dtype=bool)
        self.pad = np.zeros((self.n_stream, self.kv_size), dtype=bool)
        self.head = [0] * self.n_stream
        self.journals: list[list] = []   # undo logs of the open transactions (innermost last)
        self.memo: dict = {}   # answers of whole-stream queries; emptied by every cell change
        self.changes = CellChanges()   # every cell change (mask_step.py keeps masks up to date from it)
        # seq_add moved cached positions: K rotated at the old ones (RoPE) is stale until those
        # cells are gone (no K-shift here); a real model refuses such a cache
        self.shifted = False

    # ---------------------------------------------------------------- queries
    def used_max_p1(self, st: int) -> int:
        """One past the highest occupied cell of stream ``st`` (0 when empty)."""
        key = ("used_max_p1", st)
        got = self.memo.get(key)
        if got is None:
            occ = self.pos[st] >= 0
            last = occ.shape[0] - 1 - int(np.argmax(occ[::-1]))  # the highest True, if any
            got = self.memo[key] = last + 1 if occ[last] else 0
        return got

    def n_used(self, st: int) -> int:
        key = ("n_used", st)
        got = self.memo.get(key)
        if got is None:
            got = self.memo[key] = int(np.count_nonzero(self.pos[st] >= 0))
        return got

    def seq_cells(self, st: int, seq_id: int) -> np.ndarray:
        """Cells of ``seq_id`` in stream ``st``, pads excluded, ascending."""
        return np.flatnonzero(self.seqs[st, :, seq_id] & ~self.pad[st])

    def seq_pos(self, st: int, seq_id: int, largest: bool) -> int:
        """The largest (``largest``) or smallest position of ``seq_id`` in stream ``st``, pads
        excluded; -1 when it has none. One masked reduction, remembered until a change."""
        key = ("seq_pos", seq_id, largest)
        got = self.memo.get(key)
        if got is None:
            has = self.seqs[st, :, seq_id] & ~self.pad[st]
            if largest:  # occupied cells hold positions >= 0, so -1 is "none"
                got = int(self.pos[st].max(where=has, initial=-1))
            else:
                got = int(self.pos[st].min(where=has, initial=INT32_MAX))
                if got == INT32_MAX and not has.any():
                    got = -1
            self.memo[key] = got
        return got

    def in_range(self, st: int, lo: int, hi: int) -> np.ndarray:
        """bool ``(kv_size,)``: cells of stream ``st`` with a position in ``[lo, hi)`` (int64 compare)."""
        p = self.pos[st].astype(np.int64)
        return (p >= lo) & (p < hi)

    def find_empty(self, st: int, n: int) -> np.ndarray | None:
        """int64 ``(n,)``: ``n`` empty cells of stream ``st`` as llama.cpp's non-contiguous search
        takes them -- from the head on (the head goes back to 0 when it is far past the used
        cells), wrapping around; None when the stream has fewer than ``n`` empty cells."""
        head = self.head[st]
        if head > self.n_used(st) + 2 * n:
            head = 0
        # the first n empty cells from head on, when the next cells hold them (the usual case:
        # the cells after the last ubatch); else the whole stream, wrapping around
        if n <= SMALL:  # the n cells at head, all empty: a decode step's cells
            run = self.pos[st, head:head + n].tolist()
            if len(run) == n and max(run) < 0:
                return np.arange(head, head + n, dtype=np.int64)
        near = np.flatnonzero(self.pos[st, head:head + max(_NEAR, 2 * n)] < 0)
        if near.shape[0] >= n:
            return (near[:n] + head).astype(np.int64)
        empty = np.flatnonzero(self.pos[st] < 0)           # ascending cell ids
        k = int(np.searchsorted(empty, head))
        free = np.concatenate((empty[k:], empty[:k]))   # from head on, then wrapped
        return free[:n].astype(np.int64) if free.shape[0] >= n else None

    # ---------------------------------------------------------------- changes
    def touch(self, st: int, cells) -> None:
        """Before cells of stream ``st`` change: their state into the open transaction, the
        remembered answers forgotten, the cells logged in :attr:`changes` (module docstring)."""
        self.memo.clear()
        self.changes.add(st, cells)
        if self.journals:
            cells = np.asarray(cells)
            if cells.dtype == bool:
                cells = np.flatnonzero(cells)
            cells = cells.astype(np.int64, copy=True)
            if cells.ndim == 1:  # an index array: the gathers are copies already
                self.journals[-1].append((st, cells, self.pos[st, cells], self.seqs[st, cells], self.pad[st, cells]))
            else:
                self.journals[-1].append((st, cells, self.pos[st, cells].copy(), self.seqs[st, cells].copy(),
                                          self.pad[st, cells].copy()))

    def fill(self, st: int, rows: np.ndarray, cells: np.ndarray, ub) -> None:
        """Cells ``cells`` of stream ``st`` take rows ``rows`` of ubatch ``ub`` (positions,
        sequence sets, pad flags); the head moves past the last cell."""
        self.touch(st, cells)
        if ub.n_tokens <= SMALL and cells.ndim == 1 and cells.shape[0] == rows.shape[0]:
            self._fill_few(st, rows.tolist(), cells.tolist(), ub)
            return
        self.pos[st, cells] = ub.positions[rows]
        self.seqs[st, cells] = False
        if ub.has_coupled:
            for r, c in zip(rows.tolist(), cells.tolist()):
                self.seqs[st, c, list(ub.token_seq_ids[r])] = True
        else:  # one sequence per row: one scatter
            self.seqs[st, cells, ub.primary_seq_ids[rows]] = True
        self.pad[st, cells] = ub.is_pad[rows]
        self.head[st] = int(cells[-1]) + 1

    def _fill_few(self, st: int, rows: list[int], cells: list[int], ub) -> None:
        """:meth:`fill`'s writes for a few rows, one cell at a time (cheaper than numpy's scatters
        for a handful of cells), in the same order: positions, sequence sets cleared, then set,
        pad flags; the stream head past the last cell."""
        pos, seqs, pad = self.pos, self.seqs, self.pad
        positions, token_idx, seq_ids = ub.positions.tolist(), ub.token_idx.tolist(), ub.token_seq_ids
        for r, c in zip(rows, cells):
            pos[st, c] = positions[r]
        for c in cells:
            seqs[st, c] = False
        for r, c in zip(rows, cells):
            for s in seq_ids[r]:
                seqs[st, c, s] = True
        for r, c in zip(rows, cells):
            pad[st, c] = token_idx[r] < 0
        self.head[st] = int(cells[-1]) + 1

    def answers_after_fill(self, rows_per, cells_per, ub) -> dict:
        """The remembered query answers as they will be once ``ub``'s rows ``rows_per[j]`` fill
        cells ``cells_per[j]`` of stream ``rows_per[j][0]``, when that is cheap to know: a
        ubatch of at most ``_FILL_UPDATE_MAX`` rows (a decode step of many sequences included)
        whose cells are all empty now (so no sequence loses a cell) and whose rows all have
        positions. Then each stream's used count grows by its cells, its used range reaches
        past its highest cell, and each sequence's position range takes in its non-pad rows'
        positions. Otherwise nothing (asked again)."""
        if not self.memo or ub.n_tokens > _FILL_UPDATE_MAX:
            return {}
        positions, token_idx = ub.positions.tolist(), ub.token_idx.tolist()
        if min(positions) < 0:
            return {}
        out = {k: v for k, v in self.memo.items() if k[0] in ("n_used", "used_max_p1", "seq_pos")}
        pos = self.pos
        for (st, rows), cells in zip(rows_per, cells_per):
            cl = cells.tolist()
            if len(set(cl)) != len(cl):
                return {}
            if len(cl) <= SMALL:
                if any(pos[st, c] >= 0 for c in cl):
                    return {}
            elif bool((pos[st, cells] >= 0).any()):
                return {}
            if ("n_used", st) in out:
                out[("n_used", st)] += len(cl)
            if ("used_max_p1", st) in out:
                out[("used_max_p1", st)] = max(out[("used_max_p1", st)], max(cl) + 1)
            for r in rows.tolist():
                if token_idx[r] < 0:  # a pad row: in no sequence's range
                    continue
                p = positions[r]
                for s in ub.token_seq_ids[r]:
                    hi, lo = ("seq_pos", int(s), True), ("seq_pos", int(s), False)
                    if hi in out:
                        out[hi] = max(out[hi], p)
                    if lo in out:
                        out[lo] = p if out[lo] == -1 else min(out[lo], p)
        return out

    def free(self, st: int, cells: np.ndarray) -> None:
        """Empty ``cells`` of stream ``st``; the head moves back to the first of them."""
        self.touch(st, cells)
        self.pos[st, cells] = -1
        self.seqs[st, cells] = False
        self.pad[st, cells] = False
        if cells.size:
            self.head[st] = min(self.head[st], int(cells.min()))

    def free_pads(self, streams, cells_per) -> int:
        """Free the pad cells among ``cells_per[j]`` of stream ``streams[j]``; returns how many.
        The remembered sequence positions stay (pads are in no sequence's range): a server's
        steps, each freeing its bucket pads, would otherwise scan every sequence's cells again
        at the next step's positions."""
        n, kept = 0, None
        for st, cells in zip(streams, cells_per):
            is_pad = self.pad[st, cells]
            if cells.shape[0] <= SMALL and not any(is_pad.tolist()):
                continue
            padc = cells[is_pad]
            if padc.size:
                kept = self._seq_answers() if kept is None else kept
                self.free(st, padc)
                n += int(padc.size)
        if kept is not None:
            self.memo.update(kept)
        return n

    def _seq_answers(self, but: int | None = None) -> dict:
        """The remembered ``seq_pos`` answers (of every sequence but ``but``)."""
        return {k: v for k, v in self.memo.items() if k[0] == "seq_pos" and k[1] != but}

    # --------------------------------------------------------- seq operations
    def seq_rm(self, st: int, seq_id: int, lo: int, hi: int) -> None:
        """Remove ``seq_id`` (every sequence when -1) from stream ``st``'s cells with a position
        in ``[lo, hi)``; a cell left with no sequence is freed."""
        inr = self.in_range(st, lo, hi)
        if seq_id == -1:
            self.free(st, np.flatnonzero(inr))
            return
        hit = inr & self.seqs[st, :, seq_id]
        kept = self._seq_answers(but=seq_id)   # (the other sequences keep every cell and position)
        self.touch(st, hit)
        self.seqs[st, hit, seq_id] = False
        self.free(st, np.flatnonzero(hit & ~self.seqs[st].any(axis=1)))
        self.memo.update(kept)

    def seq_cp(self, st: int, src: int, dst: int, lo: int, hi: int) -> None:
        """``dst`` shares ``src``'s cells of stream ``st`` with a position in ``[lo, hi)``."""
        hit = self.in_range(st, lo, hi) & self.seqs[st, :, src]
        self.touch(st, hit)
        self.seqs[st, hit, dst] = True

    def copy_stream(self, s0: int, s1: int, src: int, dst: int) -> None:
        """Stream ``s1`` emptied, then holding ``dst`` in the cells ``src`` has in stream ``s0``
        (positions and head as there; the caller copies the K/V)."""
        self.free(s1, np.arange(self.kv_size))
        have = self.seqs[s0, :, src] & ~self.pad[s0]
        self.touch(s1, have)
        self.pos[s1, have] = self.pos[s0, have]
        self.seqs[s1, have, dst] = True
        self.head[s1] = self.head[s0]

    def seq_keep(self, st: int, seq_id: int) -> None:
        """In stream ``st``, drop every sequence but ``seq_id``; cells left empty are freed."""
        has = self.seqs[st, :, seq_id].copy()
        others = np.flatnonzero(~has & (self.pos[st] >= 0))
        self.touch(st, has)
        self.seqs[st, has] = False
        self.seqs[st, has, seq_id] = True
        self.free(st, others)

    def seq_add(self, st: int, seq_id: int, lo: int, hi: int, shift: int) -> None:
        """Add ``shift`` to the positions of ``seq_id``'s cells of stream ``st`` in ``[lo, hi)``;
        a cell whose position drops below 0 is freed. ValueError (nothing changed) when one
        would pass the int32 maximum."""
        hit = self.in_range(st, lo, hi) & self.seqs[st, :, seq_id]
        new = self.pos[st, hit].astype(np.int64) + max(shift, -2 * (INT32_MAX + 1))
        if new.size and new.max() > INT32_MAX:
            raise ValueError(f"seq_add(seq_id={seq_id}): shift={shift} moves position {int(new.max()) - shift} "
                             f"to {int(new.max())}, past the int32 maximum {INT32_MAX}; nothing changed")
        self.touch(st, hit)
        self.shifted = self.shifted or bool(hit.any())
        self.pos[st, hit] = np.maximum(new, -1).astype(np.int32)
        neg = np.flatnonzero(hit & (self.pos[st] < 0))
        self.free(st, neg)
        self.head[st] = int(neg.min()) if neg.size else 0

    # ----------------------------------------------------------- transactions
    @contextmanager
    def transaction(self):
        """``with cells.transaction():`` -- if the block raises (any exception, Ctrl-C
        included), every cell it changed gets back its position, sequence set and pad flag,
        and every stream its head, and the undo steps recorded with :meth:`on_undo` run (in
        reverse order), before the exception propagates. Transactions nest: a failed inner
        block undoes only itself."""
        journal: list = []
        heads = list(self.head)
        self.journals.append(journal)
        try:
            yield self
        except BaseException:
            self.journals.pop()
            self.memo.clear()
            for entry in reversed(journal):
                if callable(entry):   # an undo step of the owner's (K/V of a stream)
                    entry()
                    continue
                st, cells, pos, seqs, pad = entry
                self.changes.add(st, cells)
                self.pos[st, cells] = pos
                self.seqs[st, cells] = seqs
                self.pad[st, cells] = pad
            self.head = heads
            raise
        else:
            self.journals.pop()
            if self.journals:  # the outer transaction can still undo this one
                self.journals[-1].extend(journal)

    def on_undo(self, fn) -> None:
        """Run ``fn()`` if the open transaction fails (nothing when none is open)."""
        if self.journals:
            self.journals[-1].append(fn)

    def snapshot(self):
        return self.pos.copy(), self.seqs.copy(), self.pad.copy(), list(self.head)

    def restore(self, snap) -> None:
        self.pos, self.seqs, self.pad, self.head = snap[0], snap[1], snap[2], list(snap[3])
        self.memo.clear()
        self.changes.reset()


def ubatch_streams(ub, n_seq_max: int, unified: bool) -> list[tuple[int, np.ndarray]]:
    """``(cache stream, ubatch rows)`` per ubatch stream of ``ub`` in a cache serving
    ``n_seq_max`` sequences, unified (one stream) or split (stream = sequence id); ValueError
    for an id out of range and, split, for a layout one stream per sequence cannot take
    (coupled tokens, unequal or non-consecutive sequences, rows out of order)."""
    if ub.n_tokens == 1:  # one row of valid ids (a decode step): its stream, nothing to check
        ids = ub.token_seq_ids[0]
        if all(type(s) is int and 0 <= s < n_seq_max for s in ids) and (unified or len(ids) == 1):
            return [(0 if unified else ids[0], np.arange(1))]
    try:  # every id a plain int in range: nothing to report (else the loop names the first bad one)
        ids = ub.seq_ids
        ok = all(type(s) is int for s in ids) and 0 <= ids[0] and ids[-1] < n_seq_max
    except TypeError:
        ok = False
    if not ok:
        for ids in ub.token_seq_ids:
            for s in ids:
                s = as_int(s, "seq_id")
                if not 0 <= s < n_seq_max:
                    raise ValueError(f"seq_id {s} out of range [0, {n_seq_max})")
    if unified:
        return [(0, np.arange(ub.n_tokens))]
    seq_unq = ub.seq_ids
    if ub.has_coupled:
        raise ValueError("a split (per-sequence stream) cache cannot store coupled tokens; "
                         "use unified KV (-kvu)")
    if ub.n_tokens % len(seq_unq):
        raise ValueError(f"split KV needs an equal number of rows per sequence; {ub!r} has "
                         f"{ub.n_tokens} rows for {len(seq_unq)} sequences")
    if list(seq_unq) != list(range(seq_unq[0], seq_unq[0] + len(seq_unq))):
        raise ValueError(f"split KV needs consecutive sequence ids in a ubatch, got {list(seq_unq)}")
    n_tps = ub.n_tokens // len(seq_unq)
    prim = ub.primary_seq_ids
    if ub.n_tokens <= SMALL:  # rows j*n_tps .. (j+1)*n_tps-1 are sequence seq_unq[j]
        ok = prim.tolist() == [s for s in seq_unq for _ in range(n_tps)]
    else:
        ok = np.array_equal(prim, np.repeat(np.asarray(seq_unq), n_tps))
    out = []
    for j, s in enumerate(seq_unq):
        rows = np.arange(j * n_tps, (j + 1) * n_tps)
        if not ok and not np.all(prim[rows] == s):
            raise ValueError(f"split KV needs the rows of sequence {s} at {rows[0]}..{rows[-1]}; "
                             f"{ub!r} has them elsewhere (use 'equal', 'seq' or 'padded')")
        out.append((s, rows))
    return out
