// The Hopper (sm_90a) decode: a persistent, streaming split-KV kernel.
//
// Work: the flattened list of (row group, live KV tile). A row group is what one decode-tc
// block takes (cuda/fattn_mma.cu): 16 rows = the P query heads of one KV head x the tq = 16 / P
// tokens of one query tile of one stream. Groups are ordered (stream, query tile, head group),
// head groups fastest; a group has the live tiles of its query tile's list (the plan's, or every
// tile without one), and at least one work unit (an empty list still writes its zero rows).
// The split over the gridDim.x blocks (Walk::start): with a cap (p.work_cap, chosen on the host
// by ggml_attn/decode_tma_shape.py work_cap when it balances the blocks), on the groups' own
// boundaries -- a large group in equal parts, one block each, small groups packed whole -- so
// that few groups are merged and no block holds two parts; else block b takes units
// [b W / B, (b + 1) W / B): one balanced wave whatever the mix of lengths, groups cut anywhere.
//
// Block: a producer warp and NW consumer warps (4 for f16/bf16; the quantized register-path
// instances 7), no block-wide barrier in the loop.
//   - step produce: lane 0 of the producer walks the block's units and issues, per tile, TMA
//     copies of its K and V rows (the 128-byte swizzled 64 x 64 boxes of ggml_attn/wgmma_shape.py's
//     kv_map; the n_kv tail reads zeros) into a ring of STAGES stages, each with an "empty"
//     mbarrier (one arrival per consumer warp that reads it); the fill signals a "full" one
//     (transaction bytes): the stage's, or with a warp per tile the warp's own (FULLS).
//   - step process tile: consumer warp w takes every NW-th tile of the block's sequence whole
//     (WHOLE; or, the "split" instance, the cells [16 w, 16 w + 16) of every tile: a quarter of
//     the MMAs per warp in two dependent chains, latency-bound -- 2.6 TB/s at B=1 32k) with
//     mma.sync m16n8k16 (Q in registers; K and V by ldmatrix from the swizzled boxes, or for
//     q8_0/q4_0 from a raw box of blocks: fragments built in registers, or through scratch), masks a
//     PARTIAL tile by its rows' intervals or mask values (no bounds check on FULL tiles), zeroes
//     the V rows of its HIDDEN cells, runs its online softmax and releases the stage.
//   - step segment end: where the block's units leave a row group, the NW warps merge their
//     states in shared memory. A group the block took whole is written to dst; a part of one
//     goes to the block's partial slot (2 b for its first group, 2 b + 1 for its last), and the
//     last block to count itself in p.split_cnt[group] merges the group's slots into dst and
//     sets the counter back to 0.
// No softcap, no ALiBi; the final row factor would fold sinks in, but dispatch sends only calls
// without them (not tested with sinks). Scores in the log2 domain: Q is pre-multiplied by
// scale * log2(e). As in decode-tc, only V rows of cells no row of the group sees are zeroed: a
// cell hidden from one row but seen by another keeps its V, so non-finite V there reaches the
// hidden row as 0 * inf.
#include "decode_tma_common.cuh"

// DTMA_TRACE (tools/dev/gpu_decode_tma_trace.py): block timeline in %globaltimer ns, written by
// thread 0 to ((u64*)p.cells)[block * 8 + event] (the kernel reads no cell lists)
#ifdef DTMA_TRACE
#define DTMA_MARK(ev) do { if (threadIdx.x == 0) { unsigned long long t_; \
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_)); \
    reinterpret_cast<unsigned long long*>(const_cast<int2*>(p.cells))[blockIdx.x * 8 + (ev)] = t_; } } while (0)
#else
#define DTMA_MARK(ev) do { } while (0)
#endif

