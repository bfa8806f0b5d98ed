// Checks of the Hopper building blocks in hopper_common.cuh against the host (GPU tests in
// tests/test_gpu_hopper.py; compiled for sm_90a only). Not used by the op.
#include "fattn_wgmma.cuh"   // hopper_common.cuh and version 1's tile steps

// C[64 x 8 NB] (row-major) = a warpgroup's accumulators of NB column blocks of 8
template <int NB>
__device__ __forceinline__ void store_accumulators(float* C, const float (&d)[4 * NB]) {
    const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t4 = threadIdx.x & 3;
    const int r0 = 16 * warp + g, ld = 8 * NB;
#pragma unroll
    for (int i = 0; i < NB; ++i) {
        const int c = 8 * i + 2 * t4;
        C[r0 * ld + c] = d[4 * i];
        C[r0 * ld + c + 1] = d[4 * i + 1];
        C[(r0 + 8) * ld + c] = d[4 * i + 2];
        C[(r0 + 8) * ld + c + 1] = d[4 * i + 3];
    }
}

// C[64 x 64] f32 = A[64 x K] B[64 x K]^T, A and B f16 row-major in global memory, K a multiple
// of 16 up to 64: the tiles are staged into shared memory as core matrices, then K / 16
// wgmma m64n64k16 steps accumulate (the first one overwrites), one commit and one wait.
// lead_bytes / stride_bytes: the descriptors' byte offsets (128 and K / 8 * 128 for the
// core-matrix layout above; the test passes others to tell which field is which).
// One warpgroup: grid 1, block 128.
extern "C" __global__ void __launch_bounds__(128)
hopper_probe_gemm(const __half* A, const __half* B, float* C, int K, unsigned lead_bytes, unsigned stride_bytes) {
    constexpr int KT = 64;
    __shared__ __align__(128) __half sA[64 * KT];
    __shared__ __align__(128) __half sB[64 * KT];
    const int tid = threadIdx.x;
    for (int i = tid; i < 64 * K; i += 128) {
        const int idx = core_matrix_index(i / K, i % K, K);
        sA[idx] = A[i];
        sB[idx] = B[i];
    }
    fence_proxy_async_shared();
    __syncthreads();
    float d[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) d[i] = 0.0f;
    const unsigned a0 = smem_u32(sA), b0 = smem_u32(sB);
    wgmma_fence();
    for (int ks = 0; ks < K / 16; ++ks) {
        // step ks: the two K-neighbour core-matrix columns 2ks, 2ks+1 of every row group
        const unsigned off = ks * 2 * 128;
        wgmma_m64n64k16(d, wgmma_desc(a0 + off, lead_bytes, stride_bytes),
                            wgmma_desc(b0 + off, lead_bytes, stride_bytes), ks > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    store_accumulators<8>(C, d);
}

// C[64 x 128] f32 = A[64 x K] B[K x 128] through wgmma_m64n128k16_rs (the P V step of
// cuda/fattn_wgmma.cu): A f16 row-major in global memory, loaded into registers as mma.sync A
// fragments; B f16 row-major (N contiguous: MN-major, like V) staged by core_matrix_index_mn;
// K / 16 steps with trans-b = 1. lead_bytes / stride_bytes as in hopper_probe_gemm (the test
// tells which field is which for this layout).
extern "C" __global__ void __launch_bounds__(128)
hopper_probe_gemm_rs(const __half* A, const __half* B, float* C, int K, unsigned lead_bytes, unsigned stride_bytes) {
    __shared__ __align__(128) __half sB[64 * 128];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    for (int i = tid; i < K * 128; i += 128) sB[core_matrix_index_mn(i / 128, i % 128, K)] = B[i];
    fence_proxy_async_shared();
    __syncthreads();
    float d[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = 0.0f;
    const unsigned b0 = smem_u32(sB);
    const int r0 = 16 * warp + g;
    auto pair = [&](int r, int k) {   // A[r][k], A[r][k + 1] as one f16x2 register
        __half2 h = __halves2half2(A[r * K + k], A[r * K + k + 1]);
        return *reinterpret_cast<unsigned*>(&h);
    };
    for (int ks = 0; ks < K / 16; ++ks) {
        const int k0 = 16 * ks + 2 * t4;
        const unsigned a[4] = {pair(r0, k0), pair(r0 + 8, k0), pair(r0, k0 + 8), pair(r0 + 8, k0 + 8)};
        wgmma_fence();   // registers an earlier wgmma may read were written: fence before each
        // step ks: K rows 16ks .. 16ks+15 = K-neighbour core matrices 2ks, 2ks+1
        wgmma_m64n128k16_rs<1>(d, a, wgmma_desc(b0 + ks * 2 * 128, lead_bytes, stride_bytes), ks > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    store_accumulators<16>(C, d);
}

// One TMA box (box_x x box_y f16, the map's box) at element coordinates (x, y) of a 2-D tensor
// -> shared memory -> out[box_y][box_x]: the map's encoding, the mbarrier's byte count and the
// zero fill past the tensor's edges. One block of 128 threads; box at most 64 x 64.
extern "C" __global__ void __launch_bounds__(128)
hopper_probe_tma(const __grid_constant__ TmaMap map, __half* out, int x, int y, int box_x, int box_y) {
    __shared__ __align__(128) __half tile[64 * 64];
    __shared__ __align__(8) unsigned long long bar;
    if (threadIdx.x == 0) {
        mbar_init(&bar, 1);
        fence_mbar_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        mbar_arrive_expect_tx(&bar, box_x * box_y * 2);
        tma_load_2d(tile, &map, x, y, &bar);
    }
    mbar_wait(&bar, 0);
    for (int i = threadIdx.x; i < box_x * box_y; i += blockDim.x) out[i] = tile[i];
}

// The operand path of cuda/fattn_wgmma.cu's version 1: K and V tiles (64 rows x 128 halves,
// row-major in global memory) copied by TMA as two 64 x 64 boxes each with the 128-byte swizzle
// (maps from ggml_attn/tma.py), then S[64 x 64] = Q K^T by ws_issue_s (Q f16 row-major from
// global, staged as core matrices) and O[64 x 128] = P V by ws_issue_pv (P f16 64 x 64 row-major
// from global, as A fragments). One block of 128 threads.
extern "C" __global__ void __launch_bounds__(128)
hopper_probe_sw128(const __grid_constant__ TmaMap mk, const __grid_constant__ TmaMap mv, const __half* Q,
                   const __half* P, float* S_out, float* O_out) {
    extern __shared__ unsigned char smem_probe[];
    unsigned char* base = smem_align1024(smem_probe);
    __half* sK = reinterpret_cast<__half*>(base);
    __half* sV = sK + 64 * 128;
    __half* sQ = sV + 64 * 128;
    __shared__ __align__(8) unsigned long long bar;
    const int tid = threadIdx.x, warp = tid >> 5, g = (tid & 31) >> 2, t4 = tid & 3;
    if (tid == 0) {
        mbar_init(&bar, 1);
        fence_mbar_init();
    }
    for (int i = tid; i < 64 * 128; i += 128) sQ[core_matrix_index(i / 128, i % 128, 128)] = Q[i];
    fence_proxy_async_shared();
    __syncthreads();
    if (tid == 0) {
        mbar_arrive_expect_tx(&bar, 4 * 64 * 64 * 2);
        tma_load_2d(sK, &mk, 0, 0, &bar);
        tma_load_2d(sK + 64 * 64, &mk, 64, 0, &bar);
        tma_load_2d(sV, &mv, 0, 0, &bar);
        tma_load_2d(sV + 64 * 64, &mv, 64, 0, &bar);
    }
    mbar_wait(&bar, 0);
    float S[32], O[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) O[i] = 0.0f;
    wgmma_fence();
    ws_issue_s<128, 64>(S, smem_u32(sQ), smem_u32(sK));
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_pin(S);
    unsigned a[16];
    const int r0 = 16 * warp + g;
    auto pair = [&](int r, int k) {
        __half2 h = __halves2half2(P[r * 64 + k], P[r * 64 + k + 1]);
        return *reinterpret_cast<unsigned*>(&h);
    };
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        const int k0 = 16 * kk + 2 * t4;
        a[4 * kk] = pair(r0, k0);
        a[4 * kk + 1] = pair(r0 + 8, k0);
        a[4 * kk + 2] = pair(r0, k0 + 8);
        a[4 * kk + 3] = pair(r0 + 8, k0 + 8);
    }
    wgmma_fence();
    ws_issue_pv<128, 64>(O, a, smem_u32(sV));
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_pin(O);
    store_accumulators<8>(S_out, S);
    store_accumulators<16>(O_out, O);
}
