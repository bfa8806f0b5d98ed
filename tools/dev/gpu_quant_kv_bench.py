"""q8_0 / q4_0 K/V against f16 K/V on the GPU: device time per call (issue #32's rows), 32 q / 8
KV heads, D 128, K/V laid out as a cache's views (cells outer, each cell's heads packed in its
row), decode K/V rotated over copies larger than L2.

    python tools/dev/gpu_quant_kv_bench.py [--out OUT.json] [--quick]

Decode rows per (B, n_kv), no mask: f16 with ``auto`` (the baseline), q8_0 / q4_0 with ``auto``
(the sm_90a decode reading the blocks on an H200) and on the CUDA-core ``decode`` kernel; each
with its K/V bytes and the bandwidth they make, and the ratio to f16 ``auto`` (the issue's
targets: q8_0 <= 0.58 and q4_0 <= 0.35 at B=1 32k; q8_0 <= 0.58 at B=64 32k). Prefill rows: one
causal prompt of 8192 tokens through a plan, f16 against q8_0 / q4_0 (f16 copies made per call,
then the same kernel; target q8_0 <= 1.15).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

H, HKV, D = 32, 8, 128
DECODE = [(1, 4096), (1, 32768), (16, 4096), (64, 32768)]
PREFILL = [8192]


def cache_kv(host_rows, t, n_kv):
    """Device K or V of type ``t`` from host rows (B, n_kv, HKV, D) float32: a cache's layout
    (B, n_kv, HKV * row) on the GPU, and its ggml view [D, n_kv, HKV, B] (TensorDesc)."""
    import cupy as cp

    from ggml_attn.dtypes import GGML_TYPE_F16
    from ggml_attn.quant import quantize
    from ggml_attn.tensor import TensorDesc
    B = host_rows.shape[0]
    if t == GGML_TYPE_F16:
        blocks = host_rows.astype(np.float16).view(np.uint8)        # (B, n_kv, HKV, 2 D)
        elem, per_row = 2, 2 * D
    else:
        blocks = quantize(host_rows, t)                               # (B, n_kv, HKV, row)
        per_row = blocks.shape[-1]
        elem = per_row // (D // 32)
    dev = cp.asarray(np.ascontiguousarray(blocks).reshape(B, n_kv, HKV * per_row))
    nb1 = HKV * per_row
    return dev, TensorDesc(int(dev.data.ptr), t, (D, n_kv, HKV, B), (elem, nb1, per_row, nb1 * n_kv))


def decode_rows(device_us, log, cases) -> list[dict]:
    import cupy as cp

    from ggml_attn import cuda_backend as cb
    from ggml_attn.dtypes import GGML_TYPE_F16, GGML_TYPE_Q4_0, GGML_TYPE_Q8_0
    from ggml_attn.reference import nmse
    from ggml_attn.tensor import from_array
    from gpu_timing import copies_for
    rows = []
    rng = np.random.default_rng(0)
    for B, n_kv in cases:
        q = cp.asarray(rng.standard_normal((B, H, 1, D), dtype=np.float32))
        dst = cp.empty((B, 1, H, D), cp.float32)
        base = rng.standard_normal((B, n_kv, HKV, D), dtype=np.float32) * 0.5
        ref = None
        case = f"decode B={B} kv={n_kv}"
        for name, t, kernel in (("f16", GGML_TYPE_F16, "auto"), ("q8_0", GGML_TYPE_Q8_0, "auto"),
                                ("q8_0", GGML_TYPE_Q8_0, "decode"), ("q4_0", GGML_TYPE_Q4_0, "auto"),
                                ("q4_0", GGML_TYPE_Q4_0, "decode")):
            kvs = [(cache_kv(base, t, n_kv), cache_kv(base, t, n_kv))]   # K and V: their own bytes
            nbytes = int(kvs[0][0][0].nbytes)
            kvs += [(cache_kv(base, t, n_kv), cache_kv(base, t, n_kv)) for _ in range(copies_for(2 * nbytes) - 1)]
            qd, od = from_array(q), from_array(dst)
            calls = [cb.bind(qd, kd, vd, None, None, od, 1.0 / np.sqrt(D), kernel=kernel) for (_, kd), (_, vd) in kvs]
            fns = [c.launch for c in calls]
            us = device_us(fns)[0]
            calls[0].launch()
            out = dst.get()
            ref = out if ref is None else ref
            rows.append(dict(case=case, kv=name, kernel=calls[0].kern, us=round(us, 2), kv_bytes=2 * nbytes,
                             tb_s=round(2 * nbytes / us / 1e6, 2), nmse_vs_f16=float(nmse(out, ref))))
            del kvs, calls, fns
            cp.get_default_memory_pool().free_all_blocks()
        _ratios(rows, case, log)
    return rows


def prefill_rows(device_us, log, sizes) -> list[dict]:
    import cupy as cp

    from ggml_attn import cuda_backend as cb
    from ggml_attn.conformance import block_causal_mask
    from ggml_attn.dtypes import GGML_TYPE_F16, GGML_TYPE_Q4_0, GGML_TYPE_Q8_0
    from ggml_attn.reference import nmse
    from ggml_attn.tensor import from_array
    rows = []
    rng = np.random.default_rng(1)
    for n in sizes:
        q = cp.asarray(rng.standard_normal((1, H, n, D), dtype=np.float32))
        dst = cp.empty((1, n, H, D), cp.float32)
        base = rng.standard_normal((1, n, HKV, D), dtype=np.float32) * 0.5
        dm = cp.asarray(block_causal_mask([n], n))
        tm = from_array(dm)
        st = cp.cuda.get_current_stream().ptr
        ref = None
        case = f"prefill N={n} causal"
        for name, t in (("f16", GGML_TYPE_F16), ("q8_0", GGML_TYPE_Q8_0), ("q4_0", GGML_TYPE_Q4_0)):
            (dev, kd), (dev_v, vd) = cache_kv(base, t, n), cache_kv(base, t, n)
            plan = cb.make_plan(tm, n, H, HKV, d_k=D, kv_type=t, stream=st)
            call = cb.bind(from_array(q), kd, vd, tm, None, from_array(dst), 1.0 / np.sqrt(D), plan=plan, stream=st)
            us = device_us([call.launch], calls=10)[0]
            call.launch()
            out = dst.get()
            ref = out if ref is None else ref
            rows.append(dict(case=case, kv=name, kernel=call.kern, us=round(us, 2), kv_bytes=2 * int(dev.nbytes),
                             f16_copies=len(call._pre) == 2, nmse_vs_f16=float(nmse(out, ref))))
            del call, plan, dev, dev_v
            cp.get_default_memory_pool().free_all_blocks()
        _ratios(rows, case, log)
    return rows


def _ratios(rows, case, log):
    """Each row of ``case`` against its f16 row (the first), logged."""
    mine = [r for r in rows if r["case"] == case]
    for r in mine:
        r["vs_f16"] = round(r["us"] / mine[0]["us"], 3)
        bw = f"{r['tb_s']:5.2f} TB/s" if "tb_s" in r else ""
        log(f"{case:24s} {r['kv']:5s} {r['kernel']:13s} {r['us']:9.2f} us {bw} x{r['vs_f16']:.3f} "
            f"nmse/f16 {r['nmse_vs_f16']:.2g}")


def run(device_us, log=print, quick=False) -> list[dict]:
    return decode_rows(device_us, log, DECODE[:2] if quick else DECODE) + \
        prefill_rows(device_us, log, [2048] if quick else PREFILL)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--quick", action="store_true", help="two decode rows and a 2048-token prompt")
    a = ap.parse_args(argv)
    from gpu_timing import device_us
    rows = run(device_us, quick=a.quick)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
