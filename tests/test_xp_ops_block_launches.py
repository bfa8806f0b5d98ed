"""graph/xp_matmul.py's and xp_ops.py's GPU launches over weight blocks, their host side without a GPU: the kernels'
lookups and launches are recorded (``kernels.get_function`` / ``kernels.BoundLaunch`` /
``_CublasGemm.of_ptrs`` replaced), device arrays are numpy arrays wearing CuPy's attributes. What
is checked: ``dense_gemv_q``'s parameter block (segment pointers and rows, activations, norm
weight, row bytes, token count, mode), its instance and grid; the GEMM path's chunks (every row
of every weight once, each chunk's dequantize launch and GEMM at the right byte and column
offsets); the embedding's block rows; and where each path is taken (``md.best_matmul``)."""
import pathlib
from types import SimpleNamespace

import numpy as np
import pytest

from ggml_attn import kernels as K
from ggml_attn import matmul_dispatch as md
from ggml_attn.block_types import BLOCK_TYPES, block_layout
from ggml_attn.graph import q8_handoff, q8_matmul, xp_matmul, xp_ops
from ggml_attn.graph.model_device import QMatrix


class Dev:
    """A numpy array seen as a CuPy one: ``.data.ptr`` its address, ``.flags``, shape, dtype."""

    def __init__(self, shape, dtype=np.float32, base: np.ndarray | None = None):
        self.a = np.zeros(shape, dtype=dtype) if base is None else base
        self.data = SimpleNamespace(ptr=int(self.a.ctypes.data))
        self.flags, self.shape, self.dtype = self.a.flags, self.a.shape, self.a.dtype
        self.size, self.nbytes = self.a.size, self.a.nbytes

    def reshape(self, *shape):
        return Dev(None, base=self.a.reshape(*shape))

    def fill(self, v):
        self.a.fill(v)

    def __getitem__(self, k):
        return Dev(None, base=self.a[k])


class FakeXp:
    """What xp_matmul and xp_ops read of a non-numpy array module."""
    float16, float32 = np.float16, np.float32

    @staticmethod
    def empty(shape, dtype=np.float32):
        return Dev(shape, dtype)


class Builder:
    xp = FakeXp

    def __init__(self):
        self.kept = []

    def scratch(self, shape, dtype):
        return Dev(shape, dtype)

    def keep(self, *arrays):
        self.kept += arrays


@pytest.fixture()
def launches(monkeypatch):
    rec = []

    class Launch:
        def __init__(self, fn, grid, block, *params):
            self.fn, self.grid, self.block, self.params = fn, grid, block, params
            rec.append(self)

        def __call__(self):
            pass

    def gemm(w, n_out, n_in, x16, n_tok, out, ldc, beta=0.0):
        rec.append(SimpleNamespace(fn="gemm", args=(w, n_out, n_in, x16, n_tok, out, ldc, beta)))
        return lambda: None

    # smem None: the launch takes the instance's own dynamic shared memory (read from its program)
    monkeypatch.setattr(K, "get_function", lambda variant, name, smem=None: SimpleNamespace(variant=variant, name=name, smem=smem))
    monkeypatch.setattr(K, "BoundLaunch", Launch)
    monkeypatch.setattr(xp_matmul._CublasGemm, "of_ptrs", staticmethod(gemm))
    return rec


def _qmatrix(name, n_out, n_in, scratch=None):
    lay = block_layout(name)
    return QMatrix(name, (n_out, n_in), Dev((n_out, lay.row_bytes(n_in)), np.uint8), scratch=scratch)


def graph_nodes(monkeypatch):
    """``(GraphB, node)``: a graph builder class with the 8-bit forms' record and the arrays of
    nodes, and ``node(arr)``, a fake node over ``arr`` (what the ops read of a ggml tensor: its
    data address); xp_matmul's custom nodes and views become such nodes."""
    import ctypes
    arrays = {}

    class GraphB(Builder):
        def __init__(self):
            super().__init__()
            self.q8_forms, self.f16_forms = {}, {}

        def array(self, t):
            return arrays[ctypes.addressof(t.contents)]

        def ptr(self, a):
            return a.data.ptr

    class Tensor(ctypes.Structure):
        _fields_ = [("data", ctypes.c_uint64)]

    def node(arr):
        t = ctypes.pointer(Tensor(arr.data.ptr))
        arrays[ctypes.addressof(t.contents)] = arr
        return t
    monkeypatch.setattr(xp_matmul, "_custom", lambda b, run, srcs, out, name, ptr=None: node(out))
    monkeypatch.setattr(xp_matmul, "_views", lambda b, n, outs, base, name: [node(o) for o in outs])
    return GraphB, node


