// What the dense GEMV kernels share (dense.cu: F16 weights; dense_q.cu, dense_q8x.cu: ggml's weight
// blocks).
#pragma once

#define GEMV_WARPS 4

// 16 bytes of weights at p (16-byte aligned): weights are read once per step, so they do not
// displace the activations in L1.
__device__ __forceinline__ uint4 ld_stream(const void* p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// Programmatic dependent launch (sm_90; both no-ops on older GPUs and in a kernel launched without
// the attribute): pdl_wait() holds the thread until the stream's preceding kernel has completed
// and its writes are visible -- a kernel launched with the attribute calls it before it reads
// anything that kernel wrote or writes anything it reads; pdl_trigger() lets the stream's next
// kernel, if launched with the attribute, start its blocks now (ggml_attn/pdl.py PdlLaunch).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Every 128-byte line of the n bytes at p (128-byte lines from p on) into L2, the warp's lanes
// taking every 32nd: a row's weights requested while the kernel waits on the one before it.
__device__ __forceinline__ void prefetch_l2_span(const unsigned char* p, long long n, int lane) {
    for (long long o = 128LL * lane; o < n; o += 32 * 128) asm volatile("prefetch.global.L2 [%0];" :: "l"(p + o));
}

// Every 128-byte line of the B-byte block at blk (B <= 256) into L1, ahead of its decode.
template <int B>
__device__ __forceinline__ void qb_prefetch(const unsigned char* blk) {
    asm volatile("prefetch.global.L1 [%0];" :: "l"(blk));
    if (B > 64) asm volatile("prefetch.global.L1 [%0];" :: "l"(blk + B / 2));
    asm volatile("prefetch.global.L1 [%0];" :: "l"(blk + B - 1));
}

// The tiled block GEMMs' parameters (dense_q.cu's dense_gemm_q / _qs / _qr, dense_qw.cu's
// dense_gemm_qw; ggml_attn/kernels.py GemmQParams).
struct GemmQParams {
    const unsigned char* w;   // (rows, row_bytes) blocks, 2-byte aligned rows
    const __half* x;          // (n_tok, n_in) F16, rows n_in apart, 16-byte aligned
    float* out;               // (n_tok, rows) F32
    float* part;              // gridDim.z > 1: (gridDim.z, n_tok, rows) F32 partial sums
    long long row_bytes;
    int rows;
    int n_in;                 // a multiple of QBlock<T>::VALUES (and of 32)
    int n_tok;
    int k_chunk;              // values of n_in per split (blockIdx.z), a multiple of the kernel's step
    int mode;                 // 0: out = W·x; 1: out += W·x (one split; more: dense_splitk_sum's mode)
    int pad_;
    const unsigned char* w2;  // dense_gemm_qrg: the up matrix, rows and row_bytes as w (the gate's)
    __half* out16;            // dense_gemm_qrg: out's F16 form, (n_tok, rows) (null: none)
    unsigned* tile_done;      // dense_gemm_qr split over n_in: a counter a (blockIdx.x, blockIdx.y) tile, zero
                              // before the launch and after it; its last block adds the splits (null: dense_splitk_sum)
};

// silu(x) = x / (1 + exp(-x)), the gated FFN's activation (every kernel that applies it: one rounding)
__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }

// The k step a staged tiled GEMM's block takes s-th of its n_steps (dense_q.cu's dense_gemm_qr,
// dense_qw.cu's dense_gemm_qw): s, or with STAGGER (their probes' A/B, tools/dev/qr_probe.py) s
// rotated by the block's index, so that a launch's blocks do not all read the same x tile at once
// (each output's sum then runs in another order: its last bits differ).
template <int STAGGER>
__device__ __forceinline__ int staged_kstep(int s, int n_steps) {
    if constexpr (STAGGER != 0) {
        const int k = s + (int)(blockIdx.x % (unsigned)n_steps);
        return k < n_steps ? k : k - n_steps;
    }
    return s;
}

// One weight matrix kept in ggml's blocks, of a block GEMV's up to three (dense_q.cu's F32 and
// dense_q8x.cu's 8-bit activations; dense.cu's GemvSeg has the same layout with an F16 pointer).
struct GemvQSeg {
    const unsigned char* w;   // (rows, row_bytes), 2-byte aligned rows
    float* out;               // (n_tok, rows)
    int rows;
    int pad_;
};

// The RMS norm's scale of each of the first n_tok token rows of x (n_in floats each, rows xs
// floats apart, 16-byte aligned): s[t] = 1 / sqrt(mean(x_t^2) + eps), computed by every block
// of W warps (all its threads take part: call it before any thread leaves); s[t] = 1 for every
// t when eps <= 0 (no norm) and for t >= n_tok.
template <int NT, int W = GEMV_WARPS>
__device__ __forceinline__ void rms_scales(const float* x, long long xs, int n_in, int n_tok, float eps,
                                           float (&s)[NT]) {
#pragma unroll
    for (int t = 0; t < NT; ++t) s[t] = 1.0f;
    if (!(eps > 0.0f)) return;
    __shared__ float red[NT][W];
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        float ss = 0.0f;
        if (t < n_tok) {
            const float4* xr = reinterpret_cast<const float4*>(x + t * xs);
            for (int i = threadIdx.x; i < n_in / 4; i += blockDim.x) {
                const float4 v = __ldg(xr + i);
                ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (lane == 0) red[t][threadIdx.x >> 5] = ss;
    }
    __syncthreads();
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        float ss = 0.0f;
#pragma unroll
        for (int w = 0; w < W; ++w) ss += red[t][w];
        if (t < n_tok) s[t] = 1.0f / sqrtf(ss / (float)n_in + eps);
    }
}

