// The full block's matmuls over weights kept in ggml's blocks (graph/xp_ops.py; the blocks'
// layouts and decoding: quant_blocks.cuh), one NVRTC program per block type T (a ggml type id):
//   dense_gemv_q<T,NT>     y = W·x for n_tok <= NT tokens (NT 1, 2, 4, 8, 16): every weight byte
//                          read once per launch, decoded in registers, F32 activations (staged in
//                          shared memory per block, times g) and accumulation (no requantization
//                          of x); up to three matrices of type T
//                          in one launch, storing, accumulating (y += W·x) or gated
//                          (y = silu(W0·x) * (W1·x)), optionally of the RMS-normalized x times a
//                          norm weight g -- as dense.cu's dense_gemv for F16 weights;
//   dense_gemm_q<T>        y = W·x for more tokens: 64 x 64 output tiles on the tensor cores
//                          (mma.sync m16n8k16, F16 operands, F32 sums), each 64-value step of W
//                          decoded from its blocks into shared memory; x as F16; split over n_in
//                          into partial sums that dense_splitk_sum adds in a fixed order;
//   dense_splitk_sum       y (+)= the sum of dense_gemm_q's partials, splits in order;
//   dense_dequant_f16<T>   rows of W as F16 (a GEMM's input: dequantize + cuBLAS, the other way
//                          to run more tokens);
//   dense_get_rows_q<T>    rows ids of a block table (the token embedding) as F32.
// Layouts (numpy order, C-contiguous): W (rows, row_bytes) bytes, n_in / QBlock<T>::VALUES
// blocks a row; x (n_tok, n_in) F32 with row stride x_stride; y (n_tok, rows) F32; g (n_in) F32.
#include <cuda_fp16.h>
#include "quant_blocks.cuh"
#include "dense_common.cuh"
#include "mma_ptx.cuh"

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

// x staged in shared memory: a chunk of 32 sub-blocks (1024 values) of QG tokens at a time, each
// sub-block's 32 floats padded to XS_STRIDE so that the 8 lanes of an LDS.128 phase (lane l reads
// sub-block l) hit distinct banks. Staged values are x * g (the norm weight; 1 without one): a
// lane's loads of x are coalesced once per block instead of strided by 128 bytes per lane (the
// layout before: 32 L1 lines per load, measured 0.38 TB/s for Q4_K at one token on an H100).
#define QG 4                  // tokens staged at a time
#define XS_STRIDE 36          // floats per staged sub-block
#define XS_CHUNK 32           // sub-blocks per chunk (one per lane)

// x * g of sub-blocks [c0, c0 + XS_CHUNK) of tokens [t0, t0 + nt) (tokens past n_tok and
// columns past n_in staged as zeros) into xs; every thread of the block takes part.
__device__ __forceinline__ void stage_x(const GemvQParams& p, int c0, int t0, int nt,
                                        float (*xs)[XS_CHUNK * XS_STRIDE]) {
    const int n_sub = p.n_in / 32;
    for (int i = threadIdx.x; i < nt * XS_CHUNK * 8; i += blockDim.x) {   // float4 units
        const int t = i / (XS_CHUNK * 8), r = i % (XS_CHUNK * 8), sub = r / 8, q4 = r % 8;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (t0 + t < p.n_tok && c0 + sub < n_sub) {
            const int k = (c0 + sub) * 32 + 4 * q4;
            v = __ldg(reinterpret_cast<const float4*>(p.x + (long long)(t0 + t) * p.x_stride + k));
            if (p.g) {
                const float4 gv = __ldg(reinterpret_cast<const float4*>(p.g + k));
                v.x *= gv.x, v.y *= gv.y, v.z *= gv.z, v.w *= gv.w;
            }
        }
        *reinterpret_cast<float4*>(&xs[t][sub * XS_STRIDE + 4 * q4]) = v;
    }
}

