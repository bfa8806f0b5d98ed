"""The model graph's device form (all-custom graphs over ``Model.device_weights``), on the CPU.

``all_custom=True`` on a numpy cache builds the graph a CuPy cache gets -- every compute node a
custom op of ``xp_ops`` -- and runs the ops' numpy paths. It must give the host graph's logits
(NMSE <= 5e-4, same argmax) for small random llama / qwen2 GGUF files written here, under
several splits and both KV modes. ``xp_ops.rope`` and ``xp_ops.get_rows`` are checked against
ggml's own ``rope_ext`` / ``get_rows``; the CUDA source of the model ops compiles with NVRTC.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import ggml
import numpy as np
import pytest

import ggml_attn

from ggml_attn import runtime as fa_runtime
from ggml_attn.graph import AttnConfig, Batch, KVCache, split_ubatches
from ggml_attn.graph import model_graph, xp_node, xp_ops
from ggml_attn.graph.build import GraphBuilder, build_ubatch_graph, check_device_graph
from ggml_attn.graph.model import ROPE_NEOX, ROPE_NORMAL, HParams, load_gguf
from ggml_attn.graph.model_device import DeviceWeights
from ggml_attn.graph.model_graph import output_rows
from ggml_attn.graph.model_runner import run_model_batch
from ggml_attn.graph.plan import plan_ubatch

GGML_TYPE_I32 = 26


# ------------------------------------------------------------------ small GGUF files
@dataclass(frozen=True)
class Spec:
    arch: str = "llama"
    n_embd: int = 256
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 256
    n_layer: int = 2
    n_vocab: int = 256
    tied: bool = False
    rope_dim: int | None = None       # None: head_dim_k
    rope_freqs: bool = False
    rope_base: float = 10000.0
    linear_scale: float | None = None
    seed: int = 0


SPECS = {
    "llama": Spec(),
    "qwen2-tied": Spec(arch="qwen2", tied=True, rope_base=1e6, seed=1),
    "llama-freqs": Spec(rope_dim=32, rope_freqs=True, rope_base=5e5, linear_scale=2.0, seed=2),
}


def write_gguf(path: str, s: Spec) -> str:
    import gguf
    rng = np.random.default_rng(s.seed)
    E, H, HKV, FF, V = s.n_embd, s.n_head, s.n_head_kv, s.n_ff, s.n_vocab
    D = E // H
    w = gguf.GGUFWriter(path, s.arch)
    w.add_name(f"test-{s.arch}")
    w.add_context_length(4096), w.add_embedding_length(E), w.add_block_count(s.n_layer)
    w.add_feed_forward_length(FF), w.add_head_count(H), w.add_head_count_kv(HKV)
    w.add_rope_freq_base(s.rope_base), w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(s.rope_dim or D)
    if s.linear_scale:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(s.linear_scale)
    w.add_file_type(1)
    w.add_vocab_size(V)

    def mat(n_out, n_in):   # numpy (n_out, n_in) = ggml [n_in, n_out]; unit-ish outputs
        return (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float16)

    def norm(n):            # spread around 1
        return rng.uniform(0.5, 1.6, n).astype(np.float32)

    def bias(n):
        return (rng.standard_normal(n) * 0.5).astype(np.float32)

    w.add_tensor("token_embd.weight", mat(V, E) * np.float16(4))
    for il in range(s.n_layer):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", norm(E))
        w.add_tensor(p + "attn_q.weight", mat(H * D, E) * np.float16(2))
        w.add_tensor(p + "attn_k.weight", mat(HKV * D, E) * np.float16(2))
        w.add_tensor(p + "attn_v.weight", mat(HKV * D, E))
        if s.arch == "qwen2":
            w.add_tensor(p + "attn_q.bias", bias(H * D))
            w.add_tensor(p + "attn_k.bias", bias(HKV * D))
            w.add_tensor(p + "attn_v.bias", bias(HKV * D))
        w.add_tensor(p + "attn_output.weight", mat(E, H * D))
        w.add_tensor(p + "ffn_norm.weight", norm(E))
        w.add_tensor(p + "ffn_gate.weight", mat(FF, E))
        w.add_tensor(p + "ffn_up.weight", mat(FF, E))
        w.add_tensor(p + "ffn_down.weight", mat(E, FF))
    w.add_tensor("output_norm.weight", norm(E))
    if not s.tied:
        w.add_tensor("output.weight", mat(V, E) * np.float16(3))
    if s.rope_freqs:
        w.add_tensor("rope_freqs.weight", rng.uniform(1.0, 8.0, (s.rope_dim or D) // 2).astype(np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("gguf_device_form"))


_models: dict = {}


def model_of(name: str, gguf_dir: str):
    key = (name, gguf_dir)
    if key not in _models:
        _models[key] = load_gguf(write_gguf(os.path.join(gguf_dir, f"{name}.gguf"), SPECS[name]))
    return _models[key]


def nmse(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(((a - b) ** 2).sum() / (b ** 2).sum())


def cache_for(model, unified: bool, n_seq: int = 4, n_ctx: int = 256) -> KVCache:
    hp = model.hp
    return KVCache(n_ctx, n_seq, unified=unified, n_layer=hp.n_layer, n_head_kv=hp.n_head_kv,
                   head_dim_k=hp.head_dim_k)


# ------------------------------------------------------------------ the whole model
@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("mode, unified", [("simple", True), ("equal", True), ("equal", False),
                                           ("padded", True), ("padded", False)])
def test_device_form_matches_host(gguf_dir, name, mode, unified):
    m = model_of(name, gguf_dir)
    rng = np.random.default_rng(7)
    lens = [5, 1, 12, 7]
    prompts = [rng.integers(0, m.hp.n_vocab, n).astype(np.int32) for n in lens]
    host_c, dev_c = cache_for(m, unified), cache_for(m, unified)
    batch = Batch.from_sequences(prompts, list(range(len(lens))))
    ref = run_model_batch(host_c, batch, m, 8, mode, logits="all")
    got = run_model_batch(dev_c, batch, m, 8, mode, logits="all", all_custom=True)
    _check(got.logits, ref.logits, name)
    # the caches hold the same K/V (store and RoPE agree), then a decode step from them
    for s in range(len(lens)):
        p1, k1, v1 = host_c.sequence_contents(s, 1)
        p2, k2, v2 = dev_c.sequence_contents(s, 1)
        assert np.array_equal(p1, p2)
        assert nmse(k2, k1) < 5e-4 and nmse(v2, v1) < 5e-4
    ids = list(range(len(lens)))
    step = Batch(np.array([3, 17, 250, 64], dtype=np.int32),
                 np.array([host_c.next_positions(ids)[s] for s in ids], dtype=np.int32), tuple((s,) for s in ids))
    ref = run_model_batch(host_c, step, m, 8, mode)
    got = run_model_batch(dev_c, step, m, 8, mode, all_custom=True)
    _check(got.logits, ref.logits, name)


# The numpy path of xp_ops' matmuls rounds each product to F16 (numpy's half matmul; the CUDA
# path keeps F32), so logits differ from the host's by up to ~0.04 here (std ~3.5): a row whose
# two largest host logits are closer than this margin may pick the other one.
ARGMAX_MARGIN = 0.1


def _check(got, ref, what):
    assert got.shape == ref.shape and np.isfinite(got).all()
    e = nmse(got, ref)
    assert e <= 5e-4, (what, e)
    top2 = np.sort(ref, -1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > ARGMAX_MARGIN
    assert clear.sum() >= len(ref) // 2, (what, "too few rows with a clear argmax to check")
    bad = np.flatnonzero(clear & (got.argmax(-1) != ref.argmax(-1)))
    assert not bad.size, (what, bad)


@pytest.mark.parametrize("fused", [True, False])
def test_device_graph_is_all_custom(gguf_dir, fused, monkeypatch):
    """Every node of the device form custom (check_device_graph); the rope and the K/V store one
    node a layer (qwen2's V bias inside it) with model_graph.ROPE_STORE, else a rope node, the V
    bias and the store op."""
    monkeypatch.setattr(model_graph, "ROPE_STORE", fused)
    m = model_of("qwen2-tied", gguf_dir)
    c = cache_for(m, False)
    b = Batch.from_sequences([np.arange(6, dtype=np.int32), np.arange(3, dtype=np.int32)], [0, 1])
    (ub, *_) = split_ubatches(b, 16, "padded")
    plan = plan_ubatch(c, ub)
    want = np.ones(b.n_tokens, dtype=bool)
    g = build_ubatch_graph(c, plan, m.attn_config(), layer="model", model=m, tokens=b.tokens,
                           out_rows=output_rows(ub, want), all_custom=True)
    try:
        assert g.device
        check_device_graph(g.graph)
        names = {ggml.ggml_get_name(ggml.ggml_graph_node(g.graph, i)).decode()
                 for i in range(ggml.ggml_graph_n_nodes(g.graph))}
        per_layer = ["qk_rope_kv_store_l{}"] if fused else ["qk_rope_l{}", "v_bias_l{}"]
        expected = {"inp_embd", "x_out", *(n.format(il) for n in per_layer for il in (0, 1))}
        assert expected <= names
        assert not any(n.startswith("qk_rope_l" if fused else "qk_rope_kv_store") for n in names)
    finally:
        g.free()


# ------------------------------------------------------------------ device weights
@pytest.mark.parametrize("name", sorted(SPECS))
def test_device_weights_fold_and_size(gguf_dir, name):
    m = model_of(name, gguf_dir)
    dw = m.device_weights(np)
    assert m.device_weights(np) is dw                  # built once
    assert dw.nbytes == DeviceWeights.expected_nbytes(m)
    assert dw.tied_copy == SPECS[name].tied
    lw, dl = m.layers[1], dw.layers[1]
    g = lw["attn_norm"].to_float()
    assert np.array_equal(dl["wk"], (lw["wk"].to_float() * g[None, :]).astype(np.float16))
    assert np.array_equal(dl["wd"], lw["wd"].to_float(np.float16))
    assert all(a.dtype == np.float16 for d in dw.layers for k, a in d.items() if k.startswith("w"))
    assert np.array_equal(dw.tok_embd, m.tok_embd.to_float(np.float16))
    head = (m.output.to_float() * m.output_norm.to_float()[None, :]).astype(np.float16)
    assert np.array_equal(dw.output, head)
    if SPECS[name].tied:
        assert not np.shares_memory(dw.output, dw.tok_embd)
    assert set(dl) == set(lw)   # the norm weights too, F32 (the block matrices apply them at run time)
    assert np.array_equal(dl["attn_norm"], g) and dl["attn_norm"].dtype == np.float32
    assert dw.scratch is None    # no block matrix: no GEMM scratch


@pytest.mark.parametrize("name", ["llama-q4_0", "llama-q8_0", "llama-q4_k", "llama-q6_k", "qwen2-q8_0"])
def test_device_weights_keep_block_matrices_as_the_file_has_them(tmp_path_factory, name):
    """Block-type matrices stay the file's bytes (nothing dequantized at load, no norm folded);
    the weights take the file's tensor bytes; a tied head is the embedding's blocks."""
    import fixtures_gguf
    from ggml_attn.graph.model_device import QMatrix
    m = load_gguf(fixtures_gguf.fixture_path(name, tmp_path_factory.mktemp("q")))
    dw = DeviceWeights.from_model(m, np)
    for lw, dl in zip(m.layers, dw.layers):
        for k in ("wq", "wk", "wv", "wo", "wg", "wu", "wd"):
            q = dl[k]
            assert isinstance(q, QMatrix) and q.type == lw[k].type_name and q.shape == tuple(reversed(lw[k].ne))
            assert np.array_equal(np.asarray(q.blocks).reshape(-1), np.asarray(lw[k].data))
        np.testing.assert_array_equal(dl["wq"].values(), lw["wq"].to_float())
    assert dw.nbytes == m.nbytes == DeviceWeights.expected_nbytes(m)
    by = dw.bytes_by_type()
    assert list(by)[0] == m.type_summary() and sum(by.values()) == dw.nbytes
    assert (dw.output is dw.tok_embd) == m.tied_output and not dw.tied_copy
    assert dw.scratch is None    # numpy: no GEMM scratch (the numpy form multiplies ggml's values)


# ------------------------------------------------------------------ ops against ggml's
def _builder(D=64, n_head_kv=2):
    c = KVCache(16, 1, n_layer=1, n_head_kv=n_head_kv, head_dim_k=D)
    return GraphBuilder(c, None, AttnConfig(n_layer=1, n_head=n_head_kv, n_head_kv=n_head_kv, head_dim_k=D),
                        device=True, attention=None)


def _compute(b):
    cplan = ggml.ggml_graph_plan(b.gf, 2, None)
    work = None
    if cplan.work_size:
        work = np.empty(cplan.work_size, dtype=np.uint8)
        cplan.work_data = ctypes.cast(work.ctypes.data, ctypes.POINTER(ctypes.c_uint8))
    with fa_runtime.computing(b.gf):
        assert ggml.ggml_graph_compute(b.gf, ctypes.byref(cplan)) == 0


def _free(b):
    ggml.ggml_free(b.ctx)
    xp_node.release(b.op_keys)


def _hp(D, rope_dim, mode, base, freq_scale):
    return HParams(arch="llama", name="t", n_layer=1, n_embd=D * 4, n_head=4, n_head_kv=4, head_dim_k=D, n_ff=1,
                   n_vocab=1, n_ctx_train=4096, rms_eps=1e-5, rope_base=base, rope_dim=rope_dim, rope_mode=mode,
                   rope_freq_scale=freq_scale)


@pytest.mark.parametrize("n_t", [1, 2])
@pytest.mark.parametrize("mode", [ROPE_NORMAL, ROPE_NEOX])
@pytest.mark.parametrize("rope_dim, freqs, bias, base, freq_scale", [
    (64, False, False, 10000.0, 1.0), (64, True, False, 500000.0, 1.0), (32, False, True, 10000.0, 0.25),
    (48, True, True, 1e6, 0.5)])
def test_rope_matches_ggml(n_t, mode, rope_dim, freqs, bias, base, freq_scale):
    """One node ropes a layer's Q (3 heads) and, with n_t 2, its K (2 heads, its own bias): each
    against ggml's rope_ext of that tensor alone."""
    D, n_tok = 64, 9
    heads = (3, 2)[:n_t]
    rng = np.random.default_rng(rope_dim + mode)
    xs = [rng.standard_normal((n_tok, nh, D)).astype(np.float32) for nh in heads]
    pos = np.array([0, 1, 2, 7, 100, 4095, 31, 5, 60000], dtype=np.int32)
    ff = rng.uniform(1.0, 16.0, rope_dim // 2).astype(np.float32) if freqs else None
    bvs = [rng.standard_normal(nh * D).astype(np.float32) if bias else None for nh in heads]
    hp = _hp(D, rope_dim, mode, base, freq_scale)
    b = _builder()
    try:
        xts = [b.new(ggml.GGML_TYPE_F32, x.shape, np.float32, f"x{i}", x.copy()) for i, x in enumerate(xs)]
        pt = b.new(GGML_TYPE_I32, pos.shape, np.int32, "pos", pos.copy())
        gots = xp_ops.rope(b, xts, pt, hp, ff, bvs, "rope")
        assert len(gots) == n_t
        ft = b.new(ggml.GGML_TYPE_F32, ff.shape, np.float32, "ff", ff.copy()) if freqs else None
        refs = []
        for i, (xt, nh) in enumerate(zip(xts, heads)):
            src = xt
            if bias:
                bt = b.new(ggml.GGML_TYPE_F32, bvs[i].shape, np.float32, f"bias{i}", bvs[i].copy())
                src = b.call(ggml.ggml_add, ggml.ggml_reshape_2d(b.ctx, xt, nh * D, n_tok), bt)
                src = ggml.ggml_reshape_3d(b.ctx, src, D, nh, n_tok)
            refs.append(b.call(ggml.ggml_rope_ext, src, pt, ft, rope_dim, mode, 4096, base, freq_scale, 0.0, 1.0,
                               32.0, 1.0))
        for t in (*gots, *refs):
            b.expand(t)
        _compute(b)
        for x, nh, bv, got, ref in zip(xs, heads, bvs, gots, refs):
            g, r = b.array(got), b.array(ref)
            assert g.shape == r.shape == (n_tok, nh, D)
            np.testing.assert_allclose(g, r, rtol=0, atol=4e-6)   # (float32 ulps: cosf vs numpy's cos)
            np.testing.assert_array_equal(g[..., rope_dim:], r[..., rope_dim:])
            assert not np.allclose(g[1:, :, :rope_dim], (x + (bv.reshape(nh, D) if bias else 0))[1:, :, :rope_dim])
    finally:
        _free(b)


class _NumpyScratch:
    """What _rope_numpy reads of a graph builder: scratch arrays, nothing kept."""

    def scratch(self, shape, dtype):
        return np.empty(shape, dtype)

    def keep(self, *arrays):
        pass


@pytest.mark.gpu
@pytest.mark.skipif(not ggml_attn.gpu_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", [ROPE_NORMAL, ROPE_NEOX])
@pytest.mark.parametrize("n_tok, D, rope_dim, freqs, bias", [
    (1, 128, 128, False, False), (37, 64, 64, True, True), (600, 64, 32, False, True), (5, 256, 256, True, False)])
def test_cupy_rope_matches_the_numpy_form(mode, n_tok, D, rope_dim, freqs, bias):
    """xp_rope on the GPU (a block a token and slice of its elements, the token's angles made once
    in a table) against the numpy form of two tensors (3 and 2 heads, their biases): within the
    ulps of cos / sin, the dims past rope_dim exactly, every element written (poisoned output)."""
    import cupy
    rng = np.random.default_rng(n_tok + D + mode)
    heads = (3, 2)
    hp = _hp(D, rope_dim, mode, 500000.0, 0.5)
    xs = [rng.standard_normal((n_tok, nh, D)).astype(np.float32) for nh in heads]
    pos = rng.integers(0, 70000, n_tok).astype(np.int32)
    ff = rng.uniform(1.0, 16.0, rope_dim // 2).astype(np.float32) if freqs else None
    bvs = [rng.standard_normal(nh * D).astype(np.float32) if bias else None for nh in heads]
    ts_, fs = xp_ops.rope_theta_scale(hp), np.float32(0.5)
    refs = [np.empty_like(x) for x in xs]
    for x, o, nh, bv in zip(xs, refs, heads, bvs):
        xp_ops._rope_numpy(_NumpyScratch(), x, o, pos, rope_dim, mode == ROPE_NEOX, ts_, fs, ff,
                           None if bv is None else bv.reshape(nh, D))()
    d = [cupy.asarray(a) if a is not None else None for a in (*xs, pos, ff, *bvs)]
    outs = [cupy.full(x.shape, cupy.nan, cupy.float32) for x in xs]
    segs = []
    for i, nh in enumerate(heads):
        segs += [xp_ops._dptr(d[i]), xp_ops._dptr(outs[i]), xp_ops._dptr(d[4 + i]), ctypes.c_int32(nh),
                 ctypes.c_int64(n_tok * nh * D)]
    run = xp_ops._rope_launch("xp_rope", n_tok, sum(heads) * D, rope_dim, *segs, xp_ops._dptr(d[2]),
                              xp_ops._dptr(d[3]), ctypes.c_int32(D), ctypes.c_int32(rope_dim),
                              ctypes.c_int32(int(mode == ROPE_NEOX)), ctypes.c_float(ts_), ctypes.c_float(fs))
    assert run.grid[0] == n_tok and run.grid[1] * n_tok <= max(xp_ops.ROPE_BLOCKS, n_tok)
    run()
    cupy.cuda.get_current_stream().synchronize()
    for o, r in zip(outs, refs):
        g = o.get()
        assert np.isfinite(g).all()
        np.testing.assert_allclose(g, r, rtol=0, atol=4e-6 * float(np.abs(r).max()))
        np.testing.assert_array_equal(g[..., rope_dim:], r[..., rope_dim:])


def test_rope_launch_grid_and_refusal(monkeypatch):
    """A block a token and slice: a decode token's elements over ceil(n / 256) blocks, a prompt's
    over at most ROPE_BLOCKS / n_tok; no launch for no tokens; more dims than the table refused."""
    from types import SimpleNamespace
    from ggml_attn import kernels as K
    monkeypatch.setattr(K, "get_function", lambda variant, name: SimpleNamespace(name=name))
    monkeypatch.setattr(K, "BoundLaunch", lambda fn, grid, block, *params: SimpleNamespace(grid=grid, block=block))
    assert xp_ops._rope_launch("xp_rope_store", 1, 6144, 128).grid == (1, 24, 1)
    assert xp_ops._rope_launch("xp_rope_store", 512, 6144, 128).grid == (512, 4, 1)
    assert xp_ops._rope_launch("xp_rope_store", 4096, 6144, 128).grid == (4096, 1, 1)
    assert xp_ops._rope_launch("xp_rope", 3, 100, 64).grid == (3, 1, 1)
    assert xp_ops._rope_launch("xp_rope", 0, 100, 64)() is None
    with pytest.raises(ValueError, match="at most 512 dims"):
        xp_ops._rope_launch("xp_rope", 3, 1024, 514)


def test_rope_refuses_bad_input():
    hp = _hp(64, 64, ROPE_NORMAL, 10000.0, 1.0)
    b = _builder()
    try:
        x = b.new(ggml.GGML_TYPE_F32, (4, 2, 64), np.float32, "x", np.zeros((4, 2, 64), np.float32))
        y = b.new(ggml.GGML_TYPE_F32, (3, 2, 64), np.float32, "y", np.zeros((3, 2, 64), np.float32))
        pt = b.new(GGML_TYPE_I32, (4,), np.int32, "pos", np.arange(4, dtype=np.int32))
        with pytest.raises(ValueError, match="one or two tensors"):
            xp_ops.rope(b, [x, x, x], pt, hp)
        with pytest.raises(ValueError, match="biases for"):
            xp_ops.rope(b, [x, x], pt, hp, None, [None])
        with pytest.raises(ValueError, match="3 tokens|tokens"):
            xp_ops.rope(b, [x, y], pt, hp)
        with pytest.raises(ValueError, match="bias of shape"):
            xp_ops.rope(b, [x], pt, hp, None, [np.zeros(5, np.float32)])
    finally:
        _free(b)


# ------------------------------------------------------------------ the fused rope and K/V store
def _run_fused_or_not(m, c, batch, fused, monkeypatch, **kw):
    monkeypatch.setattr(model_graph, "ROPE_STORE", fused)
    return run_model_batch(c, batch, m, 8, "equal", logits="all", **kw)


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("unified", [True, False])
def test_rope_store_gives_the_rope_and_store_bits(gguf_dir, name, unified, monkeypatch):
    """model_graph.ROPE_STORE (xp_ops.rope_store: Q rotated, K rotated and V -- with qwen2's V
    bias -- written into the cache rows by one node): on the all-custom graph's numpy path the
    same logits and the same cache bits as a rope node and a store node, prompts then a decode
    step; and the graph has the fused node instead of those."""
    m = model_of(name, gguf_dir)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, m.hp.n_vocab, n).astype(np.int32) for n in (5, 1, 12, 7)]
    batch = Batch.from_sequences(prompts, [0, 1, 2, 3])
    ids = [0, 1, 2, 3]
    out = {}
    for fused in (False, True):
        c = cache_for(m, unified)
        got = _run_fused_or_not(m, c, batch, fused, monkeypatch, all_custom=True)
        pos = c.next_positions(ids)
        step = Batch(np.array([3, 17, 250, 64], dtype=np.int32), np.array([pos[s] for s in ids], dtype=np.int32),
                     tuple((s,) for s in ids))
        got2 = _run_fused_or_not(m, c, step, fused, monkeypatch, all_custom=True)
        out[fused] = (got.logits, got2.logits, c.k.copy(), c.v.copy())
    for a, b in zip(out[False], out[True]):
        assert np.isfinite(a).all() and a.any() and np.array_equal(a, b)
    # the graph: one fused node a layer, no rope node, no store node
    monkeypatch.setattr(model_graph, "ROPE_STORE", True)
    c = cache_for(m, unified)
    (ub, *_) = split_ubatches(batch, 16, "equal")
    g = build_ubatch_graph(c, plan_ubatch(c, ub), m.attn_config(), layer="model", model=m, tokens=batch.tokens,
                           out_rows=output_rows(ub, np.ones(batch.n_tokens, dtype=bool)), all_custom=True)
    try:
        names = {ggml.ggml_get_name(ggml.ggml_graph_node(g.graph, i)).decode() for i in range(ggml.ggml_graph_n_nodes(g.graph))}
        assert {"qk_rope_kv_store_l0", "qk_rope_kv_store_l1"} <= names
        assert not any(n.startswith(("qk_rope_l", "store_kv_l", "v_bias_l")) for n in names), names
    finally:
        g.free()


def test_rope_store_keeps_the_store_op_for_block_caches_and_refuses_bad_input(gguf_dir, monkeypatch):
    """Quantized caches keep the store op (its quantization): KVTensors.store_arrays is None for
    them; rope_store refuses mismatched shapes, caches and biases."""
    from ggml_attn.graph.kv_graph import kv_tensors
    m = model_of("llama", gguf_dir)
    hp = m.hp
    kv = kv_tensors(KVCache(256, 2, unified=True, n_layer=hp.n_layer, n_head_kv=hp.n_head_kv,
                            head_dim_k=hp.head_dim_k, type_k="q8_0", type_v="f16"))
    assert kv.store_arrays(0) is None
    c = cache_for(m, True)
    ck, cv = kv_tensors(c).store_arrays(1)
    assert ck.shape == (c.kv_size * c.n_stream, hp.n_head_kv * hp.head_dim_k) and ck.base is not None
    assert np.shares_memory(ck, c.k[1]) and np.shares_memory(cv, c.v[1])
    D = hp.head_dim_k
    rp = _hp(D, D, ROPE_NORMAL, 10000.0, 1.0)
    b = _builder()
    try:
        q = b.new(ggml.GGML_TYPE_F32, (3, 2 * D), np.float32, "q", np.zeros((3, 2 * D), np.float32))
        k = b.new(ggml.GGML_TYPE_F32, (3, hp.n_head_kv * D), np.float32, "k", np.zeros((3, hp.n_head_kv * D), np.float32))
        v = b.new(ggml.GGML_TYPE_F32, (3, hp.n_head_kv * D), np.float32, "v", np.zeros((3, hp.n_head_kv * D), np.float32))
        v2 = b.new(ggml.GGML_TYPE_F32, (2, hp.n_head_kv * D), np.float32, "v2", np.zeros((2, hp.n_head_kv * D), np.float32))
        pt = b.new(GGML_TYPE_I32, (3,), np.int32, "pos", np.arange(3, dtype=np.int32))
        rt = b.new(ggml.GGML_TYPE_I64, (3,), np.int64, "rows", np.arange(3, dtype=np.int64))
        with pytest.raises(ValueError, match="Q .* K .* V"):
            xp_ops.rope_store(b, q, k, v2, pt, rp, (ck, cv), rt)
        with pytest.raises(ValueError, match="cache rows"):
            xp_ops.rope_store(b, q, k, v, pt, rp, (ck[:, :D], cv), rt)
        with pytest.raises(ValueError, match="cache rows"):
            xp_ops.rope_store(b, q, k, v, pt, rp, (ck.astype(np.int16), cv), rt)
        with pytest.raises(ValueError, match="bias of shape"):
            xp_ops.rope_store(b, q, k, v, pt, rp, (ck, cv), rt, None, (None, None, np.zeros(3, np.float32)))
        rt2 = b.new(ggml.GGML_TYPE_I64, (2,), np.int64, "rows2", np.arange(2, dtype=np.int64))
        with pytest.raises(ValueError, match="2 cache rows for 3 tokens"):
            xp_ops.rope_store(b, q, k, v, pt, rp, (ck, cv), rt2)
    finally:
        _free(b)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_get_rows_matches_ggml(dtype):
    rng = np.random.default_rng(3)
    table = rng.standard_normal((50, 40)).astype(dtype)
    ids = np.array([3, 0, 49, 3, 17], dtype=np.int32)
    b = _builder()
    try:
        it = b.new(GGML_TYPE_I32, ids.shape, np.int32, "ids", ids.copy())
        gtype = ggml.GGML_TYPE_F16 if dtype == np.float16 else ggml.GGML_TYPE_F32
        tt = b.new(gtype, table.shape, dtype, "table", table.copy())
        # an F32 table is a graph tensor (the residual stream), an F16 one an array (a weight)
        got = xp_ops.get_rows(b, tt if dtype == np.float32 else table, it, "rows")
        ref = b.call(ggml.ggml_get_rows, tt, it)
        b.expand(got), b.expand(ref)
        _compute(b)
        assert b.array(got).dtype == np.float32
        np.testing.assert_array_equal(b.array(got), b.array(ref))
    finally:
        _free(b)


def test_add_bias_in_place():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, 24)).astype(np.float32)
    bias = rng.standard_normal(24).astype(np.float32)
    b = _builder()
    try:
        xt = b.new(ggml.GGML_TYPE_F32, x.shape, np.float32, "x", x.copy())
        y = xp_ops.add_bias(b, xt, bias, "vb")
        b.expand(y)
        _compute(b)
        np.testing.assert_array_equal(b.array(y), x + bias)
        assert y.contents.data == xt.contents.data
    finally:
        _free(b)


