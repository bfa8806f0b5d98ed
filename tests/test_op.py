"""Behaviour of the drop-in op beyond the numbers: graphs, threads, backends, error capture."""
import gc
import logging
import subprocess
import sys
import types

import ggml
import numpy as np
import pytest

import ggml_attn
from ggml_attn import reference
from ggml_attn.conformance import FACase, make_inputs
from ggml_build import build_case, case_bytes, get_data, ggml_reference_node, graph_of, new_context

CASE = FACase(hsk=64, hsv=64, n_head_kv=2, gqa=4, ne3=2, n_kv=113, n_batch=5, mask=True, sinks=True,
              max_bias=8.0, logit_softcap=0.0, kv_type=ggml.GGML_TYPE_F16)


@pytest.fixture
def case_ctx():
    x = make_inputs(CASE, np.random.default_rng(7))
    ctx = new_context(case_bytes(CASE))
    tensors = build_case(ctx, CASE, x)
    yield ctx, tensors, x
    ggml_attn.set_backend("auto")
    ggml.ggml_free(ctx)


def expected(x):
    return reference.flash_attn_ext(x.q, x.k, x.v, x.mask, CASE.scale, CASE.max_bias, 0.0, x.sinks,
                                    kv_type=CASE.kv_type)


def make_node(ctx, tensors):
    q, k, v, mask, sinks = tensors
    return ggml_attn.flash_attn_ext(ctx, q, k, v, mask, CASE.scale, CASE.max_bias, 0.0, sinks)


@pytest.mark.parametrize("n_threads", [1, 2, 3, 8])
def test_any_thread_count_gives_the_same_result(case_ctx, n_threads):
    ctx, tensors, x = case_ctx
    out = make_node(ctx, tensors)
    ggml_attn.compute_graph(ctx, graph_of(ctx, out), n_threads)
    assert reference.nmse(get_data(out), expected(x)) < 1e-6


def test_result_feeds_builtin_ops(case_ctx):
    """The op sits in a graph next to ggml's own ops: scale(ours) + ggml's FA."""
    ctx, tensors, x = case_ctx
    ours = make_node(ctx, tensors)
    theirs = ggml_reference_node(ctx, *tensors, CASE)
    total = ggml.ggml_add(ctx, ggml.ggml_scale(ctx, ours, 2.0), theirs)
    ggml_attn.compute_graph(ctx, graph_of(ctx, total), 2)
    assert reference.nmse(get_data(total), 3.0 * expected(x)) < 5e-4


def test_callback_outlives_the_python_objects_that_built_the_node(case_ctx):
    ctx, tensors, x = case_ctx

    def build():
        return graph_of(ctx, make_node(ctx, tensors))

    gf = build()
    gc.collect()
    ggml_attn.compute_graph(ctx, gf, 2)
    out = ggml.ggml_graph_node(gf, -1)
    assert reference.nmse(get_data(out), expected(x)) < 1e-6


def test_backend_api_cpu():
    """Tensors in a CPU backend buffer, computed by ggml_backend_graph_compute."""
    x = make_inputs(CASE, np.random.default_rng(3))
    params = ggml.ggml_init_params(mem_size=ggml.ggml_tensor_overhead() * 32 + ggml.ggml_graph_overhead(),
                                   mem_buffer=None, no_alloc=True)
    ctx = ggml.ggml_init(params)
    c = CASE
    q = ggml.ggml_new_tensor_4d(ctx, 0, c.hsk, c.n_batch, c.n_head, c.ne3)
    k = ggml.ggml_new_tensor_4d(ctx, c.kv_type, c.hsk, c.n_kv, c.n_head_kv, c.ne3)
    v = ggml.ggml_new_tensor_4d(ctx, c.kv_type, c.hsv, c.n_kv, c.n_head_kv, c.ne3)
    m = ggml.ggml_new_tensor_4d(ctx, 1, c.n_kv, c.n_batch, 1, c.ne3)
    s = ggml.ggml_new_tensor_1d(ctx, 0, c.n_head)
    out = ggml_attn.flash_attn_ext(ctx, q, k, v, m, c.scale, c.max_bias, 0.0, s)
    gf = graph_of(ctx, out)
    backend = ggml.ggml_backend_cpu_init()
    buf = ggml.ggml_backend_alloc_ctx_tensors(ctx, backend)
    try:
        for t, a in ((q, x.q), (k, x.k), (v, x.v), (m, x.mask), (s, x.sinks)):
            a = np.ascontiguousarray(a)
            ggml.ggml_backend_tensor_set(t, a.ctypes.data, 0, a.nbytes)
        assert ggml.ggml_backend_graph_compute(backend, gf) == 0
        ggml_attn.raise_pending()
        res = np.empty((c.ne3, c.n_batch, c.n_head, c.hsv), np.float32)
        ggml.ggml_backend_tensor_get(out, res.ctypes.data, 0, res.nbytes)
    finally:
        ggml.ggml_backend_buffer_free(buf)
        ggml.ggml_backend_free(backend)
        ggml.ggml_free(ctx)
    assert reference.nmse(res, expected(x)) < 1e-6


