"""The KV cache inside one ggml graph: its K/V views and its store op (llama.cpp's
``llama_kv_cache::get_k`` / ``get_v`` / ``cpy_k`` / ``cpy_v``).

:class:`KVTensors` wraps a :class:`~ggml_attn.graph.kv_cache.KVCache` for one graph context.
Per layer it makes the cache tensors, ggml order ``K [n_embd_k_gqa, kv_size * n_stream]`` of
the cache's type (``KVCache.type_k``), data pointing at the cache's storage (no copy), and:

* :meth:`KVTensors.cpy_k` / :meth:`KVTensors.cpy_v`: the node that writes
  ``k_cur [n_embd_k_gqa, n_tokens]`` F32 at rows ``row_idx`` (I64 ``[n_tokens]``, the plan's
  ``row_idx``): ``ggml_set_rows`` on host graphs (any cache type, quantized ones included), the
  custom store op :func:`store_callback` on all-custom graphs (F16/F32 caches only: a
  ``ValueError`` otherwise);
* :meth:`KVTensors.get_k` / :meth:`KVTensors.get_v`: the ``[D, n_kv, n_head_kv, n_stream]``
  view (ggml order) of the ubatch's streams ``s0 .. s0 + n_stream - 1``, taken of the store
  node so that attention runs after the store.
"""
from __future__ import annotations

import ctypes

import ggml
import numpy as np

from ggml_attn import op as fa_op
from ggml_attn.dtypes import STORAGE_DTYPES
from ggml_attn.tensor import as_numpy, from_ggml

from .kv_cache import KVCache

__all__ = ["KVTensors", "store_callback", "ggml_type_of"]


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
    if ith != 0:
        return
    node = ctypes.addressof(dst_p.contents)
    fa_op.register_node(node, ith)
    if fa_op.interrupted(node):
        return
    try:
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
    except BaseException as e:  # noqa: BLE001  (ggml would swallow it)
        fa_op.record_error(node, e, what="KV store op")


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
    """``cache``'s K/V in graph context ``ctx``. ``attach(t, arr)`` points a tensor at an array
    and keeps the array alive with the graph; ``all_custom``: store with the custom op."""

    def __init__(self, cache: KVCache, ctx, attach, *, all_custom: bool):
        self.cache, self.ctx, self.attach, self.all_custom = cache, ctx, attach, bool(all_custom)
        self.type_k, self.type_v = ggml_type_of(cache.type_k), ggml_type_of(cache.type_v)
        if self.all_custom and not cache.float_storage:
            raise ValueError(f"an all-custom (device) graph stores K/V with its own op, which writes "
                             f"f16/f32 caches only; this cache is K {cache.type_k} / V {cache.type_v}")
        self._tensors: dict[tuple[str, int], object] = {}
        self._stored: dict[tuple[str, int], object] = {}

    def _tensor(self, kind: str, il: int):
        t = self._tensors.get((kind, il))
        if t is None:
            c = self.cache
            gtype, n_embd, store = ((self.type_k, c.n_embd_k_gqa, c.k) if kind == "k"
                                    else (self.type_v, c.n_embd_v_gqa, c.v))
            t = ggml.ggml_new_tensor_2d(self.ctx, gtype, n_embd, c.kv_size * c.n_stream)
            ggml.ggml_set_name(t, f"cache_{kind}_l{il}".encode())
            self.attach(t, store[il])
            self._tensors[(kind, il)] = t
        return t

    def _cpy(self, kind: str, il: int, cur, row_idx, out_alloc):
        cache_t = self._tensor(kind, il)
        if self.all_custom:
            args = (ctypes.POINTER(ggml.ggml_tensor) * 3)(cache_t, cur, row_idx)
            on_device = self.cache.xp is not np
            st = ggml.ggml_custom_4d(self.ctx, ggml.GGML_TYPE_F32, 1, 1, 1, 1, args, 3, _STORE_CB, 1,
                                     ctypes.c_void_p(1 if on_device else 0))
            out_alloc(st, f"store_{kind}_l{il}")
            self._stored[(kind, il)] = cache_t  # ordered by the graph's node order
        else:
            st = ggml.ggml_set_rows(self.ctx, cache_t, cur, row_idx)  # a view of the cache tensor
            self._stored[(kind, il)] = st
        return st

    def cpy_k(self, il: int, k_cur, row_idx, out_alloc):
        """Store node of ``k_cur [n_embd_k_gqa, n_tokens]`` F32 at ``row_idx``; ``out_alloc(t,
        name)`` gives the custom op's (dummy) result memory."""
        return self._cpy("k", il, k_cur, row_idx, out_alloc)

    def cpy_v(self, il: int, v_cur, row_idx, out_alloc):
        return self._cpy("v", il, v_cur, row_idx, out_alloc)

    def _get(self, kind: str, il: int, s0: int, n_kv: int, n_stream: int):
        c = self.cache
        gtype, n_embd, d = ((self.type_k, c.n_embd_k_gqa, c.head_dim_k) if kind == "k"
                            else (self.type_v, c.n_embd_v_gqa, c.head_dim_v))
        src = self._stored.get((kind, il)) or self._tensor(kind, il)
        row = int(ggml.ggml_row_size(gtype, n_embd))
        head = int(ggml.ggml_row_size(gtype, d))
        return ggml.ggml_view_4d(self.ctx, src, d, n_kv, c.n_head_kv, n_stream,
                                 row, head, row * c.kv_size, row * c.kv_size * s0)

    def get_k(self, il: int, s0: int, n_kv: int, n_stream: int):
        """``[head_dim_k, n_kv, n_head_kv, n_stream]`` view of layer ``il``'s K, streams from ``s0``."""
        return self._get("k", il, s0, n_kv, n_stream)

    def get_v(self, il: int, s0: int, n_kv: int, n_stream: int):
        """``[head_dim_v, n_kv, n_head_kv, n_stream]`` view of layer ``il``'s V (not transposed)."""
        return self._get("v", il, s0, n_kv, n_stream)
