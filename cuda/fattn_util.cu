// Small kernels around the attention kernels: the mask pre-pass (row intervals, tile classes,
// compaction into live-tile lists) and the split-KV combine pass. See fattn_common.cuh for the parameter block and layouts.
#include "fattn_common.cuh"
#include "q8x_quant.cuh"   // fattn_quant_q8x

// Pass 0: the visible interval of each mask row. lohi[(i33*ne32 + i32)*n_batch + t] = (lo, hi)
// when the cells of row t of plane (i32, i33) that are not -inf are exactly [lo, hi) and all
// +-0 (causal, block-diagonal, sliding window, padding); (0, 0) for a fully masked row;
// (-1, -1) otherwise (ALiBi distances, random values, holes, NaN or +inf cells).
// Grid (n_batch, ne32, ne33); block 128 threads.
extern "C" __global__ void fattn_mask_rows(const FattnParams p, int2* __restrict__ lohi) {
    __shared__ int red[3][4];
    const int t = blockIdx.x, i32 = blockIdx.y, i33 = blockIdx.z;
    const unsigned short* row = reinterpret_cast<const unsigned short*>(
        p.mask + (long long)t * p.m_nb1 + (long long)i32 * p.m_nb2 + (long long)i33 * p.m_nb3);
    int lo = 0x7fffffff, hi = -1, nfin = 0, bad = 0;
    auto cell = [&](int c, unsigned short b) {
        if (!f16_bits_is_neg_inf(b)) {
            lo = min(lo, c); hi = max(hi, c); ++nfin;
            bad |= !f16_bits_is_zero(b);
        }
    };
    if (((reinterpret_cast<size_t>(row)) & 15) == 0) {
        const int n8 = p.n_kv / 8;
        for (int i = threadIdx.x; i < n8; i += blockDim.x) {
            const uint4 u = __ldg(reinterpret_cast<const uint4*>(row) + i);
            const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                cell(8 * i + 2 * j, (unsigned short)(w[j] & 0xffffu));
                cell(8 * i + 2 * j + 1, (unsigned short)(w[j] >> 16));
            }
        }
        for (int c = 8 * n8 + threadIdx.x; c < p.n_kv; c += blockDim.x) cell(c, __ldg(row + c));
    } else {
        for (int c = threadIdx.x; c < p.n_kv; c += blockDim.x) cell(c, __ldg(row + c));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, o));
        hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, o));
        nfin += __shfl_xor_sync(0xffffffffu, nfin, o);
        bad |= __shfl_xor_sync(0xffffffffu, bad, o);
    }
    const int warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    bad = __syncthreads_or(bad);
    if ((threadIdx.x & 31) == 0) { red[0][warp] = lo; red[1][warp] = hi; red[2][warp] = nfin; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < nw; ++w) {
            lo = min(lo, red[0][w]); hi = max(hi, red[1][w]); nfin += red[2][w];
        }
        int2 r;
        if (nfin == 0) r = make_int2(0, 0);
        else if (bad || nfin != hi - lo + 1) r = make_int2(-1, -1);
        else r = make_int2(lo, hi + 1);
        lohi[((long long)i33 * p.ne32 + i32) * p.n_batch + t] = r;
    }
}

// The 64-bit set of columns [c0, c0 + 64) inside the row interval [lo, hi).
__device__ __forceinline__ unsigned long long interval_bits(int lo, int hi, int c0) {
    const int a = min(max(lo - c0, 0), FATTN_KV_TILE), b = min(max(hi - c0, 0), FATTN_KV_TILE);
    if (b <= a) return 0ull;
    const unsigned long long below_b = b >= 64 ? ~0ull : (1ull << b) - 1ull;
    return below_b & ~((1ull << a) - 1ull);
}

