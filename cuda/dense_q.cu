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
//   dense_gemm_qs<T, BN>   the same product with each 256-value step's weight bytes and x tile
//                          staged by cp.async (rows of whole 16-byte units), decoded from shared
//                          memory (below);
//   dense_gemm_qr<T, BN>   dense_gemm_qs with the weights decoded straight into the tensor cores'
//                          fragments (the types of quant_blocks.cuh's QbFrag);
//   dense_splitk_sum       y (+)= the sum of dense_gemm_q's partials, splits in order;
//   dense_dequant_f16<T>   rows of W as F16 (a GEMM's input: dequantize + cuBLAS, the other way
//                          to run more tokens), the stores coalesced a warp at a time;
//   dense_get_rows_q<T>    rows ids of a block table (the token embedding) as F32.
// Layouts (numpy order, C-contiguous): W (rows, row_bytes) bytes, n_in / QBlock<T>::VALUES
// blocks a row; x (n_tok, n_in) F32 with row stride x_stride; y (n_tok, rows) F32; g (n_in) F32.
#include <cuda_fp16.h>
#include "quant_blocks.cuh"
#include "dense_common.cuh"
#include "mma_ptx.cuh"
#include "staged_rows.cuh"

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

// (GemmQParams: dense_common.cuh, shared with dense_qw.cu's dense_gemm_qw)

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

// ---------------------------------------------------------------------------------------
// The staged tiled GEMM over blocks (dense_gemm_qs<T, BN>): dense_gemm_q's F16 tensor-core
// product with dense_gemm_q8's staging, for rows of whole 16-byte units (row_bytes a multiple of
// 16, W 16-byte aligned). dense_gemm_q decodes each thread's sub-block from global memory (16
// rows a warp load: L1-bound, ~0.35 ms an 8B Q4_K layer whatever the tokens); dense_gemm_q8 stages
// whole lines but scales every int8 product per 32 values (~25 instructions an m16n8k32 on the
// K-quants' factors). Here each 256-value step's raw weight bytes (QsTile<T, BN>::RB a row) and
// its F16 x tile come by cp.async into one of QS_STAGES stages (the next step's in flight while
// this one computes); thread i decodes sub-blocks 2 (i / 64) and 2 (i / 64) + 1 of row i % 64 from
// the stage (qb_dequant32, ggml's own expressions in F32, rounded to F16) into As, and the warps'
// m16n8k16 products read As and the x tile by ldmatrix: no per-sub-block scaling, so the decode
// (once per weight value a block) is the work that grows with the rows, not with the tokens.
// Block tile QS_BM = 64 rows x BN tokens, QS_WARPS = 8 warps:
//   BN = 64 (1 block an SM: ~117-136 KB of shared memory), warps of 32 x 16 (rows 32 (w % 2),
//   tokens 16 (w / 2));
//   BN = 32 (2 blocks an SM), warps of 16 x 16 (rows 16 (w % 4), tokens 16 (w / 4)).
// (A wide tile that decoded step s + 1 between step s's products -- 3 stages, 2 decoded tiles,
// one barrier a step -- ran no faster at 07904c5: bench/NOTES.md.)
// Tokens of a warp's 8-wide tiles past n_tok skip their mma (x is not copied past the last
// 8-token tile). A staged row keeps its global bytes' alignment mod 16 as dense_gemm_q8's. Rows
// QS_LD = 264 halves (528 bytes) apart in As and the x tile: an ldmatrix phase's 8 rows and a
// 16-byte store phase's 8 lanes on distinct banks. Shared memory QsTile<T, BN>::SMEM bytes,
// dynamic (the host reads it from the cubin: dense_gemm_qs_smem, at the end of this file). Same
// parameters as dense_gemm_q.
#define QS_BM 64
#define QS_BK 256
#define QS_LD 264
#define QS_WARPS 8
#define QS_THREADS (32 * QS_WARPS)
#define QS_STAGES 2