namespace dtma {

// Dynamic shared memory of an instance of NW consumer warps: 1024-byte alignment slack, the
// ring (K tile then V tile per stage), the consumers' f16 scratch tiles (quantized K/V read
// through scratch), the merge buffer (ROWS x (D + 4) floats), the warps' row maxima and sums, the
// ring's fill barriers (FULLS in the body) and release barriers, the "last block" flag. The host reads it from the cubin (fattn_decode_tma_smem, at the end of this file).
template <typename KT, int D, int STAGES, int NW, bool SCRATCH, bool WHOLE>
__host__ __device__ constexpr int smem_bytes() {
    return 1024 + STAGES * 2 * Tile<KT, D>::BYTES + (SCRATCH ? NW * (D / 64) * BOX_BYTES : 0) +
           ROWS * (D + 4) * 4 + NW * ROWS * 2 * 4 + ((WHOLE ? NW * ((STAGES + NW - 1) / NW) : STAGES) + STAGES) * 8 + 16;
}

// ---- step dequantize (q8_0/q4_0): one tile's raw box (cells 0..63, head rows at c * RB + off) -> the
// warp's f16 scratch (D / 64 boxes of 64 rows x 128 bytes, chunk ch of row r at ch ^ (r & 7): the
// f16 ring's layout, read by the same ldmatrix code). Lane l takes block l % NB of cell l / NB,
// then 32 / NB cells further on. A block starting 2 mod 4 bytes into the box (blocks are 34 or
// 18 bytes, RB a multiple of 16, off even) has its scale in the high half of the aligned word
// before it and its quants 4-byte aligned; one starting 4-byte aligned has its scale in the low
// half and its quants straddling words (byte_perm picks them out). Cells past n_kv were read as
// zeros: scale 0, values 0.
template <typename Q, int D>
__device__ __forceinline__ void dequant_tile(const unsigned char* raw, int off, unsigned char* out, int lane) {
    constexpr int NB = D / 32, RB = Tile<Q, D>::RB;
    constexpr bool Q8 = Q::BYTES == fattn_q8_0::BYTES;
    constexpr int NW = Q8 ? 9 : 5;   // aligned words covering the block
    const __half2 bias2 = __float2half2_rn(Q8 ? 1152.0f : 1032.0f);
#pragma unroll 2
    for (int u = lane; u < BK * NB; u += 32) {
        const int c = u / NB, blk = u % NB;
        const int base = off + c * RB + blk * Q::BYTES;
        const unsigned* w = reinterpret_cast<const unsigned*>(raw + (base & ~3));
        const bool odd = (base & 2) != 0;
        const unsigned sel = odd ? 0x7654u : 0x5432u;   // quant word i = bytes of (w[i], w[i + 1])
        unsigned wr[NW];
#pragma unroll
        for (int i = 0; i < NW; ++i) wr[i] = w[i];
        const __half2 d2 = __half2half2(__ushort_as_half((unsigned short)(wr[0] >> (odd ? 16 : 0))));
        uint4 o[4];   // chunk j: values 8 j .. 8 j + 7 of the block
        if constexpr (Q8) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const uint2 a = bytes4_to_half4(__byte_perm(wr[2 * j], wr[2 * j + 1], sel) ^ 0x80808080u, bias2, d2);
                const uint2 b = bytes4_to_half4(__byte_perm(wr[2 * j + 1], wr[2 * j + 2], sel) ^ 0x80808080u, bias2, d2);
                o[j] = make_uint4(a.x, a.y, b.x, b.y);
            }
        } else {   // quant bytes 8 j .. 8 j + 7: low nibbles values 8 j.., high nibbles 16 + 8 j..
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const unsigned q0 = __byte_perm(wr[2 * j], wr[2 * j + 1], sel);
                const unsigned q1 = __byte_perm(wr[2 * j + 1], wr[2 * j + 2], sel);
                const uint2 a = bytes4_to_half4(q0 & 0x0F0F0F0Fu, bias2, d2);
                const uint2 b = bytes4_to_half4(q1 & 0x0F0F0F0Fu, bias2, d2);
                const uint2 e = bytes4_to_half4((q0 >> 4) & 0x0F0F0F0Fu, bias2, d2);
                const uint2 f = bytes4_to_half4((q1 >> 4) & 0x0F0F0F0Fu, bias2, d2);
                o[j] = make_uint4(a.x, a.y, b.x, b.y);
                o[j + 2] = make_uint4(e.x, e.y, f.x, f.y);
            }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int dim = 32 * blk + 8 * j, box = dim >> 6, ch = (dim >> 3) & 7;
            *reinterpret_cast<uint4*>(out + box * BOX_BYTES + c * 128 + ((ch ^ (c & 7)) << 4)) = o[j];
        }
    }
}

}  // namespace dtma


