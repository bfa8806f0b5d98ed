"""The builder's layer functions: the full block as a host graph (ggml's ops) and as an
all-custom graph (``graph/xp_ops.py`` over numpy, the code the device graph runs), ``-fa off``,
and the KV cache's views and store op with its cache types."""
import types

import numpy as np
import pytest

from ggml_attn.graph import AttnConfig, Batch, KVCache, split_ubatches
from ggml_attn.graph.build import GraphBuildError, build_ubatch_graph, check_device_graph
from ggml_attn.graph.plan import plan_ubatch
from ggml_attn.graph.qkv_runner import run_batch
from ggml_attn.reference import nmse

CFG = AttnConfig(n_layer=2, n_head=4, n_head_kv=2, head_dim_k=32)
N_EMBD, N_FF = 64, 96


def weights(seed=0, n_layer=2):
    rng = np.random.default_rng(seed)

    def w(n_in, n_out):
        return (rng.standard_normal((n_out, n_in), dtype=np.float32) / np.sqrt(n_in)).astype(np.float16)
    return [dict(wq=w(N_EMBD, 128), wk=w(N_EMBD, 64), wv=w(N_EMBD, 64), wo=w(128, N_EMBD),
                 wg=w(N_EMBD, N_FF), wu=w(N_EMBD, N_FF), wd=w(N_FF, N_EMBD)) for _ in range(n_layer)]


def cache(unified, **kw):
    return KVCache(4 * 512, 4, unified=unified, n_layer=2, n_head_kv=2, head_dim_k=32, **kw)


def run_full(c, batches, mode, *, all_custom, flash_attn=True, n_ubatch=512):
    """Every ubatch of ``batches`` through the full block on ``c``; outputs (real rows, batch
    order per ubatch) and the plans."""
    w = weights()
    outs = []
    for b in batches:
        for ub in split_ubatches(b, n_ubatch, mode):
            plan = plan_ubatch(c, ub)
            g = build_ubatch_graph(c, plan, CFG, layer="full", weights=w, all_custom=all_custom,
                                   flash_attn=flash_attn)
            assert g.device == all_custom
            x = np.random.default_rng(int(ub.positions.sum())).standard_normal((ub.n_tokens, N_EMBD))
            g.set_x(x.astype(np.float32))
            g.compute(2)
            outs.append(g.outputs()[0][~ub.is_pad].copy())
            g.free()
            c.free_pads(plan.slot)
    return outs


@pytest.mark.parametrize("unified, mode", [(True, "simple"), (False, "equal"), (False, "padded")])
def test_full_block_all_custom_equals_host_graph(unified, mode):
    prompts = Batch.from_lengths([3, 5, 8, 2])
    host_c, cust_c = cache(unified), cache(unified)
    host = run_full(host_c, [prompts], mode, all_custom=False)
    cust = run_full(cust_c, [prompts], mode, all_custom=True)
    step = Batch.from_lengths([1] * 4, start_pos=host_c.next_positions(range(4)))
    host += run_full(host_c, [step], mode, all_custom=False)
    cust += run_full(cust_c, [step], mode, all_custom=True)
    assert len(host) == len(cust) >= 2
    for a, b in zip(host, cust):
        assert np.isfinite(a).all() and np.isfinite(b).all()
        assert nmse(b, a) < 1e-6
    for s in range(4):
        for layer in range(2):
            p1, k1, v1 = host_c.sequence_contents(s, layer)
            p2, k2, v2 = cust_c.sequence_contents(s, layer)
            assert p1.tolist() == p2.tolist()
            assert nmse(k2, k1) < 1e-6 and nmse(v2, v1) < 1e-6


def test_full_block_all_custom_graph_has_only_custom_ops_and_views():
    c = cache(False)
    (ub,) = split_ubatches(Batch.from_lengths([3, 5]), 512, "padded")
    g = build_ubatch_graph(c, plan_ubatch(c, ub), CFG, layer="full", weights=weights(), all_custom=True)
    check_device_graph(g.graph)
    g.free()
    host = build_ubatch_graph(c, plan_ubatch(c, split_ubatches(Batch.from_lengths([1], start_pos={0: 3}), 512,
                                                                   "padded")[0]), CFG, layer="full", weights=weights())
    with pytest.raises(GraphBuildError, match="built-in CPU op"):
        check_device_graph(host.graph)  # rms_norm, mul_mat, ... are ggml's ops on a host graph
    host.free()


