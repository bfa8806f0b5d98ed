"""Strategy equivalence (every split strategy gives the same outputs and caches), by property test.

For random batches - 1..64 sequences of 1..300 tokens, ids in random order, then a few
decode steps - ``simple`` on a unified cache and ``equal``, ``seq``, ``padded`` on a split
cache give the same attention output for every real token (NMSE <= 1e-6, f32), and the same
K/V contents and positions per sequence once pads are gone; decoding after a padded prefill
equals decoding after a serial one.
"""
import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from ggml_attn.graph import Batch, KVCache
from ggml_attn.graph.kv_cache import pad_to
from ggml_attn.graph.attn_config import AttnConfig
from ggml_attn.graph.qkv_runner import run_batch

CFG = AttnConfig(n_layer=2, n_head=2, n_head_kv=1, head_dim_k=8)
STRATEGIES = [("simple", True), ("equal", False), ("seq", False), ("padded", False)]
MAX_TOTAL = 1200  # keeps one example well under a second


def per_token_nmse(a, b):
    """a, b: (n_layer, n_tokens, n_head, D) -> NMSE of every token over layers/heads/dims."""
    num = ((a.astype(np.float64) - b) ** 2).sum(axis=(0, 2, 3))
    den = (b.astype(np.float64) ** 2).sum(axis=(0, 2, 3))
    return num / np.maximum(den, 1e-300)


def _prompt_then_steps(lengths, order, decode_sets) -> list:
    """The prompts (ids in ``order``, sequence j has ``lengths[j]`` tokens), then one decode
    step per set of ids, each continuing its sequences."""
    batches = [Batch.from_lengths([lengths[s] for s in order], seq_ids=order)]
    true_len = dict(zip(range(len(lengths)), lengths))
    for ids in decode_sets:
        batches.append(Batch.from_lengths([1] * len(ids), seq_ids=ids, start_pos={s: true_len[s] for s in ids}))
        for s in ids:
            true_len[s] += 1
    return batches


