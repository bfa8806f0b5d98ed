// ggml's quantized weight blocks, decoded 32 values at a time: the one place that knows their
// byte layouts (ggml-common.h's block_q4_0 ... block_q6_K) and ggml's dequantization formulas
// (ggml-quants.c's dequantize_row_*), for the GPU's matmul kernels (dense_q.cu) and for a host
// compiler: tests/test_quant_blocks.py builds this header with g++ and checks every type
// against ggml's own dequantization, byte for byte of random blocks.
//
// A block of QB_VALUES<T> values takes QB_BYTES<T> bytes; a row of n values is n / QB_VALUES
// blocks back to back. Sub-block s (0 <= s < QB_VALUES / 32) of a block is its values
// [32 s, 32 s + 32): qb_dequant32<T>(block, s, v) writes them, as float, to v[0..32), each
// computed by ggml's own expression (the same products in the same order).
// T: the ggml type id (ggml.h enum ggml_type). Blocks are 2-byte aligned (every block size is
// even), fields are little-endian.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define QB_HD __device__ __forceinline__
#include <cuda_fp16.h>
#else
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#define QB_HD inline
#endif

#define QB_Q4_0 2
#define QB_Q4_1 3
#define QB_Q5_0 6
#define QB_Q5_1 7
#define QB_Q8_0 8
#define QB_Q2_K 10
#define QB_Q3_K 11
#define QB_Q4_K 12
#define QB_Q5_K 13
#define QB_Q6_K 14

typedef unsigned char qb_u8;

template <int T> struct QBlock;   // VALUES, BYTES per type
template <> struct QBlock<QB_Q4_0> { static constexpr int VALUES = 32, BYTES = 18; };
template <> struct QBlock<QB_Q4_1> { static constexpr int VALUES = 32, BYTES = 20; };
template <> struct QBlock<QB_Q5_0> { static constexpr int VALUES = 32, BYTES = 22; };
template <> struct QBlock<QB_Q5_1> { static constexpr int VALUES = 32, BYTES = 24; };
template <> struct QBlock<QB_Q8_0> { static constexpr int VALUES = 32, BYTES = 34; };
template <> struct QBlock<QB_Q2_K> { static constexpr int VALUES = 256, BYTES = 84; };
template <> struct QBlock<QB_Q3_K> { static constexpr int VALUES = 256, BYTES = 110; };
template <> struct QBlock<QB_Q4_K> { static constexpr int VALUES = 256, BYTES = 144; };
template <> struct QBlock<QB_Q5_K> { static constexpr int VALUES = 256, BYTES = 176; };
template <> struct QBlock<QB_Q6_K> { static constexpr int VALUES = 256, BYTES = 210; };