def test_full_block_fa_off_matches_fa_on_for_real_rows():
    """``-fa off`` (mul_mat + soft_max_ext) gives the flash-attention result on real rows; pad
    rows see their own cell, so nothing is NaN."""
    prompts = Batch.from_lengths([3, 5, 8, 2])
    on = run_full(cache(False), [prompts], "padded", all_custom=False)
    off = run_full(cache(False), [prompts], "padded", all_custom=False, flash_attn=False)
    for a, b in zip(on, off):
        assert np.isfinite(b).all()
        assert nmse(b, a) < 1e-5


def test_graph_options_that_cannot_run_are_refused():
    c = cache(False)
    (ub,) = split_ubatches(Batch.from_lengths([3, 5]), 512, "padded")
    plan = plan_ubatch(c, ub)
    with pytest.raises(GraphBuildError, match="-fa off"):
        build_ubatch_graph(c, plan, CFG, all_custom=True, flash_attn=False)
    with pytest.raises(ValueError, match="needs weights"):
        build_ubatch_graph(c, plan, CFG, layer="full")
    with pytest.raises(ValueError, match="layer must be"):
        build_ubatch_graph(c, plan, CFG, layer="mlp")


@pytest.mark.parametrize("type_k, type_v", [("q8_0", "q8_0"), ("q4_0", "f16"), ("f16", "q5_1"), ("bf16", "bf16"),
                                            ("f32", "f16")])
def test_cache_types_host_graph_close_to_f16_and_refused_where_they_cannot_run(type_k, type_v):
    b = Batch.from_lengths([3, 5, 8, 2])
    ref = run_batch(cache(False), b, 512, "equal", CFG, compute="ggml")
    c = cache(False, type_k=type_k, type_v=type_v)
    got = run_batch(c, b, 512, "equal", CFG, compute="ggml")
    assert np.isfinite(got.out).all()
    assert nmse(got.out, ref.out) < (1e-2 if "q4" in type_k + type_v else 2e-3)
    if not c.float_storage:
        assert c.k.dtype == np.uint8 or c.v.dtype == np.uint8
        with pytest.raises(ValueError, match="f16/f32"):
            run_batch(cache(False, type_k=type_k, type_v=type_v), b, 512, "equal", CFG)  # numpy path
        with pytest.raises(ValueError, match="f16/f32"):
            run_batch(cache(False, type_k=type_k, type_v=type_v), b, 512, "equal", CFG, compute="ggml",
                      all_custom=True)
        with pytest.raises(ValueError, match="f16/f32"):
            c.sequence_contents(0)
    if type_v in ("q8_0", "q5_1"):
        (ub,) = split_ubatches(Batch.from_lengths([2], start_pos={0: 20}), 512, "equal")
        with pytest.raises(ValueError, match="-fa off"):
            build_ubatch_graph(c, plan_ubatch(c, ub), CFG, flash_attn=False)


def test_unknown_cache_type_and_block_types_on_cupy_are_refused():
    with pytest.raises(ValueError, match="not a cache type"):
        cache(False, type_k="q2_k")
    with pytest.raises(ValueError, match="type_k q8_0: head size 16 is not a multiple of 32, the q8_0 block size"):
        KVCache(512, 1, n_head_kv=1, head_dim_k=16, type_k="q8_0")


# an array module that is not numpy (as CuPy is, for KVCache), its arrays numpy's: the device
# cache's rules without a GPU
_FakeDeviceXp = types.ModuleType("fakecupy")
_FakeDeviceXp.zeros = np.zeros


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_device_cache_holds_q8_0_and_q4_0_byte_rows(qtype):
    """A device (non-numpy) cache holds q8_0 / q4_0 as uint8 rows of ggml's blocks on its own
    array module, numpy order (n_layer, n_stream, kv_size, row_bytes); the device store op and
    the build checks take it (the host form of the op does not)."""
    from ggml_attn.graph.build import check_build_args
    from ggml_attn.graph.kv_graph import check_custom_store
    c = KVCache(512, 2, unified=False, n_layer=2, n_head_kv=2, head_dim_k=64, type_k=qtype, type_v=qtype,
                xp=_FakeDeviceXp)
    row = 2 * 64 // 32 * (34 if qtype == "q8_0" else 18)
    assert c.k.shape == c.v.shape == (2, 2, 256, row) and c.k.dtype == np.uint8
    cfg = AttnConfig(n_layer=2, n_head=4, n_head_kv=2, head_dim_k=64)
    assert check_build_args(c, cfg) is True   # an all-custom graph
    check_custom_store(qtype, qtype, on_device=True)
    check_custom_store(qtype, "f16", on_device=True)   # the store writes each kind's own type
    with pytest.raises(ValueError, match=rf"writes f16/f32 into a host \(numpy\) cache; this cache is K {qtype}"):
        check_custom_store(qtype, qtype, on_device=False)


