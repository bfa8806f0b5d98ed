"""Model presets and .gguf header reading."""
import pytest

from ggml_attn.cli import models
from ggml_attn.cli.errors import UserError

import gguf  # noqa: E402 - in the test extra


def test_presets_are_consistent():
    for name, m in models.PRESETS.items():
        assert m.name == name
        assert m.n_head % m.n_head_kv == 0, name
        assert m.n_layer > 0 and m.head_dim_k > 0 and m.n_embd > 0 and m.n_ff > 0
    l8 = models.resolve("llama-3-8b")
    assert (l8.n_layer, l8.n_head, l8.n_head_kv, l8.head_dim_k, l8.gqa) == (32, 32, 8, 128, 4)
    # about 8.0 B parameters for the published shape
    assert 7.9e9 < l8.n_params < 8.1e9
    assert models.resolve("LLaMA-3-70B").n_layer == 80


def test_unknown_model():
    with pytest.raises(UserError, match="unknown model 'gpt-9'.*presets: tiny"):
        models.resolve("gpt-9")
    with pytest.raises(UserError, match="not found"):
        models.resolve("/nonexistent/x.gguf")
    # a path without the extension is a missing file, not an unknown preset
    for path in ("/nonexistent/llama-8b", "models/llama-8b-q4", "./tiny"):
        with pytest.raises(UserError, match=f"model file not found: {path}$"):
            models.resolve(path)


def _write(path, arch="llama", kv=2, key_length=None):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("unit-test-model")
    w.add_block_count(3)
    w.add_embedding_length(256)
    w.add_head_count(8)
    if kv:
        w.add_head_count_kv(kv)
    if key_length:
        w.add_key_length(key_length)
    w.add_feed_forward_length(688)
    w.add_context_length(2048)
    w.add_vocab_size(1000)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_header(tmp_path):
    p = tmp_path / "m.gguf"
    _write(p)
    m = models.resolve(str(p))
    assert (m.name, m.n_layer, m.n_head, m.n_head_kv, m.head_dim_k, m.n_embd, m.n_ff, m.n_ctx_train,
            m.n_vocab) == ("unit-test-model", 3, 8, 2, 32, 256, 688, 2048, 1000)
    assert m.source == str(p)


def test_gguf_defaults_and_key_length(tmp_path):
    p = tmp_path / "q.gguf"
    _write(p, arch="qwen2", kv=0, key_length=64)
    m = models.read_gguf(str(p))
    assert m.n_head_kv == 8 and m.head_dim_k == 64


def test_gguf_garbage(tmp_path):
    p = tmp_path / "bad.gguf"
    p.write_bytes(b"not a gguf file at all")
    with pytest.raises(UserError, match="cannot read gguf"):
        models.resolve(str(p))
