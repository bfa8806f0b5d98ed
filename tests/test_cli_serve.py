"""ggml-attn-serve-bench in process: the sample trace, rows and their formats, workloads,
refusals and errors."""
import csv
import io
import json
import math
from pathlib import Path

import pytest

import fixtures_gguf
from ggml_attn.cli import format_serve, serve_bench
from ggml_attn.cli.serve_trace import load_trace, synth_trace

SAMPLE = Path(__file__).resolve().parents[1] / "bench" / "traces" / "sample.jsonl"
CPU = ["--device", "cpu", "-t", "2"]


def _run(capsys, *args):
    rc = serve_bench.main(list(args) + CPU)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _rows(out):
    return [json.loads(line) for line in out.splitlines()]


def test_sample_trace_on_the_tiny_preset(capsys):
    """The sample trace (64 requests, prompts 16-200, outputs 32-256) as the docs run it."""
    trace = load_trace(str(SAMPLE))
    assert len(trace) == 64
    rc, out, err = _run(capsys, "--trace", str(SAMPLE), "-o", "jsonl")
    assert rc == 0, err
    (row,) = _rows(out)
    assert row["rate"] is None and row["trace"] == str(SAMPLE) and row["model"] == "tiny"
    assert (row["n_done"], row["n_refused"], row["n_slots"]) == (64, 0, 64)
    assert row["split"] == "equal" and row["kv_unified"] is False and row["prompt_budget"] == 2048
    n_out = sum(r.n_predict for r in trace)
    assert row["out_tok_per_s"] == pytest.approx(n_out / row["elapsed_s"])
    assert row["prompt_tok_per_s"] == pytest.approx(sum(r.prompt_len for r in trace) / row["elapsed_s"])
    for what in ("ttft", "itl"):
        p50, p90, p99 = (row[f"{what}_ms_p{q}"] for q in (50, 90, 99))
        assert 0 < p50 <= p90 <= p99
    assert row["itl_ms_p99"] <= row["itl_ms_max"]
    assert 0 < row["mixed_share"] < 1 and row["ub_per_step"] >= 1
    # every request's cells at once at most, and every prompt's at least once
    assert max(r.prompt_len for r in trace) <= row["kv_cells_peak"] <= sum(r.prompt_len + r.n_predict for r in trace)
    assert row["steps"] >= max(r.n_predict for r in trace)


def test_every_split_side_by_side_with_budgets(capsys):
    rc, out, _ = _run(capsys, "--rate", "inf", "-n", "6", "--gen-dist", "2-4", "--prompt-dist", "3-30",
                      "--split", "all", "--prompt-budget", "0,8", "-o", "jsonl")
    assert rc == 0
    rows = _rows(out)
    assert [(r["prompt_budget"], r["split"]) for r in rows] == [
        (b, s) for s in ("simple", "equal", "seq", "padded", "auto") for b in (0, 8)]   # a strategy's rows together
    for r in rows:
        assert r["kv_unified"] is (r["split"] == "simple") and r["n_done"] == 6 and r["rate"] == "inf"
    whole = {r["split"]: r for r in rows if r["prompt_budget"] == 0}
    chunked = {r["split"]: r for r in rows if r["prompt_budget"] == 8}
    # every prompt whole in one step, then decode; 8 prompt tokens a step: more steps, mixed ones
    assert whole["simple"]["mixed_share"] == 0 and chunked["simple"]["mixed_share"] > 0
    assert chunked["simple"]["steps"] > whole["simple"]["steps"]
    # padded pads ragged prompts to one length; equal cuts them into more ubatches
    assert whole["padded"]["n_pad"] > 0 and whole["equal"]["n_pad"] == 0


