"""The CLI's multi-GPU rank engines with and without CUDA graphs, against one GPU.

``ggml-attn-batched-bench -sm row|layer --cuda-graph on`` replays captured ubatch graphs with
NCCL calls inside them (all-reduces in ``-sm row``, send/recv handovers in ``-sm layer``) and
decodes without a device sync per step. This runs the same engines (``tools/runner.Runner`` of
each rank, one process per GPU, as ``multi_gpu.wrap`` starts them) on a small llama-3-8B-shaped
model (``--layer full``, 4 layers, unified KV): ragged prompts, then decode steps without a sync
between them, with CUDA graphs off and on, and compares each rank's final residual stream (the
engine's last output) and K/V cache with graphs off, and the final output with the one-GPU
engine's (GPU 0, this process).

Usage: python tools/dev/gpu_multi_graphs_check.py [--n-gpu 2] [--steps 12]   (prints JSON; exit 1 on a mismatch)
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

LENS = [37, 5, 120, 64, 9, 200, 16, 77]
N_LAYER = 4
TOL = 5e-4


def _config(device_graph: bool, tp=None):
    from ggml_attn.cli.models import PRESETS, with_layers
    from ggml_attn.cli.runner import RunConfig
    return RunConfig(with_layers(PRESETS["llama-3-8b"], N_LAYER), n_ctx=4096, n_seq=len(LENS), kv_unified=True,
                     device="cuda", layer="full", cuda_graph=device_graph, tp=tp)


def _run(cfg, steps: int) -> dict:
    """Prompts, then ``steps`` decode steps without a sync between them; the final output and
    K/V (host arrays)."""
    from ggml_attn.cli.runner import Runner
    r = Runner(cfg)
    try:
        r.decode(r.prompt_batch(LENS), sync=False)
        for _ in range(steps):
            r.decode(r.step_batch(list(range(len(LENS)))), sync=False)
        r.synchronize()
        eng = r.engine
        return dict(out=eng._keep[1].get(), k=r.cache.k.get(), v=r.cache.v.get(),
                    captures=eng.captures, replays=eng.replays)
    finally:
        r.close()


def _rank(rank: int, n: int, uid, q, mode: str, steps: int) -> None:
    try:
        import cupy
        cupy.cuda.Device(rank).use()
        from ggml_attn.cli import multi_gpu
        ctx = multi_gpu.RankContext(rank, n, rank, uid, mode)
        multi_gpu.CURRENT = ctx
        res = {g: _run(_config(g, ctx), steps) for g in (False, True)}
        ctx.comm().close()
        q.put((rank, res))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        import traceback
        q.put((rank, f"{e!r}\n{traceback.format_exc()}"))


def run(n_gpu: int = 2, steps: int = 12, timeout: float = 300.0) -> dict:
    """The report: per mode and rank, NMSE of graphs on vs off (output, K, V), capture counts,
    and the NMSE of the final output against one GPU; ``ok`` when all are within 5e-4."""
    import cupy
    from gpu_multi_check import nmse, spawn_ranks
    from ggml_attn.graph.tp import nccl_available
    if cupy.cuda.runtime.getDeviceCount() < n_gpu or not nccl_available():
        raise RuntimeError(f"needs {n_gpu} GPUs and NCCL")
    cupy.cuda.Device(0).use()
    one = _run(_config(True), steps)
    report = {"n_gpu": n_gpu, "steps": steps, "lens": LENS, "n_layer": N_LAYER, "modes": {}}
    ok = True
    for mode in ("row", "layer"):
        got = spawn_ranks(_rank, n_gpu, timeout, mode, steps, what=f"{mode}: ")
        last = 0 if mode == "row" else n_gpu - 1    # the rank whose output is the model's
        ranks = []
        for r in range(n_gpu):
            off, on = got[r][False], got[r][True]
            row = dict(rank=r, out_nmse=nmse(on["out"], off["out"]), k_nmse=nmse(on["k"], off["k"]),
                       v_nmse=nmse(on["v"], off["v"]), captures=on["captures"], replays=on["replays"])
            ok &= max(row["out_nmse"], row["k_nmse"], row["v_nmse"]) <= TOL and row["replays"] > 0
            ranks.append(row)
        vs_one = nmse(got[last][True]["out"], one["out"])
        ok &= vs_one <= TOL
        report["modes"][mode] = dict(ranks=ranks, out_nmse_vs_one_gpu=vs_one)
    report["ok"] = bool(ok)
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-gpu", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args(argv)
    rep = run(a.n_gpu, a.steps)
    print(json.dumps(rep, indent=1))
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
