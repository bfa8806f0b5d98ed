"""llama.cpp's flags and outputs as llama-bench and llama-batched-bench have them: the values
that mean something here too (-ts lists, -ngl lists, -c 0, -pps without -kvu, -tgs) and the
columns and ``main:`` line as llama.cpp prints them."""
import json

import pytest

from ggml_attn.cli import batched_bench, bench
from ggml_attn.cli import format_bench as fmt

FAST = ["-t", "1", "--n-layer", "1"]


def _batched(capsys, *args):
    rc = batched_bench.main(list(args) + FAST)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _bench(capsys, *args):
    rc = bench.main(list(args) + ["-r", "1", "--no-warmup", "--device", "cpu"] + FAST)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _table(out: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in out.splitlines()
            if line.startswith("|")]


# ---- batched: N_KV with -pps, as llama-batched-bench's n_ctx_req
@pytest.mark.parametrize("kvu, n_kv", [([], 3 * 16 + 3 * 2), (["-kvu"], 16 + 3 * 2)])
def test_shared_prompt_n_kv_per_kv_mode(capsys, kvu, n_kv):
    """-pps: the prompt is decoded once; on one stream per sequence each stream holds a copy
    (N_KV = pl*pp + pl*tg), on a unified cache the sequences share it (pp + pl*tg)."""
    rc, out, err = _batched(capsys, "-npp", "16", "-ntg", "2", "-npl", "3", "-pps", *kvu, "-o", "jsonl")
    assert rc == 0, err
    r = json.loads(out)
    assert r["n_kv"] == n_kv and r["prompt_tokens"] == 16
    assert abs(r["speed"] - (16 + 3 * 2) / r["t"]) < 1e-6 * r["speed"]   # tokens processed, not cells
    rc, out, err = _batched(capsys, "-npp", "16", "-ntg", "2", "-npl", "3", "-pps", *kvu)
    assert _table(out)[2][3] == str(n_kv)


def test_shared_prompt_rows_fit_the_context_by_their_cells(capsys):
    """A row fits by llama-batched-bench's n_ctx_req against llama.cpp's padded context: without
    -kvu 3 copies of a 30-token prompt and 3*2 tokens are N_KV 96; with -kvu the prompt once and
    B x TG tokens: -c 300 is 512 cells, B=2 (100 + 2*200 = 500) runs, B=3 (700) is skipped."""
    rc, out, err = _batched(capsys, "-npp", "30", "-ntg", "2", "-npl", "3", "-pps", "-c", "100", "-o", "jsonl")
    assert rc == 0, err
    assert [json.loads(l)["n_kv"] for l in out.splitlines()] == [96]
    rc, out, err = _batched(capsys, "-npp", "100", "-ntg", "200", "-npl", "2,3", "-pps", "-kvu", "-c", "300",
                            "-o", "jsonl")
    assert rc == 0, err
    assert [json.loads(l)["pl"] for l in out.splitlines()] == [2]
    assert "B=3 PP=100 TG=200 (N_KV 700)" in err


# ---- batched: -tgs
def test_tgs_decodes_each_sequence_separately(capsys):
    rc, out, err = _batched(capsys, "-npp", "8", "-ntg", "3", "-npl", "2", "-tgs", "-o", "jsonl")
    assert rc == 0, err
    r = json.loads(out)
    assert r["is_tg_separate"] == 1 and r["ub_tg"] == 2 * 3   # one token per step: B x TG steps
    assert r["n_kv"] == 2 * (8 + 3)
    rc, out, err = _batched(capsys, "-npp", "8", "-ntg", "3", "-npl", "2", "-o", "jsonl")
    r = json.loads(out)
    assert r["is_tg_separate"] == 0 and r["ub_tg"] == 3


# ---- batched: -c 0 is the model's training context
def test_c0_skips_rows_past_the_training_context(capsys):
    """tiny's training context is 8192, over 3 split streams llama_n_ctx's 3 x 2816 = 8448 cells:
    B=3 of 3000 tokens (N_KV 9003) is skipped and said; the main line's n_kv_max is that
    context, as llama-batched-bench's; our cache, sized for the rows that run, 3072 cells."""
    rc, out, err = _batched(capsys, "-npp", "3000", "-ntg", "1", "-npl", "1,3")
    assert rc == 0, err
    rows = _table(out)[2:]
    assert [r[2] for r in rows] == ["1"]
    assert "main: n_kv_max = 8448," in out and "kv_cells = 3072" in out
    assert "skipping 1 row(s) that do not fit the model's training context (8448 cells" in err
    assert "B=3 PP=3000 TG=1 (N_KV 9003)" in err


def test_c0_with_no_row_that_fits_is_an_error(capsys):
    rc, out, err = _batched(capsys, "-npp", "3000", "-ntg", "1", "-npl", "3")
    assert rc == 2 and out == ""
    assert "needs 9003 KV cells but the model's training context (-c 0) holds 8448; raise it with -c" in err


