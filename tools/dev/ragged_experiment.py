"""Ragged prompts on a split KV cache, every split strategy, into one results file.

The question: with split KV (one stream per sequence, llama.cpp's ``kv_unified = false``)
llama.cpp's ``equal`` split needs every sequence in a ubatch to bring the same number of
tokens, so prompts of different lengths break into many small ubatches; padding the prompts
of a ubatch to one length and dropping the pad cells from the cache afterwards (``padded``)
keeps them in one. Cases: 10 prompts of 1..10 tokens; 16 and 64 prompts of 16-200 tokens
(uniform, ``--seed``); every split strategy side by side; ``--layer attn`` and
``--layer full``. Writes ``<out>/ragged-<device>-<date>-<commit>.jsonl`` (every row, as the
tool prints it with ``-o jsonl``, plus ``case`` and the command line) and a markdown summary
beside it, and prints the summary.

    python tools/dev/ragged_experiment.py --out bench/results            # GPU when present
    python tools/dev/ragged_experiment.py --out /tmp -- --device cpu -m tiny   # extra tool flags
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import sys

from ggml_attn.cli import batched_bench
from ggml_attn.cli.common import build_info

CASES = [
    ("10 prompts of 1..10", ["--prompt-lens", "1-10"]),
    ("16 and 64 prompts of 16-200", ["--prompt-dist", "16-200", "-npl", "16,64"]),
]


def run_case(args: list[str]) -> list[dict]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = batched_bench.main(args + ["-o", "jsonl"])
    if rc != 0:
        raise SystemExit(f"ggml-attn-batched-bench {' '.join(args)} failed with exit code {rc}")
    return [json.loads(line) for line in buf.getvalue().splitlines() if line.strip()]


def summary(rows: list[dict]) -> str:
    head = ("| case | layer | B | prompt tokens | split | UB | pad rows | T_PP ms | S_PP t/s | "
            "T_TG ms | S_TG t/s |\n|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|\n")
    lines = []
    for r in rows:
        lines.append(f"| {r['case']} | {r['layer']} | {r['pl']} | {r['prompt_tokens']} | {r['split']} | "
                     f"{r['ub']} | {r['n_pad']} | {r['t_pp'] * 1e3:.2f} | {r['speed_pp']:.0f} | "
                     f"{r['t_tg'] * 1e3:.2f} | {r['speed_tg']:.0f} |")
    return head + "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tools/dev/ragged_experiment.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results", help="folder for the results (default: bench/results)")
    p.add_argument("-ntg", default="32", help="decode steps per case (default: 32)")
    p.add_argument("--seed", default="1", help="seed of the 16-200 prompt lengths (default: 1)")
    p.add_argument("extra", nargs="*", help="more ggml-attn-batched-bench flags (after --)")
    ns = p.parse_args(argv)
    rows = []
    for layer in ("attn", "full"):
        for name, case in CASES:
            args = case + ["-ntg", ns.ntg, "--seed", ns.seed, "--split", "all", "--layer", layer] + ns.extra
            print(f"running: ggml-attn-batched-bench {' '.join(args)}", file=sys.stderr, flush=True)
            for r in run_case(args):
                r["case"] = name
                r["command"] = "ggml-attn-batched-bench " + " ".join(args)
                rows.append(r)
    commit, _ = build_info()
    device = rows[0]["device"] if rows else "none"
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    os.makedirs(ns.out, exist_ok=True)
    base = os.path.join(ns.out, f"ragged-{device}-{stamp}-{commit}")
    with open(base + ".jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    text = summary(rows)
    with open(base + ".md", "w") as f:
        f.write(f"# Ragged prompts, every split strategy, on {device} ({rows[0]['model'] if rows else ''}, commit {commit}, {stamp})\n\n")
        f.write(text)
    print(text)
    print(f"wrote {base}.jsonl and .md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
