"""The Hopper building blocks (cuda/hopper_common.cuh: wgmma on shared-memory operands, their
matrix descriptors and core-matrix layout) against numpy, on a compute capability 9.0 GPU.
Skipped without a GPU or on another architecture (the sm_90a programs load there only).
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from ggml_attn import cuda_backend as cb
from ggml_attn import kernels as K


def _is_sm90() -> bool:
    if not cb.available():
        return False
    return K.device_arch() == "sm_90"


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _is_sm90(), reason="needs a compute capability 9.0 GPU (sm_90a programs)")]


def _probe_gemm(a: np.ndarray, b: np.ndarray, lead: int, stride: int) -> np.ndarray:
    """C = A B^T through hopper_probe_gemm: a, b f16 [64, K] row-major (numpy order)."""
    import cupy as cp
    da, db = cp.asarray(a), cp.asarray(b)
    dc = cp.full((64, 64), cp.nan, dtype=cp.float32)
    fn = K.get_function(K.hopper_probe_variant(), "hopper_probe_gemm")
    stream = cp.cuda.get_current_stream()
    fn.launch((1, 1, 1), (128, 1, 1), stream.ptr, ctypes.c_uint64(da.data.ptr), ctypes.c_uint64(db.data.ptr),
              ctypes.c_uint64(dc.data.ptr), ctypes.c_int32(a.shape[1]), ctypes.c_uint32(lead),
              ctypes.c_uint32(stride))
    stream.synchronize()
    return dc.get()


@pytest.mark.parametrize("k", [16, 32, 64])
def test_wgmma_m64n64k16_core_matrix_layout(k):
    """K / 16 wgmma steps over core-matrix tiles give A B^T with the descriptor offsets the
    header documents (K-neighbour core matrices 128 bytes apart, row groups K * 2 * 8 bytes):
    the accumulator layout, the descriptor fields and the per-step start address at once. On a
    mismatch the message says whether the two offsets swapped would have matched."""
    rng = np.random.default_rng(k)
    a = rng.integers(-4, 5, (64, k)).astype(np.float16)   # small integers: exact in f32
    b = rng.integers(-4, 5, (64, k)).astype(np.float16)
    want = a.astype(np.float64) @ b.astype(np.float64).T
    lead, stride = 128, k * 16
    got = _probe_gemm(a, b, lead, stride)
    if not np.array_equal(got, want):
        swapped = _probe_gemm(a, b, stride, lead)
        bad = int((got != want).sum())
        pytest.fail(f"K={k}: {bad} of 4096 outputs wrong with lead={lead}, stride={stride}; "
                    f"swapped offsets {'match' if np.array_equal(swapped, want) else 'do not match either'}")


def test_hopper_program_refused_elsewhere(monkeypatch):
    """get_function builds sm_90a programs for compute capability 9.0 only: on another
    architecture it says so instead of loading a cubin the driver would reject."""
    monkeypatch.setattr(K, "device_arch", lambda: "sm_80")
    with pytest.raises(RuntimeError, match="sm_90a only"):
        K.get_function(K.hopper_probe_variant(), "hopper_probe_gemm")
