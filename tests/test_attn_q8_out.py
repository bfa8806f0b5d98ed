"""The attention's output in 8-bit form (ggml_attn/q8_out.py, ``flash_attn_ext(q8_out=...)``,
``matmul_dispatch.ATTN_QUANT_OUT``), its host side without a GPU: the op's argument checks and its
refusal on host data, where the fused epilogue runs (``q8_out.fused``), the fallback launch's
grid and parameters, and the model graph's handoff to the O projection (graph/q8_handoff.py): the
O projection quantizes nothing where the attention made the form, and its GEMV reads the
attention's arrays. The kernels' bits: tests/test_gpu_kernels.py (gpu-marked)."""
import ctypes
from types import SimpleNamespace

import ggml
import numpy as np
import pytest

import ggml_attn
from ggml_attn import kernels as K
from ggml_attn import matmul_dispatch as md
from ggml_attn import op, q8_out
from ggml_attn.graph import q8_handoff, xp_matmul
from ggml_build import build_case, case_bytes, graph_of, new_context
from ggml_attn.conformance import FACase, make_inputs
from test_xp_ops_block_launches import Dev, _qmatrix, graph_nodes, launches  # noqa: F401 (the fixture)

CASE = FACase(hsk=64, hsv=64, n_head_kv=2, gqa=2, ne3=1, n_kv=128, n_batch=4, mask=True, sinks=False,
              max_bias=0.0, logit_softcap=0.0, kv_type=ggml.GGML_TYPE_F16)
N_ROWS, N = CASE.n_batch * CASE.ne3, CASE.hsv * CASE.n_head_kv * CASE.gqa   # dst's rows as (n_rows, n)


class FakePlan:
    """What flash_attn_ext asks of a plan at build time."""

    def matches(self, mask, n_batch):
        return True


