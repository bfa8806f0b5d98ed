// Tile steps of the warp-specialised wgmma prefill (cuda/fattn_wgmma.cu, version 1), shared
// with its operand probe (cuda/hopper_probe.cu): the S and P V GEMMs on the TMA-swizzled K/V
// stages, the online softmax, the P fragments and the n_kv tail, for KV tiles of BK = 64 or
// 128 cells. sm_90a only.
//
// A stage holds one K and one V tile of BK cells x 128 halves as two TMA boxes of BK x 64
// (d 0-63, then d 64-127), each written with the 128-byte swizzle (cuda/hopper_common.cuh,
// wgmma_desc_sw128). A warpgroup's S = Q K^T is 64 x BK: thread (warp w, lane 4g + t4) holds
// S[4i + {0, 1}] at row 16w + g, columns 8i + 2t4 + {0, 1} and S[4i + {2, 3}] at row 16w + g + 8.
#pragma once
#include "hopper_common.cuh"

namespace ws {
constexpr int D = 128, BQ = 128, THREADS = 384;   // two consumer warpgroups, one producer
// registers per thread after reallocation: 128 x (40 + 2 x 232) = 384 x 168 (the launch's share)
constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;
template <int BK> __host__ __device__ constexpr int tile_bytes() { return BK * D * 2; }    // one K or V tile
template <int BK> __host__ __device__ constexpr int box_bytes() { return BK * 64 * 2; }    // one of its two boxes
// dynamic shared memory: 1024-byte alignment slack, the ring, Q (128 x 128 halves), 4 mbarriers
// per stage (ggml_attn/hopper_prefill.py smem_ws)
template <int BK, int STAGES> __host__ __device__ constexpr int smem_bytes() {
    return 1024 + 2 * STAGES * tile_bytes<BK>() + BQ * D * 2 + 4 * STAGES * 8;
}
}

// S (log2 domain) -> P = 2^(S - m_new) in place; m and l updated, alpha[rs] = 2^(m_old - m_new)
// returned for the caller to rescale O with. Rows g (rs 0) and g + 8 (rs 1) of each warp's 16;
// a row's BK values live in the 4 threads of a quad.
template <int BK>
__device__ __forceinline__ void ws_softmax(float (&S)[BK / 2], float (&m)[2], float (&l)[2], float (&alpha)[2]) {
#pragma unroll
    for (int rs = 0; rs < 2; ++rs) {
        float mx = FATTN_NEG_INF;
#pragma unroll
        for (int i = 0; i < BK / 8; ++i) mx = fmaxf(mx, fmaxf(S[4 * i + 2 * rs], S[4 * i + 2 * rs + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m[rs], mx);
        const float m_use = m_new == FATTN_NEG_INF ? 0.0f : m_new;
        alpha[rs] = fast_exp2(m[rs] - m_use);   // m == -inf -> 0
        m[rs] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < BK / 8; ++i) {
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

// P (S's accumulators after ws_softmax) -> the A fragments of the BK / 16 k16 steps of P V
template <int BK>
__device__ __forceinline__ void ws_pack_p(const float (&S)[BK / 2], unsigned (&a)[BK / 4]) {
#pragma unroll
    for (int i = 0; i < BK / 4; ++i) a[i] = KVTraits<__half>::pack2(S[2 * i], S[2 * i + 1]);
}

// cells of the tile starting at kv0 that lie at or past n_kv -> -inf (the last tile only)
template <int BK>
__device__ __forceinline__ void ws_mask_tail(float (&S)[BK / 2], int kv0, int n_kv, int t4) {
    if (kv0 + BK <= n_kv) return;
#pragma unroll
    for (int i = 0; i < BK / 8; ++i)
#pragma unroll
        for (int c = 0; c < 2; ++c)
            if (kv0 + 8 * i + 2 * t4 + c >= n_kv) S[4 * i + c] = S[4 * i + 2 + c] = FATTN_NEG_INF;
}

// the K-major swizzled descriptor of k16 step ks (of 8 along D) of a K tile: 32-byte steps
// inside a box's 128-byte rows, the second box for d 64-127
template <int BK>
__device__ __forceinline__ unsigned long long ws_k_desc(unsigned k_addr, int ks) {
    return wgmma_desc_sw128(k_addr + (ks >> 2) * ws::box_bytes<BK>() + (ks & 3) * 32, 16, 1024);
}

// Index (in halves) of element (row, k) of a K-major tile of `rows` rows x 128 halves stored as
// TMA writes it with the 128-byte swizzle: two boxes of rows x 64 (k 0-63, k 64-127), row r's
// 16-byte chunk c at chunk c ^ (r % 8) of its 128-byte line
__device__ __forceinline__ int sw128_index(int row, int k, int rows) {
    return (k >> 6) * rows * 64 + row * 64 + ((((k & 63) >> 3) ^ (row & 7)) << 3) + (k & 7);
}

// S = Q K^T for one tile: 8 k16 steps; Q (64 rows x 128) in plain core matrices, or with
// QSW in the swizzled layout of a K tile of 64 rows (sw128_index)
template <int BK, bool QSW = false>
__device__ __forceinline__ void ws_issue_s(float (&S)[BK / 2], unsigned q_addr, unsigned k_addr) {
#pragma unroll
    for (int ks = 0; ks < ws::D / 16; ++ks) {
        const unsigned long long da = QSW ? ws_k_desc<64>(q_addr, ks)
                                          : wgmma_desc(q_addr + ks * 256, 128, (ws::D / 8) * 128);
        if constexpr (BK == 64) wgmma_m64n64k16_f16(S, da, ws_k_desc<BK>(k_addr, ks), ks > 0);
        else wgmma_m64n128k16_f16(S, da, ws_k_desc<BK>(k_addr, ks), ks > 0);
    }
}

// O += P V for one tile: BK / 16 k16 steps of 16 cells (2048 bytes of the swizzled boxes
// each); N = 128 spans both boxes (the lead byte offset: one box)
template <int BK>
__device__ __forceinline__ void ws_issue_pv(float (&O)[64], const unsigned (&a)[BK / 4], unsigned v_addr) {
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
        const unsigned ak[4] = {a[4 * kk], a[4 * kk + 1], a[4 * kk + 2], a[4 * kk + 3]};
        wgmma_m64n128k16_f16_rs<1>(O, ak, wgmma_desc_sw128(v_addr + kk * 2048, ws::box_bytes<BK>(), 1024), true);
    }
}
