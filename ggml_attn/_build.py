"""Which ggml-attn this copy is: the short commit and the commit count of the source it came from
(llama-bench's ``build_commit`` / ``build_number``, the CLIs' ``--version``).

In order: ``GGML_ATTN_COMMIT`` ("abc1234" or "abc1234:57"); in a git checkout of ggml-attn (a
``.git`` beside the package), git; in an installed copy or an unpacked sdist, what the build
recorded in ``_build_info.py`` (written by setup.py's build hook into the sdist and the built
package, never into the checkout: git ignores it); else ("unknown", 0).

Plain standard library, no import of the package: setup.py loads this file by its path.
"""
from __future__ import annotations

import os
import subprocess

UNKNOWN = ("unknown", 0)
RECORD_NAME = "_build_info.py"


def from_env() -> tuple[str, int] | None:
    """``GGML_ATTN_COMMIT`` ("abc1234" or "abc1234:57"), None when unset."""
    env = os.environ.get("GGML_ATTN_COMMIT", "")
    if not env:
        return None
    commit, _, count = env.partition(":")
    return commit, int(count) if count.isdigit() else 0


def from_git(root: str) -> tuple[str, int] | None:
    """(short commit, number of commits) of the checkout at ``root``; None when ``root`` is not
    the top of a git checkout (an installed copy inside some other repository is not) or git
    cannot tell."""
    if not os.path.exists(os.path.join(root, ".git")):   # a directory, or a file (worktree, submodule)
        return None
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=5).stdout.strip()
        count = subprocess.run(["git", "-C", root, "rev-list", "--count", "HEAD"], capture_output=True,
                               text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (commit, int(count) if count.isdigit() else 0) if commit else None


def at_build_time(root: str) -> tuple[str, int] | None:
    """What a build from the source tree at ``root`` records: ``GGML_ATTN_COMMIT``, else git;
    None when neither tells (an unpacked sdist: the record it carries stays as it is)."""
    return from_env() or from_git(root)


def record_text(commit: str, number: int) -> str:
    """The text of ``_build_info.py``."""
    return ("# Written by ggml-attn's build (setup.py): the commit this copy was built from.\n"
            f"COMMIT = {commit!r}\nNUMBER = {int(number)}\n")


def write_record(package_dir: str, info: tuple[str, int]) -> str:
    """Write ``_build_info.py`` into ``package_dir`` (a fresh file: the one there may be a hard
    link to the source tree's copy); its path."""
    path = os.path.join(package_dir, RECORD_NAME)
    if os.path.lexists(path):
        os.unlink(path)
    with open(path, "w", encoding="utf-8") as f:
        f.write(record_text(*info))
    return path


def recorded() -> tuple[str, int] | None:
    """What the build recorded (``ggml_attn._build_info``), None when nothing was."""
    try:
        from . import _build_info   # noqa: PLC0415  (generated; absent in a checkout)
    except ImportError:
        return None
    commit, number = getattr(_build_info, "COMMIT", ""), getattr(_build_info, "NUMBER", 0)
    return (str(commit), int(number) if isinstance(number, int) else 0) if commit else None


def build_info() -> tuple[str, int]:
    """(short commit, number of commits) of this copy of ggml-attn; ("unknown", 0) when nothing
    tells (a copy without .git and without a record)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return from_env() or from_git(root) or recorded() or UNKNOWN
