// The stage-2 prefill (sm_90a): "prefill-wgmma" in ggml_attn/dispatch.py, launched by
// ggml_attn/cuda_backend.py (bind) or directly by ggml_attn/hopper_prefill.py (run_ws).
#include "fattn_wgmma.cuh"   // hopper_common.cuh, the tile steps, Q staging and row stores

// ---- Warp-specialised (the FlashAttention-3 shape), masks through the plan
// 384 threads: warps 0-7 are two consumer warpgroups of 64 query rows each (128 rows per
// block), warps 8-11 the producer warpgroup (40 registers each, the consumers 232: setmaxnreg),
// whose first thread issues TMA box copies of K and V chunks (BK cells x D halves as 64 x 64
// boxes, 128-byte swizzle; BK = ws::chunk<D>(): 128, or 64 at D 256) into a STAGES-deep ring. Per stage, full_k / full_v count
// the bytes in, empty_k the 8 consumer warps out, empty_v those and (with a plan) the fixer
// warp, v_ready the fixer's hand-over of a HIDDEN chunk's V. Consumers, per chunk j: S = Q K^T
// (Q in shared memory as core matrices, K through its swizzled descriptor), the chunk's mask
// (ws_mask_chunk), online softmax in registers, O += P V (P in registers, V through an MN-major
// swizzled descriptor; cuda/fattn_wgmma.cuh). S of chunk j and P V of chunk j-1 are issued
// together and chunk j's softmax runs while P V is on the tensor cores (FA3's intra-warpgroup
// pipelining); O is rescaled to chunk j-1's maximum under the S GEMM.
// PINGPONG: the two warpgroups take turns issuing their GEMMs (named barriers 3 / 4), so that
// one's softmax runs under the other's GEMMs.
// Chunks: with a plan (p.live_idx: 128-token query tiles), the live 64-cell tiles of the query
// tile paired into 128-cell chunks, or one per chunk at BK 64 (ws_next_chunk); each half FULL,
// ABSENT (not live: loaded from past n_kv, i.e. zeros, and scored -inf), PARTIAL (every row one
// interval of zeros: p.row_lohi) or MASKED (the mask's values read from global memory: correct,
// not fast -- ggml_attn/dispatch.py sends plans with MASKED tiles to the mma.sync kernel). A
// HIDDEN half's unseen V rows are zeroed by warp 9 (the fixer) before the consumers read that V.
// Without a plan every chunk is live and cells past n_kv score -inf. D: the tile width, 64, 128
// or 256; the call's head_dim_k = head_dim_v (p.head_dim_v) is D or a smaller multiple of 8 (40 on the D 64 instance,
// 72-112 on 128, 192 on 256): TMA reads K and V's columns past it as zeros, Q is staged with
// zeros there and only p.head_dim_v columns are stored. f16 or bf16 K/V (T: Q and P staged in the same
// type), no sinks, softcap or ALiBi. A tile is 128 query rows: 128 tokens of one head, or with
// p.pack > 1 (QTMA and masks of one head plane only; ragged batches: tiles that straddle fewer
// prompts, K/V chunks shared by the heads) 128 / pack tokens of pack query heads of one KV head
// (ws_rows). Grid (n_head / pack, n_q_tiles, ne3), query tiles in reverse order (the longest
// causal rows first), or with PERSISTENT (gridDim.x blocks, gridDim.y = z = 1) every block walks
// every gridDim.x-th tile of that order; dynamic shared memory ws::smem_bytes<D, STAGES, QTMA>().
// QTMA (D <= 128): Q reaches shared memory as f32 rows through a TMA map (mq: a box of D values x
// the warpgroup's 64 rows, ws_rows' order; tokens past n_batch and values past the head read as
// zeros), one box per warpgroup, issued by warp 10 a tile ahead -- as soon as the warpgroup has
// converted the current tile's rows into its f16 core matrices (q_empty) -- so that no tile
// waits on Q's global loads; without it (D 256: no room) the consumers load Q from global memory
// at each tile's start (wg_stage_q).
// EPI, the epilogue: 0 each thread stores its rows (wg_store_rows); 1 (OTMA, with QTMA) the rows
// leave through TMA stores of the dst map (mo: ggml_attn/wgmma_shape.py o_map): at a tile's end
// the warpgroup converts the next tile's Q rows (already landed) into its core matrices under the
// last P V, then stages O / l in the f32 rows' space (wg_stage_rows) and hands it to warp 11
// (o_full), which issues the boxes and, once TMA has read them, frees the space (o_empty;
// q_empty for the Q a tile after the next: the f32 rows now hold Q, then the staging, in turn).
// (An EPI 2 that also issued the next tile's first S GEMM before this tile's last P V was waited
// for made ptxas serialize every wgmma -- C7518, a wait count that differs between paths -- and
// ran 25-30% slower: bench/NOTES.md, eighteenth session.)
// DIAG (speed-of-light probes for tools/dev/, wrong results by design): 1 no softmax; 2 Q staged
// for a block's first tile only (later tiles reuse it: the cost of staging Q per tile); 3 no
// output rows stored (the epilogue's cost; a never-true test keeps the results live).
template <typename T, int D, int STAGES, bool PINGPONG, int DIAG = 0, bool PERSISTENT = false, bool QTMA = false,
          int SMX = 0, int EPI = 0>
