"""Output formats: every format parses, columns match llama-bench / llama-batched-bench."""
import csv
import io
import json

from ggml_attn.cli import format_batched as fb
from ggml_attn.cli import format_bench as fmt


def _row(**kw):
    row = {f: 0 for f in fmt.FIELDS}
    row.update(build_commit="abc1234", cpu_info="cpu", gpu_info="", backends="CPU",
               model_filename="tiny", model_type="llama ?B F16", model_name="tiny", model_size=25 * 2**20,
               model_n_params=13_000_000, n_batch=2048, n_ubatch=512, n_threads=2,
               type_k="f16", type_v="f16", flash_attn=-1, kv_unified=False, split="equal",
               path="numpy",
               kernel="auto", device="cpu", layer="attn", n_prompt=512, n_gen=0, n_depth=0,
               ub=1, test_time="2026-01-01T00:00:00Z", samples_ns=[1_000_000, 1_100_000, 900_000])
    row.update(kw)
    return fmt.finish_row(row)


def _render(form, rows, **kw):
    out = io.StringIO()
    p = fmt.make_printer(form, out, **kw)
    p.header()
    for r in rows:
        p.row(r)
    p.footer()
    return out.getvalue()


def test_stats_like_llama_bench():
    r = _row()
    assert r["avg_ns"] == 1_000_000
    assert r["stddev_ns"] == 100_000  # sample stddev (n-1)
    ts = fmt.samples_ts(r)
    assert abs(ts[0] - 512_000.0) < 1e-6
    assert abs(r["avg_ts"] - sum(ts) / 3) < 1e-6


def test_test_names():
    assert fmt.test_name(512, 0, 0) == "pp512"
    assert fmt.test_name(0, 128, 0) == "tg128"
    assert fmt.test_name(512, 128, 0) == "pp512+tg128"
    assert fmt.test_name(0, 32, 4096) == "tg32 @ d4096"


def test_markdown_anchors_and_optional_columns():
    text = _render("md", [_row(), _row(n_prompt=0, n_gen=16)], build="x")
    lines = text.splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head == ["model", "name", "backend", "threads", "path", "test", "t/s"]
    assert lines[1].startswith("| :") is False and lines[1].startswith("| -")
    assert lines[1].split("|")[-2].strip().endswith(":")  # t/s right-aligned
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[:2] == ["llama ?B F16", "tiny"] and cells[4] == "numpy"
    assert cells[5] == "pp512" and " ± " in cells[6]
    assert [c.strip() for c in lines[3].strip("|").split("|")][5] == "tg16"
    # every row as wide as the header (llama-bench pads to fixed widths)
    assert len({len(l) for l in lines[:4]}) == 1
    cols = fmt.markdown_columns("CUDA", ["n_ubatch", "kernel", "layer", "kv_unified", "split"], weights=True,
                                n_layer=True)
    assert cols == ["model", "model_name", "n_layer", "size", "params", "backend", "n_gpu_layers", "n_ubatch",
                    "path", "kernel", "layer", "kv_unified", "split", "test", "t/s"]
    text = _render("md", [_row(backends="CUDA", n_gpu_layers=2, path="CUDA kernels", layer="full")],
                   md_columns=cols)
    lines = text.splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head == ["model", "name", "n_layer", "size", "params", "backend", "ngl", "n_ubatch", "path", "kernel",
                    "layer", "kvu", "split", "test", "t/s"]
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[3] == "25.00 MiB" and cells[4] == "13.00 M" and cells[8] == "CUDA kernels"


def test_csv_parses():
    text = _render("csv", [_row(), _row(n_gen=128)])
    rows = list(csv.DictReader(io.StringIO(text)))
    assert len(rows) == 2 and list(rows[0]) == fmt.FIELDS
    assert rows[1]["n_gen"] == "128" and float(rows[0]["avg_ts"]) > 0 and rows[0]["kv_unified"] == "0"


