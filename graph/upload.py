"""File bytes into GPU memory through page-locked host buffers: several threads read chunks
straight from the file (``os.preadv``, no memory map and so no page faults) into pinned
buffers, and each chunk goes to the device with an asynchronous copy on one stream while the
next ones are read. What a model's GPU load spends most of its time on
(``model_device.DeviceWeights``); llama.cpp's loader works the same way.

Use::

    up = FileUploader(path)                 # pinned buffers, reader threads
    h = up.read(offset, nbytes)             # queued on the reader threads
    arr = h.result()                        # CuPy uint8 (nbytes,): its copies are queued on
    ...                                     # up.stream, so device work there sees the bytes
    up.close()                              # waits for every copy, frees the buffers
"""
from __future__ import annotations

import os
import queue
from concurrent.futures import ThreadPoolExecutor

__all__ = ["FileUploader"]


class FileUploader:
    """Copies byte ranges of the file at ``path`` to new device arrays (module docstring).
    ``chunk``: bytes per read and copy; ``n_threads``: reader threads, each with a pinned buffer
    of ``chunk`` bytes. Device arrays are made on the current CuPy device; the copies run on
    :attr:`stream` (a new non-blocking stream unless one is given). A failed read raises from
    the range's :meth:`Pending.result`. :meth:`close` does not wait for reads still queued:
    take every result first."""

    def __init__(self, path: str, *, chunk: int = 16 << 20, n_threads: int = 8, stream=None):
        import cupy
        self._cp = cupy
        self._dev = cupy.cuda.runtime.getDevice()
        self.path = path
        self.chunk = int(chunk)
        self.stream = stream if stream is not None else cupy.cuda.Stream(non_blocking=True)
        self._fd = os.open(path, os.O_RDONLY)
        self._size = os.fstat(self._fd).st_size
        self._free: queue.Queue = queue.Queue()
        self._bufs = []
        for _ in range(max(1, n_threads)):
            mem = cupy.cuda.alloc_pinned_memory(self.chunk)
            ev = cupy.cuda.Event(block=False, disable_timing=True)
            ev.record(self.stream)   # "free": nothing copied from it yet
            self._bufs.append((mem, ev))
            self._free.put(len(self._bufs) - 1)
        self._pool = ThreadPoolExecutor(max(1, n_threads), thread_name_prefix="ggml-attn-upload")

    def read(self, offset: int, nbytes: int) -> "Pending":
        """Queue file bytes ``[offset, offset + nbytes)`` into a new CuPy uint8 array ``(nbytes,)``
        (allocated now, on the current device)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self._size:
            raise ValueError(f"{self.path}: bytes [{offset}, {offset + nbytes}) are outside the file "
                             f"({self._size} bytes)")
        with self._cp.cuda.ExternalStream(self.stream.ptr):
            dst = self._cp.empty(nbytes, dtype=self._cp.uint8)
        base = int(dst.data.ptr)
        jobs = [self._pool.submit(self._copy, offset + at, min(self.chunk, nbytes - at), base + at)
                for at in range(0, nbytes, self.chunk)]
        return Pending(dst, jobs)

    def _copy(self, offset: int, n: int, dst_ptr: int) -> None:
        cp = self._cp
        cp.cuda.runtime.setDevice(self._dev)   # this thread's copies go to the uploader's device
        i = self._free.get()
        mem, ev = self._bufs[i]
        try:
            ev.synchronize()   # the buffer's last copy to the device is done
            view = _byte_view(mem.ptr, n)
            got = 0
            while got < n:
                r = os.preadv(self._fd, [view[got:]], offset + got)
                if r <= 0:
                    raise OSError(f"{self.path}: short read at byte {offset + got} (file truncated?)")
                got += r
            cp.cuda.runtime.memcpyAsync(dst_ptr, mem.ptr, n, cp.cuda.runtime.memcpyHostToDevice, self.stream.ptr)
            ev.record(self.stream)
        finally:
            self._free.put(i)

    def close(self) -> None:
        """Wait for the reads and copies under way, then free the pinned buffers and close the file."""
        try:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self.stream.synchronize()
        finally:
            self._bufs.clear()
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Pending:
    """One range queued by :meth:`FileUploader.read`."""

    def __init__(self, array, jobs):
        self._array, self._jobs = array, jobs

    def result(self):
        """The device array, once every chunk of it has been read and its copy queued on the
        uploader's stream; raises a reader's error."""
        for j in self._jobs:
            j.result()
        return self._array


def _byte_view(ptr: int, n: int):
    """A writable memoryview of ``n`` bytes at host address ``ptr``."""
    import ctypes
    return memoryview((ctypes.c_char * n).from_address(ptr)).cast("B")
