"""A progress bar on stderr for long runs: tests done of all, elapsed, estimate of what is
left (tqdm). On only when stderr is a terminal, so logs and pipes get no control codes.

Rows printed meanwhile go through :meth:`ProgressBar.writer`, which clears the bar around
each write so the table and the bar do not mix on one terminal.
"""
from __future__ import annotations

import sys

from tqdm import tqdm


class ProgressBar:
    def __init__(self, total: int, desc: str, *, file=None, enabled: bool | None = None, unit: str = "run"):
        self.file = file if file is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self.file, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        # a run takes long next to a redraw: redraw on every update (mininterval=0)
        self.bar = tqdm(total=total, desc=desc, unit=unit, file=self.file, disable=not enabled,
                        leave=False, dynamic_ncols=True, mininterval=0, miniters=1)

    def update(self, what: str = "") -> None:
        """One more run done; ``what`` names the next one."""
        if self.enabled:
            self.bar.set_postfix_str(what, refresh=False)
            self.bar.update(1)

    def add(self, n: int) -> None:
        """``n`` more runs to do than the total said (a count known later)."""
        if n and self.enabled:
            self.bar.total += n
            self.bar.refresh()

    def close(self) -> None:
        self.bar.close()

    def writer(self, stream):
        """``stream`` with the bar cleared around each write (unchanged when the bar is off)."""
        return stream if not self.enabled else _ClearingWriter(stream, self.bar)


class _ClearingWriter:
    def __init__(self, stream, bar):
        self.stream, self.bar = stream, bar

    def write(self, text: str):
        self.bar.clear()
        n = self.stream.write(text)
        self.stream.flush()
        self.bar.refresh()
        return n

    def flush(self):
        return self.stream.flush()
