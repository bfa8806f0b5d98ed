"""The library's batch paths check their arguments before any cell is claimed (issue #47 B.2,
B.4): thread counts with compute_graph's rule on run_batch, run_model_batch and greedy (a huge
one segfaulted in ggml's thread pool); greedy refuses up front what cannot fit the cache and
hands back what it generated when a step fails; bools are not token ids."""
import numpy as np
import pytest

import fixtures_gguf
from ggml_attn.graph import AttnConfig, Batch, KVCache, greedy, load_gguf, run_batch, run_model_batch

CFG = AttnConfig(n_layer=1, n_head=2, n_head_kv=1, head_dim_k=16)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_gguf(fixtures_gguf.fixture_path("llama-q8_0", tmp_path_factory.mktemp("g")))


def _cache(model, n_ctx=512, n_seq=2, unified=True):
    hp = model.hp
    return KVCache(n_ctx, n_seq, unified=unified, n_layer=hp.n_layer, n_head_kv=hp.n_head_kv, head_dim_k=hp.head_dim_k)


def _empty(cache):
    return all(cache.n_used(s) == 0 for s in range(cache.n_stream))


@pytest.mark.parametrize("n_threads", [0, -1, True, 1.5, 10**9])
def test_thread_counts_are_checked_before_the_cache_changes(model, n_threads):
    c = KVCache(256, 1, n_layer=1, n_head_kv=1, head_dim_k=16)
    with pytest.raises(ValueError, match="n_threads"):
        run_batch(c, Batch.from_lengths([3]), 16, "simple", CFG, compute="ggml", n_threads=n_threads)
    assert _empty(c)
    mc = _cache(model)
    with pytest.raises(ValueError, match="n_threads"):
        run_model_batch(mc, Batch.from_sequences([[1, 2, 3]]), model, n_threads=n_threads)
    with pytest.raises(ValueError, match="n_threads"):
        greedy(mc, model, [[1, 2]], 3, n_threads=n_threads)
    assert _empty(mc)


def test_greedy_refuses_what_cannot_fit_before_decoding(model):
    c = _cache(model, n_ctx=512, n_seq=2, unified=False)    # two streams of 256 cells
    with pytest.raises(ValueError, match=r"need 260 KV cells in stream 1, which has 256 free of 256; nothing"):
        greedy(c, model, [[1, 2, 3], list(range(10))], 251)
    assert _empty(c)
    u = _cache(model, n_ctx=256, n_seq=2)
    with pytest.raises(ValueError, match=r"need 258 KV cells in the cache, which has 256 free"):
        greedy(u, model, [[1] * 100, [2] * 100], 30)        # 200 + 2 * 29 cells: no
    assert _empty(u)
    assert [len(t) for t in greedy(u, model, [[1] * 100, [2] * 100], 29)] == [29, 29]   # 200 + 2 * 28: yes
    assert u.n_used(0) == 256


@pytest.mark.parametrize("bad, match", [(True, "n_predict must be an integer"), (-1, "n_predict = -1"),
                                        (2.0, "n_predict must be an integer")])
def test_greedy_n_predict(model, bad, match):
    c = _cache(model)
    with pytest.raises(ValueError, match=match):
        greedy(c, model, [[1, 2]], bad)
    assert _empty(c)


def test_greedy_hands_back_what_it_generated_when_a_step_fails(model, monkeypatch):
    from ggml_attn.graph import model_runner
    c = _cache(model)
    real, calls = model_runner.run_model_batch, []

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) == 4:     # the prompt, two steps, then the third step fails
            raise RuntimeError("device lost")
        return real(*a, **kw)
    monkeypatch.setattr(model_runner, "run_model_batch", failing)
    with pytest.raises(RuntimeError, match="device lost") as e:
        greedy(c, model, [[1, 2], [3]], 10)
    want = greedy(_cache(model), model, [[1, 2], [3]], 3)
    assert e.value.generated == want       # three tokens each: the prompt's and two steps'


