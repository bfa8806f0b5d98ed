"""The sm_90a decode (kernel "decode-tma", cuda/fattn_decode_tma.cu) through the op's device
entry (plan, bind, launch) against the float64 reference, dst poisoned with NaN first, on a
compute capability 9.0 GPU: every block count from one wave down to a few blocks that each take
parts of many groups (DECODE_TMA_BLOCKS), fewer work units than blocks, streams, GQA packs,
the n_kv tail, and masks of every tile class (PARTIAL intervals, MASKED values and holes, NaN in
HIDDEN cells, rows that see nothing, mask planes per head and stream). Skipped without such a GPU.
"""
from __future__ import annotations

import numpy as np
import pytest

from ggml_attn import cuda_backend as cb
from ggml_attn import kernels as K


def _is_sm90() -> bool:
    return cb.available() and K.device_arch() == "sm_90"


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _is_sm90(), reason="needs a compute capability 9.0 GPU (sm_90a programs)")]


def _run(ne3, n_batch, n_kv, nh, nkv, mask=None, blocks=0, kv_type=None, kv_nan=None, seed=0,
         monkeypatch=None, kernel="decode-tma", config="", align=1, slack=None, info=None):
    """(kernel that ran, NMSE against the reference, NaN in the output) for one call; ``mask``
    numpy f16 [ne33, ne32, n_batch, n_kv]; ``kv_nan``: cells of K and V set to NaN (a cache's
    garbage the mask hides); ``align``: cuda_launch.DECODE_TMA_ALIGN (1: groups cut on their
    boundaries when that balances, 0: equal shares), ``slack``: DECODE_TMA_CAP_SLACK; ``info``:
    a dict that receives the launch's work cap and block count."""
    import cupy as cp
    from ggml_attn import cuda_launch as L
    from ggml_attn.dtypes import GGML_TYPE_F16, from_float
    from ggml_attn.reference import flash_attn_ext, nmse
    from ggml_attn.tensor import from_array
    kv_type = GGML_TYPE_F16 if kv_type is None else kv_type
    monkeypatch.setattr(L, "DECODE_TMA_BLOCKS", blocks)
    monkeypatch.setattr(L, "DECODE_TMA_CONFIG", config)
    monkeypatch.setattr(L, "DECODE_TMA_ALIGN", align)
    if slack is not None:
        monkeypatch.setattr(L, "DECODE_TMA_CAP_SLACK", slack)
    cb._PREPARED.clear()
    rng = np.random.default_rng(seed)
    d = 128
    q = rng.uniform(-1, 1, (ne3, nh, n_batch, d)).astype(np.float32)
    k = from_float(rng.uniform(-1, 1, (ne3, nkv, n_kv, d)), kv_type)
    v = from_float(rng.uniform(-1, 1, (ne3, nkv, n_kv, d)), kv_type)
    ref = flash_attn_ext(q, k, v, mask, 0.09, 0.0, 0.0, None, kv_type=kv_type)
    if kv_nan is not None:
        nan = from_float(np.full((1,), np.nan), kv_type)[0]
        k[:, :, kv_nan] = nan
        v[:, :, kv_nan] = nan
    dq, dk, dv = cp.asarray(q), cp.asarray(k), cp.asarray(v)
    dst = cp.full((ne3, n_batch, nh, d), cp.nan, dtype=cp.float32)
    st = cp.cuda.get_current_stream().ptr
    tm = plan = None
    if mask is not None:
        dm = cp.asarray(mask)
        tm = from_array(dm, GGML_TYPE_F16)
        plan = cb.make_plan(tm, n_batch, nh, nkv, head_dim_k=d, kv_type=kv_type, ne3=ne3, stream=st)
    call = cb.bind(from_array(dq), from_array(dk, kv_type), from_array(dv, kv_type), tm, None, from_array(dst),
                   0.09, kernel=kernel, plan=plan, stream=st)
    call.launch()
    out = dst.get()
    cb._PREPARED.clear()
    if info is not None:
        info.update(work_cap=call._params.work_cap, blocks=call._grid[0])
    return call.kern, nmse(np.nan_to_num(out, nan=1e6), ref), bool(np.isnan(out).any())


