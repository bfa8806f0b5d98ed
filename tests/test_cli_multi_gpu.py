"""-sm / -ts / -mg / --n-gpu of both tools (tools/multi_gpu.py) and the -sm row rank engine
(tools/tp_engine.py) on the CPU: two ranks as threads over the in-process communicator against
the one-device engine."""
import threading

import numpy as np
import pytest

from ggml_attn.cli import batched_bench, bench, multi_gpu
from ggml_attn.cli.errors import UserError
from ggml_attn.cli.graph_engine import GraphEngine
from ggml_attn.cli.models import PRESETS
from ggml_attn.cli.runner import RunConfig
from ggml_attn.cli.tp_engine import TPCudaEngine
from ggml_attn.graph import Batch, KVCache, plan_ubatch, split_ubatches, tp

FAST = ["-t", "1", "--n-layer", "1", "-r", "1"]


def _err(capsys, tool, *args):
    rc = tool.main(list(args))
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("tool", [bench, batched_bench])
@pytest.mark.parametrize("args,msg", [
    (["-sm", "layer"], "-sm layer (contiguous layer ranges per GPU) is not implemented"),
    (["-sm", "row", "--device", "cpu"], "--device cpu runs one rank"),
    (["-sm", "none", "--n-gpu", "2"], "needs -sm row"),
    (["-sm", "none", "-ts", "1,1"], "it needs -sm row"),
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


def test_heads_checked_before_any_process_starts(monkeypatch):
    monkeypatch.setattr(multi_gpu, "gpu_count", lambda: 4)
    monkeypatch.setattr(tp, "nccl_available", lambda: True)
    monkeypatch.setattr(tp, "nccl_unique_id", lambda: pytest.fail("no process may start"))
    run = multi_gpu.wrap(lambda argv: pytest.fail("no rank may run"), "ggml_attn.cli.bench", bench.build_parser)
    with pytest.raises(UserError, match="n_head_kv 2 is not divisible by 4"):
        run(["-m", "tiny", "-sm", "row", "--n-gpu", "4"])
    with pytest.raises(UserError, match="tiny: head-parallel split: n_head_kv 2"):   # any model of the list
        run(["-m", "llama-3-70b,tiny", "--layer", "full", "-sm", "row", "--n-gpu", "4"])


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
        return KVCache(256, 1, n_layer=m.n_layer, n_head_kv=heads, head_dim_k=m.head_dim, dtype=np.float16)

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
        errors = []

        def go(r):
            try:
                engines[r].run_ubatch(plan)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                group.abort()
        ts = [threading.Thread(target=go, args=(r,)) for r in range(n)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        assert not errors, errors
        want = np.asarray(ref._keep[1], np.float64)
        if layer == "full":
            outs = [np.asarray(e._keep[1]) for e in engines]
            np.testing.assert_array_equal(outs[0], outs[1])
            got = outs[0]
        else:   # (ns, n_tps, n_head, D_v): the ranks' heads side by side
            got = np.concatenate([np.asarray(e._keep[1]) for e in engines], axis=2)
        assert got.shape == want.shape
        err = ((got - want) ** 2).sum() / (want ** 2).sum()
        assert err <= 5e-4, err
    for r in range(n):   # each rank's K/V: its heads of the one-device cache (f16, first layer exact)
        d = m.head_dim * m.n_head_kv // n
        np.testing.assert_array_equal(caches[r].k[0][..., :], ref_cache.k[0][..., r * d:(r + 1) * d])
    assert [c.calls for c in group.comms] == ([2 * m.n_layer * 3] * n if layer == "full" else [0] * n)
