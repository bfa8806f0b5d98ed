"""A small representative run for compute-sanitizer (memcheck, racecheck): the mask plan,
prefill with a ragged block-causal mask and a tail tile (n_kv = 333), decode and decode-tc
with forced KV splits + combine, the cell-list decode (its list builder, splits, D 64/128/256),
BF16, D=80 (padded head size), sinks/ALiBi/softcap, and a bias mask (no -inf) with the plan
marking its tiles FINITE (cuda_launch.FINITE_MASK_TILES), also on the 128-row tiles; on
compute capability 9.0 the sm_90a prefill as well (every instance directly, the op's through
the op with a mask of every tile class) and the sm_90a decode, also over q8_0 / q4_0 blocks,
with f16 copies of quantized K/V for a prompt and a mixed K/V pair; the weight-block matmuls
of cuda/dense_q.cu and dense_q8x.cu (every block type: the GEMVs with the fused norm, gated,
rows that do not fill a block of warps; the tiled GEMMs (F16 decodes, int8), split over n_in; the F16
dequantization; the row gather; on compute capability 9.0 the wgmma block GEMM of cuda/dense_qw.cu);
the model graph's fused rope and K/V store (xp_rope_store); the
attention's output in 8-bit form (the cell-list kernel's QO epilogue, the launch after a combine).
With --dense-q only the weight-block matmuls and the fused store (--dense-qw: only dense_gemm_qw); with --quant-kv only the
sm_90a decode over q8_0 / q4_0 blocks and its neighbours (:func:`_quantized`); with --wgmma only
every sm_90a prefill instance directly (:func:`_ws_instances`); with --attn-q8 only the
attention's output in 8-bit form (:func:`_attn_q8`). Exits non-zero if
any result misses the reference."""
from __future__ import annotations

import sys

import numpy as np

from ggml_attn import cuda_backend as cb
from ggml_attn import cuda_launch
from ggml_attn.conformance import block_causal_mask
from ggml_attn.dtypes import GGML_TYPE_BF16, GGML_TYPE_F16, from_float
from ggml_attn.reference import flash_attn_ext, nmse
from ggml_attn.tensor import from_array


def _ws_instances(cp, rng) -> int:
    """Every sm_90a prefill instance (wgmma_shape.WS_CONFIGS) directly at its head size, no mask:
    tail tiles (n_kv 333), GQA 4. The failures' count."""
    from ggml_attn import hopper_prefill
    bad = 0
    nb, n_kv, nh, nkv = 100, 333, 8, 2
    for c, wc in hopper_prefill.WS_CONFIGS.items():   # every instance, directly, at its head size
        kv_type, d = wc.kv_type, wc.d
        q = rng.uniform(-1, 1, (1, nh, nb, d)).astype(np.float32)
        kv = rng.uniform(-1, 1, (2, 1, nkv, n_kv, d))
        k, v = from_float(kv[0], kv_type), from_float(kv[1], kv_type)
        ref = flash_attn_ext(q, k, v, None, 0.1, 0.0, 0.0, None, kv_type=kv_type)
        # the device arrays stay referenced: a TensorDesc holds only a pointer, and CuPy's
        # pool hands a freed temporary's memory to the next array (K's buffer would become V's)
        dq, dk_, dv_ = cp.asarray(q), cp.asarray(k), cp.asarray(v)
        dst = cp.full((1, nb, nh, d), cp.nan, dtype=cp.float32)
        hopper_prefill.run_ws(from_array(dq), from_array(dk_, kv_type), from_array(dv_, kv_type),
                              from_array(dst), 0.1, cp.cuda.get_current_stream().ptr, config=c)
        out = dst.get()
        err = nmse(out, ref)
        ok = err <= 5e-4 and not np.isnan(out).any()
        bad += not ok
        print(f"{'ws-' + c:10s} D={d} mask=None nmse={err:.2e} {'ok' if ok else 'FAIL'}")
    return bad


