"""Where a step of dense_gemm_qr (cuda/dense_q.cu) goes, on the GPU: one llama-3-8B layer's seven
block matrices at each token count, through the shipped program and through its probes (the
program compiled with -DQR_PROBE=n: 1 the products without the decode, 2 the decode without the
products, 3 the staging alone, 4 without the x tile's ldmatrix, 5 the MMAs and the staging alone), device time per matrix (gpu_timing.device_us).

If the products alone take most of the shipped time, the tensor pipe under mma.sync bounds the
kernel; if the decode alone does, the decode's instructions; if neither, their overlap.

    python tools/dev/qr_probe.py [--types Q4_K,Q6_K] [--tokens 64,16] [--out qr_probe.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])

PROBES = {0: "shipped", 1: "no decode", 2: "decode only", 3: "staging only", 4: "no ldmatrix", 5: "mma only"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="Q4_K,Q6_K")
    ap.add_argument("--tokens", default="64,16")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import cupy as cp
    from gpu_dense_q_bench import N_EMBD, N_FF, _layer
    from gpu_timing import device_us

    from ggml_attn import kernels as K
    from ggml_attn.cuda_device import num_sms
    from ggml_attn.graph.xp_matmul import gemm_q_launch
    shipped = K.dense_q_variant
    rows = []
    for type_name in a.types.split(","):
        ws = _layer(cp, type_name, 0)
        for n in (int(t) for t in a.tokens.split(",")):
            x16 = cp.random.standard_normal((n, N_EMBD), dtype=cp.float32).astype(cp.float16)
            xf16 = cp.random.standard_normal((n, N_FF), dtype=cp.float32).astype(cp.float16)
            for probe, what in PROBES.items():
                K.dense_q_variant = (shipped if probe == 0 else
                                     lambda tid, pr=probe: dataclasses.replace(shipped(tid), options=(f"-DQR_PROBE={pr}",)))
                layer = 0.0
                for name, w in ws.items():
                    grid, _ = K.gemm_q_grid(w.shape[0], n, w.shape[1], num_sms(), "dense_gemm_qr")
                    x = xf16 if name == "wd" else x16
                    out = cp.empty((n, w.shape[0]), cp.float32)
                    part = cp.empty((grid[2], n, w.shape[0]), cp.float32) if grid[2] > 1 else None
                    f = gemm_q_launch(w, x, out, part, kernel="dense_gemm_qr")
                    us = device_us([f])
                    layer += us
                    rows.append(dict(type=type_name, tokens=n, probe=probe, what=what, matrix=name, us=round(us, 2)))
                print(f"{type_name} n_tok={n:3d} {what:14s} layer {layer:7.1f} us  " +
                      " ".join(f"{r['matrix']} {r['us']:.1f}" for r in rows[-7:]), flush=True)
    K.dense_q_variant = shipped
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