template <int T, int BN> struct QsTile {
    static constexpr int RB = QS_BK / QBlock<T>::VALUES * QBlock<T>::BYTES;   // a row's bytes a step
    static constexpr bool ALIGNED = RB % 16 == 0;
    static constexpr int UNITS = ALIGNED ? RB / 16 : (RB + 30) / 16;   // 16-byte units a row's copy
    static constexpr int SLOT = 16 * UNITS;                            // bytes between staged rows
    static constexpr int W_BYTES = QS_BM * SLOT;
    static constexpr int X_BYTES = BN * QS_LD * 2;                     // the step's F16 x tile
    static constexpr int STAGE = W_BYTES + X_BYTES;
    static constexpr int SMEM = QS_STAGES * STAGE + QS_BM * QS_LD * 2;   // stages, As
    // the warp tile: MI x 16 rows, NI x 8 tokens; RW warps along the rows
    static constexpr int MI = BN == 64 ? 2 : 1, RW = QS_BM / (16 * MI), NI = BN / 8 / (QS_WARPS / RW);
    static_assert(BN == 64 || BN == 32, "the wide and the narrow tile");
    static_assert(NI == 2 && RW * (BN / (8 * NI)) == QS_WARPS, "the warps cover the tile, two 8-token tiles each");
};

// Step k0's copies into stage st: the QS_BM rows' RB bytes from m0 (zeros past the rows or a
// row's end), x's tokens n0 .. n0 + n_cp (n_cp: the 8-token tiles that run; zeros past n_tok or
// n_in) at values k0 .. k0 + QS_BK, 32 units a token; one commit group.
// (TL, BM: dense_gemm_qr's tile and rows.)
template <int BN>
__device__ __forceinline__ void qs_stage_x(const GemmQParams& p, unsigned sx, int n0, int k0, int n_cp) {
#pragma unroll
    for (int j = 0; j < BN * 32 / QS_THREADS; ++j) {
        const int u = threadIdx.x + QS_THREADS * j, t = u >> 5, c = u & 31, k = k0 + 8 * c;
        if (t < n_cp) {   // (n_in a multiple of 32: a unit is all in or out)
            const bool ok = n0 + t < p.n_tok && k < p.n_in;
            cp_async16(sx + t * (2 * QS_LD) + 16 * c, ok ? p.x + (long long)(n0 + t) * p.n_in + k : p.x, ok ? 16 : 0);
        }
    }
}
template <int T, int BN, class TL = QsTile<T, BN>, int BM = QS_BM>
__device__ __forceinline__ void qs_stage(const GemmQParams& p, unsigned char* st, int m0, int n0, int k0, int n_cp) {
    const unsigned sw = smem_u32(st);
    stage_weight_rows<TL::RB, TL::UNITS, TL::SLOT, BM, QS_THREADS>(p.w, p.row_bytes, p.rows, m0, k0 / QS_BK, sw);
    qs_stage_x<BN>(p, sw + TL::W_BYTES, n0, k0, n_cp);
    cp_async_commit();
}

template <int T, int BN>
__global__ void __launch_bounds__(QS_THREADS, BN == 64 ? 1 : 2) dense_gemm_qs(const GemmQParams p) {
    using TL = QsTile<T, BN>;
    constexpr int MI = TL::MI, NI = TL::NI;
    constexpr int DS = QS_BK / 32 * QS_BM / QS_THREADS;   // sub-blocks a thread decodes a step
    static_assert(DS * QS_THREADS == QS_BK / 32 * QS_BM, "the decode's thread map: 64 rows x 8 / DS groups");
    static_assert(QS_BK % QBlock<T>::VALUES == 0, "whole blocks a step");
    extern __shared__ __align__(16) unsigned char qs_smem[];
    __half* As = reinterpret_cast<__half*>(qs_smem + QS_STAGES * TL::STAGE);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float acc[MI][NI][4];
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int n = 0; n < NI; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][n][e] = 0.0f;
    const int m0 = blockIdx.x * QS_BM, n0 = blockIdx.y * BN, n_sub = p.n_in / 32;
    const int k_begin = blockIdx.z * p.k_chunk, k_end = min(p.n_in, k_begin + p.k_chunk);
    const int n_steps = k_end > k_begin ? (k_end - k_begin + QS_BK - 1) / QS_BK : 0;
    const int n_cp = min(BN, (p.n_tok - n0 + 7) & ~7);   // tokens of the 8-wide tiles that run
    const int wm = 16 * MI * (warp % TL::RW), wn = 8 * NI * (warp / TL::RW);
    const bool wlive = n0 + wn < p.n_tok;   // (warp-uniform: a token in the warp's first 8-token tile)
    const int dr = threadIdx.x % QS_BM, dj = threadIdx.x / QS_BM * DS;   // decode: row, first sub-block
    const bool drow = m0 + dr < p.rows;