def test_the_best_strategy_per_rate_is_named_on_stderr(capsys):
    """After the table (stdout as the format has it), one stderr line per rate and budget that
    compared strategies: the one with the most output t/s, the lowest TTFT p50, the lowest ITL
    p99, with their values -- the ones the rows hold."""
    rc, out, err = _run(capsys, "--rate", "inf,20", "-n", "6", "--gen-dist", "2-4", "--prompt-dist", "3-30",
                        "--split", "simple,equal", "-o", "jsonl")
    assert rc == 0
    rows = _rows(out)
    lines = [ln for ln in err.splitlines() if "most output t/s" in ln]
    assert [ln.split(": ", 1)[1].split(",")[0] for ln in lines] == ["all at once", "20/s"]
    for line, rate in zip(lines, ("inf", 20.0)):
        rs = [r for r in rows if r["rate"] == rate]
        top = max(rs, key=lambda r: r["out_tok_per_s"])
        kv = "-kvu" if top["kv_unified"] else "per-stream"
        assert f"most output t/s: {top['split']} {kv} ({top['out_tok_per_s']:,.1f})" in line
        low = min(rs, key=lambda r: r["itl_ms_p99"])
        assert f"lowest ITL p99: {low['split']} {'-kvu' if low['kv_unified'] else 'per-stream'} " \
               f"({low['itl_ms_p99']:,.1f} ms)" in line
    rc, _, err = _run(capsys, "--rate", "inf", "-n", "3", "--gen-dist", "2-3", "--prompt-dist", "3-8", "-o", "jsonl")
    assert rc == 0 and "most output t/s" not in err   # one strategy: nothing to compare
    assert format_serve.summary([dict(rate=1.0, prompt_budget=0, split="a", kv_unified=True, n_refused=1,
                                      out_tok_per_s=1.0)] * 2) == []   # rows that refused requests: left out


def test_formats(capsys):
    args = ["--rate", "50", "-n", "3", "--gen-dist", "2", "--prompt-dist", "4-9"]
    rc, out, _ = _run(capsys, *args, "-o", "csv")
    assert rc == 0
    table = list(csv.reader(io.StringIO(out)))
    assert table[0] == format_serve.KEYS and len(table) == 2
    rc, out, _ = _run(capsys, *args, "-o", "json")
    (row,) = json.loads(out)
    assert set(row) == set(format_serve.KEYS) and row["rate"] == 50 and row["gen_dist"] == "2-2"
    assert (row["flash_attn"], row["warmup"], row["seed"], row["n_slots"]) == ("auto", False, 0, 3)
    rc, out, _ = _run(capsys, *args, "-r", "2", "--warmup")
    lines = [l for l in out.splitlines() if l.startswith("|")]
    assert len(lines) == 3 and len({len(l) for l in lines}) == 1   # aligned columns
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[0] == "50" and cells[-1] == "3/3" and "±" in cells[5]


def test_rate_sweep_serves_the_same_requests_faster():
    slow, fast = (synth_trace(r, 20, (16, 200), (32, 256), 3) for r in (1.0, 100.0))
    assert [(a.prompt_len, a.n_predict) for a in slow] == [(b.prompt_len, b.n_predict) for b in fast]
    assert slow[0].arrival == fast[0].arrival == 0
    assert slow[-1].arrival > 50 * fast[-1].arrival
    assert all(r.arrival == 0 for r in synth_trace(math.inf, 5, (1, 2), (1, 2), 0))


def test_saved_trace_replays_the_same_requests(capsys, tmp_path):
    path = tmp_path / "t.jsonl"
    rc, out, err = _run(capsys, "--rate", "200", "-n", "5", "--gen-dist", "3", "--save-trace", str(path),
                        "-o", "jsonl")
    assert rc == 0 and f"wrote {path}" in err
    assert [(r.prompt_len, r.n_predict) for r in load_trace(str(path))] == [
        (r.prompt_len, r.n_predict) for r in synth_trace(200, 5, (16, 200), (3, 3), 0)]
    rc, out2, _ = _run(capsys, "--trace", str(path), "-o", "jsonl")
    a, b = _rows(out)[0], _rows(out2)[0]
    assert a["steps"] == b["steps"] or a["prompt_tok_per_s"] > 0   # timing may regroup steps
    assert (a["n_done"], b["n_done"]) == (5, 5)
    rc, _, _ = _run(capsys, "--rate", "1,2", "-n", "2", "--save-trace", str(tmp_path / "s.jsonl"), "--gen-dist", "1")
    assert rc == 0 and (tmp_path / "s-1.jsonl").exists() and (tmp_path / "s-2.jsonl").exists()


