"""Path ``gemm`` over two streams (graph/path_gemm.py, ``matmul_dispatch.DEQUANT_SIDE_SMS``) without a
GPU: the launches recorded (tests/test_xp_ops_block_launches.py's fakes) and a fake CUDA stream API
logging every record, wait and launch with the stream it went to. What the ring must keep: each
chunk dequantizes into slot j % 2 and its GEMM reads that slot; a dequantization waits for the GEMM
that last read its slot, a GEMM for its dequantization; every wait is on an event recorded earlier
in the same run (a CUDA-graph capture allows no other); the GEMMs are planned for the SMs the
dequantizations leave, on a side stream of the least priority, the engine's stream the greatest."""
import numpy as np
import pytest

from ggml_attn import cuda_device
from ggml_attn import matmul_dispatch as md
from ggml_attn.graph import path_gemm, xp_matmul
from test_xp_ops_block_launches import Builder, Dev, FakeXp, _qmatrix, launches  # noqa: F401 (a fixture)


class FakeCuda:
    """Streams and events that log what happens on them: ("record", event, stream), ("wait",
    stream, event), ("launch", what, stream); ``current`` is the stream launches go to."""

    def __init__(self):
        self.log, self.main = [], "main"
        self.current = self.main
        self.priorities = []
        cuda = self

        class Stream:
            def __init__(self, non_blocking=False, priority=None):
                assert non_blocking   # (the side stream must not sync with the legacy default stream)
                cuda.priorities.append(priority)
                self.name = "side"

            def wait_event(self, ev):
                cuda.log.append(("wait", self.name, ev.name))

            def __enter__(self):
                self.saved, cuda.current = cuda.current, self.name

            def __exit__(self, *exc):
                cuda.current = self.saved

        class Event:
            n = 0

            def __init__(self, disable_timing=False):
                Event.n += 1
                self.name = f"e{Event.n}"

            def record(self, stream):
                cuda.log.append(("record", self.name, stream if isinstance(stream, str) else stream.name))

        class MainStream(str):
            def wait_event(self, ev):
                cuda.log.append(("wait", "main", ev.name))

        self.Stream, self.Event = Stream, Event
        self.get_current_stream = lambda: MainStream(self.main)


class RingXp(FakeXp):
    def __init__(self):
        self.cuda = FakeCuda()


class RingBuilder(Builder):
    def __init__(self):
        super().__init__()
        self.xp, self.dequant_rings = RingXp(), {}


def _setup(monkeypatch, side=24, n_sm=132):
    monkeypatch.setattr(md, "DEQUANT_SIDE_SMS", side)
    monkeypatch.setattr(cuda_device, "_NUM_SMS", n_sm)
    for knob in ("QGEMM_MAX_TOKENS", "QSGEMM_MAX_TOKENS", "QRGEMM_MAX_TOKENS"):
        monkeypatch.setattr(md, knob, 0)   # 33 tokens: path gemm
    b = RingBuilder()
    return b, b.xp.cuda


def _ring_graph(monkeypatch, b, cuda):
    """Two matrices, four chunks over two 100-row slots: the run, the ring, the slots' addresses."""
    scratch = Dev((2 * 256 * 100,), np.float16)   # two slots of 100 rows of 256
    w1, w2 = _qmatrix("Q8_0", 250, 256, scratch), _qmatrix("Q8_0", 40, 256, scratch)
    x, outs = Dev((33, 256)), [Dev((33, 250)), Dev((33, 40))]
    monkeypatch.setattr(path_gemm, "dequant_gemm_launches", _logging(path_gemm.dequant_gemm_launches, cuda))
    run = xp_matmul._qmatmuls(b, [w1, w2], x, outs)
    ring = b.dequant_rings[id(scratch)]
    assert ring in b.kept and len(b.dequant_rings) == 1
    slots = [s.data.ptr for s in ring.slots]
    assert slots == [scratch.data.ptr, scratch.data.ptr + 2 * 25600]
    return run, ring, slots


def test_two_streams_alternate_the_slots_and_wait_for_their_last_reader(monkeypatch, launches):  # noqa: F811
    """Each graph run in the ring's order, twice (each run on events of its own)."""
    b, cuda = _setup(monkeypatch)
    run, ring, slots = _ring_graph(monkeypatch, b, cuda)
    deq = [ln for ln in launches if getattr(ln, "fn", None) != "gemm" and "dequant" in ln.fn.name]
    assert len(deq) == 2 * 4   # each chunk built for both slots: 3 chunks of w1, 1 of w2
    gemms = [ln for ln in launches if getattr(ln, "fn", None) == "gemm"]
    assert len(gemms) == 2 * 4 and {g.sm_target for g in gemms} == {132 - 24}   # the SMs the side stream leaves
    assert cuda.priorities == [path_gemm.LEAST_PRIORITY]
    for _ in range(2):
        cuda.log.clear()
        run()
        chunks = _chunks(cuda.log)
        assert len(chunks) == 4
        seen = set()
        start = cuda.log[0]
        assert start[0] == "record" and start[2] == "main"   # chunk 0 marks the run's start on the caller's stream
        for j, ch in enumerate(chunks):
            wait_side, deq_call, rec_deq, wait_main, gemm_call, rec_gemm = ch
            assert wait_side[:2] == ("wait", "side")
            assert wait_side[2] == (start[1] if j < 2 else chunks[j - 2][5][1])   # the slot's last reader
            assert deq_call == ("dequant", "side", slots[j % 2])
            assert rec_deq[0] == "record" and rec_deq[2] == "side"
            assert wait_main == ("wait", "main", rec_deq[1])
            assert gemm_call == ("gemm", "main", slots[j % 2])   # it reads the slot its dequantization wrote
            assert rec_gemm[0] == "record" and rec_gemm[2] == "main"
            assert wait_side[2] in seen | {start[1]}   # each wait on an event recorded earlier in this run
            seen |= {rec_deq[1], rec_gemm[1]}


