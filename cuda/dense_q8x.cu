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
//                          silu(W0·x) * (W1·x)).
// Layouts (numpy order, C-contiguous): x (n_tok, n_in) F32 rows x_stride apart; xq (n_tok, n_in)
// int8; xd, xs (n_tok, n_in / 32) F32; W (rows, row_bytes) bytes; y (n_tok, rows) F32.
#include <cuda_fp16.h>
#include "quant_blocks.cuh"
#include "dense_common.cuh"

#define Q8X_WARPS 8   // warps a block, a row each

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

// One block of 256 threads per token: the RMS scale (eps > 0), then a warp per 32 values:
// v = x * g * scale, d = max|v| / 127, q = round(v / d) (0 where d is 0), xs = sum of q.
extern "C" __global__ void __launch_bounds__(256) dense_quant_q8x(const float* __restrict__ x, long long x_stride,
                                                                 const float* __restrict__ g, float eps, int n_in,
                                                                 signed char* __restrict__ xq,
                                                                 float* __restrict__ xd, float* __restrict__ xs) {
    const int t = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float* xr = x + (long long)t * x_stride;
    __shared__ float red[8];
    float scale = 1.0f;
    if (eps > 0.0f) {
        float ss = 0.0f;
        for (int i = threadIdx.x; i < n_in; i += 256) ss += xr[i] * xr[i];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (lane == 0) red[warp] = ss;
        __syncthreads();
        ss = 0.0f;
#pragma unroll
        for (int w = 0; w < 8; ++w) ss += red[w];
        scale = 1.0f / sqrtf(ss / (float)n_in + eps);
    }
    const int n_sub = n_in / 32;
    for (int s = warp; s < n_sub; s += 8) {
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
}

// The 32 activations of sub-block s of token t as eight int8x4 words.
__device__ __forceinline__ void q8x_load(const GemvQ8Params& p, int t, int s, int (&a)[8]) {
    const int4* src = reinterpret_cast<const int4*>(p.xq + (long long)t * p.n_in + 32 * s);
    const int4 u = __ldg(src), v = __ldg(src + 1);
    a[0] = u.x, a[1] = u.y, a[2] = u.z, a[3] = u.w, a[4] = v.x, a[5] = v.y, a[6] = v.z, a[7] = v.w;
}

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
    const int n_sub = p.n_in / 32;
    for (int sub = lane; sub < n_sub; sub += 32) {
        int w[8], a[8];
        float f[2], c[2];
        qb_int32<T>(w0 + (long long)(sub / S) * B, sub % S, w, f, c);
        int wu[8];
        float fu[2], cu[2];
        if (w1) qb_int32<T>(w1 + (long long)(sub / S) * B, sub % S, wu, fu, cu);
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (t < p.n_tok) {
                q8x_load(p, t, sub, a);
                const float xd = __ldg(p.xd + (long long)t * n_sub + sub), xs = __ldg(p.xs + (long long)t * n_sub + sub);
                acc[t] += qb_dot_q8<T>(w, f, c, a, xd, xs);
                if (w1) up[t] += qb_dot_q8<T>(wu, fu, cu, a, xd, xs);
            }
        }
    }
    float one[NT];   // (the norm was applied when x was quantized)
#pragma unroll
    for (int t = 0; t < NT; ++t) one[t] = 1.0f;
    gemv_q_finish<NT>(acc, up, one, p.mode, p.n_tok, sg, r);
}
