"""ggml-attn-bench's markdown table says what was measured."""
import json

import pytest

from ggml_attn.cli import bench
from ggml_attn.cli import format_bench as fmt

FAST = ["-t", "1", "--device", "cpu", "-r", "1", "--no-warmup", "-p", "8", "-n", "0"]


def _table(capsys, *args):
    rc = bench.main(list(args) + FAST)
    out = capsys.readouterr()
    assert rc == 0, out.err
    lines = [l for l in out.out.splitlines() if l.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return head, [dict(zip(head, (c.strip() for c in l.strip("|").split("|")))) for l in lines[2:]]


def test_default_attention_run_shows_path_and_no_weights(capsys):
    """llama-bench's columns, the model's name and path; our layer, kvu and split only when a
    flag sets them (llama-bench's rule for its own parameters)."""
    head, rows = _table(capsys)
    assert head == ["model", "name", "backend", "threads", "path", "test", "t/s"]
    assert (rows[0]["model"], rows[0]["name"], rows[0]["path"]) == ("llama ?B F16", "tiny", "numpy")
    head, rows = _table(capsys, "--layer", "attn", "-kvu", "1", "--split", "equal")
    assert head == ["model", "name", "backend", "threads", "path", "layer", "kvu", "split", "test", "t/s"]
    assert (rows[0]["path"], rows[0]["layer"], rows[0]["kvu"], rows[0]["split"]) == ("numpy", "attn", "1", "equal")


def test_full_layer_shows_weights(capsys):
    head, rows = _table(capsys, "--layer", "attn,full", "--n-layer", "1")
    assert head[:5] == ["model", "name", "n_layer", "size", "params"]
    assert [r["layer"] for r in rows] == ["attn", "full"]
    assert [r["size"] for r in rows][0] == "-" and rows[1]["size"].endswith("MiB")
    assert rows[0]["n_layer"] == "1"


@pytest.mark.parametrize("args, path", [(["-fa", "off"], "ggml mul_mat"), (["--kernel", "ggml"], "ggml FA"),
                                        (["--kernel", "reference"], "numpy")])
def test_path_names_what_computed_attention(capsys, args, path):
    head, rows = _table(capsys, "--n-layer", "1", *args)
    assert rows[0]["path"] == path


def test_n_layer_only_when_it_differs_from_the_preset(capsys):
    head, _ = _table(capsys, "--n-layer", "2")  # tiny has 2 layers
    assert "n_layer" not in head
    head, rows = _table(capsys, "--n-layer", "1")
    assert "n_layer" in head and rows[0]["n_layer"] == "1"


def test_unified_kv_row(capsys):
    head, rows = _table(capsys, "--n-layer", "1", "-kvu")
    assert "kvu" in head and "split" not in head and rows[0]["kvu"] == "1"
    _, rows = _table(capsys, "--n-layer", "1", "-kvu", "--split", "simple,equal")
    assert [(r["kvu"], r["split"]) for r in rows] == [("1", "simple"), ("1", "equal")]


def test_json_has_path(capsys):
    rc = bench.main(FAST + ["--n-layer", "1", "-o", "jsonl", "-fa", "on,off"])
    out = capsys.readouterr().out
    assert rc == 0 and [json.loads(l)["path"] for l in out.splitlines()] == ["numpy", "ggml mul_mat"]


def test_gpu_path_name():
    assert fmt.attention_path("cuda", "on", "auto") == "CUDA kernels"
    assert fmt.attention_path("cuda", "on", "reference") == "numpy"
