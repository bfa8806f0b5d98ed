"""ggml-attn-batched-bench in process: ragged ubatch counts, plans, rows, errors."""
import json

import pytest

from ggml_attn.cli import batched_bench

FAST = ["-t", "1", "--n-layer", "1"]


def _run(capsys, *args):
    rc = batched_bench.main(list(args) + FAST)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_plan_ragged_1_to_10_matches_graph_builder(capsys):
    """10 prompts of 1..10 tokens on split KV -> equal 10 ubatches, padded 1."""
    rc, out, _ = _run(capsys, "--prompt-lens", "1-10", "-ntg", "1", "--split", "all", "--plan", "-o", "jsonl")
    assert rc == 0
    plans = {p["split"]: p for p in map(json.loads, out.splitlines())}
    assert plans["equal"]["ub"] == 10 and plans["equal"]["shapes"][0] == "10x1"
    assert plans["equal"]["shapes"][-1] == "1x1"
    assert plans["padded"]["ub"] == 1 and plans["padded"]["shapes"] == ["10x10"]
    assert plans["padded"]["n_pad"] == 45
    assert plans["simple"]["ub"] == 1 and plans["simple"]["kv_unified"] is True
    assert plans["seq"]["ub"] == 10
    assert plans["auto"]["ub"] >= 1 and plans["auto"]["reason"]


def test_plan_ten_prompts_of_100(capsys):
    rc, out, _ = _run(capsys, "-npp", "100", "-npl", "10", "-ntg", "1", "--split", "equal", "--plan")
    assert rc == 0
    assert "2 ubatches" in out and "10x51 10x49" in out


def test_ragged_rows_report_ubatches(capsys):
    rc, out, _ = _run(capsys, "--prompt-lens", "1-10", "-ntg", "2", "--split", "equal,padded",
                      "-o", "jsonl")
    assert rc == 0
    rows = [json.loads(l) for l in out.splitlines()]
    assert [(r["split"], r["ub"]) for r in rows] == [("equal", 10), ("padded", 1)]
    for r in rows:
        assert r["pp"] == 5.5 and r["prompt_lens"] == list(range(1, 11)) and r["pl"] == 10
        assert r["path"] == "numpy" and (r["pp_min"], r["pp_max"]) == (1, 10)
        assert r["prompt_tokens"] == 55 and r["n_kv"] == 55 + 10 * 2
        assert r["ub_tg"] == 2 and r["t_pp"] > 0 and r["t_tg"] > 0
        assert abs(r["speed_pp"] - 55 / r["t_pp"]) < 1e-6 * r["speed_pp"]
    assert rows[1]["n_pad"] == 45 and rows[0]["n_pad"] == 0


def test_uniform_rows_order_and_markdown(capsys):
    rc, out, _ = _run(capsys, "-npp", "8,16", "-ntg", "2", "-npl", "1,2")
    assert rc == 0
    table = [l for l in out.splitlines() if l.startswith("|")]
    assert len(table) == 2 + 4
    cells = [[c.strip() for c in l.strip("|").split("|")] for l in table[2:]]
    # llama-batched-bench order: pp outer, then tg, then pl
    assert [(c[0], c[2]) for c in cells] == [("8", "1"), ("8", "2"), ("16", "1"), ("16", "2")]
    assert [c[3] for c in cells] == ["10", "20", "18", "36"]  # N_KV = pl*(pp+tg)
    assert all(c[10] == "equal" for c in cells)
    # a list that repeats a value runs it again where it stands (the rows were sorted by each
    # value's first position, so -npl 2,1,4,1 printed B = 2, 1, 1, 4)
    rc, out, _ = _run(capsys, "-npp", "8,4,8", "-ntg", "1", "-npl", "2,1,2", "-o", "jsonl")
    assert rc == 0
    assert [(r["pp"], r["pl"]) for r in map(json.loads, out.splitlines())] == \
        [(8, 2), (8, 1), (8, 2), (4, 2), (4, 1), (4, 2), (8, 2), (8, 1), (8, 2)]