// acc[t0 + t] += v . (staged token t's sub-block of this lane), for the staged tokens: 4 values
// of every token at a time (a compiler barrier between them keeps the shared-memory loads from
// being hoisted together: 32 floats of x per token would not fit beside v and the sums).
template <int NT>
__device__ __forceinline__ void dot_staged(const float (&v)[32], const float (*xs)[XS_CHUNK * XS_STRIDE], int t0,
                                           float (&acc)[NT]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int t = 0; t < QG; ++t) {
            if (t0 + t < NT) {   // (a constant bound: acc stays in registers)
                const float4 xv = reinterpret_cast<const float4*>(&xs[t][lane * XS_STRIDE])[j];
                float a = acc[t0 + t];
                a = fmaf(v[4 * j], xv.x, a);
                a = fmaf(v[4 * j + 1], xv.y, a);
                a = fmaf(v[4 * j + 2], xv.z, a);
                a = fmaf(v[4 * j + 3], xv.w, a);
                acc[t0 + t] = a;
            }
        }
        asm volatile("" ::: "memory");
    }
}

// One warp per output row (of the segments' rows concatenated); blocks of W warps sharing the
// staged x (the staged bytes per row fall as 1 / W; W = GEMVQ_WARPS ships, others are the
// benchmark's A/B instances: kernels.dense_q_x_variant). At least 256 (NT >= 4) or 512 threads
// an SM, whatever W. Chunk c covers sub-blocks [32 c, 32 c + 32): lane l decodes sub-block 32 c + l of
// its row (and, gated, of the up row) and dots it with the staged group of QG tokens, per group.
#define GEMVQ_WARPS 8   // warps a block of the shipped instances (8 beat 4 at every type and token count: bench/NOTES.md)

template <int T, int NT, int W = GEMVQ_WARPS>
__global__ void __launch_bounds__(W * 32, (NT >= 4 ? 256 : 512) / (W * 32) > 0 ? (NT >= 4 ? 256 : 512) / (W * 32) : 1)
dense_gemv_q(const GemvQParams p) {
    constexpr int S = QBlock<T>::VALUES / 32, B = QBlock<T>::BYTES;
    __shared__ __align__(16) float xs[QG][XS_CHUNK * XS_STRIDE];
    int r = blockIdx.x * W + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    GemvQSeg sg;
    const bool live = gemv_segment(p, r, sg);   // rows past the end stage x with the others
    const unsigned char* w0 = live ? sg.w + (long long)r * p.row_bytes : nullptr;
    const unsigned char* w1 = live && p.mode == 2 ? p.seg[1].w + (long long)r * p.row_bytes : nullptr;
    float acc[NT], up[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = 0.0f, up[t] = 0.0f;
    const int n_sub = p.n_in / 32;
    for (int c0 = 0; c0 < n_sub; c0 += XS_CHUNK) {
        const int sub = c0 + lane;
        const bool mine = live && sub < n_sub;
        if (mine) {   // this chunk's weight bytes on their way while x is staged behind the barriers
            qb_prefetch<B>(w0 + (long long)(sub / S) * B);
            if (w1) qb_prefetch<B>(w1 + (long long)(sub / S) * B);
        }
#pragma unroll
        for (int t0 = 0; t0 < NT; t0 += QG) {   // groups of QG tokens; one group up to 4 tokens
            __syncthreads();   // the last group's reads are done
            stage_x(p, c0, t0, NT - t0 < QG ? NT - t0 : QG, xs);
            __syncthreads();
            if (mine) {   // decoded again per group: 32 values live at a time, not 64 (no spills)
                float v[32];
                qb_dequant32<T>(w0 + (long long)(sub / S) * B, sub % S, v);
                dot_staged<NT>(v, xs, t0, acc);
                if (w1) {
                    qb_dequant32<T>(w1 + (long long)(sub / S) * B, sub % S, v);
                    dot_staged<NT>(v, xs, t0, up);
                }
            }
        }
    }
    float s[NT];   // after the loop: 16 registers fewer live in it
    rms_scales<NT, W>(p.x, p.x_stride, p.n_in, p.n_tok, p.norm_eps, s);   // every thread
    if (!live) return;
    gemv_q_finish<NT>(acc, up, s, p.mode, p.n_tok, sg, r);
}

// ---------------------------------------------------------------------------------------
// The tiled GEMM over blocks. Block tile GQ_BM weight rows x GQ_BN tokens, 4 warps of 32 x 32
// (warp w: rows 32 (w & 1), tokens 32 (w >> 1)); a step covers GQ_BK = 64 values of n_in, two
// 32-value sub-blocks a row: thread i decodes sub-block i & 1 of row i >> 1 (qb_dequant32, the
// GEMV's decoder) into As, and the x tile (F16) comes by cp.async into Bs; two buffers of each,
// the next step's loads issued before this step's mma (its weight bytes prefetched into L1
// first, decoded after the mma). Shared rows GQ_LD = 72 halves apart: the 8 row addresses of an
// ldmatrix phase and the 8 lanes of a 16-byte store phase land on distinct banks.
#define GQ_BM 64
#define GQ_BN 64
#define GQ_BK 64
#define GQ_LD 72
#define GQ_THREADS 128

struct GemmQParams {
    const unsigned char* w;   // (rows, row_bytes) blocks, 2-byte aligned rows
    const __half* x;          // (n_tok, n_in) F16, rows n_in apart, 16-byte aligned
    float* out;               // (n_tok, rows) F32
    float* part;              // gridDim.z > 1: (gridDim.z, n_tok, rows) F32 partial sums
    long long row_bytes;
    int rows;
    int n_in;                 // a multiple of QBlock<T>::VALUES (and of 32)
    int n_tok;
    int k_chunk;              // values of n_in per split (blockIdx.z), a multiple of GQ_BK
    int mode;                 // 0: out = W·x; 1: out += W·x (one split; more: dense_splitk_sum's mode)
    int pad_;
};

// v[0..32) rounded to F16 at dst (16-byte aligned): four 16-byte stores (16 of 4 bytes touched
// 32 sectors for 128 bytes each: the 1.57 ms of dequantize + cuBLAS an 8B layer took on the
// H100, flat from 16 to 128 tokens, bench/NOTES.md).
__device__ __forceinline__ void store32_f16(const float (&v)[32], __half* dst) {
    uint4* o = reinterpret_cast<uint4*>(dst);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        __half2 h[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) h[k] = __floats2half2_rn(v[8 * j + 2 * k], v[8 * j + 2 * k + 1]);
        o[j] = *reinterpret_cast<const uint4*>(h);
    }
}

