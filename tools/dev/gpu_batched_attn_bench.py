"""Attention of one batched decode step over a unified KV cache, per kernel (device time).

The cache is filled as ``ggml-attn-batched-bench -m llama-3-8b -npl 64 --prompt-dist 16-200 -kvu``
fills it (64 ragged prompts in one stream, then decode steps of one token per sequence, whose
cells interleave), with the driver on the host (nothing computed); the step's mask comes from
the driver's plan. One layer's attention (32 q / 8 KV heads, D 128, f16 K/V of random values)
is timed for each GPU kernel the op can run at these shapes (and ``cells`` at forced split
counts), device time per call as tools/dev/gpu_bench.py times every row (calls queued behind a sleep
kernel, K/V rotated over copies larger than L2); each row says which kernel ran (``auto``'s
choice), the plan's wall time and, for ``cells``, the device time of rebuilding the cell lists
(a plan refresh).

Rows ``cells-<label>``: the sweep of fattn_cells variants (:data:`CELLS_SWEEP`: cells in flight
per group ``u``, prefetch depth ``pf``, launch-bounds blocks per SM ``minb``, heads per block
``r``; bench/NOTES.md, "cells v2 sweep"), each selected through ``cuda_launch.CELLS_TUNE``, run
once and checked against the default ``cells`` output (``nmse_vs_default`` <= 1e-6; the default
itself against the float64 reference on a subset of tokens, ``nmse_ref``), then timed; each row
gives the instance's registers and resident blocks per SM. ``sweep`` at the end: the cell rows
by time and the variant to keep (``keep``: the fastest correct one if it beats the default by
more than 3%, else the default).

Usage: python tools/dev/gpu_batched_attn_bench.py [--seqs 64] [--steps 32] [--no-sweep] [--tunes u4-pf0,pf0]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time

import numpy as np

from ggml_attn import kernels as K

H, HKV, D = 32, 8, 128
SWEEP_NMSE_MAX = 1e-6   # a variant's output against the default's (summation order only differs)
REF_TOKENS = 16         # tokens of the default's output checked against the float64 reference
KEEP_GAIN = 0.03        # a variant replaces the default only when this much faster


def step_plan(seqs: int, steps: int):
    """The plan (``UBatchPlan``) of decode step ``steps + 1`` after ``seqs`` ragged prompts."""
    from ggml_attn.cli.models import PRESETS
    from ggml_attn.cli.runner import RunConfig, Runner
    from ggml_attn.graph import driver
    from decode_host_bench import _NoCompute
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


# The fattn_cells variants this script times (rows "cells-<label>") and the GPU tests run
# (tests/test_gpu_kernels.py), selected by cuda_launch.CELLS_TUNE (a kernels.CellsTune; only the
# default ships: in kernels.all_variants(), the CI compile); tests/test_cells.py compiles these. Device time of the batched
# bench's 64-sequence step at b95d488 (H200, L2-cold K/V; bench/NOTES.md, "cells v2 sweep"): the
# default (then labelled u2-pf1) 30.1 us, the other variants 31.0-43.5. Labels name the fields
# that differ from the default, so that run's labels (default U 4, PF 0) read differently now.
CELLS_SWEEP = (
    K.CELLS_DEFAULT,                                        # U 2, PF 1, R 4 at gqa 4: 128 registers, 4 blocks/SM
    K.CellsTune(u=4, pf=0),                                 # the first default: 35.2 us
    K.CellsTune(pf=0),                                      # no prefetch: 32.4
    K.CellsTune(pf=2, rmax=4),                              # K/V rows a step ahead: 33.4
    K.CellsTune(u=4, pf=0, rmax=2),                         # 2 heads per block: 31.0
    K.CellsTune(minb=6, rmax=2),                            # 80 registers, 6 blocks/SM: 31.5
    K.CellsTune(pf=2, minb=8, rmax=1),                      # one head per block, 64 registers: 35.1
)


def run(seqs: int = 64, steps: int = 32, timer=None, splits=(2, 4, 8), sweep=None) -> dict:
    """One row per kernel (and per forced split count of ``cells``, and per ``cells`` variant of
    ``sweep``: kernels.CellsTune values, default :data:`CELLS_SWEEP`; () for none): device time per
    call from ``timer`` (default ``gpu_timing.device_us``: calls queued behind a sleep kernel, K/V
    rotated over copies larger than L2, as each layer of a model reads its own cache)."""
    import cupy as cp

    from ggml_attn import cuda_backend as cb
    from ggml_attn import kernels as K
    from ggml_attn.dtypes import GGML_TYPE_F16
    from ggml_attn.reference import flash_attn_ext, nmse
    from ggml_attn.tensor import from_array
    if timer is None:
        from gpu_timing import device_us as timer  # noqa: PLC0415
    from gpu_timing import copies_for, knobs  # noqa: PLC0415
    if sweep is None:
        sweep = CELLS_SWEEP
    plan, n_prompt = step_plan(seqs, steps)
    mask_np = np.ascontiguousarray(plan.mask).reshape(1, 1, plan.mask.shape[-2], plan.mask.shape[-1])
    n_kv, n_tok = mask_np.shape[-1], plan.ubatch.n_tokens
    live = float((mask_np[0, 0, :n_tok] == 0).mean())
    kv_bytes = 2 * HKV * n_kv * D * 2
    n_copies = copies_for(kv_bytes)
    rng = cp.random.default_rng(0)
    q = rng.standard_normal((1, H, n_tok, D), dtype=cp.float32)
    # the K and V arrays of every copy stay alive (a descriptor does not hold its array: built from
    # temporaries, all the copies' K and V pointed at one recycled pool block, L2-resident)
    kv_arrs = [tuple(rng.standard_normal((1, HKV, n_kv, D), dtype=cp.float32).astype(cp.float16)
                     for _ in range(2)) for _ in range(n_copies)]
    kvs = [tuple(from_array(a) for a in pair) for pair in kv_arrs]
    assert len({d.ptr for pair in kvs for d in pair}) == 2 * n_copies, "K/V copies must not alias"
    mask = cp.asarray(mask_np)
    out = cp.empty((1, n_tok, H, D), dtype=cp.float32)
    dq, dm, do = from_array(q), from_array(mask), from_array(out)
    scale = 1 / np.sqrt(D)
    rows = []
    cases = [(k, None, None) for k in ("auto", "prefill", "decode", "decode-tc", "decode-tma", "cells")]
    cases += [("cells", n, None) for n in splits]
    cases += [("cells", None, t) for t in sweep if t != K.CELLS_DEFAULT]
    base = None   # the default cells output (the sweep's check)
    for kernel, n_splits, tune in cases:
        name = kernel if n_splits is None else f"{kernel}-s{n_splits}"
        if tune is not None:
            name = f"cells-{tune.label}"
        try:
            with knobs(CELLS_TUNE=tune) if tune is not None else contextlib.nullcontext():
                t0 = time.perf_counter()
                kp = cb.make_plan(dm, n_tok, H, HKV, head_dim_k=D, kernel=kernel)
                plan_ms = (time.perf_counter() - t0) * 1e3
                bound = cb.bind(dq, *kvs[0], dm, None, do, scale, kernel=kernel, plan=kp, n_splits=n_splits)
                chosen = bound.kern

                def make(kd, vd):
                    return lambda: cb.flash_attn_ext_device(dq, kd, vd, dm, None, do, scale,
                                                            kernel=kernel, plan=kp, n_splits=n_splits)
                row = dict(kernel=name)
                if kernel == "cells" and n_splits is None:   # checked once before timing
                    out.fill(cp.nan)
                    make(*kvs[0])()
                    got = out.get()
                    if tune is None:
                        base = got
                        sub = slice(0, min(REF_TOKENS, n_tok))
                        ref = flash_attn_ext(q.get()[:, :, sub], kv_arrs[0][0].get(), kv_arrs[0][1].get(),
                                             mask_np[:, :, sub], scale, kv_type=GGML_TYPE_F16)
                        row["nmse_ref"] = float(f"{nmse(got[:, sub], ref):.3g}")
                        row["ok"] = bool(np.isfinite(got).all() and row["nmse_ref"] <= 5e-4)
                    elif base is not None:
                        err = nmse(got, base)
                        row["nmse_vs_default"] = float(f"{err:.3g}")
                        row["ok"] = bool(np.isfinite(got).all() and err <= SWEEP_NMSE_MAX)
                    fn = bound._fn
                    row.update(instance=fn.name, grid=list(bound._grid),
                               registers=fn.attribute("CU_FUNC_ATTRIBUTE_NUM_REGS"),
                               blocks_per_sm=fn.occupancy(bound._block[0]))
                med, lo, hi = timer([make(kd, vd) for kd, vd in kvs])
            row.update(us=round(med, 1), us_min=round(lo, 1), ran=chosen, make_plan_ms=round(plan_ms, 2))
            if kp.reads is not None:   # auto: K/V cells per token and KV head, cell lists vs tiles
                row["reads_cells_tiles"] = [round(x, 1) for x in kp.reads]
            if kp.max_cells is not None:
                row["max_cells"] = kp.max_cells
            if kernel == "cells" and n_splits is None and tune is None:   # the cell-list build alone
                row["refresh_us"] = round(timer([kp.refresh])[0], 1)
            rows.append(row)
        except Exception as e:  # noqa: BLE001 - a kernel that does not take these shapes
            rows.append(dict(kernel=name, error=repr(e)[:200]))
    return dict(case=f"batched decode step: {seqs} seqs unified KV, n_kv {n_kv}", n_tok=n_tok, n_kv=n_kv,
                n_prompt_cells=n_prompt, live_fraction=round(live, 4), kv_mb=round(kv_bytes / 1e6, 1),
                kv_copies=n_copies, floor_us_kv_once=round(kv_bytes / 4.2e12 * 1e6, 1), rows=rows,
                sweep=sweep_verdict(rows))


def sweep_verdict(rows) -> dict:
    """The cell rows (default, forced splits, variants) by time, and the variant to keep: the
    fastest correct variant when it beats the default ``cells`` row by more than KEEP_GAIN."""
    cells = [r for r in rows if r["kernel"].startswith("cells") and "us" in r]
    by_time = [[r["kernel"], r["us"]] for r in sorted(cells, key=lambda r: r["us"])]
    default = next((r["us"] for r in cells if r["kernel"] == "cells"), None)
    variants = [r for r in cells if r.get("ok")]
    bad = [r["kernel"] for r in rows if r["kernel"].startswith("cells-") and "nmse_vs_default" in r
           and not r.get("ok")]
    keep = "cells"
    if default is not None and variants:
        best = min(variants, key=lambda r: r["us"])
        if best["us"] < default * (1 - KEEP_GAIN):
            keep = best["kernel"]
    return dict(by_time=by_time, keep=keep, failed_check=bad,
                errors=[r["kernel"] for r in rows if "error" in r])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--no-sweep", action="store_true", help="no cells-<variant> rows")
    ap.add_argument("--tunes", default=None,
                    help="comma-separated CellsTune labels to sweep instead of CELLS_SWEEP")
    a = ap.parse_args(argv)
    from ggml_attn import kernels as K
    sweep = None
    if a.no_sweep:
        sweep = ()
    elif a.tunes:
        sweep = tuple(K.CellsTune.parse(x) for x in a.tunes.split(","))
    print(json.dumps(run(a.seqs, a.steps, sweep=sweep), indent=1))


if __name__ == "__main__":
    main()
