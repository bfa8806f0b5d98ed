"""The CLI's CUDA engine against the numpy reference (needs a GPU; skipped otherwise)."""
import numpy as np
import pytest

from ggml_attn.cli.models import PRESETS
from ggml_attn.cli.runner import RunConfig, Runner, cuda_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a GPU with ggml_attn.cuda_backend")]


@pytest.mark.parametrize("split, unified, lens", [
    ("equal", False, [5, 3, 7]), ("padded", False, list(range(1, 11))), ("simple", True, [40, 1, 17]),
])
def test_cuda_engine_matches_reference(split, unified, lens):
    from ggml_attn import reference
    m = PRESETS["tiny"]
    r = Runner(RunConfig(m, n_ctx=4096, n_seq=len(lens), kv_unified=unified, split=split, n_ubatch=64,
                         device="cuda", layer="attn"))
    try:
        r.decode(r.prompt_batch(lens))
        st = r.decode(r.step_batch(list(range(len(lens)))))  # one decode step: check its output
        assert st.n_ubatches >= 1
        mask, dst, _ = r.engine._keep
        mask, dst = mask.get(), dst.get()
        ns, _, n_tps, n_kv = mask.shape
        pool = r.engine.pool.get()
        n_tok = ns * n_tps
        q = pool[: n_tok * m.n_embd_q].reshape(ns, m.n_head, n_tps, m.head_dim_k)
        ub_streams = r.engine._last_streams
        k = r.cache.k[m.n_layer - 1].get()[ub_streams[0]:ub_streams[0] + ns, :n_kv]
        v = r.cache.v[m.n_layer - 1].get()[ub_streams[0]:ub_streams[0] + ns, :n_kv]
        k = k.reshape(ns, n_kv, m.n_head_kv, m.head_dim_k).transpose(0, 2, 1, 3)
        v = v.reshape(ns, n_kv, m.n_head_kv, m.head_dim_v).transpose(0, 2, 1, 3)
        want = reference.flash_attn_ext(q, k.astype(np.float32), v.astype(np.float32), mask,
                                        1.0 / np.sqrt(m.head_dim_k))
        assert np.isfinite(dst).all()
        assert reference.nmse(dst, want) < 5e-4
    finally:
        r.close()


def test_cuda_engine_full_layer_runs():
    m = PRESETS["tiny"]
    r = Runner(RunConfig(m, n_ctx=1024, n_seq=2, split="equal", n_ubatch=32, device="cuda", layer="full"))
    try:
        st = r.decode(r.prompt_batch([20, 20]))
        assert st.n_ubatches == 2
        assert np.isfinite(r.engine._keep[1].get()).all()
    finally:
        r.close()


@pytest.mark.parametrize("layer", ["attn", "full"])
def test_cuda_graph_replay_matches_the_graph_loop(layer):
    """The CUDA engine with CUDA graphs (decode steps of one shape: the first captured at once,
    the rest replayed) leaves the same KV cache and the same last output as without them."""
    m = PRESETS["tiny"]
    results = []
    for cuda_graph in (False, True):
        r = Runner(RunConfig(m, n_ctx=2048, n_seq=4, kv_unified=True, split="simple", n_ubatch=64,
                             device="cuda", layer=layer, cuda_graph=cuda_graph))
        try:
            r.decode(r.prompt_batch([30, 7, 12, 50]))
            for _ in range(6):   # n_kv stays 256: one graph structure for every step
                r.decode(r.step_batch([0, 1, 2, 3]))
            eng = r.engine
            assert (eng.captures, eng.replays) == ((1, 5) if cuda_graph else (0, 0))
            results.append((r.cache.k.get(), r.cache.v.get(), eng._keep[1].get()))
        finally:
            r.close()
    for a, b in zip(*results):
        assert np.isfinite(b).all()
        np.testing.assert_array_equal(a, b)


def test_a_prompt_structure_is_steady_after_runs_to_steady_runs():
    """The bench's warm-up repeats a prompt run ``runs_to_steady`` times: after that many runs of
    one prompt structure the next is a replay, as every later one (the second run captured it;
    a single warm-up left the first repetition capturing: 6,600 t/s against ~16,000 on an 8B
    Q4_K_M file)."""
    m = PRESETS["tiny"]
    r = Runner(RunConfig(m, n_ctx=1024, n_seq=1, split="simple", n_ubatch=64, device="cuda", layer="attn"))
    try:
        runs = r.runs_to_steady(decode_step=False)
        assert runs == 2 and r.runs_to_steady(decode_step=True) == 1
        for _ in range(runs):
            r.clear()
            r.decode(r.prompt_batch([48]))
        eng = r.engine
        before = (eng.builds, eng.captures, eng.replays)
        assert before == (1, 1, 0)
        r.clear()
        r.decode(r.prompt_batch([48]))
        assert (eng.builds, eng.captures, eng.replays) == (1, 1, 1)
    finally:
        r.close()
