"""Every result file the shipped code and the docs cite exists: a number in a comment, a
docstring, README.md or docs/ is traceable to ``bench/results/`` (globs and ``{a,b}`` lists are
expanded; placeholders such as ``<commit>`` are not checked)."""
from __future__ import annotations

import glob
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_CITE = re.compile(r"bench/results/[A-Za-z0-9_.*{},<>/-]+")


def _expand(ref: str) -> list[str]:
    m = re.search(r"\{([^}]*)\}", ref)
    if not m:
        return [ref]
    return [x for alt in m.group(1).split(",") for x in _expand(ref[:m.start()] + alt + ref[m.end():])]


def test_cited_result_files_exist():
    files = [*ROOT.glob("ggml_attn/*.py"), *ROOT.glob("graph/*.py"), *ROOT.glob("tools/*.py"),
             *ROOT.glob("docs/*.md"), ROOT / "README.md"]
    missing = []
    for f in files:
        for ref in _CITE.findall(f.read_text()):
            ref = ref.rstrip(".,")
            if "<" in ref or ref.endswith("/"):
                continue
            for one in _expand(ref):
                if not glob.glob(str(ROOT / one)):
                    missing.append(f"{f.relative_to(ROOT)}: {one}")
    assert not missing, missing