@pytest.mark.parametrize("blocks", [0, 1, 3, 7])
@pytest.mark.parametrize("ne3,n_batch,n_kv,nh,nkv", [
    (1, 1, 4096, 32, 8),      # decode B=1: 8 groups of 64 tiles
    (1, 1, 32768, 32, 8),     # ... of 512: one wave's blocks turn the ring many times, warps race
    (1, 1, 100, 32, 8),       # 2 tiles (the second a tail): fewer units than blocks
    (3, 2, 1000, 32, 8),      # streams, 2 tokens of a 4-token tile, the tail
    (2, 2, 777, 16, 2),       # GQA 8: pack 8, 2 tokens per group
    (1, 5, 300, 4, 4),        # GQA 1: 16 tokens of one head per group
])
@pytest.mark.parametrize("align", [1, 0])
def test_no_mask(ne3, n_batch, n_kv, nh, nkv, blocks, align, monkeypatch):
    kern, err, nan = _run(ne3, n_batch, n_kv, nh, nkv, blocks=blocks, align=align, monkeypatch=monkeypatch)
    assert kern == "decode-tma"
    assert not nan and err <= 5e-4, err


@pytest.mark.parametrize("config", ["s4", "split-s4"])
@pytest.mark.parametrize("blocks", [0, 3])
def test_other_instances(config, blocks, monkeypatch):
    """The benchmark's A/B instances (4 stages; four warps on every tile), with and without a
    mask of MASKED and HIDDEN tiles."""
    m = _decode_causal(3, 1500)
    m[:, 600:700] = -np.inf
    m[np.random.default_rng(1).random(m.shape) < 0.05] = -np.inf
    for mask, nan in ((None, None), (m[None, None], slice(600, 700))):
        kern, err, bad = _run(2, 3, 1500, 32, 8, mask=mask, blocks=blocks, kv_nan=nan, config=config,
                              monkeypatch=monkeypatch)
        assert not bad and err <= 5e-4, (config, err)


def test_bf16_and_auto(monkeypatch):
    """bf16 K/V; and auto picks this kernel for a decode call on the H200 (from
    DECODE_TMA_MIN_WORK on)."""
    from ggml_attn.dtypes import GGML_TYPE_BF16
    for blocks in (0, 5):
        kern, err, nan = _run(2, 1, 2000, 32, 8, blocks=blocks, kv_type=GGML_TYPE_BF16, monkeypatch=monkeypatch)
        assert not nan and err <= 5e-4, err
    from ggml_attn import dispatch
    monkeypatch.setattr(dispatch, "DECODE_TMA_MIN_WORK", 0)   # a small call stands for a long one
    monkeypatch.setattr(dispatch, "DECODE_TMA_MIN_WORK_EVEN", 0)
    kern, err, nan = _run(1, 1, 3000, 32, 8, kernel="auto", monkeypatch=monkeypatch)
    assert kern == "decode-tma" and not nan and err <= 5e-4


def _decode_causal(n_batch, n_kv):
    """The last n_batch cells are the batch's tokens: token t sees cells [0, n_kv - n_batch + t]."""
    m = np.zeros((n_batch, n_kv), np.float16)
    for t in range(n_batch):
        m[t, n_kv - n_batch + t + 1:] = -np.inf
    return m


