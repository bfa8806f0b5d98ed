"""End-to-end runs of both console scripts as subprocesses, on the CPU."""
import csv
import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest

BIN = os.path.dirname(sys.executable)


def tool(name):
    path = os.path.join(BIN, name)
    assert os.path.exists(path), f"{name} not installed next to {sys.executable} (pip install -e .)"
    return path


def run(name, *args, timeout=120):
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    p = subprocess.run([tool(name), *args], capture_output=True, text=True, timeout=timeout, env=env)
    return p.returncode, p.stdout, p.stderr


def test_bench_default_runs_tiny_on_cpu():
    rc, out, err = run("ggml-attn-bench", "--device", "cpu", timeout=300)
    assert rc == 0, err
    lines = out.splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head == ["model", "name", "backend", "threads", "path", "test", "t/s"]
    rows = [[c.strip() for c in l.strip("|").split("|")] for l in lines[2:4]]
    assert [r[5] for r in rows] == ["pp512", "tg128"]
    assert all(r[:3] == ["llama ?B F16", "tiny", "CPU"] and r[4] == "numpy" for r in rows)
    assert lines[-1].startswith("build: ")


def test_bench_json_samples_and_csv():
    rc, out, err = run("ggml-attn-bench", "-p", "16,32", "-n", "2", "-pg", "8,2", "-r", "2", "-o", "json",
                       "--device", "cpu", "--progress")
    assert rc == 0, err
    data = json.loads(out)
    assert [(d["n_prompt"], d["n_gen"]) for d in data] == [(16, 0), (32, 0), (0, 2), (8, 2)]
    for d in data:
        assert len(d["samples_ns"]) == 2 and len(d["samples_ts"]) == 2
        assert d["avg_ts"] > 0 and d["backends"] == "CPU" and d["model_name"] == "tiny"
        assert d["model_type"] == "llama ?B F16"   # llama-bench's: llama.cpp's model description
    assert data[2]["ub"] == 2 and data[3]["ub"] == 3  # tg2: 2 steps; pp8+tg2: 1 + 2
    assert "benchmark 1/4: starting" in err and "prompt run 2/2" in err
    rc, out, err = run("ggml-attn-bench", "-p", "16", "-n", "0", "-r", "1", "-o", "csv", "-ub", "8,16",
                       "--device", "cpu")
    assert rc == 0, err
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [r["n_ubatch"] for r in rows] == ["8", "16"] and [r["ub"] for r in rows] == ["2", "1"]


def test_bench_gguf_model(tmp_path):
    import gguf  # in the test extra
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("from-gguf")
    for add, v in ((w.add_block_count, 1), (w.add_embedding_length, 128), (w.add_head_count, 4),
                   (w.add_head_count_kv, 2), (w.add_feed_forward_length, 256), (w.add_context_length, 512)):
        add(v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    rc, out, err = run("ggml-attn-bench", "-m", str(path), "-p", "16", "-n", "0", "-r", "1", "-o", "jsonl",
                       "--layer", "full", "--device", "cpu")
    assert rc == 0, err
    row = json.loads(out)
    assert row["model_name"] == "from-gguf" and row["n_head_kv"] == 2 and row["head_dim"] == 32
    assert row["model_type"] == "llama ?B (guessed) all F32"   # no general.file_type, no tensors
    assert row["layer"] == "full" and row["model_filename"] == str(path)
    # past the file's training context: run, as llama-bench runs it (its context is p + n + d), and
    # said once; -c (not a llama-bench flag) is a hard limit
    rc, _, err = run("ggml-attn-bench", "-m", str(path), "-p", "1024", "-n", "0", "-r", "1", "--layer", "full",
                     "--device", "cpu")
    assert rc == 0 and "past the model's training context, run as llama-bench runs them" in err, err
    rc, _, err = run("ggml-attn-bench", "-m", str(path), "-p", "1024", "-n", "0", "--layer", "full", "--device", "cpu",
                     "-c", "512")
    assert rc == 2 and "context overflow" in err


def test_batched_bench_end_to_end():
    rc, out, err = run("ggml-attn-batched-bench", "--prompt-lens", "1-10", "-ntg", "2", "--split", "all",
                       "-o", "jsonl", "--device", "cpu")
    assert rc == 0, err
    rows = {r["split"]: r for r in map(json.loads, out.splitlines())}
    assert set(rows) == {"simple", "equal", "seq", "padded", "auto"}
    assert rows["equal"]["ub"] == 10 and rows["padded"]["ub"] == 1 and rows["simple"]["ub"] == 1


@pytest.mark.parametrize("name, args, msg", [
    ("ggml-attn-bench", ["-m", "llama-9"], "unknown model"),
    ("ggml-attn-bench", ["-p", "5-1*x"], "invalid range format"),
    ("ggml-attn-bench", ["-b", "0"], "batch sizes must be positive"),
    ("ggml-attn-bench", ["-ngl", "99", "--device", "cpu"], "--device cpu keeps them on the CPU"),
    ("ggml-attn-bench", ["-p", "512", "-c", "100"], "context overflow"),
    ("ggml-attn-batched-bench", ["-npp", "64", "-npl", "8", "-c", "256", "-kvu"], "context overflow"),
])
def test_errors_exit_2_one_line(name, args, msg):
    rc, out, err = run(name, *args, "--device", "cpu")
    assert rc == 2
    assert err.count("\n") == 1 and msg in err and "Traceback" not in err


def test_ctrl_c_prints_finished_rows():
    """SIGINT after the first row: the finished rows and a closed json array come out."""
    env = dict(os.environ)
    p = subprocess.Popen([tool("ggml-attn-bench"), "-p", "16", "-n", "4000", "-r", "3", "-o", "json",
                          "--device", "cpu"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env,
                         # a shell's background job starts with SIGINT ignored; undo that
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    got = ""
    deadline = time.monotonic() + 60
    while '"samples_ts"' not in got and time.monotonic() < deadline:
        got += p.stdout.read(1)
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    rest = p.stdout.read()  # the text wrapper may hold buffered output: read through it
    err = p.stderr.read()
    assert p.wait(timeout=60) == 130
    data = json.loads(got + rest)
    assert len(data) == 1 and data[0]["n_prompt"] == 16
    assert "interrupted" in err and "Traceback" not in err
