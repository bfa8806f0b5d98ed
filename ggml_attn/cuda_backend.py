"""GPU backend of ``flash_attn_ext``: validation, bound calls and the entry points.

Entry points (all tensor arguments are :class:`~ggml_attn.tensor.TensorDesc` in ggml order):

- :func:`available` -- CuPy importable and a CUDA device present (cached, never raises).
- :func:`flash_attn_ext_device` -- device pointers in, kernels launched directly (raw pointers,
  one ``cuLaunchKernel`` per kernel, no CuPy arrays on the hot path).
- :func:`flash_attn_ext_host` -- host pointers in; staged through reused pinned + device buffers.
- :func:`make_plan` -- the per-ubatch map of live (query tile, KV tile) pairs (and, for the
  cell-list decode kernel, each row's list of visible cells), built on the GPU once from the
  mask and reused by every layer.

Shapes (ggml_flash_attn_ext's, ggml order): q f32 [head_dim_k, n_batch, n_head, ne3] (any byte strides, nb0 = 4);
k/v f16|bf16 [D, n_kv, n_head_kv, ne3] (rows contiguous, 16-byte aligned); mask f16
[n_kv, n_rows >= n_batch, ne32, ne33]; sinks f32 [n_head]; dst f32 contiguous
[head_dim_v, n_head, n_batch, ne3].

The backend's other jobs live in their own modules, whose public names this one re-exports:
``cuda_device`` (device presence, SM count, stream pointers), ``cuda_launch`` (launch
configuration and every tuning knob: patch knobs there, then clear :data:`_PREPARED`),
``cuda_plan`` (live-tile plans, aligned mask copies), ``cuda_workspace`` (split-KV workspaces
and host staging buffers, owned by the registry ``cuda_workspace.WORKSPACES``).
"""
from __future__ import annotations

import ctypes
import math
import warnings
from dataclasses import dataclass, replace

import numpy as np

from . import cuda_launch as L
from . import cuda_workspace
from . import dispatch
from . import kernels as K
from . import knobs
from . import q8_out
from .cuda_device import available, num_sms, stream_ptr
from .cuda_launch import LaunchConfig, launch_config
from .cuda_plan import Plan, decide, live_words, make_plan, mask_needs_aligned_copy
from .dtypes import GGML_TYPE_BF16, GGML_TYPE_F16, GGML_TYPE_F32, TYPE_NAMES
from .tensor import TensorDesc
from .validate import AttnDims, check_flash_attn_args

__all__ = ["available", "bind", "BoundCall", "flash_attn_ext_device", "flash_attn_ext_host", "run_host_on_gpu",
           "make_plan", "Plan",
           "LaunchConfig", "launch_config", "AttnDims", "validate", "decide", "num_sms", "live_words",
           "q_needs_aligned_copy", "mask_needs_aligned_copy"]

_WARNED: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        warnings.warn(f"ggml_attn.cuda_backend: {msg}", RuntimeWarning, stacklevel=3)


# ---------------------------------------------------------------------------------------
# validation
def validate(q: TensorDesc, k: TensorDesc, v: TensorDesc, mask: TensorDesc | None,
             sinks: TensorDesc | None, dst: TensorDesc, scale: float = 1.0, max_bias: float = 0.0,
             logit_softcap: float = 0.0) -> AttnDims:
    """ggml's rules for the op (:func:`ggml_attn.validate.check_flash_attn_args`, the one set of
    rules and messages) plus what the GPU entry points add: K and V of one type (or f16, q8_0 and
    q4_0 mixed: the quantized ones read as f16 copies), a contiguous f32 ``dst`` of the result's
    shape. ValueError naming the tensor at fault."""
    dims = check_flash_attn_args(q, k, v, mask, sinks, max_bias, scale, logit_softcap, mask_rows_only=True)
    mixable = (GGML_TYPE_F16, *K.QUANT_KV_CTYPES)
    if k.type != v.type and not (k.type in mixable and v.type in mixable):
        raise ValueError(f"k and v must have the same type (or f16, q8_0 and q4_0 mixed): "
                         f"{k.shape_str} vs {v.shape_str}")
    if k.type not in (GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16) and k.type not in K.QUANT_KV_CTYPES:
        raise ValueError(f"k/v type {TYPE_NAMES.get(k.type, k.type)} is not supported by the GPU "
                         f"entry points (f32, f16, bf16, q8_0, q4_0): {k.shape_str}")
    want = dims.out_ne
    if dst.type != GGML_TYPE_F32 or tuple(dst.ne) != want or not dst.is_contiguous():
        raise ValueError(f"dst must be contiguous f32 {list(want)}, got {dst.shape_str} nb={dst.nb}")
    return dims



