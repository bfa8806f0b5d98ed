"""The ggml graph of one ubatch through a stack of attention layers.

Per layer, as llama.cpp's ``build_attn`` with a KV cache does (ggml order throughout):

1. store the ubatch's K/V rows into the cache: ``k_cur [n_embd_k_gqa, n_tokens]`` F32 into the
   cache ``[n_embd_k_gqa, kv_size * n_stream]`` at rows ``row_idx`` (I64 ``[n_tokens]``);
   ``ggml_set_rows`` on host graphs, a custom op on device-resident graphs;
2. view Q per stream: ``q_cur [D, n_head, n_tokens]`` -> ``[D, n_tps, n_head, n_stream]``;
3. view K/V of the ubatch's streams ``s0..s1``: ``[D, n_kv, n_head_kv, n_stream]``;
4. flash attention with the plan's mask ``[n_kv, n_tps, 1, n_stream]`` F16 ->
   ``[D_v, n_head, n_tps, n_stream]`` F32, i.e. numpy ``(n_tokens, n_head, D_v)`` in ubatch
   row order.

One builder serves both kinds of graph. The context is ``no_alloc``: every tensor's data is an
array of the cache's array module (numpy: host graph, computed by ggml's CPU backend; CuPy:
device-resident graph: K/V and every tensor in GPU memory). Device graphs may contain only custom ops and
views; :func:`check_device_graph` enforces that before compute.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import ggml
import numpy as np

from ggml_attn import op as fa_op
from ggml_attn.dtypes import GGML_TYPE_F16, GGML_TYPE_F32, STORAGE_DTYPES
from ggml_attn.tensor import as_numpy, from_ggml

from .kv_cache import KVCache
from .plan import UBatchPlan
from .qkv import AttnConfig

__all__ = ["UBatchGraph", "build_ubatch_graph", "check_device_graph", "check_build_args", "check_geometry",
           "GraphBuildError"]

GGML_TYPE_I64 = 27
_NO_COMPUTE_OPS = {ggml.GGML_OP_NONE, ggml.GGML_OP_VIEW, ggml.GGML_OP_RESHAPE, ggml.GGML_OP_PERMUTE,
                   ggml.GGML_OP_TRANSPOSE}
_DEVICE_OK_OPS = _NO_COMPUTE_OPS | {ggml.GGML_OP_CUSTOM}


class GraphBuildError(RuntimeError):
    """A graph that must not be computed (e.g. a built-in op on device memory)."""


def _ptr(arr) -> int:
    return int(arr.data.ptr) if hasattr(arr.data, "ptr") else int(arr.ctypes.data)


def check_device_graph(graph) -> None:
    """Raise :class:`GraphBuildError` if a node of ``graph`` is a built-in compute op: on a
    device-resident graph ggml's CPU backend would read device memory."""
    bad = []
    for i in range(ggml.ggml_graph_n_nodes(graph)):
        node = ggml.ggml_graph_node(graph, i)
        if node.contents.op not in _DEVICE_OK_OPS:
            bad.append(f"{node.contents.name.decode(errors='replace') or '?'} "
                       f"({ggml.ggml_op_name(node.contents.op).decode()})")
    if bad:
        raise GraphBuildError(f"device-resident graph has built-in CPU op(s) that would touch device "
                              f"memory: {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}")


# --------------------------------------------------------------- device store op
def _store_callback(dst_p, ith, nth, userdata):
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
        cache[idx] = rows.astype(cache.dtype)
    except BaseException as e:  # noqa: BLE001  (ggml would swallow it)
        fa_op.record_error(node, e, what="KV store op")


_STORE_CB = ggml.ggml_custom_op_t(_store_callback)


