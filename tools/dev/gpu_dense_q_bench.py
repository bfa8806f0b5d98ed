"""Device time of one llama-3-8B layer's projections over weights kept in ggml's blocks (issue
#43): per block type, the GEMV (``cuda/dense_q.cu`` dense_gemv_q, one launch per matrix) at 1..16
tokens (and the 8-bit-activation GEMV, ``cuda/dense_q8x.cu``), and the GEMM paths: ``dense_dequant_f16``
into an F16 scratch then cuBLAS, the tiled ``dense_gemm_q`` (with its split-K sums), its staged
form ``dense_gemm_qs`` and its int8 twin ``dense_gemm_q8`` (the activations' quantization included) -- the GEMV's bandwidth against the
4.2 TB/s floor, and the crossovers (``matmul_dispatch.QGEMM_MAX_TOKENS``: where the tiled GEMM stops winning).

    python tools/dev/gpu_dense_q_bench.py [--types Q4_K,Q6_K,Q8_0] [--warps 8,4,16] [--max-tokens 512]
                                          [--tiled-only 16,32,64] [--dequant-only 128,512 [--dequant-alone]] [--out F.json]

Weights: two layers' seven matrices each (rotated: 2 x 0.25-0.46 GB, well over the 60 MB L2),
rows of blocks ggml quantized from random values (a pool of rows repeated). Floor: the blocks'
bytes / 4.2 TB/s. Device time as tools/dev/gpu_timing.py measures it.
"""
from __future__ import annotations

import argparse
import json
import sys

N_EMBD, N_KV, N_FF = 4096, 1024, 14336
SHAPES = dict(wq=(N_EMBD, N_EMBD), wk=(N_KV, N_EMBD), wv=(N_KV, N_EMBD), wo=(N_EMBD, N_EMBD),
              wg=(N_FF, N_EMBD), wu=(N_FF, N_EMBD), wd=(N_EMBD, N_FF))
GEMV_TOKENS = (1, 2, 4, 8, 16)
GEMM_TOKENS = (16, 32, 64, 128, 256, 512)   # dequantize + cuBLAS; the tiled GEMM runs at every count


def _layer(cp, type_name: str, seed: int) -> dict:
    """{name: QMatrix} of one layer: each matrix's rows drawn from 64 rows ggml quantized."""
    import numpy as np

    from ggml_attn.block_types import block_layout
    from ggml_attn.graph.model_device import QMatrix
    from ggml_attn.quant import quantize
    lay = block_layout(type_name)
    rng = np.random.default_rng(seed)
    out = {}
    for name, (n_out, n_in) in SHAPES.items():
        pool = quantize((rng.standard_normal((64, n_in)) * 0.02).astype(np.float32), lay.type_id)
        blocks = cp.asarray(pool)[cp.asarray(rng.integers(0, 64, n_out))]
        out[name] = QMatrix(type_name, (n_out, n_in), blocks,
                            scratch=cp.empty(max(N_FF, N_EMBD) * N_EMBD, cp.float16))
    return out


def _cublas_f16(cp, ws: dict, x16, xf16):
    """One layer by cuBLAS alone on F16 matrices (each weight's scratch, whatever it holds): the F16
    file's GEMMs, the bound of the block GEMMs' targets."""
    steps = [(w.scratch[: w.shape[0] * w.shape[1]].reshape(w.shape), xf16 if k == "wd" else x16) for k, w in ws.items()]

    def go():
        for a, xx in steps:
            cp.matmul(xx, a.T)
    return go


def _shipped_gemm(cp, K, ws: dict, x16, xf16):
    """One layer by path ``gemm`` as the model runs it, into outputs of its own."""
    outs = {k: cp.empty((x16.shape[0], w.shape[0]), cp.float32) for k, w in ws.items()}
    return _dequant_gemm(cp, K, ws, x16, xf16, outs)


