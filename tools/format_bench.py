"""Output of ``ggml-attn-bench`` in llama-bench's formats: md, csv, json, jsonl, sql.

A result row is a dict with the keys of :data:`FIELDS` plus ``samples_ns`` (one
wall-clock or CUDA-event time per repetition). Printers stream: the header when
created, one row per finished test, the footer at the end (also after Ctrl-C), so a
json array stays valid when the run is interrupted.

Markdown follows llama-bench's rules: model (llama.cpp's description, ``llama 8B F16``),
backend, [ngl when not CPU], threads (CPU), the optional columns only when a flag has a
non-default value or several values, then test and ``t/s`` as ``mean ± stddev``; and says what
was measured (:func:`markdown_columns`): the model's name, path always, layer, kvu, split and
kernel when not their defaults, n_layer when overridden, the weights' size and params only with
``--layer full`` (random F16 weights of the shape) or ``--layer model`` (the file's own
weights); an attention-only run never touches weights.
"""
from __future__ import annotations

import csv
import io
import json
import statistics

# llama-bench's fields in its order (every key llama.cpp's scripts/compare-llama-bench.py reads,
# of its versions since 2025), with ours (shape, model_name, kv_unified, split, kernel, device, layer,
# ub); model_type is llama-bench's (llama.cpp's model description, ``llama 8B Q4_K - Medium``),
# model_name the file's general.name (or its file name) or the preset's name
FIELDS = [
    "build_commit", "build_number", "cpu_info", "gpu_info", "backends",
    "model_filename", "model_type", "model_size", "model_n_params",
    "n_layer", "n_head", "n_head_kv", "head_dim",
    "n_batch", "n_ubatch", "n_threads", "cpu_mask", "cpu_strict", "poll", "type_k", "type_v",
    "n_gpu_layers", "n_cpu_moe", "split_mode", "main_gpu", "no_kv_offload", "flash_attn", "devices", "tensor_split",
    "tensor_buft_overrides", "use_mmap", "load_mode", "lazy_mode", "embeddings", "no_op_offload", "no_host",
    "repack", "fit_target",
    "fit_min_ctx", "model_name", "kv_unified", "split", "kernel", "path", "device", "layer",
    "n_prompt", "n_gen", "n_depth", "ub",
    "test_time", "avg_ns", "stddev_ns", "avg_ts", "stddev_ts",
]
INT_FIELDS = {"build_number", "model_size", "model_n_params", "n_layer", "n_head", "n_head_kv",
              "head_dim", "n_batch", "n_ubatch", "n_threads", "poll", "n_gpu_layers", "n_cpu_moe", "main_gpu",
              "flash_attn", "fit_target", "fit_min_ctx", "n_prompt", "n_gen", "n_depth", "ub", "avg_ns", "stddev_ns"}
BOOL_FIELDS = {"kv_unified", "cpu_strict", "no_kv_offload", "use_mmap", "embeddings", "no_op_offload", "no_host",
               "repack"}
FLOAT_FIELDS = {"avg_ts", "stddev_ts"}
# -fa's words as llama-bench writes its flash_attn field (llama_flash_attn_type: -1 auto)
FA_INT = {"on": 1, "off": 0, "auto": -1}
# what llama-bench writes for the settings this tool has no flag for (its defaults)
LLAMA_BENCH_DEFAULTS = dict(cpu_mask="0x0", cpu_strict=False, poll=50, n_cpu_moe=0, no_kv_offload=False,
                            devices="auto", tensor_buft_overrides="none", use_mmap=True, load_mode="auto",
                            lazy_mode="auto", embeddings=False, no_op_offload=False, no_host=False, repack=True,
                            fit_target=0, fit_min_ctx=0)

# markdown: field -> display name, and llama-bench's widths (negative: left-aligned)
DISPLAY = {"n_gpu_layers": "ngl", "n_threads": "threads", "flash_attn": "fa",
           "kv_unified": "kvu", "device": "dev", "model_name": "name", "tensor_split": "ts"}
