"""llama-bench users' flags: exact parsing, -fa auto, -t limit, new flags (issue 11 items 3-6,
issue 9 item 10)."""
import json

import pytest

from ggml_attn.cli import batched_bench, bench

FAST = ["-t", "1", "--n-layer", "1", "--device", "cpu"]


def _bench(capsys, *args):
    rc = bench.main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _batched(capsys, *args):
    rc = batched_bench.main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _one_line_exit_2(rc, out, err, prog):
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"{prog}: error:") and "Traceback" not in err


# ---- item 4: no abbreviations; an unknown flag names itself
@pytest.mark.parametrize("main, prog, args, named", [
    (_bench, "ggml-attn-bench", ["-xyz", "99"], "-xyz"),
    (_bench, "ggml-attn-bench", ["-ctx", "q8_0"], "-ctx"),
    (_bench, "ggml-attn-bench", ["-nx", "4"], "-nx"),        # not -n with value "x"
    (_bench, "ggml-attn-bench", ["--rep", "2"], "--rep"),     # not --repetitions
    (_bench, "ggml-attn-bench", ["--n-pro", "8"], "--n-pro"),  # not --n-prompt
    (_batched, "ggml-attn-batched-bench", ["-nplx", "4"], "-nplx"),
    (_batched, "ggml-attn-batched-bench", ["--prompt", "1-3"], "--prompt"),
])
def test_unknown_flags_name_themselves(capsys, main, prog, args, named):
    rc, out, err = main(capsys, *args, "--device", "cpu")
    _one_line_exit_2(rc, out, err, prog)
    assert named in err and "invalid range" not in err


# ---- item 3: -fa shows auto
def test_fa_default_is_auto_in_help_and_json(capsys):
    rc, out, _ = _bench(capsys, "--help")
    assert rc == 0
    fa_help = " ".join(out.split("-fa on|off|auto, --flash-attn on|off|auto", 1)[1].split())
    assert "(default: auto)" in fa_help.split(" -kvu")[0] and "default: -1" not in out
    rc, out, err = _bench(capsys, "-p", "8", "-n", "0", "-r", "1", "--no-warmup", "-o", "jsonl", *FAST)
    assert rc == 0, err
    assert json.loads(out)["flash_attn"] == "auto"
    rc, out, err = _bench(capsys, "-p", "8", "-n", "0", "-r", "1", "--no-warmup", "-o", "jsonl",
                          "-fa", "on,off", *FAST)
    assert rc == 0, err
    assert [json.loads(l)["flash_attn"] for l in out.splitlines()] == ["on", "off"]


# ---- issue 9 item 10: -t beyond what ggml can start
@pytest.mark.parametrize("value", ["513", "10000", "32768", "65536"])
def test_threads_capped_with_a_sentence(capsys, value):
    rc, out, err = _bench(capsys, "-p", "8", "-n", "0", "-r", "1", "--device", "cpu", "-t", value)
    _one_line_exit_2(rc, out, err, "ggml-attn-bench")
    assert f"-t {value}" in err and "512" in err
    rc, out, err = _batched(capsys, "-npp", "8", "-npl", "1", "-ntg", "1", "--device", "cpu", "-t", value)
    _one_line_exit_2(rc, out, err, "ggml-attn-batched-bench")
    assert f"-t {value}" in err and "512" in err


def test_batched_fa_is_a_word(capsys):
    rc, out, err = _batched(capsys, "-npp", "8", "-npl", "1", "-ntg", "1", "-o", "jsonl", *FAST)
    assert rc == 0, err
    assert json.loads(out)["flash_attn"] == "auto"
    rc, out, err = _batched(capsys, "-npp", "8", "-npl", "1", "-ntg", "1", *FAST)
    assert rc == 0, err
    assert "flash_attn = auto" in out
