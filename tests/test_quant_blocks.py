"""cuda/quant_blocks.cuh, the GPU's decoder of ggml's weight blocks, built for the host with g++
and checked against ggml's own dequantization (``ggml_attn.quant.dequantize_rows``): random
bytes in every field (scales, signs, high bits), the half-precision scales drawn from normal
values, extremes (+-65504), subnormals and zeros; and blocks ggml quantized from random values.
"""
import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from ggml_attn.block_types import BLOCK_TYPES, block_layout
from ggml_attn.quant import dequantize_rows, quantize
from ggml_attn.variants import Q8XV_TYPES
from half_decode import half_values

CUDA = Path(__file__).resolve().parents[1] / "cuda"

HARNESS = r"""
#include "quant_blocks.cuh"
#include <cstring>

template <int T> static void row(const qb_u8* r, int n, float* out) {
    constexpr int V = QBlock<T>::VALUES, B = QBlock<T>::BYTES;
    for (int b = 0; b < n / V; ++b)
        for (int s = 0; s < V / 32; ++s) {
            float v[32];
            qb_dequant32<T>(r + (long)b * B, s, v);
            memcpy(out + (long)b * V + 32 * s, v, sizeof v);
        }
}

// sum over the row of value_j * xd_s q_j by the integer form (qb_int8s / qb_dot_q8), per sub-block s
template <int T> static double dot_q8(const qb_u8* r, int n, const signed char* q, const float* xd) {
    constexpr int V = QBlock<T>::VALUES, B = QBlock<T>::BYTES;
    double sum = 0.0;
    for (int s = 0; s < n / 32; ++s) {
        int w[8], a[8], xs = 0;
        float f[2], c[2];
        qb_int8s<T>(r + (long)(s / (V / 32)) * B, s % (V / 32), w, f, c);
        memcpy(a, q + 32 * s, 32);
        for (int j = 0; j < 32; ++j) xs += q[32 * s + j];
        sum += qb_dot_q8<T>(w, f, c, a, xd[s], (float)xs);
    }
    return sum;
}

#define Q8CASE(T) case T: return gemm == 2 ? dot_lane<T>(r, n, q, xd) : gemm ? dot_q8s<T>(r, n, q, xd) : dot_q8<T>(r, n, q, xd);

// the same by the vector GEMV's lanes (dense_gemv_q8x_v: qb_k4_lane / qb_k4_lane_dot, eight lanes
// a block, each its 16-byte head, qs and qh words and the activations of its 16 positions of two
// sub-blocks; Q6_K's four lanes a block, qb_q6k_lane; Q8_0's one, qb_q8_0_lane_dot); 1e300 for a
// type it does not read
template <int T> static double dot_lane(const qb_u8* r, int n, const signed char* q, const float* xd) {
    if constexpr (T == QB_Q6_K || T == QB_Q8_0) {   // groups of whole 16-byte units, as the kernel stages them
        constexpr int BLOCKS = T == QB_Q6_K ? 8 : 32, GB = BLOCKS * QBlock<T>::BYTES;
        double sum = 0.0;
        for (int g = 0; g < n / (BLOCKS * QBlock<T>::VALUES); ++g) {
            unsigned words[GB / 4 + 4] = {};   // (+16 bytes: a window's fifth word)
            memcpy(words, r + (long)g * GB, GB);
            for (int lane = 0; lane < 32; ++lane) {
                if constexpr (T == QB_Q6_K) {   // four lanes a block (qb_q6k_group_lane / qb_q6k_lane_dot)
                    const int k0 = 2048 * g + qb_q6k_lane_value(lane);
                    QbQ6Lane v;
                    qb_q6k_group_lane(words, lane, v);
                    unsigned x[4][4];
                    float xdg[4];
                    for (int k = 0; k < 4; ++k) {
                        memcpy(x[k], q + k0 + 32 * k, 16);
                        xdg[k] = xd[k0 / 32 + k];
                    }
                    sum += qb_q6k_lane_dot(v, x, xdg);
                } else {   // a lane a block (qb_q8_0_group_lane / qb_q8_0_lane_dot)
                    const int b = BLOCKS * g + lane;
                    unsigned w[8], x[8];
                    float d;
                    qb_q8_0_group_lane(words, lane, w, d);
                    memcpy(x, q + 32 * b, 32);
                    sum += qb_q8_0_lane_dot(w, d, x, xd[b]);
                }
            }
        }
        return sum;
    } else if constexpr (T != QB_Q4_K && T != QB_Q5_K) {
        return 1e300;
    } else {
        constexpr int B = QBlock<T>::BYTES;
        double sum = 0.0;
        for (int b = 0; b < n / 256; ++b)
            for (int k = 0; k < 8; ++k) {
                const qb_u8* blk = r + (long)b * B;
                unsigned hd[4], qs[4], qh[4], alo[4], ahi[4];
                memcpy(hd, blk, 16);
                memcpy(qs, blk + QbLane<T>::QS + 16 * k, 16);
                memcpy(qh, blk + 16 + 16 * (k & 1), 16);
                QbLaneVals v;
                qb_k4_lane<T>(hd, qs, qh, k, v);
                const int j = k >> 1, s0 = 8 * b + 2 * j, a = 256 * b + 64 * j + 16 * (k & 1);
                memcpy(alo, q + a, 16);
                memcpy(ahi, q + a + 32, 16);
                int xs0 = 0, xs1 = 0;
                for (int i = 0; i < 32; ++i) xs0 += q[32 * s0 + i], xs1 += q[32 * (s0 + 1) + i];
                sum += qb_k4_lane_dot(v, alo, ahi, xd[s0], (float)xs0, xd[s0 + 1], (float)xs1, (k & 1) == 0);
            }
        return sum;
    }
}

// the same by the block GEMM's arithmetic (qb_int8s / qb_q8s_dot): signed bytes, each half's
// integer sum as an int8 product gives it, the activations' sums of 32 and of each half
template <int T> static double dot_q8s(const qb_u8* r, int n, const signed char* q, const float* xd) {
    constexpr int V = QBlock<T>::VALUES, B = QBlock<T>::BYTES;
    double sum = 0.0;
    for (int s = 0; s < n / 32; ++s) {
        int w[8], S[2] = {0, 0}, h[2] = {0, 0};
        float f[2], c[2];
        qb_int8s<T>(r + (long)(s / (V / 32)) * B, s % (V / 32), w, f, c);
        for (int j = 0; j < 32; ++j) {
            const int wj = (int)(signed char)(w[j / 4] >> (8 * (j % 4)));
            S[j / 16] += wj * q[32 * s + j];
            h[j / 16] += q[32 * s + j];
        }
        sum += qb_q8s_dot<T>(S[0], S[1], f[0], f[1], c[0], c[1], xd[s], (float)(h[0] + h[1]), h[0], h[1]);
    }
    return sum;
}

extern "C" double qb_dot_row_q8(int type, const qb_u8* r, int n, const signed char* q, const float* xd, int gemm) {
    switch (type) {
        Q8CASE(QB_Q4_0) Q8CASE(QB_Q4_1) Q8CASE(QB_Q5_0) Q8CASE(QB_Q5_1) Q8CASE(QB_Q8_0)
        Q8CASE(QB_Q2_K) Q8CASE(QB_Q3_K) Q8CASE(QB_Q4_K) Q8CASE(QB_Q5_K) Q8CASE(QB_Q6_K)
    }
    return 1e300;
}

// the row again through qb_frag8 (every sub-block's 32 values from its four lanes' fragments), or
// (HALF) qb_frag8h, the half-precision decode, its halves as float; 0 for a type without it
template <int T, bool HALF> static int frag_row(const qb_u8* r, int n, float* out) {
    if constexpr (!(HALF ? QbFragH<T>::OK : QbFrag<T>::OK)) {
        return 0;
    } else {
        constexpr int V = QBlock<T>::VALUES, B = QBlock<T>::BYTES;
        for (int b = 0; b < n / V; ++b)
            for (int s = 0; s < V / 32; ++s)
                for (int c = 0; c < 4; ++c) {
                    float v[8];
                    if constexpr (HALF) {
                        unsigned h[4];
                        qb_frag8h<T>(r + (long)b * B, s, c, h);
                        for (int i = 0; i < 8; ++i) v[i] = (float)qb_h16_value((h[i >> 1] >> (16 * (i & 1))) & 0xFFFFu);
                    } else {
                        qb_frag8<T>(r + (long)b * B, s, c, v);
                    }
                    for (int i = 0; i < 8; ++i)
                        out[(long)b * V + 32 * s + 2 * c + (i & 1) + 8 * (i >> 1)] = v[i];
                }
        return 1;
    }
}

#define FCASE(T) case T: return half ? frag_row<T, true>(r, n, out) : frag_row<T, false>(r, n, out);
extern "C" int qb_frag_row(int type, int half, const qb_u8* r, int n, float* out) {
    switch (type) {
        FCASE(QB_Q4_0) FCASE(QB_Q4_1) FCASE(QB_Q5_0) FCASE(QB_Q5_1) FCASE(QB_Q8_0)
        FCASE(QB_Q2_K) FCASE(QB_Q3_K) FCASE(QB_Q4_K) FCASE(QB_Q5_K) FCASE(QB_Q6_K)
    }
    return -1;
}

#define CASE(T) case T: if (out) row<T>(r, n, out); return QBlock<T>::BYTES * 1000 + QBlock<T>::VALUES;
extern "C" int qb_row(int type, const qb_u8* r, int n, float* out) {
    switch (type) {
        CASE(QB_Q4_0) CASE(QB_Q4_1) CASE(QB_Q5_0) CASE(QB_Q5_1) CASE(QB_Q8_0)
        CASE(QB_Q2_K) CASE(QB_Q3_K) CASE(QB_Q4_K) CASE(QB_Q5_K) CASE(QB_Q6_K)
    }
    return -1;
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    gxx = shutil.which("g++") or shutil.which("c++")
    assert gxx, "a C++ compiler is needed (ggml-python's build needs one too)"
    d = tmp_path_factory.mktemp("qb")
    (d / "h.cpp").write_text(HARNESS)
    so = d / "libqb.so"
    # no FMA contraction: the host decoder must give ggml's products exactly
    subprocess.run([gxx, "-O2", "-std=c++17", "-ffp-contract=off", "-shared", "-fPIC", f"-I{CUDA}",
                    str(d / "h.cpp"), "-o", str(so)], check=True)
    out = ctypes.CDLL(str(so))
    out.qb_row.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    out.qb_dot_row_q8.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    out.qb_dot_row_q8.restype = ctypes.c_double
    out.qb_frag_row.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    return out


def _decode(lib, type_id, raw: np.ndarray, n: int) -> np.ndarray:
    out = np.empty(n, dtype=np.float32)
    assert lib.qb_row(type_id, raw.ctypes.data, n, out.ctypes.data) > 0
    return out


_HALVES = np.concatenate([
    np.random.default_rng(0).standard_normal(200).astype(np.float16).view(np.uint16),
    np.array([0x7BFF, 0xFBFF, 0x0001, 0x8001, 0x03FF, 0x0400, 0x0000, 0x8000, 0x3C00], dtype=np.uint16)])


def _random_blocks(name: str, n_blocks: int, seed: int) -> np.ndarray:
    lay = block_layout(name)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n_blocks, lay.nbytes), dtype=np.uint8)
    for off in lay.half_offsets:   # finite scales, extremes and subnormals included
        raw[:, off:off + 2] = rng.choice(_HALVES, size=n_blocks).view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(-1)


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_every_block_type_decodes_as_ggml_does(lib, name):
    lay = block_layout(name)
    n_blocks = 300
    raw = _random_blocks(name, n_blocks, seed=lay.type_id)
    n = n_blocks * lay.values
    want = dequantize_rows(raw.ctypes.data, lay.type_id, n, 1, raw.size)[0]
    got = _decode(lib, lay.type_id, raw, n)
    assert np.isfinite(want).all()
    # ggml's C may contract a product and a sum into one FMA: an ulp apart at most
    np.testing.assert_allclose(got, want, rtol=2e-7, atol=0)
    ggml_q = quantize(np.random.default_rng(1).standard_normal((4, 4 * lay.values)).astype(np.float32) * 3,
                      lay.type_id).reshape(-1)
    n = 16 * lay.values
    np.testing.assert_allclose(_decode(lib, lay.type_id, ggml_q, n),
                               dequantize_rows(ggml_q.ctypes.data, lay.type_id, n, 1, ggml_q.size)[0],
                               rtol=2e-7, atol=0)


FRAG_TYPES = ("Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")   # QbFrag<T>::OK


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_fragment_decode_gives_the_sub_blocks_values_bit_for_bit(lib, name):
    """qb_frag8 (dense_gemm_qr's decode straight into m16n8k16 A fragments): the four lanes of a
    quad together give every value of each sub-block, each the same float as qb_dequant32's --
    random bytes with extreme and subnormal scales, and blocks ggml quantized; the types without
    it say so."""
    lay = block_layout(name)
    rng = np.random.default_rng(lay.type_id + 100)
    for raw in (_random_blocks(name, 64, seed=lay.type_id + 7),
                quantize(rng.standard_normal((4, 4 * lay.values)).astype(np.float32) * 3, lay.type_id).reshape(-1)):
        n = raw.size // lay.nbytes * lay.values
        got = np.full(n, np.nan, np.float32)
        ok = lib.qb_frag_row(lay.type_id, 0, raw.ctypes.data, n, got.ctypes.data)
        if name not in FRAG_TYPES:
            assert ok == 0
            return
        assert ok == 1
        want = _decode(lib, lay.type_id, raw, n)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_half_fragment_decode_is_one_f16_rounding_of_rounded_factors(lib, name):
    """qb_frag8h (dense_gemm_qw's half-precision decode): the four lanes of a quad together give
    every value of each sub-block, each exactly the f16 that numpy's reading of the block gives
    (q times the factors rounded to f16, rounded once) -- random bytes with extreme and subnormal
    scales (infinities and NaN where a factor overflows f16, as the device's), and blocks ggml
    quantized; there the values are qb_frag8's rounded to f16 (Q4_0, Q8_0: bit for bit; the
    others within the factors' rounding: 1.5 f16 ulp of the block's largest value, and a mean
    square error against ggml's values within 8x F16's own)."""
    lay = block_layout(name)
    rng = np.random.default_rng(lay.type_id + 200)
    for real, raw in ((False, _random_blocks(name, 64, seed=lay.type_id + 9)),
                      (True, quantize(rng.standard_normal((4, 4 * lay.values)).astype(np.float32) * 3,
                                      lay.type_id).reshape(-1))):
        n = raw.size // lay.nbytes * lay.values
        got = np.full(n, -1.0, np.float32)
        ok = lib.qb_frag_row(lay.type_id, 1, raw.ctypes.data, n, got.ctypes.data)
        if name not in FRAG_TYPES:
            assert ok == 0
            return
        assert ok == 1
        want = half_values(name, raw)
        assert np.array_equal(got.astype(np.float64), want, equal_nan=True)
        num = ~np.isnan(want)   # (zeros' signs too; a NaN's sign is no value's)
        assert np.array_equal(np.signbit(got[num]), np.signbit(want[num]))
        if real:
            f32 = _decode(lib, lay.type_id, raw, n).astype(np.float16).astype(np.float64)
            if name in ("Q4_0", "Q8_0"):
                assert np.array_equal(got, f32)
            else:
                big = np.repeat(np.abs(f32).reshape(-1, lay.values).max(axis=1), lay.values)
                ulp = np.ldexp(1.0, np.frexp(big)[1] - 11)
                assert np.all(np.abs(got - f32) <= 1.5 * ulp)
                # the mean square error against ggml's values: within 8x of F16's own rounding (5.2x Q4_K,
                # 4.8x Q5_K: the min term dmin m rounded to f16; 1.7x Q6_K) -- a weight NMSE of ~2e-7
                exact = _decode(lib, lay.type_id, raw, n).astype(np.float64)
                err, err16 = np.mean((got - exact) ** 2), np.mean((f32 - exact) ** 2)
                assert err <= 8 * err16, (err, err16)


def test_layouts_are_ggml_sizes(lib):
    from ggml_attn.quant import type_info
    for name in BLOCK_TYPES:
        lay = block_layout(name)
        info = type_info(lay.type_id)
        assert (info.name.upper(), info.blck_size, info.type_size) == (name, lay.values, lay.nbytes)
        assert lib.qb_row(lay.type_id, None, 0, None) == lay.nbytes * 1000 + lay.values


@pytest.mark.parametrize("name, gemm", [(n, g) for n in BLOCK_TYPES for g in (0, 1)] +
                         [(n, 2) for n in Q8XV_TYPES])
def test_integer_form_dots_as_ggml_values_do(lib, name, gemm):
    """qb_int8s / qb_dot_q8 (the 8-bit-activation GEMV's per-lane arithmetic, cuda/dense_q8x.cu),
    ``gemm`` 1: qb_int8s / qb_q8s_dot (its block GEMM's: the offset in signed bytes, one
    factor pair a sub-block where the halves share it, no c where an offset is folded), ``gemm`` 2:
    the vector GEMV's lanes (Q8XV_TYPES: qb_k4_lane / qb_k4_lane_dot, eight lanes a block; Q6_K's
    and Q8_0's groups read by qb_q6k_group_lane / qb_q8_0_group_lane, their windows' offsets and
    selectors as the kernel computes them): a row's
    dot with int8 activations (one scale per 32) equals float64 of ggml's dequantized values
    times the same activations, to F32 rounding; random bytes in every field (finite scales) and
    blocks ggml quantized; one sub-block at a time as well (each field's place)."""
    lay = block_layout(name)
    rng = np.random.default_rng(lay.type_id)
    raws = [_random_blocks(name, 64, seed=lay.type_id + 7),
            quantize(rng.standard_normal((1, 64 * lay.values)).astype(np.float32), lay.type_id).reshape(-1)]
    for raw in raws:
        n = 64 * lay.values
        vals = dequantize_rows(raw.ctypes.data, lay.type_id, n, 1, raw.size)[0].astype(np.float64)
        big = np.abs(vals) > 1e4   # the random halves' extremes: keep the sums' scale sane
        for trial in range(3):
            q = rng.integers(-127, 128, n).astype(np.int8)
            xd = rng.uniform(0.001, 0.1, n // 32).astype(np.float32)
            x = q.astype(np.float64) * np.repeat(xd.astype(np.float64), 32)
            x[big] = 0.0
            q[big] = 0
            want = float(vals @ x)
            got = lib.qb_dot_row_q8(lay.type_id, raw.ctypes.data, n, q.ctypes.data, xd.ctypes.data, int(gemm))
            tol = 1e-5 * float(np.abs(vals * x).sum()) + 1e-30
            assert abs(got - want) <= tol, (name, trial, got, want)
        one, unit = np.zeros(n, dtype=np.int8), np.ones(n // 32, np.float32)   # a single activation: each place
        for j in rng.choice(n, 40, replace=False):
            if big[j]:
                continue
            one[:] = 0
            one[j] = 1
            got = lib.qb_dot_row_q8(lay.type_id, raw.ctypes.data, n, one.ctypes.data, unit.ctypes.data, int(gemm))
            assert got == pytest.approx(vals[j], rel=1e-6, abs=1e-30), (name, j)
