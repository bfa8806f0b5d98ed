"""CPU benchmark of the op: ggml_attn.flash_attn_ext (numpy path) vs ggml's own CPU FA.

Three shapes with llama-3-8B attention (32 query heads, 8 KV heads, D=128, F16 K/V):
decode over 4096 cached tokens, a 512-token causal prefill, and 16 prompts of 16-200 tokens
in one unified-KV batch (block-diagonal causal mask). Each op runs in its own one-node
graph; the time is the median wall time of ``--repeats`` computes after one warm-up.

    python tools/dev/cpu_op_bench.py [--threads 2] [--repeats 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import ggml
import numpy as np

import ggml_attn
from ggml_attn.conformance import block_causal_mask
from ggml_attn.tensor import as_numpy, from_ggml

N_HEAD, N_HEAD_KV, D = 32, 8, 128


def shapes(seed: int):
    rng = np.random.default_rng(seed)
    lens16 = rng.integers(16, 201, 16).tolist()
    n16 = sum(lens16)
    return [
        ("decode n_kv=4096", 1, 4096, np.zeros((1, 4096), np.float16)),
        ("prefill 512", 512, 512, block_causal_mask([512], 512)),
        (f"16 prompts 16-200 ({n16} tok)", n16, -(-n16 // 256) * 256,
         block_causal_mask(lens16, -(-n16 // 256) * 256)),
    ]


def run_case(n_batch: int, n_kv: int, mask_np: np.ndarray, which: str, threads: int, repeats: int, rng):
    nbytes = 4 * D * n_batch * N_HEAD * 2 + 2 * 2 * D * n_kv * N_HEAD_KV + 2 * n_kv * n_batch
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=nbytes + (64 << 20), mem_buffer=None))
    try:
        q = ggml.ggml_new_tensor_4d(ctx, ggml.GGML_TYPE_F32, D, n_batch, N_HEAD, 1)
        k = ggml.ggml_new_tensor_4d(ctx, ggml.GGML_TYPE_F16, D, n_kv, N_HEAD_KV, 1)
        v = ggml.ggml_new_tensor_4d(ctx, ggml.GGML_TYPE_F16, D, n_kv, N_HEAD_KV, 1)
        m = ggml.ggml_new_tensor_4d(ctx, ggml.GGML_TYPE_F16, n_kv, n_batch, 1, 1)
        for t in (q, k, v):
            view = as_numpy(from_ggml(t))
            view[...] = rng.standard_normal(view.shape).astype(view.dtype)
        as_numpy(from_ggml(m))[0, 0] = mask_np
        scale = 1.0 / np.sqrt(D)
        if which == "ggml":
            out = ggml.ggml_flash_attn_ext(ctx, q, k, v, m, scale, 0.0, 0.0)
            ggml.ggml_flash_attn_ext_set_prec(out, 10)
        else:
            out = ggml_attn.flash_attn_ext(ctx, q, k, v, m, scale)
        gf = ggml.ggml_new_graph(ctx)
        ggml.ggml_build_forward_expand(gf, out)
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            ggml_attn.compute_graph(ctx, gf, threads)
            if i:
                times.append(time.perf_counter() - t0)
        return times
    finally:
        ggml.ggml_free(ctx)


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="ggml graph threads (default 2)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per case (default 5)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the rows to this JSON file")
    a = ap.parse_args(argv)
    ggml_attn.set_backend("reference")
    rng = np.random.default_rng(a.seed)
    rows = []
    print("| case | ggml CPU FA ms | ggml-attn ms | ratio |\n|---|---:|---:|---:|")
    for name, n_batch, n_kv, mask in shapes(a.seed):
        res = {w: statistics.median(run_case(n_batch, n_kv, mask, w, a.threads, a.repeats, rng))
               for w in ("ggml", "ggml_attn")}
        rows.append({"case": name, "n_batch": n_batch, "n_kv": n_kv, "ggml_ms": res["ggml"] * 1e3,
                     "ggml_attn_ms": res["ggml_attn"] * 1e3})
        print(f"| {name} | {res['ggml'] * 1e3:.2f} | {res['ggml_attn'] * 1e3:.2f} | "
              f"{res['ggml_attn'] / res['ggml']:.2f} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": platform.machine(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
                       "commit": _git_commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                       "command": "python tools/dev/cpu_op_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                       "threads": a.threads, "repeats": a.repeats, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
