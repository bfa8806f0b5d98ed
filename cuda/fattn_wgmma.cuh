// Tile steps of the warp-specialised wgmma prefill (cuda/fattn_wgmma.cu), shared
// with its operand probe (cuda/hopper_probe.cu): the S and P V GEMMs on the TMA-swizzled K/V
// stages (KV tiles of BK = 64 cells in the probe, 128 in the kernel), the online softmax, the P
// fragments, Q staging and row stores, the chunk walk over the plan's live
// tiles and its masks, the HIDDEN rows' zeroing. sm_90a only.
//
// Head sizes D 64, 128 and 256 (head_dim_k = head_dim_v). A stage holds one K and one V tile of BK cells x D
// 16-bit values as D / 64 TMA-written d-boxes of BK x 64 (d 0-63, then d 64-127, ...), each with
// the 128-byte swizzle (cuda/hopper_common.cuh, wgmma_desc_sw128). A warpgroup's S = Q K^T is
// 64 x BK: thread (warp w, lane 4g + t4) holds S[4i + {0, 1}] at row 16w + g, columns
// 8i + 2t4 + {0, 1} and S[4i + {2, 3}] at row 16w + g + 8; its O (64 x D) the same way over D.
#pragma once
#include "hopper_common.cuh"

// the element type of Q (as staged), K, V and P: f16 or bf16 (wgmma's operand type)
template <typename T> struct WgType;
template <> struct WgType<__half> { static constexpr bool BF16 = false; };
template <> struct WgType<__nv_bfloat16> { static constexpr bool BF16 = true; };

namespace ws {
// BQ: query rows per block; THREADS: two consumer warpgroups and the producer
constexpr int BQ = 128, THREADS = 384;
// registers per thread after reallocation: 128 x (40 + 2 x 232) = 384 x 168 (the launch's share)
constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;
// KV cells per step for head size D: two plan tiles (128), one (64) at D 256, where a stage of
// 128 cells (64 KB of K, 64 of V) and Q (64 KB) would leave no room for a second stage
template <int D> __host__ __device__ constexpr int chunk() { return D == 256 ? 64 : 128; }
template <int D, int BK> __host__ __device__ constexpr int tile_bytes() { return BK * D * 2; }   // one K or V tile
template <int BK> __host__ __device__ constexpr int box_bytes() { return BK * 64 * 2; }   // one of its d-boxes
// dynamic shared memory: 1024-byte alignment slack, the ring, Q (128 x D values), 5 mbarriers
// per stage; with QTMA also Q's f32 rows as TMA writes them (128 x D floats) and 4 mbarriers
// (Q landed, Q read: one per warpgroup); with OTMA 4 more (output rows staged, staging read: one
// per warpgroup; the staging is Q's f32 rows' space); the host reads it from the cubin
// (fattn_wgmma_ws_smem at the end of cuda/fattn_wgmma.cu)
template <int D, int STAGES, bool QTMA = false, bool OTMA = false> __host__ __device__ constexpr int smem_bytes() {
    return 1024 + 2 * STAGES * tile_bytes<D, chunk<D>()>() + BQ * D * 2 + (QTMA ? BQ * D * 4 + 4 * 8 : 0) +
           (OTMA ? 4 * 8 : 0) + 5 * STAGES * 8;
}
// OTMA: a warpgroup's output rows as the dst map's boxes (ggml_attn/wgmma_shape.py o_map): D / 32
// boxes of 32 values x 64 rows, 128-byte swizzled, 8 KB apart
constexpr int OBOX_COLS = 32, OBOX_BYTES = 64 * OBOX_COLS * 4;
}