# ---------------------------------------------------------------------------------------
# call parameters
def _params_common(q, k, v, mask, sinks, dst, sh: AttnDims, scale, max_bias, softcap) -> K.FattnParams:
    p = K.FattnParams()
    p.q, p.k, p.v, p.dst = q.ptr, k.ptr, v.ptr, dst.ptr
    p.mask = mask.ptr if mask is not None else 0
    p.sinks = sinks.ptr if sinks is not None else 0
    p.q_nb1, p.q_nb2, p.q_nb3 = q.nb[1], q.nb[2], q.nb[3]
    p.k_nb1, p.k_nb2, p.k_nb3 = k.nb[1], k.nb[2], k.nb[3]
    p.v_nb1, p.v_nb2, p.v_nb3 = v.nb[1], v.nb[2], v.nb[3]
    if mask is not None:
        p.m_nb1, p.m_nb2, p.m_nb3 = mask.nb[1], mask.nb[2], mask.nb[3]
    p.n_batch, p.n_kv, p.n_head, p.n_head_kv = sh.n_batch, sh.n_kv, sh.n_head, sh.n_head_kv
    p.ne3, p.ne32, p.ne33, p.gqa = sh.ne3, sh.ne32, sh.ne33, sh.gqa
    if softcap != 0.0:
        scale = scale / softcap
    p.scale, p.softcap = float(scale), float(softcap)
    p.use_alibi = int(max_bias > 0.0)
    n_head_log2 = 1 << int(math.floor(math.log2(sh.n_head)))
    p.n_head_log2 = n_head_log2
    if max_bias > 0.0:
        p.m0 = 2.0 ** (-max_bias / n_head_log2)
        p.m1 = 2.0 ** (-(max_bias / 2.0) / n_head_log2)
    p.head_dim_v = sh.head_dim_v
    return p



# ---------------------------------------------------------------------------------------
# entry points
@dataclass
class _Prepared:
    """Everything about a call that depends only on shapes, strides, types and scalars."""
    kern: str
    cfg: LaunchConfig | None = None
    fn: K.Kernel | None = None
    comb: K.Kernel | None = None
    template: K.FattnParams | None = None
    ws_o_bytes: int = 0
    ws_bytes: int = 0
    comb_grid: tuple = (1, 1, 1)
    n_groups: int = 0          # split counters the kernel needs (fused split finish), 0: none
    # quantized K/V for a kernel that reads f16: the f16 copies' descriptors (pointer 0: at
    # their offsets into the workspace's converted buffer) and their bytes (_F16Copies)
    conv: "_F16Copies | None" = None
    q8_fused: bool = False     # asked for the output's 8-bit form, the kernel makes it (q8_out.fused)


