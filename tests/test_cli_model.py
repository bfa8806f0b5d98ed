"""``-m FILE.gguf`` in the CLIs runs the file's own weights (``--layer model``): the engine's
graphs (built once per structure and output count, then reused with ``load_plan``) give the
logits ``run_model_batch`` gives for the same batches, on host graphs and on all-custom graphs
(the GPU engine's form, over numpy arrays)."""
import numpy as np
import pytest

import fixtures_gguf
from ggml_attn import reference
from ggml_attn.cli.errors import UserError
from ggml_attn.cli.host_engine import HostEngine
from ggml_attn.cli.models import resolve
from ggml_attn.cli.runner import RunConfig, Runner
from ggml_attn.graph import KVCache
from ggml_attn.graph.model import load_gguf
from ggml_attn.graph.model_runner import run_model_batch

LENGTHS = [3, 9, 5, 12]


class AllCustomHostEngine(HostEngine):
    all_custom = True


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return fixtures_gguf.fixture_path("llama-f16", str(tmp_path_factory.mktemp("gguf")))


def cli_logits(path, split, unified, engine_cls=HostEngine):
    """Prompts then three decode steps through the CLI's runner: the batches and, per ubatch,
    the logits of its output rows."""
    r = Runner(RunConfig(resolve(path), n_ctx=len(LENGTHS) * 256, n_seq=len(LENGTHS), kv_unified=unified,
                         split=split, layer="model", n_ubatch=8, device="cpu", n_threads=2))
    if engine_cls is not HostEngine:
        r.engine.close()
        r.engine = engine_cls(r.cfg, r.cache)
    eng, got, run = r.engine, [], r.engine.run_ubatch

    def run_ubatch(plan):
        run(plan)
        got.append(np.array(eng._keep[1]))
    eng.run_ubatch = run_ubatch
    batches = [r.prompt_batch(LENGTHS)] + [None] * 3
    try:
        r.decode(batches[0])
        for i in range(1, 4):
            batches[i] = r.step_batch(list(range(len(LENGTHS))))
            r.decode(batches[i])
        return batches, got, eng
    finally:
        r.close()


@pytest.mark.parametrize("split, unified", [("simple", True), ("equal", False), ("padded", False),
                                            ("auto", True)])
def test_cli_model_engine_matches_run_model_batch(gguf, split, unified):
    batches, got, _ = cli_logits(gguf, split, unified)
    model = load_gguf(gguf)
    hp = model.hp
    cache = KVCache(len(LENGTHS) * 256, len(LENGTHS), unified=unified, n_layer=hp.n_layer,
                    n_head_kv=hp.n_head_kv, head_dim_k=hp.head_dim_k)
    want = [run_model_batch(cache, b, model, 8, split).logits for b in batches]
    # the prompt's output rows come in ubatch order, a sequence's last token where it lands
    n_prompt_ub = len(got) - 3
    prompt = np.concatenate(got[:n_prompt_ub])
    assert prompt.shape == want[0].shape
    assert reference.nmse(np.sort(prompt, axis=0), np.sort(want[0], axis=0)) < 1e-10   # the same rows
    for g, w in zip(got[n_prompt_ub:], want[1:]):    # a decode step: one ubatch, batch order
        assert reference.nmse(g, w) < 1e-10


@pytest.mark.parametrize("engine_cls", [HostEngine, AllCustomHostEngine])
def test_prompt_ubatches_of_other_streams_share_a_structure(gguf, monkeypatch, engine_cls):
    """One stream per sequence, one sequence per ubatch ("seq"): sequence 1's and 3's 8-token
    chunks have one structure (build.graph_key has no first stream); the graph built for one
    computes the other's (its K/V views moved by load_plan) -- built once -- and every ubatch's
    logits, prompt and decode steps, equal run_model_batch's."""
    from ggml_attn.graph import build, split_ubatches
    built = []
    real = build.build_ubatch_graph

    def counting(cache, plan, *a, **kw):
        built.append((build.graph_key(plan), plan.slot.s0))
        return real(cache, plan, *a, **kw)
    monkeypatch.setattr(build, "build_ubatch_graph", counting)
    batches, got, _ = cli_logits(gguf, "seq", False, engine_cls)
    eight = [s0 for key, s0 in built if key[0] == 8]
    assert eight == [1], built   # sequences 1 and 3 each give an 8-token chunk first: one build
    model = load_gguf(gguf)
    hp = model.hp
    cache = KVCache(len(LENGTHS) * 256, len(LENGTHS), unified=False, n_layer=hp.n_layer,
                    n_head_kv=hp.n_head_kv, head_dim_k=hp.head_dim_k)
    bound = 1e-10 if engine_cls is HostEngine else 5e-4
    for b in batches:   # each batch's ubatches' output rows, in ubatch order (one sequence each)
        n_ub = len(split_ubatches(b, 8, "seq"))
        mine, got = np.concatenate(got[:n_ub]), got[n_ub:]
        want = run_model_batch(cache, b, model, 8, "seq").logits
        assert mine.shape == want.shape and reference.nmse(mine, want) < bound
    assert not got


