"""Device-resident ubatch graphs (CuPy cache, every compute node a custom op). GPU only."""
import numpy as np
import pytest

import ggml_attn

from ggml_attn.graph import AttnConfig, Batch, KVCache, run_batch, split_ubatches
from ggml_attn.graph.build import build_ubatch_graph, check_device_graph
from ggml_attn.graph.plan import plan_ubatch
from ggml_attn.reference import nmse

cupy = pytest.importorskip("cupy")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ggml_attn.gpu_available(), reason="needs a CUDA GPU")]

CFG = AttnConfig(n_layer=2, n_head=8, n_head_kv=2, head_dim_k=64)


def cache(unified, xp, n_seq=10):
    return KVCache(n_seq * 512, n_seq, unified=unified, n_layer=2, n_head_kv=2, head_dim_k=64, xp=xp)


@pytest.mark.parametrize("unified, mode", [(True, "simple"), (False, "equal"), (False, "padded")])
def test_device_graph_matches_host(unified, mode):
    b = Batch.from_lengths(range(1, 11))
    host_c, dev_c = cache(unified, None), cache(unified, "cupy")
    ref = run_batch(host_c, b, 512, mode, CFG)
    got = run_batch(dev_c, b, 512, mode, CFG, compute="ggml")
    assert nmse(got.out, ref.out) < 5e-4
    for s in range(10):
        p1, k1, v1 = host_c.sequence_contents(s, 1)
        p2, k2, v2 = dev_c.sequence_contents(s, 1)
        assert np.array_equal(p1, p2) and np.array_equal(k1, k2) and np.array_equal(v1, v2)
    dec = Batch.from_lengths([1] * 10, start_pos=dev_c.next_positions(range(10)))
    d_ref = run_batch(host_c, dec, 512, mode, CFG)
    d_got = run_batch(dev_c, dec, 512, mode, CFG, compute="ggml")
    assert nmse(d_got.out, d_ref.out) < 5e-4


def test_device_graph_with_backend_reference_matches_host():
    """backend 'reference' on a device graph: the numpy reference on host copies of the device
    data. The op's numpy path reads host pointers only; it was chosen here (and whenever the op
    saw no usable GPU) and segfaulted reading K (tests/test_op.py checks the choice on the CPU)."""
    b = Batch.from_lengths(range(1, 11))
    host_c, dev_c = cache(False, None), cache(False, "cupy")
    ref = run_batch(host_c, b, 512, "padded", CFG)
    ggml_attn.set_backend("reference")
    try:
        got = run_batch(dev_c, b, 512, "padded", CFG, compute="ggml")
    finally:
        ggml_attn.set_backend("auto")
    assert nmse(got.out, ref.out) < 5e-4


def test_device_graph_is_all_custom_and_plans_once():
    c = cache(False, "cupy")
    (ub,) = split_ubatches(Batch.from_lengths(range(1, 11)), 512, "padded")
    plan = plan_ubatch(c, ub)
    g = build_ubatch_graph(c, plan, CFG)
    assert g.device
    check_device_graph(g.graph)
    assert plan.kernel_plan is not None
    g.free()


def test_kernel_plan_follows_the_mask_of_a_rebuilt_graph():
    """A UBatchPlan built into a second graph gets a kernel plan for that graph's mask."""
    from ggml_attn.graph.build import _ptr
    c = cache(False, "cupy")
    (ub,) = split_ubatches(Batch.from_lengths(range(1, 11)), 512, "padded")
    plan = plan_ubatch(c, ub)
    g1 = build_ubatch_graph(c, plan, CFG)
    kp1 = plan.kernel_plan

    def mask_ptr(g):
        return next(_ptr(a) for a in g._arrays.values() if a.dtype == np.float16 and a.ndim == 4)
    assert kp1.mask.ptr == mask_ptr(g1)
    g2 = build_ubatch_graph(c, plan, CFG)
    assert plan.kernel_plan is not kp1 and plan.kernel_plan.mask.ptr == mask_ptr(g2)
    g2.free()
    g1.free()


def _attn_graph_with_inputs():
    """(graph, its cache): a device ubatch graph (10 prompts, padded split) with its Q/K/V inputs set."""
    from ggml_attn.graph.qkv_runner import ubatch_inputs
    c = cache(False, "cupy")
    (ub,) = split_ubatches(Batch.from_lengths(range(1, 11)), 512, "padded")
    g = build_ubatch_graph(c, plan_ubatch(c, ub), CFG)
    ins = [ubatch_inputs(ub, il, CFG) for il in range(CFG.n_layer)]
    g.set_inputs(*[[cupy.asarray(x[j]) for x in ins] for j in range(3)])
    return g, c