def test_json_and_jsonl_parse_with_samples():
    data = json.loads(_render("json", [_row(), _row(split="padded")]))
    assert len(data) == 2 and data[1]["split"] == "padded"
    assert data[0]["samples_ns"] == [1_000_000, 1_100_000, 900_000]
    assert len(data[0]["samples_ts"]) == 3 and isinstance(data[0]["kv_unified"], bool)
    assert isinstance(data[0]["avg_ns"], int) and isinstance(data[0]["avg_ts"], float)
    assert json.loads(_render("json", [])) == []
    lines = _render("jsonl", [_row(), _row()]).splitlines()
    assert [json.loads(l)["n_prompt"] for l in lines] == [512, 512]
    assert "samples_ts" in json.loads(lines[0])


def _brow(**kw):
    row = dict(pp=128, tg=16, pl=4, is_pp_shared=0, t_pp=0.5, t_tg=0.25, split="equal", ub=2,
               ub_tg=16, n_pad=0, kv_unified=False)
    row.update(kw)
    return fb.finish_row(row)


def test_batched_math_like_llama_batched_bench():
    r = _brow()
    assert r["n_kv"] == 4 * (128 + 16)
    assert r["speed_pp"] == 4 * 128 / 0.5 and r["speed_tg"] == 4 * 16 / 0.25
    assert r["t"] == 0.75 and r["speed"] == r["n_kv"] / 0.75
    shared = _brow(is_pp_shared=1, kv_unified=True)
    assert shared["n_kv"] == 128 + 4 * 16 and shared["speed_pp"] == 128 / 0.5
    assert shared["speed"] == (128 + 4 * 16) / 0.75
    # one stream per sequence: the shared prompt is copied into each (N_KV pl*pp + pl*tg, as
    # llama-batched-bench), the tokens processed count it once
    copied = _brow(is_pp_shared=1, kv_unified=False)
    assert copied["n_kv"] == 4 * 128 + 4 * 16 and copied["speed_pp"] == 128 / 0.5
    assert copied["speed"] == (128 + 4 * 16) / 0.75
    ragged = _brow(pp=None, pl=10, prompt_lens=list(range(1, 11)))
    assert ragged["prompt_tokens"] == 55 and ragged["n_kv"] == 55 + 10 * 16


def _brender(form, rows):
    out = io.StringIO()
    info = dict(n_kv_max=4096, n_batch=2048, n_ubatch=512, flash_attn=1, is_pp_shared=0,
                kv_unified=False, n_threads=2, model="tiny", device="cpu", kernel="auto",
                layer="attn", n_gpu_layers=0, n_threads_batch=2)
    p = fb.make_printer(form, out, info)
    p.header()
    for r in rows:
        p.row(r)
    p.footer()
    return out.getvalue()


def test_batched_markdown_columns():
    text = _brender("md", [_brow(path="numpy"), _brow(pp=None, pl=10, prompt_lens=list(range(1, 11)),
                                                       split="padded", ub=1, n_pad=45, path="CUDA kernels")])
    lines = [l for l in text.splitlines() if l.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head == ["PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "T s",
                    "S t/s", "split", "KVU", "UB", "PAD", "path"]
    assert set(lines[1]) <= {"|", "-"}
    assert len({len(l) for l in lines}) == 1
    last = [c.strip() for c in lines[3].strip("|").split("|")]
    assert last[0] == "1-10" and last[2] == "10" and last[-5:] == ["padded", "0", "1", "45", "CUDA kernels"]
    assert [c.strip() for c in lines[2].strip("|").split("|")][-2:] == ["0", "numpy"]   # the path that ran, pads
    assert "main: n_kv_max = 4096" in text


def test_batched_jsonl_fields():
    lines = _brender("jsonl", [_brow(), _brow(pp=None, pl=10, prompt_lens=list(range(1, 11)))])
    objs = [json.loads(l) for l in lines.splitlines()]
    for key in ("pp", "tg", "pl", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg", "t", "speed",
                "split", "ub"):
        assert key in objs[0]
    assert objs[0]["split"] == "equal" and objs[0]["ub"] == 2 and objs[0]["n_kv_max"] == 4096
    # ragged: pp is the mean prompt length (pl * pp = prompt tokens), the distribution beside it
    assert objs[1]["pp"] == 5.5 and objs[1]["prompt_lens"] == list(range(1, 11))
    assert (objs[1]["pp_min"], objs[1]["pp_max"], objs[1]["prompt_tokens"]) == (1, 10, 55)
    assert (objs[0]["pp"], objs[0]["pp_min"], objs[0]["pp_max"]) == (128, 128, 128)