def test_save_trace_errors_name_their_flag_and_rate_repeats(capsys, tmp_path):
    """A --save-trace file that cannot be written is a one-line error of --save-trace (not of
    --plot); --rate given twice sweeps both lists, like every list flag."""
    bad = tmp_path / "missing-dir" / "t.jsonl"
    rc, out, err = _run(capsys, "--rate", "4", "-n", "2", "--save-trace", str(bad))
    assert rc != 0 and out == "" and f"--save-trace: cannot write {bad}" in err and "--plot" not in err
    rc, out, err = _run(capsys, "--rate", "100", "--rate", "200,inf", "-n", "2", "--gen-dist", "1", "-o", "jsonl")
    assert rc == 0, err
    assert [r["rate"] for r in _rows(out)] == [100.0, 200.0, "inf"]   # JSON has no infinity


def test_a_request_longer_than_a_sequence_is_refused_and_the_others_finish(capsys, tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival": 0, "prompt_len": 20, "n_predict": 4}\n'
                    '# a comment, then a request too long for -c 512 over 2 streams\n'
                    '{"arrival": 0.001, "prompt_len": 300, "n_predict": 4}\n'
                    '{"arrival": 0.002, "prompt": [1, 2, 3], "n_predict": 5}\n')
    rc, out, err = _run(capsys, "--trace", str(path), "-c", "512", "-np", "2", "-o", "jsonl")
    assert rc == 0
    (row,) = _rows(out)
    assert (row["n_done"], row["n_refused"], row["n_requests"]) == (2, 1, 3)
    assert "1 of 3 request(s) refused" in err
    assert "request 1: 300 prompt + 4 output tokens need 303 KV cells, a sequence's stream (2 streams) holds 256" in err


def test_every_request_refused_over_repetitions_is_a_row_of_dashes(capsys):
    """Nothing served in any repetition: no rate to average (NaN each run) -- the row says so
    ("-", done 0/4), in md and jsonl alike, and the run ends with exit 1 and a line saying that a
    row served nothing (it ended 0, as a run that measured something)."""
    args = ("-n", "4", "--prompt-dist", "300-400", "--gen-dist", "2-4", "--rate", "inf", "-c", "512", "-np", "4",
            "-r", "2")
    rc, out, err = _run(capsys, *args)
    assert rc == 1 and "all 4 request(s) refused" in err
    assert err.strip().splitlines()[-1].endswith("error: 1 of 1 row(s) served no request: every one was refused")
    line = out.strip().splitlines()[-1]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[-1] == "0/4" and cells[5] == "-" and "nan" not in line.lower()
    rc, out, _ = _run(capsys, *args, "-o", "jsonl")
    (row,) = _rows(out)
    assert rc == 1 and row["n_done"] == 0 and row["out_tok_per_s"] is None and row["out_tok_per_s_stddev"] == 0.0   # (NaN: null)


def test_np_0_is_the_documented_default(capsys):
    """``-np 0`` (its help: "0: min(requests, 64)") runs as the default does, not refused."""
    rows = []
    for extra in ((), ("-np", "0")):
        rc, out, err = _run(capsys, "-n", "3", "--prompt-dist", "4-8", "--gen-dist", "2-3", "--rate", "inf",
                            "-o", "jsonl", *extra)
        assert rc == 0, err
        rows.append(_rows(out))
    rc, out, err = _run(capsys, "-n", "3", "--prompt-dist", "4-8", "--gen-dist", "2-3", "--rate", "inf", "-c", "1",
                        "-o", "jsonl")
    (row,) = _rows(out)   # (n_ctx: the cells the cache holds, -c 1 padded to 256 for each of 3 streams)
    assert rc == 0 and row["n_ctx"] == 768 and row["kv_cells_peak"] <= 768
    assert [(r["n_slots"], r["n_done"]) for r in rows[0]] == [(r["n_slots"], r["n_done"]) for r in rows[1]] == [(3, 3)]   # (one split: one row)


def test_a_request_longer_than_any_cache_makes_no_token_ids(capsys, tmp_path, monkeypatch):
    """A 2**31-token prompt: with -c the request is refused (its ids never made: 8 GB of them
    killed the process before); without, the cache it would need is refused before any output
    (its size against the machine's memory, here a 16 GiB fake) -- not after making the ids."""
    from ggml_attn.cli import runner
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival": 0, "prompt_len": 2147483647, "n_predict": 4}\n'
                    '{"arrival": 0.01, "prompt_len": 10, "n_predict": 3}\n')
    rc, out, err = _run(capsys, "--trace", str(path), "-c", "512", "-o", "jsonl")
    (row,) = _rows(out)
    assert rc == 0 and (row["n_done"], row["n_refused"]) == (1, 1) and "2147483647 prompt + 4 output tokens" in err
    monkeypatch.setattr(runner, "memory_bytes", lambda device: 16 << 30)
    rc, out, err = _run(capsys, "--trace", str(path))
    assert rc == 2 and out == "" and "not enough memory for a KV cache of" in err and "has 16.0 GiB" in err