def test_op_replays_its_bound_call_until_pointers_stream_or_settings_change(monkeypatch):
    """Ops built with the ubatch's plan keep their bound launch: a second compute launches it
    again without binding (no validation, no planning); a new stream or set_backend binds
    again; results stay the same."""
    from ggml_attn import cuda_backend
    g, _cache = _attn_graph_with_inputs()
    binds = []
    real_bind = cuda_backend.bind
    monkeypatch.setattr(cuda_backend, "bind", lambda *a, **kw: binds.append(1) or real_bind(*a, **kw))
    g.compute(1)
    first = [o.get() for o in g.outputs()]
    assert len(binds) == CFG.n_layer
    g.compute(1)
    assert len(binds) == CFG.n_layer, "the second compute must replay the bound calls"
    for a, b in zip(first, [o.get() for o in g.outputs()]):
        assert np.array_equal(a, b)
    with cupy.cuda.Stream(non_blocking=True) as s:
        g.compute(1)
        s.synchronize()
    assert len(binds) == 2 * CFG.n_layer, "another stream binds again"
    ggml_attn.set_backend("auto")
    g.compute(1)
    assert len(binds) == 3 * CFG.n_layer, "set_backend invalidates the bound calls"
    for a, b in zip(first, [o.get() for o in g.outputs()]):
        assert np.array_equal(a, b)
    g.free()


def test_captured_ubatch_graph_replays_the_same_results():
    """graph.capture: warm-up + capture of a device ubatch graph's compute; replaying the CUDA
    graph gives what a plain compute gives."""
    from ggml_attn.graph.capture import capture
    g, _cache = _attn_graph_with_inputs()
    g.compute(1)
    want = [o.get() for o in g.outputs()]
    for o in g.outputs():
        o.fill(np.nan)
    s = cupy.cuda.Stream(non_blocking=True)
    cg = capture(lambda: g.compute(1), s)
    for o in g.outputs():
        o.fill(np.nan)
    cupy.cuda.runtime.deviceSynchronize()
    cg.launch(s)
    s.synchronize()
    for a, b in zip(want, [o.get() for o in g.outputs()]):
        assert np.array_equal(a, b)
    g.free()


