"""A small llama-architecture GGUF file with random weights, written with the standard library
and numpy alone: what README's example runs on right after ``pip install``, without the tests'
``gguf``-package writer (tests/fixtures_gguf.py, whose files llama.cpp's reference logits came
from). The file has no tokenizer: this package's loader needs none (token ids in, logits out);
llama.cpp's wants one.

Layout (GGUF v3, little endian): the header, metadata (``general.*`` and ``llama.*`` keys), the
tensor infos, then each tensor's data back to back, padded to 32 bytes. Matrices F16 (numpy
order ``(n_out, n_in)`` = ggml ``[n_in, n_out]``, values N(0, 1/n_in)), norm weights F32 (ones).
"""
from __future__ import annotations

import os
import struct

import numpy as np

__all__ = ["write_example_model"]

_U32, _F32, _STRING = 4, 6, 8
_ALIGN = 32


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def write_example_model(path: str | os.PathLike, *, n_layer: int = 2, n_embd: int = 256, n_head: int = 4,
                        n_head_kv: int = 2, n_ff: int = 512, n_vocab: int = 256, seed: int = 0) -> str:
    """Write the file (module docstring) to ``path`` (atomically) and return the path."""
    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError(f"n_embd {n_embd} must be a multiple of n_head {n_head}, and n_head of n_head_kv {n_head_kv}")
    rng = np.random.default_rng(seed)
    hd = n_embd // n_head
    kv = n_head_kv * hd

    def mat(n_out, n_in):
        return (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float16)

    tensors = [("token_embd.weight", mat(n_vocab, n_embd) * np.float16(4))]
    for i in range(n_layer):
        p = f"blk.{i}."
        tensors += [(p + "attn_norm.weight", np.ones(n_embd, np.float32)),
                    (p + "attn_q.weight", mat(n_embd, n_embd)), (p + "attn_k.weight", mat(kv, n_embd)),
                    (p + "attn_v.weight", mat(kv, n_embd)), (p + "attn_output.weight", mat(n_embd, n_embd)),
                    (p + "ffn_norm.weight", np.ones(n_embd, np.float32)), (p + "ffn_gate.weight", mat(n_ff, n_embd)),
                    (p + "ffn_up.weight", mat(n_ff, n_embd)), (p + "ffn_down.weight", mat(n_embd, n_ff))]
    tensors += [("output_norm.weight", np.ones(n_embd, np.float32)), ("output.weight", mat(n_vocab, n_embd))]
    kvs = [("general.architecture", _STRING, "llama"), ("general.name", _STRING, "ggml-attn example (random weights)"),
           ("general.file_type", _U32, 1), ("llama.block_count", _U32, n_layer), ("llama.context_length", _U32, 4096),
           ("llama.embedding_length", _U32, n_embd), ("llama.feed_forward_length", _U32, n_ff),
           ("llama.attention.head_count", _U32, n_head), ("llama.attention.head_count_kv", _U32, n_head_kv),
           ("llama.rope.dimension_count", _U32, hd), ("llama.rope.freq_base", _F32, 10000.0),
           ("llama.attention.layer_norm_rms_epsilon", _F32, 1e-5), ("llama.vocab_size", _U32, n_vocab)]
    out = [b"GGUF", struct.pack("<IQQ", 3, len(tensors), len(kvs))]
    for key, vt, val in kvs:
        out.append(_str(key) + struct.pack("<I", vt) +
                   (_str(val) if vt == _STRING else struct.pack("<I" if vt == _U32 else "<f", val)))
    offset = 0
    for name, a in tensors:
        ne = a.shape[::-1]
        gtype = 1 if a.dtype == np.float16 else 0   # GGML_TYPE_F16 / F32
        out.append(_str(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne) +
                   struct.pack("<IQ", gtype, offset))
        offset += -(-a.nbytes // _ALIGN) * _ALIGN
    head = b"".join(out)
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(head + b"\0" * (-len(head) % _ALIGN))
        for _, a in tensors:
            f.write(np.ascontiguousarray(a).tobytes())
            f.write(b"\0" * (-a.nbytes % _ALIGN))
    os.replace(tmp, path)
    return path
