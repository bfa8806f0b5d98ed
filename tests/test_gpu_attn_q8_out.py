"""The attention's output in 8-bit form on the GPU (ggml_attn/q8_out.py; needs a CUDA GPU and CuPy,
skipped otherwise): whichever kernel runs -- the cell-list kernel's QO epilogue over one split,
the same kernel over several splits, the tile kernels, the numpy reference -- ``xq``, ``xd``,
``xs`` are the bits of ``dense_quant_q8x``'s rounding of the ``dst`` the call wrote (per 32
values d = max|v| / 127 in F32, q = round(v / d) ties to even, s = the sum of q), ``dst`` itself
is the call's without ``q8_out`` bit for bit, and both are poisoned before each run. A replayed
bound call (the op's fast path, a captured step) writes them again."""
from __future__ import annotations

import math

import numpy as np
import pytest

from ggml_attn import cuda_backend as cb
from ggml_attn import q8_out
from ggml_attn.dtypes import GGML_TYPE_F16
from ggml_attn.quant import q8_form
from ggml_attn.reference import flash_attn_ext, nmse
from ggml_attn.tensor import from_array

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cb.available(), reason="no CUDA GPU / CuPy")]


@pytest.fixture
def rng():
    return np.random.default_rng(11)


def _decode_mask(n_batch, n_kv, rng):
    """Each row sees a random prefix of the cells (a ragged decode step)."""
    m = np.full((n_batch, n_kv), -np.inf, dtype=np.float32)
    for t in range(n_batch):
        m[t, :rng.integers(1, n_kv + 1)] = 0.0
    return m[None, None].astype(np.float16)


@pytest.mark.parametrize("kernel, n_batch, n_kv, n_splits, fused", [
    ("cells", 1, 700, 1, True), ("cells", 4, 3000, 1, True), ("cells", 1, 4000, 3, False),
    ("decode-tc", 2, 900, None, False), ("prefill", 64, 256, None, False), ("reference", 2, 300, None, False)])
@pytest.mark.parametrize("fuse", [True, False])
def test_the_8_bit_form_is_dst_quantized(kernel, n_batch, n_kv, n_splits, fused, fuse, rng, monkeypatch):
    import cupy as cp
    monkeypatch.setattr(q8_out, "FUSE", fuse)
    n_head, n_head_kv, d = 32, 8, 128
    q = rng.uniform(-1, 1, (1, n_head, n_batch, d)).astype(np.float32)
    k = rng.uniform(-1, 1, (1, n_head_kv, n_kv, d)).astype(np.float16)
    v = (rng.uniform(-1, 1, (1, n_head_kv, n_kv, d)) * rng.choice([1e-3, 1.0, 50.0], (1, n_head_kv, n_kv, 1))).astype(np.float16)
    mask = _decode_mask(n_batch, n_kv, rng)
    scale = 1 / math.sqrt(d)
    dq, dk, dv, dm = cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(mask)
    plan = cb.make_plan(from_array(dm, GGML_TYPE_F16), n_batch, n_head, n_head_kv, head_dim_k=d,
                        kv_type=GGML_TYPE_F16, kernel=kernel if kernel != "reference" else "auto")
    n = n_head * d
    outs = {}
    for with_q8 in (False, True):
        dst = cp.full((1, n_batch, n_head, d), cp.nan, dtype=cp.float32)
        arrs = (cp.full((n_batch, n), 77, cp.int8), cp.full((n_batch, n // 32), cp.nan, cp.float32),
                cp.full((n_batch, n // 32), cp.nan, cp.float32))
        b = cb.bind(from_array(dq), from_array(dk, GGML_TYPE_F16), from_array(dv, GGML_TYPE_F16),
                    from_array(dm, GGML_TYPE_F16), None, from_array(dst), scale, kernel=kernel, plan=plan,
                    n_splits=n_splits, q8=q8_out.check_arrays(arrs, n_batch, n) if with_q8 else None)
        assert b.kern == kernel and (b._post is None) == (with_q8 and fused and fuse or not with_q8)
        for _ in range(2):   # the second launch: a replay writes the form again over a poisoned one
            b.launch()
            cp.cuda.get_current_stream().synchronize()
            got = [a.get() for a in arrs]
            for a, poison in zip(arrs, (77, cp.nan, cp.nan)):
                a.fill(poison)
        outs[with_q8] = (dst.get(), got)
    ref = flash_attn_ext(q, k, v, mask, scale, kv_type=GGML_TYPE_F16, dtype=np.float64)
    assert nmse(outs[True][0], ref) <= 5e-4
    np.testing.assert_array_equal(outs[True][0], outs[False][0])   # dst unchanged by the form
    want = q8_form(outs[True][0].reshape(n_batch, n))
    for name, g, w in zip(("xq", "xd", "xs"), outs[True][1], want):
        np.testing.assert_array_equal(g, w, err_msg=name)


def test_the_fused_epilogue_runs_where_it_fits(rng, monkeypatch):
    """One decode token over one split takes the QO instance; three splits do not (the fields it
    borrows hold the partials) and quantize after the combine."""
    import cupy as cp
    monkeypatch.setattr(q8_out, "FUSE", True)
    n_head, n_head_kv, d, n_kv = 32, 8, 128, 600
    dq = cp.asarray(rng.uniform(-1, 1, (1, n_head, 1, d)).astype(np.float32))
    dk = cp.asarray(rng.uniform(-1, 1, (1, n_head_kv, n_kv, d)).astype(np.float16))
    dm = cp.zeros((1, 1, 1, n_kv), cp.float16)
    plan = cb.make_plan(from_array(dm, GGML_TYPE_F16), 1, n_head, n_head_kv, head_dim_k=d, kv_type=GGML_TYPE_F16,
                        kernel="cells")
    arrs = (cp.zeros((1, n_head * d), cp.int8), cp.zeros((1, n_head * d // 32), cp.float32),
            cp.zeros((1, n_head * d // 32), cp.float32))
    q8 = q8_out.check_arrays(arrs, 1, n_head * d)
    dst = cp.zeros((1, 1, n_head, d), cp.float32)
    for n_splits, fused in ((1, True), (3, False)):
        b = cb.bind(from_array(dq), from_array(dk, GGML_TYPE_F16), from_array(dk, GGML_TYPE_F16),
                    from_array(dm, GGML_TYPE_F16), None, from_array(dst), 0.1, kernel="cells", plan=plan,
                    n_splits=n_splits, q8=q8)
        assert (b._post is None) == fused and b._fn.name.endswith(", 1>") == fused, n_splits