// Pass 1: the class of each (stream plane i33, query tile qt, KV tile kt), over the tokens of
// qt and every head plane i32 < ne32: flags[(i33*n_q_tiles + qt)*n_kv_tiles + kt] =
//   0 dead (every cell -inf), 1 FULL (every cell +-0, the tile ends before n_kv),
//   3 PARTIAL (rows are intervals: lohi), 7 PARTIAL|MASKED (some row of qt is not),
//   | 8 HIDDEN (PARTIAL only): some column < n_kv of the tile is -inf for every token of qt in
//   some head plane, | 16 FINITE (MASKED only, and only when mark_finite != 0): every cell < n_kv
//   of the tile, for every token of qt in every head plane, is finite and of magnitude below
//   256 (f16_bits_below_finite_max; a bias mask: no -inf select, and small enough to start
//   the MMA accumulators from, fattn_mma.cu's natural-unit scores). Then, for each plane i32,
//   hidden[((i33*n_q_tiles + qt)*n_kv_tiles + kt)*ne32 + i32] = the columns of the tile that
//   are -inf for every token of qt in plane i32 (bit c: column kt*64 + c; columns >= n_kv set
//   too); written for every PARTIAL tile. A kernel block covers the tokens of qt and the heads of some planes: the AND of their words is the set of
//   cells no row of the block sees (fattn_mask_compact moves the words into list order).
// Grid (n_kv_tiles, n_q_tiles, ne33); any block size (multiple of 32). Needs pass 0's lohi.
// FINITE needs the hidden words' pass (hidden != nullptr), which reads every row of the tile.
extern "C" __global__ void fattn_mask_scan(const FattnParams p, unsigned char* __restrict__ flags,
                                           const int2* __restrict__ lohi,
                                           unsigned long long* __restrict__ hidden,
                                           const int mark_finite) {
    __shared__ unsigned long long s_vis;
    const int kt = blockIdx.x, qt = blockIdx.y, i33 = blockIdx.z;
    const int t0 = qt * p.q_tile_tokens;
    const int nrows = min(p.q_tile_tokens, p.n_batch - t0);
    const int c0 = kt * FATTN_KV_TILE;
    const int ncols = min(FATTN_KV_TILE, p.n_kv - c0);
    const char* base = p.mask + (long long)i33 * p.m_nb3 + (long long)t0 * p.m_nb1 + (long long)c0 * 2;
    const bool vec = ncols == FATTN_KV_TILE && ((reinterpret_cast<size_t>(base) | (size_t)p.m_nb1 | (size_t)p.m_nb2) & 15) == 0;
    int live = 0, nonzero = ncols < FATTN_KV_TILE;
    if (vec) {
        const int items = nrows * p.ne32 * (FATTN_KV_TILE / 8);
        for (int i = threadIdx.x; i < items && !(live && nonzero); i += blockDim.x) {
            const int chunk = i & 7, rp = i >> 3;
            const int r = rp % nrows, pl = rp / nrows;
            const uint4 u = __ldg(reinterpret_cast<const uint4*>(base + (long long)r * p.m_nb1 + (long long)pl * p.m_nb2) + chunk);
            const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const unsigned short b0 = (unsigned short)(w[j] & 0xffffu), b1 = (unsigned short)(w[j] >> 16);
                live |= !f16_bits_is_neg_inf(b0) | !f16_bits_is_neg_inf(b1);
                nonzero |= !f16_bits_is_zero(b0) | !f16_bits_is_zero(b1);
            }
        }
    } else {
        const int items = nrows * p.ne32 * ncols;
        for (int i = threadIdx.x; i < items && !(live && nonzero); i += blockDim.x) {
            const int c = i % ncols, rp = i / ncols;
            const int r = rp % nrows, pl = rp / nrows;
            const unsigned short b = __ldg(reinterpret_cast<const unsigned short*>(
                base + (long long)r * p.m_nb1 + (long long)pl * p.m_nb2) + c);
            live |= !f16_bits_is_neg_inf(b);
            nonzero |= !f16_bits_is_zero(b);
        }
    }
    live = __syncthreads_or(live);
    nonzero = __syncthreads_or(nonzero);
    int masked = 0;
    if (live && nonzero) {
        for (int i = threadIdx.x; i < nrows * p.ne32; i += blockDim.x) {
            const int r = i % nrows, pl = i / nrows;
            masked |= __ldg(lohi + ((long long)i33 * p.ne32 + pl) * p.n_batch + t0 + r).x < 0;
        }
    }
    masked = __syncthreads_or(masked);
    const long long tile = ((long long)i33 * p.n_q_tiles + qt) * p.n_kv_tiles + kt;
    int any_hidden = 0, not_finite = 0;
    if (live && nonzero && hidden) {
        // columns seen by some token of qt, per head plane: a row that is an interval from
        // its lohi, any other row from its mask cells (visible: not -inf, NaN included)
        const unsigned long long valid = ncols >= 64 ? ~0ull : (1ull << ncols) - 1ull;
        for (int pl = 0; pl < p.ne32; ++pl) {
            if (threadIdx.x == 0) s_vis = 0ull;
            __syncthreads();
            unsigned long long vis = 0ull;
            for (int i = threadIdx.x; i < nrows * 8; i += blockDim.x) {
                const int r = i >> 3, ch = i & 7;
                const int2 lh = __ldg(lohi + ((long long)i33 * p.ne32 + pl) * p.n_batch + t0 + r);
                const unsigned long long chunk = valid & (0xFFull << (8 * ch));   // columns < n_kv
                if (lh.x >= 0) {
                    const unsigned long long iv = interval_bits(lh.x, lh.y, c0) & chunk;
                    vis |= iv;
                    not_finite |= iv != chunk;   // a -inf cell in the chunk (the rest are zeros)
                } else {
                    const unsigned short* row = reinterpret_cast<const unsigned short*>(
                        base + (long long)r * p.m_nb1 + (long long)pl * p.m_nb2);
                    unsigned bits = 0;
                    int big = 0;   // a cell of magnitude >= 256 (-inf, +inf, NaN too)
                    if (vec) {
                        const uint4 u = __ldg(reinterpret_cast<const uint4*>(row) + ch);
                        const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
                        for (int j = 0; j < 4; ++j) {
                            const unsigned short b0 = (unsigned short)(w[j] & 0xffffu), b1 = (unsigned short)(w[j] >> 16);
                            bits |= (unsigned)!f16_bits_is_neg_inf(b0) << (2 * j);
                            bits |= (unsigned)!f16_bits_is_neg_inf(b1) << (2 * j + 1);
                            big |= !f16_bits_below_finite_max(b0) | !f16_bits_below_finite_max(b1);
                        }
                    } else {
                        for (int c = 8 * ch; c < min(8 * ch + 8, ncols); ++c) {
                            const unsigned short b = __ldg(row + c);
                            bits |= (unsigned)!f16_bits_is_neg_inf(b) << (c - 8 * ch);
                            big |= !f16_bits_below_finite_max(b);
                        }
                    }
                    vis |= (unsigned long long)bits << (8 * ch);
                    not_finite |= big;
                }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) vis |= __shfl_xor_sync(0xffffffffu, vis, o);
            if ((threadIdx.x & 31) == 0 && vis) atomicOr(&s_vis, vis);
            __syncthreads();
            const unsigned long long hid = ~(s_vis & valid);
            any_hidden |= (hid & valid) != 0ull;
            if (threadIdx.x == 0) hidden[tile * p.ne32 + pl] = hid;
            __syncthreads();   // s_vis read by every thread before the next plane resets it
        }
        not_finite = __syncthreads_or(not_finite);
    } else {
        not_finite = 1;
    }
    const bool finite = mark_finite && masked && !not_finite;
    if (threadIdx.x == 0)
        flags[tile] = (unsigned char)((!live ? 0 : !nonzero ? 1 : !masked ? 3 : 7) | (any_hidden ? 8 : 0) |
                                      (finite ? 16 : 0));
}