@dataclass(frozen=True)
class _F16Copies:
    """The f16 copies of a call's q8_0/q4_0 K and/or V (``fattn_dequant_kv``): ``k16`` / ``v16``
    contiguous f16 descriptors at offsets 0 and ``v_off`` of one buffer of ``nbytes`` (pointers
    relative to it), None for a tensor that is f16 already (read in place)."""
    k16: TensorDesc | None
    v16: TensorDesc | None
    v_off: int
    nbytes: int

    @staticmethod
    def of(k: TensorDesc, v: TensorDesc) -> "_F16Copies":
        def dense(t, ptr):   # contiguous f16, ggml order [D, n_kv, n_head_kv, ne3]; None: not quantized
            if t.type not in K.QUANT_KV_CTYPES:
                return None
            nb1 = 2 * t.ne[0]
            return TensorDesc(ptr, GGML_TYPE_F16, t.ne, (2, nb1, nb1 * t.ne[1], nb1 * t.ne[1] * t.ne[2]), t.name)
        def size(t):
            return 2 * t.ne[0] * t.ne[1] * t.ne[2] * t.ne[3] if t.type in K.QUANT_KV_CTYPES else 0
        v_off = -(-size(k) // 256) * 256
        return _F16Copies(dense(k, 0), dense(v, v_off), v_off, v_off + size(v))

    def views(self, k: TensorDesc, v: TensorDesc, base: int) -> tuple[TensorDesc, TensorDesc]:
        """(K, V) the kernel reads: the copies in the buffer at ``base``, or the call's own."""
        return (replace(self.k16, ptr=base) if self.k16 is not None else k,
                replace(self.v16, ptr=base + self.v_off) if self.v16 is not None else v)

    def launches(self, k: TensorDesc, v: TensorDesc, base: int, stream: int) -> list:
        """One ``fattn_dequant_kv`` launch per quantized tensor (K/V at the call's pointers
        ``k``/``v``, the copies at ``base``), each a callable of no arguments (``Kernel.bound``)."""
        fn = K.get_function(K.util_variant(), "fattn_dequant_kv")
        calls = []
        for src, copy, off in ((k, self.k16, 0), (v, self.v16, self.v_off)):
            if copy is None:
                continue
            p = K.DequantKVParams(src.ptr, base + off, src.nb[1], src.nb[2], src.nb[3],
                                  src.ne[0], src.ne[1], src.ne[2], src.ne[3], src.type, 0)
            n = src.ne[0] // 8 * src.ne[1] * src.ne[2] * src.ne[3]
            calls.append(fn.bound((max(1, min(-(-n // 256), 16 * num_sms())), 1, 1), (256, 1, 1), stream, p))
        return calls


_PREPARED: dict[tuple, _Prepared] = {}


def _call_key(q, k, v, mask, sinks, dst, scale, max_bias, softcap, kernel, n_splits, dev, hint=None, q8=False):
    return (knobs.version(), hint, q8, q8_out.FUSE, q.type, q.ne, q.nb, k.type, k.ne, k.nb, k.ptr % 16,
            v.type, v.ne, v.nb, v.ptr % 16,
            None if mask is None else (mask.type, mask.ne, mask.nb),
            None if sinks is None else (sinks.type, sinks.ne, sinks.nb),
            dst.type, dst.ne, dst.nb, float(scale), float(max_bias), float(softcap), kernel,
            n_splits, dev)


def _prepare(q, k, v, mask, sinks, dst, scale, max_bias, softcap, kernel, n_splits,
             plan: Plan | None = None, q8: bool = False) -> _Prepared:
    sh = validate(q, k, v, mask, sinks, dst, scale, max_bias, softcap)
    choice = decide(kernel, sh, plan=plan, k=k, v=v, plain=sinks is None and softcap == 0.0 and max_bias == 0.0,
                    masked=mask is not None)
    kern = choice.kernel
    if kern == "reference":
        if kernel != "reference":
            _warn_once(choice.reason)
        return _Prepared(kern)
    conv = None
    if dispatch.reads_f16_copies(kern, k.type, v.type):
        conv = _F16Copies.of(k, v)   # f16 copies first: the kernel reads f16 (pointers fixed at bind)
        k, v = conv.views(k, v, 0)
        sh = replace(sh, kv_type=GGML_TYPE_F16, v_type=None)
    cfg = launch_config(kern, sh, n_splits, ext=softcap != 0.0 or max_bias > 0.0,
                        wide=plan.wide if plan is not None else None,
                        max_live=plan.max_live if plan is not None else None,
                        max_cells=plan.max_cells if plan is not None else None,
                        live_counts=plan.live_host if plan is not None else None)
    p = _params_common(q, k, v, mask, sinks, dst, sh, scale, max_bias, softcap)
    p.pack, p.q_tile_tokens, p.work_cap = cfg.pack, cfg.q_tile_tokens, cfg.work_cap
    p.n_q_tiles, p.n_kv_tiles, p.n_splits = cfg.n_q_tiles, cfg.n_kv_tiles, cfg.n_splits
    prep = _Prepared(kern, cfg, K.get_function(cfg.variant, cfg.name), template=p, conv=conv)
    if q8 and q8_out.fused(kern, cfg.n_splits, sh.head_dim_v):   # the cell-list kernel's QO instance
        prep.fn = K.get_function(K.cells_qo_variant(sh.head_dim_k, sh.head_dim_v, sh.kv_type, L.CELLS_TUNE),
                                 K.cells_qo_name(cfg.name))
        prep.q8_fused = True
    if kern == "decode-tma":   # two partial slots per block, a counter per row group
        from . import decode_tma_shape as dt
        groups = sh.n_head // cfg.pack if dt.whole_rows(cfg.name) else 1   # a slot of every head group's rows
        prep.ws_o_bytes, prep.ws_bytes = dt.workspace_bytes(cfg.grid[0], sh.head_dim_v, groups)
        prep.n_groups = dt.n_groups(sh.n_head, cfg.pack, cfg.n_q_tiles, sh.ne3)
    elif cfg.n_splits > 1:
        n_rows = sh.ne3 * sh.n_batch * sh.n_head
        prep.ws_o_bytes = cfg.n_splits * n_rows * sh.head_dim_v * 4
        prep.ws_bytes = prep.ws_o_bytes + cfg.n_splits * n_rows * 8
        if L.FUSED_SPLIT_FINISH and cfg.finishes_splits(prep.fn.smem):   # the last block of each row group merges
            prep.n_groups = cfg.grid[0] * cfg.grid[1] * sh.ne3
        else:
            prep.comb = K.get_function(K.util_variant(), "fattn_combine")
            prep.comb_grid = (n_rows, 1, 1)
    return prep


def q_needs_aligned_copy(q: TensorDesc) -> bool:
    """True when Q's pointer or a byte stride is not a multiple of 16.

    The kernels load Q rows with 16-byte vector loads; their scalar fallback for other
    alignments gave wrong results on the H200 (tests/test_gpu_kernels.py::
    test_q_view_at_4_byte_offset, 2026-11-29), so such a Q is copied to an aligned,
    contiguous buffer first (Q is small next to K/V: one row per query token)."""
    return q.ptr % 16 != 0 or any(nb % 16 for n, nb in zip(q.ne[1:], q.nb[1:]) if n > 1)


def _aligned_q_copy(q: TensorDesc, stream: int):
    """Contiguous copy of device f32 ``q`` (ggml order) on ``stream``: (its desc, the CuPy array)."""
    import cupy
    from .tensor import from_array
    src_mem = cupy.cuda.UnownedMemory(q.ptr, q.nbytes_span(), None)
    src = cupy.ndarray(tuple(reversed(q.ne)), cupy.float32, cupy.cuda.MemoryPointer(src_mem, 0),
                       strides=tuple(reversed(q.nb)))
    with cupy.cuda.ExternalStream(stream):
        copy = src.copy(order="C")  # always a new, pool-aligned buffer (ascontiguousarray would
        # hand back an already-contiguous view at the same misaligned pointer)
    return from_array(copy, GGML_TYPE_F32, q.name), copy


class BoundCall:
    """One call with everything filled in -- kernel, grid, parameter block, plan buffers,
    workspace, stream -- so that repeating it is one or two ``cuLaunchKernel``.

    ``ptrs`` are the six data pointers (q, k, v, mask, sinks, dst; 0 when absent) and ``stream``
    the stream it was bound for: the op's callback replays the call while both are unchanged
    (:meth:`launch`), and binds again otherwise. ``replayable`` is False when the call copies
    its inputs (a misaligned Q) or runs the numpy reference: those do per-call work. A masked
    call bound without a plan owns the tile map it built (``own_plan``): :meth:`launcher`
    rebuilds it from the mask before each replayed launch (the mask's contents may change)."""

    __slots__ = ("ptrs", "stream", "kern", "replayable", "own_plan", "_pre", "_fn", "_comb", "_grid", "_block",
                 "_comb_grid", "_params", "_args", "_keep", "_ref", "_post")

    def launch(self) -> None:
        if self._ref is not None:
            _reference_device(*self._ref, self.stream)
        else:
            for pre in self._pre:
                pre()
            self._fn.launch_raw(self._grid, self._block, self.stream, self._args)
            if self._comb is not None:
                self._comb.launch_raw(self._comb_grid, (128, 1, 1), self.stream, self._args)
        if self._post is not None:   # the output's 8-bit form, where the kernel did not make it
            self._post()

    def launcher(self):
        """:meth:`launch` for a replay, as the cheapest callable of no arguments: the driver's
        launch function with every argument fixed (``functools.partial``, no Python frame), or a
        closure running several such launches in order: the own plan's rebuild
        (``Plan.refresher``), attention, split combine, the output's 8-bit form (``q8``). Replayable
        calls only."""
        assert self.replayable and self._ref is None, "only a replayable call has a fixed launch"
        calls = [*self._pre, self._fn.partial(self._grid, self._block, self.stream, self._args)]
        if self._comb is not None:
            calls.append(self._comb.partial(self._comb_grid, (128, 1, 1), self.stream, self._args))
        calls.append(self._post)
        if self.own_plan is not None:
            calls[:0] = self.own_plan.refresher(self.stream).calls
        return K.then(*calls)


def bind(q: TensorDesc, k: TensorDesc, v: TensorDesc, mask: TensorDesc | None, sinks: TensorDesc | None,
         dst: TensorDesc, scale: float, max_bias: float = 0.0, logit_softcap: float = 0.0, *,
         kernel: str = "auto", plan: Plan | None = None, stream=None, n_splits: int | None = None,
         q8: q8_out.Q8Out | None = None) -> BoundCall:
    """Validate, choose, configure and fill in one call on device pointers (the work of
    :func:`flash_attn_ext_device` short of launching). Validation, dispatch and launch
    configuration are cached per (shapes, strides, types, scalars, plan statistics). ``q8``: the
    output in 8-bit form as well (ggml_attn/q8_out.py)."""
    import cupy
    st = stream_ptr(stream)
    b = BoundCall()
    b.ptrs = tuple(t.ptr if t is not None else 0 for t in (q, k, v, mask, sinks, dst))
    b.stream, b._keep, b._ref, b.replayable, b.own_plan, b._pre, b._post = st, None, None, True, None, (), None
    if q_needs_aligned_copy(q):
        q, b._keep = _aligned_q_copy(q, st)  # the copy: alive until launched
        b.replayable = False
    dev = cupy.cuda.runtime.getDevice()
    key = _call_key(q, k, v, mask, sinks, dst, scale, max_bias, logit_softcap, kernel, n_splits, dev,
                    plan.hint() if plan is not None else None, q8 is not None)
    prep = _PREPARED.get(key)
    if prep is None:
        prep = _prepare(q, k, v, mask, sinks, dst, scale, max_bias, logit_softcap, kernel, n_splits, plan,
                        q8=q8 is not None)
        if len(_PREPARED) > 4096:
            _PREPARED.clear()
        _PREPARED[key] = prep
    b.kern = prep.kern
    if q8 is not None and not prep.q8_fused:
        b._post = q8_out.quant_launch(q8, dst.ptr, st)
    if prep.kern == "reference":
        b._ref, b.replayable = (q, k, v, mask, sinks, dst, scale, max_bias, logit_softcap), False
        return b
    cfg = prep.cfg
    p = K.FattnParams.from_buffer_copy(prep.template)
    p.q, p.k, p.v, p.dst = q.ptr, k.ptr, v.ptr, dst.ptr
    if sinks is not None:
        p.sinks = sinks.ptr
    if mask is not None:
        n_batch = q.ne[1]
        if plan is None:
            plan = b.own_plan = Plan(mask, n_batch, q.ne[2], k.ne[2])   # its tile map: alive as long as the call
        elif not plan.matches(mask, n_batch):
            raise ValueError("plan was built for another mask or n_batch "
                             f"(plan: {plan.mask.shape_str} n_batch={plan.n_batch}; "
                             f"call: {mask.shape_str} n_batch={n_batch})")
        if prep.kern == "cells":   # the rows' cell lists (mask values included) replace the tile map
            p.cells, p.cell_cnt = plan.cell_lists(st)
        else:
            p.live_idx, p.live_cnt, p.row_lohi = plan.live(cfg.q_tile_tokens, st)
        if prep.kern not in ("decode", "cells") and mask_needs_aligned_copy(mask):
            mask = plan.aligned(st)
            p.m_nb1, p.m_nb2, p.m_nb3 = mask.nb[1], mask.nb[2], mask.nb[3]
        p.mask = mask.ptr
    if prep.ws_bytes or prep.n_groups or prep.conv:   # scratch of (device, stream, this thread)
        work = cuda_workspace.WORKSPACES.workspace(dev, st)
    if prep.conv:   # quantized K/V converted to f16 before the kernel reads them
        base, buf = work.converted(prep.conv.nbytes)
        b._pre = prep.conv.launches(k, v, base, st)
        k, v = prep.conv.views(k, v, base)
        p.k, p.v = k.ptr, v.ptr
        b._keep = (b._keep, buf)
    if prep.ws_bytes:
        ws, buf = work.partials(prep.ws_bytes)
        p.ws_o, p.ws_ml = ws, ws + prep.ws_o_bytes
        b._keep = (b._keep, buf)
    if prep.n_groups:
        p.split_cnt, cnt = work.counters(prep.n_groups)
        b._keep = (b._keep, cnt)
    if prep.q8_fused:
        q8_out.set_params(p, q8)
    b._fn, b._comb, b._grid, b._block, b._comb_grid = prep.fn, prep.comb, cfg.grid, (cfg.block, 1, 1), prep.comb_grid
    b._params = p
    if prep.kern in ("prefill-wgmma", "decode-tma"):   # K and V's TMA maps (and the prefill's Q map) follow
        from .decode_tma_shape import kv_map_of   # the params, in the kernel's order
        from .wgmma_shape import kv_map, o_map, q_map, tile_width
        promo = L.DECODE_TMA_L2_PROMOTION if prep.kern == "decode-tma" else 0
        to_map = kv_map_of(cfg.name) if k.type in K.QUANT_KV_CTYPES else kv_map
        maps = (to_map(k, promo), to_map(v, promo))
        if prep.kern == "prefill-wgmma":
            maps += (q_map(q, tile_width(q.ne[0]), cfg.pack), o_map(dst, cfg.name, cfg.pack))
        arr = K.arg_block(p, *maps)
        b._keep = (b._keep, maps)
    else:
        arr = K.arg_block(p)
    b._args, b._keep = ctypes.addressof(arr), (b._keep, arr)
    return b


def flash_attn_ext_device(q: TensorDesc, k: TensorDesc, v: TensorDesc, mask: TensorDesc | None,
                          sinks: TensorDesc | None, dst: TensorDesc, scale: float,
                          max_bias: float = 0.0, logit_softcap: float = 0.0, *,
                          kernel: str = "auto", plan: Plan | None = None, stream=None,
                          n_splits: int | None = None, q8: q8_out.Q8Out | None = None) -> None:
    """Attention on device pointers; writes ``dst``. Asynchronous on ``stream`` (default:
    CuPy's current stream). ``plan``: from :func:`make_plan` for this mask (built per call
    when None and a mask is given). ``n_splits`` overrides the KV split count (tests).
    A repeated call costs a cache lookup, a parameter copy and the launches; the op's callback
    keeps the :func:`bind` result per node and replays it instead. ``q8``: the output in 8-bit form
    as well (ggml_attn/q8_out.py)."""
    bind(q, k, v, mask, sinks, dst, scale, max_bias, logit_softcap, kernel=kernel, plan=plan,
         stream=stream, n_splits=n_splits, q8=q8).launch()


def _reference_host(q, k, v, mask, sinks, dst, scale, max_bias, softcap) -> None:
    """numpy reference on host descriptors, result written through dst (quantized K/V
    dequantized by ggml first)."""
    from .cpu import kv_head_reader
    from .dtypes import STORAGE_DTYPES
    from .reference import flash_attn_ext
    from .tensor import as_numpy
    hk, hv, kv_type = as_numpy(k), as_numpy(v), k.type
    if k.type not in STORAGE_DTYPES or v.type != k.type:
        def dense(t):   # (ne3, n_head_kv, n_kv, D) float32
            read = kv_head_reader(t)
            return np.stack([np.stack([read(s, h) for h in range(t.ne[2])]) for s in range(t.ne[3])])
        hk, hv, kv_type = dense(k), dense(v), GGML_TYPE_F32
    out = flash_attn_ext(as_numpy(q), hk, hv,
                         as_numpy(mask) if mask is not None else None, scale, max_bias, softcap,
                         as_numpy(sinks).reshape(-1) if sinks is not None else None,
                         kv_type=kv_type, dtype=np.float32)
    as_numpy(dst)[...] = out.astype(np.float32)


def _reference_device(q, k, v, mask, sinks, dst, scale, max_bias, softcap, stream: int) -> None:
    """:func:`_reference_host` on device descriptors: the inputs copied down and the result up on
    ``stream``, which is synchronized after each (a plain ``cudaMemcpy`` runs on the legacy
    stream, which a non-blocking stream's later kernels do not wait for, and returns from a
    pageable host -> device copy before its DMA is done: the next kernel could read ``dst``
    half written)."""
    import cupy
    rt = cupy.cuda.runtime
    rt.streamSynchronize(stream)
    keep = []

    def down(t):
        if t is None:
            return None
        buf = np.empty(max(t.nbytes_span(), 1), dtype=np.uint8)
        if t.nbytes_span():
            rt.memcpyAsync(buf.ctypes.data, t.ptr, t.nbytes_span(), rt.memcpyDeviceToHost, stream)
        keep.append(buf)
        return replace(t, ptr=buf.ctypes.data)
    hq, hk, hv, hm, hs = (down(t) for t in (q, k, v, mask, sinks))
    rt.streamSynchronize(stream)
    out = np.empty(dst.nbytes_span(), dtype=np.uint8)
    hd = replace(dst, ptr=out.ctypes.data)
    _reference_host(hq, hk, hv, hm, hs, hd, scale, max_bias, softcap)
    rt.memcpyAsync(dst.ptr, out.ctypes.data, dst.nbytes_span(), rt.memcpyHostToDevice, stream)
    rt.streamSynchronize(stream)   # (out is freed on return)



def flash_attn_ext_host(q: TensorDesc, k: TensorDesc, v: TensorDesc, mask: TensorDesc | None,
                        sinks: TensorDesc | None, dst: TensorDesc, scale: float,
                        max_bias: float = 0.0, logit_softcap: float = 0.0, *,
                        kernel: str = "auto") -> None:
    """Attention on host pointers: inputs staged to the GPU through pinned buffers, the result
    copied back into ``dst``; synchronous. Without a GPU, or with kernel="reference", the numpy
    reference runs on the host."""
    sh = validate(q, k, v, mask, sinks, dst, scale, max_bias, logit_softcap)
    choice = decide(kernel, sh, arch="", backend="auto", gpu=available(), on_device=False)
    if not choice.on_gpu:   # host data, no kernel for it: the numpy reference on the host
        if kernel != "reference":
            _warn_once(f"{choice.reason}; running the numpy reference on the host")
        _reference_host(q, k, v, mask, sinks, dst, scale, max_bias, logit_softcap)
        return
    run_host_on_gpu(q, k, v, mask, sinks, dst, scale, max_bias, logit_softcap, kernel=kernel)


def run_host_on_gpu(q: TensorDesc, k: TensorDesc, v: TensorDesc, mask: TensorDesc | None,
                    sinks: TensorDesc | None, dst: TensorDesc, scale: float, max_bias: float = 0.0,
                    logit_softcap: float = 0.0, *, kernel: str = "auto") -> None:
    """Host pointers through the GPU, once decided they go there (:func:`flash_attn_ext_host`,
    or the op after its own decision): the inputs staged to the device through reused pinned
    buffers, the call bound and launched there, the result copied back into ``dst``; synchronous."""
    import cupy
    rt = cupy.cuda.runtime
    stream = cupy.cuda.get_current_stream().ptr
    staging = cuda_workspace.WORKSPACES.staging(cupy.cuda.runtime.getDevice())

    def up(slot, t):
        """Copy the byte span of host tensor ``t`` to the device (keeping its address mod 16)."""
        if t is None:
            return None
        off = t.ptr % 16
        n = t.nbytes_span() + off
        hp, dp = staging.get(slot, n)
        ctypes.memmove(hp, t.ptr - off, n)
        rt.memcpyAsync(dp, hp, n, rt.memcpyHostToDevice, stream)
        return replace(t, ptr=dp + off)
    dq = up("q", q)
    dk = up("k", k)
    if v.ptr == k.ptr and v.nbytes_span() <= k.nbytes_span():   # V a view of K (MLA)
        dv = replace(v, ptr=dk.ptr)
    else:
        dv = up("v", v)
    dm = up("mask", mask)
    ds = up("sinks", sinks)
    n_out = dst.nbytes_span()
    hp_out, dp_out = staging.get("dst", n_out)
    dd = replace(dst, ptr=dp_out)
    flash_attn_ext_device(dq, dk, dv, dm, ds, dd, scale, max_bias, logit_softcap,
                          kernel=kernel, stream=stream)
    rt.memcpyAsync(hp_out, dp_out, n_out, rt.memcpyDeviceToHost, stream)
    rt.streamSynchronize(stream)
    ctypes.memmove(dst.ptr, hp_out, n_out)
