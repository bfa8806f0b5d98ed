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

// Element d of a head of x (the head starting at x_head, its bias at bias_head or null) rotated
// as ggml_rope_ext (ext_factor 0, attn_factor 1) at position p: pair j of the head (j < n_dims /
// 2) is dims (2j, 2j + 1) (normal) or (j, j + n_dims / 2) (neox), turned by theta_j = freq_scale
// * (p * theta_scale^j) / ff[j], theta_scale^j applied as ggml's CPU op does (j float products);
// dims from n_dims on are copied.
__device__ __forceinline__ float rope_elem(const float* x_head, const float* bias_head, int d, float p,
                                           const float* __restrict__ ff, int n_dims, int neox,
                                           float theta_scale, float freq_scale) {
    if (d >= n_dims) return x_head[d] + (bias_head ? bias_head[d] : 0.0f);
    const int half = n_dims / 2;
    int j, d0;
    bool first;
    if (neox) { first = d < half; j = first ? d : d - half; d0 = j; }
    else      { first = (d & 1) == 0; j = d >> 1; d0 = 2 * j; }
    const int d1 = neox ? d0 + half : d0 + 1;
    float x0v = x_head[d0], x1v = x_head[d1];
    if (bias_head) { x0v += bias_head[d0]; x1v += bias_head[d1]; }
    float theta = p;
    for (int i = 0; i < j; ++i) theta *= theta_scale;
    if (ff) theta = theta / ff[j];
    theta = freq_scale * theta;
    float s, c;
    sincosf(theta, &s, &c);
    return first ? x0v * c - x1v * s : x0v * s + x1v * c;
}

// ggml_rope_ext of up to two tensors in one launch (a layer's Q and K): segment i, x_i (n_tok,
// n_head_i, head_dim) F32 into y_i after adding bias_i (n_head_i * head_dim, or null), n_i = n_tok
// * n_head_i * head_dim elements (n_1 = 0: one tensor); element e of the n_0 + n_1 is segment 0's
// e or segment 1's e - n_0, one per thread, at the position of its token (rope_elem).
extern "C" __global__ void __launch_bounds__(256) xp_rope(
        const float* __restrict__ x0, float* __restrict__ y0, const float* __restrict__ bias0, int n_head0, long long n0,
        const float* __restrict__ x1, float* __restrict__ y1, const float* __restrict__ bias1, int n_head1, long long n1,
        const int* __restrict__ pos, const float* __restrict__ ff,
        int head_dim, int n_dims, int neox, float theta_scale, float freq_scale) {
    const long long n = n0 + n1;
    for (long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; g < n; g += (long long)gridDim.x * blockDim.x) {
        const bool second = g >= n0;
        const long long e = second ? g - n0 : g;
        const float* bias = second ? bias1 : bias0;
        const int n_head = second ? n_head1 : n_head0;
        const int d = (int)(e % head_dim);
        const long long row = e / head_dim;               // token * n_head + head
        (second ? y1 : y0)[e] = rope_elem((second ? x1 : x0) + (e - d), bias ? bias + (int)(row % n_head) * head_dim : nullptr,
                                          d, (float)pos[row / n_head], ff, n_dims, neox, theta_scale, freq_scale);
    }
}

// xp_rope of a layer's Q into yq, and its K -- rotated -- and V written straight into the KV
// cache rows of their tokens (the K/V store of graph/kv_graph.py, fused: one launch for both):
// element e of nq + nk + nv is Q's e, K's e - nq or V's e - nq - nk. xq (n_tok, n_head_q,
// head_dim), xk (n_tok, n_head_k, head_dim) and xv (n_tok, n_embd_v) F32, biases (or null) per
// row; token t's K / V row goes to row rows[t] of cache_k (n_embd_k = n_head_k * head_dim values
// a row) / cache_v (n_embd_v), F16 where k_f16 / v_f16 (__float2half_rn, as dense_kv_store) else F32.
extern "C" __global__ void __launch_bounds__(256) xp_rope_store(
        const float* __restrict__ xq, float* __restrict__ yq, const float* __restrict__ bias_q, int n_head_q, long long nq,
        const float* __restrict__ xk, const float* __restrict__ bias_k, int n_head_k, long long nk,
        const float* __restrict__ xv, const float* __restrict__ bias_v, int n_embd_v, long long nv,
        void* __restrict__ cache_k, int k_f16, void* __restrict__ cache_v, int v_f16, const long long* __restrict__ rows,
        const int* __restrict__ pos, const float* __restrict__ ff,
        int head_dim, int n_dims, int neox, float theta_scale, float freq_scale) {
    const long long n = nq + nk + nv;
    for (long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; g < n; g += (long long)gridDim.x * blockDim.x) {
        float val;
        void* cache;
        bool f16;
        long long dst;
        if (g < nq + nk) {   // Q or K: rotated
            const bool k = g >= nq;
            const long long e = k ? g - nq : g;
            const int n_head = k ? n_head_k : n_head_q;
            const float* bias = k ? bias_k : bias_q;
            const int d = (int)(e % head_dim);
            const long long row = e / head_dim;            // token * n_head + head
            const long long t = row / n_head;
            val = rope_elem((k ? xk : xq) + (e - d), bias ? bias + (int)(row % n_head) * head_dim : nullptr, d,
                            (float)pos[t], ff, n_dims, neox, theta_scale, freq_scale);
            if (!k) { yq[e] = val; continue; }
            const long long n_embd_k = (long long)n_head_k * head_dim;
            cache = cache_k, f16 = k_f16 != 0, dst = rows[t] * n_embd_k + (e - t * n_embd_k);
        } else {             // V: as it is, plus its bias
            const long long e = g - nq - nk, t = e / n_embd_v, c = e - t * n_embd_v;
            val = xv[e] + (bias_v ? bias_v[c] : 0.0f);
            cache = cache_v, f16 = v_f16 != 0, dst = rows[t] * n_embd_v + c;
        }
        if (f16) static_cast<__half*>(cache)[dst] = __float2half_rn(val);
        else static_cast<float*>(cache)[dst] = val;
    }
}
