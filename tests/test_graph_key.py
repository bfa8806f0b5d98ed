"""``graph.build.graph_key``: a decode step and a prompt chunk of the same shape are different
graph structures (the kernel plan a graph keeps chose its kernel for the kind of ubatch it was
built for: the cell-list kernel for decode steps over a unified cache, tiles for prompts)."""
import pytest

from ggml_attn.graph import AttnConfig, Batch, KVCache, split_ubatches
from ggml_attn.graph.build import build_ubatch_graph, graph_key
from ggml_attn.graph.plan import plan_ubatch

CFG = AttnConfig(n_layer=1, n_head=4, n_head_kv=2, head_dim_k=16)


def _plan(cache, batch):
    (ub,) = split_ubatches(batch, 512, "simple")
    plan = plan_ubatch(cache, ub)
    return plan


def test_decode_step_and_prompt_chunk_of_one_shape_have_different_keys():
    cache = KVCache(512, 4, unified=True, n_layer=1, n_head_kv=2, head_dim_k=16)
    prompt = _plan(cache, Batch.from_lengths([2]))           # 2 tokens of sequence 0
    step = _plan(cache, Batch.from_lengths([1, 1]))          # 1 token of sequences 0 and 1
    assert not prompt.ubatch.decode_step and step.ubatch.decode_step
    assert graph_key(prompt)[:-1] == graph_key(step)[:-1], "same shapes: only the kind differs"
    assert graph_key(prompt) != graph_key(step)
    g = build_ubatch_graph(cache, prompt, CFG)
    try:
        with pytest.raises(ValueError, match="does not fit"):
            g.load_plan(step)
    finally:
        g.free()


def test_single_token_ubatch_is_a_decode_step():
    cache = KVCache(512, 4, unified=True, n_layer=1, n_head_kv=2, head_dim_k=16)
    assert _plan(cache, Batch.from_lengths([1])).ubatch.decode_step
    assert not _plan(cache, Batch.from_lengths([3, 1])).ubatch.decode_step


def _prompt_plans(coarse, lens=(40, 90, 7, 130, 60, 200, 33, 120), n_ubatch=128):
    from ggml_attn.graph.kv_cache import pad_to
    cache = KVCache(pad_to(sum(lens) + 256, 256), len(lens), unified=True, n_layer=1, n_head_kv=2,
                    head_dim_k=16, coarse_n_kv=coarse)
    plans = []
    for ub in split_ubatches(Batch.from_lengths(list(lens)), n_ubatch, "simple"):
        p = plan_ubatch(cache, ub)
        cache.free_pads(p.slot)
        plans.append(p)
    return cache, plans


def test_coarse_prompt_ubatches_take_the_whole_cache_one_structure_per_size():
    cache, plans = _prompt_plans(True)
    assert all(p.n_kv == cache.kv_size for p in plans)
    assert len({graph_key(p) for p in plans}) <= 2, "full ubatches and the tail: two structures at most"
    _, fine = _prompt_plans(False)
    assert len({graph_key(p) for p in fine}) > 2 and fine[0].n_kv < cache.kv_size


def test_whole_cache_needs_a_small_mask_and_a_prompt(monkeypatch):
    from ggml_attn.graph import kv_cache
    monkeypatch.setattr(kv_cache, "PROMPT_WHOLE_CACHE_MASK_BYTES", 0)
    cache, plans = _prompt_plans(True)
    assert plans[0].n_kv < cache.kv_size, "budget 0: coarse padding as before"
    monkeypatch.undo()
    cache = KVCache(4096, 4, unified=True, n_layer=1, n_head_kv=2, head_dim_k=16, coarse_n_kv=True)
    prompt = _plan(cache, Batch.from_lengths([30, 30, 30, 30]))
    cache.free_pads(prompt.slot)
    assert prompt.n_kv == cache.kv_size
    step = _plan(cache, Batch.from_lengths([1] * 4, start_pos=cache.next_positions(range(4))))
    assert step.ubatch.decode_step and step.n_kv < cache.kv_size, "decode steps keep coarse padding"


def test_whole_cache_prompts_give_the_same_outputs():
    """Attention over the whole cache (the extra cells masked) equals attention over the used
    range (the CPU op, numpy path)."""
    import numpy as np

    from ggml_attn.graph import run_batch
    from ggml_attn.reference import nmse
    lens = [40, 90, 7, 130]
    outs = []
    for coarse in (False, True):
        cache = KVCache(1024, 4, unified=True, n_layer=1, n_head_kv=2, head_dim_k=16, coarse_n_kv=coarse)
        res = run_batch(cache, Batch.from_lengths(lens), 128, "simple", CFG)
        outs.append(np.asarray(res.out, dtype=np.float64))
    assert nmse(outs[1], outs[0]) < 1e-10
