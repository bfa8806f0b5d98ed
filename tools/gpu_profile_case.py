"""Attention calls for ncu (32 q heads, 8 KV heads, D=128, f16 K/V), each run twice (the
first builds and caches the call; ncu's --launch-skip picks the second):

  masked   2 sequences x 1024 tokens in one unified ubatch (block-causal mask), then the same
           shapes without a mask (prefill kernel)
  decode   one token, 4096 KV cells (decode-tc and its split combine), then the same at 32768
           cells with the first 1/8 live (a mask)
  window   a 4096-token prefill with a 512-cell sliding window

Usage: ncu --clock-control none -k regex:fattn python tools/gpu_profile_case.py [CASE ...]
(default: masked)
"""
from __future__ import annotations

import sys

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpu_bench import Ours, block_causal_mask, window_mask  # noqa: E402

CASES = ("masked", "decode", "window")


def problems(case: str) -> list[tuple[Ours, str]]:
    """(problem, kernel) pairs of ``case``, in launch order."""
    if case == "masked":
        L = 1024
        return [(Ours(1, 2 * L, 2 * L, block_causal_mask([L, L], 2 * L)), "prefill"),
                (Ours(1, 2 * L, 2 * L), "prefill")]
    if case == "decode":
        S = 32768
        m = np.full((1, S), -np.inf, dtype=np.float16)
        m[:, :S // 8] = 0
        return [(Ours(1, 1, 4096), "auto"), (Ours(1, 1, S, m), "auto")]
    if case == "window":
        return [(Ours(1, 4096, 4096, window_mask(4096, 512)), "prefill")]
    raise SystemExit(f"unknown case {case!r}: one of {', '.join(CASES)}")


def main(argv=None):
    import torch
    for case in (argv if argv is not None else sys.argv[1:]) or ["masked"]:
        for o, kernel in problems(case):
            f = o.fns(kernel)[0]
            f()
            f()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
