// The Hopper (sm_90a) decode: a persistent, streaming split-KV kernel that balances itself.
//
// Work: row groups x their live KV tiles. A row group is what one decode-tc block takes
// (cuda/fattn_mma.cu): 16 rows = the P query heads of one KV head x the tq = 16 / P tokens of
// one query tile of one stream. Groups are ordered (stream, query tile, head group), head groups
// fastest; a group has the live tiles of its query tile's list (the plan's, or every tile
// without one), and at least one work unit (an empty list still writes its zero rows).
// A group's units are cut into chunks of C tiles (C = W / (4 B) clamped to [1, MAX_CHUNK]: W
// units, B blocks); the call's N chunks, group-major, are split into B equal regions.
//
// Schedule (one persistent wave): block b owns region b. It takes the first quarter of it
// without asking, then the rest a chunk at a time from the front (the low half of the region's
// 64-bit counter, p.split_cnt); with p.steal, a block out of work takes chunks from the back of the
// region with the most left (the high half) -- a region is shared only at its end, so a block's
// own chunks stay contiguous and it writes few partial states. The H200's SMs stream the same
// bytes up to 1.7x apart in time (tools/gpu_decode_tma_trace.py); a static split waits for the
// slowest.
//
// Block: a producer warp and four consumer warps, no block-wide barrier in the loop.
//   - step produce (producer warp): takes chunks as above and publishes, through a ring of
//     EVENTS events (mbarriers "ev_full" / "ev_empty"), CHUNK (group, tile range), FLUSH (the
//     run of chunks of one group ends: written whole to dst, or as a part to a slot) and END;
//     lane 0 issues, per tile, TMA copies of its K and V rows (the 128-byte swizzled 64 x 64
//     boxes of ggml_attn/wgmma_shape.py's kv_map; the n_kv tail reads zeros) into a ring of
//     STAGES stages, each with a "full" mbarrier (transaction bytes) and an "empty" one (one
//     arrival per consumer warp that reads it).
//   - step process tile: consumer warp w takes every 4th tile of the block's sequence whole
//     (WHOLE; or, the "split" instance, the cells [16 w, 16 w + 16) of every tile) with
//     mma.sync m16n8k16 (Q in registers, K and V by ldmatrix from the swizzled boxes), masks a
//     PARTIAL tile by its rows' intervals or mask values (no bounds check on FULL tiles), zeroes
//     the V rows of its HIDDEN cells, runs its online softmax and releases the stage.
//   - step flush: the four warps merge their states in shared memory; a run that is its whole
//     group goes to dst, a part to one of the block's SLOTS partial slots, listed in the group's
//     part list (the per-group part count and unit count in p.split_cnt); the block whose units
//     complete the group merges its parts into dst (step merge) and sets the counts back to 0.
//     The last block to exit sets the region counters back to 0.
// With p.steal the split of a group into parts depends on timing: the output can differ in the
// last bits between launches (p.steal = 0: a fixed split, the same bits every launch).
// No softcap, no ALiBi; the final row factor would fold sinks in, but dispatch sends only calls
// without them (not tested with sinks). Scores in the log2 domain: Q is pre-multiplied by
// scale * log2(e). As in decode-tc, only V rows of cells no row of the group sees are zeroed: a
// cell hidden from one row but seen by another keeps its V, so non-finite V there reaches the
// hidden row as 0 * inf.
#include "hopper_common.cuh"

// DTMA_TRACE (tools/gpu_decode_tma_trace.py): block timeline in %globaltimer ns, written by
// thread 0 to ((u64*)p.cells)[block * 8 + event] (the kernel reads no cell lists); event 7 is
// the count of chunks the block took from other regions
#ifdef DTMA_TRACE
#define DTMA_MARK(ev) do { if (threadIdx.x == 0) { unsigned long long t_; \
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_)); \
    reinterpret_cast<unsigned long long*>(const_cast<int2*>(p.cells))[blockIdx.x * 8 + (ev)] = t_; } } while (0)
#define DTMA_STEALS(n) do { reinterpret_cast<unsigned long long*>(const_cast<int2*>(p.cells))[blockIdx.x * 8 + 7] = (n); } while (0)
#else
#define DTMA_MARK(ev) do { } while (0)
#define DTMA_STEALS(n) do { } while (0)
#endif