WIDTHS = {"model": -30, "model_name": -20, "n_layer": 7, "size": 10, "params": 10, "backend": -10,
          "n_gpu_layers": 3, "n_threads": 7, "n_batch": 7, "n_ubatch": 8, "type_k": 6, "type_v": 6,
          "flash_attn": 3, "tensor_split": -12, "kv_unified": 3,
          "split": -7, "kernel": -9, "layer": -5, "device": -4, "path": -12, "test": 15, "t/s": 20}
# optional markdown columns shown when non-default or several values (llama-bench's rule and
# order), before "path" (what computed attention, always shown) ...
OPTIONAL_COLUMNS = ["n_batch", "n_ubatch", "type_k", "type_v", "flash_attn", "tensor_split"]
# ... and ours, after it
OPTIONAL_AFTER_PATH = ["kernel", "layer", "kv_unified", "split"]
FORMATS = ("md", "csv", "json", "jsonl", "sql")


def mean(values):
    return sum(values) / len(values) if values else 0.0


def stdev(values):
    """Sample standard deviation (n - 1) of the values that are numbers (NaN: a repetition with
    nothing to time), 0 for fewer than two, as llama-bench."""
    values = [v for v in values if v == v]
    return statistics.stdev(values) if len(values) > 1 else 0.0


def samples_ts(row) -> list[float]:
    n_tokens = row["n_prompt"] + row["n_gen"]
    return [1e9 * n_tokens / ns for ns in row["samples_ns"] if ns > 0]


def finish_row(row: dict) -> dict:
    """Fill avg/stddev of ns and t/s from ``samples_ns``; returns ``row``."""
    ns = row["samples_ns"]
    ts = samples_ts(row)
    row["avg_ns"] = int(mean(ns))
    row["stddev_ns"] = int(stdev(ns))
    row["avg_ts"] = mean(ts)
    row["stddev_ts"] = stdev(ts)
    return row


def test_name(n_prompt: int, n_gen: int, n_depth: int) -> str:
    """``pp512``, ``tg128``, ``pp512+tg128``, with `` @ d4096`` for a depth."""
    if n_prompt > 0 and n_gen == 0:
        name = f"pp{n_prompt}"
    elif n_gen > 0 and n_prompt == 0:
        name = f"tg{n_gen}"
    else:
        name = f"pp{n_prompt}+tg{n_gen}"
    return name + (f" @ d{n_depth}" if n_depth > 0 else "")


def human_size(n_bytes: int) -> str:
    if n_bytes < 1024 ** 3:
        return f"{n_bytes / 1024 / 1024:.2f} MiB"
    return f"{n_bytes / 1024 ** 3:.2f} GiB"


def human_params(n: int) -> str:
    return f"{n / 1e6:.2f} M" if n < 1_000_000_000 else f"{n / 1e9:.2f} B"


def _json_value(field, value):
    if field in INT_FIELDS:
        return int(value)
    if field in BOOL_FIELDS:
        return bool(value)
    if field in FLOAT_FIELDS:
        return float(value)
    return "" if value is None else str(value)


def row_json(row: dict) -> dict:
    """The json object of a row: FIELDS typed as llama-bench types them, then the samples."""
    out = {f: _json_value(f, row.get(f)) for f in FIELDS}
    out["samples_ns"] = [int(x) for x in row["samples_ns"]]
    out["samples_ts"] = samples_ts(row)
    return out


def _csv_value(field, value):
    if field in BOOL_FIELDS:
        return str(int(bool(value)))
    if field in FLOAT_FIELDS:
        return f"{float(value):.6f}"
    return "" if value is None else str(value)


class Printer:
    """Base: ``header()``, ``row(r)`` per finished test, ``footer()``; writes to ``out``."""

    def __init__(self, out):
        self.out = out

    def header(self):
        pass

    def row(self, row: dict):
        raise NotImplementedError

    def footer(self):
        pass

    def _write(self, text):
        self.out.write(text)
        self.out.flush()


class CsvPrinter(Printer):
    def header(self):
        self._write(",".join(FIELDS) + "\n")

    def row(self, row):
        buf = io.StringIO()
        csv.writer(buf, quoting=csv.QUOTE_ALL, lineterminator="\n").writerow(
            [_csv_value(f, row.get(f)) for f in FIELDS])
        self._write(buf.getvalue())


