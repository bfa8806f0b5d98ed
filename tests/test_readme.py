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
    for pattern in ("*.md", "docs/*.md", "*.toml", "ggml_attn/*.py", "graph/*.py", "tools/*.py",
                    "tools/*.sh", "tools/dev/*.py", "tools/dev/*.sh", "tests/*.py", "cuda/*.cu", "cuda/*.cuh",
                    "bench/*.md"):
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


def _doc_pages():
    """README.md and the pages of docs/."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    assert len(pages) > 1, "docs/ holds no pages"
    return pages


def test_readme_paths_exist():
    """Every repository path that README.md or a page of docs/ names in backticks exists (paths are
    from the repository root, in docs/ too)."""
    missing = []
    for page in _doc_pages():
        paths = set(re.findall(r"`((?:bench|tools|tests|graph|ggml_attn|cuda|docs|\.ci)/[^` ]*)`", page.read_text()))
        assert paths or page.name != "README.md"
        missing += [f"{page.relative_to(REPO)}: {m}" for m in _missing_paths(paths)]
    assert not missing, missing


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    s = heading.strip().lower().replace("`", "")
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def test_doc_links_resolve():
    """Relative links ``[text](target#anchor)`` of README.md and docs/*.md point at files that exist
    and, with an anchor, at one of the target's headings."""
    bad = []
    for page in _doc_pages():
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.relative_to(REPO)}: {target} (no such file)")
                continue
            if anchor and dest.suffix == ".md":
                slugs = {_slug(h) for h in re.findall(r"^#+ (.*)$", dest.read_text(), flags=re.M)}
                if anchor not in slugs:
                    bad.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not bad, bad


def _missing_paths(paths) -> list[str]:
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
    return missing
