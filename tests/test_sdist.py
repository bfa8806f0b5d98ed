"""The sdist carries what its tests need (issue #47 A.8): built here with setuptools' own
backend (MANIFEST.in), it holds the tests with their conftest, fixtures and data, the
development scripts they import, the docs and bench/ files that README and the docs name,
and CI's script; nothing of that is installed (pyproject: include-package-data = false)."""
import os
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_sdist_holds_what_the_tests_need(tmp_path):
    code = ("import sys; from setuptools import build_meta as b; "
            "print(b.build_sdist(sys.argv[1]))")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    name = r.stdout.strip().splitlines()[-1]
    with tarfile.open(tmp_path / name) as t:
        members = {m.split("/", 1)[1] for m in t.getnames() if "/" in m}
    if (REPO / ".git").exists():   # a checkout: the files git tracks; an unpacked sdist: the files there
        tracked = set(subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True).stdout.split())
    else:
        tracked = {str(p.relative_to(REPO)) for p in REPO.rglob("*") if p.is_file()}
    for d in ("tests/", "tools/dev/", "docs/", "bench/", "cuda/", "graph/", "ggml_attn/"):
        want = {f for f in tracked if f.startswith(d) and "__pycache__" not in f}
        assert want and want <= members, (d, sorted(want - members)[:5])
    assert {".ci/run", "README.md", "LICENSE", "pyproject.toml", "MANIFEST.in"} <= members
    assert not any("__pycache__" in m or m.endswith(".pyc") for m in members)
    assert os.path.exists(REPO / "MANIFEST.in")
