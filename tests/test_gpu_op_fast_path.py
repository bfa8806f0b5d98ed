"""The op called with ggml's own signature (no ``plan=``, with or without a mask) in a
device-resident ggml graph: every node keeps its bound call and replays it on the next compute
(no validation, no planning), and a plan-less masked node rebuilds its tile map from the mask
before each replay, so a mask whose contents change between computes (same tensor) still gives
the right answer. GPU only; the CPU side of the registry is in tests/test_op_plan.py."""
import ctypes

import numpy as np
import pytest

import ggml_attn
from ggml_attn import cuda_backend, op
from ggml_attn.dtypes import GGML_TYPE_F16, GGML_TYPE_F32
from ggml_attn.reference import flash_attn_ext as reference, nmse

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ggml_attn.gpu_available(), reason="needs a CUDA GPU")]

H, HKV, D = 8, 2, 64
N_LAYER = 2


def _mask(rng, n_rows: int, n_kv: int, n_batch: int, kind: str) -> np.ndarray:
    """f16 numpy [1, 1, n_rows, n_kv]: 0 visible, -inf hidden; every one of the n_batch rows
    sees at least one cell. ``kind``: "causal-<offset>" (row i sees cells <= offset + i) or
    "window-<lo>" (cells >= lo, whole KV tiles hidden before it) with a few random holes."""
    m = np.full((1, 1, n_rows, n_kv), -np.inf, np.float16)
    name, arg = kind.split("-")
    arg = int(arg)
    for i in range(n_batch):
        if name == "causal":
            m[0, 0, i, :min(n_kv, arg + i + 1)] = 0
        else:
            m[0, 0, i, arg:] = 0
    holes = rng.random((n_batch, n_kv)) < 0.1
    holes[:, -1] = False
    if name == "causal":
        holes[:, 0] = False
    m[0, 0, :n_batch][holes] = -np.inf
    return m


class _DeviceGraph:
    """N_LAYER op nodes built with ggml's own signature on CuPy arrays (numpy order)."""

    def __init__(self, n_batch: int, n_kv: int, n_rows: int, with_mask: bool, rng, d: int = D):
        import cupy as cp
        import ggml
        self.cp, self.ggml = cp, ggml
        n = 8 * N_LAYER + 8
        self.ctx = ggml.ggml_init(ggml.ggml_init_params(
            mem_size=n * ggml.ggml_tensor_overhead() + ggml.ggml_graph_overhead_custom(n, False) + 4096,
            mem_buffer=None, no_alloc=True))
        self.keep = []
        self.gf = ggml.ggml_new_graph_custom(self.ctx, n, False)
        self.q, self.k, self.v, self.out, self.nodes = [], [], [], [], []
        self.mask = cp.zeros((1, 1, n_rows, n_kv), cp.float16) if with_mask else None
        mask_t = self._tensor(GGML_TYPE_F16, self.mask) if with_mask else None
        self.d = d
        for _ in range(N_LAYER):
            q = cp.asarray(rng.standard_normal((1, H, n_batch, d), dtype=np.float32))
            k = cp.asarray(rng.standard_normal((1, HKV, n_kv, d), dtype=np.float32).astype(np.float16))
            v = cp.asarray(rng.standard_normal((1, HKV, n_kv, d), dtype=np.float32).astype(np.float16))
            node = ggml_attn.flash_attn_ext(self.ctx, self._tensor(GGML_TYPE_F32, q), self._tensor(GGML_TYPE_F16, k),
                                            self._tensor(GGML_TYPE_F16, v), mask_t, 1.0 / np.sqrt(d))
            out = cp.empty((1, n_batch, H, d), cp.float32)
            node.contents.data = ctypes.c_void_p(int(out.data.ptr))
            ggml.ggml_build_forward_expand(self.gf, node)
            self.q.append(q), self.k.append(k), self.v.append(v), self.out.append(out), self.nodes.append(node)

    def _tensor(self, type_, arr):
        ne = list(reversed(arr.shape))
        t = self.ggml.ggml_new_tensor(self.ctx, type_, 4, (ctypes.c_int64 * 4)(*ne))
        t.contents.data = ctypes.c_void_p(int(arr.data.ptr))
        self.keep.append(arr)
        return t

    def compute(self) -> list[np.ndarray]:
        for o in self.out:
            o.fill(np.nan)   # poisoned: a launch that did not run shows
        ggml_attn.compute_graph(self.ctx, self.gf, 1)
        self.cp.cuda.get_current_stream().synchronize()
        return [o.get() for o in self.out]

    def expected(self, n_batch: int) -> list[np.ndarray]:
        m = None if self.mask is None else self.mask.get()[:, :, :n_batch]
        return [reference(q.get().astype(np.float64), k.get(), v.get(), m, 1.0 / np.sqrt(self.d), kv_type=GGML_TYPE_F16)
                for q, k, v in zip(self.q, self.k, self.v)]

    def free(self):
        self.ggml.ggml_free(self.ctx)