#pragma unroll
    for (int s = 0; s < QS_STAGES - 1; ++s) {
        if (s < n_steps) qs_stage<T, BN>(p, qs_smem + s * TL::STAGE, m0, n0, k_begin + s * QS_BK, n_cp);
        else cp_async_commit();
    }
    for (int s = 0; s < n_steps; ++s) {
        cp_async_wait<QS_STAGES - 2>();
        __syncthreads();   // step s's stage is in; step s - 1's reads of As and of its stage are done
        {
            const int ns = s + QS_STAGES - 1;
            if (ns < n_steps) qs_stage<T, BN>(p, qs_smem + (ns % QS_STAGES) * TL::STAGE, m0, n0, k_begin + ns * QS_BK, n_cp);
            else cp_async_commit();
        }
        const unsigned char* st = qs_smem + (s % QS_STAGES) * TL::STAGE;
        const __half* Xs = reinterpret_cast<const __half*>(st + TL::W_BYTES);
        const int k0 = k_begin + s * QS_BK;
        // the row's run in the stage: its head (the run's offset mod 16) + whole blocks
        const unsigned char* wr = st + dr * TL::SLOT + (TL::ALIGNED ? 0 : (k0 / QS_BK * TL::RB) & 15);
#pragma unroll
        for (int j = dj; j < dj + DS; ++j)
            gq_decode<T>(wr, drow && k0 / 32 + j < n_sub, j, As + dr * QS_LD + 32 * j);
        __syncthreads();   // As of step s written
        if (wlive) {
#pragma unroll 4
            for (int kk = 0; kk < QS_BK; kk += 16) {
                unsigned a[MI][4], b[NI][2];
#pragma unroll
                for (int i = 0; i < MI; ++i)
                    ldmatrix_x4(a[i][0], a[i][1], a[i][2], a[i][3],
                                smem_u32(As + (wm + 16 * i + (lane & 15)) * QS_LD + kk + 8 * (lane >> 4)));
                ldmatrix_x4(b[0][0], b[0][1], b[1][0], b[1][1],
                            smem_u32(Xs + (wn + (lane & 7) + 8 * (lane >> 4)) * QS_LD + kk + 8 * ((lane >> 3) & 1)));
#pragma unroll
                for (int n = 0; n < NI; ++n) {
                    if (n0 + wn + 8 * n >= p.n_tok) continue;   // (warp-uniform: no token of this tile)
#pragma unroll
                    for (int i = 0; i < MI; ++i) Mma<__half>::run(acc[i][n], a[i], b[n][0], b[n][1]);
                }
            }
        }
    }
    gemm_warp_store<MI, NI>(acc, gridDim.z > 1 ? p.part + (long long)blockIdx.z * p.n_tok * p.rows : p.out,
                            gridDim.z == 1 && p.mode == 1, p.rows, p.n_tok, m0 + wm, n0 + wn);
}

// ---------------------------------------------------------------------------------------
// dense_gemm_qs with the decode straight into the tensor cores' A fragments (dense_gemm_qr<T, BN>,
// the types of QbFrag<T>::OK): the same staging (each 256-value step's raw weight bytes and F16 x
// tile by cp.async, QS_STAGES stages), but no decoded tile in shared memory and no barrier between
// decode and products. Each warp owns 16 of the block's QR_BM = 128 rows and every token of the
// tile (BN = 64 or 32: NI = BN / 8 tiles of 8), so each weight value is decoded once a block, by
// the lane whose m16n8k16 A fragment holds it (qb_frag8: rows lane / 4 and + 8, columns 2 (lane %
// 4) + {0, 1, 8, 9} of each 16-value k step; each lane computes its rows' sub-block scales, the
// four lanes of a quad alike), rounded to F16 in registers and multiplied with the x tile's B fragments
// (ldmatrix, as dense_gemm_qs). The same values, roundings and k order as dense_gemm_qs: the
// same result. Shared memory QrTile<T, BN>::SMEM (the stages only), dynamic (dense_gemm_qr_smem).
// Same parameters as dense_gemm_q. dense_gemm_qr<T, 64, 2> (host name dense_gemm_qrm): MI = 2 row
// halves of QR_BM, 256 rows a block, each warp its 16 rows in each half, every ldmatrix'd B
// fragment multiplied by both halves' A fragments -- a step's x tile staged once for twice the rows.
#define QR_BM 128
// A probe of where a step's time goes (tools/dev/qr_probe.py compiles the program with -DQR_PROBE=n;
// the shipped program is QR_PROBE 0): bit 1 skips the decode (each lane's fragments constants),
// bit 2 the products (the fragments folded into one sum so the decode stays), bit 4 the x tile's
// ldmatrix (its B fragments constants); 3 leaves the staging, 5 the products alone.
#ifndef QR_PROBE
#define QR_PROBE 0
#endif
// QR_STAGGER 1 (a probe's A/B; 0 ships): each block walks its k steps rotated (dense_common.cuh
// staged_kstep).
#ifndef QR_STAGGER
#define QR_STAGGER 0
#endif

