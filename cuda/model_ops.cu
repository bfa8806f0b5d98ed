// The ops a real model's device graph adds to the full block's (graph/xp_ops.py: get_rows, rope,
// add_bias), one launch each (grid-stride; the ropes a block a token and slice); compiled and
// disk-cached as every program here (ggml_attn/kernels.py model_ops_variant).
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

// The rotation of pair j (j < n_dims / 2) at position p, as ggml_rope_ext (ext_factor 0,
// attn_factor 1): theta_j = freq_scale * (p * theta_scale^j) / ff[j], theta_scale^j applied as
// ggml's CPU op does (j float products after p), as (cos, sin).
__device__ __forceinline__ float2 rope_cs(int j, float p, const float* __restrict__ ff, float theta_scale,
                                          float freq_scale) {
    float theta = p;
    for (int i = 0; i < j; ++i) theta *= theta_scale;
    if (ff) theta = theta / ff[j];
    theta = freq_scale * theta;
    float s, c;
    sincosf(theta, &s, &c);
    return make_float2(c, s);
}

// A token's table of rope_cs for j < n_dims / 2 (at most ROPE_MAX_PAIRS) in shared memory, made
// by the block's first threads: every head of the token reads it (the chain of products and the
// sincos once a pair, not once an element).
#define ROPE_MAX_PAIRS 256
__device__ __forceinline__ void rope_table(float2* cs, int n_dims, float p, const float* __restrict__ ff,
                                           float theta_scale, float freq_scale) {
    for (int j = threadIdx.x; j < n_dims / 2; j += blockDim.x) cs[j] = rope_cs(j, p, ff, theta_scale, freq_scale);
    __syncthreads();
}

// Element d of a head of x (the head starting at x_head, its bias at bias_head or null) rotated by
// its pair's (cos, sin) of the token's table cs: pair j is dims (2j, 2j + 1) (normal) or (j, j +
// n_dims / 2) (neox); dims from n_dims on are copied. Each product and the difference rounded on
// its own (no fused multiply-add: the same bits in every kernel that rotates).
__device__ __forceinline__ float rope_elem(const float* x_head, const float* bias_head, int d, int n_dims, int neox,
                                           const float2* cs) {
    if (d >= n_dims) return x_head[d] + (bias_head ? bias_head[d] : 0.0f);
    const int half = n_dims / 2;
    int j, d0;
    bool first;
    if (neox) { first = d < half; j = first ? d : d - half; d0 = j; }
    else      { first = (d & 1) == 0; j = d >> 1; d0 = 2 * j; }
    const int d1 = neox ? d0 + half : d0 + 1;
    float x0v = x_head[d0], x1v = x_head[d1];
    if (bias_head) { x0v += bias_head[d0]; x1v += bias_head[d1]; }
    const float c = cs[j].x, s = cs[j].y;
    return first ? __fsub_rn(__fmul_rn(x0v, c), __fmul_rn(x1v, s)) : __fadd_rn(__fmul_rn(x0v, s), __fmul_rn(x1v, c));
}

// ggml_rope_ext of up to two tensors in one launch (a layer's Q and K): segment i, x_i (n_tok,
// n_head_i, head_dim) F32 into y_i after adding bias_i (n_head_i * head_dim, or null), n_i = n_tok
// * n_head_i * head_dim elements (n_1 = 0: one tensor). A grid (n_tok, any): block (t, y) makes
// token t's table (rope_table) and rotates every gridDim.y-th 256 of the token's elements of both
// segments (rope_elem).
extern "C" __global__ void __launch_bounds__(256) xp_rope(
        const float* __restrict__ x0, float* __restrict__ y0, const float* __restrict__ bias0, int n_head0, long long n0,
        const float* __restrict__ x1, float* __restrict__ y1, const float* __restrict__ bias1, int n_head1, long long n1,
        const int* __restrict__ pos, const float* __restrict__ ff,
        int head_dim, int n_dims, int neox, float theta_scale, float freq_scale) {
    __shared__ float2 cs[ROPE_MAX_PAIRS];
    const long long t = blockIdx.x;
    rope_table(cs, n_dims, (float)pos[t], ff, theta_scale, freq_scale);
    const int per0 = n0 ? n_head0 * head_dim : 0, per1 = n1 ? n_head1 * head_dim : 0;
    for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < per0 + per1; i += gridDim.y * blockDim.x) {
        const bool second = i >= per0;
        const int k = second ? i - per0 : i, d = k % head_dim, h = k / head_dim;
        const long long e = t * (second ? per1 : per0) + k;
        const float* bias = second ? bias1 : bias0;
        (second ? y1 : y0)[e] = rope_elem((second ? x1 : x0) + (e - d), bias ? bias + h * head_dim : nullptr, d, n_dims,
                                          neox, cs);
    }
}

// xp_rope of a layer's Q into yq, and its K -- rotated -- and V written straight into the KV
// cache rows of their tokens (the K/V store of graph/kv_graph.py, fused: one launch for both):
// token t's elements are its Q's, then its K's, then its V's. xq (n_tok, n_head_q, head_dim), xk
// (n_tok, n_head_k, head_dim) and xv (n_tok, n_embd_v) F32, biases (or null) per row; token t's K
// / V row goes to row rows[t] of cache_k (n_embd_k = n_head_k * head_dim values a row) / cache_v
// (n_embd_v), F16 where k_f16 / v_f16 (__float2half_rn, as dense_kv_store) else F32. Grid as
// xp_rope's (nq, nk, nv: the n_tok tokens' elements of each).
extern "C" __global__ void __launch_bounds__(256) xp_rope_store(
        const float* __restrict__ xq, float* __restrict__ yq, const float* __restrict__ bias_q, int n_head_q, long long nq,
        const float* __restrict__ xk, const float* __restrict__ bias_k, int n_head_k, long long nk,
        const float* __restrict__ xv, const float* __restrict__ bias_v, int n_embd_v, long long nv,
        void* __restrict__ cache_k, int k_f16, void* __restrict__ cache_v, int v_f16, const long long* __restrict__ rows,
        const int* __restrict__ pos, const float* __restrict__ ff,
        int head_dim, int n_dims, int neox, float theta_scale, float freq_scale) {
    __shared__ float2 cs[ROPE_MAX_PAIRS];
    const long long t = blockIdx.x;
    rope_table(cs, n_dims, (float)pos[t], ff, theta_scale, freq_scale);
    const int pq = n_head_q * head_dim, pk = n_head_k * head_dim, pv = nv ? n_embd_v : 0;
    for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < pq + pk + pv; i += gridDim.y * blockDim.x) {
        float val;
        void* cache;
        bool f16;
        long long dst;
        if (i < pq + pk) {   // Q or K: rotated
            const bool k = i >= pq;
            const int c = k ? i - pq : i, d = c % head_dim, h = c / head_dim;
            const long long e = t * (k ? pk : pq) + c;
            const float* bias = k ? bias_k : bias_q;
            val = rope_elem((k ? xk : xq) + (e - d), bias ? bias + h * head_dim : nullptr, d, n_dims, neox, cs);
            if (!k) { yq[e] = val; continue; }
            cache = cache_k, f16 = k_f16 != 0, dst = rows[t] * pk + c;
        } else {             // V: as it is, plus its bias
            const int c = i - pq - pk;
            val = xv[t * pv + c] + (bias_v ? bias_v[c] : 0.0f);
            cache = cache_v, f16 = v_f16 != 0, dst = rows[t] * pv + c;
        }
        if (f16) static_cast<__half*>(cache)[dst] = __float2half_rn(val);
        else static_cast<float*>(cache)[dst] = val;
    }
}
