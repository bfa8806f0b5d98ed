"""What a query tile of the sm_90a prefill costs apart from its chunks: the persistent D 128
instance against its probes (ggml_attn.wgmma_shape.WS_DIAG: Q staged for a block's first tile
only, no output stores), without a mask, at shapes with few KV chunks per tile (the ragged
prompts' case: 2 chunks of 128 cells) and many (causal-prefill-like). Device time as
tools/dev/gpu_bench.py measures it; 32 query heads, 8 KV heads.

Usage: python tools/dev/wgmma_tile_probe.py [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpu_bench import SCALE, Ours, _git_commit  # noqa: E402
from gpu_timing import device_us  # noqa: E402

CONFIGS = ("pp-persistent", "diag-qonce", "diag-nostore", "pp-persistent-qtma", "diag-nostore-qtma")
SHAPES = ((7424, 256), (1664, 256), (2048, 2048), (8192, 1024))   # (n_batch, n_kv)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the rows here (JSON)")
    a = ap.parse_args(argv)
    import torch
    from ggml_attn import hopper_prefill
    rows = []
    for n_batch, n_kv in SHAPES:
        o = Ours(1, n_batch, n_kv)
        tiles = -(-n_batch // 128) * 32
        for config in CONFIGS:
            fns = [lambda dk=dk, dv=dv, c=config: hopper_prefill.run_ws(o.dq, dk, dv, o.dd, SCALE, o.stream, config=c)
                   for dk, dv in o.dkv]
            med, lo, hi = device_us(fns)
            rows.append(dict(n_batch=n_batch, n_kv=n_kv, config=config, us=round(med, 2), us_min=round(lo, 2),
                             us_max=round(hi, 2), tiles=tiles))
            print(f"n_batch {n_batch:5d} n_kv {n_kv:5d} ({tiles:5d} tiles) {config:18s} {med:9.2f} us", flush=True)
        fns = [lambda dk=dk, dv=dv: hopper_prefill.run_ws(o.dq, dk, dv, o.dd, SCALE, o.stream, config="pp-persistent-qtma",
                                                          pack=4) for dk, dv in o.dkv]
        med, lo, hi = device_us(fns)   # 4 heads a tile (32 tokens): as many tiles, K/V chunks shared
        rows.append(dict(n_batch=n_batch, n_kv=n_kv, config="pp-persistent-qtma", pack=4, us=round(med, 2),
                         us_min=round(lo, 2), us_max=round(hi, 2), tiles=tiles))
        print(f"n_batch {n_batch:5d} n_kv {n_kv:5d} ({tiles:5d} tiles) {'qtma pack 4':18s} {med:9.2f} us", flush=True)
        del o
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), commit=_git_commit(), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