def test_bools_are_not_token_ids(model):
    with pytest.raises(ValueError, match="True is a bool, not a token id"):
        Batch.from_sequences([[1, True, 3]])
    with pytest.raises(ValueError, match="is a bool"):
        greedy(_cache(model), model, [[np.bool_(False)]], 1)


def test_load_gguf_says_what_a_path_is(tmp_path):
    import os
    from ggml_attn.graph import ModelError
    with pytest.raises(ModelError, match="not found"):
        load_gguf(tmp_path / "missing.gguf")
    with pytest.raises(ModelError, match="a directory, not a model file"):
        load_gguf(tmp_path)
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    with pytest.raises(ModelError, match="not a regular file"):   # (not opened: that would block)
        load_gguf(fifo)


def test_a_gguf_file_is_a_model_whatever_its_name(tmp_path, capsys):
    """``-m model.bin`` holding a GGUF runs the file's own weights (the magic bytes decide), as
    ``model.gguf`` does; it ran attention only with random weights before."""
    import json
    import shutil
    from ggml_attn.cli import batched_bench
    src = fixtures_gguf.fixture_path("llama-q8_0", tmp_path)
    path = tmp_path / "model.bin"
    shutil.copy(src, path)
    rc = batched_bench.main(["-m", str(path), "-npp", "4", "-ntg", "1", "-npl", "1", "--device", "cpu", "-o", "jsonl"])
    out = capsys.readouterr().out
    assert rc == 0 and json.loads(out.splitlines()[-1])["layer"] == "model"


def test_greedy_reuses_its_graphs_from_step_to_step(model, monkeypatch):
    """run_model_batch's engine is kept with the cache (graph/engine.py): a decode step's graph is
    built once and reused by the next steps (each step was a new graph: ~30 ms of host time for
    an 8B model on the H200's host); the tokens are those of fresh graphs."""
    from ggml_attn.graph import build
    fresh = greedy(_cache(model), model, [[1, 2, 3], [4, 5]], 9, mode="simple")
    real, built = build.build_ubatch_graph, []

    def counting(*a, **kw):
        built.append(1)
        return real(*a, **kw)
    monkeypatch.setattr(build, "build_ubatch_graph", counting)
    c = _cache(model)
    assert greedy(c, model, [[1, 2, 3], [4, 5]], 9, mode="simple") == fresh
    assert len(built) == 2          # the prompt's ubatch, then one decode step's for all 8 steps
    greedy(c, model, [[6], [7]], 4, seq_ids=[0, 1], mode="simple")   # the same cache and model: reused
    assert len(built) == 2          # (one token per sequence: the decode step's structure)
    greedy(c, model, [[6, 7], [8, 9]], 2, seq_ids=[0, 1], mode="simple")
    assert len(built) == 3          # a prompt ubatch of 4 tokens: one new structure


def test_run_batch_reuses_its_graphs_from_call_to_call(monkeypatch):
    """run_batch(compute="ggml") runs on an engine kept with the cache (runner.QKVEngine): decode
    steps of one structure build one graph, later calls reuse it with their own Q/K/V (each
    ubatch built its graph before), and every output equals the numpy reference's."""
    from ggml_attn.graph import AttnConfig, Batch, KVCache, build, run_batch
    cfg = AttnConfig(n_layer=3, n_head=4, n_head_kv=2, head_dim_k=32)
    real, built = build.build_ubatch_graph, []

    def counting(*a, **kw):
        built.append(1)
        return real(*a, **kw)
    monkeypatch.setattr(build, "build_ubatch_graph", counting)
    caches = {how: KVCache(512, 4, unified=True, n_layer=3, n_head_kv=2, head_dim_k=32, dtype=np.float32)
              for how in ("ggml", "numpy")}
    for how, c in caches.items():
        run_batch(c, Batch.from_lengths([5, 3, 7, 2]), 512, "simple", cfg, compute=how)
    assert len(built) == 1
    for step in range(4):
        outs = {}
        for how, c in caches.items():
            pos = c.next_positions(range(4))
            b = Batch(np.arange(4, dtype=np.int32), np.array([pos[s] for s in range(4)], dtype=np.int32),
                      tuple((s,) for s in range(4)))
            outs[how] = run_batch(c, b, 512, "simple", cfg, compute=how).out
        np.testing.assert_allclose(outs["ggml"], outs["numpy"], rtol=2e-3, atol=2e-3)
    assert len(built) == 2          # the prompt's ubatch, then one decode step's graph for all 4 steps


