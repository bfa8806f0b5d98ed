"""The half-precision decode of ggml's weight blocks (cuda/quant_blocks.cuh qb_frag8h, the wgmma block
GEMM's dense_gemm_qwh) read by numpy from the blocks' fields: an independent reading of ggml's
layouts for tests/test_quant_blocks.py (against the header built for the host) and the GPU
tests' reference (tests/test_gpu_dense_q.py)."""
import numpy as np

from ggml_attn.block_types import block_layout


def _f16(x) -> np.ndarray:
    """float64 -> the nearest f16 (numpy rounds a double to half once, ties to even), as float64."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(x, np.float64).astype(np.float16).astype(np.float64)


def _half_field(b: np.ndarray, off: int) -> np.ndarray:
    return b[:, off:off + 2].copy().view(np.float16)[:, 0].astype(np.float64)


def half_values(name: str, raw: np.ndarray) -> np.ndarray:
    """qb_frag8h's values by numpy, from the blocks' fields (an independent reading of ggml's
    layouts): each one rounding to f16 of the exact integer q times factors, Q6_K's d sc and the
    K-quants' dmin m rounded to f16 first."""
    b = raw.reshape(-1, block_layout(name).nbytes)
    n = b.shape[0]
    if name in ("Q4_0", "Q8_0"):
        qs = b[:, 2:18].astype(np.int64)
        q = np.concatenate([qs & 15, qs >> 4], axis=1) - 8 if name == "Q4_0" else b[:, 2:34].view(np.int8).astype(np.int64)
        return _f16(q * _half_field(b, 0)[:, None]).reshape(-1)
    q = np.empty((n, 256), np.int64)
    if name == "Q6_K":   # 128-value halves h: value 128 h + 32 k + l from ql, qh, scale sc[8 h + 2 k + l / 16]
        ql, qh, sc = b[:, :128].astype(np.int64), b[:, 128:192].astype(np.int64), b[:, 192:208].view(np.int8)
        scale = np.empty((n, 256), np.int64)
        for h in range(2):
            for k in range(4):
                v = slice(128 * h + 32 * k, 128 * h + 32 * k + 32)
                low = ql[:, 64 * h + 32 * (k & 1):64 * h + 32 * (k & 1) + 32] >> (4 * (k >> 1))
                q[:, v] = (low & 15) | (((qh[:, 32 * h:32 * h + 32] >> (2 * k)) & 3) << 4)
                scale[:, v] = np.repeat(sc[:, 8 * h + 2 * k:8 * h + 2 * k + 2].astype(np.int64), 16, axis=1)
        return _f16((q - 32) * _f16(_half_field(b, 208)[:, None] * scale)).reshape(-1)
    sc12 = b[:, 4:16].astype(np.int64)   # ggml's get_scale_min_k4
    sc = np.concatenate([sc12[:, 0:4] & 63, (sc12[:, 8:12] & 15) | ((sc12[:, 0:4] >> 6) << 4)], axis=1)
    m = np.concatenate([sc12[:, 4:8] & 63, (sc12[:, 8:12] >> 4) | ((sc12[:, 4:8] >> 6) << 4)], axis=1)
    qs = b[:, 16:144] if name == "Q4_K" else b[:, 48:176]
    for s in range(8):
        q[:, 32 * s:32 * s + 32] = (qs[:, 32 * (s >> 1):32 * (s >> 1) + 32].astype(np.int64) >> (4 * (s & 1))) & 15
        if name == "Q5_K":
            q[:, 32 * s:32 * s + 32] |= ((b[:, 16:48].astype(np.int64) >> s) & 1) << 4
    qsc = q * np.repeat(sc, 32, axis=1)   # (exact: <= 945)
    m1 = _f16(_half_field(b, 2)[:, None] * m)
    with np.errstate(invalid="ignore"):
        return _f16(qsc * _half_field(b, 0)[:, None] - np.repeat(m1, 32, axis=1)).reshape(-1)
