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

// ggml_rope_ext (ext_factor 0, attn_factor 1) of up to two tensors in one launch (a layer's Q
// and K): segment i, x_i (n_tok, n_head_i, head_dim) F32 into y_i after adding bias_i (n_head_i *
// head_dim, or null), n_i = n_tok * n_head_i * head_dim elements (n_1 = 0: one tensor); element e
// of the n_0 + n_1 is segment 0's e or segment 1's e - n_0, one per thread. Pair j of a head (j <
// n_dims / 2): dims (2j, 2j + 1) (normal) or (j, j + n_dims / 2) (neox), rotated by
// theta_j = freq_scale * (pos * theta_scale^j) / ff[j], theta_scale^j applied as ggml's CPU
// op does (j float products); dims from n_dims on are copied.
extern "C" __global__ void __launch_bounds__(256) xp_rope(
        const float* __restrict__ x0, float* __restrict__ y0, const float* __restrict__ bias0, int n_head0, long long n0,
        const float* __restrict__ x1, float* __restrict__ y1, const float* __restrict__ bias1, int n_head1, long long n1,
        const int* __restrict__ pos, const float* __restrict__ ff,
        int head_dim, int n_dims, int neox, float theta_scale, float freq_scale) {
    const long long n = n0 + n1;
    for (long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; g < n; g += (long long)gridDim.x * blockDim.x) {
        const bool second = g >= n0;
        const long long e = second ? g - n0 : g;
        const float* x = second ? x1 : x0;
        float* y = second ? y1 : y0;
        const float* bias = second ? bias1 : bias0;
        const int n_head = second ? n_head1 : n_head0;
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
        float x0v = x[base + d0], x1v = x[base + d1];
        if (bias) { x0v += bias[hb + d0]; x1v += bias[hb + d1]; }
        float theta = (float)pos[row / n_head];
        for (int i = 0; i < j; ++i) theta *= theta_scale;
        if (ff) theta = theta / ff[j];
        theta = freq_scale * theta;
        float s, c;
        sincosf(theta, &s, &c);
        y[e] = first ? x0v * c - x1v * s : x0v * s + x1v * c;
    }
}
