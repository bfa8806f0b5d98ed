"""Rows of ``ggml-attn-serve-bench``: what a served trace measured, and its md, csv, json and
jsonl forms.

A row is one (rate, split, KV mode, prompt budget) run of the trace; with ``-r N`` the trace
is served N times and latencies are pooled (every request's TTFT, every token's ITL), rates are
the mean of the runs (``_stddev`` beside them). :data:`TERMS` says what each column means.
"""
from __future__ import annotations

import csv
import io
import math

import numpy as np

from . import format_bench as fb
from .format_bench import Printer

FORMATS = ("md", "csv", "json", "jsonl")
PCTS = (50, 90, 99)

# every key of a row, in order: the result, then every input needed to run it again
KEYS = ["rate", "split", "kv_unified", "prompt_budget", "n_slots",
        "n_requests", "n_done", "n_refused", "elapsed_s", "req_per_s", "out_tok_per_s", "prompt_tok_per_s",
        "out_tok_per_s_stddev",
        "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p90", "itl_ms_p99", "itl_ms_max",
        "queue_ms_p50", "steps", "mixed_share", "ub_per_step", "n_pad", "graph_builds", "kv_cells_peak", "busy_share",
        "repetitions", "model", "device", "path", "layer", "kernel", "n_ctx", "n_batch", "n_ubatch",
        "type_k", "type_v", "flash_attn", "cuda_graph", "warmup", "trace", "prompt_dist", "gen_dist", "seed",
        "n_threads"]

# md: (header, key, width, format); negative width: left-aligned
_MD = [("rate", "rate", 6, "rate"), ("split", "split", -7, "s"), ("KVU", "kv_unified", 3, "b"),
       ("budget", "prompt_budget", 6, "budget"), ("req/s", "req_per_s", 7, ".2f"),
       ("out t/s", "out_tok_per_s", 9, "speed"), ("TTFT p50", "ttft_ms_p50", 9, ".1f"),
       ("p90", "ttft_ms_p90", 8, ".1f"), ("p99", "ttft_ms_p99", 8, ".1f"),
       ("ITL p50", "itl_ms_p50", 8, ".2f"), ("p90", "itl_ms_p90", 8, ".2f"), ("p99", "itl_ms_p99", 8, ".2f"),
       ("mixed", "mixed_share", 6, "pct"), ("UB/step", "ub_per_step", 7, ".2f"), ("PAD", "n_pad", 6, "d"),
       ("builds", "graph_builds", 6, "d"), ("KV peak", "kv_cells_peak", 8, "d"), ("done", "done", 7, "s")]

TERMS = (
    "Columns: rate: requests per second of the Poisson arrivals (inf: all at once; trace: the "
    "trace's own times). split, KVU: the ubatch split strategy and whether the KV cache is one "
    "buffer for all sequences (1) or one stream per sequence (0; simple always runs unified). "
    "budget: prompt tokens a step may carry (a step never exceeds -b tokens in all; 0: whole "
    "prompts). req/s and out t/s: finished requests and generated tokens per second of the run "
    "(first arrival to last token). TTFT: time to first token (arrival to the token its prompt's "
    "last step samples), ms, percentiles over requests. ITL: inter-token latency, ms between one "
    "request's consecutive tokens, percentiles over all of them. mixed: share of steps that "
    "carried prompt and decode tokens together. UB/step: ubatches (graph evaluations) per step. "
    "PAD: pad rows computed and dropped (padded, auto; on the CUDA engines' one-stream caches also "
    "each ubatch's pads up to its bucket of rows). builds: ubatch graphs built during the run "
    "(a structure the engine did not keep: first seen, or evicted since; each is host time in its "
    "step, ~30 ms for an 8B model graph). KV peak: KV cells holding tokens after a "
    "step, at most. done: finished of all requests (the rest were refused: too long for a "
    "sequence's cells).")


