"""ggml-attn-bench in process: every CPU compute path, markdown column rules, listing."""
import json

import pytest

import ragged_experiment  # tools/dev/ (on sys.path via conftest)
from ggml_attn.cli import bench

FAST = ["-t", "1", "--n-layer", "1", "--device", "cpu", "-r", "1", "--no-warmup"]


def _run(capsys, *args):
    rc = bench.main(list(args) + FAST)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("extra", [
    ["-fa", "on"], ["-fa", "off"], ["--kernel", "ggml"], ["--layer", "full"],
    ["--layer", "full", "-fa", "off"], ["-kvu", "--split", "padded"], ["--split", "auto"],
])
def test_every_cpu_path_runs(capsys, extra):
    rc, out, err = _run(capsys, "-p", "24", "-n", "2", "-ub", "16", "-o", "jsonl", *extra)
    assert rc == 0, err
    rows = [json.loads(l) for l in out.splitlines()]
    assert [r["ub"] for r in rows] == [2, 2]  # pp24 with -ub 16: 2 ubatches; tg2: 2 steps
    assert all(r["avg_ts"] > 0 and len(r["samples_ns"]) == 1 for r in rows)


def test_depth_and_model_list(capsys):
    rc, out, _ = _run(capsys, "-p", "0", "-n", "2", "-d", "64", "-o", "jsonl")
    assert rc == 0 and json.loads(out)["n_depth"] == 64
    rc, out, _ = _run(capsys, "--list-models")
    assert rc == 0 and out.startswith("tiny:") and "llama-3-8b: 32 layers" in out


def test_markdown_optional_columns_follow_flags(capsys):
    rc, out, _ = _run(capsys, "-p", "16", "-n", "0", "-ub", "8,16", "--split", "equal,padded")
    assert rc == 0
    head = [c.strip() for c in out.splitlines()[0].strip("|").split("|")]
    assert head == ["model", "name", "n_layer", "backend", "threads", "n_ubatch", "path", "split", "test", "t/s"]
    body = [[c.strip() for c in l.strip("|").split("|")] for l in out.splitlines()[2:6]]
    assert [(r[5], r[7]) for r in body] == [("8", "equal"), ("8", "padded"), ("16", "equal"), ("16", "padded")]


def test_no_tests_is_an_error(capsys):
    rc, _, err = _run(capsys, "-p", "0", "-n", "0")
    assert rc == 2 and "no tests to run" in err


def test_ragged_experiment_script(tmp_path, capsys):
    rc = ragged_experiment.main(["--out", str(tmp_path), "-ntg", "1", "--", "--device", "cpu", "--n-layer", "1",
                       "-t", "1"])
    assert rc == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2 and files[0].endswith(".jsonl") and files[1].endswith(".md")
    assert files[0].startswith("ragged-cpu-")
    rows = [json.loads(l) for l in (tmp_path / files[0]).read_text().splitlines()]
    # 2 layers x (1 + 2 batches) x 5 strategies
    assert len(rows) == 30
    tokens = {(r["case"], r["pl"]): r["prompt_tokens"] for r in rows}
    assert tokens[("10 prompts of 1..10", 10)] == 55
    # --seed 1 draws the prompts of docs/cli.md's H200 table (1776 and 6759 tokens)
    assert tokens[("16 and 64 prompts of 16-200", 16)] == 1776
    assert tokens[("16 and 64 prompts of 16-200", 64)] == 6759
    ub = {(r["case"], r["pl"], r["split"], r["layer"]): r["ub"] for r in rows}
    assert ub[("10 prompts of 1..10", 10, "equal", "attn")] == 10
    assert ub[("10 prompts of 1..10", 10, "padded", "full")] == 1


@pytest.mark.parametrize("args, msg", [
    (["--n-layer", "-1"], "argument --n-layer: must be at least 0 (0: the model's own), got -1"),
    (["--seed", "-1"], "argument --seed: must be at least 0, got -1"),
    (["-t", "0"], "-t must be at least 1, got 0"),
    (["--kernel", "prefill,reference"], "--kernel prefill runs on the GPU only"),
    (["-fa", "off", "--kernel", "ggml"], "-fa off runs ggml's mul_mat+soft_max path"),
    (["-c", "-5"], "argument -c/--ctx-size: must be at least 0 (0: none), got -5"),
    (["--delay", "99999999999999999999999"], "argument --delay: must be at most 86400, got 99999999999999999999999"),
    (["-b", "200-16"], "-b gives no values (a range A-B with B < A is empty)"),
    (["-ub", "64-8"], "-ub gives no values"),
    (["-d", "9-1"], "-d gives no values"),
    (["-t", "4-2"], "-t gives no values"),
    (["-ngl", "99-1"], "-ngl gives no values"),
    (["-p", "1-100000000"], "argument -p/--n-prompt: '1-100000000' gives 100000000 values; a list holds at most 10000"),
    (["-n", "5000000000"], "argument -n/--n-gen: 5000000000 is more than 2147483647"),
    (["-t", "1-10000000000*10"], "argument -t/--threads: 10000000000 is more than 2147483647"),
])
def test_bad_input_one_line_exit_2(capsys, args, msg):
    rc = bench.main(["-p", "8", "-n", "0", "-r", "1", "--device", "cpu"] + args)
    out = capsys.readouterr()
    assert rc == 2 and out.out == ""
    assert out.err.count("\n") == 1 and msg in out.err and out.err.startswith("ggml-attn-bench: error:")


def test_a_kv_cache_past_the_machines_memory_is_refused_before_the_header(capsys, monkeypatch):
    """llama-bench's p + n cells for a 2**31-token prompt: one line and exit 2 before any output
    (the table's header and build line came first, the allocation's error after them)."""
    from ggml_attn.cli import bench, runner
    monkeypatch.setattr(runner, "memory_bytes", lambda device: 16 << 30)
    rc = bench.main(["-p", "2147483647", "-n", "0", "-r", "1"])
    out = capsys.readouterr()
    assert rc == 2 and out.out == "" and "not enough memory for a KV cache of 2147483647 cells" in out.err
    assert "the host has 16.0 GiB" in out.err
