"""Which cells of a KV cache changed since a reader last looked (a change log).

``KVCache`` reports every cell whose position, sequence set or pad flag is about to change
(``KVCache._touch``, the rollback of a failed transaction) and every wholesale replacement of
its cell arrays (``KVCache._restore``). A reader that keeps something derived from the cells
(``mask_step.py``: the last decode step's visibility) takes a :meth:`CellChanges.mark` when it
builds it and later asks :meth:`CellChanges.since` which cells changed in between.

Cells are indices into one cache stream (numpy order ``pos[stream, cell]``). The log holds at
most :data:`LOG_CELLS` cells; past that it starts over and every earlier mark becomes invalid
(the reader rebuilds from scratch), so a cache nobody reads from keeps a bounded log.
"""
from __future__ import annotations

import numpy as np

__all__ = ["CellChanges", "LOG_CELLS"]

LOG_CELLS = 1 << 16  # cells logged before the log starts over (~1000 decode steps of 64 rows)


class CellChanges:
    """An append-only log of ``(stream, int64 cells (n,))`` entries with an epoch; a mark is
    ``(epoch, entries so far)``."""

    __slots__ = ("_epoch", "_log", "_n_cells")

    def __init__(self) -> None:
        self._epoch = 0
        self._log: list[tuple[int, np.ndarray]] = []
        self._n_cells = 0

    def add(self, st: int, cells) -> None:
        """Record that cells of stream ``st`` change: an index array or a bool ``(kv_size,)``
        array (copied: the caller may reuse its array)."""
        cells = np.asarray(cells)
        cells = np.flatnonzero(cells) if cells.dtype == bool else cells.astype(np.int64).reshape(-1)
        if not cells.size:
            return
        self._n_cells += int(cells.size)
        if self._n_cells > LOG_CELLS:
            self.reset()
            return
        self._log.append((int(st), cells))

    def reset(self) -> None:
        """Everything may have changed: every earlier mark becomes invalid."""
        self._epoch += 1
        self._log = []
        self._n_cells = 0

    def mark(self) -> tuple[int, int]:
        return self._epoch, len(self._log)

    def since(self, mark: tuple[int, int]) -> list[tuple[int, np.ndarray]] | None:
        """The entries logged after ``mark`` (possibly repeating cells), or None when the log
        started over since (anything may have changed)."""
        if mark[0] != self._epoch:
            return None
        return self._log[mark[1]:]
