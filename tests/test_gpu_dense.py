"""cuda/dense.cu against float64 numpy on fresh random inputs, outputs poisoned first. GPU only.

dense_gemv in its three modes (store, accumulate, gated) for 1-4 tokens and each unroll, with
and without the fused RMS norm, one to three weight
segments, row counts that do not fill a block and inner sizes that are not a multiple of the
main loop's stride; dense_rms_norm; dense_kv_store into F16 and F32 caches; the elementwise
dense_cast_f16, dense_silu_mul and dense_gelu_mul through xp_matmul's launcher (sizes that do not fill a block,
and more elements than the grid has threads)."""
import ctypes

import numpy as np
import pytest

import ggml_attn

from ggml_attn import kernels as K
from ggml_attn.reference import nmse

cupy = pytest.importorskip("cupy")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ggml_attn.gpu_available(), reason="needs a CUDA GPU")]


def _launch(name, grid, block, *params):
    fn = K.get_function(K.dense_variant(), name)
    args = K.arg_block(*params)
    fn.launch_raw(grid, block, cupy.cuda.get_current_stream().ptr, ctypes.addressof(args))
    cupy.cuda.get_current_stream().synchronize()


def _x16(x):
    """x rounded to F16 (what the kernel multiplies), as float64."""
    return x.astype(np.float16).astype(np.float64)


