"""Device time of the full block's weight reads at decode: one layer's projections for 1 token,
llama-3-8B shapes (n_embd 4096, 1024 K/V, n_ff 14336; 436 MB of F16 weights per layer, well
over the L2), as ``cuda/dense.cu`` runs them (four ``dense_gemv`` launches: Q/K/V, gate/up
with SiLU, both with the RMS norm fused, and the O and down projections added into the
residual; each unroll instance) against cuBLAS (torch
``F.linear`` in F16, one GEMM per weight). A row group of ``tools/dev/gpu_bench.py`` (case
``dense:``); floor: the bytes over 4.2 TB/s.
"""
from __future__ import annotations

N_EMBD, N_KV, N_FF = 4096, 1024, 14336


def _layer_weights(cp, rng_seed: int):
    rs = cp.random.RandomState(rng_seed)
    shapes = dict(wq=(N_EMBD, N_EMBD), wk=(N_KV, N_EMBD), wv=(N_KV, N_EMBD), wo=(N_EMBD, N_EMBD),
                  wg=(N_FF, N_EMBD), wu=(N_FF, N_EMBD), wd=(N_EMBD, N_FF))
    return {k: (rs.standard_normal(s, dtype=cp.float32) * 0.02).astype(cp.float16) for k, s in shapes.items()}


def run(device_us, log=print) -> list[dict]:
    import cupy as cp
    import torch
    import torch.nn.functional as F
    from ggml_attn import kernels as K
    from ggml_attn.graph.xp_matmul import gemv_launch

    case = "dense: llama-3-8B layer projections, 1 token"
    layers = [_layer_weights(cp, s) for s in range(2)]     # two layers: 872 MB rotated
    nbytes = sum(w.nbytes for w in layers[0].values())
    x = cp.random.standard_normal((1, N_EMBD), dtype=cp.float32)
    xf = cp.random.standard_normal((1, N_FF), dtype=cp.float32)
    qkv = [cp.empty((1, n), cp.float32) for n in (N_EMBD, N_KV, N_KV)]
    act, res = cp.empty((1, N_FF), cp.float32), cp.zeros((1, N_EMBD), cp.float32)

    def ours(w, u):   # (the arrays stay alive in `layers`, x, xf, qkv, act, res)
        steps = [gemv_launch([w["wq"], w["wk"], w["wv"]], x, qkv, mode=0, norm_eps=1e-5, unroll=u),
                 gemv_launch([w["wo"]], x, [res], mode=1, unroll=u),
                 gemv_launch([w["wg"], w["wu"]], x, [act], mode=2, norm_eps=1e-5, unroll=u),
                 gemv_launch([w["wd"]], xf, [res], mode=1, unroll=u)]
        assert all(steps), "the llama-3-8B shapes fit dense_gemv"

        def layer():
            for s in steps:
                s()
        return layer

    tw = [{k: torch.as_tensor(v, device="cuda") for k, v in w.items()} for w in layers]
    tx, txf = torch.randn(1, N_EMBD, device="cuda", dtype=torch.float16), \
        torch.randn(1, N_FF, device="cuda", dtype=torch.float16)

    def cublas(w):
        def layer():
            for k in ("wq", "wk", "wv", "wo", "wg", "wu"):
                F.linear(tx, w[k])
            F.linear(txf, w["wd"])
        return layer

    rows = []
    impls = [("ours" if u == K.GEMV_UNROLL else f"ours-gemv-u{u}", [ours(w, u) for w in layers])
             for u in K.GEMV_UNROLLS] + [("cublas", [cublas(w) for w in tw])]
    for impl, fns in impls:
        med, lo, hi = device_us(fns)
        rows.append(dict(case=case, impl=impl, us=round(med, 2), us_min=round(lo, 2), us_max=round(hi, 2),
                         tbps=round(nbytes / med / 1e6, 2),
                         note=f"{nbytes / 1e6:.0f} MB of weights; floor {nbytes / 4.2e6:.0f} us at 4.2 TB/s"))
        log(f"{case:44s} {impl:18s} {med:9.1f} {nbytes / med / 1e6:.2f} TB/s")
    return rows
