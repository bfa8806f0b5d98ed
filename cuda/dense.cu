// Dense ops of the full transformer block for device-resident graphs (graph/xp_ops.py), in as
// few launches as a decode step allows:
//   dense_gemv<NT,U> y = W·x for NT <= 4 tokens (F16 weights, F32 activations rounded to F16,
//                    F32 accumulation), up to three weight matrices in one launch, optionally
//                    accumulating into y (the residual add) or gated (y = silu(W0·x) * (W1·x)),
//                    optionally of the RMS-normalized x (the norm computed by every block; the
//                    norm's weight is folded into W at load: graph/model_device.py);
//   dense_rms_norm   y = x / sqrt(mean(x^2) + eps) (* g) per token, one launch, in F32 and/or
//                    F16 (a GEMM's input);
//   dense_silu_mul / dense_gelu_mul  y = act(g) * u, elementwise (the GEMMs' gated FFN), in F32
//                    and, where asked, F16 as well (the down projection's GEMM input);
//   dense_kv_store   a layer's K and V rows scattered into the cache (F32 -> F16/F32, or
//                    quantized to Q8_0/Q4_0 blocks as ggml's CPU reference does), one launch.
// Layouts (numpy order, C-contiguous unless a stride says otherwise): W (rows, n_in) F16,
// x (n_tok, n_in) F32 with row stride x_stride, y (n_tok, rows) F32, g (n_in) F32.
// dense_q.cu has the same GEMV over ggml's weight blocks.
#include <cuda_fp16.h>
#include "dense_common.cuh"

struct GemvSeg {
    const __half* w;   // (rows, n_in), 16-byte aligned rows
    float* out;        // (n_tok, rows)
    int rows;
    int pad_;
};

struct GemvParams {
    GemvSeg seg[3];
    const float* x;       // (n_tok, n_in), rows x_stride floats apart, 16-byte aligned
    long long x_stride;
    int n_in;             // multiple of 8
    int n_seg;            // 1..3 (mode 2: 2)
    int mode;             // 0: store; 1: accumulate (out += W·x); 2: gated, seg[0].out = silu(W0·x) * (W1·x)
    float norm_eps;       // > 0: x is RMS-normalized first (x / sqrt(mean(x^2) + norm_eps), per token)
};

// The 8 activations x[k .. k+8) times s rounded to F16 (as ggml rounds src1 for an F16 weight).
__device__ __forceinline__ void load_x8(const float* x, float s, float2 (&o)[4]) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(x));
    const float4 b = __ldg(reinterpret_cast<const float4*>(x) + 1);
    o[0] = __half22float2(__floats2half2_rn(a.x * s, a.y * s));
    o[1] = __half22float2(__floats2half2_rn(a.z * s, a.w * s));
    o[2] = __half22float2(__floats2half2_rn(b.x * s, b.y * s));
    o[3] = __half22float2(__floats2half2_rn(b.z * s, b.w * s));
}

template <int NT>
__device__ __forceinline__ void dot8(const uint4 w, const float* x, long long xs, int k, const float (&s)[NT],
                                     float (&acc)[NT]) {
    const unsigned u[4] = {w.x, w.y, w.z, w.w};
    float2 wf[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) wf[j] = __half22float2(*reinterpret_cast<const __half2*>(&u[j]));
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        float2 xf[4];
        load_x8(x + t * xs + k, s[t], xf);
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[t] = fmaf(wf[j].y, xf[j].y, fmaf(wf[j].x, xf[j].x, acc[t]));
    }
}

// Row r of W (n_in halves) dotted with every token's x times s[t]: acc[t] (full sums in every
// lane). U: 16-byte weight loads in flight per lane before any math.
template <int NT, int U>
__device__ __forceinline__ void row_dot(const __half* w, const float* x, long long xs, int n_in,
                                        const float (&s)[NT], float (&acc)[NT]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
    int k = lane * 8;
    for (; k + (U - 1) * 256 < n_in; k += U * 256) {
        uint4 wv[U];
#pragma unroll
        for (int i = 0; i < U; ++i) wv[i] = ld_stream(w + k + i * 256);
#pragma unroll
        for (int i = 0; i < U; ++i) dot8<NT>(wv[i], x, xs, k + i * 256, s, acc);
    }
    for (; k < n_in; k += 256) dot8<NT>(ld_stream(w + k), x, xs, k, s, acc);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], o);
    }
}