def main():
    import cupy as cp
    rng = np.random.default_rng(0)
    bad = 0
    from ggml_attn import kernels as K
    qw = K.device_arch() == "sm_90"   # dense_gemm_qw: an sm_90a program
    if "--dense-q" in sys.argv[1:]:   # the weight-block matmuls only (and the fused store)
        sys.exit(1 if _dense_q(cp, rng) + _rope_store(cp, rng) + (_dense_qw(cp, rng) if qw else 0) else 0)
    if "--dense-qw" in sys.argv[1:]:  # the wgmma block GEMM only
        sys.exit(1 if _dense_qw(cp, rng) else 0)
    if "--attn-q8" in sys.argv[1:]:   # the attention's output in 8-bit form only
        sys.exit(1 if _attn_q8(cp, rng) else 0)
    if "--wgmma" in sys.argv[1:]:     # every sm_90a prefill instance directly, no mask, only
        sys.exit(1 if _ws_instances(cp, rng) else 0)
    if "--quant-kv" in sys.argv[1:]:  # the decode over quantized K/V only (sm_90a)
        m = rng.uniform(-1, 1, (1, 1, 3, 333)).astype(np.float32)
        m[..., 64:200] = -np.inf
        m[rng.random(m.shape) < 0.1] = -np.inf
        sys.exit(1 if _quantized(cp, rng, m.astype(np.float16)) else 0)
    # masks: "random" (MASKED tiles: mask tiles loaded), "causal" (two block-causal
    # sequences: FULL tiles and PARTIAL tiles from row intervals), "finite" (MASKED tiles marked
    # FINITE, the tail's mask tile read -inf past n_kv), None (tail tile only)
    for kernel, dk, kv_type, nb, splits, softcap, bias, kind in [
        ("prefill", 128, GGML_TYPE_F16, 100, None, 0.0, 0.0, "random"),
        ("prefill", 128, GGML_TYPE_F16, 300, 2, 10.0, 0.0, "random"),   # 128-row tiles
        ("prefill", 80, GGML_TYPE_BF16, 70, 2, 10.0, 8.0, "random"),
        ("prefill", 128, GGML_TYPE_F16, 333, None, 0.0, 0.0, "causal"),
        ("prefill", 64, GGML_TYPE_BF16, 100, 2, 0.0, 0.0, None),
        ("decode", 128, GGML_TYPE_F16, 1, 3, 0.0, 0.0, "random"),
        ("decode-tc", 64, GGML_TYPE_BF16, 2, 3, 0.0, 8.0, "random"),
        ("decode-tc", 128, GGML_TYPE_F16, 3, 2, 0.0, 0.0, None),
        ("prefill", 128, GGML_TYPE_F16, 100, None, 0.0, 0.0, "finite"),
        ("prefill", 128, GGML_TYPE_F16, 300, 2, 10.0, 8.0, "finite"),   # 128-row tiles, EXT
        ("decode-tc", 128, GGML_TYPE_F16, 3, 2, 0.0, 0.0, "finite"),
        ("prefill", 128, GGML_TYPE_F16, 300, 2, 0.0, 0.0, "finite"),   # 128-row tiles, plain
        ("decode-tc", 64, GGML_TYPE_BF16, 3, 2, 0.0, 0.0, "finite"),
        # cell-list decode: lists from the random mask (unaligned rows: n_kv 333), splits and
        # combine, no mask (every cell), ALiBi + softcap, D 64 / 256
        ("cells", 128, GGML_TYPE_F16, 3, None, 0.0, 0.0, "random"),
        ("cells", 128, GGML_TYPE_F16, 2, 3, 0.0, 0.0, "random"),
        ("cells", 64, GGML_TYPE_BF16, 1, 2, 10.0, 8.0, "random"),
        ("cells", 256, GGML_TYPE_F16, 2, None, 0.0, 0.0, None),
    ]:
        n_kv, nh, nkv = 333, 8, 2
        q = rng.uniform(-1, 1, (1, nh, nb, dk)).astype(np.float32)
        k = from_float(rng.uniform(-1, 1, (1, nkv, n_kv, dk)), kv_type)
        v = from_float(rng.uniform(-1, 1, (1, nkv, n_kv, dk)), kv_type)
        if kind == "random":
            m = rng.uniform(-1, 1, (1, 1, nb, n_kv)).astype(np.float32)
            m[..., 64:200] = -np.inf
            m[:, :, ::4, :] = -np.inf
            mask = m.astype(np.float16)
        elif kind == "finite":
            mask = rng.uniform(-1, 1, (1, 1, nb, n_kv)).astype(np.float16)
        elif kind == "causal":
            mask = block_causal_mask([150, nb - 150], n_kv).reshape(1, 1, nb, n_kv)
        else:
            mask = None
        sinks = rng.uniform(-2, 2, nh).astype(np.float32)
        ref = flash_attn_ext(q, k, v, mask, 0.1, bias, softcap, sinks, kv_type=kv_type)
        dq, dk_, dv_, ds = (cp.asarray(x) for x in (q, k, v, sinks))
        dm = cp.asarray(mask) if mask is not None else None
        cuda_launch.FINITE_MASK_TILES = kind == "finite"   # read when the plan is built
        dst = cp.full((1, nb, nh, dk), cp.nan, dtype=cp.float32)
        cb.flash_attn_ext_device(from_array(dq), from_array(dk_, kv_type), from_array(dv_, kv_type),
                                 from_array(dm) if dm is not None else None, from_array(ds),
                                 from_array(dst), 0.1, bias, softcap,
                                 kernel=kernel, n_splits=splits)
        out = dst.get()
        err = nmse(out, ref)
        ok = err <= 5e-4 and not np.isnan(out).any()
        bad += not ok
        print(f"{kernel:10s} D={dk} mask={kind} nmse={err:.2e} {'ok' if ok else 'FAIL'}")
    from ggml_attn import kernels as K
    if K.device_arch() == "sm_90":   # the sm_90a prefill: tail tiles, GQA 4, every tile class
        from ggml_attn import hopper_prefill
        from ggml_attn.wgmma_shape import ws_config
        bad += _ws_instances(cp, rng)
        # through the op's entry with a causal mask after 500 cells: PARTIAL and ABSENT halves,
        # HIDDEN columns (the fixer warp), a -inf hole row segment (a MASKED tile), more chunks
        # per query tile than ring stages (each stage's barriers reused within a tile); each
        # tile width, and head sizes padded to one (TMA's zero fill past the head)
        nb, n_kv = 200, 700
        m = np.full((1, 1, nb, n_kv), -np.inf, np.float16)
        for t in range(nb):
            m[0, 0, t, :500 + t + 1] = 0
        m[0, 0, 5, 3:9] = -np.inf
        for d in (64, 128, 256, 40, 96, 192):
            q = rng.uniform(-1, 1, (1, nh, nb, d)).astype(np.float32)
            k = from_float(rng.uniform(-1, 1, (1, nkv, n_kv, d)), GGML_TYPE_F16)
            v = from_float(rng.uniform(-1, 1, (1, nkv, n_kv, d)), GGML_TYPE_F16)
            ref = flash_attn_ext(q, k, v, m, 0.1, 0.0, 0.0, None, kv_type=GGML_TYPE_F16)
            dq, dk_, dv_, dm = cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(m)
            dst = cp.full((1, nb, nh, d), cp.nan, dtype=cp.float32)
            cb.flash_attn_ext_device(from_array(dq), from_array(dk_, GGML_TYPE_F16), from_array(dv_, GGML_TYPE_F16),
                                     from_array(dm, GGML_TYPE_F16), None, from_array(dst), 0.1,
                                     kernel="prefill-wgmma")
            out = dst.get()
            err = nmse(out, ref)
            ok = err <= 5e-4 and not np.isnan(out).any()
            bad += not ok
            print(f"wgmma-op   D={d} mask=causal+hole nmse={err:.2e} {'ok' if ok else 'FAIL'}")
        # packed query heads (4 of 16, GQA 8): directly without a mask, 3 blocks walking many
        # tiles; and 9 ragged prompts through the op with a plan (not wide: packed tiles of 32
        # tokens, HIDDEN columns at a gap of unused cells)
        nh16 = 16
        for d, pack in ((128, 4), (64, 8)):
            c = ws_config(GGML_TYPE_F16, d=d)   # (the op's instance of each width)
            q = rng.uniform(-1, 1, (1, nh16, 100, d)).astype(np.float32)
            k = from_float(rng.uniform(-1, 1, (1, 2, 333, d)), GGML_TYPE_F16)
            v = from_float(rng.uniform(-1, 1, (1, 2, 333, d)), GGML_TYPE_F16)
            ref = flash_attn_ext(q, k, v, None, 0.1, 0.0, 0.0, None, kv_type=GGML_TYPE_F16)
            dq, dk_, dv_ = cp.asarray(q), cp.asarray(k), cp.asarray(v)
            dst = cp.full((1, 100, nh16, d), cp.nan, dtype=cp.float32)
            hopper_prefill.run_ws(from_array(dq), from_array(dk_, GGML_TYPE_F16), from_array(dv_, GGML_TYPE_F16),
                                  from_array(dst), 0.1, cp.cuda.get_current_stream().ptr, config=c, blocks=3,
                                  pack=pack)
            out = dst.get()
            err = nmse(out, ref)
            ok = err <= 5e-4 and not np.isnan(out).any()
            bad += not ok
            print(f"ws-pack{pack}   D={d} mask=None nmse={err:.2e} {'ok' if ok else 'FAIL'}")
        lens = [37, 150, 5, 80, 200, 1, 64, 129, 90]
        nb, n_kv = sum(lens), 1024
        m = block_causal_mask(lens, n_kv, gaps=[7]).reshape(1, 1, nb, n_kv)
        q = rng.uniform(-1, 1, (1, nh16, nb, 128)).astype(np.float32)
        k = from_float(rng.uniform(-1, 1, (1, 2, n_kv, 128)), GGML_TYPE_F16)
        v = from_float(rng.uniform(-1, 1, (1, 2, n_kv, 128)), GGML_TYPE_F16)
        ref = flash_attn_ext(q, k, v, m, 0.1, 0.0, 0.0, None, kv_type=GGML_TYPE_F16)
        dq, dk_, dv_, dm = cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(m)
        dst = cp.full((1, nb, nh16, 128), cp.nan, dtype=cp.float32)
        st = cp.cuda.get_current_stream().ptr
        tm = from_array(dm, GGML_TYPE_F16)
        plan = cb.make_plan(tm, nb, nh16, 2, head_dim_k=128, kv_type=GGML_TYPE_F16, stream=st)
        cb.flash_attn_ext_device(from_array(dq), from_array(dk_, GGML_TYPE_F16), from_array(dv_, GGML_TYPE_F16),
                                 tm, None, from_array(dst), 0.1, kernel="prefill-wgmma", plan=plan, stream=st)
        out = dst.get()
        err = nmse(out, ref)
        ok = err <= 5e-4 and not np.isnan(out).any()
        bad += not ok
        print(f"wgmma-op   D=128 mask=ragged (packed) nmse={err:.2e} {'ok' if ok else 'FAIL'}")
        # the sm_90a decode: no mask and a random mask with -inf holes (MASKED, HIDDEN tiles),
        # one wave of blocks and 3 blocks (parts of groups merged by the last block)
        nb, n_kv, nh, nkv = 3, 333, 32, 8
        q = rng.uniform(-1, 1, (2, nh, nb, 128)).astype(np.float32)
        k = from_float(rng.uniform(-1, 1, (2, nkv, n_kv, 128)), GGML_TYPE_F16)
        v = from_float(rng.uniform(-1, 1, (2, nkv, n_kv, 128)), GGML_TYPE_F16)
        m = rng.uniform(-1, 1, (1, 1, nb, n_kv)).astype(np.float32)
        m[..., 64:200] = -np.inf
        m[rng.random(m.shape) < 0.1] = -np.inf
        m = m.astype(np.float16)
        for mask, blocks in ((None, 0), (m, 0), (m, 3)):
            cuda_launch.DECODE_TMA_BLOCKS = blocks
            ref = flash_attn_ext(q, k, v, mask, 0.1, 0.0, 0.0, None, kv_type=GGML_TYPE_F16)
            dq, dk_, dv_ = cp.asarray(q), cp.asarray(k), cp.asarray(v)
            dm = None if mask is None else cp.asarray(mask)
            dst = cp.full((2, nb, nh, 128), cp.nan, dtype=cp.float32)
            cb.flash_attn_ext_device(from_array(dq), from_array(dk_, GGML_TYPE_F16), from_array(dv_, GGML_TYPE_F16),
                                     None if dm is None else from_array(dm, GGML_TYPE_F16), None, from_array(dst),
                                     0.1, kernel="decode-tma")
            out = dst.get()
            err = nmse(out, ref)
            ok = err <= 5e-4 and not np.isnan(out).any()
            bad += not ok
            print(f"decode-tma D=128 mask={'random' if mask is not None else None} blocks={blocks} "
                  f"nmse={err:.2e} {'ok' if ok else 'FAIL'}")
        cuda_launch.DECODE_TMA_BLOCKS = 0
        bad += _quantized(cp, rng, m)
    bad += _dense_q(cp, rng)
    bad += _dense_qw(cp, rng) if qw else 0
    bad += _rope_store(cp, rng)
    bad += _attn_q8(cp, rng)
    sys.exit(1 if bad else 0)