@pytest.mark.parametrize("qtype", ["q4_1", "q5_0", "q5_1", "iq4_nl", "bf16"])
def test_device_cache_refuses_other_block_types(qtype):
    with pytest.raises(ValueError, match=rf"type_v {qtype}: a fakecupy \(device\) cache holds f16, f32, q8_0, "
                                         rf"q4_0 only .*{qtype} runs in a host \(numpy\) cache"):
        KVCache(512, 1, n_head_kv=1, head_dim_k=64, type_v=qtype, xp=_FakeDeviceXp)
    from ggml_attn.graph.kv_graph import check_custom_store
    with pytest.raises(ValueError, match="writes f16/f32/q8_0/q4_0 into a device"):
        check_custom_store("f16", qtype, on_device=True)
    KVCache(512, 1, n_head_kv=1, head_dim_k=64, type_v=qtype)   # numpy: any cache type


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"])
def test_block_types_need_whole_blocks_per_head_not_per_row(qtype):
    """Two heads of 48: a row of 96 values is three blocks, but the second head starts in the
    middle of one; ggml's op then read NaN for 27% of the outputs with no error. Refused at
    construction, per head, naming the type, the head size and the block size."""
    with pytest.raises(ValueError, match=rf"type_k {qtype}: head size 48 is not a multiple of 32, the {qtype} block size"):
        KVCache(512, 1, n_head_kv=2, head_dim_k=48, type_k=qtype)
    with pytest.raises(ValueError, match=rf"type_v {qtype}: head size 48 is not a multiple of 32"):
        KVCache(512, 1, n_head_kv=2, head_dim_k=64, head_dim_v=48, type_v=qtype)
    KVCache(512, 1, n_head_kv=2, head_dim_k=64, head_dim_v=48, type_k=qtype)   # a 48-wide f16 V is fine


@pytest.mark.parametrize("arg", ["type_k", "type_v"])
@pytest.mark.parametrize("bad", ["", "F16", "q8", 0])
def test_cache_type_given_must_be_a_cache_type(arg, bad):
    """Only None means the dtype's type: '' used to pick f16 silently."""
    with pytest.raises(ValueError, match=rf"{arg} .* is not a cache type \(allowed: f16, bf16, f32, q8_0"):
        KVCache(512, 1, n_head_kv=1, head_dim_k=32, **{arg: bad})
    assert KVCache(512, 1, n_head_kv=1, head_dim_k=32, **{arg: None}).type_k == "f16"


@pytest.mark.parametrize("all_custom", [False, True])
def test_full_block_memory_is_one_layer_of_intermediates(all_custom):
    """The full block's results reuse the previous layer's arrays: 2 or 4 layers hold the same
    result arrays (besides each layer's weights)."""
    from ggml_attn.graph.kv_graph import data_ptr

    def n_result_arrays(n_layer):
        cfg = AttnConfig(n_layer=n_layer, n_head=4, n_head_kv=2, head_dim_k=32)
        c = KVCache(512, 2, unified=False, n_layer=n_layer, n_head_kv=2, head_dim_k=32)
        (ub,) = split_ubatches(Batch.from_lengths([3, 5]), 512, "padded")
        g = build_ubatch_graph(c, plan_ubatch(c, ub), cfg, layer="full", weights=weights(n_layer=n_layer),
                               all_custom=all_custom)
        arrays = [a for a in list(g._arrays.values()) + g._keep if hasattr(a, "dtype")]
        n = len({data_ptr(a) for a in arrays}) - 7 * n_layer  # less each layer's weights
        g.free()
        return n
    assert n_result_arrays(4) == n_result_arrays(2) > 0


def test_an_error_inside_a_custom_op_is_raised_after_compute_and_a_custom_layer_runs():
    from ggml_attn.graph import layers, xp_node
    from ggml_attn.runtime import FlashAttnError
    calls = []

    def layer(b, il, cur):
        out = layers.attn_layer(b, il, cur)

        def boom():
            calls.append(il)
            if il == 1:
                raise ZeroDivisionError("planted")
        return xp_node.custom(b, boom, [out], b.array(out), f"after_l{il}")
    c = cache(False)
    (ub,) = split_ubatches(Batch.from_lengths([3, 5]), 512, "padded")
    g = build_ubatch_graph(c, plan_ubatch(c, ub), CFG, layer=layer, all_custom=True)
    with pytest.raises(FlashAttnError, match="planted"):
        g.compute(2)
    assert calls == [0, 1]
    g.free()
