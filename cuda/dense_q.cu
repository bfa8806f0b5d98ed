// The full block's matmuls over weights kept in ggml's blocks (graph/xp_ops.py; the blocks'
// layouts and decoding: quant_blocks.cuh), one NVRTC program per block type T (a ggml type id):
//   dense_gemv_q<T,NT>     y = W·x for n_tok <= NT tokens (NT 1, 2, 4, 8, 16): every weight byte
//                          read once per launch, decoded in registers, F32 activations and
//                          accumulation (no requantization of x); up to three matrices of type T
//                          in one launch, storing, accumulating (y += W·x) or gated
//                          (y = silu(W0·x) * (W1·x)), optionally of the RMS-normalized x times a
//                          norm weight g -- as dense.cu's dense_gemv for F16 weights;
//   dense_dequant_f16<T>   rows of W as F16 (a GEMM's input: more tokens go through cuBLAS);
//   dense_get_rows_q<T>    rows ids of a block table (the token embedding) as F32.
// Layouts (numpy order, C-contiguous): W (rows, row_bytes) bytes, n_in / QBlock<T>::VALUES
// blocks a row; x (n_tok, n_in) F32 with row stride x_stride; y (n_tok, rows) F32; g (n_in) F32.
#include <cuda_fp16.h>
#include "quant_blocks.cuh"
#include "dense_common.cuh"

struct GemvQSeg {
    const unsigned char* w;   // (rows, row_bytes), 2-byte aligned rows
    float* out;               // (n_tok, rows)
    int rows;
    int pad_;
};

struct GemvQParams {
    GemvQSeg seg[3];
    const float* x;           // (n_tok, n_in), rows x_stride floats apart, 16-byte aligned
    long long x_stride;
    const float* g;           // (n_in) norm weight multiplying the normalized x, 16-byte aligned; null: none
    long long row_bytes;      // bytes of a weight row
    int n_in;                 // a multiple of QBlock<T>::VALUES
    int n_tok;                // 1..NT
    int n_seg;                // 1..3 (mode 2: 2)
    int mode;                 // 0: store; 1: accumulate (out += W·x); 2: gated, seg[0].out = silu(W0·x) * (W1·x)
    float norm_eps;           // > 0: x is RMS-normalized first (per token)
    int pad_;
};

// Row w (n_in values of type T) dotted with the first n_tok rows of x, times g: acc[t] (the
// full sums in every lane, before the norm's scale). Lane l decodes the 32-value sub-blocks
// l, l + 32, ...: a warp step reads 32 consecutive sub-blocks (4 K-quant super-blocks, or 32
// small blocks) of the row.
template <int T, int NT>
__device__ __forceinline__ void qrow_dot(const unsigned char* w, const GemvQParams& p, float (&acc)[NT]) {
    constexpr int S = QBlock<T>::VALUES / 32, B = QBlock<T>::BYTES;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
    const int n_sub = p.n_in / 32;
    for (int sub = lane; sub < n_sub; sub += 32) {
        float v[32];
        qb_dequant32<T>(w + (long long)(sub / S) * B, sub % S, v);
        const int k = sub * 32;
        if (p.g) {
            const float4* g4 = reinterpret_cast<const float4*>(p.g + k);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float4 gv = __ldg(g4 + j);
                v[4 * j] *= gv.x, v[4 * j + 1] *= gv.y, v[4 * j + 2] *= gv.z, v[4 * j + 3] *= gv.w;
            }
        }
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (t < p.n_tok) {
                const float4* x4 = reinterpret_cast<const float4*>(p.x + t * p.x_stride + k);
                float a = acc[t];
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const float4 xv = __ldg(x4 + j);
                    a = fmaf(v[4 * j], xv.x, a);
                    a = fmaf(v[4 * j + 1], xv.y, a);
                    a = fmaf(v[4 * j + 2], xv.z, a);
                    a = fmaf(v[4 * j + 3], xv.w, a);
                }
                acc[t] = a;
            }
        }
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], o);
    }
}

// One warp per output row (of the segments' rows concatenated); block GEMV_WARPS warps.
template <int T, int NT>
__global__ void __launch_bounds__(GEMV_WARPS * 32, NT >= 16 ? 3 : 4) dense_gemv_q(const GemvQParams p) {
    int r = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    float s[NT];
    rms_scales<NT>(p.x, p.x_stride, p.n_in, p.n_tok, p.norm_eps, s);   // every thread, then rows past the end leave
    GemvQSeg sg;
    if (!gemv_segment(p, r, sg)) return;
    float acc[NT];
    qrow_dot<T, NT>(sg.w + (long long)r * p.row_bytes, p, acc);
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] *= s[t];
    if (p.mode == 2) {
        float up[NT];
        qrow_dot<T, NT>(p.seg[1].w + (long long)r * p.row_bytes, p, up);
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            up[t] *= s[t];
            acc[t] = acc[t] / (1.0f + expf(-acc[t])) * up[t];
        }
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        if (lane == t && t < p.n_tok) {
            float* o = sg.out + (long long)t * sg.rows + r;
            *o = p.mode == 1 ? *o + acc[t] : acc[t];
        }
    }
}

// out (rows, n_in) F16 = W's values rounded to F16; a thread per 32-value sub-block, grid-stride.
template <int T>
__global__ void __launch_bounds__(256) dense_dequant_f16(const unsigned char* __restrict__ w, __half* __restrict__ out,
                                                         long long row_bytes, int n_in, long long rows) {
    constexpr int S = QBlock<T>::VALUES / 32, B = QBlock<T>::BYTES;
    const int per_row = n_in / 32;
    const long long n = rows * per_row;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x) {
        const long long row = e / per_row;
        const int sub = (int)(e - row * per_row);
        float v[32];
        qb_dequant32<T>(w + row * row_bytes + (long long)(sub / S) * B, sub % S, v);
        __half2* o = reinterpret_cast<__half2*>(out + row * n_in + 32 * sub);
#pragma unroll
        for (int j = 0; j < 16; ++j) o[j] = __floats2half2_rn(v[2 * j], v[2 * j + 1]);
    }
}

// out (n_ids, n_in) F32 = rows ids of the block table w (ids in range: the caller checked them);
// a thread per 32-value sub-block, grid-stride.
template <int T>
__global__ void __launch_bounds__(256) dense_get_rows_q(const unsigned char* __restrict__ w, const int* __restrict__ ids,
                                                        float* __restrict__ out, long long row_bytes, int n_in,
                                                        long long n_ids) {
    constexpr int S = QBlock<T>::VALUES / 32, B = QBlock<T>::BYTES;
    const int per_row = n_in / 32;
    const long long n = n_ids * per_row;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x) {
        const long long i = e / per_row;
        const int sub = (int)(e - i * per_row);
        float v[32];
        qb_dequant32<T>(w + (long long)ids[i] * row_bytes + (long long)(sub / S) * B, sub % S, v);
        float4* o = reinterpret_cast<float4*>(out + i * n_in + 32 * sub);
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j] = make_float4(v[4 * j], v[4 * j + 1], v[4 * j + 2], v[4 * j + 3]);
    }
}
