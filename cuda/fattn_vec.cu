// CUDA-core flash attention for few query rows (decode): split-KV / flash-decoding.
// K/V f16, bf16, or ggml's q8_0 / q4_0 blocks dequantized in registers (load8_quant, fattn_common.cuh).
//
// Block = 4 warps; it owns R query rows of one KV head (row i -> head hg*pack + i % pack,
// token qt*q_tile_tokens + i / pack, R = pack * q_tile_tokens) and a contiguous range of the
// live 64-column KV tiles of its query tile (split z of n_splits). Per tile:
//   1. scores: L lanes (a "group") share one KV row, each lane 16-byte chunks of it; every
//      group computes the R dot products of its row with the f32 Q rows held in registers
//      and reduces them with shuffles -> shared sS[R][64] (scaled, softcapped, masked, log2)
//   2. per row: tile max, rescale factor, probabilities in place, running sum
//   3. every group accumulates p * V for its KV rows into registers (its chunks of head_dim_v)
// At the end the groups' accumulators are summed in shared memory and written to dst (one
// split) or to the split workspace (fattn_combine finishes).
// Grid (n_q_tiles, n_head / pack, ne3 * n_splits); 128 threads; dynamic shared memory
// VecCfg::SMEM (the host reads it from the cubin: fattn_vec_smem, at the end of this file).
#include "fattn_common.cuh"

template <int DK, int DV, int R>
struct VecCfg {
    static constexpr int NW = 4;
    static constexpr int NT = 32 * NW;
    static constexpr int BK = FATTN_KV_TILE;
    static constexpr int CHK = DK / 8, CHV = DV / 8;            // 16-byte chunks per K / V row
    static constexpr int L = CHK >= 32 ? 32 : CHK > 8 ? 16 : CHK > 4 ? 8 : 4;  // lanes per KV row
    static constexpr int RPW = 32 / L;                          // KV rows per warp per pass
    static constexpr int NG = NW * RPW;                         // groups per block
    static constexpr int PASSES = BK / NG;
    static constexpr int NCK = (CHK + L - 1) / L, NCV = (CHV + L - 1) / L;  // chunks per lane
    static constexpr int SMEM = 4 * (R * BK + 3 * R + NG * R * DV);
    static_assert(DK % 8 == 0 && DV % 8 == 0, "head sizes must be multiples of 8");
    static_assert(BK % NG == 0, "tile must split evenly over the groups");
};

template <int DK, int DV, typename T, int R>
__global__ void __launch_bounds__(128)
fattn_vec(const FattnParams p) {
    using C = VecCfg<DK, DV, R>;
    constexpr int BK = C::BK, L = C::L, RPW = C::RPW, NG = C::NG, PASSES = C::PASSES;
    constexpr int NCK = C::NCK, NCV = C::NCV, CHK = C::CHK, CHV = C::CHV, NT = C::NT;

    extern __shared__ uint4 smem_raw[];
    float* sS = reinterpret_cast<float*>(smem_raw);   // [R][BK]
    float* sM = sS + R * BK;                          // [R] running max (log2 domain)
    float* sL = sM + R;                               // [R] running sum
    float* sA = sL + R;                               // [R] rescale factor of this tile
    float* sAcc = sA + R;                             // [NG][R][DV] (epilogue)

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int grp_in_warp = lane / L, li = lane % L;
    const int grp = warp * RPW + grp_in_warp;
    const int qt = blockIdx.x, hg = blockIdx.y;
    const int s = blockIdx.z / p.n_splits, split = blockIdx.z % p.n_splits;
    const int P = p.pack;
    const int hk = (hg * P) / p.gqa;

    // ---- Q rows (f32) -> registers: this lane's chunks of each row
    float q[R][NCK * 8];
    const char* mrow[R];
    float slope[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int tok = qt * p.q_tile_tokens + r / P, h = hg * P + r % P;
        const bool valid = tok < p.n_batch && r / P < p.q_tile_tokens;
        mrow[r] = (p.mask && valid) ? mask_row(p, tok, h, s) : nullptr;
        slope[r] = alibi_slope(p, h);
        const float* qr = reinterpret_cast<const float*>(p.q + (long long)s * p.q_nb3 + (long long)h * p.q_nb2 +
                                                         (long long)tok * p.q_nb1);
#pragma unroll
        for (int i = 0; i < NCK; ++i) {
            const int ch = li + i * L;
#pragma unroll
            for (int e = 0; e < 8; ++e) q[r][i * 8 + e] = (valid && ch < CHK) ? qr[ch * 8 + e] : 0.0f;
        }
    }
    if (tid < R) { sM[tid] = FATTN_NEG_INF; sL[tid] = 0.0f; }

    float acc[R][NCV * 8];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int i = 0; i < NCV * 8; ++i) acc[r][i] = 0.0f;

    const LiveTiles lt = live_tiles(p, qt, s);
    int jb, je;
    split_range(lt.cnt, split, p.n_splits, jb, je);
    const char* kbase = p.k + (long long)hk * p.k_nb2 + (long long)s * p.k_nb3;
    const char* vbase = p.v + (long long)hk * p.v_nb2 + (long long)s * p.v_nb3;
    __syncthreads();

    for (int j = jb; j < je; ++j) {
        const int kv0 = lt[j] * BK;
        // ---- 1. scores
#pragma unroll
        for (int ps = 0; ps < PASSES; ++ps) {
            const int kl = ps * NG + grp, kv = kv0 + kl;
            const bool in = kv < p.n_kv;
            float dot[R];
#pragma unroll
            for (int r = 0; r < R; ++r) dot[r] = 0.0f;
#pragma unroll
            for (int i = 0; i < NCK; ++i) {
                const int ch = li + i * L;
                float kf[8];
                if constexpr (KVQuant<T>::value) {
                    load8_quant<T>(kbase + (long long)kv * p.k_nb1, ch, in && ch < CHK, kf);
                } else {
                    uint4 u = make_uint4(0, 0, 0, 0);
                    if (in && ch < CHK) u = __ldg(reinterpret_cast<const uint4*>(kbase + (long long)kv * p.k_nb1) + ch);
                    unpack8<T>(u, kf);
                }
#pragma unroll
                for (int r = 0; r < R; ++r)
#pragma unroll
                    for (int e = 0; e < 8; ++e) dot[r] = fmaf(q[r][i * 8 + e], kf[e], dot[r]);
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
#pragma unroll
                for (int o = L / 2; o > 0; o >>= 1) dot[r] += __shfl_xor_sync(0xffffffffu, dot[r], o);
            }
            if (li == 0) {
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    float x = dot[r] * p.scale;
                    if (p.softcap != 0.0f) x = p.softcap * tanhf(x);
                    if (in) {
                        if (mrow[r]) {   // a -inf cell is -inf whatever K holds there
                            const float mv = __half2float(__ldg(reinterpret_cast<const __half*>(mrow[r]) + kv));
                            x = mv == FATTN_NEG_INF ? FATTN_NEG_INF : x + slope[r] * mv;
                        }
                    } else {
                        x = FATTN_NEG_INF;
                    }
                    sS[r * BK + kl] = x * FATTN_LOG2E;
                }
            }
        }
        __syncthreads();
        // ---- 2. softmax bookkeeping, one warp per row
        for (int r = warp; r < R; r += C::NW) {
            const float x0 = sS[r * BK + lane], x1 = sS[r * BK + lane + 32];
            const float mx = warp_max(fmaxf(x0, x1));
            const float m_old = sM[r];
            const float m_new = fmaxf(m_old, mx);
            const float m_use = m_new == FATTN_NEG_INF ? 0.0f : m_new;
            const float p0 = exp2f(x0 - m_use), p1 = exp2f(x1 - m_use);
            sS[r * BK + lane] = p0;
            sS[r * BK + lane + 32] = p1;
            const float sum = warp_sum(p0 + p1);
            const float alpha = exp2f(m_old - m_use);
            __syncwarp();
            if (lane == 0) { sA[r] = alpha; sM[r] = m_new; sL[r] = sL[r] * alpha + sum; }
        }
        __syncthreads();
        // ---- 3. acc = acc * alpha + P V
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float a = sA[r];
#pragma unroll
            for (int i = 0; i < NCV * 8; ++i) acc[r][i] *= a;
        }
