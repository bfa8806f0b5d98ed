"""GPU engine: CuPy arrays, attention by ``ggml_attn.cuda_backend``, matmuls by cuBLAS.

Per ubatch the plan's mask is uploaded once and the kernels' live-tile plan is built once
(``cuda_backend.make_plan``), then reused by every layer. Per layer:

* ``--layer attn``: Q and the new K/V rows are random device data (the same every layer);
* ``--layer full``: RMS norm, Q/K/V projections (F16 cuBLAS GEMMs through CuPy), attention,
  O projection, RMS norm, gated FFN (gate, up, SiLU, down) with random F16 weights;

K/V rows are scattered into the CuPy ``KVCache`` at the plan's rows, and attention reads a
strided ``[D, n_kv, n_head_kv, n_stream]`` view of it, writing ``[D_v, n_head, n_tps,
n_stream]`` (ggml order), as ``ggml_flash_attn_ext`` does. Timing uses CUDA events around
the work, after a synchronize.
"""
from __future__ import annotations

import numpy as np

from .errors import UserError

_SHARED_WEIGHTS_ABOVE = 16 << 30


class CudaTimer:
    """``with timer: ...`` then ``timer.ns``: CUDA events on the current stream, synchronized."""

    def __init__(self):
        import cupy
        self.cupy = cupy
        self.ns = 0

    def __enter__(self):
        cp = self.cupy
        cp.cuda.get_current_stream().synchronize()
        self.start, self.end = cp.cuda.Event(), cp.cuda.Event()
        self.start.record()
        return self

    def __exit__(self, *exc):
        self.end.record()
        self.end.synchronize()
        self.ns = int(self.cupy.cuda.get_elapsed_time(self.start, self.end) * 1e6)
        return False