// Pass 2: compact the flags of each (i33, qt) into the ordered list of live-tile entries
// (tile id | FATTN_TILE_PARTIAL | FATTN_TILE_MASKED | FATTN_TILE_HIDDEN | FATTN_TILE_FINITE), and
// the hidden-column words of pass 1 into the same order (live_hidden, fattn_common.cuh: 0 unless HIDDEN).
// idx holds fattn_live_words(...) ints (the entries, then the words). Grid (n_q_tiles, ne33),
// one warp per block.
extern "C" __global__ void fattn_mask_compact(const FattnParams p, const unsigned char* __restrict__ flags,
                                              int* __restrict__ idx, int* __restrict__ cnt,
                                              const unsigned long long* __restrict__ hidden) {
    const int qt = blockIdx.x, i33 = blockIdx.y, lane = threadIdx.x;
    const long long slot = (long long)i33 * p.n_q_tiles + qt;
    const unsigned char* f = flags + slot * p.n_kv_tiles;
    int* out = idx + slot * p.n_kv_tiles;
    unsigned long long* hout = live_hidden(idx, p) + slot * p.n_kv_tiles * p.ne32;
    const unsigned long long* hin = hidden + slot * p.n_kv_tiles * p.ne32;
    int n = 0;
    for (int base = 0; base < p.n_kv_tiles; base += 32) {
        const int kt = base + lane;
        const int fl = kt < p.n_kv_tiles ? f[kt] : 0;
        const bool live = fl != 0;
        const unsigned b = __ballot_sync(0xffffffffu, live);
        if (live) {
            const int pos = n + __popc(b & ((1u << lane) - 1u));
            out[pos] = kt | (fl & 2 ? FATTN_TILE_PARTIAL : 0) | (fl & 4 ? FATTN_TILE_MASKED : 0) |
                       (fl & 8 ? FATTN_TILE_HIDDEN : 0) | (fl & 16 ? FATTN_TILE_FINITE : 0);
            for (int pl = 0; pl < p.ne32; ++pl)
                hout[(long long)pos * p.ne32 + pl] = fl & 8 ? hin[(long long)kt * p.ne32 + pl] : 0ull;
        }
        n += __popc(b);
    }
    if (lane == 0) cnt[slot] = n;
}

