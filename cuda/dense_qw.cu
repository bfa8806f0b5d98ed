// The tiled block GEMM on Hopper's warpgroup MMA (sm_90a only: a program of its own, compiled for
// the architecture-specific target), one program per block type T (a ggml type id of
// quant_blocks.cuh's QbFrag<T>::OK types):
//   dense_gemm_qw<T, RM, H>  y = W·x for many tokens (a prefill's ubatch): dense_q.cu's dense_gemm_qr
//                      -- each 256-value step's raw weight bytes and F16 x tile staged by
//                      cp.async, the weights decoded straight into the A fragments (qb_frag8) --
//                      with wgmma m64n128k16 (A from registers, B the x tile in shared memory)
//                      in place of mma.sync m16n8k16: a decoded value feeds 128 tokens (dense_gemm_qr:
//                      64), and the products run asynchronously under the next sub-block's decode.
//                      H 1: the weights decoded in half precision (qb_frag8h: ~3 instructions a
//                      value against qb_frag8's ~6; values within the factors' f16 rounding).
// Same parameters (GemmQParams), layouts, rounding and split-K partial sums as dense_gemm_qr; the
// sums of one output differ from it (H 0) only in the order wgmma adds a k16 step's 16 products.
#include <cuda_fp16.h>
#include "quant_blocks.cuh"
#include "dense_common.cuh"
#include "hopper_common.cuh"   // wgmma (A in registers), descriptors, core-matrix layout, cp.async
#include "staged_rows.cuh"     // StagedRowCopies

// Block tile: QW_BM x RM weight rows (two consumer warpgroups of 64 x RM: warpgroup g's row half h
// is rows 64 (RM g + h) of the tile, warp w's 16-row slice of it 16 (w % 4) further, the m16 A
// fragment of the warpgroup's m64) x QW_BN tokens x QW_BK values a step; QW_STAGES stages of
// the raw weight rows (SLOT bytes a row, staged_rows.cuh's layout) and the x tile, the latter as
// K-major core matrices (hopper_common.cuh core_matrix_index, kt = QW_BK): [token / 8][k / 8]
// [token % 8][k % 8], so a k16 step's B descriptor starts 256 bytes further. RM = 2 reads each
// x tile for twice the rows (half the x tile's L2 traffic a product) where its stages fit.
#define QW_BM 128
#define QW_BN 128
#define QW_BK 256
#define QW_STAGES 2
#define QW_THREADS 256
// A probe of where a step's time goes (tools/dev/qr_probe.py --kernel dense_gemm_qw...: the program
// compiled with -DQW_PROBE=n; the shipped program is QW_PROBE 0): bit 1 skips the decode (each
// lane's fragments constants), bit 2 the wgmmas (the fragments folded into one sum so the decode
// stays); 3 leaves the staging.
#ifndef QW_PROBE
#define QW_PROBE 0
#endif
// Sub-blocks whose fragments one wgmma group multiplies (2 QW_GROUP RM wgmmas a commit): the shipped
// program 1; 2 and 4 are the probe's A/B forms (tools/dev/qr_probe.py --define QW_GROUP=n), more
// products in flight against each wait for the group before.
#ifndef QW_GROUP
#define QW_GROUP 1
#endif
// QW_STAGGER 1 (a probe's A/B; 0 ships): each block walks its k steps rotated (dense_common.cuh
// staged_kstep).
#ifndef QW_STAGGER
#define QW_STAGGER 0
#endif