class CudaEngine:
    def __init__(self, cfg, cache):
        import cupy as cp
        from ggml_attn import cuda_backend
        from ggml_attn.tensor import from_array
        if cfg.kernel == "ggml":
            raise UserError("--kernel ggml is ggml's CPU flash attention; use --device cpu")
        if not cfg.flash_attn:
            raise UserError("-fa off (ggml's mul_mat+soft_max path) runs on the CPU only; use --device cpu")
        self.cp, self.cb, self.from_array = cp, cuda_backend, from_array
        self.cfg, self.cache, self.m = cfg, cache, cfg.model
        m = self.m
        self.scale = 1.0 / float(np.sqrt(m.head_dim))
        rng = cp.random.default_rng(cfg.seed)
        # random inputs, sliced per ubatch; split_equal may give n_ubatch + 1 rows
        self.pool_width = width = max(m.n_embd_q, m.n_embd, m.n_embd_k, m.n_embd_v)
        self.pool = rng.standard_normal(width * (cfg.n_ubatch + 1), dtype=cp.float32)
        self.weights = self._make_weights(rng) if cfg.layer == "full" else None

    def _make_weights(self, rng):
        cp, m = self.cp, self.m

        def w(n_in, n_out):  # (n_in, n_out): y = x @ w
            return (rng.standard_normal((n_in, n_out), dtype=cp.float32) / np.sqrt(n_in)).astype(cp.float16)

        shared = m.n_layer * m.layer_params() * 2 > _SHARED_WEIGHTS_ABOVE
        sets = [dict(wq=w(m.n_embd, m.n_embd_q), wk=w(m.n_embd, m.n_embd_k), wv=w(m.n_embd, m.n_embd_v),
                     wo=w(m.n_head * m.d_v, m.n_embd), wg=w(m.n_embd, m.n_ff), wu=w(m.n_embd, m.n_ff),
                     wd=w(m.n_ff, m.n_embd))
                for _ in range(1 if shared else m.n_layer)]
        return [sets[0]] * m.n_layer if shared else sets

    # -------------------------------------------------------------- helpers
    _scatter = None

    def _scatter_kernel(self):
        """One launch per tensor and layer: rows of ``src`` (any float) into F16 cache rows."""
        if CudaEngine._scatter is None:
            CudaEngine._scatter = self.cp.ElementwiseKernel(
                "raw T src, raw int64 rows, int64 n_embd", "raw float16 dst",
                "long long t = i / n_embd; dst[rows[t] * n_embd + (i - t * n_embd)] = (float16)src[i];",
                "ggml_attn_cli_scatter_rows")
        return CudaEngine._scatter

    def _layer_descs(self, store, s0, ns, n_kv, d, name):
        """TensorDesc of the ``[d, n_kv, n_head_kv, ns]`` view of every layer (layer 0 through
        from_array, the others by pointer offset: cheap per layer)."""
        from ggml_attn.tensor import TensorDesc
        base = self.from_array(self._kv_view(store, 0, s0, ns, n_kv, d), name=name)
        step = store[1].data.ptr - store[0].data.ptr if store.shape[0] > 1 else 0
        return [TensorDesc(base.ptr + layer * step, base.type, base.ne, base.nb, name)
                for layer in range(self.m.n_layer)]

    _fused = None

    def _fused_kernels(self):
        """Fused elementwise kernels for --layer full: each is one launch instead of 2-7
        (CuPy launches cost host time; a decode step is many small launches)."""
        if CudaEngine._fused is None:
            cp = self.cp
            CudaEngine._fused = dict(
                sumsq=cp.ReductionKernel("T x", "float32 y", "(float)x * (float)x", "a + b", "y = a", "0",
                                         "ggml_attn_cli_sumsq"),
                rms_cast=cp.ElementwiseKernel(
                    "float32 x, raw float32 ss, int64 n, float32 eps", "float16 y",
                    "y = (float16)(x * rsqrtf(ss[i / n] / (float)n + eps));", "ggml_attn_cli_rms_cast"),
                silu_mul=cp.ElementwiseKernel(
                    "T g, T u", "float16 f",
                    "float gf = (float)g; f = (float16)(gf / (1.0f + expf(-gf)) * (float)u);",
                    "ggml_attn_cli_silu_mul"),
                add_into=cp.ElementwiseKernel("T y", "float32 x", "x += (float)y;", "ggml_attn_cli_add_into"),
            )
        return CudaEngine._fused

    def _rms_norm(self, x):
        """RMS norm of F32 rows ``x (n_tok, n_embd)`` -> F16 (two launches)."""
        f = self._fused_kernels()
        ss = f["sumsq"](x, axis=1)
        return f["rms_cast"](x, ss, x.shape[1], 1e-5)

    def _kv_view(self, store, layer, s0, ns, n_kv, d):
        """numpy order (ns, n_head_kv, n_kv, d) strided view = ggml [d, n_kv, n_head_kv, ns]."""
        m = self.m
        v = store[layer, s0:s0 + ns, :n_kv]                      # (ns, n_kv, n_embd)
        v = v.reshape(ns, n_kv, m.n_head_kv, d)
        return v.transpose(0, 2, 1, 3)

    # -------------------------------------------------------------- compute
    def run_ubatch(self, plan) -> None:
        cp, cb, m, cfg = self.cp, self.cb, self.m, self.cfg
        ub, slot, n_kv = plan.ubatch, plan.slot, plan.n_kv
        n_tok, ns = ub.n_tokens, slot.n_stream
        n_tps = n_tok // ns
        s0 = slot.streams[0]
        mask = cp.asarray(plan.mask)                              # (ns, 1, n_tps, n_kv) f16
        mask_d = self.from_array(mask, name="mask")
        kplan = cb.make_plan(mask_d, n_tps, m.n_head, m.n_head_kv, d_k=m.head_dim, d_v=m.d_v,
                             kernel=cfg.kernel)
        rows = cp.asarray(plan.row_idx)
        scatter = self._scatter_kernel()
        k_flat = self.cache.k.reshape(m.n_layer, -1)
        v_flat = self.cache.v.reshape(m.n_layer, -1)
        k_descs = self._layer_descs(self.cache.k, s0, ns, n_kv, m.head_dim, "k")
        v_descs = self._layer_descs(self.cache.v, s0, ns, n_kv, m.d_v, "v")
        dst = cp.empty((ns, n_tps, m.n_head, m.d_v), dtype=cp.float32)
        dst_d = self.from_array(dst, name="dst")
        pool = self.pool
        assert n_tok * self.pool_width <= pool.size, \
            f"{n_tok} rows overrun the input pool of {pool.size // self.pool_width} rows"
        if cfg.layer == "full":
            x = pool[: n_tok * m.n_embd].reshape(n_tok, m.n_embd).copy()
        else:
            q = pool[: n_tok * m.n_embd_q].reshape(ns, m.n_head, n_tps, m.head_dim)
            q_d = self.from_array(q, name="q")
            k_new = pool[: n_tok * m.n_embd_k].reshape(n_tok, m.n_embd_k)
            v_new = pool[: n_tok * m.n_embd_v].reshape(n_tok, m.n_embd_v)
        for layer in range(m.n_layer):
            if cfg.layer == "full":
                w = self.weights[layer]
                h = self._rms_norm(x)
                q = (h @ w["wq"]).astype(cp.float32).reshape(ns, n_tps, m.n_head, m.head_dim).transpose(0, 2, 1, 3)
                q_d = self.from_array(q, name="q")
                k_new = h @ w["wk"]
                v_new = h @ w["wv"]
            scatter(k_new, rows, m.n_embd_k, k_flat[layer], size=n_tok * m.n_embd_k)
            scatter(v_new, rows, m.n_embd_v, v_flat[layer], size=n_tok * m.n_embd_v)
            cb.flash_attn_ext_device(q_d, k_descs[layer], v_descs[layer], mask_d, None, dst_d,
                                     self.scale, 0.0, m.logit_softcap, kernel=cfg.kernel, plan=kplan)
            if cfg.layer == "full":
                fk = self._fused_kernels()
                fk["add_into"](dst.reshape(n_tok, m.n_head * m.d_v).astype(cp.float16) @ w["wo"], x)
                h = self._rms_norm(x)
                f = fk["silu_mul"](h @ w["wg"], h @ w["wu"])
                fk["add_into"](f @ w["wd"], x)
        self._keep = (mask, dst, kplan)  # alive until the stream has used them (and for tests)
        self._last_streams = (s0, ns)

    def synchronize(self) -> None:
        self.cp.cuda.get_current_stream().synchronize()

    def timer(self):
        return CudaTimer()

    def close(self) -> None:
        self._keep = None
        self.weights = None
