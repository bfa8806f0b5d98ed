// The 8-bit form of activations that the 8-bit GEMVs read (dense_q8x.cu), made by whichever kernel
// wrote the values: dense_quant_q8x and the GEMVs' q8x_finish (dense_q8x.cu), fattn_cells' epilogue
// and fattn_quant_q8x (fattn_util.cu) for the attention's output. The same bits from the same values
// wherever it runs.
#pragma once

// A warp's 32 values v (lane i's the i-th) in 8-bit form: d = max|v| / 127, q = round(v / d) (0
// where d is 0, ties to even) into q[lane], d and the sum of the q into *d, *s. Every lane of the
// warp calls it.
__device__ __forceinline__ void q8x_quant32(float v, signed char* q, float* d, float* s) {
    const int lane = threadIdx.x & 31;
    float amax = fabsf(v);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float dd = amax / 127.0f;
    const int qi = dd > 0.0f ? __float2int_rn(v / dd) : 0;
    int sum = qi;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    q[lane] = (signed char)qi;
    if (lane == 0) *d = dd, *s = (float)sum;
}

// q8x_quant32 of N groups at once, their reductions interleaved (N independent shuffle chains in
// flight instead of one after another: the same bits): group n's 32 values v[n] into q + 32 g[n],
// d + g[n], s + g[n], written only where live[n] (warp-uniform; a dead group's values are 0).
template <int N>
__device__ __forceinline__ void q8x_quant32_n(const float (&v)[N], const bool (&live)[N], const long long (&g)[N],
                                              signed char* q, float* d, float* s) {
    const int lane = threadIdx.x & 31;
    float amax[N], dd[N];
    int qi[N], sum[N];
#pragma unroll
    for (int n = 0; n < N; ++n) amax[n] = fabsf(v[n]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int n = 0; n < N; ++n) amax[n] = fmaxf(amax[n], __shfl_xor_sync(0xffffffffu, amax[n], o));
#pragma unroll
    for (int n = 0; n < N; ++n) {
        dd[n] = amax[n] / 127.0f;
        qi[n] = dd[n] > 0.0f ? __float2int_rn(v[n] / dd[n]) : 0;
        sum[n] = qi[n];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int n = 0; n < N; ++n) sum[n] += __shfl_xor_sync(0xffffffffu, sum[n], o);
#pragma unroll
    for (int n = 0; n < N; ++n) {
        if (!live[n]) continue;
        q[32 * g[n] + lane] = (signed char)qi[n];
        if (lane == 0) d[g[n]] = dd[n], s[g[n]] = (float)sum[n];
    }
}