// The segment (p.seg[0..p.n_seg)) that output row r of the segments' rows concatenated falls in,
// picked by constant indices (a runtime index would copy the parameters to local memory); r
// becomes the row within it. False: r is past the last row (mode 2 reads seg[0]'s rows only:
// seg[1] is its second operand, not more rows).
template <class P, class Seg>
__device__ __forceinline__ bool gemv_segment(const P& p, int& r, Seg& sg) {
    sg = p.seg[0];
    if (r < sg.rows) return true;
    if (p.mode == 2 || p.n_seg < 2) return false;
    r -= sg.rows;
    sg = p.seg[1];
    if (r < sg.rows) return true;
    r -= sg.rows;
    sg = p.seg[2];
    return p.n_seg >= 3 && r < sg.rows;
}

// The end of a block GEMV's warp (dense_q.cu, dense_q8x.cu): the lanes' sums of output row r of
// segment sg reduced, times s[t] (the RMS scales; 1 without a norm), gated (mode 2:
// silu(acc) * up) and stored by lane t for each token t < n_tok (mode 1: added to the output).
template <int NT>
__device__ __forceinline__ void gemv_q_finish(float (&acc)[NT], float (&up)[NT], const float (&s)[NT], int mode,
                                              int n_tok, const GemvQSeg& sg, int r) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], o);
            up[t] += __shfl_xor_sync(0xffffffffu, up[t], o);
        }
        acc[t] *= s[t];
        if (mode == 2) acc[t] = silu_f(acc[t]) * (up[t] * s[t]);
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        if (lane == t && t < n_tok) {
            float* o = sg.out + (long long)t * sg.rows + r;
            *o = mode == 1 ? *o + acc[t] : acc[t];
        }
    }
}

// A 64 x 64 tiled block GEMM block's place (dense_q.cu's dense_gemm_q; P: its parameters):
// its tile's first row m0 and token n0, its split's values [k_begin, k_end) of n_in (blockIdx.z
// of k_chunk), and this thread's decode -- row dr (drow: within the rows; wrow its bytes, row 0's
// where not) and sub-block ds of each 64-value step; acc zeroed.
struct GemmTilePlace {
    int m0, n0, k_begin, k_end, n_sub, dr, ds;
    bool drow;
    const unsigned char* wrow;
};

template <class P>
__device__ __forceinline__ GemmTilePlace gemm_tile_place(const P& p, float (&acc)[2][4][4]) {
    GemmTilePlace t;
    t.m0 = blockIdx.x * 64, t.n0 = blockIdx.y * 64;
    t.k_begin = blockIdx.z * p.k_chunk, t.k_end = min(p.n_in, t.k_begin + p.k_chunk);
    t.n_sub = p.n_in / 32, t.dr = threadIdx.x >> 1, t.ds = threadIdx.x & 1;
    t.drow = t.m0 + t.dr < p.rows;
    t.wrow = p.w + (long long)(t.drow ? t.m0 + t.dr : 0) * p.row_bytes;
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
    return t;
}

// A warp's end of a tiled block GEMM: acc[i][j][e] in the m16n8 accumulator layout -- row r0 +
// 16 i + lane / 4 + 8 (e >> 1), token t0 + 8 j + 2 (lane % 4) + (e & 1) -- stored into dst
// (n_tok, rows) F32 (add: added to it) where in range.
template <int MI, int NI>
__device__ __forceinline__ void gemm_warp_store(const float (&acc)[MI][NI][4], float* dst, bool add, int rows,
                                                int n_tok, int r0, int t0) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = r0 + 16 * i + (lane >> 2) + 8 * (e >> 1);
                const int tok = t0 + 8 * j + 2 * (lane & 3) + (e & 1);
                if (row < rows && tok < n_tok) {
                    float* o = dst + (long long)tok * rows + row;
                    *o = add ? *o + acc[i][j][e] : acc[i][j][e];
                }
            }
}

// A gated tiled block GEMM warp's 16 x 8 NI outputs (dense_q.cu's dense_gemm_qrg): silu(gate) * up
// of the sums in gemm_warp_store's layout, acc[0] the gate's and acc[1] the up's, stored to dst
// (n_tok, rows) F32 and, where dst16 is not null, rounded to F16 into dst16 alike.
template <int NI>
__device__ __forceinline__ void gated_warp_store(const float (&acc)[2][NI][4], float* dst, __half* dst16, int rows,
                                                 int n_tok, int r0, int t0) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < NI; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = r0 + (lane >> 2) + 8 * (e >> 1);
            const int tok = t0 + 8 * j + 2 * (lane & 3) + (e & 1);
            if (row < rows && tok < n_tok) {
                const float v = silu_f(acc[0][j][e]) * acc[1][j][e];
                const long long o = (long long)tok * rows + row;
                dst[o] = v;
                if (dst16) dst16[o] = __float2half_rn(v);
            }
        }
}

// The end of a 64 x 64 tiled block GEMM of 4 warps of 32 x 32 (dense_q.cu's dense_gemm_q; warp w:
// rows wm = 32 (w & 1), tokens wn = 32 (w >> 1)). dense_q8x.cu's dense_gemm_q8 calls
// gemm_warp_store with its own warp tiles.
__device__ __forceinline__ void gemm_tile_store(const float (&acc)[2][4][4], float* dst, bool add, int rows,
                                                int n_tok, int m0, int n0) {
    const int warp = threadIdx.x >> 5;
    gemm_warp_store<2, 4>(acc, dst, add, rows, n_tok, m0 + 32 * (warp & 1), n0 + 32 * (warp >> 1));
}
