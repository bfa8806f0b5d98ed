"""Measure the prefill / decode / decode-tc crossover on this GPU (is a tensor-core prefill-style kernel faster than a CUDA-core decode kernel at decode?).

For D=128 f16 K/V, 8 KV heads, GQA ratios {1, 2, 4, 8}, query tokens per stream n_batch in
{1, 2, 3, 4, 6, 8, 12, 16, 32}, n_kv {4096, 32768} (no mask, one stream), times each kernel
through cuda_backend.flash_attn_ext_device and prints, per (gqa, n_kv), the winner for each
n_batch, then the dispatch constants that follow from it. Writes the raw rows as JSON.

Usage: python tools/dev/gpu_crossover.py [--out FILE] [--quick]
"""
from __future__ import annotations

import argparse
import json
import math

from gpu_bench import _desc
from gpu_timing import device_us

HKV, D = 8, 128
KERNELS = ("prefill", "decode", "decode-tc")


def measure(gqa, n_batch, n_kv, reps):
    import torch
    from ggml_attn import cuda_backend as cb
    from ggml_attn.dtypes import GGML_TYPE_F16, GGML_TYPE_F32
    H = HKV * gqa
    q = torch.rand((1, H, n_batch, D), device="cuda") * 2 - 1
    k = (torch.rand((1, HKV, n_kv, D), device="cuda") * 2 - 1).half()
    v = (torch.rand((1, HKV, n_kv, D), device="cuda") * 2 - 1).half()
    dst = torch.empty((1, n_batch, H, D), device="cuda")
    dq, dk, dv, dd = _desc(q, GGML_TYPE_F32), _desc(k, GGML_TYPE_F16), _desc(v, GGML_TYPE_F16), _desc(dst, GGML_TYPE_F32)
    st = torch.cuda.current_stream().cuda_stream
    out = {}
    for kern in KERNELS:
        fn = lambda: cb.flash_attn_ext_device(dq, dk, dv, None, None, dd, 1 / math.sqrt(D), kernel=kern, stream=st)
        out[kern] = device_us([fn], calls=reps, batches=5)[0]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    import torch
    batches = (1, 2, 3, 4, 6, 8, 12, 16, 32)
    rows = []
    for n_kv in (4096, 32768):
        for gqa in (1, 2, 4, 8):
            for nb in batches:
                t = measure(gqa, nb, n_kv, 3 if a.quick else 10)
                best = min(t, key=t.get)
                rows.append(dict(gqa=gqa, n_batch=nb, n_kv=n_kv, best=best, **{k: round(v, 2) for k, v in t.items()}))
            line = " ".join(f"{r['n_batch']}:{r['best'][:3]}" for r in rows if r["gqa"] == gqa and r["n_kv"] == n_kv)
            print(f"n_kv={n_kv:6d} gqa={gqa}: {line}", flush=True)
    # dispatch constants: per gqa bucket, the largest n_batch where a decode kernel wins at both n_kv
    limits = {}
    for gqa in (1, 2, 4, 8):
        lim = 0
        for nb in batches:
            if all(r["best"] != "prefill" for r in rows if r["gqa"] == gqa and r["n_batch"] == nb):
                lim = nb
            else:
                break
        limits[gqa] = lim
    tc_min = next((g for g in (1, 2, 4, 8) if all(
        r["decode-tc"] <= r["decode"] for r in rows if r["gqa"] == g and r["n_batch"] <= max(1, limits[g]))), 16)
    print(f"DECODE_MAX_BATCH = {limits}\n(the tensor-core decode wins from gqa {tc_min}: dispatch runs it "
          f"for every gqa when it is 1)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), d=D, n_head_kv=HKV, kv="f16", rows=rows,
                           decode_max_batch=limits, decode_tc_min_gqa=tc_min), f, indent=1)
    print(f"{'n_kv':>6} {'gqa':>3} {'nb':>3} " + " ".join(f"{k:>10}" for k in KERNELS) + "  best")
    for r in rows:
        print(f"{r['n_kv']:6d} {r['gqa']:3d} {r['n_batch']:3d} " + " ".join(f"{r[k]:10.1f}" for k in KERNELS) + f"  {r['best']}")


if __name__ == "__main__":
    main()