// A warpgroup's 64 query rows tok0 .. tok0+63 of head h, stream s -> shared memory (sq: 64 x D
// 16-bit values as core matrices, K-major): T (f16 or bf16, K/V's type) of q * scale * log2 e
// (scores then come out in the log2 domain), rows past n_batch zero. D is the instance's tile
// width; the call's head size p.head_dim_v (= head_dim_k, a multiple of 8, <= D) may be smaller: columns from
// p.head_dim_v on are zero (as TMA fills K and V there), so they add nothing to S. tid: the thread's
// index in the warpgroup (0..127).
template <int D, typename T = __half>
__device__ __forceinline__ void wg_stage_q(const FattnParams& p, __half* sq, int tok0, int h, int s, int tid) {
    const float qs = p.scale * FATTN_LOG2E;
    const char* qb = p.q + (long long)s * p.q_nb3 + (long long)h * p.q_nb2;
    for (int i = tid; i < 64 * (D / 4); i += 128) {
        const int r = i / (D / 4), c = (i % (D / 4)) * 4;
        float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (tok0 + r < p.n_batch && c < p.head_dim_v)
            x = __ldg(reinterpret_cast<const float4*>(qb + (long long)(tok0 + r) * p.q_nb1) + c / 4);
        uint2 w;
        w.x = KVTraits<T>::pack2(x.x * qs, x.y * qs);
        w.y = KVTraits<T>::pack2(x.z * qs, x.w * qs);
        *reinterpret_cast<uint2*>(sq + core_matrix_index(r, c, D)) = w;
    }
}

// The same from Q's f32 rows already in shared memory (sqf: 64 rows x D floats, row-major, as
// the Q tensor map's box lands: rows past n_batch and columns past the head are TMA's zeros).
template <int D, typename T = __half>
__device__ __forceinline__ void wg_convert_q(const FattnParams& p, const float* sqf, __half* sq, int tid) {
    const float qs = p.scale * FATTN_LOG2E;
#pragma unroll 8
    for (int i = tid; i < 64 * (D / 4); i += 128) {
        const int r = i / (D / 4), c = (i % (D / 4)) * 4;
        const float4 x = reinterpret_cast<const float4*>(sqf)[i];
        uint2 w;
        w.x = KVTraits<T>::pack2(x.x * qs, x.y * qs);
        w.y = KVTraits<T>::pack2(x.z * qs, x.w * qs);
        *reinterpret_cast<uint2*>(sq + core_matrix_index(r, c, D)) = w;
    }
}

// A thread's two output rows (tok, tok + 8: rows g and g + 8 of its warp's 16) from the P V
// accumulators: O / l (0 for a row that sees no cell), f32, dst row ((s * n_batch + tok) *
// n_head + h, rows of p.head_dim_v values); rows past n_batch and the tile's columns past p.head_dim_v are not
// written. l: the thread's partial row sums (a row's sum is spread over the 4 threads of a quad).
template <int D>
__device__ __forceinline__ void wg_store_rows(const FattnParams& p, const float (&O)[D / 2], const float (&l)[2],
                                              int tok, int h, int s, int t4) {
#pragma unroll
    for (int rs = 0; rs < 2; ++rs) {
        float L = l[rs];
        L += __shfl_xor_sync(0xffffffffu, L, 1);
        L += __shfl_xor_sync(0xffffffffu, L, 2);
        const int t = tok + 8 * rs;
        if (t >= p.n_batch) continue;
        const float f = inv_row_sum(L);
        float* out = p.dst + (((long long)s * p.n_batch + t) * p.n_head + h) * p.head_dim_v;
#pragma unroll
        for (int i = 0; i < D / 8; ++i)
            if (8 * i + 2 * t4 < p.head_dim_v)
                *reinterpret_cast<float2*>(out + 8 * i + 2 * t4) = make_float2(O[4 * i + 2 * rs] * f, O[4 * i + 2 * rs + 1] * f);
    }
}

