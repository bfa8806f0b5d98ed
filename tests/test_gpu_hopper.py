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


def _probe_gemm(a: np.ndarray, b: np.ndarray, lead: int, stride: int, kernel: str = "hopper_probe_gemm") -> np.ndarray:
    """The f32 product of a probe kernel: ``hopper_probe_gemm`` C [64, 64] = A B^T (a, b f16
    [64, K]), ``hopper_probe_gemm_rs`` C [64, 128] = A B (a [64, K], b [K, 128]); numpy order."""
    import cupy as cp
    da, db = cp.asarray(a), cp.asarray(b)
    dc = cp.full((64, 64 if kernel == "hopper_probe_gemm" else 128), cp.nan, dtype=cp.float32)
    fn = K.get_function(K.hopper_probe_variant(), kernel)
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


@pytest.mark.parametrize("k", [16, 64])
def test_wgmma_a_from_registers_b_mn_major(k):
    """The register-A wgmma (wgmma_m64n128k16_rs, P V's in cuda/fattn_wgmma.cu): A (P) from
    registers in mma.sync's fragment layout, B (V as stored: keys x D, D contiguous) MN-major
    (trans-b) in core matrices [n/8][k/8][k%8][n%8], with the offsets the probe documents
    (K-neighbour core matrices 128 bytes apart, N-neighbour ones K / 8 x 128). On a mismatch
    the message says whether the swapped offsets match."""
    rng = np.random.default_rng(100 + k)
    a = rng.integers(-4, 5, (64, k)).astype(np.float16)
    b = rng.integers(-4, 5, (k, 128)).astype(np.float16)
    want = a.astype(np.float64) @ b.astype(np.float64)
    lead, stride = 128, k * 16
    got = _probe_gemm(a, b, lead, stride, "hopper_probe_gemm_rs")
    if not np.array_equal(got, want):
        swapped = _probe_gemm(a, b, stride, lead, "hopper_probe_gemm_rs")
        pytest.fail(f"K={k}: {int((got != want).sum())} of {got.size} wrong with lead={lead}, stride={stride}; "
                    f"swapped offsets {'match' if np.array_equal(swapped, want) else 'do not match either'}")


@pytest.mark.parametrize("x,y", [(0, 0), (64, 32), (96, 70)])
def test_tma_box_load(x, y):
    """A 64 x 32 box of a 100 x 160 f16 tensor (rows 512 bytes apart, like a strided ggml
    view) through cuTensorMapEncodeTiled (ggml_attn/tma.py), cp.async.bulk.tensor and an
    mbarrier: the box's elements, zeros past the tensor's edges."""
    import cupy as cp
    from ggml_attn import tma
    rows, cols, pitch = 100, 160, 256   # elements; rows 512 bytes apart: a strided view
    full = np.random.default_rng(7).standard_normal((rows, pitch)).astype(np.float16)
    d = cp.asarray(full)
    bx, by = 64, 32
    m = tma.encode_tiled(tma.DTYPE_F16, d.data.ptr, (cols, rows), (pitch * 2,), (bx, by))
    out = cp.full((by, bx), cp.nan, dtype=cp.float16)
    fn = K.get_function(K.hopper_probe_variant(), "hopper_probe_tma")
    stream = cp.cuda.get_current_stream()
    fn.launch((1, 1, 1), (128, 1, 1), stream.ptr, m, ctypes.c_uint64(out.data.ptr), ctypes.c_int32(x),
              ctypes.c_int32(y), ctypes.c_int32(bx), ctypes.c_int32(by))
    stream.synchronize()
    want = np.zeros((by, bx), np.float16)
    view = full[:, :cols]
    blk = view[y:y + by, x:x + bx]
    want[:blk.shape[0], :blk.shape[1]] = blk
    np.testing.assert_array_equal(out.get(), want)


def test_sw128_operand_path():
    """Version 1's operand path (hopper_probe_sw128): K and V tiles copied by TMA as 64 x 64
    boxes with the 128-byte swizzle, S = Q K^T through ws_issue_s (K-major swizzled descriptor,
    32-byte steps inside the atom, the second box for d 64-127) and O = P V through ws_issue_pv
    (MN-major swizzled descriptor, lead byte offset one box): exact on small integers."""
    import cupy as cp
    from ggml_attn import tma
    rng = np.random.default_rng(128)
    q, k, v, pm = (rng.integers(-3, 4, shp).astype(np.float16)
                   for shp in ((64, 128), (64, 128), (64, 128), (64, 64)))
    dq, dk, dv, dp = (cp.asarray(x) for x in (q, k, v, pm))
    mk, mv = (tma.encode_tiled(tma.DTYPE_F16, d.data.ptr, (128, 64), (256,), (64, 64), tma.SWIZZLE_128B)
              for d in (dk, dv))
    s_out = cp.full((64, 64), cp.nan, dtype=cp.float32)
    o_out = cp.full((64, 128), cp.nan, dtype=cp.float32)
    fn = K.get_function(K.hopper_probe_variant(), "hopper_probe_sw128", smem=1024 + 3 * 64 * 128 * 2)
    stream = cp.cuda.get_current_stream()
    fn.launch((1, 1, 1), (128, 1, 1), stream.ptr, mk, mv, *(ctypes.c_uint64(x.data.ptr) for x in (dq, dp, s_out, o_out)))
    stream.synchronize()
    want_s = q.astype(np.float64) @ k.astype(np.float64).T
    want_o = pm.astype(np.float64) @ v.astype(np.float64)
    got_s, got_o = s_out.get(), o_out.get()
    assert np.array_equal(got_s, want_s), f"S: {int((got_s != want_s).sum())} of 4096 wrong"
    assert np.array_equal(got_o, want_o), f"P V: {int((got_o != want_o).sum())} of 8192 wrong"