# ------------------------------------------------------------------ the CUDA source compiles
def test_model_ops_compile_with_nvrtc():
    """cuda/model_ops.cu, as kernels.model_ops_variant compiles it (the disk cache bypassed)."""
    from ggml_attn import kernels as K
    if not K.nvrtc_available():
        pytest.skip("NVRTC library not installed")
    for arch in ("sm_80", "sm_90"):
        c = K.compile_variant(K.model_ops_variant(), arch, use_disk_cache=False, extra_options=("-Xptxas=-v",))
        assert len(c.cubin) > 1000 and set(c.lowered) == set(K.MODEL_OPS_NAMES)
        usage = K.resource_usage(c.log)
        assert set(usage) >= set(K.MODEL_OPS_NAMES), usage
        for name, u in usage.items():
            assert u.get("spill_stores", 0) == 0, (arch, name, u)


# ------------------------------------------------------------------ on a GPU (CuPy cache)
@pytest.mark.gpu
@pytest.mark.skipif(not ggml_attn.gpu_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["qwen2-tied", "llama-freqs"])
@pytest.mark.parametrize("mode, unified", [("simple", True), ("padded", False)])
def test_cupy_device_form_matches_host(gguf_dir, name, mode, unified):
    """The CuPy kernels (get_rows, rope, bias; the dense ops' GEMV for the decode step, cuBLAS
    for the prompt) against the host graph."""
    import cupy
    m = model_of(name, gguf_dir)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, m.hp.n_vocab, n).astype(np.int32) for n in (5, 1, 12, 7)]
    hp = m.hp
    host_c = cache_for(m, unified)
    dev_c = KVCache(256, 4, unified=unified, n_layer=hp.n_layer, n_head_kv=hp.n_head_kv,
                    head_dim_k=hp.head_dim_k, xp="cupy")
    batch = Batch.from_sequences(prompts, [0, 1, 2, 3])
    ref = run_model_batch(host_c, batch, m, 8, mode, logits="all")
    got = run_model_batch(dev_c, batch, m, 8, mode, logits="all")
    cupy.cuda.get_current_stream().synchronize()
    _check(got.logits, ref.logits, name)
    ids = [0, 1, 2, 3]
    for s in ids:   # RoPE'd K and biased V as stored (F16)
        p1, k1, v1 = host_c.sequence_contents(s, 1)
        p2, k2, v2 = dev_c.sequence_contents(s, 1)
        assert np.array_equal(p1, p2)
        assert nmse(k2, k1) < 1e-5 and nmse(v2, v1) < 1e-5, (s, nmse(k2, k1), nmse(v2, v1))
    pos = host_c.next_positions(ids)
    step = Batch(np.array([3, 17, 250, 64], dtype=np.int32), np.array([pos[s] for s in ids], dtype=np.int32),
                 tuple((s,) for s in ids))
    ref = run_model_batch(host_c, step, m, 8, mode)
    got = run_model_batch(dev_c, step, m, 8, mode)
    _check(got.logits, ref.logits, name)
    print(f"{name} {mode} unified={unified}: decode NMSE {nmse(got.logits, ref.logits):.3g}")