def test_a_gguf_model_serves_its_own_greedy_tokens(capsys, tmp_path):
    path = fixtures_gguf.fixture_path("llama-q8_0", tmp_path)
    rc, out, err = _run(capsys, "-m", path, "--rate", "100", "-n", "4", "--gen-dist", "2-5", "--prompt-dist", "2-20",
                        "-kvu", "--split", "simple,auto", "-o", "jsonl")
    assert rc == 0, err
    rows = _rows(out)
    assert [r["layer"] for r in rows] == ["model", "model"] and all(r["n_done"] == 4 for r in rows)


@pytest.mark.parametrize("args,msg", [
    (["--trace", "/nonexistent.jsonl"], "cannot read --trace '/nonexistent.jsonl'"),
    (["--rate", "0"], "a rate must be positive"),
    (["--rate", "fast"], "invalid rate 'fast'"),
    (["--prompt-dist", "9-3"], "invalid --prompt-dist '9-3'"),
    (["-np", "300"], "must be at most 256"),
    (["--rate", "1e-300", "-n", "4"], "past the 1e+06 s a workload may span"),
    (["--save-trace", ""], "--save-trace needs a file name"),
    (["--trace", str(SAMPLE), "--rate", "4"], "not both"),
    (["--trace", str(SAMPLE), "--save-trace", "x.jsonl"], "--trace is a file already"),
    # the synthetic workload's flags beside a trace (they were ignored: the trace ran as it is)
    (["--trace", str(SAMPLE), "-n", "5"], "--trace gives the requests and their lengths; -n is for a --rate"),
    (["--trace", str(SAMPLE), "--prompt-dist", "4-8", "--gen-dist", "1-2"], "--prompt-dist, --gen-dist are for"),
    (["-b", "16", "-ub", "64", "--prompt-budget", "x"], "invalid range format 'x'"),
])
def test_user_errors_are_one_line(capsys, args, msg):
    rc, out, err = _run(capsys, *args)
    assert rc == 2 and out == "" and msg in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("line,msg", [
    ("{not json", "not JSON"),
    ('[1, 2]', "a request is a JSON object"),
    ('{"arrival": -1, "prompt_len": 3, "n_predict": 1}', "'arrival' must be seconds from 0 to 1e+06"),
    ('{"arrival": 1e308, "prompt_len": 3, "n_predict": 1}', "'arrival' must be seconds from 0 to 1e+06"),
    ('{"arrival": ' + "9" * 400 + ', "prompt_len": 3, "n_predict": 1}', "got an integer of 400 digits"),
    ('{"arrival": NaN, "prompt_len": 3, "n_predict": 1}', "got nan"),
    ("[" * 100000, "not JSON this reader takes (nested too deeply)"),
    ('{"arrival": 0, "prompt_len": ' + "9" * 5000 + ', "n_predict": 1}', "(a number of too many digits)"),
    ('{"arrival": 0, "prompt_len": 3}', "'n_predict' must be an integer >= 1"),
    ('{"arrival": 0, "prompt_len": 0, "n_predict": 1}', "'prompt_len' must be an integer >= 1"),
    ('{"arrival": 0, "prompt": [1, -2], "n_predict": 1}', "'prompt' must be a non-empty list"),
    ('{"arrival": 0, "prompt": [1], "prompt_len": 1, "n_predict": 1}', "not both"),
])
def test_bad_trace_lines_name_file_and_line(capsys, tmp_path, line, msg):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"arrival": 0, "prompt_len": 3, "n_predict": 1}\n\n' + line + "\n")
    rc, _, err = _run(capsys, "--trace", str(path))
    assert rc == 2 and f"{path}:3: " in err and msg in err


