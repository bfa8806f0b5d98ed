"""A batch that fails at any point leaves the KV cache as it was for the failed ubatch.

llama.cpp's decode removes a failed ubatch's positions and keeps the ubatches before it;
``run_batch`` does the same and says which ubatches were applied (``BatchError`` /
``BatchInterrupted``). Cell state compared: positions, sequence sets, pad flags, heads.
"""
import numpy as np
import pytest

import ggml_attn
from ggml_attn.graph import Batch, KVCache, split_ubatches
from ggml_attn.graph import build as build_mod
from ggml_attn.graph import plan as plan_mod
from ggml_attn.graph import qkv_runner as runner_mod
from ggml_attn.graph.plan import plan_ubatch
from ggml_attn.graph.attn_config import AttnConfig
from ggml_attn.graph.qkv_runner import BatchError, BatchInterrupted, run_batch

CFG = AttnConfig(n_layer=2, n_head=4, n_head_kv=2, head_dim_k=16)
BATCH_LENGTHS = [5, 1, 9, 3]


def cache_for(unified=False, n_seq=4, n_ctx=1024, cfg=CFG):
    return KVCache(n_ctx, n_seq, unified=unified, n_layer=cfg.n_layer, n_head_kv=cfg.n_head_kv,
                   head_dim_k=cfg.head_dim_k, head_dim_v=cfg.head_dim_v)


def state(c):
    return c.pos.copy(), c.seqs.copy(), c.pad.copy(), list(c.head)


def assert_state(c, expect):
    got = state(c)
    for name, a, b in zip(("pos", "seqs", "pad", "head"), got, expect):
        assert np.array_equal(np.asarray(a), np.asarray(b)), f"cache {name} differs"


def prefilled(unified, mode):
    """A cache that already holds one prompt per sequence (so rollback must keep those cells)."""
    c = cache_for(unified)
    run_batch(c, Batch.from_lengths([3, 2, 4, 1]), 512, mode, CFG)
    return c


class FailOn:
    """Callable that raises ``exc`` on call number ``n`` (0-based) and passes through otherwise."""

    def __init__(self, real, n, exc):
        self.real, self.n, self.exc, self.calls = real, n, exc, 0

    def __call__(self, *a, **kw):
        i = self.calls
        self.calls += 1
        if i == self.n:
            raise self.exc
        return self.real(*a, **kw)


def expected_after(unified, mode, n_applied, ubs):
    """The cache state after exactly the first ``n_applied`` ubatches of the batch."""
    c = prefilled(unified, mode)
    if n_applied:
        run_batch(c, the_batch(c), 512, mode, CFG, ubatches=ubs[:n_applied], validate=False)
    return state(c)


def the_batch(c):
    return Batch.from_lengths(BATCH_LENGTHS, start_pos=c.next_positions(range(4)))


# (mode, unified): padded has pad cells, equal/seq several ubatches, simple one stream
MODES = [("padded", False), ("equal", False), ("simple", True), ("seq", True)]


def failure_points(monkeypatch, where, n, exc):
    if where == "build":   # a ubatch's graph: built, or a kept one loaded with its plan (one per ubatch)
        calls = [0]

        def counted(real):
            def prepare(*a, **kw):
                calls[0] += 1
                if calls[0] - 1 == n:
                    raise exc
                return real(*a, **kw)
            return prepare
        monkeypatch.setattr(build_mod, "build_ubatch_graph", counted(build_mod.build_ubatch_graph))
        monkeypatch.setattr(build_mod.UBatchGraph, "load_plan", counted(build_mod.UBatchGraph.load_plan))
    elif where == "op":  # the attention op inside ggml's compute: 2 layers x 2 graph threads per ubatch
        monkeypatch.setattr(ggml_attn.cpu, "flash_attn_ext_host",
                            FailOn(ggml_attn.cpu.flash_attn_ext_host, 4 * n + 2, exc))
    elif where == "mask":
        monkeypatch.setattr(plan_mod, "build_mask", FailOn(plan_mod.build_mask, n, exc))
    elif where == "outputs":  # reading the results, after compute
        real, calls = build_mod.UBatchGraph.outputs, []

        def outputs(self):
            calls.append(1)
            if len(calls) - 1 == n:
                raise exc
            return real(self)
        monkeypatch.setattr(build_mod.UBatchGraph, "outputs", outputs)


@pytest.mark.parametrize("mode,unified", MODES)
@pytest.mark.parametrize("where", ["build", "op", "mask", "outputs"])
@pytest.mark.parametrize("fail_at", [0, 1])
def test_failed_ubatch_leaves_the_cache_as_it_was(monkeypatch, mode, unified, where, fail_at):
    c = prefilled(unified, mode)
    batch = the_batch(c)
    ubs = split_ubatches(batch, 8, mode)
    if fail_at >= len(ubs):
        pytest.skip(f"{mode} makes {len(ubs)} ubatch(es)")
    expect = expected_after(unified, mode, fail_at, ubs)
    failure_points(monkeypatch, where, fail_at, RuntimeError("planted failure"))
    with pytest.raises(BatchError, match="planted failure") as ei:
        run_batch(c, batch, 8, mode, CFG, compute="ggml")
    e = ei.value
    assert e.failed == fail_at and len(e.applied) == fail_at
    assert [p.ubatch.token_idx.tolist() for p in e.applied] == [u.token_idx.tolist() for u in ubs[:fail_at]]
    assert_state(c, expect)
    assert c.pad.sum() == 0, "a pad cell leaked"
    monkeypatch.undo()
    # the rest of the batch (all of it when nothing was applied) now goes through
    retry = e.remaining
    if fail_at == 0:
        assert retry.n_tokens == batch.n_tokens
    run_batch(c, retry, 8, mode, CFG, compute="ggml")
    clean = prefilled(unified, mode)
    run_batch(clean, the_batch(clean), 8, mode, CFG, compute="ggml")
    for s in range(4):
        p1, k1, v1 = c.sequence_contents(s, 1)
        p2, k2, v2 = clean.sequence_contents(s, 1)
        assert p1.tolist() == p2.tolist()
        assert np.array_equal(k1, k2) and np.array_equal(v1, v2)


