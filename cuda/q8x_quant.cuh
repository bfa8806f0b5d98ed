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