namespace dtma {
constexpr int BK = FATTN_KV_TILE;       // cells per tile (the plan's tiles)
constexpr int CONSUMERS = 4;            // warps: each takes every 4th tile (WHOLE) or 16 cells of every tile
constexpr int THREADS = 32 * (CONSUMERS + 1);
constexpr int ROWS = 16;                // rows of a group: one m16 tile
constexpr int BOX_BYTES = BK * 128;     // one 64-cell x 64-element box, 128-byte rows
constexpr int SLOTS = 8;                // partial slots per block: its region needs two (its first and its
                                        // last group), the others hold runs taken from other regions
constexpr int EVENTS = 16;              // the producer -> consumers event ring
constexpr int MAX_CHUNK = 4;            // tiles per chunk, at most
constexpr int UNASKED_DIV = 4;          // an owner takes 1 / UNASKED_DIV of its region without asking
constexpr int SCAN = 8;                 // region counters a producer lane loads at once when it looks for work
constexpr int MERGE_BATCH = 512;        // a group's part slots staged in shared memory per merge round
constexpr int MERGE_U = 16;             // parts whose loads a merging thread has in flight

enum : int { EV_CHUNK = 0, EV_FLUSH = 1, EV_END = 2 };
// One event of the ring. CHUNK: units [t0, t1) of group (pair, hg), cnt the pair's live tiles.
// FLUSH: the run of group (pair, hg) ends, t0 its units, t1 the group's; slot its partial
// slot, -1: the run is the whole group (written to dst).
struct alignas(16) Event {
    int kind, pair, hg, cnt, t0, t1, slot, pad;
};

// Dynamic shared memory of an instance: 1024-byte alignment slack, the ring (K boxes then V
// boxes per stage), the merge buffer (ROWS x D floats), the warps' row maxima and sums, the
// ring's barriers, the event ring's barriers and events, the merge's staged part slots, a flag.
// Mirrored by ggml_attn/decode_tma_shape.py.
template <int D, int STAGES>
__host__ __device__ constexpr int smem_bytes() {
    return 1024 + STAGES * 2 * (D / 64) * BOX_BYTES + ROWS * D * 4 + CONSUMERS * ROWS * 2 * 4 + 2 * STAGES * 8
         + 2 * EVENTS * 8 + EVENTS * (int)sizeof(Event) + MERGE_BATCH * 4 + 16;
}

// Live tiles of pair i = (stream, query tile) in stream-major order; every tile without a plan.
__device__ __forceinline__ int pair_cnt(const FattnParams& p, int i) {
    if (!p.live_idx) return p.n_kv_tiles;
    const int s = i / p.n_q_tiles, qt = i - s * p.n_q_tiles;
    return __ldg(p.live_cnt + (s % p.ne33) * p.n_q_tiles + qt);
}

// The live-list entry (tile id | class bits) of tile j of pair i.
__device__ __forceinline__ int tile_entry(const FattnParams& p, int i, int j) {
    if (!p.live_idx) return j == p.n_kv_tiles - 1 && p.n_kv % BK ? j | FATTN_TILE_PARTIAL : j;
    const int s = i / p.n_q_tiles, qt = i - s * p.n_q_tiles;
    return __ldg(p.live_idx + ((long long)(s % p.ne33) * p.n_q_tiles + qt) * p.n_kv_tiles + j);
}

// The counters of a call in p.split_cnt (int32, zero between launches): per group the units
// done and the parts listed, the blocks that left, per region (8-byte aligned) the chunks taken
// from its front (low half) and from its back (high half). ggml_attn/decode_tma_shape.py's
// counter_ints mirrors the size.
struct Counters {
    int* done;
    int* n_parts;
    unsigned* left;
    unsigned long long* region;
    __device__ __forceinline__ Counters(const FattnParams& p, int G) {
        done = p.split_cnt;
        n_parts = done + G;
        left = reinterpret_cast<unsigned*>(n_parts + G);
        region = reinterpret_cast<unsigned long long*>(p.split_cnt + 2 * G + 2);   // a pad int before: 8-byte aligned
    }
};

// a chunk: units [t0, t1) of group (pair, hg); cnt: the pair's live tiles
struct Pos {
    int pair, hg, cnt, t0, t1;
};

// The call's chunk list (the producer warp; every lane holds the same values).
struct Chunks {
    int C, n_hg, NP;
    long long N;   // chunks of the call

    __device__ __forceinline__ int chunks_of(int cnt) const { return (max(cnt, 1) + C - 1) / C; }

    // C from the call's units (without a plan in closed form, with one a warp-wide sum), then N
    __device__ __forceinline__ void init(const FattnParams& p, int B, int lane) {
        n_hg = p.n_head / p.pack;
        NP = p.ne3 * p.n_q_tiles;
        long long W = 0, n = 0;
        if (!p.live_idx) {
            W = (long long)max(p.n_kv_tiles, 1) * n_hg * NP;
        } else {
            for (int i = lane; i < NP; i += 32) W += (long long)max(pair_cnt(p, i), 1) * n_hg;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) W += __shfl_xor_sync(0xffffffffu, W, o);
        }
        C = (int)min((long long)MAX_CHUNK, max(1ll, W / (4ll * B)));
        if (!p.live_idx) {
            n = (long long)chunks_of(p.n_kv_tiles) * n_hg * NP;
        } else {
            for (int i = lane; i < NP; i += 32) n += (long long)chunks_of(pair_cnt(p, i)) * n_hg;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) n += __shfl_xor_sync(0xffffffffu, n, o);
        }
        N = n;
    }
    __device__ __forceinline__ void set_units(Pos& r, int ci) const {
        r.t0 = ci * C;
        r.t1 = min(r.t0 + C, max(r.cnt, 1));
    }
    // chunk c: in closed form without a plan, with one a warp-wide scan of the pairs' chunks
    __device__ __forceinline__ Pos locate(const FattnParams& p, long long c, int lane) const {
        Pos r{0, 0, p.n_kv_tiles, 0, 0};
        if (!p.live_idx) {
            const int nch = chunks_of(p.n_kv_tiles);
            const long long g = c / nch;
            r.pair = (int)(g / n_hg);
            r.hg = (int)(g - (long long)r.pair * n_hg);
            set_units(r, (int)(c - g * nch));
            return r;
        }
        long long acc = 0;   // chunks before this batch of 32 pairs
        for (int base = 0; base < NP; base += 32) {
            const int i = base + lane;
            const int cnt = i < NP ? pair_cnt(p, i) : 0;
            const long long cc = i < NP ? (long long)chunks_of(cnt) * n_hg : 0;
            long long incl = cc;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const long long y = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += y;
            }
            const unsigned hit = __ballot_sync(0xffffffffu, acc + incl > c);
            if (hit) {
                const int L = __ffs(hit) - 1;
                r.pair = base + L;
                r.cnt = __shfl_sync(0xffffffffu, cnt, L);
                const long long rem = c - acc - __shfl_sync(0xffffffffu, incl - cc, L);
                const int nch = chunks_of(r.cnt);
                r.hg = (int)(rem / nch);
                set_units(r, (int)(rem - (long long)r.hg * nch));
                return r;
            }
            acc += __shfl_sync(0xffffffffu, incl, 31);
        }
        return r;   // not reached: c < N
    }
    // the chunk after r (r is not the call's last)
    __device__ __forceinline__ void advance(const FattnParams& p, Pos& r) const {
        if (r.t1 < max(r.cnt, 1)) {
            set_units(r, r.t1 / C);
            return;
        }
        if (++r.hg == n_hg) {
            r.hg = 0;
            r.cnt = pair_cnt(p, ++r.pair);
        }
        set_units(r, 0);
    }
    // region v of B: chunks [N v / B, N (v + 1) / B); its owner takes the first quarter unasked
    __device__ __forceinline__ long long begin(int v, int B) const { return N * v / B; }
    __device__ __forceinline__ long long size(int v, int B) const { return N * (v + 1) / B - N * v / B; }
    static __device__ __forceinline__ long long unasked(long long k) { return k / UNASKED_DIV; }
};

