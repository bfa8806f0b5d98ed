"""The stage-2 prefill on sm_90a (cuda/fattn_wgmma.cu), launched directly: a TMA producer
warpgroup feeding a ring of swizzled K/V chunks (128 cells; 64 at D 256) to two consumer
warpgroups (128 query rows per block), the softmax of one chunk under the P V GEMM of the one
before, the two warpgroups in ping-pong. The op runs it as kernel ``"prefill-wgmma"`` (ggml_attn/dispatch.py
decides; cuda_backend.bind launches it with the tensor maps of ggml_attn/wgmma_shape.py), masks
through the plan's 128-token tile map. ``run_ws`` launches it without a mask in one of
``WS_CONFIGS`` (tests, benchmarks).

Tensors in ggml order: q f32 [D, n_batch, n_head, ne3], k/v f16 (or bf16 for the bf16
instances) [D, n_kv, n_head_kv, ne3], dst f32 [D, n_head, n_batch, ne3], D one of HEAD_SIZES_WS
(the instance's tile width, or a smaller size padded to it); no sinks, softcap or ALiBi.
``why_not`` says what the kernels do not take.
"""
from __future__ import annotations

from . import cuda_backend as cb
from . import dispatch
from . import kernels as K
from .cuda_device import num_sms
from .dtypes import GGML_TYPE_F16, TYPE_NAMES
from .tensor import TensorDesc
from .wgmma_shape import (HEAD_SIZES_WS, THREADS_WS, WS_CONFIGS, WS_DEFAULT, WS_DIAG, kv_map, o_map, q_map, tile_width,
                          ws_grid, ws_q_tiles)

__all__ = ["WS_CONFIGS", "WS_DEFAULT", "WS_DIAG", "kv_map", "q_map", "why_not", "run_ws"]


def why_not(sh: cb.AttnDims, q: TensorDesc, k: TensorDesc, v: TensorDesc,
            dst: TensorDesc | None = None, kv_type: int = GGML_TYPE_F16, d: int = 128) -> str | None:
    """None when an instance for K/V of ``kv_type`` and tile width ``d`` runs these shapes, else
    why not (head_dim_k = head_dim_v, a head size of HEAD_SIZES_WS whose tile width is d, that K/V type,
    16-byte aligned addresses and strides, an 8-byte aligned dst)."""
    if sh.head_dim_k != sh.head_dim_v or sh.head_dim_k not in HEAD_SIZES_WS or tile_width(sh.head_dim_k) != d:
        sizes = ", ".join(str(x) for x in HEAD_SIZES_WS if tile_width(x) == d)
        return f"head sizes {sh.head_dim_k}/{sh.head_dim_v}: this instance takes D {sizes} (head_dim_k = head_dim_v)"
    if sh.kv_type != kv_type:
        return f"K/V must be {TYPE_NAMES.get(kv_type, kv_type)} for this instance"
    if not (dispatch.kv_access(q, q)[0] and dispatch.kv_access(k, v)[0]):   # Q's 16-byte loads, TMA's strides
        return "Q, K and V rows must be 16-byte aligned"
    if dst is not None and dst.ptr % 8:
        return "dst must be 8-byte aligned"
    return None


def run_ws(q: TensorDesc, k: TensorDesc, v: TensorDesc, dst: TensorDesc, scale: float,
           stream: int = 0, config: str = WS_DEFAULT, blocks: int = 0, pack: int = 1) -> None:
    """Version 1 of dst = softmax(scale Q K^T) V (no mask) on ``stream``, in one of WS_CONFIGS
    (or a WS_DIAG probe: timing only); ``blocks``: a persistent instance's block count (0: one
    per SM); ``pack``: query heads per tile (an instance with Q through TMA; a power of 2 dividing
    gqa). ValueError for what it does not take."""
    c = WS_CONFIGS[config] if config in WS_CONFIGS else WS_DIAG[config]
    sh = cb.validate(q, k, v, None, None, dst, scale)
    reason = why_not(sh, q, k, v, dst, c.kv_type, c.d)
    if reason is None and pack != 1 and (not c.q_tma or sh.gqa % pack):
        reason = f"{pack} query heads per tile need an instance with Q through TMA and gqa a multiple of it"
    if reason:
        raise ValueError(f"wgmma prefill {config}: {reason}")
    p = cb._params_common(q, k, v, None, None, dst, sh, scale, 0.0, 0.0)
    grid = ws_grid(sh.n_batch, sh.n_head, sh.ne3, (blocks or num_sms()) if c.persistent else 0, pack)
    p.pack, p.n_q_tiles = pack, ws_q_tiles(sh.n_batch, pack)   # the tiles' rows, the persistent blocks' list
    fn = K.get_function(K.wgmma_variant(c.name), c.name)
    fn.launch(grid, (THREADS_WS, 1, 1), stream, p, kv_map(k), kv_map(v), q_map(q, c.d, pack), o_map(dst, c.name, pack))
