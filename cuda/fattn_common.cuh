// Shared device code of the ggml-attn flash-attention kernels.
//
// Compiled at run time by NVRTC (ggml_attn/kernels.py). Everything here is header-only:
// the parameter block every kernel takes, type conversions (the mma.sync / ldmatrix / cp.async
// wrappers: mma_ptx.cuh), the ALiBi slope, the live-tile iteration, and the split-KV partial layout.
//
// Tensor layouts are ggml's (ne[0] fastest; byte strides nb[1..3]):
//   q    [head_dim_k, n_batch, n_head,    ne3]  f32, any byte strides (nb0 == 4)
//   k    [head_dim_k, n_kv,    n_head_kv, ne3]  f16/bf16, rows contiguous, 16-byte aligned rows
//                                        (the CUDA-core decode kernel also reads q8_0 / q4_0
//                                        rows: ggml's blocks of 32, 2-byte aligned; load8_quant)
//   v    [head_dim_v, n_kv,    n_head_kv, ne3]  same type as k
//   mask [n_kv, n_rows, ne32,      ne33] f16, broadcast over heads (h % ne32), streams (s % ne33)
//   sinks[n_head] f32
//   dst  [head_dim_v, n_head,  n_batch,   ne3]  f32 contiguous
// A "row" of the attention problem is one (stream s, token t, head h); its index in dst
// order is  r = (s*n_batch + t)*n_head + h  and dst + r*head_dim_v is its output row.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "mma_ptx.cuh"   // smem_u32, cp.async, ldmatrix, Mma<T>

#define FATTN_KV_TILE 64          // KV columns per tile; the liveness plan uses the same size
#define FATTN_NEG_INF (-__int_as_float(0x7f800000))
#define FATTN_LOG2E 1.4426950408889634f
// split merges (fattn_combine, split_finish): the splits' partial outputs a thread loads back to
// back before it sums them in split order (one L2 round trip per batch, not per split)
#define FATTN_SPLIT_BATCH 8
#define FATTN_FINISH_BATCH 4   // split_finish: x EPT values per thread (registers of the attention kernel)

// Kernel parameters, passed by value as one struct (mirrored by ctypes in kernels.py:
// keep the order, types and padding in sync with _FattnParams there).
struct FattnParams {
    const char* q;
    const char* k;
    const char* v;
    const char* mask;          // nullptr: no mask
    const float* sinks;        // nullptr: no sinks
    float* dst;
    float* ws_o;               // split partials [n_splits][n_rows_total][head_dim_v] (unnormalized)
    float* ws_ml;              // split partials [n_splits][n_rows_total][2] (max (log2 domain), sum)
    const int* live_idx;       // [ne33][n_q_tiles][n_kv_tiles] live-tile entries (below), followed in
                               // the same buffer by their hidden-column words (live_hidden); nullptr: all live
    const int* live_cnt;       // [ne33][n_q_tiles]
    const int2* row_lohi;      // [ne33][ne32][n_batch] visible cells [lo, hi) of each mask row, or
                               // (-1, -1) when the row is not one interval of zeros; nullptr: [0, n_kv)
    long long q_nb1, q_nb2, q_nb3;
    long long k_nb1, k_nb2, k_nb3;
    long long v_nb1, v_nb2, v_nb3;
    long long m_nb1, m_nb2, m_nb3;
    int n_batch, n_kv, n_head, n_head_kv;
    int ne3, ne32, ne33, gqa;
    int pack;                  // query heads packed into one tile (divides gqa)
    int q_tile_tokens;         // tokens per query tile (plan granularity)
    int n_q_tiles, n_kv_tiles;
    int n_splits, n_head_log2;
    float scale;               // already divided by softcap when softcap != 0
    float softcap;             // 0: off
    float m0, m1;              // ALiBi bases; max_bias == 0 -> slope 1
    int use_alibi;
    int head_dim_v;                   // V head size (combine pass)
    int* split_cnt;            // n_splits > 1: one zeroed counter per row group (split_finish);
                               // nullptr: fattn_combine finishes in a launch of its own
    const int2* cells;         // cell lists (fattn_cell_lists, fattn_cells.cu): [ne33][ne32][n_batch]
                               // lists of capacity n_kv, entries (cell, float bits of its mask value)
                               // in ascending cell order; nullptr: every cell [0, n_kv), value 0
    const int* cell_cnt;       // [ne33][ne32][n_batch] entries per list
    int work_cap;              // decode-tma: the most units a block takes when groups are cut on their
                               // boundaries (cuda/fattn_decode_tma.cu Walk::start); 0: equal shares
    int pad_;
};

