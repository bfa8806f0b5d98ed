"""ggml-attn-batched-bench says what ran: kv_unified per row, UB / ub / ub_tg / n_pad defined,
plans in n_seqs x n_seq_tokens, ragged flags that conflict."""
import json

import pytest

from ggml_attn.cli import batched_bench

FAST = ["-t", "1", "--n-layer", "1", "--device", "cpu"]


def _run(capsys, *args):
    rc = batched_bench.main(list(args) + FAST)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _table(out):
    lines = [l for l in out.splitlines() if l.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return head, [dict(zip(head, (c.strip() for c in l.strip("|").split("|")))) for l in lines[2:]]


def test_markdown_kv_unified_is_right_on_every_row(capsys):
    rc, out, err = _run(capsys, "--prompt-lens", "1-4", "-ntg", "1", "--split", "simple,equal")
    assert rc == 0, err
    head, rows = _table(out)
    assert "KVU" in head
    assert [(r["split"], r["KVU"]) for r in rows] == [("simple", "1"), ("equal", "0")]
    assert "kv_unified = 0" not in out  # not claimed for the simple row


def test_markdown_header_kv_unified_when_all_rows_agree(capsys):
    rc, out, err = _run(capsys, "-npp", "8", "-npl", "2", "-ntg", "1", "--split", "simple")
    assert rc == 0, err
    assert "kv_unified = 1" in out and [r["KVU"] for r in _table(out)[1]] == ["1"]


def test_help_defines_ub_columns_and_keys(capsys):
    rc, out, _ = _run(capsys, "--help")
    assert rc == 0
    text = " ".join(out.split())
    for term in ("UB:", "ub_tg:", "n_pad:", "KVU:", "n_seqs x n_seq_tokens"):
        assert term in text, term


@pytest.mark.parametrize("split, shapes", [("simple", ["32x1"]), ("equal", ["32x1"]),
                                           ("seq", ["1x1"] * 32)])
def test_plan_shapes_are_n_seqs_x_n_seq_tokens(capsys, split, shapes):
    rc, out, err = _run(capsys, "-npp", "1", "-npl", "32", "-ntg", "1", "-kvu", "--split", split,
                        "--plan", "-o", "jsonl")
    assert rc == 0, err
    assert json.loads(out)["shapes"] == shapes
    rc, out, err = _run(capsys, "--prompt-lens", "3,3", "-ntg", "1", "-kvu", "--split", "simple", "--plan")
    assert rc == 0 and "1 ubatch: 6x1" in out


@pytest.mark.parametrize("args, msg", [
    (["--prompt-lens", "1-4", "-npl", "8"], "--prompt-lens"),
    (["--prompt-lens", "1-4", "-npp", "8"], "--prompt-lens"),
    (["--prompt-dist", "4-8", "-npp", "8"], "--prompt-dist"),
    (["--prompt-lens", "1-4", "--prompt-dist", "4-8"], "--prompt-dist"),
])
def test_ragged_flags_do_not_drop_others_silently(capsys, args, msg):
    rc, out, err = _run(capsys, *args, "-ntg", "1", "--plan")
    assert rc == 2 and out == "" and err.count("\n") == 1 and msg in err and "Traceback" not in err