template <typename KT, int D, int STAGES, bool WHOLE, int NW, bool REG, bool HF>
__device__ __forceinline__ void fattn_decode_tma_body(const FattnParams& p, const TmaMap* mk, const TmaMap* mv) {
    using namespace dtma;
    using T = typename Tile<KT, D>::T;
    constexpr bool QUANT = Tile<KT, D>::QUANT;
    constexpr bool SCRATCH = QUANT && !REG;             // quantized K/V dequantized into the warp's scratch
    constexpr int NTHREADS = 32 * (NW + 1);
    constexpr int BOXES = D / 64;
    constexpr int NC = WHOLE ? BK : BK / CONSUMERS;   // cells of a tile one warp takes
    constexpr int KV_BYTES = BOXES * BOX_BYTES;          // one f16 K (or V) tile: a ring tile's or a scratch's
    constexpr int TILE_BYTES = Tile<KT, D>::BYTES;       // one K (or V) tile in the ring
    constexpr int STAGE_BYTES = 2 * TILE_BYTES;
    static_assert(D % 64 == 0 && D <= 256, "D: a multiple of 64 up to 256 (64-element boxes)");
    static_assert(!QUANT || WHOLE, "quantized K/V: a warp per tile (its own scratch or registers)");
    static_assert(!REG || (QUANT && D == 128), "the register path: q8_0/q4_0 at D 128");
    static_assert(WHOLE || NW == CONSUMERS, "four warps per tile take 16 cells each");
    // The fill barriers. Four warps on every tile: one per stage. A warp per tile: tile i of the
    // block's sequence (warp i % NW's (i / NW)-th) lands in stage i % STAGES but signals the warp's
    // own barrier (i / NW) % WAITS of WAITS = ceil(STAGES / NW): a parity wait is right only
    // when its barrier is less than two phases from the tile's, and a stage's barrier could be
    // (another warp's earlier tile there not landed yet, or landed and taken). The warp's own
    // barrier: its previous phase is the warp's own earlier tile, taken; its next fill cannot
    // come before this tile is released (the producer runs at most STAGES tiles ahead of the
    // oldest tile not yet released, and WAITS x NW >= STAGES).
    constexpr int WAITS = (STAGES + NW - 1) / NW;
    // The merge buffer: rows of SO_LD = D + 4 floats (4 banks apart); column c at so_col(c): the
    // register path's lanes add columns 32 t4 + v (the same bank for every t4 and row in a
    // plain layout), skewed by t4 = c / 32 into 32 distinct banks.
    constexpr int SO_LD = D + 4;
    auto so_col = [](int c) { return REG ? c + (c >> 5) : c; };
    constexpr int FULLS = WHOLE ? NW * WAITS : STAGES;

    extern __shared__ unsigned char smem_raw[];
    unsigned char* ring = smem_align1024(smem_raw);
    unsigned char* scratch = ring + STAGES * STAGE_BYTES;                // [NW][KV_BYTES] (SCRATCH)
    float* sO = reinterpret_cast<float*>(scratch + (SCRATCH ? NW * KV_BYTES : 0));   // [ROWS][SO_LD]
    float* sML = sO + ROWS * SO_LD;                                      // [NW][ROWS][2]
    unsigned long long* full = reinterpret_cast<unsigned long long*>(sML + NW * ROWS * 2);   // [FULLS]
    unsigned long long* empty = full + FULLS;
    int* s_last = reinterpret_cast<int*>(empty + STAGES);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (tid == 0) {
        for (int i = 0; i < FULLS; ++i) mbar_init(full + i, 1);
        for (int i = 0; i < STAGES; ++i) mbar_init(empty + i, WHOLE ? 1 : NW);
        fence_mbar_init();
    }
    for (int i = tid; i < ROWS * SO_LD; i += NTHREADS) sO[i] = 0.0f;
    __syncthreads();
    DTMA_MARK(0);

    Walk<> wk;
    if (!wk.start(p, blockIdx.x, gridDim.x, lane, HF)) return;
    const int P = p.pack, pshift = __ffs(P) - 1, tq = p.q_tile_tokens;

    // ---- step produce (one lane of the producer warp)
    if (warp == NW) {
        if (lane != 0) return;
        int it = 0;
        for (; wk.w < wk.end; wk.next(p)) {
            const int s = wk.pair / p.n_q_tiles;
            const int hk = (wk.hg * P) / p.gqa;
            const int te = min(wk.seg_end(), wk.cnt);
            for (int j = wk.t; j < te; ++j, ++it) {
                const int stage = it % STAGES;
                if (it >= STAGES) mbar_wait(empty + stage, ((it / STAGES) & 1) ^ 1);
                const int kv0 = (tile_entry(p, wk.pair, j) & FATTN_TILE_ID_MASK) * BK;
                unsigned char* dst = ring + stage * STAGE_BYTES;
                unsigned long long* fb = WHOLE ? full + (it % NW) * WAITS + (it / NW) % WAITS : full + stage;
                mbar_arrive_expect_tx(fb, STAGE_BYTES);
                if constexpr (QUANT) {   // maps over (bytes of a cell's heads, cells, 1, streams)
                    const int x = (hk * Tile<KT, D>::ROW) & ~15;
                    tma_load_4d(dst, mk, x, kv0, 0, s, fb);
                    tma_load_4d(dst + TILE_BYTES, mv, x, kv0, 0, s, fb);
                } else {
#pragma unroll
                    for (int b = 0; b < BOXES; ++b) {
                        tma_load_4d(dst + b * BOX_BYTES, mk, 64 * b, kv0, hk, s, fb);
                        tma_load_4d(dst + KV_BYTES + b * BOX_BYTES, mv, 64 * b, kv0, hk, s, fb);
                    }
                }
            }
        }
        return;
    }

    // ---- consumers: WHOLE -- warp w takes every NW-th tile of the block's sequence, all its
    // cells; otherwise every tile, cells [16 w, 16 w + 16). Fragment rows g, g + 8, cells
    // w0 + 8 nt + [2 t4, 2 t4 + 1] of its NC (w0 = 0 or 16 w).
    const int g = lane >> 2, t4 = lane & 3, lr = lane & 7, lm = lane >> 3;
    const int w0 = WHOLE ? 0 : 16 * warp;
    // ldmatrix lanes: K rows (cells) w0 + 16 np + lr + 8 (lm >> 1), 16-byte chunk (lm & 1) of
    // each k16 step; V rows w0 + 16 kk + lr + 8 (lm & 1), chunk (lm >> 1). The 128-byte swizzle
    // puts chunk c of row r at c ^ (r & 7) = c ^ lr. Quantized K/V: the warp's scratch, K then V.
    unsigned char* my_scratch = scratch + (SCRATCH ? warp * KV_BYTES : 0);
    const unsigned k_base = SCRATCH ? smem_u32(my_scratch) : smem_u32(ring);
    const unsigned v_base = SCRATCH ? k_base : k_base + KV_BYTES;
    const unsigned k_lane = k_base + (w0 + lr + 8 * (lm >> 1)) * 128;
    const unsigned v_lane = v_base + (w0 + lr + 8 * (lm & 1)) * 128;
    const int k_x = (lm & 1) ^ lr, v_x = (lm >> 1) ^ lr;
    const long long b_start = wk.w;
    const float qs = p.scale * FATTN_LOG2E;
    int it = 0;

    for (; wk.w < wk.end; wk.next(p)) {
        const int s = wk.pair / p.n_q_tiles, qt = wk.pair - s * p.n_q_tiles;
        const int tok0 = qt * tq, h0 = wk.hg * P;
        const int row_off = QUANT ? ((h0 / p.gqa) * Tile<KT, D>::ROW) & 15 : 0;   // the head's row in a raw box row
        // a fragment row's token and head (valid: inside the batch and the query tile)
        auto row_tok = [&](int r) { return tok0 + (r >> pshift); };
        auto row_head = [&](int r) { return h0 + (r & (P - 1)); };
        auto row_valid = [&](int r) { return (r >> pshift) < tq && row_tok(r) < p.n_batch; };

        // ---- step load Q (the A fragments of the 16 x D tile, scaled, in registers), the state
        unsigned Qf[D / 16][4];
        float O[D / 8][4], m[2], l[2];
        const char* mrow[2];   // this thread's rows of the mask (nullptr: no mask or invalid row)
        int2 lohi[2];
        begin_segment<KT, T, D, REG>(p, s, g, t4, qs, row_valid, row_tok, row_head, Qf, O, m, l, mrow, lohi);

        const int te = min(wk.seg_end(), wk.cnt);
        // WHOLE: this warp's tiles of the segment are those whose place in the block's sequence
        // (it + j - t) is warp modulo NW
        const int j0 = WHOLE ? wk.t + ((warp - it) % NW + NW) % NW : wk.t;
        for (int j = j0; j < te; j += WHOLE ? NW : 1) {
            const int itj = it + (j - wk.t);
            const int stage = itj % STAGES;
            const int e = tile_entry(p, wk.pair, j);
            const int c0 = (e & FATTN_TILE_ID_MASK) * BK + w0 + 2 * t4;   // this thread's first cell
            // the tile's fill (WHOLE: the warp's own barrier, see FULLS)
            if constexpr (WHOLE) {
                const int r = itj / NW;
                mbar_wait(full + warp * WAITS + r % WAITS, (r / WAITS) & 1);
            } else {
                mbar_wait(full + stage, (itj / STAGES) & 1);
            }
            __syncwarp();   // lanes leave the spin apart; ldmatrix and mma are .aligned
            if (itj == 0) DTMA_MARK(1);
            const unsigned kb = k_lane + (SCRATCH ? 0 : stage * STAGE_BYTES), vb = v_lane + (SCRATCH ? 0 : stage * STAGE_BYTES);
            const unsigned char* raw = ring + stage * STAGE_BYTES;   // quantized K/V: the stage's raw K, then V
            if constexpr (SCRATCH) {   // ---- step dequantize K
                dequant_tile<KT, D>(ring + stage * STAGE_BYTES, row_off, my_scratch, lane);
                __syncwarp();
            }

            // ---- step S = Q K^T (16 rows x this warp's NC cells)
            float S[NC / 8][4];
#pragma unroll
            for (int nt = 0; nt < NC / 8; ++nt) S[nt][0] = S[nt][1] = S[nt][2] = S[nt][3] = 0.0f;
            if constexpr (REG) {   // cell 8 nt + g's block t4, straight from the raw box; two n-tiles
                                   // at a time, their MMA chains interleaved
#pragma unroll
                for (int nt = 0; nt < NC / 8; nt += 2) {
                    unsigned b[2][D / 16][2];
#pragma unroll
                    for (int u = 0; u < 2; ++u)
                        k_frags<KT, D>(raw, row_off + (8 * (nt + u) + g) * Tile<KT, D>::RB + t4 * KT::BYTES, b[u]);
#pragma unroll
                    for (int ks = 0; ks < D / 16; ++ks)
#pragma unroll
                        for (int u = 0; u < 2; ++u) Mma<T>::run(S[nt + u], Qf[ks], b[u][ks][0], b[u][ks][1]);
                }
            } else {
#pragma unroll
                for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
                    for (int np = 0; np < NC / 16; ++np) {
                        unsigned b0, b1, b2, b3;
                        ldmatrix_x4(b0, b1, b2, b3, kb + np * 16 * 128 + (ks >> 2) * BOX_BYTES + (((ks & 3) * 2) ^ k_x) * 16);
                        Mma<T>::run(S[2 * np], Qf[ks], b0, b1);
                        Mma<T>::run(S[2 * np + 1], Qf[ks], b2, b3);
                    }
                }
            }

            // ---- step mask a PARTIAL tile
            mask_partial<NC>(p, e, c0, mrow, lohi, S);

            // ---- step online softmax (rows g, g + 8; the 4 lanes of a quad share a row)
            online_softmax<NC, D>(S, m, l, O);

            if constexpr (SCRATCH) {   // ---- step dequantize V (over K: every lane's K fragments are read)
                __syncwarp();
                dequant_tile<KT, D>(ring + stage * STAGE_BYTES + TILE_BYTES, row_off, my_scratch, lane);
                __syncwarp();
                if (lane == 0) mbar_arrive(empty + stage);   // the raw tile is free for the next fill
            }

            // ---- step zero the V rows of this warp's HIDDEN cells (no row sees them: NaN
            // garbage there must not meet a zero probability)
            bool zeroed = false;
            unsigned long long hid_reg = 0;   // the register path: these cells' scales read as 0
            if (REG && (e & FATTN_TILE_HIDDEN)) {
                hid_reg = live_tiles(p, qt, s).hidden(p, j, h0, P);
            } else if (e & FATTN_TILE_HIDDEN) {
                const LiveTiles lt = live_tiles(p, qt, s);
                const unsigned long long hid = (lt.hidden(p, j, h0, P) >> w0) & (NC == 64 ? ~0ull : (1ull << NC) - 1);
                if (hid) {
                    unsigned char* vs = (SCRATCH ? my_scratch : ring + stage * STAGE_BYTES + KV_BYTES) + w0 * 128;
#pragma unroll
                    for (int i = lane; i < NC * BOXES * 8; i += 32) {   // (cell, box, 16-byte chunk)
                        const int c = i / (BOXES * 8), b = (i / 8) % BOXES, ch = i % 8;
                        if ((hid >> c) & 1ull)
                            *reinterpret_cast<uint4*>(vs + b * BOX_BYTES + c * 128 + ch * 16) = make_uint4(0, 0, 0, 0);
                    }
                    __syncwarp();
                    zeroed = true;
                }
            }

            // ---- step O += P V
#pragma unroll
            for (int kk = 0; kk < NC / 16; ++kk) {
                unsigned a[4];
                p_frag<T, NC>(S, kk, a);
                if constexpr (REG) {   // the 16 cells' values of the lane's columns, from the raw box
                    unsigned b[16][2];
                    v_frags<KT>(raw + TILE_BYTES, row_off, Tile<KT, D>::RB, 16 * kk, g, t4, hid_reg, b);
#pragma unroll
                    for (int nt = 0; nt < D / 8; ++nt) Mma<T>::run(O[nt], a, b[nt][0], b[nt][1]);
                } else {
#pragma unroll
                    for (int dp = 0; dp < D / 16; ++dp) {
                        unsigned b0, b1, b2, b3;
                        ldmatrix_x4_trans(b0, b1, b2, b3, vb + kk * 16 * 128 + (dp >> 2) * BOX_BYTES + (((dp & 3) * 2) ^ v_x) * 16);
                        Mma<T>::run(O[2 * dp], a, b0, b1);
                        Mma<T>::run(O[2 * dp + 1], a, b2, b3);
                    }
                }
            }
            // release the stage (generic-proxy writes ordered before the next TMA fill); SCRATCH
            // released theirs after dequantizing V, and the scratch is free once every lane's
            // V fragments are read
            if (!QUANT && zeroed) fence_proxy_async_shared();
            __syncwarp();
            if (!SCRATCH && lane == 0) mbar_arrive(empty + stage);
        }

        it += te - wk.t;
        DTMA_MARK(2);

        // ---- step segment end: merge the NW warps' states (rows g, g + 8 of each)
#pragma unroll
        for (int rs = 0; rs < 2; ++rs) {
            l[rs] += __shfl_xor_sync(0xffffffffu, l[rs], 1);
            l[rs] += __shfl_xor_sync(0xffffffffu, l[rs], 2);
            if (t4 == 0) {
                sML[(warp * ROWS + g + 8 * rs) * 2] = m[rs];
                sML[(warp * ROWS + g + 8 * rs) * 2 + 1] = l[rs];
            }
        }
        named_barrier_sync(1, 32 * NW);
        float f[2];
#pragma unroll
        for (int rs = 0; rs < 2; ++rs) {
            float M = FATTN_NEG_INF;
#pragma unroll
            for (int w = 0; w < NW; ++w) M = fmaxf(M, sML[(w * ROWS + g + 8 * rs) * 2]);
            f[rs] = m[rs] == FATTN_NEG_INF ? 0.0f : fast_exp2(m[rs] - M);
        }
#pragma unroll
        for (int w = 0; w < NW; ++w) {   // one warp at a time adds its scaled O
            if (warp == w) {
#pragma unroll
                for (int rs = 0; rs < 2; ++rs) {
                    if (!row_valid(g + 8 * rs)) continue;   // (B = 1: rows 4 .. 15; the write skips them too)
#pragma unroll
                    for (int i = 0; i < D / 8; ++i) {
                        if constexpr (REG) {   // columns 2 t4, 2 t4 + 1 of n-tile i: V's permuted dimensions
                            float* o = sO + (g + 8 * rs) * SO_LD;
                            o[so_col(32 * t4 + QuantPerm<KT>::v_val(i, 0))] += f[rs] * O[i][2 * rs];
                            o[so_col(32 * t4 + QuantPerm<KT>::v_val(i, 1))] += f[rs] * O[i][2 * rs + 1];
                        } else {
                            float2* o = reinterpret_cast<float2*>(sO + (g + 8 * rs) * SO_LD + 8 * i + 2 * t4);
                            const float2 x = *o;
                            *o = make_float2(x.x + f[rs] * O[i][2 * rs], x.y + f[rs] * O[i][2 * rs + 1]);
                        }
                    }
                }
            }
            named_barrier_sync(1, 32 * NW);
        }
        // write: the first 8 ROWS threads, thread -> row r = tid / 8, columns [cw * (tid % 8), + cw)
        const bool whole = wk.t == 0 && wk.seg_end() == wk.units();
        const int slot = 2 * blockIdx.x + (wk.w == b_start ? 0 : 1);   // the block's first group, or its last
        constexpr int CW = D / 8;
        if (tid < 8 * ROWS) {
            const int r = tid >> 3, cb = (tid & 7) * CW;
            float M = FATTN_NEG_INF, L = 0.0f;
#pragma unroll
            for (int w = 0; w < NW; ++w) M = fmaxf(M, sML[(w * ROWS + r) * 2]);
#pragma unroll
            for (int w = 0; w < NW; ++w) {
                const float mw = sML[(w * ROWS + r) * 2];
                L += mw == FATTN_NEG_INF ? 0.0f : sML[(w * ROWS + r) * 2 + 1] * fast_exp2(mw - M);
            }
            if (row_valid(r)) {
                const int h = row_head(r);
                const long long row = ((long long)s * p.n_batch + row_tok(r)) * p.n_head + h;
                const float fac = whole ? row_finish_factor(p, h, M, L) : 1.0f;
                float* out = whole ? p.dst + row * D : p.ws_o + ((long long)slot * ROWS + r) * D;
#pragma unroll
                for (int c = 0; c < CW; c += 4) {
                    const float* o = sO + r * SO_LD;
                    const float4 x = REG ? make_float4(o[so_col(cb + c)], o[so_col(cb + c + 1)], o[so_col(cb + c + 2)],
                                                       o[so_col(cb + c + 3)])
                                         : *reinterpret_cast<const float4*>(o + cb + c);
                    *reinterpret_cast<float4*>(out + cb + c) = make_float4(x.x * fac, x.y * fac, x.z * fac, x.w * fac);
                }
                if (!whole && (tid & 7) == 0) {
                    p.ws_ml[((long long)slot * ROWS + r) * 2] = M;
                    p.ws_ml[((long long)slot * ROWS + r) * 2 + 1] = L;
                }
            }
#pragma unroll
            for (int c = 0; c < CW; ++c) sO[r * SO_LD + so_col(cb + c)] = 0.0f;
        }

        DTMA_MARK(3);
        // ---- step merge a group's parts: the last block to finish one merges every part
        if (!whole) {
            const long long gb = wk.group_begin(), ge = gb + wk.units();
            // cut by the cap: the parts are in blocks b0, b0 + 1, ..., each its block's one group
            // (slot 2 b). The equal share: part k's block -- with at least as many units as
            // blocks every block has some, so the group's are b_first, b_first + 1, ...; with
            // fewer, each has one unit at most -- and its slot, 2 b + 1 when it is b's last group
            const bool capped = wk.b0 >= 0;
            const int b_first = capped ? wk.b0 : block_of(gb, wk.W, gridDim.x);
            const bool dense = wk.W >= gridDim.x;
            const int n_part = capped ? wk.n_part
                             : dense ? block_of(ge - 1, wk.W, gridDim.x) - b_first + 1 : (int)(ge - gb);
            auto part_slot = [&](int k) {
                if (capped) return 2 * (b_first + k);
                const int b = dense ? b_first + k : block_of(gb + k, wk.W, gridDim.x);
                return 2 * b + (k == 0 && wk.W * b / gridDim.x < gb ? 1 : 0);
            };
            const int group = wk.pair * (p.n_head / P) + wk.hg;
            __threadfence();
            named_barrier_sync(1, 32 * NW);
            if (tid == 0) {
                const bool last = atomicAdd(p.split_cnt + group, 1) == n_part - 1;
                if (last) p.split_cnt[group] = 0;   // for the next launch (no other block counts now)
                *s_last = last;
            }
            named_barrier_sync(1, 32 * NW);
            DTMA_MARK(4);
            if (*s_last && tid < 8 * ROWS) {   // warps 0 .. 3
                __threadfence();
                const int r = tid >> 3;
                const int h = row_head(r);
                float* out = row_valid(r) ? p.dst + (((long long)s * p.n_batch + row_tok(r)) * p.n_head + h) * D : nullptr;
                merge_parts<D>(p, r, tid & 7, n_part, part_slot, out, h);
                DTMA_MARK(5);
            }
        }
        __syncwarp();   // (merge_parts' invalid rows returned early) bar.sync is .aligned
        named_barrier_sync(1, 32 * NW);   // sO, sML and the flag are free for the next segment
    }
    DTMA_MARK(6);
}

