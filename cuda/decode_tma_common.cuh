// What the sm_90a decode's kernels share (cuda/fattn_decode_tma.cu: a KV head's rows a block,
// cuda/fattn_decode_rows.cu: whole cell rows a block): how a tile of K or V arrives (Tile), the
// register path's fragments of q8_0/q4_0 blocks (k_frags, v_frags), the walk over the flattened
// (group, live KV tile) work and its split over the blocks (Walk), and the merge of a group's
// parts (merge_parts). fattn_decode_tma.cu's opening comment describes the work and the split.
#pragma once
#include "hopper_common.cuh"

namespace dtma {
constexpr int BK = FATTN_KV_TILE;       // cells per tile (the plan's tiles)
constexpr int CONSUMERS = 4;            // warps of the f16/bf16 instances: each takes every 4th tile (WHOLE) or 16 cells of every tile
constexpr int THREADS = 32 * (CONSUMERS + 1);
constexpr int ROWS = 16;                // rows of a group: one m16 tile
constexpr int BOX_BYTES = BK * 128;     // one 64-cell x 64-element box, 128-byte rows

// How a K or V tile arrives, by the stored type KT. f16/bf16: D / 64 boxes of 64 cells x 64
// elements, 128-byte swizzled (the MMAs' type T = KT). ggml's q8_0/q4_0 blocks: one raw box per
// tile whose rows are RB bytes of a cell's row of heads from the 16-byte boundary at or before
// head hk's blocks (a box's inner start must be 16-byte aligned): the head's row (D / 32 blocks,
// ROW bytes) sits at c * RB + (hk * ROW) % 16 for cell c, RB covering the largest such offset
// (the other bytes are the neighbouring heads', or zeros past the last); the consumer warp
// builds its MMA fragments from those bytes in registers (the register path, REG), or
// dequantizes the box into its own f16 scratch tile laid out as the f16 boxes (step
// dequantize); T = __half.
template <typename KT, int D> struct Tile {
    using T = KT;
    static constexpr bool QUANT = false;
    static constexpr int ROW = D * 2;
    static constexpr int BYTES = (D / 64) * BOX_BYTES;
};
template <typename Q, int D> struct QuantTile {
    using T = __half;
    static constexpr bool QUANT = true;
    static constexpr int ROW = D / 32 * Q::BYTES;
    static constexpr int OFF_MAX = ROW % 16 == 0 ? 0 : ROW % 8 == 0 ? 8 : ROW % 4 == 0 ? 12 : 14;   // 16 - gcd(ROW, 16)
    static constexpr int RB = (ROW + OFF_MAX + 15) / 16 * 16;
    static constexpr int BYTES = BK * RB;
};
template <int D> struct Tile<fattn_q8_0, D> : QuantTile<fattn_q8_0, D> {};
template <int D> struct Tile<fattn_q4_0, D> : QuantTile<fattn_q4_0, D> {};

// ---- the register path (the "-r" instances, D 128): the MMAs' B fragments built from a tile's
// raw box in registers, no scratch. The dimension K's dot product runs over is permuted so that
// a lane's K values are one block: lane t4 of a quad takes block t4 of cell 8 nt + g, fragment
// (k step ks, position e of {2 t4, 2 t4 + 1, 2 t4 + 8, 2 t4 + 9}) being value k_val(ks, e) of
// the block; Q's A fragments are loaded in the same order. V's output dimension is permuted so
// that a lane's columns are contiguous values of one block: column g of n-tile nt is dimension
// 32 (g >> 1) + v_val(nt, g & 1); the segment end writes O back in the true order.
template <typename Q> struct QuantPerm;
template <> struct QuantPerm<fattn_q8_0> {   // quant byte j is value j
    static __device__ __forceinline__ constexpr int k_val(int ks, int e) { return 4 * ks + e; }
    static __device__ __forceinline__ constexpr int v_val(int nt, int h) { return 16 * h + nt; }
};
template <> struct QuantPerm<fattn_q4_0> {   // byte j's low nibble is value j, its high one 16 + j
    static __device__ __forceinline__ constexpr int k_val(int ks, int e) { return 16 * (ks & 1) + 4 * (ks >> 1) + e; }
    static __device__ __forceinline__ constexpr int v_val(int nt, int h) { return 16 * (nt >> 3) + 8 * h + (nt & 7); }
};

// 4 consecutive quant bytes (or nibbles) y -> f16 pairs (values 0, 1) and (2, 3), times d2.
template <typename Q>
__device__ __forceinline__ uint2 quant4_to_half4(unsigned y, __half2 d2) {
    constexpr bool Q8 = Q::BYTES == fattn_q8_0::BYTES;
    return bytes4_to_half4(Q8 ? y ^ 0x80808080u : y, __float2half2_rn(Q8 ? 1152.0f : 1032.0f), d2);
}

// One lane's K fragments of one cell: its block at raw + base (scale, then quants; base even,
// the row 4-byte aligned, so the block is 4-byte aligned or 2 past). b[ks] = the f16 pairs of
// values k_val(ks, 0..1) and k_val(ks, 2..3), scaled.
template <typename Q, int D>
__device__ __forceinline__ void k_frags(const unsigned char* raw, int base, unsigned (&b)[D / 16][2]) {
    constexpr bool Q8 = Q::BYTES == fattn_q8_0::BYTES;
    constexpr int NW = Q8 ? 9 : 5;   // aligned words covering the block
    static_assert(D == 128, "a lane takes one of the cell's four blocks");
    const unsigned* w = reinterpret_cast<const unsigned*>(raw + (base & ~3));
    const bool odd = (base & 2) != 0;
    const unsigned sel = odd ? 0x7654u : 0x5432u;   // quant word i = bytes of (w[i], w[i + 1])
    unsigned wr[NW];
#pragma unroll
    for (int i = 0; i < NW; ++i) wr[i] = w[i];
    const __half2 d2 = __half2half2(__ushort_as_half((unsigned short)(wr[0] >> (odd ? 16 : 0))));
#pragma unroll
    for (int i = 0; i < NW - 1; ++i) {
        const unsigned x = __byte_perm(wr[i], wr[i + 1], sel);
        if constexpr (Q8) {
            const uint2 h = quant4_to_half4<Q>(x, d2);
            b[i][0] = h.x, b[i][1] = h.y;
        } else {
            const uint2 lo = quant4_to_half4<Q>(x & 0x0F0F0F0Fu, d2), hi = quant4_to_half4<Q>((x >> 4) & 0x0F0F0F0Fu, d2);
            b[2 * i][0] = lo.x, b[2 * i][1] = lo.y, b[2 * i + 1][0] = hi.x, b[2 * i + 1][1] = hi.y;
        }
    }
}

// One lane's values of one cell of V: 16 values of block g >> 1 (v_val(nt, g & 1), nt = 0..15)
// as four words of 4 bytes (q8_0) or nibbles (q4_0), word m holding n-tiles 4 m .. 4 m + 3, and
// the block's scale. The cell's head row at raw + row (4-byte aligned).
template <typename Q>
__device__ __forceinline__ void v_cell(const unsigned char* raw, int row, int g, unsigned (&y)[4], unsigned short& d) {
    constexpr bool Q8 = Q::BYTES == fattn_q8_0::BYTES;
    constexpr int NB = Q8 ? 16 : 8;   // quant bytes a lane takes
    const int blk = row + (g >> 1) * Q::BYTES;
    const int base = blk + 2 + NB * (g & 1);   // 4-byte aligned or 2 past (by the block's parity)
    d = *reinterpret_cast<const unsigned short*>(raw + blk);
    const unsigned* w = reinterpret_cast<const unsigned*>(raw + (base & ~3));
    const bool odd = (base & 2) != 0;
    unsigned wr[NB / 4 + 1];
#pragma unroll
    for (int i = 0; i < NB / 4; ++i) wr[i] = w[i];
    wr[NB / 4] = odd ? w[NB / 4] : 0u;   // the word past the bytes only when they straddle it
    const unsigned sel = odd ? 0x5432u : 0x3210u;
    if constexpr (Q8) {
#pragma unroll
        for (int m = 0; m < 4; ++m) y[m] = __byte_perm(wr[m], wr[m + 1], sel) ^ 0x80808080u;
    } else {
        const unsigned x0 = __byte_perm(wr[0], wr[1], sel), x1 = __byte_perm(wr[1], wr[2], sel);
        y[0] = x0 & 0x0F0F0F0Fu, y[1] = x1 & 0x0F0F0F0Fu, y[2] = (x0 >> 4) & 0x0F0F0F0Fu, y[3] = (x1 >> 4) & 0x0F0F0F0Fu;
    }
}

// The V fragments of one k16 step: b[nt][0] pairs cells (c0, c1), b[nt][1] cells (c2, c3) -- the
// lane's cells 2 t4, 2 t4 + 1, 2 t4 + 8, 2 t4 + 9 of the step -- at column g of n-tile nt. A cell
// of hid (a HIDDEN cell: its scale may be garbage) gets scale 0.
template <typename Q>
__device__ __forceinline__ void v_frags(const unsigned char* raw, int row_off, int rb, int cell0, int g, int t4,
                                        unsigned long long hid, unsigned (&b)[16][2]) {
    constexpr bool Q8 = Q::BYTES == fattn_q8_0::BYTES;
    const __half2 bias2 = __float2half2_rn(Q8 ? 1024.0f + 128.0f : 1024.0f + 8.0f);
    unsigned y[4][4];
    __half d[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const int c = cell0 + 2 * t4 + (k & 1) + 8 * (k >> 1);
        unsigned short db;
        v_cell<Q>(raw, row_off + c * rb, g, y[k], db);
        d[k] = (hid >> c) & 1ull ? __ushort_as_half(0) : __ushort_as_half(db);
    }
    const __half2 d01 = __halves2half2(d[0], d[1]), d23 = __halves2half2(d[2], d[3]);
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        const unsigned lo01 = __byte_perm(y[0][m], y[1][m], 0x5140u), hi01 = __byte_perm(y[0][m], y[1][m], 0x7362u);
        const unsigned lo23 = __byte_perm(y[2][m], y[3][m], 0x5140u), hi23 = __byte_perm(y[2][m], y[3][m], 0x7362u);
        const unsigned src[4][2] = {{lo01, lo23}, {lo01, lo23}, {hi01, hi23}, {hi01, hi23}};
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int hl = 0; hl < 2; ++hl) {
                const unsigned h = __byte_perm(src[i][hl], 0x64646464u, (i & 1) ? 0x4342u : 0x4140u);
                const __half2 v = __hmul2(__hsub2(*reinterpret_cast<const __half2*>(&h), bias2), hl ? d23 : d01);
                b[4 * m + i][hl] = *reinterpret_cast<const unsigned*>(&v);
            }
    }
}

