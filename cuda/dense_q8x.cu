// The block GEMV with 8-bit activations (the alternative to dense_q.cu's F32 ones, as llama.cpp's
// mmvq does): x is quantized once per ubatch to int8 per 32 values (a scale each), and each lane
// multiplies its weight sub-block in integer form with IDP4A, four values an instruction, the
// block's scales applied to the integer sums (qb_int8s / qb_dot_q8 in quant_blocks.cuh, checked
// on the host against ggml's values by tests/test_quant_blocks.py). ncu on the H100 counted ~10
// instructions a value for dense_gemv_q (F32 decode, one FFMA a value): this path needs ~1.5-3.
//   dense_quant_q8x        x (times the norm weight g, RMS-normalized with eps > 0) -> xq int8,
//                          xd (the scale of each 32 values: amax / 127), xs (the sum of their
//                          int8 values), per token;
//   dense_gemv_q8x<T, NT>  y = W·x for n_tok <= NT tokens over weights of block type T (every
//                          block type), modes as dense_gemv_q's (store, accumulate, gated:
//                          silu(W0·x) * (W1·x));
//   dense_gemv_q8x_s<T, NT> the same with each warp's row streamed through shared memory (rows
//                          of whole 16-byte units);
//   dense_gemv_q8x_v<T, NT> the same for Q4_K / Q5_K / Q6_K / Q8_0 rows of whole 16-byte units,
//                          read by coalesced 16-byte loads, a few word operations a value;
//   dense_gemv_q8x_r<T, NT> that arithmetic for the same types over a wave of warps each
//                          streaming several rows through a ring of shared-memory slots;
//   dense_gemm_q8<T, BN>   the tiled GEMM on int8 tensor cores for more tokens (below).
// Layouts (numpy order, C-contiguous): x (n_tok, n_in) F32 rows x_stride apart (16-byte aligned); xq (n_tok, n_in)
// int8; xd, xs (n_tok, n_in / 32) F32; W (rows, row_bytes) bytes; y (n_tok, rows) F32.
#include <cuda_fp16.h>
#include "quant_blocks.cuh"
#include "dense_common.cuh"
#include "staged_rows.cuh"   // stage_weight_rows (smem_u32, cp.async)
#include "q8x_quant.cuh"     // q8x_quant32

#define Q8X_WARPS 8    // warps a dense_gemv_q8x block, a row each
#define Q8X_SWARPS 4   // warps a dense_gemv_q8x_s block, a row each
#define Q8X_CHUNK 1024 // values a staged chunk: a 32-value sub-block a lane
#define Q8X_STAGES 4   // chunks a staged warp's slots hold (Q8X_STAGES - 1 in flight)

struct GemvQ8Params {
    GemvQSeg seg[3];
    const signed char* xq;    // (n_tok, n_in), 16-byte aligned
    const float* xd;          // (n_tok, n_in / 32)
    const float* xs;          // (n_tok, n_in / 32)
    long long row_bytes;
    int n_in;                 // a multiple of QBlock<T>::VALUES
    int n_tok;                // 1..NT
    int n_seg;                // 1..3 (mode 2: 2)
    int mode;                 // 0: store; 1: accumulate; 2: gated
    int pdl;                  // launched with programmatic dependent launch: 1, each warp's rows
                              // prefetched into L2 while the quantization before it runs (q8x_enter);
                              // 2, without the prefetch; 0: not
    int pad_;
};
// The output's 8-bit form (q8x_finish): the next GEMV's activations, made by this one's warps.
// Where asked for, it rides in segments the launch leaves unused -- not fields of their own: the
// parameters' size moves the other instances' registers (ptxas: the split vector instance's 64
// became 66, a block fewer an SM). The gated mode (two operands): seg[2].w the buffer. The
// accumulate mode over one segment (x += W·h, the residual stream): seg[2].w the buffer and
// seg[1].w the weight g of the RMS norm the next GEMV applies (F32, rows; seg[1].rows: its eps's
// bits) -- the norm's scale r = 1 / sqrt(mean(x^2) + eps) is one number a token, and
// quantization is scale-invariant (q of r·u is q of u, d of r·u is r times d of u), so each group
// of u = x·g is quantized as it completes and the scales are multiplied by r once every group's
// sum of squares is in. The buffer, each part at a 16-byte boundary (graph/q8_matmul.py
// q8_out_arrays lays it out): int8 (n_tok, rows), the scales and the sums F32 (n_tok, rows / 32)
// each, the rows stored of each 32-row group uint32 (rows / 32), the groups' sums of squares F32
// (n_tok, rows / 32), the groups done uint32 (1). The counters are 0 between launches (the warp
// that completes a count resets it).
struct Q8xOut {
    signed char* q;
    float *d, *s, *ss, *g;
    unsigned *c, *all;
    float eps;
};
__device__ __forceinline__ bool q8x_out(const GemvQ8Params& p, int rows, Q8xOut& o) {
    unsigned char* b = const_cast<unsigned char*>(p.seg[2].w);
    if (b == nullptr || !(p.mode == 2 || (p.mode == 1 && p.n_seg == 1))) return false;
    const long long nq = ((long long)p.n_tok * rows + 15) & ~15LL, ns = ((long long)p.n_tok * rows / 8 + 15) & ~15LL;
    const long long nc = ((long long)rows / 8 + 15) & ~15LL;
    o.q = reinterpret_cast<signed char*>(b);
    o.d = reinterpret_cast<float*>(b + nq);
    o.s = reinterpret_cast<float*>(b + nq + ns);
    o.c = reinterpret_cast<unsigned*>(b + nq + 2 * ns);
    o.ss = reinterpret_cast<float*>(b + nq + 2 * ns + nc);
    o.all = reinterpret_cast<unsigned*>(b + nq + 3 * ns + nc);
    o.g = p.mode == 1 ? reinterpret_cast<float*>(const_cast<unsigned char*>(p.seg[1].w)) : nullptr;
    o.eps = __int_as_float(p.seg[1].rows);
    return true;
}

// A GEMV warp's entry, rows w0 (and w1) known: with p.pdl 1, their bytes requested into L2, then
// (every launch) the wait for the kernel before it (the activations' quantization) -- no read of
// xq / xd / xs or of the outputs before it.
__device__ __forceinline__ void q8x_enter(const GemvQ8Params& p, const unsigned char* w0, const unsigned char* w1) {
    if (p.pdl == 1) {
        const int lane = threadIdx.x & 31;
        prefetch_l2_span(w0, p.row_bytes, lane);
        if (w1) prefetch_l2_span(w1, p.row_bytes, lane);
    }
    pdl_wait();
}

