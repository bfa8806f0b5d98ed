"""Plans, host ggml graphs of a ubatch, and the device-graph check (runs without a GPU)."""
import ctypes

import ggml
import numpy as np
import pytest

from ggml_attn.graph import Batch, KVCache, split_ubatches
from ggml_attn.graph.build import GraphBuildError, build_ubatch_graph, check_device_graph
from ggml_attn.graph.plan import plan_ubatch, tile_map
from ggml_attn.graph.attn_config import AttnConfig
from ggml_attn.graph.qkv import token_qkv, token_vectors
from ggml_attn.graph.qkv_runner import run_batch
from ggml_attn.reference import nmse

CFG = AttnConfig(n_layer=2, n_head=4, n_head_kv=2, head_dim_k=16)


def cache_for(unified, n_seq=10, n_ctx=2560, cfg=CFG, **kw):
    return KVCache(n_ctx, n_seq, unified=unified, n_layer=cfg.n_layer, n_head_kv=cfg.n_head_kv,
                   head_dim_k=cfg.head_dim_k, head_dim_v=cfg.head_dim_v, **kw)


def test_token_vectors_depend_only_on_seq_pos_layer():
    a = token_vectors([3, 4, 3], [7, 7, 7], layer=1, kind=1, n_vec=2, dim=8)
    assert a.shape == (3, 2, 8) and a.dtype == np.float32
    assert np.array_equal(a[0], a[2]) and not np.array_equal(a[0], a[1])
    assert not np.array_equal(a, token_vectors([3, 4, 3], [7, 7, 7], layer=2, kind=1, n_vec=2, dim=8))
    assert -1 <= a.min() and a.max() < 1 and abs(a.mean()) < 0.3
    q, k, v = token_qkv([0, 0], [5, 5], [False, True], 0, CFG)
    assert np.abs(k[1]).max() > 1.5  # pad rows come from a different, larger stream


def test_tile_map_counts():
    vis = np.zeros((1, 128, 512), bool)
    vis[0, :64, :10] = True            # q tile 0: kv tile 0
    vis[0, 64:, 300] = True            # q tile 1: kv tile 1 only
    vis[0, 64:, 0] = True              # ... and kv tile 0 -> tail-skip visits both
    tm = tile_map(vis, 64, 256)
    assert tm.live.tolist() == [[[True, False], [True, True]]]
    assert (tm.n_live, tm.n_tail_skip, tm.n_total) == (3, 3, 4)
    vis2 = np.zeros((1, 64, 768), bool)
    vis2[0, :, 600] = True
    tm2 = tile_map(vis2, 64, 256)
    assert (tm2.n_live, tm2.n_tail_skip) == (1, 3)  # interior tiles are not skipped by tail-skip


def test_plan_is_built_once_and_holds_mask_rows_tiles():
    c = cache_for(False)
    (ub,) = split_ubatches(Batch.from_lengths(range(1, 11)), 512, "padded")
    plan = plan_ubatch(c, ub)
    assert plan.mask.shape == (10, 1, 10, 256) and plan.n_stream == 10 and plan.n_tps == 10
    assert plan.row_idx.tolist()[:3] == [0, 1, 2] and plan.row_idx[10] == 256
    assert plan.tiles.n_live == 10
    d = plan.describe()
    assert d["shape"] == "10x10" and d["n_pad"] == 45 and d["n_kv"] == 256


@pytest.mark.parametrize("unified, mode", [(True, "simple"), (False, "padded"), (False, "equal")])
def test_host_graph_matches_numpy_path_and_ggml_builtin(unified, mode):
    b = Batch.from_lengths([5, 1, 9, 3], seq_ids=[2, 0, 1, 3])
    ref = run_batch(cache_for(unified, 4, 1024), b, 16, mode, CFG, compute="numpy")
    c_ours = cache_for(unified, 4, 1024)
    ours = run_batch(c_ours, b, 16, mode, CFG, compute="ggml")
    c_builtin = cache_for(unified, 4, 1024)
    builtin = run_batch(c_builtin, b, 16, mode, CFG, compute="ggml", fa=ggml.ggml_flash_attn_ext)
    assert nmse(ours.out, ref.out) < 1e-10
    assert nmse(builtin.out, ref.out) < 1e-6  # ggml CPU FA rounds Q to F16
    # the graphs stored the same K/V as the numpy path
    c_np = cache_for(unified, 4, 1024)
    run_batch(c_np, b, 16, mode, CFG)
    for s in range(4):
        for il in range(CFG.n_layer):
            a, bb = c_np.sequence_contents(s, il), c_ours.sequence_contents(s, il)
            assert np.array_equal(a[0], bb[0]) and np.array_equal(a[1], bb[1]) and np.array_equal(a[2], bb[2])


