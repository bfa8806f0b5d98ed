// Tensor-core flash attention (prefill, and decode for grouped-query attention).
//
// mma.sync m16n8k16 (f16 or bf16 operands, f32 accumulate), ldmatrix, and a cp.async K/V
// pipeline. Q (f32 in global) is converted to the K/V type on load; without softcap and ALiBi
// (EXT = false) it is pre-multiplied by scale * log2(e), so scores come out in the log2 domain.
//
// Block = NWQ x NWK warps, MT m16 tiles of rows per warp, ST K/V stages in the ring. The
// block's BM = 16*MT*NWQ query rows are (token, head) pairs of one KV head: row i -> head
// hg*pack + i % pack, token qt*q_tile_tokens + i / pack (pack is a power of two). Warp (wq, wk) owns rows [16 MT wq, 16 MT (wq + 1)) and the KV columns
// [wk*KW, wk*KW + KW) of every 64-column KV tile (KW = 64 / NWK), running its own online
// softmax; with NWK > 1 the partial states are merged in shared memory at the end.
//   prefill:   NWQ = 4, NWK = 1, MT = 1 (64 rows) or MT = 2 (128 rows, FA2 order; long batches)
//   decode-tc: NWQ = 1, NWK = 4, MT = 1 (16 rows = packed query heads, the KV tile split over warps)
// With softcap or ALiBi the EXT instance runs. On a HIDDEN tile (fattn_common.cuh) the V rows of
// the cells no row of the block sees (the plan's word for the tile, prefetched to L1 an
// iteration ahead) are zeroed, so NaN/inf garbage there cannot reach P V (0 * NaN): the ring
// zero-fills them by cp.async (no source bytes) instead of loading them; the FA2 order, where
// that predicate at the V issue made ptxas spill the 128-row tiles, lets each thread overwrite
// its own chunks of them with zeros after its wait, before the barrier that precedes P V.
// Each block walks only the live KV tiles of its query tile (fattn_util.cu builds the list),
// split over gridDim.z / ne3 KV splits (flash-decoding); with one split it writes dst,
// otherwise partials that fattn_combine merges. A tile's class (fattn_common.cuh) decides how
// it is masked: FULL tiles load no mask and check no bounds, PARTIAL tiles compare each row's
// [lo, hi) interval, PARTIAL|MASKED tiles load the mask tile with K and V.
// Grid (n_head / pack, n_q_tiles, ne3 * n_splits), query tiles in reverse order so that the
// heaviest tiles of a causal mask start first. Dynamic shared memory: MmaCfg::SMEM (the host
// reads it from the cubin: fattn_mma_smem, at the end of this file). The mask must have 16-byte aligned rows (the backend copies one
// that does not).
#include "fattn_common.cuh"

template <int DK, int DV, int NWQ, int NWK, int MT, int ST>
struct MmaCfg {
    static constexpr int BK = FATTN_KV_TILE;
    static constexpr int KW = BK / NWK;
    static constexpr int BM = 16 * MT * NWQ;
    static constexpr int NT = 32 * NWQ * NWK;
    static constexpr int DKP = (DK + 15) / 16 * 16;
    static constexpr int DVP = (DV + 15) / 16 * 16;
    static constexpr int SK = DKP + 8;      // smem row stride (elements) of Q and K: +16 B breaks bank conflicts
    static constexpr int SV = DVP + 8;
    // FA2 order (MT > 1): one K, one V and one mask buffer; V(j) loads during S(j) and the
    // softmax, K(j+1) and its mask during P(j)V(j). Otherwise a ring of ST K/V(/mask) tiles
    // (2 where ST > 2 does not fit).
    static constexpr bool FA2 = MT > 1;
    static constexpr int STAGES = FA2 ? 1 : (DKP + DVP <= 512 ? ST : 2);
    static constexpr bool Q_REGS = MT == 1 && DKP <= 128;
    static constexpr int SO = DVP + 4;      // epilogue row stride (floats)
    static constexpr int SM = BK + 8;       // mask tile row stride (halves)
    static constexpr int PIPE_BYTES = 2 * (BM * SK + STAGES * BK * (SK + SV) + STAGES * BM * SM);
    static constexpr int EPI_BYTES = NWK > 1 ? 4 * NWK * BM * (SO + 2) : 0;
    static constexpr int SMEM = PIPE_BYTES > EPI_BYTES ? PIPE_BYTES : EPI_BYTES;
    static_assert(KW % 16 == 0, "each warp needs a multiple of 16 KV columns");
    static_assert(DK % 8 == 0 && DV % 8 == 0, "head sizes must be multiples of 8 (16-byte rows)");
};

