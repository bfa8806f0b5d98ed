"""NaN and inf: a masked cell never matters, a visible non-finite value propagates as in ggml.

ggml's own ``ggml_flash_attn_ext`` (CPU backend) is the oracle. Its scalar kernel -- the one it
runs for fewer than 64 query rows with F16/F32 K, and for any batch with BF16 or quantized K
-- skips every cell whose mask is -inf, so whatever K/V hold there cannot reach an output.
(Its tiled kernel, 64+ rows with F16/F32 K, does not skip them: garbage in a masked cell makes
rows NaN there. For those shapes the oracle is ggml on the same inputs with the garbage
replaced by finite values.) Arrays are in numpy order, see ``ggml_attn.reference``.
"""
import copy

import ggml
import numpy as np
import pytest

import ggml_attn
from ggml_attn import reference
from ggml_attn.conformance import FACase, make_inputs
from ggml_build import build_case, case_bytes, get_data, ggml_reference_node, graph_of, new_context

F32, F16, BF16, Q8_0 = ggml.GGML_TYPE_F32, ggml.GGML_TYPE_F16, ggml.GGML_TYPE_BF16, ggml.GGML_TYPE_Q8_0
MAX_NMSE = 5e-4
F16_NAN_BYTES = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
BITS = {np.nan: 0x7FC0, np.inf: 0x7F80, -np.inf: 0xFF80}  # bf16 bit patterns


def poison(arr, kv_type, cells, value, elem=3, stream=0, head=0):
    """Write ``value`` into element ``elem`` of K or V storage at ``cells`` (numpy order
    ``(ne3, n_head_kv, n_kv, D)``); for a quantized type, into the f16 scale of the row's
    first block (its whole block dequantizes to NaN/inf)."""
    for c in np.atleast_1d(cells):
        if kv_type == BF16:
            arr[stream, head, c, elem] = BITS[value] if value in BITS else value
        elif kv_type in (F16, F32):
            arr[stream, head, c, elem] = value
        else:
            arr[stream, head, c, 0:2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)


def compute(case, x, x_ggml=None, n_threads=2):
    """(ours on ``x``, ggml on ``x_ggml`` or ``x``, float64 reference on ``x``)."""
    x_ggml = x if x_ggml is None else x_ggml
    ctx = new_context(2 * case_bytes(case))
    try:
        ins = build_case(ctx, case, x)
        theirs_in = ins if x_ggml is x else build_case(ctx, case, x_ggml)
        ours = ggml_attn.flash_attn_ext(ctx, *ins[:4], case.scale, case.max_bias, case.logit_softcap, ins[4])
        theirs = ggml_reference_node(ctx, *theirs_in, case)
        ggml_attn.compute_graph(ctx, graph_of(ctx, theirs, ours), n_threads)
        a, b = get_data(ours), get_data(theirs)
    finally:
        ggml.ggml_free(ctx)
    kf, vf = x.kv_float()
    with np.errstate(all="ignore"):
        exact = reference.flash_attn_ext(x.q, kf, vf, x.mask, case.scale, case.max_bias, case.logit_softcap, x.sinks)
    return a, b, exact


def pattern(o):
    """Per (stream, row, head): N (some NaN), I (some inf), 0 (all zero) or . (finite)."""
    return np.where(np.isnan(o).any(-1), "N", np.where(np.isinf(o).any(-1), "I",
                                                       np.where((o == 0).all(-1), "0", ".")))


def assert_same(a, b, what):
    assert np.array_equal(pattern(a), pattern(b)), f"{what}: NaN/inf rows differ\n{pattern(a)[0, :, 0]}\n{pattern(b)[0, :, 0]}"
    assert reference.nmse(a, b) <= MAX_NMSE, what


def make_case(kv_type, n_batch, n_kv, sinks=False, max_bias=0.0, softcap=0.0, ne3=1, gqa=2):
    c = FACase(hsk=64, hsv=64, n_head_kv=2, gqa=gqa, ne3=ne3, n_kv=n_kv, n_batch=n_batch, mask=True,
               sinks=sinks, max_bias=max_bias, logit_softcap=softcap, kv_type=kv_type)
    x = make_inputs(c, np.random.default_rng(n_batch * 1000 + n_kv))
    x.mask[...] = np.random.default_rng(1).uniform(-1, 1, x.mask.shape).astype(np.float16)
    x.mask[..., 7] = -np.inf           # cell 7: hidden from every row
    x.mask[..., n_kv - 20:] = -np.inf  # the tail: hidden from every row
    x.mask[:, :, 0::2, 11] = -np.inf   # cell 11: hidden from even rows only
    return c, x


def scalar_kernel(kv_type, n_batch):
    """True when ggml's CPU op runs its scalar kernel (which skips masked cells) here."""
    return n_batch < 64 or kv_type not in (F16, F32)


