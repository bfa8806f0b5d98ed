"""A copy of this checkout to build packages from, for the tests of what a build records
(tests/test_cli_build_info.py, tests/test_cli_license.py): a ``git clone`` of the checkout (its
HEAD, with a .git as CI's clean clone has) with the working tree's uncommitted changes laid
over it, so the build is of the code under test; in CI, a clean clone of main, there are none.
The builds run with this environment's setuptools (no build isolation, no network), as
tests/test_install.py's do."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def git(*args, cwd=REPO) -> str:
    r = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (args, r.stderr)
    return r.stdout


def clone(dest: Path) -> Path:
    """``git clone`` of the checkout into ``dest`` plus its uncommitted changes (modified, added,
    deleted and untracked files that git does not ignore); skips outside a git checkout (an
    unpacked sdist: tests/test_cli_build_info.py checks its own record instead)."""
    if not (REPO / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    git("clone", "-q", str(REPO), str(dest), cwd=dest.parent)
    changed = git("diff", "--name-only", "-z", "HEAD").split("\0")
    changed += git("ls-files", "-z", "--others", "--exclude-standard").split("\0")
    for name in filter(None, changed):
        src, dst = REPO / name, dest / name
        if src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
        elif dst.is_file() and not src.exists():
            dst.unlink()
    return dest


def build(kind: str, src: Path, out: Path) -> tuple[Path, str]:
    """Build an sdist or a wheel (``kind``) of the source tree ``src`` into ``out`` with
    setuptools' backend, as pip does (in place, this environment's setuptools); the file and
    what the build printed (stdout and stderr)."""
    out.mkdir(parents=True, exist_ok=True)
    code = (f"import sys; from setuptools import build_meta as b; "
            f"print('BUILT', b.build_{kind}(sys.argv[1]))")
    env = {k: v for k, v in os.environ.items() if k != "GGML_ATTN_COMMIT"}
    r = subprocess.run([sys.executable, "-c", code, str(out)], cwd=src, capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    name = [line for line in r.stdout.splitlines() if line.startswith("BUILT ")][-1].split(" ", 1)[1]
    return out / name, r.stdout + r.stderr
