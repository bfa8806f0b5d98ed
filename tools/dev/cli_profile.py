"""Where a CLI run's wall time goes on the host: one ``ggml-attn-*`` command run in this process
under cProfile, its imports included (the CLI's module is imported inside the profile).

    python tools/dev/cli_profile.py [--out DIR] [--top N] -- batched-bench --device cuda -m F.gguf -c 512 -npp 8 -ntg 1 -npl 1

Writes ``DIR/cli.prof`` (pstats; ``python -m pstats DIR/cli.prof``) and ``DIR/cli_profile.txt``:
the wall time, the process's age when the CLI returned, and the top ``N`` functions by
cumulative and by own time. The command is the console script's name without ``ggml-attn-``
(``bench``, ``batched-bench``, ``serve-bench``) and its arguments. The load row of the
side-by-side script (``llamacpp_side_by_side.py``) is the command above with the kernel cache
warm: run it once first.
"""
from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import os
import pstats
import sys
import time

CLIS = {"bench": "ggml_attn.cli.bench", "batched-bench": "ggml_attn.cli.batched_bench",
        "serve-bench": "ggml_attn.cli.serve_bench"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".", help="folder for cli.prof and cli_profile.txt (default: .)")
    ap.add_argument("--top", type=int, default=60, help="functions listed per order (default: 60)")
    ap.add_argument("cli", choices=sorted(CLIS), help="the console script without its ggml-attn- prefix")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    argv0, sys.argv = sys.argv, [f"ggml-attn-{a.cli}", *a.args]
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    rc = 0
    prof.enable()
    try:
        rc = importlib.import_module(CLIS[a.cli]).main(list(a.args))   # (argv given: no SIGINT handler left behind)
    except SystemExit as e:   # (argparse's errors and --help)
        rc = e.code if isinstance(e.code, int) else 1
    finally:
        prof.disable()
        sys.argv = argv0
    wall = time.perf_counter() - t0
    prof.dump_stats(os.path.join(a.out, "cli.prof"))
    from ggml_attn.cli.verbose import process_seconds
    age = process_seconds()
    text = io.StringIO()
    text.write(f"ggml-attn-{a.cli} {' '.join(a.args)}\nrc {rc}, {wall:.3f} s in the CLI, process age at return "
               f"{'?' if age is None else f'{age:.2f}'} s\n")
    for order in ("cumulative", "tottime"):
        text.write(f"\n== top {a.top} by {order}\n")
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(a.top)
    with open(os.path.join(a.out, "cli_profile.txt"), "w") as f:
        f.write(text.getvalue())
    print(text.getvalue().split("\n== top")[0], flush=True)
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