@pytest.mark.parametrize("n_tok", [1, 2, 3, 4])
@pytest.mark.parametrize("unroll", K.GEMV_UNROLLS)
@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("rows, n_in", [((7, 13, 5), 296), ((64, 32, 32), 4096), ((130,), 1032)])
def test_gemv_matches_float64(n_tok, unroll, mode, norm, rows, n_in):
    rng = np.random.default_rng(hash((n_tok, mode, rows, n_in)) % 2**32)
    if mode == 1:
        rows = rows[:1]
    if mode == 2:
        rows = (rows[0], rows[0])
    ws = [rng.standard_normal((r, n_in)).astype(np.float16) for r in rows]
    x = (rng.standard_normal((n_tok, n_in)) * (30.0 if norm else 1.0)).astype(np.float32)
    n_out = 1 if mode else len(rows)
    init = [rng.standard_normal((n_tok, rows[i])).astype(np.float32) for i in range(n_out)]
    d_ws = [cupy.asarray(w) for w in ws]
    d_x = cupy.asarray(x)
    d_out = [cupy.asarray(o) if mode == 1 else cupy.full(o.shape, np.nan, np.float32) for o in init]
    p = K.GemvParams()
    for i, w in enumerate(d_ws):
        p.seg[i].w, p.seg[i].rows = w.data.ptr, w.shape[0]
        p.seg[i].out = d_out[0 if mode == 2 else i].data.ptr
    p.x, p.x_stride, p.n_in, p.n_seg, p.mode = d_x.data.ptr, n_in, n_in, len(ws), mode
    p.norm_eps = 1e-5 if norm else 0.0
    total = rows[0] if mode == 2 else sum(rows)
    _launch(K.gemv_name(n_tok, unroll), (-(-total // K.GEMV_WARPS), 1, 1), (32 * K.GEMV_WARPS, 1, 1), p)
    xs = x
    if norm:   # the RMS-normalized x, scaled in F32 as the kernel does, then rounded to F16
        x64 = x.astype(np.float64)
        xs = (x * (1.0 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-5)).astype(np.float32))
    prods = [_x16(xs) @ w.astype(np.float64).T for w in ws]
    if mode == 0:
        want = prods
    elif mode == 1:
        want = [init[0] + prods[0]]
    else:
        g = prods[0]
        want = [g / (1.0 + np.exp(-g)) * prods[1]]
    for got, ref in zip(d_out, want):
        got = got.get()
        assert np.isfinite(got).all()
        # with the norm, an F32 scale 1 ulp off can flip an F16 rounding: still far below the
        # 1e-1 .. 1 of a wrong norm
        assert nmse(got, ref) < (1e-7 if norm else 1e-9)


@pytest.mark.parametrize("n", [1, 255, 4096 * 7, 1024 * 256 + 77])
def test_elementwise_kernels_match_numpy(n):
    from ggml_attn.graph import xp_matmul
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 4).astype(np.float32)
    u = rng.standard_normal(n).astype(np.float32)
    d_x, d_u = cupy.asarray(x), cupy.asarray(u)
    d_h = cupy.full(n, np.nan, np.float16)
    d_y = cupy.full(n, np.nan, np.float32)
    xp_matmul._elementwise_launch("dense_cast_f16", (d_x, d_h), n)()
    d_z = cupy.full(n, np.nan, np.float32)
    d_y16, d_z16 = cupy.full(n, np.nan, np.float16), cupy.full(n, np.nan, np.float16)
    d_w = cupy.full(n, np.nan, np.float32)
    xp_matmul._elementwise_launch("dense_silu_mul", (d_x, d_u, d_y, d_y16), n)()   # F32 and F16
    xp_matmul._elementwise_launch("dense_gelu_mul", (d_x, d_u, d_z, d_z16), n)()
    xp_matmul._elementwise_launch("dense_silu_mul", (d_x, d_u, d_w, None), n)()    # F32 alone
    cupy.cuda.get_current_stream().synchronize()
    np.testing.assert_array_equal(d_h.get(), x.astype(np.float16))      # round to nearest, as numpy
    x64 = x.astype(np.float64)
    want = x64 / (1.0 + np.exp(-x64)) * u
    got = d_y.get()
    assert np.isfinite(got).all() and nmse(got, want) < 1e-12
    np.testing.assert_array_equal(d_y16.get(), got.astype(np.float16))   # the F32 result rounded to nearest
    np.testing.assert_array_equal(d_w.get(), got)
    want = 0.5 * x64 * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * x64 * (1.0 + 0.044715 * x64 * x64))) * u
    got = d_z.get()
    assert np.isfinite(got).all() and nmse(got, want) < 1e-12
    np.testing.assert_array_equal(d_z16.get(), got.astype(np.float16))
    if n > 2:   # a strided array: no launch (xp_matmul falls back to CuPy)
        assert xp_matmul._elementwise_launch("dense_cast_f16", (d_x[::2], d_h[: (n + 1) // 2]), (n + 1) // 2) is None


@pytest.mark.parametrize("n_tok, n", [(1, 4096), (5, 1000), (3, 33), (2, 8192), (2, 8196), (64, 5120)])
@pytest.mark.parametrize("weighted", [False, True])
def test_rms_norm_matches_float64(n_tok, n, weighted):
    """dense_rms_norm: rows held in registers (n a multiple of 4 up to 8192) and the strided loop
    (33, 8196), F32 and F16 outputs, F16 alone."""
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((n_tok, n)) * 3).astype(np.float32)
    g = rng.uniform(0.2, 2.0, n).astype(np.float32)
    d_x, d_y, d_g = cupy.asarray(x), cupy.full((n_tok, n), np.nan, np.float32), cupy.asarray(g)
    d_h, d_h2 = cupy.full((n_tok, n), np.nan, np.float16), cupy.full((n_tok, n), np.nan, np.float16)
    gp = ctypes.c_uint64(d_g.data.ptr if weighted else 0)
    for y, h in ((d_y, d_h), (None, d_h2)):   # F32 and F16; F16 alone (a GEMM's input)
        _launch("dense_rms_norm", (n_tok, 1, 1), (256, 1, 1), ctypes.c_uint64(d_x.data.ptr),
                ctypes.c_uint64(0 if y is None else y.data.ptr), ctypes.c_int32(n), ctypes.c_float(1e-5), gp,
                ctypes.c_uint64(h.data.ptr))
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-5) * (g if weighted else 1.0)
    got = d_y.get()
    assert nmse(got, want) < 1e-12
    np.testing.assert_array_equal(d_h.get(), got.astype(np.float16))   # the F32 values rounded to nearest
    np.testing.assert_array_equal(d_h2.get(), d_h.get())


@pytest.mark.parametrize("k_dtype, v_dtype", [(np.float16, np.float16), (np.float32, np.float16),
                                              (np.float32, np.float32)])
def test_kv_store_writes_only_its_rows(k_dtype, v_dtype):
    rng = np.random.default_rng(7)
    n_tok, n_k, n_v, n_rows = 5, 256, 200, 40
    rows = rng.choice(n_rows, n_tok, replace=False).astype(np.int64)
    k = rng.standard_normal((n_tok, n_k)).astype(np.float32)
    v = rng.standard_normal((n_tok, n_v)).astype(np.float32)
    ck = rng.standard_normal((n_rows, n_k)).astype(k_dtype)
    cv = rng.standard_normal((n_rows, n_v)).astype(v_dtype)
    d = {n: cupy.asarray(a) for n, a in dict(k=k, v=v, ck=ck, cv=cv, rows=rows).items()}
    p = K.KVStoreParams()
    p.src[0], p.src[1] = d["k"].data.ptr, d["v"].data.ptr
    p.dst[0], p.dst[1] = d["ck"].data.ptr, d["cv"].data.ptr
    p.n[0], p.n[1] = n_k, n_v
    p.type[0], p.type[1] = int(k_dtype == np.float16), int(v_dtype == np.float16)   # ggml ids: F32 0, F16 1
    p.rows, p.n_tok = d["rows"].data.ptr, n_tok
    _launch("dense_kv_store", (n_tok, 2, 1), (128, 1, 1), p)
    want_k, want_v = ck.copy(), cv.copy()
    want_k[rows], want_v[rows] = k, v     # cast on assignment, as the numpy store does
    assert np.array_equal(d["ck"].get(), want_k) and np.array_equal(d["cv"].get(), want_v)
