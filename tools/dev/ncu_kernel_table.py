"""Where a run's device time goes, kernel by kernel: reads the CSV of
``ncu --csv --metrics gpu__time_duration.sum ...`` (one row a launch) and prints each kernel
name's launches, total and mean duration and share of the total, largest first.

    ncu --csv --cache-control none --clock-control none --metrics gpu__time_duration.sum \\
        ggml-attn-bench --device cuda -m F.gguf -p 0 -n 8 -r 1 > step.csv
    python tools/dev/ncu_kernel_table.py step.csv [--per N] [--json OUT.json]

``--per N``: also each kernel's time per N-th of the run (e.g. the tokens it generated).
Template arguments are kept in the name (instances stay apart); ncu's "(a, b, c)x(d, e, f)"
launch dimensions are not part of it.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import sys


def read_rows(text: str) -> list[tuple[str, float]]:
    """(kernel name, duration in us) of each launch in ncu's CSV (its banner lines skipped)."""
    start = text.find('"ID"')
    if start < 0:
        raise SystemExit("no ncu CSV table in the input (expected a header row starting with \"ID\")")
    out = []
    for r in csv.DictReader(io.StringIO(text[start:])):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit, value = r.get("Metric Unit", ""), float(r["Metric Value"].replace(",", ""))
        scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}.get(unit)
        if scale is None:
            raise SystemExit(f"unknown duration unit {unit!r}")
        out.append((r["Kernel Name"], value * scale))
    return out


def table(rows: list[tuple[str, float]]) -> list[dict]:
    """One entry a kernel name: launches, total and mean us, share of the whole; largest first."""
    agg: dict[str, list[float]] = {}
    for name, us in rows:
        agg.setdefault(name, []).append(us)
    total = sum(us for _, us in rows) or 1.0
    out = [dict(kernel=k, launches=len(v), total_us=round(sum(v), 2), mean_us=round(sum(v) / len(v), 3),
                share=round(sum(v) / total, 4)) for k, v in agg.items()]
    return sorted(out, key=lambda e: -e["total_us"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu --csv output (- for standard input)")
    ap.add_argument("--per", type=float, default=None, help="also the time per N-th of the run (e.g. tokens)")
    ap.add_argument("--json", default=None, help="write the table as JSON here")
    ap.add_argument("--top", type=int, default=40, help="rows to print (default 40)")
    a = ap.parse_args(argv)
    text = sys.stdin.read() if a.csv == "-" else open(a.csv, encoding="utf-8", errors="replace").read()
    t = table(read_rows(text))
    total = sum(e["total_us"] for e in t)
    print(f"{sum(e['launches'] for e in t)} launches, {total:.1f} us" +
          (f", {total / a.per:.1f} us per 1/{a.per:g}" if a.per else ""))
    for e in t[:a.top]:
        per = f" {e['total_us'] / a.per:9.2f} us/per" if a.per else ""
        print(f"{e['share'] * 100:5.1f}% {e['total_us']:11.1f} us {e['launches']:6d} x {e['mean_us']:8.2f} us{per}  {e['kernel'][:150]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(total_us=round(total, 2), per=a.per, kernels=t), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
