"""GPU engine: the builder's device-resident (all-custom) ubatch graph over a CuPy KV cache.

Per ubatch the plan's mask is uploaded into the graph once and the kernels' live-tile plan is
built once by the builder (``cuda_backend.make_plan``), then reused by every layer; attention is
``ggml_attn.flash_attn_ext`` on the CUDA backend, the full block's dense ops are the custom ops
of ``graph/xp_matmul.py`` and ``graph/xp_ops.py`` (CuPy: F16 GEMVs and GEMMs, and the matmuls over a model's weight blocks). Timing uses CUDA events around the work, after a
synchronize. The kernel programs the run's calls load are compiled while the engine is made
(:func:`start_precompile`), not at each kernel's first call inside a timed run.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from .common import CudaTimer  # noqa: F401  (the timer of this engine)
from .errors import UserError
from .graph_engine import GraphEngine


class CudaEngine(GraphEngine):
    """The builder's all-custom graph over the CuPy ``KVCache`` (``graph_engine.GraphEngine``,
    device flavour): every node a custom op or a view, computed on one graph thread."""

    flavour = "device"

    def __init__(self, cfg, cache):
        if cfg.kernel == "ggml":
            raise UserError("--kernel ggml is ggml's CPU flash attention; use --device cpu")
        if not cfg.flash_attn:
            raise UserError("-fa off (ggml's mul_mat+soft_max path) runs on the CPU only; use --device cpu")
        compiling = start_precompile(cfg) if self.flavour == "device" else None   # beside the weights' load
        super().__init__(cfg, cache)
        self.kernel_load = compiling.result() if compiling is not None else None


@dataclass(frozen=True)
class KernelLoad:
    """What :func:`start_precompile` did: kernel programs made ready, how many of them NVRTC
    compiled (the others came from the memory or disk cache), and its wall seconds (beside the
    engine's own start)."""
    programs: int
    compiled: int
    seconds: float


def start_precompile(cfg) -> Future:
    """Start compiling, in a thread of its own (its compiles in parallel threads), every kernel
    program the run of ``cfg`` may load on this GPU: the attention kernels ``--kernel`` may pick
    for the model's head sizes, cache types and GQA ratio (``ggml_attn.cuda_plan.programs``),
    the plan's kernels and the device graph's dense ops (the cache's store op among them; with
    ``--layer model`` those over each block type of the file's matrices). On a
    machine whose kernel cache lacks them (a first run, a new version) each would otherwise be
    compiled by its first call, inside the timed runs (1-2 s each on 2 cores). The future's
    ``result()`` is a :class:`KernelLoad`, or raises a compile error."""
    from ggml_attn import cuda_plan
    from ggml_attn import kernels as K
    from ggml_attn.graph.kv_graph import ggml_type_of
    m = cfg.model
    variants = cuda_plan.programs(m.head_dim_k, m.head_dim_v, ggml_type_of(cfg.type_k), ggml_type_of(cfg.type_v),
                                  m.n_head // m.n_head_kv, K.device_arch(), cfg.kernel,
                                  ext=bool(m.logit_softcap)) + [K.dense_variant()]
    if cfg.layer == "model":   # its embedding/RoPE ops, and the matmuls over each block type of its weights
        from ggml_attn import matmul_dispatch
        from ggml_attn.block_types import block_layout, is_block_type
        makes = [K.dense_q_variant] + ([K.dense_q8x_variant] if matmul_dispatch.Q8X_MAX_TOKENS else []) + \
            ([K.dense_q8x_qout_variant] if matmul_dispatch.Q8X_MAX_TOKENS and matmul_dispatch.GEMV_QUANT_OUT else [])
        variants += [K.model_ops_variant()] + [v for make in makes for t in m.file_type.split("+") if is_block_type(t)
                                               for v in (make(block_layout(t).type_id),) if v is not None]
        qr_ids = [block_layout(t).type_id for t in m.file_type.split("+") if t in K.GEMMQR_TYPES]
        if matmul_dispatch.QWGEMM_MIN_TOKENS is not None and K.device_arch() + "a" == K.HOPPER_ARCH:   # wgmma GEMMs
            variants += [K.dense_qw_variant(t) for t in qr_ids]
        if matmul_dispatch.qr_two_halves():   # dense_gemm_qr's two row halves (dense_gemm_qrm)
            variants += [K.dense_qrm_variant(t) for t in qr_ids]
        if matmul_dispatch.qr_gated():   # the gated FFN's products in one launch (dense_gemm_qrg)
            variants += [K.dense_qrg_variant(t) for t in qr_ids]
        if matmul_dispatch.QR_SPLIT_FINISH:   # dense_gemm_qr's shards with the fused split finish
            variants += list(dict.fromkeys(K.qr_finish_variant(v).shard_of(n) for v in variants
                                           if v.family in ("dense-q", "dense-qrm", "dense-qrg")
                                           for n in v.names if n.startswith("dense_gemm_qr<")))
        if matmul_dispatch.ATTN_QUANT_OUT and m.head_dim_v % 32 == 0:   # the cell-list kernel's QO instances
            variants += [K.cells_qo_of(v) for v in variants if v.family == "cells"]
    def job():
        t0 = time.perf_counter()
        programs, compiled = K.precompile(variants, K.device_arch())
        return KernelLoad(programs, compiled, time.perf_counter() - t0)
    ex = ThreadPoolExecutor(1)
    try:
        return ex.submit(job)
    finally:
        ex.shutdown(wait=False)
