"""q8_0 / q4_0 K/V in GPU memory (the CUDA-core decode kernel dequantizes the blocks in
registers): test-backend-ops' quantized grid cases, K/V laid out as ggml's cache views (byte
strides, whole blocks per row), against ggml's own CPU result on the same blocks and the
float64 reference; long decode rows with holes and whole masked tiles (several KV splits).
GPU only; the dispatch side is in tests/test_op_plan.py."""
import zlib
from dataclasses import replace

import numpy as np
import pytest

import ggml_attn
import ggml_attn.conformance as conf
from ggml_attn import cuda_backend as cb
from ggml_attn import kernels as K
from ggml_attn import reference
from ggml_attn import decode_tma_shape as dt
from ggml_attn.decode_tma_shape import quant_why_not
from ggml_attn.dtypes import GGML_TYPE_F16, GGML_TYPE_Q4_0, GGML_TYPE_Q8_0
from ggml_attn.quant import dequantize_rows, quantize
from ggml_attn.tensor import TensorDesc, from_array, from_ggml
from ggml_build import build_case, case_bytes, get_data, ggml_reference_node, graph_of, new_context

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ggml_attn.gpu_available(), reason="needs a CUDA GPU")]
NMSE_MAX = 5e-4


def _is_sm90() -> bool:
    return ggml_attn.gpu_available() and K.device_arch() == "sm_90"

GPU_QUANT = (GGML_TYPE_Q8_0, GGML_TYPE_Q4_0)
CASES = [c for c in conf.grid(kv_types=GPU_QUANT) if c.kv_type in GPU_QUANT
         and getattr(c, "v_type", None) in (None, c.kv_type) and not c.nonfinite]


def _to_device(desc: TensorDesc, keep: list) -> TensorDesc:
    """A host tensor's bytes (its whole strided span) copied to the GPU: the same view there."""
    import cupy as cp
    if desc is None:
        return None
    host = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * desc.nbytes_span()).from_address(desc.ptr))
    dev = cp.asarray(host.copy())
    keep.append(dev)
    return replace(desc, ptr=int(dev.data.ptr))


def _grid_inputs(case):
    """(q, k, v, mask, sinks descriptors on the device, their buffers, ggml's CPU result, the
    float64 reference) of a conformance case, K/V laid out as ggml builds them."""
    rng = np.random.default_rng(zlib.crc32(case.id.encode()))
    x = conf.make_inputs(case, rng)
    ctx = new_context(case_bytes(case))
    keep = []
    try:
        q, k, v, mask, sinks = build_case(ctx, case, x)
        theirs = ggml_reference_node(ctx, q, k, v, mask, sinks, case)
        ggml_attn.compute_graph(ctx, graph_of(ctx, theirs), 2)
        ggml_out = get_data(theirs)
        descs = [_to_device(from_ggml(t, nm) if t is not None else None, keep)
                 for t, nm in ((q, "q"), (k, "k"), (v, "v"), (mask, "mask"), (sinks, "sinks"))]
    finally:
        import ggml
        ggml.ggml_free(ctx)
    kf, vf = x.kv_float()
    exact = reference.flash_attn_ext(x.q, kf, vf, x.mask, case.scale, case.max_bias, case.logit_softcap, x.sinks)
    return descs, keep, ggml_out, exact