def test_kept_engines_go_with_their_cache_and_stay_few(monkeypatch):
    """The engines run_batch / run_model_batch keep with a cache (graph/engine.kept_engine) hold
    it weakly: dropping the cache frees it and closes them at once (no cycle for the collector:
    on a GPU the cache is the device's K/V); one engine serves every seed of a config; at most
    MAX_KEPT_ENGINES per cache; a graph whose results cannot be read is freed, not leaked."""
    import gc
    import weakref
    from ggml_attn.graph import AttnConfig, Batch, KVCache, build, engine, run_batch
    from ggml_attn.graph.qkv_runner import QKVEngine
    gc.disable()
    try:
        c = KVCache(512, 2, n_layer=2, n_head_kv=2, head_dim_k=32, dtype=np.float32)
        for seed in range(6):
            run_batch(c, Batch.from_lengths([3, 2], start_pos=c.next_positions([0, 1])), 512, "simple",
                      AttnConfig(n_layer=2, n_head=4, n_head_kv=2, head_dim_k=32, seed=seed), compute="ggml")
        assert len(c._engines) == 1
        e = next(iter(c._engines.values()))
        for n_head in (2, 6, 8, 10, 12):   # five configs of their own
            run_batch(c, Batch.from_lengths([1], start_pos=c.next_positions([0])), 512, "simple",
                      AttnConfig(n_layer=2, n_head=n_head, n_head_kv=2, head_dim_k=32), compute="ggml")
        assert len(c._engines) == engine.MAX_KEPT_ENGINES and e not in c._engines.values()
        assert not e._graphs           # the least recently used one was closed
        kept = list(c._engines.values())
        ref = weakref.ref(c)
        del c
        assert ref() is None and all(not k._graphs for k in kept)
    finally:
        gc.enable()
    freed = []
    real_free = build.UBatchGraph.free
    monkeypatch.setattr(build.UBatchGraph, "free", lambda g: (freed.append(g.ctx is not None), real_free(g))[1])

    def unreadable(self, g, plan):
        raise RuntimeError("device lost")
    monkeypatch.setattr(QKVEngine, "ubatch_result", unreadable)
    c = KVCache(512, 1, n_layer=1, n_head_kv=1, head_dim_k=32, dtype=np.float32)
    with pytest.raises(Exception, match="device lost"):
        run_batch(c, Batch.from_lengths([4]), 512, "simple", AttnConfig(n_layer=1, n_head=1, n_head_kv=1,
                                                                         head_dim_k=32), compute="ggml")
    assert freed.count(True) == 1 and not next(iter(c._engines.values()))._graphs   # (the one graph, freed)


