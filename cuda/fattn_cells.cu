// Cell-list decode: CUDA-core flash-decoding over each query row's own list of visible KV cells.
//
// For decode steps over a unified KV cache, where the cells of many sequences interleave (every
// 64-cell tile holds a cell of every sequence): every KV tile is live for every query tile, so
// the tile kernels read the whole cache per query tile although each row sees ~1/n_seq of it.
// This kernel reads only the row's cells, from the plan's cell lists (fattn_cell_lists,
// fattn_util.cu: per mask row the cells whose mask is not -inf, with their mask values).
//
// Block = 4 warps; it owns R query heads of one KV head (heads h0 .. h0+R-1, h0 = blockIdx.y*R,
// R divides gqa) for one token (blockIdx.x) of stream s, and the range [jb, je) of the row's
// cell list given to split z (blockIdx.z = s*n_splits + z). The heads share one list: the host
// launches R = 1 when the mask has several head planes (ne32 > 1). L lanes (a "group") share
// one cell, each lane 16-byte chunks of its K and V rows; a group walks U consecutive list
// entries per step (all U K and V rows loaded before any is used: several cells in flight per
// group, 32/L groups per warp), the groups of the block taking steps in turn. Each group keeps
// its own online-softmax state (f32, log2 domain, exp2) in registers -- no barrier in the loop;
// the groups' states are merged once, in shared memory, at the end, then dst is written (one
// split) or the split workspace (fattn_combine finishes, as for the other kernels).
// Grid (n_batch, n_head / R, ne3 * n_splits); 128 threads; dynamic shared memory CellsCfg::SMEM
// (the host reads it from the cubin: fattn_cells_smem, at the end of this file).
// Instances fattn_cells<DK, DV, T, R, U, PF, MINB, QO>: U list entries per group and step, PF the
// prefetch depth (0: a step's list entries, then their K/V gathers, then math -- two dependent
// load latencies per step; 1: the next step's entries are loaded before this step's math; 2: the
// next step's K/V rows too, entries two steps ahead), MINB the __launch_bounds__ minimum blocks
// per SM (0: no hint). The default (4, 0, 0) and the sweep: kernels.CellsTune / CELLS_SWEEP.
// QO (one split, DV a multiple of 32; ggml_attn/q8_out.py): the output in the 8-bit form the
// 8-bit GEMVs read as well (cuda/q8x_quant.cuh), each warp's 32 values of epilogue 3 one 32-value
// group of the token's n_head * DV outputs -- no quantization launch before the O projection. Its
// three arrays ride in the fields one split leaves unused: ws_o the int8 values (n_tokens, n_head *
// DV), ws_ml the scales and split_cnt the sums (n_tokens, n_head * DV / 32), F32 each: each turn
// of the epilogue's loop quantizes its group (two dependent chains of five shuffles a turn, R turns:
// on the H100 the attention took 6.86 us against 5.88 for the 8 blocks of a one-token step; every
// turn's value first and the groups' reductions interleaved after, the same bits, measured no
// faster end to end and was taken out: bench/NOTES.md, twenty-fourth session).
#include "fattn_common.cuh"
#include "q8x_quant.cuh"

// Compile-time tuning (the sweep of bench/NOTES.md "cells v2 sweep"; kernels.CellsTune mirrors
// it): U list entries per group and step; PF prefetch depth (0: a step loads its list entries,
// then gathers their K/V rows, then computes; 1: the next step's list entries are loaded before
// this step's math; 2: the next step's K/V rows too (double-buffered registers), list entries two
// steps ahead); MINB the minimum blocks per SM of __launch_bounds__ (1: no register cap below 255).
template <int DK, int DV, int R, int U_ = 4>
struct CellsCfg {
    static constexpr int NW = 4;
    static constexpr int NT = 32 * NW;
    static constexpr int CHK = DK / 8, CHV = DV / 8;            // 16-byte chunks per K / V row
    static constexpr int L = CHK >= 32 ? 32 : CHK > 8 ? 16 : CHK > 4 ? 8 : 4;  // lanes per cell
    static constexpr int RPW = 32 / L;                          // groups (cells) per warp
    static constexpr int NG = NW * RPW;                         // groups per block
    static constexpr int NCK = (CHK + L - 1) / L, NCV = (CHV + L - 1) / L;  // chunks per lane
    static constexpr int U = U_;                                // list entries per group and step
    static constexpr int SMEM = 4 * NG * R * (DV + 3);          // epilogue: acc, m, l, weights
    static_assert(DK % 8 == 0 && DV % 8 == 0, "head sizes must be multiples of 8");
    static_assert(U >= 1 && U <= 16, "U: 1..16 list entries per group and step");
};

