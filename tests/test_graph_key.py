"""``graph.build.graph_key``: a decode step and a prompt chunk of the same shape are different
graph structures (the kernel plan a graph keeps chose its kernel for the kind of ubatch it was
built for: the cell-list kernel for decode steps over a unified cache, tiles for prompts)."""
import pytest

from ggml_attn.graph import AttnConfig, Batch, KVCache, split_ubatches
from ggml_attn.graph.build import build_ubatch_graph, graph_key, is_decode_step
from ggml_attn.graph.plan import plan_ubatch

CFG = AttnConfig(n_layer=1, n_head=4, n_head_kv=2, head_dim=16)


def _plan(cache, batch):
    (ub,) = split_ubatches(batch, 512, "simple")
    plan = plan_ubatch(cache, ub)
    return plan


def test_decode_step_and_prompt_chunk_of_one_shape_have_different_keys():
    cache = KVCache(512, 4, unified=True, n_layer=1, n_head_kv=2, head_dim_k=16)
    prompt = _plan(cache, Batch.from_lengths([2]))           # 2 tokens of sequence 0
    step = _plan(cache, Batch.from_lengths([1, 1]))          # 1 token of sequences 0 and 1
    assert not is_decode_step(prompt) and is_decode_step(step)
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
    assert is_decode_step(_plan(cache, Batch.from_lengths([1])))
    assert not is_decode_step(_plan(cache, Batch.from_lengths([3, 1])))
