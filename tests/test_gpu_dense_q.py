"""cuda/dense_q.cu, the matmuls over ggml's weight blocks, against float64 numpy of ggml's own
dequantization (``ggml_attn.quant``) on blocks ggml quantized from random values with scales
spread over many decades, outputs poisoned first. GPU only.

dense_gemv_q for every block type in its three modes (store, accumulate, gated), token counts
below and at each instance's NT, with and without the fused RMS norm and its weight, one to
three segments, row counts that do not fill a block: NMSE <= 1e-6 (issue #43's bound for the
GEMV; F32 sums of exact block values land far below it). dense_gemm_q (through
graph/tiled_gemm.gemm_q_launch, with and without its split over n_in and dense_splitk_sum): the
float64 product of the F16-rounded operands it multiplies, NMSE <= 1e-6, and of the exact ones
<= 1e-5. dense_dequant_f16: ggml's values rounded to F16. dense_get_rows_q: ggml's values of the
rows asked for."""
import ctypes

import numpy as np
import pytest

import ggml_attn

from ggml_attn import cuda_device
from ggml_attn import kernels as K
from ggml_attn.block_types import BLOCK_TYPES, block_layout
from ggml_attn.graph import q8_matmul, tiled_gemm, xp_matmul
from ggml_attn.graph.model_device import QMatrix
from ggml_attn.quant import dequantize_rows, q8_activations, quantize
from ggml_attn.reference import nmse
from half_decode import half_values

cupy = pytest.importorskip("cupy")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ggml_attn.gpu_available(), reason="needs a CUDA GPU")]


def _launch(type_id, name, grid, block, *params):
    fn = K.get_function(K.dense_q_variant(type_id), name)
    args = K.arg_block(*params)
    fn.launch_raw(grid, block, cupy.cuda.get_current_stream().ptr, ctypes.addressof(args))
    cupy.cuda.get_current_stream().synchronize()


def _blocks(name, rows, n_in, seed):
    """(uint8 (rows, row_bytes), float64 (rows, n_in) ggml's values): rows of random values whose
    scales span 1e-3 .. 1e3, quantized by ggml."""
    lay = block_layout(name)
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, n_in)) * 10.0 ** rng.uniform(-3, 3, (rows, 1))
    q = quantize(w.astype(np.float32), lay.type_id)
    vals = dequantize_rows(q.ctypes.data, lay.type_id, n_in, rows, q.shape[1]).astype(np.float64)
    return q, vals


def _staged_n_in(name) -> int:
    """An n_in of whole blocks whose rows are whole 16-byte units (dense_gemv_q8x_s's
    precondition), over more than Q8X_STAGES chunks of 1024 values: 4864 (the last chunk
    partial) where the block size allows, else 6144 (Q2_K, Q3_K, Q6_K)."""
    lay = block_layout(name)
    return next(n for n in (4864, 6144) if n % lay.values == 0 and lay.row_bytes(n) % 16 == 0)


def _gemv_case(name, n_tok, mode, norm, n_in=None):
    """A GEMV case: (n_in, rows per segment, [(blocks, float64 values)], x, g, the outputs'
    initial values) -- whole blocks, n_in (by default) not a multiple of 32 sub-blocks, rows that
    do not fill a block of warps; mode 0: three segments, 1: one accumulated, 2: gate and up."""
    lay = block_layout(name)
    n_in = n_in or 2 * 256 + lay.values * (3 if lay.values == 32 else 1)
    rows = {0: (37, 5, 70), 1: (61,), 2: (45, 45)}[mode]
    ws = [_blocks(name, r, n_in, 100 * mode + i) for i, r in enumerate(rows)]
    rng = np.random.default_rng(n_tok)
    x = (rng.standard_normal((n_tok, n_in)) * (30.0 if norm else 1.0)).astype(np.float32)
    g = rng.uniform(0.3, 1.7, n_in).astype(np.float32)
    init = [rng.standard_normal((n_tok, rows[i])).astype(np.float32) for i in range(1 if mode else len(rows))]
    return n_in, rows, ws, x, g, init


def _gemv_want(ws, xs, init, mode) -> list:
    """float64 outputs of a GEMV case for activations xs (float64 (n_tok, n_in))."""
    prods = [xs @ v.T for _, v in ws]
    return prods if mode == 0 else [init[0] + prods[0]] if mode == 1 else \
        [prods[0] / (1.0 + np.exp(-prods[0])) * prods[1]]


def _outs(init, mode) -> list:
    return [cupy.asarray(o) if mode == 1 else cupy.full(o.shape, np.nan, np.float32) for o in init]


