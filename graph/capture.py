"""CUDA-graph capture of a ubatch's launches (device-resident graphs only).

A device ubatch graph's compute is a fixed sequence of kernel launches once every op node has
bound its call (``ggml_attn.op``'s fast path): the same pointers, grids and parameter blocks
each time. :func:`capture` runs the compute once on a non-default stream (binding every node,
growing workspaces: nothing allocates afterwards), then records a second run into a CUDA graph;
replaying it costs one ``cudaGraphLaunch`` instead of a Python callback per op. Whoever
replays must keep every buffer the graph touches alive and write new inputs into the same
buffers (decode steps whose shapes repeat: the cache pads ``n_kv`` to 256).

A graph whose streams differ in priority (graph/path_gemm.py's side stream) is instantiated again
with the driver's ``CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY`` (:class:`NodePriorityGraph`):
a replay otherwise runs every node at the priority of the stream it is launched into.
"""
from __future__ import annotations

import ctypes

__all__ = ["capture", "CaptureError", "NodePriorityGraph", "USE_NODE_PRIORITY"]

USE_NODE_PRIORITY = 8   # CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY (cuda.h)


class CaptureError(RuntimeError):
    """The compute could not be captured (something in it synchronizes or allocates)."""


def capture(compute, stream, *, node_priority: bool = False):
    """Warm up ``compute()`` on ``stream`` (a non-default ``cupy.cuda.Stream``), then capture a
    second call into a CUDA graph and return it (``cupy.cuda.Graph``: ``.launch(stream)``; with
    ``node_priority`` a :class:`NodePriorityGraph` of it).
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
            g = stream.end_capture()
        except Exception as e:  # noqa: BLE001
            raise CaptureError(f"CUDA graph capture failed: {e}") from e
    return NodePriorityGraph(g) if node_priority else g


class NodePriorityGraph:
    """A captured ``cupy.cuda.Graph`` instantiated again with USE_NODE_PRIORITY: each kernel node
    runs at the priority its stream had when it was captured. ``.launch(stream)`` as CuPy's;
    the executable is destroyed with this object (the captured graph is kept with it)."""

    def __init__(self, graph):
        self.graph = graph
        lib = _driver()
        exe = ctypes.c_void_p()
        _check(lib.cuGraphInstantiateWithFlags(ctypes.byref(exe), ctypes.c_void_p(graph.graph),
                                               ctypes.c_ulonglong(USE_NODE_PRIORITY)), "cuGraphInstantiateWithFlags")
        self.exe = exe

    def launch(self, stream) -> None:
        _check(_driver().cuGraphLaunch(self.exe, ctypes.c_void_p(stream.ptr)), "cuGraphLaunch")

    def __del__(self):
        exe, self.exe = getattr(self, "exe", None), None
        if exe and _LIB:
            _LIB[0].cuGraphExecDestroy(exe)


_LIB: list = []


def _driver():
    """libcuda with the graph calls' prototypes (loaded once)."""
    if not _LIB:
        lib = ctypes.CDLL("libcuda.so.1")
        vp = ctypes.c_void_p
        lib.cuGraphInstantiateWithFlags.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_ulonglong]
        lib.cuGraphLaunch.argtypes = [vp, vp]
        lib.cuGraphExecDestroy.argtypes = [vp]
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        _LIB.append(lib)
    return _LIB[0]


def _check(rc: int, what: str) -> None:
    if rc:
        s = ctypes.c_char_p()
        _LIB[0].cuGetErrorName(rc, ctypes.byref(s))
        raise RuntimeError(f"{what} failed: {(s.value or b'?').decode()} ({rc})")
