"""The ubatch graph builder (``graph/build.py``) makes the same graphs as the reference dump
``tests/data/graph_structure.json``, written by ``tests/graph_dump.py`` from the builder before
its host-speed changes: same nodes in the same order (op, type, shapes, strides, views, names,
sources, op parameters, callbacks, memory aliasing) and the same results."""
import json
import os

import numpy as np
import pytest

from graph_dump import CASES, dump_case

_REF = os.path.join(os.path.dirname(__file__), "data", "graph_structure.json")


@pytest.fixture(scope="module")
def reference():
    with open(_REF) as f:
        return json.load(f)


@pytest.mark.parametrize("name", sorted(CASES))
def test_graph_structure_matches_reference(reference, name):
    got, ref = dump_case(name), reference[name]
    assert len(got["nodes"]) == len(ref["nodes"])
    for i, (a, b) in enumerate(zip(got["nodes"], ref["nodes"])):
        assert a == b, f"{name}: tensor {i} differs:\n got {a}\n ref {b}"
    # the results: each output's sum and sum of squares. ggml's CPU kernels differ in the last
    # f16 bits between machines (AVX512-FP16 against F16C conversions, other summation orders;
    # 1.6e-4 relative seen), so 1e-3 relative, the sum also within 1e-3 of the output's norm
    # (it can cancel to near 0); a wrong graph is off by O(1).
    for (s, ss), (rs, rss) in zip(got["outputs"], ref["outputs"]):
        assert ss == pytest.approx(rss, rel=1e-3), name
        assert s == pytest.approx(rs, rel=1e-3, abs=1e-3 * np.sqrt(rss)), name