template <int T, int RM> struct QwTile {
    static constexpr int BM = QW_BM * RM;
    static constexpr int RB = QW_BK / QBlock<T>::VALUES * QBlock<T>::BYTES;   // a row's bytes a step
    static constexpr bool ALIGNED = RB % 16 == 0;
    static constexpr int UNITS = ALIGNED ? RB / 16 : (RB + 30) / 16;   // 16-byte units a row's copy
    static constexpr int SLOT = 16 * UNITS;                            // bytes between staged rows
    static constexpr int X_BYTES = QW_BN * QW_BK * 2;                  // the step's F16 x tile (first)
    static constexpr int W_BYTES = BM * SLOT;
    static constexpr int STAGE = X_BYTES + W_BYTES;
    static constexpr int SMEM = QW_STAGES * STAGE;
    static constexpr bool FITS = SMEM <= 227 * 1024;   // one block an SM (RM 2: Q4_0, Q4_K, Q5_K)
    static_assert(QW_BK % QBlock<T>::VALUES == 0, "whole blocks a step");
    static_assert(QW_BM == 16 * QW_THREADS / 32, "a warp a 16-row slice of each row half");
};

// A thread's copies of every step, fixed before the first (the step only moves them along k):
// its weight rows' units (staged_rows.cuh StagedRowCopies) and its x column: 16-byte unit c =
// (i / 8) % 32 of tokens 8 j + i % 8 (j < 16), so a warp reads 64 contiguous bytes of 8 tokens
// and writes 512 contiguous bytes (4 core matrices).
template <int T, int RM>
struct QwCopies {
    using TL = QwTile<T, RM>;
    StagedRowCopies<TL::RB, TL::UNITS, TL::SLOT, TL::BM, QW_THREADS> rows;
    const __half* x;   // token n0 + i % 8's values from 8 c
    unsigned sx;       // the column's first core-matrix row in the x tile
    int ntok;          // tokens left from n0 + i % 8 (x rows 8 j with 8 j < ntok)
    __device__ __forceinline__ QwCopies(const GemmQParams& p, int m0, int n0) : rows(p.w, p.row_bytes, p.rows, m0) {
        const int tl = threadIdx.x & 7, c = (threadIdx.x >> 3) & 31;
        sx = 2 * core_matrix_index(tl, 8 * c, QW_BK);   // (token 8 j + tl: 2 * 64 * QW_BK / 8 bytes a j further)
        ntok = p.n_tok - n0 - tl;
        x = p.x + (long long)(n0 + tl) * p.n_in + 8 * c;
    }
};

// Step k0's copies into stage st (its shared address): the tile's rows' RB bytes from m0 (zeros
// past the rows or a row's end) and x's tokens n0 .. n0 + QW_BN at values k0 .. k0 + QW_BK (zeros
// past n_tok or n_in: source size 0, the address past x never dereferenced); one commit group.
template <int T, int RM>
__device__ __forceinline__ void qw_stage(const GemmQParams& p, const QwCopies<T, RM>& cp, unsigned st, int k0) {
    cp.rows.copy(st + QwTile<T, RM>::X_BYTES, k0 / QW_BK, p.row_bytes);
    const bool kin = k0 + 8 * ((threadIdx.x >> 3) & 31) < p.n_in;   // (n_in a multiple of 32: a unit all in or out)
    const __half* xk = cp.x + k0;
    const long long xs = 8LL * p.n_in;
#pragma unroll
    for (int j = 0; j < QW_BN / 8; ++j)
        cp_async16(st + cp.sx + 2 * 64 * (QW_BK / 8) * j, xk + j * xs, kin && 8 * j < cp.ntok ? 16 : 0);   // (8 tokens further)
    cp_async_commit();
}

__device__ __forceinline__ unsigned qw_pack(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&h);
}

