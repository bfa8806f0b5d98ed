"""Errors of the op stay with the graph compute (and thread) that raised them; Ctrl-C stops a
graph at the next op node; bad arguments are ValueErrors naming the argument; the BLAS limit
holds in any thread."""
import ctypes
import signal
import threading

import ggml
import numpy as np
import pytest

import ggml_attn
from ggml_attn import op, reference, runtime
from ggml_attn.conformance import FACase, make_inputs
from ggml_build import build_case, case_bytes, get_data, graph_of, new_context

CASE = FACase(hsk=64, hsv=64, n_head_kv=2, gqa=2, ne3=1, n_kv=128, n_batch=4, mask=True, sinks=False,
              max_bias=0.0, logit_softcap=0.0, kv_type=ggml.GGML_TYPE_F16)


class Graphs:
    """One context holding the case's inputs and any number of op nodes / graphs on them."""

    def __init__(self, n_bytes_extra=0):
        self.x = make_inputs(CASE, np.random.default_rng(5))
        self.ctx = new_context(case_bytes(CASE) + n_bytes_extra)
        self.ins = build_case(self.ctx, CASE, self.x)
        self.expect = reference.flash_attn_ext(self.x.q, *self.x.kv_float(), self.x.mask, CASE.scale)

    def node(self, name=None):
        q, k, v, mask, _ = self.ins
        out = ggml_attn.flash_attn_ext(self.ctx, q, k, v, mask, CASE.scale)
        if name:
            ggml.ggml_set_name(out, name.encode())
        return out

    def graph(self, *nodes):
        return graph_of(self.ctx, *nodes)

    def free(self):
        ggml.ggml_free(self.ctx)


@pytest.fixture
def gs():
    g = Graphs(1 << 20)
    yield g
    op.set_backend("auto")
    g.free()


def failing_for(*nodes):
    """A CPU path that raises for the op nodes ``nodes`` (by their data) and computes otherwise."""
    real = ggml_attn.cpu.flash_attn_ext_host
    bad = {int(n.contents.data): n.contents.name.decode() for n in nodes}

    def host(q, k, v, mask, sinks, dst, *a, **kw):
        if dst.ptr in bad:
            raise RuntimeError(f"planted failure in {bad[dst.ptr]}")
        return real(q, k, v, mask, sinks, dst, *a, **kw)
    return host


# ------------------------------------------------------------------ errors stay with their graph
def test_plain_compute_error_on_x_is_not_raised_by_compute_graph_on_y(gs, monkeypatch):
    bad, good = gs.node("bad"), gs.node("good")
    monkeypatch.setattr(ggml_attn.cpu, "flash_attn_ext_host", failing_for(bad))
    gx, gy = gs.graph(bad), gs.graph(good)
    ggml.ggml_graph_compute_with_ctx(gs.ctx, gx, 2)      # error recorded, not raised
    ggml_attn.compute_graph(gs.ctx, gy, 2)              # Y is fine: no error of X here
    assert reference.nmse(get_data(good), gs.expect) < 1e-6
    with pytest.raises(ggml_attn.FlashAttnError, match="planted failure in bad"):
        ggml_attn.raise_pending(gx)
    ggml_attn.raise_pending(gx)  # raised once, then cleared


def test_raise_pending_without_graph_raises_this_threads_errors(gs, monkeypatch):
    bad = gs.node("bad")
    monkeypatch.setattr(ggml_attn.cpu, "flash_attn_ext_host", failing_for(bad))
    gx = gs.graph(bad)
    ggml.ggml_graph_compute_with_ctx(gs.ctx, gx, 2)
    seen = []
    t = threading.Thread(target=lambda: seen.append(runtime.pending_errors()) or ggml_attn.raise_pending())
    t.start()
    t.join()
    assert seen == [[]], "another thread saw this thread's error"
    with pytest.raises(ggml_attn.FlashAttnError, match="planted failure in bad"):
        ggml_attn.raise_pending()


def test_error_in_one_threads_graph_is_raised_in_that_thread_only(gs, monkeypatch):
    other = Graphs(1 << 20)  # its own context: ggml contexts are not shared between threads
    try:
        _two_threads(gs, other, monkeypatch)
    finally:
        other.free()


