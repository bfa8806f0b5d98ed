"""Layer-parallel ranks (graph/pipe.py, llama.cpp's -sm layer) on the CPU: N simulated ranks in
one process, each with a contiguous range of layers and the KV cache of those layers, handing
the activations on per ubatch (tp.LocalGroup's send/recv), against the 1-rank graph.

Every case runs ragged prompts and then decode steps through the driver: the N-rank outputs
must equal the 1-rank ones (the same per-layer math on the same inputs: bit for bit here;
NMSE <= 5e-4 is the bar on GPUs), and rank r's K/V must be the 1-rank cache's layers of r.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from ggml_attn.graph import AttnConfig, Batch, KVCache, build, driver, pipe, plan_ubatch, split_ubatches, tp
from ggml_attn.graph.shard import ShardError
from test_graph_tp import OneRankAttn, OneRankFull, make_weights, nmse, qkv_inputs, run, stall, x_inputs


def caches(cfg, ranges, unified, n_seq):
    kw = dict(unified=unified, head_dim_k=cfg.head_dim_k, head_dim_v=cfg.head_dim_v, n_head_kv=cfg.n_head_kv,
              dtype=np.float32)
    full = KVCache(256 * n_seq, n_seq, n_layer=cfg.n_layer, **kw)
    ranks = [pipe.layer_cache(rg, 256 * n_seq, n_seq, **kw) for rg in ranges]
    return full, ranks


def check_kv(full, ranks, ranges):
    """Rank r's K/V = the 1-rank cache's layers of rank r, bit for bit."""
    for c, rg in zip(ranks, ranges):
        assert c.n_layer == len(rg)
        np.testing.assert_array_equal(c.k, pipe.kv_layer_slice(full.k, rg))
        np.testing.assert_array_equal(c.v, pipe.kv_layer_slice(full.v, rg))
        assert np.abs(c.k).sum() > 0   # every rank stored something
    np.testing.assert_array_equal(np.concatenate([c.k for c in ranks]), full.k)


CFG = AttnConfig(n_layer=4, n_head=8, n_head_kv=4, head_dim_k=16)


@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize("n_rank,shares", [(1, None), (2, None), (4, None), (2, [3, 1]), (3, [1, 2, 1])])
def test_layer_ranks_attention_equal_one_rank(n_rank, shares, unified):
    n_seq = 3
    ranges = pipe.layer_ranges(CFG.n_layer, n_rank, shares)
    full, ranks = caches(CFG, ranges, unified, n_seq)
    ref = run(full, OneRankAttn(full, CFG), CFG, n_seq, unified)
    eng = pipe.PipelineEngine(ranks, CFG, qkv_inputs(CFG), ranges=ranges)
    got = run(ranks[0], eng, CFG, n_seq, unified)
    assert len(got) == len(ref) == 3
    for gb, rb in zip(got, ref):
        assert len(gb) == CFG.n_layer          # every layer's output, in layer order
        for g, r in zip(gb, rb):
            np.testing.assert_array_equal(g, r)
    check_kv(full, ranks, ranges)
    np.testing.assert_array_equal(ranks[0].pos, full.pos)   # one plan per ubatch for all ranks
    # one handover per ubatch per rank boundary: rank r sends, rank r + 1 receives
    calls = [c.calls for c in eng.group.comms]
    if n_rank > 1:
        assert calls[0] == calls[-1] > 0 and all(c == 2 * calls[0] for c in calls[1:-1])
    else:
        assert calls == [0]


@pytest.mark.parametrize("unified,n_rank,all_custom,shares", [
    (True, 1, True, None), (True, 2, True, None), (True, 4, True, None), (False, 2, True, None),
    (False, 4, True, None), (False, 2, False, None), (True, 2, False, [1, 3]), (False, 3, True, [2, 1, 1])])
def test_layer_ranks_full_block_equal_one_rank(unified, n_rank, all_custom, shares):
    cfg = CFG
    n_seq = 3
    weights = make_weights(cfg)
    ranges = pipe.layer_ranges(cfg.n_layer, n_rank, shares)
    full, ranks = caches(cfg, ranges, unified, n_seq)
    ref = run(full, OneRankFull(full, cfg, weights, all_custom), cfg, n_seq, unified)
    eng = pipe.PipelineEngine(ranks, cfg, x_inputs, layer="full", weights=weights, ranges=ranges,
                              all_custom=all_custom)
    got = run(ranks[0], eng, cfg, n_seq, unified)
    for gb, rb in zip(got, ref):
        assert len(gb) == 1                     # the last rank's x
        assert nmse(gb[0], rb[0]) <= 5e-4
        np.testing.assert_array_equal(gb[0], rb[0])   # the same math, layer by layer: bit for bit
    check_kv(full, ranks, ranges)
    assert [len(w) for w in eng.weights] == [len(rg) for rg in ranges]
    assert eng.weights[-1][-1] is weights[-1]   # the rank's slice of the list, not copies


def test_layer_ranks_differ_without_handover():
    """Rank 1 computing from its own x instead of rank 0's output gives other results (the test
    can fail)."""
    cfg = CFG
    weights = make_weights(cfg)
    ranges = pipe.layer_ranges(cfg.n_layer, 2)
    full, ranks = caches(cfg, ranges, True, 1)
    batch = Batch.from_lengths([6], [0])
    plan = plan_ubatch(ranks[0], split_ubatches(batch, 8, "simple")[0])
    ref = OneRankFull(full, cfg, weights, True).run_ubatch(plan)[0]

    class Loopback:   # rank 1 "receives" the input x, not rank 0's output
        calls = 0

        def recv(self, arr, peer):
            arr[...] = x_inputs(plan)

    eng = pipe.PipeRankEngine(ranks[1], cfg, 1, 2, Loopback(), x_inputs, layers=ranges[1], layer="full",
                              weights=weights, all_custom=True)
    out = eng.run_ubatch(plan)[0]
    assert nmse(out, ref) > 1e-3


def test_builder_layer_range():
    """build_ubatch_graph(layers=...) runs global layers a..b-1 on a cache of b-a layers."""
    cfg = CFG
    cache = KVCache(64, 1, n_layer=2, n_head_kv=cfg.n_head_kv, head_dim_k=cfg.head_dim_k, dtype=np.float32)
    plan = plan_ubatch(cache, split_ubatches(Batch.from_lengths([5], [0]), 8, "simple")[0])
    g = build.build_ubatch_graph(cache, plan, cfg, all_custom=True, layers=range(2, 4))
    assert len(g.outputs()) == 2
    g.free()
    for bad, msg in ((range(3, 6), "inside range"), (range(1, 1), "non-empty"), ([0, 1], "range"),
                     (range(0, 4, 2), "range"), (range(0, 3), "3 layer")):
        with pytest.raises(ValueError, match=msg):
            build.build_ubatch_graph(cache, plan, cfg, all_custom=True, layers=bad)
    with pytest.raises(ValueError, match="weights for each of the 2 layers"):
        build.build_ubatch_graph(cache, plan, cfg, all_custom=True, layer="full", layers=range(0, 2),
                                 weights=make_weights(cfg)[:1])


def test_layer_ranges_like_llama_cpp():
    assert pipe.layer_ranges(32, 2) == [range(0, 16), range(16, 32)]
    assert pipe.layer_ranges(32, 2, [1, 1]) == pipe.layer_ranges(32, 2, [0.5, 0.5])
    assert pipe.layer_ranges(32, 2, [3, 1]) == [range(0, 24), range(24, 32)]
    assert pipe.layer_ranges(80, 3) == [range(0, 27), range(27, 54), range(54, 80)]
    assert pipe.layer_ranges(3, 2) == [range(0, 2), range(2, 3)]
    assert pipe.layer_ranges(5, 5) == [range(i, i + 1) for i in range(5)]
    for n_layer in (1, 7, 32, 80):
        for n in range(1, min(n_layer, 8) + 1):
            rgs = pipe.layer_ranges(n_layer, n)
            assert [il for rg in rgs for il in rg] == list(range(n_layer))
            assert max(map(len, rgs)) - min(map(len, rgs)) <= 1


@pytest.mark.parametrize("n_layer,n_rank,shares,msg", [
    (2, 3, None, "3 ranks but only 2 layer"), (4, 2, [1, 0], r"rank\(s\) \[1\] get no layer"),
    (4, 2, [100, 1], "get no layer"), (4, 2, [1], "1 share"), (4, 2, [1, -1], "non-negative"),
    (4, 2, [0, 0], "not all zero"), (4, 0, None, "at least 1")])
def test_layer_split_errors(n_layer, n_rank, shares, msg):
    with pytest.raises(ShardError, match=msg):
        pipe.layer_ranges(n_layer, n_rank, shares)


def test_rank_failure_raises_without_hanging():
    cfg = CFG
    weights = make_weights(cfg)
    ranges = pipe.layer_ranges(cfg.n_layer, 2)
    full, ranks = caches(cfg, ranges, True, 1)
    eng = pipe.PipelineEngine(ranks, cfg, x_inputs, layer="full", weights=weights, ranges=ranges, timeout=20)
    eng.ranks[0].weights[1] = dict(weights[1], wd=weights[1]["wd"][:, :3].copy())   # a broken layer on rank 0
    with pytest.raises(driver.BatchError) as ei:
        driver.decode(ranks[0], Batch.from_lengths([4], [0]), 8, "simple", eng, cfg)
    assert "rank 0" in str(ei.value.__cause__)     # the cause, not rank 1's aborted receive
    assert (ranks[0].pos >= 0).sum() == 0


def test_stuck_rank_is_named_not_waited_for():
    """Rank 0 stalls: rank 1's receive times out (an echo), and rank 0, still running a group
    timeout later, is named as the stuck one instead of holding the batch for its whole stall."""
    cfg = CFG
    ranges = pipe.layer_ranges(cfg.n_layer, 2)
    full, ranks = caches(cfg, ranges, True, 1)
    eng = pipe.PipelineEngine(ranks, cfg, x_inputs, layer="full", weights=make_weights(cfg), ranges=ranges,
                              timeout=0.5)
    release = threading.Event()
    stall(eng, 0, release)
    try:
        with pytest.raises(driver.BatchError) as ei:
            driver.decode(ranks[0], Batch.from_lengths([4], [0]), 8, "simple", eng, cfg)
        assert isinstance(ei.value.__cause__, tp.CommError)
        assert "rank 0 did not finish" in str(ei.value.__cause__)
    finally:
        release.set()


def test_local_send_recv_order_and_drain():
    group = tp.LocalGroup(2)
    a, b = group.comms
    for i in range(3):
        a.send(np.full(4, i, np.float32), 1)
    got = np.empty(4, np.float32)
    for i in range(3):                 # in the order sent; a copy (the sender may reuse its buffer)
        b.recv(got, 0)
        assert (got == i).all()
    with pytest.raises(tp.CommError, match="shape"):
        a.send(np.zeros(3, np.float32), 1)
        b.recv(got, 0)
    # the drain: the last rank's token reaches rank 0
    engs = [pipe.PipeRankEngine(KVCache(16, 1, n_layer=1, n_head_kv=4, head_dim_k=16), CFG, r, 2, group.comms[r],
                                None, layers=range(2 * r, 2 * r + 2)) for r in range(2)]
    t = threading.Thread(target=engs[0].synchronize)
    t.start()
    engs[1].synchronize()
    t.join(10)
    assert not t.is_alive()
