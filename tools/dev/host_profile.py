"""Where the host time of a benchmark run goes: runs ``ggml-attn-bench``,
``ggml-attn-batched-bench`` or ``ggml-attn-serve-bench`` in this process under cProfile and prints the functions with the
most time of their own and the most time under them (the benchmark's own table first).

Usage: python tools/dev/host_profile.py [--top 30] [--out FILE.pstats] bench|batched-bench|serve-bench ARGS...
e.g.   python tools/dev/host_profile.py batched-bench -m llama-3-8b --layer full --prompt-dist 16-200 \\
           -npl 64 -ntg 32 -kvu -r 1
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from knob_ab import _TOOLS  # noqa: E402  (the benchmarks a dev script runs in-process, and their modules)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="host_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--top", type=int, default=30, help="rows per listing (default 30)")
    p.add_argument("--out", help="also write the raw profile here (pstats format)")
    p.add_argument("tool", choices=sorted(_TOOLS), help="which benchmark to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's arguments")
    a = p.parse_args(argv)
    import importlib
    mod = importlib.import_module(f"ggml_attn.cli.{_TOOLS[a.tool]}")
    prof = cProfile.Profile()
    prof.enable()
    try:
        rc = mod._main(a.args)
    finally:
        prof.disable()
    if a.out:
        prof.dump_stats(a.out)
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(a.top)
        print(f"== by {key}")
        print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[:20000])
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