def _arrays(n_rows=N_ROWS, n=N, dts=(np.int8, np.float32, np.float32)):
    return (Dev((n_rows, n), dts[0]), Dev((n_rows, n // 32), dts[1]), Dev((n_rows, n // 32), dts[2]))


@pytest.fixture
def case():
    x = make_inputs(CASE, np.random.default_rng(3))
    ctx = new_context(case_bytes(CASE) + (1 << 20))
    yield ctx, build_case(ctx, CASE, x)
    op.set_backend("auto")
    ggml.ggml_free(ctx)


def test_check_arrays_takes_the_three_device_arrays_of_the_output():
    arrs = _arrays()
    got = q8_out.check_arrays(arrs, N_ROWS, N)
    assert (got.q, got.d, got.s, got.n_values) == (*(a.data.ptr for a in arrs), N_ROWS * N)
    for bad, msg in [(arrs[:2], "three arrays"), ("xyz", "three arrays"),
                     ((np.zeros((N_ROWS, N), np.int8), *arrs[1:]), "xq: a device"),
                     (_arrays(n_rows=N_ROWS + 1), "xq: int8"),
                     (_arrays(dts=(np.int8, np.float16, np.float32)), "xd: float32"),
                     ((arrs[0], arrs[1], Dev(None, base=np.zeros((N // 32, N_ROWS), np.float32).T)), "not C-contiguous")]:
        with pytest.raises(ValueError, match=msg):
            q8_out.check_arrays(bad, N_ROWS, N)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        q8_out.check_arrays(_arrays(n=40), N_ROWS, 40)


def test_flash_attn_ext_checks_q8_out_at_build_time(case):
    ctx, (q, k, v, mask, _) = case
    with pytest.raises(ValueError, match="q8_out= needs plan="):
        ggml_attn.flash_attn_ext(ctx, q, k, v, mask, CASE.scale, q8_out=_arrays())
    with pytest.raises(ValueError, match=r"flash_attn_ext: q8_out xq: int8 \(4, 256\)"):
        ggml_attn.flash_attn_ext(ctx, q, k, v, mask, CASE.scale, plan=FakePlan(), q8_out=_arrays(n=512))
    plan, arrs = FakePlan(), _arrays()
    node = ggml_attn.flash_attn_ext(ctx, q, k, v, mask, CASE.scale, plan=plan, q8_out=arrs)
    assert op.spec_of(node).q8 == q8_out.Q8Out(*(a.data.ptr for a in arrs), N_ROWS * N)
    assert op.spec_of(ggml_attn.flash_attn_ext(ctx, q, k, v, mask, CASE.scale, plan=plan)).q8 is None


def test_q8_out_on_host_data_is_an_error_of_the_compute_not_a_silent_skip(case):
    """A node asked for the 8-bit form whose tensors are host memory (its arrays are the device's):
    the compute raises, the output is NaN -- never an 8-bit form left unwritten behind a result."""
    ctx, (q, k, v, mask, _) = case
    plan = FakePlan()
    node = ggml_attn.flash_attn_ext(ctx, q, k, v, mask, CASE.scale, plan=plan, q8_out=_arrays())
    op.set_backend("reference")
    with pytest.raises(ggml_attn.FlashAttnError, match="device graphs only"):
        ggml_attn.compute_graph(ctx, graph_of(ctx, node), 1)
    out = np.ctypeslib.as_array(ctypes.cast(node.contents.data, ctypes.POINTER(ctypes.c_float)), (N_ROWS * N,))
    assert np.isnan(out).all()


@pytest.mark.parametrize("kern, n_splits, dv, fuse, want", [
    ("cells", 1, 128, True, True), ("cells", 2, 128, True, False), ("cells", 1, 80, True, False),
    ("decode-tma", 1, 128, True, False), ("prefill-wgmma", 1, 128, True, False), ("cells", 1, 128, False, False)])
def test_only_the_cell_list_kernel_over_one_split_fuses(monkeypatch, kern, n_splits, dv, fuse, want):
    monkeypatch.setattr(q8_out, "FUSE", fuse)
    assert q8_out.fused(kern, n_splits, dv) is want


def test_the_fallback_launch_quantizes_dst_a_warp_a_group(monkeypatch):
    seen = {}

    def get_function(variant, name):
        seen["variant"], seen["name"] = variant, name
        return SimpleNamespace(bound=lambda grid, block, stream, *args: (grid, block, stream, [a.value for a in args]))
    monkeypatch.setattr(K, "get_function", get_function)
    q8 = q8_out.Q8Out(0x1000, 0x2000, 0x3000, 3 * 4096)
    grid, block, stream, args = q8_out.quant_launch(q8, 0x4000, 77)
    assert seen == {"variant": K.util_variant(), "name": "fattn_quant_q8x"}
    assert "fattn_quant_q8x" in K.util_variant().names
    assert grid == (3 * 4096 // 32 // 8, 1, 1) and block == (256, 1, 1) and stream == 77   # 8 warps a block
    assert args == [0x4000, 3 * 4096, 0x1000, 0x2000, 0x3000]


def test_set_params_rides_in_the_fields_one_split_leaves_unused():
    p = K.FattnParams()
    q8_out.set_params(p, q8_out.Q8Out(11, 22, 33, 64))
    assert (p.ws_o, p.ws_ml, p.split_cnt) == (11, 22, 33)


def test_qo_instances_are_the_cell_kernels_with_the_flag():
    v = K.cells_qo_variant(128, 128, ggml.GGML_TYPE_F16)
    plain = K.cells_variant(128, 128, ggml.GGML_TYPE_F16)
    assert v.family == "cells-qo" and v.source == plain.source == "fattn_cells.cu"
    assert v.names == tuple(n[:-1] + ", 1>" for n in plain.names) and K.cells_qo_of(plain) == v
    assert v in K.all_variants()
    with pytest.raises(ValueError, match="multiple of 32"):
        K.cells_qo_variant(80, 80, ggml.GGML_TYPE_F16)


def test_the_o_projection_reads_the_attentions_8_bit_form(launches, monkeypatch):
    """graph/q8_handoff.py with ATTN_QUANT_OUT: arrays for the attention where the O projection
    runs the 8-bit GEMV (none for F16 weights, more tokens than the GEMV takes, or with the knob
    off), and its residual add launches no quantization and reads them."""
    GraphB, node = graph_nodes(monkeypatch)
    n = 256
    wo = _qmatrix("Q4_K", n, n)

    def o_projection(b, n_tok=1):
        att_q8 = q8_handoff.attention_arrays(b, wo, n_tok, n)
        att = q8_handoff.remember(b, node(Dev((n_tok, n))), att_q8, None, None)
        xp_matmul.mul_mat_add(b, wo, att, node(Dev((n_tok, n))), "wo_res")
        return att_q8, [(ln.fn.name, ln.params) for ln in launches]

    monkeypatch.setattr(md, "ATTN_QUANT_OUT", True)
    att_q8, got = o_projection(GraphB())
    assert att_q8 is not None and [a.shape for a in att_q8] == [(1, n), (1, n // 32), (1, n // 32)]
    assert [a.dtype for a in att_q8] == [np.int8, np.float32, np.float32]
    assert [name for name, _ in got] == ["dense_gemv_q8x_v<12, 1, 2>"], got     # no dense_quant_q8x
    (p,) = got[0][1]
    assert (p.xq, p.xd, p.xs) == tuple(a.data.ptr for a in att_q8)
    assert q8_handoff.attention_arrays(GraphB(), Dev((n, n), np.float16), 1, n) is None   # F16 weights
    assert q8_handoff.attention_arrays(GraphB(), wo, 1, n + 16) is None                   # not whole groups
    many = md.Q8X_MAX_TOKENS + 1
    assert md.best_matmul("Q4_K", many).path != "gemv-q8x"
    assert q8_handoff.attention_arrays(GraphB(), wo, many, n) is None                     # not the 8-bit GEMV
    launches.clear()
    monkeypatch.setattr(md, "ATTN_QUANT_OUT", False)
    att_q8, got = o_projection(GraphB())
    assert att_q8 is None and [name for name, _ in got] == ["dense_quant_q8x", "dense_gemv_q8x_v<12, 1, 2>"], got


def test_q8_form_is_the_kernels_rounding_in_numpy():
    """quant.q8_form, the reference of every 8-bit form (the GPU tests compare the kernels' bits
    with it): per 32 values d = max|v| / 127 in F32, q = round(v / d) ties to even, 0 for an all-zero
    group, s the sum of q; q8_activations is q * d."""
    from ggml_attn.quant import q8_activations, q8_form
    v = np.zeros((2, 64), np.float32)
    v[0, :32] = np.arange(32) - 15.5          # max 15.5: d = 15.5 / 127; v / d ties at +-0.5 steps
    v[1, 32:] = 2.5
    v[1, 32] = 127.0                          # d = 1: 2.5 rounds to 2 (ties to even)
    q, d, s = q8_form(v)
    assert q.dtype == np.int8 and d.dtype == s.dtype == np.float32 and q.shape == (2, 64) and d.shape == (2, 2)
    assert d[0, 1] == 0 and not q[0, 32:].any() and s[0, 1] == 0                      # a zero group
    assert d[1, 1] == 1 and q[1, 32] == 127 and (q[1, 33:] == 2).all() and s[1, 1] == 127 + 2 * 31
    d0 = np.float32(15.5) / np.float32(127)
    assert d[0, 0] == d0 and np.array_equal(q[0, :32], np.rint(v[0, :32] / d0).astype(np.int8))
    assert s[0, 0] == q[0, :32].astype(np.int32).sum()
    assert np.array_equal(q8_activations(v), (q.astype(np.float32).reshape(2, 2, 32) * d[..., None]).reshape(2, 64))
    with pytest.raises(ValueError, match="multiple of 32"):
        q8_form(np.zeros((1, 40), np.float32))