// The list of visible cells of one mask row: entries (cell, mask value); without a plan (no
// mask) every cell of [0, n_kv) with value 0.
struct CellList {
    const int2* e;
    int cnt;
    __device__ __forceinline__ int2 operator[](int j) const { return e ? __ldg(e + j) : make_int2(j, 0); }
};

__device__ __forceinline__ CellList cell_list(const FattnParams& p, int t, int h, int s) {
    CellList cl;
    if (p.cells == nullptr) {
        cl.e = nullptr;
        cl.cnt = p.n_kv;
    } else {
        const long long slot = ((long long)(s % p.ne33) * p.ne32 + h % p.ne32) * p.n_batch + t;
        cl.e = p.cells + slot * p.n_kv;
        cl.cnt = __ldg(p.cell_cnt + slot);
    }
    return cl;
}

// One step's list entries of a group: j0 .. j0 + U - 1 (past je: no cell, weight 0, no load).
template <int U>
__device__ __forceinline__ void cells_entries(const CellList& cl, int j0, int je, int (&cell)[U], float (&mv)[U],
                                              bool (&ok)[U]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        ok[u] = j0 + u < je;
        const int2 en = ok[u] ? cl[j0 + u] : make_int2(0, 0);
        cell[u] = en.x;
        mv[u] = __int_as_float(en.y);
    }
}

// The K and V chunks of a group's U cells, this lane's share (all loads issued before any use).
template <int U, int NCK, int NCV, int L, int CHK, int CHV>
__device__ __forceinline__ void cells_gather(const char* kbase, const char* vbase, long long k_nb1, long long v_nb1,
                                             int li, const int (&cell)[U], const bool (&ok)[U],
                                             uint4 (&kc)[U][NCK], uint4 (&vc)[U][NCV]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const uint4* kr = reinterpret_cast<const uint4*>(kbase + (long long)cell[u] * k_nb1);
        const uint4* vr = reinterpret_cast<const uint4*>(vbase + (long long)cell[u] * v_nb1);
#pragma unroll
        for (int i = 0; i < NCK; ++i) {
            const int ch = li + i * L;
            kc[u][i] = (ok[u] && ch < CHK) ? __ldg(kr + ch) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int i = 0; i < NCV; ++i) {
            const int ch = li + i * L;
            vc[u][i] = (ok[u] && ch < CHV) ? __ldg(vr + ch) : make_uint4(0, 0, 0, 0);
        }
    }
}

