"""What ``ggml_attn.cli`` ships: the three CLIs (``ggml-attn-bench`` = tools/bench.py,
``ggml-attn-batched-bench`` = tools/batched_bench.py, ``ggml-attn-serve-bench`` =
tools/serve_bench.py) and the modules they import, nothing else.
The GPU experiments, profilers and host benchmarks live in tools/dev/: not a package (no
``__init__.py``, not in pyproject's ``packages``), so not installed, and run as
``python tools/dev/X.py`` from a checkout. tests/test_install.py checks an installed copy."""
import ast
import importlib.resources
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parent.parent
TOOLS = REPO / "tools"
DEV = TOOLS / "dev"
DEV_SCRIPTS = sorted(p.name for p in DEV.iterdir() if p.suffix in (".py", ".sh"))
ENTRY_POINTS = ("bench", "batched_bench", "serve_bench")


def _sibling_imports(path: Path, names: set[str]) -> set[str]:
    """The modules of ``names`` that ``path`` imports (relative or as ``ggml_attn.cli.X``)."""
    out = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom):
            if n.level == 1:
                out |= {n.module.split(".")[0]} if n.module else {a.name for a in n.names}
            elif n.module and n.module.startswith("ggml_attn.cli"):
                rest = n.module[len("ggml_attn.cli"):].lstrip(".")
                out |= {rest.split(".")[0]} if rest else {a.name for a in n.names}
        elif isinstance(n, ast.Import):
            out |= {a.name.split(".")[2] for a in n.names if a.name.startswith("ggml_attn.cli.")}
    return out & names


def test_dev_scripts_exist():
    assert "gpu_check.sh" in DEV_SCRIPTS and "gpu_bench.py" in DEV_SCRIPTS, DEV_SCRIPTS
    assert not (DEV / "__init__.py").exists(), "tools/dev/ must not be a package (it would be installed)"


def test_pyproject_ships_tools_without_dev():
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())
    st = cfg["tool"]["setuptools"]
    assert st["package-dir"]["ggml_attn.cli"] == "tools"
    assert not [p for p in st["packages"] if p.startswith("ggml_attn.cli.")], st["packages"]
    assert not any(k.startswith("ggml_attn.cli") for k in st.get("package-data", {}))
    scripts = cfg["project"]["scripts"]
    assert scripts == {"ggml-attn-bench": "ggml_attn.cli.bench:main",
                       "ggml-attn-batched-bench": "ggml_attn.cli.batched_bench:main",
                       "ggml-attn-serve-bench": "ggml_attn.cli.serve_bench:main"}


def test_cli_package_holds_no_development_script():
    files = {p.name for p in importlib.resources.files("ggml_attn.cli").iterdir() if p.name.endswith((".py", ".sh"))}
    assert files, "ggml_attn.cli has no modules?"
    assert not files & set(DEV_SCRIPTS), sorted(files & set(DEV_SCRIPTS))
    assert not [f for f in files if f.endswith(".sh") or f.startswith("gpu_")], sorted(files)


def test_every_cli_module_is_imported_by_the_clis():
    """Every module of tools/ is reached from the entry points: a script that nothing of the
    CLI imports belongs in tools/dev/."""
    names = {p.stem for p in TOOLS.glob("*.py")}
    seen, todo = {"__init__"}, list(ENTRY_POINTS)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += _sibling_imports(TOOLS / f"{m}.py", names)
    assert names == seen, f"not imported by the CLIs (move to tools/dev/?): {sorted(names - seen)}"


def test_dev_scripts_do_not_import_each_other_through_the_package():
    """A dev script imports a sibling by name (``import gpu_timing``), never as ``ggml_attn.cli.X``."""
    dev = {p.stem for p in DEV.glob("*.py")}
    bad = {p.name: sorted(_sibling_imports(p, dev)) for p in DEV.glob("*.py") if _sibling_imports(p, dev)}
    assert not bad, bad


@pytest.mark.parametrize("script", ["knob_ab.py", "stage_profile.py", "ragged_experiment.py",
                                    "gpu_bench.py", "gpu_multi_check.py"])
def test_dev_script_runs_from_a_checkout(script):
    r = subprocess.run([sys.executable, str(DEV / script), "--help"], capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout.lower()


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_multi_check.sh"])
def test_dev_shell_scripts_parse_and_start_at_the_root(script):
    text = (DEV / script).read_text()
    assert 'cd "$(dirname "$0")/../.."' in text
    assert subprocess.run(["bash", "-n", str(DEV / script)]).returncode == 0