// ---------------------------------------------------------------------------------------
// type traits for the K/V element type
template <typename T> struct KVTraits;
template <> struct KVTraits<__half> {
    static __device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
    static __device__ __forceinline__ __half from_f(float x) { return __float2half_rn(x); }
    static __device__ __forceinline__ unsigned pack2(float a, float b) {
        __half2 h = __floats2half2_rn(a, b);
        return *reinterpret_cast<unsigned*>(&h);
    }
    static __device__ __forceinline__ float2 unpack2(unsigned u) {
        __half2 h = *reinterpret_cast<__half2*>(&u);
        return __half22float2(h);
    }
};
template <> struct KVTraits<__nv_bfloat16> {
    static __device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
    static __device__ __forceinline__ __nv_bfloat16 from_f(float x) { return __float2bfloat16_rn(x); }
    static __device__ __forceinline__ unsigned pack2(float a, float b) {
        __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
        return *reinterpret_cast<unsigned*>(&h);
    }
    static __device__ __forceinline__ float2 unpack2(unsigned u) {
        __nv_bfloat162 h = *reinterpret_cast<__nv_bfloat162*>(&u);
        return __bfloat1622float2(h);
    }
};

// 8 consecutive K/V elements (one 16-byte chunk) -> 8 floats
template <typename T>
__device__ __forceinline__ void unpack8(const uint4 u, float* f) {
    float2 a = KVTraits<T>::unpack2(u.x), b = KVTraits<T>::unpack2(u.y);
    float2 c = KVTraits<T>::unpack2(u.z), d = KVTraits<T>::unpack2(u.w);
    f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y; f[4] = c.x; f[5] = c.y; f[6] = d.x; f[7] = d.y;
}

// ggml's quantized K/V blocks, as tags for the kernels' element-type parameter: 32 values per
// block, an f16 scale d first. q8_0: 32 int8 qs, value = d * qs[j] (34 bytes). q4_0: 16 bytes of
// nibbles, value j < 16 = d * ((qs[j] & 15) - 8), value j >= 16 = d * ((qs[j - 16] >> 4) - 8)
// (18 bytes). A row of D values is D / 32 blocks back to back; rows start anywhere 2-byte aligned.
struct fattn_q8_0 { static constexpr int BYTES = 34; };
struct fattn_q4_0 { static constexpr int BYTES = 18; };

// Quantized K/V rows: 8 consecutive values -- chunk ch (values 8*ch .. 8*ch+7) of the row at
// ``row`` -- as floats, zeros when !ok (nothing read): the block's scale and 8 bytes of its quants
// (2-byte loads: blocks are 2-byte aligned). f16/bf16 rows are one 16-byte load and unpack8.
template <typename T> struct KVQuant { static constexpr bool value = false; };
template <> struct KVQuant<fattn_q8_0> { static constexpr bool value = true; };
template <> struct KVQuant<fattn_q4_0> { static constexpr bool value = true; };

