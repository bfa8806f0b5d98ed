"""GPU engine: the builder's device-resident (all-custom) ubatch graph over a CuPy KV cache.

Per ubatch the plan's mask is uploaded into the graph once and the kernels' live-tile plan is
built once by the builder (``cuda_backend.make_plan``), then reused by every layer; attention is
``ggml_attn.flash_attn_ext`` on the CUDA backend, the full block's dense ops are the custom ops
of ``graph/xp_ops.py`` (CuPy, F16 GEMMs). Timing uses CUDA events around the work, after a
synchronize.
"""
from __future__ import annotations

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
        super().__init__(cfg, cache)
