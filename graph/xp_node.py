"""The custom nodes of all-custom (device-resident) graphs' dense and model ops (``xp_matmul``,
``xp_ops``): a one-thread ``ggml_custom_4d`` node whose callback runs a Python function bound at
build time, its result an array of the graph (``b.attach``). Errors inside a callback are
recorded for the node like the attention op's (``ggml_attn.runtime.record_error``) and raised
after compute; :func:`release` forgets a freed graph's callbacks.
"""
from __future__ import annotations

import ctypes
import itertools
import threading

import ggml

from ggml_attn import runtime as fa_runtime
from ggml_attn.kernels import then   # (re-exported: the graph's launch steps as one callable)

__all__ = ["custom", "release", "dptr", "then"]


_calls: dict[int, object] = {}


_keys = itertools.count(1)


_lock = threading.Lock()


def _callback(node, ith, nth, userdata):
    fa_runtime.run_custom_node(node, ith, _calls.get(userdata) or _gone, "xp op")


def _gone():
    raise RuntimeError("this dense op's build-time state is gone (its graph was freed)")


_CB = fa_runtime.c_callback(_callback)


def release(keys) -> None:
    """Forget the callbacks of a freed graph."""
    with _lock:
        for k in keys:
            _calls.pop(k, None)


_SRC_ARRAYS = [ctypes.POINTER(ggml.ggml_tensor) * n for n in range(11)]   # by source count


_F32 = ggml.GGML_TYPE_F32


def custom(b, fn, srcs, out_arr, name: str, *, ptr: int | None = None):
    """A one-thread custom node with sources ``srcs`` (graph order), running ``fn()``; its result
    is ``out_arr`` (F32, numpy order, at most 4-D), whose data address is ``ptr`` when the caller
    knows it."""
    with _lock:
        key = next(_keys)
        _calls[key] = fn
    b.op_keys.append(key)
    shape = out_arr.shape
    nd = len(shape)
    ne = shape[::-1] + (1,) * (4 - nd)
    t = ggml.ggml_custom_4d(b.ctx, _F32, ne[0], ne[1], ne[2], ne[3], _SRC_ARRAYS[len(srcs)](*srcs), len(srcs),
                            _CB, 1, key)
    ggml.ggml_set_name(t, name.encode())
    return b.attach(t, out_arr, ptr)


def views(b, node, parts: list, base: int, name: str) -> list:
    """Tensors ``name.i`` viewing ``node``'s memory (F32, address ``base``) as ``parts``: xp F32
    arrays lying one after another in it, each C-contiguous (numpy order, 2-D or 3-D); each view
    gets its part as its array (the results of a node with several outputs)."""
    out, off = [], 0
    for a in parts:
        ne = a.shape[::-1]
        if len(ne) == 2:
            v = ggml.ggml_view_2d(b.ctx, node, ne[0], ne[1], ne[0] * 4, off * 4)
        else:
            v = ggml.ggml_view_3d(b.ctx, node, ne[0], ne[1], ne[2], ne[0] * 4, ne[0] * ne[1] * 4, off * 4)
        ggml.ggml_set_name(v, f"{name}.{len(out)}".encode())
        out.append(b.attach(v, a, base + off * 4))
        off += a.size
    return out


def dptr(a) -> ctypes.c_uint64:
    """Device pointer of CuPy array ``a`` (None: a null pointer) as a kernel argument."""
    return ctypes.c_uint64(0 if a is None else a.data.ptr)
