"""dense_gemm_qrg (cuda/dense_q.cu's dense_gemm_qr<T, 64, 2, 1>: a gated FFN's gate and up
products in one launch), its host side without a GPU: its tile and grid (gemm_tiles), where it
is routed (matmul_dispatch.gated_kernel), its launch's parameter block and split sum
(graph/tiled_gemm.gemm_qrg_launch), what that launch refuses, and the model graph's gated node
with it (one norm launch, one GEMM, no activation launch, the F16 form for the down GEMM). The
kernel's numbers: tests/test_gpu_dense_q.py."""
import ctypes

import numpy as np
import pytest

from ggml_attn import kernels as K
from ggml_attn import matmul_dispatch as md
from ggml_attn.block_types import block_layout
from ggml_attn.graph import tiled_gemm, xp_matmul
import test_xp_ops_block_launches as blocks
from test_xp_ops_block_launches import Dev, _qmatrix, graph_nodes

launches = blocks.launches   # (its fixture: the kernels' lookups and launches recorded)


@pytest.fixture()
def gated_on(monkeypatch):
    """QR_GATED on an sm_90 GPU of 132 SMs, up to 128 tokens (the A/B's range past the narrow tile)."""
    from ggml_attn import cuda_device
    monkeypatch.setattr(md, "QR_GATED", True)
    monkeypatch.setattr(md, "QR_GATED_MAX_TOKENS", 128)
    monkeypatch.setattr(md, "_hopper", lambda: True)
    monkeypatch.setattr(cuda_device, "num_sms", lambda: 132)


