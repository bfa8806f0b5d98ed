"""The package installs both ways and finds its kernel sources (cuda/*.cu, *.cuh) at run time.

``cuda/`` has no ``__init__.py`` on purpose: a regular package named ``cuda`` at the repository
root would shadow NVIDIA's ``cuda`` namespace package (``cuda.pathfinder``, which CuPy imports)
whenever the root is on sys.path. Installed, it is package data under ``ggml_attn/cuda``;
editable, the kernels find it next to the package."""
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
KERNEL_SOURCES = sorted(p.name for p in (REPO / "cuda").iterdir() if p.suffix in (".cu", ".cuh"))

PROBE = (
    "import json, site, sys\n"
    "site.addsitedir(sys.argv[1]); sys.path.append(sys.argv[2])\n"
    "import ggml_attn, ggml_attn.graph, ggml_attn.cli, ggml_attn.kernels\n"
    "src = ggml_attn.kernels.source_dir()\n"
    "files = sorted(p.name for p in src.iterdir() if p.name.endswith(('.cu', '.cuh')))\n"
    "text = {n: (src / n).read_text() for n in files}\n"
    "print(json.dumps({'file': ggml_attn.__file__, 'graph': ggml_attn.graph.__file__, 'files': files,\n"
    "                  'sizes': [len(t) for t in text.values()]}))\n"
)


@pytest.mark.parametrize("editable", [False, True], ids=["install", "editable"])
def test_kernel_sources_found_after_install(tmp_path, editable):
    assert KERNEL_SOURCES, "cuda/ holds no kernel sources"
    target = tmp_path / "site"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
           "--target", str(target)] + (["-e", str(REPO)] if editable else [str(REPO)])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    # -S: no site-packages of this environment (which holds its own editable install);
    # the dependencies come back through plain sys.path, which runs no .pth files.
    r = subprocess.run([sys.executable, "-S", "-c", PROBE, str(target), sysconfig.get_paths()["purelib"]],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout.strip().splitlines()[-1])
    assert found["files"] == KERNEL_SOURCES
    assert all(n > 0 for n in found["sizes"])
    where = Path(found["file"]).resolve()
    if editable:
        assert where.is_relative_to(REPO)
        assert Path(found["graph"]).resolve().is_relative_to(REPO / "graph")
    else:
        assert where.is_relative_to(target.resolve())
        # the CLI package ships no development script (tools/dev/, tests/test_cli_package.py)
        cli = {p.name for p in (target / "ggml_attn" / "cli").iterdir()}
        dev = {p.name for p in (REPO / "tools" / "dev").iterdir()}
        assert {"bench.py", "batched_bench.py"} <= cli
        assert "dev" not in cli and not cli & dev, sorted(cli & dev)


def test_cuda_folder_does_not_shadow_nvidia_cuda_namespace():
    assert not (REPO / "cuda" / "__init__.py").exists(), \
        "cuda/__init__.py makes `import cuda.pathfinder` (CuPy) fail when the repo root is on sys.path"