def _two_threads(gs, other, monkeypatch):
    bad, good = gs.node("bad"), other.node("good")
    monkeypatch.setattr(ggml_attn.cpu, "flash_attn_ext_host", failing_for(bad))
    gx, gy = gs.graph(bad), other.graph(good)
    ctxs = {"bad": gs.ctx, "good": other.ctx}
    errors = {"bad": 0, "good": 0}
    unexpected = []

    def worker(graph, name):
        for _ in range(15):
            try:
                ggml_attn.compute_graph(ctxs[name], graph, 2)
            except ggml_attn.FlashAttnError as e:
                errors[name] += 1
                if name not in str(e):
                    unexpected.append(str(e))
    ts = [threading.Thread(target=worker, args=(gx, "bad")), threading.Thread(target=worker, args=(gy, "good"))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == {"bad": 15, "good": 0} and not unexpected
    assert reference.nmse(get_data(good), gs.expect) < 1e-6


def test_compute_graph_clears_stale_errors_of_its_own_graph(gs, monkeypatch):
    """A graph computed plainly, failed, then recomputed by compute_graph after the cause is
    gone: compute_graph reports this compute, not the old one."""
    n = gs.node("n")
    monkeypatch.setattr(ggml_attn.cpu, "flash_attn_ext_host", failing_for(n))
    g = gs.graph(n)
    ggml.ggml_graph_compute_with_ctx(gs.ctx, g, 1)
    monkeypatch.undo()
    ggml_attn.compute_graph(gs.ctx, g, 1)
    assert reference.nmse(get_data(n), gs.expect) < 1e-6


# ------------------------------------------------------------------ Ctrl-C
def counting_host(calls, interrupt_at=None, real_signal=False):
    real = ggml_attn.cpu.flash_attn_ext_host

    def host(*a, **kw):
        calls.append(threading.get_ident())
        if interrupt_at is not None and len(calls) == interrupt_at:
            if real_signal:  # a real Ctrl-C, from whichever graph thread: the node goes on
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            else:
                raise KeyboardInterrupt
        return real(*a, **kw)
    return host


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # a Ctrl-C ctypes dropped
@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("real_signal", [False, True], ids=["raised", "sigint"])
@pytest.mark.parametrize("repeat", range(3))
def test_ctrl_c_stops_the_remaining_op_nodes(gs, monkeypatch, n_threads, real_signal, repeat):
    nodes = [gs.node(f"n{i}") for i in range(60)]
    g = gs.graph(*nodes)
    calls = []
    monkeypatch.setattr(ggml_attn.cpu, "flash_attn_ext_host", counting_host(calls, 3 * n_threads, real_signal))
    with pytest.raises(KeyboardInterrupt):
        ggml_attn.compute_graph(gs.ctx, g, n_threads)
    # the interrupted node (and its sibling graph threads, at most) ran; 57+ nodes did not
    assert len(calls) <= 4 * n_threads, f"{len(calls)} calls after Ctrl-C"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert np.isnan(get_data(nodes[-1])).all(), "a skipped node's output must be NaN, not stale"
    # the next compute runs normally
    monkeypatch.undo()
    ggml_attn.compute_graph(gs.ctx, g, n_threads)
    assert reference.nmse(get_data(nodes[-1]), gs.expect) < 1e-6


def test_ctrl_c_in_a_plain_compute_is_raised_by_raise_pending(gs, monkeypatch):
    nodes = [gs.node(f"n{i}") for i in range(20)]
    g = gs.graph(*nodes)
    calls = []
    monkeypatch.setattr(ggml_attn.cpu, "flash_attn_ext_host", counting_host(calls, 2))
    ggml.ggml_graph_compute_with_ctx(gs.ctx, g, 1)
    assert len(calls) == 2
    with pytest.raises(KeyboardInterrupt):
        ggml_attn.raise_pending()
    monkeypatch.undo()
    ggml_attn.compute_graph(gs.ctx, g, 1)
    assert reference.nmse(get_data(nodes[-1]), gs.expect) < 1e-6


def test_interrupt_of_the_main_thread_does_not_stop_a_worker_threads_graph(gs, monkeypatch):
    nodes = [gs.node(f"w{i}") for i in range(4)]
    g = gs.graph(*nodes)
    runtime._interrupted.add(threading.main_thread().ident)  # as if the main thread's graph was interrupted
    try:
        out = []
        t = threading.Thread(target=lambda: out.append(ggml_attn.compute_graph(gs.ctx, g, 2)))
        t.start()
        t.join()
        assert out == [None]
        assert reference.nmse(get_data(nodes[-1]), gs.expect) < 1e-6
    finally:
        runtime._interrupted.discard(threading.main_thread().ident)


# ------------------------------------------------------------------ bad arguments
@pytest.mark.parametrize("arg", ["ctx", "q", "k", "v"])
@pytest.mark.parametrize("bad", [None, 0, "x", 3.5])
def test_flash_attn_ext_names_a_missing_or_wrong_argument(gs, arg, bad):
    q, k, v, mask, _ = gs.ins
    kw = dict(ctx=gs.ctx, q=q, k=k, v=v)
    kw[arg] = bad
    with pytest.raises(ValueError, match=rf"\b{arg}\b"):
        ggml_attn.flash_attn_ext(kw["ctx"], kw["q"], kw["k"], kw["v"], mask, CASE.scale)


@pytest.mark.parametrize("arg", ["mask", "sinks"])
def test_flash_attn_ext_optional_tensors_must_be_tensors(gs, arg):
    q, k, v, mask, _ = gs.ins
    kw = dict(mask=mask, sinks=None)
    kw[arg] = "oops"
    with pytest.raises(ValueError, match=rf"\b{arg}\b"):
        ggml_attn.flash_attn_ext(gs.ctx, q, k, v, kw["mask"], CASE.scale, sinks=kw["sinks"])


def test_null_tensor_pointer_is_refused(gs):
    q, k, v, mask, _ = gs.ins
    null = ctypes.POINTER(ggml.ggml_tensor)()
    with pytest.raises(ValueError, match=r"\bk\b"):
        ggml_attn.flash_attn_ext(gs.ctx, q, null, v, mask, CASE.scale)


@pytest.mark.parametrize("scale", [None, "0.1", float("nan"), 10**400, -10**400])
def test_scale_must_be_a_finite_number(gs, scale):
    q, k, v, mask, _ = gs.ins
    with pytest.raises(ValueError, match="scale"):
        ggml_attn.flash_attn_ext(gs.ctx, q, k, v, mask, scale)


@pytest.mark.parametrize("arg", ["max_bias", "logit_softcap"])
def test_huge_int_parameters_are_value_errors_naming_them(gs, arg):
    """An int past the float range was an OverflowError from float()."""
    q, k, v, mask, _ = gs.ins
    with pytest.raises(ValueError, match=arg):
        ggml_attn.flash_attn_ext(gs.ctx, q, k, v, mask, CASE.scale, **{arg: 10**400})


@pytest.mark.parametrize("which,bad", [("ctx", None), ("ctx", 0), ("graph", None), ("graph", 0),
                                        ("n_threads", 0), ("n_threads", -2), ("n_threads", 1.5),
                                        ("n_threads", True), ("n_threads", "2"), ("n_threads", 513),
                                        ("n_threads", 32768), ("n_threads", 100000)])
def test_compute_graph_names_a_bad_argument(gs, which, bad):
    kw = dict(ctx=gs.ctx, graph=gs.graph(gs.node()), n_threads=1)
    kw[which] = bad
    with pytest.raises(ValueError, match=which):
        ggml_attn.compute_graph(kw["ctx"], kw["graph"], kw["n_threads"])


def test_compute_graph_thread_limit_is_the_clis(gs, capsys):
    """One rule for compute_graph's n_threads and the CLIs' -t: ggml's GGML_MAX_N_THREADS (more
    crashed ggml: 100000 segfaulted, 32768 aborted in libgomp)."""
    from ggml_attn.cli import bench
    assert runtime.MAX_THREADS == ggml.GGML_MAX_N_THREADS
    with pytest.raises(ValueError, match=rf"n_threads {runtime.MAX_THREADS + 1} .*at most {runtime.MAX_THREADS}"):
        ggml_attn.compute_graph(gs.ctx, gs.graph(gs.node()), runtime.MAX_THREADS + 1)
    assert bench.main(["-p", "8", "-n", "0", "--device", "cpu", "-t", str(runtime.MAX_THREADS + 1)]) == 2
    assert f"at most {runtime.MAX_THREADS}" in capsys.readouterr().err
    ggml_attn.compute_graph(gs.ctx, gs.graph(gs.node()), np.int64(2))   # numpy integers are integers


@pytest.mark.parametrize("bad", [0, "g", ctypes.POINTER(ggml.ggml_cgraph)()])
def test_raise_pending_and_computing_check_the_graph(bad):
    with pytest.raises(ValueError, match="graph"):
        ggml_attn.raise_pending(bad)
    with pytest.raises(ValueError, match="graph"):
        runtime.pending_errors(bad)
    with pytest.raises(ValueError, match="graph"):
        runtime.computing(bad)


def test_set_backend_rejects_unknown_kernels():
    with pytest.raises(ValueError, match=r"kernel.*'nonsense'"):
        ggml_attn.set_backend("auto", kernel="nonsense")
    with pytest.raises(ValueError, match="backend"):
        ggml_attn.set_backend(None)
    assert op._settings == {"backend": "auto", "kernel": "auto"}  # unchanged by the failures
    for k in ("auto", "prefill", "decode", "decode-tc", "cells", "reference"):
        ggml_attn.set_backend("reference", kernel=k)
    ggml_attn.set_backend("auto")


def test_set_backend_cuda_without_gpu_fails_in_set_backend():
    if ggml_attn.gpu_available():
        pytest.skip("a GPU is present: this checks the no-GPU path")
    with pytest.raises(RuntimeError, match=r"backend='cuda'.*no usable CUDA"):
        ggml_attn.set_backend("cuda")
    assert op._settings["backend"] == "auto"


# ------------------------------------------------------------------ BLAS threads in any thread
def test_blas_is_single_threaded_inside_the_op_in_any_thread(gs, monkeypatch):
    from threadpoolctl import threadpool_info
    real = ggml_attn.cpu.flash_attn_ext_host
    seen = []

    def spy(*a, **kw):
        seen.append([i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"])
        return real(*a, **kw)
    if not [i for i in threadpool_info() if i["user_api"] == "blas"]:
        pytest.skip("no BLAS library that threadpoolctl can see")
    monkeypatch.setattr(ggml_attn.cpu, "flash_attn_ext_host", spy)
    g = gs.graph(gs.node())
    ggml_attn.compute_graph(gs.ctx, g, 2)  # the main thread first
    main = list(seen)
    seen.clear()
    for how in ("compute_graph", "plain"):
        def run():
            if how == "plain":
                ggml.ggml_graph_compute_with_ctx(gs.ctx, g, 2)
            else:
                ggml_attn.compute_graph(gs.ctx, g, 2)
        t = threading.Thread(target=run)
        t.start()
        t.join()
    assert main and all(n == [1] for n in main)
    assert seen and all(n == [1] for n in seen), f"BLAS threads inside the op from a worker thread: {seen}"


def test_forced_sm90a_kernels_see_the_device_architecture(monkeypatch):
    """The op asks the device for its architecture when a GPU is usable: a forced prefill-wgmma
    or decode-tma runs on an sm_90 device (it was refused there as "this GPU is unknown") and is
    refused, naming the architecture, elsewhere."""
    import ggml
    from ggml_attn.tensor import from_ggml
    from ggml_attn.validate import check_flash_attn_args
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=8 << 20, mem_buffer=None))
    try:
        q = ggml.ggml_new_tensor_4d(ctx, ggml.GGML_TYPE_F32, 128, 256, 8, 1)
        k = ggml.ggml_new_tensor_4d(ctx, ggml.GGML_TYPE_F16, 128, 512, 2, 1)
        v = ggml.ggml_new_tensor_4d(ctx, ggml.GGML_TYPE_F16, 128, 512, 2, 1)
        qd, kd, vd = (from_ggml(t, n) for t, n in ((q, "q"), (k, "k"), (v, "v")))
        dims = check_flash_attn_args(qd, kd, vd, None, None, 0.0, 0.088, 0.0)
        monkeypatch.setattr(op, "gpu_available", lambda: True)
        monkeypatch.setattr(op, "_is_device_pointer", lambda ptr: True)
        saved = op.settings()
        try:
            for kernel in ("prefill-wgmma", "decode-tma"):
                op._settings.update(backend="cuda", kernel=kernel)
                monkeypatch.setattr(op, "_device_arch", lambda: "sm_90")
                for on_device in (True, False):
                    choice = op._choose(dims, True, on_device)
                    assert choice.kernel == kernel, choice
                monkeypatch.setattr(op, "_device_arch", lambda: "sm_89")
                with pytest.raises(ValueError, match="sm_89"):
                    op._choose(dims, True, True)
        finally:
            op._settings.update(backend=saved[0], kernel=saved[1])
    finally:
        ggml.ggml_free(ctx)
