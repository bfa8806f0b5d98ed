"""Host cost of the prompt ubatches' attention masks (``graph/mask.py`` ``build_mask``), no GPU.

The case: ``--prompts`` ragged prompts of 16-200 tokens (``np.random.default_rng(--seed)``),
a unified KV cache of ``sum(lens) + 33 * prompts + 256`` cells with coarse ``n_kv`` (8 KV heads
of 128), split into ``--ubatch``-token ubatches (``simple``); each ubatch is planned
(``graph/plan.py`` ``plan_ubatch``) and its pads freed, as the driver does. Prints, best of
``--reps`` runs per ubatch, ms per ubatch (averaged over the ubatches) of the whole plan and
of ``build_mask`` alone (timed inside the plan), and with ``--general`` the same with the general path forced (``mask.py``
``_general_mask``), for comparison. ``--n-kv-all`` builds every mask over the whole cache
instead of the cache's ``n_kv`` (a cache whose prompt ubatches attend over every cell).
``--chunk R`` times instead, after the prompts, one ubatch of ``R`` tokens of every sequence
(``R`` = 1: a decode step built from scratch), the sparse (``_fast_mask``) and the dense
(``_general_mask``) path each, whichever ``_fast_applies`` picks: the data of its cost rule.

Usage: python tools/dev/mask_host_bench.py [--prompts 64] [--ubatch 512] [--reps 5] [--seed 1]
           [--n-kv-all] [--general] [--swa N] [--alibi] [--f32] [--no-causal] [--chunk R]
"""
from __future__ import annotations

import argparse
import time


def case(prompts: int = 64, ubatch: int = 512, seed: int = 1):
    """``(make_cache, ubatches)``: a fresh empty cache per call, and the prompt ubatches."""
    import numpy as np
    from ggml_attn.graph import Batch, KVCache, split_ubatches
    lens = np.random.default_rng(seed).integers(16, 201, prompts).tolist()
    n_ctx = sum(lens) + prompts * 33 + 256

    def make_cache():
        return KVCache(n_ctx, prompts, unified=True, n_layer=1, n_head_kv=8, head_dim_k=128, coarse_n_kv=True)
    return make_cache, split_ubatches(Batch.from_lengths(lens), ubatch, "simple")


def run_once(make_cache, ubatches, *, general: bool = False, n_kv_all: bool = False, **mask_kw):
    """``(plan_s, mask_s, n_kv)``: seconds in each ubatch's plan and in its mask (lists, one
    entry per ubatch), and the largest ``n_kv``."""
    from ggml_attn.graph import mask as mask_mod
    from ggml_attn.graph import plan as plan_mod
    cache = make_cache()
    spent = [[], 0]

    def timed(c, ub, slot, n_kv=None, **kw):
        if n_kv_all:
            n_kv = c.kv_size
        spent[1] = max(spent[1], n_kv or c.n_kv(slot))
        t = time.perf_counter()
        try:
            if not general:
                return mask_mod.build_mask(c, ub, slot, n_kv, **kw)
            saved = mask_mod._fast_applies
            mask_mod._fast_applies = lambda *a: False   # the general path runs
            try:
                return mask_mod.build_mask(c, ub, slot, n_kv, **kw)
            finally:
                mask_mod._fast_applies = saved
        finally:
            spent[0].append(time.perf_counter() - t)

    saved_build = plan_mod.build_mask
    plan_mod.build_mask = lambda c, ub, slot, n_kv=None, **kw: timed(c, ub, slot, n_kv, **{**kw, **mask_kw})
    plans = []
    try:
        for ub in ubatches:
            t = time.perf_counter()
            cache.free_pads(plan_mod.plan_ubatch(cache, ub).slot)
            plans.append(time.perf_counter() - t)
    finally:
        plan_mod.build_mask = saved_build
    return plans, spent[0], spent[1]


def run(prompts: int = 64, ubatch: int = 512, reps: int = 5, seed: int = 1, general: bool = False,
        n_kv_all: bool = False, **mask_kw) -> dict:
    """``{"n_ubatch", "plan_ms", "mask_ms", "n_kv"}``: ms per ubatch, each ubatch's best of
    ``reps`` runs (a run's outliers, e.g. page-fault stalls, are left out), averaged."""
    make_cache, ubatches = case(prompts, ubatch, seed)
    runs = [run_once(make_cache, ubatches, general=general, n_kv_all=n_kv_all, **mask_kw) for _ in range(reps)]
    n = len(ubatches)
    plan_ms, mask_ms = (sum(min(r[k][i] for r in runs) for i in range(n)) / n * 1e3 for k in (0, 1))
    return {"n_ubatch": n, "plan_ms": plan_ms, "mask_ms": mask_ms, "n_kv": runs[0][2]}