// Live tiles of pair i = (stream, query tile) in stream-major order; every tile without a plan.
__device__ __forceinline__ int pair_cnt(const FattnParams& p, int i) {
    if (!p.live_idx) return p.n_kv_tiles;
    const int s = i / p.n_q_tiles, qt = i - s * p.n_q_tiles;
    return __ldg(p.live_cnt + (s % p.ne33) * p.n_q_tiles + qt);
}


// The block whose units contain unit w under the equal share: the largest b with floor(b W / B) <= w.
__device__ __forceinline__ int block_of(long long w, long long W, int B) {
    return (int)(((w + 1) * B - 1) / W);
}

// Blocks a pair's n_hg groups of u units each (u >= 1) take under the cap (>= 1): ceil(u / cap)
// equal parts per group when u >= cap, else the groups packed floor(cap / u) to a block
// (ggml_attn/decode_tma_shape.py capped_blocks).
__device__ __forceinline__ long long capped_blocks(long long u, long long n_hg, long long cap) {
    return u >= cap ? n_hg * ((u + cap - 1) / cap) : (n_hg + cap / u - 1) / (cap / u);
}

// One warp's view of the block's walk over its units (every warp computes the same). A pair's
// groups: its head groups (p.n_head / p.pack), or with ROWS one, the pair's whole rows (every head
// group of a unit's tile: cuda/fattn_decode_rows.cu).
template <bool ROWS = false>
struct Walk {
    static __device__ __forceinline__ int groups_of(const FattnParams& p) { return ROWS ? 1 : p.n_head / p.pack; }

