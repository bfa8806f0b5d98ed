// The staged block GEMMs' weight tiles (dense_q8x.cu's dense_gemm_q8, dense_q.cu's dense_gemm_qs):
// one step's raw block bytes of a tile's rows copied by cp.async into shared memory.
#pragma once
#include "mma_ptx.cuh"   // smem_u32, cp.async

// Step kstep's RB bytes of each of BM weight rows from row m0 (W: rows of row_bytes bytes, 16-byte
// aligned, a multiple of 16) into shared memory at sw: each row's run from the 16-byte unit below
// its start, UNITS units, SLOT bytes between staged rows (a staged row keeps its global bytes'
// alignment mod 16); zeros past the rows or a row's end. THREADS threads share the copies; no
// commit (the caller's group holds them with its other copies).
template <int RB, int UNITS, int SLOT, int BM, int THREADS>
__device__ __forceinline__ void stage_weight_rows(const unsigned char* w, long long row_bytes, int rows, int m0,
                                                  int kstep, unsigned sw) {
    const int a0 = (kstep * RB) & ~15;   // the run's first unit
#pragma unroll
    for (int j = 0; j < (BM * UNITS + THREADS - 1) / THREADS; ++j) {
        const int u = threadIdx.x + THREADS * j, r = u / UNITS, o = a0 + 16 * (u % UNITS);
        if ((BM * UNITS) % THREADS == 0 || u < BM * UNITS) {
            const bool ok = m0 + r < rows && o < row_bytes;
            cp_async16(sw + r * SLOT + 16 * (u % UNITS), ok ? w + (long long)(m0 + r) * row_bytes + o : w, ok ? 16 : 0);
        }
    }
}
