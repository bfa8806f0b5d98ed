"""GPU kernels against the float64 reference (needs a CUDA GPU and CuPy; skipped otherwise).

Every case: fresh random inputs, dst poisoned with NaN before each run, NMSE <= 5e-4 against
ggml_attn.reference in float64, NaN never passes. Both entry points (device pointers, host
pointers). The conformance grid is test-backend-ops' (ggml_attn.conformance); add
``--grid-sample N`` to run a seeded sample of it.
"""
from __future__ import annotations

import functools
import math
import warnings

import numpy as np
import pytest

from ggml_attn import conformance as conf
from ggml_attn import cuda_backend as cb
from ggml_attn import cuda_launch
from ggml_attn.dtypes import GGML_TYPE_BF16, GGML_TYPE_F16, GGML_TYPE_F32, from_float
from ggml_attn.reference import flash_attn_ext, nmse
from ggml_attn.tensor import from_array

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cb.available(), reason="no CUDA GPU / CuPy")]

NMSE_MAX = 5e-4
# "prefill-wide": the prefill kernel with 128-row query tiles (MT = 2, FA2 load order) forced
# at every batch size (the backend picks it from cuda_launch.PREFILL_WIDE_MIN_BATCH tokens on)
# "cells": the cell-list decode kernel (per-row lists of visible cells), run by name on every
# case it takes (decode-shaped: n_batch <= dispatch.CELLS_MAX_BATCH; larger cases skip it)
GPU_KERNELS = ("prefill", "prefill-wide", "decode", "decode-tc", "cells")


def _kernels_taking(n_batch):
    """GPU_KERNELS that take n_batch query tokens per stream (for loops: no skip midway)."""
    from ggml_attn import dispatch
    return [k for k in GPU_KERNELS if k != "cells" or n_batch <= dispatch.CELLS_MAX_BATCH]


def _skip_cells_if_large(kernel, n_batch):
    from ggml_attn import dispatch
    if kernel == "cells" and n_batch > dispatch.CELLS_MAX_BATCH:
        pytest.skip(f"cells takes n_batch <= {dispatch.CELLS_MAX_BATCH} (decode-shaped calls)")


class _Kernel:
    """Context: the backend kernel name of a test kernel name (entering forces the wide tiles)."""

    def __init__(self, kernel):
        self.name = "prefill" if kernel == "prefill-wide" else kernel
        self.wide = kernel == "prefill-wide"

    def __enter__(self):
        if self.wide:
            self.saved, cuda_launch.PREFILL_WIDE_MIN_BATCH = cuda_launch.PREFILL_WIDE_MIN_BATCH, 1
            cb._PREPARED.clear()
        return self.name

    def __exit__(self, *exc):
        if self.wide:
            cuda_launch.PREFILL_WIDE_MIN_BATCH = self.saved
            cb._PREPARED.clear()


def _cupy():
    import cupy
    return cupy


