"""Static look at a compiled kernel, without a GPU: registers and spills (ptxas), and the SASS
instruction mix (nvdisasm) of one program -- a prediction's input when no device is lent.

    python tools/dev/sass_census.py wgmma:pp-persistent-qtma decode-tma:q8_0 decode-tma:q8_0-scratch
    python tools/dev/sass_census.py decode-tma:q8_0 --dump /tmp/q8.sass --top 40

PROGRAM: ``wgmma:<key>`` (wgmma_shape.WS_CONFIGS / WS_DIAG), ``decode-tma:<key>``
(decode_tma_shape.CONFIGS), ``mma:<dk>:<type>``, ``vec:<dk>:<type>`` (type f16, bf16, q8_0,
q4_0; d_v = d_k), compiled for sm_90a (the Hopper ones) or sm_90. nvdisasm: ``$NVDISASM``, else
on PATH (pip's nvidia-cuda-nvdisasm wheel has one: nvidia/cu13/bin/nvdisasm). Counts are
static (each instruction once, loops not unrolled by their trip counts): compare programs, or
find a loop's body with ``--dump``.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

TYPES = {"f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2}


def variant_of(spec: str):
    """(Variant, arch) of a PROGRAM spec."""
    from ggml_attn import decode_tma_shape as dt
    from ggml_attn import kernels as K
    from ggml_attn import wgmma_shape as ws
    fam, _, rest = spec.partition(":")
    if fam == "wgmma":
        c = ws.WS_CONFIGS.get(rest) or ws.WS_DIAG.get(rest)
        if c is None:
            raise SystemExit(f"no wgmma configuration {rest!r}: {', '.join([*ws.WS_CONFIGS, *ws.WS_DIAG])}")
        return K.wgmma_variant(c.name), K.HOPPER_ARCH
    if fam == "decode-tma":
        if rest not in dt.CONFIGS:
            raise SystemExit(f"no decode-tma configuration {rest!r}: {', '.join(dt.CONFIGS)}")
        return K.decode_tma_variant(dt.CONFIGS[rest].name), K.HOPPER_ARCH
    if fam in ("mma", "vec"):
        d, _, t = rest.partition(":")
        make = K.mma_variant if fam == "mma" else K.vec_variant
        return make(int(d), int(d), TYPES[t or "f16"]), "sm_90"
    raise SystemExit(f"unknown program {spec!r} (wgmma:KEY, decode-tma:KEY, mma:D:TYPE, vec:D:TYPE)")


def nvdisasm() -> str:
    path = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    if not path:
        raise SystemExit("nvdisasm not found: set $NVDISASM or put it on PATH "
                         "(pip download --no-deps nvidia-cuda-nvdisasm; it is in nvidia/cu13/bin)")
    return path


def census(sass: str) -> collections.Counter:
    """Opcode (without modifiers) -> count, over every instruction line of nvdisasm's output."""
    ops = collections.Counter()
    for m in re.finditer(r"^\s*(?:/\*[0-9a-f]+\*/)?\s*(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[.\s]", sass, re.M):
        ops[m.group(1)] += 1
    return ops


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("programs", nargs="+", metavar="PROGRAM")
    ap.add_argument("--top", type=int, default=25, help="opcodes shown per program (default 25)")
    ap.add_argument("--dump", help="write the (last) program's SASS here")
    a = ap.parse_args(argv)
    from ggml_attn import kernels as K
    tool = nvdisasm()
    rows = []
    for spec in a.programs:
        v, arch = variant_of(spec)
        c = K.compile_variant(v, arch, use_disk_cache=False, extra_options=("-Xptxas=-v",))
        usage = K.resource_usage(c.log)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(c.cubin)
            f.flush()
            sass = subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout
        if a.dump:
            with open(a.dump, "w") as out:
                out.write(sass)
        ops = census(sass)
        u = next(iter(usage.values()), {})
        rows.append((spec, ops))
        print(f"== {spec} ({v.names[0]}, {arch}): {sum(ops.values())} instructions, "
              f"{u.get('registers', '?')} registers, {u.get('spill_stores', '?')} bytes spilled")
        print("   " + ", ".join(f"{op} {n}" for op, n in ops.most_common(a.top)))
    if len(rows) > 1:   # side by side: the union of the top opcodes
        keys = [op for op, _ in sum((r[1] for r in rows), collections.Counter()).most_common(a.top)]
        print("\n" + f"{'opcode':12s}" + "".join(f"{s[:22]:>24s}" for s, _ in rows))
        for op in keys:
            print(f"{op:12s}" + "".join(f"{r[1][op]:24d}" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