def test_shared_prompt_and_unified(capsys):
    rc, out, _ = _run(capsys, "-npp", "16", "-ntg", "2", "-npl", "3", "-pps", "-kvu", "-o", "jsonl")
    assert rc == 0
    r = json.loads(out)
    assert r["is_pp_shared"] == 1 and r["n_kv"] == 16 + 3 * 2 and r["split"] == "simple"
    assert r["kv_unified"] is True


def test_prompt_dist_is_seeded(capsys):
    a = _run(capsys, "--prompt-dist", "16-200", "-npl", "4", "-ntg", "1", "--seed", "3", "--plan", "-o", "jsonl")[1]
    b = _run(capsys, "--prompt-dist", "16-200", "-npl", "4", "-ntg", "1", "--seed", "3", "--plan", "-o", "jsonl")[1]
    lens = json.loads(a.splitlines()[0])["prompt_lens"]
    assert a == b and len(lens) == 4 and all(16 <= x <= 200 for x in lens)


@pytest.mark.parametrize("args, msg", [
    (["-m", "nope"], "unknown model 'nope'"),
    (["-npp", "1-"], "invalid range format"),
    (["-b", "64", "-ub", "0"], "batch sizes must be positive (n_batch 64, n_ubatch 0)"),
    (["-npp", "512", "-npl", "4", "-ntg", "1", "-c", "1024"], "context overflow"),
    (["--prompt-dist", "200-16"], "need 1 <= MIN <= MAX"),
    (["--prompt-dist", "1-99999999999999999999"], "need 1 <= MIN <= MAX <= 2147483647"),
    (["--split", "zigzag"], "choose from"),
    # split KV: 2 streams of -c/2 = 200 (-> 256) cells, the 300-token prompt needs 301 in its
    # stream; an explicit -c is a limit, not grown silently
    (["--prompt-lens", "20,300", "-ntg", "1", "-c", "400"],
     "split 'equal' (split KV, 2 streams of -c/2 cells) needs 602 KV cells but -c 400 holds 512"),
    (["--prompt-dist", "1-3", "-npl", "0", "-ntg", "1"], "-npl values must be >= 1"),
    (["-c", "-5"], "argument -c/--ctx-size: must be at least 0 (0: the model's training context), got -5"),
    (["-npp", "200-16"], "-npp gives no values (a range A-B with B < A is empty)"),
    (["-ntg", "9-1"], "-ntg gives no values"),
    (["-npl", "8-2"], "-npl gives no values"),
    (["--prompt-dist", "1-3", "-npl", "8-2"], "-npl gives no values"),
    (["--prompt-lens", "3,5", "-ntg", "4-2"], "-ntg gives no values"),
    (["-npl", "257"], "argument -npl: 257 is more than 256: at most 256 sequences run together"),
    (["-npl", "99999999999999999999"], "at most 256 sequences run together"),
    (["-npl", "1-2000000000"], "argument -npl: 2000000000 is more than 256"),   # refused before expanding
    (["-npp", "1-100000000"], "argument -npp: '1-100000000' gives 100000000 values; a list holds at most 10000"),
    (["--prompt-lens", "1-2000000000"], "argument --prompt-lens: '1-2000000000' gives 2000000000 values"),
    (["--prompt-dist", "1-3", "-npl", "99999999999999999999"], "at most 256 sequences run together"),
    (["--prompt-lens", "1-300", "-ntg", "1"], "--prompt-lens gives 300 sequences: at most 256"),
    (["--n-layer", "-1"], "argument --n-layer: must be at least 0 (0: the model's own), got -1"),
    (["--n-layer", "-2"], "got -2"),
    (["--seed", "-1"], "argument -s/--seed: must be at least 0, got -1"),
    (["-t", "0"], "argument -t/--threads: must be at least 1, got 0"),
    (["--kernel", "decode", "--device", "cpu", "--plan"], "--kernel decode runs on the GPU only"),
    (["-fa", "off", "--kernel", "ggml", "--device", "cpu", "--plan"], "-fa off runs ggml's mul_mat+soft_max"),
])
def test_errors_one_line_exit_2(capsys, args, msg):
    rc, out, err = _run(capsys, *args)
    assert rc == 2
    assert err.count("\n") == 1 and msg in err and "Traceback" not in err
    assert err.startswith("ggml-attn-batched-bench: error:")