// One instance per configuration ggml_attn/decode_tma_shape.py names (Cfg.name: this template with
// its parameters), each compiled in an NVRTC program of its own: K/V type as stored, head size,
// ring depth, a warp per tile (WHOLE) or four warps per tile, consumer warps, quantized K/V read
// in registers (REG) or through scratch; one block per SM (with two, 168 registers, the
// warp-per-tile loop spills). The quantized instances: through scratch (8 stages of 18 KB for
// q8_0, 12 of 10 KB for q4_0, and 4 x 16 KB of scratch), and in registers with 7 consumer warps
// (8 warps in all: two per SM sub-partition, whose registers allow 255 a thread; a ninth warp
// would cut them to 168) and a ring of 11 x 18 KB (q8_0) or 20 x 10 KB (q4_0), or 4 warps and 8
// stages
template <typename KT, int D, int STAGES, bool WHOLE, int NW, bool REG, bool HF>
__global__ void __launch_bounds__(32 * (NW + 1), 1)
fattn_decode_tma(const FattnParams p, const __grid_constant__ TmaMap mk, const __grid_constant__ TmaMap mv) {
    fattn_decode_tma_body<KT, D, STAGES, WHOLE, NW, REG, HF>(p, &mk, &mv);
}

// The dynamic shared memory (bytes) a launch of fattn_decode_tma<...> with the same parameters
// takes: the host reads it from the compiled program (ggml_attn/variants.py smem_expr,
// ggml_attn/cubin.py)
template <typename KT, int D, int STAGES, bool WHOLE, int NW, bool REG, bool HF>
__device__ const int fattn_decode_tma_smem = dtma::smem_bytes<KT, D, STAGES, NW, dtma::Tile<KT, D>::QUANT && !REG, WHOLE>();
