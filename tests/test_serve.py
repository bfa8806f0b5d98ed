"""graph/serve.py: a server's steps (admission, decode tokens then prompt chunks under a
budget, retirement) and, on a real model, that serving under churn changes no request's tokens."""
import itertools

import numpy as np
import pytest

import fixtures_gguf
from ggml_attn.graph import KVCache
from ggml_attn.graph.serve import Scheduler, ServeRequest, cells_needed, serve


def _cache(n_ctx=1024, n_seq=4, unified=True):
    return KVCache(n_ctx, n_seq, unified=unified, n_layer=1, n_head_kv=1, head_dim_k=8)


def _req(rid, n_prompt, n_predict, arrival=0.0):
    return ServeRequest(rid, arrival, np.arange(n_prompt) + 100 * rid, n_predict)


def _apply(cache, step):
    """What a step's compute leaves in the cache: its tokens' cells (no K/V values needed)."""
    from ggml_attn.graph.driver import decode

    class NoCompute:
        def run_ubatch(self, plan):
            return None

    from ggml_attn.graph import AttnConfig
    decode(cache, step.batch, 4096, "simple" if cache.unified else "equal", NoCompute(),
           AttnConfig(n_layer=1, n_head=1, n_head_kv=1, head_dim_k=8))


def _next_tokens(step):
    return np.flatnonzero(step.want) + 1000


def test_step_puts_decode_tokens_first_then_prompt_chunks_under_the_budget():
    cache = _cache()
    s = Scheduler(cache, 4, n_batch=64, prompt_budget=10)
    a, b = _req(0, 4, 3), _req(1, 25, 2)
    assert s.arrive(a) and s.arrive(b)
    assert s.admit(0.0) == [a, b] and (a.seq, b.seq) == (0, 1)
    st = s.next_step()
    # a's whole prompt (4) and 6 of b's: 10 prompt tokens; only a's last token asks for logits
    assert (st.n_decode, st.n_prompt) == (0, 10) and not st.mixed
    assert st.batch.seq_ids == ((0,),) * 4 + ((1,),) * 6
    assert st.want.tolist() == [False, False, False, True] + [False] * 6
    assert st.batch.positions.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]
    _apply(cache, st)
    assert s.commit(st, [7], 0.5) == []
    assert a.tokens == [7] and a.token_times == [0.5] and a.n_prompt_done == 4 and b.n_prompt_done == 6
    st = s.next_step()
    # a decodes its last token at position 4, then 10 more of b's prompt
    assert (st.n_decode, st.n_prompt) == (1, 10) and st.mixed
    assert st.batch.tokens[0] == 7 and st.batch.positions[0] == 4 and st.batch.seq_ids[0] == (0,)
    assert st.batch.positions[1:].tolist() == list(range(6, 16))
    assert st.want.tolist() == [True] + [False] * 10


def test_the_batch_size_caps_a_step_and_zero_budget_takes_whole_prompts():
    cache = _cache()
    s = Scheduler(cache, 4, n_batch=8)           # budget = n_batch (llama-server's rule)
    for i in range(3):
        s.arrive(_req(i, 5, 4))
    s.admit(0.0)
    st = s.next_step()
    assert st.n_prompt == 8 and st.batch.seq_ids == ((0,),) * 5 + ((1,),) * 3
    whole = Scheduler(_cache(), 4, n_batch=8, prompt_budget=0)
    for i in range(3):
        whole.arrive(_req(i, 5, 4))
    whole.admit(0.0)
    st = whole.next_step()
    assert st.n_prompt == 15 and st.want.sum() == 3


def test_decode_tokens_fill_the_batch_before_prompts():
    cache = _cache()
    s = Scheduler(cache, 4, n_batch=3)
    reqs = [_req(i, 1, 5) for i in range(4)]
    for r in reqs:
        s.arrive(r)
    s.admit(0.0)
    st = s.next_step()              # 3 one-token prompts fill the step
    assert st.n_prompt == 3
    _apply(cache, st)
    s.commit(st, _next_tokens(st), 1.0)
    st = s.next_step()              # 3 decode tokens: no room for request 3's prompt
    assert (st.n_decode, st.n_prompt) == (3, 0)