@st.composite
def workloads(draw):
    n_seq = draw(st.integers(1, 64))
    cap = max(1, min(300, MAX_TOTAL // n_seq))
    lengths = draw(st.lists(st.integers(1, cap), min_size=n_seq, max_size=n_seq))
    order = draw(st.permutations(range(n_seq)))
    n_ubatch = draw(st.sampled_from([8, 32, 100, 512]))
    n_steps = draw(st.integers(0, 3))
    decode_sets = [draw(st.lists(st.sampled_from(range(n_seq)), min_size=1, max_size=n_seq, unique=True))
                   for _ in range(n_steps)]
    return lengths, list(order), n_ubatch, decode_sets


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_strategies_agree(work):
    lengths, order, n_ubatch, decode_sets = work
    n_seq = len(lengths)
    n_steps = len(decode_sets)
    per_stream = pad_to(2 * max(lengths) + n_steps, 256)
    caches = {}
    for mode, unified in STRATEGIES:
        n_ctx = pad_to(sum(lengths) + n_seq * n_steps, 256) if unified else per_stream * n_seq
        caches[mode] = KVCache(n_ctx, n_seq, unified=unified, n_layer=CFG.n_layer, n_head_kv=CFG.n_head_kv,
                               head_dim_k=CFG.head_dim_k)
    # prefill: ids in random order, sequence j has lengths[j] tokens
    batches = _prompt_then_steps(lengths, order, decode_sets)
    for step, b in enumerate(batches):
        outs = {mode: run_batch(caches[mode], b, n_ubatch, mode, CFG) for mode, _ in STRATEGIES}
        ref = outs["simple"].out
        for mode in ("equal", "seq", "padded"):
            err = per_token_nmse(outs[mode].out, ref)
            assert err.max() <= 1e-6, (mode, step, int(err.argmax()), float(err.max()))
        assert all(p.ubatch.n_tokens <= n_ubatch for p in outs["padded"].plans)
    for s in range(n_seq):
        for il in range(CFG.n_layer):
            ref_pos, ref_k, ref_v = caches["simple"].sequence_contents(s, il)
            assert ref_pos.tolist() == list(range(lengths[s] + sum(s in ids for ids in decode_sets)))
            for mode in ("equal", "seq", "padded"):
                pos, k, v = caches[mode].sequence_contents(s, il)
                assert np.array_equal(pos, ref_pos) and np.array_equal(k, ref_k) and np.array_equal(v, ref_v), (mode, s)
    assert all(c.pad.sum() == 0 for c in caches.values())


# the graph the CLI's engines build (``build.build_ubatch_graph``): host graph and all-custom
# (the device form, over numpy), each strategy against the numpy path of ``simple``
GRAPH_RUNS = [("simple", True, None), ("equal", False, True), ("seq", False, False), ("padded", False, True),
              ("padded", False, False), ("auto", False, None)]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_strategies_agree_through_the_graph_builder(work):
    lengths, order, n_ubatch, decode_sets = work
    lengths = [min(x, max(1, 400 // len(lengths))) for x in lengths]
    n_seq = len(lengths)
    per_stream = pad_to(2 * max(lengths) + len(decode_sets), 256)

    def new_cache(unified):
        n_ctx = pad_to(sum(lengths) + n_seq * len(decode_sets), 256) if unified else per_stream * n_seq
        return KVCache(n_ctx, n_seq, unified=unified, n_layer=CFG.n_layer, n_head_kv=CFG.n_head_kv,
                       head_dim_k=CFG.head_dim_k)
    ref_cache = new_cache(True)
    caches = [new_cache(unified) for _, unified, _ in GRAPH_RUNS]
    batches = _prompt_then_steps(lengths, order, decode_sets)
    for step, b in enumerate(batches):
        ref = run_batch(ref_cache, b, n_ubatch, "simple", CFG).out
        for (mode, _, all_custom), c in zip(GRAPH_RUNS, caches):
            got = run_batch(c, b, n_ubatch, mode, CFG, compute="ggml", all_custom=all_custom).out
            err = per_token_nmse(got, ref)
            assert err.max() <= 1e-6, (mode, all_custom, step, int(err.argmax()), float(err.max()))
    for s in range(n_seq):
        ref_pos, ref_k, ref_v = ref_cache.sequence_contents(s, CFG.n_layer - 1)
        for (mode, _, all_custom), c in zip(GRAPH_RUNS, caches):
            pos, k, v = c.sequence_contents(s, CFG.n_layer - 1)
            assert np.array_equal(pos, ref_pos) and np.array_equal(k, ref_k) and np.array_equal(v, ref_v), \
                (mode, all_custom, s)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.booleans(), st.booleans())
def test_bucketed_ubatches_agree_with_the_plain_split(work, roomy, through_graphs):
    """A one-stream cache that coarsens shapes for graph reuse (``coarse_n_kv``: the CUDA
    engines') pads each ubatch to its bucket of rows (``split.pad_to_bucket``): every real token's
    output and every sequence's cached K/V and positions are those of the plain ``simple`` run, no
    pad cell is left, and every ubatch is at its bucket -- or, where the cache has no room for the
    pads (``roomy`` False: the real tokens' cells only) or a decode step too few free sequence ids,
    as split."""
    from ggml_attn.graph.split import bucket_rows
    lengths, order, n_ubatch, decode_sets = work
    if through_graphs:
        lengths = [min(x, max(1, 400 // len(lengths))) for x in lengths]
    n_seq = len(lengths)
    need = sum(lengths) + n_seq * len(decode_sets)
    n_ctx = pad_to(need + (n_ubatch + 64 if roomy else 0), 256)

    def new_cache(coarse):
        return KVCache(n_ctx, n_seq, unified=True, n_layer=CFG.n_layer, n_head_kv=CFG.n_head_kv,
                       head_dim_k=CFG.head_dim_k, coarse_n_kv=coarse)
    ref_cache, cache = new_cache(False), new_cache(True)
    kw = dict(compute="ggml", all_custom=True) if through_graphs else {}
    for step, b in enumerate(_prompt_then_steps(lengths, order, decode_sets)):
        ref = run_batch(ref_cache, b, n_ubatch, "simple", CFG)
        got = run_batch(cache, b, n_ubatch, "simple", CFG, **kw)
        err = per_token_nmse(got.out, ref.out)
        assert err.max() <= 1e-6, (step, int(err.argmax()), float(err.max()))
        for p, q in zip(got.plans, ref.plans):
            real = q.ubatch.n_tokens
            assert p.ubatch.n_tokens - p.ubatch.n_pad == real
            assert p.ubatch.n_tokens in (real, min(bucket_rows(real), max(real, n_ubatch)))
            assert p.ubatch.decode_step == q.ubatch.decode_step
            want = min(bucket_rows(real), max(real, n_ubatch))
            if roomy and not p.ubatch.decode_step:   # (pads continue the last sequence: room is all they need)
                assert p.ubatch.n_tokens == want
            if roomy and p.ubatch.decode_step and n_seq - real >= want - real:   # free ids for the pads
                assert p.ubatch.n_tokens == want
        assert cache.pad.sum() == 0 and cache.n_used(0) == ref_cache.n_used(0)
    for s in range(n_seq):
        for il in range(CFG.n_layer):
            ref_pos, ref_k, ref_v = ref_cache.sequence_contents(s, il)
            pos, k, v = cache.sequence_contents(s, il)
            assert np.array_equal(pos, ref_pos) and np.array_equal(k, ref_k) and np.array_equal(v, ref_v), s


@st.composite
def server_steps(draw):
    """A server's batches: prompts of the first sequences, then steps that each carry one decode
    token of a random subset of the started sequences and the whole prompt of the next one."""
    n_seq = draw(st.integers(2, 24))
    cap = max(1, min(120, 600 // n_seq))
    lengths = draw(st.lists(st.integers(1, cap), min_size=n_seq, max_size=n_seq))
    n_first = draw(st.integers(1, n_seq - 1))
    n_ubatch = draw(st.sampled_from([8, 32, 100, 512]))
    subsets = [draw(st.lists(st.sampled_from(range(j)), min_size=0, max_size=j, unique=True))
               for j in range(n_first, n_seq)]
    return lengths, n_first, n_ubatch, subsets


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(server_steps(), st.booleans())
def test_auto_on_bucketing_caches_agrees_with_simple(work, roomy):
    """``auto`` on a one-stream cache that pads ubatches to buckets (``coarse_n_kv``: it costs and
    dry-runs each candidate with the pads, ``driver._split``'s ``shape``, and runs its plans as
    they are; without them where they do not fit, ``roomy`` False) over a server's steps mixing
    decode tokens with a new prompt: every real token's output and every sequence's K/V and
    positions those of ``simple`` on a plain cache, no pad cell left."""
    lengths, n_first, n_ubatch, subsets = work
    n_seq = len(lengths)
    true_len = {}
    batches = [Batch.from_lengths(lengths[:n_first], seq_ids=list(range(n_first)))]
    true_len.update({s: lengths[s] for s in range(n_first)})
    for j, ids in zip(range(n_first, n_seq), subsets):
        batches.append(Batch.from_lengths([1] * len(ids) + [lengths[j]], seq_ids=ids + [j],
                                          start_pos={**{s: true_len[s] for s in ids}, j: 0}))
        true_len.update({s: true_len[s] + 1 for s in ids})
        true_len[j] = lengths[j]
    need = sum(true_len.values())
    n_ctx = pad_to(need + (n_ubatch + 64 if roomy else 0), 256)

    def new_cache(coarse):
        return KVCache(n_ctx, n_seq, unified=True, n_layer=CFG.n_layer, n_head_kv=CFG.n_head_kv,
                       head_dim_k=CFG.head_dim_k, coarse_n_kv=coarse)
    ref_cache, cache = new_cache(False), new_cache(True)
    for step, b in enumerate(batches):
        ref = run_batch(ref_cache, b, n_ubatch, "simple", CFG)
        got = run_batch(cache, b, n_ubatch, "auto", CFG)
        err = per_token_nmse(got.out, ref.out)
        assert err.max() <= 1e-6, (step, int(err.argmax()), float(err.max()))
        assert cache.pad.sum() == 0 and cache.n_used(0) == ref_cache.n_used(0), step
    for s in range(n_seq):
        for il in range(CFG.n_layer):
            ref_pos, ref_k, ref_v = ref_cache.sequence_contents(s, il)
            pos, k, v = cache.sequence_contents(s, il)
            assert np.array_equal(pos, ref_pos) and np.array_equal(k, ref_k) and np.array_equal(v, ref_v), s
