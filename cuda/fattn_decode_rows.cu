// The Hopper (sm_90a) decode over q8_0/q4_0 K/V that reads whole cell rows: every KV head of a
// cell at once, so that each 64-byte DRAM granule of the cache is read once, by one block, whatever
// the blocks' timing.
//
// Why: a q8_0 head's blocks are 136 bytes of a cell's row (q4_0: 72), so the per-head boxes of
// cuda/fattn_decode_tma.cu start and end inside granules that the neighbouring heads' boxes share.
// Read by blocks that run apart, a shared granule comes from DRAM twice: at B=64 32k on the H100
// the quantized instances moved 1.21x (heads first) to 1.42x the cache's bytes
// (bench/NOTES.md, #46). A whole row -- 8 KV heads: 1,088 bytes for q8_0, 576 for q4_0 -- is a
// whole number of granules.
//
// Work: as fattn_decode_tma.cu's (its opening comment), but a unit is one live KV tile of a
// (stream, query tile) pair for all of the pair's head groups at once (Walk<true>: a pair is one
// group); the split over the blocks is the same walk, with a pair's units its live tiles.
//
// Block: NW warps, NW the call's head groups (n_head / pack: the host checks), and no producer
// warp: a ninth warp would cut every thread's registers from 255 to 168 (a sub-partition's
// registers over three warps), and the register path then spills. No block-wide barrier in the loop.
//   - step produce: a stage holds HALF cells of a plan tile: one TMA copy of those cells' whole K
//     rows and one of their V rows (a box of NKV x ROW bytes as 8-byte elements, by
//     ggml_attn/decode_tma_shape.py quant_rows_map; the n_kv tail reads zeros), in a ring of
//     STAGES stages, each with a "full" mbarrier (transaction bytes) and a release count. Thread
//     0 fills the first STAGES; then the last warp to release a stage (its count) refills it with
//     the stage STAGES further on, which the block's one cursor (RowCursor, in shared memory)
//     names and moves past. Refills come in stage order: a stage's last release follows every
//     warp's release of the stage before, that stage's last among them; the fences around the
//     counts carry the cursor from one refill to the next.
//   - step process: warp w takes head group w of every stage -- its KV head's blocks at
//     byte (w P / gqa) x ROW of each cell's row -- with the register path of the decode-tma
//     instances (k_frags / v_frags: the MMAs' fragments built from the raw blocks), masks a
//     PARTIAL tile, zeroes the scales of its HIDDEN cells' V, runs its online softmax and
//     releases the stage.
//   - step segment end: each warp holds its own rows: no merge between warps. A pair the block
//     took whole is written to dst; a part of one goes to the block's partial slot (2 b for its
//     first pair, 2 b + 1 for its last; per warp), and the last block to count itself in
//     p.split_cnt[pair] merges every head group's slots into dst and sets the counter back to 0.
// No softcap, no ALiBi, no sinks (dispatch sends none to the sm_90a decode).
#include "decode_tma_common.cuh"

namespace drows {
constexpr int HALF = 32;   // cells of a stage: half a plan tile (a stage of 64 whole rows would not fit twice)

// One stage's K (or V): HALF cells' whole rows of NKV heads' blocks (NKV x ROW bytes), RB bytes
// apart: a row and 16 bytes the box reads past the tensor's row (zeros, no DRAM read), so that
// rows fall 20 words mod 32 apart in the banks, not 16 (1,088 / 576 bytes): the fragments'
// loads 2-way conflicted instead of 4 (the per-head instances' 144 / 80-byte rows: 2-way).
template <typename KT, int D, int NKV> struct RowTile {
    static constexpr int ROW = dtma::Tile<KT, D>::ROW;
    static constexpr int RB = NKV * ROW + 16;
    static constexpr int BYTES = HALF * RB;
};

// A stage of the block's sequence: tile j (of te in its segment) of the walk's current pair,
// half hf of it, in the order of the consumer loop (segments without a live tile have no
// stage); live: a stage is left.
template <int HALVES>
struct RowCursor {
    dtma::Walk<true> w;
    int j, te, hf;
    bool live;

