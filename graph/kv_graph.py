"""The KV cache inside one ggml graph: its K/V views and its store op (llama.cpp's
``llama_kv_cache::get_k`` / ``get_v`` / ``cpy_k`` / ``cpy_v``, the two stores of a layer in one).

:class:`KVTensors` (one per :class:`~ggml_attn.graph.kv_cache.KVCache`, :func:`kv_tensors`)
holds the cache tensors of every layer in a context of its own, ggml order
``K [n_embd_k_gqa, kv_size * n_stream]`` of the cache's type (``KVCache.type_k``), data pointing
at the cache's storage (no copy); in a graph's context it makes:

* :meth:`KVTensors.cpy_kv`: the nodes that write layer ``il``'s ``k_cur [n_embd_k_gqa,
  n_tokens]`` and ``v_cur [n_embd_v_gqa, n_tokens]`` F32 at rows ``row_idx`` (I64 ``[n_tokens]``,
  the plan's ``row_idx``): two ``ggml_set_rows`` on host graphs (any cache type, quantized ones
  included), one custom store op (:func:`store_callback`) on all-custom graphs (one
  ``dense_kv_store`` launch of ``cuda/dense.cu`` on the device: F16, F32, Q8_0 or Q4_0 caches,
  quantized as ggml's CPU reference quantizes; the host form of that op, numpy, writes F16/F32
  caches only; a ``ValueError`` for any other type);
* :meth:`KVTensors.get_k` / :meth:`KVTensors.get_v`: the ``[D, n_kv, n_head_kv, n_stream]``
  view (ggml order) of the ubatch's streams ``s0 .. s0 + n_stream - 1``, taken of the
  ``ggml_set_rows`` node so that attention runs after the store.
"""
from __future__ import annotations

import ctypes

import ggml
import numpy as np

from ggml_attn import runtime as fa_runtime
from ggml_attn.tensor import as_numpy, from_ggml

from .kv_cache import DEVICE_BLOCK_TYPES, KVCache

__all__ = ["KVTensors", "kv_tensors", "store_callback", "ggml_type_of", "data_ptr", "check_custom_store",
           "DEVICE_STORE_TYPES", "HOST_STORE_TYPES"]


def ggml_type_of(name: str) -> int:
    """ggml type id of a cache type name (``"q8_0"`` -> ``GGML_TYPE_Q8_0``)."""
    return int(getattr(ggml, f"GGML_TYPE_{name.upper()}"))


def data_ptr(arr) -> int:
    """Address of an array's data (numpy or CuPy)."""
    if isinstance(arr, np.ndarray):
        return arr.__array_interface__["data"][0]
    return int(arr.data.ptr)


# --------------------------------------------------------------- the custom store op
def store_callback(node, ith, nth, userdata):
    """Custom op ``[cache_k, k_rows, cache_v, v_rows, idx] -> dummy`` (node: the node tensor's
    address): ``cache_k[idx[i]] = k_rows[i]`` and the same for V (graph thread 0). ``userdata``
    1: the tensors are CuPy device memory; 0 (None): host memory (numpy). Errors are recorded
    for this node like the attention op's (``ggml_attn.runtime.record_error``)."""
    fa_runtime.run_custom_node(node, ith, lambda: _store(ctypes.cast(node, _TENSOR_P), userdata), "KV store op")


_TENSOR_P = ctypes.POINTER(ggml.ggml_tensor)


def _src_key(d) -> tuple:
    """Data pointer, type and shape of the node's sources: what a bound store depends on."""
    out = []
    for i in range(5):
        c = d.src[i].contents
        out += (int(c.data or 0), int(c.type), int(c.ne[0]), int(c.ne[1]), int(c.nb[1]))
    return tuple(out)


def _store(dst_p, userdata) -> None:
    """The store itself (``store_callback``): device rows by one ``dense_kv_store`` launch, bound
    once per node and its sources; host rows by numpy."""
    d = dst_p.contents
    pairs = [(d.src[0], d.src[1]), (d.src[2], d.src[3])]
    idx_t = d.src[4]
    if userdata:
        node = ctypes.addressof(d)
        key = _src_key(d)
        bound = _BOUND_STORES.get(node)
        if bound is None or bound[0] != key:
            if len(_BOUND_STORES) > 4096:
                _BOUND_STORES.clear()
            bound = _BOUND_STORES[node] = (key, _bind_device_store(pairs, idx_t))
        bound[1]()
        return
    idx = np.ctypeslib.as_array(ctypes.cast(idx_t.contents.data, ctypes.POINTER(ctypes.c_int64)),
                                (int(idx_t.contents.ne[0]),))
    for cache_t, rows_t in pairs:
        cache = as_numpy(from_ggml(cache_t))[0, 0]
        rows = as_numpy(from_ggml(rows_t))[0, 0]
        _check_store(cache.shape, rows.shape, idx.shape)
        cache[idx] = rows  # cast to the cache's dtype on assignment


def _check_store(cache_shape, rows_shape, idx_shape) -> None:
    if rows_shape[1] != cache_shape[1] or idx_shape[0] != rows_shape[0]:
        raise ValueError(f"store: rows {rows_shape} / idx {idx_shape} do not fit cache {cache_shape}")


_BOUND_STORES: dict = {}   # store node address -> (_src_key, launch), see _store

# cache types the custom store op writes: its numpy form (cast on assignment) and its device
# form (cuda/dense.cu dense_kv_store, whose KV_TYPE_* codes are these types' ggml ids)
HOST_STORE_TYPES = ("f16", "f32")
DEVICE_STORE_TYPES = HOST_STORE_TYPES + DEVICE_BLOCK_TYPES


