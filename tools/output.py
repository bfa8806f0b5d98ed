"""Where the tools write: stdout (and stderr with ``-oe``) and ``--plot`` files.

A write that fails (a full disk, a closed terminal) becomes :class:`OutputError`, a
UserError: one line on stderr and exit 2 instead of a traceback after the whole run.
``--plot`` paths are checked before anything runs.
"""
from __future__ import annotations

import os

from .errors import UserError

# matplotlib's savefig formats (FigureCanvasBase.get_supported_filetypes of matplotlib 3.x),
# used when matplotlib itself is not installed
_IMAGE_EXTENSIONS = ("eps", "jpeg", "jpg", "pdf", "pgf", "png", "ps", "raw", "rgba", "svg",
                     "svgz", "tif", "tiff", "webp")


class OutputError(UserError):
    """Output that could not be written; the message names where and why."""


class SafeWriter:
    """File-like wrapper of ``stream``: ``write``/``flush`` raise OutputError on OSError
    (BrokenPipeError, e.g. ``| head``, passes through: the tools end quietly on it)."""

    def __init__(self, stream, name: str = "stdout"):
        self.stream, self.name = stream, name

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise OutputError(f"cannot write to {self.name}: {e.strerror or e}") from None

    def write(self, text: str):
        try:
            return self._call(self.stream.write, text)
        except UnicodeEncodeError:   # an ASCII (or other) stdout: the table's "±" as "+-", the rest replaced
            enc = getattr(self.stream, "encoding", None) or "ascii"
            return self._call(self.stream.write, text.replace("±", "+-").encode(enc, "replace").decode(enc))

    def flush(self):
        return self._call(self.stream.flush)


def image_extensions() -> tuple[str, ...]:
    try:
        from matplotlib.backend_bases import FigureCanvasBase
        return tuple(sorted(FigureCanvasBase.get_supported_filetypes()))
    except ImportError:
        return _IMAGE_EXTENSIONS


def check_plot_path(path: str | None) -> None:
    """``--plot`` must name a file (not a folder) with an image extension, in a folder that
    exists and can be written; UserError otherwise."""
    if path is None:
        return
    if os.path.isdir(path):
        raise UserError(f"--plot '{path}' is a folder; name an image file in it, e.g. {os.path.join(path, 'plot.png')}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UserError(f"--plot '{path}': the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise UserError(f"--plot '{path}': the folder {folder} is not writable")
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    known = image_extensions()
    if ext not in known:
        raise UserError(f"--plot '{path}': unknown image extension '{ext}' "
                        f"(use one of {', '.join('.' + e for e in known)})")
    # the file itself opened for writing now, not after the run (a read-only file, or a folder
    # that refuses new files whatever its mode says: /sys, /proc, a read-only mount as root)
    existed = os.path.exists(path)
    try:
        with open(path, "ab"):
            pass
    except OSError as e:
        raise save_error(path, e) from None
    if not existed:
        os.remove(path)


def save_error(path: str, e: OSError, flag: str = "--plot") -> UserError:
    """``flag``'s file ``path`` could not be written (``e``), as a user error."""
    return OutputError(f"{flag}: cannot write {path}: {e.strerror or e}")
