// Checks of the Hopper building blocks in hopper_common.cuh against the host (GPU tests in
// tests/test_gpu_hopper.py; compiled for sm_90a only). Not used by the op.
#include "hopper_common.cuh"

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
    const unsigned a0 = hopper_smem_u32(sA), b0 = hopper_smem_u32(sB);
    wgmma_fence();
    for (int ks = 0; ks < K / 16; ++ks) {
        // step ks: the two K-neighbour core-matrix columns 2ks, 2ks+1 of every row group
        const unsigned off = ks * 2 * 128;
        wgmma_m64n64k16_f16(d, wgmma_desc(a0 + off, lead_bytes, stride_bytes),
                            wgmma_desc(b0 + off, lead_bytes, stride_bytes), ks > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int r0 = 16 * warp + g, c = 8 * i + 2 * t4;
        C[r0 * 64 + c] = d[4 * i];
        C[r0 * 64 + c + 1] = d[4 * i + 1];
        C[(r0 + 8) * 64 + c] = d[4 * i + 2];
        C[(r0 + 8) * 64 + c + 1] = d[4 * i + 3];
    }
}
