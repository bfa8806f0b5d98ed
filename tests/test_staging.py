"""graph/staging.py: the pinned ring of load_plan's host-to-device copies, with fake CuPy parts
(no GPU). The fake stream is lazy, like a real one that is behind the host: a copy reads its
source only when an event recorded after it is waited on (or at the end), so a pinned buffer
overwritten before its copy ran would deliver the wrong ubatch's data."""
import numpy as np
import pytest

from ggml_attn.graph.staging import Stager


class FakeStream:
    def __init__(self):
        self.pending = []     # (dev, source array) copies queued and not yet run, in order
        self.done = 0         # copies run so far
        self.log = []         # ("set", id(source)) / ("wait", event number)
        self.n = 0

    def run_until(self, total):
        """The stream catches up until ``total`` copies in all have run."""
        while self.done < total and self.pending:
            dev, src = self.pending.pop(0)
            dev.history.append(src.copy())
            self.done += 1

    def record(self):
        self.n += 1
        return FakeEvent(self, self.n, self.done + len(self.pending))


class FakeEvent:
    def __init__(self, stream, n, upto):
        self.stream, self.n, self.upto = stream, n, upto

    @property
    def done(self):
        return self.stream.done >= self.upto

    def synchronize(self):
        self.stream.log.append(("wait", self.n))
        self.stream.run_until(self.upto)


class FakeDev:
    def __init__(self, stream, shape, dtype):
        self.stream = stream
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.nbytes = int(np.prod(shape)) * self.dtype.itemsize
        self.history = []     # what each executed copy delivered

    fail = False   # a set that raises (tests of a copy that fails midway)

    def set(self, host, stream=None):
        if self.fail:
            raise RuntimeError("copy failed")
        assert stream is self.stream and host.dtype == self.dtype and host.shape == self.shape
        self.stream.log.append(("set", id(host)))
        self.stream.pending.append((self, host))


class FakeXp:
    def __init__(self, stream):
        self.cuda = type("cuda", (), {"get_current_stream": staticmethod(lambda: stream)})


def flush(stream):
    stream.run_until(stream.done + len(stream.pending))


@pytest.fixture
def parts():
    stream = FakeStream()
    allocated = []

    def pinned(shape, dtype):
        a = np.empty(shape, dtype)
        allocated.append(a)
        return a
    return stream, pinned, allocated, FakeDev(stream, (64, 2048), np.float16), FakeDev(stream, (64,), np.int32)


def test_pinned_ring_delivers_every_ubatch_and_reuses_a_slot_after_its_wait(parts):
    stream, pinned, allocated, mask, rows = parts
    st = Stager(FakeXp(stream), pinned=pinned, min_bytes=1024, depth=2)
    rng = np.random.default_rng(0)
    sent = []
    for i in range(5):
        m = rng.standard_normal((64, 2048)).astype(np.float32)   # cast to the device dtype
        sent.append((m.astype(np.float16), np.arange(64) + i))
        st.copy([(mask, m), (rows, np.arange(64) + i)])
    flush(stream)
    assert len(mask.history) == len(rows.history) == 5
    for (m, r), got_m, got_r in zip(sent, mask.history, rows.history):
        np.testing.assert_array_equal(got_m, m)
        np.testing.assert_array_equal(got_r, r)
    assert len(allocated) == 4, "two slots of two pinned buffers, allocated once"
    sources = [x for k, x in stream.log if k == "set"]
    slot0, slot1 = {id(a) for a in allocated[:2]}, {id(a) for a in allocated[2:]}
    assert set(sources[0:2]) == slot0 and set(sources[2:4]) == slot1 and set(sources[4:6]) == slot0
    waits = [n for k, n in stream.log if k == "wait"]
    assert waits == [1, 2, 3] and st.waits == 3   # ubatch 2 waits for ubatch 0's copies, ...
    st.wait()
    assert sorted(n for k, n in stream.log if k == "wait")[-2:] == [4, 5]