@pytest.mark.parametrize("name", BLOCK_TYPES)
@pytest.mark.parametrize("n_tok", [1, 3, 8, 13, 16])
@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("norm", [False, True])
def test_gemv_q_matches_float64(name, n_tok, mode, norm):
    n_in, rows, ws, x, g, init = _gemv_case(name, n_tok, mode, norm)
    type_id = block_layout(name).type_id
    d_ws = [cupy.asarray(q) for q, _ in ws]
    d_x, d_g = cupy.asarray(x), cupy.asarray(g)
    d_out = _outs(init, mode)
    p = K.GemvQParams()
    for i, w in enumerate(d_ws):
        p.seg[i].w, p.seg[i].rows = w.data.ptr, w.shape[0]
        p.seg[i].out = d_out[0 if mode == 2 else i].data.ptr
    p.x, p.x_stride, p.g, p.row_bytes = d_x.data.ptr, n_in, d_g.data.ptr if norm else 0, d_ws[0].shape[1]
    p.n_in, p.n_tok, p.n_seg, p.mode, p.norm_eps = n_in, n_tok, len(ws), mode, 1e-5 if norm else 0.0
    total = rows[0] if mode == 2 else sum(rows)
    _launch(type_id, K.gemv_q_name(type_id, n_tok), (-(-total // K.GEMVQ_WARPS), 1, 1),
            (32 * K.GEMVQ_WARPS, 1, 1), p)
    xs = x.astype(np.float64)
    if norm:
        xs = xs / np.sqrt((xs ** 2).mean(axis=1, keepdims=True) + 1e-5) * g
    for got, ref in zip(d_out, _gemv_want(ws, xs, init, mode)):
        got = got.get()
        assert np.isfinite(got).all() and nmse(got, ref) < 1e-6, (name, nmse(got, ref))


@pytest.mark.parametrize("name, form", [(n, f) for n in BLOCK_TYPES for f in ("plain", "staged")] +
                         [(n, f) for n in K.Q8XV_TYPES for f in ("vector", "vector-one", "vector-split")] +
                         [(n, f) for n in K.Q8XR_TYPES for f in ("ring", "ring-one")])
@pytest.mark.parametrize("n_tok", [1, 2, 3, 4, 5, 8, 13, 16])
@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("norm", [False, True])
def test_gemv_q8x_matches_float64(name, n_tok, mode, norm, form, monkeypatch):
    """The 8-bit-activation GEMV: against float64 of the activations it quantized
    (quant.q8_activations: per 32 values d = max|v| / 127, q = round(v / d)) NMSE <= 1e-5 (integer
    sums, F32 scales; an F32 ulp of the norm's scale may round a q the other way); against float64
    of the exact activations no further off than that rounding itself puts the float64 product
    (a fixed bound failed 52 of these cases on the H200 at 6d1b24e, 3.5e-4 to 1e-3, where the
    emulated bound held: the error is the rounding's, which llama.cpp's mmvq has too). ``form``
    (kernels.Q8X_FORMS) staged: rows of whole 16-byte units over several chunks
    (dense_gemv_q8x_s); vector: the same rows (dense_gemv_q8x_v: 19 blocks, a step of 4 and a
    partial one); plain: rows of any alignment (the case's n_in leaves most types' rows unaligned:
    dense_gemv_q8x); ring: the vector form's rows by a wave of warps each streaming several rows
    through shared-memory slots (dense_gemv_q8x_r, its grid sized here as for one SM: 112 rows
    over at most 24 warps; Q4_K's ring of 8 slots over rows of 5 chunks, Q6_K's of 3 over rows of
    its 8-block groups, Q8_0's of 5 over 32-block groups, the last one partial).
    "-one": modes 0 / 1 through the vector and ring forms' one-operand instances
    (matmul_dispatch.GEMV_ONE_TYPES; the ring's Q6_K 6 slots, Q8_0 8, a grid of up to 44 warps),
    the gated mode through the every-mode one still (the instance launched is checked).
    "vector-split": modes 0 / 1 at one token on two warps a row (matmul_dispatch.GEMV_SPLIT_TYPES;
    mode 1's 61 rows leave the last block a row without its warps), else as "vector".
    Token counts past a form's instances are refused (the caller's GEMM runs them)."""
    from ggml_attn import matmul_dispatch
    one, split = form.endswith("-one"), form.endswith("-split") and n_tok == 1 and mode != 2
    monkeypatch.setattr(matmul_dispatch, "GEMV_ONE_TYPES", (name,) if one else ())
    monkeypatch.setattr(matmul_dispatch, "GEMV_SPLIT_TYPES", (name,) if form.endswith("-split") else ())
    form = form.removesuffix("-one").removesuffix("-split")
    monkeypatch.setattr(cuda_device, "num_sms", lambda: 1)   # (only the ring form's grid asks)
    names, get_function = [], K.get_function
    monkeypatch.setattr(K, "get_function", lambda v, n, *a, **kw: (names.append(n), get_function(v, n, *a, **kw))[1])
    staged = form != "plain"
    n_in, rows, ws, x, g, init = _gemv_case(name, n_tok, mode, norm, _staged_n_in(name) if staged else None)
    assert (block_layout(name).row_bytes(n_in) % 16 == 0) >= staged
    qms = [QMatrix(name, (r, n_in), cupy.asarray(q)) for r, (q, _) in zip(rows, ws)]
    d_out = _outs(init, mode)
    xq = cupy.zeros((n_tok, n_in), np.int8)
    xd, xs = cupy.full((n_tok, n_in // 32), np.nan, np.float32), cupy.full((n_tok, n_in // 32), np.nan, np.float32)
    run = q8_matmul.q8x_launches(qms, cupy.asarray(x), d_out, xq, xd, xs, mode=mode, norm_eps=1e-5 if norm else None,
                                 norm_w=cupy.asarray(g) if norm else None, form=form)
    if n_tok > max(K.Q8X_FORMS[form][1]):
        assert run is None   # past the form's instances: refused (the caller's GEMM runs them)
        return
    gemvs = [n for n in names if n.startswith(K.Q8X_FORMS[form][0] + "<")]
    g_want = 2 if split else int(mode == 2 or not one)
    assert gemvs and (form not in K.Q8X_GATED_FORMS or gemvs[-1].endswith(f", {g_want}>")), gemvs
    run()
    cupy.cuda.get_current_stream().synchronize()
    v = x.astype(np.float32)
    if norm:   # the kernel's order: (x * g) * scale, in F32
        v = (v * g) * (1.0 / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-5)).astype(np.float32)
    rounded, exact = _gemv_want(ws, q8_activations(v), init, mode), _gemv_want(ws, v.astype(np.float64), init, mode)
    for got, ref_q, ref in zip(d_out, rounded, exact):
        got = got.get()
        assert np.isfinite(got).all() and nmse(got, ref_q) < 1e-5, (name, nmse(got, ref_q))
        assert nmse(got, ref) <= 1.5 * nmse(ref_q, ref) + 1e-6, (name, nmse(got, ref), nmse(ref_q, ref))


@pytest.mark.parametrize("name, form", [("Q4_K", "vector"), ("Q8_0", "vector"), ("Q6_K", "staged"), ("Q4_0", "plain"),
                                        ("Q4_K", "ring"), ("Q5_K", "ring"), ("Q6_K", "ring"), ("Q8_0", "ring")])
@pytest.mark.parametrize("mode", [0, 2])
@pytest.mark.parametrize("prefetch", [True, False])
def test_gemv_q8x_with_pdl_waits_for_the_quantization(name, form, mode, prefetch, monkeypatch):
    """Launched with programmatic dependent launch (matmul_dispatch.GEMV_PDL: its blocks start
    while the quantization before it runs, ggml_attn/pdl.py), the GEMV gives the bits it gives
    without, round after round, its activations' scales poisoned with NaN before each
    quantization: a GEMV that read them before the quantization finished would return NaN or
    other bits. (On sm_90 and later; older GPUs launch it plainly.)"""
    from ggml_attn import matmul_dispatch
    monkeypatch.setattr(matmul_dispatch, "GEMV_PDL_PREFETCH", prefetch)   # (with the rows' L2 prefetch or not)
    n_in, rows, ws, x, g, init = _gemv_case(name, 1, mode, True, _staged_n_in(name) if form != "plain" else None)
    qms = [QMatrix(name, (r, n_in), cupy.asarray(q)) for r, (q, _) in zip(rows, ws)]
    xq = cupy.zeros((1, n_in), np.int8)
    xd, xs = cupy.empty((1, n_in // 32), np.float32), cupy.empty((1, n_in // 32), np.float32)
    dx, dg = cupy.asarray(x), cupy.asarray(g)
    outs = {}
    for pdl in (False, True):
        monkeypatch.setattr(matmul_dispatch, "GEMV_PDL", pdl)
        d_out = _outs(init, mode)
        run = q8_matmul.q8x_launches(qms, dx, d_out, xq, xd, xs, mode=mode, norm_eps=1e-5, norm_w=dg, form=form)
        got = []
        for _ in range(20):
            xd.fill(np.nan), xs.fill(np.nan), xq.fill(0)
            run()
            got.append([o.get() for o in d_out])
        outs[pdl] = got
    for a, b in zip(outs[False], outs[True]):
        for u, v in zip(a, b):
            assert np.isfinite(v).all() and np.array_equal(u.view(np.uint32), v.view(np.uint32)), name


def _gemm_case(name, n_tok, n_in_blocks, rows, accumulate, kernel="dense_gemm_q", bn=None):
    """A tiled-GEMM case: (n_in, ggml's float64 values, x F32 (n_tok, n_in), the output's initial
    values, the QMatrix, the output (init with ``accumulate``, NaN else), the grid of ``kernel``,
    the partial sums' array or None) -- n_in_blocks 256-value blocks; 32-value types more
    sub-blocks where n_in_blocks > 1 (a last step part empty): one for dense_gemm_q, for the
    staged GEMMs (rows of whole 16-byte units) the fewest that keep the rows so, where fewer
    than 8 do (Q4_1: 4, Q5_1: 2); their K-quant rows rounded up to whole units too."""
    lay = block_layout(name)
    extra = 0
    if lay.values == 32 and n_in_blocks > 1:
        extra = 1 if kernel == "dense_gemm_q" else next((m for m in range(1, 8) if m * lay.nbytes % 16 == 0), 0)
    if lay.values == 256 and kernel in K.STAGED_GEMMS:   # whole 16-byte units a row: Q2_K 4 blocks, Q3_K / Q6_K 8
        unit = next(m for m in (1, 2, 4, 8) if m * lay.nbytes % 16 == 0)
        n_in_blocks = -(-n_in_blocks // unit) * unit
    n_in = n_in_blocks * 256 + 32 * extra
    q, vals = _blocks(name, rows, n_in, n_tok + rows)
    rng = np.random.default_rng(n_in)
    x = (rng.standard_normal((n_tok, n_in)) * 3.0).astype(np.float32)
    init = rng.standard_normal((n_tok, rows)).astype(np.float32)
    d_out = cupy.asarray(init) if accumulate else cupy.full((n_tok, rows), np.nan, np.float32)
    grid, _ = K.gemm_q_grid(rows, n_tok, n_in, cuda_device.num_sms(), kernel, bn)
    part = cupy.full((grid[2], n_tok, rows), np.nan, np.float32) if grid[2] > 1 else None
    return n_in, vals, x, init, QMatrix(name, (rows, n_in), cupy.asarray(q)), d_out, grid, part


_GEMM_CASES = [(name, kernel, bn) for name in BLOCK_TYPES
               for kernel, bn in [("dense_gemm_q", None), ("dense_gemm_qs", None), ("dense_gemm_qs", 32)] +
               ([("dense_gemm_qr", None), ("dense_gemm_qr", 32), ("dense_gemm_qrm", None), ("dense_gemm_qw", None),
                 ("dense_gemm_qwh", None)] if name in K.GEMMQR_TYPES else []) +
               ([("dense_gemm_qw2", None), ("dense_gemm_qw2h", None)] if name in K.GEMMQW2_TYPES else [])]


def _skip_unless_hopper(kernel):
    """dense_gemm_qw's sm_90a program loads on a compute capability 9.0 GPU only, and
    dense_gemm_qrm's stages (up to 207 KB of shared memory) fit only there."""
    if kernel.startswith("dense_gemm_qw") and K.device_arch() != "sm_90":
        pytest.skip("dense_gemm_qw needs a compute capability 9.0 GPU (an sm_90a program)")
    if kernel == "dense_gemm_qrm" and K.device_arch() != "sm_90":
        pytest.skip("dense_gemm_qrm runs on compute capability 9.0 GPUs (its shared memory)")


@pytest.mark.parametrize("name, kernel, bn", _GEMM_CASES)
@pytest.mark.parametrize("n_tok, n_in_blocks, rows", [(17, 3, 100), (64, 1, 64), (100, 2, 300), (300, 1, 37),
                                                      (40, 9, 100)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_gemm_q_matches_float64(name, n_tok, n_in_blocks, rows, accumulate, kernel, bn):
    """Token counts inside one tile and across several, rows that do not fill a tile, n_in split
    over the grid (kernels.gemm_q_grid) or not (one 256-value block a row); dense_gemm_q and the
    staged dense_gemm_qs and dense_gemm_qr (its own tile for the tokens, and the narrow 32-token one
    across several column tiles) and dense_gemm_qw (wgmma, 128-token tiles of 128 rows, and of 256:
    dense_gemm_qw2), all F16 products of ggml's values rounded to F16 -- dense_gemm_qwh / qw2h
    of the values their half-precision decode gives (tests/half_decode.py)."""
    _skip_unless_hopper(kernel)
    n_in, vals, x, init, w, d_out, grid, part = _gemm_case(name, n_tok, n_in_blocks, rows, accumulate, kernel, bn)
    x16 = x.astype(np.float16)
    xp_matmul.gemm_q_launch(w, cupy.asarray(x16), d_out, part, accumulate=accumulate, kernel=kernel, bn=bn)()
    got = d_out.get().astype(np.float64)
    base = init.astype(np.float64) if accumulate else 0.0
    w16 = half_values(name, w.blocks.get()).reshape(vals.shape) if kernel.endswith("h") else \
        vals.astype(np.float16).astype(np.float64)
    rounded = base + x16.astype(np.float64) @ w16.T
    exact = base + x16.astype(np.float64) @ vals.T
    assert np.isfinite(got).all()
    assert nmse(got, rounded) <= 1e-6 and nmse(got, exact) <= 1e-5, (nmse(got, rounded), nmse(got, exact), grid)


@pytest.mark.parametrize("name", K.GEMMQR_TYPES)
@pytest.mark.parametrize("n_tok, n_in_blocks, rows", [(9, 3, 300), (33, 16, 200), (64, 2, 4096), (100, 9, 130)])
@pytest.mark.parametrize("qr, bn", [("dense_gemm_qr", None), ("dense_gemm_qr", 32), ("dense_gemm_qrm", None)])
def test_gemm_qr_equals_gemm_qs_bit_for_bit(name, n_tok, n_in_blocks, rows, qr, bn, monkeypatch):
    """dense_gemm_qr decodes the same values into its fragments that dense_gemm_qs decodes into its
    shared tile (qb_frag8 against qb_dequant32: the same floats), rounds them to F16 alike and
    multiplies in the same k order: the same output bits, split over n_in or not, rows and tokens
    past a tile's end included. (Both split at dense_gemm_qs's least split here: the finer splits
    of small matrices, gemm_tiles.GEMMQR_MIN_SPLIT, group the partial sums otherwise, F32
    roundings apart -- test_gemm_q_matches_float64 checks dense_gemm_qr as it splits.) The same for
    dense_gemm_qrm (two row halves a block: each warp's rows decoded and multiplied as qr's)."""
    from ggml_attn import gemm_tiles
    _skip_unless_hopper(qr)
    monkeypatch.setattr(gemm_tiles, "GEMMQR_MIN_SPLIT", K.GEMMQ8_MIN_SPLIT)
    outs = []
    for kernel in ("dense_gemm_qs", qr):
        _, _, x, _, w, d_out, grid, part = _gemm_case(name, n_tok, n_in_blocks, rows, False, kernel, bn)
        xp_matmul.gemm_q_launch(w, cupy.asarray(x.astype(np.float16)), d_out, part, kernel=kernel, bn=bn)()
        outs.append((d_out.get(), grid))
    (qs, g_qs), (qr, g_qr) = outs
    assert np.isfinite(qr).all()
    if g_qs[2] == g_qr[2]:   # the same split of n_in (the same k_chunk): the same sums in the same order
        assert np.array_equal(qs.view(np.uint32), qr.view(np.uint32))
    else:   # partial sums grouped otherwise: F32 roundings apart, on the scale of the row's sums
        assert (np.abs(qr - qs) <= 1e-5 * np.abs(qs).max(axis=1, keepdims=True) + 1e-3).all(), \
            float(np.abs(qr - qs).max())


@pytest.mark.parametrize("name", K.GEMMQR_TYPES)
@pytest.mark.parametrize("n_tok, n_in_blocks, n_ff", [(9, 5, 700), (16, 16, 14336), (17, 3, 300), (64, 16, 1024),
                                                      (64, 2, 4096), (100, 9, 130), (40, 16, 14336)])
@pytest.mark.parametrize("with16", [False, True])
def test_gemm_qrg_matches_float64_and_the_two_products(name, n_tok, n_in_blocks, n_ff, with16):
    """dense_gemm_qrg (the gated FFN's gate and up products in one launch, graph/tiled_gemm.gemm_qrg_launch):
    silu(gate) * up of the F16-rounded operands in float64, NMSE <= 1e-6 (of the exact ones <=
    1e-5), split over n_in (dense_splitk_gated) or not, rows and tokens past a tile's end; its F16
    form that output rounded; and, where it splits n_in as dense_gemm_qr does each matrix, the
    bits of the two dense_gemm_qr launches and dense_silu_mul (the same sums in the same order,
    one activation)."""
    _skip_unless_hopper("dense_gemm_qrm")
    n_in, vg, x, _, wg, d_out, grid, _ = _gemm_case(name, n_tok, n_in_blocks, n_ff, False, "dense_gemm_qrg")
    qu, vu = _blocks(name, n_ff, n_in, n_tok + n_ff + 1)
    wu = QMatrix(name, (n_ff, n_in), cupy.asarray(qu))
    part = cupy.full((grid[2], 2, n_tok, n_ff), np.nan, np.float32) if grid[2] > 1 else None
    d16 = cupy.full((n_tok, n_ff), np.nan, np.float16) if with16 else None
    x16 = cupy.asarray(x.astype(np.float16))
    tiled_gemm.gemm_qrg_launch(wg, wu, x16, d_out, d16, part)()
    got = d_out.get()
    xs = x.astype(np.float16).astype(np.float64)

    def gated(a, b):
        g, u = xs @ a.T, xs @ b.T
        return g / (1.0 + np.exp(-g)) * u
    rounded = gated(vg.astype(np.float16).astype(np.float64), vu.astype(np.float16).astype(np.float64))
    assert np.isfinite(got).all()
    assert nmse(got.astype(np.float64), rounded) <= 1e-6 and nmse(got.astype(np.float64), gated(vg, vu)) <= 1e-5
    if with16:
        assert np.array_equal(d16.get().view(np.uint16), got.astype(np.float16).view(np.uint16))
    two, splits = [], []
    for w in (wg, wu):
        g_qr, _ = K.gemm_q_grid(n_ff, n_tok, n_in, cuda_device.num_sms(), "dense_gemm_qr")
        o = cupy.full((n_tok, n_ff), np.nan, np.float32)
        pq = cupy.full((g_qr[2], n_tok, n_ff), np.nan, np.float32) if g_qr[2] > 1 else None
        xp_matmul.gemm_q_launch(w, x16, o, pq, kernel="dense_gemm_qr")()
        two.append(o)
        splits.append(g_qr[2])
    ref = cupy.full((n_tok, n_ff), np.nan, np.float32)
    xp_matmul._act_mul_fn("silu", cupy, two[0], two[1], ref)()
    ref = ref.get()
    if splits == [grid[2]] * 2:
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    else:   # partial sums grouped otherwise: F32 roundings apart
        assert (np.abs(got - ref) <= 1e-5 * np.abs(ref).max(axis=1, keepdims=True) + 1e-3).all(), \
            float(np.abs(got - ref).max())


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("kernel", ["dense_gemm_qr", "dense_gemm_qrm", "dense_gemm_qrg"])
@pytest.mark.parametrize("n_tok, n_in_blocks, rows", [(16, 16, 1024), (64, 16, 1024), (40, 9, 300), (100, 16, 4096)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_split_finish_gives_the_sum_launchs_bits(name, kernel, n_tok, n_in_blocks, rows, accumulate):
    """A split dense_gemm_qr / qrm / qrg launch with tile counters (the QR_SPLIT_FINISH program: the
    last block of each tile adds the splits) writes the bits of the same launch followed by
    dense_splitk_sum / dense_splitk_gated, twice in a row (the counters back at zero after each
    launch), rows and tokens past a tile's end included."""
    from ggml_attn.graph import tiled_gemm as tg
    _skip_unless_hopper("dense_gemm_qrm" if kernel != "dense_gemm_qr" else kernel)
    gated = kernel == "dense_gemm_qrg"
    if gated and accumulate:
        pytest.skip("the gated product stores")
    n_in, _, x, init, w, _, grid, _ = _gemm_case(name, n_tok, n_in_blocks, rows, accumulate, kernel)
    if grid[2] == 1:
        pytest.skip("one split here")
    wu = QMatrix(name, (rows, n_in), cupy.asarray(_blocks(name, rows, n_in, rows + 7)[0]))
    x16 = cupy.asarray(x.astype(np.float16))
    done = cupy.zeros(grid[0] * grid[1], np.uint32)
    outs = []
    for d in (None, done, done):
        out = cupy.asarray(init) if accumulate else cupy.full((n_tok, rows), np.nan, np.float32)
        out16 = cupy.full((n_tok, rows), np.nan, np.float16) if gated else None
        part = cupy.full((grid[2], 2, n_tok, rows) if gated else (grid[2], n_tok, rows), np.nan, np.float32)
        if gated:
            tg.gemm_qrg_launch(w, wu, x16, out, out16, part, done=d)()
        else:
            tg.gemm_q_launch(w, x16, out, part, accumulate=accumulate, kernel=kernel, done=d)()
        cupy.cuda.get_current_stream().synchronize()
        outs.append((out.get(), None if out16 is None else out16.get()))
        assert not done.get().any()
    (ref, ref16), *fused = outs
    assert np.isfinite(ref).all()
    for got, got16 in fused:
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
        assert got16 is None or np.array_equal(got16.view(np.uint16), ref16.view(np.uint16))


@pytest.mark.parametrize("name, qw", [(t, k) for t in K.GEMMQR_TYPES for k in K.GEMMQW_FORMS
                                      if K.qw_instance(block_layout(t).type_id, k)])
@pytest.mark.parametrize("n_tok, n_in_blocks, rows", [(512, 16, 4096), (512, 16, 1024), (129, 8, 300), (7, 2, 130)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_gemm_qw_matches_gemm_qr(name, qw, n_tok, n_in_blocks, rows, accumulate):
    """dense_gemm_qw decodes dense_gemm_qr's values (qb_frag8) into wgmma's A fragments and
    multiplies the same F16 operands: its output within F32 roundings of dense_gemm_qr's (wgmma adds
    a k16 step's products in its own order), at an 8B-shaped prefill (512 tokens, 4096 rows, n_in
    4096) unsplit and at 1024 rows split over n_in (kernels.gemm_q_grid), a second token tile of one
    token, a call of fewer tokens than a tile; and within the float64 bound
    of the F16-rounded product. The poisoned output and partial sums are all written. The
    half-precision forms (dense_gemm_qwh / qw2h) multiply their own values (tests/half_decode.py):
    within F32 roundings of the float64 product of those, and within the issue's bound of ggml's."""
    _skip_unless_hopper("dense_gemm_qw")
    outs = {}
    for kernel in ("dense_gemm_qr", qw):
        n_in, vals, x, init, w, d_out, grid, part = _gemm_case(name, n_tok, n_in_blocks, rows, accumulate, kernel)
        if kernel != "dense_gemm_qr" and rows == 1024 and K.GEMMQW_FORMS[kernel][0] == 1:   # 32 tiles: split over n_in
            assert grid[2] > 1, grid
        xp_matmul.gemm_q_launch(w, cupy.asarray(x.astype(np.float16)), d_out, part, accumulate=accumulate,
                                kernel=kernel)()
        outs[kernel] = d_out.get()
    qr, got = outs["dense_gemm_qr"], outs[qw]
    assert np.isfinite(got).all()
    base = init.astype(np.float64) if accumulate else 0.0
    x16 = x.astype(np.float16).astype(np.float64)
    rounded = base + x16 @ vals.astype(np.float16).astype(np.float64).T
    if K.GEMMQW_FORMS[qw][1]:   # (its own values: F32 roundings apart; ggml's: the weights' NMSE ~2e-7)
        own = base + x16 @ half_values(name, w.blocks.get()).reshape(vals.shape).T
        np.testing.assert_allclose(got, own, rtol=1e-4, atol=1e-4 * float(np.abs(own).max()))
        assert nmse(got.astype(np.float64), own) <= 1e-9 and nmse(got.astype(np.float64), rounded) <= 1e-6
        return
    np.testing.assert_allclose(got, qr, rtol=1e-4, atol=1e-4 * float(np.abs(qr).max()))
    assert nmse(got.astype(np.float64), rounded) <= 1e-6


@pytest.mark.parametrize("name", BLOCK_TYPES)
@pytest.mark.parametrize("n_tok, n_in_blocks, rows", [(5, 9, 100), (16, 16, 200), (17, 3, 100), (64, 1, 64),
                                                      (100, 2, 300), (300, 1, 37)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_gemm_q8_matches_float64(name, n_tok, n_in_blocks, rows, accumulate):
    """The tiled GEMM on int8 tensor cores (dense_gemm_q8, its weight tiles staged by cp.async)
    after the activations' quantization: against float64 of the activations it quantized
    (quant.q8_activations) NMSE <= 1e-5 (exact integer sums, F32 scales); token counts inside one
    64-token tile (its 8-token tiles past n_tok skipped, their activations not copied) and across
    several, rows that do not fill a tile, n_in split over the grid or not, a last step part empty
    (Q4_1, Q5_1)."""
    n_in, vals, x, init, w, d_out, grid, part = _gemm_case(name, n_tok, n_in_blocks, rows, accumulate,
                                                           "dense_gemm_q8")
    xq = cupy.zeros((n_tok, n_in), np.int8)
    xd, xs = cupy.full((n_tok, n_in // 32), np.nan, np.float32), cupy.full((n_tok, n_in // 32), np.nan, np.float32)
    q8_matmul.quant_q8x_launch(w.type_id, cupy.asarray(x), xq, xd, xs)()
    q8_matmul.gemm_q8_launch(w, xq, xd, xs, d_out, part, accumulate=accumulate)()
    got = d_out.get().astype(np.float64)
    want = (init.astype(np.float64) if accumulate else 0.0) + q8_activations(x) @ vals.T
    assert np.isfinite(got).all() and nmse(got, want) <= 1e-5, (nmse(got, want), grid)


@pytest.mark.parametrize("name, form", [("Q4_K", "vector"), ("Q5_K", "vector"), ("Q8_0", "vector"), ("Q6_K", "vector"),
                                        ("Q4_K", "ring"), ("Q6_K", "ring"), ("Q8_0", "ring"), ("Q6_K", "staged"),
                                        ("Q4_0", "plain")])
@pytest.mark.parametrize("mode", [2, 1])
def test_gemv_q8x_writes_its_output_in_8_bit_form(name, form, mode, monkeypatch):
    """The one-token 8-bit GEMV with ``out_q`` (matmul_dispatch.GEMV_QUANT_OUT; cuda/dense_q8x.cu
    q8x_finish, the vector and ring forms' G + 4 instances), outputs and 8-bit form poisoned
    first, two launches over other activations (a graph replay: the counters reset). Gated: the
    F32 output the same bits as without, its 8-bit form the bits dense_quant_q8x makes of it.
    Accumulate (x += W·h, 224 rows; a row on two warps in the vector form) with the next RMS norm
    (weight g, eps): x as without, and the 8-bit form of x·g / rms(x) that dense_quant_q8x makes
    with that norm within its F32 roundings (each int8 at most 1 off, scales to 2e-6 relative: q
    of x·g scaled after, not before). The staged and plain forms refuse it. Rows in several 32-row
    groups over warps that each take several rows in the ring form (its grid as for one SM)."""
    from ggml_attn import matmul_dispatch
    monkeypatch.setattr(cuda_device, "num_sms", lambda: 1)
    monkeypatch.setattr(matmul_dispatch, "GEMV_SPLIT_TYPES", (name,))
    n_in, rows = _staged_n_in(name), 224
    qms = [QMatrix(name, (rows, n_in), cupy.asarray(_blocks(name, rows, n_in, 7 + i)[0])) for i in range(2 if mode == 2 else 1)]
    rng = np.random.default_rng(mode)
    g = cupy.asarray(rng.uniform(0.3, 1.7, rows).astype(np.float32)) if mode == 1 else None
    for rep in range(2):
        x = cupy.asarray(rng.standard_normal((1, n_in)).astype(np.float32))
        xq, xd, xs = cupy.empty((1, n_in), np.int8), cupy.empty((1, n_in // 32), np.float32), cupy.empty((1, n_in // 32), np.float32)
        init = rng.standard_normal((1, rows)).astype(np.float32) * 3.0
        plain, fused = [cupy.asarray(init) if mode == 1 else cupy.full((1, rows), np.nan, np.float32) for _ in range(2)]
        out_q = q8_matmul.q8_out_arrays(cupy, 1, rows)
        if rep == 0:
            assert not out_q[3].any() and not out_q[5].any()
        out_q[0].fill(77), out_q[1].fill(np.nan), out_q[2].fill(np.nan)
        run = q8_matmul.q8x_launches(qms, x, [fused], xq, xd, xs, mode=mode, form=form, out_q=out_q, out_norm=(g, 1e-5))
        if form not in K.Q8X_GATED_FORMS:
            assert run is None
            return
        run()
        q8_matmul.q8x_launches(qms, x, [plain], xq, xd, xs, mode=mode, form=form)()
        want = (cupy.empty((1, rows), np.int8), cupy.empty((1, rows // 32), np.float32), cupy.empty((1, rows // 32), np.float32))
        q8_matmul.quant_q8x_launch(block_layout(name).type_id, plain, *want, norm_eps=1e-5 if mode == 1 else None,
                                   norm_w=g)()
        cupy.cuda.get_current_stream().synchronize()
        assert np.isfinite(fused.get()).all() and np.array_equal(fused.get(), plain.get()), rep
        got, ref = [a.get() for a in out_q[:3]], [a.get() for a in want]
        if mode == 2:
            assert all(np.array_equal(a, b) for a, b in zip(got, ref)), (rep, name, form)
        else:
            assert np.abs(got[0].astype(np.int64) - ref[0]).max() <= 1, (rep, name, form)
            np.testing.assert_allclose(got[1], ref[1], rtol=2e-6)
            assert np.array_equal(got[2], got[0].reshape(1, -1, 32).sum(axis=2).astype(np.float32))
        assert not out_q[3].any() and not out_q[5].any(), rep   # (every count's last warp reset it)


@pytest.mark.parametrize("n_tok, n_in", [(1, 32), (1, 4096), (3, 4128), (2, 14336)])
@pytest.mark.parametrize("norm", [False, True])
def test_quant_q8x_gives_the_host_bits(n_tok, n_in, norm):
    """dense_quant_q8x against numpy in F32 (outputs poisoned): without the RMS norm every int8,
    scale and sum equal to quant.q8_activations' rounding; with it (times a weight) the scale
    within F32 roundings of float64's (the kernel's sum of squares in another order) and each int8
    at most 1 off. n_in whole 256-value blocks and not (a block's warps past the row idle), one
    sub-block, 14336 (the FFN's down input: 14 sum-of-squares loads a thread)."""
    rng = np.random.default_rng(n_in + n_tok)
    x = (rng.standard_normal((n_tok, n_in)) * 10.0 ** rng.uniform(-2, 2, (n_tok, n_in // 32)).repeat(32, 1)).astype(np.float32)
    g = rng.uniform(0.5, 1.5, n_in).astype(np.float32) if norm else None
    xq = cupy.full((n_tok, n_in), 77, np.int8)
    xd, xs = cupy.full((n_tok, n_in // 32), np.nan, np.float32), cupy.full((n_tok, n_in // 32), np.nan, np.float32)
    q8_matmul.quant_q8x_launch(12, cupy.asarray(x), xq, xd, xs, norm_eps=1e-5 if norm else None,
                               norm_w=cupy.asarray(g) if norm else None)()
    got_q, got_d, got_s = xq.get().astype(np.int64), xd.get(), xs.get()
    v = x.astype(np.float64)
    if norm:
        v = v * g / np.sqrt((v * v).mean(axis=1, keepdims=True) + 1e-5)
    b = v.astype(np.float32).reshape(n_tok, -1, 32)
    d = np.abs(b).max(axis=2) / np.float32(127)
    q = np.where(d[..., None] > 0, np.rint(b / np.where(d > 0, d, 1)[..., None]), 0).reshape(n_tok, n_in)
    assert np.isfinite(got_d).all() and np.isfinite(got_s).all()
    if not norm:
        assert np.array_equal(got_d, d) and np.array_equal(got_q, q)
        deq = got_q.reshape(n_tok, -1, 32).astype(np.float32) * got_d[..., None]   # (q * d in F32, as it rounds)
        assert np.array_equal(q8_activations(x), deq.reshape(n_tok, n_in).astype(np.float64))
    else:
        np.testing.assert_allclose(got_d, d, rtol=4e-6)
        assert np.abs(got_q - q).max() <= 1
    assert np.array_equal(got_s, got_q.reshape(n_tok, -1, 32).sum(axis=2).astype(np.float32))


def test_gemm_q_grid_splits_and_not():
    """The cases above cover a split and an unsplit n_in (so the sum kernel and the direct store run)."""
    n_sm = cuda_device.num_sms()
    assert K.gemm_q_grid(100, 17, 768, n_sm)[0][2] > 1 and K.gemm_q_grid(37, 300, 256, n_sm)[0][2] == 1
    assert K.gemm_q_grid(100, 5, 9 * 256, n_sm, "dense_gemm_q8")[0][2] > 1
    assert K.gemm_q_grid(100, 17, 768, n_sm, "dense_gemm_q8")[0][2] == 1
    assert K.gemm_q_grid(100, 17, 9 * 256, n_sm, "dense_gemm_qs")[0][2] > 1
    assert K.gemm_q_grid(37, 300, 256, n_sm, "dense_gemm_qs")[0][2] == 1


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_dequant_f16_and_get_rows_q(name):
    """dense_dequant_f16: ggml's values rounded to F16, over rows whose last warp of 32 sub-blocks
    is part full (24 or 3 sub-blocks a row, 301 rows) and a grid of 3 blocks (each warp loops),
    nothing written past the matrix (the poisoned tail stays NaN); dense_get_rows_q: rows of F32."""
    lay = block_layout(name)
    rows, n_in = 301, (768 if lay.values == 256 else 96)
    q, vals = _blocks(name, rows, n_in, 7)
    d_q = cupy.asarray(q)
    out = cupy.full(rows * n_in + 4096, np.nan, np.float16)
    assert rows * n_in // 32 % 32 != 0
    _launch(lay.type_id, f"dense_dequant_f16<{lay.type_id}>", (3, 1, 1), (256, 1, 1),
            ctypes.c_uint64(d_q.data.ptr), ctypes.c_uint64(out.data.ptr), ctypes.c_int64(q.shape[1]),
            ctypes.c_int32(n_in), ctypes.c_int64(rows))
    got = out.get()
    assert np.isnan(got[rows * n_in:]).all()
    # ggml's values rounded to F16 (the GPU may fuse d * q - m into one FMA: an F32 ulp of the
    # product apart, which can round the other way or matter where d * q and m nearly cancel)
    _close(got[: rows * n_in].reshape(rows, n_in).astype(np.float64), vals.astype(np.float16).astype(np.float64),
           2 ** -10)
    ids = np.array([5, 0, 300, 5, 17], dtype=np.int32)
    d_ids, rows_out = cupy.asarray(ids), cupy.full((len(ids), n_in), np.nan, np.float32)
    n_sub = len(ids) * n_in // 32
    _launch(lay.type_id, f"dense_get_rows_q<{lay.type_id}>", (-(-n_sub // 256), 1, 1), (256, 1, 1),
            ctypes.c_uint64(d_q.data.ptr), ctypes.c_uint64(d_ids.data.ptr), ctypes.c_uint64(rows_out.data.ptr),
            ctypes.c_int64(q.shape[1]), ctypes.c_int32(n_in), ctypes.c_int64(len(ids)))
    _close(rows_out.get().astype(np.float64), vals[ids], 2e-7)


def _close(got, want, rtol):
    """``got`` within ``rtol`` of ``want`` elementwise, plus 1e-6 of the row's largest value."""
    tol = rtol * np.abs(want) + 1e-6 * np.abs(want).max(axis=1, keepdims=True)
    assert np.isfinite(got).all() and (np.abs(got - want) <= tol).all(), float(np.abs(got - want).max())
