"""Deterministic writer of small random-weight GGUF models (test fixtures).

The files are what llama.cpp's converters would write for a tiny model:
llama / qwen2 / qwen3 / gemma / gemma2 architecture, the usual tensor names and metadata keys, and a
dummy SentencePiece ("llama") tokenizer that llama.cpp loads.  Weights are
random but deterministic (numpy ``default_rng(spec.seed)``); quantized types
are produced with ggml's own ``ggml_quantize_chunk`` (ggml-python), so the
bytes only depend on numpy, ggml-python and gguf-py versions.  The pinned
project venv (numpy, ggml-python 0.0.45 / ggml 0.15.3, gguf 0.19) regenerates
the files byte-identically to ``tests/data/llamacpp_ref/MANIFEST.json``.

All fixtures of one family share a seed, so ``llama-f32``, ``llama-f16``,
``llama-q4_k`` ... hold the same underlying float weights, only stored in a
different type; ``llama-f32-ropefreqs`` is ``llama-f32`` plus a
``rope_freqs.weight`` tensor.

Notes on llama.cpp behaviour (checked in llama-cpp-python 0.3.36's vendored
llama.cpp, src/llama-arch.cpp, src/models/*.cpp, conversion/__init__.py):

* ``llama``: RoPE type NORM (adjacent pairs rotated, GPT-J style).  Q/K rows
  are *not* permuted here (random weights; llama.cpp and the project's loader
  read the same file).  ``rope_freqs.weight`` (LLM_TENSOR_ROPE_FREQS, shape
  [head_dim_k/2], F32) is loaded by the llama arch when present (one tensor
  shared by all layers) and passed as ``freq_factors`` to ``ggml_rope_ext``:
  the rotation angle of pair i is ``pos * base**(-2i/head_dim_k) / rope_freqs[i]``.
  ``llama-f32-ropefreqs`` is ``llama-f32`` (same weights, same rope base) plus that
  tensor, so any difference between their logits comes from rope_freqs alone.
* ``qwen2``: RoPE type NEOX (halves rotated); Q/K/V have biases; no
  ``output.weight`` here, so the head is tied to ``token_embd.weight``.
* ``mistral``: llama.cpp has NO plain "mistral" architecture (only
  "mistral3" / "mistral4", i.e. Ministral-3 / Mistral-4 with their own
  YaRN/temperature keys).  ``MistralForCausalLM`` checkpoints are converted to
  ``general.architecture = "llama"`` (conversion/__init__.py maps
  "MistralForCausalLM": "llama").  So ``mistral-f16`` is a llama-arch file with
  Mistral-like metadata: general.name "Mistral-like", rope base 1e6, GQA 4
  (8 heads / 2 kv heads), head_dim_k 128.
* ``qwen3``: RoPE NEOX, no biases, ``attn_q_norm`` / ``attn_k_norm`` ([head_dim_k])
  per layer; the fixture's head size (``attention.key_length`` 128) is not
  n_embd / n_head (64), as in Qwen3-0.6B.
* ``gemma`` / ``gemma2``: RoPE NEOX, the head always tied to ``token_embd``
  (llama.cpp refuses an ``output.weight``), D 256 (gemma) / 128 (gemma2);
  gemma2 adds ``post_attention_norm`` / ``post_ffw_norm`` and the soft-cap keys
  (here 8 and 30: small enough for the attention cap to change the logits) and
  ``attention.sliding_window`` 4096 (past the fixtures' 512-token context).
  Tensors of these families are drawn after each layer's FFN, so the other
  families' files stay byte-identical.

Usage:
    python tests/fixtures_gguf.py OUTDIR [--only NAME ...]
    python tests/fixtures_gguf.py OUT.gguf --preset llama-3-8b [--n-layer N] [--vocab 32000]
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import hashlib
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

import gguf

__all__ = ["Spec", "SPECS", "WTYPES", "write_model", "fixture_path", "sha256",
           "expected_tensors", "write_preset"]


@dataclass(frozen=True)
class Spec:
    name: str
    arch: str            # "llama" or "qwen2" (general.architecture)
    wtype: str           # "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q6_K"; "Q4_K_M": llama-quantize's mix
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    rope_base: float
    rms_eps: float
    tied_output: bool    # True: no output.weight (head uses token_embd.weight)
    rope_freqs: bool     # True: rope_freqs.weight present
    seed: int
    n_ctx: int = 512
    model_name: str = ""  # general.name ("" -> name)
    qkv_bias: bool = False
    key_length: int = 0   # head size when not n_embd / n_head ({arch}.attention.key_length / value_length)
    attn_softcap: float = 0.0    # gemma2: {arch}.attn_logit_softcapping
    final_softcap: float = 0.0   # gemma2: {arch}.final_logit_softcapping
    sliding_window: int = 0      # gemma2: {arch}.attention.sliding_window

    @property
    def head_dim_k(self) -> int:
        return self.key_length or self.n_embd // self.n_head

    @property
    def qk_norm(self) -> bool:      # attn_q_norm / attn_k_norm [head_dim_k] per layer
        return self.arch == "qwen3"

    @property
    def post_norms(self) -> bool:   # post_attention_norm / post_ffw_norm [n_embd] per layer
        return self.arch == "gemma2"


# weight type name -> (gguf tensor type, general.file_type)
WTYPES = {
    "F32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "F16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "BF16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "Q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "Q4_0": (gguf.GGMLQuantizationType.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
    "Q4_K": (gguf.GGMLQuantizationType.Q4_K, gguf.LlamaFileType.MOSTLY_Q4_K_S),
    "Q6_K": (gguf.GGMLQuantizationType.Q6_K, gguf.LlamaFileType.MOSTLY_Q6_K),
    "Q4_K_M": (gguf.GGMLQuantizationType.Q4_K, gguf.LlamaFileType.MOSTLY_Q4_K_M),   # a mix: tensor_wtype
}

_LLAMA = dict(arch="llama", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512,
              n_vocab=256, rope_base=10000.0, rms_eps=1e-5, tied_output=False,
              rope_freqs=False, seed=22)


QWEN3_SEED, GEMMA_SEED, GEMMA2_SEED = 42, 25, 29   # (of 59 / 59 / 119 tried, as the others)


# Seeds: chosen (out of 100 / 120 / 30 tried) for the largest smallest top1-top2 logit gap
# over the reference's greedy steps (tests/data/make_llamacpp_reference.py), taken over all
# the weight types of a family, so greedy decoding is robust to small numerical noise.
def _specs() -> dict[str, Spec]:
    out: dict[str, Spec] = {}
    for wt in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q6_K"):
        name = f"llama-{wt.lower()}"
        out[name] = Spec(name=name, wtype=wt, model_name="Llama-like random", **_LLAMA)
    # the layout of llama.cpp users' most common file: Q4_K matrices, attn_v / ffn_down Q6_K in the
    # layers llama-quantize gives more bits (here layer 1 of 2), the output Q6_K
    # (a seed of its own, of 40 tried: with the family's, greedy steps come within 0.02 logits of a tie)
    out["llama-q4_k_m"] = Spec(name="llama-q4_k_m", wtype="Q4_K_M", model_name="Llama-like random",
                               **{**_LLAMA, "seed": 17})
    out["llama-f32-ropefreqs"] = Spec(name="llama-f32-ropefreqs", wtype="F32",
                                      model_name="Llama-3.1-like random",
                                      **{**_LLAMA, "rope_freqs": True})
    for wt in ("F32", "Q8_0"):
        name = f"qwen2-{wt.lower()}"
        out[name] = Spec(name=name, arch="qwen2", wtype=wt, n_layer=2, n_embd=256, n_head=4,
                         n_head_kv=2, n_ff=512, n_vocab=256, rope_base=1000000.0, rms_eps=1e-6,
                         tied_output=True, rope_freqs=False, seed=29,
                         model_name="Qwen2-like random", qkv_bias=True)
    out["qwen3-f32"] = Spec(name="qwen3-f32", arch="qwen3", wtype="F32", n_layer=2, n_embd=256, n_head=4,
                            n_head_kv=2, n_ff=512, n_vocab=256, rope_base=1000000.0, rms_eps=1e-6,
                            tied_output=False, rope_freqs=False, seed=QWEN3_SEED, key_length=128,
                            model_name="Qwen3-like random")
    for wt in ("F32", "Q8_0"):
        out[f"gemma-{wt.lower()}"] = Spec(name=f"gemma-{wt.lower()}", arch="gemma", wtype=wt, n_layer=2, n_embd=256,
                                          n_head=2, n_head_kv=1, n_ff=512, n_vocab=256, rope_base=10000.0,
                                          rms_eps=1e-6, tied_output=True, rope_freqs=False, seed=GEMMA_SEED,
                                          key_length=256, model_name="Gemma-like random")
    out["gemma2-f32"] = Spec(name="gemma2-f32", arch="gemma2", wtype="F32", n_layer=2, n_embd=256, n_head=4,
                             n_head_kv=2, n_ff=512, n_vocab=256, rope_base=10000.0, rms_eps=1e-6,
                             tied_output=True, rope_freqs=False, seed=GEMMA2_SEED, key_length=128,
                             attn_softcap=8.0, final_softcap=30.0, sliding_window=4096,
                             model_name="Gemma2-like random")
    out["mistral-f16"] = Spec(name="mistral-f16", arch="llama", wtype="F16", n_layer=2,
                              n_embd=1024, n_head=8, n_head_kv=2, n_ff=1024, n_vocab=256,
                              rope_base=1000000.0, rms_eps=1e-5, tied_output=False,
                              rope_freqs=False, seed=16, model_name="Mistral-like random")
    return out


SPECS: dict[str, Spec] = _specs()


# --------------------------------------------------------------------------------------
# weights

def rope_freqs_values(head_dim_k: int) -> np.ndarray:
    """Llama-3.1-like frequency divisors: a geometric ramp from 1 (highest frequency) to 8."""
    return np.geomspace(1.0, 8.0, head_dim_k // 2).astype(np.float32)


def _weights(spec: Spec) -> list[tuple[str, np.ndarray, bool]]:
    """[(name, float32 array in numpy order, is_matrix)] in file order.

    Scales: activations stay O(1) through the block (1/sqrt(n_in) weights),
    attention scores O(1), norm weights in [0.8, 1.2], output-head rows with a
    log-normal norm spread so the logits are heavy-tailed (clear top-1).
    """
    rng = np.random.default_rng(spec.seed)
    E, F, V, hd = spec.n_embd, spec.n_ff, spec.n_vocab, spec.head_dim_k
    nq, nkv = spec.n_head * hd, spec.n_head_kv * hd

    def mat(n_out, n_in, gain=1.0):
        return (rng.standard_normal((n_out, n_in), dtype=np.float32)
                * np.float32(gain / np.sqrt(n_in)))

    def normw(n):
        return rng.uniform(0.8, 1.2, n).astype(np.float32)

    def bias(n, scale):
        return (rng.standard_normal(n, dtype=np.float32) * np.float32(scale))

    ws: list[tuple[str, np.ndarray, bool]] = []
    ws.append(("token_embd.weight", rng.standard_normal((V, E), dtype=np.float32), True))
    if spec.rope_freqs:
        ws.append(("rope_freqs.weight", rope_freqs_values(hd), False))
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        ws.append((p + "attn_norm.weight", normw(E), False))
        ws.append((p + "attn_q.weight", mat(nq, E, 1.5), True))
        ws.append((p + "attn_k.weight", mat(nkv, E, 1.5), True))
        ws.append((p + "attn_v.weight", mat(nkv, E), True))
        if spec.qkv_bias:
            ws.append((p + "attn_q.bias", bias(nq, 0.5), False))
            ws.append((p + "attn_k.bias", bias(nkv, 0.5), False))
            # a large V bias is a constant residual direction that favours a few tokens
            ws.append((p + "attn_v.bias", bias(nkv, 0.1), False))
        ws.append((p + "attn_output.weight", mat(E, nq), True))
        ws.append((p + "ffn_norm.weight", normw(E), False))
        ws.append((p + "ffn_gate.weight", mat(F, E), True))
        ws.append((p + "ffn_up.weight", mat(F, E), True))
        ws.append((p + "ffn_down.weight", mat(E, F), True))
        if spec.qk_norm:
            ws.append((p + "attn_q_norm.weight", normw(hd), False))
            ws.append((p + "attn_k_norm.weight", normw(hd), False))
        if spec.post_norms:
            ws.append((p + "post_attention_norm.weight", normw(E), False))
            ws.append((p + "post_ffw_norm.weight", normw(E), False))
    ws.append(("output_norm.weight", normw(E), False))
    if not spec.tied_output:
        rows = np.exp(rng.standard_normal((V, 1), dtype=np.float32) * np.float32(0.5))
        ws.append(("output.weight", mat(V, E, 4.0) * rows, True))
    else:
        # tied head: token_embd is also the head.  Small embeddings (0.01) so that a
        # token's own embedding, left in the residual, does not pull the head towards
        # that token (greedy decoding would just repeat it); only a mild row-norm spread
        # (heavy-norm rows also become fixed points); a large output_norm (x30, trained
        # Qwen2 checkpoints have large ones too) gives the logits their spread back.
        rows = np.exp(rng.standard_normal((V, 1), dtype=np.float32) * np.float32(0.2))
        emb = ws[0][1]
        ws[0] = ("token_embd.weight", emb * (rows * np.float32(0.01)), True)
        ws[-1] = ("output_norm.weight", ws[-1][1] * np.float32(30.0), False)
    return ws


def _ggml():
    import ggml  # ggml-python; only needed for BF16 and quantized types
    return ggml


_GGML_TYPE = {"BF16": "GGML_TYPE_BF16", "Q8_0": "GGML_TYPE_Q8_0", "Q4_0": "GGML_TYPE_Q4_0",
              "Q4_K": "GGML_TYPE_Q4_K", "Q5_K": "GGML_TYPE_Q5_K", "Q6_K": "GGML_TYPE_Q6_K"}


def quantize(w: np.ndarray, wtype: str) -> np.ndarray:
    """float32 (rows, cols) -> array for GGUFWriter.add_tensor (uint8 (rows, row_bytes) for
    BF16 / quantized types; float32 / float16 otherwise)."""
    if wtype == "F32":
        return np.ascontiguousarray(w, dtype=np.float32)
    if wtype == "F16":
        return np.ascontiguousarray(w, dtype=np.float16)
    ggml = _ggml()
    t = getattr(ggml, _GGML_TYPE[wtype])
    rows, cols = w.shape
    src = np.ascontiguousarray(w, dtype=np.float32)
    rs = int(ggml.ggml_row_size(t, cols))
    dst = np.zeros((rows, rs), dtype=np.uint8)
    n = ggml.ggml_quantize_chunk(t, src.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                 dst.ctypes.data_as(ctypes.c_void_p), 0, rows, cols, None)
    assert n == dst.nbytes, (n, dst.nbytes)
    return dst


def tensor_wtype(spec: Spec, name: str) -> str:
    """The type of matrix ``name`` in ``spec``'s file: ``spec.wtype``, or for a mix (Q4_K_M) the
    type llama-quantize gives that tensor (:func:`preset_tensor_type`)."""
    return preset_tensor_type(name, spec.wtype, spec.n_layer) if spec.wtype == "Q4_K_M" else spec.wtype


def expected_tensors(spec: Spec | str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (gguf type name, ggml shape ne = [n_in, n_out] / [n]) as GGUFReader reports."""
    spec = SPECS[spec] if isinstance(spec, str) else spec
    out = {}
    for name, w, is_mat in _shapes(spec):
        tname = tensor_wtype(spec, name) if is_mat else "F32"
        out[name] = (tname, tuple(reversed(w)))
    return out