// ---------------------------------------------------------------------------------------
// Step: ROWS rows of CHUNKS 16-byte chunks, global -> shared (cp.async); rows >= rows_left
// are zero-filled (the n_kv tail: never NaN garbage under a zero probability), and so are the
// rows r < 64 whose bit (skip >> r) & 1 is set (the hidden cells of a V tile). Thread tid
// copies chunks i = tid, tid + NT, ... (row i / CHUNKS) on either path.
template <int ROWS, int CHUNKS, int NT>
__device__ __forceinline__ void load_rows_async(unsigned sdst, int sstride_bytes, const char* gsrc,
                                                long long gstride, int rows_left, int tid,
                                                unsigned long long skip = 0ull) {
    if constexpr (NT % CHUNKS == 0 && ROWS % (NT / CHUNKS) == 0) {
        constexpr int RS = NT / CHUNKS;   // rows per pass
        const int r0 = tid / CHUNKS, ch = tid % CHUNKS;
        const char* src = gsrc + r0 * gstride + ch * 16;
        const unsigned dst = sdst + r0 * sstride_bytes + ch * 16;
        const long long gstep = RS * gstride;
        const unsigned long long sk = ROWS <= 64 ? skip >> (r0 & 63) : 0ull;   // bit it*RS: row r0 + it*RS
#pragma unroll
        for (int it = 0; it < ROWS / RS; ++it) {
            const bool in = r0 + it * RS < rows_left && !(it * RS < 64 && ((sk >> (it * RS & 63)) & 1ull));
            cp_async16(dst + it * RS * sstride_bytes, in ? src + it * gstep : gsrc, in ? 16 : 0);
        }
    } else {
#pragma unroll 4
        for (int i = tid; i < ROWS * CHUNKS; i += NT) {
            const int r = i / CHUNKS, ch = i % CHUNKS;
            const bool in = r < rows_left && !(ROWS <= 64 && ((skip >> (r & 63)) & 1ull));
            cp_async16(sdst + r * sstride_bytes + ch * 16, in ? gsrc + r * gstride + ch * 16 : gsrc, in ? 16 : 0);
        }
    }
}

