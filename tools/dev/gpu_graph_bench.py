"""Host cost of the op inside a device-resident ggml graph: ``n_layer`` decode ops (B=1, one
query token, 32 q / 8 KV heads, D 128, f16 K/V of ``n_kv`` cells, a distinct K/V per layer) in
one ggml graph, computed by ggml's CPU graph loop with every tensor in GPU memory.

Rows (per op): the kernels' device time (direct calls queued behind a sleep kernel), the host
time of a compute (enqueue only: the GPU runs behind), the wall time of a compute including its
synchronization, and the wall time of replaying the compute captured as a CUDA graph
(``ggml_attn.graph.capture``). Wall / device is the figure of merit: 1.0 is GPU-bound.

Modes (``MODES``): the ops built with a mask and ``plan=`` (the graph builder's way), with a mask
and no plan, and with neither (ggml's own signature: every node still gets its bound call;
a plan-less masked node rebuilds its tile map from the mask on every replay).
"""
from __future__ import annotations

import ctypes
import time

import numpy as np

H, HKV, D = 32, 8, 128
# keeps the GPU busy (~10 ms at 2 GHz) while the host enqueues one compute behind it
_SPIN = r"""extern "C" __global__ void ggml_attn_bench_spin(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}"""


MODES = ("plan", "mask-no-plan", "no-mask-no-plan")


def _graph(n_layer: int, n_kv: int, mode: str = "plan"):
    """(ctx, graph, keep, direct calls, op nodes) for the n_layer decode ops; every tensor a
    CuPy array; ``mode`` one of ``MODES``."""
    import cupy as cp
    import ggml

    import ggml_attn
    from ggml_attn import cuda_backend as cb
    from ggml_attn.dtypes import GGML_TYPE_F16, GGML_TYPE_F32
    from ggml_attn.tensor import from_array
    n = 8 * n_layer + 8
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=n * ggml.ggml_tensor_overhead()
                                               + ggml.ggml_graph_overhead_custom(n, False) + 4096,
                                               mem_buffer=None, no_alloc=True))
    keep = []
    rng = cp.random.default_rng(0)

    def tensor(type_, arr, name):
        ne = list(reversed(arr.shape)) + [1] * (4 - arr.ndim)
        t = ggml.ggml_new_tensor(ctx, type_, 4, (ctypes.c_int64 * 4)(*ne))
        ggml.ggml_set_name(t, name.encode())
        t.contents.data = ctypes.c_void_p(int(arr.data.ptr))
        keep.append(arr)
        return t
    mask_a = cp.zeros((1, 1, 1, n_kv), dtype=cp.float16)
    mask = tensor(GGML_TYPE_F16, mask_a, "mask")
    plan = cb.make_plan(from_array(mask_a), 1, H, HKV, head_dim_k=D, kv_type=GGML_TYPE_F16) if mode == "plan" else None
    keep.append(plan)
    use_mask = mode != "no-mask-no-plan"
    gf = ggml.ggml_new_graph_custom(ctx, n, False)
    direct, outs = [], []
    for il in range(n_layer):
        qa = rng.standard_normal((1, H, 1, D), dtype=cp.float32)
        ka = rng.standard_normal((1, HKV, n_kv, D), dtype=cp.float32).astype(cp.float16)
        va = rng.standard_normal((1, HKV, n_kv, D), dtype=cp.float32).astype(cp.float16)
        q, k, v = tensor(GGML_TYPE_F32, qa, f"q{il}"), tensor(GGML_TYPE_F16, ka, f"k{il}"), \
            tensor(GGML_TYPE_F16, va, f"v{il}")
        out = ggml_attn.flash_attn_ext(ctx, q, k, v, mask if use_mask else None, 1.0 / np.sqrt(D), plan=plan)
        outs.append(out)
        da = cp.empty((1, 1, H, D), dtype=cp.float32)
        out.contents.data = ctypes.c_void_p(int(da.data.ptr))
        keep.append(da)
        ggml.ggml_build_forward_expand(gf, out)
        descs = [from_array(a) for a in (qa, ka, va, mask_a, da)]
        if not use_mask:
            descs[3] = None
        direct.append(lambda d=descs: cb.flash_attn_ext_device(d[0], d[1], d[2], d[3], None, d[4],
                                                               1.0 / np.sqrt(D), plan=plan))
    return ctx, gf, keep, direct, outs


_PART_NOTES = {
    "nolaunch": "the same compute with every bound launch a no-op: ggml's loop + the callbacks",
    "main-only": "the same compute launching the attention kernel only (no split combine): "
                 "what a one-launch op would cost (its results are not used)",
    "launch": "host time of one bound call's launch()s alone (attention + combine), per op",
    "launch-empty": "one cuLaunchKernel of an empty kernel (CuPy's driver binding), 256 in a row",
    "launch-attn": "one launch of the attention kernel alone, 256 in a row",
    "launch-combine": "one launch of the split combine alone, 256 in a row",
}