// As[dr][32 ds ..] = row m0 + dr's sub-block sub as F16 (zeros past the rows or n_in).
template <int T>
__device__ __forceinline__ void gq_decode(const unsigned char* wrow, bool ok, int sub, __half* dst) {
    constexpr int S = QBlock<T>::VALUES / 32, B = QBlock<T>::BYTES;
    float v[32];
    if (ok) {
        qb_dequant32<T>(wrow + (long long)(sub / S) * B, sub % S, v);
    } else {
#pragma unroll
        for (int i = 0; i < 32; ++i) v[i] = 0.0f;
    }
    store32_f16(v, dst);
}

// Bs = x's tokens n0 .. n0 + GQ_BN, values k0 .. k0 + GQ_BK (zeros past n_tok or n_in), cp.async:
// thread i copies 16-byte chunk i % 8 of tokens i / 8 + 16 j (j < 4), its addresses stepping by
// a constant (the loop unrolled: no index arithmetic a copy, 100 instructions before).
__device__ __forceinline__ void gq_load_x(const GemmQParams& p, int n0, int k0, __half* bs) {
    constexpr int CH = GQ_BK / 8, ROWS = GQ_THREADS / CH;   // chunks a token row, token rows a pass
    const int c = threadIdx.x % CH, t0 = threadIdx.x / CH, k = k0 + 8 * c;
    const bool kin = k < p.n_in;   // n_in a multiple of 32: a chunk is all in or out
    const __half* src = p.x + (long long)(n0 + t0) * p.n_in + k;
    const unsigned dst = smem_u32(bs + t0 * GQ_LD + 8 * c);
#pragma unroll
    for (int j = 0; j < GQ_BN / ROWS; ++j) {
        const bool ok = kin && n0 + t0 + ROWS * j < p.n_tok;
        cp_async16(dst + 2u * ROWS * j * GQ_LD, ok ? src + (long long)ROWS * j * p.n_in : p.x, ok ? 16 : 0);
    }
    cp_async_commit();
}

