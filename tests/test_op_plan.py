"""The op's build-time state: plans as arguments (held weakly), the spec registry, and the one
place that chooses what runs (``dispatch.best_kernel``). CPU-only; the fast path's replay on
device pointers is in tests/test_graph_device.py."""
import collections
import gc
from dataclasses import replace

import ggml
import numpy as np
import pytest

import ggml_attn
from ggml_attn import dispatch, op
from ggml_attn.conformance import FACase, make_inputs
from ggml_attn.dispatch import CallFacts, best_kernel
from ggml_attn.dtypes import GGML_TYPE_BF16, GGML_TYPE_F16, GGML_TYPE_F32
from ggml_build import build_case, case_bytes, get_data, graph_of, new_context

CASE = FACase(hsk=64, hsv=64, n_head_kv=2, gqa=4, ne3=1, n_kv=96, n_batch=5, mask=True, sinks=False,
              max_bias=0.0, logit_softcap=0.0, kv_type=ggml.GGML_TYPE_F16)
GGML_TYPE_Q8_0, GGML_TYPE_Q4_0, GGML_TYPE_Q5_1 = 8, 2, 7


class FakePlan:
    """Stands in for cuda_backend.Plan on the CPU: the op only asks it ``matches``."""

    def __init__(self, ok=True):
        self.ok = ok

    def matches(self, mask, n_batch):
        return self.ok


@pytest.fixture
def case_ctx():
    x = make_inputs(CASE, np.random.default_rng(3))
    ctx = new_context(case_bytes(CASE))
    tensors = build_case(ctx, CASE, x)
    yield ctx, tensors, x
    ggml_attn.set_backend("auto")
    ggml.ggml_free(ctx)


def _node(ctx, tensors, **kw):
    q, k, v, mask, _ = tensors
    return ggml_attn.flash_attn_ext(ctx, q, k, v, mask, CASE.scale, 0.0, 0.0, **kw)


def test_plan_needs_a_mask_and_must_fit_it(case_ctx):
    ctx, (q, k, v, mask, _), _ = case_ctx
    with pytest.raises(ValueError, match="needs a mask"):
        ggml_attn.flash_attn_ext(ctx, q, k, v, None, CASE.scale, plan=FakePlan())
    with pytest.raises(ValueError, match="not made for this mask"):
        _node(ctx, (q, k, v, mask, None), plan=FakePlan(ok=False))
    with pytest.raises(ValueError, match="not made for this mask"):
        _node(ctx, (q, k, v, mask, None), plan=object())


def test_a_plan_freed_before_compute_is_a_clear_error(case_ctx):
    ctx, tensors, _ = case_ctx
    plan = FakePlan()
    out = _node(ctx, tensors, plan=plan)
    gf = graph_of(ctx, out)
    ggml_attn.compute_graph(ctx, gf, 1)          # alive: computes (CPU path ignores the plan)
    assert np.isfinite(get_data(out)).all()
    del plan
    gc.collect()
    with pytest.raises(ggml_attn.FlashAttnError, match="plan .* was freed"):
        ggml_attn.compute_graph(ctx, gf, 1)
    assert np.isnan(get_data(out)).all()


def test_specs_are_shared_without_a_plan_and_pruned_with_dead_plans(case_ctx):
    ctx, tensors, _ = case_ctx
    before = len(op._specs)
    outs = [_node(ctx, tensors) for _ in range(50)]
    assert len(op._specs) <= before + 1, "nodes without a plan share one spec per parameter set"
    ids = [op.userdata_of(o) for o in outs]
    assert len(set(ids)) == 50, "but each has an id of its own (its spec once bound on a GPU)"
    assert len({i & 0xFFFFFFFF for i in ids}) == 1 and all(op.spec_of(o) is op.spec_of(outs[0]) for o in outs)
    assert not op.spec_of(outs[0]).per_node
    plans = [FakePlan() for _ in range(3000)]
    for p in plans:
        _node(ctx, tensors, plan=p)
    assert len(op._specs) >= 3000
    del plans, p
    gc.collect()
    keep = FakePlan()
    for _ in range(3000):    # registering more prunes the specs whose plan is gone
        _node(ctx, tensors, plan=keep)
    assert len(op._specs) < before + 1 + 3000 + 1200