def _dev(arr, permuted=False):
    """numpy array (numpy order) -> CuPy array with the same values; permuted: the memory
    order swaps axes 1 and 2 (ggml's permuted-input variant), the view is the same shape."""
    cp = _cupy()
    if arr is None:
        return None
    if permuted:
        return cp.asarray(np.ascontiguousarray(arr.transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3)
    return cp.asarray(np.ascontiguousarray(arr))


def _reference(inp, case_scale, max_bias, softcap, kv_type):
    return flash_attn_ext(inp.q, inp.k, inp.v, inp.mask, case_scale, max_bias, softcap, inp.sinks,
                          kv_type=kv_type, dtype=np.float64)


def _run_device(q, k, v, mask, sinks, scale, max_bias, softcap, kernel, *, permuted=False,
                n_splits=None, plan=None, head_dim_v=None):
    cp = _cupy()
    ne3, n_head, n_batch, _ = q.shape
    _skip_cells_if_large(kernel, n_batch)
    head_dim_v = v.shape[3] if head_dim_v is None else head_dim_v
    dq, dk_, dv_ = _dev(q, permuted), _dev(k, permuted), None
    if v is not None and k is not None and v.base is not None and v.base is k:
        dv_ = dk_[..., :v.shape[3]]   # MLA: V is a view of K
    else:
        dv_ = _dev(v, permuted)
    dm, ds = _dev(mask), _dev(sinks) if sinks is not None else None
    dst = cp.full((ne3, n_batch, n_head, head_dim_v), cp.nan, dtype=cp.float32)
    kv_type = {np.dtype(np.float16): GGML_TYPE_F16, np.dtype(np.uint16): GGML_TYPE_BF16,
               np.dtype(np.float32): GGML_TYPE_F32}[k.dtype]
    with _Kernel(kernel) as kern:
        cb.flash_attn_ext_device(from_array(dq), from_array(dk_, kv_type), from_array(dv_, kv_type),
                                 from_array(dm) if dm is not None else None,
                                 from_array(ds) if ds is not None else None, from_array(dst),
                                 scale, max_bias, softcap, kernel=kern, n_splits=n_splits, plan=plan)
    cp.cuda.get_current_stream().synchronize()
    return dst.get()


def _run_host(q, k, v, mask, sinks, scale, max_bias, softcap, kernel):
    ne3, n_head, n_batch, _ = q.shape
    _skip_cells_if_large(kernel, n_batch)
    dst = np.full((ne3, n_batch, n_head, v.shape[3]), np.nan, dtype=np.float32)
    kv_type = {np.dtype(np.float16): GGML_TYPE_F16, np.dtype(np.uint16): GGML_TYPE_BF16,
               np.dtype(np.float32): GGML_TYPE_F32}[k.dtype]
    with _Kernel(kernel) as kern:
        cb.flash_attn_ext_host(from_array(q), from_array(k, kv_type), from_array(v, kv_type),
                               from_array(mask) if mask is not None else None,
                               from_array(sinks) if sinks is not None else None, from_array(dst),
                               scale, max_bias, softcap, kernel=kern)
    return dst


def _check(out, ref, what):
    assert not np.isnan(out).any(), f"{what}: NaN in output (unwritten or bad math)"
    err = nmse(out, ref)
    assert err <= NMSE_MAX, f"{what}: NMSE {err:.3g} > {NMSE_MAX}"


def _kernels_for(hsk, hsv, kv_type):
    from ggml_attn import dispatch
    return [k for k in GPU_KERNELS if dispatch.supports(_Kernel(k).name, hsk, hsv, kv_type) is None]


# float K/V only: quantized K/V types are served by the CPU path (the GPU kernels read f16/bf16;
# f32 K/V is checked here through the backend's reference fallback)
ALL_CASES = [c for c in conf.grid(kv_types=(GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16))
             if c.kv_type in (GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16)
             and getattr(c, "v_type", None) in (None, c.kv_type)]


@pytest.fixture(scope="module")
def rng():
    return np.random.default_rng(12345)


def _sampled(request):
    n = request.config.getoption("--grid-sample", default=0)
    return n


@pytest.mark.parametrize("idx", range(len(ALL_CASES)), ids=[c.id for c in ALL_CASES])
def test_conformance_grid(idx, request, rng):
    n = _sampled(request)
    if n and idx not in set(np.random.default_rng(7).choice(len(ALL_CASES), min(n, len(ALL_CASES)), replace=False)):
        pytest.skip("not in --grid-sample")
    case = ALL_CASES[idx]
    inp = conf.make_inputs(case, rng)
    ref = _reference(inp, case.scale, case.max_bias, case.logit_softcap, case.kv_type)
    kernels = _kernels_for(case.hsk, case.hsv, case.kv_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for kern in kernels + ["auto"]:
            out = _run_device(inp.q, inp.k, inp.v, inp.mask, inp.sinks, case.scale, case.max_bias,
                              case.logit_softcap, kern, permuted=case.permuted)
            _check(out, ref, f"{case.id} device {kern}")
        if idx % 5 == 0:
            out = _run_host(inp.q, inp.k, inp.v, inp.mask, inp.sinks, case.scale, case.max_bias,
                            case.logit_softcap, "auto")
            _check(out, ref, f"{case.id} host auto")


# ---------------------------------------------------------------------------------------
# masks that matter for the project: ragged multi-sequence, interior holes, fully masked
def _block_causal_mask(seq_lens, n_kv=None, pad_rows=0):
    """Unified-KV ubatch of several sequences: token i of sequence s sees its own cells
    0..i; numpy (1, 1, n_batch + pad_rows, n_kv) f16."""
    n = sum(seq_lens)
    n_kv = n if n_kv is None else n_kv
    m = np.full((n + pad_rows, n_kv), -np.inf, dtype=np.float32)
    off = 0
    for L in seq_lens:
        for i in range(L):
            m[off + i, off:off + i + 1] = 0.0
        off += L
    return m[None, None].astype(np.float16)


def _inputs(rng, ne3, n_head, n_head_kv, n_batch, n_kv, dk, dv, kv_type, sinks=False):
    q = rng.uniform(-1, 1, (ne3, n_head, n_batch, dk)).astype(np.float32)
    k = from_float(rng.uniform(-1, 1, (ne3, n_head_kv, n_kv, dk)), kv_type)
    v = from_float(rng.uniform(-1, 1, (ne3, n_head_kv, n_kv, dv)), kv_type)
    s = rng.uniform(-3, 3, n_head).astype(np.float32) if sinks else None
    return q, k, v, s


SPECIAL = [
    # name, seq_lens, n_head, n_head_kv, dk, kv_type
    ("ragged16", [16, 200, 33, 1, 77, 128, 5, 64, 65, 190, 17, 40, 100, 3, 150, 9], 8, 2, 128, GGML_TYPE_F16),
    ("ragged_bf16", [100, 31, 64, 1, 200], 4, 4, 64, GGML_TYPE_BF16),
    ("two_seqs", [300, 250], 8, 1, 128, GGML_TYPE_F16),
    ("ragged_d256", [70, 5, 130], 4, 2, 256, GGML_TYPE_F16),
    ("ragged_d80", [70, 5, 130], 4, 2, 80, GGML_TYPE_BF16),
]


@pytest.mark.parametrize("name,seq_lens,n_head,n_head_kv,dk,kv_type", SPECIAL, ids=[s[0] for s in SPECIAL])
@pytest.mark.parametrize("kernel", GPU_KERNELS + ("auto",))
def test_ragged_block_causal(name, seq_lens, n_head, n_head_kv, dk, kv_type, kernel, rng):
    n = sum(seq_lens)
    mask = _block_causal_mask(seq_lens, pad_rows=3)
    q, k, v, s = _inputs(rng, 1, n_head, n_head_kv, n, n, dk, dk, kv_type, sinks=True)
    ref = flash_attn_ext(q, k, v, mask, 0.125, 0.0, 0.0, s, kv_type=kv_type)
    out = _run_device(q, k, v, mask, s, 0.125, 0.0, 0.0, kernel)
    _check(out, ref, f"{name} {kernel}")


@pytest.mark.parametrize("kernel", GPU_KERNELS)
@pytest.mark.parametrize("n_kv", [1, 113, 1000, 4097])
@pytest.mark.parametrize("n_batch", [1, 5, 64, 130])
def test_holes_and_fully_masked(kernel, n_kv, n_batch, rng):
    """Interior -inf holes (whole KV tiles and partial), fully masked rows and query tiles,
    cells of -inf only in the tail; sinks on so fully masked rows must still give zeros."""
    n_head, n_head_kv, d = 8, 2, 64
    q, k, v, s = _inputs(rng, 2, n_head, n_head_kv, n_batch, n_kv, d, d, GGML_TYPE_F16, sinks=True)
    m = rng.uniform(-1, 1, (2, 1, n_batch, n_kv)).astype(np.float32)
    m[:, :, :, 64:256] = -np.inf                         # interior hole spanning whole tiles
    m[:, :, :, n_kv // 2: n_kv // 2 + 7] = -np.inf       # partial hole
    m[:, :, ::3, :] = -np.inf                            # fully masked rows
    if n_batch > 64:
        m[0, :, 0:64, :] = -np.inf                       # a fully masked query tile
    m[1, :, :, max(0, n_kv - 70):] = -np.inf             # masked tail
    mask = m.astype(np.float16)
    ref = flash_attn_ext(q, k, v, mask, 0.1, 0.0, 0.0, s, kv_type=GGML_TYPE_F16)
    out = _run_device(q, k, v, mask, s, 0.1, 0.0, 0.0, kernel)
    _check(out, ref, f"holes {kernel} n_kv={n_kv} n_batch={n_batch}")
    assert np.all(out[:, ::3] == 0.0), "fully masked rows must be exactly zero"


@pytest.mark.parametrize("kernel", GPU_KERNELS)
@pytest.mark.parametrize("n_batch,n_kv", [(3, 1000), (3, 1024), (300, 1000)])
@pytest.mark.parametrize("ext", [False, True], ids=["plain", "softcap-alibi"])
def test_finite_mask_tiles(kernel, n_batch, n_kv, ext, rng, monkeypatch):
    """With the plan marking FINITE tiles (cuda_launch.FINITE_MASK_TILES):
    - a bias mask of values in [-10, -6] (no -inf: every MASKED tile FINITE, added with no
      select); the scores are so low that cells past n_kv scored 0 instead of -inf would
      outweigh the real ones, so the n_kv tail (its mask tile reads -inf past n_kv) is checked;
    - test-backend-ops' random mask (-inf blocks among finite values), and a bias mask with a
      block of -60000 (finite, but too large to start the accumulators from: not FINITE): the
      scan's classes equal a numpy recount (aligned rows: the scan's 16-byte path);
    - a mask hiding a block of cells from the even rows only, NaN in K there: those tiles are
      not FINITE and their -inf select must keep the NaN from the even rows.
    With softcap and ALiBi and without."""
    monkeypatch.setattr(cuda_launch, "FINITE_MASK_TILES", True)
    max_bias, softcap = (8.0, 30.0) if ext else (0.0, 0.0)
    q, k, v, s = _inputs(rng, 1, 16, 4, n_batch, n_kv, 128, 128, GGML_TYPE_F16, sinks=True)
    bias = rng.uniform(-10, -6, (1, 1, n_batch, n_kv)).astype(np.float16)
    rand = conf.random_kq_mask(rng, (1, 1, n_batch, n_kv))
    big = rng.uniform(-1, 1, (1, 1, n_batch, n_kv)).astype(np.float16)
    big[0, 0, :, 100:180] = -60000.0
    for name, mask in (("bias", bias), ("random", rand), ("big", big)):
        dm = _dev(mask)
        classes = cb.make_plan(from_array(dm), n_batch, 16, 4, head_dim_k=128, kv_type=GGML_TYPE_F16,
                               kernel="prefill").tile_classes(64)
        assert classes == _tile_classes_numpy(mask[0, 0], 64, n_batch, True), (name, classes)
        if name == "bias":
            assert classes["FINITE"] == classes["MASKED"] > 0, classes
        if name == "big":
            assert 0 < classes["FINITE"] < classes["MASKED"], classes
        ref = flash_attn_ext(q, k, v, mask, 0.1, max_bias, softcap, s, kv_type=GGML_TYPE_F16)
        out = _run_device(q, k, v, mask, s, 0.1, max_bias, softcap, kernel)
        _check(out, ref, f"{kernel} {name} mask, FINITE tiles marked, n_kv={n_kv} ext={ext}")
    holes = rng.uniform(-1, 1, (1, 1, n_batch, n_kv)).astype(np.float16)
    holes[0, 0, ::2, 64:200] = -np.inf
    kd = k.copy()
    kd[0, :, 64:200:7, 5] = np.float16(np.nan)
    ref = flash_attn_ext(q, k, v, holes, 0.1, max_bias, softcap, s, kv_type=GGML_TYPE_F16)
    out = _run_device(q, kd, v, holes, s, 0.1, max_bias, softcap, kernel)
    _check(out[:, ::2], ref[:, ::2], f"{kernel} NaN K under -inf cells, FINITE tiles marked, ext={ext}")


@pytest.mark.parametrize("kernel", GPU_KERNELS)
@pytest.mark.parametrize("n_splits", [1, 2, 3, 7, 8, 9, 16])   # fattn_combine: batches of 8 + rest
@pytest.mark.parametrize("fused", [True, False])
def test_forced_splits(kernel, n_splits, fused, rng, monkeypatch):
    """Split-KV, finished by the kernel's last block of each row group (fused) or by the
    fattn_combine launch."""
    monkeypatch.setattr(cuda_launch, "FUSED_SPLIT_FINISH", fused)
    q, k, v, s = _inputs(rng, 1, 16, 4, 3, 1000, 128, 128, GGML_TYPE_BF16, sinks=True)
    mask = conf.random_kq_mask(rng, (1, 1, 3, 1000))
    ref = flash_attn_ext(q, k, v, mask, 0.09, 8.0, 0.0, s, kv_type=GGML_TYPE_BF16)
    out = _run_device(q, k, v, mask, s, 0.09, 8.0, 0.0, kernel, n_splits=n_splits)
    _check(out, ref, f"{kernel} splits={n_splits} fused={fused}")


@pytest.mark.parametrize("kernel", GPU_KERNELS)
@pytest.mark.parametrize("fused", [True, False])
def test_split_of_masked_cells_ignores_stale_partials(kernel, fused, rng, monkeypatch):
    """A split whose cells are all masked weighs 0 in the merge; whatever its slot of the
    workspace holds (NaN partials of the previous call on the stream, left by a NaN Q) never
    reaches the output."""
    monkeypatch.setattr(cuda_launch, "FUSED_SPLIT_FINISH", fused)
    q, k, v, _ = _inputs(rng, 1, 16, 4, 3, 1024, 128, 128, GGML_TYPE_F16)
    zero = np.zeros((1, 1, 3, 1024), np.float16)
    bad = _run_device(np.full_like(q, np.nan), k, v, zero, None, 0.1, 0.0, 0.0, kernel, n_splits=16)
    assert np.isnan(bad).all()
    mask = zero.copy()
    mask[..., 512:] = -np.inf   # half the cells hidden: with live-tile lists, some splits get none
    ref = flash_attn_ext(q, k, v, mask, 0.1, 0.0, 0.0, None, kv_type=GGML_TYPE_F16)
    out = _run_device(q, k, v, mask, None, 0.1, 0.0, 0.0, kernel, n_splits=16)
    _check(out, ref, f"{kernel} stale partials fused={fused}")


@pytest.mark.parametrize("n_splits", [3, 8, 9, 16, 17])
@pytest.mark.parametrize("sink", [False, True])
def test_combine_skips_weightless_splits(n_splits, sink, rng):
    """fattn_combine on a hand-made workspace: splits whose max is -inf (no visible cell) hold
    NaN partial outputs, as a stale or a 0 * NaN slot would; they must add exactly nothing, in
    the batches of FATTN_SPLIT_BATCH loads and in the remainder. Expected: the float64 merge of
    the other splits."""
    from ggml_attn import kernels as K
    cp = _cupy()
    n_head, n_batch, head_dim_v = 4, 3, 136
    n_rows = n_batch * n_head
    m = rng.uniform(-4, 4, (n_splits, n_rows)).astype(np.float32)
    lsum = rng.uniform(0.5, 30, (n_splits, n_rows)).astype(np.float32)
    o = rng.uniform(-1, 1, (n_splits, n_rows, head_dim_v)).astype(np.float32)
    dead = rng.random((n_splits, n_rows)) < 0.4
    dead[:, 0] = True           # row 0: every split dead -> zeros (no sink) / 0 (sink only)
    dead[n_splits - 1, 1] = True   # the remainder loop's last split
    dead[0, 2] = True           # the first batch's first split
    m[dead], lsum[dead] = -np.inf, 0.0
    o[dead] = np.nan
    sinks = rng.uniform(-2, 2, n_head).astype(np.float32) if sink else None
    ml = np.stack([m, lsum], axis=-1)
    d_ml, d_o = cp.asarray(ml), cp.asarray(o)
    d_dst = cp.full((n_rows, head_dim_v), cp.nan, dtype=cp.float32)
    d_sk = cp.asarray(sinks) if sink else None
    p = K.FattnParams()
    p.ws_ml, p.ws_o, p.dst = d_ml.data.ptr, d_o.data.ptr, d_dst.data.ptr
    p.sinks = d_sk.data.ptr if sink else 0
    p.ne3, p.n_batch, p.n_head, p.n_splits, p.head_dim_v = 1, n_batch, n_head, n_splits, head_dim_v
    fn = K.get_function(K.util_variant(), "fattn_combine")
    fn.launch((n_rows, 1, 1), (128, 1, 1), cp.cuda.get_current_stream().ptr, p)
    cp.cuda.get_current_stream().synchronize()
    got = d_dst.get()
    # float64 merge of the live splits; the maxima are in the log2 domain
    m64 = np.where(dead, -np.inf, m.astype(np.float64))
    sk = (np.log2(np.e) * sinks[np.arange(n_rows) % n_head]) if sink else np.full(n_rows, -np.inf)
    big = np.maximum(m64.max(axis=0), sk)
    with np.errstate(invalid="ignore"):
        f = np.where(dead, 0.0, np.exp2(m64 - big))
        total = (f * np.where(dead, 0.0, lsum)).sum(axis=0) + np.where(np.isfinite(big), np.exp2(sk - big), 0.0)
        num = np.einsum("zr,zrc->rc", f, np.where(dead[..., None], 0.0, o.astype(np.float64)))
        want = np.where(total[:, None] > 0, num / np.where(total > 0, total, 1.0)[:, None], 0.0)
    assert np.isfinite(got).all(), "a weightless split's NaN reached the output"
    assert np.allclose(got, want, rtol=2e-5, atol=2e-6), np.abs(got - want).max()


@pytest.mark.parametrize("kernel", GPU_KERNELS)
def test_fused_split_counters_reset_between_launches(kernel, rng, monkeypatch):
    """Back-to-back split launches on one stream share the counters (fused split finish): each
    must leave them at 0 (else the next launch's last block is miscounted and rows stay
    unwritten)."""
    monkeypatch.setattr(cuda_launch, "FUSED_SPLIT_FINISH", True)
    cases = []
    for n_splits in (5, 3, 5, 8, 2):
        q, k, v, s = _inputs(rng, 2, 8, 2, 2, 700, 128, 128, GGML_TYPE_F16, sinks=True)
        ref = flash_attn_ext(q, k, v, None, 0.1, 0.0, 0.0, s, kv_type=GGML_TYPE_F16)
        cases.append((ref, _run_device(q, k, v, None, s, 0.1, 0.0, 0.0, kernel, n_splits=n_splits)))
    for i, (ref, out) in enumerate(cases):
        _check(out, ref, f"{kernel} launch {i}")


@pytest.mark.parametrize("kernel", GPU_KERNELS)
def test_mask_broadcast_heads_and_streams(kernel, rng):
    """mask ne32 = 2 (per-head planes), ne33 = 1 broadcast over ne3 = 3 streams; softcap."""
    q, k, v, s = _inputs(rng, 3, 8, 8, 2, 300, 64, 64, GGML_TYPE_F16)
    mask = conf.random_kq_mask(rng, (1, 2, 4, 300))
    mask[0, 1, :, 100:200] = -np.inf
    ref = flash_attn_ext(q, k, v, mask, 0.125, 0.0, 10.0, None, kv_type=GGML_TYPE_F16)
    out = _run_device(q, k, v, mask, None, 0.125, 0.0, 10.0, kernel)
    _check(out, ref, f"broadcast {kernel}")


def test_plan_live_counts_and_reuse(rng):
    """The plan's live-tile counts equal a numpy recount; a plan is reused across calls."""
    seq = [100, 30, 200, 7, 64]
    mask = _block_causal_mask(seq)
    n = sum(seq)
    cp = _cupy()
    dm = cp.asarray(mask)
    plan = cb.make_plan(from_array(dm), n, 8, 2, head_dim_k=128, kv_type=GGML_TYPE_F16, kernel="prefill")
    tq = 64 // 1
    counts = plan.live_counts(tq)
    m = mask[0, 0]
    n_kv_tiles = -(-n // 64)
    for qt in range(-(-n // tq)):
        rows = m[qt * tq: min(n, (qt + 1) * tq)]
        want = sum(np.isfinite(rows[:, j * 64:(j + 1) * 64]).any() for j in range(n_kv_tiles))
        assert counts[0, qt] == want
    assert counts.sum() < (-(-n // tq)) * n_kv_tiles, "block-diagonal mask must skip interior tiles"
    q, k, v, s = _inputs(rng, 1, 8, 2, n, n, 128, 128, GGML_TYPE_F16)
    ref = flash_attn_ext(q, k, v, mask, 0.1, 0.0, 0.0, None, kv_type=GGML_TYPE_F16)
    for _ in range(2):
        out = _run_device(q, k, v, mask, None, 0.1, 0.0, 0.0, "prefill", plan=None)
        _check(out, ref, "plan reuse")
    with pytest.raises(ValueError):
        _run_device(q[:, :, :5], k, v, mask[:, :, :5], None, 0.1, 0.0, 0.0, "prefill", plan=plan)


def _tile_classes_numpy(mask2d, tq, n_batch, finite=False):
    """FULL / PARTIAL / MASKED counts of a [n_rows, n_kv] f16 mask, numpy order (the plan's rule),
    HIDDEN: PARTIAL or MASKED tiles with a column < n_kv that no row of the query tile sees, and
    FINITE (only when the plan marks them, ``finite``): MASKED tiles whose cells < n_kv are all
    finite and below 256 in magnitude."""
    n_kv = mask2d.shape[1]
    bits = mask2d.view(np.uint16)
    neg_inf, zero = bits == 0xFC00, (bits & 0x7FFF) == 0
    fin = ~neg_inf
    interval = []
    for t in range(n_batch):
        idx = np.flatnonzero(fin[t])
        interval.append(idx.size == 0 or (zero[t, idx].all() and idx[-1] - idx[0] + 1 == idx.size))
    out = {"FULL": 0, "PARTIAL": 0, "MASKED": 0, "HIDDEN": 0, "FINITE": 0}
    for qt in range(-(-n_batch // tq)):
        r = slice(qt * tq, min(n_batch, (qt + 1) * tq))
        for kt in range(-(-n_kv // 64)):
            c = slice(kt * 64, min(n_kv, (kt + 1) * 64))
            if not fin[r, c].any():
                continue
            if zero[r, c].all() and c.stop - c.start == 64:
                out["FULL"] += 1
                continue
            elif all(interval[r]):
                out["PARTIAL"] += 1
            else:
                out["MASKED"] += 1
                out["FINITE"] += int(finite and ((bits[r, c] & 0x7FFF) < 0x5C00).all())
            out["HIDDEN"] += int(not fin[r, c].any(axis=0).all())
    return out


@pytest.mark.parametrize("finite", [False, True])
def test_plan_tile_classes(finite, rng, monkeypatch):
    """The plan's tile classes equal a numpy recount: block-causal rows are intervals (PARTIAL
    tiles compare indices), a block of rows with random values makes its tiles MASKED (FINITE
    where no cell of the tile is -inf, when the plan marks them), and the n_kv tail tile is
    never FULL."""
    monkeypatch.setattr(cuda_launch, "FINITE_MASK_TILES", finite)
    seq = [100, 30, 200, 7, 64]
    n = sum(seq)
    n_kv = n + 13
    mask = _block_causal_mask(seq)[0, 0]
    mask = np.concatenate([mask, np.full((n, n_kv - n), -np.inf, np.float16)], axis=1)
    mask[130:140, 130:140] = rng.uniform(-1, 1, (10, 10)).astype(np.float16)   # not intervals
    mask[300:302, :] = 0.0                                                     # see the tail
    mask[0:64, 0:192] = rng.uniform(-1, 1, (64, 192)).astype(np.float16)       # FINITE tiles
    mask[64:128, 384:] = rng.uniform(-1, 1, (64, n_kv - 384)).astype(np.float16)  # a finite tail tile
    cp = _cupy()
    dm = cp.asarray(np.ascontiguousarray(mask[None, None]))
    plan = cb.make_plan(from_array(dm), n, 8, 2, head_dim_k=128, kv_type=GGML_TYPE_F16, kernel="prefill")
    for tq in (16, 64, 128):
        got = plan.tile_classes(tq)
        assert got == _tile_classes_numpy(mask, tq, n, finite), tq
    assert plan.tile_classes(64)["MASKED"] > 0 and plan.tile_classes(64)["PARTIAL"] > 0
    assert (plan.tile_classes(64)["FINITE"] > 0) == finite
    q, k, v, s = _inputs(rng, 1, 8, 2, n, n_kv, 128, 128, GGML_TYPE_F16, sinks=True)
    ref = flash_attn_ext(q, k, v, mask[None, None], 0.1, 0.0, 0.0, s, kv_type=GGML_TYPE_F16)
    for kern in _kernels_taking(n):
        _check(_run_device(q, k, v, mask[None, None], s, 0.1, 0.0, 0.0, kern), ref, f"classes {kern}")


@pytest.mark.parametrize("kv_type", [GGML_TYPE_F16, GGML_TYPE_BF16])
@pytest.mark.parametrize("seq,want_wide", [
    ([16, 200, 33, 1, 77, 128, 5, 64, 65, 190, 17, 40, 100, 3, 150, 9], False),   # short prompts
    ([1500, 600], True),                                                          # long causal
])
def test_plan_chosen_tiles(seq, want_wide, kv_type, rng):
    """make_plan picks the prefill tile height from the live tiles (ragged batches of short
    prompts: 64-row tiles with GQA heads packed; long prompts: 128-row tiles), and the call
    that uses the plan is right either way."""
    cp = _cupy()
    n = sum(seq)
    mask = _block_causal_mask(seq, pad_rows=5)
    q, k, v, s = _inputs(rng, 1, 16, 4, n, n, 128, 128, kv_type, sinks=True)
    ref = flash_attn_ext(q, k, v, mask, 0.1, 0.0, 0.0, s, kv_type=kv_type)
    dq, dk_, dv_, dm, ds = (cp.asarray(np.ascontiguousarray(x)) for x in (q, k, v, mask, s))
    md = from_array(dm)
    plan = cb.make_plan(md, n, 16, 4, head_dim_k=128, kv_type=kv_type, kernel="prefill")
    assert plan.wide is want_wide
    cfg = cb.launch_config("prefill", cb.AttnDims(128, 128, n, 16, 4, 1, n, kv_type), wide=plan.wide)
    assert (cfg.q_tile_tokens, cfg.pack) == ((128, 1) if want_wide else (64 // cuda_launch.PREFILL_PACK, cuda_launch.PREFILL_PACK))
    for kern in ("prefill", "auto"):
        out = _launch(dq, dk_, dv_, md, ds, n, 16, 128, 1, kern, kv_type, plan=plan)
        cp.cuda.get_current_stream().synchronize()
        _check(out.get(), ref, f"plan-chosen tiles {kern} wide={want_wide}")


@pytest.mark.parametrize("kernel", GPU_KERNELS)
@pytest.mark.parametrize("mask_kind", ["block_causal", "random"])
def test_garbage_in_masked_cells(kernel, mask_kind, rng):
    """NaN / inf in K at cells the mask hides (-inf) for a row change nothing for that row;
    NaN / inf in V at cells hidden from every row of a 64-cell tile (uninitialised cache
    cells: a dead tile, the cells past the last sequence) change nothing either. Expected:
    the reference on the same inputs with those cells zeroed."""
    seq = [90, 40, 130]
    n = sum(seq)
    n_kv = 448   # 7 tiles; cells n..447 belong to no sequence
    mask = _block_causal_mask(seq)[0, 0]
    mask = np.concatenate([mask, np.full((n, n_kv - n), -np.inf, np.float16)], axis=1)
    if mask_kind == "random":   # MASKED tiles: the mask tile is loaded and added
        vis = np.isfinite(mask)
        mask[vis] = rng.uniform(-1, 1, vis.sum()).astype(np.float16)
    q, k, v, s = _inputs(rng, 1, 8, 2, n, n_kv, 64, 64, GGML_TYPE_F16, sinks=True)
    ref = flash_attn_ext(q, k, v, mask[None, None], 0.1, 0.0, 0.0, s, kv_type=GGML_TYPE_F16)
    kd, vd = k.copy(), v.copy()
    nan, inf = np.float16(np.nan), np.float16(np.inf)
    kd[0, :, 10, 3] = nan            # row 10 of seq 0 is visible to rows >= 10 of seq 0 only
    kd[0, :, 95, :] = inf            # a cell of seq 1 (hidden from seq 0 and seq 2)
    kd[0, :, n + 5, :] = nan         # no sequence's cell
    ref_k = flash_attn_ext(q, np.where(np.isfinite(kd), kd, 0).astype(np.float16), v, mask[None, None],
                           0.1, 0.0, 0.0, s, kv_type=GGML_TYPE_F16)
    # K: the rows that see a poisoned cell are NaN in ggml too; compare the others
    seen = np.zeros(n, bool)
    for c in (10, 95, n + 5):
        seen |= np.isfinite(mask[:, c])
    out = _run_device(q, kd, v, mask[None, None], s, 0.1, 0.0, 0.0, kernel)
    _check(out[:, ~seen], ref_k[:, ~seen], f"K garbage {kernel} {mask_kind}")
    vd[0, :, 400:, :] = nan          # a dead tile (384..447) and the cells past the sequences
    vd[0, :, n:n + 3, 0] = inf       # cells of the last live tile hidden from every row
    out = _run_device(q, k, vd, mask[None, None], s, 0.1, 0.0, 0.0, kernel)
    _check(out, ref, f"V garbage in unowned cells {kernel} {mask_kind}")


# ---------------------------------------------------------------------------------------
# hidden-column bitmaps of the plan: V rows of cells no row of a block sees are zero-filled
def _gapped_layout(seq_lens, gap, n_tail):
    """Cells of a unified KV cache with ``gap`` unowned cells after each sequence and
    ``n_tail`` past the last: (cell of each token, sequence id of each token, n_kv)."""
    pos, sid, c = [], [], 0
    for i, L in enumerate(seq_lens):
        pos += range(c, c + L)
        sid += [i] * L
        c += L + gap
    return np.array(pos), np.array(sid), c + n_tail


def _gapped_mask(pos, sid, n_kv):
    """Token t sees the cells of its own sequence up to its own cell (f32 [n_batch, n_kv])."""
    m = np.full((len(pos), n_kv), -np.inf, dtype=np.float32)
    for t in range(len(pos)):
        own = pos[(sid == sid[t]) & (pos <= pos[t])]
        m[t, own] = 0.0
    return m


def _hidden_columns_numpy(mask, tq, n_batch):
    """The plan's HIDDEN tiles and words (Plan.hidden_columns) recounted from an f16 mask
    [ne33, ne32, n_rows, n_kv] (numpy order)."""
    ne33, ne32, _, n_kv = mask.shape
    bits = mask.view(np.uint16)
    vis, zero = bits != 0xFC00, (bits & 0x7FFF) == 0
    out = {}
    for i33 in range(ne33):
        for qt in range(-(-n_batch // tq)):
            r = slice(qt * tq, min(n_batch, (qt + 1) * tq))
            for kt in range(-(-n_kv // 64)):
                c0, c1 = kt * 64, min(n_kv, kt * 64 + 64)
                if not vis[i33, :, r, c0:c1].any():
                    continue                                  # dead
                if zero[i33, :, r, c0:c1].all() and c1 - c0 == 64:
                    continue                                  # FULL
                words, hidden = [], False
                for pl in range(ne32):
                    seen = vis[i33, pl, r, c0:c1].any(axis=0)
                    w = 0
                    for c in range(64):
                        if c >= c1 - c0 or not seen[c]:
                            w |= 1 << c
                    hidden |= (w & ((1 << (c1 - c0)) - 1)) != 0
                    words.append(w)
                if hidden:
                    out[(i33, qt, kt)] = words
    return out


def test_plan_hidden_columns(rng):
    """The plan's hidden-column words equal a numpy recount for every tile size a kernel
    uses: ragged sequences with unowned cells between them, two head planes with different
    sequences, two stream planes, a block of random (MASKED) rows, n_kv not a multiple of 64."""
    cp = _cupy()
    pos, sid, n_kv = _gapped_layout([37, 5, 90, 1, 64, 20], gap=3, n_tail=21)
    n = len(pos)
    m0 = _gapped_mask(pos, sid, n_kv)
    sid1 = np.repeat(np.arange(4), [60, 60, 60, n - 180])   # plane 1: other sequence bounds
    m1 = _gapped_mask(pos, sid1, n_kv)
    m1[100:110] = np.where(np.isfinite(m1[100:110]), rng.uniform(-1, 1, (10, n_kv)), -np.inf)
    mask = np.stack([np.stack([m0, m1]), np.stack([m1, m0])]).astype(np.float16)   # [2, 2, n, n_kv]
    dm = cp.asarray(mask)
    plan = cb.make_plan(from_array(dm), n, 8, 2, head_dim_k=128, kv_type=GGML_TYPE_F16, kernel="prefill")
    for tq in (1, 4, 16, 64, 128):
        want = _hidden_columns_numpy(mask, tq, n)
        assert want, tq
        assert plan.hidden_columns(tq) == want, tq
        assert plan.tile_classes(tq)["HIDDEN"] == len(want)


def _layout_cfg(kernel, n_batch, plan):
    """(query tile tokens, packed heads) of the launch the test's call makes (n_head 8, kv 2)."""
    with _Kernel(kernel) as kern:
        sh = cb.AttnDims(128, 128, n_batch, 8, 2, 1, 1, GGML_TYPE_F16)
        cfg = cb.launch_config(kern, sh, wide=plan.wide if plan is not None else None)
    return cfg.q_tile_tokens, cfg.pack


# layouts: 64-row tiles with 4 heads packed (the plan's verdict on short ragged prompts),
# 64-row unpacked (128-row tiles switched off), 128-row (FA2 order), decode-tc (packed heads,
# 16 rows), the CUDA-core kernel
HIDDEN_LAYOUTS = [("prefill", True), ("prefill-narrow", False), ("prefill-wide", False),
                  ("decode-tc", False), ("decode", False)]


@pytest.mark.parametrize("ne32", [1, 2])
@pytest.mark.parametrize("kernel,use_plan", HIDDEN_LAYOUTS, ids=[f"{k}{'-plan' if u else ''}" for k, u in HIDDEN_LAYOUTS])
def test_nan_v_in_hidden_cells(kernel, use_plan, ne32, rng, monkeypatch):
    """NaN in K and V at every unowned cell (between sequences, past the last) and at the last
    cell of three sequences (in plane 0 seen by one row only; with ne32 = 2, plane 1 merges
    pairs of sequences, so the last cell of sequence 0 is seen by every plane-1 row of
    sequence 1): every row of a block that sees none of them must be right, whatever the block
    layout (tokens x packed heads x mask head planes). A hidden-column set computed over more
    rows than a block holds (a larger query tile, all head planes) leaves a poisoned V row in
    place and NaN reaches that block's rows (0 * NaN); one over fewer rows zeroes V rows some
    row sees (wrong values)."""
    cp = _cupy()
    pos, sid, n_kv = _gapped_layout([16, 200, 33, 1, 77, 5, 64, 65, 17, 40, 3, 9], gap=5, n_tail=30)
    n = len(pos)
    planes = [_gapped_mask(pos, sid, n_kv)]
    if ne32 == 2:   # plane 1: the same cells, sequences 2i and 2i+1 merged
        planes.append(_gapped_mask(pos, sid // 2, n_kv))
    mask = np.stack(planes)[None].astype(np.float16)            # [1, ne32, n, n_kv]
    q, k, v, s = _inputs(rng, 1, 8, 2, n, n_kv, 128, 128, GGML_TYPE_F16, sinks=True)
    owned = np.zeros(n_kv, bool)
    owned[pos] = True
    last = [pos[np.flatnonzero(sid == i)[-1]] for i in (0, 1, 4)]
    poison = np.flatnonzero(~owned).tolist() + last
    k[:, :, poison, 5] = np.float16(np.nan)
    v[:, :, poison, :] = np.float16(np.nan)
    v[:, :, poison[::2], 1] = np.float16(np.inf)
    ref = flash_attn_ext(q, k, v, mask, 0.1, 0.0, 0.0, s, kv_type=GGML_TYPE_F16)
    if kernel == "prefill-narrow":   # 64-row tiles, one head per tile
        kernel = "prefill"
        monkeypatch.setattr(cuda_launch, "PREFILL_WIDE_MIN_BATCH", 1 << 30)
        monkeypatch.setattr(cb, "_PREPARED", {})
    dm = cp.asarray(mask)
    plan = None
    if use_plan:
        plan = cb.make_plan(from_array(dm), n, 8, 2, head_dim_k=128, kv_type=GGML_TYPE_F16,
                            kernel=_Kernel(kernel).name)
        assert plan.wide is False
    tq, pack = _layout_cfg(kernel, n, plan)
    want = {("prefill", True): (64 // cuda_launch.PREFILL_PACK, cuda_launch.PREFILL_PACK), ("prefill", False): (64, 1),
            ("prefill-wide", False): (128, 1), ("decode-tc", False): (4, 4)}.get((kernel, use_plan))
    assert want is None or (tq, pack) == want, (kernel, tq, pack)
    # device arrays held in locals until the result is read: a TensorDesc is a raw pointer, and
    # an array dropped after from_array() goes back to CuPy's pool (test_q_view_at_4_byte_offset)
    dq, dk_, dv_, ds = cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(s)
    with _Kernel(kernel) as kern:
        dst = cp.full((1, n, 8, 128), cp.nan, dtype=cp.float32)
        cb.flash_attn_ext_device(from_array(dq), from_array(dk_, GGML_TYPE_F16), from_array(dv_, GGML_TYPE_F16),
                                 from_array(dm), from_array(ds), from_array(dst), 0.1, 0.0, 0.0,
                                 kernel=kern, plan=plan)
        out = dst.get()
    # the rows of every block (query tile x head group) whose rows see no poisoned cell
    bad_cells = np.zeros(n_kv, bool)
    bad_cells[poison] = True
    sees = np.isfinite(mask[0])[:, :, bad_cells].any(axis=-1)   # [ne32, n]
    ok = np.ones((n, 8), bool)
    for qt in range(-(-n // tq)):
        r = slice(qt * tq, min(n, (qt + 1) * tq))
        for hg in range(8 // pack):
            heads = range(hg * pack, hg * pack + pack)
            if any(sees[h % ne32, r].any() for h in heads):
                ok[r, hg * pack:(hg + 1) * pack] = False
    assert ok.mean() > 0.2, "too few rows checked for the test to mean anything"
    o, rf = out[0][ok], ref[0][ok]
    _check(o, rf, f"NaN V in hidden cells {kernel} plan={use_plan} ne32={ne32}")


def test_host_entry_ragged(rng):
    seq = [50, 20, 90]
    mask = _block_causal_mask(seq)
    q, k, v, s = _inputs(rng, 1, 4, 1, sum(seq), sum(seq), 128, 128, GGML_TYPE_F16, sinks=True)
    ref = flash_attn_ext(q, k, v, mask, 0.1, 0.0, 0.0, s, kv_type=GGML_TYPE_F16)
    for kern in GPU_KERNELS + ("auto",):
        _check(_run_host(q, k, v, mask, s, 0.1, 0.0, 0.0, kern), ref, f"host {kern}")


def test_errors(rng):
    q, k, v, s = _inputs(rng, 1, 4, 1, 3, 64, 128, 128, GGML_TYPE_F16)
    with pytest.raises(ValueError):
        _run_device(q, k, v, None, None, 0.1, 0.0, 0.0, "nonsense")
    q, k, v, s = _inputs(rng, 1, 4, 1, 3, 64, 576, 512, GGML_TYPE_F16)
    with pytest.raises(ValueError):
        _run_device(q, k, v, None, None, 0.1, 0.0, 0.0, "prefill")
    q, k, v, s = _inputs(rng, 1, 4, 1, 3, 64, 32, 32, GGML_TYPE_F16)   # D=32: not compiled
    with pytest.warns(RuntimeWarning, match="not compiled"):
        out = _run_device(q, k, v, None, None, 0.1, 0.0, 0.0, "auto")
    _check(out, flash_attn_ext(q, k, v, None, 0.1, kv_type=GGML_TYPE_F16), "fallback D=32")


# ---------------------------------------------------------------------------------------
# paths the cases above do not reach
def _launch(q_d, k_d, v_d, mask_desc, sinks_d, n_batch, n_head, head_dim_v, ne3, kernel, kv_type, *,
            plan=None, stream=None, n_splits=None):
    """flash_attn_ext_device on CuPy arrays / a ready mask TensorDesc; dst NaN-poisoned."""
    cp = _cupy()
    _skip_cells_if_large(kernel, n_batch)
    if isinstance(stream, cp.cuda.Stream):
        with stream:
            dst = cp.full((ne3, n_batch, n_head, head_dim_v), cp.nan, dtype=cp.float32)
    else:
        dst = cp.full((ne3, n_batch, n_head, head_dim_v), cp.nan, dtype=cp.float32)
    with _Kernel(kernel) as kern:
        cb.flash_attn_ext_device(from_array(q_d), from_array(k_d, kv_type), from_array(v_d, kv_type),
                                 mask_desc, from_array(sinks_d) if sinks_d is not None else None,
                                 from_array(dst), 0.1, 0.0, 0.0, kernel=kern, plan=plan,
                                 stream=stream, n_splits=n_splits)
    return dst


@pytest.mark.parametrize("kernel", GPU_KERNELS)
def test_q_view_at_4_byte_offset(kernel, rng):
    """Q at a pointer that is 4 mod 16 (copied to an aligned buffer by the backend), repeated
    on fresh inputs. Every device array lives until the result is read: a TensorDesc holds a
    raw pointer, so an array dropped after from_array() goes back to CuPy's pool and the
    plan's own small buffers can be carved out of it before the kernels read it -- the
    intermittent failure this test showed on the H200 until 2026-11-30."""
    cp = _cupy()
    for rep in range(20):
        q, k, v, s = _inputs(rng, 1, 8, 2, 5, 200, 128, 128, GGML_TYPE_F16, sinks=True)
        mask = conf.random_kq_mask(rng, (1, 1, 5, 200))
        buf = cp.zeros(q.size + 1, dtype=cp.float32)
        dq = buf[1:].reshape(q.shape)
        dq[...] = cp.asarray(q)
        assert dq.data.ptr % 16 == 4
        ref = flash_attn_ext(q, k, v, mask, 0.1, 0.0, 0.0, s, kv_type=GGML_TYPE_F16)
        dk_, dv_, dm, ds = _dev(k), _dev(v), _dev(mask), _dev(s)
        out = _launch(dq, dk_, dv_, from_array(dm), ds, 5, 8, 128, 1, kernel, GGML_TYPE_F16)
        cp.cuda.get_current_stream().synchronize()
        _check(out.get(), ref, f"q offset 4 {kernel} repetition {rep}")


@pytest.mark.parametrize("kernel", GPU_KERNELS)
@pytest.mark.parametrize("n_batch", [1, 3, 40])
def test_mask_head_planes_gqa4_smem(kernel, n_batch, rng):
    """mask ne32 = 2 with gqa = 4 at n_kv = 512 (rows 16-byte aligned: the shared-memory mask
    path, packed heads of one tile reading different mask planes)."""
    q, k, v, s = _inputs(rng, 1, 8, 2, n_batch, 512, 64, 64, GGML_TYPE_F16)
    mask = conf.random_kq_mask(rng, (1, 2, n_batch, 512))
    mask[0, 0, :, 64:192] = -np.inf
    mask[0, 1, :, 256:448] = -np.inf
    ref = flash_attn_ext(q, k, v, mask, 0.1, 0.0, 0.0, None, kv_type=GGML_TYPE_F16)
    out = _run_device(q, k, v, mask, None, 0.1, 0.0, 0.0, kernel)
    _check(out, ref, f"ne32=2 gqa=4 {kernel} n_batch={n_batch}")


@pytest.mark.parametrize("kernel", GPU_KERNELS)
def test_ne3_4_mask_ne33_2(kernel, rng):
    """ne3 = 4 streams over a mask with ne33 = 2 planes (stream s reads plane s % 2)."""
    q, k, v, s = _inputs(rng, 4, 8, 2, 6, 300, 128, 128, GGML_TYPE_BF16, sinks=True)
    mask = conf.random_kq_mask(rng, (2, 1, 6, 300))
    mask[1, :, :, :128] = -np.inf
    ref = flash_attn_ext(q, k, v, mask, 0.1, 0.0, 0.0, s, kv_type=GGML_TYPE_BF16)
    out = _run_device(q, k, v, mask, s, 0.1, 0.0, 0.0, kernel)
    _check(out, ref, f"ne3=4 ne33=2 {kernel}")


@pytest.mark.parametrize("kernel", GPU_KERNELS)
@pytest.mark.parametrize("n_batch", [1, 20])
def test_padded_mask_rows(kernel, n_batch, rng):
    """Mask rows padded to 2*align16(n_kv) bytes with n_kv = 113 (a view of a wider mask, NaN
    in the padding): rows are 16-byte aligned, so the shared-memory path loads the last,
    partial 8-column chunk of each row."""
    cp = _cupy()
    n_kv, width = 113, 128
    q, k, v, s = _inputs(rng, 1, 8, 2, n_batch, n_kv, 64, 64, GGML_TYPE_F16, sinks=True)
    mask = conf.random_kq_mask(rng, (1, 1, n_batch, n_kv))
    wide = cp.full((1, 1, n_batch, width), cp.nan, dtype=cp.float16)
    wide[..., :n_kv] = cp.asarray(mask)
    md = from_array(wide[..., :n_kv])
    assert md.ne[0] == n_kv and (n_batch == 1 or md.nb[1] == 2 * width)  # a 1-row dim's stride is moot
    ref = flash_attn_ext(q, k, v, mask, 0.1, 0.0, 0.0, s, kv_type=GGML_TYPE_F16)
    out = _launch(_dev(q), _dev(k), _dev(v), md, _dev(s), n_batch, 8, 64, 1, kernel, GGML_TYPE_F16)
    cp.cuda.get_current_stream().synchronize()
    _check(out.get(), ref, f"padded mask {kernel} n_batch={n_batch}")


def test_plan_built_on_another_stream(rng):
    """make_plan on stream A, attention on stream B: B waits for A's tile map (event)."""
    cp = _cupy()
    seq = [100, 30, 200]
    n = sum(seq)
    mask = _block_causal_mask(seq)
    q, k, v, s = _inputs(rng, 1, 8, 2, n, n, 128, 128, GGML_TYPE_F16)
    ref = flash_attn_ext(q, k, v, mask, 0.1, 0.0, 0.0, None, kv_type=GGML_TYPE_F16)
    dq, dk_, dv_ = _dev(q), _dev(k), _dev(v)
    cp.cuda.Device().synchronize()
    sa, sb = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    with sa:   # mask upload + scan + compact on A; the event after them orders B
        dm = cp.asarray(mask)
        plan = cb.make_plan(from_array(dm), n, 8, 2, head_dim_k=128, kv_type=GGML_TYPE_F16,
                            kernel="prefill", stream=sa)
    assert plan.items and all(st == sa.ptr for _, st, _ in plan.items.values()), \
        "every item of the plan was built on stream A"
    for kern in ("prefill", "decode-tc"):
        out = _launch(dq, dk_, dv_, from_array(dm), None, n, 8, 128, 1, kern, GGML_TYPE_F16,
                      plan=plan, stream=sb)
        sb.synchronize()
        _check(out.get(), ref, f"plan from another stream {kern}")


def test_host_entry_concurrent_threads(rng):
    """flash_attn_ext_host from several threads at once: staging buffers are per thread."""
    from concurrent.futures import ThreadPoolExecutor
    cases = []
    for i in range(4):
        n_batch, n_kv = 3 + 17 * i, 200 + 150 * i
        q, k, v, s = _inputs(rng, 1, 8, 2, n_batch, n_kv, 64, 64, GGML_TYPE_F16, sinks=True)
        mask = conf.random_kq_mask(rng, (1, 1, n_batch, n_kv))
        cases.append((q, k, v, mask, s,
                      flash_attn_ext(q, k, v, mask, 0.1, 0.0, 0.0, s, kv_type=GGML_TYPE_F16)))

    def work(c):
        q, k, v, mask, s, ref = c
        for _ in range(5):
            _check(_run_host(q, k, v, mask, s, 0.1, 0.0, 0.0, "auto"), ref, "host threaded")
        return True
    with ThreadPoolExecutor(4) as ex:
        assert all(ex.map(work, cases))


def test_split_workspace_two_devices_null_stream(rng):
    """Split-KV partials on the null stream of two devices: separate workspaces."""
    cp = _cupy()
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    q, k, v, s = _inputs(rng, 1, 16, 4, 1, 4000, 128, 128, GGML_TYPE_F16, sinks=True)
    ref = flash_attn_ext(q, k, v, None, 0.1, 0.0, 0.0, s, kv_type=GGML_TYPE_F16)
    outs = []
    for dev in (0, 1, 0, 1):
        with cp.cuda.Device(dev):
            outs.append(_launch(_dev(q), _dev(k), _dev(v), None, _dev(s), 1, 16, 128, 1, "decode",
                                GGML_TYPE_F16, stream=0, n_splits=8))
    for dev, out in zip((0, 1, 0, 1), outs):
        with cp.cuda.Device(dev):
            cp.cuda.runtime.deviceSynchronize()
            _check(out.get(), ref, f"splits on device {dev}")


@pytest.mark.parametrize("kernel", ["prefill", "decode-tc"])
def test_plan_refresh_follows_new_mask_contents(kernel, rng):
    """Plan.refresh: the mask tensor keeps its place and shape but its contents change (a decode
    step of a captured graph): the row intervals, tile maps and aligned copy are rebuilt in the
    same buffers and the kernels read the new mask. The mask rows are not 16-byte aligned (the
    aligned copy is refreshed too)."""
    cp = _cupy()
    n_kv, seq_a, seq_b = 300, [40, 90, 20], [100, 50]
    n = sum(seq_a)
    q, k, v, s = _inputs(rng, 1, 8, 2, n, n_kv, 128, 128, GGML_TYPE_F16)
    ma = _block_causal_mask(seq_a, n_kv=n_kv)
    mb = _block_causal_mask(seq_b + [n - sum(seq_b)], n_kv=n_kv)
    dm = cp.asarray(ma)
    dq, dk_, dv_ = cp.asarray(q), cp.asarray(k), cp.asarray(v)
    plan = cb.make_plan(from_array(dm), n, 8, 2, head_dim_k=128, kv_type=GGML_TYPE_F16, kernel=kernel)
    ptrs = plan.live(_layout_cfg(kernel, n, plan)[0], cp.cuda.get_current_stream().ptr)
    out = _launch(dq, dk_, dv_, from_array(dm), None, n, 8, 128, 1, kernel, GGML_TYPE_F16, plan=plan)
    _check(out.get(), flash_attn_ext(q, k, v, ma, 0.1, 0.0, 0.0, None, kv_type=GGML_TYPE_F16), "before")
    dm[...] = cp.asarray(mb)
    plan.refresh()
    assert plan.live(_layout_cfg(kernel, n, plan)[0], cp.cuda.get_current_stream().ptr) == ptrs, \
        "refresh must reuse the buffers"
    out = _launch(dq, dk_, dv_, from_array(dm), None, n, 8, 128, 1, kernel, GGML_TYPE_F16, plan=plan)
    _check(out.get(), flash_attn_ext(q, k, v, mb, 0.1, 0.0, 0.0, None, kv_type=GGML_TYPE_F16), "after refresh")


# ---------------------------------------------------------------------------------------
# cell-list decode ("cells"): lists built on the device, the kernel on sparse and interleaved
# masks, fully masked rows, splits, refresh in place, auto's choice on a batched decode step
def _sparse_mask(rng, shape, live=0.05):
    m = np.where(rng.random(shape) < live, rng.uniform(-1, 1, shape), -np.inf)
    return m.astype(np.float16)


@pytest.mark.parametrize("n_kv", [1, 113, 2049, 9000])
def test_cells_lists_match_host_mirror(n_kv, rng):
    """The device cell lists equal cell_lists_host (and the mask): odd n_kv (unaligned rows, the
    single-cell load path), two head and two stream planes, padded mask rows, NaN cells."""
    from ggml_attn.reference import cell_lists_host
    cp = _cupy()
    n_batch = 5
    m = _sparse_mask(rng, (2, 2, n_batch + 2, n_kv), 0.1)
    m[0, 0, 0] = -np.inf
    m[1, 1, 1, ::7] = np.nan
    dm = cp.asarray(m)
    plan = cb.make_plan(from_array(dm), n_batch, 4, 2, head_dim_k=128, kv_type=GGML_TYPE_F16, kernel="cells")
    want_cells, want_cnt = cell_lists_host(m, n_batch)
    cnt = plan.cell_counts()
    assert np.array_equal(cnt, want_cnt)
    got = plan.cell_entries()
    for idx in np.ndindex(*cnt.shape):   # cells exactly; values as floats (NaN payloads may differ)
        n = int(cnt[idx])
        assert np.array_equal(got[idx][:n, 0], want_cells[idx][:n, 0]), idx
        vals = [np.ascontiguousarray(a[idx][:n, 1]).view(np.float32) for a in (got, want_cells)]
        assert np.array_equal(*vals, equal_nan=True), idx
    assert plan.max_cells == int(want_cnt.max())


@pytest.mark.parametrize("d,gqa,kv_type", [(64, 1, GGML_TYPE_F16), (128, 4, GGML_TYPE_F16),
                                            (128, 8, GGML_TYPE_BF16), (256, 2, GGML_TYPE_BF16),
                                            (128, 3, GGML_TYPE_F16)])
@pytest.mark.parametrize("n_splits", [None, 1, 3])
@pytest.mark.parametrize("n_batch", [1, 7, 64])
def test_cells_random_sparse(d, gqa, kv_type, n_splits, n_batch, rng):
    """Random sparse masks (5% of cells visible, random values), fully masked rows (exact
    zeros, sinks on), splits on and off."""
    n_kv, n_head_kv = 3001, 2
    q, k, v, s = _inputs(rng, 1, n_head_kv * gqa, n_head_kv, n_batch, n_kv, d, d, kv_type, sinks=True)
    mask = _sparse_mask(rng, (1, 1, n_batch, n_kv))
    mask[:, :, ::4] = -np.inf
    ref = flash_attn_ext(q, k, v, mask, 0.1, 0.0, 0.0, s, kv_type=kv_type)
    out = _run_device(q, k, v, mask, s, 0.1, 0.0, 0.0, "cells", n_splits=n_splits)
    _check(out, ref, f"cells d={d} gqa={gqa} splits={n_splits} n_batch={n_batch}")
    assert np.all(out[:, ::4] == 0.0), "fully masked rows must be exactly zero"


@pytest.mark.parametrize("softcap,max_bias", [(10.0, 0.0), (0.0, 8.0), (20.0, 4.0)])
def test_cells_softcap_alibi(softcap, max_bias, rng):
    q, k, v, s = _inputs(rng, 2, 8, 2, 3, 700, 128, 128, GGML_TYPE_F16, sinks=True)
    mask = conf.random_kq_mask(rng, (2, 1, 3, 700))
    mask[..., 100:500] = -np.inf
    ref = flash_attn_ext(q, k, v, mask, 0.09, max_bias, softcap, s, kv_type=GGML_TYPE_F16)
    for n_splits in (1, 2):
        out = _run_device(q, k, v, mask, s, 0.09, max_bias, softcap, "cells", n_splits=n_splits)
        _check(out, ref, f"cells softcap={softcap} alibi={max_bias} splits={n_splits}")


def _decode_step_mask(seqs, steps):
    from gpu_batched_attn_bench import step_plan
    plan, _ = step_plan(seqs, steps)
    m = np.ascontiguousarray(plan.mask)
    m = m.reshape(1, 1, m.shape[-2], m.shape[-1])
    return m, plan.ubatch.n_tokens


@pytest.mark.parametrize("kernel", ["cells", "auto"])
@pytest.mark.parametrize("n_splits", [None, 1, 4])
def test_cells_interleaved_decode_step(kernel, n_splits, rng):
    """A batched decode step over a unified cache (tools/gpu_batched_attn_bench.step_plan: 64
    ragged prompts, then decode steps whose cells interleave), 32 q / 8 KV heads, D 128;
    auto must choose the cell lists here."""
    cp = _cupy()
    mask, n_tok = _decode_step_mask(64, 8)
    n_kv = mask.shape[-1]
    q, k, v, _ = _inputs(rng, 1, 32, 8, n_tok, n_kv, 128, 128, GGML_TYPE_F16)
    ref = flash_attn_ext(q, k, v, mask, 1 / math.sqrt(128), 0.0, 0.0, None, kv_type=GGML_TYPE_F16)
    dm = cp.asarray(mask)
    plan = cb.make_plan(from_array(dm, GGML_TYPE_F16), n_tok, 32, 8, head_dim_k=128, kv_type=GGML_TYPE_F16, kernel=kernel)
    if kernel == "auto":
        assert plan.reads is not None and plan.reads[0] * 2 <= plan.reads[1], plan.reads
        b = cb.bind(from_array(cp.asarray(q)), from_array(cp.asarray(k), GGML_TYPE_F16),
                    from_array(cp.asarray(v), GGML_TYPE_F16), from_array(dm, GGML_TYPE_F16), None,
                    from_array(cp.empty((1, n_tok, 32, 128), cp.float32)), 0.1, plan=plan)
        assert b.kern == "cells"
    dq, dk_, dv_ = cp.asarray(q), cp.asarray(k), cp.asarray(v)
    dst = cp.full((1, n_tok, 32, 128), cp.nan, dtype=cp.float32)
    cb.flash_attn_ext_device(from_array(dq), from_array(dk_, GGML_TYPE_F16), from_array(dv_, GGML_TYPE_F16),
                             from_array(dm, GGML_TYPE_F16), None, from_array(dst), 1 / math.sqrt(128),
                             kernel=kernel, plan=plan, n_splits=n_splits)
    cp.cuda.get_current_stream().synchronize()
    _check(dst.get(), ref, f"decode step {kernel} splits={n_splits}")


def test_cells_refresh_follows_new_mask_contents(rng):
    """Plan.refresh rebuilds the cell lists in the same buffers (a captured decode step): the
    kernel reads the new mask's cells."""
    cp = _cupy()
    n_batch, n_kv = 16, 1500
    q, k, v, _ = _inputs(rng, 1, 8, 2, n_batch, n_kv, 128, 128, GGML_TYPE_F16)
    ma = _sparse_mask(rng, (1, 1, n_batch, n_kv), 0.05)
    mb = _sparse_mask(rng, (1, 1, n_batch, n_kv), 0.3)
    dm = cp.asarray(ma)
    plan = cb.make_plan(from_array(dm), n_batch, 8, 2, head_dim_k=128, kv_type=GGML_TYPE_F16, kernel="cells")
    st = cp.cuda.get_current_stream().ptr
    ptrs = plan.cell_lists(st)
    dq, dk_, dv_ = cp.asarray(q), cp.asarray(k), cp.asarray(v)
    out = _launch(dq, dk_, dv_, from_array(dm), None, n_batch, 8, 128, 1, "cells", GGML_TYPE_F16, plan=plan)
    _check(out.get(), flash_attn_ext(q, k, v, ma, 0.1, 0.0, 0.0, None, kv_type=GGML_TYPE_F16), "before")
    dm[...] = cp.asarray(mb)
    plan.refresh()
    assert plan.cell_lists(st) == ptrs, "refresh must reuse the buffers"
    out = _launch(dq, dk_, dv_, from_array(dm), None, n_batch, 8, 128, 1, "cells", GGML_TYPE_F16, plan=plan)
    _check(out.get(), flash_attn_ext(q, k, v, mb, 0.1, 0.0, 0.0, None, kv_type=GGML_TYPE_F16), "after refresh")


def _garbage_in_hidden_cells_case(rng):
    """(q, k, v, mask, ref): interleaved cells of 9 owners, one row per owner for 8 of them; the
    9th owner's cells and a tail past the owners hold NaN (K) / inf (V), which no cell list
    names; ref is the reference with them zeroed."""
    n_own, n_kv = 9, 9 * 200 + 40
    owner = np.arange(n_kv) % n_own
    owner[-40:] = -1
    mask = np.where(owner[None, :] == np.arange(8)[:, None], 0.0, -np.inf).astype(np.float16)[None, None]
    q, k, v, _ = _inputs(rng, 1, 8, 2, 8, n_kv, 128, 128, GGML_TYPE_F16)
    hidden = (owner == 8) | (owner < 0)
    k0, v0 = k.copy(), v.copy()
    k0[:, :, hidden] = 0
    v0[:, :, hidden] = 0
    ref = flash_attn_ext(q, k0, v0, mask, 0.1, 0.0, 0.0, None, kv_type=GGML_TYPE_F16)
    k[:, :, hidden] = np.float16(np.nan)
    v[:, :, hidden] = np.float16(np.inf)
    return q, k, v, mask, ref


@pytest.mark.parametrize("n_splits", [1, 3])
def test_cells_garbage_in_hidden_cells(n_splits, rng):
    """NaN / inf in K and V at cells no row sees (interleaved cells of 9 owners, one row per
    owner for 8 of them; the 9th owner's cells and a tail past the owners hold garbage): the
    cell lists never name them, so the output equals the reference with them zeroed."""
    q, k, v, mask, ref = _garbage_in_hidden_cells_case(rng)
    out = _run_device(q, k, v, mask, None, 0.1, 0.0, 0.0, "cells", n_splits=n_splits)
    _check(out, ref, f"cells garbage splits={n_splits}")


@pytest.mark.parametrize("kernel", ["cells", "decode"])
@pytest.mark.parametrize("n_splits", [1, 3])
def test_nan_mask_cell_makes_its_row_nan(kernel, n_splits, rng):
    """A visible NaN mask cell makes its row NaN (as the reference): also when the NaN cell is
    the only visible one of its row (the cell-list kernel's group then never saw a finite
    score) and when the splits are merged by fattn_combine; other rows are unaffected."""
    n_batch, n_kv = 6, 900
    q, k, v, _ = _inputs(rng, 1, 8, 2, n_batch, n_kv, 128, 128, GGML_TYPE_F16)
    mask = _sparse_mask(rng, (1, 1, n_batch, n_kv), 0.1)
    mask[0, 0, 1, 37] = np.nan                  # among other visible cells
    mask[0, 0, 3] = -np.inf
    mask[0, 0, 3, 500] = np.nan                 # the row's only visible cell
    ref = flash_attn_ext(q, k, v, mask, 0.1, 0.0, 0.0, None, kv_type=GGML_TYPE_F16)
    nan_rows = [1, 3]
    assert np.isnan(ref[:, nan_rows]).all(), "reference: a visible NaN mask cell makes the row NaN"
    out = _run_device(q, k, v, mask, None, 0.1, 0.0, 0.0, kernel, n_splits=n_splits)
    assert np.isnan(out[:, nan_rows]).all(), f"{kernel} splits={n_splits}: NaN rows lost their NaN"
    keep = [r for r in range(n_batch) if r not in nan_rows]
    _check(out[:, keep], ref[:, keep], f"{kernel} splits={n_splits} other rows")


# ---------------------------------------------------------------------------------------
# the cells v2 sweep (tools/dev/gpu_batched_attn_bench.py CELLS_SWEEP: cells in flight per group,
# prefetch depth, launch-bounds blocks per SM, heads per block), each variant selected through
# cuda_launch.CELLS_TUNE on the cell-kernel cases above: ragged list lengths (tails shorter than a step), empty rows, splits,
# an interleaved decode step, garbage in cells no list names (prefetches must stay inside [jb, je))
def _sweep_tunes():
    from ggml_attn import kernels as K
    from gpu_batched_attn_bench import CELLS_SWEEP   # tools/dev/ (conftest puts it on the path)
    return [t for t in CELLS_SWEEP if t != K.CELLS_DEFAULT]


@pytest.fixture(params=_sweep_tunes(), ids=lambda t: t.label)
def cells_tune(request, monkeypatch):
    monkeypatch.setattr(cuda_launch, "CELLS_TUNE", request.param)
    cb._PREPARED.clear()
    yield request.param
    cb._PREPARED.clear()


@pytest.mark.parametrize("d,gqa,kv_type", [(64, 1, GGML_TYPE_F16), (128, 4, GGML_TYPE_F16),
                                            (128, 8, GGML_TYPE_BF16), (256, 2, GGML_TYPE_BF16)])
@pytest.mark.parametrize("n_splits", [None, 3])
@pytest.mark.parametrize("n_batch", [7, 64])
def test_cells_sweep_random_sparse(cells_tune, d, gqa, kv_type, n_splits, n_batch, rng):
    n_kv, n_head_kv = 3001, 2
    q, k, v, s = _inputs(rng, 1, n_head_kv * gqa, n_head_kv, n_batch, n_kv, d, d, kv_type, sinks=True)
    mask = _sparse_mask(rng, (1, 1, n_batch, n_kv))
    mask[:, :, ::4] = -np.inf
    mask[:, :, 1, :] = -np.inf
    mask[:, :, 1, 5:8] = 0.5     # a list of 3 entries: shorter than one group's step
    ref = flash_attn_ext(q, k, v, mask, 0.1, 0.0, 0.0, s, kv_type=kv_type)
    out = _run_device(q, k, v, mask, s, 0.1, 0.0, 0.0, "cells", n_splits=n_splits)
    _check(out, ref, f"cells-{cells_tune.label} d={d} gqa={gqa} splits={n_splits} n_batch={n_batch}")
    assert np.all(out[:, ::4] == 0.0), "fully masked rows must be exactly zero"
    cfg = next(p.cfg for p in cb._PREPARED.values() if p.cfg is not None and p.kern == "cells")
    assert cfg.name.endswith(f", {cells_tune.u}, {cells_tune.pf}, {cells_tune.minb}>"), cfg.name


@functools.lru_cache(maxsize=1)
def _sweep_decode_step_case():
    """The interleaved decode step's inputs and float64 reference, once for every variant."""
    mask, n_tok = _decode_step_mask(64, 8)
    q, k, v, _ = _inputs(np.random.default_rng(7), 1, 32, 8, n_tok, mask.shape[-1], 128, 128, GGML_TYPE_F16)
    ref = flash_attn_ext(q, k, v, mask, 1 / math.sqrt(128), 0.0, 0.0, None, kv_type=GGML_TYPE_F16)
    return mask, n_tok, q, k, v, ref


def test_cells_sweep_interleaved_decode_step(cells_tune):
    cp = _cupy()
    mask, n_tok, q, k, v, ref = _sweep_decode_step_case()
    dm = cp.asarray(mask)
    plan = cb.make_plan(from_array(dm, GGML_TYPE_F16), n_tok, 32, 8, head_dim_k=128, kv_type=GGML_TYPE_F16, kernel="cells")
    dq, dk_, dv_ = cp.asarray(q), cp.asarray(k), cp.asarray(v)
    for n_splits in (None, 2):
        dst = cp.full((1, n_tok, 32, 128), cp.nan, dtype=cp.float32)
        cb.flash_attn_ext_device(from_array(dq), from_array(dk_, GGML_TYPE_F16), from_array(dv_, GGML_TYPE_F16),
                                 from_array(dm, GGML_TYPE_F16), None, from_array(dst), 1 / math.sqrt(128),
                                 kernel="cells", plan=plan, n_splits=n_splits)
        cp.cuda.get_current_stream().synchronize()
        _check(dst.get(), ref, f"decode step cells-{cells_tune.label} splits={n_splits}")


def test_cells_sweep_garbage_in_hidden_cells(cells_tune, rng):
    q, k, v, mask, ref = _garbage_in_hidden_cells_case(rng)
    for n_splits in (1, 3):
        out = _run_device(q, k, v, mask, None, 0.1, 0.0, 0.0, "cells", n_splits=n_splits)
        _check(out, ref, f"cells-{cells_tune.label} garbage splits={n_splits}")
