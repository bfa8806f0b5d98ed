"""A/B runs of a benchmark under module-level knobs: each variant runs ``ggml-attn-bench``,
``ggml-attn-batched-bench`` or ``ggml-attn-serve-bench`` in a fresh Python process with some
module attributes set first (``kv_cache.PROMPT_WHOLE_CACHE_MASK_BYTES=0``, ``dispatch.CELLS_MIN_GAIN=1e9``, ...), the
variants alternating round by round (A B A B: a noisy machine's drift falls on both), and one
table is printed last with every round's numbers and each variant's median.

Usage: python tools/dev/knob_ab.py [--rounds 2] [--out FILE.json]
           --variant NAME[:MODULE.ATTR=VALUE[,MODULE.ATTR=VALUE...]] [--variant ...]
           bench|batched-bench|serve-bench ARGS...
MODULE is a module of the package (``ggml_attn.graph.kv_cache`` or, shorter,
``graph.kv_cache``, ``dispatch``, ``cli.cuda_launch`` ...); VALUE a Python literal (a tuple's
commas are its own). The
benchmark's own ``-o jsonl`` rows are read back, so leave ``-o`` out (it is added).
e.g.   python tools/dev/knob_ab.py --variant whole --variant coarse:graph.kv_cache.PROMPT_WHOLE_CACHE_MASK_BYTES=0 \\
           batched-bench -m llama-3-8b --layer full --prompt-dist 16-200 -npl 64 -ntg 32 -kvu -r 2
"""
from __future__ import annotations

import argparse
import ast
import importlib
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass, field

_TOOLS = {"bench": "bench", "batched-bench": "batched_bench", "serve-bench": "serve_bench"}
# the numbers shown per tool (keys of the benchmark's jsonl rows)
_SHOW = {"bench": ("avg_ts",), "batched-bench": ("speed_pp", "speed_tg", "speed"),
         "serve-bench": ("out_tok_per_s", "ttft_ms_p50", "itl_ms_p99", "graph_builds")}


@dataclass
class Variant:
    name: str
    knobs: list[tuple[str, str, object]] = field(default_factory=list)   # (module, attribute, value)


def _module_name(name: str) -> str:
    return name if name.startswith("ggml_attn") else f"ggml_attn.{name}"


def _split_top(spec: str) -> list[str]:
    """``spec`` split at the commas outside brackets and quotes (a tuple value keeps its own)."""
    parts, depth, quote, cur = [], 0, "", []
    for ch in spec:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    parts.append("".join(cur))
    return parts


def parse_variant(text: str) -> Variant:
    """``NAME[:MOD.ATTR=VALUE,...]`` -> :class:`Variant`; ValueError on a malformed spec, an
    unknown module or attribute, or a value that is not a Python literal."""
    name, _, spec = text.partition(":")
    if not name:
        raise ValueError(f"variant {text!r}: no name")
    v = Variant(name)
    for item in filter(None, _split_top(spec)):
        target, eq, value = item.partition("=")
        mod, dot, attr = target.rpartition(".")
        if not eq or not dot or not attr:
            raise ValueError(f"variant {name!r}: {item!r} is not MODULE.ATTR=VALUE")
        mod = _module_name(mod)
        try:
            m = importlib.import_module(mod)
        except ImportError as e:
            raise ValueError(f"variant {name!r}: no module {mod} ({e})") from None
        if not hasattr(m, attr):
            raise ValueError(f"variant {name!r}: module {mod} has no attribute {attr!r}")
        try:
            val = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"variant {name!r}: {value!r} is not a Python literal") from None
        v.knobs.append((mod, attr, val))
    return v


def child_code(v: Variant, tool: str) -> str:
    """The ``python -c`` program of one run: set the knobs, then the benchmark's ``_main``."""
    lines = ["import importlib, sys"]
    for mod, attr, val in v.knobs:
        lines.append(f"setattr(importlib.import_module({mod!r}), {attr!r}, {val!r})")
    lines.append(f"from ggml_attn.cli.{_TOOLS[tool]} import _main")
    lines.append("sys.exit(_main(sys.argv[1:]))")
    return "\n".join(lines)


def run_once(v: Variant, tool: str, args: list[str]) -> list[dict]:
    """One run of the benchmark under ``v``'s knobs: its jsonl rows. RuntimeError with the
    run's last stderr lines when it fails."""
    cmd = [sys.executable, "-c", child_code(v, tool), *args, "-o", "jsonl"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        tail = "\n".join(p.stderr.strip().splitlines()[-8:])
        raise RuntimeError(f"variant {v.name!r} failed (exit {p.returncode}):\n{tail}")
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="knob_ab", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--variant", action="append", required=True, metavar="NAME[:MOD.ATTR=VALUE,...]",
                    help="a variant (repeat); no knobs: the code as it is")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of every variant, alternating (default 2)")
    ap.add_argument("--out", help="write every row (variant, round, the benchmark's row) as JSON here")
    ap.add_argument("--code", action="store_true",
                    help="print the one --variant's python -c program for the tool and stop (to run it under "
                         "a profiler: python -c \"$(knob_ab.py --code --variant V bench)\" ARGS...)")
    ap.add_argument("tool", choices=sorted(_TOOLS), help="which benchmark")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's arguments")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error("--rounds must be >= 1")
    if "-o" in a.args or "--output" in a.args:
        ap.error("leave -o/--output out: knob_ab reads the benchmark's jsonl rows itself")
    try:
        variants = [parse_variant(t) for t in a.variant]
    except ValueError as e:
        ap.error(str(e))
    if len({v.name for v in variants}) != len(variants):
        ap.error("variant names must differ")
    if a.code:
        if len(variants) != 1:
            ap.error("--code prints one variant's program")
        print(child_code(variants[0], a.tool))
        return 0
    keys = _SHOW[a.tool]
    got: list[dict] = []
    for r in range(a.rounds):
        for v in variants:
            print(f"round {r + 1}/{a.rounds}: {v.name} ...", file=sys.stderr, flush=True)
            try:
                rows = run_once(v, a.tool, a.args)
            except RuntimeError as e:
                print(e, file=sys.stderr)
                return 1
            got += [dict(variant=v.name, round=r + 1, row=row) for row in rows]
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(tool=a.tool, args=a.args, variants=[dict(name=v.name, knobs=[list(k) for k in v.knobs])
                                                                for v in variants], rows=got), f, indent=1)
    print(f"{'variant':16s} {'row':>4s} " + " ".join(f"{k:>26s}" for k in keys))
    for v in variants:
        per_round = [[g["row"] for g in got if g["variant"] == v.name and g["round"] == r + 1]
                     for r in range(a.rounds)]
        for i in range(max(len(rows) for rows in per_round)):
            cells = []
            for k in keys:   # median over rounds, then each round's value
                xs = [rows[i][k] for rows in per_round if i < len(rows) and isinstance(rows[i].get(k), (int, float))]
                med = statistics.median(xs) if xs else float("nan")
                cells.append(f"{med:.1f} ({'/'.join(f'{x:.0f}' for x in xs)})".rjust(26))
            print(f"{v.name:16s} {i:4d} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