def test_plan_less_node_specs_are_capped(case_ctx, monkeypatch):
    """A plan-less node's own spec (made at its first bind on device pointers) is one of at most
    _MAX_NODE_SPECS: the oldest are dropped, and a dropped node falls back to the shared spec
    (its next call binds again)."""
    ctx, tensors, _ = case_ctx
    monkeypatch.setattr(op, "_MAX_NODE_SPECS", 8)
    monkeypatch.setattr(op, "_node_spec_ids", collections.deque())
    monkeypatch.setattr(op, "_node_bytes", [0])
    outs = [_node(ctx, tensors) for _ in range(12)]
    shared = op.spec_of(outs[0])
    own = [op._node_spec(op.userdata_of(o), shared) for o in outs]
    assert all(sp.per_node and sp.params == shared.params for sp in own)
    assert op._node_spec(op.userdata_of(outs[-1]), shared) is own[-1], "made once per node"
    assert [op.spec_of(o) is own[i] for i, o in enumerate(outs)] == [False] * 4 + [True] * 8
    assert all(op.spec_of(o) is shared for o in outs[:4])
    # the tile maps they hold: past _MAX_NODE_BYTES the oldest go, never the one just charged
    monkeypatch.setattr(op, "_MAX_NODE_BYTES", 1000)
    for sp in own[4:10]:
        op._charge_node_spec(sp, 300)
    assert [op.spec_of(o) is own[i] for i, o in enumerate(outs)] == [False] * 7 + [True] * 5
    assert op._node_bytes[0] == 900
    op._charge_node_spec(own[-1], 5000)   # more than the limit alone: kept, the others dropped
    assert [op.spec_of(o) is own[i] for i, o in enumerate(outs)] == [False] * 11 + [True]
    assert op._node_bytes[0] == 5000
    op._charge_node_spec(own[0], 10)      # dropped before: charges nothing
    assert op._node_bytes[0] == 5000


FACTS = CallFacts(n_batch=1, gqa=4, n_kv=4096, head_dim_k=128, head_dim_v=128, kv_type=GGML_TYPE_F16)


