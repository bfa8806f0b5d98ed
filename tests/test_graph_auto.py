"""auto (cost model) and the plan descriptions used by the CLI / README."""
import numpy as np
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
    cfg = AttnConfig(n_layer=1, n_head=2, n_head_kv=1, head_dim_k=8)
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


@pytest.mark.parametrize("model", [CostModel(), CostModel(skip="tail"), CostModel(ubatch_us=0.0, row_us=1.0)])
def test_unified_decode_step_in_any_id_order_takes_simple_as_the_dry_runs_would(monkeypatch, model):
    """On a unified cache a decode step of up to one query tile of rows, its ids in any order (a
    server's generating requests), takes simple without dry runs -- the split the dry runs of
    every candidate pick too, on a cache of interleaved prompts and earlier steps; past one query
    tile, or on a split cache, the candidates are still costed."""
    from ggml_attn.graph import auto
    rng = np.random.default_rng(7)
    for n_seq in (2, 17, 51, 64):
        cache = KVCache(64 * 512, 64, unified=True)
        lens = [int(x) for x in rng.integers(1, 200, n_seq)]
        ids = [int(x) for x in rng.permutation(64)[:n_seq]]
        cache.place(choose_split(Batch.from_lengths(lens, seq_ids=ids), 1 << 14, cache=cache).ubatches[0])
        order = [int(x) for x in rng.permutation(ids)]
        step = Batch.from_lengths([1] * n_seq, seq_ids=order, start_pos=cache.next_positions(order))
        fast = choose_split(step, 512, cache=cache, model=model)
        assert fast.mode == "simple" and "without dry runs" in fast.reason and not fast.costs
        with monkeypatch.context() as m:
            m.setattr(auto, "_uniform_choice", lambda *a: None)
            m.setattr(auto, "cost_floor", lambda mode, ubs, *a: auto.StrategyCost(mode, 0, 0, 0, 0, 0.0, False))
            full = choose_split(step, 512, cache=cache, model=model)
        assert full.mode == "simple", full.reason
    step = Batch.from_lengths([1] * 65, seq_ids=list(range(64, -1, -1)))
    with monkeypatch.context() as m:
        m.setattr(auto, "dry_run_plans", lambda *a, **k: (_ for _ in ()).throw(AssertionError("dry run")))
        with pytest.raises(AssertionError, match="dry run"):
            choose_split(step, 512, cache=KVCache(1024, 65, unified=True))


# ----------------------------------------------------------------- auto's own cost
# 48 ragged prompts of 16..200 tokens (the benchmark's --prompt-dist 16-200, smaller): auto
# picks padded; it must not plan more than padded itself does (no timing, call counts only)
RAGGED_48 = Batch.from_lengths([int(x) for x in np.random.default_rng(5).integers(16, 201, 48)])


class _Counts:
    """Counts the planning work: placement searches (``KVCache.find_slot``), masks
    (``build_mask`` as the plan calls it), tile maps, and splitter calls per mode."""

    def __init__(self, monkeypatch):
        from ggml_attn.graph import plan as plan_mod
        from ggml_attn.graph import split as split_mod
        self.n = {"find_slot": 0, "build_mask": 0, "tile_map": 0}
        self.splits = {m: 0 for m in split_mod._SPLITTERS}

        def counted(key, fn):
            def wrapper(*a, **k):
                self.n[key] += 1
                return fn(*a, **k)
            return wrapper

        monkeypatch.setattr(KVCache, "find_slot", counted("find_slot", KVCache.find_slot))
        monkeypatch.setattr(plan_mod, "build_mask", counted("build_mask", plan_mod.build_mask))
        monkeypatch.setattr(plan_mod, "tile_map", counted("tile_map", plan_mod.tile_map))
        for mode, fn in list(split_mod._SPLITTERS.items()):
            def splitter(state, n, _fn=fn, _mode=mode):
                ub = _fn(state, n)
                self.splits[_mode] += ub is not None
                return ub
            monkeypatch.setitem(split_mod._SPLITTERS, mode, splitter)

    def take(self):
        out = dict(self.n, splits=dict(self.splits))
        for k in self.n:
            self.n[k] = 0
        for k in self.splits:
            self.splits[k] = 0
        return out


