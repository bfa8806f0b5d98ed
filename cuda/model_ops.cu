// The ops a real model's device graph adds to the full block's (graph/xp_ops.py: get_rows, rope,
// add_bias), one grid-stride launch each; compiled and disk-cached as every program here
// (ggml_attn/kernels.py model_ops_variant).
#include <cuda_fp16.h>

// out[r, c] = table[ids[r], c] (F16 or F32 table, C-contiguous, n_cols per row) as F32; n = n_ids * n_cols.
extern "C" __global__ void __launch_bounds__(256) xp_get_rows_f16(const __half* __restrict__ table,
        const int* __restrict__ ids, float* __restrict__ out, long long n_cols, long long n) {
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x) {
        const long long r = e / n_cols;
        out[e] = __half2float(table[(long long)ids[r] * n_cols + (e - r * n_cols)]);
    }
}

extern "C" __global__ void __launch_bounds__(256) xp_get_rows_f32(const float* __restrict__ table,
        const int* __restrict__ ids, float* __restrict__ out, long long n_cols, long long n) {
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x) {
        const long long r = e / n_cols;
        out[e] = table[(long long)ids[r] * n_cols + (e - r * n_cols)];
    }
}

// x[r, c] += bias[c], in place; n = n_rows * n_cols.
extern "C" __global__ void __launch_bounds__(256) xp_add_bias(float* __restrict__ x,
        const float* __restrict__ bias, long long n_cols, long long n) {
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x)
        x[e] += bias[e % n_cols];
}

// ggml_rope_ext (ext_factor 0, attn_factor 1) of x (n_tok, n_head, head_dim) F32 into y, after
// adding bias (n_head * head_dim, or null); one element per thread. Pair j of a head (j <
// n_dims / 2): dims (2j, 2j + 1) (normal) or (j, j + n_dims / 2) (neox), rotated by
// theta_j = freq_scale * (pos * theta_scale^j) / ff[j], theta_scale^j applied as ggml's CPU
// op does (j float products); dims from n_dims on are copied.
extern "C" __global__ void __launch_bounds__(256) xp_rope(const float* __restrict__ x, float* __restrict__ y,
        const int* __restrict__ pos, const float* __restrict__ ff, const float* __restrict__ bias,
        int n_head, int head_dim, int n_dims, int neox, float theta_scale, float freq_scale, long long n) {
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x) {
        const int d = (int)(e % head_dim);
        const long long row = e / head_dim;               // token * n_head + head
        const int hb = (int)(row % n_head) * head_dim;     // the head's bias offset
        if (d >= n_dims) {
            y[e] = x[e] + (bias ? bias[hb + d] : 0.0f);
            continue;
        }
        const int half = n_dims / 2;
        int j, d0;
        bool first;
        if (neox) { first = d < half; j = first ? d : d - half; d0 = j; }
        else      { first = (d & 1) == 0; j = d >> 1; d0 = 2 * j; }
        const int d1 = neox ? d0 + half : d0 + 1;
        const long long base = e - d;
        float x0 = x[base + d0], x1 = x[base + d1];
        if (bias) { x0 += bias[hb + d0]; x1 += bias[hb + d1]; }
        float theta = (float)pos[row / n_head];
        for (int i = 0; i < j; ++i) theta *= theta_scale;
        if (ff) theta = theta / ff[j];
        theta = freq_scale * theta;
        float s, c;
        sincosf(theta, &s, &c);
        y[e] = first ? x0 * c - x1 * s : x0 * s + x1 * c;
    }
}