def test_best_kernel_answers_can_it_run_and_what_runs():
    assert best_kernel("auto", FACTS).kernel == "decode-tc"
    assert best_kernel("auto", CallFacts(512, 4, 4096, 128, 128, GGML_TYPE_BF16)).kernel == "prefill"
    assert best_kernel("auto", CallFacts(1, 4, 4096, 512, 512, GGML_TYPE_F16)).kernel == "decode"
    assert best_kernel("auto", CallFacts(1, 4, 4096, 128, 128, GGML_TYPE_F32)).kernel == "reference"
    assert best_kernel("auto", CallFacts(1, 4, 4096, 128, 128, GGML_TYPE_F16, kv_aligned=False)).kernel \
        == "reference"
    assert best_kernel("decode", FACTS).kernel == "decode"
    with pytest.raises(ValueError, match="cannot run this call"):
        best_kernel("prefill", CallFacts(1, 4, 4096, 512, 512, GGML_TYPE_F16))
    with pytest.raises(ValueError, match="kernel must be one of"):
        best_kernel("fast", FACTS)
    # where: backend settings, GPU presence, data location, quantized K/V
    assert best_kernel("auto", FACTS, backend="reference", on_device=False).kernel == "cpu"
    assert best_kernel("auto", FACTS, backend="reference", on_device=True).kernel == "reference"
    assert best_kernel("auto", FACTS, backend="auto", gpu=False, on_device=False).kernel == "cpu"
    with pytest.raises(RuntimeError, match="in GPU memory but there is no usable CUDA"):
        best_kernel("auto", FACTS, backend="auto", gpu=False, on_device=True)   # never "cpu" on device data
    with pytest.raises(RuntimeError, match="no usable CUDA"):
        best_kernel("auto", FACTS, backend="cuda", gpu=False)
    q8 = CallFacts(1, 4, 4096, 128, 128, GGML_TYPE_Q8_0)
    assert best_kernel("auto", q8, backend="auto", on_device=False).kernel == "cpu"
    # q8_0 / q4_0 in GPU memory: decode-shaped calls read the blocks (the sm_90a decode on
    # compute capability 9.0 when K/V go through its TMA boxes, else the CUDA-core decode);
    # larger batches run the tensor-core kernels on f16 copies, as does a tensor-core kernel
    # asked for by name; other quantized types there are an error naming what the GPU reads
    # (never a silent CPU path)
    for t in (GGML_TYPE_Q8_0, GGML_TYPE_Q4_0):
        for arch, tma_ok, want in (("sm_90", True, "decode-tma"), ("sm_90", False, "decode"), ("sm_80", True, "decode")):
            c = best_kernel("auto", CallFacts(4, 4, 4096, 128, 128, t, arch=arch, kv_tma=tma_ok),
                            backend="auto", on_device=True)
            assert c.kernel == want and "dequantizes" in c.reason, (arch, tma_ok, c)
        for arch, want in (("sm_90", "prefill-wgmma"), ("sm_80", "prefill")):
            c = best_kernel("auto", CallFacts(512, 4, 4096, 128, 128, t, arch=arch), backend="auto", on_device=True)
            assert c.kernel == want and "converted to f16" in c.reason, c
        c = best_kernel("auto", CallFacts(5, 4, 4096, 128, 128, t, arch="sm_90"))   # past the decode limit
        assert c.kernel == "prefill" and "converted to f16" in c.reason
    # K and V of different types: f16 beside q8_0/q4_0 (or those two) through f16 copies of the
    # quantized one, at every batch; the block readers refuse the pair; other pairs are an error
    for kt, vt in ((GGML_TYPE_F16, GGML_TYPE_Q8_0), (GGML_TYPE_Q4_0, GGML_TYPE_Q8_0), (GGML_TYPE_Q4_0, GGML_TYPE_F16)):
        for n_batch, want in ((1, "decode-tc"), (512, "prefill-wgmma")):
            c = best_kernel("auto", CallFacts(n_batch, 4, 4096, 128, 128, kt, arch="sm_90", v_type=vt))
            assert c.kernel == want and "converted to f16" in c.reason, (kt, vt, c)
        for name in ("decode", "decode-tma"):
            with pytest.raises(ValueError, match="reads K and V of one type"):
                best_kernel(name, CallFacts(1, 4, 4096, 128, 128, kt, arch="sm_90", v_type=vt))
        assert best_kernel("auto", CallFacts(1, 4, 4096, 128, 128, kt, v_type=vt), backend="auto",
                           on_device=False).kernel == "cpu"
    # ... and whichever kernel auto then runs reads the copies: the sm_90a decode too (a long row:
    # enough work for it), whose block-reading instances take K and V of one type only
    from ggml_attn.dispatch import reads_f16_copies
    c = best_kernel("auto", CallFacts(1, 4, 32768, 128, 128, GGML_TYPE_Q8_0, arch="sm_90", work_tiles=4096,
                                      work_even=True, v_type=GGML_TYPE_F16))
    assert c.kernel == "decode-tma" and reads_f16_copies(c.kernel, GGML_TYPE_Q8_0, GGML_TYPE_F16)
    assert reads_f16_copies("decode", GGML_TYPE_Q4_0, GGML_TYPE_Q8_0)
    assert not reads_f16_copies("decode-tma", GGML_TYPE_Q8_0, GGML_TYPE_Q8_0)
    assert reads_f16_copies("decode-tc", GGML_TYPE_Q8_0, GGML_TYPE_Q8_0)
    assert not reads_f16_copies("prefill", GGML_TYPE_F16, GGML_TYPE_F16)
    with pytest.raises(ValueError, match="K f16 / V bf16 in GPU memory"):
        best_kernel("auto", CallFacts(1, 4, 4096, 128, 128, GGML_TYPE_F16, v_type=GGML_TYPE_BF16))
    with pytest.raises(ValueError, match=r"\(bf16/q8_0\) in GPU memory"):
        best_kernel("auto", CallFacts(1, 4, 4096, 128, 128, GGML_TYPE_BF16, v_type=GGML_TYPE_Q8_0))
    # head sizes with only the CUDA-core kernel: that one at every batch
    assert best_kernel("auto", CallFacts(600, 4, 4096, 576, 512, GGML_TYPE_Q8_0, arch="sm_90")).kernel == "decode"
    assert best_kernel("decode", q8).kernel == "decode"
    assert "converted to f16" in best_kernel("prefill", q8).reason
    assert best_kernel("decode-tc", q8).kernel == "decode-tc"
    with pytest.raises(ValueError, match="compute capability 9.0"):
        best_kernel("decode-tma", q8)
    assert best_kernel("decode-tma", replace(q8, arch="sm_90")).kernel == "decode-tma"
    with pytest.raises(ValueError, match="heads packed in its row"):
        best_kernel("decode-tma", replace(q8, arch="sm_90", kv_tma=False))
    with pytest.raises(ValueError, match="D 128"):
        best_kernel("decode-tma", CallFacts(1, 4, 4096, 64, 64, GGML_TYPE_Q8_0, arch="sm_90"))
    with pytest.raises(ValueError, match="not compiled for the decode kernel"):
        best_kernel("decode", CallFacts(1, 4, 4096, 80, 80, GGML_TYPE_Q8_0))
    with pytest.raises(ValueError, match=r"\(q5_1\) in GPU memory: no GPU kernel reads them"):
        best_kernel("auto", CallFacts(1, 4, 4096, 128, 128, GGML_TYPE_Q5_1), backend="auto", on_device=True)
    with pytest.raises(ValueError, match="backend 'cuda' runs them from GPU memory only"):
        best_kernel("auto", q8, backend="cuda", on_device=False)
    assert best_kernel("auto", CallFacts(1, 4, 4096, 128, 128, GGML_TYPE_Q8_0, kv_aligned=False)).kernel \
        == "reference"