// The softmax's variants (WsConfig.softmax in ggml_attn/wgmma_shape.py; the kernel's SMX):
// WS_SMX_LAZY: a row keeps its reference maximum until a chunk's scores pass it by more than
// WS_LAZY_LOG2 (P <= 2^8 then; O and l share the reference, so O / l is unchanged), and O's
// rescale is skipped when no row of the warp moved its reference (a warp vote): most chunks of a
// long row rescale nothing. (Measured and dropped, bench/NOTES.md eighteenth session: the skip
// alone, without the lazy reference, and part of the exponentials as a polynomial on the FMA
// pipe: both no faster on an H100.)
#define WS_SMX_LAZY 1
#define WS_LAZY_LOG2 8.0f

// OTMA's epilogue: the thread's two output rows (tok, tok + 8: warpgroup rows r = 16 w4 + g and
// r + 8) as O / l (0 for a row that sees no cell) into the warpgroup's staging `so` (1024-byte
// aligned): box c / 32 of column c, at the staging row of r in the box's order (value, head,
// token): (r % tw) * (64 / tw) + r / tw, tw the warpgroup's tokens per head (ws_rows); the
// 16-byte chunks of a 128-byte box row swizzled as TMA reads them (chunk ^ row % 8). Columns past
// the head and rows past n_batch are staged too; the store leaves them out (outside the map).
template <int D>
__device__ __forceinline__ void wg_stage_rows(const float (&O)[D / 2], const float (&l)[2], float* so, int tw,
                                              int w4, int g, int t4) {
    const unsigned base = smem_u32(so);
#pragma unroll
    for (int rs = 0; rs < 2; ++rs) {
        float L = l[rs];
        L += __shfl_xor_sync(0xffffffffu, L, 1);
        L += __shfl_xor_sync(0xffffffffu, L, 2);
        const float f = inv_row_sum(L);
        const int r = 16 * w4 + g + 8 * rs, row = (r % tw) * (64 / tw) + r / tw;
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
            const int c = 8 * i + 2 * t4, cc = c % ws::OBOX_COLS;
            const unsigned a = base + (c / ws::OBOX_COLS) * ws::OBOX_BYTES + row * 128 +
                               ((((cc >> 2) ^ row) & 7) << 4) + (cc & 3) * 4;
            asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" :: "r"(a), "f"(O[4 * i + 2 * rs] * f),
                         "f"(O[4 * i + 2 * rs + 1] * f) : "memory");
        }
    }
}

