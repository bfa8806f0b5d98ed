"""llama-bench users' flags: exact parsing, -fa auto, -t limit, -ctk/-ctv, -o sql, -oe, -v,
--delay, -ngl, -b < -ub."""
import json
import re
import sys

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


# ---- no abbreviations; an unknown flag names itself
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


# ---- -fa shows auto
def test_fa_default_is_auto_in_help_and_json(capsys):
    rc, out, _ = _bench(capsys, "--help")
    assert rc == 0
    fa_help = " ".join(out.split("-fa on|off|auto, --flash-attn on|off|auto", 1)[1].split())
    assert "(default: auto)" in fa_help.split(" -kvu")[0] and "default: -1" not in out
    rc, out, err = _bench(capsys, "-p", "8", "-n", "0", "-r", "1", "--no-warmup", "-o", "jsonl", *FAST)
    assert rc == 0, err
    assert json.loads(out)["flash_attn"] == -1          # llama-bench's integer (llama_flash_attn_type)
    rc, out, err = _bench(capsys, "-p", "8", "-n", "0", "-r", "1", "--no-warmup", "-o", "jsonl",
                          "-fa", "on,off", *FAST)
    assert rc == 0, err
    assert [json.loads(l)["flash_attn"] for l in out.splitlines()] == [1, 0]


# ---- -t beyond what ggml can start
@pytest.mark.parametrize("value", ["513", "10000", "32768", "65536"])
def test_threads_capped_with_a_sentence(capsys, value):
    rc, out, err = _bench(capsys, "-p", "8", "-n", "0", "-r", "1", "--device", "cpu", "-t", value)
    _one_line_exit_2(rc, out, err, "ggml-attn-bench")
    assert f"-t {value}" in err and "512" in err
    rc, out, err = _batched(capsys, "-npp", "8", "-npl", "1", "-ntg", "1", "--device", "cpu", "-t", value)
    _one_line_exit_2(rc, out, err, "ggml-attn-batched-bench")
    assert f"-t {value}" in err and "512" in err


def test_batched_fa_is_llama_cpps_integer(capsys):
    """llama-batched-bench's jsonl and main line: int(flash_attn_type), -1 for auto."""
    rc, out, err = _batched(capsys, "-npp", "8", "-npl", "1", "-ntg", "1", "-o", "jsonl", *FAST)
    assert rc == 0, err
    assert json.loads(out)["flash_attn"] == -1
    rc, out, err = _batched(capsys, "-npp", "8", "-npl", "1", "-ntg", "1", *FAST)
    assert rc == 0, err
    assert "flash_attn = -1," in out


# ---- -b < -ub as llama.cpp (n_ubatch clamped to n_batch)
def test_ubatch_clamped_to_batch(capsys):
    rc, out, err = _bench(capsys, "-p", "32", "-n", "0", "-r", "1", "--no-warmup", "-o", "jsonl",
                          "-b", "16", "-ub", "64", *FAST)
    assert rc == 0, err
    row = json.loads(out)
    assert (row["n_batch"], row["n_ubatch"], row["ub"]) == (16, 16, 2)
    rc, out, err = _batched(capsys, "-npp", "32", "-npl", "1", "-ntg", "1", "-o", "jsonl",
                            "-b", "16", "-ub", "64", *FAST)
    assert rc == 0, err
    row = json.loads(out)
    assert (row["n_batch"], row["n_ubatch"], row["ub"]) == (16, 16, 2)


# ---- a -b/-ub far beyond the test's tokens: rows report it, nothing sized by it is allocated
def test_huge_ubatch_runs_small_tests(capsys):
    big = "100000000"
    rc, out, err = _bench(capsys, "-p", "8", "-n", "1", "-r", "1", "--no-warmup", "-o", "jsonl",
                          "-b", big, "-ub", big, *FAST)
    assert rc == 0 and "Traceback" not in err, err
    assert [(json.loads(l)["n_batch"], json.loads(l)["n_ubatch"]) for l in out.splitlines()] == \
        [(int(big), int(big))] * 2
    rc, out, err = _batched(capsys, "-npp", "8", "-npl", "2", "-ntg", "1", "-o", "jsonl",
                            "-b", big, "-ub", big, *FAST)
    assert rc == 0 and "Traceback" not in err, err
    assert json.loads(out)["n_ubatch"] == int(big)