// A sub-block's two k16 A fragments of the lane's rows (w0: row r, w1: row r + 8 of the warp's
// slice; sub-block j of the step), as dense_gemm_qr packs them (H 1: qb_frag8h's pairs, the same
// places).
template <int T, int H>
__device__ __forceinline__ void qw_frags(const unsigned char* w0, const unsigned char* w1, int j, int c,
                                         unsigned (&a)[2][4]) {
    constexpr int S = QBlock<T>::VALUES / 32, B = QBlock<T>::BYTES;
    if constexpr (H) {
        unsigned h0[4], h1[4];
        qb_frag8h<T>(w0 + (j / S) * B, j % S, c, h0);
        qb_frag8h<T>(w1 + (j / S) * B, j % S, c, h1);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            a[h][0] = h0[2 * h];
            a[h][1] = h1[2 * h];
            a[h][2] = h0[2 * h + 1];
            a[h][3] = h1[2 * h + 1];
        }
        return;
    }
    float v0[8], v1[8];
    qb_frag8<T>(w0 + (j / S) * B, j % S, c, v0);
    qb_frag8<T>(w1 + (j / S) * B, j % S, c, v1);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        a[h][0] = qw_pack(v0[4 * h], v0[4 * h + 1]);
        a[h][1] = qw_pack(v1[4 * h], v1[4 * h + 1]);
        a[h][2] = qw_pack(v0[4 * h + 2], v0[4 * h + 3]);
        a[h][3] = qw_pack(v1[4 * h + 2], v1[4 * h + 3]);
    }
}