__device__ __forceinline__ unsigned ld_u32_a2(const char* p) {   // 4 bytes at a 2-byte aligned address
    const unsigned short* h = reinterpret_cast<const unsigned short*>(p);
    return (unsigned)__ldg(h) | ((unsigned)__ldg(h + 1) << 16);
}
template <typename T>
__device__ __forceinline__ void load8_quant(const char* row, int ch, bool ok, float* f);
template <>
__device__ __forceinline__ void load8_quant<fattn_q8_0>(const char* row, int ch, bool ok, float* f) {
    float d = 0.0f;
    unsigned w0 = 0u, w1 = 0u;
    if (ok) {
        const char* blk = row + (ch >> 2) * fattn_q8_0::BYTES;
        const char* qs = blk + 2 + (ch & 3) * 8;
        d = __half2float(__ldg(reinterpret_cast<const __half*>(blk)));
        w0 = ld_u32_a2(qs);
        w1 = ld_u32_a2(qs + 4);
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] = d * (float)(signed char)((e < 4 ? w0 : w1) >> (8 * (e & 3)));
}
template <>
__device__ __forceinline__ void load8_quant<fattn_q4_0>(const char* row, int ch, bool ok, float* f) {
    float d = 0.0f;
    unsigned w0 = 0x88888888u, w1 = 0x88888888u;   // nibbles of 8: zeros
    if (ok) {
        const char* blk = row + (ch >> 2) * fattn_q4_0::BYTES;
        const char* qs = blk + 2 + (ch & 1) * 8;   // chunks 0/2: bytes 0-7, chunks 1/3: bytes 8-15
        d = __half2float(__ldg(reinterpret_cast<const __half*>(blk)));
        w0 = ld_u32_a2(qs);
        w1 = ld_u32_a2(qs + 4);
    }
    const int shift = (ch & 2) ? 4 : 0;          // chunks 2/3: the high nibbles
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] = d * (float)((int)(((e < 4 ? w0 : w1) >> (8 * (e & 3) + shift)) & 15u) - 8);
}

// Four 8-bit values (bytes of q, value i in byte i) -> four halves (h.x, h.y: values 0, 1; then
// 2, 3) times d2 (the block's scale, both halves), by the f16 magic number: byte b under 0x64
// is the half 1024 + b, exact, so (1024 + b) - bias is b - (bias - 1024) exactly and one
// rounding stays, of the product with d -- as ggml's dequantization to f32 then to f16.
// q8_0: bytes are int8, biased by the xor with 0x80 (bias 1152); q4_0: nibbles 0..15 (bias 1032).
__device__ __forceinline__ uint2 bytes4_to_half4(unsigned q, __half2 bias2, __half2 d2) {
    const unsigned lo = __byte_perm(q, 0x64646464u, 0x4140), hi = __byte_perm(q, 0x64646464u, 0x4342);
    const __half2 a = __hmul2(__hsub2(*reinterpret_cast<const __half2*>(&lo), bias2), d2);
    const __half2 b = __hmul2(__hsub2(*reinterpret_cast<const __half2*>(&hi), bias2), d2);
    return make_uint2(*reinterpret_cast<const unsigned*>(&a), *reinterpret_cast<const unsigned*>(&b));
}

__device__ __forceinline__ bool f16_bits_is_neg_inf(unsigned short b) { return b == 0xFC00u; }
__device__ __forceinline__ bool f16_bits_is_zero(unsigned short b) { return (b & 0x7FFFu) == 0u; }
// |x| < 256 (f16 exponent field below 15 + 8): false for infinities and NaN. The bound on a
// FINITE tile's cells (below): with natural-unit scores its mask starts the MMA accumulators,
// whose rounding is relative to their magnitude -- Q K^T added onto -65504 (a mask's stand-in
// for -inf) would lose most of its bits, onto values below 256 at most ~DK/16 ulp of 256.
__device__ __forceinline__ bool f16_bits_below_finite_max(unsigned short b) { return (b & 0x7FFFu) < 0x5C00u; }