def test_error_in_callback_is_reraised_by_compute_graph(case_ctx, monkeypatch):
    ctx, tensors, x = case_ctx
    out = make_node(ctx, tensors)
    monkeypatch.setattr(ggml_attn.cpu, "flash_attn_ext_host", _boom)
    with pytest.raises(ggml_attn.FlashAttnError, match="planted failure"):
        ggml_attn.compute_graph(ctx, graph_of(ctx, out), 2)
    assert np.isnan(get_data(out)).all(), "output must be poisoned, not left unwritten"
    assert ggml_attn.runtime.pending_errors() == []


def test_plain_compute_fails_loudly(case_ctx, monkeypatch, caplog):
    """Plain ggml_graph_compute_with_ctx: the error is logged, the output is NaN, and
    raise_pending() raises it afterwards."""
    ctx, tensors, x = case_ctx
    out = make_node(ctx, tensors)
    monkeypatch.setattr(ggml_attn.cpu, "flash_attn_ext_host", _boom)
    with caplog.at_level(logging.ERROR, logger="ggml_attn"):
        ggml.ggml_graph_compute_with_ctx(ctx, graph_of(ctx, out), 1)
    assert "planted failure" in caplog.text
    assert np.isnan(get_data(out)).all()
    with pytest.raises(ggml_attn.FlashAttnError):
        ggml_attn.raise_pending()


def test_cuda_backend_requested_without_gpu_fails_clearly(case_ctx, monkeypatch):
    """set_backend('cuda') checks for a GPU itself (tests/test_op_errors.py); should the GPU
    vanish afterwards, the compute still fails clearly."""
    if ggml_attn.gpu_available():
        pytest.skip("a GPU is present: this checks the no-GPU path")
    ctx, tensors, x = case_ctx
    out = make_node(ctx, tensors)
    monkeypatch.setitem(ggml_attn.op._settings, "backend", "cuda")
    with pytest.raises(ggml_attn.FlashAttnError, match="no usable CUDA"):
        ggml_attn.compute_graph(ctx, graph_of(ctx, out), 1)


def test_device_data_never_reaches_the_numpy_path(case_ctx, monkeypatch):
    """The numpy path reads its tensors through host pointers; handed a device graph's pointers
    it segfaults (seen once on the GPU host: a device graph's op took the numpy path, which the
    op chose whenever it did not consider a GPU: backend 'reference', or gpu_available() False).
    Data on the device goes to the reference on host copies (backend 'reference', through
    _bind_and_launch) or fails clearly. No GPU needed: the op is told that q is device memory."""
    ctx, tensors, x = case_ctx
    out = make_node(ctx, tensors)
    gf = graph_of(ctx, out)
    q_ptr = int(tensors[0].contents.data)
    monkeypatch.setitem(sys.modules, "cupy", sys.modules.get("cupy") or types.ModuleType("cupy"))
    monkeypatch.setattr(ggml_attn.op, "_is_device_pointer", lambda ptr: ptr == q_ptr)
    monkeypatch.setattr(ggml_attn.cpu, "flash_attn_ext_host", _boom)   # the numpy path must not run
    bound = []
    monkeypatch.setattr(ggml_attn.op, "_bind_and_launch", lambda *a, **kw: bound.append(kw["kernel"]))
    ggml_attn.set_backend("reference", kernel="prefill")
    ggml_attn.compute_graph(ctx, gf, 2)
    assert bound == ["reference"], "one call (graph thread 0), the reference on host copies"
    ggml_attn.set_backend("auto")
    monkeypatch.setattr(ggml_attn.op, "gpu_available", lambda: False)
    with pytest.raises(ggml_attn.FlashAttnError, match="in GPU memory but there is no usable CUDA"):
        ggml_attn.compute_graph(ctx, gf, 2)
    assert bound == ["reference"]