template <int T, int BN, int MI = 1> struct QrTile {
    using QS = QsTile<T, BN>;   // its staged rows and x tile
    static constexpr int RB = QS::RB, UNITS = QS::UNITS, SLOT = QS::SLOT, X_BYTES = QS::X_BYTES;
    static constexpr bool ALIGNED = QS::ALIGNED;
    static constexpr int BM = QR_BM * MI;   // the block's rows: MI row halves of QR_BM
    static constexpr int W_BYTES = BM * SLOT;
    static constexpr int STAGE = W_BYTES + X_BYTES;
    static constexpr int SMEM = QS_STAGES * STAGE;
    static constexpr int NI = BN / 8;
    static_assert(BN == 64 || BN == 32, "the wide and the narrow tile");
    static_assert(QR_BM == 16 * QS_WARPS, "a warp a 16-row slice");
    static_assert(MI == 1 || (MI == 2 && BN == 64), "two row halves on the wide tile only");
};

// A dense_gemm_qr step's copies into stage st: qs_stage's over the tile's TL::BM rows from m0, or
// (G: dense_gemm_qrg) QR_BM rows from m0 of the gate matrix p.w into the first row half and as many
// of the up matrix p.w2 into the second; one commit group.
template <int T, int BN, class TL, int G>
__device__ __forceinline__ void qr_stage(const GemmQParams& p, unsigned char* st, int m0, int n0, int k0, int n_cp) {
    if constexpr (G != 0) {
        const unsigned sw = smem_u32(st);
        stage_weight_rows<TL::RB, TL::UNITS, TL::SLOT, QR_BM, QS_THREADS>(p.w, p.row_bytes, p.rows, m0, k0 / QS_BK, sw);
        stage_weight_rows<TL::RB, TL::UNITS, TL::SLOT, QR_BM, QS_THREADS>(p.w2, p.row_bytes, p.rows, m0, k0 / QS_BK,
                                                                          sw + QR_BM * TL::SLOT);
        qs_stage_x<BN>(p, sw + TL::W_BYTES, n0, k0, n_cp);
        cp_async_commit();
    } else {
        qs_stage<T, BN, TL, TL::BM>(p, st, m0, n0, k0, n_cp);
    }
}