    long long W;        // units of the whole call
    long long w, end;   // the block's next unit and its end
    int pair, hg;       // the current group: (stream, query tile) pair and head group
    int cnt;            // live tiles of the pair's list (0: one empty unit)
    int t;              // the current unit's index in the group
    int b0, n_part;     // cut by the cap: the block holds part (b - b0) of n_part parts of its one
                        // group, in blocks b0 .. b0 + n_part - 1 (b0 -1: whole groups, or the equal share)
    bool hf;            // the groups numbered heads first (group g: head group g / NP of pair g % NP)

    // Units of the call and the block's share. The split (decode_tma_shape.py block_ranges):
    // with p.work_cap > 0 and the call's blocks under it fitting the grid, groups are cut on
    // their own boundaries -- every pair's groups as one list when all pairs have the same
    // units (then packed across pairs), else pair by pair (the blocks located by a warp-wide
    // scan of the pairs' live counts); otherwise block b takes the equal share
    // [b W / B, (b + 1) W / B). The cap only sizes the work: any cap gives a right split of
    // the current counts (a refreshed plan's included). False: the block has no units.
    // Group order: pair by pair (a pair's head groups one after another), or with heads_first,
    // in the equal share and where the cap's groups are one list of equal groups (every pair's
    // units the same), head group by head group: then the blocks that run at the same time
    // walk neighbouring heads of the same pairs over the same cells, and the DRAM granules two
    // heads' rows share (the quantized rows: 136 / 72 bytes a head) are read once, while both
    // blocks are at them, instead of once per head (bench/NOTES.md, seventeenth session).
    __device__ __forceinline__ bool start(const FattnParams& p, int b, int B, int lane, bool heads_first) {
        const int n_hg = groups_of(p), NP = p.ne3 * p.n_q_tiles;
        const long long cap = p.work_cap;
        b0 = -1, n_part = 0, hf = false;
        // pass 1: units, blocks under the cap, and whether every pair has the same units
        long long tot = 0, blocks = 0;
        int umin = 0x7fffffff, umax = 0;
        if (!p.live_idx) {
            umin = umax = max(p.n_kv_tiles, 1);
            tot = (long long)umin * n_hg * NP;
        } else {
            for (int i = lane; i < NP; i += 32) {
                const int u = max(pair_cnt(p, i), 1);
                tot += (long long)u * n_hg;
                if (cap > 0) blocks += capped_blocks(u, n_hg, cap);
                umin = min(umin, u), umax = max(umax, u);
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                tot += __shfl_xor_sync(0xffffffffu, tot, o);
                blocks += __shfl_xor_sync(0xffffffffu, blocks, o);
                umin = min(umin, __shfl_xor_sync(0xffffffffu, umin, o));
                umax = max(umax, __shfl_xor_sync(0xffffffffu, umax, o));
            }
        }
        W = tot;
        const bool equal = umin == umax;
        if (cap > 0 && equal) blocks = capped_blocks(umin, (long long)n_hg * NP, cap);
        if (cap > 0 && blocks <= B) {
            if (b >= blocks) return false;
            long long k = b, U = 0;   // the block's index in its run of groups cut alike, units before it
            int u = umin, groups = n_hg * NP, first = 0;   // the run: units per group, groups, its first pair
            if (!equal) {             // the pair whose blocks hold b: a scan of capped_blocks
                long long bacc = 0, uacc = 0;
                for (int base = 0; base < NP; base += 32) {
                    const int i = base + lane;
                    const int ui = i < NP ? max(pair_cnt(p, i), 1) : 1;
                    const long long c = i < NP ? capped_blocks(ui, n_hg, cap) : 0;
                    const long long cu = i < NP ? (long long)ui * n_hg : 0;
                    long long incl = c, uincl = cu;
#pragma unroll
                    for (int o = 1; o < 32; o <<= 1) {
                        const long long y = __shfl_up_sync(0xffffffffu, incl, o);
                        const long long z = __shfl_up_sync(0xffffffffu, uincl, o);
                        if (lane >= o) incl += y, uincl += z;
                    }
                    const unsigned hit = __ballot_sync(0xffffffffu, bacc + incl > b);
                    if (hit) {
                        const int L = __ffs(hit) - 1;
                        first = base + L;
                        k = b - (bacc + __shfl_sync(0xffffffffu, incl - c, L));
                        U = uacc + __shfl_sync(0xffffffffu, uincl - cu, L);
                        u = __shfl_sync(0xffffffffu, ui, L);
                        groups = n_hg;
                        break;
                    }
                    bacc += __shfl_sync(0xffffffffu, incl, 31);
                    uacc += __shfl_sync(0xffffffffu, uincl, 31);
                }
            }
            long long g;              // the block's first group in the run
            if (u >= cap) {
                const long long q = (u + cap - 1) / cap, j = k % q;
                g = k / q;
                w = U + g * u + u * j / q;
                end = U + g * u + u * (j + 1) / q;
                if (q > 1) b0 = b - (int)j, n_part = (int)q;
            } else {
                const long long per = cap / u;
                g = k * per;
                w = U + g * u;
                end = U + min(g + per, (long long)groups) * u;
            }
            hf = heads_first && equal;   // (equal: the run is every pair's groups, first 0)
            pair = hf ? (int)(g % NP) : first + (int)(g / n_hg);
            hg = hf ? (int)(g / NP) : (int)(g % n_hg);
            cnt = pair_cnt(p, pair);
            t = (int)(w - U - g * u);
            return true;
        }
        w = W * b / B;
        end = W * (b + 1) / B;
        if (w >= end) return false;
        if (!p.live_idx) {
            const long long per = umin;
            const long long g = w / per;
            hf = heads_first;
            pair = hf ? (int)(g % NP) : (int)(g / n_hg);
            hg = hf ? (int)(g / NP) : (int)(g % n_hg);
            cnt = p.n_kv_tiles;
            t = (int)(w - g * per);
            return true;
        }
        // pairs of unequal units: the pair holding unit w by a scan of the pairs' units -- each
        // pair's n_hg groups (pair by pair), or with heads first its one group of head group
        // w / (W / n_hg) (every head group's units are W / n_hg)
        hf = heads_first;
        const long long Wh = W / n_hg;
        const int h_w = hf ? (int)(w / Wh) : 0;
        const long long r = hf ? w - h_w * Wh : w;   // unit w's index among the scanned units
        long long acc = 0;   // units before this chunk of 32 pairs
        for (int base = 0; base < NP; base += 32) {
            const int i = base + lane;
            const long long c = i < NP ? (hf ? (long long)max(pair_cnt(p, i), 1) : (long long)max(pair_cnt(p, i), 1) * groups_of(p)) : 0;
            long long incl = c;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const long long y = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += y;
            }
            const unsigned hit = __ballot_sync(0xffffffffu, acc + incl > r);
            if (hit) {
                const int L = __ffs(hit) - 1;
                pair = base + L;
                const long long before = acc + __shfl_sync(0xffffffffu, incl - c, L);
                cnt = pair_cnt(p, pair);
                const long long per = max(cnt, 1);
                hg = hf ? h_w : (int)((r - before) / per);
                t = (int)(r - before - (hf ? 0 : (long long)hg * per));
                return true;
            }
            acc += __shfl_sync(0xffffffffu, incl, 31);
        }
        return false;   // not reached: w < W
    }
    // the group's units and its first unit's index in the call
    __device__ __forceinline__ int units() const { return max(cnt, 1); }
    __device__ __forceinline__ long long group_begin() const { return w - t; }
    // the units [t, seg_end) of the current group that the block takes
    __device__ __forceinline__ int seg_end() const {
        return (int)min((long long)units(), t + (end - w));
    }
    // move past the current segment to the next group's first unit
    __device__ __forceinline__ void next(const FattnParams& p) {
        w += seg_end() - t;
        t = 0;
        if (hf) {
            if (++pair == p.ne3 * p.n_q_tiles) pair = 0, ++hg;
            if (w < end) cnt = pair_cnt(p, pair);
        } else if (++hg == groups_of(p)) {
            hg = 0;
            ++pair;
            if (w < end) cnt = pair_cnt(p, pair);
        }
    }
};