__device__ __forceinline__ unsigned long long ld_relaxed(const unsigned long long* a) {
    unsigned long long x;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];\n" : "=l"(x) : "l"(a) : "memory");
    return x;
}
}  // namespace dtma

// Merge the n_part partial states of a group (slots list[k], k < n_part: ROWS x D outputs and
// each row's (max, sum)) into dst: the group's first nv rows are valid (row r: token tok0 +
// r / P, head h0 + r % P of stream s). The 128 consumer threads take (row, 4 columns) items,
// MERGE_U parts' loads in flight each; the slot list is staged in shared memory
// MERGE_BATCH at a time. Every consumer thread calls it (named barrier 1).
template <int D>
__device__ __forceinline__ void merge_group(const FattnParams& p, const int* list, int n_part, int* s_parts,
                                            int nv, int s, int tok0, int h0, int pshift) {
    using namespace dtma;
    constexpr int CH = D / 4, NT = 32 * CONSUMERS, ITEMS = ROWS * CH / NT;
    static_assert(ROWS * CH % NT == 0, "items per thread");
    const int tid = threadIdx.x;
    float M[ITEMS], L[ITEMS];
    float4 A[ITEMS];
#pragma unroll
    for (int q = 0; q < ITEMS; ++q) { M[q] = FATTN_NEG_INF; L[q] = 0.0f; A[q] = make_float4(0.0f, 0.0f, 0.0f, 0.0f); }
    for (int base = 0; base < n_part; base += MERGE_BATCH) {
        const int nb = min(MERGE_BATCH, n_part - base);
        for (int i = tid; i < nb; i += NT) s_parts[i] = __ldcg(list + base + i);
        named_barrier_sync(1, NT);
#pragma unroll
        for (int q = 0; q < ITEMS; ++q) {
            const int item = tid + q * NT, r = item / CH, c4 = item % CH;
            if (item >= nv * CH) continue;
            for (int k0 = 0; k0 < nb; k0 += MERGE_U) {
                float mz[MERGE_U], lz[MERGE_U];
                float4 oz[MERGE_U];
#pragma unroll
                for (int u = 0; u < MERGE_U; ++u) {
                    const bool ok = k0 + u < nb;
                    const long long z = (long long)s_parts[ok ? k0 + u : 0] * ROWS + r;
                    mz[u] = ok ? __ldcg(p.ws_ml + z * 2) : FATTN_NEG_INF;
                    lz[u] = ok ? __ldcg(p.ws_ml + z * 2 + 1) : 0.0f;
                    oz[u] = ok ? __ldcg(reinterpret_cast<const float4*>(p.ws_o + z * D) + c4) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                }
                float mx = M[q];
#pragma unroll
                for (int u = 0; u < MERGE_U; ++u) mx = fmaxf(mx, mz[u]);
                if (mx == FATTN_NEG_INF) continue;   // no visible cell in any part so far
                const float a = fast_exp2(M[q] - mx);   // M == -inf: 0
                A[q] = make_float4(A[q].x * a, A[q].y * a, A[q].z * a, A[q].w * a);
                L[q] *= a;
#pragma unroll
                for (int u = 0; u < MERGE_U; ++u) {
                    if (mz[u] == FATTN_NEG_INF) continue;   // a part with no visible cell adds nothing
                    const float w = fast_exp2(mz[u] - mx);
                    A[q] = make_float4(fmaf(w, oz[u].x, A[q].x), fmaf(w, oz[u].y, A[q].y), fmaf(w, oz[u].z, A[q].z),
                                       fmaf(w, oz[u].w, A[q].w));
                    L[q] = fmaf(w, lz[u], L[q]);
                }
                M[q] = mx;
            }
        }
        named_barrier_sync(1, NT);   // s_parts is free for the next round
    }
#pragma unroll
    for (int q = 0; q < ITEMS; ++q) {
        const int item = tid + q * NT, r = item / CH, c4 = item % CH;
        if (item >= nv * CH) continue;
        const int h = h0 + (r & ((1 << pshift) - 1));
        const float fac = row_finish_factor(p, h, M[q], L[q]);
        float* out = p.dst + (((long long)s * p.n_batch + tok0 + (r >> pshift)) * p.n_head + h) * D;
        reinterpret_cast<float4*>(out)[c4] = make_float4(A[q].x * fac, A[q].y * fac, A[q].z * fac, A[q].w * fac);
    }
}

