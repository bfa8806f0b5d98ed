"""Where a model's GPU load goes: the phases of ``-m FILE.gguf --device cuda`` timed apart.

    python tools/dev/model_load_profile.py FILE.gguf [--json OUT.json] [--cli]

Phases, in one process, each wall time: the imports (numpy, CuPy, ggml, the package), CUDA's
start (first device allocation), reading the file's header (``load_gguf``), the weights to the
GPU (``DeviceWeights``) staged through pinned buffers and, for comparison, the memory-mapped
upload of before (second, on a warm page cache like the first), and the first model graph: build
plus one 8-token prompt (loads the kernel modules). ``--cli``: also the wall time of the whole
``ggml-attn-batched-bench --device cuda -m FILE -c 512 -npp 8 -ntg 1 -npl 1`` (the side-by-side
script's load row) in a subprocess.
"""
from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("--json", default="")
    ap.add_argument("--cli", action="store_true")
    a = ap.parse_args(argv)
    rows: dict[str, float] = {}

    def mark(name, t):
        rows[name] = round(time.perf_counter() - t, 3)
        print(f"{name:28s} {rows[name]:7.3f} s", flush=True)
        return time.perf_counter()

    t = T0
    import numpy as np
    t = mark("import numpy", t)
    import cupy as cp
    t = mark("import cupy", t)
    import ggml  # noqa: F401
    t = mark("import ggml", t)
    import ggml_attn  # noqa: F401
    from ggml_attn.graph import Batch, KVCache, load_gguf, run_model_batch
    from ggml_attn.graph.model_device import DeviceWeights
    t = mark("import ggml_attn", t)
    cp.zeros(1).sum().get()
    t = mark("CUDA start", t)
    model = load_gguf(a.gguf)
    t = mark("load_gguf (header)", t)
    dw = DeviceWeights.from_model(model, cp, staged=True)
    cp.cuda.Device().synchronize()
    t = mark("weights staged", t)
    rows["weights_gb"] = round(dw.nbytes / 1e9, 3)
    ref = [a_.copy() for a_ in (dw.tok_embd, dw.output, dw.layers[0]["wq"], dw.layers[-1]["wd"])]
    del dw
    cp.get_default_memory_pool().free_all_blocks()
    t = time.perf_counter()
    dw = DeviceWeights.from_model(model, cp, staged=False)
    cp.cuda.Device().synchronize()
    t = mark("weights mmap (before)", t)
    same = all(bool((x == y).all()) for x, y in zip(ref, (dw.tok_embd, dw.output, dw.layers[0]["wq"],
                                                            dw.layers[-1]["wd"])))
    rows["staged_equals_mmap"] = same
    print("staged == mmap:", same, flush=True)
    model.__dict__.setdefault("_device_weights", {})[("cupy", int(cp.cuda.Device().id))] = dw
    del ref
    t = time.perf_counter()
    hp = model.hp
    c = KVCache(512, 1, unified=True, n_layer=hp.n_layer, n_head_kv=hp.n_head_kv, head_dim_k=hp.head_dim_k, xp="cupy")
    run_model_batch(c, Batch.from_sequences([np.arange(3, 11)]), model)
    cp.cuda.Device().synchronize()
    t = mark("first graph + 8 tokens", t)
    if a.cli:
        exe = os.path.join(os.path.dirname(sys.executable), "ggml-attn-batched-bench")
        t = time.perf_counter()
        p = subprocess.run([exe, "--device", "cuda", "-m", a.gguf, "-c", "512", "-npp", "8", "-ntg", "1", "-npl", "1"],
                           capture_output=True, text=True)
        mark("CLI one-token run (wall)", t)
        rows["cli_rc"] = p.returncode
        if p.returncode:
            print(p.stdout[-2000:], p.stderr[-2000:])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