// Where the parts of the walk's current group are, for the block that merges them (the last to
// count itself in): cut by the cap, in blocks b0, b0 + 1, ..., each its block's one group (slot
// 2 b). The equal share: part k's block -- with at least as many units as blocks every block has
// some, so the group's are b_first, b_first + 1, ...; with fewer, each has one unit at most --
// and its slot, 2 b + 1 when it is b's last group. (fattn_decode_tma.cu's merge step spells the
// same inline: through this struct its instances' SASS differs by register allocation, and they
// keep the SASS their GPU runs verified until a device run checks the change.)
template <bool ROWS>
struct GroupParts {
    const Walk<ROWS>& wk;
    long long gb;
    int b_first, n_part;
    bool capped, dense;

    __device__ __forceinline__ GroupParts(const Walk<ROWS>& walk) : wk(walk) {
        gb = wk.group_begin();
        const long long ge = gb + wk.units();
        capped = wk.b0 >= 0;
        b_first = capped ? wk.b0 : block_of(gb, wk.W, gridDim.x);
        dense = wk.W >= gridDim.x;
        n_part = capped ? wk.n_part : dense ? block_of(ge - 1, wk.W, gridDim.x) - b_first + 1 : (int)(ge - gb);
    }
    // the slot of part k (k < n_part)
    __device__ __forceinline__ int slot(int k) const {
        if (capped) return 2 * (b_first + k);
        const int b = dense ? b_first + k : block_of(gb + k, wk.W, gridDim.x);
        return 2 * b + (k == 0 && wk.W * b / gridDim.x < gb ? 1 : 0);
    }
};

