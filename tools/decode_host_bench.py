"""Host work of one decode step outside the engine, without a GPU: the driver's batch checks,
split, cell placement, plan and mask for one token of one sequence (``Runner.decode`` with an
engine that computes nothing), llama-3-8B shapes, a 512-token prompt in an 8192-cell cache.
On the GPU this work precedes every replayed CUDA graph, so it bounds tg128 with graphs.

Usage: python tools/decode_host_bench.py [--steps 100] [--reps 5]
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


def run(steps: int = 100, reps: int = 5, model: str = "llama-3-8b") -> float:
    """Best-of-``reps`` microseconds per decode step."""
    from ggml_attn.cli.models import PRESETS
    from ggml_attn.cli.runner import RunConfig, Runner
    r = Runner(RunConfig(PRESETS[model], n_ctx=8192, n_seq=1, device="cpu", layer="attn"))
    try:
        r.engine.close()
        r.engine = _NoCompute()
        r.decode(r.prompt_batch([512]))
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            for _ in range(steps):
                r.decode(r.step_batch([0]))
            best = min(best, (time.perf_counter() - t) / steps * 1e6)
        return best
    finally:
        r.close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    print(f"host work per decode step (no compute): {run(a.steps, a.reps):.0f} us")


if __name__ == "__main__":
    main()