def test_plot_needs_matplotlib_or_writes(capsys, tmp_path):
    png = tmp_path / "cmp.png"
    rc, _, err = _run(capsys, "--prompt-lens", "1-4", "-ntg", "1", "--split", "equal,padded",
                      "--plot", str(png))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert rc == 2 and "needs matplotlib" in err
        return
    assert rc == 0 and png.read_bytes()[:4] == b"\x89PNG"


def test_split_kv_sized_for_every_row_of_the_largest_b(capsys):
    """-npl 1,2: the cache has 2 streams, so B=1's long prompt must fit half of it."""
    rc, out, err = _run(capsys, "--prompt-dist", "16-300", "-npl", "1,2", "-ntg", "1", "--seed", "0",
                        "-o", "jsonl")
    assert rc == 0, err
    rows = [json.loads(l) for l in out.splitlines()]
    assert [r["prompt_lens"] for r in rows] == [[258], [197, 161]]


def test_rows_over_c_are_skipped_like_llama_batched_bench(capsys):
    """llama-batched-bench's own usage line (-c 2048 -npl 1,2,4,8,16,32) has rows whose N_KV
    exceeds -c: it skips them; the first one aborted the run here. One stderr line names them."""
    rc, out, err = _run(capsys, "-c", "256", "-npp", "16", "-ntg", "16", "-npl", "1,2,4,8,16", "-kvu",
                        "--device", "cpu", "-o", "jsonl")
    assert rc == 0, err
    assert [json.loads(line)["pl"] for line in out.splitlines()] == [1, 2, 4, 8]
    assert err.count("\n") == 1 and "skipping 1 row(s) that do not fit -c 256: B=16 PP=16 TG=16 (N_KV 512)" in err
    # split KV, as llama.cpp's context pads it (llama_n_ctx): -c 2048 over 32 sequences is 64 cells a
    # stream, padded to 256: 8192 cells, so B=16 and B=32 (N_KV 4096, 8192) fit and run too (the
    # --plan run places every token of every step in the cache)
    rc, out, err = _run(capsys, "-c", "2048", "-npp", "128", "-ntg", "128", "-npl", "1,2,4,8,16,32",
                        "--device", "cpu", "--plan", "-o", "jsonl")
    assert rc == 0, err
    assert [json.loads(line)["pl"] for line in out.splitlines()] == [1, 2, 4, 8, 16, 32]
    assert "skipping" not in err
    # (and -c 1 is llama.cpp's 256 cells: a 20-token row runs)
    rc, out, err = _run(capsys, "-c", "1", "-npp", "16", "-ntg", "4", "-npl", "1", "--device", "cpu", "-o", "jsonl")
    assert rc == 0 and json.loads(out.splitlines()[-1])["n_kv"] == 20, err



def test_padded_with_c_for_the_real_tokens_runs(capsys):
    """-c holds the real tokens (205 cells of 256) but not the padded ubatch (2x200): the row
    runs (as the equal split, no pads) instead of a context overflow before the run."""
    rc, out, err = _run(capsys, "--prompt-lens", "3,200", "-ntg", "1", "--split", "padded", "-kvu", "-c", "256",
                        "--device", "cpu", "-o", "jsonl")
    assert rc == 0 and err == "", err
    row = json.loads(out)
    assert row["split"] == "padded" and row["n_pad"] == 0 and row["n_kv"] == 205


@pytest.mark.parametrize("tool", ["bench", "batched"])
def test_kernel_help_lists_what_dispatch_lists(capsys, tool):
    """The sm_90a kernels (prefill-wgmma, decode-tma) were missing from ggml-attn-bench's help."""
    from ggml_attn import dispatch
    from ggml_attn.cli import bench
    rc = (bench if tool == "bench" else batched_bench).main(["--help"])
    assert rc == 0
    text = " ".join(capsys.readouterr().out.split())
    kernel = text.split("--kernel", 2)[-1].replace("- ", "-")   # the help line, unwrapped
    for k in dispatch.KERNELS + ("ggml",):
        assert k in kernel, k
    assert "prefill-wgmma" in kernel and "decode-tma" in kernel
