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

// The same copies planned once for every step (dense_qw.cu's dense_gemm_qw): two of the THREADS
// threads a row, BM / (THREADS / 2) passes, each thread units h, h + 2, ... of its rows' runs -- the pair reads 32 contiguous bytes, and every unit sits at the
// same place of each step's run, so a step's copy is one cp.async at constant offsets from the
// pointers fixed here. A copy outside the weights (a row past rows, a unit past a row's end)
// reads nothing (source size 0: zeros); its address is never dereferenced.
template <int RB, int UNITS, int SLOT, int BM, int THREADS>
struct StagedRowCopies {
    static constexpr int PASS = THREADS / 2, PASSES = BM / PASS, NU = (UNITS + 1) / 2;
    static_assert(BM % PASS == 0, "whole passes of two threads a row");
    const unsigned char* w[PASSES];   // the rows' first bytes (w where a row is past rows)
    unsigned sw;                      // the first row's unit h, from the staged rows' start
    int h;
    bool row_ok[PASSES];
    __device__ __forceinline__ StagedRowCopies(const unsigned char* wt, long long row_bytes, int rows, int m0) {
        const int r = threadIdx.x / 2;
        h = threadIdx.x % 2;
#pragma unroll
        for (int q = 0; q < PASSES; ++q) {
            row_ok[q] = m0 + r + PASS * q < rows;
            w[q] = row_ok[q] ? wt + (long long)(m0 + r + PASS * q) * row_bytes : wt;
        }
        sw = r * SLOT + 16 * h;
    }
    // step kstep's copies into the staged rows at shared address s (no commit)
    __device__ __forceinline__ void copy(unsigned s, int kstep, long long row_bytes) const {
        const int a0 = (kstep * RB) & ~15;   // the run's first unit
#pragma unroll
        for (int q = 0; q < PASSES; ++q)
#pragma unroll
            for (int j = 0; j < NU; ++j) {
                const int u = h + 2 * j;   // (an odd UNITS: the last j of the even threads only)
                if (UNITS % 2 == 0 || u < UNITS)
                    cp_async16(s + sw + PASS * q * SLOT + 32 * j, w[q] + a0 + 16 * u,
                               row_ok[q] && a0 + 16 * u < row_bytes ? 16 : 0);
            }
    }
};
