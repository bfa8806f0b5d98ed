"""How many ubatch graph structures a serve run meets, on the CPU, without a model.

``ggml-attn-serve-bench`` on a GPU builds a model graph (~30 ms of host time for the 8B one) for
every ubatch structure (``graph.build.graph_key`` plus the padded count of logits rows) its
engine does not keep; a timed pass at 12 requests/s on the H100 built 69, one in most steps that
mixed prompts with decode (bench/NOTES.md, fifteenth session). This runs the same trace through
the same scheduler, split, bucket pads and KV cache as the CUDA engines' (``coarse_n_kv``), with
an engine that only records the structures (kept as ``graph.engine``'s LRU keeps them) and a
clock that charges each step a modelled time (a fixed cost, a cost a token, a build's cost) so
that arrivals meet steps as on the GPU. Prints the counts: structures seen, builds per pass
(passes after the first are the warmed-up ones the benchmark times), mixed steps, pad rows, and
``auto``'s dry runs (the candidates it planned on the side) and its host time in ``choose_split``.
``auto`` costs its candidates with the 8B model's attention shape (``--heads``), as on the GPU.

    python tools/dev/serve_structures.py --rate 12 -n 96 -np 64 [--passes 3] [--split auto]
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from ggml_attn.graph import auto, build, driver, serve as gserve   # noqa: E402
from ggml_attn.graph.attn_config import AttnConfig          # noqa: E402
from ggml_attn.graph.engine import GRAPH_BYTES, MAX_GRAPHS, Engine, _Cached, out_rows_padded  # noqa: E402
from ggml_attn.graph.kv_cache import KVCache                # noqa: E402
from ggml_attn.cli.serve_trace import prompt_tokens, synth_trace  # noqa: E402


class _Built:
    """A kept structure's stand-in for a built graph (nothing to free)."""

    def free(self):
        pass


class KeyEngine:
    """``driver.decode``'s engine that runs nothing: each ubatch's structure key, kept as the
    device engine keeps its graphs (``MAX_GRAPHS[True]``, the byte bound ``max_bytes``, evicted
    by ``graph.engine.Engine._evict`` itself); ``builds`` counts the keys it did not keep."""

    def __init__(self, token_bytes: int, max_bytes: int | None):
        self.max_all, self.max_other = MAX_GRAPHS[True]
        self.token_bytes, self.max_bytes = token_bytes, max_bytes
        self._graphs: dict = {}   # key -> engine._Cached, most recently used last
        self.builds = 0
        self.seen: set = set()
        self.want = None

    def run_ubatch(self, plan):
        ub = plan.ubatch
        idx = ub.token_idx
        key = build.graph_key(plan) + (out_rows_padded(int(np.count_nonzero(self.want[idx[idx >= 0]]))),)
        self.seen.add(key)
        entry = self._graphs.pop(key, None)
        if entry is None:
            self.builds += 1
            entry = _Cached(_Built(), ub.decode_step, self.token_bytes * ub.n_tokens)
        self._graphs[key] = entry
        Engine._evict(self, self.max_all, self.max_other, self.max_bytes)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=12.0)
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("-np", type=int, default=64)
    ap.add_argument("-c", type=int, default=33280)
    ap.add_argument("-b", type=int, default=2048)
    ap.add_argument("-ub", type=int, default=512)
    ap.add_argument("--split", default="auto")
    ap.add_argument("--per-stream", action="store_true", help="a stream per sequence (without -kvu); default one buffer")
    ap.add_argument("--prompt-dist", default="16-200")
    ap.add_argument("--gen-dist", default="32-256")
    ap.add_argument("--passes", type=int, default=3, help="the trace served this many times (1 + the warm-ups)")
    ap.add_argument("--step-ms", type=float, default=14.0, help="modelled time of a step, fixed part")
    ap.add_argument("--token-ms", type=float, default=0.066, help="modelled time a token of a step")
    ap.add_argument("--build-ms", type=float, default=30.0, help="modelled time of a graph build")
    ap.add_argument("--token-kb", type=float, default=250.0,
                    help="device memory a built graph holds a token of its ubatch (graph/engine.py: ~250 KB for an 8B model)")
    ap.add_argument("--graph-gib", type=float, default=15.0,
                    help="the kept graphs' bytes at most (graph.engine.graph_bytes_budget: 15 on an H100 with the 8B "
                         f"F16 file and its cache; {GRAPH_BYTES[True] / 2**30:g} before it; 0: no bound)")
    ap.add_argument("--heads", default="32,8,128,32",
                    help="n_head,n_head_kv,head_dim,n_layer of auto's cost model (default: the 8B model's)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    n_head, n_head_kv, head_dim, n_layer = (int(x) for x in a.heads.split(","))
    lo, hi = (int(x) for x in a.prompt_dist.split("-"))
    glo, ghi = (int(x) for x in a.gen_dist.split("-"))
    trace = synth_trace(a.rate if a.rate > 0 else math.inf, a.n, (lo, hi), (glo, ghi), a.seed)
    cache = KVCache(a.c, a.np, unified=not a.per_stream, n_layer=1, n_head_kv=1, head_dim_k=16, coarse_n_kv=True)
    cfg = AttnConfig(n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv, head_dim_k=head_dim)
    dry = {"runs": 0, "s": 0.0}
    real_dry, real_choose = auto.dry_run_plans, driver.choose_split

    def counted_dry(*args, **kw):   # (auto's candidates planned on the side)
        dry["runs"] += 1
        return real_dry(*args, **kw)

    def timed_choose(*args, **kw):
        t0 = time.perf_counter()
        try:
            return real_choose(*args, **kw)
        finally:
            dry["s"] += time.perf_counter() - t0
    auto.dry_run_plans, driver.choose_split = counted_dry, timed_choose
    eng = KeyEngine(int(a.token_kb * 1024), int(a.graph_gib * 2**30) or None)
    t = [0.0]

    def step_fn(step):
        b0 = eng.builds
        eng.want = step.want
        plans = driver.decode(cache, step.batch, a.ub, a.split, eng, cfg)
        t[0] += (a.step_ms + a.token_ms * sum(p.ubatch.n_tokens for p in plans)
                 + a.build_ms * (eng.builds - b0)) / 1e3
        out = (step.batch.tokens[step.want].astype(np.int64) * 31 + 7) % 32000
        return out, dict(ubatches=len(plans), pads=sum(p.ubatch.n_pad for p in plans), builds=eng.builds - b0)

    try:
        for i in range(a.passes):
            dry.update(runs=0, s=0.0)
            reqs = [gserve.ServeRequest(r, tr.arrival, prompt_tokens(r, tr, 32000, a.seed), tr.n_predict)
                    for r, tr in enumerate(trace)]
            sched = gserve.Scheduler(cache, a.np, n_batch=a.b)
            st = gserve.serve(reqs, sched, step_fn, clock=lambda: t[0])
            ttft = np.array([r.ttft for r in reqs if r.ttft is not None]) * 1e3
            print(f"pass {i + 1}: {st.n_steps} steps ({st.n_mixed} mixed), builds {st.counts.get('builds', 0)}, "
                  f"pad rows {st.counts.get('pads', 0)}, structures seen so far {len(eng.seen)}, "
                  f"modelled TTFT p50 {np.percentile(ttft, 50):.0f} ms, elapsed {st.elapsed:.1f} s, "
                  f"auto's dry runs {dry['runs']} ({dry['s'] * 1e3:.0f} ms in choose_split)")
    finally:   # (the real ones back: the tests call main() in their process)
        auto.dry_run_plans, driver.choose_split = real_dry, real_choose
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
