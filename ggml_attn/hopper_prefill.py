"""Stage-2 prefill on sm_90a, version 0 (cuda/fattn_wgmma.cu): wgmma in place of mma.sync and
nothing else yet -- a measured starting point for the Hopper kernels, not dispatched by the op.

``run_v0`` takes the op's device tensors (ggml order: q f32 [128, n_batch, n_head, ne3], k/v f16
[128, n_kv, n_head_kv, ne3], dst f32 [128, n_head, n_batch, ne3]) with no mask, sinks, softcap
or ALiBi; ``why_not_v0`` says what it does not take.
"""
from __future__ import annotations

from . import cuda_backend as cb
from . import kernels as K
from .dtypes import GGML_TYPE_F16
from .tensor import TensorDesc

SMEM_V0 = 5 * 64 * 128 * 2   # Q, 2 K and 2 V tiles of 64 x 128 halves (cuda/fattn_wgmma.cu)
NAME_V0 = "fattn_wgmma_v0_d128"


def why_not_v0(sh: cb.Shapes, q: TensorDesc, k: TensorDesc, v: TensorDesc,
               dst: TensorDesc | None = None) -> str | None:
    """None when version 0 runs these shapes, else why not (D 128, f16 K/V, 16-byte rows, an
    8-byte aligned dst)."""
    if (sh.d_k, sh.d_v) != (128, 128):
        return f"head sizes {sh.d_k}/{sh.d_v}: version 0 is D 128 only"
    if sh.kv_type != GGML_TYPE_F16:
        return "K/V must be f16"
    if not all(cb._kv_aligned(t) for t in (q, k, v)):
        return "Q, K and V rows must be 16-byte aligned"
    if dst is not None and dst.ptr % 8:
        return "dst must be 8-byte aligned"
    return None


def run_v0(q: TensorDesc, k: TensorDesc, v: TensorDesc, dst: TensorDesc, scale: float,
           stream: int = 0) -> None:
    """dst = softmax(scale Q K^T) V on the GPU (no mask), on ``stream``; ValueError for what
    version 0 does not take."""
    sh = cb.validate(q, k, v, None, None, dst, scale)
    reason = why_not_v0(sh, q, k, v, dst)
    if reason:
        raise ValueError(f"wgmma prefill v0: {reason}")
    p = cb._params_common(q, k, v, None, None, dst, sh, scale, 0.0, 0.0)
    fn = K.get_function(K.wgmma_v0_variant(), NAME_V0, smem=SMEM_V0)
    fn.launch((-(-sh.n_batch // 64), sh.n_head, sh.ne3), (128, 1, 1), stream, p)
