"""Instruction census of a compiled kernel program, no GPU needed: NVRTC compiles the variant
(ggml_attn.kernels), cuobjdump disassembles it, and each function's loops (the ranges closed
by a backward branch) are counted by opcode -- the CPU-side half of a kernel change (issue
#48's "SASS census"): instructions a loop iteration issues against the bytes it brings in.

    python tools/dev/sass_census.py "K.dense_q_variant(12)" --function dense_gemv_qILi12ELi1E
    python tools/dev/sass_census.py "K.decode_tma_variant(dt.CONFIGS['q8_0'].name)" --arch sm_90
    [--cuobjdump PATH] [--top 14] [--skip 0xde0-0xfa0,...]

``--skip`` leaves address ranges out of a loop's count (a branch not taken in the steady
state, e.g. an unaligned fallback). cuobjdump: ``--cuobjdump``, else on PATH, else the one in
Triton's wheel (``triton/backends/nvidia/bin``: ``pip download --no-deps triton``, unzip).
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

_INS = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")
_FN = re.compile(r"^\s+Function : (\S+)")
_BRA = re.compile(r"BRA(?:\.\S+)?\s+(?:`\(\S+\)\s*)?0x([0-9a-f]+)")


def find_cuobjdump(given: str = "") -> str:
    for c in [given, shutil.which("cuobjdump") or "",
              *glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages", "triton", "backends",
                                      "nvidia", "bin", "cuobjdump")),
              *glob.glob("/tmp/*/triton/backends/nvidia/bin/cuobjdump")]:
        if c and os.path.exists(c):
            return c
    raise SystemExit("no cuobjdump: give --cuobjdump (Triton's wheel carries one: triton/backends/nvidia/bin)")


def opcode(text: str) -> str:
    """The opcode's base name of one SASS instruction (predicate and modifiers dropped)."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    """{mangled name: [(address, instruction text)]} of cuobjdump -sass output."""
    out: dict[str, list] = {}
    cur = None
    for line in sass.splitlines():
        m = _FN.match(line)
        if m:
            cur = out.setdefault(m.group(1), [])
            continue
        m = _INS.match(line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def loops(ins: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(start, end) address ranges closed by a backward branch, innermost last among nested."""
    out = []
    for a, t in ins:
        m = _BRA.search(t)
        if m and int(m.group(1), 16) <= a:
            out.append((int(m.group(1), 16), a))
    return sorted(out, key=lambda r: (r[0], -r[1]))


def census(ins, lo: int, hi: int, skip=()) -> collections.Counter:
    return collections.Counter(opcode(t) for a, t in ins
                               if lo <= a <= hi and not any(s <= a <= e for s, e in skip))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variant", help='a Python expression of ggml_attn.kernels (K) / decode_tma_shape (dt) / '
                                    'wgmma_shape (ws) giving a Variant, e.g. "K.dense_q_variant(12)"')
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--function", default="", help="substring of the mangled names to report")
    ap.add_argument("--cuobjdump", default="")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--skip", default="", help="address ranges left out of loop counts: 0xA-0xB,...")
    a = ap.parse_args(argv)
    from ggml_attn import decode_tma_shape as dt  # noqa: F401  (for the expression)
    from ggml_attn import kernels as K
    from ggml_attn import wgmma_shape as ws  # noqa: F401
    variant = eval(a.variant, {"K": K, "dt": dt, "ws": ws})   # noqa: S307 - a developer's own expression
    comp = K.compile_variant(variant, a.arch + variant.arch_suffix, use_disk_cache=False)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(comp.cubin)
        f.flush()
        sass = subprocess.run([find_cuobjdump(a.cuobjdump), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    skip = [tuple(int(x, 16) for x in r.split("-")) for r in a.skip.split(",") if r]
    for name, ins in functions(sass).items():
        if a.function not in name:
            continue
        print(f"{name}: {len(ins)} instructions")
        for lo, hi in loops(ins):
            c = census(ins, lo, hi, skip)
            top = ", ".join(f"{k} {n}" for k, n in c.most_common(a.top))
            print(f"  loop {lo:#06x}-{hi:#06x}: {sum(c.values())} ({top})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