def chunk(rows: int, prompts: int = 64, ubatch: int = 512, reps: int = 5, seed: int = 1,
          n_kv_all: bool = False, **mask_kw) -> dict:
    """ms of the sparse and of the dense path for one ubatch of ``rows`` tokens of each of the
    ``prompts`` sequences after their prompts (best of ``reps``), and which one is picked."""
    import numpy as np
    from ggml_attn.graph import Batch, split_ubatches
    from ggml_attn.graph import mask as mask_mod
    from ggml_attn.graph import plan as plan_mod
    make_cache, ubatches = case(prompts, ubatch, seed)
    cache = make_cache()
    for ub in ubatches:
        cache.free_pads(plan_mod.plan_ubatch(cache, ub).slot)
    b = Batch.from_lengths([rows] * prompts, list(range(prompts)), start_pos=cache.next_positions(range(prompts)))
    (ub,) = split_ubatches(b, rows * prompts, "simple")
    slot = cache.place(ub)
    n_kv = cache.kv_size if n_kv_all else cache.n_kv(slot)
    kw = dict(causal=True, n_swa=0, alibi=False, dtype=np.float16)
    kw.update(mask_kw)
    kw["dtype"] = np.dtype(kw["dtype"])
    out = {"n_kv": n_kv, "picked": "sparse" if mask_mod._fast_applies(ub, slot, n_kv, kw["dtype"]) else "dense"}
    for name, fn in (("sparse", mask_mod._fast_mask), ("dense", mask_mod._general_mask)):
        best = None
        for _ in range(reps):
            t = time.perf_counter()
            fn(cache, ub, slot, n_kv, **kw)
            dt = time.perf_counter() - t
            best = dt if best is None else min(best, dt)
        out[name] = best * 1e3
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=64, help="prompts of 16-200 tokens (default 64)")
    ap.add_argument("--ubatch", type=int, default=512, help="tokens per ubatch (default 512)")
    ap.add_argument("--reps", type=int, default=5, help="runs; the best is reported (default 5)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the prompt lengths (default 1)")
    ap.add_argument("--n-kv-all", action="store_true", help="masks over the whole cache (n_kv = kv_size)")
    ap.add_argument("--general", action="store_true", help="also time the general path (mask.py _general_mask)")
    ap.add_argument("--swa", type=int, default=0, help="sliding window n_swa (default 0: none)")
    ap.add_argument("--alibi", action="store_true", help="ALiBi mask values")
    ap.add_argument("--no-causal", action="store_true", help="non-causal masks")
    ap.add_argument("--f32", action="store_true", help="float32 masks (default float16)")
    ap.add_argument("--chunk", type=int, default=0, metavar="R",
                    help="time one ubatch of R tokens per sequence after the prompts, both paths")
    a = ap.parse_args(argv)
    if min(a.prompts, a.ubatch, a.reps) < 1 or a.swa < 0:
        ap.error("--prompts, --ubatch and --reps must be positive, --swa not negative")
    kw = dict(causal=not a.no_causal, n_swa=a.swa, alibi=a.alibi)
    if a.f32:
        import numpy as np
        kw["dtype"] = np.float32
    if a.chunk > 0:
        r = chunk(a.chunk, a.prompts, a.ubatch, a.reps, a.seed, a.n_kv_all, **kw)
        print(f"{a.chunk} token(s) x {a.prompts} sequences, n_kv {r['n_kv']}: sparse {r['sparse']:.2f} ms, "
              f"dense {r['dense']:.2f} ms; picked: {r['picked']}")
        return
    for general in ((False, True) if a.general else (False,)):
        r = run(a.prompts, a.ubatch, a.reps, a.seed, general, a.n_kv_all, **kw)
        print(f"{'general' if general else 'default'} path: {r['n_ubatch']} ubatches, n_kv up to {r['n_kv']}: "
              f"plan {r['plan_ms']:.2f} ms per ubatch, build_mask {r['mask_ms']:.2f} ms per ubatch")


if __name__ == "__main__":
    main()