def _prefill_case(ne3, n_batch, n_kv, kv_pitch=None, seed=0, d=128, kv_type=None, heads=(8, 2)):
    """Random Q (f32), K, V (``kv_type``, f16 by default; rows ``kv_pitch`` cells apart per head
    when given: a view of a larger cache), the float64 reference on the same K/V values and a
    NaN-poisoned dst: numpy order throughout ([ne3, heads, rows, d]); ``heads``: query and KV heads."""
    import cupy as cp
    from ggml_attn.dtypes import GGML_TYPE_F16, from_float
    from ggml_attn.reference import flash_attn_ext
    kv_type = GGML_TYPE_F16 if kv_type is None else kv_type
    rng = np.random.default_rng(seed)
    nh, nkv = heads
    q = rng.uniform(-1, 1, (ne3, nh, n_batch, d)).astype(np.float32)
    k = from_float(rng.uniform(-1, 1, (ne3, nkv, n_kv, d)), kv_type)
    v = from_float(rng.uniform(-1, 1, (ne3, nkv, n_kv, d)), kv_type)
    ref = flash_attn_ext(q, k, v, None, 0.125, 0.0, 0.0, None, kv_type=kv_type)
    dk, dv = cp.asarray(k), cp.asarray(v)
    if kv_pitch:
        big_k = cp.zeros((ne3, nkv, kv_pitch, d), dtype=k.dtype)
        big_v = cp.zeros((ne3, nkv, kv_pitch, d), dtype=v.dtype)
        big_k[:, :, :n_kv] = dk
        big_v[:, :, :n_kv] = dv
        dk, dv = big_k[:, :, :n_kv], big_v[:, :, :n_kv]
    dst = cp.full((ne3, n_batch, nh, d), cp.nan, dtype=cp.float32)
    return cp.asarray(q), dk, dv, dst, ref


@pytest.mark.parametrize("config", ["pp", "pp-persistent", "pp-persistent-3", "nopp", "s2",
                                    "pp-persistent-d256", "pp-persistent-d256-3",
                                    "pp-persistent-qtma", "pp-persistent-qtma-3", "pp-persistent-qtma-d64",
                                    "pp-persistent-qtma-d64-3", "pp-persistent-qtma-otma", "pp-persistent-qtma-otma-3",
                                    "pp-persistent-qtma-d64-otma-3", "pp-persistent-qtma-lazy-otma-3"])
@pytest.mark.parametrize("ne3,n_batch,n_kv,pitch", [(1, 1, 64, None), (1, 64, 100, None), (2, 100, 1000, None),
                                                    (1, 300, 4097, None), (1, 129, 333, None),
                                                    (2, 200, 700, 1024), (1, 128, 16, None),
                                                    (1, 256, 640, None)])
def test_wgmma_prefill_ws(config, ne3, n_batch, n_kv, pitch):
    """Version 1 (TMA producer, two consumer warpgroups) in each f16 configuration (ring depths,
    with and without the ping-pong schedule, persistent blocks; head sizes 64, 128, 256),
    launched directly without a mask, against the float64 reference: one tile and fewer cells
    than a tile, a partial last tile, a second 128-row block, GQA 4, streams, K/V as views of a
    larger cache (the TMA map's strides); dst poisoned with NaN first. "-qtma": Q through its TMA
    map a tile ahead (3 blocks: every block's Q ring runs over many tiles)."""
    import cupy as cp
    from ggml_attn import hopper_prefill as hp
    from ggml_attn.dtypes import GGML_TYPE_F16
    from ggml_attn.reference import nmse
    from ggml_attn.tensor import from_array
    from ggml_attn.wgmma_shape import WS_CONFIGS
    name = config.removesuffix("-3")
    blocks = 3 if config.endswith("-3") else 0   # 3 blocks: each walks many tiles
    dq, dk, dv, dst, ref = _prefill_case(ne3, n_batch, n_kv, pitch, seed=n_batch * 3 + n_kv, d=WS_CONFIGS[name].d)
    hp.run_ws(from_array(dq), from_array(dk, GGML_TYPE_F16), from_array(dv, GGML_TYPE_F16),
              from_array(dst), 0.125, cp.cuda.get_current_stream().ptr, config=name, blocks=blocks)
    out = dst.get()
    assert not np.isnan(out).any(), "NaN in the output (rows unwritten or bad math)"
    err = nmse(out, ref)
    assert err <= 5e-4, f"NMSE {err:.3g}"