def test_full_block_on_device_matches_host_graph():
    """The full block as a device graph (CuPy: cuBLAS GEMMs for the prompt, dense.cu's GEMV for
    decode steps, one-launch norm and K/V store) against the host graph of ggml's own ops,
    prompt and decode steps, outputs and cache."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from test_graph_layers import CFG as LCFG, N_EMBD, cache as lcache, weights
    w_host = weights()
    w_dev = [{k: cupy.asarray(v) for k, v in d.items()} for d in w_host]
    results = []
    for xp, w in ((None, w_host), ("cupy", w_dev)):
        c = lcache(True, xp=xp)
        outs = []
        # a prompt (cuBLAS GEMMs), then decode steps of 4, 1 and 3 tokens (dense_gemv<4>, <1>, <3>)
        for b in (Batch.from_lengths([3, 5, 8, 2]), 4, 1, 3):
            if isinstance(b, int):
                b = Batch.from_lengths([1] * b, start_pos=c.next_positions(range(b)))
            for ub in split_ubatches(b, 512, "simple"):
                plan = plan_ubatch(c, ub)
                g = build_ubatch_graph(c, plan, LCFG, layer="full", weights=w)
                x = np.random.default_rng(int(ub.positions.sum())).standard_normal((ub.n_tokens, N_EMBD))
                g.set_x(g.xp.asarray(x.astype(np.float32)))
                g.compute(1)
                o = g.outputs()[0]
                outs.append(o.get() if hasattr(o, "get") else o.copy())
                g.free()
                c.free_pads(plan.slot)
        results.append((outs, c))
    (h_out, h_c), (d_out, d_c) = results
    for a, b in zip(h_out, d_out):
        assert np.isfinite(b).all() and nmse(b, a) < 1e-5
    for s in range(4):
        p1, k1, v1 = h_c.sequence_contents(s, 1)
        p2, k2, v2 = d_c.sequence_contents(s, 1)
        assert p1.tolist() == p2.tolist() and nmse(k2, k1) < 1e-5 and nmse(v2, v1) < 1e-5


def test_load_plan_through_the_pinned_ring_matches_the_reference(monkeypatch):
    """load_plan's copies through the pinned ring (graph/staging.py; every copy pinned here),
    five ubatches of one structure queued on the stream without a sync between them, the stream
    held back by a ~100 ms spin kernel before each after the first (the host, a few ms per
    ubatch, is ahead, so a reused buffer must wait for its copy, and at least one wait finds the
    copy not yet run): each ubatch's outputs match the host reference of its own batch."""
    spin = cupy.RawKernel(r"""extern "C" __global__ void spin(long long cycles) {
        const long long t0 = clock64(); while (clock64() - t0 < cycles) {} }""", "spin")
    from ggml_attn.graph import staging
    from ggml_attn.graph.qkv_runner import ubatch_inputs
    monkeypatch.setattr(staging, "PINNED_MIN_BYTES", 0)
    layouts = ([5, 5], [3, 7], [9, 1], [2, 8], [1, 9])
    c = cache(True, "cupy")
    ubs = [split_ubatches(Batch.from_lengths(lens), 512, "simple")[0] for lens in layouts]
    # every ubatch's Q/K/V on the device first: a host-to-device copy in the loop would wait
    # for the spin and let the stream catch up
    dev_ins = [[[cupy.asarray(x[j]) for x in [ubatch_inputs(ub, il, CFG) for il in range(CFG.n_layer)]]
                for j in range(3)] for ub in ubs]
    cupy.cuda.get_current_stream().synchronize()
    g, got = None, []
    for ub, ins in zip(ubs, dev_ins):
        for s in range(10):
            c.seq_rm(s)
        plan = plan_ubatch(c, ub)
        if g is not None:   # (the first ubatch builds the graph: host time no spin would cover)
            spin((1,), (1,), (np.int64(200_000_000),))   # ~100 ms of GPU time before the copies
        if g is None:
            g = build_ubatch_graph(c, plan, CFG)
        else:
            g.load_plan(plan)
            g.refresh_kernel_plan()
        g.set_inputs(*ins)
        g.compute(1)
        got.append((plan.ubatch.token_idx, [o.copy() for o in g.outputs()]))   # copies queued too
    assert g._stager is not None and g._stager.waits == len(layouts) - 1 - 2, "slots reused after 2"
    assert g._stager.blocked >= 1, "no reuse found its copy pending: the test did not test the wait"
    for lens, (idx, outs) in zip(layouts, got):
        ref = run_batch(cache(True, None), Batch.from_lengths(lens), 512, "simple", CFG)
        for il in range(CFG.n_layer):   # (n_tokens, n_head, head_dim_v): ubatch rows -> batch rows
            assert nmse(cupy.asnumpy(outs[il]), ref.out[il][idx]) < 5e-4, (lens, il)
    g.free()
    assert g._stager is None


def test_kept_engine_runs_after_cache_writes_on_the_callers_stream():
    """run_batch's engine computes on a stream of its own, kept from call to call: a cache write
    the caller queued on its stream first (seq_cp across streams copies a whole stream's K/V, a
    long kernel queued before it) must be done before the engine reads the cache (the engine's
    stream waits for the caller's at each call: Engine.follow_current_stream)."""
    host_c, dev_c = cache(False, None, n_seq=4), cache(False, "cupy", n_seq=4)
    b = Batch.from_lengths([200, 3, 3, 3])
    run_batch(host_c, b, 512, "equal", CFG)
    run_batch(dev_c, b, 512, "equal", CFG, compute="ggml")
    for c in (host_c, dev_c):
        c.seq_rm(1)
    host_c.seq_cp(0, 1)
    big = cupy.ones((1 << 26,), dtype=cupy.float32)
    for _ in range(20):   # busy the caller's stream for a while before the copy is queued
        big *= 1.0000001
    dev_c.seq_cp(0, 1)
    dec = Batch.from_lengths([1], seq_ids=[1], start_pos=host_c.next_positions([1]))
    ref = run_batch(host_c, dec, 512, "equal", CFG)
    got = run_batch(dev_c, dec, 512, "equal", CFG, compute="ggml")
    assert nmse(got.out, ref.out) < 5e-4


