"""CUDA-graph capture of a ubatch's launches (device-resident graphs only).

A device ubatch graph's compute is a fixed sequence of kernel launches once every op node has
bound its call (``ggml_attn.op``'s fast path): the same pointers, grids and parameter blocks
each time. :func:`capture` runs the compute once on a non-default stream (binding every node,
growing workspaces: nothing allocates afterwards), then records a second run into a CUDA graph;
replaying it costs one ``cudaGraphLaunch`` instead of a Python callback per op. Whoever
replays must keep every buffer the graph touches alive and write new inputs into the same
buffers (decode steps whose shapes repeat: the cache pads ``n_kv`` to 256).
"""
from __future__ import annotations

__all__ = ["capture", "CaptureError"]


class CaptureError(RuntimeError):
    """The compute could not be captured (something in it synchronizes or allocates)."""


def capture(compute, stream):
    """Warm up ``compute()`` on ``stream`` (a non-default ``cupy.cuda.Stream``), then capture a
    second call into a CUDA graph and return it (``cupy.cuda.Graph``: ``.launch(stream)``).
    The warm-up run's results are real results (the graph repeats the same work); an error of
    the warm-up propagates as it is, one of the captured run (something in the compute cannot
    be captured) as :class:`CaptureError`, after which the warm-up's results still stand."""
    with stream:
        compute()
        stream.begin_capture()
        try:
            compute()
        except BaseException as e:
            try:
                stream.end_capture()
            except Exception:  # noqa: BLE001 - the capture is invalid anyway; the first error wins
                pass
            if isinstance(e, Exception):   # the warm-up ran: this is about capturing, not the math
                raise CaptureError(f"CUDA graph capture failed: {e}") from e
            raise
        try:
            return stream.end_capture()
        except Exception as e:  # noqa: BLE001
            raise CaptureError(f"CUDA graph capture failed: {e}") from e
