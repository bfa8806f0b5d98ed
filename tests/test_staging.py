"""graph/staging.py: the pinned ring of load_plan's host-to-device copies, with fake CuPy parts
(no GPU): small copies stay pageable, large ones alternate between the ring's buffers and
wait only for the copies out of the buffer they reuse, and the device arrays get the data."""
import numpy as np
import pytest

from ggml_attn.graph.staging import Stager


class FakeEvent:
    def __init__(self, log, n):
        self.log, self.n, self.done = log, n, False

    def synchronize(self):
        self.log.append(("wait", self.n))
        self.done = True


class FakeStream:
    def __init__(self):
        self.log, self.n = [], 0

    def record(self):
        self.n += 1
        return FakeEvent(self.log, self.n)


class FakeDev:
    """A device array: ``set`` records the source object (the pinned buffer or pageable host)."""
    def __init__(self, stream, shape, dtype):
        self.stream, self.data = stream, np.zeros(shape, dtype)
        self.shape, self.dtype = self.data.shape, self.data.dtype

    def set(self, host, stream=None):
        assert stream is self.stream
        self.stream.log.append(("set", id(host)))
        self.data[...] = host   # the fake stream copies at once


class FakeXp:
    def __init__(self, stream):
        self.cuda = type("cuda", (), {"get_current_stream": staticmethod(lambda: stream)})


@pytest.fixture
def parts():
    stream = FakeStream()
    allocated = []

    def pinned(shape, dtype):
        a = np.empty(shape, dtype)
        allocated.append(a)
        return a
    mask = FakeDev(stream, (64, 2048), np.float16)      # 256 KiB
    rows = FakeDev(stream, (64,), np.int32)
    return stream, pinned, allocated, mask, rows


def test_large_copies_alternate_pinned_buffers_and_wait_for_reuse(parts):
    stream, pinned, allocated, mask, rows = parts
    st = Stager(FakeXp(stream), pinned=pinned, min_bytes=1024, depth=2)
    rng = np.random.default_rng(0)
    for i in range(5):
        m = rng.standard_normal((64, 2048)).astype(np.float32)   # cast to the device dtype
        r = np.arange(64) + i
        st.copy([(mask, m), (rows, r)])
        np.testing.assert_array_equal(mask.data, m.astype(np.float16))
        np.testing.assert_array_equal(rows.data, r)
    assert len(allocated) == 4, "two slots of two pinned buffers, allocated once"
    sources = [x for k, x in stream.log if k == "set"]
    slot0, slot1 = {id(a) for a in allocated[:2]}, {id(a) for a in allocated[2:]}
    assert set(sources[0:2]) == slot0 and set(sources[2:4]) == slot1 and set(sources[4:6]) == slot0
    # ubatch 3 reuses slot 0: waits for event 1 (ubatch 1's copies); ubatch 4 for event 2 ...
    waits = [n for k, n in stream.log if k == "wait"]
    assert waits == [1, 2, 3] and st.waits == 3
    sets = [i for i, (k, _) in enumerate(stream.log) if k == "set"]
    assert stream.log.index(("wait", 1)) < sets[4], "the wait comes before the slot is overwritten"
    st.wait()
    assert sorted(n for k, n in stream.log if k == "wait")[-2:] == [4, 5]


def test_small_copies_stay_pageable(parts):
    stream, pinned, allocated, mask, rows = parts
    st = Stager(FakeXp(stream), pinned=pinned, min_bytes=10 ** 9)
    m = np.ones((64, 2048), np.float16)
    st.copy([(mask, m), (rows, np.arange(64))])
    assert not allocated and stream.n == 0 and st.waits == 0
    np.testing.assert_array_equal(mask.data, m)
    st.wait()   # nothing to wait for


def test_shape_mismatch_is_an_error(parts):
    stream, pinned, _, mask, rows = parts
    st = Stager(FakeXp(stream), pinned=pinned, min_bytes=0)
    with pytest.raises(ValueError):
        st.copy([(mask, np.zeros((63, 2048))), (rows, np.arange(64))])