// The live-list entry (tile id | class bits) of tile j of pair i.
__device__ __forceinline__ int tile_entry(const FattnParams& p, int i, int j) {
    if (!p.live_idx) return j == p.n_kv_tiles - 1 && p.n_kv % BK ? j | FATTN_TILE_PARTIAL : j;
    const int s = i / p.n_q_tiles, qt = i - s * p.n_q_tiles;
    return __ldg(p.live_idx + ((long long)(s % p.ne33) * p.n_q_tiles + qt) * p.n_kv_tiles + j);
}
// ---- a segment's start and a tile's softmax, the same in both kernels. A warp holds a group's
// 16 rows as the m16n8k16 fragments do: lane (g, t4) rows g and g + 8 (rs 0, 1), their columns
// 2 t4, 2 t4 + 1 of each n-tile. row_valid / row_tok / row_head: a fragment row's validity
// (inside the batch and the query tile), token and query head.

// The A fragments of the group's 16 x D rows of Q (stream s), times qs; invalid rows 0. The
// register path (REG) permutes K's dimension as QuantPerm<KT>::k_val does.
template <typename KT, typename T, int D, bool REG, typename Valid, typename Tok, typename Head>
__device__ __forceinline__ void load_q(const FattnParams& p, int s, int g, int t4, float qs, Valid row_valid,
                                       Tok row_tok, Head row_head, unsigned (&Qf)[D / 16][4]) {
    const char* qb = p.q + (long long)s * p.q_nb3;
#pragma unroll
    for (int rs = 0; rs < 2; ++rs) {
        const int r = g + 8 * rs;
        const bool ok = row_valid(r);
        const float* qrow = reinterpret_cast<const float*>(
            qb + (long long)row_head(ok ? r : 0) * p.q_nb2 + (long long)row_tok(ok ? r : 0) * p.q_nb1);
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks)
#pragma unroll
            for (int hi = 0; hi < 2; ++hi) {
                int dim = ks * 16 + 8 * hi + 2 * t4;
                if constexpr (REG) dim = 32 * t4 + QuantPerm<KT>::k_val(ks, 2 * hi);
                const float2 x = ok ? __ldg(reinterpret_cast<const float2*>(qrow + dim)) : make_float2(0.0f, 0.0f);
                Qf[ks][rs + 2 * hi] = KVTraits<T>::pack2(x.x * qs, x.y * qs);
            }
    }
}

