"""The path the CLI runs is the builder's: the CPU engine (``HostEngine``, a host graph) against
the same engine building all-custom graphs (the GPU engine's graph, over numpy arrays) and
against the numpy reference on the cache it filled, for every split, attention-only and full."""
import numpy as np
import pytest

from ggml_attn import reference
from ggml_attn.cli.host_engine import HostEngine
from ggml_attn.cli.models import ModelShape
from ggml_attn.cli.runner import RunConfig, Runner

MODEL = ModelShape("small", n_layer=2, n_head=4, n_head_kv=2, head_dim_k=32, n_embd=64, n_ff=96)
LENGTHS = [3, 5, 8, 2]


class AllCustomHostEngine(HostEngine):
    """The CPU engine building all-custom graphs: custom store op, ``graph/xp_ops.py`` dense ops."""
    all_custom = True


def decode(split, layer, engine_cls=HostEngine, unified=False, check_reference=False):
    """Prompts then two decode steps; per ubatch the last output (real rows), and the cache."""
    r = Runner(RunConfig(MODEL, n_ctx=len(LENGTHS) * 256, n_seq=len(LENGTHS), kv_unified=unified, split=split,
                         layer=layer, n_ubatch=8, device="cpu", n_threads=2))
    if engine_cls is not HostEngine:
        r.engine.close()
        r.engine = engine_cls(r.cfg, r.cache)
    eng, outs, real_run = r.engine, [], r.engine.run_ubatch

    def run_ubatch(plan):
        real_run(plan)
        mask, out, _ = eng._keep
        real = ~plan.ubatch.is_pad
        out = np.array(out).reshape(plan.ubatch.n_tokens, -1)
        outs.append(out[real])
        if check_reference:  # attention of the last layer on the cache as the graph left it
            m, ns, n_tps, n_kv = MODEL, plan.n_stream, plan.n_tps, plan.n_kv
            q = eng.inputs(plan)[0].reshape(ns, n_tps, m.n_head, m.head_dim_k).transpose(0, 2, 1, 3)
            s0 = plan.slot.s0
            k = r.cache.k[m.n_layer - 1, s0:s0 + ns, :n_kv].reshape(ns, n_kv, m.n_head_kv, m.head_dim_k)
            v = r.cache.v[m.n_layer - 1, s0:s0 + ns, :n_kv].reshape(ns, n_kv, m.n_head_kv, m.head_dim_v)
            want = reference.flash_attn_ext(q, k.transpose(0, 2, 1, 3).astype(np.float32),
                                            v.transpose(0, 2, 1, 3).astype(np.float32), plan.mask,
                                            1.0 / np.sqrt(m.head_dim_k))
            want = want.reshape(plan.ubatch.n_tokens, -1)[real]
            assert reference.nmse(outs[-1], want) < 1e-10
    eng.run_ubatch = run_ubatch
    try:
        r.decode(r.prompt_batch(LENGTHS))
        for _ in range(2):
            r.decode(r.step_batch(list(range(len(LENGTHS)))))
        contents = {(s, il): r.cache.sequence_contents(s, il) for s in range(len(LENGTHS))
                    for il in range(MODEL.n_layer)}
        return outs, contents
    finally:
        r.close()


SPLITS = [("simple", True), ("equal", False), ("padded", False), ("seq", True), ("auto", False)]


@pytest.mark.parametrize("split, unified", SPLITS)
def test_cli_cpu_engine_attention_matches_reference_and_all_custom_graph(split, unified):
    host, host_kv = decode(split, "attn", unified=unified, check_reference=True)
    cust, cust_kv = decode(split, "attn", AllCustomHostEngine, unified=unified)
    assert len(host) == len(cust) >= 3
    for a, b in zip(host, cust):
        assert np.isfinite(a).all()
        assert reference.nmse(b, a) < 1e-12
    for key, (pos, k, v) in host_kv.items():
        assert pos.tolist() == cust_kv[key][0].tolist()
        assert np.array_equal(k, cust_kv[key][1]) and np.array_equal(v, cust_kv[key][2])


@pytest.mark.parametrize("split, unified", SPLITS)
def test_cli_cpu_engine_full_block_matches_all_custom_graph(split, unified):
    host, host_kv = decode(split, "full", unified=unified)
    cust, cust_kv = decode(split, "full", AllCustomHostEngine, unified=unified)
    assert len(host) == len(cust) >= 3
    for a, b in zip(host, cust):
        assert np.isfinite(a).all() and a.shape[1] == MODEL.n_embd
        assert reference.nmse(b, a) < 1e-6
    for key, (pos, k, v) in host_kv.items():
        assert pos.tolist() == cust_kv[key][0].tolist()
        assert reference.nmse(cust_kv[key][1], k) < 1e-6 and reference.nmse(cust_kv[key][2], v) < 1e-6


def test_engine_puts_the_op_settings_back_on_close():
    """The CPU engine sets the op's process-wide backend to "reference"; closing it puts back
    what was set before (a device graph computed later in the process must not meet the numpy
    path)."""
    from ggml_attn import op
    before = op.settings()
    op.set_backend("auto", "decode")
    try:
        r = Runner(RunConfig(MODEL, n_ctx=256, n_seq=1, device="cpu", n_threads=1))
        assert op.settings()[0] == "reference"
        r.close()
        assert op.settings() == ("auto", "decode")
    finally:
        op.set_backend(*before)