# ---- batched: the main line, llama-batched-bench's fields in its order, then ours
def test_batched_main_line_fields(capsys):
    rc, out, err = _batched(capsys, "-npp", "8", "-ntg", "1", "-npl", "1", "-fa", "on", "-pps")
    assert rc == 0, err
    line = next(l for l in out.splitlines() if l.startswith("main:"))
    assert line.startswith("main: n_kv_max = 8192, n_batch = 2048, n_ubatch = 512, flash_attn = 1, "
                           "is_pp_shared = 1, is_tg_separate = 0, n_gpu_layers = -1, n_threads = 1, "
                           "n_threads_batch = 1, ")
    rc, out, err = _batched(capsys, "-npp", "8", "-ntg", "1", "-npl", "1", "-o", "jsonl")
    assert json.loads(out)["flash_attn"] == -1   # llama.cpp's integer (auto), not the word


# ---- bench: -ts as llama-bench's list ("," between test values, "/" between GPUs)
def test_ts_list_parses_as_llama_bench():
    from ggml_attn.cli.multi_gpu import parse_ts_list, ts_text
    assert parse_ts_list("1,1") == [(1.0,), (1.0,)]
    assert parse_ts_list("1/1") == [(1.0, 1.0)]
    assert parse_ts_list("3/1,1;1") == [(3.0, 1.0), (1.0, 1.0)]
    assert ts_text((3.0, 1.0)) == "3.00/1.00" and ts_text((1.0, 0.0)) == "1.00" and ts_text(()) == "0.00"


def test_ts_1_1_is_two_tests_on_one_device(capsys):
    rc, out, err = _bench(capsys, "-p", "8", "-n", "0", "-ts", "1,1", "-o", "jsonl")
    assert rc == 0, err
    rows = [json.loads(l) for l in out.splitlines()]
    assert [r["tensor_split"] for r in rows] == ["1.00", "1.00"]
    assert "-ts: with -sm none the model runs on one device" in err
    rc, out, err = _bench(capsys, "-p", "8", "-n", "0", "-ts", "1,1")
    head = _table(out)[0]
    assert head[head.index("path") - 1] == "ts" and [r[head.index("ts")] for r in _table(out)[2:]] == ["1.00"] * 2


def test_ts_1_over_1_is_one_test_over_two_gpus(capsys):
    rc, out, err = _bench(capsys, "-p", "8", "-n", "0", "-ts", "1/1")
    assert rc == 2 and out == "" and "-ts 1/1 splits tensors over several GPUs; it needs -sm row or -sm layer" in err
    # the batched bench takes llama.cpp's common -ts: ',' (or '/') between GPUs, one value
    rc, out, err = _batched(capsys, "-npp", "8", "-ntg", "1", "-npl", "1", "-ts", "1,1")
    assert rc == 2 and "-ts 1,1 splits tensors over several GPUs" in err


def test_ts_several_splits_in_one_run_is_said(capsys):
    rc, out, err = _bench(capsys, "-p", "8", "-n", "0", "-sm", "layer", "-ts", "1/1,3/1")
    assert rc == 2 and "-ts 1/1,3/1: one split per run here" in err


# ---- bench: -ngl lists
def test_ngl_list_runs_a_row_per_value(capsys, monkeypatch):
    rc, out, err = bench.main(["-p", "8", "-n", "0", "-ngl", "0,99", "-o", "jsonl", "-r", "1", "--no-warmup"] + FAST), \
        *(lambda o: (o.out, o.err))(capsys.readouterr())
    assert rc == 0, err
    rows = [json.loads(l) for l in out.splitlines()]
    assert len(rows) == 2 and all(r["backends"] == "CPU" for r in rows)   # no GPU here: 99 runs on the CPU
    assert "-ngl 0,99: a row per value" in err and "-ngl 99: no GPU is available" in err
    rc = bench.main(["-p", "8", "-n", "0", "-ngl", "0,99", "-r", "1", "--no-warmup"] + FAST)
    head = _table(capsys.readouterr().out)[0]
    assert "ngl" in head and "threads" in head


def test_rows_in_llama_benchs_order(capsys):
    """Rows nest as llama-bench's (get_cmd_params_instances): n_batch outside type_k outside
    flash_attn outside n_threads."""
    rc, out, err = bench.main(["-p", "8", "-n", "0", "-b", "512,1024", "-ctk", "f16,q8_0", "-fa", "on,off",
                               "-o", "jsonl", "-r", "1", "--no-warmup"] + FAST), \
        *(lambda o: (o.out, o.err))(capsys.readouterr())
    assert rc == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["n_batch"], r["type_k"], r["flash_attn"]) for r in rows] == [
        (b, t, fa) for b in (512, 1024) for t in ("f16", "q8_0") for fa in (1, 0)]


