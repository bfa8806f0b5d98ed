// PTX wrappers (sm_80+) shared by the attention kernels (through fattn_common.cuh) and the block
// GEMMs of dense_q.cu and dense_q8x.cu: shared-space addresses, cp.async, ldmatrix, mma.sync
// (f16/bf16 m16n8k16, int8 m16n8k32 and m16n8k16).
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

__device__ __forceinline__ unsigned smem_u32(const void* ptr) {
    return static_cast<unsigned>(__cvta_generic_to_shared(ptr));
}

// The first 1024-byte aligned byte of a dynamic shared memory array (the TMA boxes' 128-byte
// swizzle needs 1024-byte aligned tiles), as a pointer derived from the array itself: what is
// reached through it stays in the shared space (LDS/STS, 32-bit addresses), where a pointer made
// from an integer is generic (LD.E/ST.E on 64-bit addresses).
__device__ __forceinline__ unsigned char* smem_align1024(unsigned char* smem) {
    return smem + ((1024u - (smem_u32(smem) & 1023u)) & 1023u);
}

// 16-byte async copy global -> shared; src_bytes 0 fills zeros (out-of-range rows)
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(src_bytes));
}
// 4-byte async copy global -> shared (through L1); src_bytes 0 fills zeros
__device__ __forceinline__ void cp_async4(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" :: "r"(dst), "l"(src), "r"(src_bytes));
}
// A 4-byte shared-memory load that the compiler neither merges with another nor moves.
__device__ __forceinline__ __half2 lds_half2(unsigned addr) {
    unsigned u;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(u) : "r"(addr));
    return *reinterpret_cast<const __half2*>(&u);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

// D = A*B + D, m16n8k16, f32 accumulate
template <typename T> struct Mma;
template <> struct Mma<__half> {
    static __device__ __forceinline__ void run(float* d, const unsigned* a, unsigned b0, unsigned b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};
template <> struct Mma<__nv_bfloat16> {
    static __device__ __forceinline__ void run(float* d, const unsigned* a, unsigned b0, unsigned b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

// d += a b on int8 operands, s32 accumulators (dense_q8x.cu's block GEMM; zero d to start a sum):
// m16n8k32, a[0] = A[g][4 t ..], a[1] = A[g + 8][4 t ..], a[2], a[3] the same 16 columns on,
// b0 = B[4 t ..][g], b1 16 rows on (g = lane / 4, t = lane % 4; d as the f16 shapes' C); and
// m16n8k16, its first half (a0, a1, b0).
__device__ __forceinline__ void mma_s8_k32(int (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_s8_k16(int (&d)[4], unsigned a0, unsigned a1, unsigned b0) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 "
                 "{%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a0), "r"(a1), "r"(b0));
}
