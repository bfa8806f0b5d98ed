"""ggml-attn-bench's machine-readable outputs as llama.cpp's scripts/compare-llama-bench.py reads
them (issue #47 A.1). The facts, from that script (its versions of 2025 and 2026): it reads a
sqlite file's table ``llama_bench``, or JSON / JSONL / CSV rows, keeps the keys of llama-bench's
field list, requires its key properties plus ``build_commit``, ``test_time`` and ``avg_ts`` in
every row, and joins a baseline build's rows with a compared build's on every key property
(``flash_attn`` an integer there). The reader below is written here from those facts."""
import csv
import io
import json
import sqlite3

import pytest

from ggml_attn.cli import bench
from ggml_attn.cli import format_bench as fmt

# the key properties of both script versions (the union: 2026 adds use_mmap; 2025 had n_cpu_moe,
# load_mode, fit_target, fit_min_ctx)
KEY_PROPERTIES = ["cpu_info", "gpu_info", "backends", "n_gpu_layers", "n_cpu_moe", "tensor_buft_overrides",
                  "model_filename", "model_type", "n_batch", "n_ubatch", "embeddings", "cpu_mask", "cpu_strict",
                  "poll", "n_threads", "type_k", "type_v", "use_mmap", "no_kv_offload", "split_mode", "main_gpu",
                  "tensor_split", "load_mode", "fit_target", "fit_min_ctx", "flash_attn", "n_prompt", "n_gen",
                  "n_depth"]
REQUIRED = set(KEY_PROPERTIES) | {"build_commit", "test_time", "avg_ts"}
INTEGER = {"build_number", "model_size", "model_n_params", "n_batch", "n_ubatch", "n_threads", "poll",
           "n_gpu_layers", "n_cpu_moe", "main_gpu", "flash_attn", "n_prompt", "n_gen", "n_depth", "avg_ns",
           "stddev_ns", "fit_target", "fit_min_ctx"}
BOOLEAN = {"cpu_strict", "no_kv_offload", "use_mmap", "embeddings", "no_op_offload"}
ARGS = ["-p", "8", "-n", "2", "-r", "1", "--no-warmup", "--device", "cpu", "-t", "1", "--n-layer", "1"]


def _run(capsys, fmt_name):
    assert bench.main(ARGS + ["-o", fmt_name]) == 0
    return capsys.readouterr().out


def _rows(capsys, fmt_name) -> list[dict]:
    out = _run(capsys, fmt_name)
    if fmt_name == "jsonl":
        return [json.loads(line) for line in out.splitlines()]
    if fmt_name == "json":
        return json.loads(out)
    return list(csv.DictReader(io.StringIO(out)))


@pytest.mark.parametrize("fmt_name", ["jsonl", "json", "csv"])
def test_rows_have_every_key_the_script_requires(capsys, fmt_name):
    rows = _rows(capsys, fmt_name)
    assert len(rows) == 2
    for r in rows:
        assert REQUIRED <= set(r), sorted(REQUIRED - set(r))
        if fmt_name != "csv":   # typed as llama-bench types them
            for k in INTEGER & set(r):
                assert isinstance(r[k], int) and not isinstance(r[k], bool), (k, r[k])
            for k in BOOLEAN:
                assert isinstance(r[k], bool), (k, r[k])
        assert int(r["flash_attn"]) == -1


# llama-bench's own table at llama.cpp 0c1e570 (the vendored llama.cpp of llama-cpp-python 0.3.36,
# the project's reference): its columns, in its order (it has no use_mmap: load_mode)
LLAMA_BENCH_TABLE = [
    "build_commit", "build_number", "cpu_info", "gpu_info", "backends", "model_filename", "model_type",
    "model_size", "model_n_params", "n_batch", "n_ubatch", "n_threads", "cpu_mask", "cpu_strict", "poll",
    "type_k", "type_v", "n_gpu_layers", "n_cpu_moe", "split_mode", "main_gpu", "no_kv_offload", "flash_attn",
    "devices", "tensor_split", "tensor_buft_overrides", "load_mode", "lazy_mode", "embeddings", "no_op_offload",
    "no_host", "repack", "fit_target", "fit_min_ctx", "n_prompt", "n_gen", "n_depth", "test_time", "avg_ns",
    "stddev_ns", "avg_ts", "stddev_ts"]