def test_bucketed_ubatches_on_the_device_match_the_host():
    """The CUDA engines' caches (``coarse_n_kv``) pad each ubatch to a bucket of rows
    (``split.pad_to_bucket``): ragged prompts of 1-10 tokens (55 rows -> 56), then decode steps of
    3, 5 and 7 of the 10 sequences (4, 8, 8 rows: pad rows that are sequences of their own, fully
    masked) give the host's outputs for every real token, the same cached K/V, and no pad cell."""
    from ggml_attn.graph.split import bucket_rows
    host_c = cache(True, None)
    dev_c = KVCache(10 * 512, 10, unified=True, n_layer=2, n_head_kv=2, head_dim_k=64, xp="cupy", coarse_n_kv=True)
    b = Batch.from_lengths(range(1, 11))
    ref = run_batch(host_c, b, 512, "simple", CFG)
    got = run_batch(dev_c, b, 512, "simple", CFG, compute="ggml")
    assert [p.ubatch.n_tokens for p in got.plans] == [bucket_rows(55)] == [56]
    assert nmse(got.out, ref.out) < 5e-4
    for ids in ([0, 4, 9], [1, 2, 3, 5, 8], [0, 1, 2, 3, 4, 5, 6]):
        dec = Batch.from_lengths([1] * len(ids), seq_ids=ids, start_pos=dev_c.next_positions(ids))
        d_ref = run_batch(host_c, dec, 512, "simple", CFG)
        d_got = run_batch(dev_c, dec, 512, "simple", CFG, compute="ggml")
        (p,) = d_got.plans
        assert p.ubatch.decode_step and p.ubatch.n_tokens == bucket_rows(len(ids)) > len(ids)
        assert nmse(d_got.out, d_ref.out) < 5e-4 and np.isfinite(d_got.out).all()
        assert int(dev_c.pad.sum()) == 0
    for s in range(10):
        p1, k1, v1 = host_c.sequence_contents(s, 1)
        p2, k2, v2 = dev_c.sequence_contents(s, 1)
        assert np.array_equal(p1, p2) and np.array_equal(k1, k2) and np.array_equal(v1, v2)


def test_full_block_with_bucket_pads_on_device_matches_host_graph():
    """Bucket pads (``split.pad_to_bucket``) through the full block on the device: a prompt
    ubatch's pads continuing its last sequence and a decode step's pads that are sequences of
    their own, fed large inputs (1e3) and writing K/V into pad cells, leave every real row's
    output and the cache as the host graph's without pads."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from test_graph_layers import CFG as LCFG, N_EMBD, weights
    from ggml_attn.graph.split import pad_to_bucket
    w_host = weights()
    w_dev = [{k: cupy.asarray(v) for k, v in d.items()} for d in w_host]
    results = []
    for xp, w, pad in ((None, w_host, False), ("cupy", w_dev, True)):
        c = KVCache(8 * 512, 8, unified=True, n_layer=2, n_head_kv=2, head_dim_k=32, xp=xp)
        outs, sizes = [], []
        for b in (Batch.from_lengths([3, 5, 8, 2]), 4, 1, 3):   # 18 rows -> 24; 4; 1; 3 -> 4
            if isinstance(b, int):
                b = Batch.from_lengths([1] * b, start_pos=c.next_positions(range(b)))
            for ub in split_ubatches(b, 512, "simple"):
                n = ub.n_tokens
                if pad:
                    ub = pad_to_bucket(ub, c.n_seq_max, lambda s: c.seq_pos_max(s) + 1, 512)
                sizes.append(ub.n_tokens)
                plan = plan_ubatch(c, ub)
                g = build_ubatch_graph(c, plan, LCFG, layer="full", weights=w)
                x = np.random.default_rng(n).standard_normal((n, N_EMBD))
                x = np.concatenate([x, np.full((ub.n_tokens - n, N_EMBD), 1e3)])
                g.set_x(g.xp.asarray(x.astype(np.float32)))
                g.compute(1)
                o = g.outputs()[0]
                outs.append((o.get() if hasattr(o, "get") else o.copy())[:n])
                g.free()
                c.free_pads(plan.slot)
        results.append((outs, c, sizes))
    (h_out, h_c, _), (d_out, d_c, d_sizes) = results
    assert d_sizes == [24, 4, 1, 4]
    for a, b in zip(h_out, d_out):
        assert np.isfinite(b).all() and nmse(b, a) < 1e-5
    assert int(d_c.pad.sum()) == 0
    for s in range(4):
        p1, k1, v1 = h_c.sequence_contents(s, 1)
        p2, k2, v2 = d_c.sequence_contents(s, 1)
        assert p1.tolist() == p2.tolist() and nmse(k2, k1) < 1e-5 and nmse(v2, v1) < 1e-5