template <int DK, int DV, typename T, int NWQ, int NWK, int MT, int ST, bool EXT>
__global__ void __launch_bounds__(32 * NWQ * NWK, 2)
fattn_mma(const FattnParams p) {
    using C = MmaCfg<DK, DV, NWQ, NWK, MT, ST>;
    constexpr int BK = C::BK, KW = C::KW, BM = C::BM, NT = C::NT;
    constexpr int DKP = C::DKP, DVP = C::DVP, SK = C::SK, SV = C::SV, STAGES = C::STAGES;
    constexpr float ML = FATTN_LOG2E;   // mask -> score units, the log2 domain (times the slope)

    extern __shared__ uint4 smem_raw[];
    // FA2 order: the hidden words of this block's live list (nullptr without a plan), read from
    // shared memory where used (a register would stay live across the loop at the limit)
    __shared__ const unsigned long long* s_hid;
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sK = sQ + BM * SK;
    T* sV = sK + STAGES * BK * SK;
    __half* sMask = reinterpret_cast<__half*>(sV + STAGES * BK * SV);   // [STAGES][BM][SM]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wq = warp % NWQ, wk = warp / NWQ;
    const int g = lane >> 2, t4 = lane & 3;
    const int hg = blockIdx.x, qt = p.n_q_tiles - 1 - blockIdx.y;
    const int s = blockIdx.z / p.n_splits, split = blockIdx.z % p.n_splits;
    const int P = p.pack, pshift = __ffs(P) - 1;
    const int tq = p.q_tile_tokens, tok0 = qt * tq;
    const int hk = (hg * P) / p.gqa;

    // ---- zero the padding columns of K/V stages (head sizes not a multiple of 16)
    if constexpr (DKP != DK || DVP != DV) {
        for (int i = tid; i < STAGES * BK; i += NT) {
            for (int c = DK; c < DKP; ++c) sK[i * SK + c] = KVTraits<T>::from_f(0.0f);
            for (int c = DV; c < DVP; ++c) sV[i * SV + c] = KVTraits<T>::from_f(0.0f);
        }
    }

    // ---- step: Q tile -> shared (converted to T; pre-scaled unless EXT), zero rows past the
    // tile. 16-byte loads issued in unrolled batches so that many are in flight.
    {
        const float qs = EXT ? 1.0f : p.scale * FATTN_LOG2E;
        const char* qbase = p.q + (long long)s * p.q_nb3;
        constexpr int QV = DKP / 4, QITEMS = BM * QV, QB = 8;
        for (int base = 0; base < QITEMS; base += QB * NT) {
            float4 buf[QB];
#pragma unroll
            for (int u = 0; u < QB; ++u) {
                const int i = base + u * NT + tid;
                const int r = i / QV, c4 = i % QV;
                const int tr = r >> pshift, tok = tok0 + tr, h = hg * P + (r & (P - 1));
                buf[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (i < QITEMS && c4 * 4 < DK && tok < p.n_batch && tr < tq)
                    buf[u] = __ldg(reinterpret_cast<const float4*>(qbase + (long long)h * p.q_nb2 +
                                                                   (long long)tok * p.q_nb1) + c4);
            }
#pragma unroll
            for (int u = 0; u < QB; ++u) {
                const int i = base + u * NT + tid;
                if (i < QITEMS) {
                    const int r = i / QV, c4 = i % QV;
                    uint2 w;
                    w.x = KVTraits<T>::pack2(buf[u].x * qs, buf[u].y * qs);
                    w.y = KVTraits<T>::pack2(buf[u].z * qs, buf[u].w * qs);
                    *reinterpret_cast<uint2*>(sQ + r * SK + c4 * 4) = w;
                }
            }
        }
    }

    // ---- per-thread rows: g and g + 8 of each of this warp's MT m-tiles. A row's visible
    // interval [lo, hi) (PARTIAL tiles) is read when needed: registers are short with MT = 2.
    auto row_range = [&](int mt, int rs) -> int2 {
        const int r = 16 * (MT * wq + mt) + g + 8 * rs;
        const int tr = r >> pshift, tok = tok0 + tr, h = hg * P + (r & (P - 1));
        if (p.row_lohi && tok < p.n_batch && tr < tq)
            return __ldg(p.row_lohi + ((long long)(s % p.ne33) * p.ne32 + (p.ne32 == 1 ? 0 : h % p.ne32)) * p.n_batch + tok);
        return make_int2(0, p.n_kv);
    };
    float slope[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int rs = 0; rs < 2; ++rs) {
            const int r = 16 * (MT * wq + mt) + g + 8 * rs;
            slope[mt][rs] = EXT ? alibi_slope(p, hg * P + (r & (P - 1))) : 1.0f;
        }
    }

    const LiveTiles lt = live_tiles(p, qt, s);
    if (C::FA2 && tid == 0) s_hid = lt.idx ? lt.hidden_words(p, 0) : nullptr;   // published by the barrier after the prologue
    int jb, je;
    split_range(lt.cnt, split, p.n_splits, jb, je);

    const char* kbase = p.k + (long long)hk * p.k_nb2 + (long long)s * p.k_nb3;
    const char* vbase = p.v + (long long)hk * p.v_nb2 + (long long)s * p.v_nb3;
    const char* mbase = p.mask ? p.mask + (long long)(s % p.ne33) * p.m_nb3 : nullptr;

    // ---- step: K tile (and the mask tile of a MASKED tile) -> stage; V tile -> stage
    auto load_k = [&](int stage, int e) {
        const int kv0 = (e & FATTN_TILE_ID_MASK) * BK;
        const int left = p.n_kv - kv0;
        load_rows_async<BK, DK / 8, NT>(smem_u32(sK + stage * BK * SK), SK * 2,
                                        kbase + (long long)kv0 * p.k_nb1, p.k_nb1, left, tid);
        if (e & FATTN_TILE_MASKED) {
            __half* dm = sMask + stage * BM * C::SM;
            if (P == 1 && left >= BK) {   // rows = tokens of one head: a strided copy like K's
                load_rows_async<BM, BK / 8, NT>(smem_u32(dm), C::SM * 2,
                                                mbase + (long long)tok0 * p.m_nb1 + (long long)(hg % p.ne32) * p.m_nb2 +
                                                (long long)kv0 * 2, p.m_nb1, min(tq, p.n_batch - tok0), tid);
            } else for (int i = tid; i < BM * (BK / 8); i += NT) {
                const int r = i / (BK / 8), ch = i % (BK / 8);
                const int tr = r >> pshift, tok = tok0 + tr, h = hg * P + (r & (P - 1));
                const int cl = left - ch * 8;   // mask columns left from this chunk
                const bool row = tok < p.n_batch && tr < tq;
                const char* src = row ? mbase + (long long)tok * p.m_nb1 + (long long)(h % p.ne32) * p.m_nb2 +
                                        (long long)(kv0 + ch * 8) * 2 : p.mask;
                if (!row || cl >= 8) {   // rows past the batch: zeros (their outputs are not written)
                    cp_async16(smem_u32(dm + r * C::SM + ch * 8), src, row ? 16 : 0);
                } else {
                    // the n_kv tail: the cells past n_kv read as -inf (their K rows are zeros), so
                    // the score step checks no bounds; plain loads and a store (one chunk per row)
                    const unsigned short* sh = reinterpret_cast<const unsigned short*>(src);
                    uint4 u;
                    unsigned* w = reinterpret_cast<unsigned*>(&u);
#pragma unroll
                    for (int k = 0; k < 4; ++k)
                        w[k] = (2 * k < cl ? (unsigned)__ldg(sh + 2 * k) : 0xFC00u) |
                               (2 * k + 1 < cl ? (unsigned)__ldg(sh + 2 * k + 1) : 0xFC00u) << 16;
                    *reinterpret_cast<uint4*>(dm + r * C::SM + ch * 8) = u;
                }
            }
        }
    };
    // hid: the tile's cells no row of the block sees (their V rows are zero-filled, not loaded)
    auto load_v = [&](int stage, int e, unsigned long long hid) {
        const int kv0 = (e & FATTN_TILE_ID_MASK) * BK;
        load_rows_async<BK, DV / 8, NT>(smem_u32(sV + stage * BK * SV), SV * 2,
                                        vbase + (long long)kv0 * p.v_nb1, p.v_nb1, p.n_kv - kv0, tid, hid);
    };

    float O[MT][DVP / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < DVP / 8; ++i) O[mt][i][0] = O[mt][i][1] = O[mt][i][2] = O[mt][i][3] = 0.0f;
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) { m[mt][0] = m[mt][1] = FATTN_NEG_INF; l[mt][0] = l[mt][1] = 0.0f; }
    unsigned Qf[C::Q_REGS ? DKP / 16 : 1][4];

    // prologue: ring -- tiles jb .. jb+STAGES-2 in flight (one commit group per tile, empty
    // groups keep the count uniform); FA2 order -- K (and mask) of tile jb
    if constexpr (C::FA2) {
        if (jb < je) load_k(0, lt.entry(jb));
        cp_async_commit();
    } else {
#pragma unroll
        for (int i = 0; i < STAGES - 1; ++i) {
            if (jb + i < je) {
                const int e0 = lt.entry(jb + i);
                load_k(i, e0);
                load_v(i, e0, e0 & FATTN_TILE_HIDDEN ? lt.hidden(p, jb + i, hg * P, P) : 0ull);
            }
            cp_async_commit();
        }
    }
    __syncthreads();  // Q in shared memory
    const int lr = lane & 7, lm = lane >> 3;
    const unsigned q_addr = smem_u32(sQ + (16 * MT * wq + lr + (lm & 1) * 8) * SK + (lm >> 1) * 8);
    if constexpr (C::Q_REGS) {
#pragma unroll
        for (int ks = 0; ks < DKP / 16; ++ks)
            ldmatrix_x4(Qf[ks][0], Qf[ks][1], Qf[ks][2], Qf[ks][3], q_addr + ks * 32);
    }

    const int ahead = C::FA2 ? 1 : STAGES - 1;
    int e_next = jb + ahead < je ? lt.entry(jb + ahead) : 0;
    int e_cur = jb < je ? lt.entry(jb) : 0;
    // the hidden word the loop's first V load (ring) / first zeroing (FA2) reads
    if (C::FA2 ? jb < je : jb + ahead < je) lt.prefetch_hidden(p, C::FA2 ? jb : jb + ahead, hg * P);
    for (int j = jb; j < je; ++j) {
        const int stage = C::FA2 ? 0 : (j - jb) % STAGES;
        const int e = e_cur;
        if constexpr (C::FA2) {
            cp_async_wait<0>();   // K(j) and its mask have landed
            __syncthreads();      // ... for every thread; and every warp is done with V(j-1)
            load_v(0, e, 0ull);   // a HIDDEN tile's hidden rows are zeroed after the wait below
            cp_async_commit();
            e_cur = e_next;
            e_next = j + 2 < je ? lt.entry(j + 2) : 0;
            if (e_cur & FATTN_TILE_HIDDEN)   // tile j+1's word, read an iteration from now
                prefetch_l1(s_hid + (long long)(j + 1) * p.ne32 + (p.ne32 == 1 ? 0 : (hg * P) % p.ne32));
        } else {
            // refill the stage used by iteration j-1 (all threads passed its closing barrier)
            if (j + STAGES - 1 < je) {
                const int st = (j - jb + STAGES - 1) % STAGES;
                load_k(st, e_next);
                // the hidden word was prefetched to L1 an iteration ago (a register kept across
                // the loop instead cost occupancy at small head sizes)
                load_v(st, e_next, e_next & FATTN_TILE_HIDDEN ? lt.hidden(p, j + STAGES - 1, hg * P, P) : 0ull);
            }
            cp_async_commit();
            // next entries: loaded now, used next iteration (hides the list's load latency)
            e_cur = STAGES == 2 ? e_next : (j + 1 < je ? lt.entry(j + 1) : 0);
            e_next = j + STAGES < je ? lt.entry(j + STAGES) : 0;
            if (j + STAGES < je) lt.prefetch_hidden(p, j + STAGES, hg * P);
            cp_async_wait<STAGES - 1>();   // tile j has landed
            __syncthreads();               // ... for every thread
        }
        const int kv0 = (e & FATTN_TILE_ID_MASK) * BK + wk * KW;

        // ---- step: S = Q K^T for 16*MT rows x KW columns (the mask: this thread's two cells of
        // (m-tile mt, row half rs, n-tile nt), see the masking)
        const unsigned sm_tile = smem_u32(sMask + stage * BM * C::SM + (16 * MT * wq + g) * C::SM + wk * KW + 2 * t4);
        auto mask_pair = [&](int mt, int rs, int nt) {
            return lds_half2(sm_tile + ((mt * 16 + rs * 8) * C::SM + nt * 8) * 2);
        };
        float S[MT][KW / 8][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int i = 0; i < KW / 8; ++i) S[mt][i][0] = S[mt][i][1] = S[mt][i][2] = S[mt][i][3] = 0.0f;
        const unsigned k_addr = smem_u32(sK + stage * BK * SK + (wk * KW + lr + (lm >> 1) * 8) * SK + (lm & 1) * 8);
#pragma unroll
        for (int ks = 0; ks < DKP / 16; ++ks) {
            unsigned a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                if constexpr (C::Q_REGS) {
                    a[mt][0] = Qf[C::Q_REGS ? ks : 0][0]; a[mt][1] = Qf[C::Q_REGS ? ks : 0][1];
                    a[mt][2] = Qf[C::Q_REGS ? ks : 0][2]; a[mt][3] = Qf[C::Q_REGS ? ks : 0][3];
                } else {
                    ldmatrix_x4(a[mt][0], a[mt][1], a[mt][2], a[mt][3], q_addr + (mt * 16 * SK + ks * 16) * 2);
                }
            }
#pragma unroll
            for (int np = 0; np < KW / 16; ++np) {
                unsigned b0, b1, b2, b3;
                ldmatrix_x4(b0, b1, b2, b3, k_addr + (np * 16 * SK + ks * 16) * 2);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    Mma<T>::run(S[mt][2 * np], a[mt], b0, b1);
                    Mma<T>::run(S[mt][2 * np + 1], a[mt], b2, b3);
                }
            }
        }

        // ---- step: the tile's masking (and, EXT, scale and softcap; scores in the log2 domain)
        if constexpr (EXT) {   // scale, softcap; ALiBi slope * mask below
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < KW / 8; ++nt)
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        float x = S[mt][nt][c] * p.scale;
                        if (p.softcap != 0.0f) x = p.softcap * tanhf(x);
                        S[mt][nt][c] = x * FATTN_LOG2E;
                    }
        }
        if (e & FATTN_TILE_PARTIAL) {
            if (e & FATTN_TILE_MASKED) {
                // The n_kv tail's mask tile reads -inf past n_kv (load_k): no bounds check here.
                // sel: a -inf cell gives -inf (add_mask_pair); a FINITE tile has none (a bias
                // mask), so it is added with no select. Volatile
                // loads: with plain ones ptxas hoists both loops' loads above the branch and the
                // 128-row tiles spill.
                auto add_mask = [&](const bool sel) {
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                        for (int nt = 0; nt < KW / 8; ++nt)
#pragma unroll
                            for (int rs = 0; rs < 2; ++rs)
                                add_mask_pair(S[mt][nt][2 * rs], S[mt][nt][2 * rs + 1], mask_pair(mt, rs, nt),
                                              slope[mt][rs] * ML, sel);
                };
                if (EXT) add_mask(!(e & FATTN_TILE_FINITE));   // one loop: EXT's registers are at the limit
                else if (!(e & FATTN_TILE_FINITE)) add_mask(true);
                else add_mask(false);
            } else {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int rs = 0; rs < 2; ++rs) {
                        const int2 lh = row_range(mt, rs);
#pragma unroll
                        for (int nt = 0; nt < KW / 8; ++nt) {
                            const int col = kv0 + nt * 8 + 2 * t4;
                            if (col < lh.x || col >= lh.y) S[mt][nt][2 * rs] = FATTN_NEG_INF;
                            if (col + 1 < lh.x || col + 1 >= lh.y) S[mt][nt][2 * rs + 1] = FATTN_NEG_INF;
                        }
                    }
            }
        }

        // ---- step: online softmax (rows g and g+8 of each m-tile; 4 lanes share a row)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int rs = 0; rs < 2; ++rs) {
                float mx = FATTN_NEG_INF;
