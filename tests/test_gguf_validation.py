"""Corrupt GGUF files that llama.cpp's loader refuses are refused here too, with one line naming
the problem (issue #47 B.3): never loaded with wrong weights, never a TypeError. Header level
(graph/gguf_file.py): duplicate keys and tensor names, tensor data that is misaligned, overlaps
the tensor before it or leaves a gap (llama.cpp's reader wants the tensors back to back in file
order, each padded to the alignment). Model level (graph/model.py): tensors the architecture
does not have (block_count smaller than the layers present), a float or a string where an integer
belongs, an array where one value belongs."""
import struct

import numpy as np
import pytest

import fixtures_gguf
from ggml_attn.graph import ModelError, load_gguf
from ggml_attn.graph.gguf_file import GGUFError, read_header
from test_model import _rewrite


def _gguf(kvs, tensors, *, align=32, offsets=None) -> bytes:
    """A GGUF v3 file: ``kvs`` [(key, u32 value)], ``tensors`` [(name, n values F32)], data back
    to back (``offsets``: the data offsets to write instead)."""
    def s(x: str) -> bytes:
        b = x.encode()
        return struct.pack("<Q", len(b)) + b
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs))
    for k, v in kvs:
        out += s(k) + struct.pack("<II", 4, v)
    at, offs = 0, []
    for name, n in tensors:
        offs.append(at)
        at += -(-4 * n // align) * align
    offs = offsets or offs
    for (name, n), off in zip(tensors, offs):
        out += s(name) + struct.pack("<I", 1) + struct.pack("<Q", n) + struct.pack("<I", 0) + struct.pack("<Q", off)
    out += b"\0" * (-len(out) % align)
    return out + b"\0" * (at + 64)


def _write(tmp_path, data: bytes):
    p = tmp_path / "t.gguf"
    p.write_bytes(data)
    return p


def test_a_well_formed_file_reads(tmp_path):
    h = read_header(_write(tmp_path, _gguf([("a", 1), ("b", 2)], [("x", 8), ("y", 3), ("z", 16)])))
    assert [t.name for t in h.tensors] == ["x", "y", "z"] and h.fields == {"a": 1, "b": 2}


@pytest.mark.parametrize("kvs, tensors, offsets, match", [
    ([("a", 1), ("a", 2)], [("x", 8)], None, "metadata key a appears twice"),
    ([], [("x", 8), ("x", 8)], None, "tensor x appears twice"),
    ([], [("x", 8), ("y", 8)], [0, 33], r"tensor y has data offset 33, expected 32 \(not a multiple of the alignment 32\)"),
    ([], [("x", 8), ("y", 8)], [0, 0], r"tensor y has data offset 0, expected 32 \(overlapping the tensor before it\)"),
    ([], [("x", 8), ("y", 8)], [0, 64], r"expected 32 \(leaving a gap after the tensor before it\)"),
])
def test_header_errors(tmp_path, kvs, tensors, offsets, match):
    with pytest.raises(GGUFError, match=match):
        read_header(_write(tmp_path, _gguf(kvs, tensors, offsets=offsets)))


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return fixtures_gguf.fixture_path("llama-f32", tmp_path_factory.mktemp("v"))


def _patched(src, tmp_path, key: bytes, vtype: int | None = None, value: int | None = None):
    """A copy of ``src`` with the u32 metadata value of ``key`` given another type tag or value
    (in place: the file's layout unchanged)."""
    data = bytearray(open(src, "rb").read())
    at = data.index(key) + len(key)
    if vtype is not None:
        data[at:at + 4] = struct.pack("<I", vtype)
    if value is not None:
        data[at + 4:at + 8] = struct.pack("<I", value)
    p = tmp_path / "p.gguf"
    p.write_bytes(bytes(data))
    return p


def test_block_count_smaller_than_the_layers_present(src, tmp_path):
    with pytest.raises(ModelError, match=r"tensor\(s\) that a llama model of 1 layers does not have: blk\.1\."):
        load_gguf(_patched(src, tmp_path, b"llama.block_count", value=1))


def test_a_float_where_an_integer_belongs(src, tmp_path):
    with pytest.raises(ModelError, match=r"llama.block_count is \d.*e-45; expected an integer"):
        load_gguf(_patched(src, tmp_path, b"llama.block_count", vtype=6))     # the same 4 bytes as FLOAT32


@pytest.mark.parametrize("key, value, match", [
    ("{arch}.context_length", ([4096, 4096], None), "context_length is an array of 2; expected one number"),
    ("{arch}.embedding_length", ("256", 8), r"embedding_length is '256'; expected an integer"),
    ("{arch}.attention.head_count_kv", (["a", "b"], None), "head_count_kv must hold ints, got an array of 2 strings"),
    ("{arch}.rope.freq_base", ("x", 8), r"rope.freq_base is 'x'; expected a float"),
    ("{arch}.rope.freq_base", (10000, 4), r"rope.freq_base is 10000; expected a float"),   # a u32: llama.cpp refuses it
    ("{arch}.vocab_size", ([256], None), "vocab_size is an array of 1; expected one number"),
    ("{arch}.vocab_size", ("abc", 8), r"vocab_size is 'abc'; expected an integer"),
    ("{arch}.vocab_size", (256.7, 6), r"vocab_size is 256\.7.*; expected an integer"),
    ("{arch}.attention.head_count", ([4], None), "head_count has 1 values for 2 layers"),
])
def test_values_of_the_wrong_type(src, tmp_path, key, value, match):
    import gguf
    vt = value[1] if value[1] is None else gguf.GGUFValueType(value[1])
    with pytest.raises(ModelError, match=match):
        load_gguf(_rewrite(src, str(tmp_path / "w.gguf"), kv={key: (value[0], vt)}))


def test_per_layer_arrays_of_one_value_still_load(src, tmp_path):
    m = load_gguf(src)
    w = load_gguf(_rewrite(src, str(tmp_path / "w.gguf"), kv={"{arch}.attention.head_count_kv":
                                                               ([m.hp.n_head_kv] * m.hp.n_layer, None)}))
    assert w.hp == m.hp and np.array_equal(w.layers[1]["wq"].to_float(), m.layers[1]["wq"].to_float())


def test_a_string_array_where_a_string_belongs_is_shown_not_repr(src, tmp_path):
    bad = _rewrite(src, str(tmp_path / "s.gguf"), extra_kv={"{arch}.rope.scaling.type": (["linear"], None)})
    with pytest.raises(ModelError, match="rope scaling an array of 1 strings is not supported"):
        load_gguf(bad)


def test_a_scalar_token_list_is_refused(src, tmp_path):
    """No vocab_size and tokenizer.ggml.tokens one number: one line, not a TypeError."""
    import gguf
    bad = _rewrite(src, str(tmp_path / "t.gguf"), drop_kv=("{arch}.vocab_size",),
                   kv={"tokenizer.ggml.tokens": (5, gguf.GGUFValueType.UINT32)})
    with pytest.raises(ModelError, match="tokenizer.ggml.tokens is 5; expected an array of strings"):
        load_gguf(bad)