def _kernel_plan(mask_t, n_tps: int, n_stream: int, cfg: AttnConfig, kv_type: int):
    """The CUDA backend's live-tile plan for this ubatch's device mask (``cuda_backend.make_plan``),
    built once and kept on the ``UBatchPlan`` for every layer; None when the backend is absent."""
    try:
        from ggml_attn import cuda_backend  # noqa: PLC0415
    except ImportError:
        return None
    return cuda_backend.make_plan(from_ggml(mask_t, "kq_mask"), n_tps, cfg.n_head, cfg.n_head_kv,
                                  d_k=cfg.head_dim, d_v=cfg.d_v, kv_type=kv_type, ne3=n_stream)


# ------------------------------------------------------------------- the graph
@dataclass(eq=False)
class UBatchGraph:
    """A built ubatch graph. Inputs are written with :meth:`set_inputs`, results read with
    :meth:`outputs`; arrays are of the cache's array module, numpy order."""

    plan: UBatchPlan
    device: bool
    ctx: object
    graph: object
    q_in: list
    k_in: list
    v_in: list
    out: list
    _arrays: dict = field(default_factory=dict)  # tensor name -> backing array (kept alive)
    kernel_plan: object = None   # the tile map every layer's op uses; the ops hold it weakly

    def set_inputs(self, q, k, v) -> None:
        """``q[l] (n_tokens, n_head, D)``, ``k[l] (n_tokens, n_head_kv, D)``, ``v[l] (n_tokens,
        n_head_kv, D_v)`` per layer ``l``, numpy order, ubatch row order."""
        for name_list, vals in ((self.q_in, q), (self.k_in, k), (self.v_in, v)):
            for t, x in zip(name_list, vals):
                arr = self._arrays[id(t)]
                arr[...] = x.reshape(arr.shape)

    def compute(self, n_threads: int = 2) -> None:
        if self.device:
            check_device_graph(self.graph)
        cplan = ggml.ggml_graph_plan(self.graph, n_threads, None)
        work = None
        if cplan.work_size:
            work = np.empty(cplan.work_size, dtype=np.uint8)
            cplan.work_data = ctypes.cast(work.ctypes.data, ctypes.POINTER(ctypes.c_uint8))
        # errors of this graph's op nodes (attention, KV store) are raised on leaving, only those
        with fa_op.computing(self.graph):
            status = ggml.ggml_graph_compute(self.graph, ctypes.byref(cplan))  # plan reused by every layer
        del work
        if status != 0:
            raise GraphBuildError(f"ggml_graph_compute returned status {status}")

    def outputs(self) -> list:
        """Per layer, float32 ``(n_tokens, n_head, D_v)`` in ubatch row order (views)."""
        return [self._arrays[id(t)].reshape(self.plan.ubatch.n_tokens, *self._arrays[id(t)].shape[-2:])
                for t in self.out]

    def free(self) -> None:
        if self.ctx is not None:
            ggml.ggml_free(self.ctx)
            self.ctx = None
            self._arrays.clear()
            self.kernel_plan = None

    def __del__(self):
        try:
            self.free()
        except Exception:  # noqa: BLE001
            pass


def check_geometry(cache: KVCache, cfg: AttnConfig) -> None:
    """ValueError when ``cfg``'s layers or K/V geometry do not fit ``cache``."""
    if (cfg.n_head_kv, cfg.head_dim, cfg.d_v) != (cache.n_head_kv, cache.head_dim_k, cache.head_dim_v):
        raise ValueError(f"AttnConfig K/V geometry {cfg.n_head_kv}x{cfg.head_dim}/{cfg.d_v} (n_head_kv x "
                         f"head_dim/d_v) does not match the cache's {cache.n_head_kv}x{cache.head_dim_k}/"
                         f"{cache.head_dim_v}")
    if cfg.n_layer > cache.n_layer:
        raise ValueError(f"AttnConfig n_layer={cfg.n_layer} but the cache holds {cache.n_layer} layer(s)")