@pytest.mark.gpu
@pytest.mark.skipif(not ggml_attn.gpu_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("unified, type_kv", [(True, "f16"), (False, "f16"), (True, "f32")])
def test_cupy_rope_store_gives_the_rope_and_store_bits(gguf_dir, name, unified, type_kv, monkeypatch):
    """xp_rope_store (model_graph.ROPE_STORE) on the GPU: the cache bits, the prompt logits and a
    decode step's logits equal to those of xp_rope then dense_kv_store (the same rotation,
    __float2half_rn in both), F16 and F32 caches."""
    import cupy
    m = model_of(name, gguf_dir)
    hp = m.hp
    rng = np.random.default_rng(13)
    prompts = [rng.integers(0, hp.n_vocab, n).astype(np.int32) for n in (5, 1, 12, 7)]
    batch = Batch.from_sequences(prompts, [0, 1, 2, 3])
    ids = [0, 1, 2, 3]
    out = {}
    for fused in (False, True):
        c = KVCache(256, 4, unified=unified, n_layer=hp.n_layer, n_head_kv=hp.n_head_kv, head_dim_k=hp.head_dim_k,
                    type_k=type_kv, type_v=type_kv, xp="cupy")
        c.k.fill(np.nan), c.v.fill(np.nan)   # (poisoned: a cell the store misses stays NaN)
        got = _run_fused_or_not(m, c, batch, fused, monkeypatch)
        pos = c.next_positions(ids)
        step = Batch(np.array([3, 17, 250, 64], dtype=np.int32), np.array([pos[s] for s in ids], dtype=np.int32),
                     tuple((s,) for s in ids))
        got2 = _run_fused_or_not(m, c, step, fused, monkeypatch)
        cupy.cuda.get_current_stream().synchronize()
        out[fused] = (got.logits, got2.logits, c.k.get(), c.v.get())
    for a, b in zip(out[False][:2], out[True][:2]):
        assert np.isfinite(a).all() and np.array_equal(a, b)
    for a, b in zip(out[False][2:], out[True][2:]):   # every cell: NaN where nothing was stored, in both
        assert np.array_equal(a, b, equal_nan=True) and np.isfinite(a).any()


# ------------------------------------------------ every architecture against llama.cpp
@pytest.mark.parametrize("name", ["qwen3-f32", "gemma-f32", "gemma-q8_0", "gemma2-f32", "qwen2-q8_0", "llama-q4_k",
                                  "llama-q4_k_m"])
@pytest.mark.parametrize("mode, unified", [("simple", True), ("equal", False)])
def test_device_form_matches_llamacpp(tmp_path_factory, name, mode, unified):
    """The device form of each architecture's block (qwen3's per-head Q/K norms, gemma's scaled
    embedding and GeGLU, gemma2's post-norms and soft-caps) on the llama.cpp fixtures: prompt
    logits within 5e-4 of llama.cpp's own (``tests/data/llamacpp_ref``); quantized files 1e-3, as
    on the GPU (``test_model.py``'s GPU test: block matrices multiply F32 activations where
    llama.cpp rounds them to 8 bits)."""
    import fixtures_gguf
    from test_model import REF_DIR, prompts_of, ref_of
    if not os.path.exists(os.path.join(REF_DIR, f"{name}.npz")):
        pytest.fail(f"llama.cpp's reference for {name} is missing from {REF_DIR}")
    d = str(tmp_path_factory.getbasetemp() / "llamacpp_fixtures")
    m = load_gguf(fixtures_gguf.fixture_path(name, d))
    ref = ref_of(name)
    prompts = prompts_of(ref)
    c = KVCache(256, len(prompts), unified=unified, n_layer=m.hp.n_layer, n_head_kv=m.hp.n_head_kv,
                head_dim_k=m.hp.head_dim_k)
    got = run_model_batch(c, Batch.from_sequences(prompts), m, 16, mode, logits="all", all_custom=True).logits
    off = 0
    for i, p in enumerate(prompts):
        e = nmse(got[off:off + len(p)], ref[f"logits_{i}"][:len(p)])
        assert e <= (1e-3 if fixtures_gguf.SPECS[name].wtype.startswith("Q") else 5e-4), (name, i, e)
        off += len(p)
