"""Attention calls for ncu (32 q heads, 8 KV heads, D=128, f16 K/V), each run twice (the
first builds and caches the call; ncu's --launch-skip picks the second):

  masked   2 sequences x 1024 tokens in one unified ubatch (block-causal mask), then the same
           shapes without a mask (prefill kernel)
  decode   one token, 4096 KV cells (decode-tc and its split combine), then the same at 32768
           cells with the first 1/8 live (a mask)
  window   a 4096-token prefill with a 512-cell sliding window
  decode-tma  one token, 4096 then 32768 KV cells through the sm_90a decode (kernel "decode-tma")
  wgmma    a 4096-token prefill without a mask through the sm_90a kernel (hopper_prefill.run_ws,
           configuration $WGMMA_CONFIG, default pp-persistent: a key of ggml_attn.wgmma_shape.WS_CONFIGS)
  decode-quant  one token a sequence over a cache view through the sm_90a decode, for each of
           $DECODE_QUANT_SHAPES (comma-separated kind:B:cells, default q8_0:1:32768; issue #46's
           rows: q8_0:1:32768,q8_0:64:32768,q4_0:64:32768,f16:64:32768): its default instance,
           then each $DECODE_TMA_CONFIGS (comma-separated decode_tma_shape.CONFIGS keys); every
           launch profiled (each call runs twice: the first builds it)
  dense-qs one llama-3-8B layer's seven Q4_K matrices ($DENSE_QS_TYPE) through dense_gemm_qs
           (cuda/dense_q.cu, issue #43; $DENSE_QS_KERNEL=dense_gemm_qr or a form of
           dense_gemm_qw: that kernel) at each of $DENSE_QS_TOKENS (default 64,16: the 64-token
           tile, then the 32-token one): ncu -k regex:dense_gemm_q[srw] --launch-skip 7 --launch-count 14
  gemv-q8x the 8B gate matrix (14336 x 4096, $GEMV_Q8X_TYPE, default Q4_K) at one token through
           each form of the 8-bit-activation GEMV (cuda/dense_q8x.cu: staged, plain, vector,
           persist; the activations quantized once before), then the F16 GEMV (cuda/dense.cu
           dense_gemv) on the same shape: ncu -k regex:dense_gemv --launch-skip 4 --launch-count 10

Usage: ncu --clock-control none $(python tools/dev/gpu_profile_case.py --ncu-args CASE) \
           python tools/dev/gpu_profile_case.py CASE     (default: masked)
"""
from __future__ import annotations

import sys

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpu_bench import SCALE, Ours, block_causal_mask, window_mask  # noqa: E402

CASES = ("masked", "decode", "window", "wgmma", "decode-tma", "decode-quant", "dense-qs", "gemv-q8x")
# ncu's kernel filter for each case (regex, launches skipped, launches profiled): the first call of
# each shape builds it, the skip passes over that (``--ncu-args CASE`` prints them for the scripts)
NCU_FILTERS = {"wgmma": ("fattn_wgmma", 1, 1), "decode-tma": ("fattn_decode_tma", 1, 3),
               "decode-quant": ("fattn_decode_tma", 0, 0),   # (0: every launch, quant_calls' count)
               "dense-qs": ("dense_gemm_q[srw]", 7, 14),     # DENSE_QS_KERNEL=dense_gemm_qr etc.: that kernel
               "gemv-q8x": ("dense_gemv", 4, 10)}            # each of Q4_K's 4 forms once as it is built, then each form twice and F16's GEMV twice


def ncu_args(case: str) -> str:
    """ncu's ``-k regex:... --launch-skip N --launch-count M`` for ``case`` (fattn_mma's for the
    mma.sync cases)."""
    if case not in CASES:
        raise SystemExit(f"unknown case {case!r}: one of {', '.join(CASES)}")
    kre, skip, count = NCU_FILTERS.get(case, ("fattn_mma", 1, 3))
    if case == "decode-quant":
        count = 2 * len(quant_calls())
    return f"-k regex:{kre} --launch-skip {skip} --launch-count {count}"


