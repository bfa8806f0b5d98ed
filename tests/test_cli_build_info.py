"""The identity of a copy (issue #47 A.4): llama-bench's ``build_commit``/``build_number`` and the
CLIs' ``--version`` name the commit a copy came from. A checkout asks git; an installed wheel has
no .git, so the build records the commit (setup.py's hook: ``ggml_attn/_build_info.py`` in the
built package) and an sdist carries it to the wheels built from it (they said ``unknown (0)``)."""
import ast
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest
from source_copy import REPO, build, clone, git

RECORD = "ggml_attn/_build_info.py"

# the installed copy alone: -S keeps this environment's (editable) ggml_attn off sys.path
VERSION = ("import site, sys\n"
           "site.addsitedir(sys.argv[1]); sys.path.append(sys.argv[2])\n"
           "sys.argv = ['ggml-attn-bench', '--version']\n"
           "from ggml_attn.cli.bench import main\n"
           "sys.exit(main())\n")


def _env():
    return {k: v for k, v in os.environ.items() if k not in ("GGML_ATTN_COMMIT", "PYTHONPATH")}


def _record(text: str) -> tuple[str, int]:
    names = {n.targets[0].id: ast.literal_eval(n.value) for n in ast.parse(text).body if isinstance(n, ast.Assign)}
    return names["COMMIT"], names["NUMBER"]


def _pip_wheel(src: Path, out: Path) -> Path:
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(out), str(src)], capture_output=True, text=True, timeout=300, env=_env(),
                       cwd=out.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    wheels = list(out.glob("ggml_attn-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _head(src: Path) -> tuple[str, int]:
    return git("rev-parse", "--short", "HEAD", cwd=src).strip(), int(git("rev-list", "--count", "HEAD", cwd=src))


def _version_of(wheel: Path, where: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        z.extractall(where)
    r = subprocess.run([sys.executable, "-S", "-c", VERSION, str(where), sysconfig.get_paths()["purelib"]],
                       capture_output=True, text=True, timeout=120, cwd=where.parent, env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_wheel_records_the_commit(tmp_path):
    """``pip wheel`` of a clone: the wheel holds the clone's commit and count, and ``--version``
    of the unpacked wheel (no .git anywhere near it) prints them; the clone's own tree gets no
    record (git ignores it, a checkout asks git)."""
    src = clone(tmp_path / "src")
    wheel = _pip_wheel(src, tmp_path / "dist")
    commit, number = _head(src)
    with zipfile.ZipFile(wheel) as z:
        assert _record(z.read(RECORD).decode()) == (commit, number)
    assert _version_of(wheel, tmp_path / "site") == f"ggml-attn-bench 0.1.0 (build: {commit} ({number}))\n"
    assert not (src / RECORD).exists()
    assert git("check-ignore", RECORD, cwd=src).strip() == RECORD


def test_sdist_carries_the_commit_to_its_wheels(tmp_path):
    """sdist -> wheel, the way ``pip install ggml-attn-X.tar.gz`` goes: the sdist holds the
    record, and a wheel built from the unpacked sdist (no .git there) keeps it."""
    src = clone(tmp_path / "src")
    sdist, _ = build("sdist", src, tmp_path / "sdist")
    head = _head(src)
    with tarfile.open(sdist) as t:
        if hasattr(tarfile, "data_filter"):   # Python 3.12, and 3.10.12 / 3.11.4 on
            t.extractall(tmp_path / "unpacked", filter="data")
        else:
            t.extractall(tmp_path / "unpacked")
    unpacked = next((tmp_path / "unpacked").iterdir())
    assert not (unpacked / ".git").exists()
    assert _record((unpacked / RECORD).read_text()) == head
    assert not (src / RECORD).exists()
    wheel = _pip_wheel(unpacked, tmp_path / "dist")
    with zipfile.ZipFile(wheel) as z:
        assert _record(z.read(RECORD).decode()) == head
    assert _version_of(wheel, tmp_path / "site") == f"ggml-attn-bench 0.1.0 (build: {head[0]} ({head[1]}))\n"


PROBE = ("import sys; sys.path.insert(0, sys.argv[1])\n"
         "from ggml_attn._build import build_info\n"
         "print(*build_info())\n")


def _probe(site: Path, env=None) -> str:
    r = subprocess.run([sys.executable, "-S", "-c", PROBE, str(site)], capture_output=True, text=True,
                       timeout=60, cwd=site, env={**_env(), **(env or {})})
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_lookup_order(tmp_path):
    """GGML_ATTN_COMMIT, then git for a checkout (a .git beside the package), then the record,
    then "unknown 0". A copy installed inside some other git repository (a venv in a project's
    checkout) is not that repository's checkout: it said that repository's commit before."""
    if shutil.which("git") is None:
        pytest.skip("no git")
    outer = tmp_path / "project"
    site = outer / "venv" / "site-packages"
    (site / "ggml_attn").mkdir(parents=True)
    (site / "ggml_attn" / "__init__.py").write_text("")
    (site / "ggml_attn" / "_build.py").write_text((REPO / "ggml_attn" / "_build.py").read_text())
    git("init", "-q", str(outer), cwd=tmp_path)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "x", cwd=outer)
    assert _probe(site) == "unknown 0"
    (site / RECORD).write_text("COMMIT = 'abc1234'\nNUMBER = 57\n")
    assert _probe(site) == "abc1234 57"
    assert _probe(site, {"GGML_ATTN_COMMIT": "fed4321:9"}) == "fed4321 9"
    git("init", "-q", str(site), cwd=tmp_path)   # now a checkout of its own
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "x", cwd=site)
    assert _probe(site) == f"{git('rev-parse', '--short', 'HEAD', cwd=site).strip()} 1"


def test_this_copy():
    """A checkout: git's HEAD; an unpacked sdist: what its build recorded."""
    from ggml_attn import _build
    if os.environ.get("GGML_ATTN_COMMIT"):
        pytest.skip("GGML_ATTN_COMMIT is set")
    if (REPO / ".git").exists():
        assert _build.build_info() == _head(REPO)
    else:
        assert _build.build_info() == _build.recorded() != _build.UNKNOWN