// The lane's two rows' mask rows (nullptr: no mask, or an invalid row) and visible intervals
// [lo, hi) (the plan's row_lohi; every cell without one; empty for an invalid row).
template <typename Valid, typename Tok, typename Head>
__device__ __forceinline__ void row_bounds(const FattnParams& p, int s, int g, Valid row_valid, Tok row_tok,
                                           Head row_head, const char* (&mrow)[2], int2 (&lohi)[2]) {
#pragma unroll
    for (int rs = 0; rs < 2; ++rs) {
        const int r = g + 8 * rs;
        const bool ok = row_valid(r);
        mrow[rs] = p.mask && ok ? p.mask + (long long)(s % p.ne33) * p.m_nb3 +
                                  (long long)(row_head(r) % p.ne32) * p.m_nb2 + (long long)row_tok(r) * p.m_nb1
                                : nullptr;
        lohi[rs] = !ok ? make_int2(0, 0)
                 : p.row_lohi ? __ldg(p.row_lohi + ((long long)(s % p.ne33) * p.ne32 +
                                                   (p.ne32 == 1 ? 0 : row_head(r) % p.ne32)) * p.n_batch + row_tok(r))
                              : make_int2(0, p.n_kv);
    }
}

// A segment's start for the group's rows: Q's fragments (load_q), the output accumulators and
// the rows' running maxima and sums reset, the rows' mask rows and intervals (row_bounds).
template <typename KT, typename T, int D, bool REG, typename Valid, typename Tok, typename Head>
__device__ __forceinline__ void begin_segment(const FattnParams& p, int s, int g, int t4, float qs, Valid row_valid,
                                              Tok row_tok, Head row_head, unsigned (&Qf)[D / 16][4],
                                              float (&O)[D / 8][4], float (&m)[2], float (&l)[2],
                                              const char* (&mrow)[2], int2 (&lohi)[2]) {
    load_q<KT, T, D, REG>(p, s, g, t4, qs, row_valid, row_tok, row_head, Qf);
#pragma unroll
    for (int i = 0; i < D / 8; ++i) O[i][0] = O[i][1] = O[i][2] = O[i][3] = 0.0f;
    m[0] = m[1] = FATTN_NEG_INF;
    l[0] = l[1] = 0.0f;
    row_bounds(p, s, g, row_valid, row_tok, row_head, mrow, lohi);
}