@pytest.mark.parametrize("config,d,bf16", [("pp-persistent", 96, False), ("pp-persistent", 80, False),
                                           ("pp-persistent", 72, False), ("pp-persistent", 112, False),
                                           ("pp-persistent-qtma", 80, False), ("pp-persistent-qtma", 112, False),
                                           ("pp-persistent-qtma-bf16", 72, True),
                                           ("pp-persistent-qtma-d64", 40, False),
                                           ("pp-persistent-d256", 192, False), ("pp-persistent-bf16-d256", 192, True),
                                           ("pp-persistent-qtma-otma", 80, False),
                                           ("pp-persistent-qtma-bf16-otma", 112, True),
                                           ("pp-persistent-qtma-d64-otma", 40, False)])
@pytest.mark.parametrize("ne3,n_batch,n_kv,pitch", [(1, 64, 100, None), (1, 300, 4097, None), (2, 200, 700, 1024)])
def test_wgmma_prefill_ws_padded_head_sizes(config, d, bf16, ne3, n_batch, n_kv, pitch):
    """Head sizes below an instance's tile width (40 on D 64; 72-112 on 128; 192 on 256), launched
    directly without a mask against the float64 reference: K/V's columns past the head come from
    TMA's zero fill (also from views of a larger cache), Q is staged with zeros there, dst rows are
    d values long and nothing past them is written (dst poisoned with NaN first, a guard row
    after it checked)."""
    import cupy as cp
    from ggml_attn import hopper_prefill as hp
    from ggml_attn.dtypes import GGML_TYPE_BF16, GGML_TYPE_F16
    from ggml_attn.reference import nmse
    from ggml_attn.tensor import from_array
    kv_type = GGML_TYPE_BF16 if bf16 else GGML_TYPE_F16
    dq, dk, dv, dst, ref = _prefill_case(ne3, n_batch, n_kv, pitch, seed=d + n_kv, d=d, kv_type=kv_type)
    guarded = cp.full(dst.size + 64, cp.nan, dtype=cp.float32)   # dst, then 64 floats nobody may write
    view = guarded[:dst.size].reshape(dst.shape)
    hp.run_ws(from_array(dq), from_array(dk, kv_type), from_array(dv, kv_type),
              from_array(view), 0.125, cp.cuda.get_current_stream().ptr, config=config)
    out = view.get()
    assert not np.isnan(out).any(), "NaN in the output (rows unwritten or bad math)"
    assert np.isnan(guarded[dst.size:].get()).all(), "written past dst"
    err = nmse(out, ref)
    assert err <= 5e-4, f"NMSE {err:.3g}"


@pytest.mark.parametrize("config", ["pp-bf16", "pp-persistent-bf16-d256", "pp-persistent-qtma-bf16",
                                    "pp-persistent-qtma-bf16-d64", "pp-persistent-qtma-bf16-otma",
                                    "pp-persistent-qtma-bf16-lazy-otma"])
@pytest.mark.parametrize("ne3,n_batch,n_kv", [(1, 64, 100), (2, 300, 1000), (1, 128, 4097)])
def test_wgmma_prefill_ws_bf16(config, ne3, n_batch, n_kv):
    """Version 1's bf16 instances (bf16 wgmma, Q and P staged in bf16, the TMA map's element type
    bf16; head sizes 64, 128, 256) against the float64 reference on the same bf16 K/V values;
    f16 K/V or another head size through them: refused."""
    import cupy as cp
    from ggml_attn import hopper_prefill as hp
    from ggml_attn.dtypes import GGML_TYPE_BF16, GGML_TYPE_F16
    from ggml_attn.reference import nmse
    from ggml_attn.tensor import from_array
    from ggml_attn.wgmma_shape import WS_CONFIGS
    d = WS_CONFIGS[config].d
    dq, dk, dv, dst, ref = _prefill_case(ne3, n_batch, n_kv, seed=n_batch + n_kv, d=d, kv_type=GGML_TYPE_BF16)
    hp.run_ws(from_array(dq), from_array(dk, GGML_TYPE_BF16), from_array(dv, GGML_TYPE_BF16),
              from_array(dst), 0.125, cp.cuda.get_current_stream().ptr, config=config)
    out = dst.get()
    assert not np.isnan(out).any()
    assert nmse(out, ref) <= 5e-4
    with pytest.raises(ValueError, match="K/V must be bf16"):   # f16 K/V through it: refused
        hp.run_ws(from_array(dq), from_array(dk, GGML_TYPE_F16), from_array(dv, GGML_TYPE_F16), from_array(dst),
                  0.125, config=config)
    other = 128 if d != 128 else 64   # another head size through it: refused, naming its own
    oq, ok, ov, odst, _ = _prefill_case(1, 64, 100, d=other, kv_type=GGML_TYPE_BF16)
    with pytest.raises(ValueError, match=rf"takes D [0-9, ]*\b{d} \(head_dim_k = head_dim_v\)"):
        hp.run_ws(from_array(oq), from_array(ok, GGML_TYPE_BF16), from_array(ov, GGML_TYPE_BF16),
                  from_array(odst), 0.125, config=config)


