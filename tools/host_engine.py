"""CPU engine: one ggml graph per ubatch through every layer, computed by ggml's CPU backend.

Per layer (ggml order):

* ``--layer attn``: Q ``[D, n_tps, n_head, n_stream]`` and the new K/V rows
  ``[n_embd_kv, n_tokens]`` are random inputs (the same for every layer);
* ``--layer full``: RMS norm, Q/K/V projections from the residual stream, attention,
  O projection, RMS norm and a gated FFN (gate, up, SiLU, down) with random F16 weights;

then the K/V rows go into the cache with ``ggml_set_rows`` (F16 cache tensors point at
the ``KVCache`` storage, so the cache really fills; other ``-ctk``/``-ctv`` types live in
byte buffers of the engine, quantized by ``ggml_set_rows``) and attention reads a
``[D, n_kv, n_head_kv, n_stream]`` view of it with the ubatch mask:

* ``-fa on`` (default): ``ggml_attn.flash_attn_ext`` (the project's op; its CPU path);
* ``--kernel ggml``: ggml's own ``ggml_flash_attn_ext``, a CPU baseline;
* ``-fa off``: ggml's ``mul_mat`` + ``soft_max_ext`` + ``mul_mat`` path.

Memory for intermediate tensors comes from a ggml graph allocator reused between ubatches.
Weights: one set per layer while all layers' weights fit in 1 GiB, else one set shared by
all layers (the same matmul cost, less memory).
"""
from __future__ import annotations

import ctypes

import ggml
import numpy as np

from .common import WallTimer
from .kv_types import ggml_type

_SHARED_WEIGHTS_ABOVE = 1 << 30


def _cpu_buffer_type() -> int:
    """``ggml_backend_cpu_buffer_type()``; ggml-python 0.0.45 declares its result as an int
    NewType, which truncates the pointer, so bind a private copy returning ``c_void_p``."""
    for library in ggml.ggml.lib._libraries:
        try:
            fn = library["ggml_backend_cpu_buffer_type"]  # a fresh function object
        except AttributeError:
            continue
        fn.argtypes, fn.restype = [], ctypes.c_void_p
        return fn()
    raise RuntimeError("ggml_backend_cpu_buffer_type not found in the ggml libraries")


def _tensor_data_ptr(t) -> int:
    return int(t.contents.data or 0)


def _copy_in(t, arr: np.ndarray) -> None:
    arr = np.ascontiguousarray(arr)
    ctypes.memmove(_tensor_data_ptr(t), arr.ctypes.data, arr.nbytes)


def _pad_rows_see_own_cell(mask: np.ndarray, ub, slot) -> None:
    """For ``-fa off``: unmask each pad row's own cell in ``mask`` (numpy ``(ns, 1, n_tps,
    n_kv)``, in place). ``soft_max_ext`` of a fully masked row is NaN (FA gives zeros); the NaN
    would become the pad's K/V in the next layer and reach real rows as 0 * NaN. Real rows
    never see pad cells, so this changes nothing for them."""
    pad = ub.is_pad.reshape(slot.n_stream, -1)
    for j, cells in enumerate(slot.cells):
        rows = np.flatnonzero(pad[j])
        mask[j, 0, rows, cells[rows]] = 0