// Grid (n_in / 256 rounded up, n_tok), 256 threads: warp w quantizes sub-block 8 blockIdx.x + w
// of token blockIdx.y -- v = x * g * scale, d = max|v| / 127, q = round(v / d) (0 where d is 0),
// xs = sum of q -- after, with eps > 0, every block reduced the token's whole row for the RMS
// scale (L2-resident; one block a token held ~13 us a call on the H100 at b63b788, one warp
// walking 16-56 sub-blocks in turn). x's rows 16-byte aligned.
extern "C" __global__ void __launch_bounds__(256) dense_quant_q8x(const float* __restrict__ x, long long x_stride,
                                                                 const float* __restrict__ g, float eps, int n_in,
                                                                 signed char* __restrict__ xq,
                                                                 float* __restrict__ xd, float* __restrict__ xs) {
    pdl_trigger();   // the GEMV after it (launched with the attribute) may start: it waits for this grid
    const int t = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float* xr = x + (long long)t * x_stride;
    const int n_sub = n_in / 32, s = 8 * blockIdx.x + warp, k = 32 * s + lane;
    const bool live = s < n_sub;
    // the lane's value and weight requested before the row's sum of squares (one L2 round trip
    // under the other), that sum's loads four at a time (the loop unrolled: their latencies overlap)
    float v = live ? xr[k] * (g ? g[k] : 1.0f) : 0.0f;
    __shared__ float red[8];
    if (eps > 0.0f) {
        float ss = 0.0f;
        const float4* x4 = reinterpret_cast<const float4*>(xr);
#pragma unroll 4
        for (int i = threadIdx.x; i < n_in / 4; i += 256) {
            const float4 u = __ldg(x4 + i);
            ss += u.x * u.x + u.y * u.y + u.z * u.z + u.w * u.w;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (lane == 0) red[warp] = ss;
        __syncthreads();
        ss = 0.0f;
#pragma unroll
        for (int w = 0; w < 8; ++w) ss += red[w];
        v *= 1.0f / sqrtf(ss / (float)n_in + eps);
    }
    if (!live) return;
    q8x_quant32(v, xq + (long long)t * n_in + 32 * s, xd + (long long)t * n_sub + s, xs + (long long)t * n_sub + s);
}

// The 32 activations of sub-block s of token t as eight int8x4 words, with their scale and sum.
struct Q8xAct {
    int a[8];
    float d, s;
};

__device__ __forceinline__ void q8x_load1(const GemvQ8Params& p, int t, int sub, Q8xAct& x) {
    const int n_sub = p.n_in / 32;
    const int4* src = reinterpret_cast<const int4*>(p.xq + (long long)t * p.n_in + 32 * sub);
    const int4 u = __ldg(src), v = __ldg(src + 1);
    x.a[0] = u.x, x.a[1] = u.y, x.a[2] = u.z, x.a[3] = u.w, x.a[4] = v.x, x.a[5] = v.y, x.a[6] = v.z, x.a[7] = v.w;
    x.d = __ldg(p.xd + (long long)t * n_sub + sub), x.s = __ldg(p.xs + (long long)t * n_sub + sub);
}

// Tokens whose activations a lane loads ahead of its sub-block's weights (their latency under the
// weights'); with more tokens than this each token's are loaded as its dot needs them (ten
// registers a token held ahead: 8 and 16 tokens would spill).
__host__ __device__ constexpr int q8x_ahead(int nt) { return nt <= 4 ? nt : 1; }

template <int NT>
__device__ __forceinline__ void q8x_load(const GemvQ8Params& p, int sub, Q8xAct (&x)[q8x_ahead(NT)]) {
#pragma unroll
    for (int t = 0; t < q8x_ahead(NT); ++t) {
        if (t < p.n_tok) q8x_load1(p, t, sub, x[t]);
    }
}

// One lane's sub-block sub (of its row's weights at b0, the gated mode's second operand at b1,
// each the start of the block holding it) times every token's activations (the first
// q8x_ahead(NT) in x).
template <int T, int NT>
__device__ __forceinline__ void q8x_sub(const GemvQ8Params& p, const unsigned char* b0, const unsigned char* b1, int sub,
                                        const Q8xAct (&x)[q8x_ahead(NT)], float (&acc)[NT], float (&up)[NT]) {
    constexpr int S = QBlock<T>::VALUES / 32;
    int w[8], wu[8];
    float f[2], c[2], fu[2], cu[2];
    qb_int8s<T>(b0, sub % S, w, f, c);
    if (b1) qb_int8s<T>(b1, sub % S, wu, fu, cu);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        if (t < p.n_tok) {
            Q8xAct xt;
            if (t < q8x_ahead(NT)) xt = x[t < q8x_ahead(NT) ? t : 0];
            else q8x_load1(p, t, sub, xt);
            acc[t] += qb_dot_q8<T>(w, f, c, xt.a, xt.d, xt.s);
            if (b1) up[t] += qb_dot_q8<T>(wu, fu, cu, xt.a, xt.d, xt.s);
        }
    }
}

// A GEMV warp's end, every form: row r's sums out (gemv_q_finish; the norm was applied when x was
// quantized). With an 8-bit output (q8x_out; rows a multiple of 32) the row then counts in its
// 32-row group, and the warp that counts the group's last row quantizes the group for every
// token (q8x_quant32, from the stored values, times the next norm's weight in the accumulate
// mode): the next GEMV's activations without a dense_quant_q8x launch between. In the
// accumulate mode that warp then counts the group among the groups done, and the warp that
// counts the last multiplies every scale by the norm's scale. Each warp fences its stores before
// its count (the threadFenceReduction order), the last reads from L2 (__ldcg) after its own fence.
// QO: the instances with it (the vector and ring forms' GQ >= 4); the others leave it out.
template <int NT, bool QO = false>
__device__ __forceinline__ void q8x_finish(const GemvQ8Params& p, float (&acc)[NT], float (&up)[NT],
                                           const GemvQSeg& sg, int r) {
    float one[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) one[t] = 1.0f;
    gemv_q_finish<NT>(acc, up, one, p.mode, p.n_tok, sg, r);
    Q8xOut o;
    if (!QO || !q8x_out(p, sg.rows, o)) return;
    const int lane = threadIdx.x & 31, g = r >> 5, n_g = sg.rows >> 5;
    __threadfence();
    __syncwarp();
    unsigned done = 0;
    if (lane == 0) done = atomicAdd(o.c + g, 1u);
    if (__shfl_sync(0xffffffffu, done, 0) != 31u) return;
    __threadfence();
    for (int t = 0; t < p.n_tok; ++t) {   // the group, every token: u = x·g, its 8-bit form and sum of squares
        const float x = __ldcg(sg.out + (long long)t * sg.rows + 32 * g + lane);
        q8x_quant32(o.g ? x * o.g[32 * g + lane] : x, o.q + (long long)t * sg.rows + 32 * g,
                    o.d + (long long)t * n_g + g, o.s + (long long)t * n_g + g);
        if (o.g) {
            float sq = x * x;
#pragma unroll
            for (int k = 16; k > 0; k >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, k);
            if (lane == 0) o.ss[(long long)t * n_g + g] = sq;
        }
    }
    if (lane == 0) o.c[g] = 0u;   // (for the next launch: every row of the group has counted)
    if (!o.g) return;
    __threadfence();   // the group's scales and sum of squares before its count
    done = 0;
    if (lane == 0) done = atomicAdd(o.all, 1u);
    if (__shfl_sync(0xffffffffu, done, 0) != (unsigned)n_g - 1u) return;
    __threadfence();
    for (int t = 0; t < p.n_tok; ++t) {   // every group in: the norm's scale into each scale (a fixed order: deterministic)
        float sq = 0.0f;
        for (int i = lane; i < n_g; i += 32) sq += __ldcg(o.ss + (long long)t * n_g + i);
#pragma unroll
        for (int k = 16; k > 0; k >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, k);
        const float rs = 1.0f / sqrtf(sq / (float)sg.rows + o.eps);
        for (int i = lane; i < n_g; i += 32) {
            float* d = o.d + (long long)t * n_g + i;
            *d = __ldcg(d) * rs;
        }
    }
    if (lane == 0) *o.all = 0u;
}

