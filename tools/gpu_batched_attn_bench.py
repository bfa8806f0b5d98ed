"""Attention of one batched decode step over a unified KV cache, per kernel (device time).

The cache is filled as ``ggml-attn-batched-bench -m llama-3-8b -npl 64 --prompt-dist 16-200 -kvu``
fills it (64 ragged prompts in one stream, then decode steps of one token per sequence, whose
cells interleave), with the driver on the host (nothing computed); the step's mask comes from
the driver's plan. One layer's attention (32 q / 8 KV heads, D 128, f16 K/V of random values)
is timed for each GPU kernel the op can run at these shapes (and ``cells`` at forced split
counts), device time per call as tools/gpu_bench.py times every row (calls queued behind a sleep
kernel, K/V rotated over copies larger than L2); each row says which kernel ran (``auto``'s
choice), the plan's wall time and, for ``cells``, the device time of rebuilding the cell lists
(a plan refresh).

Usage: python tools/gpu_batched_attn_bench.py [--seqs 64] [--steps 32]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

H, HKV, D = 32, 8, 128


def step_plan(seqs: int, steps: int):
    """The plan (``UBatchPlan``) of decode step ``steps + 1`` after ``seqs`` ragged prompts."""
    from ggml_attn.cli.models import PRESETS
    from ggml_attn.cli.runner import RunConfig, Runner
    from ggml_attn.graph import driver
    from ggml_attn.cli.decode_host_bench import _NoCompute
    lens = [int(x) for x in np.random.default_rng(1).integers(16, 201, seqs)]
    r = Runner(RunConfig(PRESETS["llama-3-8b"], n_ctx=sum(lens) + seqs * (steps + 1) + 256, n_seq=seqs,
                         device="cpu", layer="attn", kv_unified=True))
    try:
        r.engine.close()
        r.engine = _NoCompute()
        r.decode(r.prompt_batch(lens))
        for _ in range(steps):
            r.decode(r.step_batch(list(range(seqs))))
        plans = driver.decode(r.cache, r.step_batch(list(range(seqs))), 512, r.cfg.split, r.engine, r.attn_config())
        return plans[0], sum(lens)
    finally:
        r.close()


def run(seqs: int = 64, steps: int = 32, timer=None, splits=(2, 4, 8)) -> dict:
    """One row per kernel (and per forced split count of ``cells``): device time per call from
    ``timer`` (default ``gpu_timing.device_us``: calls queued behind a sleep kernel, K/V rotated
    over copies larger than L2, as each layer of a model reads its own cache)."""
    import cupy as cp

    from ggml_attn import cuda_backend as cb
    from ggml_attn.tensor import from_array
    if timer is None:
        from ggml_attn.cli.gpu_timing import device_us as timer  # noqa: PLC0415
    from ggml_attn.cli.gpu_timing import copies_for  # noqa: PLC0415
    plan, n_prompt = step_plan(seqs, steps)
    mask_np = np.ascontiguousarray(plan.mask).reshape(1, 1, plan.mask.shape[-2], plan.mask.shape[-1])
    n_kv, n_tok = mask_np.shape[-1], plan.ubatch.n_tokens
    live = float((mask_np[0, 0, :n_tok] == 0).mean())
    kv_bytes = 2 * HKV * n_kv * D * 2
    n_copies = copies_for(kv_bytes)
    rng = cp.random.default_rng(0)
    q = rng.standard_normal((1, H, n_tok, D), dtype=cp.float32)
    kvs = [tuple(from_array(rng.standard_normal((1, HKV, n_kv, D), dtype=cp.float32).astype(cp.float16))
                 for _ in range(2)) for _ in range(n_copies)]
    mask = cp.asarray(mask_np)
    out = cp.empty((1, n_tok, H, D), dtype=cp.float32)
    dq, dm, do = from_array(q), from_array(mask), from_array(out)
    rows = []
    cases = [(k, None) for k in ("auto", "prefill", "decode", "decode-tc", "cells")]
    cases += [("cells", n) for n in splits]
    for kernel, n_splits in cases:
        name = kernel if n_splits is None else f"{kernel}-s{n_splits}"
        try:
            t0 = time.perf_counter()
            kp = cb.make_plan(dm, n_tok, H, HKV, d_k=D, kernel=kernel)
            plan_ms = (time.perf_counter() - t0) * 1e3
            chosen = cb.bind(dq, *kvs[0], dm, None, do, 1 / np.sqrt(D), kernel=kernel, plan=kp).kern

            def make(kd, vd):
                return lambda: cb.flash_attn_ext_device(dq, kd, vd, dm, None, do, 1 / np.sqrt(D),
                                                        kernel=kernel, plan=kp, n_splits=n_splits)
            med, lo, hi = timer([make(kd, vd) for kd, vd in kvs])
            row = dict(kernel=name, us=round(med, 1), us_min=round(lo, 1), ran=chosen,
                       make_plan_ms=round(plan_ms, 2))
            if kp.reads is not None:   # auto: K/V cells per token and KV head, cell lists vs tiles
                row["reads_cells_tiles"] = [round(x, 1) for x in kp.reads]
            if kp.max_cells is not None:
                row["max_cells"] = kp.max_cells
            if kernel == "cells" and n_splits is None:   # the cell-list build alone (a plan refresh)
                row["refresh_us"] = round(timer([kp.refresh])[0], 1)
            rows.append(row)
        except Exception as e:  # noqa: BLE001 - a kernel that does not take these shapes
            rows.append(dict(kernel=name, error=repr(e)[:200]))
    return dict(case=f"batched decode step: {seqs} seqs unified KV, n_kv {n_kv}", n_tok=n_tok, n_kv=n_kv,
                n_prompt_cells=n_prompt, live_fraction=round(live, 4), kv_mb=round(kv_bytes / 1e6, 1),
                kv_copies=n_copies, floor_us_kv_once=round(kv_bytes / 4.2e12 * 1e6, 1), rows=rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    a = ap.parse_args(argv)
    print(json.dumps(run(a.seqs, a.steps), indent=1))


if __name__ == "__main__":
    main()