SQL_KEYS = [p for p in KEY_PROPERTIES if p in LLAMA_BENCH_TABLE]


def test_sql_is_the_llama_bench_table_and_two_builds_join(capsys):
    """-o sql | sqlite3: the table llama_bench with llama-bench's columns exactly (every key
    property of that version); two builds' rows (two runs, the second under another
    build_commit) join on all key properties, as the script's comparison does."""
    assert set(KEY_PROPERTIES) - set(SQL_KEYS) == {"use_mmap"}
    db = sqlite3.connect(":memory:")
    db.executescript(_run(capsys, "sql"))
    cols = {r[1]: r[2] for r in db.execute("PRAGMA table_info(llama_bench)")}
    assert list(cols) == LLAMA_BENCH_TABLE
    assert all(cols[k] == "INTEGER" for k in INTEGER & set(cols)) and cols["avg_ts"] == "REAL"
    db.executescript(_run(capsys, "sql").replace("CREATE TABLE IF NOT EXISTS", "CREATE TABLE IF NOT EXISTS"))
    first = db.execute("SELECT MIN(rowid) FROM llama_bench WHERE rowid > 2").fetchone()[0]
    # the second build's commit: 'x' + the first's ('x' starts no hex hash: a commit such as
    # bd54dae must not look like the second build)
    db.execute(f"UPDATE llama_bench SET build_commit = 'x' || build_commit WHERE rowid >= {first}")
    on = " AND ".join(f"tb.{p} = tc.{p}" for p in SQL_KEYS)
    joined = db.execute(f"SELECT tb.n_prompt, tb.n_gen, tb.avg_ts, tc.avg_ts FROM llama_bench tb JOIN llama_bench tc "
                        f"ON {on} AND tb.build_commit != tc.build_commit AND tc.build_commit LIKE 'x%'").fetchall()
    assert sorted((p, g) for p, g, _, _ in joined) == [(0, 2), (8, 0)]
    assert all(a > 0 and b > 0 for _, _, a, b in joined)


def test_markdown_fa_column_is_llama_bench_s_integer(capsys):
    assert bench.main(ARGS + ["-fa", "on,off"]) == 0
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    fa = head.index("fa")
    assert [[c.strip() for c in l.strip("|").split("|")][fa] for l in lines[2:]] == ["1", "1", "0", "0"]


def test_fields_cover_the_script_and_say_each_type():
    assert REQUIRED <= set(fmt.FIELDS)
    assert set(fmt.LLAMA_BENCH_DEFAULTS) <= set(fmt.FIELDS)
    assert fmt.SQL_TABLE == "llama_bench"


def test_one_database_of_both_tools_in_either_order(capsys):
    """llama.cpp users keep one sqlite file of every run: llama-bench's table created first (its
    own CREATE) then our -o sql, or ours first then llama-bench's INSERT, both load (our extra
    fields in a table of their own) and the rows of both tools are there."""
    ours = _run(capsys, "sql")
    theirs_create = "CREATE TABLE IF NOT EXISTS llama_bench (" + ", ".join(LLAMA_BENCH_TABLE) + ");"
    theirs_insert = (f"INSERT INTO llama_bench ({', '.join(LLAMA_BENCH_TABLE)}) VALUES "
                     f"({', '.join(repr('1') for _ in LLAMA_BENCH_TABLE)});")
    for script in (theirs_create + theirs_insert + ours, ours + theirs_create + theirs_insert):
        db = sqlite3.connect(":memory:")
        db.executescript(script)
        assert db.execute("SELECT COUNT(*) FROM llama_bench").fetchone()[0] == 3
        assert db.execute("SELECT COUNT(*) FROM ggml_attn_bench").fetchone()[0] == 2
