// Tensor-core flash attention (prefill, and decode for grouped-query attention).
//
// mma.sync m16n8k16 (f16 or bf16 operands, f32 accumulate), ldmatrix, and a two-stage
// cp.async K/V pipeline. Q (f32 in global) is converted to the K/V type on load.
//
// Block = NWQ x NWK warps. The block's BM = 16*NWQ query rows are (token, head) pairs of one
// KV head: row i -> head hg*pack + i % pack, token qt*q_tile_tokens + i / pack. Warp (wq, wk)
// owns rows [16 wq, 16 wq + 16) and the KV columns [wk*KW, wk*KW + KW) of every 64-column KV
// tile (KW = 64 / NWK), running its own online softmax; the NWK partial states are merged
// in shared memory at the end.
//   prefill:   NWQ = 4, NWK = 1 (64 rows, all warps share each K/V tile)
//   decode-tc: NWQ = 1, NWK = 4 (16 rows = packed query heads, the KV tile split over warps)
// Each block walks only the live KV tiles of its query tile (fattn_util.cu builds the list),
// split over gridDim.z / ne3 KV splits (flash-decoding); with one split it writes dst,
// otherwise partials that fattn_combine merges.
// Grid (n_q_tiles, n_head / pack, ne3 * n_splits). Dynamic shared memory: fattn_mma_smem()
// below (mirrored in ggml_attn/kernels.py).
#include "fattn_common.cuh"

template <int DK, int DV, int NWQ, int NWK>
struct MmaCfg {
    static constexpr int BK = FATTN_KV_TILE;
    static constexpr int KW = BK / NWK;
    static constexpr int BM = 16 * NWQ;
    static constexpr int NT = 32 * NWQ * NWK;
    static constexpr int DKP = (DK + 15) / 16 * 16;
    static constexpr int DVP = (DV + 15) / 16 * 16;
    static constexpr int SK = DKP + 8;      // smem row stride (elements) of Q and K: +16 B breaks bank conflicts
    static constexpr int SV = DVP + 8;
    // K/V pipeline depth: 3 for decode-tc (latency-bound, little compute per tile) where it fits
    static constexpr int STAGES = (NWK > 1 && DKP + DVP <= 512) ? 3 : 2;
    static constexpr bool Q_REGS = DKP <= 128;
    static constexpr int SO = DVP + 4;      // epilogue row stride (floats)
    static constexpr int SM = BK + 8;       // mask tile row stride (halves)
    static constexpr int PIPE_BYTES = 2 * (BM * SK + STAGES * BK * (SK + SV) + STAGES * BM * SM);
    static constexpr int EPI_BYTES = 4 * NWK * BM * (SO + 2);
    static constexpr int SMEM = PIPE_BYTES > EPI_BYTES ? PIPE_BYTES : EPI_BYTES;
    static_assert(KW % 16 == 0, "each warp needs a multiple of 16 KV columns");
    static_assert(DK % 8 == 0 && DV % 8 == 0, "head sizes must be multiples of 8 (16-byte rows)");
};

