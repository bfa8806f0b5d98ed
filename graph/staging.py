"""Host-to-device copies of a built graph's per-ubatch inputs (mask, row indices).

A copy from pageable host memory is staged by the driver; a large one waits until the stream
has reached it, i.e. until the device finished the previous ubatch, so the host cannot prepare
the next ubatch while the device computes this one (a 512-token prompt ubatch over a 7k-cell
cache: a 9.4 MB mask, 11 ms of host waiting per ubatch on the H200, bench/NOTES.md, "sixth
session"). Large copies therefore go through a ring of pinned buffers: the host copies into a
buffer, the stream copies out of it asynchronously, and the host waits only when the buffer
comes round again (an event recorded after its last copy), which lets it run ``depth - 1``
ubatches ahead. Small copies stay pageable: the driver takes them at once, and the pinned path
measured slower for one-token decode steps.
"""
from __future__ import annotations

import numpy as np

# copies of at least this many bytes in all go through the pinned ring
PINNED_MIN_BYTES = 256 * 1024
RING_DEPTH = 2


def empty_pinned(shape, dtype) -> np.ndarray:
    """A numpy array of ``shape`` and ``dtype`` over page-locked memory from CuPy's pinned pool
    (what ``cupyx.empty_pinned`` makes, without importing cupyx: its import pulls in
    ``cupyx.scipy.sparse`` and SciPy, 0.6 s of a model's start on the H100's machine,
    bench/NOTES.md, twenty-seventh session)."""
    import cupy  # noqa: PLC0415 (device graphs only)
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    mem = cupy.cuda.alloc_pinned_memory(max(n * dtype.itemsize, 1))
    return np.ndarray(shape, dtype=dtype, buffer=mem)   # (the array holds ``mem``: the pool's block lives with it)


class Stager:
    """Copies ``host -> dev`` pairs on the current stream of ``xp`` (CuPy), asynchronously.

    ``pinned(shape, dtype)`` allocates a page-locked numpy array (:func:`empty_pinned`);
    tests pass fakes for it and for ``xp``. Each :meth:`copy` call is one ubatch's inputs; the
    shapes and dtypes of the device arrays never change for one graph."""

    def __init__(self, xp, pinned=None, min_bytes: int | None = None, depth: int = RING_DEPTH):
        if pinned is None:
            pinned = empty_pinned
        self.xp, self.pinned, self.depth = xp, pinned, depth
        self.min_bytes = PINNED_MIN_BYTES if min_bytes is None else min_bytes
        self._ring: list[list] = []      # per slot: pinned buffers, one per device array
        self._events: list = []          # per slot: recorded after its copies (None: never used)
        self._next = 0
        self.waits = 0                   # how often a slot's event was waited on (tests, probes)
        self.blocked = 0                 # ... of which the copies out of the slot had not run yet

    def copy(self, pairs) -> None:
        """``pairs``: ``(dev, host)`` with ``dev`` a device array and ``host`` anything numpy
        reshapes to ``dev.shape`` and casts to ``dev.dtype`` (numpy order, both)."""
        hosts = [np.asarray(h).reshape(d.shape) for d, h in pairs]
        stream = self.xp.cuda.get_current_stream()
        if sum(d.nbytes for d, _ in pairs) < self.min_bytes:
            for (dev, _), h in zip(pairs, hosts):
                dev.set(np.ascontiguousarray(h, dtype=dev.dtype), stream=stream)
            return
        k = self._next
        if k == len(self._ring):   # (a failed allocation leaves the ring as it was)
            self._ring.append([self.pinned(d.shape, d.dtype) for d, _ in pairs])
            self._events.append(None)
        elif self._events[k] is not None:
            ev = self._events[k]
            self.blocked += not ev.done
            ev.synchronize()   # the stream copied out of this slot already
            self.waits += 1
        issued = False
        try:
            for (dev, _), h, buf in zip(pairs, hosts, self._ring[k]):
                np.copyto(buf, h, casting="unsafe")   # the cast to the device dtype, in place
                dev.set(buf, stream=stream)
                issued = True
        finally:
            if issued:   # also when a later copy failed: the slot is in use until its event
                self._events[k] = stream.record()
                self._next = (k + 1) % self.depth

    def wait(self) -> None:
        """Until the stream copied out of every pinned buffer (before they are dropped)."""
        for ev in self._events:
            if ev is not None:
                ev.synchronize()