def _host_parts(compute, stream, spin, outs) -> dict:
    """Where a compute's host time goes (median of 15 each, us per op): callbacks without
    launches, with the attention kernel only, and the bound launches alone, for the graph's op
    nodes ``outs``."""
    from ggml_attn import op
    specs = [op.spec_of(o) for o in outs]
    specs = [sp for sp in specs if sp.bound is not None and sp.call is not None]
    assert len(specs) == len(outs), f"{len(specs)} bound op nodes, expected {len(outs)}"
    n_layer = len(outs)
    saved = [sp.bound for sp in specs]

    def with_launch(make):   # every bound node's fast-path launch replaced by make(call)
        for sp, rec in zip(specs, saved):
            sp.bound = (*rec[:2], make(sp.call), *rec[3:])

    def timed(fn, n):
        ts = []
        for _ in range(15):
            spin((1,), (1,), (np.int64(20_000_000),))
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) / n * 1e6)
            stream.synchronize()
        ts.sort()
        return ts[7], ts[0]
    out = {}
    try:
        with_launch(lambda call: (lambda: None))
        out["nolaunch"] = timed(compute, n_layer)
        with_launch(lambda call: call._fn.partial(call._grid, call._block, call.stream, call._args))
        out["main-only"] = timed(compute, n_layer)
    finally:
        for sp, rec in zip(specs, saved):
            sp.bound = rec
    calls = [sp.call for sp in specs]
    out["launch"] = timed(lambda: [b.launch() for b in calls], len(calls))
    # one cuLaunchKernel (through CuPy's driver binding, as the bound calls launch) of an empty
    # kernel, of the attention kernel and of the split combine, 256 in a row: the platform's cost
    import cupy as cp
    from cupy.cuda import driver
    empty = cp.RawKernel('extern "C" __global__ void ggml_attn_empty() {}', "ggml_attn_empty")
    empty((1,), (32,), ())
    fn = empty.kernel.ptr
    args = (ctypes.c_void_p * 1)()
    b = calls[0]
    reps = 256
    out["launch-empty"] = timed(lambda: [driver.launchKernel(fn, 1, 1, 1, 32, 1, 1, 0, stream.ptr,
                                                            ctypes.addressof(args), 0) for _ in range(reps)], reps)
    out["launch-attn"] = timed(lambda: [b._fn.launch_raw(b._grid, b._block, b.stream, b._args)
                                        for _ in range(reps)], reps)
    if b._comb is not None:
        out["launch-combine"] = timed(lambda: [b._comb.launch_raw(b._comb_grid, (128, 1, 1), b.stream, b._args)
                                               for _ in range(reps)], reps)
    return out


def run(device_us, n_layer: int = 32, n_kv: int = 4096, reps: int = 50, log=print, modes=MODES) -> list[dict]:
    """The rows of each mode; ``device_us(fns)`` is the benchmark's device timer (median, min,
    max in us)."""
    rows = []
    for mode in modes:
        rows += _run_mode(device_us, n_layer, n_kv, reps, log, mode)
    return rows


def _run_mode(device_us, n_layer: int, n_kv: int, reps: int, log, mode: str) -> list[dict]:
    import cupy as cp
    import ggml

    from ggml_attn import runtime
    from ggml_attn.graph.capture import capture

    ctx, gf, keep, direct, outs = _graph(n_layer, n_kv, mode)
    case = f"graph: {n_layer} decode ops B=1 kv={n_kv}" + ("" if mode == "plan" else f" {mode}")

    def compute():
        with runtime.computing(gf):
            runtime.plan_and_compute(gf, 1)   # (compute_with_ctx took a work buffer from ctx per call)
    try:
        dev = device_us(direct)[0]
        stream = cp.cuda.Stream(non_blocking=True)
        spin = cp.RawKernel(_SPIN, "ggml_attn_bench_spin")
        with stream:
            compute()
            stream.synchronize()
            hosts = []
            for _ in range(15):   # host time of one compute while the GPU is busy (enqueue only,
                spin((1,), (1,), (np.int64(20_000_000),))   # far from filling the launch queue)
                t = time.perf_counter()
                compute()
                hosts.append((time.perf_counter() - t) / n_layer * 1e6)
                stream.synchronize()
            hosts.sort()
            host, host_min = hosts[7], hosts[0]
            parts = _host_parts(compute, stream, spin, outs)
            t = time.perf_counter()
            for _ in range(reps):
                compute()
                stream.synchronize()
            wall = (time.perf_counter() - t) / reps / n_layer * 1e6
        g = capture(compute, stream)
        g.launch(stream)
        stream.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            g.launch(stream)
        stream.synchronize()
        replay = (time.perf_counter() - t) / reps / n_layer * 1e6
    finally:
        ggml.ggml_free(ctx)
    rows = [dict(case=case, impl="ours-device", us=round(dev, 2), note="kernels' device time per op"),
            dict(case=case, impl="ours-graph-host", host_us=round(host, 2), host_us_min=round(host_min, 2),
                 note="host time per op of one ggml compute queued behind a busy GPU (median of 15)"),
            *[dict(case=case, impl=f"ours-graph-host-{k}", host_us=round(v[0], 2), host_us_min=round(v[1], 2),
                   note=_PART_NOTES[k] + " (median and min of 15)") for k, v in parts.items()],
            dict(case=case, impl="ours-graph-wall", host_us=round(wall, 2), ratio=round(wall / dev, 2),
                 target=1.2, note="wall per op of a compute + sync; ratio = wall / device"),
            dict(case=case + " (CUDA graph replay)", impl="ours-replay-wall", host_us=round(replay, 2),
                 ratio=round(replay / dev, 2), target=1.2, note="wall per op of graph replays")]
    for r in rows:
        log(f"{r['case']:44s} {r['impl']:18s} {r.get('us', r.get('host_us'))} {r.get('ratio', '')}"
            f"{' min ' + str(r['host_us_min']) if 'host_us_min' in r else ''}")
    return rows