def _shapes(spec: Spec):
    E, F, V, hd = spec.n_embd, spec.n_ff, spec.n_vocab, spec.head_dim_k
    nq, nkv = spec.n_head * hd, spec.n_head_kv * hd
    yield "token_embd.weight", (V, E), True
    if spec.rope_freqs:
        yield "rope_freqs.weight", (hd // 2,), False
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", (E,), False
        yield p + "attn_q.weight", (nq, E), True
        yield p + "attn_k.weight", (nkv, E), True
        yield p + "attn_v.weight", (nkv, E), True
        if spec.qkv_bias:
            yield p + "attn_q.bias", (nq,), False
            yield p + "attn_k.bias", (nkv,), False
            yield p + "attn_v.bias", (nkv,), False
        yield p + "attn_output.weight", (E, nq), True
        yield p + "ffn_norm.weight", (E,), False
        yield p + "ffn_gate.weight", (F, E), True
        yield p + "ffn_up.weight", (F, E), True
        yield p + "ffn_down.weight", (E, F), True
        if spec.qk_norm:
            yield p + "attn_q_norm.weight", (hd,), False
            yield p + "attn_k_norm.weight", (hd,), False
        if spec.post_norms:
            yield p + "post_attention_norm.weight", (E,), False
            yield p + "post_ffw_norm.weight", (E,), False
    yield "output_norm.weight", (E,), False
    if not spec.tied_output:
        yield "output.weight", (V, E), True


# --------------------------------------------------------------------------------------
# metadata

def _add_metadata(w: gguf.GGUFWriter, spec: Spec, *, file_type=None, quantized: bool | None = None) -> None:
    ftype = WTYPES[spec.wtype][1] if file_type is None else file_type
    w.add_name(spec.model_name or spec.name)
    w.add_context_length(spec.n_ctx)
    w.add_embedding_length(spec.n_embd)
    w.add_block_count(spec.n_layer)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_rope_freq_base(spec.rope_base)
    w.add_rope_dimension_count(spec.head_dim_k)
    if spec.key_length:
        w.add_key_length(spec.key_length)
        w.add_value_length(spec.key_length)
    if spec.attn_softcap:
        w.add_attn_logit_softcapping(spec.attn_softcap)
    if spec.final_softcap:
        w.add_final_logit_softcapping(spec.final_softcap)
    if spec.sliding_window:
        w.add_sliding_window(spec.sliding_window)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    w.add_file_type(int(ftype))
    w.add_vocab_size(spec.n_vocab)
    if spec.wtype not in ("F32", "F16", "BF16") if quantized is None else quantized:
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_tokenizer(w, spec.n_vocab)


def _add_tokenizer(w: gguf.GGUFWriter, n_vocab: int) -> None:
    toks = ["<unk>", "<s>", "</s>"] + [f"<t{i}>" for i in range(3, n_vocab)]
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores([0.0, 0.0, 0.0] + [-float(i) for i in range(3, n_vocab)])
    w.add_token_types([int(gguf.TokenType.UNKNOWN), int(gguf.TokenType.CONTROL),
                       int(gguf.TokenType.CONTROL)] + [int(gguf.TokenType.NORMAL)] * (n_vocab - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)


# --------------------------------------------------------------------------------------
# API

def write_model(spec_or_name: Spec | str, path: str | os.PathLike) -> str:
    """Write the fixture to ``path`` (atomically: temp file + rename). Returns the path."""
    spec = SPECS[spec_or_name] if isinstance(spec_or_name, str) else spec_or_name
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    w = gguf.GGUFWriter(tmp, spec.arch)
    _add_metadata(w, spec)
    for name, arr, is_mat in _weights(spec):
        if not is_mat:
            w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
            continue
        tw = tensor_wtype(spec, name)
        q = quantize(arr, tw)
        if q.dtype == np.uint8:
            # raw shape = byte shape (rows, row_bytes); gguf-py derives [n_in, n_out] from it
            w.add_tensor(name, q, raw_dtype=WTYPES[tw][0])
        else:
            w.add_tensor(name, q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


def fixture_path(name: str, dir: str | os.PathLike) -> str:
    """Path of fixture ``name`` in ``dir``, writing it first if it is not there."""
    path = os.path.join(os.fspath(dir), f"{name}.gguf")
    if not os.path.exists(path):
        write_model(name, path)
    return path


def sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------------------
# big benchmark preset (streamed, F16, values tiled from one random pool)

PRESETS = {
    "llama-3-8b": dict(n_embd=4096, n_layer=32, n_head=32, n_head_kv=8, n_ff=14336,
                       rope_base=500000.0, rms_eps=1e-5, n_ctx=8192),
    "llama-3-70b": dict(n_embd=8192, n_layer=80, n_head=64, n_head_kv=8, n_ff=28672,
                        rope_base=500000.0, rms_eps=1e-5, n_ctx=8192),
    "small": dict(n_embd=256, n_layer=9, n_head=4, n_head_kv=2, n_ff=512,   # the tests' copy of the others
                  rope_base=500000.0, rms_eps=1e-5, n_ctx=4096),
}

# File types of write_preset: the type of each matrix, as llama.cpp's llama-quantize picks it
# (src/llama-quant.cpp, llama_tensor_get_type, for these shapes): the _M mixes give attn_v and
# ffn_down Q6_K in the layers use_more_bits selects (the first and last eighth, every third
# between) and the output Q6_K; token_embd stays the base type.
PRESET_FTYPES = {"F16": ("F16", None, None), "Q8_0": ("Q8_0", "Q8_0", None), "Q6_K": ("Q6_K", "Q6_K", None),
                 "Q4_0": ("Q4_0", "Q6_K", None), "Q4_K_M": ("Q4_K", "Q6_K", "Q6_K"),
                 "Q5_K_M": ("Q5_K", "Q6_K", "Q6_K")}   # base, output, the more-bits layers' attn_v / ffn_down
_LLAMA_FTYPES = {"F16": "MOSTLY_F16", "Q8_0": "MOSTLY_Q8_0", "Q6_K": "MOSTLY_Q6_K", "Q4_0": "MOSTLY_Q4_0",
                 "Q4_K_M": "MOSTLY_Q4_K_M", "Q5_K_M": "MOSTLY_Q5_K_M"}


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def preset_tensor_type(name: str, ftype: str, n_layer: int) -> str:
    """The ggml type of matrix ``name`` in a ``ftype`` file (:data:`PRESET_FTYPES`)."""
    base, output, more = PRESET_FTYPES[ftype]
    if name == "output.weight":
        return output or base
    if more and name.endswith(("attn_v.weight", "ffn_down.weight")):
        return more if _use_more_bits(int(name.split(".")[1]), n_layer) else base
    return base


def write_preset(path: str | os.PathLike, preset: str = "llama-3-8b", n_layer: int | None = None,
                 n_vocab: int = 32000, seed: int = 0, verbose: bool = True, ftype: str = "F16") -> str:
    """Write a full-size llama file without holding it in memory: each tensor's data is a
    window of one pool of random F16 values (std 0.02; norms 1.0), written in chunks; with a
    quantized ``ftype`` (:data:`PRESET_FTYPES`) each matrix is a window of whole blocks of a pool
    ggml quantized from such values, in the type llama-quantize would give it (no F16 file first:
    a 70B Q4_K_M file is written directly)."""
    p = dict(PRESETS[preset])
    if n_layer is not None:
        p["n_layer"] = n_layer
    spec = Spec(name=preset, arch="llama", wtype="F16", n_layer=p["n_layer"], n_embd=p["n_embd"],
                n_head=p["n_head"], n_head_kv=p["n_head_kv"], n_ff=p["n_ff"], n_vocab=n_vocab,
                rope_base=p["rope_base"], rms_eps=p["rms_eps"], tied_output=False,
                rope_freqs=False, seed=seed, n_ctx=p["n_ctx"], model_name=f"{preset} random")
    path = os.fspath(path)
    t0 = time.time()
    rng = np.random.default_rng(seed)
    pool_n = 1 << 24  # 16 Mi values, 32 MiB
    pool = (rng.standard_normal(pool_n, dtype=np.float32) * np.float32(0.02)).astype(np.float16)
    pool2 = np.concatenate([pool, pool])  # windows wrap around without copying
    pool_b = memoryview(pool2.view(np.uint8))
    shapes = list(_shapes(spec))
    types = {name: preset_tensor_type(name, ftype, spec.n_layer) for name, _, is_mat in shapes if is_mat}
    qpools = {}
    for t in set(types.values()) - {"F16"}:   # whole blocks of random values, twice (windows wrap)
        q = quantize(pool[: 1 << 20].astype(np.float32).reshape(-1, 4096), t).reshape(-1)
        qpools[t] = (memoryview(np.concatenate([q, q])), q.size)
    w = gguf.GGUFWriter(path, "llama")
    _add_metadata(w, spec, file_type=getattr(gguf.LlamaFileType, _LLAMA_FTYPES[ftype]),
                  quantized=ftype != "F16")
    for name, shape, is_mat in shapes:
        n = int(np.prod(shape))
        if is_mat and types[name] != "F16":
            t = getattr(gguf.GGMLQuantizationType, types[name])
            bs, ts = gguf.GGML_QUANT_SIZES[t]
            rows, cols = shape
            w.add_tensor_info(name, (rows, cols // bs * ts), np.dtype(np.uint8), rows * cols // bs * ts, raw_dtype=t)
        elif is_mat:
            w.add_tensor_info(name, shape, np.dtype(np.float16), n * 2)
        else:
            w.add_tensor_info(name, shape, np.dtype(np.float32), n * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    w.write_padding(fout, fout.tell())
    off = 0
    chunk = pool_n  # values per write
    for k, (name, shape, is_mat) in enumerate(shapes):
        n = int(np.prod(shape))
        if is_mat and types[name] != "F16":
            qb, q_n = qpools[types[name]]
            bs, ts = gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, types[name])]
            nbytes = n // bs * ts
            left, at = nbytes, (7919 * (k + 1) * ts) % q_n   # block-aligned windows of the pool
            while left:
                m = min(left, q_n - q_n % ts, 1 << 26)
                m -= m % ts
                fout.write(qb[at: at + m])
                at = (at + m + 4099 * ts) % q_n
                left -= m
        elif is_mat:
            left = n
            while left:
                m = min(left, chunk)
                s = off % pool_n
                fout.write(pool_b[2 * s: 2 * (s + m)])
                off += 7919 * (k + 1) + m
                left -= m
            nbytes = n * 2
        else:
            np.ones(n, dtype=np.float32).tofile(fout)
            nbytes = n * 4
        w.write_padding(fout, nbytes)
        w.tensors[0].pop(name)
    fout.flush()
    w.close()
    if verbose:
        print(f"{path}: {os.path.getsize(path) / 2**30:.2f} GiB in {time.time() - t0:.1f} s")
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="output directory (fixtures) or OUT.gguf (--preset)")
    ap.add_argument("--only", nargs="+", metavar="NAME", help=f"subset of {sorted(SPECS)}")
    ap.add_argument("--preset", choices=sorted(PRESETS))
    ap.add_argument("--n-layer", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--ftype", choices=sorted(PRESET_FTYPES), default="F16",
                    help="--preset's file type (matrix types as llama-quantize picks them)")
    a = ap.parse_args(argv)
    if a.preset:
        write_preset(a.out, a.preset, n_layer=a.n_layer, n_vocab=a.vocab, ftype=a.ftype)
        return 0
    names = a.only or list(SPECS)
    for n in names:
        if n not in SPECS:
            ap.error(f"unknown fixture {n!r}; known: {sorted(SPECS)}")
    os.makedirs(a.out, exist_ok=True)
    for n in names:
        t0 = time.time()
        p = write_model(n, os.path.join(a.out, f"{n}.gguf"))
        print(f"{p}  {os.path.getsize(p)} bytes  {time.time() - t0:.2f} s  sha256 {sha256(p)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
