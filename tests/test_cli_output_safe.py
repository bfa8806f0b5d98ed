"""A file's strings reach the terminal as text (issue #47 B.5): a model name with ESC, BEL, a
C1 CSI, a newline and a '|' prints escaped (``\\x1b``) in every tool's table, main line, verbose
lines and errors, one line each; JSON escapes them by itself."""
import dataclasses
import re

import pytest

import fixtures_gguf
from ggml_attn.cli import batched_bench, bench, serve_bench
from ggml_attn.cli.text import printable

EVIL = "evil\x1b[31mRED\x07|name\nline2\x9b\x7f"
UNSAFE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f]")   # every control character but the newline


@pytest.fixture(scope="module")
def evil(tmp_path_factory):
    spec = dataclasses.replace(fixtures_gguf.SPECS["llama-q8_0"], model_name=EVIL)
    return fixtures_gguf.write_model(spec, tmp_path_factory.mktemp("evil") / "evil.gguf")


def test_printable():
    assert printable(EVIL) == "evil\\x1b[31mRED\\x07|name line2\\x9b\\x7f"
    assert printable("  a\tb\n") == "a b" and printable("ünïcode ok") == "ünïcode ok"


@pytest.mark.parametrize("tool, args", [
    (bench, ["-p", "4", "-n", "0", "-r", "1"]),
    (batched_bench, ["-npp", "4", "-ntg", "1", "-npl", "1"]),
    (serve_bench, ["--rate", "inf", "-n", "2", "--gen-dist", "2", "--prompt-dist", "4"]),
])
def test_every_tool_escapes_the_file_s_strings(evil, capsys, tool, args):
    assert tool.main(["-m", str(evil), "-v", "--device", "cpu", "-t", "1"] + args) == 0
    out = capsys.readouterr()
    for text in (out.out, out.err):
        assert not UNSAFE.search(text), repr(UNSAFE.search(text).group())
    assert "evil\\x1b[31mRED\\x07" in out.err            # the verbose line, escaped
    if tool is not serve_bench:                          # (the serve table has no model column)
        assert "evil\\x1b[31mRED\\x07" in out.out


def test_errors_escape_paths(capsys, tmp_path):
    bad = tmp_path / "x\x1b[2Jy.gguf"
    bad.write_bytes(b"not a gguf")
    assert bench.main(["-m", str(bad), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "x\\x1b[2Jy.gguf" in err and not UNSAFE.search(err)