    // the first stage at or after tile j0 of the walk's current segment
    __device__ __forceinline__ void settle(const FattnParams& p, int j0) {
        j = j0;
        for (;;) {
            live = w.w < w.end;
            if (!live) return;
            te = min(w.seg_end(), w.cnt);
            if (j < te) return;
            w.next(p);
            j = w.t;
        }
    }
    __device__ __forceinline__ void begin(const FattnParams& p, const dtma::Walk<true>& start) {
        w = start, hf = 0;
        settle(p, w.t);
    }
    __device__ __forceinline__ void advance(const FattnParams& p) {
        if (!live) return;
        if (++hf < HALVES) return;
        hf = 0;
        settle(p, j + 1);
    }
};

constexpr int CURSOR_BYTES = 96;   // the cursor's place in shared memory (a static_assert checks)

// Dynamic shared memory: 1024-byte alignment slack, the ring (K then V per stage), its fill
// barriers, the cursor, the release counts, the "last block" flag. The host reads it from the
// cubin (fattn_decode_rows_smem, at the end of this file).
template <typename KT, int D, int STAGES, int NKV>
__host__ __device__ constexpr int smem_bytes() {
    return 1024 + STAGES * 2 * RowTile<KT, D, NKV>::BYTES + STAGES * 8 + CURSOR_BYTES + STAGES * 4 + 16;
}
}  // namespace drows

// The register path's V columns (QuantPerm::v_val) come in runs of four: n-tiles 4 k .. 4 k + 3
// of a lane's column are 4 consecutive dimensions (the segment end's float4 stores).
template <typename Q>
__device__ constexpr bool v_runs_of_four() {
    for (int nt = 0; nt < 16; ++nt)
        for (int h = 0; h < 2; ++h)
            if (dtma::QuantPerm<Q>::v_val(nt, h) != dtma::QuantPerm<Q>::v_val(nt & ~3, h) + (nt & 3)) return false;
    return true;
}