template <int DK, int DV, typename T, int R, int U, int PF, int MINB, int QO = 0>
__global__ void __launch_bounds__(128, MINB)
fattn_cells(const FattnParams p) {
    using C = CellsCfg<DK, DV, R, U>;
    constexpr int L = C::L, RPW = C::RPW, NG = C::NG;
    constexpr int NCK = C::NCK, NCV = C::NCV, CHK = C::CHK, CHV = C::CHV, NT = C::NT;
    static_assert(PF >= 0 && PF <= 2, "PF: prefetch depth 0, 1 or 2");
    static_assert(MINB >= 0 && MINB <= 8, "MINB: 0 (no hint) .. 8 blocks per SM");
    static_assert((QO == 0 || QO == 1) && (!QO || DV % 32 == 0), "QO: 0 or 1; whole 32-value groups of a head's outputs");

    extern __shared__ uint4 smem_raw[];
    float* sAcc = reinterpret_cast<float*>(smem_raw);   // [NG][R][DV] groups' unnormalized outputs
    float* sM = sAcc + NG * R * DV;                      // [NG][R] groups' maxima (log2 domain)
    float* sL = sM + NG * R;                             // [NG][R] groups' sums
    float* sW = sL + NG * R;                             // [NG][R] merge weights

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int li = lane % L, grp = warp * RPW + lane / L;
    const int t = blockIdx.x, h0 = blockIdx.y * R;
    const int s = blockIdx.z / p.n_splits, split = blockIdx.z % p.n_splits;
    const int hk = h0 / p.gqa;

    // ---- the row's cell list and this split's part of it
    const CellList cl = cell_list(p, t, h0, s);
    int jb, je;
    split_range(cl.cnt, split, p.n_splits, jb, je);

    // ---- Q rows (f32) -> registers: this lane's chunks of each head's row
    float q[R][NCK * 8];
    float slope[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int h = h0 + r;
        slope[r] = alibi_slope(p, h);
        const float* qr = reinterpret_cast<const float*>(p.q + (long long)s * p.q_nb3 + (long long)h * p.q_nb2 +
                                                         (long long)t * p.q_nb1);
#pragma unroll
        for (int i = 0; i < NCK; ++i) {
            const int ch = li + i * L;
#pragma unroll
            for (int e = 0; e < 8; ++e) q[r][i * 8 + e] = ch < CHK ? qr[ch * 8 + e] : 0.0f;
        }
    }
    const char* kbase = p.k + (long long)hk * p.k_nb2 + (long long)s * p.k_nb3;
    const char* vbase = p.v + (long long)hk * p.v_nb2 + (long long)s * p.v_nb3;

    // ---- this group's online-softmax state
    float m[R], l[R], acc[R][NCV * 8];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        m[r] = FATTN_NEG_INF;
        l[r] = 0.0f;
#pragma unroll
        for (int i = 0; i < NCV * 8; ++i) acc[r][i] = 0.0f;
    }

    // The loop runs warp-uniformly (jw is the warp's; the warp's first entry decides): the groups
    // of one warp reduce their dot products with full-warp shuffles, so no lane may leave the loop
    // while another group of its warp is still in it (a deadlock at the shuffle otherwise). The
    // prefetches below are predicated loads only (entries past je load nothing), no shuffle.
    constexpr int JS = NG * U;                 // list entries per block and step
    const int jg = (lane / L) * U;             // this group's first entry within its warp's step
    int jw = jb + warp * RPW * U;
    // current step: entries (cell, mask value, in range) and, with PF 2, its K/V chunks
    int cell[U];
    float mv[U];
    bool ok[U];
    uint4 kc[U][NCK], vc[U][NCV];
    // PF 2: the next step's entries (their K/V gathered during this step)
    int cell1[PF >= 2 ? U : 1];
    float mv1[PF >= 2 ? U : 1];
    bool ok1[PF >= 2 ? U : 1];
    if constexpr (PF >= 1) cells_entries<U>(cl, jw + jg, je, cell, mv, ok);
    if constexpr (PF >= 2) {
        cells_gather<U, NCK, NCV, L, CHK, CHV>(kbase, vbase, p.k_nb1, p.v_nb1, li, cell, ok, kc, vc);
        cells_entries<U>(cl, jw + JS + jg, je, cell1, mv1, ok1);
    }
    for (; jw < je; jw += JS) {
        // ---- 1. this step's list entries (PF 0) and K/V chunks (PF 0-1): loads in flight together
        if constexpr (PF == 0) cells_entries<U>(cl, jw + jg, je, cell, mv, ok);
        if constexpr (PF <= 1)
            cells_gather<U, NCK, NCV, L, CHK, CHV>(kbase, vbase, p.k_nb1, p.v_nb1, li, cell, ok, kc, vc);
        // ---- 2. prefetch: the next step's entries (PF 1), or its K/V and the entries after (PF 2)
        int ncell[PF >= 1 ? U : 1];
        float nmv[PF >= 1 ? U : 1];
        bool nok[PF >= 1 ? U : 1];
        uint4 nkc[PF >= 2 ? U : 1][NCK], nvc[PF >= 2 ? U : 1][NCV];
        if constexpr (PF == 1) cells_entries<U>(cl, jw + JS + jg, je, ncell, nmv, nok);
        if constexpr (PF >= 2) {
            cells_gather<U, NCK, NCV, L, CHK, CHV>(kbase, vbase, p.k_nb1, p.v_nb1, li, cell1, ok1, nkc, nvc);
            cells_entries<U>(cl, jw + 2 * JS + jg, je, ncell, nmv, nok);
        }
        // ---- 3. scores: dot products over the group's lanes, scale, softcap, mask value, log2
        float sc[U][R];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float dot[R];
#pragma unroll
            for (int r = 0; r < R; ++r) dot[r] = 0.0f;
#pragma unroll
            for (int i = 0; i < NCK; ++i) {
                float kf[8];
                unpack8<T>(kc[u][i], kf);
#pragma unroll
                for (int r = 0; r < R; ++r)
#pragma unroll
                    for (int e = 0; e < 8; ++e) dot[r] = fmaf(q[r][i * 8 + e], kf[e], dot[r]);
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
#pragma unroll
                for (int o = L / 2; o > 0; o >>= 1) dot[r] += __shfl_xor_sync(0xffffffffu, dot[r], o);
                float x = dot[r] * p.scale;
                if (p.softcap != 0.0f) x = p.softcap * tanhf(x);
                x += slope[r] * mv[u];   // listed cells are never -inf
                sc[u][r] = ok[u] ? x * FATTN_LOG2E : FATTN_NEG_INF;
            }
        }
        // ---- 4. online softmax: new max, rescale, probabilities (every lane of the group alike)
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float mx = sc[0][r];
#pragma unroll
            for (int u = 1; u < U; ++u) mx = fmaxf(mx, sc[u][r]);
            const float m_new = fmaxf(m[r], mx);
            const float m_use = m_new == FATTN_NEG_INF ? 0.0f : m_new;
            const float alpha = fast_exp2(m[r] - m_use);
            float sum = 0.0f;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                sc[u][r] = fast_exp2(sc[u][r] - m_use);
                sum += sc[u][r];
            }
            l[r] = l[r] * alpha + sum;
            m[r] = m_new;