def test_a_run_out_of_build_order_is_refused(monkeypatch, launches):  # noqa: F811
    """The chunks' events follow the build order: a run that calls chunk 2 before chunk 1 would
    wait for an event of the run before (a race); it raises instead, and a run from chunk 0 again
    goes on."""
    b, cuda = _setup(monkeypatch)
    scratch = Dev((2 * 256 * 100,), np.float16)
    w = _qmatrix("Q8_0", 250, 256, scratch)
    monkeypatch.setattr(path_gemm, "dequant_gemm_launches", _logging(path_gemm.dequant_gemm_launches, cuda))
    steps = path_gemm.path_gemm_steps(b, w, Dev((33, 256), np.float16), Dev((33, 250)))
    assert len(steps) == 3
    steps[0]()
    with pytest.raises(RuntimeError, match="chunk 2 called after chunk 0"):
        steps[2]()
    for s in steps:   # a whole run in order
        s()
    steps[0]()
    steps[1]()
    with pytest.raises(RuntimeError, match="chunk 1 called after chunk 1"):   # (a chunk twice in a run)
        steps[1]()


def _logging(make, cuda):
    """dequant_gemm_launches whose functions log (what, the stream, the slot) when called."""
    def wrapped(w, x16, out, *, accumulate=False, scratch=None, sm_target=0):
        pairs = make(w, x16, out, accumulate=accumulate, scratch=scratch, sm_target=sm_target)
        ptr = scratch.data.ptr
        return [(lambda: cuda.log.append(("dequant", cuda.current, ptr)),
                 lambda: cuda.log.append(("gemm", cuda.current, ptr))) for _ in pairs]
    return wrapped


def _chunks(log):
    """The run's log (after chunk 0's start record) cut into chunks of six entries."""
    body = log[1:]
    assert len(body) % 6 == 0, body
    return [body[i:i + 6] for i in range(0, len(body), 6)]


def test_one_stream_is_the_pairs_in_order(monkeypatch, launches):  # noqa: F811
    """DEQUANT_SIDE_SMS None: the pairs of dequant_gemm_launches as they are, no ring made, each
    GEMM on every SM, the engine's stream of the default priority."""
    b, cuda = _setup(monkeypatch, side=None)
    scratch = Dev((256 * 100,), np.float16)
    w = _qmatrix("Q8_0", 250, 256, scratch)
    steps = path_gemm.path_gemm_steps(b, w, Dev((33, 256), np.float16), Dev((33, 250)))
    assert len(steps) == 6 and b.dequant_rings == {} and cuda.priorities == []
    assert {ln.sm_target for ln in launches if getattr(ln, "fn", None) == "gemm"} == {0}
    assert path_gemm.engine_stream_priority() is None
    monkeypatch.setattr(md, "DEQUANT_SIDE_SMS", 16)
    assert path_gemm.engine_stream_priority() == path_gemm.GREATEST_PRIORITY


@pytest.mark.parametrize("bad", [0, -4, 132, 200, 2.5, True, "24"])
def test_bad_settings_are_refused(monkeypatch, launches, bad):  # noqa: F811
    b, cuda = _setup(monkeypatch, side=bad)
    w = _qmatrix("Q8_0", 250, 256, Dev((256 * 100,), np.float16))
    with pytest.raises(ValueError, match=r"DEQUANT_SIDE_SMS must be None or a whole number of SMs in 1\.\.131"):
        path_gemm.path_gemm_steps(b, w, Dev((33, 256), np.float16), Dev((33, 250)))
    monkeypatch.setattr(md, "DEQUANT_SIDE_SMS", 24)
    with pytest.raises(ValueError, match="no F16 scratch"):
        path_gemm.path_gemm_steps(b, _qmatrix("Q8_0", 250, 256), Dev((33, 256), np.float16), Dev((33, 250)))
    with pytest.raises(ValueError, match="no room for two slots"):
        path_gemm.DequantRing(b.xp, Dev((100,), np.float16), 108)


def test_device_weights_make_two_slots_for_the_ring(monkeypatch):
    """DeviceWeights' scratch holds two of the largest layer matrix with DEQUANT_SIDE_SMS set, one
    without (the memory the two streams cost, ``-v``'s scratch line)."""
    from ggml_attn.graph.model_device import SCRATCH_MIN_ELEMENTS, scratch_elements
    monkeypatch.setattr(md, "DEQUANT_SIDE_SMS", None)
    assert scratch_elements(14336 * 4096) == 14336 * 4096
    assert scratch_elements(10) == SCRATCH_MIN_ELEMENTS
    monkeypatch.setattr(md, "DEQUANT_SIDE_SMS", 24)
    assert scratch_elements(14336 * 4096) == 2 * 14336 * 4096
    assert scratch_elements(10) == 2 * SCRATCH_MIN_ELEMENTS