def test_qrg_tile_and_grid_count_the_gate_rows():
    """Its tile as gemm_q_grid counts it: 128 rows of each matrix (256 a block), 64 tokens, one
    block an SM. An 8B FFN at 64 tokens: 112 blocks of 16 steps, no split (two splits would take
    two waves of 8: as long, and a sum launch more); a small FFN splits down to
    GEMMQR_MIN_SPLIT as dense_gemm_qr's matrices do; every value in exactly one split."""
    assert K.gemm_tiling("dense_gemm_qrg", 64) == (K.GEMMQRG_TILE, 1, K.GEMMQ8_MIN_SPLIT) == \
        ((128, 64, 256), 1, K.GEMMQ8_MIN_SPLIT)
    assert K.gemm_qs_bn(17, "dense_gemm_qrg") == K.gemm_qs_bn(64, "dense_gemm_qrg") == 64
    with pytest.raises(ValueError, match="64 tokens"):
        K.gemm_tiling("dense_gemm_qrg", 32, 32)
    assert K.gemm_q_grid(14336, 64, 4096, 132, "dense_gemm_qrg") == ((112, 1, 1), 4096)
    assert K.gemm_q_grid(14336, 17, 4096, 132, "dense_gemm_qrg") == ((112, 1, 1), 4096)
    (gm, gn, gz), kc = K.gemm_q_grid(1024, 64, 4096, 132, "dense_gemm_qrg")
    assert (gm, gn) == (8, 1) and gz > 1 and gm * gz <= 132 and kc == 256
    for rows, n_in in ((300, 768), (4096, 14336), (28672, 8192)):
        (gm, gn, gz), kc = K.gemm_q_grid(rows, 70, n_in, 132, "dense_gemm_qrg")
        assert gm == -(-rows // 128) and gn == 2 and kc % 256 == 0 and gz * kc >= n_in > (gz - 1) * kc
    assert K.staged_instance("dense_gemm_qrg", 12, 64) == "dense_gemm_qr<12, 64, 2, 1>"
    assert K.dense_qrg_variant(14).names == ("dense_gemm_qr<14, 64, 2, 1>", "dense_splitk_gated")
    with pytest.raises(ValueError, match="decodes"):
        K.dense_qrg_variant(block_layout("Q3_K").type_id)
    assert "dense_gemm_qrg" in K.STAGED_GEMMS and "dense_gemm_qrg" not in K.GEMMQR_KERNELS


def test_gated_kernel_where_it_runs(monkeypatch):
    """On as shipped at the narrow tile's tokens (measured faster there, slower past them): both
    matrices of one type that takes dense_gemm_qr, on its path (from 9 tokens) up to
    QR_GATED_MAX_TOKENS, rows aligned, on an sm_90 GPU; nowhere else. The knob's bound moves it."""
    monkeypatch.setattr(md, "_hopper", lambda: True)
    assert md.QR_GATED is True and md.QR_GATED_MAX_TOKENS == K.GEMMQR_NARROW_MAX_TOKENS
    assert [md.gated_kernel("Q4_K", "Q4_K", n) for n in (1, 8, 9, 12, 16, 17, 64, 128)] == \
        [None] * 2 + ["dense_gemm_qrg"] * 3 + [None] * 3
    assert md.gated_kernel("Q6_K", "Q6_K", 16) == md.gated_kernel("Q8_0", "Q8_0", 9) == "dense_gemm_qrg"
    assert md.gated_kernel("Q4_K", "Q6_K", 16) is None            # (two types: two programs)
    assert md.gated_kernel("Q3_K", "Q3_K", 16) is None            # (dense_gemm_qs's type)
    assert md.gated_kernel("F16", "F16", 16) is None
    assert md.gated_kernel("Q4_K", "Q4_K", 16, aligned=False) is None
    monkeypatch.setattr(md, "QR_GATED_MAX_TOKENS", 128)            # (the A/B past the narrow tile)
    assert [md.gated_kernel("Q4_K", "Q4_K", n) for n in (17, 64, 128, 129, 512)] == ["dense_gemm_qrg"] * 3 + [None] * 2
    monkeypatch.setattr(md, "QR_GATED", False)
    assert md.gated_kernel("Q4_K", "Q4_K", 16) is None and not md.qr_gated()
    monkeypatch.setattr(md, "QR_GATED", True)
    monkeypatch.setattr(md, "_hopper", lambda: False)               # (its stages: up to 207 KB of shared memory)
    assert md.gated_kernel("Q4_K", "Q4_K", 16) is None and not md.qr_gated()


@pytest.mark.parametrize("n_ff, n_tok, with16", [(14336, 64, True), (1024, 40, True), (1024, 64, False)])
def test_gemm_qrg_launch_parameters_and_split_sum(launches, gated_on, n_ff, n_tok, with16):
    """One dense_gemm_qr<T, 64, 2, 1> launch on gemm_q_grid's grid for the gate's rows: w the gate's
    blocks, w2 the up's, out and out16 (0 without), the partial sums where it splits; then, split,
    one dense_splitk_gated over every output (part, out, out16, n, splits) from the same program."""
    n_in = 4096
    wg, wu = _qmatrix("Q4_K", n_ff, n_in), _qmatrix("Q4_K", n_ff, n_in)
    x16, out = Dev((n_tok, n_in), np.float16), Dev((n_tok, n_ff))
    out16 = Dev((n_tok, n_ff), np.float16) if with16 else None
    grid, k_chunk = K.gemm_q_grid(n_ff, n_tok, n_in, 132, "dense_gemm_qrg")
    part = Dev((grid[2], 2, n_tok, n_ff)) if grid[2] > 1 else None
    tiled_gemm.gemm_qrg_launch(wg, wu, x16, out, out16, part)()
    gemm, *rest = launches
    assert gemm.fn.name == "dense_gemm_qr<12, 64, 2, 1>" and gemm.fn.variant == K.dense_qrg_variant(12)
    assert gemm.grid == grid and gemm.block == (K.GEMMQS_THREADS, 1, 1) and gemm.fn.smem is None
    (p,) = gemm.params
    assert (p.w, p.w2, p.x, p.out, p.out16) == (wg.blocks.data.ptr, wu.blocks.data.ptr, x16.data.ptr, out.data.ptr,
                                                out16.data.ptr if with16 else 0)
    assert (p.row_bytes, p.rows, p.n_in, p.n_tok, p.k_chunk) == (wg.row_bytes, n_ff, n_in, n_tok, k_chunk)
    assert (p.part != 0) == (grid[2] > 1) == bool(rest)
    if rest:
        (s,) = rest
        assert s.fn.name == "dense_splitk_gated" and s.fn.variant == K.dense_qrg_variant(12)
        src, dst, d16, n, z = (a.value for a in s.params)
        assert (src, dst, d16 or 0, n, z) == (part.data.ptr, out.data.ptr, out16.data.ptr if with16 else 0,
                                              n_tok * n_ff, grid[2])


def test_gemm_qrg_launch_refuses_what_it_cannot_run(launches, gated_on):
    n_ff, n_in, n_tok = 1024, 4096, 64
    wg = _qmatrix("Q4_K", n_ff, n_in)
    x16, out = Dev((n_tok, n_in), np.float16), Dev((n_tok, n_ff))
    grid, _ = K.gemm_q_grid(n_ff, n_tok, n_in, 132, "dense_gemm_qrg")
    part = Dev((grid[2], 2, n_tok, n_ff))
    for wu, match in ((_qmatrix("Q6_K", n_ff, n_in), "differ"), (_qmatrix("Q4_K", 512, n_in), "differ")):
        with pytest.raises(ValueError, match=match):
            tiled_gemm.gemm_qrg_launch(wg, wu, x16, out, None, part)
    q3 = _qmatrix("Q3_K", n_ff, n_in)
    with pytest.raises(ValueError, match="it reads"):
        tiled_gemm.gemm_qrg_launch(q3, q3, x16, out, None, part)
    wu = _qmatrix("Q4_K", n_ff, n_in)
    with pytest.raises(ValueError, match="C-contiguous"):
        tiled_gemm.gemm_qrg_launch(wg, wu, x16, Dev((n_tok, n_ff + 1)), None, part)
    with pytest.raises(ValueError, match="C-contiguous"):
        tiled_gemm.gemm_qrg_launch(wg, wu, x16, out, Dev((n_tok, n_ff - 1), np.float16), part)
    with pytest.raises(ValueError, match="partial sums"):
        tiled_gemm.gemm_qrg_launch(wg, wu, x16, out, None, Dev((grid[2], n_tok, n_ff)))
    with pytest.raises(ValueError, match="partial sums"):
        tiled_gemm.gemm_qrg_launch(wg, wu, x16, out, None, None)
    assert not launches


@pytest.mark.parametrize("n_tok, bound", [(8, 128), (16, 16), (64, 128), (64, 16)])
@pytest.mark.parametrize("on", [False, True])
def test_gated_node_is_one_launch_with_the_down_gemms_f16_input(launches, monkeypatch, gated_on, n_tok, bound, on):
    """The model graph's gated FFN node over Q4_K gate / up with QR_GATED, from 9 tokens up to
    QR_GATED_MAX_TOKENS (``bound``; 16 as shipped): the norm writes the F16 input (dense_rms_norm,
    times the norm weight), one dense_gemm_qrg launch writes silu(gate) * up and its F16 form,
    which the down matrix's GEMM reads (no cast); no dense_silu_mul. Off, at 8 tokens (the int8
    GEMM's) or past the bound: the two products' launches and the activation's."""
    monkeypatch.setattr(md, "QR_GATED", on)
    monkeypatch.setattr(md, "QR_GATED_MAX_TOKENS", bound)
    GraphB, node = graph_nodes(monkeypatch)
    n_embd, n_ff = 1024, 2048
    wg, wu, wd = _qmatrix("Q4_K", n_ff, n_embd), _qmatrix("Q4_K", n_ff, n_embd), _qmatrix("Q4_K", n_embd, n_ff)
    g = Dev((n_embd,))
    b = GraphB()
    x = node(Dev((n_tok, n_embd)))
    f = xp_matmul.mul_mat_gated(b, wg, wu, x, "ffn", norm_eps=1e-5, norm_w=g, down=wd)
    names = [ln.fn.name for ln in launches]
    out = b.array(f)
    fused = on and 9 <= n_tok <= bound
    if not fused:
        assert "dense_silu_mul" in names and not any(n.endswith(", 2, 1>") for n in names), names
        return
    assert names[0] == "dense_rms_norm" and names[1] == "dense_gemm_qr<12, 64, 2, 1>", names
    assert "dense_silu_mul" not in names and "dense_cast_f16" not in names, names
    norm, gemm = launches[0], launches[1]
    x16_ptr = norm.params[-1].value
    (p,) = gemm.params
    assert norm.params[4].value == g.data.ptr and x16_ptr == p.x != 0   # (the norm's F16 output, times g)
    out16 = b.f16_forms[ctypes.addressof(f.contents)]
    assert (p.out, p.out16) == (out.data.ptr, out16.data.ptr) and out16.shape == (n_tok, n_ff)
    launches.clear()
    xp_matmul.mul_mat_add(b, wd, f, node(Dev((n_tok, n_embd))), "ffn_res")
    names = [ln.fn.name for ln in launches]
    assert "dense_cast_f16" not in names and launches[0].params[0].x == out16.data.ptr, names


def test_split_finish_where_it_applies(monkeypatch):
    """matmul_dispatch.QR_SPLIT_FINISH (off as shipped): a split launch of dense_gemm_qr, qrm or
    qrg adds its splits itself; one split, or another kernel, keeps dense_splitk_sum."""
    assert md.QR_SPLIT_FINISH is False and not md.split_finish("dense_gemm_qr", 4)
    monkeypatch.setattr(md, "QR_SPLIT_FINISH", True)
    assert all(md.split_finish(k, 2) for k in ("dense_gemm_qr", "dense_gemm_qrm", "dense_gemm_qrg"))
    assert not md.split_finish("dense_gemm_qr", 1)
    assert not any(md.split_finish(k, 4) for k in ("dense_gemm_qs", "dense_gemm_q8", "dense_gemm_qw", "dense_gemm_q"))
    v = K.dense_q_variant(12)
    assert K.qr_finish_variant(v).options == ("-DQR_SPLIT_FINISH=1",) and K.qr_finish_variant(v).names == v.names
    with pytest.raises(ValueError, match="dense_q.cu"):
        K.qr_finish_variant(K.dense_qw_variant(12))


@pytest.mark.parametrize("kernel, rows", [("dense_gemm_qr", 1024), ("dense_gemm_qrm", 4096), ("dense_gemm_qr", 14336)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_split_launch_with_counters_adds_its_splits(launches, gated_on, kernel, rows, accumulate):
    """With tile counters a split dense_gemm_qr / qrm launch takes the QR_SPLIT_FINISH program and
    the counters' address, and no dense_splitk_sum follows; unsplit (the 14336-row gate at 64
    tokens) the counters are not read and the shipped program runs. Counters that do not cover
    the grid, or another kernel's split, are refused."""
    from ggml_attn.graph import tiled_gemm
    n_in, n_tok = 4096, 64
    w = _qmatrix("Q4_K", rows, n_in)
    grid, _ = K.gemm_q_grid(rows, n_tok, n_in, 132, kernel)
    part = Dev((grid[2], n_tok, rows)) if grid[2] > 1 else None
    done = Dev((grid[0] * grid[1],), np.uint32)
    tiled_gemm.gemm_q_launch(w, Dev((n_tok, n_in), np.float16), Dev((n_tok, rows)), part, accumulate=accumulate,
                             kernel=kernel, done=done)()
    names = [ln.fn.name for ln in launches]
    (p,) = launches[0].params
    base = K.dense_qrm_variant(12) if kernel == "dense_gemm_qrm" else K.dense_q_variant(12)
    if grid[2] > 1:
        assert names == [K.staged_instance(kernel, 12, 64)] and p.tile_done == done.data.ptr
        assert launches[0].fn.variant == K.qr_finish_variant(base) and p.mode == int(accumulate)
        with pytest.raises(ValueError, match="counters"):
            tiled_gemm.gemm_q_launch(w, Dev((n_tok, n_in), np.float16), Dev((n_tok, rows)), part, kernel=kernel,
                                     done=Dev((grid[0] * grid[1] - 1,), np.uint32))
    else:
        assert names == [K.staged_instance(kernel, 12, 64)] and p.tile_done == 0 and launches[0].fn.variant == base
    q3 = _qmatrix("Q3_K", 1024, n_in)
    g3, _ = K.gemm_q_grid(1024, n_tok, n_in, 132, "dense_gemm_qs")
    with pytest.raises(ValueError, match="itself"):
        tiled_gemm.gemm_q_launch(q3, Dev((n_tok, n_in), np.float16), Dev((n_tok, 1024)), Dev((g3[2], n_tok, 1024)),
                                 kernel="dense_gemm_qs", done=Dev((64,), np.uint32))


def test_split_finish_in_the_graph(launches, monkeypatch, gated_on):
    """QR_SPLIT_FINISH on: the device graph's split dense_gemm_qr launches (an 8B-shaped K matrix
    at 64 tokens: 16 splits) and a split dense_gemm_qrg (a small FFN) each get zeroed tile counters
    made at build and no sum launch; off, dense_splitk_sum / dense_splitk_gated follow them."""
    for on in (False, True):
        launches.clear()
        monkeypatch.setattr(md, "QR_SPLIT_FINISH", on)
        GraphB, node = graph_nodes(monkeypatch)
        b = GraphB()
        wk = _qmatrix("Q4_K", 1024, 4096)
        x = node(Dev((64, 4096)))
        xp_matmul.mul_mat_group(b, [wk], x, "k", norm_eps=1e-5, norm_w=Dev((4096,)))
        wg, wu = _qmatrix("Q4_K", 1024, 4096), _qmatrix("Q4_K", 1024, 4096)
        xp_matmul.mul_mat_gated(b, wg, wu, x, "ffn", norm_eps=1e-5, norm_w=Dev((4096,)))
        names = [ln.fn.name for ln in launches]
        gemms = [ln for ln in launches if ln.fn.name.startswith("dense_gemm_qr<")]
        assert len(gemms) == 2 and all(ln.grid[2] > 1 for ln in gemms), names
        assert ("dense_splitk_sum" in names and "dense_splitk_gated" in names) == (not on), names
        for ln in gemms:
            (p,) = ln.params
            assert (p.tile_done != 0) == on
            if on:
                done = next(a for a in b.kept if getattr(a, "data", None) is not None and a.data.ptr == p.tile_done)
                assert done.dtype == np.uint32 and done.size == ln.grid[0] * ln.grid[1] and not done.a.any()
