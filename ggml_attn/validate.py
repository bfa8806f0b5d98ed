"""Graph-build-time checks of ``flash_attn_ext`` arguments.

Works on :class:`~ggml_attn.tensor.TensorDesc` (ggml order ``ne[0..3]``), so the op, the
CUDA backend and tests share one set of rules and messages. Every failure is a
``ValueError`` that names the tensor, its shape and what was expected.
"""
from __future__ import annotations

from dataclasses import dataclass

from .dtypes import GGML_TYPE_BF16, GGML_TYPE_F16, GGML_TYPE_F32, TYPE_SIZES
from .quant import is_quantized_kv, type_info
from .tensor import TensorDesc, type_name

KV_TYPES = (GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16)


@dataclass(frozen=True)
class AttnDims:
    """Sizes and types of one flash-attention call, derived from validated inputs (ggml order):
    q [head_dim_k, n_batch, n_head, ne3], k/v [head_dim_k|head_dim_v, n_kv, n_head_kv, ne3] of ``kv_type`` (V of
    ``v_type`` when it differs: f16 beside q8_0/q4_0), mask planes [n_kv, rows, ne32, ne33]
    (1, 1 without a mask). The one record of a call's dimensions: the op, the CPU path, the
    dispatcher's facts and the CUDA launch configuration all read it."""
    head_dim_k: int
    head_dim_v: int
    n_batch: int
    n_head: int
    n_head_kv: int
    ne3: int
    n_kv: int
    kv_type: int = GGML_TYPE_F16
    ne32: int = 1    # mask head planes (1 when no mask)
    ne33: int = 1    # mask stream planes
    v_type: int | None = None   # V's type when it differs from K's (kv_type)

    @property
    def gqa(self) -> int:
        """Query heads per KV head."""
        return self.n_head // self.n_head_kv

    @property
    def out_ne(self) -> tuple[int, int, int, int]:
        """ggml ne of the result: [head_dim_v, n_head, n_batch, ne3]."""
        return (self.head_dim_v, self.n_head, self.n_batch, self.ne3)


def check_flash_attn_args(q: TensorDesc, k: TensorDesc, v: TensorDesc,
                          mask: TensorDesc | None = None, sinks: TensorDesc | None = None,
                          max_bias: float = 0.0, scale: float = 1.0,
                          logit_softcap: float = 0.0, *, mask_rows_only: bool = False) -> AttnDims:
    """Validate q/k/v/mask/sinks (ggml order) and return the call's :class:`AttnDims`.
    ``mask_rows_only``: the mask needs contiguous rows only (the CUDA backend's direct entry
    points take strided mask views; the op, like ggml's, wants a contiguous mask)."""
    if q.type != GGML_TYPE_F32:
        raise ValueError(f"q {q.shape_str}: expected type f32, got {type_name(q.type)}")
    for t in (k, v):
        if t.type not in KV_TYPES and not is_quantized_kv(t.type):
            raise ValueError(f"{t.name} {t.shape_str}: expected type f32, f16, bf16 or a quantized "
                             f"type ggml can dequantize, got {type_name(t.type)}")
        if t.type in KV_TYPES:
            elem = TYPE_SIZES[t.type]
        else:
            info = type_info(t.type)
            elem = info.type_size
            if t.ne[0] % info.blck_size:
                raise ValueError(f"{t.name} {t.shape_str}: head size {t.ne[0]} is not a multiple of "
                                 f"{info.name}'s block size {info.blck_size}")
        if t.nb[0] != elem:
            raise ValueError(f"{t.name} {t.shape_str}: rows must be contiguous "
                             f"(nb[0] == {elem}), got nb={list(t.nb)}")
    if q.nb[0] != 4:
        raise ValueError(f"q {q.shape_str}: rows must be contiguous (nb[0] == 4), got nb={list(q.nb)}")
    head_dim_k, n_batch, n_head, ne3 = q.ne
    if k.ne[0] != head_dim_k:
        raise ValueError(f"k {k.shape_str}: head size ne[0]={k.ne[0]} must equal q's ne[0]={head_dim_k}")
    n_kv, n_head_kv = k.ne[1], k.ne[2]
    if v.ne[1] != n_kv:
        raise ValueError(f"v {v.shape_str}: n_kv ne[1]={v.ne[1]} must equal k's ne[1]={n_kv}")
    if v.ne[2] != n_head_kv:
        raise ValueError(f"v {v.shape_str}: n_head_kv ne[2]={v.ne[2]} must equal k's ne[2]={n_head_kv}")
    if v.ne[3] != k.ne[3]:
        raise ValueError(f"v {v.shape_str}: streams ne[3]={v.ne[3]} must equal k's ne[3]={k.ne[3]}")
    if k.ne[3] != ne3:
        raise ValueError(f"k {k.shape_str}: streams ne[3]={k.ne[3]} must equal q's ne[3]={ne3} "
                         "(ggml_flash_attn_ext does not broadcast K/V over streams)")
    if min(q.ne) < 1 or min(k.ne) < 1 or min(v.ne) < 1:
        raise ValueError(f"empty tensor: q {q.shape_str}, k {k.shape_str}, v {v.shape_str}")
    if n_head % n_head_kv:
        raise ValueError(f"k {k.shape_str}: q's n_head={n_head} must be a multiple of "
                         f"n_head_kv={n_head_kv} (GQA/MQA)")
    ne32 = ne33 = 1
    if mask is not None:
        if mask.type != GGML_TYPE_F16:
            raise ValueError(f"mask {mask.shape_str}: expected type f16, got {type_name(mask.type)}")
        if not mask.is_contiguous() and (not mask_rows_only or mask.nb[0] != 2):
            raise ValueError(f"mask {mask.shape_str}: must be {'rows-' if mask_rows_only else ''}contiguous, "
                             f"got nb={list(mask.nb)}")
        if mask.ne[0] != n_kv:
            raise ValueError(f"mask {mask.shape_str}: ne[0]={mask.ne[0]} must equal n_kv={n_kv} (k's ne[1])")
        if mask.ne[1] < n_batch:
            raise ValueError(f"mask {mask.shape_str}: ne[1]={mask.ne[1]} rows, need at least "
                             f"n_batch={n_batch} (q's ne[1])")
        ne32, ne33 = mask.ne[2], mask.ne[3]
        if n_head % ne32:
            raise ValueError(f"mask {mask.shape_str}: ne[2]={ne32} must divide n_head={n_head}")
        if ne3 % ne33:
            raise ValueError(f"mask {mask.shape_str}: ne[3]={ne33} must divide q's ne[3]={ne3}")
    elif max_bias > 0.0:
        raise ValueError(f"max_bias={max_bias} > 0 (ALiBi) requires a mask")
    if sinks is not None:
        if sinks.type != GGML_TYPE_F32 or sinks.ne != (n_head, 1, 1, 1):
            raise ValueError(f"sinks {sinks.shape_str}: expected f32 [{n_head}] (one per query head)")
    for name, val in (("scale", scale), ("max_bias", max_bias), ("logit_softcap", logit_softcap)):
        if val != val or val in (float("inf"), float("-inf")):
            raise ValueError(f"{name}={val} must be finite")
    return AttnDims(head_dim_k, v.ne[0], n_batch, n_head, n_head_kv, ne3, n_kv, k.type, ne32, ne33,
                    v.type if v.type != k.type else None)