// QR_SPLIT_FINISH 1 (an A/B program: ggml_attn/variants.py qr_finish_variant; 0 ships): dense_gemm_qr
// split over n_in with p.tile_done adds its splits itself (qr_split_finish) where 0 leaves them to
// dense_splitk_sum. (A macro, not a branch: the epilogue's code moved the main loop's registers.)
#ifndef QR_SPLIT_FINISH
#define QR_SPLIT_FINISH 0
#endif
// The end of a dense_gemm_qr block split over n_in with p.tile_done: after its partial sums, the
// block of its tile that counts last adds the tile's bm x bn outputs' splits in split order --
// dense_splitk_sum's sums and roundings (G: dense_splitk_gated's, silu(gate) * up and its F16
// form), the same bits without their launch -- reading the partials past L1 (another SM wrote
// them), and sets the tile's counter back to zero for the next launch. smem: 4 bytes of the
// block's shared memory, free (the stages' last reads are done).
template <int G>
__device__ __forceinline__ void qr_split_finish(const GemmQParams& p, unsigned char* smem, int m0, int n0, int bm,
                                                int bn) {
    volatile unsigned* last = reinterpret_cast<volatile unsigned*>(smem);
    __threadfence();   // this thread's partial sums visible to the GPU before the tile's count
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned* c = p.tile_done + blockIdx.y * gridDim.x + blockIdx.x;
        const unsigned done = atomicAdd(c, 1u) == gridDim.z - 1;
        if (done) *c = 0u;   // (every block of the tile has counted)
        *last = done;
    }
    __syncthreads();
    if (!*last) return;
    __threadfence();
    const long long n = (long long)p.n_tok * p.rows;
    const int rows = min(bm, p.rows - m0), toks = min(bn, p.n_tok - n0);
    for (int e = threadIdx.x; e < rows * toks; e += blockDim.x) {
        const long long i = (long long)(n0 + e / rows) * p.rows + m0 + e % rows;
        if constexpr (G != 0) {
            float g = 0.0f, u = 0.0f;
            for (int z = 0; z < (int)gridDim.z; ++z) {
                g += __ldcg(p.part + 2 * z * n + i);
                u += __ldcg(p.part + (2 * z + 1) * n + i);
            }
            const float v = silu_f(g) * u;
            p.out[i] = v;
            if (p.out16) p.out16[i] = __float2half_rn(v);
        } else {
            float s = 0.0f;
            for (int z = 0; z < (int)gridDim.z; ++z) s += __ldcg(p.part + z * n + i);
            p.out[i] = p.mode == 1 ? p.out[i] + s : s;
        }
    }
}

__device__ __forceinline__ unsigned qr_pack(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&h);
}

template <int T, int BN, int MI = 1, int G = 0>
__global__ void __launch_bounds__(QS_THREADS, BN == 64 ? 1 : 2) dense_gemm_qr(const GemmQParams p) {
    using TL = QrTile<T, BN, MI>;
    static_assert(G == 0 || MI == 2, "the gated form: the gate's and the up's rows, one row half each");
    constexpr int NI = TL::NI, S = QBlock<T>::VALUES / 32, B = QBlock<T>::BYTES;
    static_assert(QbFrag<T>::OK, "a type with a fragment decode (qb_frag8)");
    static_assert(QS_BK % QBlock<T>::VALUES == 0, "whole blocks a step");
    extern __shared__ __align__(16) unsigned char qr_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, c = lane & 3;
    float acc[MI][NI][4];
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int n = 0; n < NI; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][n][e] = 0.0f;
    const int m0 = blockIdx.x * (G ? QR_BM : TL::BM), n0 = blockIdx.y * BN;   // (G: of the gate's rows and the up's)
    const int k_begin = blockIdx.z * p.k_chunk, k_end = min(p.n_in, k_begin + p.k_chunk);
    const int n_steps = k_end > k_begin ? (k_end - k_begin + QS_BK - 1) / QS_BK : 0;
    const int n_cp = min(BN, (p.n_tok - n0 + 7) & ~7);   // tokens of the 8-wide tiles that run
    const int r0 = 16 * warp + (lane >> 2);              // the lane's rows: r0 and r0 + 8 (+ QR_BM i) of the tile
