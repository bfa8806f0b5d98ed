"""Stage-2 prefill on sm_90a (cuda/fattn_wgmma.cu), not dispatched by the op yet.

- version 0 (``run_v0``): wgmma in place of mma.sync and nothing else; one warpgroup per 64
  query rows, cp.async loads.
- version 1 (``run_ws``): warp-specialised -- a TMA producer warpgroup feeding a ring of
  swizzled K/V tiles to two consumer warpgroups (128 query rows per block), with the
  intra-warpgroup pipelining (S of tile j under P V of tile j-1); ``WS_CONFIGS`` names the
  instances (ring depth, the two warpgroups' ping-pong schedule, the serial order for
  comparison).

Both take the op's device tensors (ggml order: q f32 [128, n_batch, n_head, ne3], k/v f16
[128, n_kv, n_head_kv, ne3], dst f32 [128, n_head, n_batch, ne3]) with no mask, sinks, softcap
or ALiBi; ``why_not`` says what they do not take.
"""
from __future__ import annotations

from . import cuda_backend as cb
from . import kernels as K
from . import tma
from .dtypes import GGML_TYPE_F16
from .tensor import TensorDesc

SMEM_V0 = 5 * 64 * 128 * 2   # Q, 2 K and 2 V tiles of 64 x 128 halves
NAME_V0 = "fattn_wgmma_v0_d128"
THREADS_WS = 384   # two consumer warpgroups and the producer warpgroup (cuda/fattn_wgmma.cuh)
# version 1's instances (FATTN_WS_INSTANCE in cuda/fattn_wgmma.cu): kernel, KV tile cells, ring
# stages; "bk128" is the default, the others are its A/B rows in tools/gpu_bench.py
WS_CONFIGS = {
    "bk128": ("fattn_wgmma_ws_d128", 128, 3),
    "bk128-pp": ("fattn_wgmma_ws_pp_d128", 128, 3),
    "bk128-pp-qsw": ("fattn_wgmma_ws_qsw_d128", 128, 3),
    "bk128-s2pp": ("fattn_wgmma_ws_s2pp_d128", 128, 2),
    "bk128-serial": ("fattn_wgmma_ws_serial_d128", 128, 3),
}
# speed-of-light probes of bk128-pp for tools/gpu_bench.py (wrong results by design): without
# the softmax (GEMMs and the pipeline only), without loads past the ring's first fill
WS_DIAG = {
    "diag-nosoftmax": ("fattn_wgmma_ws_diag_nosoftmax_d128", 128, 3),
    "diag-noload": ("fattn_wgmma_ws_diag_noload_d128", 128, 3),
}


def smem_ws(bk: int, stages: int) -> int:
    """ws::smem_bytes<BK, STAGES>() of cuda/fattn_wgmma.cuh: alignment slack, the K/V ring, Q
    (128 x 128 halves), 4 mbarriers per stage."""
    return 1024 + 2 * stages * bk * 128 * 2 + 128 * 128 * 2 + 4 * stages * 8


def why_not(sh: cb.Shapes, q: TensorDesc, k: TensorDesc, v: TensorDesc,
            dst: TensorDesc | None = None) -> str | None:
    """None when versions 0 and 1 run these shapes, else why not (D 128, f16 K/V, 16-byte
    aligned addresses and strides, an 8-byte aligned dst)."""
    if (sh.d_k, sh.d_v) != (128, 128):
        return f"head sizes {sh.d_k}/{sh.d_v}: D 128 only"
    if sh.kv_type != GGML_TYPE_F16:
        return "K/V must be f16"
    if not all(cb._kv_aligned(t) for t in (q, k, v)):   # cp.async's 16-byte copies, TMA's strides
        return "Q, K and V rows must be 16-byte aligned"
    if dst is not None and dst.ptr % 8:
        return "dst must be 8-byte aligned"
    return None


def _checked(q, k, v, dst, scale, what: str):
    sh = cb.validate(q, k, v, None, None, dst, scale)
    reason = why_not(sh, q, k, v, dst)
    if reason:
        raise ValueError(f"wgmma prefill {what}: {reason}")
    return sh, cb._params_common(q, k, v, None, None, dst, sh, scale, 0.0, 0.0)


def run_v0(q: TensorDesc, k: TensorDesc, v: TensorDesc, dst: TensorDesc, scale: float,
           stream: int = 0) -> None:
    """dst = softmax(scale Q K^T) V on the GPU (no mask), on ``stream``; ValueError for what
    version 0 does not take."""
    sh, p = _checked(q, k, v, dst, scale, "v0")
    fn = K.get_function(K.wgmma_v0_variant(), NAME_V0, smem=SMEM_V0)
    fn.launch((-(-sh.n_batch // 64), sh.n_head, sh.ne3), (128, 1, 1), stream, p)


def kv_map(t: TensorDesc, bk: int) -> tma.TmaMap:
    """The TMA map of a K or V tensor (ggml order [128, n_kv, n_head_kv, ne3], f16) that version
    1's producer reads bk x 64 boxes through, 128-byte swizzled; cells past n_kv read as 0."""
    return tma.encode_tiled(tma.DTYPE_F16, t.ptr, tuple(t.ne), tuple(t.nb[1:]), (64, bk, 1, 1),
                            tma.SWIZZLE_128B)


def run_ws(q: TensorDesc, k: TensorDesc, v: TensorDesc, dst: TensorDesc, scale: float,
           stream: int = 0, config: str = "bk128") -> None:
    """Version 1 of dst = softmax(scale Q K^T) V (no mask) on ``stream``, in one of WS_CONFIGS
    (or a WS_DIAG probe: timing only); ValueError for what it does not take."""
    sh, p = _checked(q, k, v, dst, scale, "v1")
    name, bk, stages = WS_CONFIGS[config] if config in WS_CONFIGS else WS_DIAG[config]
    fn = K.get_function(K.wgmma_v0_variant(), name, smem=smem_ws(bk, stages))
    fn.launch((-(-sh.n_batch // 128), sh.n_head, sh.ne3), (THREADS_WS, 1, 1), stream, p,
              kv_map(k, bk), kv_map(v, bk))
