// The block GEMV with 8-bit activations (the alternative to dense_q.cu's F32 ones, as llama.cpp's
// mmvq does): x is quantized once per ubatch to int8 per 32 values (a scale each), and each lane
// multiplies its weight sub-block in integer form with IDP4A, four values an instruction, the
// block's scales applied to the integer sums (qb_int32 / qb_dot_q8 in quant_blocks.cuh, checked
// on the host against ggml's values by tests/test_quant_blocks.py). ncu on the H100 counted ~10
// instructions a value for dense_gemv_q (F32 decode, one FFMA a value): this path needs ~1.5-3.
//   dense_quant_q8x        x (times the norm weight g, RMS-normalized with eps > 0) -> xq int8,
//                          xd (the scale of each 32 values: amax / 127), xs (the sum of their
//                          int8 values), per token;
//   dense_gemv_q8x<T, NT>  y = W·x for n_tok <= NT tokens over weights of block type T (every
//                          block type), modes as dense_gemv_q's (store, accumulate, gated:
//                          silu(W0·x) * (W1·x));
//   dense_gemv_q8x_s<T, NT> the same with each warp's row streamed through shared memory (rows
//                          of whole 16-byte units).
// Layouts (numpy order, C-contiguous): x (n_tok, n_in) F32 rows x_stride apart (16-byte aligned); xq (n_tok, n_in)
// int8; xd, xs (n_tok, n_in / 32) F32; W (rows, row_bytes) bytes; y (n_tok, rows) F32.
#include <cuda_fp16.h>
#include "quant_blocks.cuh"
#include "dense_common.cuh"
#include "mma_ptx.cuh"   // smem_u32, cp.async

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
};

// Grid (n_in / 256 rounded up, n_tok), 256 threads: warp w quantizes sub-block 8 blockIdx.x + w
// of token blockIdx.y -- v = x * g * scale, d = max|v| / 127, q = round(v / d) (0 where d is 0),
// xs = sum of q -- after, with eps > 0, every block reduced the token's whole row for the RMS
// scale (L2-resident; one block a token held ~13 us a call on the H100 at b63b788, one warp
// walking 16-56 sub-blocks in turn). x's rows 16-byte aligned.
extern "C" __global__ void __launch_bounds__(256) dense_quant_q8x(const float* __restrict__ x, long long x_stride,
                                                                 const float* __restrict__ g, float eps, int n_in,
                                                                 signed char* __restrict__ xq,
                                                                 float* __restrict__ xd, float* __restrict__ xs) {
    const int t = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float* xr = x + (long long)t * x_stride;
    __shared__ float red[8];
    float scale = 1.0f;
    if (eps > 0.0f) {
        float ss = 0.0f;
        const float4* x4 = reinterpret_cast<const float4*>(xr);
        for (int i = threadIdx.x; i < n_in / 4; i += 256) {
            const float4 v = __ldg(x4 + i);
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (lane == 0) red[warp] = ss;
        __syncthreads();
        ss = 0.0f;
#pragma unroll
        for (int w = 0; w < 8; ++w) ss += red[w];
        scale = 1.0f / sqrtf(ss / (float)n_in + eps);
    }
    const int n_sub = n_in / 32, s = 8 * blockIdx.x + warp;
    if (s >= n_sub) return;
    const int k = 32 * s + lane;
    const float v = xr[k] * (g ? g[k] : 1.0f) * scale;
    float amax = fabsf(v);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float d = amax / 127.0f;
    const int q = d > 0.0f ? __float2int_rn(v / d) : 0;
    int sum = q;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    xq[(long long)t * n_in + k] = (signed char)q;
    if (lane == 0) {
        xd[(long long)t * n_sub + s] = d;
        xs[(long long)t * n_sub + s] = (float)sum;
    }
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
    qb_int32<T>(b0, sub % S, w, f, c);
    if (b1) qb_int32<T>(b1, sub % S, wu, fu, cu);
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
    float acc[NT], up[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = 0.0f, up[t] = 0.0f;
    for (int sub = lane; sub < p.n_in / 32; sub += 32) {
        Q8xAct x[q8x_ahead(NT)];
        q8x_load<NT>(p, sub, x);
        const long long off = (long long)(sub / S) * B;
        q8x_sub<T, NT>(p, w0 + off, w1 ? w1 + off : nullptr, sub, x, acc, up);
    }
    float one[NT];   // (the norm was applied when x was quantized)
#pragma unroll
    for (int t = 0; t < NT; ++t) one[t] = 1.0f;
    gemv_q_finish<NT>(acc, up, one, p.mode, p.n_tok, sg, r);
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

// cp.async of chunk c of row w (row_bytes bytes, 16-byte aligned): the UNITS 16-byte units from
// its first byte rounded down to 16 into the shared slot at address slot (so that byte lands at
// its row offset mod 16); units at or past the row's end are zero-filled, nothing read. A fixed
// unit count and 32-bit offsets: the copy is a few instructions a lane (a count computed per
// chunk and 64-bit offsets made it ~100 a chunk at b63b788).
template <int T>
__device__ __forceinline__ void q8x_stage(const unsigned char* w, int row_bytes, int c, unsigned slot, int lane) {
    constexpr int UNITS = Q8xChunk<T>::UNITS;
    const int a0 = (c * Q8xChunk<T>::BYTES) & ~15;
#pragma unroll
    for (int k = 0; k < (UNITS + 31) / 32; ++k) {
        const int u = lane + 32 * k, o = a0 + 16 * u;
        if (UNITS % 32 == 0 || u < UNITS) cp_async16(slot + 16u * u, w + (o < row_bytes ? o : 0), o < row_bytes ? 16 : 0);
    }
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
    float one[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) one[t] = 1.0f;
    gemv_q_finish<NT>(acc, up, one, p.mode, p.n_tok, sg, r);
}