@pytest.mark.parametrize("config,d,bf16", [("pp-persistent-qtma", 128, False), ("pp-persistent-qtma-bf16", 128, True),
                                           ("pp-persistent-qtma-d64", 64, False), ("pp-persistent-qtma", 96, False),
                                           ("pp-persistent-qtma-d64", 40, False)])
@pytest.mark.parametrize("pack", [2, 4, 8])
@pytest.mark.parametrize("ne3,n_batch,n_kv,blocks", [(1, 1, 64, 0), (1, 37, 100, 0), (2, 100, 1000, 3),
                                                     (1, 300, 333, 0), (1, 129, 4097, 5)])
def test_wgmma_prefill_packed_heads(config, d, bf16, pack, ne3, n_batch, n_kv, blocks):
    """Tiles of ``pack`` query heads (128 / pack tokens each; cuda/fattn_wgmma.cuh ws_rows) launched
    directly without a mask, 16 query heads on 2 KV heads (GQA 8), against the float64 reference:
    token counts that leave the last tile partial, streams, many tiles per persistent block, head
    sizes padded to the tile width, bf16; dst poisoned with NaN first and a guard row after it
    checked (a row of another head or token written is a wrong or missing value, or a NaN left)."""
    import cupy as cp
    from ggml_attn import hopper_prefill as hp
    from ggml_attn.dtypes import GGML_TYPE_BF16, GGML_TYPE_F16
    from ggml_attn.reference import nmse
    from ggml_attn.tensor import from_array
    kv_type = GGML_TYPE_BF16 if bf16 else GGML_TYPE_F16
    dq, dk, dv, dst, ref = _prefill_case(ne3, n_batch, n_kv, seed=pack * 1000 + n_batch + d, d=d, kv_type=kv_type,
                                         heads=(16, 2))
    guarded = cp.full(dst.size + 64, cp.nan, dtype=cp.float32)
    view = guarded[:dst.size].reshape(dst.shape)
    hp.run_ws(from_array(dq), from_array(dk, kv_type), from_array(dv, kv_type), from_array(view), 0.125,
              cp.cuda.get_current_stream().ptr, config=config, blocks=blocks, pack=pack)
    out = view.get()
    assert not np.isnan(out).any(), "NaN in the output (rows unwritten or bad math)"
    assert np.isnan(guarded[dst.size:].get()).all(), "written past dst"
    err = nmse(out, ref)
    assert err <= 5e-4, f"NMSE {err:.3g}"


def test_wgmma_prefill_packed_heads_refused_where_they_cannot_run():
    """Several heads per tile need an instance with Q through TMA and gqa a multiple of the pack."""
    from ggml_attn import hopper_prefill as hp
    from ggml_attn.dtypes import GGML_TYPE_F16
    from ggml_attn.tensor import from_array
    dq, dk, dv, dst, _ = _prefill_case(1, 64, 100)   # GQA 4
    args = (from_array(dq), from_array(dk, GGML_TYPE_F16), from_array(dv, GGML_TYPE_F16), from_array(dst), 0.125)
    with pytest.raises(ValueError, match="Q through TMA"):
        hp.run_ws(*args, config="pp-persistent", pack=4)
    with pytest.raises(ValueError, match="gqa a multiple"):
        hp.run_ws(*args, config="pp-persistent-qtma", pack=8)


@pytest.mark.parametrize("pack", [1, 2, 4, 8])
@pytest.mark.parametrize("d,bf16,config", [(128, False, ""), (64, False, ""), (128, True, ""), (96, False, ""),
                                           (128, False, "pp-persistent-qtma-otma"),
                                           (64, False, "pp-persistent-qtma-d64-otma"),
                                           (128, True, "pp-persistent-qtma-bf16-otma"),
                                           (128, True, "pp-persistent-qtma-bf16-lazy-otma"),
                                           (96, False, "pp-persistent-qtma-lazy-otma")])
