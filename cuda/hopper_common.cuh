// Device helpers for the Hopper (sm_90a) kernels: warpgroup MMA (wgmma) with operands in shared
// memory or A in registers, the shared-memory operand layout, mbarriers and TMA box loads.
// Compiled only into programs built for -arch=sm_90a (ggml_attn/kernels.py, Variant.arch_suffix
// "a"): NVRTC rejects wgmma for plain sm_90.
//
// Operand layout without swizzle ("interleaved"): a K-major tile of R rows x K halves is stored
// as 8 x 8 core matrices (8 rows of 16 bytes, 128 contiguous bytes each); the descriptor gives
// the byte distance between core matrices that are neighbours along K (the leading dimension
// byte offset) and along the rows (the stride dimension byte offset).
#pragma once
#include "fattn_common.cuh"   // smem_u32, the cp.async wrappers, FattnParams

// Matrix descriptor of a shared-memory operand, no swizzle: bits 0-13 start address >> 4,
// 16-29 leading dimension byte offset >> 4, 32-45 stride dimension byte offset >> 4,
// 49-51 base offset (0), 62-63 swizzle mode (0: none).
__device__ __forceinline__ unsigned long long wgmma_desc(unsigned smem_addr, unsigned lead_bytes,
                                                         unsigned stride_bytes) {
    return (unsigned long long)((smem_addr & 0x3FFFFu) >> 4) |
           ((unsigned long long)((lead_bytes >> 4) & 0x3FFFu) << 16) |
           ((unsigned long long)((stride_bytes >> 4) & 0x3FFFu) << 32);
}

// The same descriptor for an operand in the 128-byte swizzled layout that TMA writes with
// CU_TENSOR_MAP_SWIZZLE_128B (bits 62-63: 1). The layout's atom is 8 rows of 128 bytes (1024
// bytes, 1024-byte aligned), the 16-byte chunks of row r XOR-ed with r % 8.
//  - K-major (K of Q K^T: a row = 64 halves of D): lead_bytes unused (16), stride_bytes = 1024
//    (the next 8 rows); a k16 step inside the atom advances the start address by 32 bytes.
//  - MN-major (V of P V: a row = 64 halves of D for one cell, N = D): lead_bytes = the distance
//    between 64-wide blocks along N, stride_bytes = 1024 (the next 8 cells along K); a k16
//    step (16 cells) advances the start address by 2048 bytes.
__device__ __forceinline__ unsigned long long wgmma_desc_sw128(unsigned smem_addr, unsigned lead_bytes,
                                                               unsigned stride_bytes) {
    return wgmma_desc(smem_addr, lead_bytes, stride_bytes) | (1ull << 62);
}

// Index (in halves) of element (row, k) of a K-major tile of kt halves per row (kt a multiple
// of 8) stored as core matrices [row / 8][k / 8][row % 8][k % 8]: K-neighbour core matrices
// 128 bytes apart, row-neighbour ones kt / 8 * 128 bytes apart (the descriptor's lead and
// stride byte offsets).
__device__ __forceinline__ int core_matrix_index(int row, int k, int kt) {
    return ((row >> 3) * (kt >> 3) + (k >> 3)) * 64 + (row & 7) * 8 + (k & 7);
}

// Index (in halves) of element (k, n) of an MN-major operand of kt rows along K (a multiple of
// 8; N contiguous, as V is stored: cells x D) stored as core matrices [n / 8][k / 8][k % 8][n % 8]
// (16 contiguous bytes along N): K-neighbour core matrices 128 bytes apart (the lead byte
// offset), N-neighbour ones kt / 8 * 128 apart (the stride byte offset).
__device__ __forceinline__ int core_matrix_index_mn(int k, int n, int kt) {
    return ((n >> 3) * (kt >> 3) + (k >> 3)) * 64 + (k & 7) * 8 + (n & 7);
}

// Generic-proxy writes to shared memory (st.shared) made visible to the async proxy that
// wgmma reads its descriptors' operands through; every writing thread runs it before the
// barrier that precedes the wgmma.
__device__ __forceinline__ void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory"); }

// the accumulator registers' places in a wgmma's asm text: %0..%31 (m64n64), %0..%63 (m64n128)
#define WGMMA_ACC32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WGMMA_ACC64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// the 32 f32 accumulators of an m64n64 wgmma as read-write asm operands %0..%31
#define WGMMA_D32_OUTPUTS(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

