"""Compile every kernel variant for this machine's GPU into the disk cache, in parallel: every
program of ``kernels.all_variants()`` and, on compute capability 9.0, the sm_90a programs (one per
instance, ``kernels.hopper_variants()``).

Run before the GPU tests so that test workers load cubins instead of compiling the same
variants concurrently. Usage: python tools/dev/gpu_precompile.py [-j N]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor


def _jobs(arch: str):
    """(variant, arch) of every program this GPU's architecture loads."""
    from ggml_attn import kernels as K
    jobs = [(s, arch) for v in K.all_variants() for s in v.shards()]   # (the programs get_function loads)
    if arch + "a" == K.HOPPER_ARCH:
        jobs += [(s, K.HOPPER_ARCH) for v in K.hopper_variants() for s in v.shards()]
    return jobs


def _one(args):
    idx, arch = args
    from ggml_attn import kernels as K
    v, a = _jobs(arch)[idx]
    t = time.time()
    K.compile_variant(v, a)
    return v.label, time.time() - t


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("-j", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--arch", default=None)
    a = ap.parse_args(argv)
    from ggml_attn import kernels as K
    arch = a.arch or K.device_arch()
    n = len(_jobs(arch))
    t = time.time()
    with ProcessPoolExecutor(a.j) as ex:
        res = list(ex.map(_one, [(i, arch) for i in range(n)]))
    slow = sorted(res, key=lambda r: -r[1])[:3]
    print(f"precompiled {n} programs for {arch} in {time.time() - t:.1f}s "
          f"(slowest: {', '.join(f'{l[:40]} {s:.1f}s' for l, s in slow)})", file=sys.stderr)


if __name__ == "__main__":
    main()