def test_a_second_ggml_in_the_process_is_named():
    """ggml_attn refuses to import beside another ggml's libraries (llama.cpp's libggml-base.so
    found first through LD_LIBRARY_PATH), naming them; ggml-python's own pass."""
    from ggml_attn._ggml_check import foreign_ggml_libraries
    own = "/venv/site-packages/ggml/lib"
    maps = "\n".join([
        f"7f00-7f10 r-xp 00000000 08:01 1 {own}/libggml.so",
        f"7f10-7f20 r-xp 00000000 08:01 2 {own}/libggml-cpu.so",
        "7f20-7f30 r-xp 00000000 08:01 3 /tmp/lc/build/bin/libggml-base.so",
        "7f30-7f40 r--p 00001000 08:01 3 /tmp/lc/build/bin/libggml-base.so",
        "7f40-7f50 r-xp 00000000 08:01 4 /usr/lib/libm.so.6",
        "7f50-7f60 rw-p 00000000 00:00 0 ",
        "7f60-7f70 r-xp 00000000 08:01 5 [vdso]"])
    assert foreign_ggml_libraries(maps, own) == ["/tmp/lc/build/bin/libggml-base.so"]
    assert foreign_ggml_libraries(maps.replace("/tmp/lc/build/bin", own), own) == []


def test_this_process_has_one_ggml():
    import ggml_attn._ggml_check as c
    c.check_one_ggml()   # what import ggml_attn ran: ggml-python's libraries only


def test_import_refuses_a_ggml_found_first_on_the_library_path(tmp_path):
    """The real case: a libggml-base.so in a folder on LD_LIBRARY_PATH (here a copy of
    ggml-python's own, standing for llama.cpp's) is what the loader picks; import says so."""
    import os
    import shutil
    import subprocess
    import sys
    import ggml
    own = os.path.dirname(ggml.ggml.lib._name)
    shutil.copy(os.path.join(own, "libggml-base.so"), tmp_path / "libggml-base.so")
    env = dict(os.environ, LD_LIBRARY_PATH=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", "import ggml_attn"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0 and f"loaded {tmp_path}/libggml-base.so beside ggml-python's own ggml" in r.stderr


def test_the_example_model_is_a_gguf_file_for_both_readers(tmp_path):
    """README's example file (graph/example_model.py, standard library + numpy): the gguf
    package reads the same keys and tensors, our loader runs it, the CLIs take it."""
    import gguf
    from ggml_attn.graph import write_example_model
    path = write_example_model(tmp_path / "ex.gguf", n_layer=3, n_vocab=300, seed=1)
    r = gguf.GGUFReader(path)
    assert r.fields["general.architecture"].contents() == "llama"
    assert r.fields["llama.block_count"].contents() == 3 and r.fields["llama.vocab_size"].contents() == 300
    m = load_gguf(path)
    assert (m.hp.n_layer, m.hp.n_vocab, m.hp.n_head_kv, m.hp.head_dim_k) == (3, 300, 2, 64)
    by_name = {t.name: t for t in r.tensors}
    assert len(by_name) == 2 + 9 * 3 + 1
    np.testing.assert_array_equal(np.asarray(by_name["blk.2.ffn_down.weight"].data), m.layers[2]["wd"].to_float(np.float16))
    np.testing.assert_array_equal(np.asarray(by_name["blk.0.attn_norm.weight"].data), np.ones(256, np.float32))
    assert [len(t) for t in greedy(_cache(m), m, [[1, 2], [3]], 4)] == [4, 4]


def test_a_cache_and_its_engine_go_together(model):
    """The model engine kept with a cache (graph/model_runner.model_engine) does not keep the
    cache alive: five caches used by greedy and dropped are collected (a registry keyed by the
    cache held each through its engine, graphs and all, until the process ended)."""
    import gc
    import weakref
    refs = []
    for _ in range(5):
        c = _cache(model)
        greedy(c, model, [[1, 2], [3]], 3)
        refs.append(weakref.ref(c))
        del c
    gc.collect()
    assert [r() for r in refs] == [None] * 5


@pytest.mark.parametrize("fa", [True, False, "off", 1])
def test_fa_must_be_an_op(model, fa):
    """fa=True / False / "off" (a llama.cpp user's -fa habit) is refused before anything is
    decoded (it failed inside the first ubatch, or fa=False silently ran flash attention)."""
    c = _cache(model)
    with pytest.raises(ValueError, match="fa must be a flash-attention op"):
        greedy(c, model, [[1, 2]], 2, fa=fa)
    assert _empty(c)