def check_custom_store(type_k: str, type_v: str, *, on_device: bool) -> None:
    """``ValueError`` unless the custom store op (all-custom graphs) writes caches of these types:
    :data:`DEVICE_STORE_TYPES` on the device, :data:`HOST_STORE_TYPES` on the host (its numpy
    form)."""
    ok = DEVICE_STORE_TYPES if on_device else HOST_STORE_TYPES
    if type_k not in ok or type_v not in ok:
        where = "a device (CuPy) cache" if on_device else "a host (numpy) cache"
        raise ValueError(f"an all-custom graph stores K/V with its own op, which writes {'/'.join(ok)} "
                         f"into {where}; this cache is K {type_k} / V {type_v}")


def _bind_device_store(pairs, idx_t):
    """A function of no arguments that stores the K and V rows of device tensors ``pairs``
    (``(cache, rows)``: cache ``[n, rows]`` (ggml order) of a :data:`DEVICE_STORE_TYPES` type,
    contiguous F32 rows ``[n, n_tok]``) at the rows ``idx_t`` (I64 ``[n_tok]``) names: one
    ``dense_kv_store`` launch on the current stream."""
    from ggml_attn import kernels as K  # noqa: PLC0415  (device graphs only)
    n_tok = int(idx_t.contents.ne[0])
    p = K.KVStoreParams()
    for i, (cache_t, rows_t) in enumerate(pairs):
        c, r = cache_t.contents, rows_t.contents
        _check_store((int(c.ne[1]), int(c.ne[0])), (int(r.ne[1]), int(r.ne[0])), (n_tok,))
        if r.type != ggml.GGML_TYPE_F32 or int(r.nb[1]) != 4 * int(r.ne[0]):
            raise ValueError("store: the rows must be contiguous F32")
        if c.type not in _DEVICE_STORE_IDS:
            raise ValueError(f"store: the device store writes {'/'.join(DEVICE_STORE_TYPES)} caches only")
        if c.type not in (ggml.GGML_TYPE_F16, ggml.GGML_TYPE_F32) and int(r.ne[0]) % 32:
            raise ValueError(f"store: rows of {int(r.ne[0])} values are not whole blocks of 32")
        p.src[i], p.dst[i] = int(r.data), int(c.data)
        p.n[i], p.type[i] = int(r.ne[0]), int(c.type)
    p.rows, p.n_tok = int(idx_t.contents.data), n_tok
    return K.BoundLaunch(K.get_function(K.dense_variant(), "dense_kv_store"), (n_tok, 2, 1), (128, 1, 1), p)


_DEVICE_STORE_IDS = tuple(ggml_type_of(t) for t in DEVICE_STORE_TYPES)
_STORE_CB = fa_runtime.c_callback(store_callback)
_FIVE_SRCS = ctypes.POINTER(ggml.ggml_tensor) * 5


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
        # per kind: bytes of one cell's row (all heads) and of one head's row
        self.row_bytes = {kind: (int(ggml.ggml_row_size(gtype, n_embd)), int(ggml.ggml_row_size(gtype, d)))
                          for kind, (gtype, n_embd, d) in self.geom.items()}
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

    def _check_custom(self) -> None:
        check_custom_store(*self.types, on_device=self.on_device)

    def cpy_kv(self, ctx, il: int, k_cur, v_cur, row_idx, *, all_custom: bool, out_alloc):
        """``(node storing K, node storing V)`` of layer ``il`` in graph context ``ctx`` (module
        doc): two ``ggml_set_rows``, or with ``all_custom`` one custom store node for both, whose
        (dummy) result gets its memory from ``out_alloc(t, name)``."""
        ck, cv = self.tensors[("k", il)], self.tensors[("v", il)]
        if not all_custom:   # views of the cache tensors
            return ggml.ggml_set_rows(ctx, ck, k_cur, row_idx), ggml.ggml_set_rows(ctx, cv, v_cur, row_idx)
        self._check_custom()
        args = _FIVE_SRCS(ck, k_cur, cv, v_cur, row_idx)
        st = ggml.ggml_custom_4d(ctx, ggml.GGML_TYPE_F32, 1, 1, 1, 1, args, 5, _STORE_CB, 1,
                                 1 if self.on_device else None)   # userdata: the device flag (NULL: host)
        out_alloc(st, f"store_kv_l{il}")
        return st, st

    def store_arrays(self, il: int):
        """``(K, V)`` of layer ``il`` as arrays of rows, numpy order ``(kv_size * n_stream,
        n_embd_gqa)`` F16/F32 (row ``r`` is the plan's ``row_idx`` value ``r``), for an op that
        stores the ubatch's K/V itself (``xp_ops.rope_store``); None unless both caches are float
        (the block types' quantization stays in the store op)."""
        if not all(t in HOST_STORE_TYPES for t in self.types):
            return None
        return tuple(s[il].reshape(-1, s.shape[-1]) for s in self.storage)

    def _get(self, ctx, kind: str, il: int, s0: int, n_kv: int, n_stream: int, after):
        d = self.geom[kind][2]
        # a view of the set_rows node orders attention after the store; the custom store node
        # is not a view, so that order is the graph's node order (the store is expanded first)
        src = after if after is not None and after.contents.op == ggml.GGML_OP_SET_ROWS \
            else self.tensors[(kind, il)]
        row, head = self.row_bytes[kind]
        return ggml.ggml_view_4d(ctx, src, d, n_kv, self.n_head_kv, n_stream,
                                 row, head, self.stream_bytes(kind), self.stream_bytes(kind) * s0)

    def stream_bytes(self, kind: str) -> int:
        """Bytes between two streams' first cells in the ``kind`` ("k"/"v") cache tensor: what a
        view of :meth:`get_k`/:meth:`get_v` moves by per stream."""
        return self.row_bytes[kind][0] * self.kv_size

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