// One warp per output row (of the segments' rows concatenated); block GEMV_WARPS warps.
template <int NT, int U>
__global__ void __launch_bounds__(GEMV_WARPS * 32, 4) dense_gemv(const GemvParams p) {
    int r = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    // the RMS norm's scale of each token (every thread of the block takes part, then rows past
    // the end leave)
    float s[NT];
    rms_scales<NT>(p.x, p.x_stride, p.n_in, NT, p.norm_eps, s);
    GemvSeg sg;
    if (!gemv_segment(p, r, sg)) return;
    float acc[NT];
    row_dot<NT, U>(sg.w + (long long)r * p.n_in, p.x, p.x_stride, p.n_in, s, acc);
    if (p.mode == 2) {
        float up[NT];
        row_dot<NT, U>(p.seg[1].w + (long long)r * p.n_in, p.x, p.x_stride, p.n_in, s, up);
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[t] = silu_f(acc[t]) * up[t];
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        if (lane == t) {
            float* o = sg.out + (long long)t * sg.rows + r;
            *o = p.mode == 1 ? *o + acc[t] : acc[t];
        }
    }
}

// One block per token (x and y rows n floats apart); times g (n floats) when g is not null. The
// result goes to y (F32) and to y16 (F16, rounded to nearest: the GEMMs' input, which then needs no
// cast of its own), each where not null. A row of at most 4 * 256 * RMS_V4 values, a multiple of 4
// with every array 16-byte aligned, is read once into registers as float4s (one pass over
// memory, 16-byte accesses); others through the strided loop (read twice).
#define RMS_V4 8
extern "C" __global__ void __launch_bounds__(256) dense_rms_norm(const float* __restrict__ x,
                                                                 float* __restrict__ y, int n, float eps,
                                                                 const float* __restrict__ g,
                                                                 __half* __restrict__ y16) {
    __shared__ float red[8];
    const float* xr = x + (long long)blockIdx.x * n;
    float* yr = y ? y + (long long)blockIdx.x * n : nullptr;
    __half* hr = y16 ? y16 + (long long)blockIdx.x * n : nullptr;
    const bool held = blockDim.x == 256 && (n & 3) == 0 && n <= 4 * 256 * RMS_V4 &&
                      ((reinterpret_cast<unsigned long long>(xr) | reinterpret_cast<unsigned long long>(yr) |
                        reinterpret_cast<unsigned long long>(hr) | reinterpret_cast<unsigned long long>(g)) & 15) == 0;
    const int n4 = n >> 2;
    float4 v[RMS_V4];
    float ss = 0.0f;
    if (held) {
#pragma unroll
        for (int k = 0; k < RMS_V4; ++k) {
            const int i = threadIdx.x + 256 * k;
            v[k] = i < n4 ? reinterpret_cast<const float4*>(xr)[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            ss += v[k].x * v[k].x + v[k].y * v[k].y + v[k].z * v[k].z + v[k].w * v[k].w;
        }
    } else {
        for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    __syncthreads();
    ss = 0.0f;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) ss += red[w];
    const float d = sqrtf(ss / (float)n + eps);
    if (held) {
#pragma unroll
        for (int k = 0; k < RMS_V4; ++k) {
            const int i = threadIdx.x + 256 * k;
            if (i >= n4) break;
            float4 o = make_float4(v[k].x / d, v[k].y / d, v[k].z / d, v[k].w / d);
            if (g) {
                const float4 w = reinterpret_cast<const float4*>(g)[i];
                o = make_float4(o.x * w.x, o.y * w.y, o.z * w.z, o.w * w.w);
            }
            if (yr) reinterpret_cast<float4*>(yr)[i] = o;
            if (hr) {
                const __half2 h[2] = {__floats2half2_rn(o.x, o.y), __floats2half2_rn(o.z, o.w)};
                reinterpret_cast<uint2*>(hr)[i] = *reinterpret_cast<const uint2*>(h);
            }
        }
        return;
    }
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float val = g ? (xr[i] / d) * g[i] : xr[i] / d;
        if (yr) yr[i] = val;
        if (hr) hr[i] = __float2half_rn(val);
    }
}

