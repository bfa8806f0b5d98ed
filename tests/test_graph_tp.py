"""Head-parallel ranks (graph/shard.py, graph/tp.py) on the CPU: N simulated ranks in one
process, computed in lockstep, against the 1-rank graph of the same batches.

Every case runs ragged prompts and then decode steps through the driver: the N-rank outputs
must equal the 1-rank ones (NMSE <= 5e-4; f32 math gives ~1e-7..1e-6), and each rank's K/V
must be the matching head slice of the 1-rank cache.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from ggml_attn.graph import AttnConfig, Batch, KVCache, build, driver, plan_ubatch, shard, split_ubatches, tp
from ggml_attn.graph.qkv import token_vectors
from ggml_attn.graph.qkv_runner import ubatch_inputs

N_EMBD, N_FF = 48, 64


def nmse(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(((a - b) ** 2).sum() / max((b ** 2).sum(), 1e-30))


def make_weights(cfg: AttnConfig, seed: int = 1, shared: bool = False):
    rng = np.random.default_rng(seed)

    def w(n_in, n_out):
        return (rng.standard_normal((n_out, n_in), dtype=np.float32) / np.sqrt(n_in)).astype(np.float16)

    def one():
        return dict(wq=w(N_EMBD, cfg.n_head * cfg.head_dim_k), wk=w(N_EMBD, cfg.n_head_kv * cfg.head_dim_k),
                    wv=w(N_EMBD, cfg.n_head_kv * cfg.head_dim_v), wo=w(cfg.n_head * cfg.head_dim_v, N_EMBD),
                    wg=w(N_EMBD, N_FF), wu=w(N_EMBD, N_FF), wd=w(N_FF, N_EMBD))
    if shared:
        s = one()
        return [s] * cfg.n_layer
    return [one() for _ in range(cfg.n_layer)]


def x_inputs(plan):
    ub = plan.ubatch
    return token_vectors(ub.primary_seq_ids, ub.positions, 0, 9, 1, N_EMBD)[:, 0]


def qkv_inputs(cfg):
    def inputs(plan):
        return [ubatch_inputs(plan.ubatch, il, cfg) for il in range(cfg.n_layer)]
    return inputs


class OneRankFull:
    """The reference: the plain full block (layers.full_layer) of build_ubatch_graph."""

    def __init__(self, cache, cfg, weights, all_custom):
        self.cache, self.cfg, self.weights, self.all_custom = cache, cfg, weights, all_custom

    def run_ubatch(self, plan):
        g = build.build_ubatch_graph(self.cache, plan, self.cfg, layer="full", weights=self.weights,
                                     all_custom=self.all_custom)
        try:
            g.set_x(x_inputs(plan))
            g.compute(1)
            return [np.array(g.outputs()[-1], copy=True)]
        finally:
            g.free()


class OneRankAttn:
    def __init__(self, cache, cfg):
        self.cache, self.cfg = cache, cfg

    def run_ubatch(self, plan):
        g = build.build_ubatch_graph(self.cache, plan, self.cfg, all_custom=True)
        try:
            ins = [ubatch_inputs(plan.ubatch, il, self.cfg) for il in range(self.cfg.n_layer)]
            g.set_inputs(*[[x[j] for x in ins] for j in range(3)])
            g.compute(1)
            return [np.array(o, copy=True) for o in g.outputs()]
        finally:
            g.free()


def batches(cache_for_positions, n_seq: int):
    """Ragged prompts, then two decode steps of every sequence (positions from the cache)."""
    lens = [5, 17, 3, 9][:n_seq]
    yield Batch.from_lengths(lens, list(range(n_seq)), start_pos=cache_for_positions().next_positions(range(n_seq)))
    for _ in range(2):
        yield Batch.from_lengths([1] * n_seq, list(range(n_seq)),
                                 start_pos=cache_for_positions().next_positions(range(n_seq)))


def run(cache, engine, cfg, n_seq, unified, n_ubatch=8):
    """Every batch through driver.decode; per batch, per result slot, the real rows in batch order."""
    mode = "simple" if unified else "equal"
    outs = []
    for batch in batches(lambda: cache, n_seq):
        per: dict = {}

        def done(plan, res):
            idx = plan.ubatch.token_idx
            real = ~plan.ubatch.is_pad
            for j, r in enumerate(res):
                per.setdefault(j, np.zeros((batch.n_tokens,) + r.shape[1:], np.float32))[idx[real]] = r[real]
        driver.decode(cache, batch, n_ubatch, mode, engine, cfg, on_done=done)
        outs.append([per[j] for j in sorted(per)])
    return outs


def caches(cfg, n_rank, unified, n_seq):
    kw = dict(unified=unified, n_layer=cfg.n_layer, head_dim_k=cfg.head_dim_k, head_dim_v=cfg.head_dim_v, dtype=np.float32)
    full = KVCache(256 * n_seq, n_seq, n_head_kv=cfg.n_head_kv, **kw)
    ranks = [shard.rank_cache(n_rank, 256 * n_seq, n_seq, n_head_kv=cfg.n_head_kv, **kw) for _ in range(n_rank)]
    return full, ranks


def check_kv(full, ranks, cfg, exact_layers=None):
    """Rank r's K/V = head slice r of the 1-rank cache: bit for bit in ``exact_layers`` (all by
    default), NMSE <= 5e-4 elsewhere (the full block's later layers see the all-reduced residual,
    summed in another order than one rank's matmul)."""
    n = len(ranks)
    exact = range(cfg.n_layer) if exact_layers is None else exact_layers
    for r, c in enumerate(ranks):
        s = shard.HeadShard(r, n)
        for mine, ref in ((c.k, shard.kv_head_slice(full.k, s, cfg.n_head_kv, cfg.head_dim_k)),
                          (c.v, shard.kv_head_slice(full.v, s, cfg.n_head_kv, cfg.head_dim_v))):
            assert mine.shape == ref.shape
            for il in range(cfg.n_layer):
                if il in exact:
                    np.testing.assert_array_equal(mine[il], ref[il])
                else:
                    assert nmse(mine[il], ref[il]) <= 5e-4
    assert np.abs(ranks[0].k).sum() > 0   # something was stored


CFG = AttnConfig(n_layer=2, n_head=8, n_head_kv=4, head_dim_k=16)


@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize("n_rank", [1, 2, 4])
def test_attention_ranks_equal_one_rank(n_rank, unified):
    n_seq = 3
    full, ranks = caches(CFG, n_rank, unified, n_seq)
    ref = run(full, OneRankAttn(full, CFG), CFG, n_seq, unified)
    eng = tp.LockstepEngine(ranks, CFG, qkv_inputs(CFG))
    got = run(ranks[0], eng, CFG, n_seq, unified)
    assert len(got) == len(ref) == 3
    for gb, rb in zip(got, ref):
        assert len(gb) == CFG.n_layer
        for g, r in zip(gb, rb):
            assert g.shape == r.shape == (r.shape[0], CFG.n_head, CFG.head_dim_v)
            assert nmse(g, r) <= 5e-4
            np.testing.assert_allclose(g, r, atol=1e-5)   # no communication: the same per-head math
    check_kv(full, ranks, CFG)
    # the planning cache's cells match the reference's: one plan per ubatch for all ranks
    np.testing.assert_array_equal(ranks[0].pos, full.pos)


@pytest.mark.parametrize("unified,n_rank,all_custom,n_head_kv", [
    (True, 1, True, 4), (True, 2, True, 4), (True, 4, True, 4), (False, 2, True, 4), (False, 4, True, 8),
    (True, 8, True, 8), (False, 2, False, 4)])
def test_full_block_ranks_equal_one_rank(unified, n_rank, all_custom, n_head_kv):
    cfg = AttnConfig(n_layer=2, n_head=2 * n_head_kv, n_head_kv=n_head_kv, head_dim_k=16)
    n_seq = 3
    weights = make_weights(cfg)
    full, ranks = caches(cfg, n_rank, unified, n_seq)
    ref = run(full, OneRankFull(full, cfg, weights, all_custom), cfg, n_seq, unified)
    eng = tp.LockstepEngine(ranks, cfg, x_inputs, layer="full", weights=weights, all_custom=all_custom)
    got = run(ranks[0], eng, cfg, n_seq, unified)
    for gb, rb in zip(got, ref):
        assert len(gb) == n_rank
        for g in gb:   # the all-reduce leaves the same residual stream on every rank
            np.testing.assert_array_equal(g, gb[0])
        err = nmse(gb[0], rb[0])
        assert err <= 5e-4, err
        if n_rank == 1:
            np.testing.assert_array_equal(gb[0], rb[0])   # one rank: the plain block, bit for bit
    assert all(c.calls > 0 for c in eng.group.comms)
    check_kv(full, ranks, cfg, exact_layers=None if n_rank == 1 else [0])


def test_full_block_shared_weights_and_count_of_allreduces():
    cfg = CFG
    weights = make_weights(cfg, shared=True)
    full, ranks = caches(cfg, 2, True, 2)
    eng = tp.LockstepEngine(ranks, cfg, x_inputs, layer="full", weights=weights)
    assert eng.weights[0][0] is eng.weights[0][1]   # one shared set stays one slice
    plans = []
    for batch in batches(lambda: ranks[0], 2):
        plans += driver.decode(ranks[0], batch, 64, "simple", eng, cfg)
    # two all-reduces per layer and ubatch, on every rank
    assert [c.calls for c in eng.group.comms] == [2 * cfg.n_layer * len(plans)] * 2


def test_ranks_differ_from_unreduced():
    """Without the all-reduce the ranks' residual streams differ (the test can fail)."""
    cfg = CFG
    weights = make_weights(cfg)
    full, ranks = caches(cfg, 2, True, 1)

    class NoReduce:
        def __init__(self):
            self.calls = 0

        def allreduce(self, arr):
            self.calls += 1
            return arr

    batch = Batch.from_lengths([6], [0])
    plan = plan_ubatch(ranks[0], split_ubatches(batch, 8, "simple")[0])
    outs = []
    for r in range(2):
        w = shard.shard_layer_weights(weights, shard.HeadShard(r, 2), cfg)
        g = tp.build_rank_graph(ranks[r], plan, shard.rank_config(cfg, 2), NoReduce(), layer="full", weights=w,
                                all_custom=True)
        g.set_x(x_inputs(plan))
        g.compute(1)
        outs.append(np.array(g.outputs()[-1]))
        g.free()
    assert nmse(outs[0], outs[1]) > 1e-3


def test_local_allreduce_semantics():
    group = tp.LocalGroup(3)
    arrs = [np.full((2, 5), r + 1, np.float32) for r in range(3)]
    arrs[1][0, 0] = 10.0

    def go(r):
        group.comms[r].allreduce(arrs[r])
    ts = [threading.Thread(target=go, args=(r,)) for r in range(3)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    want = np.full((2, 5), 6, np.float32)
    want[0, 0] = 1 + 10 + 3
    for a in arrs:   # in place, the sum, on every rank
        np.testing.assert_array_equal(a, want)
    assert [c.calls for c in group.comms] == [1, 1, 1]


def test_rank_failure_raises_without_hanging():
    cfg = CFG
    weights = make_weights(cfg)
    full, ranks = caches(cfg, 2, True, 1)

    eng = tp.LockstepEngine(ranks, cfg, x_inputs, layer="full", weights=weights, timeout=20)
    eng.weights[1][1] = dict(eng.weights[1][1], wd=eng.weights[1][1]["wd"][:, :3].copy())   # a broken slice
    with pytest.raises(driver.BatchError) as ei:
        driver.decode(ranks[0], Batch.from_lengths([4], [0]), 8, "simple", eng, cfg)
    assert "rank 1" in str(ei.value.__cause__)
    assert (ranks[0].pos >= 0).sum() == 0   # the failed ubatch was rolled back


def stall(engine, rank: int, release: threading.Event):
    """Rank ``rank`` of ``engine`` stalls in its next ubatch until ``release`` is set (at most
    30 s), then computes it as usual."""
    real = engine.ranks[rank].run_ubatch

    def stalled(plan, ins=None):
        release.wait(30)
        return real(plan, ins)
    engine.ranks[rank].run_ubatch = stalled
    return real


@pytest.mark.parametrize("layer", ["attn", "full"])
def test_stuck_rank_is_named_after_the_group_timeout_and_the_engine_recovers(layer):
    """A rank that stalls (not failing) held the batch for its whole stall: the threads were
    joined without the group timeout. Now the batch fails naming the rank once it is that far
    behind the others; the engine refuses new work while the rank is stuck and runs again after."""
    cfg = CFG
    full, ranks = caches(cfg, 2, True, 1)
    kw = dict(layer="full", weights=make_weights(cfg)) if layer == "full" else {}
    eng = tp.LockstepEngine(ranks, cfg, x_inputs if layer == "full" else qkv_inputs(cfg), timeout=0.5, **kw)
    release = threading.Event()
    real = stall(eng, 1, release)
    try:
        with pytest.raises(driver.BatchError) as ei:
            driver.decode(ranks[0], Batch.from_lengths([4], [0]), 8, "simple", eng, cfg)
        cause = ei.value.__cause__
        assert isinstance(cause, tp.CommError) and "rank 1 did not finish" in str(cause) and "stuck" in str(cause)
        assert "rank 0" not in str(cause)
        assert (ranks[0].pos >= 0).sum() == 0   # rolled back
        with pytest.raises(driver.BatchError) as ei:   # rank 1 still stalls: no new ubatch
            driver.decode(ranks[0], Batch.from_lengths([4], [0]), 8, "simple", eng, cfg)
        assert "rank 1 is still stuck" in str(ei.value.__cause__)
    finally:
        release.set()
    eng.ranks[1].run_ubatch = real
    for t in threading.enumerate():
        if t.name.endswith("rank1"):
            t.join(30)
    plans = driver.decode(ranks[0], Batch.from_lengths([4], [0]), 8, "simple", eng, cfg)
    assert len(plans) == 1 and (ranks[0].pos >= 0).sum() == 4


@pytest.mark.parametrize("n_head,n_head_kv,n_rank,msg", [
    (8, 4, 3, "not divisible by 3"), (8, 2, 4, "not divisible by 4")])
def test_shard_errors(n_head, n_head_kv, n_rank, msg):
    with pytest.raises(shard.ShardError, match=msg):
        shard.rank_config(AttnConfig(n_head=n_head, n_head_kv=n_head_kv), n_rank)
    with pytest.raises(shard.ShardError, match="ALiBi"):
        shard.rank_config(AttnConfig(n_head=8, n_head_kv=4, max_bias=8.0), 2)
    with pytest.raises(shard.ShardError, match="n_ff"):
        shard.check_shardable(8, 4, 2, n_ff=33)


def test_shard_ranges_and_weight_orders():
    cfg = AttnConfig(n_head=8, n_head_kv=2, head_dim_k=4)
    s = shard.HeadShard(1, 2)
    assert list(s.kv_heads(2)) == [1] and list(s.q_heads(8)) == [4, 5, 6, 7]   # GQA groups together
    w = {k: np.arange(np.prod(sh), dtype=np.float32).reshape(sh) for k, sh in
         dict(wq=(32, 6), wk=(8, 6), wv=(8, 6), wo=(6, 32), wg=(10, 6), wu=(10, 6), wd=(6, 10)).items()}
    p = shard.shard_weights(w, s, cfg)
    np.testing.assert_array_equal(p["wq"], w["wq"][16:32])     # column-parallel: numpy rows (ggml ne1)
    np.testing.assert_array_equal(p["wk"], w["wk"][4:8])
    np.testing.assert_array_equal(p["wo"], w["wo"][:, 16:32])  # row-parallel: numpy columns (ggml ne0)
    np.testing.assert_array_equal(p["wg"], w["wg"][5:10])
    np.testing.assert_array_equal(p["wd"], w["wd"][:, 5:10])
    assert all(a.flags.c_contiguous for a in p.values())
    rc = shard.rank_config(cfg, 2)
    assert (rc.n_head, rc.n_head_kv, rc.scale) == (4, 1, cfg.scale)
    with pytest.raises(shard.ShardError):
        shard.HeadShard(2, 2)


def test_nccl_comm_counts_calls_made_during_a_capture(monkeypatch):
    """NcclComm takes no timing events while its stream is captured (a CUDA graph's replays run
    the calls later), and counts those calls apart, so the tools can say the NCCL time printed
    leaves them out. No GPU: the stream and the capture state are faked."""
    import types
    cupy = pytest.importorskip("cupy")
    from ggml_attn.graph import tp
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: types.SimpleNamespace(ptr=1))
    c = object.__new__(tp.NcclComm)
    c.nccl = types.SimpleNamespace(NCCL_FLOAT32=7, NCCL_FLOAT16=6)
    c.timing, c.calls, c.captured, c._events = True, 0, 0, []
    arr = types.SimpleNamespace(flags=types.SimpleNamespace(c_contiguous=True), dtype=np.float32)
    seen = []
    monkeypatch.setattr(tp, "_capturing", lambda s: True)
    c._call("all-reduce", arr, lambda dt, s: seen.append((dt, s)))
    c._call("all-reduce", arr, lambda dt, s: seen.append((dt, s)))
    assert seen == [(7, 1), (7, 1)] and c.calls == 2 and c.captured == 2 and c._events == []
