"""No import circles among the repository's modules.

Every ``import`` / ``from ... import`` statement of every module in ``ggml_attn/``, ``graph/``
(``ggml_attn.graph``) and ``tools/`` (``ggml_attn.cli``) is read with ``ast`` -- module level and
inside functions, classes, ``try`` and ``if`` blocks alike -- and mapped to the repository module
it names (package directories as ``pyproject.toml`` maps them). The implicit import of a
module's parent package is not an edge (Python runs a package's ``__init__`` before its
submodules; counting it would make every ``__init__`` that imports a submodule a circle). The
graph must be acyclic.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"ggml_attn": "ggml_attn", "graph": "ggml_attn.graph", "tools": "ggml_attn.cli"}


def repo_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the mapped package directories."""
    mods = {}
    for folder, pkg in PACKAGES.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            name = pkg if path.stem == "__init__" else f"{pkg}.{path.stem}"
            mods[name] = path
    return mods


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module name a ``from`` import starts from."""
    if not node.level:
        return node.module or ""
    pkg = module if path.stem == "__init__" else module.rpartition(".")[0]
    parts = pkg.split(".")
    if node.level > 1:
        parts = parts[: len(parts) - (node.level - 1)]
    base = ".".join(parts)
    return f"{base}.{node.module}" if node.module else base


def _target(name: str, mods: dict[str, Path]) -> str | None:
    """The repository module ``name`` loads: itself, else its nearest known parent."""
    while name:
        if name in mods:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Repository modules that ``module`` imports explicitly, anywhere in its body."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, path, node)
            # "from pkg import sub" imports the submodule pkg.sub when there is one
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        for n in names:
            t = _target(n, mods)
            if t is not None and t != module:
                out.add(t)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = repo_modules()
    return {m: imports_of(m, p, mods) for m, p in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as ``[a, b, ..., a]``, or None when the graph is acyclic."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(graph, WHITE)
    stack: list[str] = []

    def visit(u):
        color[u] = GREY
        stack.append(u)
        for v in sorted(graph.get(u, ())):
            if color.get(v, BLACK) == GREY:
                return stack[stack.index(v):] + [v]
            if color.get(v) == WHITE:
                found = visit(v)
                if found:
                    return found
        stack.pop()
        color[u] = BLACK
        return None

    for m in sorted(graph):
        if color[m] == WHITE:
            found = visit(m)
            if found:
                return found
    return None


def test_every_package_is_found():
    mods = repo_modules()
    for name in ("ggml_attn.op", "ggml_attn.graph.split", "ggml_attn.graph.auto",
                 "ggml_attn.cli.runner", "ggml_attn.cli.host_engine"):
        assert name in mods


def test_detector_sees_function_level_and_relative_imports(tmp_path):
    """The parser finds imports inside functions, and relative ones, and a circle through them."""
    mods = {"ggml_attn.graph.a": tmp_path / "a.py", "ggml_attn.graph.b": tmp_path / "b.py",
            "ggml_attn.graph": tmp_path / "__init__.py"}
    mods["ggml_attn.graph.a"].write_text("from .b import f\n")
    mods["ggml_attn.graph.b"].write_text("def f():\n    from . import a\n    return a\n")
    mods["ggml_attn.graph"].write_text("from .a import f\n")
    graph = {m: imports_of(m, p, mods) for m, p in mods.items()}
    assert graph["ggml_attn.graph.b"] == {"ggml_attn.graph.a"}
    assert graph["ggml_attn.graph"] == {"ggml_attn.graph.a"}
    assert find_cycle(graph) == ["ggml_attn.graph.a", "ggml_attn.graph.b", "ggml_attn.graph.a"]
    mods["ggml_attn.graph.b"].write_text("def f():\n    return 1\n")
    graph = {m: imports_of(m, p, mods) for m, p in mods.items()}
    assert find_cycle(graph) is None


def test_no_import_circles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


@pytest.mark.parametrize("low, high", [("ggml_attn.graph.split", "ggml_attn.graph.auto"),
                                       ("ggml_attn.cli.host_engine", "ggml_attn.cli.runner")])
def test_one_way_dependencies(low, high):
    """``split`` knows nothing of ``auto``; the engine knows nothing of the runner that drives it."""
    assert high not in import_graph()[low]


def test_graph_package_places_every_module():
    """graph/__init__'s docstring names every module of the package (issue #45: a newcomer's map)."""
    import pathlib
    import ggml_attn.graph as g
    mods = {p.stem for p in pathlib.Path(g.__file__).parent.glob("*.py")} - {"__init__"}
    missing = sorted(m for m in mods if f"``{m}``" not in g.__doc__)
    assert not missing, missing


MAX_MODULE_LINES, MAX_CLASS_LINES = 550, 400


def test_modules_and_classes_stay_small():
    """Small modules with one job each: every shipped module at most 550 lines, no class over
    400 (when one grows past, it is holding a second job: split it, as ``kv_cells`` left
    ``kv_cache`` and ``variants`` left ``kernels``)."""
    too_big = []
    for name, path in repo_modules().items():
        text = path.read_text()
        n = text.count("\n")
        if n > MAX_MODULE_LINES:
            too_big.append(f"{name}: {n} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                too_big.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not too_big, too_big


OLD_HEAD_NAMES = {"head_dim", "d_k", "d_v", "D_k", "D_v"}


def test_one_vocabulary_for_head_sizes():
    """Head sizes are ``head_dim_k`` / ``head_dim_v`` in every shipped module: no identifier (name,
    attribute, argument or keyword) is one of the older spellings (``head_dim``, ``d_k``, ``d_v``,
    ``D_k``, ``D_v``); data keys -- the ``head_dim`` output column, in strings or ``dict(...)``
    keywords -- are not identifiers."""
    found = []
    for name, path in repo_modules().items():
        tree = ast.parse(path.read_text())
        data_keys = {id(k) for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                     and n.func.id == "dict" for k in n.keywords}
        for node in ast.walk(tree):
            if id(node) in data_keys:
                continue
            ids = []
            if isinstance(node, ast.Name):
                ids = [node.id]
            elif isinstance(node, ast.Attribute):
                ids = [node.attr]
            elif isinstance(node, ast.arg):
                ids = [node.arg]
            elif isinstance(node, ast.keyword) and node.arg:
                ids = [node.arg]
            found += [f"{name}:{node.lineno}: {i}" for i in ids if i in OLD_HEAD_NAMES]
    assert not found, found