// Mask the scores S of NC cells from c0 (the lane's first: c0 + 8 nt, + 1) of a tile whose
// live-list entry is e, when it is PARTIAL: mask values (MASKED; -inf selected unless FINITE) or
// the rows' intervals; cells past n_kv and invalid rows give -inf.
template <int NC>
__device__ __forceinline__ void mask_partial(const FattnParams& p, int e, int c0, const char* const (&mrow)[2],
                                             const int2 (&lohi)[2], float (&S)[NC / 8][4]) {
    if (!(e & FATTN_TILE_PARTIAL)) return;
    const bool sel = !(e & FATTN_TILE_FINITE);
#pragma unroll
    for (int rs = 0; rs < 2; ++rs)
#pragma unroll
        for (int nt = 0; nt < NC / 8; ++nt) {
            const int c = c0 + 8 * nt;
            float& s0 = S[nt][2 * rs];
            float& s1 = S[nt][2 * rs + 1];
            if ((e & FATTN_TILE_MASKED) && mrow[rs]) {
                if (c + 1 < p.n_kv) {
                    add_mask_pair(s0, s1, __ldg(reinterpret_cast<const __half2*>(mrow[rs]) + (c >> 1)), FATTN_LOG2E, sel);
                } else {
                    if (c < p.n_kv) add_mask_pair(s0, s1, __halves2half2(__ldg(reinterpret_cast<const __half*>(mrow[rs]) + c),
                                                                         __float2half(0.0f)), FATTN_LOG2E, sel);
                    else s0 = FATTN_NEG_INF;
                    s1 = FATTN_NEG_INF;
                }
            } else {
                const int2 lh = (e & FATTN_TILE_MASKED) ? make_int2(0, 0) : lohi[rs];
                if (c < lh.x || c >= lh.y || c >= p.n_kv) s0 = FATTN_NEG_INF;
                if (c + 1 < lh.x || c + 1 >= lh.y || c + 1 >= p.n_kv) s1 = FATTN_NEG_INF;
            }
        }
}

// The A fragment of P (the probabilities S of NC cells, rows g and g + 8) for P V's k16 step kk:
// cells 16 kk .. 16 kk + 15 as type T pairs.
template <typename T, int NC>
__device__ __forceinline__ void p_frag(const float (&S)[NC / 8][4], int kk, unsigned (&a)[4]) {
    a[0] = KVTraits<T>::pack2(S[2 * kk][0], S[2 * kk][1]);
    a[1] = KVTraits<T>::pack2(S[2 * kk][2], S[2 * kk][3]);
    a[2] = KVTraits<T>::pack2(S[2 * kk + 1][0], S[2 * kk + 1][1]);
    a[3] = KVTraits<T>::pack2(S[2 * kk + 1][2], S[2 * kk + 1][3]);
}

