"""Model shapes for the benchmarks: presets of real families, or a ``.gguf`` header.

Only the shapes matter (no weights are loaded): the attention layers need n_layer,
n_head, n_head_kv, head_dim_k; ``--layer full`` also needs n_embd and n_ff for the
projection and FFN matmuls, which run with random weights.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace

import numpy as np

from ggml_attn.graph.gguf_file import StringArray
from ggml_attn.graph.model import PER_LAYER_KEYS, ModelError, gguf_field, has_swa_layers, show_value

from .errors import UserError
from .text import printable


@dataclass(frozen=True)
class ModelShape:
    name: str
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    n_embd: int
    n_ff: int
    n_ctx_train: int = 0          # 0: unknown (no context limit checked)
    n_vocab: int = 0              # 0: unknown (not counted in params)
    head_dim_v: int = 0           # 0: same as head_dim_k (resolved at construction)
    logit_softcap: float = 0.0    # attention logit soft-capping (gemma-2)
    pos_limit: int = 0            # gemma-2's sliding window: positions from it on are refused (0: none)
    source: str = "preset"        # "preset" or the .gguf path
    file_bytes: int = 0           # a .gguf's tensor bytes and parameters (its own weights, --layer model)
    file_params: int = 0
    file_type: str = ""           # the matrices' ggml types, most bytes first ("F16", "Q4_K+Q6_K")
    arch: str = "llama"           # general.architecture (a preset: its family's)
    type_label: str = "?B"        # llama.cpp's model type of the shape ("8B"; "?B": none it names)
    ftype_name: str = "F16"       # llama.cpp's file type name ("Q4_K - Medium"; a preset's weights are F16)

    def __post_init__(self):
        if not self.head_dim_v:
            object.__setattr__(self, "head_dim_v", self.head_dim_k)   # (frozen)

    @property
    def desc(self) -> str:
        """llama.cpp's ``llama_model_desc``, llama-bench's model column: ``llama 8B Q4_K - Medium``."""
        return f"{self.arch} {self.type_label} {self.ftype_name}"

    @property
    def is_file(self) -> bool:
        """A model file (read as GGUF by its magic bytes, whatever its name), not a preset."""
        return self.source != "preset"

    @property
    def gqa(self) -> int:
        return self.n_head // self.n_head_kv

    @property
    def n_embd_q(self) -> int:
        return self.n_head * self.head_dim_k

    @property
    def n_embd_k(self) -> int:
        return self.n_head_kv * self.head_dim_k

    @property
    def n_embd_v(self) -> int:
        return self.n_head_kv * self.head_dim_v

    def layer_params(self) -> int:
        """Weights of one block: Q, K, V, O projections and a gated FFN (gate, up, down)."""
        attn = self.n_embd * (self.n_embd_q + self.n_embd_k + self.n_embd_v) + self.n_head * self.head_dim_v * self.n_embd
        ffn = 3 * self.n_embd * self.n_ff
        return attn + ffn

    @property
    def n_params(self) -> int:
        """Parameters of the blocks plus token embedding and output head (when n_vocab is known)."""
        return self.n_layer * self.layer_params() + 2 * self.n_vocab * self.n_embd

    @property
    def size_bytes(self) -> int:
        """Bytes of the weights at F16 (the benchmarks use F16 weights and K/V)."""
        return 2 * self.n_params

    def kv_bytes_per_token(self, type_k: str = "f16", type_v: str = "f16") -> int:
        """K and V bytes per cached token over all layers, K and V of the cache types named
        (``-ctk``/``-ctv``: ggml's row sizes, blocks included)."""
        from ggml_attn.graph.kv_graph import ggml_type_of
        from ggml_attn.quant import type_info
        row = type_info(ggml_type_of(type_k)).row_bytes(self.n_embd_k) + \
            type_info(ggml_type_of(type_v)).row_bytes(self.n_embd_v)
        return self.n_layer * row

    def describe(self) -> str:
        gq = f", gqa {self.gqa}" if self.gqa > 1 else ""
        return (f"{self.name}: {self.n_layer} layers, {self.n_head} heads / {self.n_head_kv} kv heads"
                f"{gq}, head_dim_k {self.head_dim_k}, n_embd {self.n_embd}, n_ff {self.n_ff}")


def type_label(arch: str, n_layer: int, n_embd: int, n_head: int, n_head_kv: int, n_vocab: int,
               n_expert: int = 0) -> str:
    """llama.cpp's model type name (``llm_type_name``) of a shape, as its loader picks it for the
    architectures this project runs (``src/models/<arch>.cpp``, by layer count and a few other
    hparams); ``?B`` where llama.cpp names none (its LLM_TYPE_UNKNOWN)."""
    if arch == "llama" and n_expert == 8:
        table = {32: "8x7B", 56: "8x22B"}
    elif arch == "llama":
        table = {16: "1B", 22: "1B", 26: "3B", 28: "3B", 30: "256M", 36: "8B", 40: "13B", 48: "34B", 60: "30B",
                 32: "3B" if n_vocab == 49152 else ("7B" if n_vocab < 40000 else "8B"),
                 80: "65B" if n_head == n_head_kv else "70B"}
    elif arch == "qwen2":
        table = {24: "0.5B" if n_embd == 1024 else "1B", 28: "1.5B" if n_embd == 1536 else "7B", 32: "7B",
                 36: "3B", 40: "4B" if n_head == 20 else "13B", 48: "14B", 64: "32B", 80: "70B"}
    elif arch == "qwen3":
        table = {28: "0.6B" if n_embd == 1024 else "1.7B", 36: "4B" if n_embd == 2560 else "8B", 40: "14B",
                 64: "32B"}
    elif arch == "gemma":
        table = {18: "2B", 28: "7B"}
    elif arch == "gemma2":
        table = {26: "2B", 42: "9B", 46: "27B"}
    else:
        table = {}
    return table.get(n_layer, "?B")


# llama.cpp's file type names (llama_ftype_name) by general.file_type (enum llama_ftype)
FTYPE_NAMES = {
    0: "all F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K - Medium",
    11: "Q3_K - Small", 12: "Q3_K - Medium", 13: "Q3_K - Large", 14: "Q4_K - Small", 15: "Q4_K - Medium",
    16: "Q5_K - Small", 17: "Q5_K - Medium", 18: "Q6_K", 19: "IQ2_XXS - 2.0625 bpw", 20: "IQ2_XS - 2.3125 bpw",
    21: "Q2_K - Small", 22: "IQ3_XS - 3.3 bpw", 23: "IQ3_XXS - 3.0625 bpw", 24: "IQ1_S - 1.5625 bpw",
    25: "IQ4_NL - 4.5 bpw", 26: "IQ3_S - 3.4375 bpw", 27: "IQ3_S mix - 3.66 bpw", 28: "IQ2_S - 2.5 bpw",
    29: "IQ2_M - 2.7 bpw", 30: "IQ4_XS - 4.25 bpw", 31: "IQ1_M - 1.75 bpw", 32: "BF16",
    36: "TQ1_0 - 1.69 bpw ternary", 37: "TQ2_0 - 2.06 bpw ternary", 38: "MXFP4 MoE", 39: "NVFP4", 40: "Q1_0",
    41: "Q2_0",
}
# the file type llama.cpp guesses from the tensors' most common ggml type (no general.file_type)
_FTYPE_OF_TYPE = {"F32": 0, "F16": 1, "BF16": 32, "Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q5_1": 9, "Q8_0": 7,
                  "Q2_K": 10, "Q3_K": 12, "Q4_K": 15, "Q5_K": 17, "Q6_K": 18, "TQ1_0": 36, "TQ2_0": 37,
                  "IQ2_XXS": 19, "IQ2_XS": 20, "IQ2_S": 28, "IQ3_XXS": 23, "IQ1_S": 24, "IQ1_M": 31,
                  "IQ4_NL": 25, "IQ4_XS": 30, "IQ3_S": 26, "NVFP4": 39, "Q1_0": 40, "Q2_0": 41}


def ftype_name(file_type, tensors) -> str:
    """llama.cpp's file type name of a model: its ``general.file_type`` (``file_type``, None when
    absent) or, as llama.cpp's loader guesses it, the ggml type most tensors have (the first
    by tensor name to reach that count), marked ``(guessed)``."""
    if isinstance(file_type, (int, np.integer)) and not isinstance(file_type, bool):
        return FTYPE_NAMES.get(int(file_type), "unknown, may not work")
    counts: dict[str, int] = {}
    best, top = "F32", 0
    for t in sorted(tensors, key=lambda t: t.name):
        counts[t.type_name] = counts.get(t.type_name, 0) + 1
        if counts[t.type_name] > top:
            best, top = t.type_name, counts[t.type_name]
    return "(guessed) " + FTYPE_NAMES[_FTYPE_OF_TYPE.get(best, 0)]


def _preset(name: str, arch: str, *args, **kw) -> ModelShape:
    m = ModelShape(name, *args, arch=arch, **kw)
    return replace(m, type_label=type_label(arch, m.n_layer, m.n_embd, m.n_head, m.n_head_kv, m.n_vocab))


# Shapes from the published configs of each family (the model column names the family's
# architecture and llama.cpp's type of the shape; the weights, with --layer full, are F16)
PRESETS: dict[str, ModelShape] = {m.name: m for m in [
    # small and fast on a CPU: the default when no GPU is used
    _preset("tiny", "llama", n_layer=2, n_head=8, n_head_kv=2, head_dim_k=64, n_embd=512, n_ff=1408,
            n_ctx_train=8192),
    _preset("llama-3.2-1b", "llama", 16, 32, 8, 64, 2048, 8192, 131072, 128256),
    _preset("llama-3-8b", "llama", 32, 32, 8, 128, 4096, 14336, 8192, 128256),
    _preset("llama-3-70b", "llama", 80, 64, 8, 128, 8192, 28672, 8192, 128256),
    _preset("mistral-7b", "llama", 32, 32, 8, 128, 4096, 14336, 32768, 32768),
    _preset("qwen2.5-0.5b", "qwen2", 24, 14, 2, 64, 896, 4864, 32768, 151936),
    _preset("qwen2.5-7b", "qwen2", 28, 28, 4, 128, 3584, 18944, 32768, 152064),
    _preset("gemma-7b", "gemma", 28, 16, 16, 256, 3072, 24576, 8192, 256000),
    _preset("gemma-2-9b", "gemma2", 42, 16, 8, 256, 3584, 14336, 8192, 256000, logit_softcap=50.0, pos_limit=4096),
]}

DEFAULT_CPU_MODEL = "tiny"
DEFAULT_GPU_MODEL = "llama-3-8b"


def check_model_file(path: str, n_layer: int) -> None:
    """UserError when the .gguf at ``path`` cannot run as a model (``--layer model``) of
    ``n_layer`` layers: the layer count differs from the file's (--n-layer), or graph/model.py's
    loader refuses it (an architecture, tensor or value it does not take). Checked before a tool
    prints anything; a file that loads is remembered."""
    own = resolve(path).n_layer
    if n_layer != own:
        raise UserError(f"--layer model runs the file's {own} layers; --n-layer {n_layer} cannot change the "
                        f"layer count of a real model")
    if path not in _LOADABLE:
        from ggml_attn.graph.model import ModelError, load_gguf
        try:
            load_gguf(path)
        except ModelError as e:
            raise UserError(str(e)) from e
        _LOADABLE.add(path)


_LOADABLE: set[str] = set()


def resolve(name_or_path: str) -> ModelShape:
    """A preset name or a ``.gguf`` path -> ModelShape; UserError if neither."""
    key = name_or_path.strip()
    if key.lower() in PRESETS:
        return PRESETS[key.lower()]
    # a path: a .gguf name, anything that exists, or a name with a folder in it (no preset has one)
    if key.lower().endswith(".gguf") or os.path.exists(key) or os.sep in key or (os.altsep or os.sep) in key:
        if not os.path.exists(key):
            raise UserError(f"model file not found: {key}")
        if not os.path.isfile(key):
            what = "a directory" if os.path.isdir(key) else "not a regular file"
            raise UserError(f"model file {key} is {what}")
        return read_gguf(key)
    raise UserError(f"unknown model '{key}' (presets: {', '.join(PRESETS)}; or a .gguf path)")


# llama.cpp reads these hparams as uint32; a shape value outside 1..U32_MAX is no model's
U32_MAX = 2**32 - 1


def _as_int(value, where: str):
    """A shape value from the header -> int in 1..U32_MAX, or UserError naming ``where``.
    Per-layer arrays (e.g. head_count_kv) give their largest value, each entry checked."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        vals = [_as_int(v, where) for v in value]
        return max(vals) if vals else None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise UserError(f"{where} is {value!r} ({type(value).__name__}); expected a positive integer")
    value = int(value)
    if not 1 <= value <= U32_MAX:
        raise UserError(f"{where} is {value}; expected 1..{U32_MAX}")
    return value


def read_gguf(path: str) -> ModelShape:
    """Attention shapes from a GGUF header (llama.cpp's key names); no tensor data is read."""
    from ggml_attn.graph.gguf_file import GGUFError, read_header
    try:
        reader = read_header(path)
    except (GGUFError, OSError) as e:
        raise UserError(f"cannot read gguf '{path}': {e}") from e
    arch = gguf_field(reader, "general.architecture")
    if arch is None:
        raise UserError(f"'{path}' has no general.architecture key")
    if not isinstance(arch, str) or not arch:
        raise UserError(f"'{path}': general.architecture is {show_value(arch)}; expected an architecture's name")

    def get(key, required=True):
        v = gguf_field(reader, f"{arch}.{key}")
        if isinstance(v, (list, tuple, StringArray)) and key not in PER_LAYER_KEYS:
            raise UserError(f"'{path}': {arch}.{key} is {show_value(v)}; expected one number")
        v = _as_int(v, f"'{path}': {arch}.{key}")
        if v is None and required:
            raise UserError(f"'{path}' lacks {arch}.{key}")
        return v

    n_layer = get("block_count")
    n_embd = get("embedding_length")
    n_head = get("attention.head_count")
    n_head_kv = get("attention.head_count_kv", required=False) or n_head
    head_dim_k = get("attention.key_length", required=False) or (n_embd // n_head)
    head_dim_v = get("attention.value_length", required=False) or 0
    n_ff = get("feed_forward_length", required=False) or 4 * n_embd
    n_ctx = get("context_length", required=False) or 0
    n_vocab = get("vocab_size", required=False)
    if n_vocab is None:
        toks = gguf_field(reader, "tokenizer.ggml.tokens")
        if toks is not None and not isinstance(toks, (list, tuple, StringArray)):
            raise UserError(f"'{path}': tokenizer.ggml.tokens is {show_value(toks)}; expected an array of strings")
        n_vocab = len(toks) if toks is not None else 0
    softcap = gguf_field(reader, f"{arch}.attn_logit_softcapping")
    pos_limit = 0
    if arch == "gemma2":   # llama.cpp's defaults where a key is absent: soft-cap 50, window 4096
        softcap = 50.0 if softcap is None else softcap
        try:
            swa = has_swa_layers(gguf_field(reader, f"{arch}.attention.sliding_window_pattern"), n_layer, path, arch)
        except ModelError as e:
            raise UserError(str(e)) from e
        if swa:
            pos_limit = get("attention.sliding_window", required=False) or 4096
    if softcap is not None and (isinstance(softcap, (bool, str, list, tuple))
                                or not np.isfinite(float(softcap)) or float(softcap) < 0):
        raise UserError(f"'{path}': {arch}.attn_logit_softcapping is {softcap!r}; expected a number >= 0")
    name = gguf_field(reader, "general.name")
    if not isinstance(name, str) or not name:   # (a number or an array there: the file's name instead)
        name = os.path.splitext(os.path.basename(path))[0]
    name = printable(name)   # display text: a newline would break table rows, an ESC or BEL reach the terminal
    by_type: dict[str, int] = {}
    for t in reader.tensors:
        if len(t.ne) > 1:
            by_type[t.type_name] = by_type.get(t.type_name, 0) + t.nbytes
    file_bytes = sum(t.nbytes for t in reader.tensors)
    file_params = sum(t.n_elements for t in reader.tensors)
    if head_dim_k < 1:
        raise UserError(f"'{path}': head_dim_k = embedding_length {n_embd} // head_count {n_head} is 0; "
                        f"set {arch}.attention.key_length")
    if n_head % n_head_kv:
        raise UserError(f"'{path}': head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
    n_expert = gguf_field(reader, f"{arch}.expert_count")
    n_expert = int(n_expert) if isinstance(n_expert, (int, np.integer)) and not isinstance(n_expert, bool) else 0
    return ModelShape(str(name), n_layer, n_head, n_head_kv, head_dim_k, n_embd, n_ff, n_ctx,
                      n_vocab, head_dim_v if head_dim_v != head_dim_k else 0,
                      float(softcap or 0.0), pos_limit=pos_limit, source=path, file_bytes=file_bytes,
                      file_params=file_params,
                      file_type="+".join(sorted(by_type, key=lambda k: -by_type[k])),
                      arch=printable(str(arch)),
                      type_label=type_label(str(arch), n_layer, n_embd, n_head, n_head_kv, n_vocab, n_expert),
                      ftype_name=ftype_name(gguf_field(reader, "general.file_type"), reader.tensors))


def resolve_run_model(name: str, device: str, n_layer: int | None) -> ModelShape:
    """``-m`` of a tool that runs one model: ``auto`` is the device's default preset; ``--n-layer``
    applied (:func:`with_layers`)."""
    if name == "auto":
        name = DEFAULT_GPU_MODEL if device == "cuda" else DEFAULT_CPU_MODEL
    return with_layers(resolve(name), n_layer)


def default_layer(model: ModelShape) -> str:
    """``--layer``'s default (llama-bench's meaning of ``-m FILE``): a model file its own weights
    (``model``), a preset attention only (``attn``)."""
    return "model" if model.is_file else "attn"


def synthetic_layer_note(model: ModelShape, layer: str) -> str | None:
    """What to say once on stderr when ``layer`` (``attn`` / ``full``: layers of random weights)
    stands in for a file of another architecture than llama: those layers are llama's (RMS
    norms, RoPE, attention, a SwiGLU FFN) with the file's shapes and soft-cap, not the file's own
    layer. None for ``model``, a preset, or a llama file."""
    if layer not in ("attn", "full") or not model.is_file or model.arch == "llama":
        return None
    return (f"--layer {layer} times llama-shaped layers with the {model.arch} file's heads, head sizes, FFN "
            f"width and soft-cap, not a {model.arch} layer itself (--layer model runs the file's own)")


def say_synthetic_layers(prog: str, pairs) -> None:
    """:func:`synthetic_layer_note` of each distinct (model, layer) of ``pairs``, once, on stderr."""
    for note in dict.fromkeys(synthetic_layer_note(m, layer) for m, layer in pairs):
        if note:
            print(f"{prog}: note: {note}", file=sys.stderr, flush=True)


def with_layers(model: ModelShape, n_layer: int | None) -> ModelShape:
    """The same shape with a different number of layers (``--n-layer`` override; 0 or None:
    the model's own)."""
    if n_layer is not None and n_layer < 0:
        raise UserError(f"--n-layer must be at least 1 (0: the model's own), got {n_layer}")
    return model if not n_layer else replace(model, n_layer=n_layer)