// D[64 x 64] (+)= A[64 x 16] B[64 x 16]^T, f16 (BF16: bf16) operands in shared memory (both
// K-major), f32 accumulators: the warpgroup's 128 threads hold 32 each -- thread t of warp w
// holds, for column block i (0..7), d[4i + {0, 1}] at row 16w + t/4, columns 8i + 2(t%4) +
// {0, 1}, and d[4i + {2, 3}] at row 16w + 8 + t/4 (mma.sync's m16n8 accumulator layout, 8 times
// over). accumulate = false: D = A B^T (the accumulators' values are ignored).
#define WGMMA_M64N64_SS(TY)                                                                            \
    asm volatile(                                                                                      \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                   \
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " "                                    \
        WGMMA_ACC32 ", "                                                                               \
        "%32, %33, p, 1, 1, 0, 0;\n}\n"                                                                \
        : WGMMA_D32_OUTPUTS(d)                                                                         \
        : "l"(desc_a), "l"(desc_b), "r"((int)accumulate))
template <bool BF16 = false>
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], unsigned long long desc_a,
                                                unsigned long long desc_b, bool accumulate) {
    if constexpr (BF16) WGMMA_M64N64_SS("bf16");
    else WGMMA_M64N64_SS("f16");
}

// Accumulators pinned in place: an empty asm that reads and writes each register, placed
// after wgmma.wait so that no use of them is scheduled above the wait (the compiler does not
// know that wgmma writes its outputs asynchronously) and before an issue for the same reason.
template <int N>
__device__ __forceinline__ void wgmma_pin(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_pin(unsigned (&a)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(a[i]) :: "memory");
}

// the 64 f32 accumulators of an m64n128 wgmma as read-write asm operands %0..%63
#define WGMMA_D64_OUTPUTS(d) WGMMA_D32_OUTPUTS(d), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// D[64 x 128] (+)= A[64 x 16] B[128 x 16]^T, both in shared memory (K-major), accumulators as
// in wgmma_m64n64k16 with 16 column blocks of 8
#define WGMMA_M64N128_SS(TY)                                                                           \
    asm volatile(                                                                                      \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                   \
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " "                                   \
        WGMMA_ACC64 ", "                                                                               \
        "%64, %65, p, 1, 1, 0, 0;\n}\n"                                                                \
        : WGMMA_D64_OUTPUTS(d)                                                                         \
        : "l"(desc_a), "l"(desc_b), "r"((int)accumulate))
template <bool BF16 = false>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], unsigned long long desc_a,
                                                 unsigned long long desc_b, bool accumulate) {
    if constexpr (BF16) WGMMA_M64N128_SS("bf16");
    else WGMMA_M64N128_SS("f16");
}

// D[64 x 128] (+)= A[64 x 16] B[16 x 128], A from registers (the mma.sync m16n8k16 A fragment of
// each warp's 16 rows: a[0] rows g, k 2t..2t+1; a[1] rows g+8; a[2] rows g, k 8+2t..; a[3] rows
// g+8, k 8+2t..), B through its descriptor (TRANS_B 1: MN-major, N contiguous: V as ggml stores
// it; 0: K-major); f16 (BF16: bf16) operands; accumulators as in wgmma_m64n64k16 with 16 column
// blocks of 8: d[4i + {0, 1}] row 16w + t/4, d[4i + {2, 3}] row 16w + 8 + t/4.
#define WGMMA_M64N128_RS(TY)                                                                           \
    asm volatile(                                                                                      \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %70, 0;\n"                                                   \
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " "                                   \
        WGMMA_ACC64 ", "                                                                               \
        "{%64, %65, %66, %67}, %68, p, 1, 1, %69;\n}\n"                                               \
        : WGMMA_D64_OUTPUTS(d)                                                                         \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(TRANS_B), "r"((int)accumulate))
template <int TRANS_B, bool BF16 = false>
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const unsigned (&a)[4],
                                                    unsigned long long desc_b, bool accumulate) {
    if constexpr (BF16) WGMMA_M64N128_RS("bf16");
    else WGMMA_M64N128_RS("f16");
}

