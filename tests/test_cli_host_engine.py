"""The CPU engine (HostEngine) through the Runner: pad rows with -fa off, n_ubatch + 1 rows."""
import numpy as np

from ggml_attn.cli.models import resolve, with_layers
from ggml_attn.cli.runner import RunConfig, Runner


def _cache_after(lengths, steps=0, **kw):
    """Decode prompts of ``lengths`` (+ ``steps`` one-token steps); the cache's per-sequence
    contents (positions, K, V of every layer) and whether any stored value is NaN."""
    m = with_layers(resolve("tiny"), kw.pop("n_layer", 3))
    r = Runner(RunConfig(m, n_ctx=kw.pop("n_ctx", len(lengths) * 256), n_seq=len(lengths),
                         device="cpu", n_threads=1, **kw))
    try:
        r.decode(r.prompt_batch(lengths))
        for _ in range(steps):
            r.decode(r.step_batch(list(range(len(lengths)))))
        c = r.cache
        contents = {(s, layer): c.sequence_contents(s, layer)
                    for s in range(len(lengths)) for layer in range(m.n_layer)}
        used = c.pos >= 0
        finite = all(np.isfinite(c.k[layer][used]).all() and np.isfinite(c.v[layer][used]).all()
                     for layer in range(m.n_layer))
        return contents, finite
    finally:
        r.close()


def test_fa_off_padded_pad_rows_stay_finite_and_match_fa_on():
    """soft_max_ext of a fully masked pad row is NaN; the pad's K/V in the next layer would be
    NaN and reach real rows as 0 * NaN (and stay in the freed cells for later batches)."""
    kw = dict(split="padded", layer="full")
    off, off_finite = _cache_after([3, 5, 8, 2], steps=2, flash_attn=False, **kw)
    on, on_finite = _cache_after([3, 5, 8, 2], steps=2, flash_attn=True, **kw)
    assert off_finite and on_finite
    for key, (pos, k, v) in off.items():
        assert np.isfinite(k).all() and np.isfinite(v).all(), key
        ref = on[key]  # same split, so the same input row per token
        assert pos.tolist() == ref[0].tolist()
        # layers 1, 2 hold projections of the attention outputs of the layer before
        np.testing.assert_allclose(k, ref[1], atol=1e-2, rtol=1e-2, err_msg=str(key))
        np.testing.assert_allclose(v, ref[2], atol=1e-2, rtol=1e-2, err_msg=str(key))


def test_equal_split_ubatch_of_n_ubatch_plus_1_rows_has_every_input():
    """5 sequences with n_ubatch 4: llama.cpp's split_equal makes one 5x1 ubatch. Its inputs
    must all come from the pool (the same as with n_ubatch 8, whose pool starts alike)."""
    got, _ = _cache_after([1] * 5, n_layer=1, layer="full", split="equal", n_ubatch=4, n_batch=8)
    ref, _ = _cache_after([1] * 5, n_layer=1, layer="full", split="equal", n_ubatch=8, n_batch=8)
    for key in ref:
        np.testing.assert_array_equal(got[key][1], ref[key][1], err_msg=str(key))
        np.testing.assert_array_equal(got[key][2], ref[key][2], err_msg=str(key))