// Rows read from global memory as the lanes' sub-blocks need them (any row alignment).
template <int T, int NT>
__global__ void __launch_bounds__(Q8X_WARPS * 32) dense_gemv_q8x(const GemvQ8Params p) {
    constexpr int S = QBlock<T>::VALUES / 32, B = QBlock<T>::BYTES;
    int r = blockIdx.x * Q8X_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    GemvQSeg sg;
    if (!gemv_segment(p, r, sg)) return;   // (no barrier below: a warp past the rows may leave)
    const unsigned char* w0 = sg.w + (long long)r * p.row_bytes;
    const unsigned char* w1 = p.mode == 2 ? p.seg[1].w + (long long)r * p.row_bytes : nullptr;
    q8x_enter(p, w0, w1);
    float acc[NT], up[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = 0.0f, up[t] = 0.0f;
    for (int sub = lane; sub < p.n_in / 32; sub += 32) {
        Q8xAct x[q8x_ahead(NT)];
        q8x_load<NT>(p, sub, x);
        const long long off = (long long)(sub / S) * B;
        q8x_sub<T, NT>(p, w0 + off, w1 ? w1 + off : nullptr, sub, x, acc, up);
    }
    q8x_finish<NT>(p, acc, up, sg, r);
}

// The staged form, for rows that start 16-byte aligned (row_bytes a multiple of 16, every
// segment's pointer aligned): each warp streams its row (and the gated mode's second row) through
// Q8X_STAGES shared-memory slots of Q8X_CHUNK values by cp.async, Q8X_STAGES - 1 chunks in
// flight while it multiplies one -- a row's bytes requested at once, not one sub-block a lane
// at a time (dense_gemv_q8x held ~0.6 TB/s on the H200 at 6d1b24e: memory latency, one
// sub-block's bytes a lane in flight). Slot bytes keep the global bytes' alignment mod 16, so
// qb_int32's 16-byte loads take the same path.
template <int T> struct Q8xChunk {
    static constexpr int BYTES = Q8X_CHUNK / QBlock<T>::VALUES * QBlock<T>::BYTES;   // a whole chunk's
    static constexpr bool ALIGNED = BYTES % 16 == 0;   // every chunk starts 16-byte aligned (not Q3_K, Q6_K)
    static constexpr int UNITS = ALIGNED ? BYTES / 16 : (BYTES + 30) / 16;   // 16-byte units a chunk's copy
    static constexpr int SLOT = 16 * UNITS;
};

// cp.async of UNITS 16-byte units of row w (row_bytes bytes, 16-byte aligned) from its byte a0 (a
// multiple of 16) into the shared slot at address slot; units at or past the row's end are
// zero-filled, nothing read. A fixed unit count and 32-bit offsets: the copy is a few
// instructions a lane (a count computed per chunk and 64-bit offsets made it ~100 a chunk at b63b788).
template <int UNITS>
__device__ __forceinline__ void q8x_stage_units(const unsigned char* w, int row_bytes, int a0, unsigned slot, int lane) {
#pragma unroll
    for (int k = 0; k < (UNITS + 31) / 32; ++k) {
        const int u = lane + 32 * k, o = a0 + 16 * u;
        if (UNITS % 32 == 0 || u < UNITS) cp_async16(slot + 16u * u, w + (o < row_bytes ? o : 0), o < row_bytes ? 16 : 0);
    }
}

// The staged form's chunk c of row w: its units from its first byte rounded down to 16 (so that
// byte lands in the slot at its row offset mod 16).
template <int T>
__device__ __forceinline__ void q8x_stage(const unsigned char* w, int row_bytes, int c, unsigned slot, int lane) {
    q8x_stage_units<Q8xChunk<T>::UNITS>(w, row_bytes, (c * Q8xChunk<T>::BYTES) & ~15, slot, lane);
}

template <int T, int NT>
__global__ void __launch_bounds__(Q8X_SWARPS * 32) dense_gemv_q8x_s(const GemvQ8Params p) {
    constexpr int S = QBlock<T>::VALUES / 32, B = QBlock<T>::BYTES, SLOT = Q8xChunk<T>::SLOT;
    constexpr int SUBS = Q8X_CHUNK / 32;   // sub-blocks a chunk: one a lane
    __shared__ __align__(16) unsigned char buf[Q8X_SWARPS][2][Q8X_STAGES][SLOT];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int r = blockIdx.x * Q8X_SWARPS + warp;
    GemvQSeg sg;
    if (!gemv_segment(p, r, sg)) return;   // (no block barrier below)
    const int row_bytes = (int)p.row_bytes;   // (a row's bytes: far below 2^31)
    const unsigned char* w0 = sg.w + (long long)r * row_bytes;
    const unsigned char* w1 = p.mode == 2 ? p.seg[1].w + (long long)r * row_bytes : nullptr;
    q8x_enter(p, w0, w1);
    const unsigned s0 = smem_u32(&buf[warp][0][0][0]), s1 = smem_u32(&buf[warp][1][0][0]);
    const int n_sub = p.n_in / 32, n_chunks = (n_sub + SUBS - 1) / SUBS;
#pragma unroll
    for (int c = 0; c < Q8X_STAGES - 1; ++c) {
        if (c < n_chunks) {
            q8x_stage<T>(w0, row_bytes, c, s0 + c * SLOT, lane);
            if (w1) q8x_stage<T>(w1, row_bytes, c, s1 + c * SLOT, lane);
        }
        cp_async_commit();
    }
    float acc[NT], up[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = 0.0f, up[t] = 0.0f;
    // the lane's block in a chunk's slot: the chunk's head (its offset mod 16) + (lane / S) blocks
    const int lane_off = (lane / S) * B;
    for (int c = 0; c < n_chunks; ++c) {
        const int nc = c + Q8X_STAGES - 1, slot = c % Q8X_STAGES;
        if (nc < n_chunks) {   // into the slot chunk c - 1 used (its reads are done: __syncwarp below)
            q8x_stage<T>(w0, row_bytes, nc, s0 + (nc % Q8X_STAGES) * SLOT, lane);
            if (w1) q8x_stage<T>(w1, row_bytes, nc, s1 + (nc % Q8X_STAGES) * SLOT, lane);
        }
        cp_async_commit();
        const int sub = SUBS * c + lane;
        Q8xAct x[q8x_ahead(NT)];
        if (sub < n_sub) q8x_load<NT>(p, sub, x);   // (before the wait: its latency overlaps)
        cp_async_wait<Q8X_STAGES - 1>();   // chunk c is in
        __syncwarp();
        if (sub < n_sub) {
            const int off = (Q8xChunk<T>::ALIGNED ? 0 : (c * Q8xChunk<T>::BYTES) & 15) + lane_off;
            q8x_sub<T, NT>(p, &buf[warp][0][slot][off], w1 ? &buf[warp][1][slot][off] : nullptr, sub, x, acc, up);
        }
        __syncwarp();   // every lane's reads of the slot are done before a later chunk fills it
    }
    q8x_finish<NT>(p, acc, up, sg, r);
}

// The vector GEMV (dense_gemv_q8x_v<T, NT>) for Q4_K, Q5_K, Q6_K and Q8_0 rows of whole 16-byte units:
// the weights read from global memory 16 bytes a load, coalesced, the way dense.cu's F16 GEMV
// reads (3.5 TB/s on the H100), with each lane's arithmetic a few word operations a value. A warp
// a row; a lane issues the loads of Q8xV::U steps before any of their arithmetic.
//   Q4_K / Q5_K (144 and 176 bytes a block: every block 16-byte aligned): a step covers 4 blocks,
//   eight lanes a block (lane k = lane % 8 of block lane / 8: qb_k4_lane's head, qs and qh words
//   straight into registers); no shared memory, no barrier.
//   Q6_K (210 bytes: blocks 2-byte aligned, 8 of them 105 whole units): a step covers such a
//   group of 8 blocks, staged through the warp's own shared memory (coalesced 16-byte loads, then
//   stores, __syncwarp) and read back by four lanes a block (qb_q6k_group_lane's 16-byte windows:
//   five word loads and four byte permutes each, the block's offset mod 4 the same every group).
//   Q8_0 (34 bytes): the same with groups of 32 blocks (68 units), a lane a block.
// The scales come by word operations, the dots by IDP4A on the 8-bit activations (xq, xd, xs as
// for dense_gemv_q8x). Static SASS (sm_90): bench/NOTES.md, tenth session. Rows 16-byte aligned
// (q8_matmul.rows_aligned).
#define Q8X_VWARPS 4   // warps a dense_gemv_q8x_v block, a row each

// U: the steps whose loads a lane issues together; MINB: blocks an SM its registers allow (no
// spills at sm_90: Q5_K's third load a step halves U; Q6_K's steps are 2048 values).
template <int T, int NT> struct Q8xV {
    static constexpr int U = T == QB_Q4_K ? 4 : 2;
    static constexpr int MINB = NT == 1 && T != QB_Q6_K ? 4 : 3;
};

template <int T>
__device__ __forceinline__ void q8x_v_load(const unsigned char* blk, int k, uint4& hd, uint4& qs, uint4& qh) {
    hd = ld_stream(blk);
    qs = ld_stream(blk + QbLane<T>::QS + 16 * k);
    if (QbLane<T>::QH) qh = ld_stream(blk + 16 + 16 * (k & 1));
}

// q8x_v_load's words from a block staged in shared memory.
template <int T>
__device__ __forceinline__ void q8x_v_load_smem(const unsigned char* blk, int k, uint4& hd, uint4& qs, uint4& qh) {
    hd = *reinterpret_cast<const uint4*>(blk);
    qs = *reinterpret_cast<const uint4*>(blk + QbLane<T>::QS + 16 * k);
    if (QbLane<T>::QH) qh = *reinterpret_cast<const uint4*>(blk + 16 + 16 * (k & 1));
}

__device__ __forceinline__ void u4_words(const uint4& u, unsigned (&w)[4]) { w[0] = u.x, w[1] = u.y, w[2] = u.z, w[3] = u.w; }

// One step's block of Q4_K / Q5_K (this lane's part: its words hd / qs / qh of block blk of the
// row, the gated mode's second operand's in hd1 / qs1 / qh1 when w1) times the tokens'
// activations, into acc (up): the lane's activations are positions 16 (k & 1) .. + 15 of
// sub-blocks 2 j and 2 j + 1 of the block (their scales and sums at sub-block 8 blk + 2 j).
template <int T, int NT>
__device__ __forceinline__ void q8x_v_block_k4(const GemvQ8Params& p, int blk, bool w1,
                                               const uint4& hd, const uint4& qs, const uint4& qh,
                                               const uint4& hd1, const uint4& qs1, const uint4& qh1,
                                               float (&acc)[NT], float (&up)[NT]) {
    const int lane = threadIdx.x & 31, k = lane & 7, j = k >> 1, n_sub = p.n_in / 32;
    const bool with_min = (k & 1) == 0;
    unsigned h[4], q[4], e[4];
    QbLaneVals v, v1;
    u4_words(hd, h), u4_words(qs, q);
    if (QbLane<T>::QH) u4_words(qh, e);
    qb_k4_lane<T>(h, q, e, k, v);
    if (w1) {
        u4_words(hd1, h), u4_words(qs1, q);
        if (QbLane<T>::QH) u4_words(qh1, e);
        qb_k4_lane<T>(h, q, e, k, v1);
    }
    const signed char* xa = p.xq + 256 * blk + 64 * j + 16 * (k & 1);
    const int sub = 8 * blk + 2 * j;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        if (t < p.n_tok) {
            const signed char* a = xa + (long long)t * p.n_in;
            unsigned alo[4], ahi[4];
            u4_words(__ldg(reinterpret_cast<const uint4*>(a)), alo);
            u4_words(__ldg(reinterpret_cast<const uint4*>(a + 32)), ahi);
            const float2 xd = __ldg(reinterpret_cast<const float2*>(p.xd + (long long)t * n_sub + sub));
            const float2 xs = __ldg(reinterpret_cast<const float2*>(p.xs + (long long)t * n_sub + sub));
            acc[t] += qb_k4_lane_dot(v, alo, ahi, xd.x, xs.x, xd.y, xs.y, with_min);
            if (w1) up[t] += qb_k4_lane_dot(v1, alo, ahi, xd.x, xs.x, xd.y, xs.y, with_min);
        }
    }
}

// One row of Q4_K / Q5_K blocks (w0; the gated mode's second operand w1, else null) times the
// tokens' activations into acc (up), U steps' loads at a time; with NS warps a row (the split
// instances), this warp's part: chunks of U steps h, h + NS, ...
template <int T, int NT, int U = Q8xV<T, NT>::U, int NS = 1>
__device__ __forceinline__ void q8x_v_row_k4(const GemvQ8Params& p, const unsigned char* w0, const unsigned char* w1,
                                             float (&acc)[NT], float (&up)[NT], int h = 0) {
    constexpr int B = QBlock<T>::BYTES;
    const int lane = threadIdx.x & 31, k = lane & 7, b0 = lane >> 3;
    const int n_blk = p.n_in / 256, first = b0 + 4 * U * h;
    // the lane's first block; each chunk moves it 4 U NS blocks on
    w0 += first * B;
    if (w1) w1 += first * B;
    for (int base = first; base < n_blk; base += 4 * U * NS) {
        uint4 hd[U], qs[U], qh[U], hd1[U], qs1[U], qh1[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (base + 4 * u < n_blk) {
                q8x_v_load<T>(w0 + 4 * u * B, k, hd[u], qs[u], qh[u]);
                if (w1) q8x_v_load<T>(w1 + 4 * u * B, k, hd1[u], qs1[u], qh1[u]);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (base + 4 * u < n_blk)
                q8x_v_block_k4<T, NT>(p, base + 4 * u, w1 != nullptr, hd[u], qs[u], qh[u], hd1[u], qs1[u], qh1[u], acc, up);
        w0 += 4 * U * NS * B;
        if (w1) w1 += 4 * U * NS * B;
    }
}

// The group-staged types: a group of BLOCKS blocks is whole 16-byte units (UNITS), staged through
// the warp's shared memory, then read by group_dot's lanes (Q6_K: four a block, Q8_0: one).
template <int T> struct Q8xVGroup;
template <> struct Q8xVGroup<QB_Q6_K> { static constexpr int BLOCKS = 8; };    // 1680 bytes, 2048 values
template <> struct Q8xVGroup<QB_Q8_0> { static constexpr int BLOCKS = 32; };   // 1088 bytes, 1024 values
template <int T> struct Q8xVG {
    static constexpr int BYTES = Q8xVGroup<T>::BLOCKS * QBlock<T>::BYTES, UNITS = BYTES / 16, LOADS = (UNITS + 31) / 32;
    static_assert(BYTES % 16 == 0, "a group is whole 16-byte units");
};

// The first n_units units of the group at w into registers st (unit lane + 32 i), and back out
// into the warp's buffer.
template <int T>
__device__ __forceinline__ void group_load(const unsigned char* w, int lane, int n_units, uint4 (&st)[Q8xVG<T>::LOADS]) {
#pragma unroll
    for (int i = 0; i < Q8xVG<T>::LOADS; ++i)
        if (lane + 32 * i < n_units) st[i] = ld_stream(w + 16 * (lane + 32 * i));
}

template <int T>
__device__ __forceinline__ void group_store(unsigned char* buf, int lane, int n_units, const uint4 (&st)[Q8xVG<T>::LOADS]) {
#pragma unroll
    for (int i = 0; i < Q8xVG<T>::LOADS; ++i)
        if (lane + 32 * i < n_units) *reinterpret_cast<uint4*>(buf + 16 * (lane + 32 * i)) = st[i];
}

// Group grp (staged at g; with gated, the second operand's at g1) times the tokens' activations,
// this lane's part, into acc (up). (A flag, not a null g1: a shared pointer compared with null
// becomes a generic one.)
template <int T, int NT>
__device__ __forceinline__ void group_dot(const GemvQ8Params& p, const unsigned char* g, const unsigned char* g1, bool gated,
                                          int grp, float (&acc)[NT], float (&up)[NT]) {
    const int lane = threadIdx.x & 31, n_sub = p.n_in / 32;
    if constexpr (T == QB_Q6_K) {   // lane (n, h) of block lane / 4 (qb_q6k_group_lane)
        QbQ6Lane v, v1;
        qb_q6k_group_lane(reinterpret_cast<const unsigned*>(g), lane, v);
        if (gated) qb_q6k_group_lane(reinterpret_cast<const unsigned*>(g1), lane, v1);
        const int k = 2048 * grp + qb_q6k_lane_value(lane), sub = k / 32;
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (t < p.n_tok) {
                const signed char* a = p.xq + (long long)t * p.n_in + k;
                unsigned x[4][4];
#pragma unroll
                for (int gq = 0; gq < 4; ++gq) u4_words(__ldg(reinterpret_cast<const uint4*>(a + 32 * gq)), x[gq]);
                const float4 d4 = __ldg(reinterpret_cast<const float4*>(p.xd + (long long)t * n_sub + sub));
                const float xd[4] = {d4.x, d4.y, d4.z, d4.w};
                acc[t] += qb_q6k_lane_dot(v, x, xd);
                if (gated) up[t] += qb_q6k_lane_dot(v1, x, xd);
            }
        }
    } else {   // Q8_0: block lane of the group (qb_q8_0_group_lane)
        const int blk = 32 * grp + lane;
        if (blk >= p.n_in / 32) return;   // (a row's last group may be partial)
        unsigned w[8], w1[8];
        float d, d1 = 0.0f;
        qb_q8_0_group_lane(reinterpret_cast<const unsigned*>(g), lane, w, d);
        if (gated) qb_q8_0_group_lane(reinterpret_cast<const unsigned*>(g1), lane, w1, d1);
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (t < p.n_tok) {
                const uint4* a = reinterpret_cast<const uint4*>(p.xq + (long long)t * p.n_in + 32 * blk);
                unsigned x[8];
                u4_words(__ldg(a), *reinterpret_cast<unsigned (*)[4]>(x));
                u4_words(__ldg(a + 1), *reinterpret_cast<unsigned (*)[4]>(x + 4));
                const float xd = __ldg(p.xd + (long long)t * n_sub + blk);
                acc[t] += qb_q8_0_lane_dot(w, d, x, xd);
                if (gated) up[t] += qb_q8_0_lane_dot(w1, d1, x, xd);
            }
        }
    }
}

// One row of a group-staged type (w0; the gated mode's second operand w1, else null): U groups'
// units loaded together, stored to the warp's buffers, then each group's dot; with NS warps a
// row, this warp's chunks of U groups h, h + NS, ...
template <int T, int NT, int U = Q8xV<T, NT>::U, int NS = 1>
__device__ __forceinline__ void q8x_v_row_groups(const GemvQ8Params& p, const unsigned char* w0, const unsigned char* w1,
                                                 float (&acc)[NT], float (&up)[NT], int h = 0) {
    constexpr int GB = Q8xVG<T>::BYTES, LOADS = Q8xVG<T>::LOADS;
    __shared__ __align__(16) unsigned char gbuf[Q8X_VWARPS][2][U][GB + 16];   // (+16: a window's fifth word)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n_blk = p.n_in / QBlock<T>::VALUES, n_grp = (n_blk + Q8xVGroup<T>::BLOCKS - 1) / Q8xVGroup<T>::BLOCKS;
    const int row_units = n_blk * QBlock<T>::BYTES / 16;   // (rows of whole units)
    for (int g0 = U * h; g0 < n_grp; g0 += U * NS) {
        uint4 st[U][LOADS], st1[U][LOADS];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int units = min(Q8xVG<T>::UNITS, row_units - (g0 + u) * Q8xVG<T>::UNITS);   // <= 0 past the row
            group_load<T>(w0 + (long long)(g0 + u) * GB, lane, units, st[u]);
            if (w1) group_load<T>(w1 + (long long)(g0 + u) * GB, lane, units, st1[u]);
        }
        __syncwarp();   // the last step's reads of the buffers are done
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int units = min(Q8xVG<T>::UNITS, row_units - (g0 + u) * Q8xVG<T>::UNITS);
            group_store<T>(gbuf[warp][0][u], lane, units, st[u]);
            if (w1) group_store<T>(gbuf[warp][1][u], lane, units, st1[u]);
        }
        __syncwarp();
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (g0 + u < n_grp) group_dot<T, NT>(p, gbuf[warp][0][u], gbuf[warp][1][u], w1 != nullptr, g0 + u, acc, up);
    }
}