template <typename T, int D, int STAGES, bool WHOLE>
__device__ __forceinline__ void fattn_decode_tma_body(const FattnParams& p, const TmaMap* mk, const TmaMap* mv) {
    using namespace dtma;
    constexpr int BOXES = D / 64;
    constexpr int NC = WHOLE ? BK : BK / CONSUMERS;   // cells of a tile one warp takes
    constexpr int KV_BYTES = BOXES * BOX_BYTES;          // one K (or V) tile
    constexpr int STAGE_BYTES = 2 * KV_BYTES;
    constexpr int NT = 32 * CONSUMERS;
    static_assert(D % 64 == 0 && D <= 256, "D: a multiple of 64 up to 256 (64-element boxes)");
    static_assert(!WHOLE || (2 * STAGES) % CONSUMERS == 0, "a warp's own tile two ring turns back (see the full wait)");

    extern __shared__ unsigned char smem_raw[];
    unsigned char* ring = reinterpret_cast<unsigned char*>((reinterpret_cast<size_t>(smem_raw) + 1023) & ~size_t(1023));
    float* sO = reinterpret_cast<float*>(ring + STAGES * STAGE_BYTES);   // [ROWS][D]
    float* sML = sO + ROWS * D;                                          // [CONSUMERS][ROWS][2]
    unsigned long long* full = reinterpret_cast<unsigned long long*>(sML + CONSUMERS * ROWS * 2);
    unsigned long long* empty = full + STAGES;
    unsigned long long* ev_full = empty + STAGES;
    unsigned long long* ev_empty = ev_full + EVENTS;
    Event* events = reinterpret_cast<Event*>(ev_empty + EVENTS);
    int* s_parts = reinterpret_cast<int*>(events + EVENTS);
    int* s_flag = s_parts + MERGE_BATCH;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (tid == 0) {
        for (int i = 0; i < STAGES; ++i) { mbar_init(full + i, 1); mbar_init(empty + i, WHOLE ? 1 : CONSUMERS); }
        for (int i = 0; i < EVENTS; ++i) { mbar_init(ev_full + i, 1); mbar_init(ev_empty + i, CONSUMERS); }
        fence_mbar_init();
    }
    for (int i = tid; i < ROWS * D; i += THREADS) sO[i] = 0.0f;
    __syncthreads();
    DTMA_MARK(0);

    const int P = p.pack, pshift = __ffs(P) - 1, tq = p.q_tile_tokens, n_hg = p.n_head / P;
    const int B = gridDim.x, b = blockIdx.x;
    const Counters ctr(p, p.ne3 * p.n_q_tiles * n_hg);

    // ---- step produce (the producer warp; lane 0 publishes events and issues the copies)
    if (warp == CONSUMERS) {
        Chunks ch;
        ch.init(p, B, lane);
        const long long R0 = ch.begin(b, B), k = ch.size(b, B), n0 = Chunks::unasked(k);
        int it = 0, ev = 0, ns = 0, steals = 0;
        bool active = false;                            // a run (chunks of one group) is open
        int r_pair = 0, r_hg = 0, r_units = 0, g_units = 0;
        auto publish = [&](int kind, int pair, int hg, int cnt, int t0, int t1, int slot) {
            if (lane == 0) {
                const int e = ev % EVENTS;
                if (ev >= EVENTS) mbar_wait(ev_empty + e, ((ev / EVENTS) & 1) ^ 1);
                events[e] = Event{kind, pair, hg, cnt, t0, t1, slot, 0};
                mbar_arrive(ev_full + e);   // release: the event's writes before the arrival
            }
            ++ev;
        };
        auto flush = [&]() {
            if (!active) return;
            const bool whole = r_units == g_units;   // every unit of the group is in this run
            publish(EV_FLUSH, r_pair, r_hg, 0, r_units, g_units, whole ? -1 : b * SLOTS + ns);
            ns += !whole;
            active = false;
        };
        auto take = [&](const Pos& c) {
            if (active && (c.pair != r_pair || c.hg != r_hg)) flush();
            if (!active) {
                active = true;
                r_pair = c.pair; r_hg = c.hg; r_units = 0; g_units = max(c.cnt, 1);
            }
            publish(EV_CHUNK, c.pair, c.hg, c.cnt, c.t0, c.t1, 0);
            r_units += c.t1 - c.t0;
            const int te = min(c.t1, c.cnt);
            if (lane == 0) {
                const int s = c.pair / p.n_q_tiles, hk = (c.hg * P) / p.gqa;
                for (int j = c.t0; j < te; ++j, ++it) {
                    const int stage = it % STAGES;
                    if (it >= STAGES) mbar_wait(empty + stage, ((it / STAGES) & 1) ^ 1);
                    const int kv0 = (tile_entry(p, c.pair, j) & FATTN_TILE_ID_MASK) * BK;
                    unsigned char* dst = ring + stage * STAGE_BYTES;
                    mbar_arrive_expect_tx(full + stage, STAGE_BYTES);
#pragma unroll
                    for (int bx = 0; bx < BOXES; ++bx) {
                        tma_load_4d(dst + bx * BOX_BYTES, mk, 64 * bx, kv0, hk, s, full + stage);
                        tma_load_4d(dst + KV_BYTES + bx * BOX_BYTES, mv, 64 * bx, kv0, hk, s, full + stage);
                    }
                }
            }
            __syncwarp();
            if (c.t1 == g_units) flush();   // the group's last chunk: no chunk of this run can follow
        };

        // own region: the first quarter unasked, then a chunk at a time from the front; the
        // request for the next chunk goes out while this one is issued (its answer is read,
        // from lane 0, only when the chunk is needed)
        if (k > 0) {
            Pos pos = ch.locate(p, R0, lane);
            long long c = R0, lim = R0 + n0;
            unsigned long long grab = 0;
            bool pending = false;
            for (;;) {
                if (c == lim) {
                    if (!pending && lane == 0) grab = atomicAdd(ctr.region + b, 1ull);
                    pending = false;
                    const unsigned long long x = __shfl_sync(0xffffffffu, grab, 0);
                    if (n0 + (long long)(unsigned)x + (long long)(x >> 32) >= k) break;   // the rest was taken
                    ++lim;   // chunk c: the front's next (the owner alone takes from the front)
                }
                if (c + 1 == lim && lim < R0 + k) {
                    if (lane == 0) grab = atomicAdd(ctr.region + b, 1ull);
                    pending = true;
                }
                take(pos);
                if (++c == R0 + k) break;
                ch.advance(p, pos);
            }
        }
        // then chunks from the back of the region with the most left, while a slot is free
        // for a new run. The open run is flushed first: the consumers need not wait for the
        // search (loads of every region's counter, slow while the memory is saturated).
        flush();
        while (p.steal && ns + (active ? 1 : 0) + 1 <= SLOTS) {
            long long best = 0;
            int bv = -1;
            for (int v0 = 0; v0 < B; v0 += 32 * SCAN) {
                unsigned long long xs[SCAN];
#pragma unroll
                for (int i = 0; i < SCAN; ++i) {   // the loads first, all in flight together
                    const int v = v0 + lane + 32 * i;
                    xs[i] = v < B ? ld_relaxed(ctr.region + v) : 0ull;
                }
#pragma unroll
                for (int i = 0; i < SCAN; ++i) {
                    const int v = v0 + lane + 32 * i;
                    const long long vk = v < B ? ch.size(v, B) : 0;
                    const long long left = vk - Chunks::unasked(vk) - (long long)(unsigned)xs[i] - (long long)(xs[i] >> 32);
                    if (left > best) { best = left; bv = v; }
                }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const long long ob = __shfl_xor_sync(0xffffffffu, best, o);
                const int ov = __shfl_xor_sync(0xffffffffu, bv, o);
                if (ob > best || (ob == best && ov > bv)) { best = ob; bv = ov; }
            }
            if (best <= 0) break;   // nothing left anywhere
            unsigned long long x = 0;
            if (lane == 0) x = atomicAdd(ctr.region + bv, 1ull << 32);
            x = __shfl_sync(0xffffffffu, x, 0);
            const long long vk = ch.size(bv, B), t = (long long)(x >> 32);
            if (Chunks::unasked(vk) + (long long)(unsigned)x + t >= vk) continue;   // taken meanwhile: look again
            take(ch.locate(p, ch.begin(bv, B) + vk - 1 - t, lane));
            ++steals;
        }
        flush();
        publish(EV_END, 0, 0, 0, 0, 0, 0);
        if (lane == 0) DTMA_STEALS(steals);
        // the last block out sets the region counters back to 0 for the next launch
        unsigned last = 0;
        if (lane == 0) {
            __threadfence();
            last = atomicAdd(ctr.left, 1u) == (unsigned)B - 1;
        }
        if (__shfl_sync(0xffffffffu, last, 0)) {
            for (int v = lane; v < B; v += 32) ctr.region[v] = 0ull;
            if (lane == 0) *ctr.left = 0u;
        }
        return;
    }

    // ---- consumers: WHOLE -- warp w takes every 4th tile of the block's sequence, all its
    // cells; otherwise every tile, cells [16 w, 16 w + 16). Fragment rows g, g + 8, cells
    // w0 + 8 nt + [2 t4, 2 t4 + 1] of its NC (w0 = 0 or 16 w).
    const int g = lane >> 2, t4 = lane & 3, lr = lane & 7, lm = lane >> 3;
    const int w0 = WHOLE ? 0 : 16 * warp;
    // ldmatrix lanes: K rows (cells) w0 + 16 np + lr + 8 (lm >> 1), 16-byte chunk (lm & 1) of
    // each k16 step; V rows w0 + 16 kk + lr + 8 (lm & 1), chunk (lm >> 1). The 128-byte swizzle
    // puts chunk c of row r at c ^ (r & 7) = c ^ lr.
    const unsigned ring_u32 = smem_u32(ring);
    const unsigned k_lane = ring_u32 + (w0 + lr + 8 * (lm >> 1)) * 128;
    const unsigned v_lane = ring_u32 + KV_BYTES + (w0 + lr + 8 * (lm & 1)) * 128;
    const int k_x = (lm & 1) ^ lr, v_x = (lm >> 1) ^ lr;
    const float qs = p.scale * FATTN_LOG2E;
    const int LCAP = max(p.n_kv_tiles, 1);   // parts a group can have: one chunk each at least
    int* plist = reinterpret_cast<int*>(p.ws_ml + (long long)SLOTS * B * ROWS * 2);

    // the next event of the ring (every consumer warp reads each one)
    int ev = 0;
    auto next_event = [&]() {
        const int e = ev % EVENTS;
        mbar_wait(ev_full + e, (ev / EVENTS) & 1);
        const Event x = events[e];
        __syncwarp();
        if (lane == 0) mbar_arrive(ev_empty + e);
        ++ev;
        return x;
    };

    for (int it = 0;;) {
        Event x = next_event();
        if (x.kind == EV_END) break;
        // ---- step open a run (x: its first chunk): its group's Q, mask rows, state
        const int s = x.pair / p.n_q_tiles, qt = x.pair - s * p.n_q_tiles;
        const int tok0 = qt * tq, h0 = x.hg * P;
        // a fragment row's token and head (valid: inside the batch and the query tile)
        auto row_tok = [&](int r) { return tok0 + (r >> pshift); };
        auto row_head = [&](int r) { return h0 + (r & (P - 1)); };
        auto row_valid = [&](int r) { return (r >> pshift) < tq && row_tok(r) < p.n_batch; };
        unsigned Qf[D / 16][4];
        float O[D / 8][4];
        float m[2], l[2];
        const char* mrow[2];   // this thread's rows of the mask (nullptr: no mask or invalid row)
        int2 lohi[2];
        {
            const char* qb = p.q + (long long)s * p.q_nb3;
#pragma unroll
            for (int rs = 0; rs < 2; ++rs) {
                const int r = g + 8 * rs;
                const bool ok = row_valid(r);
                const float* qrow = reinterpret_cast<const float*>(
                    qb + (long long)row_head(ok ? r : 0) * p.q_nb2 + (long long)row_tok(ok ? r : 0) * p.q_nb1);
#pragma unroll
                for (int ks = 0; ks < D / 16; ++ks)
#pragma unroll
                    for (int hi = 0; hi < 2; ++hi) {
                        const float2 y = ok ? __ldg(reinterpret_cast<const float2*>(qrow + ks * 16 + 8 * hi + 2 * t4))
                                            : make_float2(0.0f, 0.0f);
                        Qf[ks][rs + 2 * hi] = KVTraits<T>::pack2(y.x * qs, y.y * qs);
                    }
                mrow[rs] = p.mask && ok ? p.mask + (long long)(s % p.ne33) * p.m_nb3 +
                                          (long long)(row_head(r) % p.ne32) * p.m_nb2 + (long long)row_tok(r) * p.m_nb1
                                        : nullptr;
                lohi[rs] = !ok ? make_int2(0, 0)
                         : p.row_lohi ? __ldg(p.row_lohi + ((long long)(s % p.ne33) * p.ne32 +
                                                           (p.ne32 == 1 ? 0 : row_head(r) % p.ne32)) * p.n_batch + row_tok(r))
                                      : make_int2(0, p.n_kv);
                m[rs] = FATTN_NEG_INF;
                l[rs] = 0.0f;
            }
#pragma unroll
            for (int i = 0; i < D / 8; ++i) O[i][0] = O[i][1] = O[i][2] = O[i][3] = 0.0f;
        }

        for (; x.kind == EV_CHUNK; x = next_event()) {   // the run's chunks, up to its FLUSH
            const int te = min(x.t1, x.cnt);
            // WHOLE: this warp's tiles of the chunk are those whose place in the block's
            // sequence (it + j - t0) is warp modulo 4
            const int j0 = WHOLE ? x.t0 + ((warp - it) % CONSUMERS + CONSUMERS) % CONSUMERS : x.t0;
            for (int j = j0; j < te; j += WHOLE ? CONSUMERS : 1) {
                const int itj = it + (j - x.t0);
                const int stage = itj % STAGES;
                const int en = tile_entry(p, x.pair, j);
                const int c0 = (en & FATTN_TILE_ID_MASK) * BK + w0 + 2 * t4;   // this thread's first cell
                // WHOLE: the stage's previous tile (itj - STAGES) may be another warp's, whose fill
                // may not have landed yet: waiting on "full" now could pass on the parity of the
                // phase before (a stale tile). Its release comes first (the one before that is this
                // warp's own: STAGES is even), then the fill is this tile's.
                if (WHOLE && itj >= STAGES) mbar_wait(empty + stage, ((itj / STAGES) & 1) ^ 1);
                mbar_wait(full + stage, (itj / STAGES) & 1);
                __syncwarp();   // lanes leave the spin apart; ldmatrix and mma are .aligned
                if (itj == 0) DTMA_MARK(1);
                const unsigned kb = k_lane + stage * STAGE_BYTES, vb = v_lane + stage * STAGE_BYTES;

                // ---- step S = Q K^T (16 rows x this warp's NC cells)
                float S[NC / 8][4];
#pragma unroll
                for (int nt = 0; nt < NC / 8; ++nt) S[nt][0] = S[nt][1] = S[nt][2] = S[nt][3] = 0.0f;
#pragma unroll
                for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
                    for (int np = 0; np < NC / 16; ++np) {
                        unsigned b0, b1, b2, b3;
                        ldmatrix_x4(b0, b1, b2, b3, kb + np * 16 * 128 + (ks >> 2) * BOX_BYTES + (((ks & 3) * 2) ^ k_x) * 16);
                        Mma<T>::run(S[2 * np], Qf[ks], b0, b1);
                        Mma<T>::run(S[2 * np + 1], Qf[ks], b2, b3);
                    }
                }

                // ---- step mask a PARTIAL tile: mask values (MASKED; -inf selected unless FINITE)
                // or the rows' intervals; cells past n_kv and invalid rows give -inf
                if (en & FATTN_TILE_PARTIAL) {
                    const bool sel = !(en & FATTN_TILE_FINITE);
#pragma unroll
                    for (int rs = 0; rs < 2; ++rs)
#pragma unroll
                        for (int nt = 0; nt < NC / 8; ++nt) {
                            const int c = c0 + 8 * nt;
                            float& s0 = S[nt][2 * rs];
                            float& s1 = S[nt][2 * rs + 1];
                            if ((en & FATTN_TILE_MASKED) && mrow[rs]) {
                                if (c + 1 < p.n_kv) {
                                    add_mask_pair(s0, s1, __ldg(reinterpret_cast<const __half2*>(mrow[rs]) + (c >> 1)),
                                                  FATTN_LOG2E, sel);
                                } else {
                                    if (c < p.n_kv) add_mask_pair(s0, s1, __halves2half2(__ldg(reinterpret_cast<const __half*>(mrow[rs]) + c),
                                                                                         __float2half(0.0f)), FATTN_LOG2E, sel);
                                    else s0 = FATTN_NEG_INF;
                                    s1 = FATTN_NEG_INF;
                                }
                            } else {
                                const int2 lh = (en & FATTN_TILE_MASKED) ? make_int2(0, 0) : lohi[rs];
                                if (c < lh.x || c >= lh.y || c >= p.n_kv) s0 = FATTN_NEG_INF;
                                if (c + 1 < lh.x || c + 1 >= lh.y || c + 1 >= p.n_kv) s1 = FATTN_NEG_INF;
                            }
                        }
                }

                // ---- step online softmax (rows g, g + 8; the 4 lanes of a quad share a row)
#pragma unroll
                for (int rs = 0; rs < 2; ++rs) {
                    float mx = FATTN_NEG_INF;
#pragma unroll
                    for (int nt = 0; nt < NC / 8; ++nt) mx = fmaxf(mx, fmaxf(S[nt][2 * rs], S[nt][2 * rs + 1]));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    const float m_new = fmaxf(m[rs], mx);
                    const float m_use = m_new == FATTN_NEG_INF ? 0.0f : m_new;
                    if (__any_sync(0xffffffffu, m_new != m[rs])) {   // skip the rescale when no max moved
                        const float alpha = fast_exp2(m[rs] - m_use);   // m == -inf -> 0
                        l[rs] *= alpha;
#pragma unroll
                        for (int i = 0; i < D / 8; ++i) { O[i][2 * rs] *= alpha; O[i][2 * rs + 1] *= alpha; }
                    }
                    m[rs] = m_new;
#pragma unroll
                    for (int nt = 0; nt < NC / 8; ++nt) {
                        S[nt][2 * rs] = fast_exp2(S[nt][2 * rs] - m_use);
                        S[nt][2 * rs + 1] = fast_exp2(S[nt][2 * rs + 1] - m_use);
                        l[rs] += S[nt][2 * rs] + S[nt][2 * rs + 1];
                    }
                }

                // ---- step zero the V rows of this warp's HIDDEN cells (no row sees them: NaN
                // garbage there must not meet a zero probability)
                bool zeroed = false;
                if (en & FATTN_TILE_HIDDEN) {
                    const LiveTiles lt = live_tiles(p, qt, s);
                    const unsigned long long hid = (lt.hidden(p, j, h0, P) >> w0) & (NC == 64 ? ~0ull : (1ull << NC) - 1);
                    if (hid) {
                        unsigned char* vs = ring + stage * STAGE_BYTES + KV_BYTES + w0 * 128;
#pragma unroll
                        for (int i = lane; i < NC * BOXES * 8; i += 32) {   // (cell, box, 16-byte chunk)
                            const int c = i / (BOXES * 8), bx = (i / 8) % BOXES, chn = i % 8;
                            if ((hid >> c) & 1ull)
                                *reinterpret_cast<uint4*>(vs + bx * BOX_BYTES + c * 128 + chn * 16) = make_uint4(0, 0, 0, 0);
                        }
                        __syncwarp();
                        zeroed = true;
                    }
                }

                // ---- step O += P V
#pragma unroll
                for (int kk = 0; kk < NC / 16; ++kk) {
                    unsigned a[4];
                    a[0] = KVTraits<T>::pack2(S[2 * kk][0], S[2 * kk][1]);
                    a[1] = KVTraits<T>::pack2(S[2 * kk][2], S[2 * kk][3]);
                    a[2] = KVTraits<T>::pack2(S[2 * kk + 1][0], S[2 * kk + 1][1]);
                    a[3] = KVTraits<T>::pack2(S[2 * kk + 1][2], S[2 * kk + 1][3]);
#pragma unroll
                    for (int dp = 0; dp < D / 16; ++dp) {
                        unsigned b0, b1, b2, b3;
                        ldmatrix_x4_trans(b0, b1, b2, b3, vb + kk * 16 * 128 + (dp >> 2) * BOX_BYTES + (((dp & 3) * 2) ^ v_x) * 16);
                        Mma<T>::run(O[2 * dp], a, b0, b1);
                        Mma<T>::run(O[2 * dp + 1], a, b2, b3);
                    }
                }
                // release the stage (generic-proxy writes ordered before the next TMA fill)
                if (zeroed) fence_proxy_async_shared();
                __syncwarp();
                if (lane == 0) mbar_arrive(empty + stage);
            }
            it += max(te - x.t0, 0);
            DTMA_MARK(2);
        }

        // ---- step flush (EV_FLUSH): merge the four warps' states (rows g, g + 8 of each)
#pragma unroll
        for (int rs = 0; rs < 2; ++rs) {
            l[rs] += __shfl_xor_sync(0xffffffffu, l[rs], 1);
            l[rs] += __shfl_xor_sync(0xffffffffu, l[rs], 2);
            if (t4 == 0) {
                sML[(warp * ROWS + g + 8 * rs) * 2] = m[rs];
                sML[(warp * ROWS + g + 8 * rs) * 2 + 1] = l[rs];
            }
        }
        named_barrier_sync(1, NT);
        float f[2];
#pragma unroll
        for (int rs = 0; rs < 2; ++rs) {
            float M = FATTN_NEG_INF;
#pragma unroll
            for (int w = 0; w < CONSUMERS; ++w) M = fmaxf(M, sML[(w * ROWS + g + 8 * rs) * 2]);
            f[rs] = m[rs] == FATTN_NEG_INF ? 0.0f : fast_exp2(m[rs] - M);
        }
#pragma unroll
        for (int w = 0; w < CONSUMERS; ++w) {   // one warp at a time adds its scaled O
            if (warp == w) {
#pragma unroll
                for (int rs = 0; rs < 2; ++rs)
#pragma unroll
                    for (int i = 0; i < D / 8; ++i) {
                        float2* o = reinterpret_cast<float2*>(sO + (g + 8 * rs) * D + 8 * i + 2 * t4);
                        const float2 y = *o;
                        *o = make_float2(y.x + f[rs] * O[i][2 * rs], y.y + f[rs] * O[i][2 * rs + 1]);
                    }
            }
            named_barrier_sync(1, NT);
        }
        // write: thread -> row r = tid / 8, columns [cw * (tid % 8), + cw); the whole group to
        // dst, a part (unnormalized, with each row's max and sum) to its slot
        const bool whole = x.slot < 0;
        constexpr int CW = D / 8;
        {
            const int r = tid >> 3, cb = (tid & 7) * CW;
            float M = FATTN_NEG_INF, L = 0.0f;
#pragma unroll
            for (int w = 0; w < CONSUMERS; ++w) M = fmaxf(M, sML[(w * ROWS + r) * 2]);
#pragma unroll
            for (int w = 0; w < CONSUMERS; ++w) {
                const float mw = sML[(w * ROWS + r) * 2];
                L += mw == FATTN_NEG_INF ? 0.0f : sML[(w * ROWS + r) * 2 + 1] * fast_exp2(mw - M);
            }
            if (row_valid(r)) {
                const int h = row_head(r);
                const long long row = ((long long)s * p.n_batch + row_tok(r)) * p.n_head + h;
                const float fac = whole ? row_finish_factor(p, h, M, L) : 1.0f;
                float* out = whole ? p.dst + row * D : p.ws_o + ((long long)x.slot * ROWS + r) * D;
#pragma unroll
                for (int c = 0; c < CW; c += 4) {
                    const float4 y = *reinterpret_cast<const float4*>(sO + r * D + cb + c);
                    *reinterpret_cast<float4*>(out + cb + c) = make_float4(y.x * fac, y.y * fac, y.z * fac, y.w * fac);
                }
                if (!whole && (tid & 7) == 0) {
                    p.ws_ml[((long long)x.slot * ROWS + r) * 2] = M;
                    p.ws_ml[((long long)x.slot * ROWS + r) * 2 + 1] = L;
                }
            }
#pragma unroll
            for (int c = 0; c < CW; c += 4) *reinterpret_cast<float4*>(sO + r * D + cb + c) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        DTMA_MARK(3);
        // ---- step merge: the part joins its group's list; the block whose units complete the
        // group merges every part
        if (!whole) {
            const int group = x.pair * n_hg + x.hg;
            __threadfence();
            named_barrier_sync(1, NT);
            if (tid == 0) {
                const int kp = atomicAdd(ctr.n_parts + group, 1);
                plist[(long long)group * LCAP + kp] = x.slot;
                __threadfence();   // the list entry before the units that may complete the group
                int n = 0;
                if (atomicAdd(ctr.done + group, x.t0) + x.t0 == x.t1) {   // every other part is listed
                    n = atomicExch(ctr.n_parts + group, 0);
                    atomicExch(ctr.done + group, 0);
                }
                *s_flag = n;
            }
            named_barrier_sync(1, NT);
            DTMA_MARK(4);
            const int n_part = *s_flag;
            if (n_part) {
                __threadfence();
                merge_group<D>(p, plist + (long long)group * LCAP, n_part, s_parts,
                               min(ROWS, (p.n_batch - tok0) << pshift), s, tok0, h0, pshift);
                DTMA_MARK(5);
            }
        }
        named_barrier_sync(1, NT);   // sO, sML, the flag and s_parts are free for the next run
    }
    DTMA_MARK(6);
}

// the configurations ggml_attn/decode_tma_shape.py names: K/V type, head size, ring depth, a
// warp per tile (WHOLE) or four warps per tile, blocks per SM the registers must allow (one:
// with two, 168 registers, the warp-per-tile loop spills)
#define FATTN_DECODE_TMA_INSTANCE(NAME, T, D, STAGES, WHOLE, MINB)                                     \
    extern "C" __global__ void __launch_bounds__(dtma::THREADS, MINB)                                  \
    NAME(const FattnParams p, const __grid_constant__ TmaMap mk, const __grid_constant__ TmaMap mv) { \
        fattn_decode_tma_body<T, D, STAGES, WHOLE>(p, &mk, &mv);                                       \
    }
FATTN_DECODE_TMA_INSTANCE(fattn_decode_tma_d128, __half, 128, 6, true, 1)
FATTN_DECODE_TMA_INSTANCE(fattn_decode_tma_bf16_d128, __nv_bfloat16, 128, 6, true, 1)
FATTN_DECODE_TMA_INSTANCE(fattn_decode_tma_s4_d128, __half, 128, 4, true, 1)
FATTN_DECODE_TMA_INSTANCE(fattn_decode_tma_split_d128, __half, 128, 4, false, 1)
