"""The KV cache inside one ggml graph: its K/V views and its store op (llama.cpp's
``llama_kv_cache::get_k`` / ``get_v`` / ``cpy_k`` / ``cpy_v``).

:class:`KVTensors` (one per :class:`~ggml_attn.graph.kv_cache.KVCache`, :func:`kv_tensors`)
holds the cache tensors of every layer in a context of its own, ggml order
``K [n_embd_k_gqa, kv_size * n_stream]`` of the cache's type (``KVCache.type_k``), data pointing
at the cache's storage (no copy); in a graph's context it makes:

* :meth:`KVTensors.cpy_k` / :meth:`KVTensors.cpy_v`: the node that writes
  ``k_cur [n_embd_k_gqa, n_tokens]`` F32 at rows ``row_idx`` (I64 ``[n_tokens]``, the plan's
  ``row_idx``): ``ggml_set_rows`` on host graphs (any cache type, quantized ones included), the
  custom store op :func:`store_callback` on all-custom graphs (F16/F32 caches only: a
  ``ValueError`` otherwise);
* :meth:`KVTensors.get_k` / :meth:`KVTensors.get_v`: the ``[D, n_kv, n_head_kv, n_stream]``
  view (ggml order) of the ubatch's streams ``s0 .. s0 + n_stream - 1``, taken of the
  ``ggml_set_rows`` node so that attention runs after the store.
"""
from __future__ import annotations

import ctypes

import ggml
import numpy as np

from ggml_attn import op as fa_op
from ggml_attn.dtypes import STORAGE_DTYPES
from ggml_attn.tensor import as_numpy, from_ggml

from .kv_cache import KVCache

__all__ = ["KVTensors", "kv_tensors", "store_callback", "ggml_type_of", "data_ptr"]


def ggml_type_of(name: str) -> int:
    """ggml type id of a cache type name (``"q8_0"`` -> ``GGML_TYPE_Q8_0``)."""
    return int(getattr(ggml, f"GGML_TYPE_{name.upper()}"))


def data_ptr(arr) -> int:
    """Address of an array's data (numpy or CuPy)."""
    if isinstance(arr, np.ndarray):
        return arr.__array_interface__["data"][0]
    return int(arr.data.ptr)


# --------------------------------------------------------------- the custom store op
def store_callback(dst_p, ith, nth, userdata):
    """Custom op ``[cache2d, rows, idx] -> dummy``: ``cache2d[idx[i]] = rows[i]`` (graph thread 0).
    ``userdata`` 1: the tensors are CuPy device memory; 0: host memory (numpy). Errors are
    recorded for this node like the attention op's (``ggml_attn.op.record_error``)."""
    fa_op.run_custom_node(dst_p, ith, lambda d: _store(d, userdata), "KV store op")


def _store(dst_p, userdata) -> None:
    """The store itself (``store_callback``): device rows by one scatter launch, host rows by numpy."""
    d = dst_p.contents
    cache_t, rows_t, idx_t = d.src[0], d.src[1], d.src[2]
    if userdata:
        import cupy as cp  # noqa: PLC0415  (device graphs only)

        def wrap(t, dtype):
            c = t.contents
            shape = (int(c.ne[1]), int(c.ne[0]))
            mem = cp.cuda.UnownedMemory(int(c.data), shape[0] * shape[1] * np.dtype(dtype).itemsize, None)
            return cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(mem, 0))

        cache = wrap(cache_t, STORAGE_DTYPES[cache_t.contents.type])
        rows = wrap(rows_t, np.float32)
        idx = wrap(idx_t, np.int64).reshape(-1)
    else:
        cache = as_numpy(from_ggml(cache_t))[0, 0]
        rows = as_numpy(from_ggml(rows_t))[0, 0]
        idx = np.ctypeslib.as_array(ctypes.cast(idx_t.contents.data, ctypes.POINTER(ctypes.c_int64)),
                                    (int(idx_t.contents.ne[0]),))
    if rows.shape[1] != cache.shape[1] or idx.shape[0] != rows.shape[0]:
        raise ValueError(f"store: rows {rows.shape} / idx {idx.shape} do not fit cache {cache.shape}")
    if userdata:  # one launch on the current stream, nothing allocated
        _scatter_kernel()(rows, idx, rows.shape[1], cache, size=rows.size)
    else:
        cache[idx] = rows  # cast to the cache's dtype on assignment


_STORE_CB = ggml.ggml_custom_op_t(store_callback)
_SCATTER = []


def _scatter_kernel():
    """CuPy kernel ``dst[rows[t]] = (dst type) src[t]`` over F32 rows (compiled once)."""
    if not _SCATTER:
        import cupy as cp  # noqa: PLC0415  (device graphs only)
        _SCATTER.append(cp.ElementwiseKernel(
            "raw T src, raw int64 rows, int64 n_embd", "raw U dst",
            "long long t = i / n_embd; dst[rows[t] * n_embd + (i - t * n_embd)] = (U)src[i];",
            "ggml_attn_kv_store_rows"))
    return _SCATTER[0]