def test_auto_plans_no_more_than_the_split_it_picks(monkeypatch):
    """run_batch with auto: the chosen split's dry-run plans are the ones run (no second
    planning, no second fit check), and candidates whose cost floor loses are never dry-run."""
    cfg = AttnConfig(n_layer=1, n_head=2, n_head_kv=1, head_dim_k=8)
    kw = dict(n_layer=1, n_head_kv=1, head_dim_k=8)
    counts = _Counts(monkeypatch)
    ref = run_batch(KVCache(48 * 512, 48, unified=False, **kw), RAGGED_48, 512, "padded", cfg)
    padded = counts.take()
    got = run_batch(KVCache(48 * 512, 48, unified=False, **kw), RAGGED_48, 512, "auto", cfg)
    auto = counts.take()
    assert [p.ubatch.mode for p in got.plans] == ["padded"] * len(ref.plans)
    n_ub = len(ref.plans)
    # host tile maps are built on first use: the splits that do not ask (padded) build none;
    # auto builds at most one per plan it dry-runs (its cost model), and plans nothing twice
    assert padded["build_mask"] == n_ub and padded["tile_map"] == 0
    assert auto["build_mask"] <= padded["build_mask"] and auto["tile_map"] <= auto["build_mask"]
    assert auto["find_slot"] <= padded["find_slot"]  # padded: prepare + plan; auto: its dry run
    assert auto["splits"]["padded"] == padded["splits"]["padded"] == n_ub  # the winner is split once
    assert nmse(got.out, ref.out) == 0.0


def test_cli_runner_auto_plans_no_more_than_the_split_it_picks(monkeypatch):
    """The same through the benchmarks' Runner.decode (the CPU engine)."""
    from ggml_attn.cli.models import resolve, with_layers
    from ggml_attn.cli.runner import RunConfig, Runner

    counts = _Counts(monkeypatch)
    model = with_layers(resolve("tiny"), 1)
    seen = {}
    for split in ("padded", "auto"):
        r = Runner(RunConfig(model, n_ctx=48 * 512, n_seq=48, split=split, device="cpu", n_threads=1))
        try:
            batch = r.prompt_batch(RAGGED_48.seq_token_counts().values())
            counts.take()
            st = r.decode(batch)
            seen[split] = (counts.take(), st.shapes)
        finally:
            r.close()
    (padded, shapes_p), (auto, shapes_a) = seen["padded"], seen["auto"]
    assert shapes_a == shapes_p
    assert auto["build_mask"] <= padded["build_mask"] and auto["tile_map"] <= auto["build_mask"]
    assert auto["find_slot"] <= padded["find_slot"]
    assert auto["splits"]["padded"] == padded["splits"]["padded"]


def test_auto_floor_pruning_keeps_the_choice(monkeypatch):
    """Dry-running every candidate (no floors) picks the same split, with the same cost."""
    from ggml_attn.graph import auto

    for batch, unified in ((RAGGED_48, False), (TEN_RAGGED, False), (TEN_RAGGED, True),
                           (Batch.from_lengths([500] + [1] * 9), False), (Batch.from_lengths([300, 290]), True)):
        cache = KVCache(48 * 1024, 48, unified=unified)
        for model in (CostModel(), CostModel(skip="tail"), CostModel(ubatch_us=0.0, row_us=1.0)):
            fast = choose_split(batch, 512, cache=cache, model=model)
            with monkeypatch.context() as m:
                m.setattr(auto, "cost_floor", lambda mode, ubs, *a: auto.StrategyCost(mode, 0, 0, 0, 0, 0.0, False))
                full = choose_split(batch, 512, cache=cache, model=model)
            assert all(c.exact for c in full.costs)
            assert fast.mode == full.mode
            exact = {c.mode: c for c in full.costs}
            for c in fast.costs:  # a floor is never above the exact cost
                assert c.est_us <= exact[c.mode].est_us and c.kv_tiles <= exact[c.mode].kv_tiles
                if c.exact:
                    assert c == exact[c.mode]
            assert cache.pos.max() == -1


def test_auto_plans_apply_only_to_the_cache_state_they_were_made_on():
    from ggml_attn.graph import apply_plan

    cache = KVCache(48 * 512, 48, unified=False)
    choice = choose_split(RAGGED_48, 512, cache=cache)
    assert choice.plans is not None and [p.ubatch for p in choice.plans] == choice.ubatches
    assert choose_split(RAGGED_48, 512).plans is None  # no cache given: nothing to apply
    cache.place(choice.ubatches[0])  # the cache moved on: the first plan's cells are taken
    with pytest.raises(ValueError, match="stale plan"):
        apply_plan(cache, choice.plans[0])