def test_set_backend_rejects_unknown():
    with pytest.raises(ValueError, match="backend must be one of"):
        ggml_attn.set_backend("tpu")


def test_import_and_compute_without_cupy():
    code = (
        "import sys; sys.modules['cupy'] = None\n"
        "import numpy as np, ggml, ggml_attn\n"
        "from ggml_attn.tensor import as_numpy, from_ggml\n"
        "ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=1 << 24, mem_buffer=None))\n"
        "q = ggml.ggml_new_tensor_4d(ctx, 0, 64, 2, 2, 1); k = ggml.ggml_new_tensor_4d(ctx, 1, 64, 8, 1, 1)\n"
        "for t in (q, k): as_numpy(from_ggml(t))[...] = 0.5\n"
        "out = ggml_attn.flash_attn_ext(ctx, q, k, k, None, 0.125)\n"
        "gf = ggml.ggml_new_graph(ctx); ggml.ggml_build_forward_expand(gf, out)\n"
        "ggml_attn.compute_graph(ctx, gf, 2)\n"
        "print(float(as_numpy(from_ggml(out)).mean()))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert float(r.stdout.strip()) == pytest.approx(0.5, rel=1e-3)


def _boom(*args, **kwargs):
    raise RuntimeError("planted failure")


def test_ctrl_c_inside_the_callback_stays_keyboard_interrupt(case_ctx, monkeypatch):
    ctx, tensors, x = case_ctx
    out = make_node(ctx, tensors)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ggml_attn.cpu, "flash_attn_ext_host", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ggml_attn.compute_graph(ctx, graph_of(ctx, out), 1)


RECOMPUTE = r"""
import ggml, numpy as np, ggml_attn
from ggml.utils import to_numpy
D, n_kv, n_batch, n_head, n_head_kv = 64, 256, 4, 8, 2
ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=2 << 20, mem_buffer=None))
q = ggml.ggml_new_tensor_4d(ctx, ggml.GGML_TYPE_F32, D, n_batch, n_head, 1)
k = ggml.ggml_new_tensor_4d(ctx, ggml.GGML_TYPE_F16, D, n_kv, n_head_kv, 1)
v = ggml.ggml_new_tensor_4d(ctx, ggml.GGML_TYPE_F16, D, n_kv, n_head_kv, 1)
rng = np.random.default_rng(0)
for t, shape in ((q, (n_head, n_batch, D)), (k, (n_head_kv, n_kv, D)), (v, (n_head_kv, n_kv, D))):
    to_numpy(t)[...] = rng.standard_normal(shape)
ours = ggml_attn.flash_attn_ext(ctx, q, k, v, None, 1 / np.sqrt(D))
theirs = ggml.ggml_flash_attn_ext(ctx, q, k, v, None, 1 / np.sqrt(D), 0.0, 0.0)
gf = ggml.ggml_new_graph(ctx)
ggml.ggml_build_forward_expand(gf, ours)
ggml.ggml_build_forward_expand(gf, theirs)
used = ggml.ggml_used_mem(ctx)
for i in range(10000):
    ggml_attn.compute_graph(ctx, gf, 2)
assert ggml.ggml_used_mem(ctx) == used, (used, ggml.ggml_used_mem(ctx))
assert ggml_attn.nmse(to_numpy(ours), to_numpy(theirs)) < 1e-5
print("computed 10000 times")
"""


def test_compute_graph_can_recompute_a_graph_forever():
    """README's graph computed 10,000 times in a 2 MiB context: compute_graph takes its work
    buffer from no context (ggml_graph_compute_with_ctx took a new one from the graph's context
    at every call: the context ran out within a few hundred computes and ggml aborted)."""
    r = subprocess.run([sys.executable, "-c", RECOMPUTE], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "computed 10000 times" in r.stdout, r.stderr[-2000:]