class HostEngine:
    def __init__(self, cfg, cache):
        from ggml_attn import op
        self.cfg = cfg
        self.cache = cache
        self.m = m = cfg.model
        op.set_backend("reference", cfg.kernel if cfg.kernel != "ggml" else "auto")
        self.backend = ggml.ggml_backend_cpu_init()
        ggml.ggml_backend_cpu_set_n_threads(self.backend, max(1, int(cfg.n_threads)))
        self.galloc = ggml.ggml_gallocr_new(_cpu_buffer_type())
        self.rng = np.random.default_rng(cfg.seed)
        self.scale = 1.0 / float(np.sqrt(m.head_dim))
        # persistent tensors: cache K/V per layer and weights, data owned by numpy
        n_persist = 2 * m.n_layer + 8 * m.n_layer + 8
        self.pctx = ggml.ggml_init(ggml.ggml_init_params(
            mem_size=ggml.ggml_tensor_overhead() * n_persist, mem_buffer=None, no_alloc=True))
        rows = cache.n_stream * cache.kv_size
        self._keep = []  # numpy arrays whose memory ggml tensors point at
        self.type_k, self.type_v = ggml_type(cfg.type_k), ggml_type(cfg.type_v)
        self.k_cache = [self._cache_tensor(self.type_k, m.n_embd_k, rows, cache.k[layer])
                        for layer in range(m.n_layer)]
        self.v_cache = [self._cache_tensor(self.type_v, m.n_embd_v, rows, cache.v[layer])
                        for layer in range(m.n_layer)]
        self.weights = self._make_weights() if cfg.layer == "full" else None
        # random input values, sliced per ubatch; split_equal may give n_ubatch + 1 rows
        self.pool_width = width = max(m.n_embd_q, m.n_embd, m.n_embd_k, m.n_embd_v)
        self.pool = self.rng.standard_normal(width * (cfg.n_ubatch + 1), dtype=np.float32)

    def _cache_tensor(self, gtype: int, n_embd: int, rows: int, f16_storage: np.ndarray):
        """One layer's K or V cache ``[n_embd, rows]`` of ``gtype``: F16 lives in the KVCache's
        own arrays; other types (-ctk/-ctv) in a byte buffer of this engine."""
        t = ggml.ggml_new_tensor_2d(self.pctx, gtype, n_embd, rows)
        if gtype == ggml.GGML_TYPE_F16:
            data = f16_storage
        else:
            data = np.zeros(int(ggml.ggml_nbytes(t)), dtype=np.uint8)
            self._keep.append(data)
        t.contents.data = ctypes.c_void_p(data.ctypes.data)
        return t

    # ------------------------------------------------------------ weights
    def _weight(self, n_in: int, n_out: int):
        """F16 ``[n_in, n_out]`` (ggml order) = numpy ``(n_out, n_in)``, N(0, 1/n_in)."""
        w = (self.rng.standard_normal((n_out, n_in), dtype=np.float32) / np.sqrt(n_in)).astype(np.float16)
        t = ggml.ggml_new_tensor_2d(self.pctx, ggml.GGML_TYPE_F16, n_in, n_out)
        t.contents.data = ctypes.c_void_p(w.ctypes.data)
        self._keep.append(w)
        return t

    def _make_weights(self):
        m = self.m
        shared = m.n_layer * m.layer_params() * 2 > _SHARED_WEIGHTS_ABOVE
        sets = []
        for layer in range(1 if shared else m.n_layer):
            sets.append(dict(
                wq=self._weight(m.n_embd, m.n_embd_q), wk=self._weight(m.n_embd, m.n_embd_k),
                wv=self._weight(m.n_embd, m.n_embd_v), wo=self._weight(m.n_head * m.d_v, m.n_embd),
                wg=self._weight(m.n_embd, m.n_ff), wu=self._weight(m.n_embd, m.n_ff),
                wd=self._weight(m.n_ff, m.n_embd)))
        return [sets[0]] * m.n_layer if shared else sets

    # ------------------------------------------------------------- compute
    def _attention(self, ctx, q, k, v, mask):
        m, cfg = self.m, self.cfg
        if cfg.flash_attn and cfg.kernel == "ggml":
            out = ggml.ggml_flash_attn_ext(ctx, q, k, v, mask, self.scale, 0.0, m.logit_softcap)
            ggml.ggml_flash_attn_ext_set_prec(out, ggml.GGML_PREC_F32)
            return out
        if cfg.flash_attn:
            from ggml_attn import flash_attn_ext
            return flash_attn_ext(ctx, q, k, v, mask, self.scale, 0.0, m.logit_softcap)
        # llama.cpp's non-FA path: KQ, soft_max_ext with the mask, KQV
        kq = ggml.ggml_mul_mat(ctx, k, q)                       # [n_kv, n_tps, n_head, ns]
        if m.logit_softcap:
            kq = ggml.ggml_scale(ctx, kq, self.scale / m.logit_softcap)
            kq = ggml.ggml_scale(ctx, ggml.ggml_tanh(ctx, kq), m.logit_softcap)
            kq = ggml.ggml_soft_max_ext(ctx, kq, mask, 1.0, 0.0)
        else:
            kq = ggml.ggml_soft_max_ext(ctx, kq, mask, self.scale, 0.0)
        vt = ggml.ggml_cont(ctx, ggml.ggml_permute(ctx, v, 1, 0, 2, 3))  # [n_kv, D_v, n_head_kv, ns]
        kqv = ggml.ggml_mul_mat(ctx, vt, kq)                    # [D_v, n_tps, n_head, ns]
        return ggml.ggml_cont(ctx, ggml.ggml_permute(ctx, kqv, 0, 2, 1, 3))  # [D_v, n_head, n_tps, ns]

    def _kv_view(self, ctx, stored, gtype, n_embd, d, n_kv, s0, ns):
        """``[d, n_kv, n_head_kv, ns]`` view of a cache tensor, after its set_rows node."""
        row = int(ggml.ggml_row_size(gtype, n_embd))
        head = int(ggml.ggml_row_size(gtype, d))
        return ggml.ggml_view_4d(ctx, stored, d, n_kv, self.m.n_head_kv, ns,
                                 row, head, self.cache.kv_size * row, s0 * self.cache.kv_size * row)

    def run_ubatch(self, plan) -> None:
        """Compute ``plan`` (``ggml_attn.graph.UBatchPlan``: ubatch, slot, n_kv, mask, row_idx)."""
        m, cfg = self.m, self.cfg
        ub, slot, n_kv, mask = plan.ubatch, plan.slot, plan.n_kv, plan.mask
        n_tokens = ub.n_tokens
        ns = slot.n_stream
        n_tps = n_tokens // ns
        s0 = slot.streams[0]
        n_nodes = 64 + m.n_layer * 40
        ctx = ggml.ggml_init(ggml.ggml_init_params(
            mem_size=ggml.ggml_tensor_overhead() * n_nodes * 2 + ggml.ggml_graph_overhead_custom(n_nodes, False),
            mem_buffer=None, no_alloc=True))
        try:
            gf = ggml.ggml_new_graph_custom(ctx, n_nodes, False)
            inputs = []

            def new_input(t, data):
                ggml.ggml_set_input(t)
                inputs.append((t, data))
                return t

            rows = np.asarray(plan.row_idx, dtype=np.int64)
            t_rows = new_input(ggml.ggml_new_tensor_1d(ctx, ggml.GGML_TYPE_I64, n_tokens), rows)
            mask16 = mask.astype(np.float16)
            if not cfg.flash_attn and ub.n_pad:
                _pad_rows_see_own_cell(mask16, ub, slot)
            t_mask = new_input(ggml.ggml_new_tensor_4d(ctx, ggml.GGML_TYPE_F16, n_kv, n_tps, 1, ns), mask16)
            pool = self.pool
            assert n_tokens * self.pool_width <= pool.size, \
                f"{n_tokens} rows overrun the input pool of {pool.size // self.pool_width} rows"
            if cfg.layer == "full":
                x = new_input(ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, m.n_embd, n_tokens),
                              pool[: m.n_embd * n_tokens])
            else:
                q_in = new_input(ggml.ggml_new_tensor_4d(ctx, ggml.GGML_TYPE_F32, m.head_dim, n_tps, m.n_head, ns),
                                 pool[: m.n_embd_q * n_tokens])
                k_in = new_input(ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, m.n_embd_k, n_tokens),
                                 pool[: m.n_embd_k * n_tokens])
                v_in = new_input(ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, m.n_embd_v, n_tokens),
                                 pool[: m.n_embd_v * n_tokens])
            last = None
            for layer in range(m.n_layer):
                if cfg.layer == "full":
                    w = self.weights[layer]
                    h = ggml.ggml_rms_norm(ctx, x, 1e-5)
                    q = ggml.ggml_mul_mat(ctx, w["wq"], h)
                    q = ggml.ggml_reshape_4d(ctx, q, m.head_dim, m.n_head, n_tps, ns)
                    q = ggml.ggml_permute(ctx, q, 0, 2, 1, 3)   # [D, n_tps, n_head, ns]
                    k_new = ggml.ggml_mul_mat(ctx, w["wk"], h)
                    v_new = ggml.ggml_mul_mat(ctx, w["wv"], h)
                else:
                    q, k_new, v_new = q_in, k_in, v_in
                k_st = ggml.ggml_set_rows(ctx, self.k_cache[layer], k_new, t_rows)
                v_st = ggml.ggml_set_rows(ctx, self.v_cache[layer], v_new, t_rows)
                k = self._kv_view(ctx, k_st, self.type_k, m.n_embd_k, m.head_dim, n_kv, s0, ns)
                v = self._kv_view(ctx, v_st, self.type_v, m.n_embd_v, m.d_v, n_kv, s0, ns)
                att = self._attention(ctx, q, k, v, t_mask)     # [D_v, n_head, n_tps, ns]
                if cfg.layer == "full":
                    att = ggml.ggml_reshape_2d(ctx, att, m.n_head * m.d_v, n_tokens)
                    x = ggml.ggml_add(ctx, x, ggml.ggml_mul_mat(ctx, w["wo"], att))
                    h = ggml.ggml_rms_norm(ctx, x, 1e-5)
                    g = ggml.ggml_silu(ctx, ggml.ggml_mul_mat(ctx, w["wg"], h))
                    u = ggml.ggml_mul_mat(ctx, w["wu"], h)
                    x = ggml.ggml_add(ctx, x, ggml.ggml_mul_mat(ctx, w["wd"], ggml.ggml_mul(ctx, g, u)))
                    last = x
                else:
                    ggml.ggml_build_forward_expand(gf, att)
                    last = att
            ggml.ggml_set_output(last)
            ggml.ggml_build_forward_expand(gf, last)
            if not ggml.ggml_gallocr_alloc_graph(self.galloc, gf):
                raise MemoryError("ggml graph allocation failed")
            for t, data in inputs:
                _copy_in(t, data)
            self._compute(gf)
        finally:
            ggml.ggml_free(ctx)

    def _compute(self, gf) -> None:
        from ggml_attn import op
        op.raise_pending()
        status = ggml.ggml_backend_graph_compute(self.backend, gf)
        try:
            op.raise_pending()
        except op.FlashAttnError as e:
            # Ctrl-C lands in whichever Python code runs: often the op's callback on the
            # main thread, which records it; hand it on as the interrupt it is
            if isinstance(e.__cause__, KeyboardInterrupt):
                raise KeyboardInterrupt from None
            raise
        if status != 0:
            raise RuntimeError(f"ggml_backend_graph_compute returned status {status}")

    def synchronize(self) -> None:
        pass  # the CPU backend computes synchronously

    def timer(self):
        return WallTimer()

    def close(self) -> None:
        if self.galloc:
            ggml.ggml_gallocr_free(self.galloc)
            self.galloc = None
        if self.pctx:
            ggml.ggml_free(self.pctx)
            self.pctx = None
        if self.backend:
            ggml.ggml_backend_free(self.backend)
            self.backend = None