// An IEEE half (its 16 bits) as float, exactly.
QB_HD float qb_half(const qb_u8* p) {
    const unsigned short h = (unsigned short)(p[0] | (p[1] << 8));
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
    return __half2float(__ushort_as_half(h));
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ffu, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {   // subnormal: normalize
        int e = -1;
        do { man <<= 1; ++e; } while (!(man & 0x400u));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

// The little-endian word of the 4 bytes at p (any alignment).
QB_HD unsigned qb_le32(const qb_u8* p) {
    return (unsigned)p[0] | ((unsigned)p[1] << 8) | ((unsigned)p[2] << 16) | ((unsigned)p[3] << 24);
}

// 16 bytes at p as four little-endian words: one 16-byte load on the device where p is 16-byte
// aligned (Q4_K and Q5_K blocks in rows of 16-byte aligned matrices: 144 and 176 bytes a
// block), bytes otherwise (warp-uniform: every block of such a matrix has p's alignment).
QB_HD void qb_load16(const qb_u8* p, unsigned (&w)[4]) {
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
    if ((reinterpret_cast<unsigned long long>(p) & 15) == 0) {
        const uint4 u = *reinterpret_cast<const uint4*>(p);
        w[0] = u.x, w[1] = u.y, w[2] = u.z, w[3] = u.w;
        return;
    }
#endif
    for (int i = 0; i < 4; ++i) w[i] = qb_le32(p + 4 * i);
}

// 4 N bytes at a 2-byte aligned p (Q6_K's 210-byte blocks, Q4_0's and Q8_0's 18 and 34) as N
// little-endian words, read as 2 N 2-byte halves on the device.
template <int N>
QB_HD void qb_load_2(const qb_u8* p, unsigned (&w)[N]) {
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
    const unsigned short* h = reinterpret_cast<const unsigned short*>(p);
    for (int i = 0; i < N; ++i) w[i] = (unsigned)h[2 * i] | ((unsigned)h[2 * i + 1] << 16);
#else
    for (int i = 0; i < N; ++i) w[i] = qb_le32(p + 4 * i);
#endif
}

// Byte j (0..3) of x plus 2^23, as float (exact): one byte permute into 2^23's bits on the
// device, no integer-to-float conversion. Subtracting 2^23 (+ an offset) is exact as well.
QB_HD float qb_byte_2p23(unsigned x, int j) {
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
    return __uint_as_float(__byte_perm(x, 0x4B000000u, 0x7440u + (unsigned)j));
#else
    const uint32_t bits = 0x4B000000u | ((x >> (8 * j)) & 0xFFu);
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

// Byte j (0..3) of x as float, exactly.
QB_HD float qb_byte_f(unsigned x, int j) { return qb_byte_2p23(x, j) - 8388608.0f; }

// Q4_K / Q5_K: the 6-bit scale and min of sub-block j (ggml's get_scale_min_k4).
QB_HD void qb_scale_min_k4(int j, const qb_u8* q, int& d, int& m) {
    if (j < 4) {
        d = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Q3_K: the signed 6-bit scale of sub-block i (0..15) from the 12 packed bytes (ggml's aux
// shuffle of dequantize_row_q3_K, read per scale): low 4 bits from byte i % 8 (low nibble for
// i < 8, high for i >= 8), high 2 bits from byte 8 + i % 4 (bits 2 (i / 4) .. +1), minus 32.
QB_HD int qb_scale_q3k(int i, const qb_u8* s) {
    const int lo = i < 8 ? (s[i] & 0xF) : (s[i - 8] >> 4);
    const int hi = (s[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
    return (lo | (hi << 4)) - 32;
}

template <int T> QB_HD void qb_dequant32(const qb_u8* b, int s, float (&v)[32]);

template <> QB_HD void qb_dequant32<QB_Q4_0>(const qb_u8* b, int, float (&v)[32]) {
    const float d = qb_half(b);
    const qb_u8* qs = b + 2;
    for (int j = 0; j < 16; ++j) {
        v[j] = (float)((qs[j] & 0x0F) - 8) * d;
        v[j + 16] = (float)((qs[j] >> 4) - 8) * d;
    }
}

template <> QB_HD void qb_dequant32<QB_Q4_1>(const qb_u8* b, int, float (&v)[32]) {
    const float d = qb_half(b), m = qb_half(b + 2);
    const qb_u8* qs = b + 4;
    for (int j = 0; j < 16; ++j) {
        v[j] = (float)(qs[j] & 0x0F) * d + m;
        v[j + 16] = (float)(qs[j] >> 4) * d + m;
    }
}

template <> QB_HD void qb_dequant32<QB_Q5_0>(const qb_u8* b, int, float (&v)[32]) {
    const float d = qb_half(b);
    const unsigned qh = qb_le32(b + 2);
    const qb_u8* qs = b + 6;
    for (int j = 0; j < 16; ++j) {
        const int xh0 = ((qh >> j) << 4) & 0x10;
        const int xh1 = (qh >> (j + 12)) & 0x10;
        v[j] = (float)(((qs[j] & 0x0F) | xh0) - 16) * d;
        v[j + 16] = (float)(((qs[j] >> 4) | xh1) - 16) * d;
    }
}

template <> QB_HD void qb_dequant32<QB_Q5_1>(const qb_u8* b, int, float (&v)[32]) {
    const float d = qb_half(b), m = qb_half(b + 2);
    const unsigned qh = qb_le32(b + 4);
    const qb_u8* qs = b + 8;
    for (int j = 0; j < 16; ++j) {
        const int xh0 = ((qh >> j) << 4) & 0x10;
        const int xh1 = (qh >> (j + 12)) & 0x10;
        v[j] = (float)((qs[j] & 0x0F) | xh0) * d + m;
        v[j + 16] = (float)((qs[j] >> 4) | xh1) * d + m;
    }
}

template <> QB_HD void qb_dequant32<QB_Q8_0>(const qb_u8* b, int, float (&v)[32]) {
    const float d = qb_half(b);
    unsigned w[8];
    qb_load_2(b + 2, w);
    for (int i = 0; i < 8; ++i) {   // q + 128 a byte, then 2^23 + 128 off exactly: q, no conversion
        const unsigned m = w[i] ^ 0x80808080u;
        for (int j = 0; j < 4; ++j) v[4 * i + j] = (qb_byte_2p23(m, j) - 8388736.0f) * d;
    }
}

// Q2_K: scales[16] @0, qs[64] @16, d @80, dmin @82. Sub-block s: 128-value half n = s / 4,
// 2-bit plane j = s % 4 of qs[32 n ..]; values 0..15 scale 2 s, 16..31 scale 2 s + 1.
template <> QB_HD void qb_dequant32<QB_Q2_K>(const qb_u8* b, int s, float (&v)[32]) {
    const float d = qb_half(b + 80), mn = qb_half(b + 82);
    const qb_u8* q = b + 16 + 32 * (s >> 2);
    const int shift = 2 * (s & 3);
    for (int h = 0; h < 2; ++h) {
        const int sc = b[2 * s + h];
        const float dl = d * (float)(sc & 0xF), ml = mn * (float)(sc >> 4);
        for (int l = 0; l < 16; ++l) v[16 * h + l] = dl * (float)((q[16 * h + l] >> shift) & 3) - ml;
    }
}

// Q3_K: hmask[32] @0, qs[64] @32, scales[12] @96, d @108. Sub-block s: qs half n = s / 4, plane
// j = s % 4, high bit (1 << s) of hmask; values 0..15 scale 2 s, 16..31 scale 2 s + 1.
template <> QB_HD void qb_dequant32<QB_Q3_K>(const qb_u8* b, int s, float (&v)[32]) {
    const float d_all = qb_half(b + 108);
    const qb_u8* hm = b;
    const qb_u8* q = b + 32 + 32 * (s >> 2);
    const int shift = 2 * (s & 3), m = 1 << s;
    for (int h = 0; h < 2; ++h) {
        const float dl = d_all * (float)qb_scale_q3k(2 * s + h, b + 96);
        for (int l = 16 * h; l < 16 * h + 16; ++l)
            v[l] = dl * (float)(((q[l] >> shift) & 3) - ((hm[l] & m) ? 0 : 4));
    }
}

// Q4_K: d @0, dmin @2, scales[12] @4, qs[128] @16. Sub-block s: nibble (s & 1) of qs[32 (s / 2) ..].
template <> QB_HD void qb_dequant32<QB_Q4_K>(const qb_u8* b, int s, float (&v)[32]) {
    const float d = qb_half(b), mn = qb_half(b + 2);
    int sc, m;
    qb_scale_min_k4(s, b + 4, sc, m);
    const float d1 = d * (float)sc, m1 = mn * (float)m;
    const qb_u8* q = b + 16 + 32 * (s >> 1);
    const int shift = 4 * (s & 1);
    unsigned w[8];
    qb_load16(q, *reinterpret_cast<unsigned (*)[4]>(w));
    qb_load16(q + 16, *reinterpret_cast<unsigned (*)[4]>(w + 4));
    for (int i = 0; i < 8; ++i) {   // four nibbles a word, each in its own byte
        const unsigned m = (w[i] >> shift) & 0x0F0F0F0Fu;
        for (int j = 0; j < 4; ++j) v[4 * i + j] = d1 * qb_byte_f(m, j) - m1;
    }
}

// Q5_K: d @0, dmin @2, scales[12] @4, qh[32] @16, qs[128] @48. Sub-block s: nibble (s & 1) of
// qs[32 (s / 2) ..], fifth bit (1 << s) of qh.
template <> QB_HD void qb_dequant32<QB_Q5_K>(const qb_u8* b, int s, float (&v)[32]) {
    const float d = qb_half(b), mn = qb_half(b + 2);
    int sc, m;
    qb_scale_min_k4(s, b + 4, sc, m);
    const float d1 = d * (float)sc, m1 = mn * (float)m;
    const qb_u8* q = b + 48 + 32 * (s >> 1);
    const int shift = 4 * (s & 1);
    unsigned w[8], h[8];
    qb_load16(q, *reinterpret_cast<unsigned (*)[4]>(w));
    qb_load16(q + 16, *reinterpret_cast<unsigned (*)[4]>(w + 4));
    qb_load16(b + 16, *reinterpret_cast<unsigned (*)[4]>(h));
    qb_load16(b + 32, *reinterpret_cast<unsigned (*)[4]>(h + 4));
    for (int i = 0; i < 8; ++i) {   // nibble | fifth bit (bit s of qh) << 4, a value a byte
        const unsigned m = ((w[i] >> shift) & 0x0F0F0F0Fu) | (((h[i] >> s) & 0x01010101u) << 4);
        for (int j = 0; j < 4; ++j) v[4 * i + j] = d1 * qb_byte_f(m, j) - m1;
    }
}

// Q6_K: ql[128] @0, qh[64] @128, scales[16] (int8) @192, d @208. Sub-block s: 128-value half
// n = s / 4, quarter k = s % 4: low bits nibble (k / 2) of ql[64 n + 32 (k & 1) ..], high bits
// (2 k .. 2 k + 1) of qh[32 n ..]; values 0..15 scale 8 n + 2 k, 16..31 the next.
template <> QB_HD void qb_dequant32<QB_Q6_K>(const qb_u8* b, int s, float (&v)[32]) {
    const float d = qb_half(b + 208);
    const int n = s >> 2, k = s & 3;
    const qb_u8* ql = b + 64 * n + 32 * (k & 1);
    const qb_u8* qh = b + 128 + 32 * n;
    const signed char* sc = reinterpret_cast<const signed char*>(b + 192) + 8 * n + 2 * k;
    const int lshift = 4 * (k >> 1), hshift = 2 * k;
    unsigned lw[8], hw[8];
    qb_load_2(ql, lw);
    qb_load_2(qh, hw);
    const float ds[2] = {d * (float)sc[0], d * (float)sc[1]};   // ggml's d * sc, then times q
    for (int i = 0; i < 8; ++i) {   // the 6-bit values of four cells, one a byte
        const unsigned m = ((lw[i] >> lshift) & 0x0F0F0F0Fu) | (((hw[i] >> hshift) & 0x03030303u) << 4);
        for (int j = 0; j < 4; ++j) v[4 * i + j] = ds[i >> 2] * (qb_byte_2p23(m, j) - 8388640.0f);   // q - 32
    }
}

// ---------------------------------------------------------------------------------------
// A sub-block's share of an m16n8k16 A fragment, for a GEMM that decodes the weights straight into
// its fragments (dense_q.cu's dense_gemm_qr): qb_frag8<T>(b, s, c, v) writes v[0..8), the values of
// sub-block s at positions 2c, 2c + 1, 2c + 8, 2c + 9, 16 + 2c, 17 + 2c, 24 + 2c, 25 + 2c (c = 0..3,
// the lane's place in its quad: columns 2c.. of the fragment's two 8-column halves, for the
// sub-block's two 16-value k steps), each by qb_dequant32's expression (the same float, bit for
// bit). QbFrag<T>::OK: the types that have one (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K: the Q4_0, Q8_0,
// Q4_K_M and Q5_K_M files' matrices).

template <int T> struct QbFrag { static constexpr bool OK = false; };
template <> struct QbFrag<QB_Q4_0> { static constexpr bool OK = true; };
template <> struct QbFrag<QB_Q8_0> { static constexpr bool OK = true; };
template <> struct QbFrag<QB_Q4_K> { static constexpr bool OK = true; };
template <> struct QbFrag<QB_Q5_K> { static constexpr bool OK = true; };
template <> struct QbFrag<QB_Q6_K> { static constexpr bool OK = true; };

// The little-endian 16 bits at a 2-byte aligned p (one 2-byte load on the device).
QB_HD unsigned qb_u16(const qb_u8* p) {
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
    return *reinterpret_cast<const unsigned short*>(p);
#else
    return (unsigned)p[0] | ((unsigned)p[1] << 8);
#endif
}

template <int T> QB_HD void qb_frag8(const qb_u8* b, int s, int c, float (&v)[8]);

// Q4_0: value j < 16 the low nibble of qs[j], j >= 16 the high nibble of qs[j - 16].
template <> QB_HD void qb_frag8<QB_Q4_0>(const qb_u8* b, int, int c, float (&v)[8]) {
    const float d = qb_half(b);
    for (int h = 0; h < 4; ++h) {
        const unsigned w = qb_u16(b + 2 + ((2 * c + 8 * h) & 15)) >> (h < 2 ? 0 : 4);
        v[2 * h] = (float)((int)(w & 0x0F) - 8) * d;
        v[2 * h + 1] = (float)((int)((w >> 8) & 0x0F) - 8) * d;
    }
}

template <> QB_HD void qb_frag8<QB_Q8_0>(const qb_u8* b, int, int c, float (&v)[8]) {
    const float d = qb_half(b);
    for (int h = 0; h < 4; ++h) {
        const unsigned m = qb_u16(b + 2 + 2 * c + 8 * h) ^ 0x8080u;
        v[2 * h] = (qb_byte_2p23(m, 0) - 8388736.0f) * d;
        v[2 * h + 1] = (qb_byte_2p23(m, 1) - 8388736.0f) * d;
    }
}

// Q4_K / Q5_K: sub-block s's factors of value = d1 q - m1 (ggml's d * sc and dmin * m).
QB_HD void qb_k4_factors(const qb_u8* b, int s, float& d1, float& m1) {
    int sc, m;
    qb_scale_min_k4(s, b + 4, sc, m);
    d1 = qb_half(b) * (float)sc;
    m1 = qb_half(b + 2) * (float)m;
}

template <> QB_HD void qb_frag8<QB_Q4_K>(const qb_u8* b, int s, int c, float (&v)[8]) {
    float d1, m1;
    qb_k4_factors(b, s, d1, m1);
    const qb_u8* q = b + 16 + 32 * (s >> 1) + 2 * c;
    const int shift = 4 * (s & 1);
    for (int h = 0; h < 4; ++h) {
        const unsigned x = (qb_u16(q + 8 * h) >> shift) & 0x0F0Fu;
        v[2 * h] = d1 * qb_byte_f(x, 0) - m1;
        v[2 * h + 1] = d1 * qb_byte_f(x, 1) - m1;
    }
}

template <> QB_HD void qb_frag8<QB_Q5_K>(const qb_u8* b, int s, int c, float (&v)[8]) {
    float d1, m1;
    qb_k4_factors(b, s, d1, m1);
    const qb_u8* q = b + 48 + 32 * (s >> 1) + 2 * c;
    const qb_u8* qh = b + 16 + 2 * c;
    const int shift = 4 * (s & 1);
    for (int h = 0; h < 4; ++h) {
        const unsigned x = ((qb_u16(q + 8 * h) >> shift) & 0x0F0Fu) | (((qb_u16(qh + 8 * h) >> s) & 0x0101u) << 4);
        v[2 * h] = d1 * qb_byte_f(x, 0) - m1;
        v[2 * h + 1] = d1 * qb_byte_f(x, 1) - m1;
    }
}

template <> QB_HD void qb_frag8<QB_Q6_K>(const qb_u8* b, int s, int c, float (&v)[8]) {
    const float d = qb_half(b + 208);
    const int n = s >> 2, k = s & 3;
    const qb_u8* ql = b + 64 * n + 32 * (k & 1) + 2 * c;
    const qb_u8* qh = b + 128 + 32 * n + 2 * c;
    const signed char* sc = reinterpret_cast<const signed char*>(b + 192) + 8 * n + 2 * k;
    const int lshift = 4 * (k >> 1), hshift = 2 * k;
    const float ds[2] = {d * (float)sc[0], d * (float)sc[1]};
    for (int h = 0; h < 4; ++h) {
        const unsigned x = ((qb_u16(ql + 8 * h) >> lshift) & 0x0F0Fu) |
                           (((qb_u16(qh + 8 * h) >> hshift) & 0x0303u) << 4);
        v[2 * h] = ds[h >> 1] * (qb_byte_2p23(x, 0) - 8388640.0f);
        v[2 * h + 1] = ds[h >> 1] * (qb_byte_2p23(x, 1) - 8388640.0f);
    }
}

// ---------------------------------------------------------------------------------------
// The same share of a fragment decoded in half precision (dense_qw.cu's dense_gemm_qw<T, RM, 1>):
// qb_frag8h<T>(b, s, c, h) writes h[i] (i = 0..3), the packed f16 pair of values 8 i + 2c and
// 8 i + 2c + 1 of sub-block s (low half first) -- the pair qb_frag8 gives as v[2 i], v[2 i + 1].
// The block's integer q becomes the exact half 1024 + q by its bits (0x6400 | q), 1024 comes off
// exactly, and f16 operations apply the factors:
//   Q4_0 (q - 8) d            Q8_0 q d            Q6_K (q - 32) RN16(d sc)
//   Q4_K / Q5_K  (q sc) d - RN16(dmin m)   (q sc exact: (1024 + q) sc - 1024 sc in one multiply-add;
//                                            then one more: one rounding)
// -- about 3 instructions a value against qb_frag8's 6 (a byte permute, a float add and a
// multiply-add a value, a conversion a pair). Q4_0's and Q8_0's values are qb_frag8's rounded
// to f16, bit for bit; the others may differ by the rounding of the factor named RN16 (within ~1
// f16 ulp of the block's largest value). The host's build emulates each f16 operation (computed
// exactly, rounded once to nearest even), so tests can give the device's bits. QbFragH<T>::OK as
// QbFrag.
template <int T> struct QbFragH { static constexpr bool OK = QbFrag<T>::OK; };

#if !(defined(__CUDACC__) || defined(__CUDACC_RTC__))
// (host) the f16 nearest to x (ties to even), as bits (x a double: the emulated operations are exact
// in double but for sums of far-apart terms, whose one extra rounding the tests never meet)
inline unsigned qb_h16_bits(double x) {
    const unsigned sign = std::signbit(x) ? 0x8000u : 0u;
    const double a = std::fabs(x);
    if (std::isnan(x)) return 0x7E00u;
    if (a >= 65520.0) return sign | 0x7C00u;   // (65520: the tie between 65504 and 2^16 rounds up)
    int e;
    std::frexp(a, &e);                          // a = f 2^e, 0.5 <= f < 1
    const double ulp = std::ldexp(1.0, std::max(e - 11, -24));   // (subnormals: 2^-24)
    const double m = std::nearbyint(a / ulp);   // (the default rounding mode: to even)
    const double r = m * ulp;
    unsigned bits;
    if (r < 6.103515625e-05) bits = (unsigned)(r / 5.960464477539063e-08);   // subnormal (or 0)
    else {
        int re;
        const double rf = std::frexp(r, &re);
        bits = ((unsigned)(re - 1 + 15) << 10) | ((unsigned)std::ldexp(rf * 2.0 - 1.0, 10) & 0x3FFu);
    }
    return sign | bits;
}

inline double qb_h16_value(unsigned h) {
    const qb_u8 b[2] = {(qb_u8)(h & 0xFF), (qb_u8)(h >> 8)};
    return (double)qb_half(b);
}
#endif

// Packed half pairs (low half first), x the halves 1024 + q of qb_h2_1024 and off the exact halves
// to take off (1024 + the type's offset): (x - off) f[half] per half (half 2: f's own halves,
// element by element), rounded once (the subtraction is exact).
// Half 0 / 1 of f broadcast by the operand's own selector on the device (HMUL2 / HFMA2 R.H0_H0).
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
QB_HD __half2 qb_as_h2(unsigned u) { return *reinterpret_cast<const __half2*>(&u); }
QB_HD unsigned qb_h2_bits(__half2 h) { return *reinterpret_cast<const unsigned*>(&h); }
QB_HD unsigned qb_h2_qmul(unsigned x, unsigned off, unsigned f, int half) {
    const __half2 fh = qb_as_h2(f);
    return qb_h2_bits(__hmul2(__hsub2(qb_as_h2(x), qb_as_h2(off)),
                              half == 2 ? fh : half ? __high2half2(fh) : __low2half2(fh)));
}
// Q4_K / Q5_K: q sc d - RN16(dmin m) for x the halves 1024 + q, sm {sc, m}, nm {-1024 sc,
// RN16(dmin m)}, dm the block's {d, dmin}: q sc exactly ((1024 + q) sc - 1024 sc, one rounding
// of an integer <= 945), then one multiply-add -- only the min term's product rounded apart.
QB_HD unsigned qb_h2_k4(unsigned x, unsigned sm, unsigned nm, unsigned dm) {
    const __half2 qsc = __hfma2(qb_as_h2(x), __low2half2(qb_as_h2(sm)), __low2half2(qb_as_h2(nm)));
    return qb_h2_bits(__hfma2(qsc, __low2half2(qb_as_h2(dm)), __hneg2(__high2half2(qb_as_h2(nm)))));
}
#else
inline unsigned qb_h2_qmul(unsigned x, unsigned off, unsigned f, int half) {
    unsigned out = 0;
    for (int k = 0; k < 2; ++k) {   // (x - off: exact)
        const double fv = qb_h16_value((f >> (16 * (half == 2 ? k : half))) & 0xFFFFu);
        const double q = qb_h16_value((x >> (16 * k)) & 0xFFFFu) - qb_h16_value((off >> (16 * k)) & 0xFFFFu);
        out |= qb_h16_bits(q * fv) << (16 * k);
    }
    return out;
}
inline unsigned qb_h2_k4(unsigned x, unsigned sm, unsigned nm, unsigned dm) {
    const double sc = qb_h16_value(sm & 0xFFFFu), n1024 = qb_h16_value(nm & 0xFFFFu);
    const double m1 = qb_h16_value(nm >> 16), d = qb_h16_value(dm & 0xFFFFu);
    unsigned out = 0;
    for (int k = 0; k < 2; ++k) {
        const double qsc = qb_h16_value(qb_h16_bits(std::fma(qb_h16_value((x >> (16 * k)) & 0xFFFFu), sc, n1024)));
        out |= qb_h16_bits(std::fma(qsc, d, -m1)) << (16 * k);
    }
    return out;
}
#endif

// Byte sel & 7 of the 8 bytes {lo, hi} (little-endian) into each byte of the result by sel's
// nibbles, as the device's byte permute (PRMT; only selector values 0..7).
QB_HD unsigned qb_perm(unsigned lo, unsigned hi, unsigned sel) {
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
    return __byte_perm(lo, hi, sel);
#else
    const unsigned long long v = lo | ((unsigned long long)hi << 32);
    unsigned out = 0;
    for (int i = 0; i < 4; ++i) out |= (unsigned)((v >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i);
    return out;
#endif
}

// The halves 1024 + q for q the bytes 0 and 1 of u masked by mask (0x6400 | q, exact; mask 0xF0:
// 1024 + 16 q of the high nibbles): one byte permute that puts 0x64 above each byte, and one AND
// (its mask the only constant the AND takes).
QB_HD unsigned qb_h2_1024(unsigned u, unsigned mask) {
    return qb_perm(u, 0x64646464u, 0x4140u) & (0xFF00FF00u | (mask * 0x10001u));
}

// x - off per half (exact for the halves here).
QB_HD unsigned qb_h2_sub(unsigned x, unsigned off) {
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
    return qb_h2_bits(__hsub2(qb_as_h2(x), qb_as_h2(off)));
#else
    unsigned out = 0;
    for (int k = 0; k < 2; ++k)
        out |= qb_h16_bits(qb_h16_value((x >> (16 * k)) & 0xFFFFu) - qb_h16_value((off >> (16 * k)) & 0xFFFFu)) << (16 * k);
    return out;
#endif
}

// The 4-byte-aligned little-endian word at p (one 4-byte load on the device).
QB_HD unsigned qb_u32a(const qb_u8* p) {
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
    return *reinterpret_cast<const unsigned*>(p);
#else
    return qb_le32(p);
#endif
}

template <int T> QB_HD void qb_frag8h(const qb_u8* b, int s, int c, unsigned (&h)[4]);

template <> QB_HD void qb_frag8h<QB_Q4_0>(const qb_u8* b, int, int c, unsigned (&h)[4]) {
    const unsigned d = qb_u16(b);
    for (int i = 0; i < 4; ++i)   // (1024 + q) - 1032: q - 8
        h[i] = qb_h2_qmul(qb_h2_1024(qb_u16(b + 2 + ((2 * c + 8 * i) & 15)) >> (i < 2 ? 0 : 4), 0x0F), 0x64086408u, d, 0);
}

template <> QB_HD void qb_frag8h<QB_Q8_0>(const qb_u8* b, int, int c, unsigned (&h)[4]) {
    const unsigned d = qb_u16(b);
    for (int i = 0; i < 4; ++i)   // the int8 q + 128 as its byte: (1024 + q + 128) - 1152
        h[i] = qb_h2_qmul(qb_h2_1024(qb_u16(b + 2 + 2 * c + 8 * i) ^ 0x8080u, 0xFF), 0x64806480u, d, 0);
}

// Q4_K / Q5_K (4-byte aligned blocks): sub-block s's factors for qb_h2_k4, sm = {sc / r, m} -- ggml's
// 6-bit sc and m (get_scale_min_k4) placed into exact halves by their bits; r 16 where the pairs
// come as 1024 + 16 q (Q4_K's high nibbles, in place) -- and nm = {-1024 sc / r, RN16(dmin m)}.
QB_HD void qb_k4_factors_h(const qb_u8* b, int s, bool r16, unsigned& sm, unsigned& nm) {
    const unsigned w1 = qb_u32a(b + 4), w2 = qb_u32a(b + 8);
    unsigned x;
    if (s < 4) {   // sc = byte s of w1, m = byte s of w2 (6 bits each)
        x = (qb_perm(w1, w2, (unsigned)(s | (s << 4) | ((4 + s) << 8) | ((4 + s) << 12))) & 0x003F003Fu) | 0x64006400u;
    } else {       // sc = (w3.j & 15) | (w1.j >> 6) << 4, m = (w3.j >> 4) | (w2.j >> 6) << 4 (j = s - 4)
        const unsigned j = (unsigned)(s - 4);
        const unsigned a = qb_perm(qb_u32a(b + 12), 0u, j | (4u << 4) | (j << 8) | (4u << 12));
        const unsigned t = (qb_perm(w1, w2, j | (4u << 4) | ((4u + j) << 8) | (4u << 12)) >> 2) & 0x00300030u;
        x = (a & 0x0000000Fu) | ((a >> 4) & 0x000F0000u) | t | 0x64006400u;
    }
    sm = r16 ? qb_h2_qmul(x, 0x64006400u, 0x3C002C00u, 2) : qb_h2_sub(x, 0x64006400u);   // ({1/16, 1}: exact)
    nm = qb_h2_qmul(x, 0x64006400u, (qb_u32a(b) & 0xFFFF0000u) | (r16 ? 0xD400u : 0xE400u), 2);   // {-1024 / r, dmin}
}

template <> QB_HD void qb_frag8h<QB_Q4_K>(const qb_u8* b, int s, int c, unsigned (&h)[4]) {
    unsigned sm, nm;
    qb_k4_factors_h(b, s, s & 1, sm, nm);   // (odd s: the high nibbles in place, 1024 + 16 q)
    const unsigned dm = qb_u32a(b);
    const qb_u8* q = b + 16 + 32 * (s >> 1) + 2 * c;
    for (int i = 0; i < 4; ++i) h[i] = qb_h2_k4(qb_h2_1024(qb_u16(q + 8 * i), s & 1 ? 0xF0 : 0x0F), sm, nm, dm);
}

template <> QB_HD void qb_frag8h<QB_Q5_K>(const qb_u8* b, int s, int c, unsigned (&h)[4]) {
    unsigned sm, nm;
    qb_k4_factors_h(b, s, false, sm, nm);
    const unsigned dm = qb_u32a(b);
    const qb_u8* q = b + 48 + 32 * (s >> 1) + 2 * c;
    const qb_u8* qh = b + 16 + 2 * c;
    const int shift = 4 * (s & 1);
    for (int i = 0; i < 4; ++i) {
        const unsigned x = ((qb_u16(q + 8 * i) >> shift) & 0x0F0Fu) | (((qb_u16(qh + 8 * i) >> s) & 0x0101u) << 4);
        h[i] = qb_h2_k4(qb_h2_1024(x, 0x1F), sm, nm, dm);
    }
}

template <> QB_HD void qb_frag8h<QB_Q6_K>(const qb_u8* b, int s, int c, unsigned (&h)[4]) {
    const int n = s >> 2, k = s & 3;
    const qb_u8* ql = b + 64 * n + 32 * (k & 1) + 2 * c;
    const qb_u8* qh = b + 128 + 32 * n + 2 * c;
    const int lshift = 4 * (k >> 1), hshift = 2 * k;
    // {RN16(d sc0), RN16(d sc1)} (values 0..15 and 16..31): the int8 sc + 128 as bytes, less 1152
    const unsigned ds = qb_h2_qmul(qb_h2_1024(qb_u16(b + 192 + 8 * n + 2 * k) ^ 0x8080u, 0xFF), 0x64806480u,
                                   qb_u16(b + 208), 0);
    for (int i = 0; i < 4; ++i) {   // (1024 + q) - 1056: q - 32
        const unsigned x = ((qb_u16(ql + 8 * i) >> lshift) & 0x0F0Fu) | (((qb_u16(qh + 8 * i) >> hshift) & 0x0303u) << 4);
        h[i] = qb_h2_qmul(qb_h2_1024(x, 0x3F), 0x64206420u, ds, i >> 1);
    }
}

// ---------------------------------------------------------------------------------------
// The integer form of a sub-block for 8-bit activations (dense_q8x.cu, llama.cpp's mmvq way):
// qb_int32<T>(b, s, w, f, c) gives w[0..8), the sub-block's 32 integer parts u_j four to a word
// (one byte each, 0..63, in value order), and per half h (values 16 h .. 16 h + 15) the factors
// of value_j = f[h] (u_j - QbQ8<T>::OFF) + c[h]; qb_int8s (below) folds OFF into the bytes and
// qb_q8s_dot / qb_dot_q8 make a dot of it with 32 activations x_j = xd q_j (q_j int8, xs = sum
// q_j). Every block type.

// c + the dot of the four signed bytes of a and b (IDP4A on the device).
QB_HD int qb_dp4a(int a, int b, int c) {
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
    return __dp4a(a, b, c);
#else
    for (int i = 0; i < 4; ++i) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
#endif
}

template <int T> struct QbQ8 { static constexpr int OFF = 0; static constexpr bool HALVES = false; };
template <> struct QbQ8<QB_Q2_K> { static constexpr int OFF = 0; static constexpr bool HALVES = true; };
template <> struct QbQ8<QB_Q3_K> { static constexpr int OFF = 4; static constexpr bool HALVES = true; };
template <> struct QbQ8<QB_Q6_K> { static constexpr int OFF = 32; static constexpr bool HALVES = true; };

// Bit 4 of each byte of a word from bits 0..3 of h (Q5_0 / Q5_1's fifth bits of four values).
QB_HD unsigned qb_spread4(unsigned h) {
    return ((h & 1u) << 4) | ((h & 2u) << 11) | ((h & 4u) << 18) | ((h & 8u) << 25);
}

// Q4_0 .. Q5_1: 16 bytes of nibbles at qs (value j low nibble of byte j, value 16 + j its high
// nibble), fifth bits (bit j of qh for value j) when qh is given.
QB_HD void qb_nibbles32(const qb_u8* qs, const qb_u8* qh, int (&w)[8]) {
    unsigned q[4];
    qb_load_2(qs, q);
    unsigned h = 0;
    if (qh) h = qb_le32(qh);
    for (int i = 0; i < 4; ++i) {
        w[i] = (int)((q[i] & 0x0F0F0F0Fu) | (qh ? qb_spread4(h >> (4 * i)) : 0u));
        w[4 + i] = (int)(((q[i] >> 4) & 0x0F0F0F0Fu) | (qh ? qb_spread4(h >> (16 + 4 * i)) : 0u));
    }
}

template <int T> QB_HD void qb_int32(const qb_u8* b, int s, int (&w)[8], float (&f)[2], float (&c)[2]);

template <> QB_HD void qb_int32<QB_Q4_0>(const qb_u8* b, int, int (&w)[8], float (&f)[2], float (&c)[2]) {
    qb_nibbles32(b + 2, nullptr, w);   // d (n - 8)
    const float d = qb_half(b);
    f[0] = f[1] = d, c[0] = c[1] = -8.0f * d;
}

template <> QB_HD void qb_int32<QB_Q4_1>(const qb_u8* b, int, int (&w)[8], float (&f)[2], float (&c)[2]) {
    qb_nibbles32(b + 4, nullptr, w);   // d n + m
    f[0] = f[1] = qb_half(b), c[0] = c[1] = qb_half(b + 2);
}

template <> QB_HD void qb_int32<QB_Q5_0>(const qb_u8* b, int, int (&w)[8], float (&f)[2], float (&c)[2]) {
    qb_nibbles32(b + 6, b + 2, w);   // d (u - 16)
    const float d = qb_half(b);
    f[0] = f[1] = d, c[0] = c[1] = -16.0f * d;
}

template <> QB_HD void qb_int32<QB_Q5_1>(const qb_u8* b, int, int (&w)[8], float (&f)[2], float (&c)[2]) {
    qb_nibbles32(b + 8, b + 4, w);   // d u + m
    f[0] = f[1] = qb_half(b), c[0] = c[1] = qb_half(b + 2);
}

template <> QB_HD void qb_int32<QB_Q8_0>(const qb_u8* b, int, int (&w)[8], float (&f)[2], float (&c)[2]) {
    unsigned u[8];   // d q
    qb_load_2(b + 2, u);
    for (int i = 0; i < 8; ++i) w[i] = (int)u[i];
    f[0] = f[1] = qb_half(b), c[0] = c[1] = 0.0f;
}

template <> QB_HD void qb_int32<QB_Q2_K>(const qb_u8* b, int s, int (&w)[8], float (&f)[2], float (&c)[2]) {
    unsigned q[8];   // d sc_h q - dmin m_h (layout: qb_dequant32<QB_Q2_K>)
    qb_load_2(b + 16 + 32 * (s >> 2), q);
    const int shift = 2 * (s & 3);
    for (int i = 0; i < 8; ++i) w[i] = (int)((q[i] >> shift) & 0x03030303u);
    const float d = qb_half(b + 80), mn = qb_half(b + 82);
    for (int h = 0; h < 2; ++h) {
        const int sc = b[2 * s + h];
        f[h] = d * (float)(sc & 0xF), c[h] = -(mn * (float)(sc >> 4));
    }
}

template <> QB_HD void qb_int32<QB_Q3_K>(const qb_u8* b, int s, int (&w)[8], float (&f)[2], float (&c)[2]) {
    unsigned q[8], hm[8];   // dl_h (u - 4), u = 2 low bits | the hmask bit << 2 (layout: qb_dequant32<QB_Q3_K>)
    qb_load_2(b + 32 + 32 * (s >> 2), q);
    qb_load_2(b, hm);
    const int shift = 2 * (s & 3);
    for (int i = 0; i < 8; ++i) w[i] = (int)(((q[i] >> shift) & 0x03030303u) | (((hm[i] >> s) & 0x01010101u) << 2));
    const float d = qb_half(b + 108);
    for (int h = 0; h < 2; ++h) f[h] = d * (float)qb_scale_q3k(2 * s + h, b + 96), c[h] = 0.0f;
}

template <> QB_HD void qb_int32<QB_Q4_K>(const qb_u8* b, int s, int (&w)[8], float (&f)[2], float (&c)[2]) {
    int sc, m;   // d sc n - dmin m, n the nibble (s & 1) of qs[32 (s / 2) ..]
    qb_scale_min_k4(s, b + 4, sc, m);
    unsigned q[8];
    qb_load16(b + 16 + 32 * (s >> 1), *reinterpret_cast<unsigned (*)[4]>(q));
    qb_load16(b + 32 + 32 * (s >> 1), *reinterpret_cast<unsigned (*)[4]>(q + 4));
    const int shift = 4 * (s & 1);
    for (int i = 0; i < 8; ++i) w[i] = (int)((q[i] >> shift) & 0x0F0F0F0Fu);
    f[0] = f[1] = qb_half(b) * (float)sc, c[0] = c[1] = -(qb_half(b + 2) * (float)m);
}

template <> QB_HD void qb_int32<QB_Q5_K>(const qb_u8* b, int s, int (&w)[8], float (&f)[2], float (&c)[2]) {
    int sc, m;   // d sc u - dmin m, u = nibble | the qh bit s << 4 (layout: qb_dequant32<QB_Q5_K>)
    qb_scale_min_k4(s, b + 4, sc, m);
    unsigned q[8], h[8];
    qb_load16(b + 48 + 32 * (s >> 1), *reinterpret_cast<unsigned (*)[4]>(q));
    qb_load16(b + 64 + 32 * (s >> 1), *reinterpret_cast<unsigned (*)[4]>(q + 4));
    qb_load16(b + 16, *reinterpret_cast<unsigned (*)[4]>(h));
    qb_load16(b + 32, *reinterpret_cast<unsigned (*)[4]>(h + 4));
    const int shift = 4 * (s & 1);
    for (int i = 0; i < 8; ++i) w[i] = (int)(((q[i] >> shift) & 0x0F0F0F0Fu) | (((h[i] >> s) & 0x01010101u) << 4));
    f[0] = f[1] = qb_half(b) * (float)sc, c[0] = c[1] = -(qb_half(b + 2) * (float)m);
}

template <> QB_HD void qb_int32<QB_Q6_K>(const qb_u8* b, int s, int (&w)[8], float (&f)[2], float (&c)[2]) {
    const int n = s >> 2, k = s & 3;   // d sc_h (u - 32), u the 6-bit value (layout: qb_dequant32<QB_Q6_K>)
    unsigned lw[8], hw[8];
    qb_load_2(b + 64 * n + 32 * (k & 1), lw);
    qb_load_2(b + 128 + 32 * n, hw);
    const int lshift = 4 * (k >> 1), hshift = 2 * k;
    for (int i = 0; i < 8; ++i)
        w[i] = (int)(((lw[i] >> lshift) & 0x0F0F0F0Fu) | (((hw[i] >> hshift) & 0x03030303u) << 4));
    const signed char* sc = reinterpret_cast<const signed char*>(b + 192) + 8 * n + 2 * k;
    const float d = qb_half(b + 208);
    f[0] = d * (float)sc[0], f[1] = d * (float)sc[1], c[0] = c[1] = 0.0f;
}

// ---------------------------------------------------------------------------------------
// The signed integer form (dense_q8x.cu's GEMV and its int8 tensor-core GEMM): qb_int8s<T> is qb_int32<T>
// with the offset folded into the bytes, w_j = u_j - QbQ8<T>::OFF as signed bytes, so that a
// product's integer sum needs no activation sum for it; qb_q8s_dot<T> the sub-block's dot from
// the integer sums of its halves S_lo, S_hi (sum of w_j q_j: one k32 product gives their total,
// S_hi 0, where !QbQ8<T>::HALVES), the activations' scale xd and sum xs (of 32) or per-half sums
// s_lo, s_hi (only Q2_K's per-half mins read them). It reads one factor pair where !HALVES (f and c
// equal across the halves: tests/test_quant_blocks.py checks it on ggml's values) and no c where
// HALVES with an offset (Q3_K, Q6_K: c = 0).
QB_HD unsigned qb_vsub4(unsigned a, unsigned b) {   // bytewise a - b, each modulo 256
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
    return __vsub4(a, b);
#else
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= ((((a >> (8 * i)) & 0xFFu) - ((b >> (8 * i)) & 0xFFu)) & 0xFFu) << (8 * i);
    return r;
#endif
}

template <int T> QB_HD void qb_int8s(const qb_u8* b, int s, int (&w)[8], float (&f)[2], float (&c)[2]) {
    qb_int32<T>(b, s, w, f, c);
    if (QbQ8<T>::OFF)
        for (int i = 0; i < 8; ++i) w[i] = (int)qb_vsub4((unsigned)w[i], QbQ8<T>::OFF * 0x01010101u);
}

template <int T>
QB_HD float qb_q8s_dot(int s_lo, int s_hi, float f0, float f1, float c0, float c1, float xd, float xs, int h_lo,
                       int h_hi) {
    if (!QbQ8<T>::HALVES) return xd * (f0 * (float)(s_lo + s_hi) + c0 * xs);
    if (QbQ8<T>::OFF == 0) return xd * (f0 * (float)s_lo + f1 * (float)s_hi + c0 * (float)h_lo + c1 * (float)h_hi);
    return xd * (f0 * (float)s_lo + f1 * (float)s_hi);
}

// The GEMV's dot of one sub-block (w from qb_int8s) with 32 int8 activations q (scale xd, sum
// xs): each half's integer sum by IDP4A, four a word (and each half's activation sum where
// Q2_K's mins need it), then qb_q8s_dot.
template <int T>
QB_HD float qb_dot_q8(const int (&w)[8], const float (&f)[2], const float (&c)[2], const int (&q)[8], float xd,
                      float xs) {
    int s_lo = 0, s_hi = 0, h_lo = 0, h_hi = 0;
    for (int i = 0; i < 4; ++i) s_lo = qb_dp4a(w[i], q[i], s_lo), s_hi = qb_dp4a(w[4 + i], q[4 + i], s_hi);
    if (QbQ8<T>::HALVES && QbQ8<T>::OFF == 0)
        for (int i = 0; i < 4; ++i) h_lo = qb_dp4a(0x01010101, q[i], h_lo), h_hi = qb_dp4a(0x01010101, q[4 + i], h_hi);
    return qb_q8s_dot<T>(s_lo, s_hi, f[0], f[1], c[0], c[1], xd, xs, h_lo, h_hi);
}

// ---------------------------------------------------------------------------------------
// Q4_K / Q5_K as dense_q8x.cu's vector GEMV (dense_gemv_q8x_v) reads them: eight lanes a block,
// lane k (0..7) holding the block's 16-byte head (d, dmin, the 12 scale bytes: words hd[0..3]),
// the 16 bytes of qs at QbLane<T>::QS + 16 k and (Q5_K) the 16 of qh at 16 + 16 (k & 1). Its
// bytes are values 16 (k & 1) .. 16 (k & 1) + 15 of two sub-blocks, 2 (k / 2) (low nibbles) and
// 2 (k / 2) + 1 (high nibbles): qb_k4_lane gives them as integer words lo / hi (0..31 a byte)
// with each sub-block's factors, value = f u + c. Its scales come from the head's words by word
// operations (all eight sub-blocks' 6-bit scales and mins at once: ggml's get_scale_min_k4),
// never a runtime index into registers.
template <int T> struct QbLane;
template <> struct QbLane<QB_Q4_K> { static constexpr int QS = 16; static constexpr bool QH = false; };
template <> struct QbLane<QB_Q5_K> { static constexpr int QS = 48; static constexpr bool QH = true; };

// The eight 6-bit scales (sc[0]: sub-blocks 0..3 a byte each, sc[1]: 4..7) and mins (m) of a
// Q4_K / Q5_K block from its scale bytes' three little-endian words s0, s1, s2 (bytes 4..15).
QB_HD void qb_k4_scale_words(unsigned s0, unsigned s1, unsigned s2, unsigned (&sc)[2], unsigned (&m)[2]) {
    sc[0] = s0 & 0x3F3F3F3Fu;
    m[0] = s1 & 0x3F3F3F3Fu;
    sc[1] = (s2 & 0x0F0F0F0Fu) | ((s0 >> 2) & 0x30303030u);
    m[1] = ((s2 >> 4) & 0x0F0F0F0Fu) | ((s1 >> 2) & 0x30303030u);
}

struct QbLaneVals {
    unsigned lo[4], hi[4];   // sub-block 2 (k / 2)'s 16 values (low), 2 (k / 2) + 1's (high), a byte each
    float f[2], c[2];        // their factors (c: -dmin m, on every lane: the caller adds it once a sub-block)
};

template <int T>
QB_HD void qb_k4_lane(const unsigned (&hd)[4], const unsigned (&qs)[4], const unsigned (&qh)[4], int k, QbLaneVals& v) {
    const int j = k >> 1;
    unsigned sc[2], m[2];
    qb_k4_scale_words(hd[1], hd[2], hd[3], sc, m);
    const unsigned sw = j < 2 ? sc[0] : sc[1], mw = j < 2 ? m[0] : m[1];
    const int b0 = 2 * (j & 1);   // the two sub-blocks' bytes in sw, mw
    float d, dm;
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
    const float2 dd = __half22float2(*reinterpret_cast<const __half2*>(&hd[0]));
    d = dd.x, dm = dd.y;
#else
    qb_u8 hb[4];
    memcpy(hb, &hd[0], 4);
    d = qb_half(hb), dm = qb_half(hb + 2);
#endif
    v.f[0] = d * qb_byte_f(sw, b0), v.f[1] = d * qb_byte_f(sw, b0 + 1);
    v.c[0] = -(dm * qb_byte_f(mw, b0)), v.c[1] = -(dm * qb_byte_f(mw, b0 + 1));
    for (int i = 0; i < 4; ++i) {
        v.lo[i] = qs[i] & 0x0F0F0F0Fu;
        v.hi[i] = (qs[i] >> 4) & 0x0F0F0F0Fu;
        if (QbLane<T>::QH) {
            v.lo[i] |= ((qh[i] >> (2 * j)) & 0x01010101u) << 4;
            v.hi[i] |= ((qh[i] >> (2 * j + 1)) & 0x01010101u) << 4;
        }
    }
}

// The lane's part of its two sub-blocks' dot with 8-bit activations: a_lo, a_hi the int8 words
// of the same 16 positions (scales xd0, xd1, sums of all 32 xs0, xs1); the min terms only where
// with_min (one lane of the two holding a sub-block's halves).
QB_HD float qb_k4_lane_dot(const QbLaneVals& v, const unsigned (&a_lo)[4], const unsigned (&a_hi)[4], float xd0,
                           float xs0, float xd1, float xs1, bool with_min) {
    int s0 = 0, s1 = 0;
    for (int i = 0; i < 4; ++i) s0 = qb_dp4a((int)v.lo[i], (int)a_lo[i], s0), s1 = qb_dp4a((int)v.hi[i], (int)a_hi[i], s1);
    const float r0 = v.f[0] * (float)s0 + (with_min ? v.c[0] * xs0 : 0.0f);
    const float r1 = v.f[1] * (float)s1 + (with_min ? v.c[1] * xs1 : 0.0f);
    return xd0 * r0 + xd1 * r1;
}

// Q6_K as the vector GEMV reads it: four lanes a block, lane (n, h) holding ql's 16 bytes at
// 64 n + 16 h (a) and at 64 n + 32 + 16 h (b), qh's 16 at 128 + 32 n + 16 h (q): values
// 128 n + 32 g + 16 h .. + 15 of the four 32-value groups g (ggml's dequantize_row_q6_K with
// l = 16 h + i: g 0 the low nibbles of a with qh bits 0-1, g 1 b's low with bits 2-3, g 2 a's high
// with bits 4-5, g 3 b's high with bits 6-7; each minus 32), scaled by d sc[8 n + 2 g + h].
// qb_q6k_lane gives each group's 16 unsigned 6-bit values (u, a byte each) and factor d sc.
struct QbQ6Lane {
    unsigned u[4][4];   // [g][word]
    float f[4];         // d * sc of group g
};

QB_HD void qb_q6k_lane(const unsigned (&a)[4], const unsigned (&b)[4], const unsigned (&q)[4], float d,
                       const int (&sc)[4], QbQ6Lane& v) {
    for (int i = 0; i < 4; ++i) {
        v.u[0][i] = (a[i] & 0x0F0F0F0Fu) | ((q[i] << 4) & 0x30303030u);
        v.u[1][i] = (b[i] & 0x0F0F0F0Fu) | ((q[i] << 2) & 0x30303030u);
        v.u[2][i] = ((a[i] >> 4) & 0x0F0F0F0Fu) | (q[i] & 0x30303030u);
        v.u[3][i] = ((b[i] >> 4) & 0x0F0F0F0Fu) | ((q[i] >> 2) & 0x30303030u);
    }
    for (int g = 0; g < 4; ++g) v.f[g] = d * (float)sc[g];
}

// The lane's part of its groups' dot with 8-bit activations: x[g] the int8 words of group g's
// same 16 positions, xd[g] its sub-block's scale. The offset 32 through the activations' own
// sum (IDP4A with -32 a byte), so the bytes stay as loaded.
QB_HD float qb_q6k_lane_dot(const QbQ6Lane& v, const unsigned (&x)[4][4], const float (&xd)[4]) {
    float r = 0.0f;
    for (int g = 0; g < 4; ++g) {
        int s = 0;
        for (int i = 0; i < 4; ++i) s = qb_dp4a((int)v.u[g][i], (int)x[g][i], qb_dp4a((int)0xE0E0E0E0u, (int)x[g][i], s));
        r += xd[g] * (v.f[g] * (float)s);
    }
    return r;
}

// ---- the group-staged vector GEMV's reads (dense_q8x.cu's group_dot): a group of whole blocks
// (8 of Q6_K, 32 of Q8_0: whole 16-byte units) as words in shared memory, each lane's 16-byte
// windows at even byte offsets o read as five aligned words and four byte permutes.
QB_HD unsigned qb_byte_perm(unsigned a, unsigned b, unsigned sel) {   // __byte_perm without its sign modes
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
    return __byte_perm(a, b, sel);
#else
    const unsigned long long x = (unsigned long long)a | ((unsigned long long)b << 32);
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned)((x >> (8 * ((sel >> (4 * i)) & 7))) & 0xFFu) << (8 * i);
    return r;
#endif
}

// The selector of a window at byte offset o (even): 0x3210 where o is 4-byte aligned, else 0x5432.
QB_HD unsigned qb_window_sel(int o) { return (o & 2) ? 0x5432u : 0x3210u; }

// The 16 bytes at byte o of words (4-byte aligned; the word after them readable) as four words,
// sel = qb_window_sel(o).
QB_HD void qb_window16(const unsigned* words, int o, unsigned sel, unsigned (&w)[4]) {
    unsigned x[5];
    for (int i = 0; i < 5; ++i) x[i] = words[(o >> 2) + i];
    for (int i = 0; i < 4; ++i) w[i] = qb_byte_perm(x[i], x[i + 1], sel);
}

// The half at a 2-byte aligned p as float (one 2-byte load on the device).
QB_HD float qb_half_a2(const qb_u8* p) {
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
    return __half2float(__ushort_as_half((unsigned short)qb_u16(p)));
#else
    return qb_half(p);
#endif
}

// Q6_K group lane L: block L / 4 of the group, half n = (L / 2) % 2, h = L % 2 (qb_q6k_lane). Its
// positions start at value qb_q6k_lane_value(L) of the group (256 (L / 4) + 128 n + 16 h): group
// g's four 16-value runs 32 apart from there, in sub-blocks qb_q6k_lane_value(L) / 32 .. + 3.
QB_HD int qb_q6k_lane_value(int lane) { return 256 * (lane >> 2) + 128 * ((lane >> 1) & 1) + 16 * (lane & 1); }

QB_HD void qb_q6k_group_lane(const unsigned* words, int lane, QbQ6Lane& v) {
    const int bi = lane >> 2, hn = (lane >> 1) & 1, h = lane & 1, o = 210 * bi;
    const unsigned sel = qb_window_sel(o);   // the same for the block's windows: all 16 bytes apart
    const qb_u8* bytes = reinterpret_cast<const qb_u8*>(words);
    unsigned a[4], b[4], q[4];
    qb_window16(words, o + 64 * hn + 16 * h, sel, a);
    qb_window16(words, o + 64 * hn + 32 + 16 * h, sel, b);
    qb_window16(words, o + 128 + 32 * hn + 16 * h, sel, q);
    int sc[4];
    for (int i = 0; i < 4; ++i) sc[i] = (signed char)bytes[o + 192 + 8 * hn + 2 * i + h];
    qb_q6k_lane(a, b, q, qb_half_a2(bytes + o + 208), sc, v);
}

// Q8_0 group lane L: block L of the group, its 32 bytes (from byte 34 L + 2) as words w, d its scale.
QB_HD void qb_q8_0_group_lane(const unsigned* words, int lane, unsigned (&w)[8], float& d) {
    const int o = 34 * lane + 2;
    const unsigned sel = qb_window_sel(o);
    qb_window16(words, o, sel, *reinterpret_cast<unsigned (*)[4]>(w));
    qb_window16(words, o + 16, sel, *reinterpret_cast<unsigned (*)[4]>(w + 4));
    d = qb_half_a2(reinterpret_cast<const qb_u8*>(words) + 34 * lane);
}

// Q8_0 as the vector GEMV reads it: a lane a block, its 32 bytes (qs, from byte 2) as words w and
// d its scale, times 32 int8 activations x of scale xd.
QB_HD float qb_q8_0_lane_dot(const unsigned (&w)[8], float d, const unsigned (&x)[8], float xd) {
    int s = 0;
    for (int i = 0; i < 8; ++i) s = qb_dp4a((int)w[i], (int)x[i], s);
    return xd * (d * (float)s);
}