// Two scores plus the slope times their mask cells m = (m.x, m.y). With sel, a -inf cell gives
// -inf whatever the score holds (a masked cell's K may be NaN/inf garbage: NaN + -inf would be
// NaN); without (no cell is -inf), the add alone.
__device__ __forceinline__ void add_mask_pair(float& s0, float& s1, __half2 m, float slope, bool sel) {
    const float2 mv = __half22float2(m);
    const float r0 = fmaf(slope, mv.x, s0), r1 = fmaf(slope, mv.y, s1);
    s0 = sel && mv.x == FATTN_NEG_INF ? FATTN_NEG_INF : r0;
    s1 = sel && mv.y == FATTN_NEG_INF ? FATTN_NEG_INF : r1;
}

// L1 prefetch hint (no register result)
__device__ __forceinline__ void prefetch_l1(const void* ptr) {
    asm volatile("prefetch.global.L1 [%0];\n" :: "l"(ptr));
}

// 2^x, flush-to-zero, one MUFU op (2^-inf = +0)
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// ---------------------------------------------------------------------------------------
// ALiBi slope of query head h (ggml: m0^(h+1) below n_head_log2, else m1^(2(h-n_head_log2)+1));
// 1 when ALiBi is off.
__device__ __forceinline__ float alibi_slope(const FattnParams& p, int h) {
    if (!p.use_alibi) return 1.0f;
    return h < p.n_head_log2 ? powf(p.m0, (float)(h + 1))
                             : powf(p.m1, (float)(2 * (h - p.n_head_log2) + 1));
}

// mask value at (kv column c, token t) for head h, stream s, as float (-inf stays -inf)
__device__ __forceinline__ const char* mask_row(const FattnParams& p, int t, int h, int s) {
    return p.mask + (long long)t * p.m_nb1 + (long long)(h % p.ne32) * p.m_nb2
                  + (long long)(s % p.ne33) * p.m_nb3;
}

// ---------------------------------------------------------------------------------------
// Live KV tiles of one query tile. An entry of the plan's list is a KV tile id plus class bits
// (fattn_util.cu sets them):
//   FULL     (no bit): every mask cell of the tile is +-0 for every row of the query tile and the
//            tile ends before n_kv -- no mask load, no bounds check;
//   PARTIAL:  some cell is -inf or past n_kv; every row is one interval [lo, hi) of zeros
//            (row_lohi), so the kernel compares indices instead of loading mask bytes;
//   PARTIAL|MASKED: some row is not an interval of zeros (ALiBi distances, random masks,
//            holes): the mask tile is loaded.
//   HIDDEN (with PARTIAL): some column < n_kv of the tile is -inf for every token of the query
//            tile in some head plane. A block zero-fills the V rows of the columns none of its
//            rows sees (LiveTiles::hidden) instead of loading them: 0 * NaN/inf garbage there
//            (uninitialised cache cells, other sequences' cells) would otherwise reach P V.
//            Columns >= n_kv need nothing: the V loader zero-fills them on every tile.
//   FINITE (with MASKED, only where the plan was asked to mark it): every mask cell < n_kv of
//            the tile is finite and below 256 in magnitude, for every token of the
//            query tile in every head plane (a bias mask), so the mask is added with no -inf
//            select (natural-unit scores: it starts the MMA accumulators).
#define FATTN_TILE_PARTIAL (1 << 30)
#define FATTN_TILE_MASKED (1 << 29)
#define FATTN_TILE_HIDDEN (1 << 28)
#define FATTN_TILE_FINITE (1 << 27)
#define FATTN_TILE_ID_MASK ((1 << 27) - 1)

// The hidden-column words of a plan's live lists, after its entries in the live_idx buffer
// (ggml_attn/cuda_backend.py allocates it; fattn_mask_compact writes it): u64
// [ne33][n_q_tiles][n_kv_tiles][ne32], list order. Word (slot, j, i32): the columns of the j-th
// live tile that are -inf for every token of the query tile in head plane i32 (bit c: column
// c of the tile); 0 for a tile without FATTN_TILE_HIDDEN. The entries take ne33*n_q_tiles*
// n_kv_tiles ints, rounded up to an even count (8-byte alignment).
template <typename I>
__device__ __forceinline__ unsigned long long* live_hidden(I* live_idx, const FattnParams& p) {
    const long long n = (long long)p.ne33 * p.n_q_tiles * p.n_kv_tiles;
    return reinterpret_cast<unsigned long long*>(const_cast<int*>(live_idx) + ((n + 1) & ~1ll));
}