@pytest.mark.parametrize("n_tok, nt", [(1, 1), (3, 4), (8, 8), (9, 16), (16, 16)])
def test_gemv_q_parameter_block(launches, n_tok, nt):
    ws = [_qmatrix("Q4_K", 96, 512), _qmatrix("Q4_K", 32, 512), _qmatrix("Q4_K", 32, 512)]
    x = Dev((n_tok, 512))
    outs = [Dev((n_tok, w.shape[0])) for w in ws]
    g = Dev((512,))
    run = xp_matmul.gemv_q_launch(ws, x, outs, mode=0, norm_eps=1e-5, norm_w=g)
    (ln,) = launches
    assert run is ln and ln.fn.name == f"dense_gemv_q<12, {nt}>" and ln.fn.variant == K.dense_q_variant(12)
    assert ln.grid == (-(-160 // K.GEMVQ_WARPS), 1, 1) and ln.block == (32 * K.GEMVQ_WARPS, 1, 1)
    (p,) = ln.params
    assert isinstance(p, K.GemvQParams)
    for i, (w, o) in enumerate(zip(ws, outs)):
        assert (p.seg[i].w, p.seg[i].out, p.seg[i].rows) == (w.blocks.data.ptr, o.data.ptr, w.shape[0])
    assert (p.x, p.x_stride, p.g, p.row_bytes) == (x.data.ptr, 512, g.data.ptr, 2 * 144)
    assert (p.n_in, p.n_tok, p.n_seg, p.mode) == (512, n_tok, 3, 0) and p.norm_eps == pytest.approx(1e-5)


def test_gemv_q_ab_instances(launches):
    """The benchmark's instances with more warps a block: their program, name and grid; token
    counts they lack refused."""
    ws = [_qmatrix("Q8_0", 100, 256)]
    run = xp_matmul.gemv_q_launch(ws, Dev((2, 256)), [Dev((2, 100))], mode=0, warps=16)
    assert run.fn.variant == K.dense_q_x_variant(8, 16) and run.fn.name == "dense_gemv_q<8, 2, 16>"
    assert run.grid == (7, 1, 1) and run.block == (512, 1, 1)
    assert xp_matmul.gemv_q_launch(ws, Dev((3, 256)), [Dev((3, 100))], mode=0, warps=4).fn.name == "dense_gemv_q<8, 4, 4>"
    assert xp_matmul.gemv_q_launch(ws, Dev((3, 256)), [Dev((3, 100))], mode=0, warps=16) is None
    assert xp_matmul.gemv_q_launch(ws, Dev((1, 256)), [Dev((1, 100))], mode=0, warps=8).fn.name == "dense_gemv_q<8, 1>"
    with pytest.raises(ValueError, match="warps"):
        K.dense_q_x_variant(8, 8)


def test_q8x_launches(launches):
    """The 8-bit-activation GEMV's two launches: the quantization (a block a token; x, norm
    weight, eps, the int8 and scale arrays) and the GEMV's parameter block; refusals."""
    ws = [_qmatrix("Q4_K", 96, 512), _qmatrix("Q4_K", 32, 512)]
    x, g = Dev((2, 512)), Dev((512,))
    xq, xd, xs = Dev((2, 512), np.int8), Dev((2, 16)), Dev((2, 16))
    outs = [Dev((2, 96)), Dev((2, 32))]
    q8_matmul.q8x_launches(ws, x, outs, xq, xd, xs, mode=0, norm_eps=1e-5, norm_w=g)
    quant, gemv = launches
    assert quant.fn.name == "dense_quant_q8x" and quant.fn.variant == K.dense_q8x_variant(12) and quant.grid == (2, 2, 1)   # (512 / 256, tokens)
    xp_, xst, gp, eps, n_in, q, d, s_ = (a.value for a in quant.params)
    assert (xp_, xst, gp, n_in, q, d, s_) == (x.data.ptr, 512, g.data.ptr, 512, xq.data.ptr, xd.data.ptr, xs.data.ptr)
    assert eps == pytest.approx(1e-5)
    assert all(w.blocks.data.ptr % 16 == 0 for w in ws)   # (numpy's allocations: the staged kernel's precondition)
    assert gemv.fn.name == "dense_gemv_q8x_s<12, 2>" and gemv.grid == (-(-128 // K.Q8X_SWARPS), 1, 1)
    assert gemv.block == (32 * K.Q8X_SWARPS, 1, 1)
    (p,) = gemv.params
    assert (p.xq, p.xd, p.xs, p.row_bytes, p.n_in, p.n_tok, p.n_seg, p.mode) == \
        (xq.data.ptr, xd.data.ptr, xs.data.ptr, 2 * 144, 512, 2, 2, 0)
    assert [(p.seg[i].w, p.seg[i].out, p.seg[i].rows) for i in range(2)] == \
        [(w.blocks.data.ptr, o.data.ptr, w.shape[0]) for w, o in zip(ws, outs)]
    n = len(launches)
    assert q8_matmul.q8x_launches(ws, Dev((17, 512)), outs, Dev((17, 512), np.int8), Dev((17, 16)), Dev((17, 16)),
                                  mode=0) is None                                                       # 17 tokens
    assert q8_matmul.q8x_launches([ws[0], _qmatrix("Q6_K", 32, 512)], x, outs, xq, xd, xs, mode=0) is None   # 2 types
    x4 = Dev(None, base=np.zeros(2 * 512 + 4, np.float32)[1:1 + 2 * 512].reshape(2, 512))
    assert x4.data.ptr % 16 and q8_matmul.q8x_launches(ws, x4, outs, xq, xd, xs, mode=0) is None   # x's rows unaligned
    assert len(launches) == n


@pytest.mark.parametrize("case", ["row_bytes", "pointer"])
def test_q8x_unstaged_where_rows_are_not_16_byte_aligned(launches, case):
    """Rows that do not all start 16-byte aligned (Q8_0 rows of 96 values: 102 bytes; a matrix
    2 bytes into its buffer) take dense_gemv_q8x (plain loads) in its blocks of Q8X_WARPS."""
    n_in = 96 if case == "row_bytes" else 256
    w = _qmatrix("Q8_0", 40, n_in)
    if case == "pointer":
        buf = np.zeros(40 * w.row_bytes + 16, np.uint8)
        w = QMatrix("Q8_0", (40, n_in), Dev(None, base=buf[2:2 + 40 * w.row_bytes].reshape(40, w.row_bytes)))
    x, xq, xd, xs = Dev((1, n_in)), Dev((1, n_in), np.int8), Dev((1, n_in // 32)), Dev((1, n_in // 32))
    q8_matmul.q8x_launches([w], x, [Dev((1, 40))], xq, xd, xs, mode=0, quantize=False)
    (gemv,) = launches
    assert gemv.fn.name == "dense_gemv_q8x<8, 1>" and gemv.grid == (-(-40 // K.Q8X_WARPS), 1, 1)
    assert gemv.block == (32 * K.Q8X_WARPS, 1, 1)
    n = max(K.Q8X_PLAIN_TOKENS) + 1   # past the plain kernel's instances: refused, nothing launched
    assert _q8x_refuses(w, n, n_in) and len(launches) == 1


def _q8x_refuses(w, n_tok, n_in) -> bool:
    x, xq, xd, xs = Dev((n_tok, n_in)), Dev((n_tok, n_in), np.int8), Dev((n_tok, n_in // 32)), Dev((n_tok, n_in // 32))
    return q8_matmul.q8x_launches([w], x, [Dev((n_tok, 40))], xq, xd, xs, mode=0) is None


def test_gemv_q8x_path_when_dispatch_says_so(launches, monkeypatch):
    """With Q8X_MAX_TOKENS set, block GEMVs go through the 8-bit-activation GEMV: x quantized
    once (its int8 and scale arrays from the builder) for the groups of every block type; F16
    weights keep theirs."""
    monkeypatch.setattr(md, "Q8X_MAX_TOKENS", 2)
    assert md.best_matmul("Q6_K", 2).path == "gemv-q8x" and md.best_matmul("Q6_K", 3).path == "gemm-q8"
    assert md.best_matmul("Q5_K", 1).path == "gemv-q8x" and md.best_matmul("F16", 1).path == "gemv"
    b = Builder()
    ws = [_qmatrix("Q4_K", 64, 256), _qmatrix("Q5_K", 16, 256)]
    x, outs = Dev((2, 256)), [Dev((2, 64)), Dev((2, 16))]
    assert xp_matmul._gemv(b, ws, x, outs, mode=0, norm_eps=1e-5, norm_w=Dev((256,))) is not None
    assert [ln.fn.name for ln in launches] == ["dense_quant_q8x", "dense_gemv_q8x_s<12, 2>", "dense_gemv_q8x_s<13, 2>"]
    assert [a.shape for a in b.kept[:3]] == [(2, 256), (2, 8), (2, 8)] and b.kept[0].dtype == np.int8
    xq = b.kept[0].data.ptr
    assert launches[1].params[0].xq == launches[2].params[0].xq == xq


def test_gemv_q8x_vector_form_where_dispatch_routes_it(launches, monkeypatch):
    """matmul_dispatch.Q8XV_TYPES sends its types' 16-byte aligned rows to dense_gemv_q8x_v
    (blocks of Q8X_VWARPS) up to Q8XV_MAX_TOKENS tokens; other types and more tokens stay staged,
    unaligned rows plain; asked for by name, the vector form refuses a type it does not read,
    unaligned rows and more tokens than its instances."""
    assert md.Q8XV_TYPES == ("Q4_K", "Q5_K", "Q8_0") and md.Q8XV_MAX_TOKENS == 1   # (measured: matmul_dispatch)
    assert [md.gemv_q8x_form(t, True, 1) for t in ("Q4_K", "Q5_K", "Q8_0", "Q6_K")] == ["vector", "vector", "vector", "ring"]
    assert md.gemv_q8x_form("Q6_K", True, 2) == "staged"
    assert md.gemv_q8x_form("Q4_K", True, 2) == "staged" and md.gemv_q8x_form("Q4_K", False, 1) == "plain"
    assert "dense_gemv_q8x_v" in md.best_matmul("Q4_K", 1).reason
    assert "dense_gemv_q8x_s" in md.best_matmul("Q4_K", 2).reason
    monkeypatch.setattr(md, "Q8XV_TYPES", ("Q4_K", "Q4_0"))   # (Q4_0: not a type the kernel reads)
    monkeypatch.setattr(md, "Q8XV_MAX_TOKENS", 4)
    assert [md.gemv_q8x_form(t, a, 4) for t, a in (("Q4_K", True), ("Q4_K", False), ("Q4_0", True), ("Q5_K", True))] \
        == ["vector", "plain", "staged", "staged"]
    ws = [_qmatrix("Q4_K", 96, 512), _qmatrix("Q4_K", 32, 512)]
    x, xq, xd, xs = Dev((3, 512)), Dev((3, 512), np.int8), Dev((3, 16)), Dev((3, 16))
    outs = [Dev((3, 96)), Dev((3, 32))]
    q8_matmul.q8x_launches(ws, x, outs, xq, xd, xs, mode=0, quantize=False)
    (gemv,) = launches
    assert gemv.fn.name == "dense_gemv_q8x_v<12, 4, 0>" and gemv.fn.variant == K.dense_q8x_variant(12)   # (GEMV_ONE_TYPES)
    assert gemv.grid == (-(-128 // K.Q8X_VWARPS), 1, 1) and gemv.block == (32 * K.Q8X_VWARPS, 1, 1)
    assert gemv.params[0].n_tok == 3 and gemv.params[0].row_bytes == 2 * 144
    q4 = [_qmatrix("Q4_0", 32, 512)]
    assert q8_matmul.q8x_launches(q4, x, outs[1:], xq, xd, xs, mode=0, form="vector") is None
    buf = np.zeros(32 * 288 + 16, np.uint8)
    skew = [QMatrix("Q4_K", (32, 512), Dev(None, base=buf[2:2 + 32 * 288].reshape(32, 288)))]
    assert q8_matmul.q8x_launches(skew, x, outs[1:], xq, xd, xs, mode=0, form="vector") is None
    n = max(K.Q8XV_TOKENS) + 1
    assert q8_matmul.q8x_launches(ws, Dev((n, 512)), [Dev((n, 96)), Dev((n, 32))], Dev((n, 512), np.int8),
                                  Dev((n, 16)), Dev((n, 16)), mode=0, form="vector") is None
    # activations' scales off a 16-byte boundary or strided, a gated launch without two equal matrices
    off = Dev(None, base=np.zeros(3 * 16 + 1, np.float32)[1:].reshape(3, 16))
    strided = Dev(None, base=np.zeros((3, 32), np.float32)[:, ::2])
    for d, s in ((off, xs), (xd, strided)):
        assert q8_matmul.q8x_launches(ws[:1], x, outs[:1], xq, d, s, mode=0, form="vector") is None
    for pair in (ws[:1], ws):
        assert q8_matmul.q8x_launches(pair, x, outs[:1], xq, xd, xs, mode=2, form="vector") is None
    assert len(launches) == 1
    # every mode runs the form's instance for every mode (G 1), unless GEMV_ONE_TYPES sends
    # modes 0 / 1 to the one-operand instance (G 0: fewer registers without the second operand's words)
    for one, gs in ((False, (1, 1, 1)), (True, (1, 0, 0))):
        monkeypatch.setattr(md, "GEMV_ONE_TYPES", ("Q6_K", "Q4_K") if one else ("Q6_K",))
        launches.clear()
        q8_matmul.q8x_launches([ws[0], _qmatrix("Q4_K", 96, 512)], x, outs[:1], xq, xd, xs, mode=2, quantize=False)
        for mode in (1, 0):
            q8_matmul.q8x_launches(ws[:1], x, outs[:1], xq, xd, xs, mode=mode, quantize=False)
        assert [ln.fn.name for ln in launches] == [f"dense_gemv_q8x_v<12, 4, {g}>" for g in gs]
        assert [ln.params[0].mode for ln in launches] == [2, 1, 0]
    assert md.gemv_q8x_gated_instance(2, "Q4_K") and not md.gemv_q8x_gated_instance(0, "Q4_K")   # (still listed)
    assert md.gemv_q8x_gated_instance(0, "Q5_K") and not md.gemv_q8x_gated_instance(1, "Q6_K")   # (per type)
    monkeypatch.setattr(md, "GEMV_ONE_TYPES", ())
    assert md.gemv_q8x_gated_instance(0, "Q4_K") and md.GEMV_ONE_TYPES == ()
    assert K.q8x_name(12, 1, "vector", gated=True) == "dense_gemv_q8x_v<12, 1, 1>"
    assert K.q8x_name(12, 1, "staged", gated=True) == "dense_gemv_q8x_s<12, 1>"   # (one instance for every mode)
    for t in (13, 14, 8):
        assert {f"dense_gemv_q8x_v<{t}, {nt}, {g}>" for nt in K.Q8XV_TOKENS for g in (0, 1)} <= set(K.dense_q8x_variant(t).names)
    assert not any("q8x_v" in name for name in K.dense_q8x_variant(2).names)


def test_gemv_q8x_split_rows(launches, monkeypatch):
    """matmul_dispatch.GEMV_SPLIT_TYPES: the vector GEMV at one token in modes 0 / 1 runs a row on
    two warps (the instance G 2, half the rows a block: twice the blocks) for matrices of at most
    GEMV_SPLIT_MAX_ROWS rows (a launch's segments together); the gated mode, more rows, more tokens,
    other types and forms as before."""
    monkeypatch.setattr(md, "GEMV_SPLIT_TYPES", ("Q4_K",))
    monkeypatch.setattr(md, "GEMV_SPLIT_MAX_ROWS", 128)
    ws = [_qmatrix("Q4_K", 96, 512), _qmatrix("Q4_K", 32, 512), _qmatrix("Q4_K", 33, 512)]
    x, xq, xd, xs = Dev((1, 512)), Dev((1, 512), np.int8), Dev((1, 16)), Dev((1, 16))
    warps = K.Q8X_VWARPS
    for pair, mode, name, grid in ((ws[:2], 0, "dense_gemv_q8x_v<12, 1, 2>", -(-128 // (warps // 2))),
                                   (ws[:1], 1, "dense_gemv_q8x_v<12, 1, 2>", -(-96 // (warps // 2))),
                                   ([ws[0], ws[2]], 0, "dense_gemv_q8x_v<12, 1, 0>", -(-129 // warps)),   # (129 rows)
                                   ([ws[0], ws[0]], 2, "dense_gemv_q8x_v<12, 1, 1>", -(-96 // warps))):
        launches.clear()
        outs = [Dev((1, 96))] if mode else [Dev((1, w.shape[0])) for w in pair]
        q8_matmul.q8x_launches(pair, x, outs, xq, xd, xs, mode=mode, quantize=False)
        (gemv,) = launches
        assert (gemv.fn.name, gemv.grid, gemv.block) == (name, (grid, 1, 1), (32 * warps, 1, 1)), mode
    assert md.gemv_q8x_split("Q4_K", "vector", 1, 128, 0) and not md.gemv_q8x_split("Q4_K", "vector", 2, 128, 0)
    assert not md.gemv_q8x_split("Q4_K", "ring", 1, 128, 0) and not md.gemv_q8x_split("Q5_K", "vector", 1, 128, 1)
    assert K.q8x_name(13, 1, "vector", split=True) == "dense_gemv_q8x_v<13, 1, 2>"
    assert all(f"dense_gemv_q8x_v<{t}, 1, 2>" in K.dense_q8x_variant(t).names for t in K.Q8XV_TYPE_IDS)
    with pytest.raises(AssertionError):
        K.q8x_name(12, 1, "vector", gated=True, split=True)


def test_gemv_q_gated_and_what_it_refuses(launches):
    wg, wu = _qmatrix("Q6_K", 64, 256), _qmatrix("Q6_K", 64, 256)
    x, out = Dev((2, 256)), Dev((2, 64))
    xp_matmul.gemv_q_launch([wg, wu], x, [out], mode=2)
    (p,) = launches[-1].params
    assert p.mode == 2 and p.seg[0].out == out.data.ptr and p.g == 0 and p.norm_eps == 0.0
    assert launches[-1].grid == (64 // K.GEMVQ_WARPS, 1, 1)   # the gate's rows only
    n = len(launches)
    assert xp_matmul.gemv_q_launch([wg, _qmatrix("Q4_K", 64, 256)], x, [out], mode=2) is None   # two types
    assert xp_matmul.gemv_q_launch([wg], Dev((17, 256)), [Dev((17, 64))], mode=0) is None       # 17 tokens
    assert xp_matmul.gemv_q_launch([wg], x, [out], mode=0, norm_w=Dev((256,))) is None          # a weight, no norm
    assert xp_matmul.gemv_q_launch([wg], x, [out], mode=0, norm_eps=1e-5, norm_w=Dev((128,))) is None
    assert len(launches) == n


def test_gemvs_write_the_next_gemvs_activations_when_dispatch_says_so(launches, monkeypatch):
    """matmul_dispatch.GEMV_QUANT_OUT: where a GEMV and the GEMVs reading its output all run the
    8-bit GEMV at one token, it launches its form's instance with the 8-bit output (G + 4) and
    the output's 8-bit arrays and zeroed counters in one buffer (GemvQ8Params.seg[2].w, a segment
    the launch leaves free; the accumulate mode's next RMS norm in seg[1]: its weight, its eps's
    bits), and a reader handed them launches no quantization of its own. Off, more tokens, rows
    not whole 32-row groups, an F16 reader or the F32 GEMV: none; q8x_launches refuses them in
    the store mode, for two accumulated matrices, in the staged and plain forms, and laid out
    otherwise than q8_out_arrays lays them."""
    import struct
    real = q8_matmul.q8_out_arrays
    monkeypatch.setattr(q8_handoff, "q8_out_arrays", lambda xp, n, r: tuple(Dev(None, base=a) for a in real(np, n, r)))
    b = Builder()
    wg, wu, wd = _qmatrix("Q4_K", 256, 256), _qmatrix("Q4_K", 256, 256), _qmatrix("Q8_0", 256, 256)
    monkeypatch.setattr(md, "GEMV_QUANT_OUT", False)
    assert q8_handoff.arrays_for(b, [wg, wd], 1, 256) is None
    monkeypatch.setattr(md, "GEMV_QUANT_OUT", True)
    assert q8_handoff.arrays_for(b, [wg, wd], 5, 256) is None                       # 5 tokens: the GEMMs
    assert q8_handoff.arrays_for(b, [wg, wd], 2, 256) is None                       # 2: no instances with it
    assert q8_handoff.arrays_for(b, [wg, wd], 1, 80) is None                        # not whole groups
    assert q8_handoff.arrays_for(b, [wg, Dev((256, 256), np.float16)], 1, 256) is None   # an F16 reader
    out_q = q8_handoff.arrays_for(b, [wg, wd], 1, 256)
    assert [(a.shape, a.dtype) for a in out_q] == [((1, 256), np.int8), ((1, 8), np.float32), ((1, 8), np.float32),
                                                   ((8,), np.uint32), ((1, 8), np.float32), ((1,), np.uint32)]
    assert not out_q[3].a.any() and not out_q[5].a.any()
    assert [a.data.ptr - out_q[0].data.ptr for a in out_q] == [0, 256, 288, 320, 352, 384]   # (16-byte parts of one buffer)
    # the gated GEMV writes the down matrix's activations
    x, f = Dev((1, 256)), Dev((1, 256))
    assert xp_matmul._gemv(b, [wg, wu], x, [f], mode=2, norm_eps=1e-5, norm_w=Dev((256,)), out_q=out_q) is not None
    quant, gated = launches
    assert quant.fn.name == "dense_quant_q8x" and gated.fn.name == "dense_gemv_q8x_v<12, 1, 5>"
    (p,) = gated.params
    assert (p.mode, p.n_seg, p.seg[2].w) == (2, 2, out_q[0].data.ptr)
    n = len(launches)
    y = Dev((1, 256))
    assert xp_matmul._gemv(b, [wd], f, [y], mode=1, q8=out_q[:3]) is not None
    (down,) = launches[n:]                                                           # no quantization launch
    (pd,) = down.params
    assert (pd.xq, pd.xd, pd.xs, pd.mode, pd.seg[2].w) == (*(a.data.ptr for a in out_q[:3]), 1, 0)
    # a residual add writes the normalized x's 8-bit form for the matrices after the norm
    wo, g = _qmatrix("Q8_0", 256, 256), Dev((256,))
    res_q = q8_handoff.arrays_for(b, [wo, wg, wu], 1, 256)
    n = len(launches)
    assert xp_matmul._gemv(b, [wo], f, [y], mode=1, q8=out_q[:3], out_q=res_q, out_norm=(g, 1e-5)) is not None
    (add,) = launches[n:]
    (pa,) = add.params
    assert add.fn.name == "dense_gemv_q8x_v<8, 1, 6>"                                # (two warps a row, with it)
    assert (pa.mode, pa.n_seg, pa.seg[2].w, pa.seg[1].w) == (1, 1, res_q[0].data.ptr, g.data.ptr)
    assert pa.seg[1].rows == struct.unpack("<i", struct.pack("<f", 1e-5))[0]
    n = len(launches)
    xq, xd, xs = Dev((1, 256), np.int8), Dev((1, 8)), Dev((1, 8))
    assert q8_matmul.q8x_launches([wg, wu], x, [f], xq, xd, xs, mode=0, out_q=out_q) is None     # the store mode
    assert q8_matmul.q8x_launches([wg, wu], x, [f], xq, xd, xs, mode=1, out_q=out_q) is None     # two matrices
    assert q8_matmul.q8x_launches([wg, wu], x, [f], xq, xd, xs, mode=2, out_q=out_q[::-1]) is None   # not its layout
    assert q8_matmul.q8x_launches([wg, wu], x, [f], xq, xd, xs, mode=2, out_q=out_q, form="staged") is None
    odd = [_qmatrix("Q4_K", 80, 256)] * 2
    assert q8_matmul.q8x_launches(odd, x, [Dev((1, 80))], xq, xd, xs, mode=2, out_q=out_q) is None   # 80 rows
    assert q8_matmul.q8x_launches([wo], f, [y], *out_q[:3], mode=1, out_q=res_q, out_norm=(Dev((128,)), 1e-5)) is None
    monkeypatch.setattr(md, "Q8X_MAX_TOKENS", 0)                                     # the F32 GEMV instead
    assert xp_matmul._gemv(b, [wg, wu], x, [f], mode=2, out_q=out_q) is None
    assert len(launches) == n


def test_8_bit_forms_pass_from_node_to_node(launches, monkeypatch):
    """The model graph's chain with matmul_dispatch.GEMV_QUANT_OUT (graph/q8_handoff.py): the
    gated node makes its output's 8-bit form for the down matrix's residual add, which quantizes
    nothing and makes the normalized x's for the next layer's Q/K/V, which quantize nothing; a
    reader of another norm weight (or of none) does not take a form made for another, and with
    the knob off every node quantizes its own input. Nodes faked (no ggml context); launches
    recorded."""
    real = q8_matmul.q8_out_arrays
    monkeypatch.setattr(q8_handoff, "q8_out_arrays", lambda xp, n, r: tuple(Dev(None, base=a) for a in real(np, n, r)))
    GraphB, node = graph_nodes(monkeypatch)
    n_embd, n_ff = 256, 512
    wg, wu = _qmatrix("Q4_K", n_ff, n_embd), _qmatrix("Q4_K", n_ff, n_embd)
    wd, wq, wk, wv = (_qmatrix("Q4_K", n_embd, n_ff), _qmatrix("Q4_K", n_embd, n_embd), _qmatrix("Q4_K", 128, n_embd),
                      _qmatrix("Q8_0", 128, n_embd))
    g_ffn, g_attn = Dev((n_embd,)), Dev((n_embd,))

    def chain(b):
        x = node(Dev((1, n_embd)))
        f = xp_matmul.mul_mat_gated(b, wg, wu, x, "ffn", norm_eps=1e-5, norm_w=g_ffn, down=wd)
        x2 = xp_matmul.mul_mat_add(b, wd, f, x, "ffn_res", norm_next=(g_attn, 1e-5, [wq, wk, wv]))
        xp_matmul.mul_mat_group(b, [wq, wk, wv], x2, "qkv", norm_eps=1e-5, norm_w=g_attn)
        xp_matmul.mul_mat_group(b, [wq], x2, "other_norm", norm_eps=1e-5, norm_w=g_ffn)
        xp_matmul.mul_mat_group(b, [wq], x2, "no_norm")
        return [(ln.fn.name, ln.params) for ln in launches]

    monkeypatch.setattr(md, "GEMV_QUANT_OUT", True)
    got = chain(GraphB())
    names = [n for n, _ in got]
    assert names == ["dense_quant_q8x", "dense_gemv_q8x_v<12, 1, 5>",                   # x, then gate/up with it
                     "dense_gemv_q8x_v<12, 1, 6>",                                      # wd: no quantization
                     "dense_gemv_q8x_v<12, 1, 2>", "dense_gemv_q8x_v<8, 1, 2>",         # Q/K, V: none either
                     "dense_quant_q8x", "dense_gemv_q8x_v<12, 1, 2>",                   # another norm: its own
                     "dense_quant_q8x", "dense_gemv_q8x_v<12, 1, 2>"], names            # no norm: its own
    (pg,), (pd,), (pq,), (pv,) = (got[i][1] for i in (1, 2, 3, 4))
    assert pd.xq == pg.seg[2].w and pd.seg[1].w == g_attn.data.ptr   # (the down GEMV reads the gated one's)
    assert pq.xq == pv.xq == pd.seg[2].w                             # (Q/K/V read the residual add's)
    launches.clear()
    monkeypatch.setattr(md, "GEMV_QUANT_OUT", False)
    names = [n for n, _ in chain(GraphB())]
    assert names.count("dense_quant_q8x") == 5 and not any(n.endswith((", 4>", ", 5>", ", 6>")) for n in names), names


def test_best_matmul(monkeypatch):
    assert md.best_matmul("F16", 4).path == "gemv" and md.best_matmul("F16", 5).path == "gemm"
    assert [md.best_matmul("Q4_K", n).path for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 128, 129, 512)] == \
        ["gemv-q8x"] * 4 + ["gemm-q8"] * 2 + ["gemm-qr"] * 8 + ["gemm", "gemm"]   # (qr to QRGEMM_MAX_TOKENS)
    assert [md.best_matmul("Q3_K", n).path for n in (9, 64, 65)] == ["gemm-qs"] * 2 + ["gemm"]
    # dense_gemm_qr for the types routed to it that have a fragment decode, dense_gemm_qs for the others
    assert md.QRGEMM_TYPES == ("Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q8_0")   # (every one it reads, measured: bench/NOTES.md)
    assert set(K.GEMMQR_TYPES) == {"Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}
    monkeypatch.setattr(md, "QRGEMM_TYPES", ("Q4_K", "Q6_K", "Q2_K"))
    assert {t: md.best_matmul(t, 16).path for t in BLOCK_TYPES} == \
        {t: "gemm-qr" if t in ("Q4_K", "Q6_K") else "gemm-qs" for t in BLOCK_TYPES}
    assert [md.best_matmul("Q4_K", n).path for n in (8, 9, 64, 65, 128, 129)] == \
        ["gemm-q8"] + ["gemm-qr"] * 4 + ["gemm"]
    monkeypatch.setattr(md, "QRGEMM_TYPES", ())
    assert "dequantized" in md.best_matmul("Q8_0", 512).reason
    # a caller whose GEMV launch refused the arrays: the tiled GEMM from one token, never a GEMV
    assert [md.best_matmul("Q4_K", n, gemv=False).path for n in (1, 2, 8, 9, 16, 32, 33, 64, 65)] == \
        ["gemm-q8"] * 3 + ["gemm-qs"] * 5 + ["gemm"]
    assert [md.best_matmul("F16", n, gemv=False).path for n in (1, 4, 5)] == ["gemm"] * 3
    # rows not 16-byte aligned: the 8-bit GEMV only in its plain form's tokens, no staged tiled GEMM
    assert [md.best_matmul("Q8_0", n, aligned=False).path for n in (4, 5, 8, 16, 64)] == \
        ["gemv-q8x"] + ["gemm-q"] * 4
    # the staged GEMM off (an empty range): the int8 one up to its tokens, dense_gemm_q past them
    monkeypatch.setattr(md, "QSGEMM_MAX_TOKENS", 0)
    monkeypatch.setattr(md, "QRGEMM_MAX_TOKENS", 0)
    assert [md.best_matmul("Q4_K", n).path for n in (5, 32, 33, 64, 65)] == \
        ["gemm-q8", "gemm-q8", "gemm-q", "gemm-q", "gemm"]


def test_unaligned_rows_route_past_the_staged_kernels(launches, monkeypatch):
    """A weight whose rows are not whole 16-byte units (Q8_0 rows of 40 values) takes the plain
    8-bit GEMV up to its tokens and the tiled F16-decode GEMM past them, never dense_gemm_q8
    (whose launch refuses such rows), dense_gemm_qs or dense_gemm_qr."""
    monkeypatch.setattr(md, "Q8GEMM_MAX_TOKENS", 64)
    w = _qmatrix("Q8_0", 64, 32 * 5)   # 5 blocks of 34 bytes: 170-byte rows
    assert not q8_matmul.rows_aligned([w]) and q8_matmul.rows_aligned([_qmatrix("Q8_0", 64, 256)])
    assert md.best_matmul("Q8_0", 16).path == "gemm-qr" and md.best_matmul("Q8_0", 8).path == "gemm-q8"
    assert md.best_matmul("Q8_0", 16, aligned=False).path == "gemm-q"
    b = Builder()
    x = Dev((16, 160))
    assert xp_matmul._gemv(b, [w], x, [Dev((16, 64))], mode=0) is None
    xp_matmul._qmatmuls(b, [w], x, [Dev((16, 64))])
    assert [ln.fn.name for ln in launches if hasattr(ln.fn, "name")] == ["dense_cast_f16", "dense_gemm_q<8>"]
    xq, xd = Dev((16, 160), np.int8), Dev((16, 5))
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        q8_matmul.gemm_q8_launch(w, xq, xd, xd, Dev((16, 64)), None)
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        xp_matmul.gemm_q_launch(w, Dev((16, 160), np.float16), Dev((16, 64)), None, kernel="dense_gemm_qs")
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        xp_matmul.gemm_q_launch(w, Dev((16, 160), np.float16), Dev((16, 64)), None, kernel="dense_gemm_qr")
    with pytest.raises(ValueError, match="no fragment decode of Q3_K"):   # a type dense_gemm_qr does not read
        xp_matmul.gemm_q_launch(_qmatrix("Q3_K", 64, 2048), Dev((16, 2048), np.float16), Dev((16, 64)), None,
                                kernel="dense_gemm_qr")
    with pytest.raises(ValueError, match="IQ4_NL"):
        md.best_matmul("IQ4_NL", 1)


def test_group_of_mixed_types_is_one_launch_per_type(launches, monkeypatch):
    monkeypatch.setattr(md, "Q8X_MAX_TOKENS", 0)   # the F32-activation GEMV (the 8-bit one: below)
    monkeypatch.setattr(md, "Q8GEMM_MAX_TOKENS", 0)
    b = Builder()
    ws = [_qmatrix("Q4_K", 64, 256), _qmatrix("Q4_K", 16, 256), _qmatrix("Q6_K", 16, 256)]
    x = Dev((1, 256))
    outs = [Dev((1, w.shape[0])) for w in ws]
    run = xp_matmul._gemv(b, ws, x, outs, mode=0, norm_eps=1e-5, norm_w=Dev((256,)))
    assert run is not None and [ln.fn.name for ln in launches] == ["dense_gemv_q<12, 1>", "dense_gemv_q<14, 1>"]
    assert [ln.params[0].n_seg for ln in launches] == [2, 1]
    assert launches[1].params[0].seg[0].out == outs[2].data.ptr
    assert xp_matmul._gemv(b, ws[:2], Dev((20, 256)), [Dev((20, 64)), Dev((20, 16))], mode=0) is None   # GEMM's


@pytest.mark.parametrize("accumulate, scratch_rows, spans", [
    (False, 100, [(0, 100), (100, 200), (200, 250), (0, 40)]),
    (True, 100, [(0, 100), (100, 200), (200, 250), (0, 40)]),
    (True, 70, [(0, 70), (70, 140), (140, 210), (210, 250), (0, 40)]),
    (False, 400, [(0, 250), (0, 40)])])
def test_gemm_path_dequantizes_chunks_of_rows_into_the_scratch(launches, monkeypatch, accumulate, scratch_rows, spans):
    """Past the tiled GEMMs each chunk of rows (matmul_dispatch.dequant_chunk: what the scratch
    holds) is one dense_dequant_f16 launch into the scratch and one cuBLAS GEMM into the chunk's
    columns of the output."""
    monkeypatch.setattr(md, "QGEMM_MAX_TOKENS", 0)   # 33 tokens: dequantize + cuBLAS
    monkeypatch.setattr(md, "QSGEMM_MAX_TOKENS", 0)
    monkeypatch.setattr(md, "QRGEMM_MAX_TOKENS", 0)
    scratch = Dev((256 * scratch_rows,), np.float16)
    w1, w2 = _qmatrix("Q8_0", 250, 256, scratch), _qmatrix("Q8_0", 40, 256, scratch)
    x = Dev((33, 256))
    outs = [Dev((33, 250)), Dev((33, 40))]
    xp_matmul._qmatmuls(Builder(), [w1, w2], x, outs, accumulate=accumulate)
    deq = [ln for ln in launches if getattr(ln, "fn", None) != "gemm" and "dequant" in ln.fn.name]
    gemms = [ln.args for ln in launches if getattr(ln, "fn", None) == "gemm"]
    row_bytes = block_layout("Q8_0").row_bytes(256)
    assert len(deq) == len(gemms) == len(spans)
    for (r0, r1), ln, gm, (w, o) in zip(spans, deq, gemms, [(w1, outs[0])] * (len(spans) - 1) + [(w2, outs[1])]):
        src, dst, rb, n_in, rows = (a.value for a in ln.params)
        assert (src, dst, rb, n_in, rows) == (w.blocks.data.ptr + r0 * row_bytes, scratch.data.ptr, row_bytes, 256,
                                              r1 - r0)
        assert ln.fn.name == "dense_dequant_f16<8>"
        wptr, n_out, k, _x16, n_tok, out, ldc, beta = gm
        assert (wptr, n_out, k, n_tok, out, ldc) == (scratch.data.ptr, r1 - r0, 256, 33, o.data.ptr + 4 * r0,
                                                     w.shape[0])
        assert beta == (1.0 if accumulate else 0.0)


def test_dense_q_bench_runs_path_gemm_as_the_model_does(launches, monkeypatch):
    """tools/dev/gpu_dense_q_bench.py's dequantize + cuBLAS rows launch what _qmatmuls launches for
    the same matrix (the scratch, the chunks, the GEMMs' columns; the bench's own F16 x)."""
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "tools" / "dev"))
    import gpu_dense_q_bench as bench
    for knob in ("QGEMM_MAX_TOKENS", "QSGEMM_MAX_TOKENS", "QRGEMM_MAX_TOKENS"):
        monkeypatch.setattr(md, knob, 0)   # 33 tokens: dequantize + cuBLAS in the model too
    scratch = Dev((256 * 100,), np.float16)
    w, x16, out = _qmatrix("Q8_0", 250, 256, scratch), Dev((33, 256), np.float16), Dev((33, 250))

    def recorded():
        return [ln.args if ln.fn == "gemm" else (ln.fn.name, tuple(a.value for a in ln.params))
                for ln in launches if ln.fn == "gemm" or "dequant" in ln.fn.name]
    bench._dequant_gemm(None, K, {"wq": w}, x16, None, {"wq": out})
    got = recorded()
    launches.clear()
    xp_matmul._qmatmuls(Builder(), [w], Dev((33, 256)), [out])
    want = [a[:3] + (x16.data.ptr,) + a[4:] if a[0] == scratch.data.ptr else a for a in recorded()]
    assert got == want and len(got) == 2 * 3


def test_dequant_chunk_bounds():
    assert md.dequant_chunk(14336, 4096, 14336 * 4096) == 14336
    assert md.dequant_chunk(4096, 4096, 14336 * 4096) == 4096   # at most the matrix
    assert md.dequant_chunk(128256, 4096, 14336 * 4096) == 14336   # the head: what the scratch holds
    assert md.dequant_chunk(10, 4096, 4096) == 1
    with pytest.raises(ValueError, match="holds no row"):
        md.dequant_chunk(10, 4096, 4095)


@pytest.mark.parametrize("n_sm, splits", [(132, 10), (1, 1)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_gemm_q_path_launches_the_tiled_kernel(launches, monkeypatch, n_sm, splits, accumulate):
    """Under QGEMM_MAX_TOKENS the block weights take dense_gemm_q (no scratch needed): its grid
    and parameter block; split over n_in, the partial sums' scratch and one dense_splitk_sum
    launch adding them in the output's mode."""
    from ggml_attn import cuda_device
    monkeypatch.setattr(md, "Q8X_MAX_TOKENS", 0)   # (the F32 GEMV below the tiled GEMM)
    monkeypatch.setattr(md, "Q8GEMM_MAX_TOKENS", 0)   # (dense_gemm_q, not the int8 one
    monkeypatch.setattr(md, "QSGEMM_MAX_TOKENS", 0)   # nor the staged one)
    monkeypatch.setattr(md, "QRGEMM_MAX_TOKENS", 0)
    monkeypatch.setattr(md, "QGEMM_MIN_TOKENS", 17)
    monkeypatch.setattr(md, "QGEMM_MAX_TOKENS", 64)
    monkeypatch.setattr(cuda_device, "num_sms", lambda: n_sm)
    assert md.best_matmul("Q4_K", 33).path == "gemm-q" and md.best_matmul("Q4_K", 65).path == "gemm"
    assert md.best_matmul("F16", 33).path == "gemm" and md.best_matmul("Q4_K", 16).path == "gemv"
    monkeypatch.setattr(md, "QGEMM_MIN_TOKENS", 4)   # below the GEMV's limit: the tiled GEMM from 4 tokens
    assert [md.best_matmul("Q4_K", n).path for n in (3, 4, 16)] == ["gemv", "gemm-q", "gemm-q"]
    assert md.best_matmul("F16", 4).path == "gemv"
    monkeypatch.setattr(md, "QGEMM_MIN_TOKENS", 17)
    w = _qmatrix("Q4_K", 4096, 4096)   # no F16 scratch: the tiled path does not need one
    x, out = Dev((33, 4096)), Dev((33, 4096))
    kept = Builder()
    xp_matmul._qmatmuls(kept, [w], x, [out], accumulate=accumulate)
    gq = [ln for ln in launches if getattr(ln, "fn", None) != "gemm" and ln.fn.name.startswith("dense_gemm_q")]
    (ln,) = gq
    grid, k_chunk = K.gemm_q_grid(4096, 33, 4096, n_sm)
    assert ln.fn.name == "dense_gemm_q<12>" and ln.grid == grid == (64, 1, splits) and ln.block == (128, 1, 1)
    (p,) = ln.params
    assert isinstance(p, K.GemmQParams)
    assert (p.w, p.out, p.row_bytes, p.rows, p.n_in, p.n_tok, p.k_chunk) == \
        (w.blocks.data.ptr, out.data.ptr, 16 * 144, 4096, 4096, 33, k_chunk)
    assert p.x != 0 and p.x != x.data.ptr   # the F16 copy of x
    sums = [ln for ln in launches if getattr(ln, "fn", None) != "gemm" and ln.fn.name == "dense_splitk_sum"]
    if splits == 1:
        assert p.part == 0 and not sums and p.mode == int(accumulate)
        return
    (part,) = [a for a in kept.kept if getattr(a, "shape", None) == (splits, 33, 4096)]
    assert p.part == part.data.ptr and k_chunk * splits >= 4096 > k_chunk * (splits - 1)
    (sm,) = sums
    src, dst, n, z, mode = (a.value for a in sm.params)
    assert (src, dst, n, z, mode) == (part.data.ptr, out.data.ptr, 33 * 4096, splits, int(accumulate))


@pytest.mark.parametrize("n_tok", [9, 16, 17, 32, 33, 64])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("kernel, types", [("dense_gemm_qs", ("Q3_K", "Q2_K")), ("dense_gemm_qr", ("Q4_K", "Q6_K")),
                                           ("dense_gemm_qrm", ("Q4_K", "Q6_K"))])
def test_gemm_qs_path_casts_once_and_launches_the_staged_kernel(launches, monkeypatch, n_tok, accumulate,
                                                                 kernel, types):
    """In QSGEMM_MIN_TOKENS .. QSGEMM_MAX_TOKENS block weights with 16-byte aligned rows take
    dense_gemm_qr (the types of QRGEMM_TYPES, here all it reads) or dense_gemm_qs (the others): x rounded to F16 once
    for every weight, each weight's launch its tile for the tokens (gemm_qs_bn: 32 tokens, 2
    blocks an SM, up to 32 tokens for dense_gemm_qs and 16 for dense_gemm_qr, then 64) with that
    tile's dynamic shared memory, on gemm_q_grid's split, whose partial sums dense_splitk_sum
    adds in the output's mode. With matmul_dispatch.QRGEMM_ROWS 256, dense_gemm_qrm (dense_gemm_qr's
    wide tile over two row halves, the instance <T, 64, 2> of a program of its own) past the narrow
    tile's tokens."""
    bn = 32 if n_tok <= (32 if kernel == "dense_gemm_qs" else 16) else 64
    assert md.QRGEMM_ROWS == 128   # (dense_gemm_qrm: an A/B until measured)
    monkeypatch.setattr(md, "QRGEMM_ROWS", 256 if kernel == "dense_gemm_qrm" else 128)
    monkeypatch.setattr(md, "_hopper", lambda: True)   # (dense_gemm_qrm runs on sm_90 GPUs)
    if kernel == "dense_gemm_qrm" and n_tok <= K.GEMMQR_NARROW_MAX_TOKENS:
        kernel = "dense_gemm_qr"   # (the narrow tile's tokens keep dense_gemm_qr)
    qrm = kernel == "dense_gemm_qrm"
    from ggml_attn import cuda_device
    monkeypatch.setattr(cuda_device, "num_sms", lambda: 132)
    monkeypatch.setattr(md, "QRGEMM_TYPES", K.GEMMQR_TYPES)
    ws = [_qmatrix(types[0], 4096, 4096), _qmatrix(types[1], 1024, 4096)]
    path = "gemm-qs" if kernel == "dense_gemm_qs" else "gemm-qr"
    assert [md.best_matmul(w.type, n_tok).path for w in ws] == [path] * 2
    x, outs = Dev((n_tok, 4096)), [Dev((n_tok, 4096)), Dev((n_tok, 1024))]
    kept = Builder()
    xp_matmul._qmatmuls(kept, ws, x, outs, accumulate=accumulate)
    names = [ln.fn.name for ln in launches if getattr(ln, "fn", None) != "gemm"]
    assert names.count("dense_cast_f16") == 1 and "dense_quant_q8x" not in names
    gemms = [ln for ln in launches if getattr(ln, "fn", None) != "gemm" and ln.fn.name.startswith("dense_gemm_q")]
    assert [ln.fn.name for ln in gemms] == [f"dense_gemm_qr<{w.type_id}, {bn}, 2>" if qrm else
                                            f"{kernel}<{w.type_id}, {bn}>" for w in ws]
    sums = [ln for ln in launches if getattr(ln, "fn", None) != "gemm" and ln.fn.name == "dense_splitk_sum"]
    assert len(sums) == sum(ln.grid[2] > 1 for ln in gemms)
    for ln, w, o in zip(gemms, ws, outs):
        grid, k_chunk = K.gemm_q_grid(w.shape[0], n_tok, 4096, 132, kernel)
        assert ln.grid == grid and grid[1] == -(-n_tok // bn) and ln.block == (K.GEMMQS_THREADS, 1, 1)
        assert ln.fn.variant == (K.dense_qrm_variant(w.type_id) if qrm else K.dense_q_variant(w.type_id)) and \
            ln.fn.smem is None   # its own tile's SMEM
        (p,) = ln.params
        assert isinstance(p, K.GemmQParams) and p.x not in (0, x.data.ptr)   # the F16 copy of x
        assert (p.w, p.out, p.row_bytes, p.rows, p.n_in, p.n_tok, p.k_chunk) == \
            (w.blocks.data.ptr, o.data.ptr, w.row_bytes, w.shape[0], 4096, n_tok, k_chunk)
        assert (p.part != 0) == (grid[2] > 1) and p.mode == int(accumulate)
    for sm in sums:
        assert sm.params[-1].value == int(accumulate)


@pytest.mark.parametrize("accumulate", [False, True])
def test_gemm_qw_path_on_sm90_from_its_tokens(launches, monkeypatch, accumulate):
    """With QWGEMM_MIN_TOKENS set, on an sm_90 GPU (only: elsewhere the sm_90a program does not
    load) block weights of the types dense_gemm_qr reads take dense_gemm_qw from that many tokens:
    x rounded to F16 once, one launch a weight of its sm_90a program, gemm_q_grid's grid of
    128 x 128 tiles (split over n_in where the tiles are few: the 1024-row weight) in 256 threads
    with its own dynamic shared memory, the partial sums added by dense_splitk_sum; the other
    types keep dequantize + cuBLAS. Off (None, the default), nothing changes."""
    from ggml_attn import cuda_device
    monkeypatch.setattr(cuda_device, "num_sms", lambda: 132)
    assert md.QWGEMM_MIN_TOKENS is None and md.best_matmul("Q4_K", 512).path == "gemm"
    monkeypatch.setattr(md, "QWGEMM_MIN_TOKENS", 129)
    monkeypatch.setattr(K, "device_arch", lambda: "sm_80")
    assert md.best_matmul("Q4_K", 512).path == "gemm"
    monkeypatch.setattr(K, "device_arch", lambda: "sm_90")
    assert [md.best_matmul("Q4_K", n).path for n in (4, 64, 128, 129, 512)] == \
        ["gemv-q8x", "gemm-qr", "gemm-qr", "gemm-qw", "gemm-qw"]
    assert md.best_matmul("Q3_K", 512).path == "gemm" and md.best_matmul("Q4_K", 512, aligned=False).path == "gemm"
    assert "wgmma" in md.best_matmul("Q6_K", 512).reason
    ws = [_qmatrix("Q4_K", 4096, 4096), _qmatrix("Q6_K", 1024, 4096)]
    x, outs = Dev((512, 4096)), [Dev((512, 4096)), Dev((512, 1024))]
    xp_matmul._qmatmuls(Builder(), ws, x, outs, accumulate=accumulate)
    names = [ln.fn.name for ln in launches if getattr(ln, "fn", None) != "gemm"]
    assert names.count("dense_cast_f16") == 1 and not any(n.startswith("dense_dequant") for n in names)
    gemms = [ln for ln in launches if getattr(ln, "fn", None) != "gemm" and ln.fn.name.startswith("dense_gemm_q")]
    assert [ln.fn.name for ln in gemms] == [f"dense_gemm_qw<{w.type_id}, 1, 0>" for w in ws]
    for ln, w, o in zip(gemms, ws, outs):
        grid, k_chunk = K.gemm_q_grid(w.shape[0], 512, 4096, 132, "dense_gemm_qw")
        assert ln.grid == grid and grid[:2] == (w.shape[0] // 128, 4) and ln.block == (256, 1, 1)
        assert ln.fn.variant == K.dense_qw_variant(w.type_id) and ln.fn.variant.arch_suffix == "a" and ln.fn.smem is None
        (p,) = ln.params
        assert (p.w, p.out, p.rows, p.n_in, p.n_tok, p.k_chunk, p.mode) == \
            (w.blocks.data.ptr, o.data.ptr, w.shape[0], 4096, 512, k_chunk, int(accumulate))
        assert (p.part != 0) == (grid[2] > 1)
    assert [ln.grid[2] for ln in gemms] == [1, 4]   # 128 tiles fill 132 SMs; 32 take 4 k chunks
    sums = [ln for ln in launches if getattr(ln, "fn", None) != "gemm" and ln.fn.name == "dense_splitk_sum"]
    assert len(sums) == 1 and sums[0].params[-1].value == int(accumulate)
    with pytest.raises(ValueError, match="decodes"):
        K.dense_qw_variant(block_layout("Q3_K").type_id)
    # the 256-row tile (matmul_dispatch.QWGEMM_ROWS 256, an A/B) where its stages fit: Q4_K's, not Q6_K's
    monkeypatch.setattr(md, "QWGEMM_ROWS", 256)
    launches.clear()
    xp_matmul._qmatmuls(Builder(), ws, x, outs, accumulate=accumulate)
    gemms = [ln for ln in launches if getattr(ln, "fn", None) != "gemm" and ln.fn.name.startswith("dense_gemm_q")]
    assert [ln.fn.name for ln in gemms] == ["dense_gemm_qw<12, 2, 0>", "dense_gemm_qw<14, 1, 0>"]
    assert gemms[0].grid[:2] == (16, 4) and gemms[0].grid == K.gemm_q_grid(4096, 512, 4096, 132, "dense_gemm_qw2")[0]
    with pytest.raises(ValueError, match="do not fit"):
        xp_matmul.gemm_q_launch(ws[1], x, outs[1], None, kernel="dense_gemm_qw2")
    # the half-precision decode (matmul_dispatch.QWGEMM_HALF, an A/B): the same tiles and grids
    monkeypatch.setattr(md, "QWGEMM_HALF", True)
    launches.clear()
    xp_matmul._qmatmuls(Builder(), ws, x, outs, accumulate=accumulate)
    half = [ln for ln in launches if getattr(ln, "fn", None) != "gemm" and ln.fn.name.startswith("dense_gemm_q")]
    assert [ln.fn.name for ln in half] == ["dense_gemm_qw<12, 2, 1>", "dense_gemm_qw<14, 1, 1>"]
    assert [ln.grid for ln in half] == [ln.grid for ln in gemms]
    assert [md.gemm_qw_kernel(t) for t in ("Q4_K", "Q6_K")] == ["dense_gemm_qw2h", "dense_gemm_qwh"]
    with pytest.raises(ValueError, match="do not fit"):
        xp_matmul.gemm_q_launch(ws[1], x, outs[1], None, kernel="dense_gemm_qw2h")


@pytest.mark.parametrize("n_sm, splits", [(132, 4), (1, 1)])
def test_gemm_q8_path_quantizes_once_and_launches_the_int8_kernel(launches, monkeypatch, n_sm, splits):
    """Under Q8GEMM_MAX_TOKENS block weights take dense_gemm_q8: x quantized once (no F16 copy)
    for every weight, each weight's launch on gemm_q_grid with the int8 arrays, split over n_in
    into partial sums that dense_splitk_sum adds."""
    from ggml_attn import cuda_device
    monkeypatch.setattr(md, "Q8X_MAX_TOKENS", 4)
    monkeypatch.setattr(md, "Q8GEMM_MAX_TOKENS", 64)
    monkeypatch.setattr(md, "QSGEMM_MAX_TOKENS", 0)
    monkeypatch.setattr(md, "QRGEMM_MAX_TOKENS", 0)
    monkeypatch.setattr(cuda_device, "num_sms", lambda: n_sm)
    assert [md.best_matmul("Q6_K", n).path for n in (4, 5, 64, 65)] == ["gemv-q8x", "gemm-q8", "gemm-q8", "gemm"]
    assert md.best_matmul("F16", 33).path == "gemm"
    ws = [_qmatrix("Q4_K", 4096, 4096), _qmatrix("Q4_K", 1024, 4096)]
    x, outs = Dev((33, 4096)), [Dev((33, 4096)), Dev((33, 1024))]
    kept = Builder()
    xp_matmul._qmatmuls(kept, ws, x, outs, accumulate=True)
    names = [ln.fn.name for ln in launches]
    assert names[0] == "dense_quant_q8x" and "dense_cast_f16" not in names
    assert names.count("dense_quant_q8x") == 1 and names.count("dense_gemm_q8<12, 64>") == 2
    quant = launches[0]
    assert quant.grid == (16, 33, 1) and quant.params[0].value == x.data.ptr and quant.params[3].value == 0.0
    xq, xd, xs = (a.value for a in (quant.params[5], quant.params[6], quant.params[7]))
    gemms = [ln for ln in launches if ln.fn.name == "dense_gemm_q8<12, 64>"]
    for ln, w, o in zip(gemms, ws, outs):
        grid, k_chunk = K.gemm_q_grid(w.shape[0], 33, 4096, n_sm, "dense_gemm_q8")
        assert ln.grid == grid and ln.block == (K.GEMMQ8_THREADS, 1, 1) and ln.fn.variant == K.dense_q8x_variant(12)
        assert ln.fn.smem is None   # its own: Q8gTile<12, 64>::SMEM (tests/test_kernels_compile.py)
        (p,) = ln.params
        assert isinstance(p, K.GemmQ8Params)
        assert (p.w, p.xq, p.xd, p.xs, p.out, p.row_bytes, p.rows, p.n_in, p.n_tok, p.k_chunk, p.mode) == \
            (w.blocks.data.ptr, xq, xd, xs, o.data.ptr, 16 * 144, w.shape[0], 4096, 33, k_chunk, 1)
        assert (p.part != 0) == (grid[2] > 1)
    assert gemms[0].grid[2] == splits
    sums = [ln for ln in launches if ln.fn.name == "dense_splitk_sum"]
    assert len(sums) == sum(ln.grid[2] > 1 for ln in gemms)
    with pytest.raises(ValueError, match="int8 block GEMM"):   # activations the quantization cannot take
        x4 = Dev(None, base=np.zeros(33 * 4096 + 4, np.float32)[1:1 + 33 * 4096].reshape(33, 4096))
        xp_matmul._qmatmuls(Builder(), ws[:1], x4, outs[:1])


def test_gemm_q_grid():
    """Tiles of 64 x 64, n_in split in whole 64-value steps (at least 256 values) into at most one
    wave of 5 blocks an SM; no split once the tiles fill a wave."""
    assert K.gemm_q_grid(4096, 32, 4096, 132) == ((64, 1, 10), 448)      # 640 blocks of 660 places
    assert K.gemm_q_grid(14336, 64, 4096, 132) == ((224, 1, 2), 2048)    # 448 (3 splits: 672, a second wave)
    assert K.gemm_q_grid(4096, 512, 4096, 132) == ((64, 8, 1), 4096)
    assert K.gemm_q_grid(37, 17, 608, 132) == ((1, 1, 2), 320)   # 10 steps, the last one half
    for rows, n_tok, n_in in [(1024, 64, 4096), (4096, 100, 14336), (32000, 17, 4096), (64, 64, 256)]:
        (gm, gn, gz), kc = K.gemm_q_grid(rows, n_tok, n_in, 132)
        assert kc % 64 == 0 and kc >= min(n_in, 256) and gz == -(-n_in // kc) and (gz - 1) * kc < n_in
        assert gz == 1 or gm * gn * gz <= 5 * 132
        assert gm * 64 >= rows and gn * 64 >= n_tok
    with pytest.raises(ValueError, match="tokens"):
        K.gemm_q_grid(4096, 0, 4096, 132)


def test_gemm_q8_grid_covers_every_value_and_takes_the_fewest_step_waves():
    """dense_gemm_q8's grid over random shapes and SM counts: 64-row x 16- or 64-token tiles, n_in
    split in whole 256-value steps (at least GEMMQ8_MIN_SPLIT values a split unless n_in is
    smaller) covering every value once, and no split count with fewer (waves x steps a block)."""
    rng = np.random.default_rng(3)
    for _ in range(300):
        rows, n_tok = int(rng.integers(1, 20000)), int(rng.integers(1, 200))
        n_in, n_sm = 32 * int(rng.integers(1, 600)), int(rng.choice([1, 8, 78, 132, 144]))
        (gm, gn, gz), kc = K.gemm_q_grid(rows, n_tok, n_in, n_sm, "dense_gemm_q8")
        bn = K.gemm_q8_bn(n_tok)
        assert gm == -(-rows // 64) and gn == -(-n_tok // bn) and kc % 256 == 0
        assert (gz - 1) * kc < n_in <= gz * kc and (gz == 1 or kc >= K.GEMMQ8_MIN_SPLIT)
        steps, slots = -(-n_in // 256), K.GEMMQ8_BLOCKS_PER_SM[bn] * n_sm

        def cost(z):
            return -(-gm * gn * z // slots) * -(-steps // z)
        assert all(cost(gz) <= cost(z) for z in range(1, max(1, steps * 256 // K.GEMMQ8_MIN_SPLIT) + 1))


def test_gemm_qr_min_split_lets_small_matrices_fill_the_sms(monkeypatch):
    """gemm_tiles.GEMMQR_MIN_SPLIT bounds dense_gemm_qr's split from below
    where GEMMQ8_MIN_SPLIT's leaves SMs idle: an 8B layer's 1024-row K projection at 64 tokens is
    8 x 4 blocks at 1024 values and takes 16 splits (128 blocks on 132 SMs) at 256; the matrices
    whose tiles fill the SMs keep their grids, dense_gemm_qs keeps GEMMQ8_MIN_SPLIT; values that
    are not whole steps are refused."""
    from ggml_attn import gemm_tiles
    assert gemm_tiles.GEMMQR_MIN_SPLIT == 256   # (routed at 59f97e0)
    monkeypatch.setattr(gemm_tiles, "GEMMQR_MIN_SPLIT", 1024)
    shapes = {"wk": (1024, 4096), "wq": (4096, 4096), "wg": (14336, 4096), "wd": (4096, 14336)}
    before = {k: K.gemm_q_grid(r, 64, n_in, 132, "dense_gemm_qr")[0] for k, (r, n_in) in shapes.items()}
    assert before["wk"] == (8, 1, 4)
    for ms in (256, 512):
        monkeypatch.setattr(gemm_tiles, "GEMMQR_MIN_SPLIT", ms)
        after = {k: K.gemm_q_grid(r, 64, n_in, 132, "dense_gemm_qr")[0] for k, (r, n_in) in shapes.items()}
        assert after["wk"] == (8, 1, 16 if ms == 256 else 8)
        assert {k: g for k, g in after.items() if k != "wk"} == {k: g for k, g in before.items() if k != "wk"}
        assert K.gemm_q_grid(1024, 64, 4096, 132, "dense_gemm_qs")[0][2] <= 4096 // K.GEMMQ8_MIN_SPLIT
        for n_in in (256, 768, 4096 + 512):   # every value once, whole steps a split
            (gm, gn, gz), kc = K.gemm_q_grid(1024, 16, n_in, 132, "dense_gemm_qr")
            assert kc % 256 == 0 and (gz == 1 or kc >= ms) and (gz - 1) * kc < n_in <= gz * kc
    for bad in (0, 100, 300):
        monkeypatch.setattr(gemm_tiles, "GEMMQR_MIN_SPLIT", bad)
        with pytest.raises(ValueError, match="GEMMQR_MIN_SPLIT"):
            K.gemm_q_grid(1024, 64, 4096, 132, "dense_gemm_qr")


def test_embedding_rows_of_blocks(launches):
    table = _qmatrix("Q4_0", 1000, 256)
    b = Builder()
    b.array = lambda t: ids
    ids = Dev((5,), np.int32)
    ids_t = SimpleNamespace()   # a tensor of the graph (b.array reads it)
    captured = {}

    def custom(b_, run, srcs, out, name, ptr=None):
        captured.update(run=run, out=out)
        return out
    orig = xp_ops._custom
    xp_ops._custom = custom
    try:
        xp_ops.get_rows(b, table, ids_t, "inp_embd", own=True)
    finally:
        xp_ops._custom = orig
    (ln,) = launches
    assert ln.fn.name == "dense_get_rows_q<2>" and captured["run"] is ln
    w, i, o, rb, n, n_ids = (a.value for a in ln.params)
    assert (w, i, o, rb, n, n_ids) == (table.blocks.data.ptr, ids.data.ptr, captured["out"].data.ptr, 8 * 18, 256, 5)
    assert ln.grid == (1, 1, 1)


@pytest.mark.parametrize("n_tok, bn", [(9, 16), (16, 16), (17, 64)])
def test_gemm_q8_tile_follows_the_tokens(launches, monkeypatch, n_tok, bn):
    """dense_gemm_q8 runs its narrow tile (64 x 16: a quarter of the activations' shared memory,
    3 blocks an SM) up to 16 tokens and its wide one past them: the instance, its dynamic shared
    memory (the instance's own, read from its program), and a grid of 16- or 64-token tiles split to
    fill that many blocks an SM."""
    from ggml_attn import cuda_device
    monkeypatch.setattr(cuda_device, "num_sms", lambda: 132)
    w = _qmatrix("Q4_K", 14336, 4096)
    xq, xd = Dev((n_tok, 4096), np.int8), Dev((n_tok, 128))
    grid, k_chunk = K.gemm_q_grid(14336, n_tok, 4096, 132, "dense_gemm_q8")
    part = Dev((grid[2], n_tok, 14336)) if grid[2] > 1 else None
    q8_matmul.gemm_q8_launch(w, xq, xd, xd, Dev((n_tok, 14336)), part)()
    ln = launches[0]
    assert ln.fn.name == f"dense_gemm_q8<12, {bn}>" and ln.fn.smem is None
    assert ln.grid == grid and grid[1] == -(-n_tok // bn) and ln.params[0].k_chunk == k_chunk
    # 224 row tiles: the narrow tile's 396 places take 3 splits of 6 steps (2 waves); the wide one's
    # 264 none (1, 2 and 4 splits all take 16 steps' time)
    assert (grid, k_chunk) == (((224, 1, 3), 6 * 256) if bn == 16 else ((224, 1, 1), 4096))



def test_gemv_q8x_ring_form_one_wave(launches, monkeypatch):
    """matmul_dispatch.Q8XR_TYPES (Q6_K, where it measured faster) sends aligned rows of the types the ring
    form reads (kernels.Q8XR_TYPES: the vector form's) at up to Q8XR_MAX_TOKENS tokens to
    dense_gemv_q8x_r, ahead of the vector form; its grid is one wave (SMs x the kernel's resident
    blocks), never more blocks than rows need; a type it does not read keeps its form, and a
    launch asking the form for one is refused."""
    from ggml_attn import cuda_device
    assert md.Q8XR_TYPES == ("Q6_K",) and K.Q8XR_TYPES == ("Q4_K", "Q5_K", "Q6_K", "Q8_0")
    monkeypatch.setattr(md, "Q8XR_TYPES", ("Q4_K", "Q6_K", "Q4_0"))
    assert [md.gemv_q8x_form(t, a, n) for t, a, n in (("Q4_K", True, 1), ("Q4_K", True, 2), ("Q4_K", False, 1),
                                                      ("Q6_K", True, 1), ("Q4_0", True, 1), ("Q8_0", True, 1))] \
        == ["ring", "staged", "plain", "ring", "staged", "vector"]
    monkeypatch.setattr(md, "Q8XR_MAX_TOKENS", 4)
    assert md.gemv_q8x_form("Q4_K", True, 4) == "ring" and md.gemv_q8x_form("Q4_K", True, 5) == "staged"
    # (occupancy by instance: the one-operand instance's, G 0, more blocks an SM)
    monkeypatch.setattr(K, "get_function", lambda variant, name, smem=None: SimpleNamespace(
        variant=variant, name=name, smem=smem, occupancy=lambda threads: 11 if name.endswith(", 0>") else 6))
    monkeypatch.setattr(cuda_device, "num_sms", lambda: 2)
    x, xq, xd, xs = Dev((2, 512)), Dev((2, 512), np.int8), Dev((2, 16)), Dev((2, 16))
    for one, g, per_sm in ((False, 1, 6), (True, 0, 11)):
        monkeypatch.setattr(md, "GEMV_ONE_TYPES", ("Q4_K",) if one else ())
        for rows in (128, 12, 200):
            launches.clear()
            w = _qmatrix("Q4_K", rows, 512)
            q8_matmul.q8x_launches([w], x, [Dev((2, rows))], xq, xd, xs, mode=0, quantize=False)
            (gemv,) = launches
            assert gemv.fn.name == f"dense_gemv_q8x_r<12, 2, {g}>"
            assert gemv.grid == (min(-(-rows // K.Q8X_SWARPS), 2 * per_sm), 1, 1)
            assert gemv.block == (32 * K.Q8X_SWARPS, 1, 1)
        launches.clear()   # gated: the every-mode instance, its occupancy, whatever the flag
        q8_matmul.q8x_launches([w, _qmatrix("Q4_K", 200, 512)], x, [Dev((2, 200))], xq, xd, xs, mode=2, quantize=False)
        (gemv,) = launches
        assert gemv.fn.name == "dense_gemv_q8x_r<12, 2, 1>" and gemv.grid == (2 * 6, 1, 1)
    assert q8_matmul.q8x_launches([_qmatrix("Q4_0", 16, 512)], x, [Dev((2, 16))], xq, xd, xs, mode=0,
                                  quantize=False, form="ring") is None
    assert {"dense_gemv_q8x_r<14, 4, 0>", "dense_gemv_q8x_r<14, 4, 1>"} <= set(K.dense_q8x_variant(14).names)
    assert not any("q8x_r" in n for n in K.dense_q8x_variant(2).names)


def test_gemm_qrm_tiles_take_two_row_halves_and_split_to_fill_the_sms():
    """dense_gemm_qrm (gemm_tiles.GEMMQRM_TILE: 256 rows, 64 tokens, one block an SM): an 8B
    gate matrix at 64 tokens is 56 tiles, split twice over n_in (112 blocks, 8 steps each, where
    one split would take 16 steps on 56 SMs); small matrices split down to GEMMQR_MIN_SPLIT as
    dense_gemm_qr's do; every value in exactly one split; no narrow tile."""
    assert K.gemm_tiling("dense_gemm_qrm", 64) == (K.GEMMQRM_TILE, 1, K.GEMMQ8_MIN_SPLIT)
    assert K.gemm_qs_bn(9, "dense_gemm_qrm") == K.gemm_qs_bn(64, "dense_gemm_qrm") == 64
    with pytest.raises(ValueError, match="64 tokens"):
        K.gemm_tiling("dense_gemm_qrm", 16, 32)
    with pytest.raises(ValueError, match="64 tokens"):
        K.staged_instance("dense_gemm_qrm", 12, 32)
    assert K.gemm_q_grid(14336, 64, 4096, 132, "dense_gemm_qrm") == ((56, 1, 2), 2048)
    (gm, gn, gz), kc = K.gemm_q_grid(1024, 64, 4096, 132, "dense_gemm_qrm")
    assert (gm, gn) == (4, 1) and gz * gm <= 132 and kc == 256   # (4 tiles: splits of one step)
    for rows, n_in in ((300, 768), (4096, 14336), (1024, 4096 + 512)):
        (gm, gn, gz), kc = K.gemm_q_grid(rows, 70, n_in, 132, "dense_gemm_qrm")
        assert gm == -(-rows // 256) and gn == 2 and kc % 256 == 0 and gz * kc >= n_in > (gz - 1) * kc
    assert K.staged_instance("dense_gemm_qrm", 12, 64) == "dense_gemm_qr<12, 64, 2>"
    assert K.dense_qrm_variant(12).names == ("dense_gemm_qr<12, 64, 2>",)
    with pytest.raises(ValueError, match="decodes"):
        K.dense_qrm_variant(block_layout("Q3_K").type_id)
    assert md.tiled_kernel("gemm-qr", "Q4_K", 64) == "dense_gemm_qr"   # (QRGEMM_ROWS 128 ships)


def test_qrgemm_rows_routes_dense_gemm_qrm_past_the_narrow_tile(monkeypatch):
    monkeypatch.setattr(md, "QRGEMM_ROWS", 256)
    monkeypatch.setattr(md, "_hopper", lambda: True)
    assert [md.tiled_kernel("gemm-qr", "Q4_K", n) for n in (9, 16, 17, 64, 128)] == \
        ["dense_gemm_qr"] * 2 + ["dense_gemm_qrm"] * 3
    monkeypatch.setattr(md, "_hopper", lambda: False)   # (its stages: up to 207 KB of shared memory)
    assert md.tiled_kernel("gemm-qr", "Q4_K", 64) == "dense_gemm_qr"
    assert md.tiled_kernel("gemm-qs", "Q3_K", 64) == "dense_gemm_qs"
    monkeypatch.setattr(md, "QRGEMM_ROWS", 192)
    with pytest.raises(ValueError, match="QRGEMM_ROWS"):
        md.tiled_kernel("gemm-qr", "Q4_K", 64)