// The online softmax over a tile's NC scores (log2 domain): the rows' maxima m and sums l move,
// O is rescaled (skipped when no row's maximum moved), S becomes the probabilities.
template <int NC, int D>
__device__ __forceinline__ void online_softmax(float (&S)[NC / 8][4], float (&m)[2], float (&l)[2], float (&O)[D / 8][4]) {
#pragma unroll
    for (int rs = 0; rs < 2; ++rs) {
        float mx = FATTN_NEG_INF;
#pragma unroll
        for (int nt = 0; nt < NC / 8; ++nt) mx = fmaxf(mx, fmaxf(S[nt][2 * rs], S[nt][2 * rs + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m[rs], mx);
        const float m_use = m_new == FATTN_NEG_INF ? 0.0f : m_new;
        if (__any_sync(0xffffffffu, m_new != m[rs])) {   // skip the rescale when no max moved
            const float alpha = fast_exp2(m[rs] - m_use);   // m == -inf -> 0
            l[rs] *= alpha;
#pragma unroll
            for (int i = 0; i < D / 8; ++i) { O[i][2 * rs] *= alpha; O[i][2 * rs + 1] *= alpha; }
        }
        m[rs] = m_new;
#pragma unroll
        for (int nt = 0; nt < NC / 8; ++nt) {
            S[nt][2 * rs] = fast_exp2(S[nt][2 * rs] - m_use);
            S[nt][2 * rs + 1] = fast_exp2(S[nt][2 * rs + 1] - m_use);
            l[rs] += S[nt][2 * rs] + S[nt][2 * rs + 1];
        }
    }
}
}  // namespace dtma


// Merge the n_part partial states (slot part_slot(k), k < n_part: ROWS x D outputs and each row's
// (max, sum)) of row r into out (nullptr: an invalid row -- nothing read, nothing written: at
// B=1 12 of 16 rows). The 8 threads of a
// row (j = 0..7, consecutive lanes) take parts j, j + 8, ... for the row's max and sum (an online
// merge), then columns [j D / 8, (j + 1) D / 8) of the output, 4 parts' loads in flight at a time:
// the merge is on the kernel's critical path, and a serial walk was one L2 round trip per part.
template <int D, typename SlotOf>
__device__ __forceinline__ void merge_parts(const FattnParams& p, int r, int j, int n_part, SlotOf part_slot,
                                            float* out, int h) {
    constexpr int ROWS = dtma::ROWS, CW = D / 8, U = 4;
    if (out == nullptr) return;   // an invalid row: its 8 threads leave together (no loads)
    const unsigned row_lanes = 0xFFu << (threadIdx.x & 24);   // the row's 8 lanes of the warp
    float M = FATTN_NEG_INF, L = 0.0f;
    for (int k0 = j; k0 < n_part; k0 += 8 * 4) {
        float mz[4], lz[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int k = k0 + 8 * u;
            const long long z = (long long)part_slot(k < n_part ? k : 0) * ROWS + r;
            mz[u] = k < n_part ? __ldcg(p.ws_ml + z * 2) : FATTN_NEG_INF;
            lz[u] = k < n_part ? __ldcg(p.ws_ml + z * 2 + 1) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            if (mz[u] == FATTN_NEG_INF) continue;   // a part with no visible cell adds nothing
            const float Mn = fmaxf(M, mz[u]);
            L = L * fast_exp2(M - Mn) + lz[u] * fast_exp2(mz[u] - Mn);   // M == -inf: L is 0
            M = Mn;
        }
    }
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) {   // the row's 8 threads
        const float M2 = __shfl_xor_sync(row_lanes, M, o), L2 = __shfl_xor_sync(row_lanes, L, o);
        const float Mn = fmaxf(M, M2);
        if (Mn != FATTN_NEG_INF) L = L * fast_exp2(M - Mn) + L2 * fast_exp2(M2 - Mn);
        M = Mn;
    }
    float acc[CW];
#pragma unroll
    for (int c = 0; c < CW; ++c) acc[c] = 0.0f;
    const int cb = j * CW;
    for (int k0 = 0; k0 < n_part; k0 += U) {
        float mz[U];
        float4 o[U][CW / 4];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int k = k0 + u;
            const long long z = (long long)part_slot(k < n_part ? k : 0) * ROWS + r;
            mz[u] = k < n_part ? __ldcg(p.ws_ml + z * 2) : FATTN_NEG_INF;
#pragma unroll
            for (int c = 0; c < CW / 4; ++c)
                o[u][c] = __ldcg(reinterpret_cast<const float4*>(p.ws_o + z * D + cb) + c);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (mz[u] == FATTN_NEG_INF) continue;
            const float f = fast_exp2(mz[u] - M);
#pragma unroll
            for (int c = 0; c < CW / 4; ++c) {
                acc[4 * c] = fmaf(f, o[u][c].x, acc[4 * c]);
                acc[4 * c + 1] = fmaf(f, o[u][c].y, acc[4 * c + 1]);
                acc[4 * c + 2] = fmaf(f, o[u][c].z, acc[4 * c + 2]);
                acc[4 * c + 3] = fmaf(f, o[u][c].w, acc[4 * c + 3]);
            }
        }
    }
    const float fac = row_finish_factor(p, h, M, L);
#pragma unroll
    for (int c = 0; c < CW; c += 4)
        *reinterpret_cast<float4*>(out + cb + c) = make_float4(acc[c] * fac, acc[c + 1] * fac, acc[c + 2] * fac, acc[c + 3] * fac);
}