@pytest.mark.parametrize("align", [1, 0])
@pytest.mark.parametrize("blocks", [0, 4])
@pytest.mark.parametrize("kind", ["causal", "window", "holes", "bias", "hidden nan", "empty rows", "planes"])
def test_masks(kind, blocks, align, monkeypatch):
    rng = np.random.default_rng(7)
    ne3, n_batch, n_kv, nh, nkv = 2, 3, 1500, 32, 8
    kv_nan = None
    if kind == "causal":
        m = _decode_causal(n_batch, n_kv)[None, None]
    elif kind == "window":   # the last 200 cells of each token: most tiles ABSENT, PARTIAL intervals
        m = _decode_causal(n_batch, n_kv)
        for t in range(n_batch):
            m[t, :n_kv - n_batch + t - 199] = -np.inf
        m = m[None, None]
    elif kind == "holes":    # -inf holes inside visible ranges: MASKED tiles
        m = _decode_causal(n_batch, n_kv)
        m[rng.random(m.shape) < 0.1] = -np.inf
        m = m[None, None]
    elif kind == "bias":     # finite values everywhere: FINITE tiles (added with no select)
        m = rng.uniform(-2, 2, (1, 1, n_batch, n_kv)).astype(np.float16)
    elif kind == "hidden nan":   # cells 600-700 hidden from every token hold NaN in K and V
        m = _decode_causal(n_batch, n_kv)
        m[:, 600:700] = -np.inf
        m = m[None, None]
        kv_nan = slice(600, 700)
    elif kind == "empty rows":   # token 1 sees nothing (its output is zeros)
        m = _decode_causal(n_batch, n_kv)
        m[1, :] = -np.inf
        m = m[None, None]
    else:                    # a mask plane per stream (ne33 = 2) and per head (ne32 = 2)
        m = np.stack([np.stack([np.pad(_decode_causal(n_batch, n_kv - 64 * i - 32 * j), ((0, 0), (0, 64 * i + 32 * j)),
                                       constant_values=-np.inf) for j in range(2)]) for i in range(2)])
    kern, err, nan = _run(ne3, n_batch, n_kv, nh, nkv, mask=m.astype(np.float16), blocks=blocks, kv_nan=kv_nan,
                          align=align, monkeypatch=monkeypatch)
    assert kern == "decode-tma"
    assert not nan, "NaN in the output"
    assert err <= 5e-4, err


def test_groups_whose_query_tile_sees_nothing(monkeypatch):
    """A query tile none of whose tokens sees a cell (an empty live list): its rows are zeros,
    the other groups right, with blocks taking parts of several groups."""
    n_batch, n_kv = 8, 500   # GQA 4: tiles of 4 tokens; tokens 4-7 see nothing
    m = _decode_causal(n_batch, n_kv)
    m[4:, :] = -np.inf
    for blocks in (0, 3):
        kern, err, nan = _run(1, n_batch, n_kv, 32, 8, mask=m[None, None], blocks=blocks, monkeypatch=monkeypatch)
        assert not nan and err <= 5e-4, (blocks, err)


def test_repeated_launches_reset_the_counters(monkeypatch):
    """The merging block sets its group's counter back to 0: the same bound call launched
    again (as the op's replay does) gives the same output."""
    import cupy as cp
    from ggml_attn import cuda_launch as L
    from ggml_attn.dtypes import GGML_TYPE_F16, from_float
    from ggml_attn.tensor import from_array
    monkeypatch.setattr(L, "DECODE_TMA_BLOCKS", 5)
    cb._PREPARED.clear()
    rng = np.random.default_rng(3)
    q = cp.asarray(rng.uniform(-1, 1, (1, 32, 1, 128)).astype(np.float32))
    k = cp.asarray(from_float(rng.uniform(-1, 1, (1, 8, 5000, 128)), GGML_TYPE_F16))
    v = cp.asarray(from_float(rng.uniform(-1, 1, (1, 8, 5000, 128)), GGML_TYPE_F16))
    dst = cp.full((1, 1, 32, 128), cp.nan, dtype=cp.float32)
    call = cb.bind(from_array(q), from_array(k, GGML_TYPE_F16), from_array(v, GGML_TYPE_F16), None, None,
                   from_array(dst), 0.09, kernel="decode-tma")
    call.launch()
    first = dst.get()
    for _ in range(3):
        dst.fill(cp.nan)
        call.launch()
    cb._PREPARED.clear()
    assert not np.isnan(first).any()
    np.testing.assert_array_equal(dst.get(), first)


def _stream_lengths(lens, n_kv):
    """One mask plane per stream (ne33 = len(lens)), one token each: stream s sees its first lens[s] cells."""
    m = np.full((len(lens), 1, 1, n_kv), -np.inf, np.float16)
    for s_, L_ in enumerate(lens):
        m[s_, 0, 0, :L_] = 0
    return m