def test_small_copies_stay_pageable(parts):
    stream, pinned, allocated, mask, rows = parts
    st = Stager(FakeXp(stream), pinned=pinned, min_bytes=10 ** 9)
    for i in range(3):
        st.copy([(mask, np.full((64, 2048), i, np.float16)), (rows, np.arange(64))])
    flush(stream)
    assert not allocated and stream.n == 0 and st.waits == 0
    assert [h[0, 0] for h in mask.history] == [0, 1, 2]
    st.wait()   # nothing to wait for


def test_a_failed_allocation_leaves_the_ring_usable(parts):
    stream, pinned, allocated, mask, rows = parts
    calls = {"n": 0}

    def flaky(shape, dtype):
        calls["n"] += 1
        if calls["n"] == 1:
            raise MemoryError("pinned memory")
        return pinned(shape, dtype)
    st = Stager(FakeXp(stream), pinned=flaky, min_bytes=0)
    with pytest.raises(MemoryError):
        st.copy([(mask, np.zeros((64, 2048))), (rows, np.arange(64))])
    for i in range(3):
        st.copy([(mask, np.full((64, 2048), i)), (rows, np.arange(64))])
    flush(stream)
    assert [h[0, 0] for h in mask.history] == [0, 1, 2]


def test_shape_mismatch_is_an_error(parts):
    stream, pinned, _, mask, rows = parts
    st = Stager(FakeXp(stream), pinned=pinned, min_bytes=0)
    with pytest.raises(ValueError):
        st.copy([(mask, np.zeros((63, 2048))), (rows, np.arange(64))])


def test_a_copy_failing_midway_still_guards_its_slot(parts):
    """The second array's copy raises after the first was queued out of the slot: the slot's
    event covers that queued copy, so the next use of the slot waits for it."""
    stream, pinned, allocated, mask, rows = parts
    st = Stager(FakeXp(stream), pinned=pinned, min_bytes=1024, depth=2)
    rows.fail = True
    m0 = np.full((64, 2048), 1, np.float16)
    with pytest.raises(RuntimeError):
        st.copy([(mask, m0), (rows, np.arange(64))])
    rows.fail = False
    st.copy([(mask, np.full((64, 2048), 2, np.float16)), (rows, np.arange(64))])
    assert st.waits == 0 and st.blocked == 0   # slot 1: new
    st.copy([(mask, np.full((64, 2048), 3, np.float16)), (rows, np.arange(64))])   # slot 0 again
    assert st.waits == 1 and st.blocked == 1, "the slot of the failed copy was reused unguarded"
    flush(stream)
    assert [int(h[0, 0]) for h in mask.history] == [1, 2, 3]


def test_empty_pinned_is_an_array_over_cupys_pinned_block(monkeypatch):
    """The default ``pinned``: a numpy array of the shape and dtype over one block of CuPy's pinned
    pool (a fake here: no GPU), which it keeps alive; cupyx (its import pulls in SciPy) is not
    imported."""
    import subprocess
    import sys

    import cupy

    from ggml_attn.graph import staging
    blocks = []

    def alloc(n):
        blocks.append(bytearray(n))
        return blocks[-1]
    monkeypatch.setattr(cupy.cuda, "alloc_pinned_memory", alloc)
    a = staging.empty_pinned((3, 5), np.float16)
    assert a.shape == (3, 5) and a.dtype == np.float16 and len(blocks[0]) == 30 and a.base is not None
    a[...] = 7
    assert bytes(blocks[0]) == np.full((3, 5), 7, np.float16).tobytes()
    assert staging.empty_pinned((0, 4), np.int32).shape == (0, 4)
    assert Stager(None).pinned is staging.empty_pinned
    code = ("import sys; from ggml_attn.graph.staging import Stager; Stager(None); "
            "import ggml_attn.graph.build; sys.exit(int('cupyx' in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