// S (log2 domain) -> P = 2^(S - m_ref) in place; m (the rows' reference maxima) and l updated,
// alpha[rs] = 2^(m_old - m_ref) returned for the caller to rescale O with, and whether any of
// the thread's two rows moved its reference (alpha != 1). Rows g (rs 0) and g + 8 (rs 1) of each
// warp's 16; a row's BK values live in the 4 threads of a quad. SMX: the WS_SMX_* flags above
// (0: the reference is the running maximum).
template <int BK, int SMX = 0>
__device__ __forceinline__ bool ws_softmax(float (&S)[BK / 2], float (&m)[2], float (&l)[2], float (&alpha)[2]) {
    bool moved = false;
#pragma unroll
    for (int rs = 0; rs < 2; ++rs) {
        float mx = FATTN_NEG_INF;
#pragma unroll
        for (int i = 0; i < BK / 8; ++i) mx = fmaxf(mx, fmaxf(S[4 * i + 2 * rs], S[4 * i + 2 * rs + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        float m_new = fmaxf(m[rs], mx);
        // lazy: the reference stays unless passed by more than WS_LAZY_LOG2 (-inf + 8 = -inf:
        // a row's first finite score always moves it)
        if ((SMX & WS_SMX_LAZY) && !(m_new > m[rs] + WS_LAZY_LOG2)) m_new = m[rs];
        const float m_use = m_new == FATTN_NEG_INF ? 0.0f : m_new;
        moved |= m_new != m[rs];
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
    return moved;
}

template <int D>
__device__ __forceinline__ void ws_rescale(float (&O)[D / 2], const float (&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
        O[4 * i] *= alpha[0]; O[4 * i + 1] *= alpha[0];
        O[4 * i + 2] *= alpha[1]; O[4 * i + 3] *= alpha[1];
    }
}

// P (S's accumulators after ws_softmax) -> the A fragments (type T) of the BK / 16 k16 steps of P V
template <int BK, typename T = __half>
__device__ __forceinline__ void ws_pack_p(const float (&S)[BK / 2], unsigned (&a)[BK / 4]) {
#pragma unroll
    for (int i = 0; i < BK / 4; ++i) a[i] = KVTraits<T>::pack2(S[2 * i], S[2 * i + 1]);
}

// the K-major swizzled descriptor of k16 step ks (of D / 16) of a K tile: 32-byte steps inside a
// d-box's 128-byte rows, the next d-box every 4 steps
template <int BK>
__device__ __forceinline__ unsigned long long ws_k_desc(unsigned k_addr, int ks) {
    return wgmma_desc_sw128(k_addr + (ks >> 2) * ws::box_bytes<BK>() + (ks & 3) * 32, 16, 1024);
}

// S = Q K^T for one tile: D / 16 k16 steps; Q (64 rows x D) in plain core matrices
template <int D, int BK, typename T = __half>
__device__ __forceinline__ void ws_issue_s(float (&S)[BK / 2], unsigned q_addr, unsigned k_addr) {
    constexpr bool BF16 = WgType<T>::BF16;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
        const unsigned long long da = wgmma_desc(q_addr + ks * 256, 128, (D / 8) * 128);
        if constexpr (BK == 64) wgmma_m64n64k16<BF16>(S, da, ws_k_desc<BK>(k_addr, ks), ks > 0);
        else wgmma_m64n128k16<BF16>(S, da, ws_k_desc<BK>(k_addr, ks), ks > 0);
    }
}

// O += P V for one tile: BK / 16 k16 steps of 16 cells (2048 bytes of the swizzled d-boxes
// each). N = D: one d-box at D 64; at D 128 both (the lead byte offset: one box); at D 256 two
// N = 128 GEMMs per step, d-boxes 0-1 into O[0..63] and 2-3 into O[64..127] (column blocks
// 16-31: the accumulator layout over D)
template <int D, int BK, typename T = __half>
__device__ __forceinline__ void ws_issue_pv(float (&O)[D / 2], const unsigned (&a)[BK / 4], unsigned v_addr) {
    constexpr bool BF16 = WgType<T>::BF16;
    constexpr unsigned BOX = ws::box_bytes<BK>();
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
        const unsigned ak[4] = {a[4 * kk], a[4 * kk + 1], a[4 * kk + 2], a[4 * kk + 3]};
        const unsigned at = v_addr + kk * 2048;
        if constexpr (D == 64) {
            wgmma_m64n64k16_rs<1, BF16>(O, ak, wgmma_desc_sw128(at, BOX, 1024), true);
        } else if constexpr (D == 128) {
            wgmma_m64n128k16_rs<1, BF16>(O, ak, wgmma_desc_sw128(at, BOX, 1024), true);
        } else {
            static_assert(D == 256, "head sizes 64, 128, 256");
            wgmma_m64n128k16_rs<1, BF16>(*reinterpret_cast<float(*)[64]>(&O[0]), ak, wgmma_desc_sw128(at, BOX, 1024), true);
            wgmma_m64n128k16_rs<1, BF16>(*reinterpret_cast<float(*)[64]>(&O[64]), ak,
                                         wgmma_desc_sw128(at + 2 * BOX, BOX, 1024), true);
        }
    }
}

// ---- the KV chunks of one query tile (BK cells each: two 64-cell plan tiles, or one at BK 64)
// and their masks. A half (one plan tile's 64 cells) has a class (2 bits per half, half 0 in
// bits 0-1): FULL (no mask), ABSENT (no cell visible:
// not live in the plan, or past n_kv), PARTIAL (every row one interval of zeros: p.row_lohi),
// MASKED (the mask's values are read)
#define WS_FULL 0
#define WS_ABSENT 1
#define WS_PARTIAL 2
#define WS_MASKED 3

struct WsChunks {
    const int* idx;                  // the plan's live list of the query tile (nullptr: every chunk, no mask)
    const unsigned long long* hid;   // its hidden-column words, ne32 per entry (list order)
    int cnt;                         // its entries (without a plan: the chunks covering n_kv)
    int n_kv;
    int oob;                         // a cell index past n_kv: TMA boxes there read as zeros
};
struct WsChunk {
    int kv0;     // first cell
    int cls;     // the halves' classes (half 1 unused at BK 64)
    int hid;     // bit hf: half hf has columns no row of the query tile sees (the plan's HIDDEN)
    int pos0;    // list positions of the halves' entries (their hidden words), -1: none
    int pos1;
};

// the query tiles a persistent block computes: every gridDim.x-th of (n_head / pack) x ne3 x
// n_q_tiles, starting at blockIdx.x
__device__ __forceinline__ int ws_tiles_of_block(const FattnParams& p) {
    const int total = p.n_head / p.pack * p.ne3 * p.n_q_tiles;
    return total > (int)blockIdx.x ? (total - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x : 0;
}

// The 64 rows of warpgroup wg in query tile qt of head group hg (query heads hg * pack ..
// hg * pack + pack - 1, one KV head; p.pack a power of 2 dividing gqa): row r is query head
// hbase + r / tw at token tbase + r % tw. pack 1: head hg, tokens qt * 128 + 64 wg + r (tw 64);
// pack >= 2: 128 / pack tokens from qt * 128 / pack (tw) of heads pack / 2 * (2 hg + wg) ..
// (64 / tw of them) -- the Q map's box (D x tw tokens x 64 / tw heads) lands them in that order.
// A warp's 16 rows are of one head (tw >= 16: pack <= 8).
struct WsRows {
    int hbase, tbase, tw;
    __device__ __forceinline__ int head(int r) const { return hbase + r / tw; }
    __device__ __forceinline__ int token(int r) const { return tbase + r % tw; }
};
__device__ __forceinline__ WsRows ws_rows(const FattnParams& p, int hg, int qt, int wg) {
    WsRows r;
    if (p.pack == 1) {
        r.hbase = hg, r.tw = 64, r.tbase = qt * ws::BQ + wg * 64;
    } else {
        r.tw = ws::BQ / p.pack, r.hbase = hg * p.pack + wg * (p.pack >> 1), r.tbase = qt * r.tw;
    }
    return r;
}

template <int BK>
__device__ __forceinline__ WsChunks ws_chunks(const FattnParams& p, int q_tile, int s) {
    WsChunks c;
    c.n_kv = c.oob = p.n_kv;
    c.hid = nullptr;
    if (p.live_idx == nullptr) {
        c.idx = nullptr;
        c.cnt = (p.n_kv + BK - 1) / BK;
    } else {
        const long long slot = (long long)(s % p.ne33) * p.n_q_tiles + q_tile;
        c.idx = p.live_idx + slot * p.n_kv_tiles;
        c.hid = live_hidden(p.live_idx, p) + slot * p.n_kv_tiles * p.ne32;
        c.cnt = __ldg(p.live_cnt + slot);
    }
    return c;
}

__device__ __forceinline__ int ws_class(int e) {
    return !(e & FATTN_TILE_PARTIAL) ? WS_FULL : (e & FATTN_TILE_MASKED) ? WS_MASKED : WS_PARTIAL;
}

// the next chunk from list position pos (advanced past the entries it used); false at the end.
// With a plan: its entries are ascending 64-cell tile ids, at BK 128 paired by id / 2 (a tile
// missing from a pair is ABSENT), at BK 64 one per chunk. Without one: chunk pos, halves past
// n_kv ABSENT, a half that n_kv cuts PARTIAL.
template <int BK>
__device__ __forceinline__ bool ws_next_chunk(const WsChunks& c, int& pos, WsChunk& out) {
    if (pos >= c.cnt) return false;
    out.hid = 0;
    out.pos0 = out.pos1 = -1;
    if constexpr (BK == 64) {
        if (c.idx == nullptr) {
            out.kv0 = pos++ * 64;
            out.cls = c.n_kv - out.kv0 >= 64 ? WS_FULL : WS_PARTIAL;
            return true;
        }
        const int e0 = __ldg(c.idx + pos);
        out.kv0 = (e0 & FATTN_TILE_ID_MASK) * 64;
        out.cls = ws_class(e0);
        out.hid = e0 & FATTN_TILE_HIDDEN ? 1 : 0;
        out.pos0 = pos++;
        return true;
    }
    if (c.idx == nullptr) {
        out.kv0 = pos++ * 128;
        const int left = c.n_kv - out.kv0;
        const int h0 = left >= 64 ? WS_FULL : WS_PARTIAL;
        const int h1 = left <= 64 ? WS_ABSENT : left >= 128 ? WS_FULL : WS_PARTIAL;
        out.cls = h0 | (h1 << 2);
        return true;
    }
    const int e0 = __ldg(c.idx + pos), t0 = e0 & FATTN_TILE_ID_MASK;
    out.kv0 = (t0 >> 1) * 128;
    const int here = pos++;
    if (t0 & 1) {   // the chunk's first tile is not live
        out.cls = WS_ABSENT | (ws_class(e0) << 2);
        out.hid = e0 & FATTN_TILE_HIDDEN ? 2 : 0;
        out.pos1 = here;
        return true;
    }
    out.pos0 = here;
    out.hid = e0 & FATTN_TILE_HIDDEN ? 1 : 0;
    int k1 = WS_ABSENT;
    if (pos < c.cnt) {
        const int e1 = __ldg(c.idx + pos);
        if ((e1 & FATTN_TILE_ID_MASK) == t0 + 1) {
            k1 = ws_class(e1);
            out.hid |= e1 & FATTN_TILE_HIDDEN ? 2 : 0;
            out.pos1 = pos++;
        }
    }
    out.cls = ws_class(e0) | (k1 << 2);
    return true;
}

// the visible cells [lo, hi) of a thread's two rows (tok and tok + 8): the plan's row intervals
// (valid in every row of a query tile that has a PARTIAL tile), [0, n_kv) without a plan, empty
// past n_batch
struct RowIntervals {
    int lo[2], hi[2];
};
__device__ __forceinline__ RowIntervals ws_row_intervals(const FattnParams& p, int tok, int h, int s) {
    RowIntervals r;
#pragma unroll
    for (int rs = 0; rs < 2; ++rs) {
        const int t = tok + 8 * rs;
        int2 v = make_int2(0, p.n_kv);
        if (t >= p.n_batch) v = make_int2(0, 0);
        else if (p.row_lohi)
            v = __ldg(p.row_lohi + ((long long)(s % p.ne33) * p.ne32 + (p.ne32 == 1 ? 0 : h % p.ne32)) * p.n_batch + t);
        r.lo[rs] = v.x;
        r.hi[rs] = v.y;
    }
    return r;
}

// the chunk's mask on S (64 rows x BK columns of the warpgroup, accumulator layout; scores in
// the log2 domain): ABSENT halves -inf, PARTIAL halves -inf outside each row's interval, MASKED
// halves plus the mask's values (read from p.mask, times log2 e; -inf cells and rows past
// n_batch set to -inf, not added: NaN in an unseen cell's K stays out), FULL halves untouched.
// tok: the thread's first row (the second is tok + 8).
template <int BK>
__device__ __forceinline__ void ws_mask_chunk(float (&S)[BK / 2], const WsChunk& c, const RowIntervals& r,
                                              const FattnParams& p, int tok, int h, int s, int t4) {
    if (c.cls == (WS_FULL | (WS_FULL << 2))) return;
#pragma unroll
    for (int hf = 0; hf < BK / 64; ++hf) {
        const int k = (c.cls >> (2 * hf)) & 3;
        if (k == WS_FULL) continue;
        if (k == WS_MASKED) {
#pragma unroll
            for (int rs = 0; rs < 2; ++rs) {
                const bool in = tok + 8 * rs < p.n_batch;
                const __half* mrow = reinterpret_cast<const __half*>(mask_row(p, in ? tok + 8 * rs : 0, h, s));
#pragma unroll
                for (int i = 8 * hf; i < 8 * hf + 8; ++i) {
                    const int col = c.kv0 + 8 * i + 2 * t4;
                    float m0 = FATTN_NEG_INF, m1 = FATTN_NEG_INF;
                    if (in && col < p.n_kv) m0 = __half2float(__ldg(mrow + col));
                    if (in && col + 1 < p.n_kv) m1 = __half2float(__ldg(mrow + col + 1));
                    // a -inf cell scores -inf whatever its K holds (NaN + -inf would be NaN)
                    S[4 * i + 2 * rs] = m0 == FATTN_NEG_INF ? FATTN_NEG_INF : S[4 * i + 2 * rs] + m0 * FATTN_LOG2E;
                    S[4 * i + 2 * rs + 1] = m1 == FATTN_NEG_INF ? FATTN_NEG_INF : S[4 * i + 2 * rs + 1] + m1 * FATTN_LOG2E;
                }
            }
            continue;
        }
#pragma unroll
        for (int i = 8 * hf; i < 8 * hf + 8; ++i)
#pragma unroll
            for (int cc = 0; cc < 2; ++cc) {
                const int col = c.kv0 + 8 * i + 2 * t4 + cc;
                if (k == WS_ABSENT || col < r.lo[0] || col >= r.hi[0]) S[4 * i + cc] = FATTN_NEG_INF;
                if (k == WS_ABSENT || col < r.lo[1] || col >= r.hi[1]) S[4 * i + 2 + cc] = FATTN_NEG_INF;
            }
    }
}

// zero the V rows (cells) of a stage that no row of the query tile sees in mask plane h0 % ne32
// (h0: the tile's first head; a tile of several heads has a mask of one plane, ne32 1: the
// kernel checks): the hidden columns of each HIDDEN half (one warp; every lane). A hidden
// cell's P is 0, but 0 x NaN or inf left in an unused cache cell would still reach O. V's stage:
// D / 64 d-boxes of BK cells x 128 bytes (sv: its shared-memory address), cell r of d-box db at
// db * BK * 128 + r * 128 (the swizzle permutes 16-byte chunks within a row only).
template <int D, int BK>
__device__ __forceinline__ void ws_zero_hidden_v(unsigned sv, const WsChunk& c, const WsChunks& cs, int ne32,
                                                 int h0, int lane) {
#pragma unroll
    for (int hf = 0; hf < BK / 64; ++hf) {
        if (!(c.hid >> hf & 1)) continue;
        const int pos = hf ? c.pos1 : c.pos0;
        unsigned long long w = __ldg(cs.hid + (long long)pos * ne32 + (ne32 == 1 ? 0 : h0 % ne32));
        while (w) {   // one cell per step: D / 64 d-boxes x 8 chunks of 16 bytes, one per lane
            const int r = 64 * hf + __ffsll((long long)w) - 1;
            w &= w - 1;
            if (lane < D / 8) {
                const unsigned a = sv + (lane >> 3) * (BK * 128) + r * 128 + (lane & 7) * 16;
                asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" :: "r"(a), "r"(0u) : "memory");
            }
        }
    }
}