def percentile(values, q: float) -> float:
    """numpy's linear percentile of ``values``; NaN when there are none."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else math.nan


def row_of(runs: list[dict], inputs: dict) -> dict:
    """A row from ``runs`` (one dict per repetition: ``requests`` (served
    ``graph.serve.ServeRequest``), ``stats`` (``graph.serve.ServeStats``)) and ``inputs``
    (the keys of :data:`KEYS` that describe the run)."""
    ttft, itl, queue = [], [], []
    out_rates, prompt_rates, req_rates = [], [], []
    steps = mixed = ubs = pads = builds = peak = 0
    busy = elapsed = 0.0
    n_done = n_refused = 0
    for run in runs:
        st, reqs = run["stats"], run["requests"]
        done = [r for r in reqs if r.refused is None]
        n_done += len(done)
        n_refused += len(reqs) - len(done)
        ttft += [r.ttft for r in done]
        queue += [r.admitted - r.arrival for r in done]
        for r in done:
            itl += r.itl
        n_out = sum(len(r.tokens) for r in done)
        span = st.elapsed if st.elapsed > 0 else math.nan
        out_rates.append(n_out / span)
        req_rates.append(len(done) / span)
        prompt_rates.append(st.n_prompt_tokens / span)
        steps += st.n_steps
        mixed += st.n_mixed
        ubs += st.counts.get("ubatches", 0)
        pads += st.counts.get("pads", 0)
        builds += st.counts.get("builds", 0)
        peak = max(peak, st.cells_peak)
        busy += st.busy
        elapsed += st.elapsed
    n = len(runs)
    row = dict(inputs)
    row.update(n_done=n_done // n, n_refused=n_refused // n, elapsed_s=elapsed / n,
               req_per_s=fb.mean(req_rates), out_tok_per_s=fb.mean(out_rates),
               prompt_tok_per_s=fb.mean(prompt_rates),
               out_tok_per_s_stddev=fb.stdev(out_rates),
               queue_ms_p50=percentile(queue, 50) * 1e3,
               steps=steps // n, mixed_share=mixed / steps if steps else 0.0,
               ub_per_step=ubs / steps if steps else 0.0, n_pad=pads // n, graph_builds=builds // n, kv_cells_peak=peak,
               busy_share=busy / elapsed if elapsed > 0 else 0.0, repetitions=n,
               itl_ms_max=max(itl) * 1e3 if itl else math.nan)
    for q in PCTS:
        row[f"ttft_ms_p{q}"] = percentile(ttft, q) * 1e3
        row[f"itl_ms_p{q}"] = percentile(itl, q) * 1e3
    return row


_BEST = (("out_tok_per_s", max, "most output t/s", ""), ("ttft_ms_p50", min, "lowest TTFT p50", " ms"),
         ("itl_ms_p99", min, "lowest ITL p99", " ms"))


def summary(rows: list[dict]) -> list[str]:
    """Which strategy did best, per rate and prompt budget of ``rows`` (:func:`row_of`) where
    several were served: the most output tokens/s, the lowest TTFT p50 and the lowest ITL p99 --
    a line each group, naming the split, KV mode and value (rows that refused requests left
    out). Nothing when no group compares two strategies."""
    groups: dict = {}
    for r in rows:
        if not r.get("n_refused"):
            groups.setdefault((r.get("rate"), r.get("prompt_budget")), []).append(r)
    out = []
    for (rate, budget), rs in groups.items():
        if len(rs) < 2:
            continue
        parts = []
        for key, pick, what, unit in _BEST:
            ok = [r for r in rs if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
            if ok:
                b = pick(ok, key=lambda r: r[key])
                parts.append(f"{what}: {b['split']} {'-kvu' if b.get('kv_unified') else 'per-stream'} "
                             f"({b[key]:,.1f}{unit})")
        where = "trace" if rate is None else ("all at once" if math.isinf(rate) else f"{rate:g}/s")
        budget_s = "whole prompts" if budget == 0 else f"prompt budget {budget}"
        out.append(f"{where}, {budget_s}: " + "; ".join(parts))
    return out


def _json_value(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, np.generic):
        return v.item()
    return v


def row_json(row: dict) -> dict:
    return {k: _json_value(row.get(k)) for k in KEYS}


def _md_cell(row: dict, key: str, fmt: str) -> str:
    if key == "done":
        return f"{row['n_done']}/{row['n_requests']}"
    v = row.get(key)
    if isinstance(v, float) and math.isnan(v):   # (nothing measured: e.g. no request served)
        return "-"
    if fmt == "rate":
        return "trace" if v is None else ("inf" if math.isinf(v) else f"{v:g}")
    if fmt == "b":
        return str(int(bool(v)))
    if fmt == "budget":
        return "whole" if v == 0 else str(v)
    if fmt == "pct":
        return f"{100 * v:.0f}%"
    if fmt == "speed":
        sd = row.get("out_tok_per_s_stddev", 0.0)
        return f"{v:.2f} ± {sd:.2f}" if row.get("repetitions", 1) > 1 else f"{v:.2f}"
    if fmt == "s":
        return str(v)
    return format(v, fmt)


class MarkdownPrinter(Printer):
    def __init__(self, out, repetitions: int = 1):
        super().__init__(out)
        self.repetitions = repetitions

    def header(self):
        def width(h, fmt, w):   # "mean ± stddev" with several repetitions
            return 19 if fmt == "speed" and self.repetitions > 1 else max(abs(w), len(h))
        self.widths = [width(h, fmt, w) * (1 if w > 0 else -1) for h, _, w, fmt in _MD]
        cells = [h.ljust(abs(w)) if w < 0 else h.rjust(w) for (h, _, _, _), w in zip(_MD, self.widths)]
        self._write("| " + " | ".join(cells) + " |\n")
        self._write("|" + "|".join(("-" * (abs(w) + 1) + ":") if w > 0 else ("-" * (abs(w) + 2))
                                   for w in self.widths) + "|\n")

    def row(self, row):
        cells = []
        for (_, key, _, fmt), w in zip(_MD, self.widths):
            text = _md_cell(row, key, fmt)
            cells.append(text.ljust(abs(w)) if w < 0 else text.rjust(w))
        self._write("| " + " | ".join(cells) + " |\n")


class CsvPrinter(Printer):
    def header(self):
        self._write(",".join(KEYS) + "\n")

    def row(self, row):
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerow(["" if v is None else v for v in row_json(row).values()])
        self._write(buf.getvalue())


class JsonPrinter(fb.JsonPrinter):
    to_json = staticmethod(row_json)


class JsonlPrinter(fb.JsonlPrinter):
    to_json = staticmethod(row_json)


def make_printer(fmt: str, out, repetitions: int = 1) -> Printer:
    if fmt == "md":
        return MarkdownPrinter(out, repetitions)
    return {"csv": CsvPrinter, "json": JsonPrinter, "jsonl": JsonlPrinter}[fmt](out)
