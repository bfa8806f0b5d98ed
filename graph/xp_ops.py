"""The full block's dense ops as ggml custom ops over an array module ``xp`` (numpy or CuPy,
the same code), for all-custom (device-resident) graphs.

Every op's result memory and scratch is an array made at build time (``b.scratch``); the callback only runs
``xp`` functions with ``out=`` on arrays bound at build time: nothing is allocated while the
graph computes, nothing synchronizes (on CuPy each op launches work on the current stream).
Shapes at the function boundaries, ggml order ``[ne0, ne1]`` = numpy ``(ne1, ne0)``:

* :func:`mul_mat`: weight F16 numpy ``(n_out, n_in)`` = ggml ``[n_in, n_out]`` times
  ``h`` F32 ``[n_in, n_tokens]`` -> F32 ``[n_out, n_tokens]``; ``h`` is rounded to F16 first
  and the products summed in F32, as ggml's CPU ``mul_mat`` with an F16 weight does; the
  F16 GEMM output is widened to F32;
* :func:`rms_norm`: F32 ``[n, n_tokens]`` -> F32, ``x / sqrt(mean(x^2) + eps)`` per token;
* :func:`silu_mul`: ``silu(g) * u``, F32 ``[n_ff, n_tokens]``;
* :func:`add_into`: ``x += y`` in place; the node's result is ``x``'s memory.

Each function takes the graph builder ``b`` (``build.GraphBuilder``) and tensors made by it,
and returns the result tensor. Errors inside a callback are recorded for the node like the
attention op's (``ggml_attn.op.record_error``) and raised after compute.
"""
from __future__ import annotations

import ctypes
import itertools
import threading

import ggml
import numpy as np

from ggml_attn import op as fa_op

__all__ = ["mul_mat", "rms_norm", "silu_mul", "add_into", "release"]

_calls: dict[int, object] = {}
_keys = itertools.count(1)
_lock = threading.Lock()


def _callback(dst_p, ith, nth, userdata):
    if ith != 0:
        return
    node = ctypes.addressof(dst_p.contents)
    fa_op.register_node(node, ith)
    if fa_op.interrupted(node):
        return
    try:
        _calls[int(userdata or 0)]()
    except BaseException as e:  # noqa: BLE001  (ggml would swallow it)
        fa_op.record_error(node, e, what="xp op")


_CB = ggml.ggml_custom_op_t(_callback)


def release(keys) -> None:
    """Forget the callbacks of a freed graph."""
    with _lock:
        for k in keys:
            _calls.pop(k, None)


def _custom(b, fn, srcs, out_arr, name: str, *, alias=None):
    """A one-thread custom node with sources ``srcs`` (graph order), running ``fn()``; its result
    is ``out_arr`` (F32), or the memory of tensor ``alias`` when given."""
    with _lock:
        key = next(_keys)
        _calls[key] = fn
    b.op_keys.append(key)
    ne = list(reversed(out_arr.shape)) + [1] * (4 - out_arr.ndim)
    args = (ctypes.POINTER(ggml.ggml_tensor) * len(srcs))(*srcs)
    t = ggml.ggml_custom_4d(b.ctx, ggml.GGML_TYPE_F32, *ne, args, len(srcs), _CB, 1, ctypes.c_void_p(key))
    ggml.ggml_set_name(t, name.encode())
    return b.attach(t, out_arr)


def mul_mat(b, w: np.ndarray, h, name: str):
    """``w`` (xp F16 ``(n_out, n_in)``) x ``h`` (tensor F32 ``[n_in, n_tokens]``)."""
    xp = b.xp
    x = b.array(h)                                  # (n_tokens, n_in) F32
    n_tok, n_out = x.shape[0], w.shape[0]
    x16 = b.scratch(x.shape, np.float16)
    o16 = b.scratch((n_tok, n_out), np.float16)
    out = b.scratch((n_tok, n_out), np.float32)
    wt = w.T

    def run():
        xp.copyto(x16, x, casting="same_kind")
        xp.matmul(x16, wt, out=o16)
        xp.copyto(out, o16)
    b.keep(x16, o16, w)
    return _custom(b, run, [h], out, name)


def rms_norm(b, x_t, eps: float, name: str):
    xp = b.xp
    x = b.array(x_t)
    ms = b.scratch((x.shape[0], 1), np.float32)
    out = b.scratch(x.shape, np.float32)
    inv_n = np.float32(1.0 / x.shape[1])

    def run():
        xp.multiply(x, x, out=out)
        xp.sum(out, axis=1, keepdims=True, out=ms)
        xp.multiply(ms, inv_n, out=ms)
        xp.add(ms, np.float32(eps), out=ms)
        xp.sqrt(ms, out=ms)
        xp.divide(x, ms, out=out)
    b.keep(ms)
    return _custom(b, run, [x_t], out, name)


def silu_mul(b, g_t, u_t, name: str):
    xp = b.xp
    g, u = b.array(g_t), b.array(u_t)
    out = b.scratch(g.shape, np.float32)

    def run():
        xp.negative(g, out=out)
        xp.exp(out, out=out)
        xp.add(out, np.float32(1.0), out=out)
        xp.divide(g, out, out=out)
        xp.multiply(out, u, out=out)
    return _custom(b, run, [g_t, u_t], out, name)


def add_into(b, x_t, y_t, name: str):
    """``x += y``; returns a node whose memory is ``x``'s (the residual stream, updated)."""
    xp = b.xp
    x, y = b.array(x_t), b.array(y_t)

    def run():
        xp.add(x, y, out=x)
    return _custom(b, run, [x_t, y_t], x, name)