@pytest.mark.parametrize("unified, mode", [(True, "simple"), (False, "padded")])
def test_all_custom_graph_form_runs_on_host(unified, mode):
    """The device-resident graph's form (custom store op + our FA op only), on numpy memory."""
    b = Batch.from_lengths([5, 1, 9, 3])
    ref = run_batch(cache_for(unified, 4, 1024), b, 16, mode, CFG)
    c = cache_for(unified, 4, 1024)
    (ub, *_) = split_ubatches(b, 16, mode)
    g = build_ubatch_graph(c, plan_ubatch(c, ub), CFG, all_custom=True)
    check_device_graph(g.graph)  # passes: no built-in compute op
    g.free()
    c = cache_for(unified, 4, 1024)
    got = run_batch(c, b, 16, mode, CFG, compute="ggml", all_custom=True)
    assert nmse(got.out, ref.out) < 1e-10
    assert np.array_equal(c.sequence_contents(2, 1)[1], ref_cache_k(b, unified, mode, 2, 1))
    with pytest.raises(GraphBuildError, match="needs ggml_attn.flash_attn_ext"):
        run_batch(cache_for(unified, 4, 1024), b, 16, mode, CFG, compute="ggml", all_custom=True,
                  fa=ggml.ggml_flash_attn_ext)


def ref_cache_k(b, unified, mode, seq, layer):
    c = cache_for(unified, 4, 1024)
    run_batch(c, b, 16, mode, CFG)
    return c.sequence_contents(seq, layer)[1]


def test_check_device_graph_refuses_builtin_ops():
    c = cache_for(False)
    (ub,) = split_ubatches(Batch.from_lengths([2, 2]), 512, "equal")
    g = build_ubatch_graph(c, plan_ubatch(c, ub), CFG)  # host graph: ggml_set_rows is built in
    with pytest.raises(GraphBuildError, match="SET_ROWS"):
        check_device_graph(g.graph)
    g.free()


def test_geometry_mismatch_is_refused():
    c = cache_for(True)
    (ub,) = split_ubatches(Batch.from_lengths([2]), 512, "simple")
    with pytest.raises(ValueError, match="does not match"):
        build_ubatch_graph(c, plan_ubatch(c, ub), AttnConfig(n_head=4, n_head_kv=4, head_dim_k=16))


def test_run_batch_refuses_overflow_and_leaves_cache_unchanged():
    from ggml_attn.graph import KVCacheFullError
    c = cache_for(False, 2, 512)
    with pytest.raises(KVCacheFullError):
        run_batch(c, Batch.from_lengths([300, 3]), 512, "equal", CFG)
    assert c.pos.max() == -1


def test_padded_equals_serial_and_pads_leave_no_trace():
    b = Batch.from_lengths(range(1, 11))
    serial = cache_for(False)
    r_serial = run_batch(serial, b, 512, "seq", CFG)
    padded = cache_for(False)
    r_pad = run_batch(padded, b, 512, "padded", CFG)
    assert len(r_pad.plans) == 1 and r_pad.plans[0].ubatch.n_pad == 45
    assert nmse(r_pad.out, r_serial.out) < 1e-12
    assert padded.pad.sum() == 0
    for s in range(10):
        for il in range(CFG.n_layer):
            p1, k1, v1 = serial.sequence_contents(s, il)
            p2, k2, v2 = padded.sequence_contents(s, il)
            assert p1.tolist() == p2.tolist() == list(range(s + 1))
            assert np.array_equal(k1, k2) and np.array_equal(v1, v2)
    # decode continues from the true lengths
    dec = Batch.from_lengths([1] * 10, start_pos=padded.next_positions(range(10)))
    assert dec.positions.tolist() == [s + 1 for s in range(10)]
    d1 = run_batch(serial, dec, 512, "equal", CFG)
    d2 = run_batch(padded, dec, 512, "equal", CFG)
    assert nmse(d2.out, d1.out) < 1e-12