def test_wgmma_prefill_ragged_plan_packs_heads(pack, d, bf16, config, monkeypatch):
    """Ragged prompts in one unified ubatch through the op with a plan (make_plan: not wide), the
    sm_90a prefill by name: its tiles take cuda_launch.WGMMA_RAGGED_PACK query heads (the plan's
    map of 128 / pack tokens); NaN in the K/V cells past the prompts and in a cell between two of
    them that no row sees (HIDDEN columns) must not reach the output; against the float64
    reference, dst poisoned with NaN first. ``config``: the op's instance (cuda_launch.WGMMA_CONFIG),
    or one that stores its rows through TMA (the dst map's boxes of tw tokens x 64 / tw heads at
    every pack)."""
    import cupy as cp
    from ggml_attn import cuda_launch as L
    from ggml_attn.conformance import block_causal_mask
    from ggml_attn.dtypes import GGML_TYPE_BF16, GGML_TYPE_F16, from_float
    from ggml_attn.reference import flash_attn_ext, nmse
    from ggml_attn.tensor import from_array
    monkeypatch.setattr(L, "WGMMA_RAGGED_PACK", pack)
    monkeypatch.setattr(L, "WGMMA_CONFIG", config)
    cb._PREPARED.clear()
    kv_type = GGML_TYPE_BF16 if bf16 else GGML_TYPE_F16
    rng = np.random.default_rng(pack + d)
    lens = [int(x) for x in rng.integers(1, 201, 13)]
    n_batch = sum(lens)
    n_kv = -(-(n_batch + 5) // 256) * 256
    m = block_causal_mask(lens, n_kv, gaps=[5])   # 5 cells between the first two prompts: seen by no row
    nh, nkv = 16, 2
    q = rng.uniform(-1, 1, (1, nh, n_batch, d)).astype(np.float32)
    k = from_float(rng.uniform(-1, 1, (1, nkv, n_kv, d)), kv_type)
    v = from_float(rng.uniform(-1, 1, (1, nkv, n_kv, d)), kv_type)
    m4 = m.reshape(1, 1, n_batch, n_kv)
    ref = flash_attn_ext(q, k, v, m4, 0.1, 0.0, 0.0, None, kv_type=kv_type)
    unseen = ~np.isfinite(m).any(axis=0)
    assert unseen[lens[0]:lens[0] + 5].all() and unseen[n_batch + 5:].all()
    nan = from_float(np.array([np.nan]), kv_type)[0]   # (bf16 K/V are uint16 bit patterns)
    k[:, :, unseen] = nan
    v[:, :, unseen] = nan
    dq, dk, dv, dm = cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(m4)
    dst = cp.full((1, n_batch, nh, d), cp.nan, dtype=cp.float32)
    tq, tk, tv, td, tm = (from_array(dq), from_array(dk, kv_type), from_array(dv, kv_type), from_array(dst),
                          from_array(dm, GGML_TYPE_F16))
    st = cp.cuda.get_current_stream().ptr
    plan = cb.make_plan(tm, n_batch, nh, nkv, head_dim_k=d, kv_type=kv_type, stream=st)
    assert plan.wide is False
    call = cb.bind(tq, tk, tv, tm, None, td, 0.1, kernel="prefill-wgmma", plan=plan, stream=st)
    assert (call.kern, call._params.pack, call._params.q_tile_tokens) == ("prefill-wgmma", pack, 128 // pack)
    call.launch()
    out = dst.get()
    cb._PREPARED.clear()
    assert not np.isnan(out).any(), "NaN in the output"
    err = nmse(out, ref)
    assert err <= 5e-4, f"NMSE {err:.3g}"


def test_wgmma_prefill_refuses_what_it_does_not_take():
    """The f16 instance refuses bf16 K/V (and says which type it takes)."""
    import cupy as cp
    from ggml_attn import hopper_prefill as hp
    from ggml_attn.dtypes import GGML_TYPE_BF16
    from ggml_attn.tensor import from_array
    q = cp.zeros((1, 4, 8, 128), cp.float32)
    kv = cp.zeros((1, 1, 64, 128), cp.uint16)   # bf16 bits
    dst = cp.zeros((1, 8, 4, 128), cp.float32)
    with pytest.raises(ValueError, match="K/V must be f16"):
        hp.run_ws(from_array(q), from_array(kv, GGML_TYPE_BF16), from_array(kv, GGML_TYPE_BF16),
                  from_array(dst), 0.1)


def _causal(n_batch: int, n_kv: int, past: int) -> np.ndarray:
    """f16 [n_batch, n_kv]: token t sees cells [0, past + t]."""
    m = np.full((n_batch, n_kv), -np.inf, np.float16)
    for t in range(n_batch):
        m[t, :past + t + 1] = 0
    return m


def _two_prompts() -> np.ndarray:
    """f16 [400, 400]: prompts of 150 and 250 tokens in one unified ubatch (block-causal)."""
    from ggml_attn.conformance import block_causal_mask
    return block_causal_mask([150, 250], 400).reshape(400, 400)


def _masks():
    rng = np.random.default_rng(5)
    rand = rng.uniform(-1, 1, (300, 300)).astype(np.float16)
    return {
        # name: (n_batch, n_kv, mask or None, the kernel auto must pick on sm_90)
        "no mask": (300, 1000, None, "prefill-wgmma"),
        "causal": (300, 300, _causal(300, 300, 0), "prefill-wgmma"),
        "causal after 256 cells": (300, 556, _causal(300, 556, 256), "prefill-wgmma"),
        "causal, 8 tokens": (8, 300, _causal(8, 300, 292), "prefill"),   # < WGMMA_MIN_BATCH
        # the second prompt's third query tile cannot see the first's cells in a live tile:
        # HIDDEN columns (the fixer zeroes their V rows; ragged: tiles of 2 query heads)
        "two prompts": (400, 400, _two_prompts(), "prefill-wgmma"),
        "causal after 100 cells": (300, 400, _causal(300, 400, 100), "prefill-wgmma"),   # HIDDEN
        "random bias": (300, 300, rand, "prefill"),   # MASKED tiles
        # HIDDEN columns at each window's left edge, but ~8 live KV tiles per query tile (the
        # plan's "wide"): the sm_90a prefill
        "window 512": (2048, 2048, _window(2048, 512), "prefill-wgmma"),
    }


def _window(n, w):
    m = _causal(n, n, 0)
    for i in range(n):
        m[i, :max(0, i - w + 1)] = -np.inf
    return m


@pytest.mark.parametrize("name", list(_masks()))
def test_op_runs_wgmma_prefill_where_it_applies(name):
    """Through the op's device entry (make_plan, bind, launch): auto picks the sm_90a prefill for
    no mask and for masks whose 128-token tile map has only FULL and PARTIAL-interval tiles
    (causal, with an aligned prefix) or also HIDDEN tiles (ragged prompts, a window), the mma.sync
    prefill for MASKED tiles or short rows; either way the result matches the float64 reference
    (dst poisoned with NaN first)."""
    import cupy as cp
    from ggml_attn.dtypes import GGML_TYPE_F16, from_float
    from ggml_attn.reference import flash_attn_ext, nmse
    from ggml_attn.tensor import from_array
    n_batch, n_kv, mask, want = _masks()[name]
    rng = np.random.default_rng(n_batch + n_kv)
    nh, nkv, d, scale = 32, 8, 128, 0.0884
    q = rng.uniform(-1, 1, (1, nh, n_batch, d)).astype(np.float32)
    k = from_float(rng.uniform(-1, 1, (1, nkv, n_kv, d)), GGML_TYPE_F16)
    v = from_float(rng.uniform(-1, 1, (1, nkv, n_kv, d)), GGML_TYPE_F16)
    m4 = None if mask is None else mask.reshape(1, 1, n_batch, n_kv)
    ref = flash_attn_ext(q, k, v, m4, scale, 0.0, 0.0, None, kv_type=GGML_TYPE_F16)
    dq, dk, dv = cp.asarray(q), cp.asarray(k), cp.asarray(v)
    dm = None if m4 is None else cp.asarray(m4)
    dst = cp.full((1, n_batch, nh, d), cp.nan, dtype=cp.float32)
    tq, tk, tv, td = (from_array(dq), from_array(dk, GGML_TYPE_F16), from_array(dv, GGML_TYPE_F16), from_array(dst))
    tm = None if dm is None else from_array(dm, GGML_TYPE_F16)
    st = cp.cuda.get_current_stream().ptr
    plan = None if tm is None else cb.make_plan(tm, n_batch, nh, nkv, head_dim_k=d, kv_type=GGML_TYPE_F16, stream=st)
    call = cb.bind(tq, tk, tv, tm, None, td, scale, plan=plan, stream=st)
    assert call.kern == want, (name, call.kern, None if plan is None else plan.wgmma_tiles)
    call.launch()
    out = dst.get()
    assert not np.isnan(out).any(), "NaN in the output (rows unwritten or bad math)"
    err = nmse(out, ref)
    assert err <= 5e-4, f"{name}: NMSE {err:.3g}"


@pytest.mark.parametrize("d", [64, 80, 128, 192, 256])
@pytest.mark.parametrize("kind", ["random bias", "holes", "nan in hidden cells", "two prompts"])
def test_wgmma_prefill_by_name_takes_every_tile_class(kind, d):
    """kernel="prefill-wgmma" asked for by name on masks auto would not give it, at each head
    size: MASKED tiles (a random bias; -inf holes inside causal rows) read from the mask, NaN in
    the K/V cells no row sees (HIDDEN columns, ABSENT halves) must not reach the output, ragged
    prompts in one ubatch (HIDDEN columns)."""
    import cupy as cp
    from ggml_attn.dtypes import GGML_TYPE_F16, from_float
    from ggml_attn.reference import flash_attn_ext, nmse
    from ggml_attn.tensor import from_array
    rng = np.random.default_rng(3)
    n_batch, n_kv, nh, nkv = (400, 400, 8, 2) if kind == "two prompts" else (300, 420, 8, 2)
    q = rng.uniform(-1, 1, (1, nh, n_batch, d)).astype(np.float32)
    k = from_float(rng.uniform(-1, 1, (1, nkv, n_kv, d)), GGML_TYPE_F16)
    v = from_float(rng.uniform(-1, 1, (1, nkv, n_kv, d)), GGML_TYPE_F16)
    if kind == "random bias":
        m = rng.uniform(-2, 2, (n_batch, n_kv)).astype(np.float16)
    elif kind == "two prompts":
        m = _two_prompts()
    elif kind == "holes":
        m = _causal(n_batch, n_kv, 100)
        m[rng.random((n_batch, n_kv)) < 0.05] = -np.inf
    else:   # causal after 100 cells; cells no row sees hold NaN (garbage in an unused cache);
        m = _causal(n_batch, n_kv, 100)   # a hole in row 290 makes their tile MASKED for rows 256-299
        m[290, 385] = -np.inf
        k[:, :, 100 + n_batch:] = np.nan
        v[:, :, 100 + n_batch:] = np.nan
    m4 = m.reshape(1, 1, n_batch, n_kv)
    ref = flash_attn_ext(q, np.nan_to_num(k), np.nan_to_num(v), m4, 0.1, 0.0, 0.0, None, kv_type=GGML_TYPE_F16)
    dq, dk, dv, dm = cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(m4)
    dst = cp.full((1, n_batch, nh, d), cp.nan, dtype=cp.float32)
    cb.flash_attn_ext_device(from_array(dq), from_array(dk, GGML_TYPE_F16), from_array(dv, GGML_TYPE_F16),
                             from_array(dm, GGML_TYPE_F16), None, from_array(dst), 0.1, kernel="prefill-wgmma")
    out = dst.get()
    assert not np.isnan(out).any(), "NaN in the output"
    assert nmse(out, ref) <= 5e-4


def test_wgmma_prefill_by_name_with_streams_and_planes():
    """kernel="prefill-wgmma" asked for by name: two streams (ne3 = 2, each its own causal mask
    plane: ne33 = 2), 256 tokens, GQA 4, against the reference."""
    import cupy as cp
    from ggml_attn.dtypes import GGML_TYPE_F16, from_float
    from ggml_attn.reference import flash_attn_ext, nmse
    from ggml_attn.tensor import from_array
    rng = np.random.default_rng(11)
    n_batch, n_kv, nh, nkv, d = 256, 384, 8, 2, 128
    q = rng.uniform(-1, 1, (2, nh, n_batch, d)).astype(np.float32)
    k = from_float(rng.uniform(-1, 1, (2, nkv, n_kv, d)), GGML_TYPE_F16)
    v = from_float(rng.uniform(-1, 1, (2, nkv, n_kv, d)), GGML_TYPE_F16)
    m = np.stack([_causal(n_batch, n_kv, 128), _causal(n_batch, n_kv, 0)]).reshape(2, 1, n_batch, n_kv)
    ref = flash_attn_ext(q, k, v, m, 0.1, 0.0, 0.0, None, kv_type=GGML_TYPE_F16)
    dq, dk, dv, dm = cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(m)
    dst = cp.full((2, n_batch, nh, d), cp.nan, dtype=cp.float32)
    cb.flash_attn_ext_device(from_array(dq), from_array(dk, GGML_TYPE_F16), from_array(dv, GGML_TYPE_F16),
                             from_array(dm, GGML_TYPE_F16), None, from_array(dst), 0.1, kernel="prefill-wgmma")
    out = dst.get()
    assert not np.isnan(out).any()
    assert nmse(out, ref) <= 5e-4


@pytest.mark.parametrize("config,blocks,bf16,d", [("", 0, False, 128), ("", 5, False, 128), ("pp", 0, False, 128),
                                                  ("", 0, True, 128), ("", 5, True, 128),
                                                  ("", 0, False, 64), ("", 5, True, 64),
                                                  ("", 0, False, 256), ("", 5, False, 256), ("", 0, True, 256),
                                                  ("", 0, False, 96), ("", 5, True, 96), ("", 0, False, 40),
                                                  ("", 5, False, 112), ("", 0, True, 192), ("", 5, False, 72),
                                                  # #48's softmax variant (A/B instances)
                                                  ("pp-persistent-qtma-lazy", 5, False, 112),
                                                  ("pp-persistent-qtma-d64-lazy", 0, False, 64),
                                                  ("pp-persistent-qtma-d64-lazy", 5, False, 40),
                                                  ("pp-persistent-qtma-lazy-otma", 0, False, 128),
                                                  # the output through TMA stores
                                                  ("pp-persistent-qtma-otma", 5, False, 128),
                                                  ("pp-persistent-qtma-bf16-otma", 0, True, 96),
                                                  ("pp-persistent-qtma-bf16-lazy-otma", 5, True, 128),
                                                  ("pp-persistent-qtma-d64-otma", 5, False, 64),
                                                  ("pp-persistent-qtma-lazy-otma", 5, False, 72)])
@pytest.mark.parametrize("name", ["causal", "causal after 256 cells", "two prompts", "no mask"])
def test_wgmma_instances_through_the_op(name, config, blocks, bf16, d, monkeypatch):
    """The op's instance (cuda_launch.WGMMA_CONFIG "": the persistent one of the K/V type, f16 or
    bf16, and tile width, 64, 128 or 256, at those head sizes and smaller ones padded to them;
    blocks: one per SM, or 5 so that each block walks many tiles with different chunk counts, the
    ring running on across them) and the
    one-block-per-tile "pp", by name through the op against the float64 reference on the same
    K/V values: a mask's every class (causal tiles of 0-4 chunks, HIDDEN columns), ne3 = 2."""
    import cupy as cp
    from ggml_attn import cuda_launch as L
    from ggml_attn.dtypes import GGML_TYPE_BF16, GGML_TYPE_F16, from_float
    from ggml_attn.reference import flash_attn_ext, nmse
    from ggml_attn.tensor import from_array
    monkeypatch.setattr(L, "WGMMA_CONFIG", config)
    monkeypatch.setattr(L, "WGMMA_PERSISTENT_BLOCKS", blocks)
    cb._PREPARED.clear()
    n_batch, n_kv, mask, _ = _masks()[name]
    kv_type = GGML_TYPE_BF16 if bf16 else GGML_TYPE_F16
    rng = np.random.default_rng(17)
    ne3, nh, nkv = 2, 8, 2
    q = rng.uniform(-1, 1, (ne3, nh, n_batch, d)).astype(np.float32)
    k = from_float(rng.uniform(-1, 1, (ne3, nkv, n_kv, d)), kv_type)
    v = from_float(rng.uniform(-1, 1, (ne3, nkv, n_kv, d)), kv_type)
    m4 = None if mask is None else mask.reshape(1, 1, n_batch, n_kv)
    ref = flash_attn_ext(q, k, v, m4, 0.1, 0.0, 0.0, None, kv_type=kv_type)
    dq, dk, dv = cp.asarray(q), cp.asarray(k), cp.asarray(v)
    dm = None if m4 is None else cp.asarray(m4)
    dst = cp.full((ne3, n_batch, nh, d), cp.nan, dtype=cp.float32)
    tq, tk, tv, td = from_array(dq), from_array(dk, kv_type), from_array(dv, kv_type), from_array(dst)
    tm = None if dm is None else from_array(dm, GGML_TYPE_F16)
    st = cp.cuda.get_current_stream().ptr
    if mask is None:   # what auto picks for a plain call, bf16 K/V included
        assert cb.bind(tq, tk, tv, None, None, td, 0.1, stream=st).kern == "prefill-wgmma"
    call = cb.bind(tq, tk, tv, tm, None, td, 0.1, kernel="prefill-wgmma", stream=st)
    call.launch()
    out = dst.get()
    cb._PREPARED.clear()
    assert not np.isnan(out).any()
    assert nmse(out, ref) <= 5e-4, name


@pytest.mark.parametrize("config", ["pp-persistent-qtma", "pp-persistent-qtma-lazy", "pp-persistent-qtma-otma",
                                    "pp-persistent-qtma-lazy-otma",
                                    "pp-persistent-qtma-d64", "pp-persistent-qtma-d64-lazy"])
@pytest.mark.parametrize("growth", [1 / 32, 1 / 4])
def test_wgmma_prefill_rising_scores(config, growth):
    """Scores that rise along the cells (K's rows scaled by 1 + growth x cell, scale 0.5: a row's
    maximum passes the lazy reference by far more than 2^8 many times), launched directly without
    a mask, 3 blocks walking many tiles, against the float64 reference: the lazy maximum, the TMA
    epilogue and the plain instances they are measured against."""
    import cupy as cp
    from ggml_attn import hopper_prefill as hp
    from ggml_attn.dtypes import GGML_TYPE_F16, from_float
    from ggml_attn.reference import flash_attn_ext, nmse
    from ggml_attn.tensor import from_array
    from ggml_attn.wgmma_shape import WS_CONFIGS
    d, ne3, n_batch, n_kv, nh, nkv = WS_CONFIGS[config].d, 2, 200, 1500, 8, 2
    rng = np.random.default_rng(23)
    q = rng.uniform(-1, 1, (ne3, nh, n_batch, d)).astype(np.float32)
    rise = (1 + growth * np.arange(n_kv))[None, None, :, None]
    k = from_float(rng.uniform(-1, 1, (ne3, nkv, n_kv, d)) * rise, GGML_TYPE_F16)
    v = from_float(rng.uniform(-1, 1, (ne3, nkv, n_kv, d)), GGML_TYPE_F16)
    ref = flash_attn_ext(q, k, v, None, 0.5, 0.0, 0.0, None)
    assert np.isfinite(ref).all()
    dst = cp.full((ne3, n_batch, nh, d), cp.nan, dtype=cp.float32)
    # the device arrays stay referenced: a TensorDesc holds only a pointer (a freed temporary's
    # memory goes to the next array)
    dq, dk, dv = cp.asarray(q), cp.asarray(k), cp.asarray(v)
    hp.run_ws(from_array(dq), from_array(dk, GGML_TYPE_F16), from_array(dv, GGML_TYPE_F16), from_array(dst), 0.5,
              cp.cuda.get_current_stream().ptr, config=config, blocks=3)
    out = dst.get()
    assert not np.isnan(out).any()
    err = nmse(out, ref)
    assert err <= 5e-4, f"NMSE {err:.3g}"