// y[i] = (half) x[i], round to nearest (the GEMMs' F16 input), i < n; a grid-stride loop.
extern "C" __global__ void __launch_bounds__(256) dense_cast_f16(const float* __restrict__ x,
                                                                 __half* __restrict__ y, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = __float2half_rn(x[i]);
}

// y[i] = act(g[i]) * u[i] (ACT's op), F32, i < n; a grid-stride loop, four values a thread and step
// where n is a multiple of 4 and every array 16-byte aligned (y16 8-byte), else one. y16 (where not
// null): the same values rounded to F16 (the down projection's GEMM input, no cast launch between).
template <typename ACT>
__device__ __forceinline__ void act_mul(const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ y,
                                        __half* __restrict__ y16, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x, t0 = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const bool vec = (n & 3) == 0 && ((reinterpret_cast<unsigned long long>(g) | reinterpret_cast<unsigned long long>(u) |
                                       reinterpret_cast<unsigned long long>(y)) & 15) == 0 &&
                     (reinterpret_cast<unsigned long long>(y16) & 7) == 0;
    if (vec) {
        for (long long i = t0; i < n / 4; i += stride) {
            const float4 a = reinterpret_cast<const float4*>(g)[i], b = reinterpret_cast<const float4*>(u)[i];
            const float4 v = make_float4(ACT::f(a.x) * b.x, ACT::f(a.y) * b.y, ACT::f(a.z) * b.z, ACT::f(a.w) * b.w);
            reinterpret_cast<float4*>(y)[i] = v;
            if (y16) {
                const __half2 h[2] = {__floats2half2_rn(v.x, v.y), __floats2half2_rn(v.z, v.w)};
                reinterpret_cast<uint2*>(y16)[i] = *reinterpret_cast<const uint2*>(h);
            }
        }
        return;
    }
    for (long long i = t0; i < n; i += stride) {
        const float v = ACT::f(g[i]) * u[i];
        y[i] = v;
        if (y16) y16[i] = __float2half_rn(v);
    }
}

struct SiluAct {   // g / (1 + exp(-g))
    static __device__ __forceinline__ float f(float x) { return silu_f(x); }
};
struct GeluAct {   // ggml's tanh GELU, 0.5 g (1 + tanh(sqrt(2/pi) g (1 + 0.044715 g^2)))
    static __device__ __forceinline__ float f(float x) {
        return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * x * (1.0f + 0.044715f * x * x)));
    }
};

// y = silu(g) * u (the gated FFN); act_mul's layout.
extern "C" __global__ void __launch_bounds__(256) dense_silu_mul(const float* __restrict__ g,
                                                                 const float* __restrict__ u,
                                                                 float* __restrict__ y, __half* __restrict__ y16,
                                                                 long long n) {
    act_mul<SiluAct>(g, u, y, y16, n);
}

// y = gelu(g) * u with ggml's tanh GELU (gemma's GeGLU); act_mul's layout.
extern "C" __global__ void __launch_bounds__(256) dense_gelu_mul(const float* __restrict__ g,
                                                                 const float* __restrict__ u,
                                                                 float* __restrict__ y, __half* __restrict__ y16,
                                                                 long long n) {
    act_mul<GeluAct>(g, u, y, y16, n);
}

// Cache row types of dense_kv_store: ggml's type ids (ggml.h enum ggml_type).
#define KV_TYPE_F32 0
#define KV_TYPE_F16 1
#define KV_TYPE_Q4_0 2
#define KV_TYPE_Q8_0 8

struct KVStoreParams {
    const float* src[2];      // K rows (n_tok, n[0]) F32, V rows (n_tok, n[1]) F32, contiguous
    void* dst[2];             // cache (kv_size * n_stream) rows of n[i] values of type[i]: F16/F32
                              // (2/4 bytes a value), Q8_0 (34-byte blocks of 32), Q4_0 (18-byte blocks)
    const long long* rows;    // (n_tok,) destination row of each token
    int n[2];                 // values per row; a multiple of 32 for Q8_0/Q4_0
    int type[2];              // KV_TYPE_* of each cache
    int n_tok;
    int pad_;
};

