"""Block timeline of the sm_90a decode (kernel "decode-tma") on the GPU: the kernel compiled with
DTMA_TRACE writes %globaltimer stamps per block (cuda/fattn_decode_tma.cu, DTMA_MARK); this prints
their spread -- when blocks start, see their first tile, end their last segment, count
themselves, finish a merge and exit -- for one decode call (B=1, 32 q / 8 KV heads, D 128).

Usage: python tools/dev/gpu_decode_tma_trace.py [n_kv ...]   (default 4096 32768)
"""
from __future__ import annotations

import sys

import numpy as np

EVENTS = ("start", "first tile", "segment end", "written", "counted", "merged", "exit")


def trace(n_kv: int, reps: int = 3) -> dict:
    import cupy as cp
    from ggml_attn import cuda_backend as cb
    from ggml_attn import kernels as K
    from ggml_attn.dtypes import GGML_TYPE_F16
    from ggml_attn.tensor import from_array
    rng = np.random.default_rng(0)
    q = cp.asarray(rng.uniform(-1, 1, (1, 32, 1, 128)).astype(np.float32))
    k = cp.asarray(rng.uniform(-1, 1, (1, 8, n_kv, 128)).astype(np.float16))
    v = cp.asarray(rng.uniform(-1, 1, (1, 8, n_kv, 128)).astype(np.float16))
    dst = cp.zeros((1, 1, 32, 128), cp.float32)
    cb._PREPARED.clear()
    b = cb.bind(from_array(q), from_array(k, GGML_TYPE_F16), from_array(v, GGML_TYPE_F16), None, None,
                from_array(dst), 0.088, kernel="decode-tma")
    cfg = cb._PREPARED[next(iter(cb._PREPARED))].cfg
    var = K.decode_tma_variant(cfg.name)
    traced = K.Variant(var.family + "-trace", var.source, var.names, ("-DDTMA_TRACE=1",), var.arch_suffix)
    fn = K.get_function(traced, cfg.name)
    n_blocks = b._grid[0]
    buf = cp.zeros((n_blocks, 8), cp.uint64)
    b._params.cells = buf.data.ptr   # the argument block points at this struct
    out = None
    for _ in range(reps):
        buf.fill(0)
        b.launch()   # the untraced kernel first: the same state of the caches as a repeated call
        fn.launch_raw(b._grid, b._block, b.stream, b._args)
        cp.cuda.get_current_stream().synchronize()
        out = buf.get().astype(np.int64)
    t0 = out[:, 0][out[:, 0] > 0].min()
    rel = np.where(out > 0, out - t0, -1)
    res = {"n_kv": n_kv, "blocks": n_blocks}
    for i, name in enumerate(EVENTS):
        col = rel[:, i][rel[:, i] >= 0]
        if col.size:
            res[name] = (int(col.min()), int(np.median(col)), int(col.max()), int(col.size))
    return res


def main(argv=None):
    sizes = [int(a) for a in (argv if argv is not None else sys.argv[1:])] or [4096, 32768]
    for n in sizes:
        r = trace(n)
        print(f"n_kv {r['n_kv']}, {r['blocks']} blocks: event  min / median / max ns after the first start  (blocks)")
        for name in EVENTS:
            if name in r:
                lo, med, hi, cnt = r[name]
                print(f"  {name:12s} {lo:8d} {med:8d} {hi:8d}  ({cnt})")


if __name__ == "__main__":
    main()
