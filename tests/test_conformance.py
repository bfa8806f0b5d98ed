"""Our op against ggml's own ggml_flash_attn_ext (CPU backend) on test-backend-ops' grid.

Both results are also checked against the float64 numpy reference. NMSE <= 5e-4 and any
NaN/inf mismatch fails, as in test-backend-ops. Cases with garbage in masked KV cells
(``FACase.nonfinite``) give ggml the clean inputs (its tiled CPU kernel, 64+ query rows with
F16/F32 K, does not skip masked cells) and ours and the reference the garbage.
"""
import random
import zlib

import numpy as np
import pytest

import ggml_attn
from ggml_attn import reference
from ggml_attn.conformance import grid, make_inputs
from ggml_build import build_case, case_bytes, get_data, ggml_reference_node, graph_of, new_context

MAX_NMSE = 5e-4
ALL_CASES = list(grid())


def pytest_generate_tests(metafunc):
    # The whole grid runs by default (about 3 minutes on 2 cores); --grid-sample N runs a
    # fixed, seeded sample of N cases for quick local runs.
    if "case" in metafunc.fixturenames:
        n = metafunc.config.getoption("--grid-sample")
        cases = ALL_CASES
        if n:
            cases = [ALL_CASES[i] for i in sorted(random.Random(1234).sample(range(len(ALL_CASES)), n))]
        metafunc.parametrize("case", cases, ids=[c.id for c in cases])


def test_grid_size():
    # the port of test-backend-ops' loops: F32/F16/BF16 cases including permuted variants
    # float types, 6 quantized types, mixed K/V types, garbage in masked cells
    assert len(ALL_CASES) == 2808 + 6 * 336 + 9 + 328
    assert sum(c.nonfinite for c in ALL_CASES) == 328
    print(f"conformance grid: {len(ALL_CASES)} cases")


def test_conformance(case):
    rng = np.random.default_rng(zlib.crc32(case.id.encode()))
    x = make_inputs(case, rng)
    ctx = new_context(case_bytes(case) * (2 if case.nonfinite else 1))
    try:
        q, k, v, mask, sinks = build_case(ctx, case, x)
        theirs_in = build_case(ctx, case, x.clean) if case.nonfinite else (q, k, v, mask, sinks)
        theirs = ggml_reference_node(ctx, *theirs_in, case)
        ours = ggml_attn.flash_attn_ext(ctx, q, k, v, mask, case.scale, case.max_bias,
                                        case.logit_softcap, sinks)
        ggml_attn.compute_graph(ctx, graph_of(ctx, theirs, ours), 2)
        a, b = get_data(ours), get_data(theirs)
    finally:
        import ggml
        ggml.ggml_free(ctx)
    kf, vf = x.kv_float()
    with np.errstate(all="ignore"):  # garbage cells: the reference drops them, silently
        exact = reference.flash_attn_ext(x.q, kf, vf, x.mask, case.scale, case.max_bias,
                                         case.logit_softcap, x.sinks)
    assert a.shape == b.shape == exact.shape
    assert reference.nmse(a, b) <= MAX_NMSE, "ours vs ggml"
    assert reference.nmse(a, exact) <= MAX_NMSE, "ours vs float64 reference"
    assert reference.nmse(b, exact) <= MAX_NMSE, "ggml vs float64 reference"
    if case.nonfinite:
        assert np.isfinite(a).all(), "garbage in masked cells reached the output"