def test_cli_model_engine_all_custom_form(gguf):
    _, host, _ = cli_logits(gguf, "equal", False)
    _, cust, eng = cli_logits(gguf, "equal", False, AllCustomHostEngine)
    assert len(host) == len(cust) >= 4
    for a, b in zip(host, cust):
        assert np.isfinite(b).all() and reference.nmse(b, a) < 5e-4


@pytest.mark.parametrize("name", ["llama-q8_0", "llama-q4_0", "llama-q4_k", "llama-q6_k", "qwen2-q8_0"])
@pytest.mark.parametrize("split, unified", [("equal", False), ("simple", True)])
def test_cli_model_engine_all_custom_form_on_weight_blocks(tmp_path_factory, name, split, unified):
    """The GPU engine's graph form with matrices kept in their blocks (the norm weights applied to
    the activations, not folded) gives the host graph's logits (ggml's quantized matmuls) and its
    greedy tokens: prompt ubatches of 8 tokens and decode steps."""
    from ggml_attn.graph.model_device import QMatrix
    path = fixtures_gguf.fixture_path(name, str(tmp_path_factory.mktemp("q")))
    _, host, _ = cli_logits(path, split, unified)
    _, cust, eng = cli_logits(path, split, unified, AllCustomHostEngine)
    dw = load_gguf(path).device_weights(np)
    assert isinstance(dw.layers[0]["wq"], QMatrix) and isinstance(dw.output, QMatrix)
    assert len(host) == len(cust) >= 4
    for a, b in zip(host, cust):
        # the host quantizes its activations to Q8 for the dot products, ours stay F32: the
        # logits differ by ~0.5 at most on these files, NMSE 1.3e-4 .. 8e-4 -- what the earlier
        # F16-dequantized form gave too (qwen2-q8_0 0.00023 .. 0.00081 before, 0.00023 .. 0.00078 now)
        assert np.isfinite(b).all() and reference.nmse(b, a) < 1e-3
        # so the same greedy token unless the host's top two are near
        top2 = np.sort(a, axis=1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 1.0
        assert (a.argmax(axis=1) == b.argmax(axis=1))[clear].all()


def test_cli_model_needs_a_gguf():
    with pytest.raises(UserError, match="needs|give -m FILE.gguf"):
        RunConfig(resolve("tiny"), n_ctx=256, layer="model", device="cpu")


def test_cli_model_refuses_multi_gpu_split(gguf):
    from types import SimpleNamespace
    with pytest.raises(UserError, match="one GPU or the CPU"):
        RunConfig(resolve(gguf), n_ctx=256, layer="model", device="cuda",
                  tp=SimpleNamespace(n_rank=2, mode="row"))


def test_bench_layer_default_is_per_model(gguf, capsys):
    """Without --layer, each -m gets its own default: a .gguf its own weights (model), a preset its
    shapes (attn) -- a preset beside the file turned the file's runs into attention-only ones."""
    import json

    from ggml_attn.cli import bench
    rc = bench.main(["-m", gguf, "-m", "tiny", "-p", "8", "-n", "0", "-r", "1", "--device", "cpu", "-t", "1",
                     "-o", "jsonl"])
    assert rc == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["model_name"] == "tiny", r["layer"]) for r in rows] == [(False, "model"), (True, "attn")]


