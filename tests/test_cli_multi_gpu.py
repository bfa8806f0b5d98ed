"""-sm / -ts / -mg / --n-gpu of both tools (tools/multi_gpu.py) and the -sm row and -sm layer
rank engines (tools/tp_engine.py, tools/layer_engine.py) on the CPU: ranks as threads over the
in-process communicator against the one-device engine."""
import threading

import numpy as np
import pytest

from ggml_attn.cli import batched_bench, bench, multi_gpu
from ggml_attn.cli.errors import UserError
from ggml_attn.cli.graph_engine import GraphEngine
from ggml_attn.cli.layer_engine import LayerCudaEngine
from ggml_attn.cli.models import PRESETS
from ggml_attn.cli.runner import RunConfig
from ggml_attn.cli.tp_engine import TPCudaEngine
from ggml_attn.graph import Batch, KVCache, plan_ubatch, split_ubatches, tp

FAST = ["-t", "1", "--n-layer", "1", "-r", "1"]


def _on_rank_threads(n: int, group, body) -> None:
    """``body(r)`` for ranks 0..n-1, each on a thread of its own over ``group`` (a
    ``tp.LocalGroup``); a failing rank aborts the group's collectives; asserts none failed."""
    errors = []

    def go(r):
        try:
            body(r)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            group.abort()
    ts = [threading.Thread(target=go, args=(r,)) for r in range(n)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert not errors, errors


def _err(capsys, tool, *args):
    rc = tool.main(list(args))
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("tool", [bench, batched_bench])
@pytest.mark.parametrize("args,msg", [
    (["-sm", "layer", "--device", "cpu"], "ggml_attn.graph.pipe are for tests"),
    (["-sm", "row", "--device", "cpu"], "--device cpu runs one rank"),
    (["-sm", "layer", "--n-gpu", "64"], "-sm layer on 64 GPUs: only"),
    (["-sm", "layer", "-ts", "1/x"], "expected proportions"),   # '/' between GPUs: both tools
    (["-sm", "none", "--n-gpu", "2"], "needs -sm row"),
    (["-sm", "none", "-ts", "1/1"], "it needs -sm row"),
    (["-sm", "row", "--n-gpu", "64"], "only"),
])
def test_multi_gpu_user_errors(capsys, tool, args, msg):
    rc, err = _err(capsys, tool, *(args + (FAST if tool is bench else ["-t", "1", "--n-layer", "1"])))
    assert rc == 2
    assert msg in err and err.count("\n") == 1


def _ns(**kw):
    ns = bench.build_parser().parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_plan_ranks(monkeypatch):
    monkeypatch.setattr(multi_gpu, "gpu_count", lambda: 4)
    monkeypatch.setattr(tp, "nccl_available", lambda: True)
    assert multi_gpu.plan_ranks(_ns()) == (1, [0])
    assert multi_gpu.plan_ranks(_ns(split_mode="row")) == (4, [0, 1, 2, 3])
    assert multi_gpu.plan_ranks(_ns(split_mode="row", n_gpu=2, main_gpu=2)) == (2, [2, 0])
    assert multi_gpu.plan_ranks(_ns(split_mode="row", tensor_split="1,1")) == (2, [0, 1])
    with pytest.raises(UserError, match="equal shares"):
        multi_gpu.plan_ranks(_ns(split_mode="row", tensor_split="3,1"))
    with pytest.raises(UserError, match="equal shares"):
        multi_gpu.plan_ranks(_ns(split_mode="row", n_gpu=2, tensor_split="1,1,1"))
    with pytest.raises(UserError, match="-mg 4"):
        multi_gpu.plan_ranks(_ns(split_mode="row", n_gpu=2, main_gpu=4))
    monkeypatch.setattr(tp, "nccl_available", lambda: False)
    with pytest.raises(UserError, match="needs NCCL"):
        multi_gpu.plan_ranks(_ns(split_mode="row", n_gpu=2))
    with pytest.raises(UserError, match="-sm layer on several GPUs needs NCCL"):
        multi_gpu.plan_ranks(_ns(split_mode="layer", n_gpu=2))


def test_plan_ranks_layer(monkeypatch):
    monkeypatch.setattr(multi_gpu, "gpu_count", lambda: 4)
    monkeypatch.setattr(tp, "nccl_available", lambda: True)
    assert multi_gpu.plan_ranks(_ns(split_mode="layer")) == (4, [0, 1, 2, 3])
    assert multi_gpu.plan_ranks(_ns(split_mode="layer", n_gpu=2, main_gpu=1)) == (2, [1, 0])
    assert multi_gpu.plan_ranks(_ns(split_mode="layer", tensor_split="3,1")) == (2, [0, 1])   # unequal: fine
    assert multi_gpu.plan_ranks(_ns(split_mode="layer", tensor_split="1,0,1")) == (3, [0, 1, 2])   # the split says
    with pytest.raises(UserError, match="gives 3 share"):
        multi_gpu.plan_ranks(_ns(split_mode="layer", n_gpu=2, tensor_split="1,1,1"))
    with pytest.raises(UserError, match="on 5 GPUs: only 4"):
        multi_gpu.plan_ranks(_ns(split_mode="layer", tensor_split="1,1,1,1,1"))
    with pytest.raises(UserError, match="non-negative"):
        multi_gpu.plan_ranks(_ns(split_mode="layer", tensor_split="1,-1"))


def test_rank_context_layers():
    ctx = multi_gpu.RankContext(1, 2, 1, mode="layer")
    assert ctx.layers(32) == range(16, 32)
    assert multi_gpu.RankContext(0, 2, 0, mode="layer", shares=(3.0, 1.0)).layers(32) == range(0, 24)


@pytest.fixture
def checked_run(monkeypatch):
    """``wrap``'s bench entry on 4 visible GPUs with NCCL, failing the test if a rank process
    would start or a rank would run: what it raises was decided before any of them."""
    monkeypatch.setattr(multi_gpu, "gpu_count", lambda: 4)
    monkeypatch.setattr(tp, "nccl_available", lambda: True)
    monkeypatch.setattr(tp, "nccl_unique_id", lambda: pytest.fail("no process may start"))
    return multi_gpu.wrap(lambda argv: pytest.fail("no rank may run"), "ggml_attn.cli.bench", bench.build_parser)


def test_quantized_cache_refused_before_any_process_starts(checked_run):
    """q8_0/q4_0 caches run on one GPU: -sm row/layer over several is one UserError, before any
    rank process starts (both tools; every -ctk/-ctv pair of a list is checked)."""
    run = checked_run
    for sm in ("row", "layer"):
        with pytest.raises(UserError, match=f"-ctk q8_0 -ctv q8_0: -sm row/layer over 2 GPUs keep an f16 KV cache"):
            run(["-m", "llama-3-8b", "-sm", sm, "--n-gpu", "2", "-ctk", "q8_0", "-ctv", "q8_0"])
    with pytest.raises(UserError, match="-ctk f16 -ctv q4_0: -sm row/layer over 2 GPUs"):   # the first pair of many
        run(["-m", "llama-3-8b", "-sm", "row", "--n-gpu", "2", "-ctk", "f16,q4_0", "-ctv", "f16,q4_0"])
    run_b = multi_gpu.wrap(lambda argv: pytest.fail("no rank may run"), "ggml_attn.cli.batched_bench",
                           batched_bench.build_parser)
    with pytest.raises(UserError, match="-ctk q4_0 -ctv q4_0: -sm row/layer over 2 GPUs"):
        run_b(["-m", "llama-3-8b", "-sm", "layer", "--n-gpu", "2", "-ctk", "q4_0", "-ctv", "q4_0"])


def test_layers_checked_before_any_process_starts(checked_run):
    run = checked_run
    with pytest.raises(UserError, match="-sm layer over 4 GPUs, tiny: layer split: 4 ranks but only 2 layer"):
        run(["-m", "tiny", "-sm", "layer", "--n-gpu", "4"])
    with pytest.raises(UserError, match="3 ranks but only 2 layer"):   # --n-layer counts
        run(["-m", "llama-3-8b", "--n-layer", "2", "-sm", "layer", "--n-gpu", "3"])
    with pytest.raises(UserError, match=r"rank\(s\) \[1\] get no layer"):
        run(["-m", "llama-3-8b", "-sm", "layer", "-ts", "1/0"])   # llama-bench's '/' between GPUs
    run_b = multi_gpu.wrap(lambda argv: pytest.fail("no rank may run"), "ggml_attn.cli.batched_bench",
                           batched_bench.build_parser)
    with pytest.raises(UserError, match="4 ranks but only 2 layer"):
        run_b(["-m", "tiny", "-sm", "layer", "--n-gpu", "4"])


def test_heads_checked_before_any_process_starts(checked_run):
    run = checked_run
    with pytest.raises(UserError, match="n_head_kv 2 is not divisible by 4"):
        run(["-m", "tiny", "-sm", "row", "--n-gpu", "4"])
    with pytest.raises(UserError, match="tiny: head-parallel split: n_head_kv 2"):   # any model of the list
        run(["-m", "llama-3-70b,tiny", "--layer", "full", "-sm", "row", "--n-gpu", "4"])


def test_check_model_layers():
    multi_gpu.check_model(PRESETS["tiny"], 2, "full", "layer")
    multi_gpu.check_model(PRESETS["tiny"], 1, "full", "layer", (1.0, 0.0))   # one rank: nothing to split
    with pytest.raises(UserError, match="-sm layer over 2 GPUs, tiny: .*get no layer"):
        multi_gpu.check_model(PRESETS["tiny"], 2, "attn", "layer", (5.0, 1.0))


def test_check_model_heads():
    multi_gpu.check_model(PRESETS["llama-3-70b"], 8, "full")
    with pytest.raises(UserError, match="n_head_kv 2 is not divisible by 4"):
        multi_gpu.check_model(PRESETS["tiny"], 4, "attn")
    with pytest.raises(UserError, match="n_head_kv 8 is not divisible by 3"):
        multi_gpu.check_model(PRESETS["llama-3-70b"], 3, "attn")


class _HostTP(TPCudaEngine):
    """The -sm row rank engine on the CPU: all-custom numpy graphs, the in-process communicator."""
    flavour = "host"
    all_custom = True


class _Host(GraphEngine):
    all_custom = True


@pytest.mark.parametrize("layer", ["attn", "full"])
def test_rank_engines_equal_one_device(layer):
    m = PRESETS["tiny"]
    n = 2
    group = tp.LocalGroup(n)

    def cfg(ctx=None):
        return RunConfig(m, n_ctx=256, device="cpu", layer=layer, n_ubatch=64, n_batch=64, tp=ctx)

    def cache(heads):
        return KVCache(256, 1, n_layer=m.n_layer, n_head_kv=heads, head_dim_k=m.head_dim_k, dtype=np.float16)

    ref_cache = cache(m.n_head_kv)
    ref = _Host(cfg(), ref_cache)
    engines, caches = [], []
    for r in range(n):
        ctx = multi_gpu.RankContext(r, n, device=0)
        ctx._comm = group.comms[r]
        caches.append(cache(m.n_head_kv // n))
        engines.append(_HostTP(cfg(ctx), caches[-1]))
    assert engines[0].m.n_head == m.n_head // n and engines[0].m.n_ff == m.n_ff // n
    for lens in ([37], [1], [1]):
        batch = Batch.from_lengths(lens, [0], start_pos=ref_cache.next_positions([0]))
        ub = split_ubatches(batch, 64, "simple")[0]
        ref_plan = plan_ubatch(ref_cache, ub)
        plan = plan_ubatch(caches[0], ub)
        ref.run_ubatch(ref_plan)
        _on_rank_threads(n, group, lambda r: engines[r].run_ubatch(plan))
        want = np.asarray(ref._keep[1], np.float64)
        if layer == "full":
            outs = [np.asarray(e._keep[1]) for e in engines]
            np.testing.assert_array_equal(outs[0], outs[1])
            got = outs[0]
        else:   # (ns, n_tps, n_head, head_dim_v): the ranks' heads side by side
            got = np.concatenate([np.asarray(e._keep[1]) for e in engines], axis=2)
        assert got.shape == want.shape
        err = ((got - want) ** 2).sum() / (want ** 2).sum()
        assert err <= 5e-4, err
    for r in range(n):   # each rank's K/V: its heads of the one-device cache (f16, first layer exact)
        d = m.head_dim_k * m.n_head_kv // n
        np.testing.assert_array_equal(caches[r].k[0][..., :], ref_cache.k[0][..., r * d:(r + 1) * d])
    assert [c.calls for c in group.comms] == ([2 * m.n_layer * 3] * n if layer == "full" else [0] * n)


class _HostLayer(LayerCudaEngine):
    """The -sm layer rank engine on the CPU: all-custom numpy graphs, the in-process communicator."""
    flavour = "host"
    all_custom = True


@pytest.mark.parametrize("layer", ["attn", "full"])
@pytest.mark.parametrize("n,shares", [(2, ()), (3, (1.0, 2.0, 1.0))])
def test_layer_rank_engines_equal_one_device(layer, n, shares):
    from dataclasses import replace
    m = replace(PRESETS["tiny"], n_layer=5)
    group = tp.LocalGroup(n)

    def cfg(ctx=None):
        return RunConfig(m, n_ctx=256, device="cpu", layer=layer, n_ubatch=64, n_batch=64, tp=ctx)

    def cache(n_layer):
        return KVCache(256, 1, n_layer=n_layer, n_head_kv=m.n_head_kv, head_dim_k=m.head_dim_k, dtype=np.float16)

    ref_cache = cache(m.n_layer)
    ref = _Host(cfg(), ref_cache)
    engines, caches = [], []
    for r in range(n):
        ctx = multi_gpu.RankContext(r, n, device=0, mode="layer", shares=shares)
        ctx._comm = group.comms[r]
        caches.append(cache(len(ctx.layers(m.n_layer))))
        engines.append(_HostLayer(cfg(ctx), caches[-1]))
    ranges = [e.layers for e in engines]
    assert [il for rg in ranges for il in rg] == list(range(m.n_layer))
    if layer == "full":   # each rank keeps its layers' weights: the one-device engine's
        for e in engines:
            assert len(e.weights) == len(e.layers)
            np.testing.assert_array_equal(e.weights[0]["wq"], ref.weights[e.layers.start]["wq"])
    n_ub = 0
    for lens in ([37], [1], [1]):
        batch = Batch.from_lengths(lens, [0], start_pos=ref_cache.next_positions([0]))
        ub = split_ubatches(batch, 64, "simple")[0]
        ref_plan = plan_ubatch(ref_cache, ub)
        plans = [plan_ubatch(c, ub) for c in caches]   # every rank plans on its own cells, the same way
        ref.run_ubatch(ref_plan)
        ref.synchronize()
        n_ub += 1
        def go(r):
            engines[r].run_ubatch(plans[r])
            engines[r].synchronize()   # the pipeline drain: the last rank's token to rank 0
        _on_rank_threads(n, group, go)
        # the last rank's last output: the model's output (full) / the last layer's attention
        np.testing.assert_array_equal(np.asarray(engines[-1]._keep[1]), np.asarray(ref._keep[1]))
    for c, rg in zip(caches, ranges):   # each rank's K/V: its layers of the one-device cache
        np.testing.assert_array_equal(c.k, ref_cache.k[rg.start:rg.stop])
        np.testing.assert_array_equal(c.v, ref_cache.v[rg.start:rg.stop])
    # per ubatch: a send from every rank but the last, a receive on every rank but the first;
    # per synchronize: the drain token from the last rank to rank 0
    want = [(r < n - 1) * n_ub + (r > 0) * n_ub + (r in (0, n - 1)) * n_ub for r in range(n)]
    assert [c.calls for c in group.comms] == want


@pytest.mark.parametrize("n", [2, 3])
def test_gpu_multi_check_logic_on_cpu(monkeypatch, n):
    """tools/dev/gpu_multi_check.py's per-rank cases, joining of outputs and comparison, with numpy
    ranks on threads over the in-process communicator instead of processes over NCCL: both
    modes must match one rank; its table shows both."""
    import gpu_multi_check as gmc  # tools/dev/ (on sys.path via conftest)
    from ggml_attn.graph import AttnConfig
    monkeypatch.setattr(gmc, "LENS", [5, 3, 9])
    monkeypatch.setattr(gmc, "N_STEPS", 2)
    monkeypatch.setattr(gmc, "N_EMBD", 32)
    monkeypatch.setattr(gmc, "N_FF", 48)
    monkeypatch.setattr(gmc, "_cfg", lambda n_gpu: AttnConfig(n_layer=max(4, n_gpu), n_head=6, n_head_kv=3,
                                                               head_dim_k=16) if n_gpu == 3 else
                        AttnConfig(n_layer=4, n_head=8, n_head_kv=4, head_dim_k=16))
    cfg = gmc._cfg(n)
    weights = gmc._weights(cfg, np)
    group = tp.LocalGroup(n, timeout=60)
    got = {}

    def go(r):
        got[r] = gmc.rank_cases(r, n, group.comms[r], cfg, weights, xp=np, sync=lambda: None)
    _on_rank_threads(n, group, go)
    refs = {}
    for layer, unified in sorted({(c[1], c[2]) for c in gmc.CASES}):
        cache = gmc._caches(cfg, 1, unified, xp=np)
        eng = tp.RankEngine(cache, cfg, 0, 1, gmc._NoComm(), gmc._inputs(cfg, layer), layer=layer, weights=weights)
        ref, t1 = gmc._run_case(cache, eng, cfg, unified, sync=lambda: None)
        refs[(layer, unified)] = (ref, t1, cache.k.copy(), cache.v.copy())
    report = gmc.compare(cfg, n, got, refs)
    assert len(report["cases"]) == 8
    for c in report["cases"]:
        assert c["out_nmse"] <= 1e-5 and c["kv_nmse"] <= 1e-5, c
        if c["mode"] == "layer" or c["layer"] == "attn":
            assert c["out_nmse"] == 0.0 and c["kv_nmse"] == 0.0, c   # the same math, no sums across ranks
        assert c["comm_calls"] > 0 or (c["mode"], c["layer"]) == ("row", "attn")
    text = gmc.table(report)
    assert text.count("\nrow ") == 4 and text.count("\nlayer ") == 4


def test_rank_timer_queues_the_drain_before_its_end_event():
    """-sm layer: decode steps do not synchronize, so the timer itself must queue the pipeline
    drain before recording its end (else rank 0's timer stops before the later ranks' layers
    ran); not when the timed region raised (the ranks stop instead)."""
    from ggml_attn.cli.tp_engine import _RankTimer

    class Timer:
        ns = 7

        def __enter__(self):
            order.append("start")

        def __exit__(self, *exc):
            order.append("end")
            return False

    class Comm:
        seconds = 0.0

    class Ctx:
        timed_ns = 0
        nccl_s = 0.0
    order = []
    with _RankTimer(Timer(), Comm(), Ctx(), before_end=lambda: order.append("drain")):
        order.append("work")
    assert order == ["start", "work", "drain", "end"]
    order.clear()
    with pytest.raises(RuntimeError):
        with _RankTimer(Timer(), Comm(), Ctx(), before_end=lambda: order.append("drain")):
            raise RuntimeError("boom")
    assert order == ["start", "end"]
