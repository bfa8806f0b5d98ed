"""README's two commands are what CI and users run."""
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _command_after(marker: str) -> str:
    text = (REPO / "README.md").read_text()
    block = text.split(f"<!-- {marker} -->", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    return block.strip()


def test_ci_runs_the_readme_test_command():
    cmd = _command_after("test-command")
    tail = cmd.split(". .venv/bin/activate && ", 1)[1]
    ci = (REPO / ".ci" / "run").read_text()
    assert tail in ci.splitlines(), f"README test command {tail!r} is not a line of .ci/run"


def test_readme_opens_with_the_two_commands():
    text = (REPO / "README.md").read_text()
    assert text.index("<!-- main-command -->") < text.index("<!-- test-command -->") < text.index("## ")
    assert "ggml-attn-bench" in _command_after("main-command")


# ---- README's python examples run: every ```python block after a
# <!-- tested --> marker is executed, in order, each in a fresh namespace
def _tested_blocks() -> list[str]:
    text = (REPO / "README.md").read_text()
    return [part.split("```python\n", 1)[1].split("```", 1)[0]
            for part in text.split("<!-- tested -->")[1:]]


def test_readme_has_tested_examples_for_the_op_and_a_batch():
    blocks = _tested_blocks()
    assert len(blocks) >= 3
    joined = "\n".join(blocks)
    for name in ("ggml_init", "to_numpy", "flash_attn_ext", "KVCache", "AttnConfig", "run_batch",
                 "describe_plan"):
        assert name in joined, name


def test_readme_examples_run(capsys):
    for i, code in enumerate(_tested_blocks()):
        exec(compile(code, f"README.md tested block {i}", "exec"), {"__name__": f"readme_{i}"})


# ---- docs point only at what the repository has
import re

def _owned_files():
    """Every text file the repository ships or tests with (committed results keep their names)."""
    out = []
    for pattern in ("*.md", "*.toml", "ggml_attn/*.py", "graph/*.py", "tools/*.py", "tools/*.sh",
                    "tools/dev/*.py", "tools/dev/*.sh", "tests/*.py", "cuda/*.cu", "cuda/*.cuh", "bench/*.md"):
        out += sorted(REPO.glob(pattern))
    return out


def test_no_citations_of_documents_outside_the_repository():
    bad = re.compile(r"REFERENCE|[Ss]eed ?0\d\d|[Ii]ssue \d")
    hits = []
    for path in _owned_files():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            line = re.sub(r"bench/results/[^` ]*", "", line)  # committed result files keep their names
            if bad.search(line) and "bad = re.compile" not in line:
                hits.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_readme_paths_exist():
    text = (REPO / "README.md").read_text()
    paths = set(re.findall(r"`((?:bench|tools|tests|graph|ggml_attn|cuda|\.ci)/[^` ]*)`", text))
    assert paths
    missing = []
    for p in paths:
        p = p.split("::")[0].rstrip(".,:")
        if "<" in p or "*" in p:
            continue
        options = [p]
        m = re.match(r"(.*)\{(.*)\}(.*)", p)
        if m:
            options = [m.group(1) + x + m.group(3) for x in m.group(2).split(",")]
        missing += [o for o in options if not (REPO / o).exists()]
    assert not missing, missing