class JsonPrinter(Printer):
    """A json array of ``to_json(row)`` objects."""

    to_json = staticmethod(row_json)

    def __init__(self, out):
        super().__init__(out)
        self.first = True

    def header(self):
        self._write("[\n")

    def row(self, row):
        body = json.dumps(self.to_json(row), indent=2)
        body = "\n".join("  " + line for line in body.splitlines())
        self._write(("" if self.first else ",\n") + body)
        self.first = False

    def footer(self):
        self._write("\n]\n")


class JsonlPrinter(Printer):
    to_json = staticmethod(row_json)

    def row(self, row):
        self._write(json.dumps(self.to_json(row)) + "\n")


SQL_TABLE = "llama_bench"   # llama-bench's table (compare-llama-bench.py reads this name)
# its columns, exactly llama-bench's (llama.cpp 0c1e570's, in its order): either tool's -o sql may
# create the table and the other's rows still go in (one database of both, as llama.cpp users
# keep theirs); our other fields go to a table of their own, joined on OURS_SQL_KEY
LLAMA_BENCH_SQL_FIELDS = [
    "build_commit", "build_number", "cpu_info", "gpu_info", "backends", "model_filename", "model_type",
    "model_size", "model_n_params", "n_batch", "n_ubatch", "n_threads", "cpu_mask", "cpu_strict", "poll",
    "type_k", "type_v", "n_gpu_layers", "n_cpu_moe", "split_mode", "main_gpu", "no_kv_offload", "flash_attn",
    "devices", "tensor_split", "tensor_buft_overrides", "load_mode", "lazy_mode", "embeddings", "no_op_offload",
    "no_host", "repack", "fit_target", "fit_min_ctx", "n_prompt", "n_gen", "n_depth", "test_time", "avg_ns",
    "stddev_ns", "avg_ts", "stddev_ts",
]
OURS_SQL_TABLE = "ggml_attn_bench"
OURS_SQL_KEY = ["build_commit", "test_time", "model_filename", "n_prompt", "n_gen", "n_depth"]
OURS_SQL_FIELDS = OURS_SQL_KEY + [f for f in FIELDS if f not in LLAMA_BENCH_SQL_FIELDS]


class SqlPrinter(Printer):
    """llama-bench's ``-o sql``: CREATE TABLE IF NOT EXISTS of llama-bench's table (its columns
    exactly) and of ours (:data:`OURS_SQL_FIELDS`), then per test one INSERT into each."""

    @staticmethod
    def sql_type(field) -> str:
        if field in INT_FIELDS or field in BOOL_FIELDS:
            return "INTEGER"
        return "REAL" if field in FLOAT_FIELDS else "TEXT"

    def header(self):
        for table, fields in ((SQL_TABLE, LLAMA_BENCH_SQL_FIELDS), (OURS_SQL_TABLE, OURS_SQL_FIELDS)):
            cols = ",\n".join(f"  {f} {self.sql_type(f)}" for f in fields)
            self._write(f"CREATE TABLE IF NOT EXISTS {table} (\n{cols}\n);\n\n")

    def row(self, row):
        for table, fields in ((SQL_TABLE, LLAMA_BENCH_SQL_FIELDS), (OURS_SQL_TABLE, OURS_SQL_FIELDS)):
            values = ", ".join("'" + _csv_value(f, row.get(f)).replace("'", "''") + "'" for f in fields)
            self._write(f"INSERT INTO {table} ({', '.join(fields)}) VALUES ({values});\n")


class Tee(Printer):
    """Several printers fed the same rows (``-o`` on stdout and ``-oe`` on stderr)."""

    def __init__(self, *printers):
        super().__init__(None)
        self.printers = printers

    def header(self):
        for p in self.printers:
            p.header()

    def row(self, row):
        for p in self.printers:
            p.row(row)

    def footer(self):
        for p in self.printers:
            p.footer()


