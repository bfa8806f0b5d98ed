"""Signals while ggml runs the op's callback (issue #47 B.6): a Python signal handler runs between
any two bytecodes, inside an op callback too, and what it raises cannot pass through ggml's C
code (ctypes prints "Exception ignored on calling ctypes callback", or the callback records it as
an op error). During a compute the handler is held (``runtime.computing``): it runs, what it
raises is raised when the compute returns, never inside the callback; the remaining op nodes
return at once. Both Python's default SIGINT handler and a program's own (the CLIs' flag handler:
the first Ctrl-C sets a flag, the second raises) -- a second Ctrl-C raised inside the callback."""
import signal
import threading

import ggml
import numpy as np
import pytest

import ggml_attn
from ggml_attn import reference
from ggml_attn.conformance import FACase, make_inputs
from ggml_build import build_case, case_bytes, get_data, graph_of, new_context

CASE = FACase(hsk=64, hsv=64, n_head_kv=2, gqa=2, ne3=1, n_kv=64, n_batch=4, mask=True, sinks=False,
              max_bias=0.0, logit_softcap=0.0, kv_type=ggml.GGML_TYPE_F16)
N_NODES = 40


@pytest.fixture(scope="module")
def graph():
    x = make_inputs(CASE, np.random.default_rng(7))
    ctx = new_context(case_bytes(CASE) + (1 << 20))
    q, k, v, mask, _ = build_case(ctx, CASE, x)
    nodes = [ggml_attn.flash_attn_ext(ctx, q, k, v, mask, CASE.scale) for _ in range(N_NODES)]
    expect = reference.flash_attn_ext(x.q, *x.kv_float(), x.mask, CASE.scale)
    yield ctx, graph_of(ctx, *nodes), nodes, expect
    ggml.ggml_free(ctx)


def signalling_host(monkeypatch, signum, times, at_call=3):
    """The CPU path, sending ``signum`` ``times`` times to this process from inside the op's
    callback at its ``at_call``-th call; what got raised inside the callback is in ``raised``."""
    real = ggml_attn.cpu.flash_attn_ext_host
    calls, raised = [], []

    def host(*a, **kw):
        calls.append(1)
        if len(calls) == at_call:
            for _ in range(times):
                try:
                    signal.raise_signal(signum)   # its Python handler runs before this returns
                except BaseException as e:  # noqa: BLE001
                    raised.append(e)
        return real(*a, **kw)
    monkeypatch.setattr(ggml_attn.cpu, "flash_attn_ext_host", host)
    return calls, raised


class FlagHandler:
    """The CLIs' handler (tools/common.py install_sigint_flag): a flag, then KeyboardInterrupt."""

    def __init__(self):
        self.flag = False

    def __call__(self, signum, frame):
        if self.flag:
            raise KeyboardInterrupt
        self.flag = True


@pytest.fixture
def handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def _check_stopped(ctx, g, nodes, expect, calls, raised, handler_now, handler_before):
    assert not raised, f"raised inside the op callback: {raised!r}"
    assert len(calls) <= 4, f"{len(calls)} op calls after the interrupt"   # the remaining nodes returned
    assert handler_now is handler_before
    assert np.isnan(get_data(nodes[-1])).all()
    ggml_attn.compute_graph(ctx, g, 1)   # the next compute runs normally
    assert reference.nmse(get_data(nodes[-1]), expect) < 1e-6


@pytest.mark.parametrize("times", [1, 2, 3])
def test_ctrl_c_with_pythons_handler_is_raised_after_the_compute(graph, monkeypatch, handlers, times):
    ctx, g, nodes, expect = graph
    signal.signal(signal.SIGINT, signal.default_int_handler)
    calls, raised = signalling_host(monkeypatch, signal.SIGINT, times)
    with pytest.raises(KeyboardInterrupt):
        ggml_attn.compute_graph(ctx, g, 1)
    monkeypatch.undo()
    _check_stopped(ctx, g, nodes, expect, calls, raised, signal.getsignal(signal.SIGINT), signal.default_int_handler)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_programs_handler_runs_and_what_it_raises_comes_after_the_compute(graph, monkeypatch, handlers, signum):
    ctx, g, nodes, expect = graph
    flag = FlagHandler()
    signal.signal(signum, flag)
    # one signal: the handler sets its flag, the compute goes on to the end
    calls, raised = signalling_host(monkeypatch, signum, 1)
    ggml_attn.compute_graph(ctx, g, 1)
    assert flag.flag and not raised and len(calls) == N_NODES
    assert reference.nmse(get_data(nodes[-1]), expect) < 1e-6
    assert signal.getsignal(signum) is flag
    # two: the second raises, after the compute; the remaining op nodes returned at once
    monkeypatch.undo()
    flag.flag = False
    calls, raised = signalling_host(monkeypatch, signum, 2)
    with pytest.raises(KeyboardInterrupt):
        ggml_attn.compute_graph(ctx, g, 1)
    monkeypatch.undo()
    _check_stopped(ctx, g, nodes, expect, calls, raised, signal.getsignal(signum), flag)


def test_not_held_off_the_main_thread_nor_when_not_pythons(graph, monkeypatch, handlers):
    """A compute in another thread holds nothing (only the main thread runs Python's signal
    handlers), nor does one where the handler is SIG_IGN / SIG_DFL."""
    ctx, g, nodes, expect = graph
    seen = []

    def spy(*a, **kw):
        seen.append((signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)))
        return real(*a, **kw)
    real = ggml_attn.cpu.flash_attn_ext_host
    monkeypatch.setattr(ggml_attn.cpu, "flash_attn_ext_host", spy)
    flag = FlagHandler()
    signal.signal(signal.SIGINT, flag)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    t = threading.Thread(target=ggml_attn.compute_graph, args=(ctx, g, 1))
    t.start()
    t.join()
    assert seen and all(s == (flag, signal.SIG_DFL) for s in seen)
    seen.clear()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ggml_attn.compute_graph(ctx, g, 1)
    assert seen and all(s == (signal.SIG_IGN, signal.SIG_DFL) for s in seen)


def test_a_signal_as_the_handlers_come_back_leaves_every_handler_given_back(graph, monkeypatch, handlers):
    """A second Ctrl-C landing as the compute gives the handlers back (SIGINT's restored, SIGTERM's
    not yet; the CLIs' flag handler raises on it): both are the program's again afterwards (before:
    SIGTERM stayed bound to the finished compute), the interrupt is raised, and the next compute
    runs normally."""
    from ggml_attn import runtime
    ctx, g, nodes, expect = graph
    h = FlagHandler()
    signal.signal(signal.SIGINT, h)
    signal.signal(signal.SIGTERM, h)
    h.flag = True   # the first Ctrl-C was seen already
    real_set = runtime._setsignal

    def set_then_signal(sig, handler):
        out = real_set(sig, handler)
        if sig == signal.SIGINT and handler is h:
            signal.raise_signal(signal.SIGINT)
        return out
    monkeypatch.setattr(runtime, "_setsignal", set_then_signal)
    with pytest.raises(KeyboardInterrupt):
        ggml_attn.compute_graph(ctx, g, 1)
    monkeypatch.setattr(runtime, "_setsignal", real_set)
    assert signal.getsignal(signal.SIGINT) is h and signal.getsignal(signal.SIGTERM) is h
    h.flag = False
    ggml_attn.compute_graph(ctx, g, 1)
    assert reference.nmse(get_data(nodes[-1]), expect) < 1e-6