def test_unified_admission_reserves_cells_and_a_request_too_long_is_refused():
    cache = _cache(n_ctx=256, n_seq=4)
    s = Scheduler(cache, 4, n_batch=512)
    big, small, huge = _req(0, 150, 51), _req(1, 60, 41), _req(2, 250, 10)
    assert cells_needed(150, 51) == 200
    assert s.arrive(big) and s.arrive(small)
    assert not s.arrive(huge)
    assert huge.refused == "request 2: 250 prompt + 10 output tokens need 259 KV cells, the cache holds 256"
    assert s.admit(0.0) == [big]    # small's 100 cells do not fit beside big's 200 yet
    assert s.waiting == [small]


def test_per_stream_refusal_names_the_stream():
    cache = _cache(n_ctx=1024, n_seq=4, unified=False)
    s = Scheduler(cache, 4)
    r = _req(0, 300, 1)
    assert not s.arrive(r) and "a sequence's stream (4 streams) holds 256" in r.refused


def test_bad_requests_and_slots():
    with pytest.raises(ValueError, match="n_predict"):
        _req(0, 3, 0)
    with pytest.raises(ValueError, match="empty prompt"):
        ServeRequest(0, 0.0, [], 1)
    with pytest.raises(ValueError, match="arrival"):
        ServeRequest(0, float("nan"), [1], 1)
    with pytest.raises(ValueError, match="n_slots"):
        Scheduler(_cache(n_seq=2), 3)
    with pytest.raises(ValueError, match="prompt_budget"):
        Scheduler(_cache(), 1, prompt_budget=-1)


