"""Scratch memory of the CUDA backend, as objects with a lifetime.

- :class:`Workspace` -- per (device, stream, thread): the split-KV partials buffer, the
  split counters of the fused split finish, and the f16 copies of quantized K/V. The null
  stream is 0 on every device and in every thread, so the stream alone must not pick the
  buffers.
- :class:`Staging` -- per (thread, device): the pinned host + device buffers through which
  :func:`ggml_attn.cuda_backend.flash_attn_ext_host` copies host tensors.
- :class:`Workspaces` -- the registry that owns both; the backend uses the one instance
  :data:`WORKSPACES` (read at call time, so a test may put a fresh registry in its place).

Lifetime: a Workspace or Staging is made on first use by its key and grows its buffers as
needed; it lives until :meth:`Workspaces.clear` (or its own ``release``) drops the registry's
references. Buffers are CuPy arrays / pinned memory, freed when the last reference goes:
a bound call (:class:`ggml_attn.cuda_backend.BoundCall`) keeps the buffers it launches with,
so growing or releasing never frees memory a bound call still uses. Release only while no
launch on these buffers is in flight, or rely on CuPy's pool, which hands freed device memory
out again only on the stream it was allocated on.
"""
from __future__ import annotations

import threading


class Workspace:
    """Split-KV scratch of one (device, stream, thread), grown as needed.

    ``partials``: uint8 bytes of split partials, O [n_splits][rows][head_dim_v] f32 then (max, sum)
    [n_splits][rows][2] f32 (the kernels' ``ws_o`` / ``ws_ml``). ``counters``: int32 split
    counters, one per row group, zero between launches."""

    __slots__ = ("dev", "stream", "_partials", "_counters", "_converted")

    def __init__(self, dev: int, stream: int):
        self.dev, self.stream = dev, stream
        self._partials = None
        self._counters = None
        self._converted = None

    def _bytes(self, slot: str, nbytes: int):
        """(pointer, buffer) of slot ``slot`` ("_partials", "_converted"), grown to ``nbytes``
        (at least 1 MiB) on this workspace's stream."""
        import cupy
        buf = getattr(self, slot)
        if buf is None or buf.size < nbytes:
            with cupy.cuda.ExternalStream(self.stream):
                buf = cupy.empty(max(nbytes, 1 << 20), dtype=cupy.uint8)
            setattr(self, slot, buf)
        return buf.data.ptr, buf

    def converted(self, nbytes: int):
        """(pointer, buffer) of at least ``nbytes`` for the f16 copies of quantized K and V that
        the tensor-core kernels read (``fattn_dequant_kv``); kept by the bound calls as
        :meth:`partials` is. Calls on one stream run one after another, so they share it."""
        return self._bytes("_converted", nbytes)

    def partials(self, nbytes: int):
        """(pointer, buffer) of at least ``nbytes``; a bound call keeps the buffer, so growing it
        for a later call never frees memory an earlier bound call still launches with."""
        return self._bytes("_partials", nbytes)

    def counters(self, n: int):
        """(pointer, buffer) of at least ``n`` int32 counters, zero between launches: made zeroed,
        and every kernel that counts in them sets its counters back to 0 (``split_finish``).
        Calls on one stream run one after another."""
        import cupy
        buf = self._counters
        if buf is None or buf.size < n:
            with cupy.cuda.ExternalStream(self.stream):
                buf = cupy.zeros(max(n, 4096), dtype=cupy.int32)
            self._counters = buf
        return buf.data.ptr, buf

    def release(self) -> None:
        """Drop this workspace's buffers (bound calls keep theirs); the next use makes new ones."""
        self._partials = self._counters = self._converted = None


class Staging:
    """Pinned host + device buffers per slot, grown as needed and reused. One per (thread,
    device) (:meth:`Workspaces.staging`): a call synchronizes its stream before returning, so a
    buffer freed when its slot grows has no copy of this thread in flight, and no other thread
    ever sees it."""

    def __init__(self):
        self.pinned: dict[str, object] = {}
        self.device: dict[str, object] = {}

    def get(self, slot: str, nbytes: int):
        import cupy
        nbytes = max(nbytes, 1)
        pm = self.pinned.get(slot)
        if pm is None or pm.size() < nbytes:
            pm = cupy.cuda.alloc_pinned_memory(nbytes * 5 // 4)
            self.pinned[slot] = pm
        dm = self.device.get(slot)
        if dm is None or dm.size < nbytes:
            dm = cupy.empty(nbytes * 5 // 4, dtype=cupy.uint8)
            self.device[slot] = dm
        return pm.ptr, dm.data.ptr

    def release(self) -> None:
        """Drop every slot's buffers; the next use makes new ones."""
        self.pinned.clear()
        self.device.clear()


class Workspaces:
    """Registry of the backend's scratch memory: a :class:`Workspace` per (device, stream,
    thread) and a :class:`Staging` per (thread, device), each made on first use."""

    def __init__(self):
        self._ws: dict[tuple, Workspace] = {}
        self._staging = threading.local()   # .by_dev: device id -> Staging of this thread

    def workspace(self, dev: int, stream: int) -> Workspace:
        """The workspace of (``dev``, ``stream``, the calling thread)."""
        key = (dev, stream, threading.get_ident())
        ws = self._ws.get(key)
        if ws is None:
            ws = self._ws[key] = Workspace(dev, stream)
        return ws

    def staging(self, dev: int) -> Staging:
        """The staging buffers of (the calling thread, ``dev``)."""
        by_dev = getattr(self._staging, "by_dev", None)
        if by_dev is None:
            by_dev = self._staging.by_dev = {}
        st = by_dev.get(dev)
        if st is None:
            st = by_dev[dev] = Staging()
        return st

    def workspaces(self) -> dict[tuple, Workspace]:
        """(device, stream, thread id) -> Workspace, a copy (for tests and statistics)."""
        return dict(self._ws)

    def clear(self) -> None:
        """Release every workspace and forget them all, and drop every thread's staging
        buffers (the per-thread store is replaced; a call in progress keeps the Staging it
        holds until it returns)."""
        for ws in list(self._ws.values()):
            ws.release()
        self._ws.clear()
        self._staging = threading.local()


WORKSPACES = Workspaces()