template <typename KT, int D, int STAGES, int NW, int NKV>
__device__ __forceinline__ void fattn_decode_rows_body(const FattnParams& p, const TmaMap* mk, const TmaMap* mv) {
    using namespace dtma;
    using RT = drows::RowTile<KT, D, NKV>;
    using T = __half;
    constexpr int NC = drows::HALF;          // cells a stage
    constexpr int HALVES = BK / NC;          // stages a plan tile
    constexpr int STAGE_BYTES = 2 * RT::BYTES;
    static_assert(Tile<KT, D>::QUANT && D == 128, "whole rows: q8_0/q4_0 blocks at D 128 (the register path)");
    static_assert(RT::RB % 16 == 0 && RT::RB / 8 <= 256, "a cell's row: one TMA box side of 8-byte elements");
    static_assert(RT::BYTES % 128 == 0, "V's box 128-byte aligned after K's");
    static_assert(STAGE_BYTES % 128 == 0, "each stage 128-byte aligned for the TMA");
    static_assert(v_runs_of_four<KT>(), "the output's float4 stores");

    extern __shared__ unsigned char smem_raw[];
    unsigned char* ring = smem_align1024(smem_raw);
    unsigned long long* full = reinterpret_cast<unsigned long long*>(ring + STAGES * STAGE_BYTES);
    using Cursor = drows::RowCursor<HALVES>;
    static_assert(sizeof(Cursor) <= drows::CURSOR_BYTES && alignof(Cursor) <= 8, "the cursor's place");
    Cursor* s_cur = reinterpret_cast<Cursor*>(full + STAGES);   // the next stage to fill
    int* released = reinterpret_cast<int*>(reinterpret_cast<unsigned char*>(s_cur) + drows::CURSOR_BYTES);   // [STAGES]: releases, ever
    int* s_last = released + STAGES;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (tid == 0) {
        for (int i = 0; i < STAGES; ++i) mbar_init(full + i, 1), released[i] = 0;
        fence_mbar_init();
    }
    __syncthreads();

    Walk<true> wk;
    if (!wk.start(p, blockIdx.x, gridDim.x, lane, false)) return;
    const int P = p.pack, pshift = __ffs(P) - 1, tq = p.q_tile_tokens;

    // ---- step produce: stage `it` of the cursor's place into its ring slot (one thread)
    auto produce = [&](const Cursor& c, int at) {
        const int stage = at % STAGES;
        const int kv0 = (tile_entry(p, c.w.pair, c.j) & FATTN_TILE_ID_MASK) * BK + NC * c.hf;
        const int s = c.w.pair / p.n_q_tiles;
        unsigned char* dst = ring + stage * STAGE_BYTES;
        mbar_arrive_expect_tx(full + stage, STAGE_BYTES);
        tma_load_4d(dst, mk, 0, kv0, 0, s, full + stage);
        tma_load_4d(dst + RT::BYTES, mv, 0, kv0, 0, s, full + stage);
    };
    if (tid == 0) {   // the first STAGES stages; the cursor left at the next (a warp's first
        Cursor c;     // release, warp 0's included, comes after this: no barrier)
        c.begin(p, wk);
        for (int at = 0; at < STAGES && c.live; ++at) {
            produce(c, at);
            c.advance(p);
        }
        *s_cur = c;
        __threadfence_block();
    }

    // ---- warp w takes head group w (query heads h0 .. h0 + P - 1) of every stage; fragment
    // rows g, g + 8, cells 8 nt + [2 t4, 2 t4 + 1] of the stage's NC
    const int g = lane >> 2, t4 = lane & 3;
    const int h0 = warp * P;
    const int row_off = (h0 / p.gqa) * Tile<KT, D>::ROW;   // its KV head's blocks in a cell's row
    const long long b_start = wk.w;
    const float qs = p.scale * FATTN_LOG2E;
    int it = 0;

    for (; wk.w < wk.end; wk.next(p)) {
        const int s = wk.pair / p.n_q_tiles, qt = wk.pair - s * p.n_q_tiles;
        const int tok0 = qt * tq;
        auto row_tok = [&](int r) { return tok0 + (r >> pshift); };
        auto row_head = [&](int r) { return h0 + (r & (P - 1)); };
        auto row_valid = [&](int r) { return (r >> pshift) < tq && row_tok(r) < p.n_batch; };

        unsigned Qf[D / 16][4];
        float O[D / 8][4], m[2], l[2];
        const char* mrow[2];
        int2 lohi[2];
        begin_segment<KT, T, D, true>(p, s, g, t4, qs, row_valid, row_tok, row_head, Qf, O, m, l, mrow, lohi);

        const int te = min(wk.seg_end(), wk.cnt);
        for (int j = wk.t; j < te; ++j) {
            const int e = tile_entry(p, wk.pair, j);
            // the tile's cells no row of this group sees: their V scales read as 0 (NaN garbage
            // there must not meet a zero probability)
            const unsigned long long hid = (e & FATTN_TILE_HIDDEN) ? live_tiles(p, qt, s).hidden(p, j, h0, P) : 0ull;
#pragma unroll 1
            for (int hf = 0; hf < HALVES; ++hf, ++it) {
                const int stage = it % STAGES;
                mbar_wait(full + stage, (it / STAGES) & 1);
                __syncwarp();   // lanes leave the spin apart; mma is .aligned
                const unsigned char* raw = ring + stage * STAGE_BYTES;
                const int c0 = (e & FATTN_TILE_ID_MASK) * BK + NC * hf + 2 * t4;   // this thread's first cell

                // ---- step S = Q K^T (16 rows x NC cells): cell 8 nt + g's block t4 from the raw
                // rows, two n-tiles at a time, their MMA chains interleaved
                float S[NC / 8][4];
#pragma unroll
                for (int nt = 0; nt < NC / 8; ++nt) S[nt][0] = S[nt][1] = S[nt][2] = S[nt][3] = 0.0f;
#pragma unroll
                for (int nt = 0; nt < NC / 8; nt += 2) {
                    unsigned b[2][D / 16][2];
#pragma unroll
                    for (int u = 0; u < 2; ++u)
                        k_frags<KT, D>(raw, row_off + (8 * (nt + u) + g) * RT::RB + t4 * KT::BYTES, b[u]);
#pragma unroll
                    for (int ks = 0; ks < D / 16; ++ks)
#pragma unroll
                        for (int u = 0; u < 2; ++u) Mma<T>::run(S[nt + u], Qf[ks], b[u][ks][0], b[u][ks][1]);
                }
                mask_partial<NC>(p, e, c0, mrow, lohi, S);
                online_softmax<NC, D>(S, m, l, O);

                // ---- step O += P V (the 16 cells' values of the lane's columns, from the raw rows)
#pragma unroll
                for (int kk = 0; kk < NC / 16; ++kk) {
                    unsigned a[4];
                    p_frag<T, NC>(S, kk, a);
                    unsigned b[16][2];
                    v_frags<KT>(raw + RT::BYTES, row_off, RT::RB, 16 * kk, g, t4, hid >> (NC * hf), b);
#pragma unroll
                    for (int nt = 0; nt < D / 8; ++nt) Mma<T>::run(O[nt], a, b[nt][0], b[nt][1]);
                }
                // ---- step release: every lane's fragments of the stage are read; the last of
                // the NW warps to release it refills it (generic reads ordered before the
                // TMA's writes: fences around the count, then the proxy fence)
                __syncwarp();
                if (lane == 0) {
                    __threadfence_block();
                    const int n = atomicAdd(released + stage, 1);
                    if (n == NW * (it / STAGES) + NW - 1) {   // the cursor is at stage it + STAGES
                        __threadfence_block();
                        Cursor c = *s_cur;
                        if (c.live) {
                            fence_proxy_async_shared();
                            produce(c, it + STAGES);
                            c.advance(p);
                            *s_cur = c;
                        }
                    }
                }
            }
        }

        // ---- step segment end: the warp's rows g, g + 8 to dst (a pair taken whole) or to its
        // partial slot. Columns: n-tile nt's 2 t4 + h is dimension 32 t4 + v_val(nt, h) (the
        // register path's permuted V), and n-tiles 4 k .. 4 k + 3 are 4 consecutive dimensions.
        const bool whole = wk.t == 0 && wk.seg_end() == wk.units();
        const int slot = 2 * blockIdx.x + (wk.w == b_start ? 0 : 1);   // the block's first pair, or its last
#pragma unroll
        for (int rs = 0; rs < 2; ++rs) {
            l[rs] += __shfl_xor_sync(0xffffffffu, l[rs], 1);
            l[rs] += __shfl_xor_sync(0xffffffffu, l[rs], 2);
            const int r = g + 8 * rs;
            if (!row_valid(r)) continue;
            const int h = row_head(r);
            const long long z = ((long long)slot * NW + warp) * ROWS + r;   // the row's partial slot
            const float fac = whole ? row_finish_factor(p, h, m[rs], l[rs]) : 1.0f;
            float* out = whole ? p.dst + (((long long)s * p.n_batch + row_tok(r)) * p.n_head + h) * D : p.ws_o + z * D;
#pragma unroll
            for (int k = 0; k < D / 32; ++k)
#pragma unroll
                for (int hl = 0; hl < 2; ++hl)
                    *reinterpret_cast<float4*>(out + 32 * t4 + QuantPerm<KT>::v_val(4 * k, hl)) =
                        make_float4(O[4 * k][2 * rs + hl] * fac, O[4 * k + 1][2 * rs + hl] * fac,
                                    O[4 * k + 2][2 * rs + hl] * fac, O[4 * k + 3][2 * rs + hl] * fac);
            if (!whole && t4 == 0) p.ws_ml[z * 2] = m[rs], p.ws_ml[z * 2 + 1] = l[rs];
        }

        // ---- step merge a pair's parts: the last block to finish one merges every head group's
        if (!whole) {
            const GroupParts parts(wk);   // each part's slot holds the NW warps' rows
            const int n_part = parts.n_part;
            auto part_slot = [&](int k) { return parts.slot(k) * NW + warp; };
            __threadfence();
            __syncwarp();   // (the rows' stores above diverged) bar.sync is .aligned
            named_barrier_sync(1, 32 * NW);   // also: every warp read the previous segment's flag
            if (tid == 0) {
                const bool last = atomicAdd(p.split_cnt + wk.pair, 1) == n_part - 1;
                if (last) p.split_cnt[wk.pair] = 0;   // for the next launch (no other block counts now)
                *s_last = last;
            }
            named_barrier_sync(1, 32 * NW);
            if (*s_last) {
                __threadfence();
#pragma unroll 1
                for (int r0 = 0; r0 < ROWS; r0 += 4) {   // 8 lanes a row, 4 rows at a time
                    const int r = r0 + (lane >> 3);
                    const int h = row_head(r);
                    float* out = row_valid(r) ? p.dst + (((long long)s * p.n_batch + row_tok(r)) * p.n_head + h) * D : nullptr;
                    merge_parts<D>(p, r, lane & 7, n_part, part_slot, out, h);
                    __syncwarp();
                }
            }
        }
    }
}

// One instance per configuration ggml_attn/decode_tma_shape.py names with row_heads (Cfg.name),
// each its own NVRTC program: K/V type as stored (q8_0/q4_0), head size (128), ring depth, NW
// consumer warps (the call's head groups), NKV KV heads a cell's row. One block per SM.
template <typename KT, int D, int STAGES, int NW, int NKV>
__global__ void __launch_bounds__(32 * NW, 1)
fattn_decode_rows(const FattnParams p, const __grid_constant__ TmaMap mk, const __grid_constant__ TmaMap mv) {
    fattn_decode_rows_body<KT, D, STAGES, NW, NKV>(p, &mk, &mv);
}

// The dynamic shared memory (bytes) a launch of fattn_decode_rows<...> with the same parameters
// takes: the host reads it from the compiled program (ggml_attn/variants.py smem_expr)
template <typename KT, int D, int STAGES, int NW, int NKV>
__device__ const int fattn_decode_rows_smem = drows::smem_bytes<KT, D, STAGES, NKV>();