def test_best_kernel_is_asked_by_the_op_and_the_plan_only():
    """#45: one decision in one place. best_kernel is called by the op (calls the GPU backend
    does not take whole) and by cuda_plan.decide (the backend's calls, with or without a
    plan), nowhere else in the package; dispatch's own helpers aside."""
    import ast
    import pathlib
    root = pathlib.Path(ggml_attn.__file__).parent
    sites = collections.Counter()
    for path in [*root.glob("*.py"), *(root.parent / "graph").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                if name == "best_kernel":
                    sites[path.name] += 1
    assert {f: n for f, n in sites.items() if f != "dispatch.py"} == {"op.py": 1, "cuda_plan.py": 1}


@pytest.mark.parametrize("backend, on_device, want", [
    ("auto", True, ("bind", "auto")), ("reference", True, ("bind", "reference")),
    ("auto", False, ("host", "auto")), ("cuda", False, ("host", "auto"))])
def test_the_op_routes_device_data_to_the_backend_without_choosing(case_ctx, monkeypatch, backend, on_device, want):
    """Device data on the GPU backend goes to bind under the op's kernel setting (the backend's
    plan decides; the op asks best_kernel nothing), 'reference' too; host data with a usable
    GPU: the op asks best_kernel once, then stages the call under the setting (the backend
    decides on the staged call's facts)."""
    from ggml_attn import cuda_backend
    ctx, tensors, _ = case_ctx
    asked, ran = [], []
    real = dispatch.best_kernel
    monkeypatch.setattr(dispatch, "best_kernel", lambda *a, **kw: asked.append(a[0]) or real(*a, **kw))
    monkeypatch.setattr(op, "gpu_available", lambda: True)
    monkeypatch.setattr(op, "_is_device_pointer", lambda ptr: on_device)
    monkeypatch.setattr(op, "_maybe_device_pointer", lambda ptr: on_device)   # (backend 'reference')
    monkeypatch.setattr(op, "_device_arch", lambda: "sm_90")
    monkeypatch.setattr(op, "_bind_and_launch", lambda *a, kernel, **kw: ran.append(("bind", kernel)))
    monkeypatch.setattr(cuda_backend, "run_host_on_gpu", lambda *a, kernel, **kw: ran.append(("host", kernel)))
    ggml_attn.set_backend(backend)
    node = _node(ctx, tensors)
    ggml_attn.compute_graph(ctx, graph_of(ctx, node), 1)
    assert ran == [want]
    assert asked == ([] if on_device else ["auto"])


def test_the_plan_keeps_its_decisions(monkeypatch):
    """cuda_plan.decide asks best_kernel once per (kernel, call facts) of a plan: every later
    call with the same facts (each layer of a ubatch) gets the kept decision; other facts
    (a misaligned V, softcap), another kernel or a knob set ask again."""
    from ggml_attn import cuda_plan, dispatch as D
    from ggml_attn.tensor import TensorDesc
    from ggml_attn.validate import AttnDims
    asked = []
    real = D.best_kernel
    monkeypatch.setattr(D, "best_kernel", lambda *a, **kw: asked.append(a[0]) or real(*a, **kw))
    mask = TensorDesc(0x1000, GGML_TYPE_F16, (4096, 16, 1, 1), (2, 8192, 8192 * 16, 8192 * 16))
    plan = cuda_plan.Plan(mask, 1, 32, 8)
    dims = AttnDims(128, 128, 1, 32, 8, 1, 4096)
    kv = TensorDesc(0x10000, GGML_TYPE_F16, (128, 4096, 8, 1), (2, 256, 256 * 4096, 256 * 4096 * 8))
    first = cuda_plan.decide("auto", dims, plan=plan, k=kv, v=kv, arch="sm_90")
    for _ in range(31):
        assert cuda_plan.decide("auto", dims, plan=plan, k=kv, v=kv, arch="sm_90") is first
    assert asked == ["auto"] and first.kernel == "decode-tc"
    odd = TensorDesc(0x10004, GGML_TYPE_F16, kv.ne, kv.nb)
    assert cuda_plan.decide("auto", dims, plan=plan, k=kv, v=odd, arch="sm_90").kernel == "reference"
    assert cuda_plan.decide("auto", dims, plan=plan, k=kv, v=kv, arch="sm_90", plain=False).kernel == "decode-tc"
    assert cuda_plan.decide("prefill", dims, plan=plan, k=kv, v=kv, arch="sm_90").kernel == "prefill"
    assert len(asked) == 4
    monkeypatch.setattr(D, "CELLS_MIN_GAIN", D.CELLS_MIN_GAIN)   # a knob set: decisions made again
    cuda_plan.decide("auto", dims, plan=plan, k=kv, v=kv, arch="sm_90")
    assert len(asked) == 5
    assert cuda_plan.decide("auto", dims, arch="sm_90") == first and len(asked) == 6, "no plan: no memory"


@pytest.mark.parametrize("plan, mask", [(True, True), (False, True), (False, False)],
                         ids=["plan", "mask-no-plan", "no-mask-no-plan"])
def test_bound_nodes_take_the_fast_path(plan, mask):
    """tools/dev/op_overhead_bench.py's graph: every node bound to a (no-op) launch is relaunched by
    the callback without descriptors or validation (its run() asserts one launch per node and
    compute) -- with a plan, and with ggml's own signature (no plan, with or without a mask)."""
    import op_overhead_bench  # tools/dev/ (on sys.path via conftest)
    res = op_overhead_bench.run(n=4, reps=3, plan=plan, mask=mask)
    assert set(res) == {"plain", "computing"} and all(v > 0 for v in res.values())


def test_a_bound_node_whose_plan_is_gone_is_not_relaunched(case_ctx, monkeypatch):
    """The fast path relaunches a bound call only while the build-time plan lives (the call
    reads the plan's buffers): after the plan is freed the node fails clearly instead."""
    import ctypes
    ctx, tensors, _ = case_ctx
    plan = FakePlan()
    out = _node(ctx, tensors, plan=plan)
    gf = graph_of(ctx, out)
    launches = []

    class Stream:
        ptr = 0
    spec = op.spec_of(out)
    spec.bound = op.fast_record(ctypes.addressof(out.contents), 3 + CASE.mask + CASE.sinks,
                                lambda: launches.append(1), 0)
    monkeypatch.setattr(op, "_current_stream", Stream)
    ggml_attn.compute_graph(ctx, gf, 1)
    assert launches == [1], "a live plan: the bound call is relaunched"
    del plan
    gc.collect()
    with pytest.raises(ggml_attn.FlashAttnError, match="freed"):
        ggml_attn.compute_graph(ctx, gf, 1)
    assert launches == [1]


def test_decode_host_bench_runs_the_driver_without_compute():
    import decode_host_bench  # tools/dev/
    assert decode_host_bench.run(steps=3, reps=1) > 0
    assert decode_host_bench.run(steps=2, reps=1, seqs=8) > 0   # a step of 8 sequences


def test_every_gpu_choice_launches():
    """Whatever best_kernel answers for a GPU kernel -- auto or by name, every head size family,
    K/V type pair (mixed too), batch, context, architecture, softcap/ALiBi or not, mask verdict,
    TMA-readable views or not -- the backend can launch: the kernel takes the head sizes and the
    type it reads (its f16 copies where dispatch.reads_f16_copies says so: the mixed pairs on the
    block readers were bound without copies before), the sm_90a kernels only on sm_90, plain
    calls only there, the quantized sm_90a decode only on TMA-readable views, and the launch
    configuration names an instance of its program."""
    import itertools

    from ggml_attn import cuda_launch as L
    from ggml_attn import dispatch
    F16, BF16, Q8, Q4 = GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0
    heads = [(40, 40), (128, 128), (192, 128), (256, 256), (576, 512)]
    pairs = [(F16, F16), (BF16, BF16), (Q8, Q8), (Q4, Q4), (Q8, F16), (F16, Q4), (Q4, Q8)]
    seen = set()
    for (dk, dv), (kt, vt), gqa, nb, nkv, arch, kern, plain, mask, tma in itertools.product(
            heads, pairs, (1, 8), (1, 16, 600), (100, 40000), ("sm_90", "sm_80"),
            ("auto",) + dispatch.GPU_KERNELS, (True, False), ("none", "masked"), (True, False)):
        sh = L.AttnDims(dk, dv, nb, gqa * 8, 8, 1, nkv, kt, v_type=None if vt == kt else vt)
        try:
            c = dispatch.best_kernel(kern, dispatch.call_facts(sh, arch=arch, plain=plain, mask_tiles=mask, kv_tma=tma))
        except ValueError:
            continue
        if not c.on_gpu:
            continue
        t = F16 if dispatch.reads_f16_copies(c.kernel, kt, vt) else kt
        case = (dk, dv, kt, vt, gqa, nb, nkv, arch, kern, plain, mask, tma, c.kernel)
        assert dispatch.supports(c.kernel, dk, dv, t) is None, case
        assert kt == vt or t == F16, case   # one instance reads K and V of one type
        assert arch == "sm_90" or c.kernel not in ("prefill-wgmma", "decode-tma"), case
        assert plain or c.kernel not in ("prefill-wgmma", "decode-tma"), case
        assert tma or not (c.kernel == "decode-tma" and t in (Q8, Q4)), case
        cfg = L.launch_config(c.kernel, L.AttnDims(dk, dv, nb, gqa * 8, 8, 1, nkv, t), blocks_per_sm=1, ext=not plain)
        assert cfg.name in cfg.variant.names, case
        seen.add((c.kernel, t == kt))
    assert {k for k, _ in seen} == set(dispatch.GPU_KERNELS) and ("decode-tma", False) in seen