# ---- bench: llama-bench's column widths and model description
def test_fa_and_type_columns_as_wide_as_llama_bench(capsys):
    rc, out, err = _bench(capsys, "-p", "8", "-n", "0", "-fa", "on,off", "-ctk", "q8_0")
    assert rc == 0, err
    lines = [l for l in out.splitlines() if l.startswith("|")]
    assert "| type_k |  fa |" in lines[0]   # 6 and 3 wide, right-aligned, as llama-bench's
    assert "|   q8_0 |   1 |" in lines[2] and "|   q8_0 |   0 |" in lines[3]
    assert "| -----: | --: |" in lines[1]


def _gguf(tmp_path, n_layer, file_type=None, name="my model"):
    import gguf  # in the test extra
    import numpy as np
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    for add, v in ((w.add_block_count, n_layer), (w.add_embedding_length, 128), (w.add_head_count, 4),
                   (w.add_head_count_kv, 2), (w.add_feed_forward_length, 256), (w.add_context_length, 512),
                   (w.add_vocab_size, 128256)):
        add(v)
    if file_type is not None:
        w.add_file_type(file_type)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(128, dtype=np.float32))
    for i in range(2):
        w.add_tensor(f"blk.0.ffn_{i}.weight", np.ones((4, 128), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_model_description_as_llama_cpp(tmp_path):
    """llama_model_desc: "<arch> <type> <file type>"; the type from llama.cpp's table (32 layers
    and a 128256 vocabulary: 8B), the file type from general.file_type or guessed from the
    tensors (two F16, one F32: F16)."""
    from ggml_attn.cli.models import PRESETS, resolve
    m = resolve(_gguf(tmp_path, 32, file_type=15))
    assert m.desc == "llama 8B Q4_K - Medium" and m.name == "my model"
    m = resolve(_gguf(tmp_path, 3))
    assert m.desc == "llama ?B (guessed) F16"
    assert PRESETS["llama-3-8b"].desc == "llama 8B F16" and PRESETS["gemma-2-9b"].desc == "gemma2 9B F16"
    assert PRESETS["mistral-7b"].desc == "llama 7B F16" and PRESETS["tiny"].desc == "llama ?B F16"


def test_model_and_name_columns(capsys, tmp_path):
    path = _gguf(tmp_path, 32, file_type=1)
    rc, out, err = _bench(capsys, "-m", path, "--layer", "attn", "-p", "8", "-n", "0", "-o", "jsonl")
    assert rc == 0, err
    row = json.loads(out)
    assert (row["model_type"], row["model_name"]) == ("llama 8B F16", "my model")
    assert fmt.FIELDS.index("model_type") < fmt.FIELDS.index("model_name")


@pytest.mark.parametrize("value", ["-1", "auto", "all"])
def test_ngl_all_layers_spellings(capsys, value):
    """llama-bench's default -ngl -1 and common/arg.cpp's auto / all: every layer on the GPU (here,
    without one, the CPU with the fallback note), not an error."""
    rc = bench.main(["-p", "8", "-n", "0", "-ngl", value, "-o", "jsonl", "-r", "1", "--no-warmup"] + FAST)
    err = capsys.readouterr().err
    assert rc == 0 and "-ngl all: no GPU is available" in err, err
    rc = batched_bench.main(["-npp", "8", "-ntg", "1", "-npl", "1", "-ngl", value, "-o", "jsonl"])
    assert rc == 0, capsys.readouterr().err


@pytest.mark.parametrize("value, msg", [("nan", "invalid -ts value 'nan'"), ("1e400", "invalid -ts value '1e400'"),
                                        ("0/0", "-ts 0/0: proportions must be finite")])
def test_ts_values_that_split_nothing(capsys, value, msg):
    """-ts NaN / inf shares are refused (they were recorded as tensor_split "nan"/"inf"), and a
    message quotes the value as typed (0/0 was shown as "0,0", another meaning in this syntax)."""
    rc = bench.main(["-p", "8", "-n", "0", "-r", "1", "-ts", value] + FAST)
    err = capsys.readouterr().err
    assert rc == 2 and msg in err, err


@pytest.mark.parametrize("flags, mode", [([], "layer"), (["-sm", "none"], "none"), (["--split-mode=none"], "none")])
def test_split_mode_column_says_what_was_asked(capsys, flags, mode):
    """One device: the row's split_mode is llama-bench's default ("layer", so that rows join its
    own) unless -sm was given, then what was given (-sm none was written as "layer")."""
    rc, out, err = _bench(capsys, "-m", "tiny", "-p", "4", "-n", "0", "-o", "jsonl", *flags)
    assert rc == 0, err
    assert json.loads(out.splitlines()[0])["split_mode"] == mode