// Split-KV combine: one block per output row r = (s*n_batch + t)*n_head + h (grid.x), any
// block size that is a multiple of 32 (<= 1024). n_splits <= FATTN_MAX_SPLITS.
// ws_ml[(z*n_rows + r)*2 + {0,1}] = (max in log2 domain, sum); ws_o[(z*n_rows + r)*head_dim_v + c].
#define FATTN_MAX_SPLITS 256
extern "C" __global__ void fattn_combine(const FattnParams p) {
    __shared__ float w[FATTN_MAX_SPLITS];
    __shared__ float red[32];
    const long long r = blockIdx.x;
    const long long n_rows = (long long)p.ne3 * p.n_batch * p.n_head;
    const int h = (int)(r % p.n_head);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    // 1. global max over splits (and the sink)
    float mx = FATTN_NEG_INF;
    for (int z = tid; z < p.n_splits; z += blockDim.x) {
        const float m = p.ws_ml[(z * n_rows + r) * 2];
        w[z] = m;
        mx = fmaxf(mx, m);
    }
    mx = warp_max(mx);
    if (lane == 0) red[warp] = mx;
    __syncthreads();
    float M = FATTN_NEG_INF;
    for (int i = 0; i < nw; ++i) M = fmaxf(M, red[i]);
    const float sk = p.sinks ? __ldg(p.sinks + h) * FATTN_LOG2E : FATTN_NEG_INF;
    M = fmaxf(M, sk);
    __syncthreads();
    // 2. per-split factors and the total sum
    float sum = 0.0f;
    for (int z = tid; z < p.n_splits; z += blockDim.x) {
        const float m = w[z];
        const float f = (m == FATTN_NEG_INF) ? 0.0f : fast_exp2(m - M);
        w[z] = f;
        sum += f * p.ws_ml[(z * n_rows + r) * 2 + 1];
    }
    sum = warp_sum(sum);
    if (lane == 0) red[warp] = sum;
    __syncthreads();
    float L = 0.0f;
    for (int i = 0; i < nw; ++i) L += red[i];
    if (M != FATTN_NEG_INF && p.sinks) L += fast_exp2(sk - M);
    const float inv = inv_row_sum(L);   // NaN stays NaN (see fattn_common.cuh)
    // 3. weighted sum of the partial outputs, columns across threads; the loads of one column's
    //    splits are issued FATTN_SPLIT_BATCH at a time, then summed in split order. A split
    //    with weight 0 (every cell of it masked) adds 0: its partial output may be stale.
    const long long zs = n_rows * p.head_dim_v;
    for (int c = tid; c < p.head_dim_v; c += blockDim.x) {
        float acc = 0.0f;
        if (inv != 0.0f) {
            const float* o = p.ws_o + r * p.head_dim_v + c;
            int z = 0;
            for (; z + FATTN_SPLIT_BATCH <= p.n_splits; z += FATTN_SPLIT_BATCH) {
                float v[FATTN_SPLIT_BATCH];
#pragma unroll
                for (int j = 0; j < FATTN_SPLIT_BATCH; ++j) v[j] = __ldcg(o + (z + j) * zs);
#pragma unroll
                for (int j = 0; j < FATTN_SPLIT_BATCH; ++j) {
                    const float f = w[z + j];
                    acc = f != 0.0f ? fmaf(v[j], f, acc) : acc;   // as the remainder loop rounds
                }
            }
            for (; z < p.n_splits; ++z) {
                const float f = w[z];
                if (f != 0.0f) acc = fmaf(__ldcg(o + z * zs), f, acc);
            }
        }
        p.dst[r * p.head_dim_v + c] = acc * inv;
    }
}