@pytest.mark.parametrize("compute", ["ggml", "numpy"])
def test_ctrl_c_is_still_keyboard_interrupt_and_rolls_back(monkeypatch, compute):
    c = prefilled(False, "equal")
    before = state(c)
    batch = the_batch(c)
    monkeypatch.setattr(runner_mod, "ubatch_inputs", FailOn(runner_mod.ubatch_inputs, 1, KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt) as ei:
        run_batch(c, batch, 8, "equal", CFG, compute=compute)
    assert isinstance(ei.value, BatchInterrupted)
    assert ei.value.failed == 0 and ei.value.applied == []
    assert_state(c, before)
    monkeypatch.undo()
    run_batch(c, batch, 8, "equal", CFG, compute=compute)  # the same batch, again: fine


def test_ctrl_c_inside_the_op_rolls_back(monkeypatch):
    c = prefilled(True, "simple")
    before = state(c)
    batch = the_batch(c)

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(ggml_attn.cpu, "flash_attn_ext_host", interrupted)
    with pytest.raises(BatchInterrupted):
        run_batch(c, batch, 512, "simple", CFG, compute="ggml")
    assert_state(c, before)
    monkeypatch.undo()
    run_batch(c, batch, 512, "simple", CFG, compute="ggml")


@pytest.mark.parametrize("compute", ["ggml", "numpy"])
@pytest.mark.parametrize("cfg", [AttnConfig(n_layer=3, n_head=4, n_head_kv=2, head_dim_k=16),
                                 AttnConfig(n_layer=2, n_head=4, n_head_kv=4, head_dim_k=16),
                                 AttnConfig(n_layer=2, n_head=4, n_head_kv=2, head_dim_k=8),
                                 AttnConfig(n_layer=2, n_head=4, n_head_kv=2, head_dim_k=16, head_dim_v=8)],
                         ids=["layers", "heads", "head_dim", "head_dim_v"])
def test_geometry_mismatch_is_found_before_any_cell_is_claimed(compute, cfg):
    c = prefilled(False, "equal")
    before = state(c)
    with pytest.raises(ValueError, match="cache"):
        run_batch(c, the_batch(c), 8, "equal", cfg, compute=compute)
    assert_state(c, before)


def test_plan_ubatch_is_atomic(monkeypatch):
    c = prefilled(False, "padded")
    before = state(c)
    (ub, *_) = split_ubatches(the_batch(c), 512, "padded")
    monkeypatch.setattr(plan_mod, "build_mask", FailOn(plan_mod.build_mask, 0, RuntimeError("mask")))
    with pytest.raises(RuntimeError, match="mask"):
        plan_ubatch(c, ub)
    assert_state(c, before)


def test_transaction_restores_cells_and_heads_and_nests():
    c = prefilled(False, "padded")
    before = state(c)
    ub = split_ubatches(the_batch(c), 512, "padded")[0]
    with pytest.raises(RuntimeError):
        with c.transaction():
            slot = c.place(ub)
            c.free_pads(slot)
            c.seq_rm(0)
            c.seq_add(1, -1, -1, 5)
            with c.transaction():
                c.seq_keep(2)
            raise RuntimeError
    assert_state(c, before)
    with c.transaction():  # success: kept
        c.place(ub)
    assert c.pos.max() > before[0].max()
    # an inner failure undoes only the inner part
    mid = state(c)
    with c.transaction():
        with pytest.raises(RuntimeError):
            with c.transaction():
                c.seq_rm(-1)
                raise RuntimeError
        assert_state(c, mid)


@pytest.mark.parametrize("exc", [RuntimeError("planted failure"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_cli_runner_decode_rolls_back_a_failed_ubatch(monkeypatch, exc):
    """The CLI's pipeline (``ggml_attn.cli.runner.Runner.decode``) uses the same transaction."""
    from ggml_attn.cli.models import PRESETS
    from ggml_attn.cli.runner import RunConfig, Runner
    r = Runner(RunConfig(model=PRESETS["tiny"], n_ctx=1024, n_seq=2, kv_unified=False, split="padded"))
    try:
        r.decode(r.prompt_batch([5, 3]))
        before = state(r.cache)
        monkeypatch.setattr(r.engine, "run_ubatch", FailOn(r.engine.run_ubatch, 0, exc))
        with pytest.raises(type(exc)):
            r.decode(r.prompt_batch([2, 4]))
        assert_state(r.cache, before)
        monkeypatch.undo()
        r.decode(r.prompt_batch([2, 4]))  # the same batch again
        assert [r.cache.seq_pos_max(s) for s in (0, 1)] == [6, 6]
        assert r.cache.pad.sum() == 0
    finally:
        r.close()


def test_transaction_restores_kv_copied_across_streams():
    """seq_cp across streams (split cache) copies K/V data too: a failed transaction puts the
    destination stream's K/V back as well, not only its cells."""
    c = prefilled(False, "equal")
    before = state(c)
    k1, v1 = c.k[:, 1].copy(), c.v[:, 1].copy()
    with pytest.raises(RuntimeError):
        with c.transaction():
            c.seq_cp(0, 1)
            raise RuntimeError
    assert_state(c, before)
    assert np.array_equal(c.k[:, 1], k1) and np.array_equal(c.v[:, 1], v1)
    assert c.sequence_contents(1)[0].tolist() == [0, 1]