#pragma unroll
                for (int nt = 0; nt < KW / 8; ++nt) mx = fmaxf(mx, fmaxf(S[mt][nt][2 * rs], S[mt][nt][2 * rs + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float m_new = fmaxf(m[mt][rs], mx);
                const float m_use = m_new == FATTN_NEG_INF ? 0.0f : m_new;
                // p = exp2(S - m_use); alpha rescales the previous tiles' p onto this one's max
                if (__any_sync(0xffffffffu, m_new != m[mt][rs])) {   // skip the rescale when no max moved
                    const float alpha = fast_exp2(m[mt][rs] - m_use);  // m == -inf -> 0
                    l[mt][rs] *= alpha;
#pragma unroll
                    for (int i = 0; i < DVP / 8; ++i) { O[mt][i][2 * rs] *= alpha; O[mt][i][2 * rs + 1] *= alpha; }
                }
                m[mt][rs] = m_new;
                auto p_of = [&](float x) { return fast_exp2(x - m_use); };
#pragma unroll
                for (int nt = 0; nt < KW / 8; ++nt) {
                    S[mt][nt][2 * rs] = p_of(S[mt][nt][2 * rs]);
                    S[mt][nt][2 * rs + 1] = p_of(S[mt][nt][2 * rs + 1]);
                    l[mt][rs] += S[mt][nt][2 * rs] + S[mt][nt][2 * rs + 1];
                }
            }
        }

        if constexpr (C::FA2) {
            cp_async_wait<0>();   // V(j) has landed (this thread's chunks)
            if (e & FATTN_TILE_HIDDEN) {   // zero this thread's chunks of the hidden cells' V rows
                const unsigned long long hid = block_hidden(s_hid + (long long)j * p.ne32, p.ne32, hg * P, P);
                constexpr int CH = DV / 8;
#pragma unroll
                for (int i = tid; i < BK * CH; i += NT)
                    if ((hid >> (i / CH)) & 1ull)
                        *reinterpret_cast<uint4*>(sV + (i / CH) * SV + (i % CH) * 8) = make_uint4(0, 0, 0, 0);
            }
            __syncthreads();      // ... for every thread; and every warp is done with K(j), mask(j)
            if (j + 1 < je) load_k(0, e_cur);
            cp_async_commit();
        }

        // ---- step: O += P V
        const unsigned v_addr = smem_u32(sV + stage * BK * SV + (wk * KW + lr + (lm & 1) * 8) * SV + (lm >> 1) * 8);
#pragma unroll
        for (int kk = 0; kk < KW / 16; ++kk) {
            unsigned a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                a[mt][0] = KVTraits<T>::pack2(S[mt][2 * kk][0], S[mt][2 * kk][1]);
                a[mt][1] = KVTraits<T>::pack2(S[mt][2 * kk][2], S[mt][2 * kk][3]);
                a[mt][2] = KVTraits<T>::pack2(S[mt][2 * kk + 1][0], S[mt][2 * kk + 1][1]);
                a[mt][3] = KVTraits<T>::pack2(S[mt][2 * kk + 1][2], S[mt][2 * kk + 1][3]);
            }
#pragma unroll
            for (int dp = 0; dp < DVP / 16; ++dp) {
                unsigned b0, b1, b2, b3;
                ldmatrix_x4_trans(b0, b1, b2, b3, v_addr + (kk * 16 * SV + dp * 16) * 2);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    Mma<T>::run(O[mt][2 * dp], a[mt], b0, b1);
                    Mma<T>::run(O[mt][2 * dp + 1], a[mt], b2, b3);
                }
            }
        }
        if constexpr (!C::FA2) __syncthreads();  // this stage may be refilled by the next iteration's prefetch
    }
    cp_async_wait<0>();   // drain (empty) trailing groups before shared memory is reused

    // ---- step: output
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int rs = 0; rs < 2; ++rs) {
            l[mt][rs] += __shfl_xor_sync(0xffffffffu, l[mt][rs], 1);
            l[mt][rs] += __shfl_xor_sync(0xffffffffu, l[mt][rs], 2);
        }
    const long long n_rows_total = (long long)p.ne3 * p.n_batch * p.n_head;
    if constexpr (NWK == 1) {
        // each thread writes its own columns of its rows straight from registers
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int rs = 0; rs < 2; ++rs) {
                const int r = 16 * (MT * wq + mt) + g + 8 * rs;
                const int tr = r >> pshift, tok = tok0 + tr, h = hg * P + (r & (P - 1));
                if (tok >= p.n_batch || tr >= tq) continue;
                const long long row = ((long long)s * p.n_batch + tok) * p.n_head + h;
                float* out;
                float f;
                if (p.n_splits == 1) {
                    out = p.dst + row * DV;
                    f = row_finish_factor(p, h, m[mt][rs], l[mt][rs]);
                } else {
                    const long long wr = (long long)split * n_rows_total + row;
                    out = p.ws_o + wr * DV;
                    f = 1.0f;
                    if (t4 == 0) { p.ws_ml[wr * 2] = m[mt][rs]; p.ws_ml[wr * 2 + 1] = l[mt][rs]; }
                }
#pragma unroll
                for (int i = 0; i < DVP / 8; ++i)
                    if (i * 8 < DV)
                        *reinterpret_cast<float2*>(out + i * 8 + 2 * t4) =
                            make_float2(O[mt][i][2 * rs] * f, O[mt][i][2 * rs + 1] * f);
            }
    } else {
        // merge the NWK column groups through shared memory, then write
        __syncthreads();
        float* sO = reinterpret_cast<float*>(smem_raw);
        float* sML = sO + NWK * BM * C::SO;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int rs = 0; rs < 2; ++rs) {
                const int r = 16 * (MT * wq + mt) + g + 8 * rs;
                float* orow = sO + (wk * BM + r) * C::SO;
#pragma unroll
                for (int i = 0; i < DVP / 8; ++i)
                    *reinterpret_cast<float2*>(orow + i * 8 + 2 * t4) = make_float2(O[mt][i][2 * rs], O[mt][i][2 * rs + 1]);
                if (t4 == 0) {
                    sML[(wk * BM + r) * 2] = m[mt][rs];
                    sML[(wk * BM + r) * 2 + 1] = l[mt][rs];
                }
            }
        __syncthreads();
        for (int i = tid; i < BM * DV; i += NT) {
            const int r = i / DV, c = i % DV;
            const int tr = r >> pshift, tok = tok0 + tr, h = hg * P + (r & (P - 1));
            if (tok >= p.n_batch || tr >= tq) continue;
            float M = FATTN_NEG_INF;
#pragma unroll
            for (int w = 0; w < NWK; ++w) M = fmaxf(M, sML[(w * BM + r) * 2]);
            float L = 0.0f, o = 0.0f;
#pragma unroll
            for (int w = 0; w < NWK; ++w) {
                const float mw = sML[(w * BM + r) * 2];
                const float f = (mw == FATTN_NEG_INF) ? 0.0f : fast_exp2(mw - M);
                L += sML[(w * BM + r) * 2 + 1] * f;
                o += sO[(w * BM + r) * C::SO + c] * f;
            }
            store_row_value(p, ((long long)s * p.n_batch + tok) * p.n_head + h, h, c, DV, split, o, M, L);
        }
    }
    if constexpr (MT == 1 && DK <= 256) {   // (128-row tiles and DK 320-576: fattn_combine; at the register limit)
      if (p.n_splits > 1 && p.split_cnt) {
        split_finish<4>(p, BM, [&](int r) -> long long {
            const int tr = r >> pshift, tok = tok0 + tr, h = hg * P + (r & (P - 1));
            if (tok >= p.n_batch || tr >= tq) return -1;
            return ((long long)s * p.n_batch + tok) * p.n_head + h;
        }, DV, reinterpret_cast<float*>(smem_raw));
      }
    }
}

// The dynamic shared memory (bytes) a launch of fattn_mma<...> with the same parameters takes: the
// host reads it from the compiled program (ggml_attn/variants.py smem_expr, ggml_attn/cubin.py)
template <int DK, int DV, typename T, int NWQ, int NWK, int MT, int ST, bool EXT>
__device__ const int fattn_mma_smem = MmaCfg<DK, DV, NWQ, NWK, MT, ST>::SMEM;