# ------------------------------------------------------------------ item: masked cells
@pytest.mark.parametrize("kv_type", [F32, F16, BF16, Q8_0], ids=["f32", "f16", "bf16", "q8_0"])
@pytest.mark.parametrize("n_batch,n_kv", [(1, 113), (1, 1024), (3, 113), (32, 1024), (75, 113)])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_masked_cells_never_matter(kv_type, n_batch, n_kv, value):
    """NaN/inf in K and V at cells that every row has masked: the output is that of the clean
    inputs, in ours and in the float64 reference, and equals ggml's."""
    c, clean = make_case(kv_type, n_batch, n_kv)
    x = copy.deepcopy(clean)
    for arr in (x.k, x.v):
        for head in (0, 1):
            poison(arr, kv_type, [7, n_kv - 1, n_kv - 20], value, head=head)
    ours, theirs, exact = compute(c, x, None if scalar_kernel(kv_type, n_batch) else clean)
    assert np.isfinite(ours).all() and np.isfinite(exact).all()
    _, theirs_clean, exact_clean = compute(c, clean)
    assert_same(ours, theirs, "ours vs ggml")
    assert_same(ours, theirs_clean, "ours vs ggml on clean inputs")
    assert reference.nmse(exact, exact_clean) <= 1e-12, "reference with garbage vs clean"


@pytest.mark.parametrize("kv_type", [F32, F16, BF16, Q8_0], ids=["f32", "f16", "bf16", "q8_0"])
@pytest.mark.parametrize("n_batch,n_kv", [(3, 113), (32, 1024)])
@pytest.mark.parametrize("where", ["k", "v"])
def test_cell_masked_for_some_rows(kv_type, n_batch, n_kv, where):
    """NaN in K or V at a cell hidden from even rows and visible to odd rows: exactly the odd
    rows (of the KV head that holds it) are NaN, as in ggml; even rows are untouched."""
    c, x = make_case(kv_type, n_batch, n_kv)
    poison(getattr(x, where), kv_type, [11], np.nan, head=1)
    ours, theirs, exact = compute(c, x)
    assert_same(ours, theirs, "ours vs ggml")
    assert_same(exact, theirs, "reference vs ggml")
    nan_rows = np.isnan(ours).any(-1)[0]   # (n_batch, n_head)
    assert not nan_rows[0::2].any() and not nan_rows[:, :2].any()
    if n_batch > 1:
        assert nan_rows[1::2, 2:].all()


@pytest.mark.parametrize("compute", ["ggml", "numpy"])
def test_masked_garbage_in_the_batching_path(compute):
    """The batching path (cache views, cells never written): garbage in unused cache cells does
    not reach the outputs, in the ggml graph and in the numpy (reference) path."""
    from ggml_attn.graph import AttnConfig, Batch, KVCache, run_batch
    cfg = AttnConfig(n_layer=1, n_head=4, n_head_kv=2, head_dim_k=64)
    batch = Batch.from_lengths([5, 3, 9])
    ref = run_batch(KVCache(512, 3, n_layer=1, n_head_kv=2, head_dim_k=64), batch, 512, "simple", cfg,
                    compute=compute).out
    cache = KVCache(512, 3, n_layer=1, n_head_kv=2, head_dim_k=64)
    cache.k[...] = np.nan
    cache.v[...] = np.inf
    out = run_batch(cache, batch, 512, "simple", cfg, compute=compute).out
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=0, atol=0)


# ------------------------------------------------------------------ item: visible values
def _set(name, fn):
    return pytest.param(fn, id=name)


VISIBLE = [
    _set("q-nan", lambda x: x.q.__setitem__((0, 1, 1, 5), np.nan)),
    _set("q-inf", lambda x: x.q.__setitem__((0, 1, 1, 5), np.inf)),
    _set("q-nan-fully-masked-row", lambda x: (x.mask.__setitem__((0, 0, 2, slice(None)), -np.inf),
                                              x.q.__setitem__((0, 0, 2, 5), np.nan))),
    _set("mask-nan", lambda x: x.mask.__setitem__((0, 0, 1, 3), np.nan)),
    _set("mask-+inf", lambda x: x.mask.__setitem__((0, 0, 1, 3), np.inf)),
    _set("mask-+inf-twice", lambda x: (x.mask.__setitem__((0, 0, 1, 3), np.inf),
                                       x.mask.__setitem__((0, 0, 1, 9), np.inf))),
    _set("mask-+inf-only-visible-cell", lambda x: (x.mask.__setitem__((0, 0, 2, slice(None)), -np.inf),
                                                   x.mask.__setitem__((0, 0, 2, 4), np.inf))),
]
KV_VISIBLE = [
    ("k", np.nan, 3), ("v", np.nan, 3), ("v", np.inf, 3), ("v", -np.inf, 3),
    ("k", np.inf, 0), ("k", -np.inf, 0), ("k", np.inf, 5), ("k", -np.inf, 5),
]