def test_grid_has_the_gpu_types():
    assert len(CASES) == 2 * 336 and {c.kv_type for c in CASES} == set(GPU_QUANT)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_quantized_grid_on_the_gpu(case, request):
    n = request.config.getoption("--grid-sample", default=0)
    if n and zlib.crc32(case.id.encode()) % max(1, len(CASES) // n):
        pytest.skip("not in --grid-sample")
    import cupy as cp
    descs, keep, ggml_out, exact = _grid_inputs(case)
    plain = case.max_bias == 0.0 and case.logit_softcap == 0.0 and descs[4] is None
    d128 = descs[1].ne[0] == 128 and descs[2].ne[0] == 128 and _is_sm90() and plain
    tma = d128 and quant_why_not(descs[1]) is None and quant_why_not(descs[2]) is None
    # the blocks read directly (CUDA-core decode; the sm_90a decode where its TMA boxes can read
    # them), and the tensor-core kernels over f16 copies; auto: one of them, never the reference
    kernels = ["decode", "auto", "prefill"] + (["decode-tma"] if tma else []) + (["prefill-wgmma"] if d128 else [])
    for kernel in kernels:
        dst = cp.full(exact.shape, cp.nan, dtype=cp.float32)
        call = cb.bind(*descs, from_array(dst), case.scale, case.max_bias, case.logit_softcap, kernel=kernel)
        assert call.kern == kernel or (kernel == "auto" and call.kern in cb.dispatch.GPU_KERNELS), \
            f"{kernel} chose {call.kern}"   # not the reference fallback
        call.launch()
        out = dst.get()
        assert np.isfinite(out).all(), f"{kernel}: unwritten or non-finite output"
        assert reference.nmse(out, exact) <= NMSE_MAX, (kernel, "vs float64", reference.nmse(out, exact))
        assert reference.nmse(out, ggml_out) <= NMSE_MAX, (kernel, "vs ggml", reference.nmse(out, ggml_out))


@pytest.mark.parametrize("kv_type", GPU_QUANT, ids=["q8_0", "q4_0"])
@pytest.mark.parametrize("n_batch, n_kv, d", [(1, 5000, 128), (3, 4097, 128), (1, 2500, 64), (2, 1500, 256)])
def test_long_rows_with_holes_and_masked_tiles(kv_type, n_batch, n_kv, d):
    """Rows long enough for several KV splits; whole 64-cell tiles masked, scattered holes,
    a stride between rows larger than a row (a cache view of a wider buffer)."""
    import cupy as cp
    rng = np.random.default_rng(n_kv + d + kv_type)
    n_head, n_head_kv = 16, 4
    q = rng.standard_normal((1, n_head, n_batch, d), dtype=np.float32)
    kf = rng.standard_normal((1, n_head_kv, n_kv, d), dtype=np.float32)
    vf = rng.standard_normal((1, n_head_kv, n_kv, d), dtype=np.float32)
    kq, vq = quantize(kf, kv_type), quantize(vf, kv_type)          # (1, n_head_kv, n_kv, row_bytes)
    wide = np.zeros(kq.shape[:-1] + (kq.shape[-1] + 34,), np.uint8)  # rows 34 bytes apart more
    wide[..., :kq.shape[-1]] = kq
    mask = np.zeros((1, 1, n_batch, n_kv), np.float32)
    mask[..., 128:448] = -np.inf                                    # whole tiles
    mask[rng.random(mask.shape) < 0.2] = -np.inf
    mask[..., -1] = 0
    mask = mask.astype(np.float16)
    deq = [dequantize_rows(a.ctypes.data, kv_type, d, a.size // a.shape[-1], a.shape[-1]).reshape(a.shape[:-1] + (d,))
           for a in (kq, vq)]
    exact = reference.flash_attn_ext(q, deq[0], deq[1], mask, 0.1)

    dk, dv = cp.asarray(wide), cp.asarray(vq)
    kd, vd = from_array(dk[..., :kq.shape[-1]], kv_type), from_array(dv, kv_type)
    assert kd.ne == vd.ne == (d, n_kv, n_head_kv, 1) and kd.nb[1] == kq.shape[-1] + 34
    dq, dm = cp.asarray(q), cp.asarray(mask)
    dst = cp.full((1, n_batch, n_head, d), cp.nan, dtype=cp.float32)
    for n_splits in (None, 1, 7):
        cb.flash_attn_ext_device(from_array(dq), kd, vd, from_array(dm), None, from_array(dst), 0.1,
                                 kernel="decode", n_splits=n_splits)
        out = dst.get()
        assert np.isfinite(out).all() and reference.nmse(out, exact) <= NMSE_MAX, (n_splits, reference.nmse(out, exact))
    del dk, dv


def _cache_view(dev, kv_type, d, n_kv, n_head_kv, n_stream=1):
    """A cache view over device rows ``dev`` uint8 (n_stream * n_kv, n_head_kv * row + pad): ggml
    order [d, n_kv, n_head_kv, n_stream], each cell's heads packed in its row (what decode-tma's
    boxes read), the streams one after another."""
    blk = {GGML_TYPE_Q8_0: 34, GGML_TYPE_Q4_0: 18}[kv_type]
    row = d // 32 * blk
    return TensorDesc(int(dev.data.ptr), kv_type, (d, n_kv, n_head_kv, n_stream),
                      (blk, dev.strides[0], row, dev.strides[0] * n_kv))


def _packed_inputs(rng, kv_type, n_batch, n_kv, n_head, n_head_kv, pad, d=128, n_stream=1):
    """Q f32 (n_stream, n_head, n_batch, d); K/V quantized as cache rows (n_stream * n_kv,
    n_head_kv * row + pad) uint8 on the device with their views; the dequantized K/V (n_stream,
    n_head_kv, n_kv, d) float32."""
    import cupy as cp
    q = rng.standard_normal((n_stream, n_head, n_batch, d), dtype=np.float32)
    views, deq, keep = [], [], []
    for _ in range(2):
        f = rng.standard_normal((n_stream, n_head_kv, n_kv, d), dtype=np.float32)
        b = quantize(f, kv_type)                                       # (n_stream, n_head_kv, n_kv, row)
        rows = np.zeros((n_stream, n_kv, n_head_kv * b.shape[-1] + pad), np.uint8)
        rows[..., :n_head_kv * b.shape[-1]] = b.transpose(0, 2, 1, 3).reshape(n_stream, n_kv, -1)
        dev = cp.asarray(rows.reshape(n_stream * n_kv, -1))
        keep.append(dev)
        views.append(_cache_view(dev, kv_type, d, n_kv, n_head_kv, n_stream))
        deq.append(dequantize_rows(b.ctypes.data, kv_type, d, n_stream * n_head_kv * n_kv, b.shape[-1])
                   .reshape(n_stream, n_head_kv, n_kv, d))
    return q, views, deq, keep


def _launch_within_bound(call, dst, exact) -> None:
    """Launch a bound call whose output ``dst`` (CuPy, poisoned with NaN) must come out finite
    and within NMSE_MAX of ``exact``; the prepared-call cache cleared after (instance knobs)."""
    call.launch()
    out = dst.get()
    err = reference.nmse(out, exact)
    assert np.isfinite(out).all() and err <= NMSE_MAX, err
    cb._PREPARED.clear()


# every quantized decode-tma instance of a type: "" (the op's, FOR_TYPE) and the A/B rows
QUANT_CONFIGS = [(t, c) for t, name in ((GGML_TYPE_Q8_0, "q8_0"), (GGML_TYPE_Q4_0, "q4_0"))
                 for c in ("", *(k for k, v in dt.CONFIGS.items() if v.kv_type == t and k != dt.FOR_TYPE[t]))]
QUANT_CONFIG_IDS = [f"{'q8_0' if t == GGML_TYPE_Q8_0 else 'q4_0'}-{c or 'default'}" for t, c in QUANT_CONFIGS]


@pytest.mark.skipif(not _is_sm90(), reason="sm_90a decode: compute capability 9.0")
@pytest.mark.parametrize("kv_type, config", QUANT_CONFIGS, ids=QUANT_CONFIG_IDS)
@pytest.mark.parametrize("n_batch, n_kv, masked, blocks", [
    (1, 5000, True, 0), (1, 5000, True, 3), (4, 4097, True, 0), (2, 70, False, 0), (1, 33000, False, 0),
    (1, 33000, False, 5), (16, 2000, True, 0)])
def test_decode_tma_reads_the_blocks(kv_type, config, n_batch, n_kv, masked, blocks, monkeypatch):
    """decode-tma (each instance of the type) on a cache view of q8_0/q4_0 rows (heads packed in
    a cell's row, rows 16 bytes wider than their blocks): whole masked tiles, holes, the n_kv
    tail, a few blocks taking parts of many groups, 16 tokens; through a plan and without;
    against float64 on the dequantized values."""
    import cupy as cp
    from ggml_attn import cuda_launch as L
    monkeypatch.setattr(L, "DECODE_TMA_BLOCKS", blocks)
    monkeypatch.setattr(L, "DECODE_TMA_CONFIG", config)
    cb._PREPARED.clear()
    rng = np.random.default_rng(n_kv + kv_type + blocks)
    n_head, n_head_kv = 32, 8
    q, (kd, vd), deq, keep = _packed_inputs(rng, kv_type, n_batch, n_kv, n_head, n_head_kv, pad=16)
    assert quant_why_not(kd) is None and kd.nb[2] == kd.row_bytes()
    mask = None
    if masked:
        m = np.zeros((1, 1, n_batch, n_kv), np.float32)
        m[..., 128:448] = -np.inf
        m[rng.random(m.shape) < 0.2] = -np.inf
        m[..., -1] = 0
        mask = m.astype(np.float16)
    exact = reference.flash_attn_ext(q, deq[0], deq[1], mask, 0.1)
    dq = cp.asarray(q)
    dm = cp.asarray(mask) if masked else None
    tm = from_array(dm) if masked else None
    plans = [None] + ([cb.make_plan(tm, n_batch, n_head, n_head_kv, kv_type=kv_type)] if masked else [])
    for plan in plans:
        for kernel in ("auto", "decode-tma") if n_batch <= 4 else ("decode-tma",):   # 16 tokens: auto's prefill
            dst = cp.full((1, n_batch, n_head, 128), cp.nan, dtype=cp.float32)
            call = cb.bind(from_array(dq), kd, vd, tm, None, from_array(dst), 0.1, kernel=kernel, plan=plan)
            assert call.kern == "decode-tma", (kernel, call.kern)
            call.launch()
            out = dst.get()
            err = reference.nmse(out, exact)
            assert np.isfinite(out).all() and err <= NMSE_MAX, (kernel, plan is not None, err)
    cb._PREPARED.clear()
    del keep


@pytest.mark.skipif(not _is_sm90(), reason="sm_90a decode: compute capability 9.0")
@pytest.mark.parametrize("kv_type, config", QUANT_CONFIGS, ids=QUANT_CONFIG_IDS)
@pytest.mark.parametrize("n_stream, n_kv, blocks", [(6, 3000, 0), (6, 3000, 5), (6, 3000, 40), (24, 700, 0),
                                                    (24, 700, 7), (3, 9000, 0)])
def test_decode_tma_streams_in_either_group_order(kv_type, config, n_stream, n_kv, blocks, monkeypatch):
    """decode-tma on a one-token step of several streams (a cache view [d, n_kv, 8, n_stream]):
    without a plan and through one whose streams have the same live tiles, every pair's units
    are equal and the heads-first instances walk the groups head by head -- whole groups per
    block, a group cut in parts, the equal share (``blocks``) -- and through a plan whose streams
    differ (pair by pair); every (stream, head) once, against float64 on the dequantized values."""
    import cupy as cp
    from ggml_attn import cuda_launch as L
    monkeypatch.setattr(L, "DECODE_TMA_BLOCKS", blocks)
    monkeypatch.setattr(L, "DECODE_TMA_CONFIG", config)
    cb._PREPARED.clear()
    rng = np.random.default_rng(n_stream * n_kv + kv_type + blocks)
    n_head, n_head_kv = 32, 8
    q, (kd, vd), deq, keep = _packed_inputs(rng, kv_type, 1, n_kv, n_head, n_head_kv, pad=16, n_stream=n_stream)
    assert quant_why_not(kd) is None
    same = np.zeros((n_stream, 1, 1, n_kv), np.float32)
    same[..., 256:1024] = -np.inf                       # the same whole tiles hidden in every stream
    differ = same.copy()
    for s in range(n_stream):                           # each stream's own length
        differ[s, ..., n_kv - 97 * s - 1:] = -np.inf if s else 0.0
    dq = cp.asarray(q)
    for mask in (None, same.astype(np.float16), differ.astype(np.float16)):
        exact = reference.flash_attn_ext(q, deq[0], deq[1], mask, 0.1)
        dm = cp.asarray(mask) if mask is not None else None
        tm = from_array(dm) if mask is not None else None
        plans = [None] if mask is None else [None, cb.make_plan(tm, 1, n_head, n_head_kv, kv_type=kv_type)]
        for plan in plans:
            dst = cp.full((n_stream, 1, n_head, 128), cp.nan, dtype=cp.float32)
            call = cb.bind(from_array(dq), kd, vd, tm, None, from_array(dst), 0.1, kernel="decode-tma", plan=plan)
            assert call.kern == "decode-tma"
            call.launch()
            out = dst.get()
            err = reference.nmse(out, exact)
            assert np.isfinite(out).all() and err <= NMSE_MAX, (mask is not None, plan is not None, err)
    cb._PREPARED.clear()
    del keep


@pytest.mark.skipif(not _is_sm90(), reason="sm_90a decode: compute capability 9.0")
@pytest.mark.parametrize("kv_type, config", QUANT_CONFIGS, ids=QUANT_CONFIG_IDS)
def test_decode_tma_hidden_blocks_may_hold_nan(kv_type, config, monkeypatch):
    """Cells no row sees (a cache's unused cells: -inf for every row, inside a tile that has
    visible cells) whose blocks hold a NaN scale and garbage quants in K and V: through a plan
    (its HIDDEN tiles) the output is finite and right."""
    import cupy as cp
    from ggml_attn import cuda_launch as L
    monkeypatch.setattr(L, "DECODE_TMA_CONFIG", config)
    cb._PREPARED.clear()
    rng = np.random.default_rng(7 + kv_type)
    n_batch, n_kv, n_head, n_head_kv, d = 2, 3000, 32, 8, 128
    q, (kd, vd), deq, keep = _packed_inputs(rng, kv_type, n_batch, n_kv, n_head, n_head_kv, pad=16)
    hidden = np.r_[100:128, 700:705, 2990:3000]   # parts of tiles 1, 10 and 46 (the tail)
    m = np.zeros((1, 1, n_batch, n_kv), np.float32)
    m[..., hidden] = -np.inf
    mask = m.astype(np.float16)
    exact = reference.flash_attn_ext(q, deq[0], deq[1], mask, 0.1)
    blk = {GGML_TYPE_Q8_0: 34, GGML_TYPE_Q4_0: 18}[kv_type]
    for dev in keep:                                 # NaN scales, 0xFF quants, every head
        rows = dev[hidden, :n_head_kv * d // 32 * blk].reshape(len(hidden), -1, blk)
        rows[...] = 0xFF
        rows[..., 0], rows[..., 1] = 0x00, 0x7E      # f16 NaN
        dev[hidden, :n_head_kv * d // 32 * blk] = rows.reshape(len(hidden), -1)
    dq, dm = cp.asarray(q), cp.asarray(mask)
    tm = from_array(dm)
    plan = cb.make_plan(tm, n_batch, n_head, n_head_kv, kv_type=kv_type)
    dst = cp.full((1, n_batch, n_head, d), cp.nan, dtype=cp.float32)
    call = cb.bind(from_array(dq), kd, vd, tm, None, from_array(dst), 0.1, kernel="decode-tma", plan=plan)
    _launch_within_bound(call, dst, exact)
    del keep


@pytest.mark.parametrize("kv_type", GPU_QUANT, ids=["q8_0", "q4_0"])
@pytest.mark.parametrize("n_batch, n_kv, d, kernels", [
    (512, 1500, 128, ("auto", "prefill", "prefill-wgmma")), (64, 777, 128, ("auto", "prefill", "decode-tc")),
    (300, 1000, 64, ("auto", "prefill"))])
def test_tensor_core_kernels_on_f16_copies(kv_type, n_batch, n_kv, d, kernels):
    """Prompt-sized calls on q8_0/q4_0 K/V: the tensor-core kernels read f16 copies made by
    fattn_dequant_kv before them (a causal mask through a plan, and a bound call's replay), right
    against float64 on the dequantized values; the copy is what the blocks hold, bit for bit."""
    import cupy as cp
    if not _is_sm90():
        kernels = tuple(k for k in kernels if k != "prefill-wgmma")
    rng = np.random.default_rng(n_batch + d + kv_type)
    n_head, n_head_kv = 16, 4
    q, (kd, vd), deq, keep = _packed_inputs(rng, kv_type, n_batch, n_kv, n_head, n_head_kv, pad=2, d=d)
    m = np.zeros((1, 1, n_batch, n_kv), np.float32)
    m[0, 0] = np.where(np.arange(n_kv)[None, :] <= n_kv - n_batch + np.arange(n_batch)[:, None], 0, -np.inf)
    mask = m.astype(np.float16)
    exact = reference.flash_attn_ext(q, deq[0], deq[1], mask, 0.1)
    dq, dm = cp.asarray(q), cp.asarray(mask)
    tm = from_array(dm)
    plan = cb.make_plan(tm, n_batch, n_head, n_head_kv, head_dim_k=d, kv_type=kv_type)
    for kernel in kernels:
        dst = cp.full((1, n_batch, n_head, d), cp.nan, dtype=cp.float32)
        call = cb.bind(from_array(dq), kd, vd, tm, None, from_array(dst), 0.1, kernel=kernel, plan=plan)
        assert call.kern not in ("reference", "decode", "decode-tma") and (kernel == "auto" or call.kern == kernel)
        assert len(call._pre) == 2   # the two copies
        call.launcher()()
        out = dst.get()
        err = reference.nmse(out, exact)
        assert np.isfinite(out).all() and err <= NMSE_MAX, (kernel, call.kern, err)
    # the copies hold the dequantized values exactly (one f16 rounding of d * q)
    from ggml_attn import cuda_workspace
    ws = cuda_workspace.WORKSPACES.workspace(cp.cuda.runtime.getDevice(), cp.cuda.get_current_stream().ptr)
    base, buf = ws.converted(0)
    cp.cuda.get_current_stream().synchronize()
    k16 = buf[:2 * d * n_kv * n_head_kv].view(cp.float16).get().reshape(1, n_head_kv, n_kv, d)
    assert np.array_equal(k16, deq[0].astype(np.float16))
    del keep


MIXED = [c for c in conf.grid(kv_types=GPU_QUANT + (GGML_TYPE_F16,))
         if getattr(c, "v_type", None) not in (None, c.kv_type) and not c.nonfinite
         and {c.kv_type, c.v_type} <= {GGML_TYPE_F16, *GPU_QUANT}]


def test_grid_has_mixed_pairs():
    assert len(MIXED) >= 4 and any(GGML_TYPE_F16 in (c.kv_type, c.v_type) for c in MIXED)


@pytest.mark.parametrize("case", MIXED, ids=[c.id for c in MIXED])
def test_mixed_kv_types_on_f16_copies(case):
    """K and V of different types (f16 beside q8_0 / q4_0, or those two): the quantized one read
    through its f16 copy by every kernel (auto's and the tensor-core prefill), against ggml's CPU
    result and float64; the kernels that read blocks themselves refuse the pair, naming it."""
    import cupy as cp
    descs, keep, ggml_out, exact = _grid_inputs(case)
    for kernel in ("auto", "prefill"):
        dst = cp.full(exact.shape, cp.nan, dtype=cp.float32)
        call = cb.bind(*descs, from_array(dst), case.scale, case.max_bias, case.logit_softcap, kernel=kernel)
        n_quant = sum(t in GPU_QUANT for t in (case.kv_type, case.v_type))   # one copy per quantized tensor
        assert call.kern in cb.dispatch.GPU_KERNELS and len(call._pre) == n_quant, (kernel, call.kern)
        call.launch()
        out = dst.get()
        assert np.isfinite(out).all(), f"{kernel}: unwritten or non-finite output"
        assert reference.nmse(out, exact) <= NMSE_MAX, (kernel, "vs float64", reference.nmse(out, exact))
        assert reference.nmse(out, ggml_out) <= NMSE_MAX, (kernel, "vs ggml", reference.nmse(out, ggml_out))
    dst = cp.full(exact.shape, cp.nan, dtype=cp.float32)
    with pytest.raises(ValueError, match="reads K and V of one type"):
        cb.bind(*descs, from_array(dst), case.scale, case.max_bias, case.logit_softcap, kernel="decode")


@pytest.mark.skipif(not _is_sm90(), reason="sm_90a decode: compute capability 9.0")
@pytest.mark.parametrize("k_type, v_type", [(GGML_TYPE_Q8_0, GGML_TYPE_F16), (GGML_TYPE_F16, GGML_TYPE_Q4_0),
                                            (GGML_TYPE_Q4_0, GGML_TYPE_Q8_0)])
def test_mixed_pair_on_the_sm90a_decode(k_type, v_type):
    """A long decode row (B=1, 33000 cells) of K and V of different types: auto runs the sm_90a
    decode on f16 copies of the quantized ones (before the fix its block-reading instance was
    bound to the pair and the TMA map of the other type refused it), against float64."""
    import cupy as cp
    cb._PREPARED.clear()
    rng = np.random.default_rng(k_type * 7 + v_type)
    n_batch, n_kv, n_head, n_head_kv = 1, 33000, 32, 8
    q = rng.standard_normal((1, n_head, n_batch, 128), dtype=np.float32)
    descs, exact_kv, keep = [], [], []
    for i, t in enumerate((k_type, v_type)):
        if t == GGML_TYPE_F16:
            f = rng.standard_normal((1, n_head_kv, n_kv, 128)).astype(np.float16)
            keep.append(cp.asarray(f))
            descs.append(from_array(keep[-1], GGML_TYPE_F16))
            exact_kv.append(f.astype(np.float32))
        else:   # a cache view of t (the i-th of the K/V pair _packed_inputs makes)
            _, views, deq, kp = _packed_inputs(rng, t, n_batch, n_kv, n_head, n_head_kv, pad=16)
            descs.append(views[i])
            exact_kv.append(deq[i])
            keep += kp
    exact = reference.flash_attn_ext(q, exact_kv[0], exact_kv[1], None, 0.1)
    dst = cp.full((1, n_batch, n_head, 128), cp.nan, dtype=cp.float32)
    call = cb.bind(from_array(cp.asarray(q)), descs[0], descs[1], None, None, from_array(dst), 0.1)
    assert call.kern == "decode-tma" and len(call._pre) == sum(t != GGML_TYPE_F16 for t in (k_type, v_type))
    _launch_within_bound(call, dst, exact)
    del keep
