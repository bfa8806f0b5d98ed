"""#45's check on the GPU: ``graph.greedy``'s time per decode step on a GGUF file, with the
library's engine replaying CUDA graphs (``ModelEngine.CUDA_GRAPHS``) off and on, against the
CLI's step (``ggml-attn-batched-bench`` S_TG on the same file, sequences and prompt length).

    python tools/dev/gpu_greedy_time.py /tmp/m8b.gguf [--n-seq 4] [--n-prompt 128] [--steps 32] [--out F.json]

A step of greedy = one decode batch through ``run_model_batch`` plus the logits' copy and argmax
on the host; the per-step time is (greedy of 1 + steps tokens - greedy of 1 token) / steps, each
on a cache emptied first (graphs kept: the engine lives with the cache), median of ``--reps``.
The tokens of the two settings must agree (replay is checked under the op's "auto" backend).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("--n-seq", type=int, default=4)
    ap.add_argument("--n-prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="")
    ap.add_argument("--xp", default="cupy", choices=("cupy", "numpy"), help="the cache's arrays (numpy: a CPU "
                                                                          "check of this script)")
    a = ap.parse_args(argv)
    import numpy as np

    from ggml_attn.graph.kv_cache import KVCache
    from ggml_attn.graph.model import load_gguf
    from ggml_attn.graph.model_runner import ModelEngine, greedy
    m = load_gguf(a.gguf)
    hp = m.hp
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, hp.n_vocab, a.n_prompt).tolist() for _ in range(a.n_seq)]
    rows, tokens = [], {}
    for cg in (False, True):
        ModelEngine.CUDA_GRAPHS = cg
        cells = a.n_seq * (a.n_prompt + a.steps + 1)   # unified: every sequence's cells in one stream
        cache = KVCache(-(-cells // 256) * 256, a.n_seq, unified=True, n_layer=hp.n_layer,
                        n_head_kv=hp.n_head_kv, head_dim_k=hp.head_dim_k, xp=a.xp)

        def run(n):
            cache.seq_rm(-1)
            t0 = time.perf_counter()
            out = greedy(cache, m, prompts, n)
            return time.perf_counter() - t0, out
        run(a.steps + 1)   # builds (and captures) the prompt's and a step's graphs
        one = [run(1)[0] for _ in range(a.reps)]
        full = [run(a.steps + 1) for _ in range(a.reps)]
        tokens[cg] = full[0][1]
        step = (statistics.median(t for t, _ in full) - statistics.median(one)) / a.steps
        rows.append(dict(tool="greedy", cuda_graphs=cg, step_ms=1e3 * step, prompt_s=statistics.median(one)))
        print(f"greedy CUDA_GRAPHS={cg}: {1e3 * step:.2f} ms a step ({a.n_seq} sequences)", flush=True)
    same = tokens[False] == tokens[True]
    print(f"tokens equal with and without replay: {same}", flush=True)
    cli = shutil.which("ggml-attn-batched-bench")
    if cli and a.xp == "cupy":
        p = subprocess.run([cli, "--device", "cuda", "-m", a.gguf, "-npp", str(a.n_prompt), "-ntg", str(a.steps),
                            "-npl", str(a.n_seq), "-kvu", "-r", str(a.reps), "-o", "jsonl"],
                           capture_output=True, text=True, timeout=600)
        for line in p.stdout.splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                rows.append(dict(tool="batched-bench", step_ms=1e3 * a.n_seq / r["speed_tg"]))
                print(f"batched-bench step: {rows[-1]['step_ms']:.2f} ms", flush=True)
        if p.returncode:
            print(p.stderr[-2000:], file=sys.stderr)
    res = dict(gguf=os.path.basename(a.gguf), n_seq=a.n_seq, n_prompt=a.n_prompt, steps=a.steps,
               tokens_equal=same, rows=rows, commit=os.environ.get("GGML_ATTN_COMMIT", ""))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
