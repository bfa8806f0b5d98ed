"""Static look at a compiled kernel, without a GPU: registers and spills (ptxas), and the SASS
instruction mix (nvdisasm) of one program -- a prediction's input when no device is lent.

    python tools/dev/sass_census.py wgmma:pp-persistent-qtma decode-tma:q8_0 decode-tma:q8_0-scratch
    python tools/dev/sass_census.py decode-tma:q8_0 --dump /tmp/q8.sass --top 40
    python tools/dev/sass_census.py dense-q:Q4_K --loops dense_gemv_qILi12ELi1E [--skip 0xde0-0xfa0,...]

PROGRAM: ``wgmma:<key>`` (wgmma_shape.WS_CONFIGS / WS_DIAG), ``decode-tma:<key>``
(decode_tma_shape.CONFIGS), ``mma:<dk>:<type>``, ``vec:<dk>:<type>`` (type f16, bf16, q8_0,
q4_0; head_dim_v = head_dim_k), ``dense-q:<block type>`` (cuda/dense_q.cu: Q4_0 ... Q6_K), ``dense-q8x:<type>``
(cuda/dense_q8x.cu), ``dense-qw:<block type>`` (cuda/dense_qw.cu), compiled for sm_90a
(the Hopper ones) or sm_90. nvdisasm: ``$NVDISASM``, else
on PATH (pip's nvidia-cuda-nvdisasm wheel has one: nvidia/cu13/bin/nvdisasm). Counts are
static (each instruction once, loops not unrolled by their trip counts): compare programs, or
find a loop's body with ``--dump``, or count each loop of the functions whose mangled names
contain ``--loops`` (the ranges closed by a backward branch: a loop iteration's instructions;
``--skip`` leaves address ranges out, e.g. a fallback not taken in the steady state).
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
    if fam in ("dense-q", "dense-q8x", "dense-qw"):
        from ggml_attn.block_types import block_layout
        make = {"dense-q": K.dense_q_variant, "dense-q8x": K.dense_q8x_variant, "dense-qw": K.dense_qw_variant}[fam]
        return make(block_layout(rest).type_id), K.HOPPER_ARCH if fam == "dense-qw" else "sm_90"
    if fam in ("mma", "vec"):
        d, _, t = rest.partition(":")
        make = K.mma_variant if fam == "mma" else K.vec_variant
        return make(int(d), int(d), TYPES[t or "f16"]), "sm_90"
    raise SystemExit(f"unknown program {spec!r} (wgmma:KEY, decode-tma:KEY, mma:D:TYPE, vec:D:TYPE, dense-q:TYPE, "
                     "dense-q8x:TYPE, dense-qw:TYPE)")


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


_INS = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")


def loops(sass: str, function: str, skip=()) -> list[tuple[str, int, int, collections.Counter]]:
    """(function, start, end, opcode census) of each loop of the functions of nvdisasm's output
    whose names contain ``function``: the address ranges from a branch's target label back to
    the branch, ``skip`` ranges (start, end) left out of the counts."""
    out, name, ins, labels, pending = [], None, [], {}, []

    def close():
        for a, text in ins:
            m = re.search(r"BRA\S*\s+`\((\.L_x_\d+)\)", text)
            lo = labels.get(m.group(1)) if m else None
            if lo is not None and lo <= a:
                body = "\n".join(t for b, t in ins if lo <= b <= a and not any(s <= b <= e for s, e in skip))
                out.append((name, lo, a, census(body)))
    for line in sass.splitlines():
        m = re.match(r"^\.text\.(\S+):", line)
        if m:
            if name is not None and function in name:
                close()
            name, ins, labels, pending = m.group(1), [], {}, []
            continue
        m = re.match(r"^\s*(\.L_x_\d+):", line)
        if m:
            pending.append(m.group(1))
            continue
        m = _INS.match(line)
        if m and name is not None:
            a = int(m.group(1), 16)
            labels.update((lab, a) for lab in pending)
            pending = []
            ins.append((a, m.group(2)))
    if name is not None and function in name:
        close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("programs", nargs="+", metavar="PROGRAM")
    ap.add_argument("--top", type=int, default=25, help="opcodes shown per program (default 25)")
    ap.add_argument("--dump", help="write the (last) program's SASS here")
    ap.add_argument("--loops", metavar="NAME", help="count each loop of the functions whose mangled names contain NAME")
    ap.add_argument("--skip", default="", help="with --loops: address ranges left out, 0xA-0xB,...")
    a = ap.parse_args(argv)
    skip = [tuple(int(x, 16) for x in r.split("-")) for r in a.skip.split(",") if r]
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
        for fn, uf in usage.items() if a.loops else ():   # the --loops functions' own registers
            if a.loops in fn:
                print(f"   {fn}: {uf.get('registers', '?')} registers, {uf.get('spill_stores', '?')} bytes spilled")
        for fn, lo, hi, c in loops(sass, a.loops, skip) if a.loops else ():
            print(f"   loop {lo:#06x}-{hi:#06x} of {fn}: {sum(c.values())} "
                  f"({', '.join(f'{op} {n}' for op, n in c.most_common(a.top))})")
    if len(rows) > 1:   # side by side: the union of the top opcodes
        keys = [op for op, _ in sum((r[1] for r in rows), collections.Counter()).most_common(a.top)]
        print("\n" + f"{'opcode':12s}" + "".join(f"{s[:22]:>24s}" for s, _ in rows))
        for op in keys:
            print(f"{op:12s}" + "".join(f"{r[1][op]:24d}" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