// Cell lists for the cell-list decode kernel (fattn_cells.cu): for each mask row (stream plane
// i33, head plane i32, token t), the cells whose mask value is not -inf, in ascending order, as
// int2 (cell, __float_as_int(mask value)) at cells[slot * n_kv ...] (capacity n_kv per row, so
// that a refresh never needs more room: no host synchronization, CUDA-graph replays stay valid),
// and their number at cnt[slot], slot = (i33*ne32 + i32)*n_batch + t. NaN and +inf cells are
// listed (visible, as everywhere else). Each thread takes 8 consecutive cells per pass (one
// 16-byte load when the row is aligned), a block-wide exclusive scan of the per-thread counts
// places them. ggml_attn/cuda_plan.py's cell_lists_host mirrors this on the host.
// Grid (n_batch, ne32, ne33); block FATTN_CELL_THREADS threads.
#define FATTN_CELL_THREADS 256
extern "C" __global__ void __launch_bounds__(FATTN_CELL_THREADS)
fattn_cell_lists(const FattnParams p, int2* __restrict__ cells, int* __restrict__ cnt) {
    constexpr int NW = FATTN_CELL_THREADS / 32;
    __shared__ int warp_sum_s[NW];
    const int t = blockIdx.x, i32 = blockIdx.y, i33 = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long slot = ((long long)i33 * p.ne32 + i32) * p.n_batch + t;
    const unsigned short* row = reinterpret_cast<const unsigned short*>(
        p.mask + (long long)t * p.m_nb1 + (long long)i32 * p.m_nb2 + (long long)i33 * p.m_nb3);
    int2* out = cells + slot * p.n_kv;
    const bool vec = (reinterpret_cast<size_t>(row) & 15) == 0;
    int base = 0;
    for (int c0 = 0; c0 < p.n_kv; c0 += 8 * FATTN_CELL_THREADS) {
        // ---- 1. this thread's 8 cells: which are visible
        const int c = c0 + 8 * threadIdx.x;
        unsigned short b[8];
        if (vec && c + 8 <= p.n_kv) {
            const uint4 u = __ldg(reinterpret_cast<const uint4*>(row + c));
            const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) { b[2 * j] = (unsigned short)(w[j] & 0xffffu); b[2 * j + 1] = (unsigned short)(w[j] >> 16); }
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) b[e] = c + e < p.n_kv ? __ldg(row + c + e) : (unsigned short)0xFC00u;
        }
        unsigned bits = 0;