// The main loop. A step: wait for its stage, one barrier (every warpgroup's wgmma reads of the
// stage before are complete: each waits for its own before the barrier), the next step's copies,
// then its QW_BK / 32 sub-blocks, QW_GROUP at a time (group g): decode them into fragment set g % 2
// (each row half's), fence, 2 QW_GROUP RM wgmma, commit, and wait until at most the group just
// committed is in flight -- group g - 1's fragments (set (g + 1) % 2, pinned there so the compiler
// keeps them until the wait) are free for group g + 1's decode, which runs while group g's
// products do.
template <int T, int RM, int H>
__global__ void __launch_bounds__(QW_THREADS, 1) dense_gemm_qw(const GemmQParams p) {
    using TL = QwTile<T, RM>;
    static_assert(QbFrag<T>::OK && (!H || QbFragH<T>::OK), "a type with a fragment decode (qb_frag8, qb_frag8h)");
    static_assert(TL::FITS, "the stages fit one block an SM");
    extern __shared__ __align__(128) unsigned char qw_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, c = lane & 3;
    // m64n128 a row half: d[4 i + e] row 16 (warp % 4) + lane / 4 (+ 8: e >= 2), token 8 i + 2 c + e % 2
    float acc[RM][64];
#pragma unroll
    for (int h = 0; h < RM; ++h)
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[h][i] = 0.0f;
    const int m0 = blockIdx.x * TL::BM, n0 = blockIdx.y * QW_BN;
    const int k_begin = blockIdx.z * p.k_chunk, k_end = min(p.n_in, k_begin + p.k_chunk);
    const int n_steps = k_end > k_begin ? (k_end - k_begin + QW_BK - 1) / QW_BK : 0;
    const int wr = 64 * RM * (warp >> 2) + 16 * (warp & 3);   // the warp's slice of row half 0
    const int r0 = wr + (lane >> 2);                         // the lane's rows: r0 (+ 64 h) and + 8
    const QwCopies<T, RM> copies(p, m0, n0);
    const unsigned s0 = smem_u32(qw_smem);
#pragma unroll
    for (int s = 0; s < QW_STAGES - 1; ++s) {
        if (s < n_steps)
            qw_stage<T, RM>(p, copies, s0 + s * TL::STAGE, k_begin + staged_kstep<QW_STAGGER>(s, n_steps) * QW_BK);
        else cp_async_commit();
    }
    // sub-block sets: QW_GROUP sub-blocks' fragments a wgmma group, two sets taking turns
    unsigned a[2][QW_GROUP][RM][2][4] = {};
    for (int s = 0; s < n_steps; ++s) {
        cp_async_wait<QW_STAGES - 2>();
        fence_proxy_async_shared();   // this thread's x copies, visible to wgmma's reads
        __syncthreads();
        {
            const int ns = s + QW_STAGES - 1;
            if (ns < n_steps)
                qw_stage<T, RM>(p, copies, s0 + (ns % QW_STAGES) * TL::STAGE,
                                k_begin + staged_kstep<QW_STAGGER>(ns, n_steps) * QW_BK);
            else cp_async_commit();
        }
        unsigned char* st = qw_smem + (s % QW_STAGES) * TL::STAGE;
        const unsigned xs = smem_u32(st);
        const int k0 = k_begin + staged_kstep<QW_STAGGER>(s, n_steps) * QW_BK;
        // the rows' runs in the stage: their head (the run's offset mod 16) + whole blocks
        const unsigned char* w0 = st + TL::X_BYTES + r0 * TL::SLOT + (TL::ALIGNED ? 0 : (k0 / QW_BK * TL::RB) & 15);
#pragma unroll
        for (int jg = 0; jg < QW_BK / 32 / QW_GROUP; ++jg) {
            unsigned (&ag)[QW_GROUP][RM][2][4] = a[jg & 1];
            // (rows past p.rows and values past n_in were staged as zero bytes: they decode to 0)
#pragma unroll
            for (int g = 0; g < QW_GROUP; ++g) {
                const int j = QW_GROUP * jg + g;
#pragma unroll
                for (int h = 0; h < RM; ++h) {
                    if constexpr (QW_PROBE & 1) {
#pragma unroll
                        for (int k = 0; k < 2; ++k)
#pragma unroll
                            for (int e = 0; e < 4; ++e) ag[g][h][k][e] = 0x3c003c00u ^ (unsigned)(c + e + k);
                    } else {
                        qw_frags<T, H>(w0 + 64 * h * TL::SLOT, w0 + (64 * h + 8) * TL::SLOT, j, c, ag[g][h]);
                    }
                }
            }
            if constexpr ((QW_PROBE & 2) != 0) {
#pragma unroll
                for (int h = 0; h < RM; ++h)
                    acc[h][jg] += __uint_as_float((ag[0][h][0][0] ^ ag[QW_GROUP - 1][h][1][3]) & 0x3fffffffu);
                continue;
            }
            wgmma_fence();
#pragma unroll
            for (int g = 0; g < QW_GROUP; ++g)
#pragma unroll
                for (int k = 0; k < 2; ++k)
#pragma unroll
                    for (int h = 0; h < RM; ++h)
                        wgmma_m64n128k16_rs<0>(acc[h], ag[g][h][k],
                                               wgmma_desc(xs + (2 * (QW_GROUP * jg + g) + k) * 256, 128,
                                                          (QW_BK / 8) * 128), true);
            wgmma_commit();
            wgmma_wait<1>();
#pragma unroll
            for (int g = 0; g < QW_GROUP; ++g)
#pragma unroll
                for (int h = 0; h < RM; ++h) {
                    wgmma_pin(a[(jg + 1) & 1][g][h][0]);
                    wgmma_pin(a[(jg + 1) & 1][g][h][1]);
                }
        }
        wgmma_wait<0>();   // the stage's reads done before the next barrier lets its copies in
#pragma unroll
        for (int h = 0; h < RM; ++h) wgmma_pin(acc[h]);
    }
#pragma unroll
    for (int h = 0; h < RM; ++h)
        gemm_warp_store<1, 16>(*reinterpret_cast<const float(*)[1][16][4]>(acc[h]),
                               gridDim.z > 1 ? p.part + (long long)blockIdx.z * p.n_tok * p.rows : p.out,
                               gridDim.z == 1 && p.mode == 1, p.rows, p.n_tok, m0 + wr + 64 * h, n0);
}

// The dynamic shared memory (bytes) a launch of dense_gemm_qw<T, RM, H> takes (ggml_attn/variants.py
// smem_expr).
template <int T, int RM, int H>
__device__ const int dense_gemm_qw_smem = QwTile<T, RM>::SMEM;