#pragma unroll
            for (int i = 0; i < NCV * 8; ++i) acc[r][i] *= alpha;
        }
        // ---- 5. acc += P V (an empty slot has weight 0 and a zero V row)
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int i = 0; i < NCV; ++i) {
                float vf[8];
                unpack8<T>(vc[u][i], vf);
#pragma unroll
                for (int r = 0; r < R; ++r)
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[r][i * 8 + e] = fmaf(sc[u][r], vf[e], acc[r][i * 8 + e]);
            }
        }
        // ---- 6. the prefetched step becomes the current one
        if constexpr (PF == 1) {
#pragma unroll
            for (int u = 0; u < U; ++u) { cell[u] = ncell[u]; mv[u] = nmv[u]; ok[u] = nok[u]; }
        }
        if constexpr (PF >= 2) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                mv[u] = mv1[u];
                ok[u] = ok1[u];
                cell1[u] = ncell[u];
                mv1[u] = nmv[u];
                ok1[u] = nok[u];
#pragma unroll
                for (int i = 0; i < NCK; ++i) kc[u][i] = nkc[u][i];
#pragma unroll
                for (int i = 0; i < NCV; ++i) vc[u][i] = nvc[u][i];
            }
        }
    }

    // ---- epilogue 1: the groups' states to shared memory
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int i = 0; i < NCV; ++i) {
            const int ch = li + i * L;
            if (ch < CHV) {
#pragma unroll
                for (int e = 0; e < 8; ++e) sAcc[(grp * R + r) * DV + ch * 8 + e] = acc[r][i * 8 + e];
            }
        }
        if (li == 0) { sM[grp * R + r] = m[r]; sL[grp * R + r] = l[r]; }
    }
    __syncthreads();
    // ---- epilogue 2: per head, the block's max and each group's weight; the max and sum kept
    //      in sM[r] / sL[r] (group 0's slots, read by every thread below)
    if (tid < R) {
        const int r = tid;
        float M = FATTN_NEG_INF;
#pragma unroll
        for (int g = 0; g < NG; ++g) M = fmaxf(M, sM[g * R + r]);
        float Ls = 0.0f;
#pragma unroll
        for (int g = 0; g < NG; ++g) {
            // a group whose max stayed -inf saw no finite score: weight 0, unless its sum is
            // NaN (a visible NaN mask cell: fmaxf skipped it) -- then NaN, so the row is NaN
            const float mg = sM[g * R + r], lg = sL[g * R + r];
            const float w = mg != FATTN_NEG_INF ? fast_exp2(mg - M) : lg == lg ? 0.0f : lg;
            sW[g * R + r] = w;
            Ls += w * lg;
        }
        sM[r] = M;   // group 0's own entry, already read (weight in sW)
        sL[r] = Ls;
    }
    __syncthreads();
    // ---- epilogue 3: merged row values to dst (one split) or the split workspace; with QO (one
    //      split) a warp's 32 values, columns 32 k .. 32 k + 31 of one head (NT and DV multiples of
    //      32: every lane of a warp takes the same turns), also in 8-bit form
    // (merged(r, c): the block's value of column c of head h0 + r, unnormalized)
    const auto merged = [&](int r, int c) {
        float o = 0.0f;
#pragma unroll
        for (int g = 0; g < NG; ++g) {
            const float w = sW[g * R + r];
            o += w != 0.0f ? w * sAcc[(g * R + r) * DV + c] : 0.0f;
        }
        return o;
    };
    for (int i = tid; i < R * DV; i += NT) {
        const int r = i / DV, c = i % DV, h = h0 + r;
        const float o = merged(r, c);
        const long long row = ((long long)s * p.n_batch + t) * p.n_head + h;
        if constexpr (QO == 1) {
            const float val = o * row_finish_factor(p, h, sM[r], sL[r]);   // store_row_value's, one split
            p.dst[row * DV + c] = val;
            const long long grp32 = (row * DV + c) / 32;   // (row * DV + c: the value's place in the token rows)
            q8x_quant32(val, reinterpret_cast<signed char*>(p.ws_o) + 32 * grp32, p.ws_ml + grp32,
                        reinterpret_cast<float*>(p.split_cnt) + grp32);
        } else {
            store_row_value(p, row, h, c, DV, split, o, sM[r], sL[r]);
        }
    }
}

// The dynamic shared memory (bytes) a launch of fattn_cells<...> with the same parameters takes: the
// host reads it from the compiled program (ggml_attn/variants.py smem_expr, ggml_attn/cubin.py)
template <int DK, int DV, typename T, int R, int U, int PF, int MINB, int QO = 0>
__device__ const int fattn_cells_smem = CellsCfg<DK, DV, R, U>::SMEM;