#pragma unroll
        for (int e = 0; e < 8; ++e) bits |= (unsigned)!f16_bits_is_neg_inf(b[e]) << e;
        const int n = __popc(bits);
        // ---- 2. block-wide exclusive scan of the counts
        int incl = n;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int x = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += x;
        }
        if (lane == 31) warp_sum_s[warp] = incl;
        __syncthreads();
        int before = 0, total = 0;
#pragma unroll
        for (int w2 = 0; w2 < NW; ++w2) {
            const int x = warp_sum_s[w2];
            before += w2 < warp ? x : 0;
            total += x;
        }
        // ---- 3. write the entries in cell order
        int pos = base + before + incl - n;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            if (bits & (1u << e)) {
                __half hv = __ushort_as_half(b[e]);
                out[pos++] = make_int2(c + e, __float_as_int(__half2float(hv)));
            }
        }
        base += total;
        __syncthreads();   // warp_sum_s read by every thread before the next pass writes it
    }
    if (threadIdx.x == 0) cnt[slot] = base;
}

// ggml's q8_0 / q4_0 K or V rows -> f16, contiguous [D, n_kv, n_head, ne3] (ggml order): the
// tensor-core kernels read quantized K/V through this copy, made once per call (as llama.cpp's
// tensor-core kernels convert quantized K/V to f16 first). One thread per 8 values (one 16-byte
// chunk of the copy), grid-stride; values d * q rounded once to f16.
struct DequantKVParams {
    const char* src;          // the view's first row; rows (cells) at nb1, heads at nb2, streams at nb3
    __half* dst;
    long long nb1, nb2, nb3;
    int d, n_kv, n_head, ne3;
    int type;                 // ggml type id: 8 q8_0, 2 q4_0
    int pad_;
};
extern "C" __global__ void __launch_bounds__(256) fattn_dequant_kv(const DequantKVParams p) {
    const int cpr = p.d / 8;   // chunks per row
    const long long n = (long long)cpr * p.n_kv * p.n_head * p.ne3;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const int ch = (int)(i % cpr);
        long long r = i / cpr;
        const int c = (int)(r % p.n_kv);
        r /= p.n_kv;
        const int h = (int)(r % p.n_head), s = (int)(r / p.n_head);
        const char* row = p.src + c * p.nb1 + h * p.nb2 + s * p.nb3;
        float f[8];
        if (p.type == 8) load8_quant<fattn_q8_0>(row, ch, true, f);
        else load8_quant<fattn_q4_0>(row, ch, true, f);
        uint4 o;
        o.x = KVTraits<__half>::pack2(f[0], f[1]);
        o.y = KVTraits<__half>::pack2(f[2], f[3]);
        o.z = KVTraits<__half>::pack2(f[4], f[5]);
        o.w = KVTraits<__half>::pack2(f[6], f[7]);
        reinterpret_cast<uint4*>(p.dst)[i] = o;
    }
}

// The attention's output (n values F32 from x, n a multiple of 32) in the 8-bit form the 8-bit
// GEMVs read (q8x_quant.cuh: int8 q, F32 scales d and sums s per 32 values), where its kernel did
// not make it (ggml_attn/q8_out.py: every kernel but fattn_cells' QO instances over one split).
// Grid (n / 256 rounded up), 256 threads: a warp a 32-value group.
extern "C" __global__ void __launch_bounds__(256) fattn_quant_q8x(const float* __restrict__ x, long long n,
                                                                 signed char* __restrict__ q,
                                                                 float* __restrict__ d, float* __restrict__ s) {
    const long long g = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
    if (32 * g >= n) return;   // (whole warps: n is a multiple of 32)
    q8x_quant32(x[32 * g + (threadIdx.x & 31)], q + 32 * g, d + g, s + g);
}