def test_token_ids_outside_the_vocabulary(capsys, tmp_path):
    model = fixtures_gguf.fixture_path("llama-q8_0", tmp_path)
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival": 0, "prompt": [1, 256], "n_predict": 1}\n')
    rc, _, err = _run(capsys, "-m", model, "--trace", str(path))
    assert rc == 2 and "request 0: token id 256 is not in the model's vocabulary (n_vocab 256)" in err


def test_plot_needs_matplotlib_or_writes(capsys, tmp_path):
    out = tmp_path / "serve.png"
    rc, _, err = _run(capsys, "--rate", "100,inf", "-n", "3", "--gen-dist", "2", "--plot", str(out))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert rc == 2 and "needs matplotlib" in err
        return
    assert rc == 0 and out.stat().st_size > 1000 and out.read_bytes()[:4] == b"\x89PNG"


def test_help_names_the_columns(capsys):
    with pytest.raises(SystemExit):
        serve_bench.build_parser().parse_args(["--help"])
    text = capsys.readouterr().out
    assert "TTFT" in text and "--prompt-budget" in text and "llama-server" in text


def test_warmup_serves_the_trace_until_the_engine_is_steady(capsys, monkeypatch):
    """--warmup: the row's trace served untimed as many times as the engine needs before a run
    of a prompt shape is like every later one (Runner.runs_to_steady: 1 on the CPU, 2 on a GPU:
    a prompt shape is captured at its second run), then -r timed passes; none without it."""
    from ggml_attn.cli.runner import Runner
    from ggml_attn.graph import serve as serve_mod
    passes = []
    real = serve_mod.serve

    def counting(reqs, *a, **kw):
        passes.append(len(reqs))
        return real(reqs, *a, **kw)
    monkeypatch.setattr(serve_mod, "serve", counting)
    args = ["--rate", "50", "-n", "3", "--gen-dist", "2", "--prompt-dist", "4-9", "-o", "jsonl"]
    for steady, warmup, want in ((1, True, 1 + 2), (2, True, 2 + 2), (2, False, 2)):
        monkeypatch.setattr(Runner, "runs_to_steady", lambda self, decode_step, n=steady: 1 if decode_step else n)
        passes.clear()
        rc, out, err = _run(capsys, *args, "-r", "2", *(["--warmup"] if warmup else []))
        assert rc == 0, err
        (row,) = _rows(out)
        assert len(passes) == want and row["warmup"] is warmup and row["n_requests"] == 3


def test_requests_past_the_training_context_are_said_and_served(capsys, tmp_path):
    """A trace request longer than the model's training context (the tiny preset's 8192): one
    stderr line says how many, and it is served (as bench runs such tests; it ran silently)."""
    trace = tmp_path / "long.jsonl"
    trace.write_text('{"arrival": 0, "prompt_len": 8, "n_predict": 2}\n'
                     '{"arrival": 0, "prompt_len": 8200, "n_predict": 2}\n')
    rc, out, err = _run(capsys, "-m", "tiny", "--trace", str(trace), "-o", "jsonl", "--n-layer", "1")
    (row,) = _rows(out)
    assert rc == 0 and row["n_done"] == 2, err
    assert err.count("1 request(s) need more positions than the model's training context (8192; the longest 8201)") == 1
    rc, _, err = _run(capsys, "-m", "tiny", "--trace", str(SAMPLE), "-o", "jsonl", "--n-layer", "1")
    assert rc == 0 and "training context" not in err


def test_llama_server_flags(capsys):
    """llama-server's spellings: -np / --parallel (the slots), -ngl (0: the CPU path; checked
    against --device as batched-bench does), -cb (said once: always on here)."""
    args = ("-m", "tiny", "-n", "2", "--prompt-dist", "4-8", "--gen-dist", "1-2", "--rate", "inf", "-o", "jsonl",
            "--n-layer", "1")
    rc, out, err = _run(capsys, *args, "--parallel", "2", "-ngl", "0", "-cb")
    (row,) = _rows(out)
    assert rc == 0 and row["n_slots"] == 2 and row["device"] == "cpu", err
    assert err.count("-cb: requests join and leave the running batch here always") == 1
    rc, out, err = _run(capsys, *args, "-ngl", "1")   # (_run gives --device cpu: they contradict)
    assert rc == 2 and "-ngl 1 offloads layers to the GPU but --device cpu" in err and out == ""