def check_build_args(cache: KVCache, cfg: AttnConfig, *, fa=None, all_custom: bool | None = None) -> bool:
    """Everything :func:`build_ubatch_graph` refuses, checked without a plan (so a caller can
    check before claiming cache cells). Returns True when the graph will be all-custom."""
    check_geometry(cache, cfg)
    on_device = cache.xp is not np
    device = on_device if all_custom is None else bool(all_custom)
    if on_device and not device:
        raise GraphBuildError("a CuPy cache needs an all-custom graph (all_custom must not be False)")
    if device and (fa or fa_op.flash_attn_ext) is ggml.ggml_flash_attn_ext:
        raise GraphBuildError("an all-custom (device-resident) graph needs ggml_attn.flash_attn_ext, "
                              "not ggml's built-in op")
    return device


def build_ubatch_graph(cache: KVCache, plan: UBatchPlan, cfg: AttnConfig, *, fa=None,
                       all_custom: bool | None = None) -> UBatchGraph:
    """Build the graph of ``plan``'s ubatch through ``cfg.n_layer`` layers.

    The graph is device-resident when the cache stores K/V in CuPy (``cache.xp`` is not
    numpy), a host graph otherwise. Device graphs are *all-custom*: the K/V store is our
    custom op instead of ``ggml_set_rows`` and the attention must be a custom op, checked by
    :func:`check_device_graph`. ``all_custom=True`` builds a host graph the same way (to test
    that form without a GPU). ``fa`` is the attention op, ``ggml_attn.flash_attn_ext`` by
    default; a host graph may use ``ggml.ggml_flash_attn_ext`` instead.
    """
    xp = cache.xp
    on_device = xp is not np
    device = check_build_args(cache, cfg, fa=fa, all_custom=all_custom)
    fa = fa or fa_op.flash_attn_ext
    ub = plan.ubatch
    n_tok, n_stream, n_tps, n_kv = ub.n_tokens, plan.n_stream, plan.n_tps, plan.n_kv
    kv_type = GGML_TYPE_F16 if cache.dtype == np.float16 else GGML_TYPE_F32
    n_rows_all = cache.kv_size * cache.n_stream
    n_tensors = 32 * cfg.n_layer + 16
    params = ggml.ggml_init_params(mem_size=n_tensors * ggml.ggml_tensor_overhead()
                                   + ggml.ggml_graph_overhead_custom(n_tensors, False) + 4096,
                                   mem_buffer=None, no_alloc=True)
    ctx = ggml.ggml_init(params)
    if not ctx:
        raise GraphBuildError("ggml_init failed")
    arrays: dict = {}

    def attach(t, arr):
        arrays[id(t)] = arr
        t.contents.data = ctypes.c_void_p(_ptr(arr))
        return t

    def new(type_, shape_np, dtype, name):
        ne = list(reversed(shape_np)) + [1] * (4 - len(shape_np))
        t = ggml.ggml_new_tensor(ctx, type_, len(shape_np), (ctypes.c_int64 * 4)(*ne))
        ggml.ggml_set_name(t, name.encode())
        return attach(t, xp.zeros(shape_np, dtype=dtype))

    def alloc_result(t, dtype, name):
        ggml.ggml_set_name(t, name.encode())
        shape = tuple(int(t.contents.ne[i]) for i in range(3, -1, -1))
        return attach(t, xp.zeros(shape, dtype=dtype))

    gf = ggml.ggml_new_graph_custom(ctx, n_tensors, False)
    idx = new(GGML_TYPE_I64, (n_tok,), np.int64, "row_idx")
    arrays[id(idx)][...] = xp.asarray(plan.row_idx)
    mask = new(GGML_TYPE_F16, (n_stream, 1, n_tps, n_kv), np.float16, "kq_mask")
    arrays[id(mask)][...] = xp.asarray(plan.mask)
    # the kernel plan reads the mask through its pointer: a plan kept on the UBatchPlan from an
    # earlier graph points at that graph's mask tensor, so rebuild it for this graph's mask
    kp_mask = getattr(plan.kernel_plan, "mask", None)
    if on_device and (kp_mask is None or kp_mask.ptr != _ptr(arrays[id(mask)])):
        plan.kernel_plan = _kernel_plan(mask, n_tps, n_stream, cfg, kv_type)
    kplan = plan.kernel_plan if on_device else None
    ds = 2 if kv_type == GGML_TYPE_F16 else 4
    q_in, k_in, v_in, outs = [], [], [], []
    for il in range(cfg.n_layer):
        ck = ggml.ggml_new_tensor_2d(ctx, kv_type, cache.n_embd_k_gqa, n_rows_all)
        cv = ggml.ggml_new_tensor_2d(ctx, kv_type, cache.n_embd_v_gqa, n_rows_all)
        ggml.ggml_set_name(ck, f"cache_k_l{il}".encode())
        ggml.ggml_set_name(cv, f"cache_v_l{il}".encode())
        attach(ck, cache.k[il])
        attach(cv, cache.v[il])
        q = new(GGML_TYPE_F32, (n_tok, cfg.n_head, cfg.head_dim), np.float32, f"q_l{il}")
        k = new(GGML_TYPE_F32, (n_tok, cfg.n_head_kv * cfg.head_dim), np.float32, f"k_l{il}")
        v = new(GGML_TYPE_F32, (n_tok, cfg.n_head_kv * cfg.d_v), np.float32, f"v_l{il}")
        q_in.append(q), k_in.append(k), v_in.append(v)
        # 1. store K/V rows
        for cache_t, cur in ((ck, k), (cv, v)):
            if device:
                args = (ctypes.POINTER(ggml.ggml_tensor) * 3)(cache_t, cur, idx)
                st = ggml.ggml_custom_4d(ctx, GGML_TYPE_F32, 1, 1, 1, 1, args, 3, _STORE_CB, 1,
                                         ctypes.c_void_p(1 if on_device else 0))
                alloc_result(st, np.float32, f"store_{ggml.ggml_get_name(cache_t).decode()}")
            else:
                st = ggml.ggml_set_rows(ctx, cache_t, cur, idx)
            ggml.ggml_build_forward_expand(gf, st)
        # 2. Q per stream [D, n_head, n_tps, n_stream] -> [D, n_tps, n_head, n_stream]
        qc = q.contents
        q4 = ggml.ggml_view_4d(ctx, q, cfg.head_dim, cfg.n_head, n_tps, n_stream,
                               qc.nb[1], qc.nb[2], qc.nb[2] * n_tps, 0)
        q4 = ggml.ggml_permute(ctx, q4, 0, 2, 1, 3)
        # 3. K/V of streams s0..s1: [D, n_head_kv, n_kv, ns] -> [D, n_kv, n_head_kv, ns]
        views = []
        for cache_t, d, n_embd in ((ck, cfg.head_dim, cache.n_embd_k_gqa), (cv, cfg.d_v, cache.n_embd_v_gqa)):
            row = n_embd * ds
            t = ggml.ggml_view_4d(ctx, cache_t, d, cfg.n_head_kv, n_kv, n_stream, d * ds, row,
                                  row * cache.kv_size, row * cache.kv_size * plan.slot.s0)
            views.append(ggml.ggml_permute(ctx, t, 0, 2, 1, 3))
        # 4. attention
        if fa is fa_op.flash_attn_ext:   # the ubatch's tile map, made once above, shared by every layer
            out = fa(ctx, q4, views[0], views[1], mask, cfg.scale, cfg.max_bias, cfg.logit_softcap,
                     plan=kplan)
        else:
            out = fa(ctx, q4, views[0], views[1], mask, cfg.scale, cfg.max_bias, cfg.logit_softcap)
        if fa is ggml.ggml_flash_attn_ext:
            ggml.ggml_flash_attn_ext_set_prec(out, 10)  # GGML_PREC_F32
        alloc_result(out, np.float32, f"attn_out_l{il}")
        outs.append(out)
        ggml.ggml_build_forward_expand(gf, out)
    g = UBatchGraph(plan, device, ctx, gf, q_in, k_in, v_in, outs, arrays, kplan)
    if device:
        check_device_graph(gf)
    return g