@pytest.mark.parametrize("lens,slack,blocks", [
    ([4096] * 8, None, 0),                          # equal streams under a plan: one list of groups
    ([200, 3000, 64, 1500, 900, 2500], 100.0, 0),   # unequal: cut pair by pair
    ([200, 3000, 64, 1500, 900, 2500], 100.0, 40),  # ... on fewer blocks (long groups in parts)
    ([200, 3000, 64, 1500, 900, 2500], 1.0, 0),     # too unequal for the slack: equal shares
    ([1, 0, 4000], 100.0, 9),                       # a stream that sees nothing
])
def test_plan_split_on_group_boundaries(lens, slack, blocks, monkeypatch):
    """Per-stream decode under a plan whose streams have different live lengths: the split the
    plan's counts give (cuda_launch.decode_tma_cap) is right, capped or not."""
    n_kv = 4096
    info = {}
    kern, err, nan = _run(len(lens), 1, n_kv, 32, 8, mask=_stream_lengths(lens, n_kv), blocks=blocks, slack=slack,
                          monkeypatch=monkeypatch, info=info)
    assert kern == "decode-tma" and not nan and err <= 5e-4, (err, info)
    assert (info["work_cap"] > 0) == (slack != 1.0), info


def test_a_refreshed_plan_keeps_the_split_right(monkeypatch):
    """The work cap comes from the counts make_plan read; a refreshed mask (new contents, same
    tensor: a captured decode step) changes the counts under the bound call. The kernel derives
    its split from the counts it reads, so the output stays right whether the cap still fits
    (fewer live tiles) or not (more: equal shares)."""
    import cupy as cp
    from ggml_attn import cuda_launch as L
    from ggml_attn.dtypes import GGML_TYPE_F16, from_float
    from ggml_attn.reference import flash_attn_ext, nmse
    from ggml_attn.tensor import from_array
    monkeypatch.setattr(L, "DECODE_TMA_CAP_SLACK", 100.0)
    cb._PREPARED.clear()
    rng = np.random.default_rng(5)
    ne3, n_kv = 4, 4096
    q = rng.uniform(-1, 1, (ne3, 32, 1, 128)).astype(np.float32)
    k = from_float(rng.uniform(-1, 1, (ne3, 8, n_kv, 128)), GGML_TYPE_F16)
    v = from_float(rng.uniform(-1, 1, (ne3, 8, n_kv, 128)), GGML_TYPE_F16)
    dq, dk, dv = cp.asarray(q), cp.asarray(k), cp.asarray(v)
    dst = cp.full((ne3, 1, 32, 128), cp.nan, dtype=cp.float32)
    st = cp.cuda.get_current_stream().ptr
    dm = cp.asarray(_stream_lengths([1000, 2000, 300, 1500], n_kv))
    tm = from_array(dm, GGML_TYPE_F16)
    plan = cb.make_plan(tm, 1, 32, 8, head_dim_k=128, kv_type=GGML_TYPE_F16, ne3=ne3, stream=st)
    call = cb.bind(from_array(dq), from_array(dk, GGML_TYPE_F16), from_array(dv, GGML_TYPE_F16), tm, None,
                   from_array(dst), 0.09, kernel="decode-tma", plan=plan, stream=st)
    assert call._params.work_cap > 0
    for lens in ([1000, 2000, 300, 1500], [900, 1000, 64, 1400], [4096, 4000, 3000, 4096], [0, 1, 2, 3]):
        m = _stream_lengths(lens, n_kv)
        dm[...] = cp.asarray(m)
        plan.refresh(st)
        dst.fill(cp.nan)
        call.launch()
        out = dst.get()
        ref = flash_attn_ext(q, k, v, m, 0.09, 0.0, 0.0, None, kv_type=GGML_TYPE_F16)
        assert not np.isnan(out).any() and nmse(out, ref) <= 5e-4, lens
    cb._PREPARED.clear()
