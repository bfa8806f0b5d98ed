"""Head-parallel ranks on N GPUs against one GPU: one process per rank (``spawn``), NCCL
all-reduce (``graph/tp.py``'s ``NcclComm``), the driver's plans; then the one-GPU reference
in this process on GPU 0.

    python -m ggml_attn.cli.gpu_multi_check [--n-gpu 2] [--out results.json]

Cases: attention only and the full block, unified and split KV, ragged prompts then decode
steps, a llama-3-70B-like head layout (64 q / 8 KV heads, D 128) with few layers and a small
``n_embd``. Reported per case: NMSE of every output against one GPU, the largest NMSE of each
rank's K/V against the matching head slice of the one-GPU cache, all-reduce calls and NCCL
time on rank 0, and decode tokens/s (plain graph loop, no CUDA graphs) for N GPUs and one.
tests/test_gpu_multi.py asserts on these numbers.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

N_EMBD, N_FF = 1024, 2048
LENS = [37, 5, 130, 64]
N_STEPS = 16


def _cfg():
    from ggml_attn.graph import AttnConfig
    return AttnConfig(n_layer=3, n_head=64, n_head_kv=8, head_dim=128)


def _weights(cfg, xp):
    rng = np.random.default_rng(7)

    def w(n_in, n_out):
        return xp.asarray((rng.standard_normal((n_out, n_in), dtype=np.float32) / np.sqrt(n_in)).astype(np.float16))
    return [dict(wq=w(N_EMBD, cfg.n_head * cfg.head_dim), wk=w(N_EMBD, cfg.n_head_kv * cfg.head_dim),
                 wv=w(N_EMBD, cfg.n_head_kv * cfg.d_v), wo=w(cfg.n_head * cfg.d_v, N_EMBD),
                 wg=w(N_EMBD, N_FF), wu=w(N_EMBD, N_FF), wd=w(N_FF, N_EMBD)) for _ in range(cfg.n_layer)]


def _inputs(cfg, layer):
    from ggml_attn.graph.qkv import token_vectors
    from ggml_attn.graph.runner import ubatch_inputs

    def inputs(plan):
        ub = plan.ubatch
        if layer == "full":
            return token_vectors(ub.primary_seq_ids, ub.positions, 0, 9, 1, N_EMBD)[:, 0]
        return [ubatch_inputs(ub, il, cfg) for il in range(cfg.n_layer)]
    return inputs


def _run_case(cache, engine, cfg, unified):
    """Prompts, then N_STEPS decode steps; outputs per batch (real rows, batch order) and decode seconds."""
    import cupy
    from ggml_attn.graph import Batch, driver
    mode = "simple" if unified else "equal"
    n_seq = len(LENS)
    outs, t_dec = [], 0.0
    for i in range(1 + N_STEPS):
        lens = LENS if i == 0 else [1] * n_seq
        batch = Batch.from_lengths(lens, list(range(n_seq)), start_pos=cache.next_positions(range(n_seq)))
        per: dict = {}

        def done(plan, res):
            idx, real = plan.ubatch.token_idx, ~plan.ubatch.is_pad
            for j, r in enumerate(res):
                per.setdefault(j, np.zeros((batch.n_tokens,) + r.shape[1:], np.float32))[idx[real]] = r[real]
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        driver.decode(cache, batch, 256, mode, engine, cfg, on_done=done)
        cupy.cuda.Device().synchronize()
        if i > 0:
            t_dec += time.perf_counter() - t0
        outs.append([per[j] for j in sorted(per)])
    return outs, t_dec


def _caches(cfg, n_rank, unified):
    import cupy
    from ggml_attn.graph import shard
    kw = dict(unified=unified, n_layer=cfg.n_layer, head_dim_k=cfg.head_dim, dtype=np.float16, xp=cupy)
    return shard.rank_cache(n_rank, 1024, len(LENS), n_head_kv=cfg.n_head_kv, **kw)


CASES = [(layer, unified) for layer in ("attn", "full") for unified in (True, False)]


def _rank(rank: int, n_rank: int, uid, q) -> None:
    """One rank: every case on GPU ``rank``; results (outputs, K/V) to ``q``."""
    try:
        import cupy
        cupy.cuda.Device(rank).use()
        from ggml_attn import op
        from ggml_attn.graph import tp
        op.set_backend("cuda", "auto")
        cfg = _cfg()
        comm = tp.NcclComm(rank, n_rank, uid)
        weights = _weights(cfg, cupy)
        res = {}
        for layer, unified in CASES:
            cache = _caches(cfg, n_rank, unified)
            eng = tp.RankEngine(cache, cfg, rank, n_rank, comm, _inputs(cfg, layer), layer=layer, weights=weights)
            calls, s0 = comm.calls, comm.seconds
            outs, t_dec = _run_case(cache, eng, cfg, unified)
            res[(layer, unified)] = dict(outs=outs if rank == 0 else None, k=cupy.asnumpy(cache.k),
                                         v=cupy.asnumpy(cache.v), t_dec=t_dec, calls=comm.calls - calls,
                                         nccl_s=comm.seconds - s0)
        comm.close()
        q.put((rank, res))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        import traceback
        q.put((rank, f"{e!r}\n{traceback.format_exc()}"))


def nmse(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(((a - b) ** 2).sum() / max((b ** 2).sum(), 1e-30))


def run(n_gpu: int = 2, timeout: float = 540.0) -> dict:
    """Every case on ``n_gpu`` GPUs and on GPU 0 alone; the report (module doc)."""
    import multiprocessing as mp
    import queue as queue_mod
    import cupy
    from ggml_attn import op
    from ggml_attn.graph import shard, tp
    if cupy.cuda.runtime.getDeviceCount() < n_gpu or not tp.nccl_available():
        raise RuntimeError(f"needs {n_gpu} GPUs and NCCL")
    uid = tp.nccl_unique_id()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, n_gpu, uid, q), daemon=True) for r in range(n_gpu)]
    for p in procs:
        p.start()
    got = {}
    try:
        deadline = time.time() + timeout
        while len(got) < n_gpu:
            try:
                r, res = q.get(timeout=max(1.0, deadline - time.time()))
            except queue_mod.Empty:
                raise RuntimeError(f"ranks {sorted(set(range(n_gpu)) - set(got))} did not finish") from None
            if isinstance(res, str):
                raise RuntimeError(f"rank {r} failed: {res}")
            got[r] = res
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    # the one-GPU reference, in this process on GPU 0
    cupy.cuda.Device(0).use()
    op.set_backend("cuda", "auto")
    cfg = _cfg()
    weights = _weights(cfg, cupy)
    report = {"n_gpu": n_gpu, "cases": []}
    for layer, unified in CASES:
        cache = _caches(cfg, 1, unified)
        eng = tp.RankEngine(cache, cfg, 0, 1, _NoComm(), _inputs(cfg, layer), layer=layer, weights=weights)
        ref, t1 = _run_case(cache, eng, cfg, unified)
        mine = got[0][(layer, unified)]
        out_nmse = max(nmse(g, r) for gb, rb in zip(mine["outs"], ref) for g, r in zip(gb, rb))
        kv_nmse = 0.0
        k1, v1 = cupy.asnumpy(cache.k), cupy.asnumpy(cache.v)
        for r in range(n_gpu):
            s = shard.HeadShard(r, n_gpu)
            for a, full, d in ((got[r][(layer, unified)]["k"], k1, cfg.head_dim),
                               (got[r][(layer, unified)]["v"], v1, cfg.d_v)):
                kv_nmse = max(kv_nmse, nmse(a, shard.kv_head_slice(full, s, cfg.n_head_kv, d)))
        n_dec = N_STEPS * len(LENS)
        report["cases"].append(dict(layer=layer, unified=unified, out_nmse=out_nmse, kv_nmse=kv_nmse,
                                    allreduce_calls=mine["calls"], nccl_ms=mine["nccl_s"] * 1e3,
                                    tg_ts_n_gpu=n_dec / max(mine["t_dec"], 1e-9), tg_ts_1_gpu=n_dec / max(t1, 1e-9)))
    return report


class _NoComm:
    calls, seconds = 0, 0.0

    def allreduce(self, arr):
        return arr


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-gpu", type=int, default=2)
    p.add_argument("--out", default=None, help="also write the JSON report here")
    ns = p.parse_args(argv)
    report = run(ns.n_gpu)
    text = json.dumps(report, indent=1)
    print(text)
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(text + "\n")
    bad = [c for c in report["cases"] if c["out_nmse"] > 5e-4 or c["kv_nmse"] > 5e-4]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
