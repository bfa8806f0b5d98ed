"""Host cost of building one ubatch graph (``graph/build.py`` ``build_ubatch_graph``), without a
GPU: the all-custom form GPU runs use (``all_custom=True``), built as a host graph over numpy
arrays, llama-3-8B shapes (``tools/models.py`` ``PRESETS``), one 512-token prompt ubatch or a
64-token decode ubatch (64 sequences, one token each), nothing computed. Prints microseconds
per graph and per layer, best of ``--reps`` (and the spread: the slowest of them).

The weights of ``--layer full`` are zero-stride F16 arrays of the model's shapes (the builder
reads only their shapes and binds them; no 14 GB of weights), the KV cache is
``graph/kv_cache.py``'s ``KVCache`` (its memory is never touched while building).

Usage: python tools/dev/build_host_bench.py [--layer full|attn] [--tokens 512] [--seqs 1]
           [--graphs 20] [--reps 5] [--profile N]
"""
from __future__ import annotations

import argparse
import time


def model_weights(m, n_layer: int) -> list:
    """Per layer, the F16 weights ``layers.full_layer`` takes (numpy ``(n_out, n_in)``), as
    zero-stride arrays of one element: shapes without memory."""
    import numpy as np
    one = np.zeros(1, dtype=np.float16)

    def w(n_in, n_out):
        return np.lib.stride_tricks.as_strided(one, (n_out, n_in), (0, 0))
    return [dict(wq=w(m.n_embd, m.n_embd_q), wk=w(m.n_embd, m.n_embd_k), wv=w(m.n_embd, m.n_embd_v),
                 wo=w(m.n_head * m.head_dim_v, m.n_embd), wg=w(m.n_embd, m.n_ff), wu=w(m.n_embd, m.n_ff),
                 wd=w(m.n_ff, m.n_embd)) for _ in range(n_layer)]


def setup(layer: str = "full", tokens: int = 512, seqs: int = 1, model: str = "llama-3-8b",
          n_layer: int | None = None):
    """``(build, m)``: ``build()`` builds one all-custom host graph of the ubatch and frees it;
    the ubatch is ``tokens`` tokens of one sequence (``seqs`` 1) or one token of each of ``seqs``
    sequences after a 16-token prompt each (unified KV)."""
    from ggml_attn.cli.models import PRESETS
    from ggml_attn.graph import AttnConfig, Batch, KVCache, split_ubatches
    from ggml_attn.graph.build import build_ubatch_graph
    from ggml_attn.graph.plan import plan_ubatch
    m = PRESETS[model]
    n_layer = n_layer or m.n_layer
    cfg = AttnConfig(n_layer=n_layer, n_head=m.n_head, n_head_kv=m.n_head_kv, head_dim_k=m.head_dim_k,
                     head_dim_v=m.head_dim_v or None)
    n_ctx = 1024 if seqs == 1 else 32 * seqs
    cache = KVCache(n_ctx, seqs, unified=True, n_layer=n_layer, n_head_kv=m.n_head_kv,
                    head_dim_k=m.head_dim_k, head_dim_v=m.head_dim_v)
    if seqs == 1:
        batch = Batch.from_lengths([tokens])
    else:
        for ub in split_ubatches(Batch.from_lengths([16] * seqs), 4096, "simple"):
            cache.free_pads(plan_ubatch(cache, ub).slot)
        batch = Batch.from_lengths([1] * seqs, start_pos=cache.next_positions(range(seqs)))
    (ub,) = split_ubatches(batch, max(tokens, seqs), "simple")
    plan = plan_ubatch(cache, ub)
    weights = model_weights(m, n_layer) if layer == "full" else None

    def build():
        g = build_ubatch_graph(cache, plan, cfg, layer=layer, weights=weights, all_custom=True)
        g.free()
    return build, cfg


def run(layer: str = "full", tokens: int = 512, seqs: int = 1, graphs: int = 20, reps: int = 5,
        model: str = "llama-3-8b") -> tuple[float, float, int]:
    """``(best, worst, n_layer)``: microseconds per graph over ``reps`` runs of ``graphs`` builds."""
    build, cfg = setup(layer, tokens, seqs, model)
    build()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(graphs):
            build()
        times.append((time.perf_counter() - t) / graphs * 1e6)
    return min(times), max(times), cfg.n_layer


def profile(layer: str, tokens: int, seqs: int, graphs: int, top: int = 30) -> None:
    """cProfile ``graphs`` builds; prints the functions by own time and by cumulative time."""
    import cProfile
    import pstats
    build, _ = setup(layer, tokens, seqs)
    build()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(graphs):
        build()
    prof.disable()
    for key in ("tottime", "cumulative"):
        print(f"== by {key}")
        pstats.Stats(prof).sort_stats(key).print_stats(top)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layer", choices=("full", "attn"), default="full")
    ap.add_argument("--tokens", type=int, default=512, help="prompt tokens of the ubatch (default 512)")
    ap.add_argument("--seqs", type=int, default=1, help="N > 1: a decode ubatch of N sequences (default 1)")
    ap.add_argument("--graphs", type=int, default=20, help="graphs built per run (default 20)")
    ap.add_argument("--reps", type=int, default=5, help="runs; the best is reported (default 5)")
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile N builds instead")
    a = ap.parse_args(argv)
    if min(a.tokens, a.seqs, a.graphs, a.reps) < 1:
        ap.error("--tokens, --seqs, --graphs and --reps must be positive")
    if a.profile:
        profile(a.layer, a.tokens, a.seqs, a.profile)
        return
    best, worst, n_layer = run(a.layer, a.tokens, a.seqs, a.graphs, a.reps, a.model)
    what = f"{a.tokens}-token prompt" if a.seqs == 1 else f"{a.seqs}-sequence decode"
    print(f"build_ubatch_graph layer={a.layer} all-custom, {a.model} ({n_layer} layers), {what}: "
          f"{best:.0f} us per graph (worst run {worst:.0f}), {best / n_layer:.1f} us per layer")


if __name__ == "__main__":
    main()