// ggml's quantize_row_q8_0_ref (ggml/src/ggml-quants.c) of one block of 32 values, lane j holding
// x[j]: d = amax / 127, q = roundf(x / d) (x * (1/d), as ggml: not x * 127 / amax); written as
// f16 d, then the 32 int8 q. The _rn intrinsics keep each operation rounded on its own (no FMA
// contraction), as the CPU reference computes.
__device__ __forceinline__ void store_block_q8_0(unsigned char* blk, float x) {
    const int lane = threadIdx.x & 31;
    float amax = fabsf(x);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float d = __fdiv_rn(amax, 127.0f);
    const float id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
    if (lane == 0) *reinterpret_cast<__half*>(blk) = __float2half_rn(d);
    blk[2 + lane] = (unsigned char)(signed char)roundf(__fmul_rn(x, id));
}

// ggml's quantize_row_q4_0_ref of one block of 32 values, lane j holding x[j]: max = the value of
// largest |x| (the first such, in value order; +0 when all are zero), d = max / -8,
// q = min(15, (int)(x * (1/d) + 8.5)), byte j (j < 16) = q[j] | q[j + 16] << 4 after the f16 d.
__device__ __forceinline__ void store_block_q4_0(unsigned char* blk, float x) {
    const int lane = threadIdx.x & 31;
    float a = fabsf(x), m = x;
    int at = lane;
    if (!(a > 0.0f)) a = 0.0f, m = 0.0f, at = 32;   // zeros (and NaN) never replace the start value +0
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float a2 = __shfl_xor_sync(0xffffffffu, a, o), m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const int at2 = __shfl_xor_sync(0xffffffffu, at, o);
        if (a2 > a || (a2 == a && at2 < at)) a = a2, m = m2, at = at2;
    }
    const float d = __fdiv_rn(m, -8.0f);
    const float id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
    const int q = min(15, (int)(signed char)__float2int_rz(__fadd_rn(__fmul_rn(x, id), 8.5f)));
    const int hi = __shfl_down_sync(0xffffffffu, q, 16);
    if (lane == 0) *reinterpret_cast<__half*>(blk) = __float2half_rn(d);
    if (lane < 16) blk[2 + lane] = (unsigned char)(q | (hi << 4));
}

// Grid (n_tok, 2): block y = 0 stores K, 1 stores V. F16/F32: a value per thread; Q8_0/Q4_0: a
// block of 32 values per warp (each warp takes blocks warp, warp + 4, ...).
extern "C" __global__ void __launch_bounds__(128) dense_kv_store(const KVStoreParams p) {
    const int t = blockIdx.x, kind = blockIdx.y, n = kind ? p.n[1] : p.n[0];
    const int type = kind ? p.type[1] : p.type[0];
    const float* src = (kind ? p.src[1] : p.src[0]) + (long long)t * n;
    void* dst_base = kind ? p.dst[1] : p.dst[0];
    const long long row = p.rows[t];
    if (type == KV_TYPE_F16) {
        __half* dst = static_cast<__half*>(dst_base) + row * n;
        for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = __float2half_rn(src[i]);
    } else if (type == KV_TYPE_F32) {
        float* dst = static_cast<float*>(dst_base) + row * n;
        for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
    } else {
        const bool q8 = type == KV_TYPE_Q8_0;
        const int blk_bytes = q8 ? 34 : 18, n_blk = n / 32;
        unsigned char* dst = static_cast<unsigned char*>(dst_base) + row * (long long)(n_blk * blk_bytes);
        const int lane = threadIdx.x & 31;
        for (int b = threadIdx.x >> 5; b < n_blk; b += blockDim.x >> 5) {
            const float x = src[b * 32 + lane];
            if (q8) store_block_q8_0(dst + b * blk_bytes, x);
            else store_block_q4_0(dst + b * blk_bytes, x);
        }
    }
}
