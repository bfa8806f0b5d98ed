"""The block matmuls for ncu (issue #43): one llama-3-8B gate matrix (14336 x 4096) of TYPE
(default Q4_K) times one token by dense_gemv_q, by the 8-bit-activation GEMV (dense_quant_q8x,
dense_gemv_q8x_s), then times 16 tokens by dense_gemm_q and by dense_gemm_q8 (each with its
split-K sum), each launched twice (ncu's --launch-skip passes over the first of each).

    ncu --clock-control none -k regex:dense_ python tools/dev/gpu_dense_q_profile.py [TYPE]
"""
from __future__ import annotations

import sys


def main(argv=None) -> int:
    import cupy as cp

    from ggml_attn import kernels as K
    from ggml_attn.cuda_device import num_sms
    from ggml_attn.graph.q8_matmul import gemm_q8_launch, quant_q8x_launch, q8x_launches
    from ggml_attn.graph.xp_matmul import gemm_q_launch, gemv_q_launch
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from gpu_dense_q_bench import _layer
    argv = sys.argv[1:] if argv is None else argv
    w = _layer(cp, argv[0] if argv else "Q4_K", 0)["wg"]
    x = cp.random.standard_normal((1, w.shape[1]), dtype=cp.float32)
    gemv = gemv_q_launch([w], x, [cp.empty((1, w.shape[0]), cp.float32)], mode=0)
    n_in = w.shape[1]
    q8 = (cp.empty((1, n_in), cp.int8), cp.empty((1, n_in // 32), cp.float32), cp.empty((1, n_in // 32), cp.float32))
    q8x = q8x_launches([w], x, [cp.empty((1, w.shape[0]), cp.float32)], *q8, mode=0)
    x16 = cp.random.standard_normal((16, w.shape[1]), dtype=cp.float32).astype(cp.float16)
    grid, _ = K.gemm_q_grid(w.shape[0], 16, w.shape[1], num_sms())
    part = cp.empty((grid[2], 16, w.shape[0]), cp.float32) if grid[2] > 1 else None
    gemm = gemm_q_launch(w, x16, cp.empty((16, w.shape[0]), cp.float32), part)
    x32 = x16.astype(cp.float32)
    q16 = (cp.empty((16, n_in), cp.int8), cp.empty((16, n_in // 32), cp.float32), cp.empty((16, n_in // 32), cp.float32))
    quant_q8x_launch(w.type_id, x32, *q16)()
    grid8, _ = K.gemm_q_grid(w.shape[0], 16, n_in, num_sms(), "dense_gemm_q8")
    part8 = cp.empty((grid8[2], 16, w.shape[0]), cp.float32) if grid8[2] > 1 else None
    gemm8 = gemm_q8_launch(w, *q16, cp.empty((16, w.shape[0]), cp.float32), part8)
    for f in (gemv, gemv, q8x, q8x, gemm, gemm, gemm8, gemm8):
        f()
    cp.cuda.get_current_stream().synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
