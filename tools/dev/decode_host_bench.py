"""Host work of one decode step outside the engine, without a GPU: the driver's batch checks,
split, cell placement, plan and mask for one token of one sequence (``Runner.decode`` with an
engine that computes nothing), llama-3-8B shapes, a 512-token prompt in an 8192-cell cache.
On the GPU this work precedes every replayed CUDA graph, so it bounds tg128 with graphs.

With ``--seqs N``: a decode step of N sequences at once (one token each, unified KV, ragged
prompts of 16-200 tokens), as ``ggml-attn-batched-bench -npl N -kvu`` runs them.

Usage: python tools/dev/decode_host_bench.py [--steps 100] [--reps 5] [--seqs 1]
"""
from __future__ import annotations

import argparse
import time


class _NoCompute:
    """The driver's engine interface, computing nothing."""

    def run_ubatch(self, plan):
        return None

    def synchronize(self):
        pass

    def close(self):
        pass


def run(steps: int = 100, reps: int = 5, model: str = "llama-3-8b", seqs: int = 1) -> float:
    """Best-of-``reps`` microseconds per decode step of ``seqs`` sequences."""
    import numpy as np
    from ggml_attn.cli.models import PRESETS
    from ggml_attn.cli.runner import RunConfig, Runner
    if seqs == 1:
        r = Runner(RunConfig(PRESETS[model], n_ctx=8192, n_seq=1, device="cpu", layer="attn"))
        prompts = [512]
    else:
        prompts = [int(x) for x in np.random.default_rng(0).integers(16, 201, seqs)]
        r = Runner(RunConfig(PRESETS[model], n_ctx=sum(prompts) + seqs * (steps * reps + 256), n_seq=seqs,
                             device="cpu", layer="attn", kv_unified=True))
    ids = list(range(seqs))
    try:
        r.engine.close()
        r.engine = _NoCompute()
        r.decode(r.prompt_batch(prompts))
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            for _ in range(steps):
                r.decode(r.step_batch(ids))
            best = min(best, (time.perf_counter() - t) / steps * 1e6)
        return best
    finally:
        r.close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seqs", type=int, default=1, help="sequences per decode step (default 1)")
    a = ap.parse_args(argv)
    if a.steps < 1 or a.reps < 1 or a.seqs < 1:
        ap.error("--steps, --reps and --seqs must be positive")
    print(f"host work per decode step of {a.seqs} sequence(s) (no compute): "
          f"{run(a.steps, a.reps, seqs=a.seqs):.0f} us")


if __name__ == "__main__":
    main()