def _dequant_gemm(cp, K, ws: dict, x16, xf16, outs: dict, gemm: bool = True):
    """One layer as the model runs path ``gemm`` (graph/path_gemm.py's dequant_gemm_launches): per
    matrix and chunk of rows the dequantization into the matrix's scratch and cuBLAS's F32-output
    GEMM into the chunk's columns of ``outs[name]``; ``gemm=False``: the dequantizations alone."""
    from ggml_attn.graph.path_gemm import dequant_gemm_launches
    pairs = [p for k, w in ws.items() for p in dequant_gemm_launches(w, xf16 if k == "wd" else x16, outs[k])]
    return K.then(*(s for p in pairs for s in (p if gemm else p[:1])))


def _dequant_rows(cp, K, device_us, t: str, layers, tokens, nbytes, floor, rows, log, alone: bool = False):
    """Path ``gemm`` at ``tokens``: the dequantization alone (its read and write bandwidth; ``alone``:
    only that), with cuBLAS, and cuBLAS on the F16 matrices alone."""
    f16_bytes = 2 * sum(a * b for a, b in SHAPES.values())
    for n in tokens:
        x16 = cp.random.standard_normal((n, N_EMBD), dtype=cp.float32).astype(cp.float16)
        xf16 = cp.random.standard_normal((n, N_FF), dtype=cp.float32).astype(cp.float16)
        outs = {k: cp.empty((n, s[0]), cp.float32) for k, s in SHAPES.items()}
        cases = [("dequant alone", lambda ws: _dequant_gemm(cp, K, ws, x16, xf16, outs, gemm=False))]
        if not alone:
            cases += [("dequant+gemm", lambda ws: _dequant_gemm(cp, K, ws, x16, xf16, outs)),
                      ("cublas f16", lambda ws: _cublas_f16(cp, ws, x16, xf16))]
        for impl, make in cases:
            med, lo, hi = device_us([make(ws) for ws in layers])
            moved = (nbytes + f16_bytes) / med / 1e6   # blocks read + halves written, TB/s
            rows.append(dict(case=f"dense_q: 8B layer {t}", impl=impl, n_tok=n, us=round(med, 2),
                             us_min=round(lo, 2), us_max=round(hi, 2), floor_us=round(floor, 1),
                             tbps_rw=round(moved, 2)))
            log(f"{t:5s} {impl:15s} n_tok={n:3d} {med:9.1f} us ({moved:.2f} TB/s of blocks read + halves written)")


def _tiled(cp, K, ws: dict, x16, xf16, n_sm: int, gemm_q_launch, kernel: str = "dense_gemm_q", bn=None):
    """One layer by F16 tiled block GEMM ``kernel`` (dense_gemm_q, or the staged dense_gemm_qs with
    tile ``bn``) and, split over n_in, dense_splitk_sum."""
    steps = []
    for k, w in ws.items():
        n = x16.shape[0]
        grid, _ = K.gemm_q_grid(w.shape[0], n, w.shape[1], n_sm, kernel, bn if kernel != "dense_gemm_q" else None)
        part = cp.empty((grid[2], n, w.shape[0]), cp.float32) if grid[2] > 1 else None
        steps.append(gemm_q_launch(w, xf16 if k == "wd" else x16, cp.empty((n, w.shape[0]), cp.float32), part,
                                   kernel=kernel, bn=bn))

    def go():
        for s in steps:
            s()
    return go