// The AND over the mask planes of heads h0 .. h0+P-1 of one tile's ne32 hidden words at w.
__device__ __forceinline__ unsigned long long block_hidden(const unsigned long long* w, int ne32, int h0, int P) {
    if (ne32 == 1) return __ldg(w);
    unsigned long long r = ~0ull;
    const int n = min(P, ne32);   // P consecutive heads: every plane once when P >= ne32
    for (int i = 0; i < n; ++i) r &= __ldg(w + (h0 + i) % ne32);
    return r;
}

struct LiveTiles {
    const int* idx;
    int cnt;
    int tail_entry;   // without a plan: the entry of the last tile (PARTIAL when n_kv % 64 != 0)
    // the j-th entry (tile id | class bits)
    __device__ __forceinline__ int entry(int j) const {
        return idx ? __ldg(idx + j) : (j == cnt - 1 ? tail_entry : j);
    }
    // the j-th tile id
    __device__ __forceinline__ int operator[](int j) const { return entry(j) & FATTN_TILE_ID_MASK; }
    // the hidden words of the j-th entry (plan present: idx != nullptr), found from idx so
    // that no second pointer stays live in the kernels' loops
    __device__ __forceinline__ const unsigned long long* hidden_words(const FattnParams& p, int j) const {
        return live_hidden(p.live_idx, p) + ((idx - p.live_idx) + j) * (long long)p.ne32;
    }
    // the columns of the j-th tile (j < cnt) that no row of a block sees, the block's rows being
    // the tokens of the query tile x the heads h0 .. h0+P-1; 0 without a plan
    __device__ __forceinline__ unsigned long long hidden(const FattnParams& p, int j, int h0, int P) const {
        return idx ? block_hidden(hidden_words(p, j), p.ne32, h0, P) : 0ull;
    }
    // an L1 prefetch of the j-th tile's first hidden word (j < cnt)
    __device__ __forceinline__ void prefetch_hidden(const FattnParams& p, int j, int h0) const {
        if (idx) prefetch_l1(hidden_words(p, j) + (p.ne32 == 1 ? 0 : h0 % p.ne32));
    }
};

__device__ __forceinline__ LiveTiles live_tiles(const FattnParams& p, int q_tile, int s) {
    LiveTiles lt;
    lt.tail_entry = (p.n_kv_tiles - 1) | (p.n_kv % FATTN_KV_TILE ? FATTN_TILE_PARTIAL : 0);
    if (p.live_idx == nullptr) {
        lt.idx = nullptr;
        lt.cnt = p.n_kv_tiles;
    } else {
        const int slot = (s % p.ne33) * p.n_q_tiles + q_tile;
        lt.idx = p.live_idx + (long long)slot * p.n_kv_tiles;
        lt.cnt = __ldg(p.live_cnt + slot);
    }
    return lt;
}

// The [begin, end) range of live-list entries handled by split z of n.
__device__ __forceinline__ void split_range(int cnt, int z, int n, int& begin, int& end) {
    begin = (int)(((long long)cnt * z) / n);
    end = (int)(((long long)cnt * (z + 1)) / n);
}

// 1 / L for a row's softmax sum: 0 for an empty row (L = 0: the row sees no cell, its output
// is zeros), NaN when L is NaN (a visible NaN logit: the row is NaN, as in the reference)
__device__ __forceinline__ float inv_row_sum(float L) {
    return L > 0.0f ? 1.0f / L : (L == L ? 0.0f : L);
}

