// Tile steps of the warp-specialised wgmma prefill (cuda/fattn_wgmma.cu, version 1), shared
// with its operand probe (cuda/hopper_probe.cu): the S and P V GEMMs on the TMA-swizzled K/V
// stages, the online softmax, the P fragments and the n_kv tail. sm_90a only.
#pragma once
#include "hopper_common.cuh"

namespace ws {
constexpr int D = 128, BQ = 128, BK = 64, STAGES = 4, THREADS = 288;
constexpr int TILE_BYTES = BK * D * 2;     // one K or V tile: 16 KB
constexpr int BOX_HALVES = BK * 64;        // one 64 x 64 box (the d 0-63 or d 64-127 half)
}
#define WS_SMEM (1024 + 2 * ws::STAGES * ws::TILE_BYTES + ws::BQ * ws::D * 2 + 3 * ws::STAGES * 8)

// S (64 x 64 per warpgroup, log2 domain) -> P = 2^(S - m_new) in place; m and l updated,
// alpha[rs] = 2^(m_old - m_new) returned for the caller to rescale O with. Rows g (rs 0) and
// g + 8 (rs 1) of each warp's 16; a row's 64 values live in the 4 threads of a quad.
__device__ __forceinline__ void ws_softmax(float (&S)[32], float (&m)[2], float (&l)[2], float (&alpha)[2]) {
#pragma unroll
    for (int rs = 0; rs < 2; ++rs) {
        float mx = FATTN_NEG_INF;
#pragma unroll
        for (int i = 0; i < 8; ++i) mx = fmaxf(mx, fmaxf(S[4 * i + 2 * rs], S[4 * i + 2 * rs + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m[rs], mx);
        const float m_use = m_new == FATTN_NEG_INF ? 0.0f : m_new;
        alpha[rs] = fast_exp2(m[rs] - m_use);   // m == -inf -> 0
        m[rs] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            S[4 * i + 2 * rs] = fast_exp2(S[4 * i + 2 * rs] - m_use);
            S[4 * i + 2 * rs + 1] = fast_exp2(S[4 * i + 2 * rs + 1] - m_use);
            sum += S[4 * i + 2 * rs] + S[4 * i + 2 * rs + 1];
        }
        l[rs] = l[rs] * alpha[rs] + sum;
    }
}

__device__ __forceinline__ void ws_rescale(float (&O)[64], const float (&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        O[4 * i] *= alpha[0]; O[4 * i + 1] *= alpha[0];
        O[4 * i + 2] *= alpha[1]; O[4 * i + 3] *= alpha[1];
    }
}

// P (S's accumulators after ws_softmax) -> the A fragments of the 4 k16 steps of P V
__device__ __forceinline__ void ws_pack_p(const float (&S)[32], unsigned (&a)[16]) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) a[4 * kk + e] = KVTraits<__half>::pack2(S[8 * kk + 2 * e], S[8 * kk + 2 * e + 1]);
}

// cells of tile j at or past n_kv -> -inf (the last tile only)
__device__ __forceinline__ void ws_mask_tail(float (&S)[32], int kv0, int n_kv, int t4) {
    if (kv0 + ws::BK <= n_kv) return;
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int c = 0; c < 2; ++c)
            if (kv0 + 8 * i + 2 * t4 + c >= n_kv) S[4 * i + c] = S[4 * i + 2 + c] = FATTN_NEG_INF;
}

// S = Q K^T for one tile: 8 k16 steps; Q no-swizzle core matrices (64 rows x 128), K the stage's
// two swizzled 64 x 64 boxes (d 0-63, then d 64-127)
__device__ __forceinline__ void ws_issue_s(float (&S)[32], unsigned q_addr, unsigned k_addr) {
#pragma unroll
    for (int ks = 0; ks < ws::D / 16; ++ks)
        wgmma_m64n64k16_f16(S, wgmma_desc(q_addr + ks * 256, 128, (ws::D / 8) * 128),
                            wgmma_desc_sw128(k_addr + (ks >> 2) * (ws::BOX_HALVES * 2) + (ks & 3) * 32, 16, 1024),
                            ks > 0);
}

// O += P V for one tile: 4 k16 steps of 16 cells (2048 bytes of the swizzled boxes each); N =
// 128 spans both boxes (lead byte offset: one box)
__device__ __forceinline__ void ws_issue_pv(float (&O)[64], const unsigned (&a)[16], unsigned v_addr) {
#pragma unroll
    for (int kk = 0; kk < ws::BK / 16; ++kk) {
        const unsigned ak[4] = {a[4 * kk], a[4 * kk + 1], a[4 * kk + 2], a[4 * kk + 3]};
        wgmma_m64n128k16_f16_rs<1>(O, ak, wgmma_desc_sw128(v_addr + kk * 2048, ws::BOX_HALVES * 2, 1024), true);
    }
}