__device__ __forceinline__ void fattn_wgmma_ws_body(const FattnParams& p, const TmaMap* mk, const TmaMap* mv,
                                                    const TmaMap* mq, const TmaMap* mo) {
    using namespace ws;
    constexpr bool OTMA = EPI == 1;
    static_assert(EPI == 0 || EPI == 1, "epilogues: 0 the threads' stores, 1 TMA's");
    constexpr int BK = chunk<D>();
    constexpr int SMEM = smem_bytes<D, STAGES, QTMA, OTMA>();
    static_assert(SMEM <= 227 * 1024, "the ring and Q exceed a block's shared memory");
    static_assert(!(QTMA && DIAG == 2), "the Q-once probe stages Q itself");
    static_assert(!OTMA || (QTMA && DIAG == 0), "the output's staging is Q's f32 rows' space");
    constexpr int TILE = BK * D;   // halves per K or V chunk
    constexpr int BAR_Q = 1, BAR_SCHED = 3;   // named barriers: Q stored (1 + wg), turn to issue (3 + wg)
    extern __shared__ unsigned char smem_ws[];
    unsigned char* base = smem_align1024(smem_ws);
    __half* sK = reinterpret_cast<__half*>(base);      // STAGES x (D / 64 d-boxes x BK cells x 64), swizzled
    __half* sV = sK + STAGES * TILE;                    // the same for V
    __half* sQ = sV + STAGES * TILE;                    // 2 x (64 rows x D), core matrices
    float* sQf = reinterpret_cast<float*>(sQ + BQ * D);   // QTMA: 2 x (64 rows x D) f32, row-major
    unsigned long long* full_k = reinterpret_cast<unsigned long long*>(QTMA ? reinterpret_cast<__half*>(sQf + BQ * D)
                                                                               : sQ + BQ * D);
    unsigned long long* full_v = full_k + STAGES;
    unsigned long long* empty_k = full_v + STAGES;
    unsigned long long* empty_v = empty_k + STAGES;
    unsigned long long* v_ready = empty_v + STAGES;   // a HIDDEN chunk's V after its hidden rows are zeroed
    unsigned long long* q_full = v_ready + STAGES;    // QTMA, per warpgroup: its rows of the tile's Q landed
    unsigned long long* q_empty = q_full + 2;         // ... and converted (sQf free for the next tile's)
    unsigned long long* o_full = q_empty + 2;         // OTMA, per warpgroup: its output rows staged in sQf
    unsigned long long* o_empty = o_full + 2;         // ... and read by TMA (sQf free for the next staging)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // the query tiles this block computes: its grid coordinates, or (PERSISTENT) every
    // gridDim.x-th tile of the heaviest-first list (heads fastest, then streams, query tiles last
    // to first). Every role walks the same tiles and chunks; J counts the chunks walked before
    // the current tile (the ring's stage and phase run on across tiles).
    const int n_iter = PERSISTENT ? ws_tiles_of_block(p) : 1;
    // A tile is (head group hg, query tile qt, stream s): p.pack query heads of one KV head
    // (ws_rows: which rows each warpgroup holds).
    const int n_hg = p.n_head / p.pack;
    auto tile_of = [&](int it, int& hg, int& qt, int& s) {
        if (!PERSISTENT) {
            hg = blockIdx.x, qt = gridDim.y - 1 - blockIdx.y, s = blockIdx.z;
        } else {
            const int t = blockIdx.x + it * gridDim.x, r = t / n_hg;
            hg = t % n_hg, s = r % p.ne3, qt = p.n_q_tiles - 1 - r / p.ne3;
        }
    };

    // f(it, w, rows, s) for warpgroup w's rows of each tile of this block, in order (warp 10's Q
    // loads, warp 11's output stores)
    auto each_wg_rows = [&](auto f) {
        for (int it = 0; it < n_iter; ++it) {
            int hg, qt, s;
            tile_of(it, hg, qt, s);
#pragma unroll
            for (int w = 0; w < 2; ++w) f(it, w, ws_rows(p, hg, qt, w), s);
        }
    };

    if (threadIdx.x == 0) {
        unsigned dyn;   // the launch's dynamic shared memory must cover this layout
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        if (dyn < (unsigned)SMEM) trap_out_of_line();
        // several heads per tile: Q through TMA (wg_stage_q reads the rows of one head), one mask
        // plane (the fixer zeroes the hidden V rows of the tile's first head's plane)
        if (p.pack != 1 && (!QTMA || p.ne32 != 1)) trap_out_of_line();
        for (int i = 0; i < STAGES; ++i) {
            mbar_init(&full_k[i], 1);
            mbar_init(&full_v[i], 1);
            mbar_init(&empty_k[i], 8);   // lane 0 of each consumer warp
            mbar_init(&empty_v[i], p.live_idx ? 9 : 8);   // and the fixer when there is a plan
            mbar_init(&v_ready[i], 1);
        }
        if (QTMA)
            for (int i = 0; i < 2; ++i) {
                mbar_init(&q_full[i], 1);
                mbar_init(&q_empty[i], 1);
                if (OTMA) {
                    mbar_init(&o_full[i], 1);
                    mbar_init(&o_empty[i], 1);
                }
            }
        fence_mbar_init();
    }
    __syncthreads();

    // ---- producer warpgroup: its registers go to the consumers; one thread keeps the ring full
    if (warp >= 8) {
        setmaxnreg_dec<PRODUCER_REGS>();
        if (warp == 8 && lane == 0) {
            int J = 0;
            for (int it = 0; it < n_iter; ++it) {
                int hg, qt, s;
                tile_of(it, hg, qt, s);
                const int hk = hg * p.pack / p.gqa;
                const WsChunks chunks = ws_chunks<BK>(p, qt, s);
                int pos = 0, j = 0;
                WsChunk c;
                for (; ws_next_chunk<BK>(chunks, pos, c); ++j) {
                    const int n = J + j, st = n % STAGES, release = ((n / STAGES) - 1) & 1;
                    // an ABSENT half is read from past n_kv: TMA writes zeros (no stale cache cells)
                    const int y0 = (c.cls & 3) == WS_ABSENT ? chunks.oob : c.kv0;
                    const int y1 = BK == 128 && (c.cls >> 2) == WS_ABSENT ? chunks.oob : c.kv0 + 64;
                    // one chunk of K or V into stage st once the consumers freed it: 64 x 64
                    // boxes, d-box db (d 64 db .. 64 db + 63) of cells 0-63 (and 64-127)
                    auto load = [&](__half* dst, const TmaMap* map, unsigned long long* empty,
                                    unsigned long long* full) {
                        if (n >= STAGES) mbar_wait(empty, release);
                        mbar_arrive_expect_tx(full, tile_bytes<D, BK>());
#pragma unroll
                        for (int db = 0; db < D / 64; ++db)
#pragma unroll
                            for (int hf = 0; hf < BK / 64; ++hf)
                                tma_load_4d(dst + db * (BK * 64) + hf * 64 * 64, map, 64 * db, hf ? y1 : y0, hk, s,
                                            full);
                    };
                    load(sK + st * TILE, mk, &empty_k[st], &full_k[st]);
                    load(sV + st * TILE, mv, &empty_v[st], &full_v[st]);
                }
                J += j;
            }
        } else if (warp == 9 && p.live_idx != nullptr) {
            // the fixer: once a chunk's V has landed, zero the rows of its hidden columns, then
            // arrive on v_ready -- for every chunk, so that v_ready's phases count the stage's
            // uses as full_v's do (the consumers wait there for HIDDEN chunks only) -- and on
            // empty_v: a stage is not refilled before the fixer is done with it either, so
            // neither full_v nor v_ready ever runs a phase ahead of it
            int J = 0;
            for (int it = 0; it < n_iter; ++it) {
                int hg, qt, s;
                tile_of(it, hg, qt, s);
                const WsChunks chunks = ws_chunks<BK>(p, qt, s);
                int pos = 0, j = 0;
                WsChunk c;
                for (; ws_next_chunk<BK>(chunks, pos, c); ++j) {
                    const int n = J + j, st = n % STAGES;
                    mbar_wait(&full_v[st], (n / STAGES) & 1);
                    if (c.hid) {
                        ws_zero_hidden_v<D, BK>(smem_u32(sV + st * TILE), c, chunks, p.ne32, hg * p.pack, lane);
                        fence_proxy_async_shared();   // the zeros, visible to the consumers' wgmma
                    }
                    __syncwarp();
                    if (lane == 0) {
                        mbar_arrive(&v_ready[st]);
                        // the phase it just completed (its one arrival), waited here: the consumers
                        // wait on v_ready for HIDDEN chunks only, and a phase no thread waited on
                        // before the stage's next use is a protocol error to compute-sanitizer's
                        // synccheck (seen once stages are reused within a tile); returns at once
                        mbar_wait(&v_ready[st], (n / STAGES) & 1);
                        mbar_arrive(&empty_v[st]);
                    }
                }
                J += j;
            }
        } else if (QTMA && warp == 10 && lane == 0) {
            // Q: warpgroup w's 64 rows of each tile, once it has converted the previous tile's
            each_wg_rows([&](int it, int w, const WsRows& rw, int s) {
                if (it > 0) mbar_wait(&q_empty[w], (it - 1) & 1);
                mbar_arrive_expect_tx(&q_full[w], 64 * D * 4);
                tma_load_4d(sQf + w * 64 * D, mq, 0, rw.tbase, rw.hbase, s, &q_full[w]);
            });
        } else if (OTMA && warp == 11 && lane == 0) {
            // the output rows: warpgroup w's staged boxes of each tile -> dst; its staging space
            // then freed for the next tile's rows (o_empty) and the Q of the tile after next
            // (q_empty: the consumers freed it for the next tile's Q at the first tile's start)
            each_wg_rows([&](int it, int w, const WsRows& rw, int s) {
                mbar_wait(&o_full[w], it & 1);
#pragma unroll
                for (int b = 0; b < D / OBOX_COLS; ++b)
                    tma_store_4d(mo, reinterpret_cast<unsigned char*>(sQf + w * 64 * D) + b * OBOX_BYTES,
                                 OBOX_COLS * b, rw.hbase, rw.tbase, s);
                tma_store_commit();
                tma_store_wait_read();
                if (it + 1 < n_iter) mbar_arrive(&o_empty[w]);
                if (it + 2 < n_iter) mbar_arrive(&q_empty[w]);
            });
            tma_store_wait();   // the rows written before the block ends
        }
        return;
    }

    // ---- consumers: warpgroup wg owns 64 query rows of each tile (ws_rows)
    setmaxnreg_inc<CONSUMER_REGS>();
    const int wg = warp >> 2, tid = threadIdx.x & 127, w4 = warp & 3, g = lane >> 2, t4 = lane & 3;
    __half* sQw = sQ + wg * 64 * D;
    const unsigned q_addr = smem_u32(sQw);
    auto k_addr = [&](int st) { return smem_u32(sK + st * TILE); };
    auto v_addr = [&](int st) { return smem_u32(sV + st * TILE); };
    // ping-pong: wait for this warpgroup's turn to issue GEMMs / hand the turn to the other
    auto my_turn = [&]() { if (PINGPONG) named_barrier_sync(BAR_SCHED + wg, 256); };
    auto their_turn = [&]() { if (PINGPONG) named_barrier_arrive(BAR_SCHED + (wg ^ 1), 256); };
    int J = 0;
    for (int it = 0; it < n_iter; ++it) {
        int hg, qt, s;
        tile_of(it, hg, qt, s);
        const WsChunks chunks = ws_chunks<BK>(p, qt, s);
        const WsRows rw = ws_rows(p, hg, qt, wg);
        float S[BK / 2];   // S of a chunk, then its P (f32)
        // this thread's rows 16 w4 + g and + 8 of the warpgroup's 64: one head, tokens tok and tok + 8
        const int h = rw.head(16 * w4), tok = rw.token(16 * w4) + g;
        // Q rows -> shared, then visible to wgmma; a later tile's only after every warp of the
        // warpgroup has waited for the previous tile's S GEMMs (the only readers of this Q)
        if ((DIAG != 2 && !OTMA) || it == 0) {   // (OTMA: a later tile's Q was converted at the last tile's end)
            if (it > 0) named_barrier_sync(BAR_Q + wg, 128);
            if constexpr (QTMA) {
                mbar_wait(&q_full[wg], it & 1);
                wg_convert_q<D, T>(p, sQf + wg * 64 * D, sQw, tid);
            } else {
                wg_stage_q<D, T>(p, sQw, rw.tbase, rw.hbase, s, tid);   // (pack 1 only: one head)
            }
            fence_proxy_async_shared();
            named_barrier_sync(BAR_Q + wg, 128);
            if (QTMA && tid == 0) mbar_arrive(&q_empty[wg]);   // every thread's reads of sQf are done
        }
        // chunk n's V in stage st: from TMA, and from the fixer when the chunk hides columns.
        // full_v first: its completion means the producer saw the stage's previous use released
        // (the fixer's arrival included), so v_ready is then at most one phase behind and its
        // parity wait cannot pass on a phase two uses old.
        auto wait_v = [&](int st, int n, const WsChunk& c) {
            mbar_wait(&full_v[st], (n / STAGES) & 1);
            if (c.hid) mbar_wait(&v_ready[st], (n / STAGES) & 1);
        };
        // this thread's two rows: their visible intervals
        const RowIntervals rows = ws_row_intervals(p, tok, h, s);
        // OTMA: the next tile's Q rows (landed a tile ahead) -> this warpgroup's core matrices,
        // once every warp is past its last S GEMM of this tile (the only readers of sQw)
        auto next_q = [&]() {
            if (!OTMA || it + 1 >= n_iter) return;
            named_barrier_sync(BAR_Q + wg, 128);
            mbar_wait(&q_full[wg], (it + 1) & 1);
            wg_convert_q<D, T>(p, sQf + wg * 64 * D, sQw, tid);
            fence_proxy_async_shared();
        };

        float O[D / 2];
#pragma unroll
        for (int i = 0; i < D / 2; ++i) O[i] = 0.0f;
        float m[2] = {FATTN_NEG_INF, FATTN_NEG_INF}, l[2] = {0.0f, 0.0f}, alpha[2] = {1.0f, 1.0f};
        unsigned a[BK / 4];   // P as the P V GEMM's A fragments
        // rescale: O must be scaled by alpha before the next P V (with WS_SMX_LAZY only when a row
        // of the warp moved its reference maximum: a warp-uniform branch)
        bool rescale = true;
        auto softmax = [&](const WsChunk& c) {
            ws_mask_chunk<BK>(S, c, rows, p, tok, h, s, t4);
            if (DIAG == 1) {
                alpha[0] = alpha[1] = 1.0f;
            } else {
                const bool moved = ws_softmax<BK, SMX>(S, m, l, alpha);
                if (SMX & WS_SMX_LAZY) rescale = __any_sync(0xffffffffu, moved);
            }
        };
        auto rescale_o = [&]() {
            if (!(SMX & WS_SMX_LAZY) || rescale) ws_rescale<D>(O, alpha);
        };

        int pos = 0, j = 0;
        WsChunk cur, prev;
        if (ws_next_chunk<BK>(chunks, pos, cur)) {
            // chunk 0: S alone; then per chunk j: S_j and P_{j-1} V_{j-1} in flight together,
            // softmax of S_j under P V; O is rescaled to chunk j-1's maximum while S_j runs,
            // before P_{j-1} V_{j-1} adds to it (alpha of chunk 0 multiplies zeros)
            const int st0 = J % STAGES;
            mbar_wait(&full_k[st0], (J / STAGES) & 1);
            wgmma_fence();
            ws_issue_s<D, BK, T>(S, q_addr, k_addr(st0));
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_pin(S);
            if (lane == 0) mbar_arrive(&empty_k[st0]);
            softmax(cur);
            ws_pack_p<BK, T>(S, a);
            if (wg == 1) their_turn();   // warpgroup 0 issues first
            for (j = 1, prev = cur; ws_next_chunk<BK>(chunks, pos, cur); prev = cur, ++j) {
                const int n = J + j, st = n % STAGES, pst = (n - 1) % STAGES;
                mbar_wait(&full_k[st], (n / STAGES) & 1);
                my_turn();
                wgmma_fence();
                ws_issue_s<D, BK, T>(S, q_addr, k_addr(st));
                wgmma_commit();
                rescale_o();
                wait_v(pst, n - 1, prev);
                wgmma_fence();          // O's registers were just written
                ws_issue_pv<D, BK, T>(O, a, v_addr(pst));
                wgmma_commit();
                their_turn();
                wgmma_wait<1>();   // S_j is in
                wgmma_pin(S);
                softmax(cur);
                // K_j's stage is free. The arrival's predicate reads the row sums: without that
                // data dependence ptxas hoists the wait below above the whole softmax (it
                // schedules WARPGROUP.DEPBAR as early as it can), and P V would no longer hide
                // the softmax.
                if (lane == 0 && !(l[0] + l[1] < 0.0f)) mbar_arrive(&empty_k[st]);   // l >= 0 or NaN: always
                wgmma_wait<0>();   // P V of chunk j-1 is in: V_{j-1}'s stage and P's registers are free
                wgmma_pin(O);
                wgmma_pin(a);
                if (lane == 0) mbar_arrive(&empty_v[pst]);
                ws_pack_p<BK, T>(S, a);
            }
            const int lst = (J + j - 1) % STAGES;
            rescale_o();
            wait_v(lst, J + j - 1, prev);
            my_turn();   // the turns balance: every arrival on a schedule barrier meets its sync
            wgmma_fence();
            ws_issue_pv<D, BK, T>(O, a, v_addr(lst));
            wgmma_commit();
            if (wg == 0) their_turn();
            next_q();   // (under the last P V)
            wgmma_wait<0>();
            wgmma_pin(O);
            // the last V stage: released too when a later tile of this block refills the ring
            if (PERSISTENT && lane == 0) mbar_arrive(&empty_v[lst]);
        } else {
            next_q();
        }

        // ---- output rows
        if constexpr (OTMA) {
            // staged in sQf once its next Q is converted (every warp: the barrier) and TMA has
            // read this warpgroup's previous rows out of it (o_empty), then handed to warp 11
            named_barrier_sync(BAR_Q + wg, 128);
            if (it > 0) mbar_wait(&o_empty[wg], (it - 1) & 1);
            wg_stage_rows<D>(O, l, sQf + wg * 64 * D, rw.tw, w4, g, t4);
            fence_proxy_async_shared();
            named_barrier_sync(BAR_Q + wg, 128);
            if (tid == 0) mbar_arrive(&o_full[wg]);
        } else if (DIAG != 3 || O[0] == 1234.5f) {
            wg_store_rows<D>(p, O, l, tok, h, s, t4);
        }
        J += j;
    }
}

