"""The ggml graph of one ubatch through a stack of layers: one builder, a per-layer hook.

Per layer, as llama.cpp's ``build_attn`` with a KV cache does (ggml order throughout; the
layer functions are in ``layers.py``):

1. store the ubatch's K/V rows into the cache (``kv_graph.KVTensors.cpy_kv``):
   ``k_cur [n_embd_k_gqa, n_tokens]`` F32 at rows ``row_idx`` (I64 ``[n_tokens]``);
   ``ggml_set_rows`` on host graphs, a custom op on all-custom graphs;
2. view Q per stream: ``q_cur [D, n_head, n_tokens]`` -> ``[D, n_tps, n_head, n_stream]``;
3. view K/V of the ubatch's streams (``get_k/get_v``): ``[D, n_kv, n_head_kv, n_stream]``;
4. attention with the plan's mask ``[n_kv, n_tps, 1, n_stream]`` F16 ->
   ``[head_dim_v, n_head, n_tps, n_stream]`` F32, i.e. numpy ``(n_tokens, n_head, head_dim_v)`` in ubatch
   row order: flash attention (our op or ggml's), or ``-fa off``'s ``mul_mat`` + ``soft_max_ext``.

``layer="attn"`` runs steps 1-4 on Q/K/V inputs per layer; ``layer="full"`` runs the whole
block (norms, projections, attention, FFN) on the residual stream ``x [n_embd, n_tokens]``;
any ``layer(b, il, cur) -> cur`` function of a :class:`GraphBuilder` works the same way.

One builder serves both kinds of graph. The context is ``no_alloc``: every tensor's data is an
array of the cache's array module, made at build time (numpy: host graph, computed by ggml's
CPU backend; CuPy: device-resident graph: K/V and every tensor in GPU memory). Device graphs
may contain only custom ops and views; :func:`check_device_graph` enforces that before compute.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import ggml
import numpy as np

from ggml_attn import op as fa_op
from ggml_attn import runtime as fa_runtime
from ggml_attn.dtypes import GGML_TYPE_F16, GGML_TYPE_F32
from ggml_attn.tensor import from_ggml

from . import layers as layer_fns
from . import model_graph, xp_node
from .kv_cache import KVCache
from .kv_graph import data_ptr, ggml_type_of, kv_tensors
from .plan import UBatchPlan
from .attn_config import AttnConfig
from .build_checks import (LAYERS, GraphBuildError, check_build_args, check_device_graph,  # noqa: F401 (re-exported)
                           check_geometry, check_layers)

__all__ = ["UBatchGraph", "GraphBuilder", "build_ubatch_graph", "graph_key", "check_device_graph", "check_build_args",
           "check_geometry", "check_layers", "GraphBuildError", "LAYERS"]

GGML_TYPE_I64 = 27
_ptr = data_ptr
_NP_DTYPES = {GGML_TYPE_F32: np.float32, GGML_TYPE_F16: np.float16}
_DTYPE_STRS: dict = {}


def _dtype_str(dtype) -> str:
    """``np.dtype(dtype).str``, remembered per ``dtype`` object."""
    s = _DTYPE_STRS.get(dtype)
    if s is None:
        s = _DTYPE_STRS[dtype] = np.dtype(dtype).str
    return s


def _kernel_plan(mask_t, n_tps: int, n_stream: int, cfg: AttnConfig, kv_type: int):
    """The CUDA backend's live-tile plan for this ubatch's device mask (``cuda_backend.make_plan``),
    built once and kept on the ``UBatchPlan`` for every layer; None when the backend is absent."""
    try:
        from ggml_attn import cuda_backend  # noqa: PLC0415
    except ImportError:
        return None
    return cuda_backend.make_plan(from_ggml(mask_t, "kq_mask"), n_tps, cfg.n_head, cfg.n_head_kv,
                                  head_dim_k=cfg.head_dim_k, head_dim_v=cfg.head_dim_v, kv_type=kv_type, ne3=n_stream,
                                  kernel=fa_op.settings()[1])


# ------------------------------------------------------------------- the graph
def graph_key(plan: UBatchPlan) -> tuple:
    """The structure of a ubatch plan's graph: tokens, streams (their count), KV cells viewed,
    decode step or not (``UBatch.decode_step``: a decode step's kernel plan may choose the
    cell-list kernel, which a prompt chunk of the same size must not inherit). Plans with equal
    keys differ only in mask and row-index contents and in their first stream, which
    :meth:`UBatchGraph.load_plan` moves the K/V views to: with one stream per sequence, a prompt
    of 64 sequences is 64 x (its n_kv steps) ubatches of a few structures, not one structure
    each (each built anew: ~30 ms of host time per 8B model graph on the H200's host)."""
    return (plan.ubatch.n_tokens, plan.n_stream, plan.n_tps, plan.n_kv, plan.ubatch.decode_step)


def _np_shape(t) -> tuple[int, ...]:
    """numpy shape of a tensor: its ``ne`` reversed, at least 2-D (``[n, n_tokens]`` ->
    ``(n_tokens, n)``); trailing size-1 dims of ``ne`` dropped, as ``ggml_n_dims`` counts them."""
    ne = t.contents.ne[:]
    return tuple(ne[::-1]) if ne[3] > 1 else (ne[2], ne[1], ne[0]) if ne[2] > 1 else (ne[1], ne[0])


def _addr(t) -> int:
    return ctypes.addressof(t.contents)


@dataclass(eq=False)
class UBatchGraph:
    """A built ubatch graph. Inputs are written with :meth:`set_inputs` (``layer="attn"``) or
    :meth:`set_x` (``layer="full"``), results read with :meth:`outputs`; arrays are of the
    cache's array module, numpy order."""

    plan: UBatchPlan
    device: bool
    ctx: object
    graph: object
    q_in: list
    k_in: list
    v_in: list
    out: list
    _arrays: dict = field(default_factory=dict)  # tensor address -> backing array (kept alive)
    x_in: object = None
    mask_t: object = None
    row_idx_t: object = None
    xp: object = np          # the array module of the graph's arrays
    _checked: bool = False   # check_device_graph passed
    layer: str = "attn"
    _op_keys: list = field(default_factory=list)
    _keep: list = field(default_factory=list)
    kernel_plan: object = None   # the tile map every layer's op uses; the ops hold it weakly
    n_out: int = 0               # layer="model": rows with logits
    model_in: object = None      # layer="model": model_graph.ModelInputs (tokens, positions, out_ids)
    _stager: object = None       # load_plan's host-to-device copies (device graphs; staging.py)
    kv_views: list = field(default_factory=list)   # (K/V view tensor, bytes per stream): load_plan's moves

    def array(self, t):
        return self._arrays[_addr(t)]

    def set_inputs(self, q, k, v) -> None:
        """``q[l] (n_tokens, n_head, D)``, ``k[l] (n_tokens, n_head_kv, D)``, ``v[l] (n_tokens,
        n_head_kv, head_dim_v)`` per layer ``l`` (one set when the inputs are shared by all layers),
        numpy order, ubatch row order."""
        for name_list, vals in ((self.q_in, q), (self.k_in, k), (self.v_in, v)):
            for t, x in zip(name_list, vals):
                arr = self.array(t)
                arr[...] = x.reshape(arr.shape)

    def load_plan(self, plan: UBatchPlan, tokens=None, out_rows=None) -> None:
        """Make this built graph compute ``plan``, a ubatch plan with the same :func:`graph_key`:
        its mask and row indices are copied into the graph's inputs and the kernel plan is
        rebuilt in place on the current stream (``Plan.refresh``; a captured CUDA graph replays
        the same launches). Nothing is allocated on the device. ``layer="model"``: also the
        token ids (``tokens``: the batch's) and positions of the ubatch and its output rows
        (``out_rows``, as many as the graph was built for)."""
        if graph_key(plan) != graph_key(self.plan):
            raise ValueError(f"plan {graph_key(plan)} does not fit a graph built for {graph_key(self.plan)}")
        self._move_views(plan.slot.s0 - self.plan.slot.s0)
        pairs = ((self.array(self.mask_t), plan.mask), (self.array(self.row_idx_t), plan.row_idx))
        if self.model_in is not None:
            if out_rows is None or len(out_rows) != self.n_out:
                raise ValueError(f"a model graph built for {self.n_out} output rows needs as many out_rows")
            pairs += tuple(zip((self.array(t) for t in self.model_in.tensors()),
                               model_graph.input_values(plan.ubatch, tokens, out_rows)))
        if self.xp is np:
            for arr, host in pairs:
                arr[...] = np.asarray(host, dtype=arr.dtype).reshape(arr.shape)
        else:
            # asynchronous on the current stream: the host goes on to the next ubatch while
            # the device computes this one (staging.py)
            if self._stager is None:
                from .staging import Stager  # noqa: PLC0415 (device graphs only)
                self._stager = Stager(self.xp)
            self._stager.copy(pairs)
        self.plan = plan
        plan.kernel_plan = self.kernel_plan

    def _move_views(self, streams: int) -> None:
        """Point every K/V view ``streams`` streams further into the cache (its data pointer
        and view offset; the ops read both at compute time, a changed pointer rebinds the
        attention op's launch)."""
        if not streams:
            return
        for t, stride in self.kv_views:
            c = t.contents
            c.data = ctypes.c_void_p(int(c.data) + streams * stride)
            c.view_offs += streams * stride

    def refresh_kernel_plan(self) -> None:
        """Rebuild the kernel plan from the graph's mask as it is now (device graphs)."""
        if self.kernel_plan is not None:
            self.kernel_plan.refresh()

    def set_x(self, x) -> None:
        """The residual stream ``x (n_tokens, n_embd)`` F32, numpy order (``layer="full"``)."""
        arr = self.array(self.x_in)
        arr[...] = x.reshape(arr.shape)

    def compute(self, n_threads: int = 2) -> None:
        if self.device and not self._checked:   # the nodes never change after build: once
            check_device_graph(self.graph)
            self._checked = True
        # errors of this graph's op nodes (attention, KV store) are raised on leaving, only those
        with fa_runtime.computing(self.graph):
            status = fa_runtime.plan_and_compute(self.graph, n_threads)
        if status != 0:
            raise GraphBuildError(f"ggml_graph_compute returned status {status}")

    def outputs(self) -> list:
        """``layer="attn"``: per layer, float32 ``(n_tokens, n_head, head_dim_v)``; ``layer="full"``:
        ``[x (n_tokens, n_embd)]``, the residual stream after the last layer; ``layer="model"``:
        ``[logits (n_out, n_vocab)]`` of the output rows (``out_rows`` order). Ubatch row order
        (views)."""
        return [self.output(i) for i in range(len(self.out))]

    def output(self, i: int):
        """Output ``i`` of :meth:`outputs` alone (a view)."""
        a = self.array(self.out[i])
        if self.layer == "model":
            return a[:self.n_out]
        n = self.plan.ubatch.n_tokens
        return a.reshape(n, -1) if self.layer == "full" else a.reshape(n, *a.shape[-2:])

    def free(self) -> None:
        try:
            if self._stager is not None:   # the stream may still copy out of its pinned buffers
                self._stager.wait()
        finally:
            self._stager = None
            self._free_graph()

    def _free_graph(self) -> None:
        if self.ctx is not None:
            ggml.ggml_free(self.ctx)
            self.ctx = None
            self._arrays.clear()
            xp_node.release(self._op_keys)
            self._op_keys.clear()
            self._keep.clear()
            self.kernel_plan = None

    def __del__(self):
        try:
            self.free()
        except Exception:  # noqa: BLE001
            pass


class GraphBuilder:
    """What a layer function builds with: the ``no_alloc`` context and graph of one ubatch,
    ``plan``/``cfg``, the mask and row index inputs, the cache's tensors (``kv``:
    :class:`~ggml_attn.graph.kv_graph.KVTensors`, kept alive with the graph), the attention step (``attention``),
    ``weights`` (per layer, see ``layers.full_layer``) and ``device`` (all-custom graph).
    Every tensor with memory of its own gets an ``xp`` array here, at build time."""

    layers: range | None = None   # the global layers of the graph (build_ubatch_graph's ``layers``)

    model = None            # layer="model": the graph.model.Model, its inputs and the batch's token ids
    model_inputs = None
    batch_tokens = None

    def __init__(self, cache: KVCache, plan: UBatchPlan, cfg: AttnConfig, *, device: bool, attention,
                 weights=None, shared_inputs: bool = False, reuse: bool = False, n_tensors: int = 256):
        self.cache, self.plan, self.cfg, self.xp = cache, plan, cfg, cache.xp
        self.device, self.attention, self.weights = device, attention, weights
        self.shared_inputs, self.reuse = shared_inputs, reuse
        self._step, self._scratch = 0, {}
        params = ggml.ggml_init_params(mem_size=n_tensors * ggml.ggml_tensor_overhead()
                                       + ggml.ggml_graph_overhead_custom(n_tensors, False) + 4096,
                                       mem_buffer=None, no_alloc=True)
        self.ctx = ggml.ggml_init(params)
        if not self.ctx:
            raise GraphBuildError("ggml_init failed")
        self.gf = ggml.ggml_new_graph_custom(self.ctx, n_tensors, False)
        self.arrays: dict = {}
        self.op_keys: list = []
        self.kept: list = []
        self.q_in, self.k_in, self.v_in = [], [], []
        self.kv_views: list = []   # (K/V view, bytes per stream) of every layer (layers.attention)
        self._weights: dict = {}
        self._ptrs: dict = {}   # id(array) -> (array, data address): arrays attached more than once
        self._inputs: list = []   # [q, k, v] zeroed arrays of the layers still to come (qkv_inputs)
        # tensor address -> ((xq, xd, xs), the RMS norm it is of or None): a node's output in 8-bit
        # form, made by that node (xp_matmul.mul_mat_gated's ``down``, mul_mat_add's ``norm_next``)
        # for the 8-bit GEMVs that multiply it next (graph/q8_handoff.py)
        self.q8_forms: dict = {}
        self.f16_forms: dict = {}   # tensor address -> its F16 form, made by its node (q8_handoff.remember_f16)
        self.kv = kv_tensors(cache)

    # -- memory
    def attach(self, t, arr, ptr: int | None = None):
        """Make ``arr`` (an ``xp`` array) the memory of tensor ``t``; ``ptr``: its data address
        when the caller knows it (else read off the array)."""
        c = t.contents
        self.arrays[ctypes.addressof(c)] = arr
        c.data = _ptr(arr) if ptr is None else ptr
        return t

    def ptr(self, arr) -> int:
        """Data address of ``arr``, remembered (with the array) for arrays asked again: the
        scratch arrays every layer reuses."""
        e = self._ptrs.get(id(arr))
        if e is None:
            e = self._ptrs[id(arr)] = (arr, _ptr(arr))
        return e[1]

    def begin_layer(self, il: int) -> None:
        """Layer ``il`` starts: its results may reuse the previous layer's (``reuse``)."""
        self._step = 0

    def scratch(self, shape, dtype):
        """A new array for a result, made now. With ``reuse`` (layers whose intermediates do not
        outlive the layer: the full block), the k-th array a layer asks for is the one the
        layer before got as its k-th: the graph computes layer by layer (one stream on the
        device), so every reader of the earlier one has run before the later one is written;
        memory stays at one layer's intermediates."""
        if not self.reuse:
            return self.xp.empty(shape, dtype=dtype)
        key = (self._step, shape if type(shape) is tuple else tuple(shape),
               _DTYPE_STRS.get(dtype) or _dtype_str(dtype))
        self._step += 1
        arr = self._scratch.get(key)
        if arr is None:
            arr = self._scratch[key] = self.xp.empty(shape, dtype=dtype)
        return arr

    def keep(self, *arrs) -> None:
        """Keep arrays alive as long as the graph (scratch of custom ops)."""
        self.kept.extend(arrs)

    def new(self, type_, shape_np, dtype, name, arr=None):
        """A zeroed input tensor of numpy shape ``shape_np``; ``arr``: the zeroed ``xp`` array of
        that shape and dtype to use (else a new one)."""
        ne = list(reversed(shape_np)) + [1] * (4 - len(shape_np))
        t = ggml.ggml_new_tensor(self.ctx, type_, len(shape_np), (ctypes.c_int64 * 4)(*ne))
        ggml.ggml_set_name(t, name.encode())
        return self.attach(t, self.xp.zeros(shape_np, dtype=dtype) if arr is None else arr)

    def _zeroed_f32(self, shapes: list, n_sets: int) -> list:
        """``n_sets`` sets of zeroed F32 ``xp`` arrays of numpy ``shapes``, all views of one
        allocation (each starting 256-byte aligned): the per-layer inputs in one ``zeros``."""
        sizes = [int(np.prod(sh)) for sh in shapes]
        spans = [-(-n // 64) * 64 for n in sizes]   # floats, rounded up to 256 bytes
        block = self.xp.zeros(n_sets * sum(spans), dtype=np.float32)
        out, off = [], 0
        for _ in range(n_sets):
            arrs = []
            for sh, n, span in zip(shapes, sizes, spans):
                arrs.append(block[off:off + n].reshape(sh))
                off += span
            out.append(arrs)
        return out

    def result(self, t, name: str | None = None):
        """Give an op's result tensor its memory (an F32/F16 array of its shape, bytes for other
        types), unless it has some (a view)."""
        if name:
            ggml.ggml_set_name(t, name.encode())
        c = t.contents
        if not c.data:
            dtype = _NP_DTYPES.get(c.type)
            if dtype is None:  # bf16 / block types: bytes (host graphs only read them through ggml)
                arr = self.scratch((int(ggml.ggml_nbytes(t)),), np.uint8)
            else:
                arr = self.scratch(_np_shape(t), dtype)
            self.attach(t, arr, self.ptr(arr))
        return t

    def call(self, fn, *args):
        """``fn(ctx, *args)`` (a ggml op), its result given memory."""
        return self.result(fn(self.ctx, *args))

    def array(self, t):
        """The ``xp`` array of a tensor with memory, or of a contiguous view at offset 0 of one
        (reshaped), numpy order (at least 2-D)."""
        c = t.contents
        arr = self.arrays.get(ctypes.addressof(c))
        if arr is not None:
            return arr.reshape(_np_shape(t))
        if c.view_src and int(c.view_offs) == 0 and ggml.ggml_is_contiguous(t):
            return self.arrays[_addr(c.view_src)].reshape(_np_shape(t))
        raise GraphBuildError(f"tensor {ggml.ggml_get_name(t).decode()!r} has no array of its own")

    def expand(self, t) -> None:
        ggml.ggml_build_forward_expand(self.gf, t)

    # -- inputs
    def qkv_inputs(self, il: int):
        """Q/K/V input tensors of layer ``il`` (attention-only layers): ``q_cur [D, n_head,
        n_tokens]``, ``k_cur [n_embd_k_gqa, n_tokens]``, ``v_cur [n_embd_v_gqa, n_tokens]`` F32."""
        if self.shared_inputs and self.q_in:
            return self.q_in[0], self.k_in[0], self.v_in[0]
        cfg, n_tok = self.cfg, self.plan.ubatch.n_tokens
        shapes = [(n_tok, cfg.n_head, cfg.head_dim_k), (n_tok, cfg.n_head_kv * cfg.head_dim_k),
                  (n_tok, cfg.n_head_kv * cfg.head_dim_v)]
        if not self._inputs:   # every layer's Q/K/V at once: one allocation
            n_sets = 1 if self.shared_inputs else len(self.layers or range(cfg.n_layer))
            self._inputs = self._zeroed_f32(shapes, n_sets)[::-1]
        qa, ka, va = self._inputs.pop() if self._inputs else (None, None, None)
        q = self.new(GGML_TYPE_F32, shapes[0], np.float32, f"q_l{il}", qa)
        k = self.new(GGML_TYPE_F32, shapes[1], np.float32, f"k_l{il}", ka)
        v = self.new(GGML_TYPE_F32, shapes[2], np.float32, f"v_l{il}", va)
        self.q_in.append(q), self.k_in.append(k), self.v_in.append(v)
        return q, k, v

    def weight_tensor(self, il: int, key: str):
        """Host graphs: F16 tensor ``[n_in, n_out]`` over ``weights[il][key]`` (numpy ``(n_out, n_in)``)."""
        w = self.weights[il][key]
        t = self._weights.get(id(w))
        if t is None:
            t = ggml.ggml_new_tensor_2d(self.ctx, GGML_TYPE_F16, int(w.shape[1]), int(w.shape[0]))
            self.attach(t, w)
            self._weights[id(w)] = t
        return t


def build_ubatch_graph(cache: KVCache, plan: UBatchPlan, cfg: AttnConfig, *, fa=None,
                       all_custom: bool | None = None, layer="attn", weights=None,
                       flash_attn: bool = True, shared_inputs: bool = False, full_layer=None,
                       layers=None, model=None, tokens=None, out_rows=None) -> UBatchGraph:
    """Build the graph of ``plan``'s ubatch through ``cfg.n_layer`` layers, or through the
    contiguous ``layers`` range of them (a layer-parallel rank, ``graph/pipe.py``).

    The graph is device-resident when the cache stores K/V in CuPy (``cache.xp`` is not
    numpy), a host graph otherwise. Device graphs are *all-custom*: the K/V store is our
    custom op instead of ``ggml_set_rows``, the attention must be a custom op and the full
    block's dense ops are ``xp_matmul``'s and ``xp_ops``' custom ops, checked by :func:`check_device_graph`.
    ``all_custom=True`` builds a host graph the same way (to test that form without a GPU).

    ``layer``: ``"attn"`` (inputs with :meth:`UBatchGraph.set_inputs`; per layer, or one set
    for all layers with ``shared_inputs``), ``"full"`` (input ``x`` with
    :meth:`UBatchGraph.set_x`; ``weights[il]`` as ``layers.full_layer`` describes) or a
    function ``layer(b, il, cur) -> cur`` (each result is an output). ``fa`` is the attention
    op, ``ggml_attn.flash_attn_ext`` by default; a host graph may use ``ggml.ggml_flash_attn_ext``
    instead, or ``flash_attn=False``: ggml's ``mul_mat`` + ``soft_max_ext`` (llama.cpp's ``-fa off``).
    ``full_layer``: the layer function ``layer="full"`` runs instead of ``layers.full_layer``
    (same input ``x``, weights and memory reuse; e.g. ``tp.tp_full_layer``, a head-parallel rank).
    ``layers``: ``range(a, b)`` inside ``range(cfg.n_layer)`` (None: all): the graph runs global
    layers ``a..b-1`` only; the cache holds those layers (cache layer ``il - a``), ``weights`` are
    theirs (``weights[il - a]``), and the layer functions see these local indices
    (``GraphBuilder.layers`` is the global range). ``layer="full"`` takes ``x`` as the input of
    layer ``a`` and gives the output of layer ``b-1``; ``"attn"`` gives one output per layer.
    ``layer="model"``: a real model (``model``, a ``graph.model.Model``; ``cfg`` its
    ``attn_config()``) from token ids to logits (``model_graph.py``): ``tokens`` int32 ``(n,)``
    the batch's token ids (read through ``plan.ubatch.token_idx``), ``out_rows`` int32 the
    ubatch rows that need logits (``model_graph.output_rows``); one output, the logits.
    """
    on_device = cache.xp is not np
    device = check_build_args(cache, cfg, fa=fa, all_custom=all_custom, layer=layer,
                              flash_attn=flash_attn, weights=weights, layers=layers, model=model)
    layers = check_layers(cfg, layers)
    attention = layer_fns.flash_attention(fa or fa_op.flash_attn_ext) if flash_attn else layer_fns.softmax_attention
    fn = {"attn": layer_fns.attn_layer, "full": full_layer or layer_fns.full_layer,
          "model": model_graph.model_layer}.get(layer, layer) if isinstance(layer, str) else layer
    residual = layer in ("full", "model")   # one residual stream through the layers
    ub = plan.ubatch
    n_tok, n_stream, n_tps, n_kv = ub.n_tokens, plan.n_stream, plan.n_tps, plan.n_kv
    b = GraphBuilder(cache, plan, cfg, device=device, attention=attention, weights=weights,
                     shared_inputs=shared_inputs, reuse=residual,
                     n_tensors=(64 if residual else 32) * len(layers) + (64 if layer == "model" else 16))
    b.layers = layers
    try:
        b.row_idx = b.new(GGML_TYPE_I64, (n_tok,), np.int64, "row_idx")
        b.arrays[_addr(b.row_idx)][...] = b.xp.asarray(plan.row_idx)
        b.mask = b.new(GGML_TYPE_F16, (n_stream, 1, n_tps, n_kv), np.float16, "kq_mask")
        mask = plan.mask
        if not flash_attn and ub.n_pad:
            mask = mask.astype(np.float16, copy=True)
            layer_fns.pad_rows_see_own_cell(mask, ub, plan.slot)
        b.arrays[_addr(b.mask)][...] = b.xp.asarray(mask)
        # the kernel plan reads the mask through its pointer: a plan kept on the UBatchPlan from an
        # earlier graph points at that graph's mask tensor, so rebuild it for this graph's mask
        kp_mask = getattr(plan.kernel_plan, "mask", None)
        if on_device and (kp_mask is None or kp_mask.ptr != _ptr(b.arrays[_addr(b.mask)])):
            plan.kernel_plan = _kernel_plan(b.mask, n_tps, n_stream, cfg, ggml_type_of(cache.type_k))
        x_in, outs = None, []
        cur = None
        if layer == "full":
            n_embd = int(weights[0]["wq"].shape[1])
            x_in = cur = b.new(GGML_TYPE_F32, (n_tok, n_embd), np.float32, "x")
        elif layer == "model":
            b.model, b.batch_tokens = model, np.asarray(tokens, dtype=np.int32)
            b.model_inputs = model_graph.model_inputs(b, ub, np.asarray(out_rows, dtype=np.int32))
            cur = model_graph.embed(b, b.model_inputs)
        for il in range(len(layers)):   # local: the cache's and the weights' index
            b.begin_layer(il)
            cur = fn(b, il, cur)
            if not residual:
                b.result(cur)
                outs.append(cur)
                b.expand(cur)
        if layer == "model":
            cur = model_graph.head(b, cur, b.model_inputs)
        if residual:
            outs.append(cur)
            b.expand(cur)
    except BaseException:
        ggml.ggml_free(b.ctx)
        xp_node.release(b.op_keys)
        raise
    b.keep(b.kv)
    g = UBatchGraph(plan, device, b.ctx, b.gf, b.q_in, b.k_in, b.v_in, outs, b.arrays, x_in=x_in, mask_t=b.mask,
                    row_idx_t=b.row_idx, xp=b.xp,
                    layer=layer if layer in ("full", "model") else "attn", _op_keys=b.op_keys, _keep=b.kept,
                    n_out=len(out_rows) if layer == "model" else 0, model_in=b.model_inputs,
                    kernel_plan=plan.kernel_plan if on_device else None, kv_views=b.kv_views)
    if device:
        check_device_graph(b.gf)
    return g
