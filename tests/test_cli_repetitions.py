"""ggml-attn-batched-bench -r (mean ± stddev as llama-bench) and the progress bar: count done,
elapsed, estimate left, only when stderr is a terminal."""
import io
import json
import statistics
import sys

import pytest

from ggml_attn.cli import batched_bench, bench
from ggml_attn.cli.progress import ProgressBar

FAST = ["-t", "1", "--n-layer", "1", "--device", "cpu"]


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_repetitions_give_samples_mean_and_stddev(capsys):
    rc = batched_bench.main(["-npp", "8", "-npl", "1,2", "-ntg", "2", "-r", "3", "-o", "jsonl"] + FAST)
    out = capsys.readouterr()
    assert rc == 0, out.err
    rows = [json.loads(l) for l in out.out.splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert len(r["t_pp_samples"]) == 3 and len(r["t_tg_samples"]) == 3
        assert r["t_pp"] == pytest.approx(statistics.mean(r["t_pp_samples"]))
        speeds = [r["prompt_tokens"] / t for t in r["t_pp_samples"]]
        assert r["speed_pp"] == pytest.approx(statistics.mean(speeds))
        assert r["speed_pp_stddev"] == pytest.approx(statistics.stdev(speeds))
        assert r["speed_tg_stddev"] >= 0 and r["speed_stddev"] >= 0


def test_markdown_shows_plus_minus_with_repetitions(capsys):
    rc = batched_bench.main(["-npp", "8", "-npl", "1", "-ntg", "2", "-r", "2"] + FAST)
    out = capsys.readouterr().out
    assert rc == 0
    lines = [l for l in out.splitlines() if l.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    cells = dict(zip(head, (c.strip() for c in lines[2].strip("|").split("|"))))
    assert " ± " in cells["S_PP t/s"] and " ± " in cells["S_TG t/s"] and " ± " in cells["S t/s"]
    assert len({len(l) for l in lines}) == 1
    assert "repetitions = 2" in out


def test_one_repetition_keeps_llama_batched_bench_cells(capsys):
    rc = batched_bench.main(["-npp", "8", "-npl", "1", "-ntg", "2"] + FAST)
    out = capsys.readouterr().out
    assert rc == 0 and "±" not in out


def test_bad_repetitions(capsys):
    rc = batched_bench.main(["-r", "0"] + FAST)
    err = capsys.readouterr().err
    assert rc == 2 and "-r" in err and err.count("\n") == 1


def test_no_progress_bar_when_stderr_is_not_a_terminal(capsys):
    rc = batched_bench.main(["-npp", "8", "-npl", "1,2", "-ntg", "1"] + FAST)
    assert rc == 0 and capsys.readouterr().err == ""


@pytest.mark.parametrize("tool, args, total", [
    (batched_bench, ["-npp", "8", "-npl", "1,2", "-ntg", "1", "-r", "2"], 4),
    (bench, ["-p", "8,16", "-n", "0", "-r", "1", "--no-warmup"], 2),
])
def test_progress_bar_on_a_terminal(capsys, monkeypatch, tool, args, total):
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    rc = tool.main(args + FAST)
    out = capsys.readouterr().out
    assert rc == 0
    text = term.getvalue()
    assert f"{total}/{total}" in text and "<" in text  # count done / total, elapsed<left
    assert "|" in out  # the table still reaches stdout


def test_progress_bar_class_counts_and_estimates():
    term = _Terminal()
    bar = ProgressBar(4, "x", file=term)
    bar.update("a")
    bar.update("b")
    bar.close()
    assert "2/4" in term.getvalue() and "<" in term.getvalue()
    quiet = io.StringIO()
    bar = ProgressBar(4, "x", file=quiet)
    bar.update("a")
    bar.close()
    assert quiet.getvalue() == ""


def test_tqdm_is_a_dependency():
    from pathlib import Path
    text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    deps = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert '"tqdm' in deps


def test_warmup_runs_each_row_untimed_until_steady(capsys, monkeypatch):
    """--warmup: untimed runs of each row before its repetitions (the samples stay -r's), as many
    as the engine needs (Runner.runs_to_steady: one on the CPU, two on a GPU)."""
    calls = []
    real = batched_bench.run_row

    def counting(runner, row, pps, tgs=False):
        calls.append(row["pl"])
        return real(runner, row, pps, tgs)
    monkeypatch.setattr(batched_bench, "run_row", counting)
    rc = batched_bench.main(["-npp", "8", "-npl", "1,2", "-ntg", "2", "-r", "2", "-o", "jsonl", "--warmup"] + FAST)
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert calls == [1, 1, 1, 2, 2, 2]
    assert all(len(json.loads(l)["t_pp_samples"]) == 2 for l in out.out.splitlines())
    calls.clear()
    assert batched_bench.main(["-npp", "8", "-npl", "1", "-ntg", "2", "-o", "jsonl"] + FAST) == 0
    assert calls == [1], "no row warm-up by default"
    # as many untimed runs as the engine needs for a prompt to run as the next will (a GPU's: 2)
    from ggml_attn.cli.runner import Runner
    monkeypatch.setattr(Runner, "runs_to_steady", lambda self, decode_step: 1 if decode_step else 2)
    calls.clear()
    assert batched_bench.main(["-npp", "8", "-npl", "1,2", "-ntg", "2", "-r", "1", "-o", "jsonl", "--warmup"] + FAST) == 0
    assert calls == [1, 1, 1, 2, 2, 2]