#pragma unroll
    for (int s = 0; s < QS_STAGES - 1; ++s) {
        if (s < n_steps) qr_stage<T, BN, TL, G>(p, qr_smem + s * TL::STAGE, m0, n0,
                                                k_begin + staged_kstep<QR_STAGGER>(s, n_steps) * QS_BK, n_cp);
        else cp_async_commit();
    }
    for (int s = 0; s < n_steps; ++s) {
        cp_async_wait<QS_STAGES - 2>();
        __syncthreads();   // step s's stage is in; step s - 1's reads of its stage are done
        {
            const int ns = s + QS_STAGES - 1;
            if (ns < n_steps) qr_stage<T, BN, TL, G>(p, qr_smem + (ns % QS_STAGES) * TL::STAGE, m0, n0,
                                                     k_begin + staged_kstep<QR_STAGGER>(ns, n_steps) * QS_BK, n_cp);
            else cp_async_commit();
        }
        const unsigned char* st = qr_smem + (s % QS_STAGES) * TL::STAGE;
        const __half* Xs = reinterpret_cast<const __half*>(st + TL::W_BYTES);
        const int k0 = k_begin + staged_kstep<QR_STAGGER>(s, n_steps) * QS_BK;
        // the rows' runs in the stage: their head (the run's offset mod 16) + whole blocks
        const unsigned char* w0 = st + r0 * TL::SLOT + (TL::ALIGNED ? 0 : (k0 / QS_BK * TL::RB) & 15);
#pragma unroll
        for (int j = 0; j < QS_BK / 32; ++j) {   // the step's sub-blocks: two 16-value k steps each
            // (rows past p.rows and values past n_in were staged as zero bytes: they decode to 0)
            float v0[MI][8], v1[MI][8];
#pragma unroll
            for (int i = 0; i < MI; ++i) {
                if constexpr (QR_PROBE & 1) {
#pragma unroll
                    for (int e = 0; e < 8; ++e) v0[i][e] = v1[i][e] = 0.001f * (c + e + i);
                } else {
                    const unsigned char* wi = w0 + QR_BM * i * TL::SLOT;
                    qb_frag8<T>(wi + (j / S) * B, j % S, c, v0[i]);
                    qb_frag8<T>(wi + 8 * TL::SLOT + (j / S) * B, j % S, c, v1[i]);
                }
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                unsigned a[MI][4];
#pragma unroll
                for (int i = 0; i < MI; ++i) {
                    a[i][0] = qr_pack(v0[i][4 * h], v0[i][4 * h + 1]);
                    a[i][1] = qr_pack(v1[i][4 * h], v1[i][4 * h + 1]);
                    a[i][2] = qr_pack(v0[i][4 * h + 2], v0[i][4 * h + 3]);
                    a[i][3] = qr_pack(v1[i][4 * h + 2], v1[i][4 * h + 3]);
                }
                const int kk = 32 * j + 16 * h;
                if constexpr (QR_PROBE & 2) {
#pragma unroll
                    for (int i = 0; i < MI; ++i)
                        acc[i][h][0] += __uint_as_float((a[i][0] ^ a[i][1] ^ a[i][2] ^ a[i][3]) & 0x3fffffffu);
                    continue;
                }
#pragma unroll
                for (int n = 0; n < NI; n += 2) {
                    // (block-uniform: no token of these two tiles; with one, both run: the second's
                    // sums, of x rows not copied, are never stored)
                    if (n0 + 8 * n >= p.n_tok) continue;
                    unsigned b0, b1, b2, b3;
                    if constexpr (QR_PROBE & 4) {
                        b0 = 0x3c003c00u ^ (lane + n), b1 = b0 ^ 1u, b2 = b0 ^ 2u, b3 = b0 ^ 3u;
                    } else {
                        ldmatrix_x4(b0, b1, b2, b3, smem_u32(Xs + (8 * n + (lane & 7) + 8 * (lane >> 4)) * QS_LD + kk +
                                                             8 * ((lane >> 3) & 1)));
                    }
#pragma unroll
                    for (int i = 0; i < MI; ++i) {
                        Mma<__half>::run(acc[i][n], a[i], b0, b1);
                        Mma<__half>::run(acc[i][n + 1], a[i], b2, b3);
                    }
                }
            }
        }
    }
    if constexpr (G != 0) {
        if (gridDim.z > 1) {   // both halves' partial sums, (gridDim.z, 2, n_tok, rows): dense_splitk_gated's
            float* part = p.part + (long long)blockIdx.z * 2 * p.n_tok * p.rows;
#pragma unroll
            for (int i = 0; i < 2; ++i)
                gemm_warp_store<1, NI>(*reinterpret_cast<const float(*)[1][NI][4]>(acc[i]),
                                       part + (long long)i * p.n_tok * p.rows, false, p.rows, p.n_tok, m0 + 16 * warp, n0);
            if constexpr (QR_SPLIT_FINISH != 0) {
                if (p.tile_done) qr_split_finish<G>(p, qr_smem, m0, n0, QR_BM, BN);
            }
        } else {
            gated_warp_store<NI>(acc, p.out, p.out16, p.rows, p.n_tok, m0 + 16 * warp, n0);
        }
        return;
    }