@pytest.mark.parametrize("tool", ["bench", "batched"])
def test_model_file_errors_come_before_any_output(gguf, capsys, tool, tmp_path):
    """What the model file refuses (its layer count against --n-layer; a file whose header reads
    but whose weights do not) is one line before anything is printed: the header, an empty table
    or a csv header came first before."""
    import gguf as gguf_pkg

    from ggml_attn.cli import batched_bench, bench
    header_only = str(tmp_path / "h.gguf")
    w = gguf_pkg.GGUFWriter(header_only, "llama")
    for key, value in (("block_count", 2), ("embedding_length", 128), ("attention.head_count", 4),
                       ("attention.head_count_kv", 2), ("feed_forward_length", 256), ("context_length", 512),
                       ("vocab_size", 64)):
        w.add_uint32(f"llama.{key}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for path, extra, words in ((gguf, ["--n-layer", "5"], "cannot change the layer count"),
                               (header_only, [], "lacks tensor")):
        if tool == "bench":
            rc = bench.main(["-m", path, "-p", "8", "-n", "2", "-r", "1", "--device", "cpu", "-t", "1", "-o", "csv"]
                            + extra)
        else:
            rc = batched_bench.main(["-m", path, "-npp", "8", "-ntg", "2", "-npl", "1", "--device", "cpu", "-t", "1"]
                                    + extra)
        out = capsys.readouterr()
        assert rc == 2 and out.out == "" and out.err.count("\n") == 1 and words in out.err, (path, out)


def test_output_rows_padded_to_a_power_of_two_share_a_structure(gguf, monkeypatch):
    """Ragged prompts that end anywhere in a ubatch: the engine pads each ubatch's output rows
    to a power of two (copies of the last), so ubatches of 3, 5, 6 or 7 endings share the
    structure of 4 or 8; each prompt's logits (the real rows only) equal run_model_batch's."""
    from ggml_attn.graph import Batch, build, split_ubatches
    lengths = [1, 1, 6, 1, 1, 1, 1, 4, 1, 1, 1, 1, 1, 3, 1, 7]   # 8-token ubatches ending 3, 5, 6, 2 prompts
    built = []
    real = build.build_ubatch_graph

    def counting(cache, plan, *a, **kw):
        built.append(len(kw["out_rows"]))
        return real(cache, plan, *a, **kw)
    monkeypatch.setattr(build, "build_ubatch_graph", counting)
    r = Runner(RunConfig(resolve(gguf), n_ctx=512, n_seq=len(lengths), kv_unified=True, split="simple",
                         layer="model", n_ubatch=8, device="cpu", n_threads=2))
    got, run = [], r.engine.run_ubatch

    def run_ubatch(plan):
        run(plan)
        got.append(np.array(r.engine._keep[1]))
    r.engine.run_ubatch = run_ubatch
    batch = r.prompt_batch(lengths)
    try:
        r.decode(batch)
    finally:
        r.close()
    assert [len(x) for x in got] == [3, 5, 6, 2] and built == [4, 8, 2], built   # 6 endings: 5's structure
    model = load_gguf(gguf)
    hp = model.hp
    cache = KVCache(512, len(lengths), unified=True, n_layer=hp.n_layer, n_head_kv=hp.n_head_kv,
                    head_dim_k=hp.head_dim_k)
    want = run_model_batch(cache, batch, model, 8, "simple").logits
    assert len(split_ubatches(batch, 8, "simple")) == len(got)
    assert reference.nmse(np.sort(np.concatenate(got), axis=0), np.sort(want, axis=0)) < 1e-10


def test_gemma2_window_limit_holds_in_the_clis(tmp_path, capsys):
    """The CLIs decode with the GGUF's own attention config: gemma2's window layers run as dense
    ones, so a row whose positions reach the window is refused with the reason (they ran
    silently before), and one below it runs."""
    import dataclasses

    import fixtures_gguf
    from ggml_attn.cli import batched_bench
    spec = dataclasses.replace(fixtures_gguf.SPECS["gemma2-f32"], sliding_window=64)
    path = fixtures_gguf.write_model(spec, str(tmp_path / "g2w64.gguf"))
    rc = batched_bench.main(["-m", path, "-npp", "16", "-ntg", "4", "-npl", "1", "--device", "cpu"])
    assert rc == 0, capsys.readouterr().err
    capsys.readouterr()
    rc = batched_bench.main(["-m", path, "-npp", "128", "-ntg", "1", "-npl", "1", "--device", "cpu"])
    assert rc != 0 and "sliding window (64 tokens)" in capsys.readouterr().err