class MarkdownPrinter(Printer):
    """``columns``: the optional fields to show (see :func:`markdown_columns`)."""

    def __init__(self, out, columns: list[str], build: str = ""):
        super().__init__(out)
        self.columns = columns
        self.build = build

    @staticmethod
    def width(field):
        if field in WIDTHS:
            return WIDTHS[field]
        return -max(len(DISPLAY.get(field, field)), 10)

    def _line(self, cells):
        parts = []
        for field, text in zip(self.columns, cells):
            text = str(text).replace("|", "\\|")   # a cell's own '|' (a model's name) must not split it
            w = self.width(field)
            parts.append(f" {text:<{-w}} |" if w < 0 else f" {text:>{w}} |")
        return "|" + "".join(parts) + "\n"

    def header(self):
        self._write(self._line([DISPLAY.get(f, f) for f in self.columns]))
        rule = "|" + "".join(f" {'-' * (abs(self.width(f)) - 1)}{':' if self.width(f) > 0 else '-'} |"
                             for f in self.columns)
        self._write(rule + "\n")

    def cell(self, field, row):
        if field == "model":
            return row["model_type"]
        if field == "tensor_split":
            return row["tensor_split"]
        if field in ("size", "params") and row.get("layer") not in ("full", "model"):
            return "-"  # attention only: no weights touched
        if field == "size":
            return human_size(row["model_size"])
        if field == "params":
            return human_params(row["model_n_params"])
        if field == "backend":
            return row["backends"]
        if field == "test":
            return test_name(row["n_prompt"], row["n_gen"], row["n_depth"])
        if field == "t/s":
            return f"{row['avg_ts']:.2f} ± {row['stddev_ts']:.2f}"
        value = row.get(field)
        if field in BOOL_FIELDS:
            return str(int(bool(value)))
        return str(value)

    def row(self, row):
        self._write(self._line([self.cell(f, row) for f in self.columns]))

    def footer(self):
        if self.build:
            self._write(f"\nbuild: {self.build}\n")


def markdown_columns(backend: str, optional: list[str], *, weights: bool = False,
                     n_layer: bool = False) -> list[str]:
    """llama-bench's column list: model (its description, ``llama 8B F16``), then ``name`` (the
    file's general.name or the preset; llama-bench has no such column), ``n_layer`` when it
    differs from the model's (``n_layer``), the weights' ``size`` and ``params`` only when a row
    runs them (``weights``: --layer full or model), backend, ngl for a GPU backend (or several
    -ngl values), threads for the CPU backend (or a non-default -t), the ``optional`` columns (a
    flag with a non-default value or several values, llama-bench's order), ``path`` (what
    computed attention) always, then our optional ones (kernel, layer, kvu, split), test, t/s."""
    cols = ["model", "model_name"] + (["n_layer"] if n_layer else []) + (["size", "params"] if weights else [])
    cols += ["backend"] + (["n_gpu_layers"] if backend != "CPU" or "n_gpu_layers" in optional else [])
    cols += ["n_threads"] if backend == "CPU" or "n_threads" in optional else []
    cols += [c for c in OPTIONAL_COLUMNS if c in optional] + ["path"]
    cols += [c for c in OPTIONAL_AFTER_PATH if c in optional]
    return cols + ["test", "t/s"]


def attention_path(device: str, flash_attn: str, kernel: str) -> str:
    """What computed attention in a row: ggml_attn's ``CUDA kernels`` or ``numpy`` path,
    ggml's own CPU flash attention (``ggml FA``, --kernel ggml), or ggml's mul_mat + soft_max
    (``ggml mul_mat``, -fa off)."""
    if flash_attn == "off":
        return "ggml mul_mat"
    if kernel == "ggml":
        return "ggml FA"
    if kernel == "reference" or device != "cuda":
        return "numpy"
    return "CUDA kernels"


def make_printer(fmt: str, out, *, md_columns=None, build: str = "") -> Printer:
    if fmt == "md":
        return MarkdownPrinter(out, md_columns or markdown_columns("CPU", []), build)
    if fmt == "csv":
        return CsvPrinter(out)
    if fmt == "json":
        return JsonPrinter(out)
    if fmt == "jsonl":
        return JsonlPrinter(out)
    if fmt == "sql":
        return SqlPrinter(out)
    raise ValueError(f"unknown output format {fmt}")
