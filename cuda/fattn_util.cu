// Small kernels around the attention kernels: the mask liveness pre-pass (scan + compact)
// and the split-KV combine pass. See fattn_common.cuh for the parameter block and layouts.
#include "fattn_common.cuh"

// Pass 1: flags[(i33*n_q_tiles + qt)*n_kv_tiles + kt] = 1 when any mask cell of
// (tokens of query tile qt, any head plane i32 < ne32, stream plane i33, KV columns of tile kt)
// is not -inf. Grid (n_kv_tiles, n_q_tiles, ne33); any block size (multiple of 32).
extern "C" __global__ void fattn_mask_scan(const FattnParams p, unsigned char* __restrict__ flags) {
    const int kt = blockIdx.x, qt = blockIdx.y, i33 = blockIdx.z;
    const int t0 = qt * p.q_tile_tokens;
    const int nrows = min(p.q_tile_tokens, p.n_batch - t0);
    const int c0 = kt * FATTN_KV_TILE;
    const int ncols = min(FATTN_KV_TILE, p.n_kv - c0);
    const char* base = p.mask + (long long)i33 * p.m_nb3 + (long long)t0 * p.m_nb1 + (long long)c0 * 2;
    const bool vec = ncols == FATTN_KV_TILE && ((reinterpret_cast<size_t>(base) | (size_t)p.m_nb1 | (size_t)p.m_nb2) & 15) == 0;
    int live = 0;
    if (vec) {
        const int items = nrows * p.ne32 * (FATTN_KV_TILE / 8);
        for (int i = threadIdx.x; i < items && !live; i += blockDim.x) {
            const int chunk = i & 7, rp = i >> 3;
            const int r = rp % nrows, pl = rp / nrows;
            const uint4 u = __ldg(reinterpret_cast<const uint4*>(base + (long long)r * p.m_nb1 + (long long)pl * p.m_nb2) + chunk);
            const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                live |= !f16_bits_is_neg_inf((unsigned short)(w[j] & 0xffffu));
                live |= !f16_bits_is_neg_inf((unsigned short)(w[j] >> 16));
            }
        }
    } else {
        const int items = nrows * p.ne32 * ncols;
        for (int i = threadIdx.x; i < items && !live; i += blockDim.x) {
            const int c = i % ncols, rp = i / ncols;
            const int r = rp % nrows, pl = rp / nrows;
            const unsigned short b = __ldg(reinterpret_cast<const unsigned short*>(
                base + (long long)r * p.m_nb1 + (long long)pl * p.m_nb2) + c);
            live |= !f16_bits_is_neg_inf(b);
        }
    }
    live = __syncthreads_or(live);
    if (threadIdx.x == 0)
        flags[((long long)i33 * p.n_q_tiles + qt) * p.n_kv_tiles + kt] = (unsigned char)(live != 0);
}

// Pass 2: compact the flags of each (i33, qt) into the ordered list of live KV tile ids.
// Grid (n_q_tiles, ne33), one warp per block.
extern "C" __global__ void fattn_mask_compact(const FattnParams p, const unsigned char* __restrict__ flags,
                                              int* __restrict__ idx, int* __restrict__ cnt) {
    const int qt = blockIdx.x, i33 = blockIdx.y, lane = threadIdx.x;
    const long long slot = (long long)i33 * p.n_q_tiles + qt;
    const unsigned char* f = flags + slot * p.n_kv_tiles;
    int* out = idx + slot * p.n_kv_tiles;
    int n = 0;
    for (int base = 0; base < p.n_kv_tiles; base += 32) {
        const int kt = base + lane;
        const bool live = kt < p.n_kv_tiles && f[kt];
        const unsigned b = __ballot_sync(0xffffffffu, live);
        if (live) out[n + __popc(b & ((1u << lane) - 1u))] = kt;
        n += __popc(b);
    }
    if (lane == 0) cnt[slot] = n;
}

// Split-KV combine: one block per output row r = (s*n_batch + t)*n_head + h (grid.x), any
// block size that is a multiple of 32 (<= 1024). n_splits <= FATTN_MAX_SPLITS.
// ws_ml[(z*n_rows + r)*2 + {0,1}] = (max in log2 domain, sum); ws_o[(z*n_rows + r)*d_v + c].
#define FATTN_MAX_SPLITS 256
extern "C" __global__ void fattn_combine(const FattnParams p) {
    __shared__ float w[FATTN_MAX_SPLITS];
    __shared__ float red[32];
    const long long r = blockIdx.x;
    const long long n_rows = (long long)p.ne3 * p.n_batch * p.n_head;
    const int h = (int)(r % p.n_head);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    // 1. global max over splits (and the sink)
    float mx = FATTN_NEG_INF;
    for (int z = tid; z < p.n_splits; z += blockDim.x) {
        const float m = p.ws_ml[(z * n_rows + r) * 2];
        w[z] = m;
        mx = fmaxf(mx, m);
    }
    mx = warp_max(mx);
    if (lane == 0) red[warp] = mx;
    __syncthreads();
    float M = FATTN_NEG_INF;
    for (int i = 0; i < nw; ++i) M = fmaxf(M, red[i]);
    const float sk = p.sinks ? __ldg(p.sinks + h) * FATTN_LOG2E : FATTN_NEG_INF;
    M = fmaxf(M, sk);
    __syncthreads();
    // 2. per-split factors and the total sum
    float sum = 0.0f;
    for (int z = tid; z < p.n_splits; z += blockDim.x) {
        const float m = w[z];
        const float f = (m == FATTN_NEG_INF) ? 0.0f : exp2f(m - M);
        w[z] = f;
        sum += f * p.ws_ml[(z * n_rows + r) * 2 + 1];
    }
    sum = warp_sum(sum);
    if (lane == 0) red[warp] = sum;
    __syncthreads();
    float L = 0.0f;
    for (int i = 0; i < nw; ++i) L += red[i];
    if (M != FATTN_NEG_INF && p.sinks) L += exp2f(sk - M);
    const float inv = L > 0.0f ? 1.0f / L : 0.0f;
    // 3. weighted sum of the partial outputs, columns across threads
    for (int c = tid; c < p.d_v; c += blockDim.x) {
        float acc = 0.0f;
        if (inv != 0.0f) {
            for (int z = 0; z < p.n_splits; ++z) {
                const float f = w[z];
                if (f != 0.0f) acc += p.ws_o[(z * n_rows + r) * p.d_v + c] * f;
            }
        }
        p.dst[r * p.d_v + c] = acc * inv;
    }
}
