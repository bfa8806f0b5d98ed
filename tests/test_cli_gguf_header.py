"""A .gguf header with shape values no model has: one line on stderr, exit 2."""
import pytest

from ggml_attn.cli import batched_bench, bench, models
from ggml_attn.cli.errors import UserError

import gguf  # noqa: E402 - in the test extra

GOOD = {"block_count": ("uint32", 2), "embedding_length": ("uint32", 128),
        "attention.head_count": ("uint32", 4), "attention.head_count_kv": ("uint32", 2),
        "feed_forward_length": ("uint32", 256), "context_length": ("uint32", 512)}


def _write(path, **override):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("odd")
    for key, (kind, value) in {**GOOD, **override}.items():
        getattr(w, f"add_{kind}")(f"llama.{key}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


BAD = [
    ({"attention.head_count": ("uint32", 0)}, "head_count"),
    ({"block_count": ("int32", -3)}, "block_count"),
    ({"attention.head_count": ("string", "eight")}, "head_count"),
    ({"attention.head_count": ("string", "8")}, "head_count"),
    ({"embedding_length": ("uint64", 2 ** 62)}, "embedding_length"),
    ({"embedding_length": ("float32", 128.5)}, "embedding_length"),
    ({"attention.head_count_kv": ("int32", -2)}, "head_count_kv"),
    ({"attention.head_count_kv": ("uint32", 3)}, "head_count_kv"),
    ({"feed_forward_length": ("int64", -1)}, "feed_forward_length"),
    ({"context_length": ("uint64", 2 ** 40)}, "context_length"),
    ({"embedding_length": ("uint32", 2)}, "head_dim"),  # 2 // 4 heads = 0
]


@pytest.mark.parametrize("override, key", BAD)
def test_reader_rejects_with_the_key(tmp_path, override, key):
    path = _write(tmp_path / "m.gguf", **override)
    with pytest.raises(UserError, match=key):
        models.resolve(path)


@pytest.mark.parametrize("override, key", BAD[:5])
@pytest.mark.parametrize("tool", ["bench", "batched"])
def test_tools_one_line_exit_2(tmp_path, capsys, override, key, tool):
    path = _write(tmp_path / "m.gguf", **override)
    if tool == "bench":
        rc = bench.main(["-m", path, "-p", "8", "-n", "0", "-r", "1", "--device", "cpu", "-t", "1"])
    else:
        rc = batched_bench.main(["-m", path, "-npp", "8", "-npl", "1", "-ntg", "1", "--device", "cpu",
                                 "-t", "1"])
    out = capsys.readouterr()
    assert rc == 2 and out.out == ""
    assert out.err.count("\n") == 1 and key in out.err and "Traceback" not in out.err


def test_big_but_valid_shape_is_one_line_when_memory_runs_out(tmp_path, capsys):
    """2**31 - 1 fits llama.cpp's uint32 fields; the KV cache of it does not fit memory."""
    path = _write(tmp_path / "m.gguf", embedding_length=("uint32", 2 ** 30), **{
        "attention.head_count": ("uint32", 1), "attention.head_count_kv": ("uint32", 1)})
    rc = bench.main(["-m", path, "-p", "8", "-n", "0", "-r", "1", "--device", "cpu", "-t", "1",
                     "-c", "16", "--layer", "attn"])   # a header: shapes only (as --layer model it fails before)
    out = capsys.readouterr()
    assert rc == 2 and out.err.count("\n") == 1 and "memory" in out.err


def test_good_header_still_reads(tmp_path):
    m = models.resolve(_write(tmp_path / "m.gguf"))
    assert (m.n_layer, m.n_head, m.n_head_kv, m.head_dim_k, m.n_embd) == (2, 4, 2, 32, 128)


@pytest.mark.parametrize("value", [("string", "fifty"), ("float32", float("nan")), ("float32", -1.0)])
def test_softcap_must_be_a_number(tmp_path, value):
    path = _write(tmp_path / "m.gguf", attn_logit_softcapping=value)
    with pytest.raises(UserError, match="attn_logit_softcapping"):
        models.resolve(path)


def test_vocab_and_tokens_of_the_wrong_kind(tmp_path):
    """vocab_size an array, tokenizer.ggml.tokens one number: one line naming the key (the header
    reader took an array's largest value and the weight loader then failed with a TypeError)."""
    w = gguf.GGUFWriter(str(tmp_path / "v.gguf"), "llama")
    for key, (kind, value) in GOOD.items():
        getattr(w, f"add_{kind}")(f"llama.{key}", value)
    w.add_array("llama.vocab_size", [256])
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(UserError, match="vocab_size is an array of 1"):
        models.resolve(str(tmp_path / "v.gguf"))
    path = _write(tmp_path / "t.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "t2.gguf"), "llama")
    for key, (kind, value) in GOOD.items():
        getattr(w, f"add_{kind}")(f"llama.{key}", value)
    w.add_uint32("tokenizer.ggml.tokens", 5)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    assert models.resolve(path).n_vocab == 0
    with pytest.raises(UserError, match="tokenizer.ggml.tokens is 5; expected an array of strings"):
        models.resolve(str(tmp_path / "t2.gguf"))


def test_gemma2_files_carry_their_window_and_softcap(tmp_path):
    """A gemma2 header gives the attention-only runs (--layer attn/full) the file's window as a
    position limit and llama.cpp's soft-cap default (50) when the key is absent; the preset too."""
    import dataclasses

    import fixtures_gguf
    spec = dataclasses.replace(fixtures_gguf.SPECS["gemma2-f32"], sliding_window=32, attn_softcap=0.0)
    m = models.resolve(fixtures_gguf.write_model(spec, str(tmp_path / "g.gguf")))
    assert (m.pos_limit, m.logit_softcap) == (32, 50.0)
    assert models.resolve("gemma-2-9b").pos_limit == 4096
    rc = bench.main(["-m", str(tmp_path / "g.gguf"), "-p", "64", "-n", "0", "-r", "1", "--device", "cpu",
                     "--layer", "attn"])
    assert rc != 0


@pytest.mark.parametrize("tool", ["bench", "batched", "serve"])
def test_layers_of_random_weights_say_when_they_stand_in_for_another_arch(tmp_path, capsys, tool):
    """--layer attn|full on a qwen3 file times llama-shaped layers with its shapes: one note on
    stderr says so (once, whatever the rows); a llama file, and --layer model, say nothing."""
    import fixtures_gguf
    from ggml_attn.cli import serve_bench
    qwen = fixtures_gguf.write_model(fixtures_gguf.SPECS["qwen3-f32"], str(tmp_path / "q.gguf"))
    llama = _write(tmp_path / "l.gguf")

    def run(path, layer):
        if tool == "bench":
            return bench.main(["-m", path, "-p", "8,16", "-n", "0", "-r", "1", "--device", "cpu", "-t", "1",
                               "--layer", layer, "-o", "jsonl"])
        if tool == "batched":
            return batched_bench.main(["-m", path, "-npp", "8", "-npl", "1,2", "-ntg", "1", "--device", "cpu",
                                       "-t", "1", "--layer", layer])
        return serve_bench.main(["-m", path, "-n", "2", "--prompt-dist", "4-8", "--gen-dist", "1-2", "--device",
                                 "cpu", "-t", "1", "--layer", layer])

    assert run(qwen, "attn") == 0
    err = capsys.readouterr().err
    assert err.count("note: --layer attn times llama-shaped layers with the qwen3 file's") == 1, err
    for path, layer in ((llama, "attn"), (qwen, "model")):
        assert run(path, layer) == 0
        assert "llama-shaped" not in capsys.readouterr().err
    assert models.synthetic_layer_note(models.resolve(qwen), "full").startswith("--layer full times")
    assert models.synthetic_layer_note(models.resolve("llama-3-8b"), "attn") is None   # a preset
