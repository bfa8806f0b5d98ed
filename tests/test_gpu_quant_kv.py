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
from ggml_attn import reference
from ggml_attn.dtypes import GGML_TYPE_Q4_0, GGML_TYPE_Q8_0
from ggml_attn.quant import dequantize_rows, quantize
from ggml_attn.tensor import TensorDesc, from_array, from_ggml
from ggml_build import build_case, case_bytes, get_data, ggml_reference_node, graph_of, new_context

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ggml_attn.gpu_available(), reason="needs a CUDA GPU")]
NMSE_MAX = 5e-4
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


def test_grid_has_the_gpu_types():
    assert len(CASES) == 2 * 336 and {c.kv_type for c in CASES} == set(GPU_QUANT)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_quantized_grid_on_the_gpu(case, request):
    n = request.config.getoption("--grid-sample", default=0)
    if n and zlib.crc32(case.id.encode()) % max(1, len(CASES) // n):
        pytest.skip("not in --grid-sample")
    import cupy as cp
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
    for kernel in ("decode", "auto"):
        dst = cp.full(exact.shape, cp.nan, dtype=cp.float32)
        call = cb.bind(*descs, from_array(dst), case.scale, case.max_bias, case.logit_softcap, kernel=kernel)
        assert call.kern == "decode", f"{kernel} chose {call.kern}"   # not the reference fallback
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