# ---- -ctk / -ctv
@pytest.mark.parametrize("ctk, ctv, extra", [
    ("q8_0", "q8_0", []), ("q4_0", "f16", []), ("bf16", "bf16", []), ("f32", "q5_1", []),
    ("q8_0", "q4_0", ["--kernel", "ggml"]), ("q8_0", "f16", ["-fa", "off"]), ("bf16", "bf16", ["-fa", "off"]),
    ("iq4_nl", "q8_0", ["--layer", "full"]),
])
def test_cache_types_run_on_the_cpu_path(capsys, ctk, ctv, extra):
    rc, out, err = _bench(capsys, "-p", "40", "-n", "2", "-ub", "16", "-r", "1", "--no-warmup", "-o", "jsonl",
                          "-ctk", ctk, "-ctv", ctv, *extra, *FAST)
    assert rc == 0, err
    rows = [json.loads(l) for l in out.splitlines()]
    assert [(r["type_k"], r["type_v"]) for r in rows] == [(ctk, ctv)] * 2
    assert all(r["avg_ts"] > 0 for r in rows)


def test_cache_types_in_markdown_and_batched(capsys):
    rc, out, err = _bench(capsys, "-p", "8", "-n", "0", "-r", "1", "--no-warmup", "-ctk", "f16,q8_0", *FAST)
    assert rc == 0, err
    lines = [l for l in out.splitlines() if l.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert "type_k" in head and "type_v" not in head
    i = head.index("type_k")
    assert [l.strip("|").split("|")[i].strip() for l in lines[2:]] == ["f16", "q8_0"]
    rc, out, err = _batched(capsys, "-npp", "8", "-npl", "2", "-ntg", "2", "-ctk", "q8_0", "-ctv", "q4_0",
                            "-o", "jsonl", *FAST)
    assert rc == 0, err
    row = json.loads(out)
    assert (row["type_k"], row["type_v"]) == ("q8_0", "q4_0") and row["speed"] > 0


@pytest.mark.parametrize("args, msg", [
    (["-ctv", "q8_0", "-fa", "off"], "quantized V cache needs flash attention"),
    (["-ctk", "q3_k"], "choose from"),
])
def test_cache_type_errors(capsys, args, msg):
    _both_tools_refuse(capsys, args, msg, FAST)


def _both_tools_refuse(capsys, args, msg, base):
    """Both tools given ``args`` (and ``base``) say ``msg`` in one stderr line and exit 2."""
    rc, out, err = _bench(capsys, "-p", "8", "-n", "0", "-r", "1", *args, *base)
    _one_line_exit_2(rc, out, err, "ggml-attn-bench")
    assert msg in err
    rc, out, err = _batched(capsys, "-npp", "8", "-npl", "1", "-ntg", "1", *args, *base)
    _one_line_exit_2(rc, out, err, "ggml-attn-batched-bench")
    assert msg in err


def test_cache_types_on_the_cuda_engine():
    """The GPU engine keeps K and V of f16, q8_0 or q4_0 (the same or mixed), on one GPU; a
    kernel asked for by name must read them (dispatch.supports; mixed pairs: not the block readers)."""
    from ggml_attn.cli.errors import UserError
    from ggml_attn.cli.kv_types import check_cache_types
    for t in ("f16", "q8_0", "q4_0"):
        check_cache_types(t, t, device="cuda", flash_attn=True, head_dim_k=128, head_dim_v=128)
    check_cache_types("q8_0", "q8_0", device="cuda", flash_attn=True, head_dim_k=128, head_dim_v=128,
                      kernel="decode")
    for tk, tv in (("q8_0", "f16"), ("q8_0", "q4_0"), ("f16", "q4_0")):   # mixed: f16 copies of the quantized one
        check_cache_types(tk, tv, device="cuda", flash_attn=True, head_dim_k=128, head_dim_v=128)
        with pytest.raises(UserError, match=rf"--kernel decode-tma -ctk {tk} -ctv {tv}: that kernel reads K and V of one"):
            check_cache_types(tk, tv, device="cuda", flash_attn=True, head_dim_k=128, head_dim_v=128,
                              kernel="decode-tma")
    for tk, tv in (("bf16", "f16"), ("f32", "f32"), ("q8_0", "bf16"), ("q5_1", "q5_1"), ("iq4_nl", "iq4_nl")):
        with pytest.raises(UserError, match=rf"-ctk {tk} -ctv {tv}: the GPU engine keeps K and V of "
                                            rf"f16, q8_0, q4_0 .*--device cpu"):
            check_cache_types(tk, tv, device="cuda", flash_attn=True, head_dim_k=128, head_dim_v=128)
    # the tensor-core kernels run on f16 copies of the blocks; decode-tma reads them at D 128 only
    check_cache_types("q4_0", "q4_0", device="cuda", flash_attn=True, head_dim_k=128, head_dim_v=128,
                      kernel="prefill")
    with pytest.raises(UserError, match="--kernel decode-tma -ctk q4_0: head sizes head_dim_k=64.*--kernel auto"):
        check_cache_types("q4_0", "q4_0", device="cuda", flash_attn=True, head_dim_k=64, head_dim_v=64,
                          kernel="decode-tma")
    with pytest.raises(UserError, match="-sm row/layer over 2 GPUs keep an f16 KV cache; q8_0, q4_0 run on one GPU"):
        check_cache_types("q8_0", "q8_0", device="cuda", flash_attn=True, head_dim_k=128, head_dim_v=128, n_gpu=2)
    check_cache_types("f16", "f16", device="cuda", flash_attn=True, head_dim_k=128, head_dim_v=128, n_gpu=2)
    with pytest.raises(UserError, match="-ctk q8_0: head size 48.*multiple of 32"):
        check_cache_types("q8_0", "q8_0", device="cuda", flash_attn=True, head_dim_k=48, head_dim_v=48)
    with pytest.raises(UserError, match="head size 48.*multiple of 32"):
        check_cache_types("q8_0", "f16", device="cpu", flash_attn=True, head_dim_k=48, head_dim_v=48)


def test_run_config_on_cuda_takes_quantized_caches():
    """RunConfig (no GPU needed to make one) passes q8_0/q4_0 pairs on cuda and refuses them on
    several GPUs (a -sm rank context)."""
    from ggml_attn.cli.errors import UserError
    from ggml_attn.cli.models import resolve
    from ggml_attn.cli.multi_gpu import RankContext
    from ggml_attn.cli.runner import RunConfig
    m = resolve("llama-3-8b")
    for t in ("q8_0", "q4_0"):
        cfg = RunConfig(m, n_ctx=256, device="cuda", type_k=t, type_v=t)
        assert (cfg.type_k, cfg.type_v) == (t, t)
        with pytest.raises(UserError, match="-sm row/layer over 2 GPUs"):
            RunConfig(m, n_ctx=256, device="cuda", type_k=t, type_v=t, tp=RankContext(0, 2, 0))
        # a tensor-core kernel by name runs on f16 copies of the blocks
        assert RunConfig(m, n_ctx=256, device="cuda", type_k=t, type_v=t, kernel="decode-tc").type_k == t
    assert RunConfig(m, n_ctx=256, device="cuda", type_k="q8_0", type_v="f16").type_v == "f16"
    with pytest.raises(UserError, match="-ctk q8_0 -ctv bf16: the GPU engine"):
        RunConfig(m, n_ctx=256, device="cuda", type_k="q8_0", type_v="bf16")


@pytest.mark.parametrize("args, msg", [
    (["-ctk", "bf16"], "-ctk bf16 -ctv f16: the GPU engine keeps K and V of f16, q8_0, q4_0"),
    (["-ctk", "q5_0", "-ctv", "q5_0"], "-ctk q5_0 -ctv q5_0: the GPU engine keeps K and V of f16, q8_0, q4_0"),
    (["-ctk", "q4_0", "-ctv", "q8_0", "--kernel", "decode"], "--kernel decode -ctk q4_0 -ctv q8_0: that kernel reads"),
])
def test_cache_type_errors_on_the_cuda_path(capsys, monkeypatch, args, msg):
    """--device cuda (a GPU faked: the checks come before any GPU work): one line, exit 2."""
    from ggml_attn.cli import runner
    monkeypatch.setattr(runner, "cuda_available", lambda: True)
    _both_tools_refuse(capsys, args, msg, ["-t", "1", "--n-layer", "1", "--device", "cuda"])


# ---- -o sql, -oe
def test_sql_output_loads_into_sqlite(capsys):
    import sqlite3
    rc, out, err = _bench(capsys, "-p", "8,16", "-n", "0", "-r", "2", "--no-warmup", "-o", "sql", *FAST)
    assert rc == 0, err
    db = sqlite3.connect(":memory:")
    db.executescript(out)
    rows = db.execute("SELECT l.n_prompt, l.avg_ts, l.flash_attn, o.path FROM llama_bench l JOIN ggml_attn_bench o "
                      "USING (build_commit, test_time, model_filename, n_prompt, n_gen, n_depth) "
                      "ORDER BY l.n_prompt").fetchall()
    assert [r[0] for r in rows] == [8, 16] and all(r[1] > 0 for r in rows)
    assert rows[0][2:] == (-1, "numpy")
    types = {r[1]: r[2] for r in db.execute("PRAGMA table_info(llama_bench)")}
    assert types["n_prompt"] == "INTEGER" and types["avg_ts"] == "REAL" and types["model_type"] == "TEXT"


def test_second_format_on_stderr(capsys):
    rc, out, err = _bench(capsys, "-p", "8", "-n", "0", "-r", "1", "--no-warmup", "-o", "md", "-oe", "jsonl", *FAST)
    assert rc == 0, err
    assert out.startswith("| model") and json.loads(err)["n_prompt"] == 8


# ---- -v, --delay
def test_verbose_describes_the_run_on_stderr(capsys):
    rc, out, err = _bench(capsys, "-p", "24", "-n", "0", "-ub", "16", "-r", "1", "--no-warmup", "-v", *FAST)
    assert rc == 0
    assert "tiny: 1 layers" in err and "KV cache" in err and "per repetition: ubatches 1x16 1x8" in err
    assert re.search(r"ready \d+\.\d\d s after the process started", err) or not sys.platform.startswith("linux")
    rc, _, err = _bench(capsys, "-p", "24", "-n", "0", "-r", "1", "--no-warmup", *FAST)
    assert rc == 0 and err == ""


def test_verbose_says_where_a_gpu_runs_load_went(capsys, monkeypatch):
    """-v on the GPU: the kernel programs made ready beside the engine's start (how many NVRTC
    compiled now), the weights' upload time and rate, and the time since the process started."""
    from types import SimpleNamespace

    from ggml_attn.cli import verbose
    from ggml_attn.cli.cuda_engine import KernelLoad
    monkeypatch.setattr(verbose, "process_seconds", lambda: 3.25)
    dw = SimpleNamespace(bytes_by_type=lambda: {"Q4_K": 2 ** 31, "Q6_K": 2 ** 29}, load_s=0.5)
    model = SimpleNamespace(nbytes=2 ** 31 + 2 ** 29, device_weights=lambda xp: dw)
    cfg = SimpleNamespace(model=SimpleNamespace(describe=lambda: "m"), type_k="f16", type_v="f16", split="equal",
                          n_batch=2048, n_ubatch=512, n_threads=4, device="cuda")
    runner = SimpleNamespace(cfg=cfg, cache=SimpleNamespace(xp=None),
                             engine=SimpleNamespace(kernel_load=KernelLoad(14, 9, 2.5), model=model))
    verbose.Verbose("tool", True).runner(runner)
    err = capsys.readouterr().err
    assert "tool: kernels: 14 programs ready in 2.50 s beside the engine's start (9 compiled by NVRTC now" in err
    assert "Q4_K 2.00 GiB, Q6_K 0.50 GiB (the file's tensors: 2.50 GiB; read, uploaded and folded in 0.50 s, " \
           "5.4 GB/s of the file)" in err
    assert err.rstrip().endswith("tool: ready 3.25 s after the process started")


def test_delay_sleeps_between_tests(capsys, monkeypatch):
    slept = []
    monkeypatch.setattr(bench, "interruptible_sleep", slept.append)
    rc, _, err = _bench(capsys, "-p", "8,16", "-n", "0", "-r", "1", "--no-warmup", "--delay", "3", *FAST)
    assert rc == 0, err
    assert slept == [3, 3]
    rc, _, err = _bench(capsys, "-p", "8", "-n", "0", "--delay", "-1", *FAST)
    assert rc == 2 and "--delay" in err


# ---- -ngl
def test_ngl_zero_is_the_cpu_path(capsys):
    rc, out, err = _bench(capsys, "-p", "8", "-n", "0", "-r", "1", "--no-warmup", "-o", "jsonl", "-ngl", "0",
                          "-t", "1", "--n-layer", "1")
    assert rc == 0, err
    row = json.loads(out)
    assert row["n_gpu_layers"] == 0 and row["backends"] == "CPU"
    rc, out, err = _bench(capsys, "-p", "8", "-n", "0", "-r", "1", "--no-warmup", "-o", "jsonl", "-t", "1",
                          "--n-layer", "1")
    assert rc == 0 and json.loads(out)["n_gpu_layers"] == -1   # llama-bench's default, recorded as it does


@pytest.mark.parametrize("args, msg", [
    (["-ngl", "1", "--n-layer", "2"], "all layers"),
    (["-ngl", "99", "--device", "cpu"], "--device cpu"),
    (["-ngl", "0", "--device", "cuda"], "--device cuda"),
])
def test_ngl_rejects_what_cannot_run(capsys, args, msg):
    rc, out, err = _bench(capsys, "-p", "8", "-n", "0", "-t", "1", *args)
    _one_line_exit_2(rc, out, err, "ggml-attn-bench")
    assert msg in err


def test_batched_verbose_describes_runs_on_stderr(capsys):
    rc, out, err = _batched(capsys, "--prompt-lens", "1-3", "-ntg", "1", "--split", "equal,padded", "-v", *FAST)
    assert rc == 0, err
    assert "tiny: 1 layers" in err and "KV cache" in err
    assert "split=equal: prompt: ubatches 3x1 2x1 1x1" in err and "split=padded: prompt: ubatches 3x3" in err
    rc, _, err = _batched(capsys, "--prompt-lens", "1-3", "-ntg", "1", *FAST)
    assert rc == 0 and err == ""


@pytest.mark.parametrize("tool", ["bench", "batched"])
def test_ngl_without_a_gpu_says_it_runs_on_the_cpu(capsys, monkeypatch, tool):
    """-ngl 99 and no GPU: the CPU, as llama-bench, but no longer silently."""
    from ggml_attn.cli import runner
    monkeypatch.setattr(runner, "cuda_available", lambda: False)
    if tool == "bench":
        rc, out, err = _bench(capsys, "-p", "8", "-n", "0", "-r", "1", "--no-warmup", "-o", "jsonl", "-ngl", "99",
                              "-t", "1", "--n-layer", "1")
        prog = "ggml-attn-bench"
    else:
        rc, out, err = _batched(capsys, "-npp", "8", "-npl", "1", "-ntg", "1", "-o", "jsonl", "-ngl", "99",
                                "-t", "1", "--n-layer", "1")
        prog = "ggml-attn-batched-bench"
    assert rc == 0, err
    row = json.loads(out)
    assert row["n_gpu_layers"] == 99 and row.get("backends", "CPU") == "CPU"   # the value given, as llama.cpp's
    assert err == (f"{prog}: -ngl 99: no GPU is available (CuPy and a CUDA device are needed), so it runs on the "
                   f"CPU (the rows' backends say CPU)\n")


# ---- the two tools take the same spellings (llama-bench's and llama-batched-bench's)
@pytest.mark.parametrize("fa, word", [("1", "on"), ("0", "off"), ("-1", "auto"), ("on", "on"), ("auto", "auto")])
@pytest.mark.parametrize("kvu, unified", [(["-kvu"], True), (["-kvu", "1"], True), (["-kvu", "0"], False), ([], False)])
def test_both_tools_take_fa_and_kvu_as_llama_cpp(capsys, fa, word, kvu, unified):
    rc, out, err = _bench(capsys, "-p", "8", "-n", "0", "-r", "1", "--no-warmup", "--output-format", "jsonl",
                          "-fa", fa, *kvu, *FAST)
    assert rc == 0, err
    row = json.loads(out)
    assert row["flash_attn"] == {"on": 1, "off": 0, "auto": -1}[word] and row["kv_unified"] is unified
    rc, out, err = _batched(capsys, "-npp", "8", "-npl", "2", "-ntg", "1", "--output-format", "jsonl",
                            "-fa", fa, *kvu, *FAST)
    assert rc == 0, err
    row = json.loads(out)
    assert row["flash_attn"] == {"on": 1, "off": 0, "auto": -1}[word] and row["kv_unified"] is unified


@pytest.mark.parametrize("args, flag", [(["-fa", "maybe"], "-fa/--flash-attn"), (["-kvu", "2"], "-kvu/--kv-unified"),
                                        (["--output-format", "xml"], "-o/--output/--output-format")])
@pytest.mark.parametrize("tool", ["bench", "batched"])
def test_flag_errors_name_the_flag(capsys, args, flag, tool):
    if tool == "bench":
        rc, out, err = _bench(capsys, "-p", "8", "-n", "0", *args, *FAST)
        prog = "ggml-attn-bench"
    else:
        rc, out, err = _batched(capsys, "-npp", "8", "-npl", "1", "-ntg", "1", *args, *FAST)
        prog = "ggml-attn-batched-bench"
    _one_line_exit_2(rc, out, err, prog)
    assert f"argument {flag}:" in err


def test_kv_cache_bytes_follow_the_cache_types(capsys, monkeypatch):
    """The size a KV cache would take counts the cache's types (ggml's row sizes: a q8_0 row of
    1024 values is 1088 bytes), and a cache too large for memory says so in one line with it."""
    from ggml_attn import graph
    from ggml_attn.cli.models import resolve
    m = resolve("llama-3-8b")   # 32 layers, 8 KV heads of 128
    assert m.kv_bytes_per_token() == 32 * 2 * 2048
    assert m.kv_bytes_per_token("q8_0", "q8_0") == 32 * 2 * 1088
    assert m.kv_bytes_per_token("q4_0", "f16") == 32 * (576 + 2048)

    def no_memory(*a, **kw):
        raise MemoryError
    monkeypatch.setattr(graph, "KVCache", no_memory)
    rc, out, err = _bench(capsys, "-p", "8", "-n", "0", "-r", "1", "-t", "1", "--n-layer", "1",
                          "-ctk", "q8_0", "-ctv", "q8_0")
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err   # (the table's header is out already)
    assert "not enough memory for a KV cache of 8 cells (0.0 GiB of q8_0/q8_0)" in err, err


def test_batched_bench_splits_that_do_not_fit_together_run_one_at_a_time(capsys, monkeypatch):
    """Every split keeps its runner (cache, weights) for the next rows; when the next one does
    not fit beside them, they are closed and it runs alone (warmed up like the first ones), with
    one note on stderr: every row is still measured. When even one runner does not fit: one
    error line, exit 2."""
    from ggml_attn.cli.errors import OutOfMemory
    real = batched_bench.Runner
    alive, made = [], []

    class OneAtATime(real):
        def __init__(self, cfg):
            if alive:
                raise OutOfMemory("not enough memory for a KV cache (test: one runner at a time)")
            super().__init__(cfg)
            alive.append(self)
            made.append(cfg.split)

        def close(self):
            super().close()
            alive.remove(self)
    monkeypatch.setattr(batched_bench, "Runner", OneAtATime)
    rc, out, err = _batched(capsys, "-npp", "8", "-npl", "1,2", "-ntg", "1", "--split", "equal,seq",
                            "-o", "jsonl", *FAST)
    assert rc == 0, err
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [(r["pl"], r["split"]) for r in rows] == [(1, "equal"), (1, "seq"), (2, "equal"), (2, "seq")]
    assert all(r["t_pp"] > 0 and r["t_tg"] > 0 for r in rows)
    assert err.count("do not fit in memory together") == 1 and "Traceback" not in err
    assert made == ["equal", "seq", "equal", "seq", "equal", "seq"] and alive == []

    class Never(real):
        def __init__(self, cfg):
            raise OutOfMemory("not enough memory for a KV cache of 9 cells (test)")
    monkeypatch.setattr(batched_bench, "Runner", Never)
    rc, out, err = _batched(capsys, "-npp", "8", "-npl", "1", "-ntg", "1", "--split", "equal,seq", *FAST)
    assert rc == 2 and err.count("\n") == 1 and "not enough memory for a KV cache of 9 cells" in err


def test_weights_that_do_not_fit_beside_the_cache_are_one_line(capsys, monkeypatch):
    """The engine's weights failing to allocate (after the KV cache did) is one error line that
    names the weights and the cache's size, not a traceback."""
    from ggml_attn.cli import runner as runner_mod

    def no_memory(*a, **kw):
        raise MemoryError
    monkeypatch.setattr(runner_mod, "make_engine", no_memory)
    rc, out, err = _batched(capsys, "-npp", "8", "-npl", "1", "-ntg", "1", "--layer", "full", *FAST)
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "not enough memory for the model's weights (--layer full" in err and "beside a KV cache of" in err, err


@pytest.mark.parametrize("tool", ["bench", "batched_bench", "serve_bench"])
def test_version(capsys, tool):
    """--version (llama.cpp's tools have it): the package's version and the build's commit."""
    import importlib
    import ggml_attn
    from ggml_attn.cli.common import build_info
    mod = importlib.import_module(f"ggml_attn.cli.{tool}")
    assert mod.main(["--version"]) == 0
    out = capsys.readouterr().out
    commit, number = build_info()
    assert out == f"{mod.PROG} {ggml_attn.__version__} (build: {commit} ({number}))\n"
