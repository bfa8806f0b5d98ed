"""llama.cpp's command lines run unchanged (issue #47 A.2): flags that change nothing here are
taken and said once on stderr (never given another meaning), underscore spellings of long
flags work, ``--list-devices``, ``-no-kvu``, ``-s``."""
import json

import pytest

from ggml_attn.cli import batched_bench, bench, serve_bench
from ggml_attn.cli.args import LLAMA_BATCHED_INERT, LLAMA_BENCH_INERT

CPU = ["--device", "cpu", "-t", "1", "--n-layer", "1"]


def _bench(capsys, *args):
    rc = bench.main(["-p", "8", "-n", "0", "-r", "1", "--no-warmup", "-o", "jsonl", *CPU, *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("entry", LLAMA_BENCH_INERT, ids=lambda e: e[0][0])
def test_llama_bench_flags_are_taken_and_said_once(capsys, entry):
    flags, note, *nargs = entry
    val = [[], ["0"]][nargs[0] if nargs else 1]
    rc, out, err = _bench(capsys, flags[0], *val, flags[-1], *val)
    assert rc == 0, err
    assert err.count(note) == 1 and err.startswith(f"ggml-attn-bench: {flags[0]}: ")
    assert json.loads(out)["n_prompt"] == 8


@pytest.mark.parametrize("entry", LLAMA_BATCHED_INERT, ids=lambda e: e[0][0])
def test_llama_batched_bench_flags_are_taken_and_said_once(capsys, entry):
    flags, note, *nargs = entry
    val = [[], ["4"]][nargs[0] if nargs else 1]
    rc = batched_bench.main(["-npp", "8", "-ntg", "1", "-npl", "1", "-o", "jsonl", *CPU, flags[0], *val])
    out = capsys.readouterr()
    assert rc == 0 and out.err.count(note) == 1 and json.loads(out.out)["pp"] == 8


def test_underscore_spellings(capsys):
    rc, out, err = _bench(capsys, "--n_prompt", "16", "--batch_size=64", "--n_depth", "0")
    assert rc == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["n_prompt"] for r in rows] == [8, 16] and rows[0]["n_batch"] == 64
    rc, out, err = _bench(capsys, "--n_foo", "1")
    assert rc == 2 and "--n_foo" in err


def test_list_devices(capsys):
    assert bench.main(["--list-devices"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Available devices:\n  CPU: ") and "(--device cpu)" in out


def test_no_kvu_and_s(capsys):
    rc = batched_bench.main(["-npp", "8", "-ntg", "1", "-npl", "2", "-o", "jsonl", *CPU, "-kvu", "-no-kvu", "-s", "3"])
    row = json.loads(capsys.readouterr().out)
    assert rc == 0 and row["kv_unified"] is False
    rc = serve_bench.main(["--rate", "inf", "-n", "2", "--gen-dist", "1", "-o", "jsonl", "--device", "cpu",
                           "--no-kv-unified", "-s", "5", "--no-mmap"])
    out = capsys.readouterr()
    row = json.loads(out.out)
    assert rc == 0 and row["kv_unified"] is False and row["seed"] == 5 and "--no-mmap: " in out.err