def problems(case: str) -> list[tuple[Ours, str]]:
    """(problem, kernel) pairs of ``case``, in launch order."""
    if case == "masked":
        L = 1024
        return [(Ours(1, 2 * L, 2 * L, block_causal_mask([L, L], 2 * L)), "prefill"),
                (Ours(1, 2 * L, 2 * L), "prefill")]
    if case == "decode":
        S = 32768
        m = np.full((1, S), -np.inf, dtype=np.float16)
        m[:, :S // 8] = 0
        return [(Ours(1, 1, 4096), "auto"), (Ours(1, 1, S, m), "auto")]
    if case == "decode-tma":
        return [(Ours(1, 1, 4096), "decode-tma"), (Ours(1, 1, 32768), "decode-tma")]
    if case == "window":
        return [(Ours(1, 4096, 4096, window_mask(4096, 512)), "prefill")]
    raise SystemExit(f"unknown case {case!r}: one of {', '.join(CASES)}")


def wgmma_fn(config: str):
    """One call of the sm_90a prefill (4096 tokens, no mask) in ``config``."""
    from ggml_attn import hopper_prefill
    o = Ours(1, 4096, 4096)
    dk, dv = o.dkv[0]
    return lambda: hopper_prefill.run_ws(o.dq, dk, dv, o.dd, SCALE, o.stream, config=config)


def quant_shapes() -> list[tuple[str, int, int]]:
    """decode-quant's (K/V kind, sequences, cells each), from $DECODE_QUANT_SHAPES."""
    import os
    out = []
    for item in os.environ.get("DECODE_QUANT_SHAPES", "q8_0:1:32768").split(","):
        try:
            kind, b, n = item.split(":")
            if kind not in ("f16", "q8_0", "q4_0") or int(b) < 1 or int(n) < 1:
                raise ValueError
        except ValueError:
            raise SystemExit(f"DECODE_QUANT_SHAPES: {item!r} is not kind:B:cells (kind f16, q8_0 or q4_0)")
        out.append((kind, int(b), int(n)))
    return out


def quant_configs() -> list[str]:
    """The decode-tma instances decode-quant runs besides the default, from $DECODE_TMA_CONFIGS."""
    import os
    return [c for c in os.environ.get("DECODE_TMA_CONFIGS", "").split(",") if c]


def quant_calls() -> list[tuple[tuple[str, int, int], str]]:
    """decode-quant's (shape, instance) pairs: each shape through its default instance ("") and
    the $DECODE_TMA_CONFIGS of its kind (a config's kind is its name up to the first '-')."""
    return [(sh, c) for sh in quant_shapes() for c in ("", *quant_configs()) if not c or c.split("-")[0] == sh[0]]


def quant_fns(calls) -> list:
    """decode-quant's calls, one function each: ``calls`` as quant_calls() gives them."""
    import cupy as cp

    from ggml_attn import cuda_backend as cb
    from ggml_attn.tensor import from_array
    from gpu_quant_kv_bench import D, H, cache_kv
    from gpu_timing import knobs
    bufs = {}
    def fn(shape, c):
        kind, B, n = shape
        if shape not in bufs:   # (one cache a shape, made on its first call: one shape's bytes at a time)
            bufs.clear()
            (_, kd), (_, vd) = cache_kv(B, n, kind, 1), cache_kv(B, n, kind, 2)
            bufs[shape] = (kd, vd, cp.ones((B, H, 1, D), cp.float32), cp.empty((B, 1, H, D), cp.float32))
        kd, vd, q, dst = bufs[shape]
        with knobs(DECODE_TMA_CONFIG=c):
            cb.bind(from_array(q), kd, vd, None, None, from_array(dst), 1.0 / np.sqrt(D), kernel="decode-tma").launch()
    return [lambda sh=sh, c=c: fn(sh, c) for sh, c in calls]


def dense_qs_fns(type_name: str, kernel: str = "dense_gemm_qs", tokens=(64, 16)) -> list:
    """dense-qs's calls: one 8B layer through ``kernel`` at each of ``tokens``."""
    import cupy as cp

    from ggml_attn import kernels as K
    from ggml_attn.cuda_device import num_sms
    from ggml_attn.graph.xp_matmul import gemm_q_launch
    from gpu_dense_q_bench import N_EMBD, N_FF, _layer, _tiled
    ws = _layer(cp, type_name, 0)
    fns = []
    for n in tokens:
        x16 = cp.random.standard_normal((n, N_EMBD), dtype=cp.float32).astype(cp.float16)
        xf16 = cp.random.standard_normal((n, N_FF), dtype=cp.float32).astype(cp.float16)
        fns.append(_tiled(cp, K, ws, x16, xf16, num_sms(), gemm_q_launch, kernel))
    return fns


def gemv_q8x_fns(type_name: str) -> list:
    """gemv-q8x's calls: the gate matrix at one token in each 8-bit GEMV form, then F16's GEMV."""
    import cupy as cp

    from ggml_attn import kernels as K
    from ggml_attn.graph.q8_matmul import q8x_launches
    from ggml_attn.graph.xp_matmul import gemv_launch
    from gpu_dense_q_bench import N_EMBD, N_FF, _layer, _q8x
    w = _layer(cp, type_name, 0)["wg"]
    fns = [_q8x(cp, K, {"wg": w}, 1, q8x_launches, form, False)
           for form in K.Q8X_FORMS if K.q8x_form_reads(form, type_name)]
    w16 = (cp.random.standard_normal((N_FF, N_EMBD), dtype=cp.float32) * 0.02).astype(cp.float16)
    x, out = cp.random.standard_normal((1, N_EMBD), dtype=cp.float32), cp.empty((1, N_FF), cp.float32)
    f16 = gemv_launch([w16], x, [out], mode=0)
    fns.append(lambda keep=(w16, x, out): f16())
    return fns


def main(argv=None):
    import os

    argv = argv if argv is not None else sys.argv[1:]
    if argv[:1] == ["--ncu-args"]:
        print(ncu_args(argv[1] if len(argv) > 1 else "masked"))
        return
    import torch
    for case in argv or ["masked"]:
        if case == "decode-quant":
            for f in quant_fns(quant_calls()):
                f()
                f()
            continue
        if case == "dense-qs":
            env = os.environ.get
            for f in dense_qs_fns(env("DENSE_QS_TYPE", "Q4_K"), env("DENSE_QS_KERNEL", "dense_gemm_qs"),
                                  tuple(int(n) for n in env("DENSE_QS_TOKENS", "64,16").split(","))):
                f()
                f()
            continue
        if case == "gemv-q8x":
            for f in gemv_q8x_fns(os.environ.get("GEMV_Q8X_TYPE", "Q4_K")):
                f()
                f()
            continue
        if case == "wgmma":
            from ggml_attn.wgmma_shape import WS_DEFAULT
            f = wgmma_fn(os.environ.get("WGMMA_CONFIG", WS_DEFAULT))
            f()
            f()
            continue
        for o, kernel in problems(case):
            f = o.fns(kernel)[0]
            f()
            f()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