def _served_cache(rng, n_hist: int, n_seq: int, coarse: bool = False) -> tuple[KVCache, dict]:
    """A one-stream cache after a server's first steps: ``n_hist`` prompts of 16-200 tokens,
    then 1-40 decode steps of all of them (the ids interleaved in the cells), and the sequences'
    next positions."""
    cache = KVCache(16384, n_seq, unified=True, coarse_n_kv=coarse)
    lens = [int(x) for x in rng.integers(16, 201, n_hist)]
    for ub in choose_split(Batch.from_lengths(lens, seq_ids=list(range(n_hist))), 2048, cache=cache).ubatches:
        cache.free_pads(cache.place(ub))
    for _ in range(int(rng.integers(1, 41))):
        ids = list(range(n_hist))
        step = Batch.from_lengths([1] * n_hist, seq_ids=ids, start_pos=cache.next_positions(ids))
        cache.free_pads(cache.place(choose_split(step, 2048, cache=cache).ubatches[0]))
    return cache, cache.next_positions(list(range(n_hist)))


@pytest.mark.parametrize("seed", range(6))
def test_history_floor_is_a_floor_and_keeps_the_choice(seed, monkeypatch):
    """On a cache holding a server's earlier steps, a step mixing every generating request's
    token with new prompts: the floor of each candidate -- with the tiles its rows' histories
    hold (auto._History) -- never exceeds the candidate's dry-run cost, and the choice is the one
    of dry-running everything."""
    from ggml_attn.graph import auto
    rng = np.random.default_rng(seed)
    n_hist = int(rng.integers(8, 49))
    cache, nxt = _served_cache(rng, n_hist, 64)
    new = [int(x) for x in rng.integers(1, 201, int(rng.integers(1, 6)))]
    ids = list(range(n_hist)) + list(range(n_hist, n_hist + len(new)))
    order = [int(x) for x in rng.permutation(n_hist)] + ids[n_hist:]
    mixed = Batch.from_lengths([1] * n_hist + new, seq_ids=order,
                               start_pos={**nxt, **{s: 0 for s in ids[n_hist:]}})
    cfg = AttnConfig(n_head=32, n_head_kv=8, head_dim_k=128, n_layer=32)
    history = auto._History(cache, mixed.unique_seq_ids)
    for mode in auto.candidates_for(True):
        ubs = auto._split.split_ubatches(mixed, 512, mode)
        floor = auto.cost_floor(mode, ubs, True, cfg, CostModel(), history)
        exact = auto.cost_of(mode, auto.dry_run_plans(cache, ubs), cfg, CostModel())
        assert floor.kv_tiles <= exact.kv_tiles and floor.est_us <= exact.est_us, (mode, floor, exact)
        assert floor.kv_tiles >= auto.cost_floor(mode, ubs, True, cfg, CostModel()).kv_tiles
    fast = choose_split(mixed, 512, cache=cache, cfg=cfg)
    with monkeypatch.context() as m:
        m.setattr(auto, "cost_floor", lambda mode, ubs, *a: auto.StrategyCost(mode, 0, 0, 0, 0, 0.0, False))
        full = choose_split(mixed, 512, cache=cache, cfg=cfg)
    assert fast.mode == full.mode and {c.mode: c for c in full.costs}[fast.mode] == \
        {c.mode: c for c in fast.costs}[fast.mode]


def test_a_mixed_step_over_long_histories_dry_runs_one_candidate(monkeypatch):
    """48 generating requests' tokens and three new prompts on a bucketing cache (the CUDA
    engines'): the rows' histories already hold most of the tiles any split visits, so the
    floors of equal and padded exceed simple's exact cost -- one dry run, not three (each a
    placement and a mask over the cache's cells: ~5-10 ms of a server's mixed step)."""
    from ggml_attn.graph import auto, driver
    rng = np.random.default_rng(0)
    cache, nxt = _served_cache(rng, 48, 64, coarse=True)
    ids = list(range(51))
    mixed = Batch.from_lengths([1] * 48 + [150, 180, 120], seq_ids=ids, start_pos={**nxt, 48: 0, 49: 0, 50: 0})
    runs = []
    real = auto.dry_run_plans
    monkeypatch.setattr(auto, "dry_run_plans", lambda c, ubs, **kw: runs.append(len(ubs)) or real(c, ubs, **kw))
    cfg = AttnConfig(n_head=32, n_head_kv=8, head_dim_k=128, n_layer=32)
    got = choose_split(mixed, 2048, cache=cache, cfg=cfg, shape=lambda u: driver._bucketed(cache, u, 2048))
    assert got.mode == "simple" and runs == [1], (got.reason, runs)
    assert [c.exact for c in got.costs] == [True, False, False]
