"""One masked prefill call and one unmasked, for ncu: 2 sequences x 1024 tokens in one unified
ubatch (block-causal mask) and the same shapes without a mask. 32 q heads, 8 KV heads, D=128.

Usage: ncu --clock-control none -k regex:fattn_mma python tools/gpu_profile_case.py
"""
from __future__ import annotations

import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpu_bench import Ours, block_causal_mask_np  # noqa: E402


def main():
    import torch
    L = 1024
    masked = Ours(1, 2 * L, 2 * L, block_causal_mask_np([L, L], 2 * L))
    plain = Ours(1, 2 * L, 2 * L)
    for o in (masked, plain):
        o.call("prefill")
        o.call("prefill")
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