def _tiled_q8(cp, K, ws: dict, n: int, n_sm: int):
    """One layer by the tiled GEMM on int8 tensor cores: each matrix's activations quantized
    (dense_quant_q8x), then dense_gemm_q8 (and, split over n_in, dense_splitk_sum)."""
    from ggml_attn.graph.q8_matmul import gemm_q8_launch, quant_q8x_launch
    steps = []
    for w in ws.values():
        n_out, n_in = w.shape
        x = cp.random.standard_normal((n, n_in), dtype=cp.float32)
        q8 = (cp.empty((n, n_in), cp.int8), cp.empty((n, n_in // 32), cp.float32), cp.empty((n, n_in // 32), cp.float32))
        grid, _ = K.gemm_q_grid(n_out, n, n_in, n_sm, "dense_gemm_q8")
        part = cp.empty((grid[2], n, n_out), cp.float32) if grid[2] > 1 else None
        steps += [quant_q8x_launch(w.type_id, x, *q8), gemm_q8_launch(w, *q8, cp.empty((n, n_out), cp.float32), part)]

    def go():
        for s in steps:
            s()
    return go


def _q8x(cp, K, ws: dict, n: int, q8x_launches, form: str = "staged", quantize: bool = True):
    """One layer by the 8-bit-activation GEMV: each matrix's activations quantized (not with
    ``quantize=False``: the GEMV alone), then its GEMV in ``form`` (kernels.Q8X_FORMS; "<form>-one":
    its one-operand instance, matmul_dispatch.GEMV_ONE_TYPES; "vector-split": every matrix on two
    warps a row, GEMV_SPLIT_TYPES)."""
    from gpu_timing import knobs

    from ggml_attn import matmul_dispatch
    split = form.endswith("-split")
    with knobs(matmul_dispatch, GEMV_ONE_TYPES=K.Q8XV_TYPES if form.endswith("-one") else (),
               GEMV_SPLIT_TYPES=K.Q8XV_TYPES if split else (), GEMV_SPLIT_MAX_ROWS=1 << 30 if split else 0):
        return _q8x_steps(cp, ws, n, q8x_launches, form.removesuffix("-one").removesuffix("-split"), quantize)


def _q8x_steps(cp, ws: dict, n: int, q8x_launches, form: str, quantize: bool):
    """:func:`_q8x`'s launches (every one made now: the instance is chosen here)."""
    steps = []
    for k, w in ws.items():
        n_in = w.shape[1]
        x = cp.random.standard_normal((n, n_in), dtype=cp.float32)
        xq, xd, xs = (cp.empty((n, n_in), cp.int8), cp.empty((n, n_in // 32), cp.float32),
                      cp.empty((n, n_in // 32), cp.float32))
        if not quantize:   # (quantized once: the GEMV reads real scales)
            q8x_launches([w], x, [cp.empty((n, w.shape[0]), cp.float32)], xq, xd, xs, mode=0, form=form)()
        run = q8x_launches([w], x, [cp.empty((n, w.shape[0]), cp.float32)], xq, xd, xs, mode=0, form=form,
                           quantize=quantize)
        assert run is not None, f"the llama-3-8B shapes fit the {form} dense_gemv_q8x"
        steps.append(run)

    def go():
        for s in steps:
            s()
    return go


def _q8x_rows(cp, K, device_us, t, layers, nbytes, floor, rows, log):
    """The 8-bit-activation GEMV's rows: one layer in each form that reads type ``t``
    (kernels.Q8X_FORMS: staged ships, plain, vector, ring; the vector and ring forms' one-operand
    instances as "vector-one" / "ring-one": every launch here is mode 0; the vector form's rows on
    two warps as "vector-split", at one token) at each of its instances' tokens, with the
    quantization and without (" noquant"), then each matrix alone at one token without it."""
    from ggml_attn.graph.q8_matmul import q8x_launches
    forms = [f for f in K.Q8X_FORMS if K.q8x_form_reads(f, t)]
    forms += [f"{f}-one" for f in forms if f in K.Q8X_GATED_FORMS] + [f"{f}-split" for f in K.Q8X_SPLIT_TOKENS if f in forms]
    for form in forms:
        split = form.endswith("-split")
        for n in K.Q8X_SPLIT_TOKENS[form.removesuffix("-split")] if split else K.Q8X_FORMS[form.removesuffix("-one")][1]:
            for quant in (True, False):
                impl = "gemv q8x" + ("" if form == "staged" else f" {form}") + ("" if quant else " noquant")
                med, lo, hi = device_us([_q8x(cp, K, ws, n, q8x_launches, form, quant) for ws in layers])
                rows.append(dict(case=f"dense_q: 8B layer {t}", impl=impl, n_tok=n, us=round(med, 2),
                                 us_min=round(lo, 2), us_max=round(hi, 2), tbps=round(nbytes / med / 1e6, 2),
                                 floor_us=round(floor, 1), mb=round(nbytes / 1e6, 1)))
                log(f"{t:5s} {impl:24s} n_tok={n:3d} {med:9.1f} us {nbytes / med / 1e6:.2f} TB/s (floor {floor:.0f} us)")
    for form in forms:
        for k in SHAPES:   # each matrix alone at one token, without the quantization
            mb = layers[0][k].nbytes
            impl = "gemv q8x" + ("" if form == "staged" else f" {form}") + " noquant"
            med, lo, hi = device_us([_q8x(cp, K, {k: ws[k]}, 1, q8x_launches, form, False) for ws in layers])
            rows.append(dict(case=f"dense_q: 8B {t} {k}", impl=impl, n_tok=1, us=round(med, 2),
                             us_min=round(lo, 2), us_max=round(hi, 2), tbps=round(mb / med / 1e6, 2),
                             floor_us=round(mb / 4.2e6, 1), mb=round(mb / 1e6, 1)))
            log(f"{t:5s} {k} alone: {impl:24s} {med:7.1f} us {mb / med / 1e6:.2f} TB/s (floor {mb / 4.2e6:.1f} us)")


def run(device_us, types=("Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q5_K"), log=print, warps=(8, 4, 16),
        rows: list | None = None, max_tokens: int = 512, tiled_only: tuple | None = None,
        q8x_only: bool = False, dequant_only: tuple | None = None, dequant_alone: bool = False) -> list[dict]:
    """The rows (appended to ``rows`` as they are measured: ``log`` after each can save them);
    ``tiled_only``: just the tiled GEMMs' rows at these token counts; ``q8x_only``: just the
    8-bit-activation GEMV's; ``dequant_only``: just path gemm's A/Bs at these token counts (any
    of the three together: those)."""
    import cupy as cp

    from ggml_attn import kernels as K
    from ggml_attn.cuda_device import num_sms
    from ggml_attn.graph.xp_matmul import gemm_q_launch, gemv_q_launch
    rows = [] if rows is None else rows
    nbytes_vals = sum(a * b for a, b in SHAPES.values())   # weights (multiply-adds a token)
    for t in types:
        layers = [_layer(cp, t, s) for s in range(2)]
        nbytes = sum(w.nbytes for w in layers[0].values())
        floor = nbytes / 4.2e6
        if q8x_only or tiled_only or dequant_only:
            if dequant_only:
                _dequant_rows(cp, K, device_us, t, layers, dequant_only, nbytes, floor, rows, log, dequant_alone)
            if q8x_only:
                _q8x_rows(cp, K, device_us, t, layers, nbytes, floor, rows, log)
            if tiled_only:
                _tiled_rows(cp, K, device_us, t, layers, tiled_only, nbytes, nbytes_vals, floor, rows, log)
            del layers
            cp.get_default_memory_pool().free_all_blocks()
            continue
        for n in (t_ for t_ in GEMV_TOKENS if t_ <= max_tokens):
            x = cp.random.standard_normal((n, N_EMBD), dtype=cp.float32)
            xf = cp.random.standard_normal((n, N_FF), dtype=cp.float32)
            outs = {k: cp.empty((n, s[0]), cp.float32) for k, s in SHAPES.items()}

            def layer_fn(ws, w_):
                steps = [gemv_q_launch([w], xf if k == "wd" else x, [outs[k]], mode=0, warps=w_) for k, w in ws.items()]
                assert all(steps), "the llama-3-8B shapes fit dense_gemv_q"

                def go():
                    for s in steps:
                        s()
                return go
            for wp in warps:   # the shipped block (GEMVQ_WARPS) and the A/B instances that have n tokens
                if wp != K.GEMVQ_WARPS and n > max(K.GEMVQ_WARPS_X.get(wp, (0,))):
                    continue
                med, lo, hi = device_us([layer_fn(ws, wp) for ws in layers])
                impl = "gemv" if wp == K.GEMVQ_WARPS else f"gemv w{wp}"
                rows.append(dict(case=f"dense_q: 8B layer {t}", impl=impl, n_tok=n, us=round(med, 2),
                                 us_min=round(lo, 2), us_max=round(hi, 2), tbps=round(nbytes / med / 1e6, 2),
                                 floor_us=round(floor, 1), mb=round(nbytes / 1e6, 1)))
                log(f"{t:5s} {impl:8s} n_tok={n:3d} {med:9.1f} us {nbytes / med / 1e6:.2f} TB/s (floor {floor:.0f} us)")
        _q8x_rows(cp, K, device_us, t, layers, nbytes, floor, rows, log)
        for n in sorted(t_ for t_ in set(GEMV_TOKENS) | set(GEMM_TOKENS) if t_ <= max_tokens):
            x16 = cp.random.standard_normal((n, N_EMBD), dtype=cp.float32).astype(cp.float16)
            xf16 = cp.random.standard_normal((n, N_FF), dtype=cp.float32).astype(cp.float16)
            if n in GEMM_TOKENS:
                med, lo, hi = device_us([_shipped_gemm(cp, K, ws, x16, xf16) for ws in layers])
                rows.append(dict(case=f"dense_q: 8B layer {t}", impl="dequant+cublas", n_tok=n, us=round(med, 2),
                                 us_min=round(lo, 2), us_max=round(hi, 2), floor_us=round(floor, 1)))
                log(f"{t:5s} dequant+cuBLAS n_tok={n:3d} {med:9.1f} us")
            med, lo, hi = device_us([_tiled(cp, K, ws, x16, xf16, num_sms(), gemm_q_launch) for ws in layers])
            rows.append(dict(case=f"dense_q: 8B layer {t}", impl="gemm_q", n_tok=n, us=round(med, 2),
                             us_min=round(lo, 2), us_max=round(hi, 2), floor_us=round(floor, 1),
                             tbps=round(nbytes / med / 1e6, 2), tflops=round(2 * nbytes_vals * n / med / 1e6, 1)))
            log(f"{t:5s} gemm_q         n_tok={n:3d} {med:9.1f} us {nbytes / med / 1e6:.2f} TB/s "
                f"{2 * nbytes_vals * n / med / 1e6:.0f} TFLOP/s")
            med, lo, hi = device_us([_tiled_q8(cp, K, ws, n, num_sms()) for ws in layers])
            rows.append(dict(case=f"dense_q: 8B layer {t}", impl="gemm_q8", n_tok=n, us=round(med, 2),
                             us_min=round(lo, 2), us_max=round(hi, 2), floor_us=round(floor, 1),
                             tbps=round(nbytes / med / 1e6, 2), tflops=round(2 * nbytes_vals * n / med / 1e6, 1)))
            log(f"{t:5s} gemm_q8        n_tok={n:3d} {med:9.1f} us {nbytes / med / 1e6:.2f} TB/s "
                f"{2 * nbytes_vals * n / med / 1e6:.0f} TFLOP/s (quantization included)")
        del layers
        cp.get_default_memory_pool().free_all_blocks()
    return rows


def _tiled_rows(cp, K, device_us, t: str, layers, tokens, nbytes, nbytes_vals, floor, rows, log):
    """Type ``t``'s tiled GEMMs at ``tokens``: dense_gemm_q, dense_gemm_qs and (its types)
    dense_gemm_qr (each its tile for the tokens, and each tile alone) and, on an sm_90 GPU,
    dense_gemm_qw (its forms: the 256-row tile where it fits, the half-precision decode), dense_gemm_q8 (its activations' quantization included), and dequantize +
    cuBLAS, the path past the tiled GEMMs' tokens (``matmul_dispatch.QSGEMM_MAX_TOKENS``,
    ``QRGEMM_MAX_TOKENS``: the crossovers' other side), and cuBLAS alone on the F16 matrices (the
    F16 file's GEMMs)."""
    from gpu_timing import knobs

    from ggml_attn import gemm_tiles
    from ggml_attn.block_types import block_layout
    from ggml_attn.cuda_device import num_sms
    from ggml_attn.graph.xp_matmul import gemm_q_launch
    for n in tokens:
        x16 = cp.random.standard_normal((n, N_EMBD), dtype=cp.float32).astype(cp.float16)
        xf16 = cp.random.standard_normal((n, N_FF), dtype=cp.float32).astype(cp.float16)

        def split_at(ms, ws):   # dense_gemm_qr with gemm_tiles.GEMMQR_MIN_SPLIT ms
            with knobs(gemm_tiles, GEMMQR_MIN_SPLIT=ms):
                return _tiled(cp, K, ws, x16, xf16, num_sms(), gemm_q_launch, "dense_gemm_qr")
        cases = [("gemm_q", lambda ws: _tiled(cp, K, ws, x16, xf16, num_sms(), gemm_q_launch))]
        cases += [(f"gemm_qs{'' if bn is None else f' bn{bn}'}",
                   lambda ws, bn=bn: _tiled(cp, K, ws, x16, xf16, num_sms(), gemm_q_launch, "dense_gemm_qs", bn))
                  for bn in (None, *K.GEMMQS_BLOCKS_PER_SM)]
        if t in K.GEMMQR_TYPES:   # the fragment-decode form, its tile for the tokens and each tile alone
            cases += [(f"gemm_qr{'' if bn is None else f' bn{bn}'}",
                       lambda ws, bn=bn: _tiled(cp, K, ws, x16, xf16, num_sms(), gemm_q_launch, "dense_gemm_qr", bn))
                      for bn in (None, *K.GEMMQR_BLOCKS_PER_SM)]
            cases += [(f"gemm_qr ms{ms}", lambda ws, ms=ms: split_at(ms, ws)) for ms in (512, 1024)]   # small matrices' splits
            cases += [("gemm_qrm", lambda ws: _tiled(cp, K, ws, x16, xf16, num_sms(), gemm_q_launch, "dense_gemm_qrm"))]
            if K.device_arch() == "sm_90":   # the wgmma form (an sm_90a program): its forms (kernels.GEMMQW_FORMS)
                tid = block_layout(t).type_id
                cases += [(k[6:], lambda ws, k=k: _tiled(cp, K, ws, x16, xf16, num_sms(), gemm_q_launch, k))
                          for k in K.GEMMQW_FORMS if K.qw_instance(tid, k)]
        cases += [("gemm_q8", lambda ws: _tiled_q8(cp, K, ws, n, num_sms())),
                  ("dequant+cublas", lambda ws: _shipped_gemm(cp, K, ws, x16, xf16)),
                  ("cublas f16", lambda ws: _cublas_f16(cp, ws, x16, xf16))]
        for impl, make in cases:
            med, lo, hi = device_us([make(ws) for ws in layers])
            rows.append(dict(case=f"dense_q: 8B layer {t}", impl=impl, n_tok=n, us=round(med, 2),
                             us_min=round(lo, 2), us_max=round(hi, 2), floor_us=round(floor, 1),
                             tbps=round(nbytes / med / 1e6, 2), tflops=round(2 * nbytes_vals * n / med / 1e6, 1)))
            log(f"{t:5s} {impl:12s} n_tok={n:3d} {med:9.1f} us {nbytes / med / 1e6:.2f} TB/s "
                f"{2 * nbytes_vals * n / med / 1e6:.0f} TFLOP/s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0,Q4_0,Q5_K")
    ap.add_argument("--warps", default="8,4,16", help="GEMV blocks of these many warps (8 ships; 4, 16: A/B instances)")
    ap.add_argument("--max-tokens", type=int, default=512, help="rows of at most this many tokens")
    ap.add_argument("--tiled-only", default="", help="just the tiled GEMMs' rows at these token counts (e.g. 16,32,64)")
    ap.add_argument("--q8x-only", action="store_true",
                    help="just the 8-bit-activation GEMV's rows, every form (with --tiled-only: both)")
    ap.add_argument("--dequant-only", default="",
                    help="just path gemm's rows (the dequantization alone, with cuBLAS) at these token counts (e.g. 128,512)")
    ap.add_argument("--dequant-alone", action="store_true",
                    help="with --dequant-only: just the dequantization alone (every --types)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    from gpu_timing import device_us
    rows: list = []

    def log(msg):   # each row saved as it comes: a call cut at its limit keeps what it measured
        print(msg, flush=True)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(rows, f, indent=1)
    run(device_us, tuple(a.types.split(",")), log=log, warps=tuple(int(w) for w in a.warps.split(",")), rows=rows,
        max_tokens=a.max_tokens, tiled_only=tuple(int(n) for n in a.tiled_only.split(",")) if a.tiled_only else None,
        q8x_only=a.q8x_only, dequant_only=tuple(int(n) for n in a.dequant_only.split(",")) if a.dequant_only else None,
        dequant_alone=a.dequant_alone)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, __import__("os").path.dirname(__file__))
    sys.exit(main())