def _visible_case(kv_type, n_batch, n_kv, **kw):
    c, x = make_case(kv_type, n_batch, n_kv, **kw)
    return c, x


@pytest.mark.parametrize("kv_type", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("n_batch,n_kv", [(3, 113), (3, 1024), (32, 113)])
@pytest.mark.parametrize("change", VISIBLE)
def test_visible_nonfinite_q_and_mask_as_ggml(kv_type, n_batch, n_kv, change):
    """NaN in Q or the mask turns the row NaN; one +inf mask cell gives that cell's V, two give
    NaN; a fully masked row stays zero whatever Q holds -- as ggml's CPU op."""
    c, x = _visible_case(kv_type, n_batch, n_kv)
    change(x)
    ours, theirs, exact = compute(c, x)
    assert_same(ours, theirs, "ours vs ggml")
    assert_same(exact, theirs, "reference vs ggml")


@pytest.mark.parametrize("kv_type", [F32, F16, BF16, Q8_0], ids=["f32", "f16", "bf16", "q8_0"])
@pytest.mark.parametrize("n_batch,n_kv", [(1, 113), (3, 1024), (32, 113)])
@pytest.mark.parametrize("where,value,cell", KV_VISIBLE, ids=[f"{w}{v}@{c}" for w, v, c in KV_VISIBLE])
def test_visible_nonfinite_kv_as_ggml(kv_type, n_batch, n_kv, where, value, cell):
    """NaN/inf in K or V at a cell every row sees. An inf in K makes a logit +-inf (NaN when
    the signs of q cancel it): one +inf logit gives that cell's V, a -inf logit weighs 0 except
    at a row's first visible cell (ggml's running max starts at -inf: NaN)."""
    if kv_type == Q8_0 and not np.isnan(value):
        value = np.nan  # an inf scale dequantizes to inf and NaN mixed; NaN is the clean case
    c, x = _visible_case(kv_type, n_batch, n_kv)
    poison(getattr(x, where), kv_type, [cell], value)
    ours, theirs, exact = compute(c, x)
    assert_same(ours, theirs, "ours vs ggml")
    assert_same(exact, theirs, "reference vs ggml")


@pytest.mark.parametrize("sink", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_nonfinite_sinks_as_ggml(sink):
    c, x = make_case(F16, 5, 113, sinks=True)
    x.mask[0, 0, 3, :] = -np.inf  # a fully masked row
    x.sinks[1] = sink
    ours, theirs, exact = compute(c, x)
    assert_same(ours, theirs, "ours vs ggml")
    assert_same(exact, theirs, "reference vs ggml")


@pytest.mark.parametrize("kw", [dict(softcap=10.0), dict(max_bias=8.0), dict(sinks=True)],
                         ids=["softcap", "alibi", "sinks"])
def test_nonfinite_with_softcap_alibi_sinks(kw):
    """inf in K under a softcap (tanh: finite logit), +inf/NaN mask under ALiBi, and with sinks."""
    c, x = make_case(F16, 3, 113, **kw)
    poison(x.k, F16, [5], np.inf)
    poison(x.k, F16, [7, 100], np.nan)   # masked: never matters
    x.mask[0, 0, 1, 3] = np.inf
    x.mask[0, 0, 2, 4] = np.nan
    ours, theirs, exact = compute(c, x)
    assert_same(ours, theirs, "ours vs ggml")
    assert_same(exact, theirs, "reference vs ggml")


@pytest.mark.parametrize("n_threads", [1, 3])
def test_nan_propagation_in_ggml_tiled_shapes(n_threads):
    """64+ rows (ggml's tiled kernel): NaN in Q, the mask or a visible K cell still makes
    exactly that row NaN, in ours and in ggml."""
    c, x = make_case(F16, 75, 113)
    x.q[0, 0, 4, 1] = np.nan
    x.mask[0, 0, 9, 2] = np.nan
    ours, theirs, exact = compute(c, x, n_threads=n_threads)
    assert_same(ours, theirs, "ours vs ggml")
    assert_same(exact, theirs, "reference vs ggml")
    nan = np.isnan(ours).any(-1)[0]  # (n_batch, n_head)
    assert nan[4, 0] and nan[9].all() and nan.sum() == 1 + c.n_head


def test_nmse_accepts_equal_nan_patterns():
    """NaN at the same places in both: compared on the finite rest (not inf as before)."""
    a = np.array([1.0, np.nan, np.inf, 2.0])
    assert reference.nmse(a, a.copy()) == 0.0
    assert reference.nmse(a, np.array([1.0, np.inf, np.nan, 2.0])) == np.inf
    assert reference.nmse(a, np.array([1.0, np.nan, -np.inf, 2.0])) == np.inf