template <int DK, int DV, typename T, int NWQ, int NWK>
__global__ void __launch_bounds__(32 * NWQ * NWK)
fattn_mma(const FattnParams p) {
    using C = MmaCfg<DK, DV, NWQ, NWK>;
    constexpr int BK = C::BK, KW = C::KW, BM = C::BM, NT = C::NT;
    constexpr int DKP = C::DKP, DVP = C::DVP, SK = C::SK, SV = C::SV, STAGES = C::STAGES;

    extern __shared__ uint4 smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sK = sQ + BM * SK;
    T* sV = sK + STAGES * BK * SK;
    __half* sMask = reinterpret_cast<__half*>(sV + STAGES * BK * SV);   // [STAGES][BM][SM]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wq = warp % NWQ, wk = warp / NWQ;
    const int g = lane >> 2, t4 = lane & 3;
    const int qt = blockIdx.x, hg = blockIdx.y;
    const int s = blockIdx.z / p.n_splits, split = blockIdx.z % p.n_splits;
    const int P = p.pack;
    const int hk = (hg * P) / p.gqa;
    const long long n_rows_total = (long long)p.ne3 * p.n_batch * p.n_head;

    // ---- zero the padding columns of K/V stages (head sizes not a multiple of 16)
    if (DKP != DK || DVP != DV) {
        for (int i = tid; i < STAGES * BK; i += NT) {
            for (int c = DK; c < DKP; ++c) sK[i * SK + c] = KVTraits<T>::from_f(0.0f);
            for (int c = DV; c < DVP; ++c) sV[i * SV + c] = KVTraits<T>::from_f(0.0f);
        }
    }
    // ---- Q tile -> shared (converted to T), zero for rows past n_batch and padding columns.
    // 16-byte loads issued in unrolled batches so that many are in flight (a load-then-store
    // loop runs at one memory latency per element and dominated blocks with few KV tiles).
    const bool q_vec = DK % 4 == 0 &&
        ((reinterpret_cast<size_t>(p.q) | (size_t)p.q_nb1 | (size_t)p.q_nb2 | (size_t)p.q_nb3) & 15) == 0;
    if (q_vec) {
        constexpr int QV = DKP / 4, QITEMS = BM * QV, QB = 8;
        for (int base = 0; base < QITEMS; base += QB * NT) {
            float4 buf[QB];
#pragma unroll
            for (int u = 0; u < QB; ++u) {
                const int i = base + u * NT + tid;
                const int r = i / QV, c4 = i % QV;
                const int tok = qt * p.q_tile_tokens + r / P, h = hg * P + r % P;
                buf[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (i < QITEMS && c4 * 4 < DK && tok < p.n_batch && r / P < p.q_tile_tokens)
                    buf[u] = __ldg(reinterpret_cast<const float4*>(p.q + (long long)s * p.q_nb3 +
                        (long long)h * p.q_nb2 + (long long)tok * p.q_nb1) + c4);
            }
#pragma unroll
            for (int u = 0; u < QB; ++u) {
                const int i = base + u * NT + tid;
                if (i < QITEMS) {
                    const int r = i / QV, c4 = i % QV;
                    uint2 w;
                    w.x = KVTraits<T>::pack2(buf[u].x, buf[u].y);
                    w.y = KVTraits<T>::pack2(buf[u].z, buf[u].w);
                    *reinterpret_cast<uint2*>(sQ + r * SK + c4 * 4) = w;
                }
            }
        }
    } else {
        for (int i = tid; i < BM * DKP; i += NT) {
            const int r = i / DKP, c = i % DKP;
            const int tok = qt * p.q_tile_tokens + r / P, h = hg * P + r % P;
            float x = 0.0f;
            if (c < DK && tok < p.n_batch && r / P < p.q_tile_tokens)
                x = *reinterpret_cast<const float*>(p.q + (long long)s * p.q_nb3 + (long long)h * p.q_nb2 +
                                                    (long long)tok * p.q_nb1 + (long long)c * 4);
            sQ[r * SK + c] = KVTraits<T>::from_f(x);
        }
    }

    // ---- per-thread rows: g and g + 8 of this warp's 16
    const char* mrow[2];
    float slope[2];
#pragma unroll
    for (int rs = 0; rs < 2; ++rs) {
        const int r = 16 * wq + g + 8 * rs;
        const int tok = qt * p.q_tile_tokens + r / P, h = hg * P + r % P;
        const bool valid = tok < p.n_batch && r / P < p.q_tile_tokens;
        mrow[rs] = (p.mask && valid) ? mask_row(p, tok, h, s) : nullptr;
        slope[rs] = alibi_slope(p, h);
    }

    // mask tiles go through shared memory (cp.async with K/V) when rows are 16-byte aligned
    const bool mask_smem = p.mask != nullptr &&
        ((reinterpret_cast<size_t>(p.mask) | (size_t)p.m_nb1 | (size_t)p.m_nb2 | (size_t)p.m_nb3) & 15) == 0;
    const LiveTiles lt = live_tiles(p, qt, s);
    int jb, je;
    split_range(lt.cnt, split, p.n_splits, jb, je);

    const char* kbase = p.k + (long long)hk * p.k_nb2 + (long long)s * p.k_nb3;
    const char* vbase = p.v + (long long)hk * p.v_nb2 + (long long)s * p.v_nb3;
    auto load_kv = [&](int stage, int tile) {
        const int kv0 = tile * BK;
        T* dk = sK + stage * BK * SK;
        T* dv = sV + stage * BK * SV;
        constexpr int CK = DK / 8, CV = DV / 8;
        for (int i = tid; i < BK * CK; i += NT) {
            const int r = i / CK, ch = i % CK;
            const bool in = kv0 + r < p.n_kv;
            const char* src = in ? kbase + (long long)(kv0 + r) * p.k_nb1 + ch * 16 : kbase;
            cp_async16(smem_u32(dk + r * SK + ch * 8), src, in ? 16 : 0);
        }
        for (int i = tid; i < BK * CV; i += NT) {
            const int r = i / CV, ch = i % CV;
            const bool in = kv0 + r < p.n_kv;
            const char* src = in ? vbase + (long long)(kv0 + r) * p.v_nb1 + ch * 16 : vbase;
            cp_async16(smem_u32(dv + r * SV + ch * 8), src, in ? 16 : 0);
        }
        if (mask_smem) {
            __half* dm = sMask + stage * BM * C::SM;
            for (int i = tid; i < BM * (BK / 8); i += NT) {
                const int r = i / (BK / 8), ch = i % (BK / 8);
                const int tok = qt * p.q_tile_tokens + r / P, h = hg * P + r % P;
                const int left = p.n_kv - (kv0 + ch * 8);   // mask columns left from this chunk
                const bool in = tok < p.n_batch && r / P < p.q_tile_tokens && left > 0;
                const char* src = in ? mask_row(p, tok, h, s) + (long long)(kv0 + ch * 8) * 2 : p.mask;
                // a chunk that ends past n_kv (padded mask rows, n_kv % 8 != 0) reads only the
                // columns < n_kv; cp.async zero-fills the rest (masked by the KV bound below)
                cp_async16(smem_u32(dm + r * C::SM + ch * 8), src, in ? 2 * min(8, left) : 0);
            }
        }
    };

    float O[DVP / 8][4];
#pragma unroll
    for (int i = 0; i < DVP / 8; ++i) O[i][0] = O[i][1] = O[i][2] = O[i][3] = 0.0f;
    float m[2] = {FATTN_NEG_INF, FATTN_NEG_INF}, l[2] = {0.0f, 0.0f};
    unsigned Qf[C::Q_REGS ? DKP / 16 : 1][4];

    // prologue: tiles jb .. jb+STAGES-2 in flight (one commit group per tile, empty groups
    // keep the count uniform)
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
        if (jb + i < je) load_kv(i, lt[jb + i]);
        cp_async_commit();
    }
    __syncthreads();  // Q in shared memory
    const int lr = lane & 7, lm = lane >> 3;
    const unsigned q_addr = smem_u32(sQ + (16 * wq + lr + (lm & 1) * 8) * SK + (lm >> 1) * 8);
    if (C::Q_REGS) {
#pragma unroll
        for (int ks = 0; ks < (C::Q_REGS ? DKP / 16 : 0); ++ks)
            ldmatrix_x4(Qf[ks][0], Qf[ks][1], Qf[ks][2], Qf[ks][3], q_addr + ks * 32);
    }

    for (int j = jb; j < je; ++j) {
        const int stage = (j - jb) % STAGES;
        // refill the stage used by iteration j-1 (all threads passed its closing barrier)
        if (j + STAGES - 1 < je) load_kv((j - jb + STAGES - 1) % STAGES, lt[j + STAGES - 1]);
        cp_async_commit();
        cp_async_wait<STAGES - 1>();   // tile j has landed
        __syncthreads();
        const int kv0 = lt[j] * BK + wk * KW;

        // ---- S = Q K^T for 16 rows x KW columns
        float S[KW / 8][4];
#pragma unroll
        for (int i = 0; i < KW / 8; ++i) S[i][0] = S[i][1] = S[i][2] = S[i][3] = 0.0f;
        const unsigned k_addr = smem_u32(sK + stage * BK * SK + (wk * KW + lr + (lm >> 1) * 8) * SK + (lm & 1) * 8);
#pragma unroll
        for (int ks = 0; ks < DKP / 16; ++ks) {
            unsigned a[4];
            if (C::Q_REGS) {
                a[0] = Qf[C::Q_REGS ? ks : 0][0]; a[1] = Qf[C::Q_REGS ? ks : 0][1];
                a[2] = Qf[C::Q_REGS ? ks : 0][2]; a[3] = Qf[C::Q_REGS ? ks : 0][3];
            } else {
                ldmatrix_x4(a[0], a[1], a[2], a[3], q_addr + ks * 32);
            }
#pragma unroll
            for (int np = 0; np < KW / 16; ++np) {
                unsigned b0, b1, b2, b3;
                ldmatrix_x4(b0, b1, b2, b3, k_addr + (np * 16 * SK + ks * 16) * 2);
                Mma<T>::run(S[2 * np], a, b0, b1);
                Mma<T>::run(S[2 * np + 1], a, b2, b3);
            }
        }

        // ---- scale, softcap, ALiBi * mask, KV bounds; to the log2 domain
        const __half* sm_tile = sMask + stage * BM * C::SM + (16 * wq + g) * C::SM + wk * KW + 2 * t4;
#pragma unroll
        for (int nt = 0; nt < KW / 8; ++nt) {
#pragma unroll
            for (int rs = 0; rs < 2; ++rs) {
                float mv0 = 0.0f, mv1 = 0.0f;
                const int col = kv0 + nt * 8 + 2 * t4;
                if (mask_smem) {
                    const float2 mv = __half22float2(*reinterpret_cast<const __half2*>(sm_tile + rs * 8 * C::SM + nt * 8));
                    mv0 = mv.x; mv1 = mv.y;
                } else if (mrow[rs]) {
                    const __half* mr = reinterpret_cast<const __half*>(mrow[rs]);
                    if (col < p.n_kv) mv0 = __half2float(__ldg(mr + col));
                    if (col + 1 < p.n_kv) mv1 = __half2float(__ldg(mr + col + 1));
                }
                float x0 = S[nt][2 * rs] * p.scale, x1 = S[nt][2 * rs + 1] * p.scale;
                if (p.softcap != 0.0f) { x0 = p.softcap * tanhf(x0); x1 = p.softcap * tanhf(x1); }
                x0 = col < p.n_kv ? (x0 + slope[rs] * mv0) * FATTN_LOG2E : FATTN_NEG_INF;
                x1 = col + 1 < p.n_kv ? (x1 + slope[rs] * mv1) * FATTN_LOG2E : FATTN_NEG_INF;
                S[nt][2 * rs] = x0;
                S[nt][2 * rs + 1] = x1;
            }
        }

        // ---- online softmax (rows g and g+8; 4 lanes share a row)
#pragma unroll
        for (int rs = 0; rs < 2; ++rs) {
            float mx = FATTN_NEG_INF;
#pragma unroll
            for (int nt = 0; nt < KW / 8; ++nt) mx = fmaxf(mx, fmaxf(S[nt][2 * rs], S[nt][2 * rs + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(m[rs], mx);
            const float m_use = m_new == FATTN_NEG_INF ? 0.0f : m_new;
            const float alpha = exp2f(m[rs] - m_use);  // m == -inf -> 0
            m[rs] = m_new;
            l[rs] *= alpha;
#pragma unroll
            for (int i = 0; i < DVP / 8; ++i) { O[i][2 * rs] *= alpha; O[i][2 * rs + 1] *= alpha; }
#pragma unroll
            for (int nt = 0; nt < KW / 8; ++nt) {
                S[nt][2 * rs] = exp2f(S[nt][2 * rs] - m_use);
                S[nt][2 * rs + 1] = exp2f(S[nt][2 * rs + 1] - m_use);
                l[rs] += S[nt][2 * rs] + S[nt][2 * rs + 1];
            }
        }

        // ---- O += P V
        const unsigned v_addr = smem_u32(sV + stage * BK * SV + (wk * KW + lr + (lm & 1) * 8) * SV + (lm >> 1) * 8);
#pragma unroll
        for (int kk = 0; kk < KW / 16; ++kk) {
            unsigned a[4];
            a[0] = KVTraits<T>::pack2(S[2 * kk][0], S[2 * kk][1]);
            a[1] = KVTraits<T>::pack2(S[2 * kk][2], S[2 * kk][3]);
            a[2] = KVTraits<T>::pack2(S[2 * kk + 1][0], S[2 * kk + 1][1]);
            a[3] = KVTraits<T>::pack2(S[2 * kk + 1][2], S[2 * kk + 1][3]);
#pragma unroll
            for (int dp = 0; dp < DVP / 16; ++dp) {
                unsigned b0, b1, b2, b3;
                ldmatrix_x4_trans(b0, b1, b2, b3, v_addr + (kk * 16 * SV + dp * 16) * 2);
                Mma<T>::run(O[2 * dp], a, b0, b1);
                Mma<T>::run(O[2 * dp + 1], a, b2, b3);
            }
        }
        __syncthreads();  // this stage may be refilled by the next iteration's prefetch
    }
    cp_async_wait<0>();   // drain (empty) trailing groups before shared memory is reused
    __syncthreads();

    // ---- epilogue: per-warp states -> shared, merge the NWK column groups, write
#pragma unroll
    for (int rs = 0; rs < 2; ++rs) {
        l[rs] += __shfl_xor_sync(0xffffffffu, l[rs], 1);
        l[rs] += __shfl_xor_sync(0xffffffffu, l[rs], 2);
    }
    float* sO = reinterpret_cast<float*>(smem_raw);
    float* sML = sO + NWK * BM * C::SO;
#pragma unroll
    for (int rs = 0; rs < 2; ++rs) {
        const int r = 16 * wq + g + 8 * rs;
        float* orow = sO + (wk * BM + r) * C::SO;
#pragma unroll
        for (int i = 0; i < DVP / 8; ++i)
            *reinterpret_cast<float2*>(orow + i * 8 + 2 * t4) = make_float2(O[i][2 * rs], O[i][2 * rs + 1]);
        if (t4 == 0) {
            sML[(wk * BM + r) * 2] = m[rs];
            sML[(wk * BM + r) * 2 + 1] = l[rs];
        }
    }
    __syncthreads();
    for (int i = tid; i < BM * DV; i += NT) {
        const int r = i / DV, c = i % DV;
        const int tok = qt * p.q_tile_tokens + r / P, h = hg * P + r % P;
        if (tok >= p.n_batch || r / P >= p.q_tile_tokens) continue;
        float M = FATTN_NEG_INF;
#pragma unroll
        for (int w = 0; w < NWK; ++w) M = fmaxf(M, sML[(w * BM + r) * 2]);
        float L = 0.0f, o = 0.0f;
#pragma unroll
        for (int w = 0; w < NWK; ++w) {
            const float mw = sML[(w * BM + r) * 2];
            const float f = (mw == FATTN_NEG_INF) ? 0.0f : exp2f(mw - M);
            L += sML[(w * BM + r) * 2 + 1] * f;
            o += sO[(w * BM + r) * C::SO + c] * f;
        }
        const long long row = ((long long)s * p.n_batch + tok) * p.n_head + h;
        if (p.n_splits == 1) {
            p.dst[row * DV + c] = o * row_finish_factor(p, h, M, L);
        } else {
            const long long wr = (long long)split * n_rows_total + row;
            p.ws_o[wr * DV + c] = o;
            if (c == 0) { p.ws_ml[wr * 2] = M; p.ws_ml[wr * 2 + 1] = L; }
        }
    }
}