@pytest.mark.parametrize("n_batch, n_kv, n_rows, masks", [
    (1, 1000, 1, None),                                   # decode, no mask: the case
    (1, 1000, 1, ("causal-700", "window-512")),           # decode, masked: whole tiles hidden the second time
    (4, 2000, 4, ("window-64", "causal-1500")),
    (70, 300, 72, ("causal-230", "window-128")),          # prefill; rows of 600 bytes: the aligned mask copy
], ids=["decode-no-mask", "decode-mask", "decode4-mask", "prefill-mask"])
def test_plan_less_nodes_replay_and_follow_the_mask(monkeypatch, n_batch, n_kv, n_rows, masks):
    rng = np.random.default_rng(n_batch * 7 + n_kv)
    g = _DeviceGraph(n_batch, n_kv, n_rows, masks is not None, rng)
    binds = []
    real_bind = cuda_backend.bind
    monkeypatch.setattr(cuda_backend, "bind", lambda *a, **kw: binds.append(1) or real_bind(*a, **kw))
    try:
        rounds = masks or ("none", "none")
        for i, kind in enumerate(rounds):
            if g.mask is not None:   # the same tensor, new contents
                g.mask[...] = g.cp.asarray(_mask(rng, n_rows, n_kv, n_batch, kind))
            got, want = g.compute(), g.expected(n_batch)
            for a, b in zip(got, want):
                assert np.isfinite(a).all()
                assert nmse(a, b) <= 5e-4, (kind, nmse(a, b))
            assert len(binds) == N_LAYER, "the first compute binds each node once; later ones replay"
            for node in g.nodes:
                spec = op.spec_of(node)
                assert spec.per_node and spec.bound is not None and spec.plan_ref is None
        g.q[0][...] = g.cp.asarray(rng.standard_normal(g.q[0].shape, dtype=np.float32))
        got, want = g.compute(), g.expected(n_batch)
        assert len(binds) == N_LAYER and nmse(got[0], want[0]) <= 5e-4, "new Q data: replayed, right"
    finally:
        g.free()


@pytest.mark.parametrize("kernel, n_batch, n_kv", [("prefill-wgmma", 256, 640), ("decode-tma", 1, 4096)])
def test_forced_sm90a_kernels_run_on_an_sm90_gpu(kernel, n_batch, n_kv):
    """set_backend("cuda", <an sm_90a kernel>) runs that kernel on an H100/H200 through the op (it
    was refused there: the op chose without the device's architecture) and gives the right result."""
    from ggml_attn.kernels import device_arch
    if device_arch() != "sm_90":
        pytest.skip(f"the sm_90a kernels need an sm_90 GPU; this one is {device_arch()}")
    g = _DeviceGraph(n_batch, n_kv, n_batch, True, np.random.default_rng(11), d=128)
    g.mask[...] = g.cp.asarray(_mask(np.random.default_rng(12), n_batch, n_kv, n_batch, f"causal-{n_kv - n_batch}"))
    ggml_attn.set_backend("cuda", kernel)
    try:
        got, want = g.compute(), g.expected(n_batch)
        assert all(op.spec_of(node).call.kern == kernel for node in g.nodes)
        assert all(nmse(a, b) <= 5e-4 for a, b in zip(got, want))
    finally:
        ggml_attn.set_backend("auto")
        g.free()