// ---------------------------------------------------------------------------------------
// Final write of one row: o_unnorm is sum_j p_j v_j (p in the log2 domain with max m),
// l the sum of p. With one split the sink is folded in and dst is written; with several,
// the unnormalized partial goes to the workspace and the combine pass finishes it.
// Called by the threads that own columns [c0, c0+n) of the row (any split of columns).
__device__ __forceinline__ float row_finish_factor(const FattnParams& p, int h, float m, float l) {
    // returns the factor to multiply o_unnorm with for the final output (1 split)
    if (p.sinks) {
        const float sk = __ldg(p.sinks + h) * FATTN_LOG2E;
        const float mm = fmaxf(m, sk);
        const float a = (m == FATTN_NEG_INF) ? 0.0f : fast_exp2(m - mm);
        const float lt = l * a + fast_exp2(sk - mm);
        return lt > 0.0f ? __fdividef(a, lt) : 0.0f;
    }
    return l > 0.0f ? __fdividef(1.0f, l) : 0.0f;
}

// One output value (row, column c) of a block that reduced its partial states in shared
// memory: the final value to dst with one split, else the unnormalized partial (and the row's
// max and sum, once) to the split workspace for fattn_combine.
__device__ __forceinline__ void store_row_value(const FattnParams& p, long long row, int h, int c, int head_dim_v,
                                                int split, float o, float m, float l) {
    if (p.n_splits == 1) {
        p.dst[row * head_dim_v + c] = o * row_finish_factor(p, h, m, l);
    } else {
        const long long wr = (long long)split * p.ne3 * p.n_batch * p.n_head + row;
        p.ws_o[wr * head_dim_v + c] = o;
        if (c == 0) { p.ws_ml[wr * 2] = m; p.ws_ml[wr * 2 + 1] = l; }
    }
}

// ---------------------------------------------------------------------------------------
// Warp reductions
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// Split-KV finish inside the attention kernel, instead of a fattn_combine launch: each block
// of a row group (the blocks with the same blockIdx.x/y and stream, splits z = 0 .. n_splits-1)
// counts itself in p.split_cnt[group] once its partials are written; the last one merges the
// n_splits partials of its rows into dst, as fattn_combine does, and sets the counter back to
// 0 for the next launch. Every thread of the block calls it. row_of(r): the output row of the
// block's local row r (0 <= r < n_r) or -1; scratch: split_finish_floats(n_r, n_splits) floats
// of shared memory the block no longer uses (the host checks that the kernel has them).
// Three passes, each with independent loads: the splits' maxima into shared memory; per row
// (a warp each) the max, the split weights and 1 / sum; the weighted sum of the partial
// outputs, columns across threads.
__host__ __device__ constexpr int split_finish_floats(int n_r, int n_splits) {
    return n_r * n_splits + 2 * n_r + 2;
}

