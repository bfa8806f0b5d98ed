"""Where a step of dense_gemm_qr / dense_gemm_qrm (cuda/dense_q.cu) or of a dense_gemm_qw form
(cuda/dense_qw.cu, --kernel) goes, on the GPU: one llama-3-8B layer's seven block matrices at each
token count, through the shipped program and through its probes -- the program compiled with
-DQR_PROBE=n (dense_gemm_qr / qrm: 1 the products without the decode, 2 the decode without the
products, 3 the staging alone, 4 without the x tile's ldmatrix, 5 the MMAs and the staging alone)
or -DQW_PROBE=n (dense_gemm_qw: 1, 2 and 3 the same) -- device time per matrix
(gpu_timing.device_us). --define compiles more macros into every program of a run (QW_GROUP,
QR_STAGGER, QW_STAGGER: A/B forms of the source) and checks probe 0's bits against the shipped
program's.

If the products alone take most of the shipped time, the tensor pipe under mma.sync bounds the
kernel; if the decode alone does, the decode's instructions; if neither, their overlap.

    python tools/dev/qr_probe.py [--kernel dense_gemm_qr] [--types Q4_K,Q6_K] [--tokens 64,16] [--out qr_probe.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

sys.path.insert(0, __file__.rsplit("/", 1)[0])


def _compile(job):
    """(a worker process) one probe program's shard into the kernel cache"""
    from ggml_attn import kernels as K
    K.compile_variant(*job)


def _shards(K, make, kernel: str, type_ids, tokens) -> list:
    """The programs (shards) the timed launches load: ``make`` (a probe's variant maker) of each type,
    the shard holding each instance ``kernel`` launches."""
    out = set()
    for tid in type_ids:
        v = make(tid)
        if kernel in K.GEMMQR_KERNELS:
            names = {K.staged_instance(kernel, tid, K.gemm_qs_bn(n, kernel)) for n in tokens}
        else:
            names = {K.qw_instance(tid, kernel)}
        out |= {v.shard_of(n) for n in names}
    return sorted(out, key=lambda v: v.label)


PROBES = {0: "shipped", 1: "no decode", 2: "decode only", 3: "staging only", 4: "no ldmatrix", 5: "mma only"}
QW_PROBES = (0, 1, 2, 3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", default="dense_gemm_qr",
                    help="dense_gemm_qr, dense_gemm_qrm or a form of dense_gemm_qw")
    ap.add_argument("--types", default="Q4_K,Q6_K")
    ap.add_argument("--tokens", default="64,16")
    ap.add_argument("--probes", default=None, help="comma list of probe numbers (default: every one)")
    ap.add_argument("--define", action="append", default=[],
                    help="NAME=VALUE compiled into every program timed here (e.g. QW_GROUP=2); probe 0's outputs are "
                         "then checked bit for bit against the shipped program's")
    ap.add_argument("--compile-only", action="store_true", help="compile the programs into the kernel cache and stop")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import cupy as cp
    from gpu_dense_q_bench import N_EMBD, N_FF, _layer
    from gpu_timing import device_us

    from ggml_attn import kernels as K
    from ggml_attn.block_types import block_layout
    from ggml_attn.cuda_device import num_sms
    from ggml_attn.graph.xp_matmul import gemm_q_launch
    qw = a.kernel in K.GEMMQW_FORMS
    attr, macro = {"dense_gemm_qr": ("dense_q_variant", "QR_PROBE"),
                   "dense_gemm_qrm": ("dense_qrm_variant", "QR_PROBE")}.get(a.kernel, ("dense_qw_variant", "QW_PROBE"))
    shipped = getattr(K, attr)
    probes = [p for p in PROBES if (not qw or p in QW_PROBES) and
              (a.probes is None or str(p) in a.probes.split(","))]
    defines = tuple(f"-D{d}" for d in a.define)

    def maker(probe):
        opts = defines + ((f"-D{macro}={probe}",) if probe else ())
        return shipped if not opts else lambda tid: dataclasses.replace(shipped(tid), options=opts)
    tokens = [int(t) for t in a.tokens.split(",")]
    tids = [block_layout(t).type_id for t in a.types.split(",")]
    arch = K.device_arch() + ("a" if qw else "")
    makers = [maker(p) for p in probes] + ([shipped] if defines else [])
    jobs = [(v, arch) for m in makers for v in _shards(K, m, a.kernel, tids, tokens)]
    with ProcessPoolExecutor(min(len(jobs), os.cpu_count() or 1), mp_context=get_context("spawn")) as ex:
        list(ex.map(_compile, jobs))   # (every program compiled at once; the timing loads them)
    if a.compile_only:
        return 0
    rows = []
    for type_name in a.types.split(","):
        ws = _layer(cp, type_name, 0)
        for n in tokens:
            x16 = cp.random.standard_normal((n, N_EMBD), dtype=cp.float32).astype(cp.float16)
            xf16 = cp.random.standard_normal((n, N_FF), dtype=cp.float32).astype(cp.float16)
            for probe in probes:
                what = PROBES[probe]
                setattr(K, attr, maker(probe))
                layer, same = 0.0, True
                for name, w in ws.items():
                    grid, _ = K.gemm_q_grid(w.shape[0], n, w.shape[1], num_sms(), a.kernel)
                    x = xf16 if name == "wd" else x16
                    out = cp.empty((n, w.shape[0]), cp.float32)
                    part = cp.empty((grid[2], n, w.shape[0]), cp.float32) if grid[2] > 1 else None
                    f = gemm_q_launch(w, x, out, part, kernel=a.kernel)
                    us = device_us([f])[0]   # (median, min, max)
                    if probe == 0 and defines:   # (the same bits as the shipped program's)
                        setattr(K, attr, shipped)
                        ref = cp.empty_like(out)
                        gemm_q_launch(w, x, ref, part, kernel=a.kernel)()
                        setattr(K, attr, maker(0))
                        same = same and bool((ref.view(cp.uint32) == out.view(cp.uint32)).all())
                    layer += us
                    rows.append(dict(kernel=a.kernel, type=type_name, tokens=n, probe=probe, what=what, matrix=name,
                                     defines=a.define, us=round(us, 2)))
                tag = f"{what} {' '.join(a.define)}".strip()
                check = "" if probe or not defines else \
                    ("  (bits as shipped)" if same else "  (BITS DIFFER from shipped)")
                print(f"{a.kernel} {type_name} n_tok={n:3d} {tag:24s} layer {layer:7.1f} us  " +
                      " ".join(f"{r['matrix']} {r['us']:.1f}" for r in rows[-7:]) + check, flush=True)
    setattr(K, attr, shipped)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
