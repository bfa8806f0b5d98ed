"""tools/dev/gpu_batched_attn_bench.py's setup, without a GPU: the decode step it times is the one
ggml-attn-batched-bench -npl 64 -kvu makes (one row per sequence, each seeing only its own
cells), and the steps' cells interleave so that every KV tile past the prompts holds a live cell
of every row -- the case the benchmark is about."""
import numpy as np

import gpu_batched_attn_bench as b  # tools/dev/ (on sys.path via conftest)


def test_step_plan_rows_see_their_own_cells_and_decode_tiles_interleave():
    seqs, steps = 16, 8
    plan, n_prompt = b.step_plan(seqs, steps)
    mask = np.asarray(plan.mask).reshape(-1, plan.mask.shape[-1])[:plan.ubatch.n_tokens]
    live = mask == 0
    assert plan.ubatch.n_tokens == seqs and live.shape[1] == plan.n_kv
    per_row = live.sum(axis=1)
    assert (per_row > 0).all() and per_row.sum() == n_prompt + seqs * (steps + 1)   # each cell seen by one row
    assert (live.sum(axis=0) <= 1).all()
    decode = live[:, n_prompt:n_prompt + seqs * steps]          # the steps' cells, in tiles of `seqs`
    tiles = decode.reshape(seqs, steps, seqs).any(axis=2)
    assert tiles.all(), "every step's block holds a live cell of every row"


# ---------------------------------------------------------------------------------------
# the bench's run() end to end without a GPU: CuPy and the backend's entry points faked on the
# host (numpy arrays; the float64 reference as "kernel"), so that the GPU slot is not spent on a
# broken row loop (cells sweep rows, checks, verdict)
class _HostArr(np.ndarray):
    def get(self):
        return np.asarray(self).copy()


class _FakeRng:
    def __init__(self, seed):
        self.g = np.random.default_rng(seed)

    def standard_normal(self, shape, dtype=np.float32):
        return self.g.standard_normal(shape, dtype=dtype).view(_HostArr)


def _fake_backend(monkeypatch, bad_label):
    import sys
    import types

    from ggml_attn import cuda_backend as cb
    from ggml_attn import cuda_launch
    from ggml_attn.dtypes import GGML_TYPE_F16
    from ggml_attn.reference import flash_attn_ext
    from ggml_attn.tensor import as_numpy
    cp = types.SimpleNamespace(float32=np.float32, float16=np.float16, nan=np.nan,
                               random=types.SimpleNamespace(default_rng=_FakeRng),
                               asarray=lambda a: np.ascontiguousarray(a).view(_HostArr),
                               empty=lambda shape, dtype: np.empty(shape, dtype).view(_HostArr))
    monkeypatch.setitem(sys.modules, "cupy", cp)
    import gpu_timing
    monkeypatch.setattr(gpu_timing, "copies_for", lambda nbytes: 2)
    calls = []

    def make_plan(dm, n_tok, h, hkv, head_dim_k, kernel):
        return types.SimpleNamespace(reads=(10.0, 100.0) if kernel == "auto" else None,
                                     max_cells=7 if kernel in ("auto", "cells") else None,
                                     refresh=lambda: None)

    class Fn:
        name = "fake"

        def attribute(self, attr):
            assert attr == "CU_FUNC_ATTRIBUTE_NUM_REGS"
            return 128

        def occupancy(self, block):
            assert block == 128
            return 4

    def bind(dq, kd, vd, dm, sinks, do, scale, kernel, plan, n_splits=None):
        return types.SimpleNamespace(kern="cells" if kernel == "auto" else kernel, _fn=Fn(),
                                     _grid=(1, 2, 3), _block=(128, 1, 1))

    def attn(dq, kd, vd, dm, sinks, do, scale, kernel, plan, n_splits=None):
        calls.append((kernel, n_splits, cuda_launch.CELLS_TUNE))
        q, k, v, m = (as_numpy(t) for t in (dq, kd, vd, dm))
        o = flash_attn_ext(q, k, v, m, scale, kv_type=GGML_TYPE_F16)
        if cuda_launch.CELLS_TUNE.label == bad_label:
            o = o * 1.01
        as_numpy(do)[...] = o
    monkeypatch.setattr(cb, "make_plan", make_plan)
    monkeypatch.setattr(cb, "bind", bind)
    monkeypatch.setattr(cb, "flash_attn_ext_device", attn)
    return calls


def test_bench_run_sweep_rows_checks_and_verdict(monkeypatch):
    from ggml_attn import cuda_launch
    from ggml_attn import kernels as K
    sweep = (K.CELLS_DEFAULT, K.CellsTune(u=4, pf=0), K.CellsTune(pf=2, rmax=4), K.CellsTune(rmax=2))
    calls = _fake_backend(monkeypatch, bad_label="pf2-r4")
    times = {"": 30.0, "u4-pf0": 20.0, "pf2-r4": 10.0, "r2": 29.5}

    def timer(fns):
        assert len(fns) in (1, 2)   # the K/V copies (1: the cell-list refresh)
        return times.get(cuda_launch.CELLS_TUNE.label, 50.0), 1.0, 2.0
    res = b.run(seqs=4, steps=2, timer=timer, splits=(2,), sweep=sweep)
    rows = {r["kernel"]: r for r in res["rows"]}
    assert list(rows) == ["auto", "prefill", "decode", "decode-tc", "decode-tma", "cells", "cells-s2", "cells-u4-pf0",
                          "cells-pf2-r4", "cells-r2"], rows
    assert not any("error" in r for r in rows.values()), rows
    assert rows["cells"]["nmse_ref"] <= 1e-12 and rows["cells"]["ok"] and "refresh_us" in rows["cells"]
    assert rows["cells-u4-pf0"]["nmse_vs_default"] == 0.0 and rows["cells-u4-pf0"]["ok"]
    assert not rows["cells-pf2-r4"]["ok"], "a variant off the default's output fails its check"
    assert rows["cells-r2"]["registers"] == 128 and rows["cells-r2"]["blocks_per_sm"] == 4
    # the variants ran under their tune, the default after them is restored
    assert {t for k, n, t in calls if k == "cells" and n is None} == set(sweep)
    assert cuda_launch.CELLS_TUNE == K.CELLS_DEFAULT
    v = res["sweep"]
    assert v["keep"] == "cells-u4-pf0" and v["failed_check"] == ["cells-pf2-r4"] and not v["errors"]
    assert v["by_time"][0] == ["cells-pf2-r4", 10.0]


def test_bench_verdict_keeps_default_without_a_clear_gain():
    rows = [dict(kernel="cells", us=30.0, ok=True), dict(kernel="cells-u2", us=29.5, ok=True,
                                                          nmse_vs_default=0.0),
            dict(kernel="cells-s2", us=20.0), dict(kernel="cells-pf1", error="x")]
    v = b.sweep_verdict(rows)
    assert v["keep"] == "cells" and v["errors"] == ["cells-pf1"] and v["by_time"][0] == ["cells-s2", 20.0]


def test_bench_cli_tunes(monkeypatch):
    from ggml_attn import kernels as K
    seen = {}
    monkeypatch.setattr(b, "run", lambda seqs, steps, sweep=None: seen.setdefault("sweep", sweep) and {})
    b.main(["--tunes", "u2-pf1,r2"])
    assert seen.pop("sweep") == (K.CellsTune(u=2, pf=1), K.CellsTune(rmax=2))
    b.main(["--no-sweep"])
    assert seen.pop("sweep") == ()
