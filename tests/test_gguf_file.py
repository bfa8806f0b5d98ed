"""graph/gguf_file.py: the project's own GGUF header reader reads what the ``gguf`` package
reads on every fixture, and a broken file is one GGUFError that says what is wrong."""
import os
import struct

import numpy as np
import pytest

import fixtures_gguf
import gguf
from ggml_attn.graph.gguf_file import GGUFError, StringArray, read_header
from ggml_attn.graph.model import ModelError, load_gguf


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    for name in ("llama-q4_k", "qwen2-q8_0", "llama-bf16", "llama-f32-ropefreqs"):
        fixtures_gguf.write_model(name, fixtures_gguf.fixture_path(name, str(d)))
    return str(d)


def _theirs(field):
    v = field.contents()
    return [x for x in v] if isinstance(v, list) else v


@pytest.mark.parametrize("name", ["llama-q4_k", "qwen2-q8_0", "llama-bf16", "llama-f32-ropefreqs"])
def test_reads_what_the_gguf_package_reads(fixture_dir, name):
    path = fixtures_gguf.fixture_path(name, fixture_dir)
    ours, theirs = read_header(path), gguf.GGUFReader(path)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert list(ours.fields) == keys
    for k in keys:
        mine, want = ours.fields[k], _theirs(theirs.fields[k])
        if isinstance(mine, StringArray):
            assert len(mine) == len(want) and list(mine) == want, k
        elif isinstance(want, float):
            assert np.float32(mine) == np.float32(want), k
        else:
            assert mine == want, k
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.type, a.ne, a.offset, a.nbytes, a.n_elements) == \
            (b.name, int(b.tensor_type), tuple(int(x) for x in b.shape), int(b.data_offset), int(b.n_bytes),
             int(b.n_elements)), a.name
    assert ours.version == 3 and ours.data_start % 32 == 0


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _gguf(kvs=(), tensors=(), *, version=3, magic=b"GGUF", data=b"") -> bytes:
    """A GGUF file by hand: ``kvs`` (key, value type, packed value), ``tensors`` (name, ne, ggml
    type, offset); the data section after the header, aligned to 32."""
    out = magic + struct.pack("<IQQ", version, len(tensors), len(kvs))
    for key, vtype, packed in kvs:
        out += _str(key) + struct.pack("<I", vtype) + packed
    for name, ne, gtype, off in tensors:
        out += _str(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne) + struct.pack("<IQ", gtype, off)
    out += b"\0" * (-len(out) % 32)
    return out + data


ARCH = ("general.architecture", 8, _str("llama"))
TOKS = ("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 3) + _str("a") + _str("") + _str("ünï"))


def test_hand_made_file_and_lazy_string_arrays(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(_gguf([ARCH, TOKS, ("llama.block_count", 4, struct.pack("<I", 2)),
                         ("x.list", 9, struct.pack("<IQ", 6, 2) + struct.pack("<2f", 1.5, -2.0))],
                        [("t", (32, 2), 8, 0)], data=b"\1" * 68))
    h = read_header(p)
    assert h.fields["general.architecture"] == "llama" and h.fields["llama.block_count"] == 2
    assert h.fields["x.list"] == [1.5, -2.0]
    toks = h.fields["tokenizer.ggml.tokens"]
    assert len(toks) == 3 and list(toks) == ["a", "", "ünï"] and toks[2] == "ünï"
    (t,) = h.tensors
    assert (t.type_name, t.ne, t.nbytes, t.offset) == ("Q8_0", (32, 2), 68, h.data_start)


@pytest.mark.parametrize("blob, match", [
    (b"GGML" + b"\0" * 40, "not a GGUF file"),
    (_gguf(version=1), "version 1 is not supported"),
    (b"GGUF\3\0", "too short"),
    (_gguf([("k", 13, b"")]), "value type 13, which GGUF does not define"),
    (_gguf([("k", 9, struct.pack("<IQ", 42, 1))]), "array of value type 42"),
    (_gguf([ARCH], [("t", (32,), 42, 0)]), "ggml type 42, which this ggml does not know"),
    (_gguf([ARCH], [("t", (33,), 8, 0)], data=b"\0" * 64), "not a multiple of its type's block size 32"),
    (_gguf([ARCH], [("t", (32,), 8, 0)], data=b"\0" * 10), "runs past the end of the file"),
    (_gguf([ARCH, ("general.alignment", 4, struct.pack("<I", 24))]), "alignment is 24"),
    (_gguf([ARCH], [("t", (1, 1, 1, 1, 1), 0, 0)]), "5 dimensions"),
    # counts no file of its size holds (a key "appeared twice", a tensor had 0 dimensions)
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 2 ** 62) + bytes(64), "counts 4611686018427387904 metadata pairs"),
    (b"GGUF" + struct.pack("<IQQ", 3, 2 ** 62, 0) + bytes(64), "truncated or corrupt"),
])
def test_broken_files_say_what_is_wrong(tmp_path, blob, match):
    p = tmp_path / "bad.gguf"
    p.write_bytes(blob)
    with pytest.raises(GGUFError, match=match):
        read_header(p)
    with pytest.raises(ModelError, match="cannot read gguf"):
        load_gguf(p)


def test_cut_short_anywhere_is_one_clear_error(tmp_path):
    full = _gguf([ARCH, TOKS, ("llama.block_count", 4, struct.pack("<I", 2))], [("t", (32, 2), 8, 0)])
    header_end = len(full) - (-len(full) % 32)
    p = tmp_path / "cut.gguf"
    for cut in range(24, header_end, 3):
        p.write_bytes(full[:cut])
        with pytest.raises(GGUFError, match="ends inside the header|runs past the end|truncated or corrupt"):
            read_header(p)


def test_a_files_header_is_parsed_once_until_the_file_changes(tmp_path, monkeypatch):
    """A CLI reads one file's header three times (shapes, the loader's check, the load): the
    parse runs once per unchanged file (same path, inode, size and modification time; errors are
    not kept); a file rewritten in place or replaced is parsed again."""
    from ggml_attn.graph import gguf_file
    parses = []
    real = gguf_file._read_header
    monkeypatch.setattr(gguf_file, "_read_header", lambda *a: parses.append(a[0]) or real(*a))
    monkeypatch.setattr(gguf_file, "_HEADERS", {})
    p = tmp_path / "x.gguf"
    blocks = ("llama.block_count", 4, struct.pack("<I", 2))
    p.write_bytes(_gguf([ARCH, TOKS, blocks]))
    h = read_header(p)
    assert read_header(str(p)) is h and len(parses) == 1
    st = p.stat()
    p.write_bytes(_gguf([ARCH, TOKS, ("llama.block_count", 4, struct.pack("<I", 3))]))   # (same size)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert read_header(p).fields["llama.block_count"] == 3 and len(parses) == 2
    q = tmp_path / "y.gguf"
    q.write_bytes(_gguf([ARCH, blocks]))
    os.replace(q, p)
    assert "tokenizer.ggml.tokens" not in read_header(p).fields and len(parses) == 3
    p.write_bytes(b"GGML" + b"\0" * 40)
    for _ in range(2):
        with pytest.raises(GGUFError, match="not a GGUF file"):
            read_header(p)
    assert len(parses) == 5
    for i in range(gguf_file._HEADERS_MAX + 2):   # (a few files' headers kept, the oldest dropped)
        f = tmp_path / f"f{i}.gguf"
        f.write_bytes(_gguf([ARCH, blocks]))
        read_header(f)
    assert len(gguf_file._HEADERS) == gguf_file._HEADERS_MAX
