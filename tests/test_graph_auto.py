"""auto (cost model) and the plan descriptions used by the CLI / README."""
import pytest

from ggml_attn.graph import (AttnConfig, Batch, CostModel, KVCache, choose_split, compare_strategies,
                             describe_plan, format_table, run_batch, split_ubatches)
from ggml_attn.reference import nmse

# ten prompts of 1..10 tokens: with split KV, llama.cpp cuts them into ten ubatches (10x1, 9x1, ...)
TEN_RAGGED = Batch.from_lengths(range(1, 11))


def test_ten_ragged_prompts_table_ubatch_counts():
    rows = {r["strategy"]: r for r in compare_strategies(TEN_RAGGED, 512)}
    assert {k: r["n_ubatches"] for k, r in rows.items()} == {
        "simple": 1, "equal": 10, "seq": 10, "padded": 1, "auto": 1}
    assert rows["equal"]["shapes"] == "10x1, 9x1, 8x1, ... 1x1"
    assert rows["padded"]["n_pad"] == 45 and rows["padded"]["rows"] == 100
    assert rows["auto"]["note"] == "-> padded"
    table = format_table(list(rows.values()))
    assert table.splitlines()[0].startswith("| strategy") and len(table.splitlines()) == 7


def test_auto_picks_padded_for_ten_ragged_prompts_and_says_why():
    choice = choose_split(TEN_RAGGED, 512)
    assert choice.mode == "padded"
    assert "padded: 1 ubatch(es), 100 rows (45 pad)" in choice.reason and "equal: 10 ubatch(es)" in choice.reason
    assert all(u.reason == choice.reason for u in choice.ubatches)


def test_auto_prefers_equal_when_padding_buys_nothing():
    choice = choose_split(Batch.from_lengths([100] * 10), 512)
    assert choice.mode == "equal"  # same shapes, llama.cpp's split listed first wins ties


def test_auto_avoids_padding_when_a_long_prompt_dominates():
    # ubatch overhead negligible -> padding 9 short prompts to 500 rows is not worth it
    model = CostModel(ubatch_us=0.0, row_us=1.0)
    choice = choose_split(Batch.from_lengths([500] + [1] * 9), 512, model=model)
    assert choice.mode != "padded" or all(u.n_pad == 0 for u in choice.ubatches)
    costs = {c.mode: c for c in choice.costs}
    assert costs[choice.mode].est_us == min(c.est_us for c in choice.costs)


def test_auto_on_unified_cache_considers_simple():
    cache = KVCache(1024, 10, unified=True)
    choice = choose_split(TEN_RAGGED, 512, cache=cache)
    assert {c.mode for c in choice.costs} == {"simple", "equal", "padded"}
    assert choice.mode == "simple"
    assert cache.pos.max() == -1  # dry run left the cache untouched
    with pytest.raises(ValueError, match="contradicts"):
        choose_split(TEN_RAGGED, 512, cache=cache, unified=False)


def test_tail_skip_cost_model_counts_interior_tiles():
    b = Batch.from_lengths([300, 290])  # unequal lengths: costed (equal ones take the fast path)
    cache = KVCache(1024, 2, unified=True)
    all_ = {c.mode: c for c in choose_split(b, 1024, cache=cache).costs}
    tail = {c.mode: c for c in choose_split(b, 1024, cache=cache, model=CostModel(skip="tail")).costs}
    assert tail["simple"].kv_tiles >= all_["simple"].kv_tiles
    with pytest.raises(ValueError, match="skip"):
        choose_split(b, 1024, cache=cache, model=CostModel(skip="some"))


def test_run_batch_auto_matches_simple():
    cfg = AttnConfig(n_layer=1, n_head=2, n_head_kv=1, head_dim=8)
    kw = dict(n_layer=1, n_head_kv=1, head_dim_k=8)
    ref = run_batch(KVCache(256, 10, unified=True, **kw), TEN_RAGGED, 512, "simple", cfg)
    got = run_batch(KVCache(2560, 10, unified=False, **kw), TEN_RAGGED, 512, "auto", cfg)
    assert [p.ubatch.mode for p in got.plans] == ["padded"]
    assert nmse(got.out, ref.out) < 1e-12


def test_describe_plan_rows():
    rows = describe_plan(TEN_RAGGED, 512, "equal")
    assert [r["shape"] for r in rows] == [f"{n}x1" for n in range(10, 0, -1)]
    assert rows[0]["n_stream"] == 10 and rows[0]["n_kv"] == 256 and rows[0]["seq_ids"] == "0..9"
    rows = describe_plan(TEN_RAGGED, 512, "simple")
    assert len(rows) == 1 and rows[0]["n_stream"] == 1 and rows[0]["shape"] == "1x55"
    rows = describe_plan(TEN_RAGGED, 512, "auto")
    assert "auto chose padded" in rows[0]["reason"]


def test_split_ubatches_auto_entry():
    ubs = split_ubatches(TEN_RAGGED, 512, "auto")
    assert [u.shape_str for u in ubs] == ["10x10"]


def test_auto_decode_step_takes_fast_path_without_dry_runs(monkeypatch):
    """64 sequences x 1 token (a decode step): padded == equal, nothing to cost."""
    import time

    from ggml_attn.graph import auto

    def boom(*a, **k):
        raise AssertionError("dry_run_plans called")
    monkeypatch.setattr(auto, "dry_run_plans", boom)
    split = KVCache(64 * 256, 64, unified=False)
    step = Batch.from_lengths([1] * 64, start_pos={s: 100 + s for s in range(64)})
    t0 = time.perf_counter()
    choice = choose_split(step, 512, cache=split)
    assert time.perf_counter() - t0 < 0.05
    assert choice.mode == "equal" and [u.shape_str for u in choice.ubatches] == ["64x1"]
    assert "without dry runs" in choice.reason and all(u.reason == choice.reason for u in choice.ubatches)
    assert choose_split(step, 512, cache=KVCache(64 * 256, 64, unified=True)).mode == "simple"
    assert choose_split(Batch.from_lengths([8] * 4), 512).mode == "equal"  # equal prompts too
    # reverse ids: padded takes them together where equal cannot -> costed (and dry-run)
    with pytest.raises(AssertionError, match="dry_run_plans"):
        choose_split(Batch.from_lengths([1] * 4, seq_ids=[3, 2, 1, 0]), 512, cache=split)
    with pytest.raises(AssertionError, match="dry_run_plans"):
        choose_split(Batch.from_lengths([1, 2]), 512, cache=split)
