"""The gated FFN's products of one llama-3-8B layer (gate and up, 14336 x 4096, then silu(gate) * up
and its F16 form), on the GPU, three ways per block type and token count, device time
(gpu_timing.device_us):

  qr    two dense_gemm_qr launches (each with its split sum where it splits) + dense_silu_mul
  qrm   the same with dense_gemm_qrm (matmul_dispatch.QRGEMM_ROWS 256)
  qrg   one dense_gemm_qrg launch (matmul_dispatch.QR_GATED; dense_splitk_gated where it splits)
  qr_fin, qrg_fin   qr and qrg where they split with the fused split finish (matmul_dispatch.QR_SPLIT_FINISH:
        tile counters, no sum launch)

and whether qrg's output is qr's (bits where both take one split of n_in, else the largest
difference relative to the row's largest value). Needs an sm_90 GPU (qrm's and qrg's shared memory).

    python tools/dev/qrg_ab.py [--types Q4_K,Q6_K,Q8_0] [--tokens 16,32,64,128] [--out qrg_ab.json]
"""
from __future__ import annotations

import argparse
import json
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0")
    ap.add_argument("--tokens", default="16,32,64,128")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import cupy as cp
    from gpu_dense_q_bench import N_EMBD, _layer
    from gpu_timing import device_us

    from ggml_attn import kernels as K
    from ggml_attn.cuda_device import num_sms
    from ggml_attn.graph.tiled_gemm import gemm_q_launch, gemm_qrg_launch
    from ggml_attn.graph.xp_matmul import _act_mul_fn
    from ggml_attn.kernels import then
    rows = []
    for type_name in a.types.split(","):
        ws = _layer(cp, type_name, 0)
        wg, wu = ws["wg"], ws["wu"]
        n_ff = int(wg.shape[0])
        for n in (int(t) for t in a.tokens.split(",")):
            x16 = cp.random.standard_normal((n, N_EMBD), dtype=cp.float32).astype(cp.float16)
            outs, res = {}, {}
            for form in ("qr", "qrm", "qrg", "qr_fin", "qrg_fin"):
                out = cp.empty((n, n_ff), cp.float32)
                out16 = cp.empty((n, n_ff), cp.float16)
                kernel = {"qr": "dense_gemm_qr", "qrm": "dense_gemm_qrm", "qr_fin": "dense_gemm_qr"}.get(form,
                                                                                                  "dense_gemm_qrg")
                grid, _ = K.gemm_q_grid(n_ff, n, N_EMBD, num_sms(), kernel)
                splits = grid[2]
                if form.endswith("_fin") and splits == 1:
                    continue
                done = [cp.zeros(grid[0] * grid[1], cp.uint32) for _ in range(2)] if form.endswith("_fin") else [None] * 2
                if form.startswith("qrg"):
                    part = cp.empty((grid[2], 2, n, n_ff), cp.float32) if grid[2] > 1 else None
                    f = gemm_qrg_launch(wg, wu, x16, out, out16, part, done=done[0])
                else:
                    g, u = cp.empty_like(out), cp.empty_like(out)
                    parts = [cp.empty((grid[2], n, n_ff), cp.float32) if grid[2] > 1 else None for _ in range(2)]
                    f = then(gemm_q_launch(wg, x16, g, parts[0], kernel=kernel, done=done[0]),
                             gemm_q_launch(wu, x16, u, parts[1], kernel=kernel, done=done[1]),
                             _act_mul_fn("silu", cp, g, u, out, out16))
                med, lo, hi = device_us([f])
                f()
                cp.cuda.get_current_stream().synchronize()
                outs[form], res[form] = out, dict(us=round(med, 2), min=round(lo, 2), max=round(hi, 2), splits=splits)
            ref, got = outs["qr"], outs["qrg"]
            same = bool((ref.view(cp.uint32) == got.view(cp.uint32)).all())
            rel = float((cp.abs(got - ref) / cp.maximum(cp.abs(ref).max(axis=1, keepdims=True), 1e-30)).max())
            rows.append(dict(type=type_name, tokens=n, **{f"{k}_{kk}": v for k, d in res.items() for kk, v in d.items()},
                             qrg_bits_of_qr=same, qrg_rel_diff=rel))
            print(f"{type_name} n_tok={n:3d}  " + "  ".join(f"{k} {d['us']:7.1f} us ({d['splits']} split)"
                                                           for k, d in res.items()) +
                  f"  qrg/qr {res['qrg']['us'] / res['qr']['us']:.3f}  bits {'same' if same else f'rel {rel:.1e}'}",
                  flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