template <int T>
__global__ void __launch_bounds__(GQ_THREADS) dense_gemm_q(const GemmQParams p) {
    constexpr int S = QBlock<T>::VALUES / 32, B = QBlock<T>::BYTES;
    __shared__ __align__(16) __half As[2][GQ_BM * GQ_LD];
    __shared__ __align__(16) __half Bs[2][GQ_BN * GQ_LD];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    static_assert(GQ_BM == 64 && GQ_BN == 64 && GQ_THREADS == 128, "gemm_tile_place's and gemm_tile_store's tile");
    float acc[2][4][4];
    const GemmTilePlace tp = gemm_tile_place(p, acc);
    const int m0 = tp.m0, n0 = tp.n0, k_begin = tp.k_begin, k_end = tp.k_end, n_sub = tp.n_sub, dr = tp.dr, ds = tp.ds;
    const bool drow = tp.drow;
    const unsigned char* wrow = tp.wrow;
    const int wm = 32 * (warp & 1), wn = 32 * (warp >> 1);
    if (k_begin < k_end) {
        int sub = k_begin / 32 + ds;
        gq_decode<T>(wrow, drow && sub < n_sub, sub, &As[0][dr * GQ_LD + 32 * ds]);
        gq_load_x(p, n0, k_begin, Bs[0]);
    }
    int buf = 0;
    for (int k0 = k_begin; k0 < k_end; k0 += GQ_BK) {
        cp_async_wait<0>();
        __syncthreads();   // step buf is in (stores and cp.async); the last step's reads of buf ^ 1 are done
        const bool more = k0 + GQ_BK < k_end;
        const int sub = (k0 + GQ_BK) / 32 + ds;
        const bool dok = more && drow && sub < n_sub;
        if (more) {
            gq_load_x(p, n0, k0 + GQ_BK, Bs[buf ^ 1]);
            if (dok) qb_prefetch<B>(wrow + (long long)(sub / S) * B);   // on their way while the tensor cores run
        }
#pragma unroll
        for (int kk = 0; kk < GQ_BK; kk += 16) {
            unsigned a[2][4], b[4][2];
#pragma unroll
            for (int i = 0; i < 2; ++i)
                ldmatrix_x4(a[i][0], a[i][1], a[i][2], a[i][3],
                            smem_u32(&As[buf][(wm + 16 * i + (lane & 15)) * GQ_LD + kk + 8 * (lane >> 4)]));
#pragma unroll
            for (int j = 0; j < 2; ++j)
                ldmatrix_x4(b[2 * j][0], b[2 * j][1], b[2 * j + 1][0], b[2 * j + 1][1],
                            smem_u32(&Bs[buf][(wn + 16 * j + (lane & 7) + 8 * (lane >> 4)) * GQ_LD + kk +
                                              8 * ((lane >> 3) & 1)]));
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) Mma<__half>::run(acc[i][j], a[i], b[j][0], b[j][1]);
        }
        if (more) gq_decode<T>(wrow, dok, sub, &As[buf ^ 1][dr * GQ_LD + 32 * ds]);
        buf ^= 1;
    }
    gemm_tile_store(acc, gridDim.z > 1 ? p.part + (long long)blockIdx.z * p.n_tok * p.rows : p.out,
                    gridDim.z == 1 && p.mode == 1, p.rows, p.n_tok, m0, n0);
}

// out[i] = (mode 1: out[i] +) part[0][i] + part[1][i] + ... + part[splits - 1][i], for i < n
// (dense_gemm_q's partial sums, added in split order: the same result on every run).
extern "C" __global__ void __launch_bounds__(256) dense_splitk_sum(const float* __restrict__ part,
                                                                   float* __restrict__ out, long long n,
                                                                   int splits, int mode) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float s = 0.0f;
        for (int z = 0; z < splits; ++z) s += part[z * n + i];
        out[i] = mode == 1 ? out[i] + s : s;
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
        store32_f16(v, out + row * n_in + 32 * sub);
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
