"""The GEMMs' F16 input made by its producer on device graphs (graph/xp_matmul.py, graph/q8_handoff.py's
F16 form), without a GPU: the launches recorded (tests/test_xp_ops_block_launches.py's fakes). Past
the GEMVs the RMS norm writes the F16 input of GEMMs that read F16 only (no F32 copy, no cast
launch), and the gated FFN's product writes its F16 form beside its F32 result for the down
projection's GEMM, which reads it instead of casting; where a GEMM quantizes its F32 input
(``gemm-q8``) or a GEMV reads F32, both stay F32."""
import numpy as np
import pytest

from ggml_attn import matmul_dispatch as md
from ggml_attn.graph import q8_handoff, xp_matmul
from test_xp_ops_block_launches import Dev, _qmatrix, graph_nodes, launches  # noqa: F401 (fixtures)


def _path_gemm(monkeypatch):
    for knob in ("QGEMM_MAX_TOKENS", "QSGEMM_MAX_TOKENS", "QRGEMM_MAX_TOKENS", "Q8GEMM_MAX_TOKENS"):
        monkeypatch.setattr(md, knob, 0)   # 33 tokens: dequantize + cuBLAS


def _named(launches, name):
    return [ln for ln in launches if getattr(ln, "fn", None) != "gemm" and ln.fn.name == name]


def _gemm_inputs(launches):
    return [ln.args[3] for ln in launches if getattr(ln, "fn", None) == "gemm"]


@pytest.mark.parametrize("kind", ["Q4_K", "F16"])
def test_norm_writes_the_gemms_f16_input(launches, monkeypatch, kind):  # noqa: F811
    """mul_mat_group with a norm at 33 tokens: one dense_rms_norm launch whose F32 output is null
    and whose F16 output every GEMM reads; no cast."""
    _path_gemm(monkeypatch)
    GraphB, node = graph_nodes(monkeypatch)
    b = GraphB()
    scratch = Dev((512 * 64,), np.float16)
    ws = ([_qmatrix(kind, 64, 512, scratch), _qmatrix(kind, 32, 512, scratch)] if kind != "F16"
          else [Dev((64, 512), np.float16), Dev((32, 512), np.float16)])
    if kind == "F16":
        monkeypatch.setattr(xp_matmul, "_CublasGemm", _gemm_recorder(launches))
    g = Dev((512,))
    xp_matmul.mul_mat_group(b, ws, node(Dev((33, 512))), "qkv", norm_eps=1e-5, norm_w=g)
    (norm,) = _named(launches, "dense_rms_norm")
    x, y, n, eps, gw, y16 = (a.value for a in norm.params)
    assert y == 0 and y16 != 0 and n == 512 and gw == (g.data.ptr if kind != "F16" else 0)
    assert not _named(launches, "dense_cast_f16")
    ins = _gemm_inputs(launches)
    assert len(ins) == 2 and set(ins) == {y16}


def _gemm_recorder(launches):
    """CublasGemm(w, x16, out, beta) recorded as the launches fixture records of_ptrs."""
    from types import SimpleNamespace

    def gemm(w, x16, out, beta=0.0):
        launches.append(SimpleNamespace(fn="gemm", args=(w.data.ptr, w.shape[0], w.shape[1], x16.data.ptr,
                                                         x16.shape[0], out.data.ptr, out.shape[1], beta)))
        return lambda: None
    return gemm


def test_gated_product_hands_its_f16_form_to_the_down_gemm(launches, monkeypatch):  # noqa: F811
    """mul_mat_gated(down=wd) at 33 tokens writes silu(g)·u in F32 and F16 in one launch; the down
    projection's GEMM reads the F16 form, no cast launched for it."""
    _path_gemm(monkeypatch)
    GraphB, node = graph_nodes(monkeypatch)
    b = GraphB()
    scratch = Dev((512 * 256,), np.float16)
    wg, wu, wd = (_qmatrix("Q4_K", 256, 512, scratch), _qmatrix("Q4_K", 256, 512, scratch),
                  _qmatrix("Q4_K", 512, 256, scratch))
    h = xp_matmul.mul_mat_gated(b, wg, wu, node(Dev((33, 512))), "ffn", norm_eps=1e-5, norm_w=Dev((512,)), down=wd)
    (act,) = _named(launches, "dense_silu_mul")
    gp, up, y, y16, n = (a.value for a in act.params)
    assert y == b.array(h).data.ptr and y16 != 0 and n == 33 * 256
    assert b.f16_forms[__import__("ctypes").addressof(h.contents)].data.ptr == y16
    before = len(launches)
    xp_matmul.mul_mat_add(b, wd, h, node(Dev((33, 512))), "down")
    down = launches[before:]
    assert not _named(down, "dense_cast_f16") and _gemm_inputs(down) == [y16]


def test_f32_stays_where_a_reader_needs_it(launches, monkeypatch):  # noqa: F811
    """Under Q8GEMM_MAX_TOKENS the block GEMM quantizes the F32 input: the norm writes F32 and the
    gated product no F16 form; at GEMV token counts no F16 form either."""
    _path_gemm(monkeypatch)
    monkeypatch.setattr(md, "Q8X_MAX_TOKENS", 4)
    monkeypatch.setattr(md, "Q8GEMM_MAX_TOKENS", 64)
    GraphB, node = graph_nodes(monkeypatch)
    b = GraphB()
    scratch = Dev((512 * 256,), np.float16)
    wg, wu, wd = (_qmatrix("Q4_K", 256, 512, scratch), _qmatrix("Q4_K", 256, 512, scratch),
                  _qmatrix("Q4_K", 512, 256, scratch))
    assert not q8_handoff.reads_f16([wg], 33) and q8_handoff.reads_f16([wg], 65)
    xp_matmul.mul_mat_gated(b, wg, wu, node(Dev((33, 512))), "ffn", norm_eps=1e-5, norm_w=Dev((512,)), down=wd)
    (norm,) = _named(launches, "dense_rms_norm")
    assert norm.params[1].value != 0 and norm.params[5].value == 0
    (act,) = _named(launches, "dense_silu_mul")
    assert act.params[3].value == 0 and not b.f16_forms
    assert q8_handoff.f16_for(b, wd, 2, (2, 256)) is None   # a GEMV reads F32
    assert q8_handoff.f16_for(b, None, 65, (65, 256)) is None
    assert q8_handoff.f16_for(b, wd, 65, (65, 256)).dtype == np.float16


def test_the_int8_gemm_refuses_an_f16_only_input(launches, monkeypatch):  # noqa: F811
    """_qmatmuls given only the F16 form where a weight's path quantizes F32 activations: a clear
    error, not a launch over a null pointer."""
    _path_gemm(monkeypatch)
    monkeypatch.setattr(md, "Q8X_MAX_TOKENS", 4)
    monkeypatch.setattr(md, "Q8GEMM_MAX_TOKENS", 64)
    w = _qmatrix("Q4_K", 256, 512)
    with pytest.raises(ValueError, match="quantizes F32 activations"):
        xp_matmul._qmatmuls(graph_nodes(monkeypatch)[0](), [w], None, [Dev((33, 256))], x16=Dev((33, 512), np.float16))