// D[64 x 64] (+)= A[64 x 16] B[16 x 64]: wgmma_m64n128k16_rs at N = 64 (8 column blocks of 8)
#define WGMMA_M64N64_RS(TY)                                                                            \
    asm volatile(                                                                                      \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %38, 0;\n"                                                   \
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " "                                    \
        WGMMA_ACC32 ", "                                                                               \
        "{%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"                                               \
        : WGMMA_D32_OUTPUTS(d)                                                                         \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(TRANS_B), "r"((int)accumulate))
template <int TRANS_B, bool BF16 = false>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const unsigned (&a)[4],
                                                   unsigned long long desc_b, bool accumulate) {
    if constexpr (BF16) WGMMA_M64N64_RS("bf16");
    else WGMMA_M64N64_RS("f16");
}

// Register reallocation between warpgroups (every thread of the warpgroup runs it): a producer
// warpgroup gives registers back (dec) so that the consumers can take them (inc); N a multiple
// of 8 in 24..256.
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(N)); }
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(N)); }

// ---- TMA (bulk tensor copies) and the mbarrier that counts their bytes
// The tensor map: 128 opaque bytes from cuTensorMapEncodeTiled (ggml_attn/tma.py), passed by
// value as a `const __grid_constant__` kernel parameter.
struct alignas(64) TmaMap {
    unsigned long long words[16];
};

__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(smem_u32(bar)), "r"(count) : "memory");
}
// the initialised barrier made visible to the async proxy (the TMA unit) before first use
__device__ __forceinline__ void fence_mbar_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// one arrival that also announces `bytes` of transactions the copies will complete
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                 :: "r"(smem_u32(bar)), "r"(bytes) : "memory");
}
// true once the barrier's phase `parity` has completed (the instruction may wait a while first)
__device__ __forceinline__ bool mbar_try_wait(unsigned long long* bar, unsigned parity) {
    unsigned done;
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
    return done != 0;
}
// a trap kept out of line (a barrier that never completes, a bad launch): an inlined trap makes ptxas ignore
// setmaxnreg's larger register budget for the whole kernel (it then spills the consumers)
__device__ __noinline__ void trap_out_of_line() { __trap(); }
// wait for phase `parity`; a barrier still open after 2^36 cycles (~40 s: a wrong byte count,
// a copy that never issued) traps instead of hanging the GPU -- long enough that preemption,
// time slicing or a sanitizer's slowdown do not trip it
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
    const long long t0 = clock64();
    while (!mbar_try_wait(bar, parity))
        if (clock64() - t0 > (1ll << 36)) trap_out_of_line();
}
// one plain arrival (the consumers' "stage free" signal)
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(smem_u32(bar)) : "memory");
}
// barrier `id` (1..15; 0 is __syncthreads) over `threads` threads (a multiple of 32)
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}
// one arrival on barrier `id` without waiting (the producer side of a named-barrier handoff)
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}
// box at element coordinates (x innermost, y) of a 2-D tensor map -> shared memory (dst 128-byte
// aligned); out-of-range elements are written as zeros; completes its bytes on `bar`
__device__ __forceinline__ void tma_load_2d(void* dst, const TmaMap* map, int x, int y,
                                            unsigned long long* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
        :: "r"(smem_u32(dst)), "l"(reinterpret_cast<unsigned long long>(map)), "r"(x), "r"(y),
           "r"(smem_u32(bar)) : "memory");
}
// the same for a 4-D map (x innermost, y, z, w): K/V as ggml stores them, [D, n_kv, head, stream]
__device__ __forceinline__ void tma_load_4d(void* dst, const TmaMap* map, int x, int y, int z, int w,
                                            unsigned long long* bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
        :: "r"(smem_u32(dst)), "l"(reinterpret_cast<unsigned long long>(map)), "r"(x), "r"(y), "r"(z),
           "r"(w), "r"(smem_u32(bar)) : "memory");
}
// shared memory (src 128-byte aligned; 1024 with a swizzled map) -> the box at element
// coordinates (x innermost, y, z, w) of a 4-D tensor map; elements outside the tensor are not
// written. The issuing thread's bulk group: tma_store_commit, then tma_store_wait_read (the
// shared memory may be rewritten) or tma_store_wait (the global writes done). The writes to src
// must be fenced for the async proxy first (fence_proxy_async_shared) and ordered before the
// issue (a barrier).
__device__ __forceinline__ void tma_store_4d(const TmaMap* map, const void* src, int x, int y, int z, int w) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
                 :: "l"(reinterpret_cast<unsigned long long>(map)), "r"(smem_u32(src)), "r"(x), "r"(y), "r"(z),
                    "r"(w) : "memory");
}
__device__ __forceinline__ void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void tma_store_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
__device__ __forceinline__ void tma_store_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