// One instance per configuration ggml_attn/wgmma_shape.py names (WsConfig.name: this template
// with its parameters), each compiled in an NVRTC program of its own (a name expression, so that
// the first call of one instance compiles that one alone): K/V type, tile width, ring depth,
// ping-pong, diagnostic mode, persistent blocks, Q through TMA (every instance takes the Q map;
// those without QTMA ignore it), the softmax's variant (WS_SMX_* in cuda/fattn_wgmma.cuh), the
// epilogue (every instance takes the dst map; those that store their rows themselves ignore it)
template <typename T, int D, int STAGES, bool PINGPONG, int DIAG, bool PERSISTENT, bool QTMA, int SMX, int EPI>
__global__ void __launch_bounds__(ws::THREADS, 1)
fattn_wgmma_ws(const FattnParams p, const __grid_constant__ TmaMap mk, const __grid_constant__ TmaMap mv,
               const __grid_constant__ TmaMap mq, const __grid_constant__ TmaMap mo) {
    fattn_wgmma_ws_body<T, D, STAGES, PINGPONG, DIAG, PERSISTENT, QTMA, SMX, EPI>(p, &mk, &mv, &mq, &mo);
}

// The dynamic shared memory (bytes) a launch of fattn_wgmma_ws<...> with the same parameters takes:
// the host reads it from the compiled program (ggml_attn/variants.py smem_expr, ggml_attn/cubin.py)
template <typename T, int D, int STAGES, bool PINGPONG, int DIAG, bool PERSISTENT, bool QTMA, int SMX, int EPI>
__device__ const int fattn_wgmma_ws_smem = ws::smem_bytes<D, STAGES, QTMA, (EPI == 1)>();