class _Clock:
    """A clock that moves 1 ms per reading: each step takes 1 ms, whatever the machine."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 0.001
        return self.t


def _fake_step_fn(cache):
    def step_fn(step):
        _apply(cache, step)
        return _next_tokens(step), {"ubatches": 1}
    return step_fn


@pytest.mark.parametrize("unified", [True, False])
def test_serve_times_tokens_retires_and_leaves_the_cache_empty(unified):
    cache = _cache(n_ctx=1024, n_seq=2, unified=unified)
    s = Scheduler(cache, 2, n_batch=64)
    reqs = [_req(0, 3, 2, 0.0), _req(1, 2, 3, 0.0), _req(2, 4, 1, 0.0), _req(3, 2, 2, 10.0)]
    finished = []
    stats = serve(reqs, s, _fake_step_fn(cache), clock=_Clock(), on_finish=finished.append)
    assert all(len(r.tokens) == r.n_predict for r in reqs) and not s.busy
    assert all(cache.n_used(st) == 0 for st in range(cache.n_stream)) and s.free_slots == [0, 1]
    # two slots: request 2 waits for request 0 (done after its 2nd step), request 3 arrives idle
    assert [r.rid for r in finished] == [0, 1, 2, 3]
    assert reqs[0].token_times == pytest.approx([0.001, 0.002])
    assert reqs[1].ttft == pytest.approx(0.001) and reqs[1].itl == pytest.approx([0.001, 0.001])
    assert reqs[2].admitted == pytest.approx(0.002) and reqs[2].ttft == pytest.approx(0.003)
    assert reqs[3].admitted == 10.0 and reqs[3].ttft == pytest.approx(0.001)
    assert stats.elapsed == pytest.approx(10.002) and stats.busy == pytest.approx(0.005)
    assert stats.n_steps == 5 and stats.counts == {"ubatches": 5}
    assert stats.n_mixed == 1   # step 3: request 1's decode token with request 2's prompt
    assert stats.cells_peak == 8   # after step 3: request 1's 2 + 2, request 2's prompt of 4


def test_a_refused_request_leaves_the_others_running():
    cache = _cache(n_ctx=256, n_seq=2)
    s = Scheduler(cache, 2)
    reqs = [_req(0, 3, 2), _req(1, 300, 2), _req(2, 5, 3)]
    refused = []
    serve(reqs, s, _fake_step_fn(cache), clock=_Clock(), on_refuse=refused.append)
    assert refused == [reqs[1]] and reqs[1].tokens == []
    assert len(reqs[0].tokens) == 2 and len(reqs[2].tokens) == 3


# ---------------------------------------------------------------------------------------------
# a real model (GGUF fixture) through the CLI's engine: churn changes no request's tokens

def _model_runner(path, split, kvu, n_slots):
    from ggml_attn.cli.models import resolve
    from ggml_attn.cli.runner import RunConfig, Runner
    cfg = RunConfig(resolve(path), n_ctx=1024, n_seq=n_slots, kv_unified=kvu, split=split, n_batch=64,
                    n_ubatch=16, layer="model", device="cpu", n_threads=2)
    return Runner(cfg)


def _served(path, split, kvu, reqs, budget=None, n_slots=4):
    from ggml_attn.cli.serve_bench import make_step_fn
    r = _model_runner(path, split, kvu, n_slots)
    try:
        reqs = [ServeRequest(i, a, p, n) for i, (a, p, n) in enumerate(reqs)]
        sched = Scheduler(r.cache, n_slots, n_batch=64, prompt_budget=budget)
        stats = serve(reqs, sched, make_step_fn(r, True, r.cfg.model.n_vocab), clock=_Clock())
        assert all(r.cache.n_used(s) == 0 for s in range(r.cache.n_stream))   # every cell free again
        return [x.tokens for x in reqs], stats
    finally:
        r.close()


@pytest.fixture(scope="module")
def churn(tmp_path_factory):
    path = fixtures_gguf.fixture_path("llama-q8_0", tmp_path_factory.mktemp("gguf"))
    rng = np.random.default_rng(5)
    n = 10
    arrivals = np.cumsum(rng.exponential(0.004, n))   # 1 ms steps: arrivals during others' decode
    reqs = [(float(a), rng.integers(0, 256, int(rng.integers(1, 40))), int(rng.integers(1, 10))) for a in arrivals]
    alone = [_served(path, "equal", False, [(0.0, p, k)], n_slots=1)[0][0] for _, p, k in reqs]
    return path, reqs, alone


@pytest.mark.parametrize("split,kvu", [("simple", True), ("equal", False), ("equal", True), ("seq", False),
                                       ("padded", False), ("padded", True), ("auto", False), ("auto", True)])
@pytest.mark.parametrize("budget", [None, 5, 0])
def test_churn_changes_no_request_tokens(churn, split, kvu, budget):
    path, reqs, alone = churn
    toks, stats = _served(path, split, kvu, reqs, budget)
    assert toks == alone
    assert stats.n_mixed > 0     # prompts did run beside other requests' decode steps
    assert stats.counts["ubatches"] >= stats.n_steps


def test_alone_matches_the_library_greedy(churn):
    """The reference of the churn test: each request alone, as graph.greedy computes it."""
    from ggml_attn.graph import greedy, load_gguf
    path, reqs, alone = churn
    model = load_gguf(path)
    hp = model.hp
    assert len({tuple(t) for t in alone}) > 1   # the requests differ
    for (_, p, k), got in itertools.islice(zip(reqs, alone), 4):
        cache = KVCache(1024, 1, unified=True, n_layer=hp.n_layer, n_head_kv=hp.n_head_kv, head_dim_k=hp.head_dim_k)
        assert greedy(cache, model, [p.tolist()], k)[0] == got


def test_a_request_past_the_models_window_is_refused_alone():
    """With a position limit (gemma2's window), a request whose positions would reach it is
    refused with the reason and the others are queued (the run went on to fail whole before)."""
    sched = Scheduler(_cache(), 2, pos_limit=32)
    ok, long = _req(0, 20, 5), _req(1, 30, 4)
    assert sched.arrive(ok) and not sched.arrive(long)
    assert "reach position 32, past the model's sliding window (32)" in long.refused
    assert sched.waiting == [ok]