// G: the instance for every mode (1: the gated mode's second operand a run-time choice) or for
// modes 0 / 1 only (0): without the second operand's words a lane holds about two thirds of the
// registers (Q4_K NT 1: 78 against 122 at sm_90), so more warps fit an SM (6 blocks against 4),
// each with its row's loads in flight (the host's choice: matmul_dispatch.GEMV_ONE_TYPES). G 2
// (NT 1, modes 0 / 1): two warps a row, each its chunks of half the steps (U / 2), their lanes'
// sums added through shared memory before the row's end -- twice the warps for a matrix of few
// rows, whose one-row warps fill 1.3 waves of an SM's slots (4096 rows), so that its last wave's
// idle slots cost less (matmul_dispatch.GEMV_SPLIT_TYPES). GQ = G + 4: the same with the output's
// 8-bit form (q8x_out; instances of their own, so that the others keep their registers).
template <int T, int NT, int GQ>
__global__ void __launch_bounds__(Q8X_VWARPS * 32, (Q8xV<T, NT>::MINB)) dense_gemv_q8x_v(const GemvQ8Params p) {
    constexpr int G = GQ & 3;
    constexpr bool QO = GQ >= 4;
    constexpr int NS = G == 2 ? 2 : 1, U = NS == 1 ? Q8xV<T, NT>::U : (Q8xV<T, NT>::U + 1) / 2;
    static_assert(GQ >= 0 && GQ <= 6 && G <= 2 && (NS == 1 || NT == 1),
                  "G: 0 modes 0 / 1, 1 every mode, 2 split (one token); + 4 with the 8-bit output");
    const int warp = threadIdx.x >> 5, h = warp % NS;
    int r = blockIdx.x * (Q8X_VWARPS / NS) + warp / NS;
    GemvQSeg sg;
    if (G != 1 && p.mode == 2) __trap();      // (the host never launches it gated)
    float acc[NT], up[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = 0.0f, up[t] = 0.0f;
    if constexpr (NS == 1) {
        if (!gemv_segment(p, r, sg)) return;   // (no block barrier below)
        const unsigned char* w0 = sg.w + (long long)r * p.row_bytes;
        const unsigned char* w1 = G && p.mode == 2 ? p.seg[1].w + (long long)r * p.row_bytes : nullptr;
        q8x_enter(p, w0, w1);
        if constexpr (T == QB_Q6_K || T == QB_Q8_0) q8x_v_row_groups<T, NT>(p, w0, w1, acc, up);
        else q8x_v_row_k4<T, NT>(p, w0, w1, acc, up);
    } else {   // this warp's half of the row, then the second warp's lane sums to the first's
        __shared__ float part[Q8X_VWARPS / 2][NT][32];
        const int lane = threadIdx.x & 31;
        const bool live = gemv_segment(p, r, sg);   // (every warp to the barrier)
        if (live) {
            const unsigned char* w0 = sg.w + (long long)r * p.row_bytes;
            q8x_enter(p, w0, nullptr);
            if constexpr (T == QB_Q6_K || T == QB_Q8_0) q8x_v_row_groups<T, NT, U, NS>(p, w0, nullptr, acc, up, h);
            else q8x_v_row_k4<T, NT, U, NS>(p, w0, nullptr, acc, up, h);
        }
        if (h == 1) {
#pragma unroll
            for (int t = 0; t < NT; ++t) part[warp / 2][t][lane] = acc[t];
        }
        __syncthreads();
        if (h == 1 || !live) return;
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[t] += part[warp / 2][t][lane];
    }
    q8x_finish<NT, QO>(p, acc, up, sg, r);
}

// The ring GEMV (dense_gemv_q8x_r<T, NT>) for Q4_K / Q5_K / Q6_K / Q8_0 rows of whole 16-byte
// units: a grid of one wave (the host sizes it by the kernel's occupancy) whose warp gw takes rows
// gw, gw + GW, ... and streams every chunk of all of them through Q8xR<T, G>::STAGES shared-memory
// slots by cp.async (q8x_ring_stage), STAGES - 1 chunks in flight across its rows' boundaries, and
// multiplies each chunk with the vector form's lane arithmetic: a chunk is the vector form's step
// (Q4_K / Q5_K: 4 blocks, lane group lane / 8 the chunk's block lane / 8, its words read from the
// slot by q8x_v_load_smem, then q8x_v_block_k4) or its group (Q6_K 8 blocks, Q8_0 32: group_dot on
// the slot). The bytes in flight wait in shared memory, not in registers: ~4 KB a warp (Q4_K), 24
// warps an SM. (At 0ef699c / bca6c0e on the H100: the vector form holds its row in registers, ~37
// KB an SM, then multiplies with nothing in flight; a register ring held less; the staged ring's
// own arithmetic, ~6.6 instructions a value, bound it: bench/NOTES.md, twelfth session.) Its first
// STAGES - 1 chunks are requested before pdl_wait.
template <int T> struct Q8xRBlocks { static constexpr int N = 4; };   // blocks a chunk
template <> struct Q8xRBlocks<QB_Q6_K> { static constexpr int N = Q8xVGroup<QB_Q6_K>::BLOCKS; };
template <> struct Q8xRBlocks<QB_Q8_0> { static constexpr int N = Q8xVGroup<QB_Q8_0>::BLOCKS; };
template <int T> struct Q8xRChunk {   // a ring chunk of type T (either instance)
    static constexpr int BLOCKS = Q8xRBlocks<T>::N, BYTES = BLOCKS * QBlock<T>::BYTES, UNITS = BYTES / 16;
    static constexpr int SLOT = BYTES + 16;   // (+16: a group window's fifth word, as the vector form's buffers)
    static_assert(BYTES % 16 == 0, "a chunk is whole 16-byte units");
};
template <int T, int G> struct Q8xR : Q8xRChunk<T> {
    // slots a warp's operand, at most 8: the every-mode instance (G 1) as many as 48 KB of static
    // shared memory holds for two operands of every warp (Q4_K 8, Q5_K 8, Q6_K 3, Q8_0 5); the
    // one-operand instance (G 0) twice that in no more shared memory (Q6_K 6, the others 8), so
    // that no fewer blocks fit an SM (Q6_K at 7 slots: 4 blocks against 5)
    static constexpr int FIT2 = 49152 / (Q8X_SWARPS * 2 * Q8xRChunk<T>::SLOT), ST2 = FIT2 < 8 ? FIT2 : 8;
    static constexpr int STAGES = G ? ST2 : (2 * ST2 < 8 ? 2 * ST2 : 8);
    static_assert(STAGES >= 3, "a chunk's slot too large for the ring form");
};

// cp.async of ring chunk c of row w (row_bytes bytes, 16-byte aligned) into the shared slot at
// address slot: its UNITS 16-byte units (q8x_stage_units: those past the row's end zero-filled).
template <int T>
__device__ __forceinline__ void q8x_ring_stage(const unsigned char* w, int row_bytes, int c, unsigned slot, int lane) {
    q8x_stage_units<Q8xRChunk<T>::UNITS>(w, row_bytes, c * Q8xRChunk<T>::BYTES, slot, lane);
}

// Rows of the launch: the gated mode's segment, else every segment's.
__device__ __forceinline__ int q8x_rows(const GemvQ8Params& p) {
    if (p.mode == 2) return p.seg[0].rows;
    return p.seg[0].rows + (p.n_seg > 1 ? p.seg[1].rows : 0) + (p.n_seg > 2 ? p.seg[2].rows : 0);
}

// G: the instance for every mode (1: slots for the gated mode's two operands a warp) or for modes
// 0 / 1 only (0: one operand, twice its slots up to 8 in no more shared memory, and no second
// operand's registers), as the vector form's; GQ = G + 4 with the output's 8-bit form, as there.
template <int T, int NT, int GQ>
__global__ void __launch_bounds__(Q8X_SWARPS * 32) dense_gemv_q8x_r(const GemvQ8Params p) {
    static_assert(T == QB_Q4_K || T == QB_Q5_K || T == QB_Q6_K || T == QB_Q8_0, "the ring GEMV reads Q4_K / Q5_K / Q6_K / Q8_0 rows");
    constexpr int G = GQ & 3;
    constexpr bool QO = GQ >= 4;
    static_assert(G <= 1 && GQ <= 5, "G: 0 modes 0 / 1, 1 every mode; + 4 with the 8-bit output");
    constexpr int B = QBlock<T>::BYTES, SLOT = Q8xR<T, G>::SLOT, ST = Q8xR<T, G>::STAGES, BLOCKS = Q8xR<T, G>::BLOCKS;
    constexpr bool K4 = T == QB_Q4_K || T == QB_Q5_K;
    __shared__ __align__(16) unsigned char buf[Q8X_SWARPS][1 + G][ST][SLOT];
    if (!G && p.mode == 2) __trap();   // (the host never launches it gated)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, k = lane & 7, b0 = lane >> 3;
    const int gw = blockIdx.x * Q8X_SWARPS + warp, n_gw = gridDim.x * Q8X_SWARPS, rows = q8x_rows(p);
    const int row_bytes = (int)p.row_bytes, n_blk = p.n_in / QBlock<T>::VALUES, n_chunks = (n_blk + BLOCKS - 1) / BLOCKS;
    const int n_mine = gw < rows ? (rows - 1 - gw) / n_gw + 1 : 0;   // the warp's rows
    const int n_j = n_mine * n_chunks;   // its chunks (far below 2^31)
    const bool gated = G && p.mode == 2;
    const unsigned s0 = smem_u32(&buf[warp][0][0][0]), s1 = smem_u32(&buf[warp][G][0][0]);
    // the warp's chunk j is chunk j % n_chunks of its row j / n_chunks, in slot j % ST; stage() issues
    // the next one, (si, sc), its row's bytes found once a row
    int si = 0, sc = 0;
    const unsigned char *sw0 = nullptr, *sw1 = nullptr;
    auto stage = [&](int j) {
        if (sc == 0) {
            int r = gw + si * n_gw;
            GemvQSeg sg;
            gemv_segment(p, r, sg);
            sw0 = sg.w + (long long)r * row_bytes;
            sw1 = gated ? p.seg[1].w + (long long)r * row_bytes : nullptr;
        }
        q8x_ring_stage<T>(sw0, row_bytes, sc, s0 + (j % ST) * SLOT, lane);
        if (gated) q8x_ring_stage<T>(sw1, row_bytes, sc, s1 + (j % ST) * SLOT, lane);
        if (++sc == n_chunks) sc = 0, ++si;
    };
#pragma unroll
    for (int j = 0; j < ST - 1; ++j) {
        if (j < n_j) stage(j);
        cp_async_commit();
    }
    pdl_wait();   // (only weights read so far)
    float acc[NT], up[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = 0.0f, up[t] = 0.0f;
    for (int j = 0, i = 0, c = 0; j < n_j; ++j) {   // chunk j: chunk c of the warp's row i
        if (j + ST - 1 < n_j) stage(j + ST - 1);   // into the slot chunk j - 1 used (its reads are done)
        cp_async_commit();
        cp_async_wait<ST - 1>();   // chunk j is in
        __syncwarp();
        const int slot = j % ST;
        if constexpr (K4) {
            const int blk = BLOCKS * c + b0;
            if (blk < n_blk) {
                uint4 hd, qs, qh, hd1, qs1, qh1;
                q8x_v_load_smem<T>(&buf[warp][0][slot][b0 * B], k, hd, qs, qh);
                if (gated) q8x_v_load_smem<T>(&buf[warp][G][slot][b0 * B], k, hd1, qs1, qh1);
                q8x_v_block_k4<T, NT>(p, blk, gated, hd, qs, qh, hd1, qs1, qh1, acc, up);
            }
        } else {
            group_dot<T, NT>(p, buf[warp][0][slot], buf[warp][G][slot], gated, c, acc, up);
        }
        __syncwarp();   // every lane's reads of the slot are done before a later chunk fills it
        if (c == n_chunks - 1) {   // the row's last chunk: its sums out
            int r = gw + i * n_gw;
            GemvQSeg sg;
            gemv_segment(p, r, sg);
            q8x_finish<NT, QO>(p, acc, up, sg, r);
#pragma unroll
            for (int t = 0; t < NT; ++t) acc[t] = 0.0f, up[t] = 0.0f;
            c = 0, ++i;
        } else {
            ++c;
        }
    }
}

// ---------------------------------------------------------------------------------------
// The tiled block GEMM with 8-bit activations (dense_gemm_q8<T, BN>: int8 tensor cores on the
// blocks' integer form and the activations dense_quant_q8x made, as for the GEMV), for rows of
// whole 16-byte units (row_bytes a multiple of 16, W 16-byte aligned). Block tile Q8G_BM = 64
// weight rows x BN tokens, Q8G_WARPS = 8 warps (2 blocks an SM, 3 of the narrow tile: 16 / 24
// warps; with 4 warps a block, at 0d06753, 8-12 warps an SM left the steps latency-bound):
//   BN = 64, warps of 32 rows x 16 tokens (warp w: rows 32 (w % 2), tokens 16 (w / 2));
//   BN = 16 (calls of up to 16 tokens: a quarter of the activations' shared memory), warps of
//   16 x 8 (rows 16 (w % 4), tokens 8 (w / 4)).
// A step covers Q8G_BK = 256 values (one block of a K-quant row, eight of the 32-value types').
// Each step's raw weight bytes -- Q8gTile<T, BN>::RB a row, every row's run contiguous -- and its
// activations come by cp.async in 16-byte units into one of Q8G_STAGES stages (the next step's in
// flight while this one computes): whole lines a request, where dense_gemm_q (and this kernel's
// first form, at 457d60e) had each thread decode its own row's sub-block from global memory, 16
// rows a warp load, which kept L1 busy and left both flat in the tokens at ~0.4 TB/s. Then thread
// i decodes sub-blocks 2 (i / 64) and 2 (i / 64) + 1 of row i % 64 from the stage into their
// integer form (qb_int8s: the offset folded into signed bytes) in As and their factors f, c per
// half in Fs / Cs; per sub-block each warp's 16 x 8 tiles take one m16n8k32 (two m16n8k16 where
// the factors differ by half: QbQ8<T>::HALVES) and the integer sums become F32 at once
// (qb_q8s_dot: acc += xd (f S + c s); Q2_K's per-half mins from the activations' half sums Hs).
// Tokens of a warp's 8-wide tiles past n_tok skip their mma (their activations are not copied
// past the last 8-token tile). A staged row keeps its global bytes' alignment mod 16 (types whose
// RB is not a multiple of 16: the copy starts at the 16-byte unit below, UNITS units), so the
// decoders' word loads take the same path. Rows Q8G_LD = 272 bytes apart in As and Bs: a fragment
// load's 8 rows x 4 words on distinct banks. Shared memory: Q8gTile<T, BN>::SMEM bytes, dynamic
// (the host reads it from the cubin: dense_gemm_q8_smem, at the end of this file).
#define Q8G_BM 64
#define Q8G_BN 64       // the wide tile's tokens (the narrow one: 16)
#define Q8G_BK 256
#define Q8G_LD 272
#define Q8G_WARPS 8
#define Q8G_THREADS (32 * Q8G_WARPS)
#define Q8G_STAGES 2
#define Q8G_SUBS (Q8G_BK / 32)   // sub-blocks a step

struct GemmQ8Params {
    const unsigned char* w;   // (rows, row_bytes) blocks, 16-byte aligned rows
    const signed char* xq;    // (n_tok, n_in) int8, 16-byte aligned (n_in a multiple of 32)
    const float* xd;          // (n_tok, n_in / 32)
    const float* xs;          // (n_tok, n_in / 32)
    float* out;               // (n_tok, rows) F32
    float* part;              // gridDim.z > 1: (gridDim.z, n_tok, rows) F32 partial sums
    long long row_bytes;      // a multiple of 16
    int rows;
    int n_in;                 // a multiple of QBlock<T>::VALUES (and of 32)
    int n_tok;
    int k_chunk;              // values of n_in per split (blockIdx.z), a multiple of Q8G_BK
    int mode;                 // 0: out = W·x; 1: out += W·x (one split; more: dense_splitk_sum's mode)
    int pad_;
};

template <int T, int BN> struct Q8gTile {
    static constexpr int RB = Q8G_BK / QBlock<T>::VALUES * QBlock<T>::BYTES;   // a row's bytes a step
    static constexpr bool ALIGNED = RB % 16 == 0;   // every step's run starts 16-byte aligned (not Q2_K, Q3_K, Q6_K)
    static constexpr int UNITS = ALIGNED ? RB / 16 : (RB + 30) / 16;   // 16-byte units a row's copy
    static constexpr int SLOT = 16 * UNITS;                            // bytes between staged rows
    static constexpr int W_BYTES = Q8G_BM * SLOT;
    static constexpr int B_BYTES = BN * Q8G_LD;                        // the step's int8 activations
    static constexpr int D_BYTES = Q8G_SUBS * BN * 4;                  // their scales (Ds), then sums (Ss)
    static constexpr int STAGE = W_BYTES + B_BYTES + 2 * D_BYTES;
    static constexpr bool HALF_MINS = QbQ8<T>::HALVES && QbQ8<T>::OFF == 0;   // Q2_K: a min per half
    static constexpr int SMEM = Q8G_STAGES * STAGE + Q8G_BM * Q8G_LD      // stages, As
                                + 2 * Q8G_SUBS * Q8G_BM * 8                // Fs, Cs: [sub][row] float2
                                + (HALF_MINS ? Q8G_SUBS * 2 * BN * 4 : 0);   // Hs: [sub][half][token]
    // the warp tile: MI x 16 rows, NI x 8 tokens; RW warps along the rows, Q8G_WARPS / RW along the tokens
    static constexpr int MI = BN == 64 ? 2 : 1, RW = Q8G_BM / (16 * MI), NI = BN / 8 / (Q8G_WARPS / RW);
    static_assert(BN == 64 || BN == 16, "the wide and the narrow tile");
    static_assert(NI >= 1 && RW * (BN / (8 * NI)) == Q8G_WARPS, "the warps cover the tile");
};

// Step k0's copies into stage st (bytes of shared memory): the Q8G_BM rows' RB bytes from m0
// (zeros past rows or a row's end), the activations of tokens n0 .. n0 + n_cp (n_cp: the 8-token
// tiles that run; zeros past n_tok or n_in) and their Q8G_SUBS scales and sums; one commit group.
template <int T, int BN>
__device__ __forceinline__ void q8g_stage(const GemmQ8Params& p, unsigned char* st, int m0, int n0, int k0, int n_cp) {
    using TL = Q8gTile<T, BN>;
    const unsigned sw = smem_u32(st);
    stage_weight_rows<TL::RB, TL::UNITS, TL::SLOT, Q8G_BM, Q8G_THREADS>(p.w, p.row_bytes, p.rows, m0, k0 / Q8G_BK, sw);
    const unsigned sb = sw + TL::W_BYTES;
#pragma unroll
    for (int j = 0; j < (BN * 16 + Q8G_THREADS - 1) / Q8G_THREADS; ++j) {   // 16 units a token
        const int u = threadIdx.x + Q8G_THREADS * j, t = u >> 4, c = u & 15, k = k0 + 16 * c;
        if (t < n_cp) {   // (t < BN too: n_cp <= BN)
            const bool ok = n0 + t < p.n_tok && k < p.n_in;
            cp_async16(sb + t * Q8G_LD + 16 * c, ok ? p.xq + (long long)(n0 + t) * p.n_in + k : p.xq, ok ? 16 : 0);
        }
    }
    const unsigned sd = sb + TL::B_BYTES;
    const int n_sub = p.n_in / 32;
#pragma unroll
    for (int j = 0; j < (Q8G_SUBS * BN + Q8G_THREADS - 1) / Q8G_THREADS; ++j) {   // [sub][token]
        const int e = threadIdx.x + Q8G_THREADS * j, sub = e / BN, t = e % BN, ks = k0 / 32 + sub;
        if (e < Q8G_SUBS * BN && t < n_cp) {
            const bool ok = n0 + t < p.n_tok && ks < n_sub;
            const long long i = ok ? (long long)(n0 + t) * n_sub + ks : 0;
            cp_async4(sd + 4 * e, p.xd + i, ok ? 4 : 0);
            cp_async4(sd + TL::D_BYTES + 4 * e, p.xs + i, ok ? 4 : 0);
        }
    }
    cp_async_commit();
}

template <int T, int BN>
__global__ void __launch_bounds__(Q8G_THREADS, BN == 64 ? 2 : 3) dense_gemm_q8(const GemmQ8Params p) {
    using TL = Q8gTile<T, BN>;
    constexpr int MI = TL::MI, NI = TL::NI;
    constexpr int S = QBlock<T>::VALUES / 32, B = QBlock<T>::BYTES;
    constexpr bool HALVES = QbQ8<T>::HALVES, HALF_MINS = TL::HALF_MINS;
    extern __shared__ __align__(16) unsigned char q8g_smem[];
    signed char* As = reinterpret_cast<signed char*>(q8g_smem + Q8G_STAGES * TL::STAGE);
    float2* Fs = reinterpret_cast<float2*>(As + Q8G_BM * Q8G_LD);   // [sub][row]
    float2* Cs = Fs + Q8G_SUBS * Q8G_BM;
    int* Hs = reinterpret_cast<int*>(Cs + Q8G_SUBS * Q8G_BM);      // [sub][half][token] (Q2_K)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    constexpr int DS = Q8G_SUBS * Q8G_BM / Q8G_THREADS;   // sub-blocks a thread decodes a step
    static_assert(DS * Q8G_THREADS == Q8G_SUBS * Q8G_BM, "the decode's thread map: 64 rows x Q8G_SUBS / DS groups");
    static_assert(Q8G_BK % QBlock<T>::VALUES == 0, "whole blocks a step");
    float acc[MI][NI][4];
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int n = 0; n < NI; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][n][e] = 0.0f;
    const int m0 = blockIdx.x * Q8G_BM, n0 = blockIdx.y * BN, n_sub = p.n_in / 32;
    const int k_begin = blockIdx.z * p.k_chunk, k_end = min(p.n_in, k_begin + p.k_chunk);
    const int n_steps = k_end > k_begin ? (k_end - k_begin + Q8G_BK - 1) / Q8G_BK : 0;
    const int n_cp = min(BN, (p.n_tok - n0 + 7) & ~7);   // tokens of the 8-wide tiles that run
    const int wm = 16 * MI * (warp % TL::RW), wn = 8 * NI * (warp / TL::RW);
    const int dr = threadIdx.x % Q8G_BM, dj = threadIdx.x / Q8G_BM * DS;   // decode: row, first sub-block
    const bool drow = m0 + dr < p.rows;
#pragma unroll
    for (int s = 0; s < Q8G_STAGES - 1; ++s) {
        if (s < n_steps) q8g_stage<T, BN>(p, q8g_smem + s * TL::STAGE, m0, n0, k_begin + s * Q8G_BK, n_cp);
        else cp_async_commit();
    }
    for (int s = 0; s < n_steps; ++s) {
        cp_async_wait<Q8G_STAGES - 2>();
        __syncthreads();   // step s's stage is in; step s - 1's reads of As, Fs, Cs, Hs and of its stage are done
        {
            const int ns = s + Q8G_STAGES - 1;
            if (ns < n_steps)
                q8g_stage<T, BN>(p, q8g_smem + (ns % Q8G_STAGES) * TL::STAGE, m0, n0, k_begin + ns * Q8G_BK, n_cp);
            else cp_async_commit();
        }
        const unsigned char* st = q8g_smem + (s % Q8G_STAGES) * TL::STAGE;
        const signed char* Bs = reinterpret_cast<const signed char*>(st + TL::W_BYTES);
        const float* Ds = reinterpret_cast<const float*>(st + TL::W_BYTES + TL::B_BYTES);
        const float* Ss = Ds + Q8G_SUBS * BN;
        const int k0 = k_begin + s * Q8G_BK;
        // the row's run in the stage: its head (the run's offset mod 16) + whole blocks
        const unsigned char* wr = st + dr * TL::SLOT + (TL::ALIGNED ? 0 : (k0 / Q8G_BK * TL::RB) & 15);
#pragma unroll
        for (int j = dj; j < dj + DS; ++j) {
            int w[8];
            float f[2] = {0.0f, 0.0f}, c[2] = {0.0f, 0.0f};
            if (drow && k0 / 32 + j < n_sub) {
                qb_int8s<T>(wr + (j / S) * B, j % S, w, f, c);
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) w[i] = 0;
            }
            uint4* o = reinterpret_cast<uint4*>(As + dr * Q8G_LD + 32 * j);
            o[0] = make_uint4(w[0], w[1], w[2], w[3]);
            o[1] = make_uint4(w[4], w[5], w[6], w[7]);
            Fs[j * Q8G_BM + dr] = make_float2(f[0], f[1]);
            Cs[j * Q8G_BM + dr] = make_float2(c[0], c[1]);
        }
        if (HALF_MINS) {   // each half's activation sum of (sub-block e / BN, token e % BN)
#pragma unroll
            for (int i = 0; i < (Q8G_SUBS * BN + Q8G_THREADS - 1) / Q8G_THREADS; ++i) {
                const int e = threadIdx.x + Q8G_THREADS * i, j = e / BN, t = e % BN;
                if (e >= Q8G_SUBS * BN) break;
                const int* q = reinterpret_cast<const int*>(Bs + t * Q8G_LD + 32 * j);
                int s0 = 0, s1 = 0;
                if (t < n_cp) {
#pragma unroll
                    for (int k = 0; k < 4; ++k) s0 = __dp4a(0x01010101, q[k], s0), s1 = __dp4a(0x01010101, q[4 + k], s1);
                }
                Hs[(j * 2) * BN + t] = s0, Hs[(j * 2 + 1) * BN + t] = s1;
            }
        }
        __syncthreads();   // As, Fs, Cs, Hs of step s written
#pragma unroll 2
        for (int j = 0; j < Q8G_SUBS; ++j) {   // the step's sub-blocks
            unsigned a[MI][4];
#pragma unroll
            for (int i = 0; i < MI; ++i) {
                const signed char* ar = As + (wm + 16 * i + g) * Q8G_LD + 32 * j + 4 * tg;
                a[i][0] = *reinterpret_cast<const unsigned*>(ar);
                a[i][1] = *reinterpret_cast<const unsigned*>(ar + 8 * Q8G_LD);
                a[i][2] = *reinterpret_cast<const unsigned*>(ar + 16);
                a[i][3] = *reinterpret_cast<const unsigned*>(ar + 8 * Q8G_LD + 16);
            }
#pragma unroll
            for (int n = 0; n < NI; ++n) {
                if (n0 + wn + 8 * n >= p.n_tok) continue;   // (warp-uniform: no token of this tile)
                const signed char* br = Bs + (wn + 8 * n + g) * Q8G_LD + 32 * j + 4 * tg;
                const unsigned b0 = *reinterpret_cast<const unsigned*>(br), b1 = *reinterpret_cast<const unsigned*>(br + 16);
#pragma unroll
                for (int i = 0; i < MI; ++i) {
                    int d[4] = {0, 0, 0, 0}, d1[4] = {0, 0, 0, 0};
                    if (HALVES) {
                        mma_s8_k16(d, a[i][0], a[i][1], b0);
                        mma_s8_k16(d1, a[i][2], a[i][3], b1);
                    } else {
                        mma_s8_k32(d, a[i], b0, b1);
                    }
                    // d[e]: row wm + 16 i + g + 8 (e >> 1), token wn + 8 n + 2 tg + (e & 1)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int r = wm + 16 * i + g + 8 * (e >> 1), t = wn + 8 * n + 2 * tg + (e & 1);
                        const float2 f = Fs[j * Q8G_BM + r], c = Cs[j * Q8G_BM + r];
                        acc[i][n][e] += qb_q8s_dot<T>(d[e], d1[e], f.x, f.y, c.x, c.y, Ds[j * BN + t], Ss[j * BN + t],
                                                      HALF_MINS ? Hs[(j * 2) * BN + t] : 0,
                                                      HALF_MINS ? Hs[(j * 2 + 1) * BN + t] : 0);
                    }
                }
            }
        }
    }
    gemm_warp_store<MI, NI>(acc, gridDim.z > 1 ? p.part + (long long)blockIdx.z * p.n_tok * p.rows : p.out,
                            gridDim.z == 1 && p.mode == 1, p.rows, p.n_tok, m0 + wm, n0 + wn);
}

// The dynamic shared memory (bytes) a launch of dense_gemm_q8<T, BN> takes: the host reads it from
// the compiled program (ggml_attn/variants.py smem_expr, ggml_attn/cubin.py)
template <int T, int BN>
__device__ const int dense_gemm_q8_smem = Q8gTile<T, BN>::SMEM;