#pragma unroll
    for (int i = 0; i < MI; ++i)
        gemm_warp_store<1, NI>(*reinterpret_cast<const float(*)[1][NI][4]>(acc[i]),
                               gridDim.z > 1 ? p.part + (long long)blockIdx.z * p.n_tok * p.rows : p.out,
                               gridDim.z == 1 && p.mode == 1, p.rows, p.n_tok, m0 + QR_BM * i + 16 * warp, n0);
    if constexpr (QR_SPLIT_FINISH != 0) {
        if (gridDim.z > 1 && p.tile_done) qr_split_finish<0>(p, qr_smem, m0, n0, TL::BM, BN);
    }
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

// out[i] = silu(g) * u, g = part[0][0][i] + ... + part[splits - 1][0][i] and u the same of part[z][1][i]
// (dense_gemm_qrg's partial sums, (splits, 2, n) F32, added in split order as dense_splitk_sum adds
// them); out16[i] its F16 form where out16 is not null.
extern "C" __global__ void __launch_bounds__(256) dense_splitk_gated(const float* __restrict__ part,
                                                                     float* __restrict__ out,
                                                                     __half* __restrict__ out16, long long n,
                                                                     int splits) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float g = 0.0f, u = 0.0f;
        for (int z = 0; z < splits; ++z) {
            g += part[2 * z * n + i];
            u += part[(2 * z + 1) * n + i];
        }
        const float v = silu_f(g) * u;
        out[i] = v;
        if (out16) out16[i] = __float2half_rn(v);
    }
}

// out (rows, n_in) F16 = W's values rounded to F16 (qb_dequant32's floats, each __float2half_rn),
// out 16-byte aligned; grid-stride over warps of 32 sub-blocks. Each lane decodes one sub-block,
// parks its 64 bytes of halves in the warp's shared-memory slot (80 bytes a lane: the 16-byte
// writes of an 8-lane phase on distinct banks), and the warp then writes its 32 sub-blocks' 2 KB
// as four 512-byte runs (lane l the 16 bytes at 16 l + 512 j): whole sectors, where a lane storing
// its own 64 bytes wrote each sector in two partial writes (1.43 against 2.53 TB/s of blocks read
// and halves written on an 8B Q4_K layer, H100: bench/results/2026-12-07-a2d3dc2-h100-deq-qrd/).
#define DQW_SLOT 5            // uint4 units a lane's slot (4 used)
template <int T>
__global__ void __launch_bounds__(256) dense_dequant_f16(const unsigned char* __restrict__ w, __half* __restrict__ out,
                                                         long long row_bytes, int n_in, long long rows) {
    constexpr int S = QBlock<T>::VALUES / 32, B = QBlock<T>::BYTES;
    __shared__ uint4 slots[256 / 32][32 * DQW_SLOT];
    const int lane = threadIdx.x & 31;
    uint4* slot = slots[threadIdx.x >> 5];
    const int per_row = n_in / 32;
    const long long n = rows * per_row;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    uint4* out4 = reinterpret_cast<uint4*>(out);
    for (long long e0 = 32 * (((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5); e0 < n; e0 += 32 * warps) {
        const long long e = e0 + lane;
        if (e < n) {
            const long long row = e / per_row;
            const int sub = (int)(e - row * per_row);
            float v[32];
            qb_dequant32<T>(w + row * row_bytes + (long long)(sub / S) * B, sub % S, v);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                __half2 h[4];
#pragma unroll
                for (int k = 0; k < 4; ++k) h[k] = __floats2half2_rn(v[8 * j + 2 * k], v[8 * j + 2 * k + 1]);
                slot[lane * DQW_SLOT + j] = *reinterpret_cast<const uint4*>(h);
            }
        }
        __syncwarp();
        const long long left = 4 * (n - e0);   // uint4 units of this warp's span inside out
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int i = lane + 32 * j;
            if (i < left) out4[4 * e0 + i] = slot[(i >> 2) * DQW_SLOT + (i & 3)];
        }
        __syncwarp();
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

// The dynamic shared memory (bytes) a launch of dense_gemm_qs<T, BN> takes: the host reads it from
// the compiled program (ggml_attn/variants.py smem_expr, ggml_attn/cubin.py)
template <int T, int BN>
__device__ const int dense_gemm_qs_smem = QsTile<T, BN>::SMEM;
template <int T, int BN, int MI = 1, int G = 0>
__device__ const int dense_gemm_qr_smem = QrTile<T, BN, MI>::SMEM;