def _attn_q8(cp, rng) -> int:
    """The attention's output in 8-bit form (ggml_attn/q8_out.py): the cell-list kernel's QO
    epilogues over one split (R 4 and 1: ragged rows; both QO epilogues) and the launch after
    three splits' combine; the bits against numpy's rounding of dst."""
    from ggml_attn import q8_out
    from ggml_attn.quant import q8_form
    bad = 0
    for nb, nh, nkv, splits in ((1, 32, 8, 1), (3, 8, 8, 1), (2, 32, 8, 3)):
        n_kv, d = 333, 128
        q = rng.uniform(-1, 1, (1, nh, nb, d)).astype(np.float32)
        k, v = (from_float(rng.uniform(-1, 1, (1, nkv, n_kv, d)), GGML_TYPE_F16) for _ in range(2))
        m = rng.uniform(-1, 1, (1, 1, nb, n_kv)).astype(np.float32)
        m[..., 100:] = -np.inf
        dst = cp.full((1, nb, nh, d), cp.nan, dtype=cp.float32)
        arrs = (cp.zeros((nb, nh * d), cp.int8), cp.zeros((nb, nh * d // 32), cp.float32),
                cp.zeros((nb, nh * d // 32), cp.float32))
        dm = cp.asarray(m.astype(np.float16))
        cb.flash_attn_ext_device(from_array(cp.asarray(q)), from_array(cp.asarray(k), GGML_TYPE_F16),
                                 from_array(cp.asarray(v), GGML_TYPE_F16), from_array(dm), None, from_array(dst),
                                 0.1, kernel="cells", n_splits=splits, q8=q8_out.check_arrays(arrs, nb, nh * d))
        ok = all(np.array_equal(a.get(), w) for a, w in zip(arrs, q8_form(dst.get().reshape(nb, -1))))
        bad += not ok
        print(f"attn q8 out cells splits={splits} rows={nb} {'ok' if ok else 'FAIL'}")
    return bad


def _quantized(cp, rng, mask) -> int:
    """q8_0 / q4_0 K/V as a cache's rows (cells outer, heads packed, rows 16 bytes wider): the
    sm_90a decode reading the blocks (no mask and ``mask``, a wave and 3 blocks; one token of 6
    streams: the heads-first group order, whole groups and the equal share), a prompt on f16
    copies (fattn_dequant_kv, then the tensor-core prefill), a K f16 / V q8_0 pair. The decode
    cases run the op's instance and each of $DECODE_TMA_CONFIGS (comma-separated
    decode_tma_shape.CONFIGS keys) of their K/V type. Failures."""
    import os

    from ggml_attn import decode_tma_shape as dt
    from ggml_attn.dtypes import GGML_TYPE_Q4_0, GGML_TYPE_Q8_0
    from ggml_attn.quant import dequantize_rows, quantize
    from ggml_attn.tensor import TensorDesc
    nh, nkv, n_kv, bad, keep = 32, 8, 333, 0, []

    def rows(kv_type, ns):   # (device view, float32 (ns, nkv, n_kv, 128) of what it holds)
        if kv_type == GGML_TYPE_F16:
            x = from_float(rng.uniform(-1, 1, (ns, nkv, n_kv, 128)), GGML_TYPE_F16)
            dev = cp.asarray(x)
            keep.append(dev)
            return from_array(dev, GGML_TYPE_F16), x.astype(np.float32)
        b = quantize(rng.uniform(-1, 1, (ns, nkv, n_kv, 128)).astype(np.float32), kv_type)   # (ns, nkv, n_kv, row)
        row = b.shape[-1]
        host = np.zeros((ns, n_kv, nkv * row + 16), np.uint8)
        host[..., :nkv * row] = b.transpose(0, 2, 1, 3).reshape(ns, n_kv, -1)
        dev = cp.asarray(host)
        keep.append(dev)
        deq = dequantize_rows(b.ctypes.data, kv_type, 128, ns * nkv * n_kv, row).reshape(ns, nkv, n_kv, 128)
        return TensorDesc(int(dev.data.ptr), kv_type, (128, n_kv, nkv, ns),
                          (row // 4, host.shape[2], row, host.shape[2] * n_kv)), deq
    for kt, vt, nb, ns, kernel, m, blocks in ((GGML_TYPE_Q8_0, GGML_TYPE_Q8_0, 3, 1, "decode-tma", None, 0),
                                              (GGML_TYPE_Q4_0, GGML_TYPE_Q4_0, 3, 1, "decode-tma", mask, 3),
                                              (GGML_TYPE_Q8_0, GGML_TYPE_Q8_0, 1, 6, "decode-tma", None, 0),
                                              (GGML_TYPE_Q4_0, GGML_TYPE_Q4_0, 1, 6, "decode-tma", None, 5),
                                              (GGML_TYPE_Q8_0, GGML_TYPE_Q8_0, 100, 1, "prefill", None, 0),
                                              (GGML_TYPE_F16, GGML_TYPE_Q8_0, 3, 1, "auto", mask, 0)):
        cuda_launch.DECODE_TMA_BLOCKS = blocks
        (kd, kf), (vd, vf) = rows(kt, ns), rows(vt, ns)
        mm = None if m is None else np.ascontiguousarray(np.broadcast_to(m[..., :1, :], (1, 1, nb, n_kv)))
        q = rng.uniform(-1, 1, (ns, nh, nb, 128)).astype(np.float32)
        ref = flash_attn_ext(q, kf, vf, mm, 0.1, 0.0, 0.0, None)
        dq = cp.asarray(q)
        dm = None if mm is None else cp.asarray(mm)
        extra = [c for c in os.environ.get("DECODE_TMA_CONFIGS", "").split(",")
                 if c and kernel == "decode-tma" and kt == vt and dt.CONFIGS[c].kv_type == kt]
        for config in ["", *extra]:
            cuda_launch.DECODE_TMA_CONFIG = config
            dst = cp.full((ns, nb, nh, 128), cp.nan, dtype=cp.float32)
            cb.flash_attn_ext_device(from_array(dq), kd, vd, None if dm is None else from_array(dm, GGML_TYPE_F16),
                                     None, from_array(dst), 0.1, kernel=kernel)
            out = dst.get()
            err = nmse(out, ref)
            ok = err <= 5e-4 and not np.isnan(out).any()
            bad += not ok
            print(f"quant {kernel:10s} {config or 'default':9s} K {kt} V {vt} streams={ns} mask={m is not None} "
                  f"blocks={blocks} nmse={err:.2e} {'ok' if ok else 'FAIL'}")
    cuda_launch.DECODE_TMA_BLOCKS = 0
    cuda_launch.DECODE_TMA_CONFIG = ""
    return bad


def _staged_n_in(lay) -> int:
    """An n_in whose rows are whole 16-byte units over more than 4 chunks of 1024 values
    (dense_gemv_q8x_s, its cp.async slots reused): 4864 where the block size allows, else 6144."""
    return next(n for n in (4864, 6144) if n % lay.values == 0 and lay.row_bytes(n) % 16 == 0)


def _q8x_gated(cp, rng, name: str, n_in: int, rows: int, form: str | None = None, gated: bool = True,
               split: bool = False, qout: bool = False) -> int:
    """The 8-bit-activation GEMV (cuda/dense_q8x.cu; ``form``: kernels.Q8X_FORMS', None the
    dispatch's) gated (or, ``gated`` False, the gate matrix alone in mode 0 through the vector and
    ring forms' one-operand instance: matmul_dispatch.GEMV_ONE_TYPES; ``split``: the vector form's
    instance with two warps a row, GEMV_SPLIT_TYPES) with the RMS norm at one token against float64
    of the activations it quantized (quant.q8_activations); ``qout`` (the vector and ring forms,
    rows whole 32-row groups): writing its output's 8-bit form too (q8_matmul.q8_out_arrays) --
    gated, the bits of dense_quant_q8x on that output; not gated, in the accumulate mode with the
    next RMS norm, that norm's dense_quant_q8x within F32 roundings. Failures (0 or 1)."""
    from gpu_timing import knobs

    from ggml_attn import matmul_dispatch
    from ggml_attn.block_types import block_layout
    from ggml_attn.graph import q8_matmul
    from ggml_attn.graph.model_device import QMatrix
    from ggml_attn.quant import dequantize_rows, q8_activations, quantize
    lay = block_layout(name)
    qs = [quantize((rng.standard_normal((rows, n_in)) * 10.0 ** rng.uniform(-3, 3, (rows, 1))).astype(np.float32),
                   lay.type_id) for _ in range(2)]   # gate, up
    vals = [dequantize_rows(q.ctypes.data, lay.type_id, n_in, rows, q.shape[1]).astype(np.float64) for q in qs]
    g = rng.uniform(0.3, 1.7, n_in).astype(np.float32)
    x = (rng.standard_normal((1, n_in)) * 30.0).astype(np.float32)
    mode = 2 if gated else 1 if qout else 0
    init = (rng.standard_normal((1, rows)) * 3.0).astype(np.float32)
    d_out = cp.asarray(init) if mode == 1 else cp.full((1, rows), np.nan, np.float32)
    q8 = (cp.zeros((1, n_in), np.int8), cp.zeros((1, n_in // 32), np.float32), cp.zeros((1, n_in // 32), np.float32))
    out_q = q8_matmul.q8_out_arrays(cp, 1, rows) if qout else None
    g_out = cp.asarray(rng.uniform(0.3, 1.7, rows).astype(np.float32)) if mode == 1 else None
    if qout:
        out_q[0].fill(77), out_q[1].fill(np.nan), out_q[2].fill(np.nan)
    with knobs(matmul_dispatch, GEMV_ONE_TYPES=() if gated else (name,), GEMV_SPLIT_TYPES=(name,) if split else ()):
        run = q8_matmul.q8x_launches([QMatrix(name, (rows, n_in), cp.asarray(q)) for q in qs[:1 + gated]],
                                     cp.asarray(x), [d_out], *q8, mode=mode, norm_eps=1e-5, norm_w=cp.asarray(g),
                                     form=form, out_q=out_q, out_norm=(g_out, 1e-5))
    if run is None:
        print(f"gemv_q8x {name:5s} n_in={n_in:5d} ({form}) refused FAIL")
        return 1
    run()
    same = True
    if qout:   # (its 8-bit form against dense_quant_q8x of the same output; the counters back at 0)
        want = (cp.empty((1, rows), np.int8), cp.empty((1, rows // 32), np.float32), cp.empty((1, rows // 32), np.float32))
        q8_matmul.quant_q8x_launch(lay.type_id, d_out, *want, norm_eps=1e-5 if mode == 1 else None, norm_w=g_out)()
        if mode == 2:
            same = all(bool((a == b).all()) for a, b in zip(out_q[:3], want))
        else:
            same = int(cp.abs(out_q[0].astype(cp.int32) - want[0]).max()) <= 1 and \
                float(cp.abs(out_q[1] / want[1] - 1.0).max()) <= 2e-6
        same = same and not bool(out_q[3].any()) and not bool(out_q[5].any())
    cp.cuda.get_current_stream().synchronize()
    got = d_out.get()
    v = (x * g) * (1.0 / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-5)).astype(np.float32)
    gate, up = (q8_activations(v) @ w.T for w in vals)
    err = nmse(got, gate / (1.0 + np.exp(-gate)) * up if gated else init + gate if mode == 1 else gate)
    ok = bool(np.isfinite(got).all()) and err < 1e-5 and same
    form = form or ("staged" if lay.row_bytes(n_in) % 16 == 0 else "plain")
    what = ("gated+qout" if qout else "gated") if gated else ("add+qout" if qout else "split" if split else "one")
    print(f"gemv_q8x {name:5s} n_in={n_in:5d} ({form}) {what}+norm nmse={err:.2e} {'ok' if ok else 'FAIL'}")
    return 0 if ok else 1


def _rope_store(cp, rng) -> int:
    """cuda/model_ops.cu's xp_rope_store (NEOX pairs, partial rotation, biases) against xp_rope
    then the rows stored by hand: Q bit-equal, the F16 / F32 cache rows bit-equal at the tokens'
    rows (scattered, not in order), every other row left as poisoned. Failures."""
    import ctypes

    from ggml_attn import kernels as K
    from ggml_attn.graph.xp_node import dptr as d
    n_tok, nh_q, nh_k, D, n_dims = 5, 4, 2, 64, 48
    pos = cp.asarray(rng.integers(0, 4000, n_tok).astype(np.int32))
    rows = cp.asarray(np.array([9, 2, 14, 0, 7], dtype=np.int64))
    xq, xk = (cp.asarray(rng.standard_normal((n_tok, nh, D)).astype(np.float32)) for nh in (nh_q, nh_k))
    xv = cp.asarray(rng.standard_normal((n_tok, nh_k * D)).astype(np.float32))
    bq, bk, bv = (cp.asarray(rng.standard_normal(n).astype(np.float32)) for n in (nh_q * D, nh_k * D, nh_k * D))
    ff = cp.asarray(rng.uniform(0.5, 2.0, n_dims // 2).astype(np.float32))
    ts, fs, bad = np.float32(10000.0) ** np.float32(-2.0 / n_dims), np.float32(0.5), 0
    tail = (ctypes.c_int32(D), ctypes.c_int32(n_dims), ctypes.c_int32(1), ctypes.c_float(ts), ctypes.c_float(fs))
    yq, yk = cp.empty_like(xq), cp.empty_like(xk)
    K.grid_launch(K.get_function(K.model_ops_variant(), "xp_rope"), yq.size + yk.size,
                  d(xq), d(yq), d(bq), ctypes.c_int32(nh_q), ctypes.c_int64(xq.size),
                  d(xk), d(yk), d(bk), ctypes.c_int32(nh_k), ctypes.c_int64(xk.size), d(pos), d(ff), *tail)()
    for dtype in (np.float16, np.float32):
        ck, cv = (cp.full((16, nh_k * D), np.nan, dtype) for _ in range(2))
        gq = cp.full_like(xq, np.nan)
        K.grid_launch(K.get_function(K.model_ops_variant(), "xp_rope_store"), xq.size + xk.size + xv.size,
                      d(xq), d(gq), d(bq), ctypes.c_int32(nh_q), ctypes.c_int64(xq.size),
                      d(xk), d(bk), ctypes.c_int32(nh_k), ctypes.c_int64(xk.size),
                      d(xv), d(bv), ctypes.c_int32(nh_k * D), ctypes.c_int64(xv.size),
                      d(ck), ctypes.c_int32(dtype == np.float16), d(cv), ctypes.c_int32(dtype == np.float16),
                      d(rows), d(pos), d(ff), *tail)()
        cp.cuda.get_current_stream().synchronize()
        want_k, want_v = (cp.full((16, nh_k * D), np.nan, dtype) for _ in range(2))
        want_k[rows] = yk.reshape(n_tok, -1).astype(dtype)
        want_v[rows] = (xv + bv).astype(dtype)
        ok = all(np.array_equal(a.get(), b.get(), equal_nan=True) for a, b in ((gq, yq), (ck, want_k), (cv, want_v)))
        bad += not ok
        print(f"xp_rope_store {np.dtype(dtype).name} cache: {'ok' if ok else 'FAIL'}")
    return bad


def _dense_q(cp, rng) -> int:
    """cuda/dense_q.cu on every weight block type: dense_gemv_q (1 and 16 tokens, RMS norm with
    its weight, gate and up in one launch, 45 rows: a partial block of warps; at 1 token also
    the 8-bit-activation GEMV of cuda/dense_q8x.cu), dense_dequant_f16 and dense_get_rows_q, each against float64 of ggml's dequantized values; dense_gemm_q (20 and 70
    tokens, n_in split: dense_splitk_sum) and the staged dense_gemm_qs (both tiles) against float64
    of their F16-rounded operands (and dense_gemm_qr for its types), and dense_gemm_q8 against
    float64 of its quantized activations.
    Failures."""
    import ctypes

    from ggml_attn import kernels as K
    from ggml_attn.block_types import BLOCK_TYPES, block_layout
    from ggml_attn.cuda_device import num_sms
    from ggml_attn.graph import q8_matmul, xp_matmul
    from ggml_attn.graph.model_device import QMatrix
    from ggml_attn.quant import dequantize_rows, q8_activations, quantize
    bad = 0
    st = cp.cuda.get_current_stream()

    def launch(type_id, name, grid, block, *params):
        args = K.arg_block(*params)
        K.get_function(K.dense_q_variant(type_id), name).launch_raw(grid, block, st.ptr, ctypes.addressof(args))
        st.synchronize()
    for name in BLOCK_TYPES:
        lay = block_layout(name)
        n_in, rows = 2 * 256 + lay.values, 45
        ws = []
        for _ in range(2):   # gate, up
            w = rng.standard_normal((rows, n_in)) * 10.0 ** rng.uniform(-3, 3, (rows, 1))
            q = quantize(w.astype(np.float32), lay.type_id)
            ws.append((q, dequantize_rows(q.ctypes.data, lay.type_id, n_in, rows, q.shape[1]).astype(np.float64)))
        d_ws = [cp.asarray(q) for q, _ in ws]
        g = rng.uniform(0.3, 1.7, n_in).astype(np.float32)
        d_g = cp.asarray(g)
        for n_tok in (1, 16):
            x = (rng.standard_normal((n_tok, n_in)) * 30.0).astype(np.float32)
            d_x, d_out = cp.asarray(x), cp.full((n_tok, rows), np.nan, np.float32)
            p = K.GemvQParams()
            for i, w in enumerate(d_ws):
                p.seg[i].w, p.seg[i].rows, p.seg[i].out = w.data.ptr, rows, d_out.data.ptr
            p.x, p.x_stride, p.g, p.row_bytes = d_x.data.ptr, n_in, d_g.data.ptr, d_ws[0].shape[1]
            p.n_in, p.n_tok, p.n_seg, p.mode, p.norm_eps = n_in, n_tok, 2, 2, 1e-5
            launch(lay.type_id, K.gemv_q_name(lay.type_id, n_tok), (-(-rows // K.GEMVQ_WARPS), 1, 1),
                   (32 * K.GEMVQ_WARPS, 1, 1), p)
            xs = x.astype(np.float64)
            xs = xs / np.sqrt((xs ** 2).mean(axis=1, keepdims=True) + 1e-5) * g
            gate, up = (xs @ v.T for _, v in ws)
            got, want = d_out.get(), gate / (1.0 + np.exp(-gate)) * up
            err = nmse(got, want)
            ok = bool(np.isfinite(got).all()) and err < 1e-6
            bad += not ok
            print(f"gemv_q   {name:5s} n_tok={n_tok:2d} gated+norm nmse={err:.2e} {'ok' if ok else 'FAIL'}")
        for n in (n_in, _staged_n_in(lay)):   # the 8-bit-activation GEMV: rows of any alignment, and staged
            bad += _q8x_gated(cp, rng, name, n, rows)
        if name in K.Q8XV_TYPES:   # its vector form on the staged case's rows (each instance)
            for gated, split in ((True, False), (False, False), (False, True)):
                bad += _q8x_gated(cp, rng, name, _staged_n_in(lay), rows, "vector", gated, split)
            for gated, split in ((True, False), (False, True)):   # its output's 8-bit form (gated; accumulated, normalized)
                bad += _q8x_gated(cp, rng, name, _staged_n_in(lay), 96, "vector", gated, split, qout=True)
        if name in K.Q8XR_TYPES:   # the ring form, its grid as on one SM: several rows a warp
            import ggml_attn.cuda_device as cd
            sms, cd.num_sms = cd.num_sms, lambda: 1
            try:
                for gated in (True, False):
                    bad += _q8x_gated(cp, rng, name, _staged_n_in(lay), rows, "ring", gated)
                for gated in (True, False):
                    bad += _q8x_gated(cp, rng, name, _staged_n_in(lay), 96, "ring", gated, qout=True)
            finally:
                cd.num_sms = sms
        q, vals = ws[0]
        d_q, out = d_ws[0], cp.full((rows, n_in), np.nan, np.float16)
        launch(lay.type_id, f"dense_dequant_f16<{lay.type_id}>", (2, 1, 1), (256, 1, 1),   # a grid of 2 blocks (looping)
               ctypes.c_uint64(d_q.data.ptr), ctypes.c_uint64(out.data.ptr), ctypes.c_int64(q.shape[1]),
               ctypes.c_int32(n_in), ctypes.c_int64(rows))
        ids = np.array([5, 0, rows - 1, 5], dtype=np.int32)
        d_ids, got_rows = cp.asarray(ids), cp.full((len(ids), n_in), np.nan, np.float32)
        launch(lay.type_id, f"dense_get_rows_q<{lay.type_id}>", (-(-len(ids) * n_in // 32 // 256), 1, 1), (256, 1, 1),
               ctypes.c_uint64(d_q.data.ptr), ctypes.c_uint64(d_ids.data.ptr), ctypes.c_uint64(got_rows.data.ptr),
               ctypes.c_int64(q.shape[1]), ctypes.c_int32(n_in), ctypes.c_int64(len(ids)))
        e16, er = nmse(out.get().astype(np.float64), vals), nmse(got_rows.get().astype(np.float64), vals[ids])
        ok = e16 < 1e-6 and er < 1e-12
        bad += not ok
        print(f"dequant  {name:5s} f16 nmse={e16:.2e} get_rows nmse={er:.2e} {'ok' if ok else 'FAIL'}")
        for n_tok in (20, 70):   # the tiled GEMM: split over n_in (partials + dense_splitk_sum), 2 token tiles
            x16 = (rng.standard_normal((n_tok, n_in)) * 3.0).astype(np.float16)
            d_out = cp.full((n_tok, rows), np.nan, np.float32)
            grid, _ = K.gemm_q_grid(rows, n_tok, n_in, num_sms())
            part = cp.full((grid[2], n_tok, rows), np.nan, np.float32) if grid[2] > 1 else None
            xp_matmul.gemm_q_launch(QMatrix(name, (rows, n_in), d_q), cp.asarray(x16), d_out, part)()
            st.synchronize()
            err = nmse(d_out.get(), x16.astype(np.float64) @ vals.astype(np.float16).astype(np.float64).T)
            ok = err < 1e-6
            bad += not ok
            print(f"gemm_q   {name:5s} n_tok={n_tok:2d} splits={grid[2]} nmse={err:.2e} {'ok' if ok else 'FAIL'}")
        # the int8 GEMM (rows of whole 16-byte units: 8 steps of 256 values, and for Q4_1 / Q5_1
        # a last step part empty; split over n_in) against its quantized activations
        extra = next((m for m in range(1, 8) if m * lay.nbytes % 16 == 0), 0) if lay.values == 32 else 0
        n8 = 8 * 256 + 32 * extra
        q8w = quantize((rng.standard_normal((rows, n8)) * 10.0 ** rng.uniform(-3, 3, (rows, 1))).astype(np.float32),
                       lay.type_id)
        vals8 = dequantize_rows(q8w.ctypes.data, lay.type_id, n8, rows, q8w.shape[1]).astype(np.float64)
        w8 = QMatrix(name, (rows, n8), cp.asarray(q8w))
        for n_tok in (20, 70):
            x = (rng.standard_normal((n_tok, n8)) * 3.0).astype(np.float32)
            q8 = (cp.zeros((n_tok, n8), np.int8), cp.zeros((n_tok, n8 // 32), np.float32),
                  cp.zeros((n_tok, n8 // 32), np.float32))
            d_out = cp.full((n_tok, rows), np.nan, np.float32)
            grid, _ = K.gemm_q_grid(rows, n_tok, n8, num_sms(), "dense_gemm_q8")
            part = cp.full((grid[2], n_tok, rows), np.nan, np.float32) if grid[2] > 1 else None
            q8_matmul.quant_q8x_launch(lay.type_id, cp.asarray(x), *q8)()
            q8_matmul.gemm_q8_launch(w8, *q8, d_out, part)()
            st.synchronize()
            err = nmse(d_out.get(), q8_activations(x) @ vals8.T)
            ok = err < 1e-5
            bad += not ok
            print(f"gemm_q8  {name:5s} n_tok={n_tok:2d} splits={grid[2]} nmse={err:.2e} {'ok' if ok else 'FAIL'}")
        # the staged F16 GEMMs on the same rows, both tiles: dense_gemm_qs, and for its types dense_gemm_qr
        staged = ("dense_gemm_qs", "dense_gemm_qr") if name in K.GEMMQR_TYPES else ("dense_gemm_qs",)
        staged += ("dense_gemm_qrm",) if name in K.GEMMQR_TYPES and K.device_arch() == "sm_90" else ()
        for kernel in staged:
            tiles = ((20, None), (70, None), (70, 32)) if kernel != "dense_gemm_qrm" else ((20, None), (70, None))
            for n_tok, bn in tiles:
                x16 = (rng.standard_normal((n_tok, n8)) * 3.0).astype(np.float16)
                bad += not _staged_gemm_ok(cp, kernel, w8, vals8, x16, bn)
                if kernel in K.GEMMQR_KERNELS and bn is None:   # the fused split finish's program
                    bad += not _staged_gemm_ok(cp, kernel, w8, vals8, x16, bn, finish=True)
        if "dense_gemm_qrm" in staged:   # the gated form (dense_gemm_qrg): these rows as the gate and, reversed, the up
            wu8 = QMatrix(name, (rows, n8), cp.asarray(q8w[::-1].copy()))
            for n_tok in (20, 70):
                x16 = (rng.standard_normal((n_tok, n8)) * 3.0).astype(np.float16)
                for finish in (False, True):
                    bad += not _gated_gemm_ok(cp, w8, wu8, vals8, vals8[::-1], x16, finish)
    return bad


def _gated_gemm_ok(cp, wg, wu, vg, vu, x16, finish: bool = False) -> bool:
    """One dense_gemm_qrg launch (graph/tiled_gemm.gemm_qrg_launch) over gate ``wg`` and up ``wu``
    (float64 values ``vg``, ``vu``) and F16 ``x16`` into a poisoned output, its F16 form and
    partial sums (where gemm_q_grid splits n_in), against float64 silu(gate) * up of the
    F16-rounded operands (NMSE < 1e-6); ``finish``: with tile counters (the fused split finish),
    left zero; prints the row."""
    from ggml_attn import kernels as K
    from ggml_attn.cuda_device import num_sms
    from ggml_attn.graph import tiled_gemm
    (rows, n_in), n_tok = wg.shape, x16.shape[0]
    d_out = cp.full((n_tok, rows), np.nan, np.float32)
    d16 = cp.full((n_tok, rows), np.nan, np.float16)
    grid, _ = K.gemm_q_grid(rows, n_tok, n_in, num_sms(), "dense_gemm_qrg")
    part = cp.full((grid[2], 2, n_tok, rows), np.nan, np.float32) if grid[2] > 1 else None
    done = cp.zeros(grid[0] * grid[1], np.uint32) if finish else None
    tiled_gemm.gemm_qrg_launch(wg, wu, cp.asarray(x16), d_out, d16, part, done=done)()
    cp.cuda.get_current_stream().synchronize()
    xs = x16.astype(np.float64)
    g, u = (xs @ v.astype(np.float16).astype(np.float64).T for v in (vg, vu))
    got = d_out.get()
    err = nmse(got, g / (1.0 + np.exp(-g)) * u)
    ok = err < 1e-6 and bool((d16.get() == got.astype(np.float16)).all()) and (done is None or not done.get().any())
    print(f"gemm_qrg {wg.type:5s} n_tok={n_tok:3d} splits={grid[2]} finish={finish} nmse={err:.2e} "
          f"{'ok' if ok else 'FAIL'}")
    return ok


def _staged_gemm_ok(cp, kernel: str, w, vals, x16, bn=None, finish: bool = False) -> bool:
    """One launch of staged tiled block GEMM ``kernel`` (graph/tiled_gemm.gemm_q_launch, tile ``bn``)
    over QMatrix ``w`` (float64 values ``vals``) and F16 ``x16`` into a poisoned output (and
    partial sums, where gemm_q_grid splits n_in), against float64 of the F16-rounded operands
    (NMSE < 1e-6); prints the row."""
    from ggml_attn import kernels as K
    from ggml_attn.cuda_device import num_sms
    from ggml_attn.graph import xp_matmul
    (rows, n_in), n_tok = w.shape, x16.shape[0]
    d_out = cp.full((n_tok, rows), np.nan, np.float32)
    grid, _ = K.gemm_q_grid(rows, n_tok, n_in, num_sms(), kernel, bn)
    part = cp.full((grid[2], n_tok, rows), np.nan, np.float32) if grid[2] > 1 else None
    done = cp.zeros(grid[0] * grid[1], np.uint32) if finish else None
    xp_matmul.gemm_q_launch(w, cp.asarray(x16), d_out, part, kernel=kernel, bn=bn, done=done)()
    cp.cuda.get_current_stream().synchronize()
    err = nmse(d_out.get(), x16.astype(np.float64) @ vals.astype(np.float16).astype(np.float64).T)
    ok = err < 1e-6 and (done is None or not done.get().any())
    print(f"{kernel[6:]:8s} {w.type:5s} n_tok={n_tok:3d} bn={bn} splits={grid[2]}{' finish' if finish else ''} "
          f"nmse={err:.2e} {'ok' if ok else 'FAIL'}")
    return ok


def _dense_qw(cp, rng) -> int:
    """cuda/dense_qw.cu (sm_90a) on each type it reads: dense_gemm_qw's forms (kernels.GEMMQW_FORMS:
    its 256-row tile where it fits, the half-precision decode) over 300 rows (a partial row tile) at
    138 tokens (a second token tile of 10), n_in 2048 split in two k chunks (partial sums,
    dense_splitk_sum), against float64 of its F16-rounded operands (:func:`_staged_gemm_ok`: the
    half forms' values within NMSE 1e-6 of those). Failures."""
    from ggml_attn import kernels as K
    from ggml_attn.block_types import block_layout
    from ggml_attn.graph.model_device import QMatrix
    from ggml_attn.quant import dequantize_rows, quantize
    bad, rows, n_in, n_tok = 0, 300, 2048, 138
    for name in K.GEMMQR_TYPES:
        lay = block_layout(name)
        q = quantize((rng.standard_normal((rows, n_in)) * 10.0 ** rng.uniform(-3, 3, (rows, 1))).astype(np.float32),
                     lay.type_id)
        vals = dequantize_rows(q.ctypes.data, lay.type_id, n_in, rows, q.shape[1]).astype(np.float64)
        x16 = (rng.standard_normal((n_tok, n_in)) * 3.0).astype(np.float16)
        w = QMatrix(name, (rows, n_in), cp.asarray(q))
        for kernel in (k for k in K.GEMMQW_FORMS if K.qw_instance(lay.type_id, k)):
            bad += not _staged_gemm_ok(cp, kernel, w, vals, x16)
    return bad


if __name__ == "__main__":
    main()
