"""Both multi-GPU modes on N GPUs against one GPU: one process per rank (``spawn``), one NCCL
communicator (``graph/tp.py``'s ``NcclComm``), the driver's plans; then the one-GPU reference
in this process on GPU 0.

    python tools/dev/gpu_multi_check.py [--n-gpu 2] [--out results.json]

Modes: ``row`` (head-parallel, ``graph/tp.py``: all-reduces in the full block) and ``layer``
(layer-parallel, ``graph/pipe.py``: contiguous layer ranges, NCCL send/recv of the activations
per ubatch, the pipeline drained at the end of every batch). Cases per mode: attention only and
the full block, unified and split KV, ragged prompts then decode steps, a llama-3-70B-like head
layout (64 q / 8 KV heads, D 128) with few layers (``max(4, N)``) and a small ``n_embd``.
Reported per case: NMSE of every output against one GPU, the largest NMSE of each rank's K/V
against the matching slice (heads or layers) of the one-GPU cache, NCCL calls and time on
rank 0 (layer mode: sends and the drain's receive, which waits for the last rank), and decode
tokens/s (plain graph loop, no CUDA graphs; rank 0's clock, which with the drain covers every
rank) for N GPUs and one. The JSON has every case; the last lines are a table of both modes.
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


def _cfg(n_gpu: int):
    from ggml_attn.graph import AttnConfig
    return AttnConfig(n_layer=max(4, n_gpu), n_head=64, n_head_kv=8, head_dim_k=128)


def _weights(cfg, xp):
    rng = np.random.default_rng(7)

    def w(n_in, n_out):
        return xp.asarray((rng.standard_normal((n_out, n_in), dtype=np.float32) / np.sqrt(n_in)).astype(np.float16))
    return [dict(wq=w(N_EMBD, cfg.n_head * cfg.head_dim_k), wk=w(N_EMBD, cfg.n_head_kv * cfg.head_dim_k),
                 wv=w(N_EMBD, cfg.n_head_kv * cfg.head_dim_v), wo=w(cfg.n_head * cfg.head_dim_v, N_EMBD),
                 wg=w(N_EMBD, N_FF), wu=w(N_EMBD, N_FF), wd=w(N_FF, N_EMBD)) for _ in range(cfg.n_layer)]


def _inputs(cfg, layer):
    from ggml_attn.graph.qkv import token_vectors
    from ggml_attn.graph.qkv_runner import ubatch_inputs

    def inputs(plan):
        ub = plan.ubatch
        if layer == "full":
            return token_vectors(ub.primary_seq_ids, ub.positions, 0, 9, 1, N_EMBD)[:, 0]
        return [ubatch_inputs(ub, il, cfg) for il in range(cfg.n_layer)]
    return inputs


def _device_sync():
    import cupy
    cupy.cuda.Device().synchronize()


def _run_case(cache, engine, cfg, unified, sync=_device_sync):
    """Prompts, then N_STEPS decode steps; outputs per batch (real rows, batch order) and decode
    seconds. ``sync()``: wait for the device (the CPU tests pass a no-op)."""
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
        sync()
        t0 = time.perf_counter()
        driver.decode(cache, batch, 256, mode, engine, cfg, on_done=done)
        engine.synchronize()          # -sm layer: the pipeline drain (every rank, every batch)
        sync()
        if i > 0:
            t_dec += time.perf_counter() - t0
        outs.append([per[j] for j in sorted(per)])
    return outs, t_dec


def _caches(cfg, n_rank, unified, mode="row", rank=0, xp=None):
    """Rank ``rank``'s cache: ``row``: its heads of every layer; ``layer``: every head of its
    layers. ``xp``: CuPy unless given (the CPU tests give numpy)."""
    from ggml_attn.graph import pipe, shard
    if xp is None:
        import cupy as xp
    kw = dict(unified=unified, head_dim_k=cfg.head_dim_k, dtype=np.float16, xp=xp)
    if mode == "layer":
        return pipe.layer_cache(pipe.layer_ranges(cfg.n_layer, n_rank)[rank], 1024, len(LENS),
                                n_head_kv=cfg.n_head_kv, **kw)
    return shard.rank_cache(n_rank, 1024, len(LENS), n_head_kv=cfg.n_head_kv, n_layer=cfg.n_layer, **kw)


MODES = ("row", "layer")
CASES = [(mode, layer, unified) for mode in MODES for layer in ("attn", "full") for unified in (True, False)]


def _engine(mode, cache, cfg, rank, n_rank, comm, layer, weights):
    from ggml_attn.graph import pipe, tp
    if mode == "layer":
        return pipe.PipeRankEngine(cache, cfg, rank, n_rank, comm, _inputs(cfg, layer),
                                   layers=pipe.layer_ranges(cfg.n_layer, n_rank)[rank], layer=layer, weights=weights)
    return tp.RankEngine(cache, cfg, rank, n_rank, comm, _inputs(cfg, layer), layer=layer, weights=weights)


def _keeps_outputs(mode, layer, rank, n_rank) -> bool:
    """Which ranks' outputs make the run's: row/full: rank 0's x (the same on every rank after the
    all-reduce); row/attn: every rank's heads (joined by head in the parent); layer/full: the
    last rank's x; layer/attn: every rank's own layers."""
    if mode == "row":
        return layer == "attn" or rank == 0
    return layer == "attn" or rank == n_rank - 1


def _host(a):
    return a.get() if hasattr(a, "get") else np.array(a, copy=True)


def rank_cases(rank: int, n_rank: int, comm, cfg, weights, *, xp=None, sync=_device_sync) -> dict:
    """Every case on this rank over ``comm``: ``{(mode, layer, unified): outputs (the kept
    ranks'), K, V (host arrays), decode seconds, NCCL calls and seconds}``. ``xp``/``sync``: CuPy
    and a device synchronize unless given (the CPU tests run numpy ranks over ``tp.LocalGroup``)."""
    res = {}
    for mode, layer, unified in CASES:
        cache = _caches(cfg, n_rank, unified, mode, rank, xp=xp)
        eng = _engine(mode, cache, cfg, rank, n_rank, comm, layer, weights)
        calls, s0 = comm.calls, comm.seconds
        outs, t_dec = _run_case(cache, eng, cfg, unified, sync=sync)
        keep = _keeps_outputs(mode, layer, rank, n_rank)
        res[(mode, layer, unified)] = dict(outs=outs if keep else None, k=_host(cache.k), v=_host(cache.v),
                                           t_dec=t_dec, calls=comm.calls - calls, nccl_s=comm.seconds - s0)
    return res


def _rank(rank: int, n_rank: int, uid, q) -> None:
    """One rank: every case on GPU ``rank``; results (outputs, K/V) to ``q``."""
    try:
        import cupy
        cupy.cuda.Device(rank).use()
        from ggml_attn import op
        from ggml_attn.graph import tp
        op.set_backend("cuda", "auto")
        cfg = _cfg(n_rank)
        comm = tp.NcclComm(rank, n_rank, uid)
        res = rank_cases(rank, n_rank, comm, cfg, _weights(cfg, cupy))
        comm.close()
        q.put((rank, res))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        import traceback
        q.put((rank, f"{e!r}\n{traceback.format_exc()}"))


def nmse(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(((a - b) ** 2).sum() / max((b ** 2).sum(), 1e-30))


def spawn_ranks(target, n: int, timeout: float, *args, what: str = "") -> dict:
    """Run ``target(rank, n, uid, q, *args)`` in ``n`` spawned processes sharing one NCCL unique
    id; each puts ``(rank, result)`` on ``q`` (a string: its traceback). Returns ``{rank:
    result}``; RuntimeError (prefixed ``what``) when a rank fails or does not report within
    ``timeout`` seconds. The processes are joined (or terminated) before returning."""
    import multiprocessing as mp
    import queue as queue_mod
    from ggml_attn.graph import tp
    uid = tp.nccl_unique_id()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, n, uid, q, *args), daemon=True) for r in range(n)]
    for p in procs:
        p.start()
    got = {}
    try:
        deadline = time.time() + timeout
        while len(got) < n:
            try:
                r, res = q.get(timeout=max(1.0, deadline - time.time()))
            except queue_mod.Empty:
                raise RuntimeError(f"{what}ranks {sorted(set(range(n)) - set(got))} did not finish") from None
            if isinstance(res, str):
                raise RuntimeError(f"{what}rank {r} failed: {res}")
            got[r] = res
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    return got


def run(n_gpu: int = 2, timeout: float = 540.0) -> dict:
    """Every case on ``n_gpu`` GPUs and on GPU 0 alone; the report (module doc)."""
    import cupy
    from ggml_attn import op
    from ggml_attn.graph import tp
    if cupy.cuda.runtime.getDeviceCount() < n_gpu or not tp.nccl_available():
        raise RuntimeError(f"needs {n_gpu} GPUs and NCCL")
    got = spawn_ranks(_rank, n_gpu, timeout)
    # the one-GPU reference, in this process on GPU 0
    cupy.cuda.Device(0).use()
    op.set_backend("cuda", "auto")
    cfg = _cfg(n_gpu)
    weights = _weights(cfg, cupy)
    refs = {}
    for layer, unified in sorted({(c[1], c[2]) for c in CASES}):
        cache = _caches(cfg, 1, unified)
        eng = tp.RankEngine(cache, cfg, 0, 1, _NoComm(), _inputs(cfg, layer), layer=layer, weights=weights)
        ref, t1 = _run_case(cache, eng, cfg, unified)
        refs[(layer, unified)] = (ref, t1, cupy.asnumpy(cache.k), cupy.asnumpy(cache.v))
    return compare(cfg, n_gpu, got, refs)


def compare(cfg, n_gpu: int, got: dict, refs: dict) -> dict:
    """The report: ``got[rank][(mode, layer, unified)]`` (what ``_rank`` sends) against
    ``refs[(layer, unified)] = (outputs, decode seconds, K, V)`` of one GPU."""
    from ggml_attn.graph import pipe, shard
    ranges = pipe.layer_ranges(cfg.n_layer, n_gpu)
    report = {"n_gpu": n_gpu, "n_layer": cfg.n_layer, "layer_ranges": [[rg.start, rg.stop - 1] for rg in ranges],
              "cases": []}
    n_dec = N_STEPS * len(LENS)
    for mode, layer, unified in CASES:
        ref, t1, k1, v1 = refs[(layer, unified)]
        key = (mode, layer, unified)
        mine = got[0][key]
        outs = _outputs(mode, layer, [got[r][key]["outs"] for r in range(n_gpu)])
        assert len(outs) == len(ref) and all(len(a) == len(b) for a, b in zip(outs, ref)), key
        out_nmse = max(nmse(g, r) for gb, rb in zip(outs, ref) for g, r in zip(gb, rb))
        kv_nmse = 0.0
        for r in range(n_gpu):
            if mode == "layer":
                want = (pipe.kv_layer_slice(k1, ranges[r]), pipe.kv_layer_slice(v1, ranges[r]))
            else:
                s = shard.HeadShard(r, n_gpu)
                want = (shard.kv_head_slice(k1, s, cfg.n_head_kv, cfg.head_dim_k),
                        shard.kv_head_slice(v1, s, cfg.n_head_kv, cfg.head_dim_v))
            for a, w in zip((got[r][key]["k"], got[r][key]["v"]), want):
                assert a.shape == w.shape, (key, r, a.shape, w.shape)
                kv_nmse = max(kv_nmse, nmse(a, w))
        report["cases"].append(dict(mode=mode, layer=layer, unified=unified, out_nmse=out_nmse, kv_nmse=kv_nmse,
                                    comm_calls=mine["calls"], nccl_ms=mine["nccl_s"] * 1e3,
                                    tg_ts_n_gpu=n_dec / max(mine["t_dec"], 1e-9), tg_ts_1_gpu=n_dec / max(t1, 1e-9)))
    return report


def _outputs(mode, layer, per_rank):
    """The N-GPU run's outputs per batch (as ``_run_case`` gives them) from the kept ranks'."""
    if layer == "full":
        return per_rank[0] if mode == "row" else per_rank[-1]
    if mode == "row":   # each rank's heads of every layer, joined in rank (= head) order
        return [[np.concatenate(heads, axis=1) for heads in zip(*batch)] for batch in zip(*per_rank)]
    return [[o for outs in batch for o in outs] for batch in zip(*per_rank)]   # layers in rank order


def table(report) -> str:
    """Both modes side by side, one row per case."""
    head = (f"{'mode':<6} {'layer':<5} {'kv':<7} {'out NMSE':>9} {'KV NMSE':>9} {'NCCL calls':>10} "
            f"{'NCCL ms':>8} {'tg t/s ' + str(report['n_gpu']) + ' GPU':>13} {'tg t/s 1 GPU':>13} {'ratio':>6}")
    lines = [head, "-" * len(head)]
    for c in report["cases"]:
        ratio = c["tg_ts_n_gpu"] / max(c["tg_ts_1_gpu"], 1e-9)
        lines.append(f"{c['mode']:<6} {c['layer']:<5} {'unified' if c['unified'] else 'split':<7} "
                     f"{c['out_nmse']:>9.2e} {c['kv_nmse']:>9.2e} {c['comm_calls']:>10} {c['nccl_ms']:>8.1f} "
                     f"{c['tg_ts_n_gpu']:>13.1f} {c['tg_ts_1_gpu']:>13.1f} {ratio:>6.2f}")
    rg = ", ".join(f"rank {r}: {a}-{b}" for r, (a, b) in enumerate(report["layer_ranges"]))
    lines.append(f"-sm layer: {report['n_layer']} layers, {rg}; -sm row: {64 // report['n_gpu']} q / "
                 f"{8 // report['n_gpu']} KV heads per rank")
    return "\n".join(lines)


class _NoComm:
    calls, seconds = 0, 0.0

    def allreduce(self, arr):
        return arr

    def send(self, arr, peer):
        raise AssertionError("one rank sends nothing")

    recv = send


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-gpu", type=int, default=2)
    p.add_argument("--out", default=None, help="also write the JSON report here")
    ns = p.parse_args(argv)
    report = run(ns.n_gpu)
    text = json.dumps(report, indent=1)
    print(text)
    print(table(report))
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(text + "\n")
    bad = [c for c in report["cases"] if c["out_nmse"] > 5e-4 or c["kv_nmse"] > 5e-4]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
