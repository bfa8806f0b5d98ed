"""Host work of one decode step outside the engine, without a GPU: the driver's batch checks,
split, cell placement, plan and mask for one token of one sequence (``Runner.decode`` with an
engine that computes nothing), llama-3-8B shapes, a 512-token prompt in an 8192-cell cache.
On the GPU this work precedes every replayed CUDA graph, so it bounds tg128 with graphs.

With ``--seqs N``: a decode step of N sequences at once (one token each, unified KV, ragged
prompts of 16-200 tokens), as ``ggml-attn-batched-bench -npl N -kvu`` runs them. With
``--prompt N``: a whole prompt of N tokens of one sequence into an emptied cache instead (in
ubatches of 512; ``--split`` the split mode), as ``ggml-attn-bench -p N`` times it: on the GPU this
work comes before the prompt's replayed graph, inside the timed run.

Usage: python tools/dev/decode_host_bench.py [--steps 100] [--reps 5] [--seqs 1 | --prompt 512 [--split equal]]
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


def run_prompt(n: int, steps: int = 20, reps: int = 5, model: str = "llama-3-8b", split: str = "equal") -> float:
    """Best-of-``reps`` microseconds of host work per prompt of ``n`` tokens (one sequence, the
    cache emptied before each)."""
    from ggml_attn.cli.models import PRESETS
    from ggml_attn.cli.runner import RunConfig, Runner
    r = Runner(RunConfig(PRESETS[model], n_ctx=max(n, 256), n_seq=1, device="cpu", layer="attn", n_ubatch=512,
                         split=split))
    try:
        r.engine.close()
        r.engine = _NoCompute()
        best = float("inf")
        for _ in range(reps):
            total = 0.0
            for _ in range(steps):
                r.clear()
                t = time.perf_counter()
                r.decode(r.prompt_batch([n]))
                total += time.perf_counter() - t
            best = min(best, total / steps * 1e6)
        return best
    finally:
        r.close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seqs", type=int, default=1, help="sequences per decode step (default 1)")
    ap.add_argument("--prompt", type=int, default=0, help="time a whole prompt of this many tokens instead")
    ap.add_argument("--split", default="equal", help="with --prompt: the split mode (default equal)")
    a = ap.parse_args(argv)
    if a.steps < 1 or a.reps < 1 or a.seqs < 1 or a.prompt < 0:
        ap.error("--steps, --reps and --seqs must be positive, --prompt not negative")
    if a.prompt:
        print(f"host work per prompt of {a.prompt} tokens, split {a.split} (no compute): "
              f"{run_prompt(a.prompt, a.steps, a.reps, split=a.split):.0f} us")
        return
    print(f"host work per decode step of {a.seqs} sequence(s) (no compute): "
          f"{run(a.steps, a.reps, seqs=a.seqs):.0f} us")


if __name__ == "__main__":
    main()
