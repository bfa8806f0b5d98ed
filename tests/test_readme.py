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
