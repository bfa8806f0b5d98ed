"""The development scripts (tools/dev/) run on the device machine, where a mistake costs a device
call: each script's ``if __name__ == "__main__"`` block is its last statement (a function defined
after it is not defined when the block runs: the sanitizer case's dense_q section once failed so,
on the device)."""
import ast
import pathlib

import pytest

DEV = pathlib.Path(__file__).resolve().parents[1] / "tools" / "dev"


@pytest.mark.parametrize("path", sorted(DEV.glob("*.py")), ids=lambda p: p.name)
def test_the_main_block_comes_last(path):
    body = ast.parse(path.read_text()).body
    mains = [i for i, n in enumerate(body) if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    assert not mains or mains[-1] == len(body) - 1, f"{path.name}: statements after the __main__ block"