template <int EPT, typename RowOf>   // EPT: output values per thread in flight in the last pass
__device__ __forceinline__ void split_finish(const FattnParams& p, int n_r, RowOf row_of, int head_dim_v,
                                             float* scratch) {
    const int ns = p.n_splits;
    float* fz = scratch;                 // [n_r][ns]: split maxima, then weights
    float* inv = scratch + n_r * ns;     // [n_r]
    int* vr = reinterpret_cast<int*>(inv + n_r);   // [n_r] local rows with an output row, then
    int* nv = vr + n_r;                            // their count (also the "last block" flag)
    const int group = ((blockIdx.z / ns) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    __threadfence();            // this thread's partials are visible before the block is counted
    __syncthreads();
    if (threadIdx.x == 0) {
        const bool last = atomicAdd(p.split_cnt + group, 1) == ns - 1;
        int n = 0;
        if (last)
            for (int r = 0; r < n_r; ++r)
                if (row_of(r) >= 0) vr[n++] = r;
        *nv = last ? n : -1;
    }
    __syncthreads();
    const int n_valid = *nv;
    if (n_valid < 0) return;
    __threadfence();
    const long long n_rows = (long long)p.ne3 * p.n_batch * p.n_head;
    for (int i = threadIdx.x; i < n_valid * ns; i += blockDim.x) {
        const int k = i / ns, z = i - k * ns;
        fz[vr[k] * ns + z] = __ldcg(p.ws_ml + (z * n_rows + row_of(vr[k])) * 2);
    }
    __syncthreads();
    const int lane = threadIdx.x & 31;
    for (int k = threadIdx.x >> 5; k < n_valid; k += blockDim.x >> 5) {   // a warp per row
        const int r = vr[k];
        const long long row = row_of(r);
        float M = FATTN_NEG_INF;
        for (int z = lane; z < ns; z += 32) M = fmaxf(M, fz[r * ns + z]);
        M = warp_max(M);
        const float sk = p.sinks ? __ldg(p.sinks + row % p.n_head) * FATTN_LOG2E : FATTN_NEG_INF;
        M = fmaxf(M, sk);
        float L = 0.0f;
        for (int z = lane; z < ns; z += 32) {
            const float m = fz[r * ns + z];
            const float f = m == FATTN_NEG_INF ? 0.0f : fast_exp2(m - M);
            L += f * __ldcg(p.ws_ml + (z * n_rows + row) * 2 + 1);
            fz[r * ns + z] = f;
        }
        L = warp_sum(L);
        if (M != FATTN_NEG_INF && p.sinks) L += fast_exp2(sk - M);
        if (lane == 0) inv[r] = inv_row_sum(L);
    }
    __syncthreads();
    // sum_z f_z * partial_z for EPT values per thread at once, FATTN_FINISH_BATCH splits per batch of loads
    const int n_e = n_valid * head_dim_v;
    const long long zs = n_rows * head_dim_v;
    for (int e0 = threadIdx.x; e0 < n_e; e0 += EPT * blockDim.x) {
        const float* o[EPT];
        const float* f[EPT];
        float acc[EPT];
#pragma unroll
        for (int j = 0; j < EPT; ++j) {
            const int e = min(e0 + j * (int)blockDim.x, n_e - 1);
            const int k = e / head_dim_v, r = vr[k];
            o[j] = p.ws_o + row_of(r) * head_dim_v + (e - k * head_dim_v);
            f[j] = fz + r * ns;
            acc[j] = 0.0f;
        }
        // (a split with no visible cell adds nothing: its partials may be stale)
        int z = 0;
        for (; z + FATTN_FINISH_BATCH <= ns; z += FATTN_FINISH_BATCH) {
            float v[FATTN_FINISH_BATCH][EPT];
#pragma unroll
            for (int b = 0; b < FATTN_FINISH_BATCH; ++b)
#pragma unroll
                for (int j = 0; j < EPT; ++j) v[b][j] = __ldcg(o[j] + (z + b) * zs);
#pragma unroll
            for (int b = 0; b < FATTN_FINISH_BATCH; ++b)
#pragma unroll
                for (int j = 0; j < EPT; ++j) {
                    const float w = f[j][z + b];
                    acc[j] = w != 0.0f ? fmaf(v[b][j], w, acc[j]) : acc[j];
                }
        }
        for (; z < ns; ++z) {
#pragma unroll
            for (int j = 0; j < EPT; ++j) {
                const float w = f[j][z];
                if (w != 0.0f) acc[j] = fmaf(__ldcg(o[j] + z * zs), w, acc[j]);
            }
        }
#pragma unroll
        for (int j = 0; j < EPT; ++j) {
            const int e = e0 + j * (int)blockDim.x;
            if (e < n_e) {
                const int k = e / head_dim_v, r = vr[k];
                p.dst[row_of(r) * head_dim_v + (e - k * head_dim_v)] = acc[j] * inv[r];
            }
        }
    }
    if (threadIdx.x == 0) p.split_cnt[group] = 0;
}