#pragma unroll
        for (int ps = 0; ps < PASSES; ++ps) {
            const int kl = ps * NG + grp, kv = kv0 + kl;
            const bool in = kv < p.n_kv;
#pragma unroll
            for (int i = 0; i < NCV; ++i) {
                const int ch = li + i * L;
                float vf[8];
                if constexpr (KVQuant<T>::value) {
                    load8_quant<T>(vbase + (long long)kv * p.v_nb1, ch, in && ch < CHV, vf);
                } else {
                    uint4 u = make_uint4(0, 0, 0, 0);
                    if (in && ch < CHV) u = __ldg(reinterpret_cast<const uint4*>(vbase + (long long)kv * p.v_nb1) + ch);
                    unpack8<T>(u, vf);
                }
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const float pr = sS[r * BK + kl];
                    if (pr == 0.0f) continue;   // a masked cell adds nothing, even when V holds NaN/inf
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[r][i * 8 + e] = fmaf(pr, vf[e], acc[r][i * 8 + e]);
                }
            }
        }
        __syncthreads();
    }

    // ---- epilogue: sum the groups' accumulators, finish or write the split partial
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int i = 0; i < NCV; ++i) {
            const int ch = li + i * L;
            if (ch < CHV) {
#pragma unroll
                for (int e = 0; e < 8; ++e) sAcc[(grp * R + r) * DV + ch * 8 + e] = acc[r][i * 8 + e];
            }
        }
    __syncthreads();
    for (int i = tid; i < R * DV; i += NT) {
        const int r = i / DV, c = i % DV;
        const int tok = qt * p.q_tile_tokens + r / P, h = hg * P + r % P;
        if (tok >= p.n_batch || r / P >= p.q_tile_tokens) continue;
        float o = 0.0f;
#pragma unroll
        for (int gi = 0; gi < NG; ++gi) o += sAcc[(gi * R + r) * DV + c];
        const float M = sM[r], Ls = sL[r];
        store_row_value(p, ((long long)s * p.n_batch + tok) * p.n_head + h, h, c, DV, split, o, M, Ls);
    }
}

// The dynamic shared memory (bytes) a launch of fattn_vec<...> with the same parameters takes: the
// host reads it from the compiled program (ggml_attn/variants.py smem_expr, ggml_attn/cubin.py)
template <int DK, int DV, typename T, int R>
__device__ const int fattn_vec_smem = VecCfg<DK, DV, R>::SMEM;