# ------------------------------------------------------------------ KV in a graph
class KVTensors:
    """``cache``'s K/V as ggml tensors: a small context of its own holds one tensor per layer and
    kind, ggml order ``[n_embd_gqa, kv_size * n_stream]`` of the cache's type, data pointing at
    the cache's storage; graphs take their views and store nodes in their own context. Get it
    with :func:`kv_tensors` (one per cache)."""

    def __init__(self, cache: KVCache):
        self.storage = (cache.k, cache.v)  # (kept alive; the tensors point into them)
        self.float_storage = cache.float_storage
        self.types = (cache.type_k, cache.type_v)
        self.on_device = cache.xp is not np
        self.kv_size, self.n_head_kv = cache.kv_size, cache.n_head_kv
        self.geom = {"k": (ggml_type_of(cache.type_k), cache.n_embd_k_gqa, cache.head_dim_k),
                     "v": (ggml_type_of(cache.type_v), cache.n_embd_v_gqa, cache.head_dim_v)}
        n = 2 * cache.n_layer
        self.ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=n * ggml.ggml_tensor_overhead() + 1024,
                                                        mem_buffer=None, no_alloc=True))
        self.tensors = {}
        for kind, store in (("k", cache.k), ("v", cache.v)):
            gtype, n_embd, _ = self.geom[kind]
            for il in range(cache.n_layer):
                t = ggml.ggml_new_tensor_2d(self.ctx, gtype, n_embd, cache.kv_size * cache.n_stream)
                ggml.ggml_set_name(t, f"cache_{kind}_l{il}".encode())
                t.contents.data = ctypes.c_void_p(data_ptr(store[il]))
                self.tensors[(kind, il)] = t

    def __del__(self):
        if getattr(self, "ctx", None):
            ggml.ggml_free(self.ctx)
            self.ctx = None

    def _cpy(self, ctx, kind: str, il: int, cur, row_idx, all_custom: bool, out_alloc):
        cache_t = self.tensors[(kind, il)]
        if not all_custom:
            return ggml.ggml_set_rows(ctx, cache_t, cur, row_idx)  # a view of the cache tensor
        if not self.float_storage:
            raise ValueError(f"an all-custom (device) graph stores K/V with its own op, which writes "
                             f"f16/f32 caches only; this cache is K {self.types[0]} / V {self.types[1]}")
        args = (ctypes.POINTER(ggml.ggml_tensor) * 3)(cache_t, cur, row_idx)
        st = ggml.ggml_custom_4d(ctx, ggml.GGML_TYPE_F32, 1, 1, 1, 1, args, 3, _STORE_CB, 1,
                                 ctypes.c_void_p(1 if self.on_device else 0))
        out_alloc(st, f"store_{kind}_l{il}")
        return st

    def cpy_k(self, ctx, il: int, k_cur, row_idx, *, all_custom: bool, out_alloc):
        """Node of graph context ``ctx`` storing ``k_cur [n_embd_k_gqa, n_tokens]`` F32 at rows
        ``row_idx`` (I64): ``ggml_set_rows``, or with ``all_custom`` the custom store op, whose
        (dummy) result gets its memory from ``out_alloc(t, name)``."""
        return self._cpy(ctx, "k", il, k_cur, row_idx, all_custom, out_alloc)

    def cpy_v(self, ctx, il: int, v_cur, row_idx, *, all_custom: bool, out_alloc):
        return self._cpy(ctx, "v", il, v_cur, row_idx, all_custom, out_alloc)

    def _get(self, ctx, kind: str, il: int, s0: int, n_kv: int, n_stream: int, after):
        gtype, n_embd, d = self.geom[kind]
        # a view of the set_rows node orders attention after the store; the custom store node
        # is not a view, so that order is the graph's node order (the store is expanded first)
        src = after if after is not None and after.contents.op == ggml.GGML_OP_SET_ROWS \
            else self.tensors[(kind, il)]
        row = int(ggml.ggml_row_size(gtype, n_embd))
        head = int(ggml.ggml_row_size(gtype, d))
        return ggml.ggml_view_4d(ctx, src, d, n_kv, self.n_head_kv, n_stream,
                                 row, head, row * self.kv_size, row * self.kv_size * s0)

    def get_k(self, ctx, il: int, s0: int, n_kv: int, n_stream: int, *, after=None):
        """``[head_dim_k, n_kv, n_head_kv, n_stream]`` view (graph context ``ctx``) of layer
        ``il``'s K, streams ``s0 .. s0 + n_stream - 1``; ``after``: the store node to follow."""
        return self._get(ctx, "k", il, s0, n_kv, n_stream, after)

    def get_v(self, ctx, il: int, s0: int, n_kv: int, n_stream: int, *, after=None):
        """``[head_dim_v, n_kv, n_head_kv, n_stream]`` view of layer ``il``'s V (not transposed)."""
        return self._get(ctx, "v", il, s0, n_kv, n_stream, after)


def kv_tensors(cache: KVCache) -> KVTensors:
    """The cache's :class:`KVTensors`, made once and kept on the cache."""
    kv = cache.__dict__.get("_kv_tensors")
    if kv is None or kv.storage[0] is not cache.k or kv.storage[1] is not cache.v:
        kv = cache.__dict__["_kv_tensors"] = KVTensors(cache)
    return kv
