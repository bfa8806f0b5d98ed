"""A llama-family model from a GGUF file: hyper-parameters and weights, memory-mapped.

:func:`load_gguf` reads a file as llama.cpp's loader does (``src/llama-model.cpp`` key and
tensor names) for the architectures in :data:`ARCHS`:

* ``llama`` (Mistral-7B-style models too: llama.cpp's converter writes them as ``llama``; it has
  no plain ``mistral`` architecture): RMS norm with a weight, Q/K/V without bias, RoPE in the
  normal (adjacent-pair) layout, SwiGLU FFN;
* ``qwen2``: the same block with Q/K/V biases and RoPE in the NEOX (half-split) layout;
* ``qwen3``: no biases; Q and K RMS-normalized per head (``attn_q_norm`` / ``attn_k_norm``,
  ``[head_dim_k]``) before RoPE (NEOX); the head size may differ from ``n_embd / n_head``;
* ``gemma``: the embedding scaled by ``sqrt(n_embd)``, RoPE NEOX, GeGLU FFN (tanh GELU), the head
  tied to the embedding (a file with ``output.weight`` is refused, as llama.cpp does);
* ``gemma2``: gemma plus RMS norms after the attention and after the FFN (``post_attention_norm``,
  ``post_ffw_norm``), attention logits soft-capped (``attn_logit_softcapping``) and the final
  logits too (``final_logit_softcapping``), the 27B's query scale, and sliding-window layers:
  those run as dense layers, which is exact only while every position stays below the window
  (``attention.sliding_window``; :attr:`HParams.pos_limit` -- later positions are refused).

Weights stay in their file type and in the file (``numpy.memmap``, read-only): a host graph
hands their bytes to ggml's own ``mul_mat`` / ``get_rows``; :meth:`Weight.to_float` dequantizes
through ggml's type traits (what a GPU engine does once at load). Tensors are validated
against the hyper-parameters: a missing tensor, a wrong shape or a type ggml's CPU matmul
cannot run raises :class:`ModelError` naming it.

Shapes: a :class:`Weight` has ggml order ``ne`` (``[n_in, n_out]`` for a matrix); its numpy
shape ``(n_out, n_in)`` is the reverse.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np

from .attn_config import AttnConfig

__all__ = ["ModelError", "Weight", "HParams", "Model", "load_gguf", "gguf_field", "has_swa_layers", "show_value",
           "PER_LAYER_KEYS", "ARCHS", "WEIGHT_TYPES", "ROPE_NORMAL", "ROPE_NEOX"]

ROPE_NORMAL, ROPE_NEOX = 0, 2   # ggml's rope modes (GGML_ROPE_TYPE_NORMAL / _NEOX)


class ModelError(ValueError):
    """A model file this package cannot run: the message names the file and what is missing."""


@dataclass(frozen=True)
class ArchInfo:
    """What an architecture's block does beyond llama's (llama.cpp's ``src/models/<arch>.cpp``)."""

    rope_mode: int              # ROPE_NORMAL or ROPE_NEOX
    qkv_bias: bool = False      # attn_q/k/v carry a bias (required)
    qk_norm: bool = False       # per-head RMS norm of Q and K before RoPE (attn_q_norm / attn_k_norm)
    gemma: bool = False         # embedding * sqrt(n_embd), GeGLU FFN, head tied to the embedding
    post_norms: bool = False    # RMS norms of the attention's and the FFN's outputs (gemma2)
    softcap: bool = False       # attention and final logit soft-capping, sliding-window layers (gemma2)


ARCHS: dict[str, ArchInfo] = {
    "llama": ArchInfo(ROPE_NORMAL),
    "qwen2": ArchInfo(ROPE_NEOX, qkv_bias=True),
    "qwen3": ArchInfo(ROPE_NEOX, qk_norm=True),
    "gemma": ArchInfo(ROPE_NEOX, gemma=True),
    "gemma2": ArchInfo(ROPE_NEOX, gemma=True, post_norms=True, softcap=True),
}

# ggml types whose weights ggml's CPU mul_mat and get_rows take (and which dequantize)
_TYPE_NAMES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
               "Q5_K", "Q6_K", "IQ4_NL")


def _weight_types() -> dict[int, str]:
    import ggml  # noqa: PLC0415
    return {int(getattr(ggml, f"GGML_TYPE_{n}")): n for n in _TYPE_NAMES}


WEIGHT_TYPES: dict[int, str] = _weight_types()

# per-layer tensors: key -> (GGUF name, required); biases only where the architecture has them
_LAYER_TENSORS = {
    "attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight",
    "wo": "attn_output.weight", "ffn_norm": "ffn_norm.weight", "wg": "ffn_gate.weight",
    "wu": "ffn_up.weight", "wd": "ffn_down.weight",
}
_BIAS_TENSORS = {"bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias"}
_QK_NORM_TENSORS = {"q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight"}        # [head_dim_k]
_POST_NORM_TENSORS = {"attn_post_norm": "post_attention_norm.weight", "ffn_post_norm": "post_ffw_norm.weight"}


@dataclass(frozen=True, eq=False)
class Weight:
    """One tensor of the file. ``type``: ggml type id; ``ne``: ggml order, trailing 1s dropped;
    ``data``: its bytes, read-only, rows back to back (``ggml_row_size(type, ne[0])`` bytes each);
    ``offset``: where they start in the file (-1: not from a file)."""

    name: str
    type: int
    ne: tuple[int, ...]
    data: np.ndarray
    offset: int = -1

    @property
    def type_name(self) -> str:
        return WEIGHT_TYPES.get(self.type, str(self.type))

    @property
    def n_rows(self) -> int:
        return int(np.prod(self.ne[1:], dtype=np.int64)) if len(self.ne) > 1 else 1

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def ptr(self) -> int:
        return int(self.data.ctypes.data)

    def to_float(self, dtype=np.float32) -> np.ndarray:
        """All values, numpy order (``ne`` reversed), as ``dtype`` (dequantized by ggml); an F32 or
        F16 weight asked for in its own type is the file's memory, read-only."""
        from ggml_attn.quant import dequantize_rows  # noqa: PLC0415
        from ggml_attn.dtypes import STORAGE_DTYPES  # noqa: PLC0415
        shape = tuple(reversed(self.ne))
        np_dtype = STORAGE_DTYPES.get(self.type)
        if np_dtype is not None and np_dtype is not np.uint16:   # F32 / F16: a view (read-only) when no cast
            return self.data.view(np_dtype).reshape(shape).astype(dtype, copy=False)
        ne0 = self.ne[0]
        out = dequantize_rows(self.ptr, self.type, ne0, self.n_rows, self.nbytes // self.n_rows)
        return out.reshape(shape).astype(dtype, copy=False)


@dataclass(frozen=True)
class HParams:
    """What the graph needs of the model, from the GGUF keys ``{arch}.*`` (llama.cpp's names)."""

    arch: str
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    rope_dim: int          # rotated dimensions per head (rope.dimension_count)
    rope_mode: int         # ROPE_NORMAL or ROPE_NEOX
    rope_freq_scale: float  # 1 / rope.scaling.factor (linear scaling), else 1
    embd_scale: float = 1.0        # the embedding's rows times this (gemma: sqrt(n_embd))
    attn_scale: float | None = None   # the attention's scale (None: 1 / sqrt(head_dim_k))
    attn_softcap: float = 0.0      # attention logits soft-capped at this (0: none)
    final_softcap: float = 0.0     # the output logits soft-capped at this (0: none)
    pos_limit: int = 0             # > 0: positions must stay below it (gemma2's window; 0: no limit)
    ffn_gelu: bool = False         # GeGLU (tanh GELU) instead of SwiGLU

    @property
    def info(self) -> ArchInfo:
        return ARCHS[self.arch]

    @property
    def n_embd_q(self) -> int:
        return self.n_head * self.head_dim_k

    @property
    def n_embd_kv(self) -> int:
        return self.n_head_kv * self.head_dim_k


@dataclass(eq=False)
class Model:
    """A loaded model. ``layers[il]``: dict of :class:`Weight` by key (``attn_norm wq wk wv wo
    ffn_norm wg wu wd``, plus ``bq bk bv`` for qwen2, ``q_norm k_norm`` for qwen3,
    ``attn_post_norm ffn_post_norm`` for gemma2). ``output`` is ``tok_embd`` when the file
    has no ``output.weight`` (tied embeddings). ``rope_freqs``: F32 ``[rope_dim / 2]`` frequency
    factors, or None."""

    path: str
    hp: HParams
    tok_embd: Weight
    output_norm: Weight
    output: Weight
    layers: list[dict[str, Weight]]
    rope_freqs: Weight | None = None
    _map: object = field(default=None, repr=False)   # the file's memory map (the weights' data views it)

    @property
    def tied_output(self) -> bool:
        return self.output is self.tok_embd

    def weights(self):
        """Every distinct weight, once."""
        seen = {}
        for w in [self.tok_embd, self.output_norm, self.output, self.rope_freqs,
                  *(w for lw in self.layers for w in lw.values())]:
            if w is not None:
                seen[id(w)] = w
        return list(seen.values())

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.weights())

    @property
    def n_params(self) -> int:
        return sum(int(np.prod(w.ne, dtype=np.int64)) for w in self.weights())

    def attn_config(self) -> AttnConfig:
        hp = self.hp
        return AttnConfig(n_layer=hp.n_layer, n_head=hp.n_head, n_head_kv=hp.n_head_kv, head_dim_k=hp.head_dim_k,
                          logit_softcap=hp.attn_softcap, scale_override=hp.attn_scale, pos_limit=hp.pos_limit)

    def device_weights(self, xp=np):
        """The weights as all-custom (device-resident) graphs read them
        (``model_device.DeviceWeights``: F16 matrices of ``xp`` with the RMS-norm weights folded
        in, block matrices in their blocks or as F16: ``model_device.keep_blocks``), built on the
        first call per array module, device and ``model_device.WEIGHTS`` and kept on the model."""
        from . import model_device  # noqa: PLC0415
        key = (xp.__name__, model_device.WEIGHTS)   # (the form setting: another one builds again)
        if xp is not np:
            key += (int(xp.cuda.Device().id),)
        cache = self.__dict__.setdefault("_device_weights", {})
        dw = cache.get(key)
        if dw is None:
            dw = cache[key] = model_device.DeviceWeights.from_model(self, xp)
        return dw

    def type_summary(self) -> str:
        """The matrices' types, most common first (``"Q4_K"``, ``"Q4_K+Q6_K"``...)."""
        count: dict[str, int] = {}
        for w in self.weights():
            if len(w.ne) > 1:
                count[w.type_name] = count.get(w.type_name, 0) + w.nbytes
        return "+".join(sorted(count, key=lambda k: -count[k]))


# keys llama.cpp reads per layer (get_key_or_arr): an array of one value per layer is allowed
PER_LAYER_KEYS = ("attention.head_count", "attention.head_count_kv", "feed_forward_length")


def _is_num(v, kind) -> bool:
    """``v`` is a value of ``kind`` as GGUF stores it: an integer (bool excluded) for ``int``, a
    float for ``float`` (llama.cpp's typed keys refuse an integer where a float belongs)."""
    if isinstance(v, bool):
        return False
    return isinstance(v, int) if kind is int else isinstance(v, float)


def show_value(v) -> str:
    """A metadata value for a message: its value, short (never an object's repr)."""
    from .gguf_file import StringArray  # noqa: PLC0415
    if isinstance(v, StringArray):
        return f"an array of {len(v)} strings"
    if isinstance(v, (list, tuple)):
        return f"an array of {len(v)}: {list(v[:4])}{' ...' if len(v) > 4 else ''}"
    return repr(v)


def gguf_field(header, key):
    """The value of metadata key ``key`` of a ``gguf_file.GGUFHeader`` (None when absent)."""
    return header.fields.get(key)


def load_gguf(path: str | os.PathLike) -> Model:
    """Read ``path`` (memory-mapped); :class:`ModelError` if it is not a model this package runs:
    as llama.cpp's loader, a file whose tensors are not exactly the architecture's (a missing or
    an extra one), of the wrong shape or type, or whose keys have the wrong types is refused."""
    from .gguf_file import GGUFError, read_header  # noqa: PLC0415
    path = os.fspath(path)
    if not os.path.isfile(path):
        what = ("not found" if not os.path.exists(path) else "a directory, not a model file" if os.path.isdir(path)
                else "not a regular file (a FIFO, device or socket): give the model file itself")
        raise ModelError(f"model file {path}: {what}")
    try:
        header = read_header(path)
    except (GGUFError, OSError) as e:
        raise ModelError(f"cannot read gguf '{path}': {e}") from e
    arch = gguf_field(header, "general.architecture")
    if not isinstance(arch, str) or arch not in ARCHS:
        raise ModelError(f"'{path}': architecture {show_value(arch)} is not supported (supported: {', '.join(ARCHS)})")
    hp = _hparams(header, path, arch)
    tensors = {t.name: t for t in header.tensors}
    file_map = np.memmap(path, dtype=np.uint8, mode="r") if header.tensors else None

    taken: set = set()

    def get(name: str, ne: tuple[int, ...] | None, *, required: bool = True, float_only: bool = False):
        taken.add(name)
        t = tensors.get(name)
        if t is None:
            if required:
                raise ModelError(f"'{path}' ({arch}) lacks tensor {name}")
            return None
        gtype = t.type
        t_ne = t.ne
        while len(t_ne) > 1 and t_ne[-1] == 1:
            t_ne = t_ne[:-1]
        if gtype not in WEIGHT_TYPES or (float_only and WEIGHT_TYPES[gtype] not in ("F32", "F16", "BF16")):
            allowed = "F32, F16, BF16" if float_only else ", ".join(_TYPE_NAMES)
            raise ModelError(f"'{path}': tensor {name} has type {t.type_name}, which this package cannot run "
                             f"(supported: {allowed})")
        if ne is not None and t_ne != ne:
            raise ModelError(f"'{path}': tensor {name} has shape {list(t_ne)} (ggml order), expected {list(ne)}")
        return Weight(name, gtype, t_ne, file_map[t.offset:t.offset + t.nbytes], t.offset)

    E, V, info = hp.n_embd, hp.n_vocab, ARCHS[arch]
    tok_embd = get("token_embd.weight", (E, V))
    # gemma's head is always the embedding: an output.weight is an extra tensor (refused below)
    output = None if info.gemma else get("output.weight", (E, V), required=False)
    output = output or tok_embd
    layers = []
    for il in range(hp.n_layer):
        shapes = {"attn_norm": (E,), "wq": (E, hp.n_embd_q), "wk": (E, hp.n_embd_kv), "wv": (E, hp.n_embd_kv),
                  "wo": (hp.n_embd_q, E), "ffn_norm": (E,), "wg": (E, hp.n_ff), "wu": (E, hp.n_ff),
                  "wd": (hp.n_ff, E)}
        lw = {k: get(f"blk.{il}.{n}", shapes[k], float_only=len(shapes[k]) == 1) for k, n in _LAYER_TENSORS.items()}
        extra = {}
        if info.qkv_bias:
            extra.update((k, (n, (d,))) for (k, n), d in zip(_BIAS_TENSORS.items(),
                                                              (hp.n_embd_q, hp.n_embd_kv, hp.n_embd_kv)))
        if info.qk_norm:
            extra.update((k, (n, (hp.head_dim_k,))) for k, n in _QK_NORM_TENSORS.items())
        if info.post_norms:
            extra.update((k, (n, (E,))) for k, n in _POST_NORM_TENSORS.items())
        for k, (n, ne) in extra.items():
            lw[k] = get(f"blk.{il}.{n}", ne, float_only=True)
        layers.append(lw)
    rope_freqs = get("rope_freqs.weight", (hp.rope_dim // 2,), required=False, float_only=True)
    if rope_freqs is not None and rope_freqs.type_name != "F32":
        raise ModelError(f"'{path}': rope_freqs.weight must be F32 (ggml_rope_ext reads it as float)")
    output_norm = get("output_norm.weight", (E,), float_only=True)
    if info.qk_norm:   # a qwen3 reranker's classifier head (llama.cpp loads it if present; unused here)
        cls = get("cls_out.weight", None, required=False)
        if cls is not None and cls.ne[0] != E:
            raise ModelError(f"'{path}': tensor cls_out.weight has shape {list(cls.ne)} (ggml order), expected "
                             f"[{E}, n_cls_out]")
    extra = sorted(set(tensors) - taken)
    if extra:   # llama.cpp: "wrong number of tensors" (e.g. block_count smaller than the layers present)
        raise ModelError(f"'{path}': {len(extra)} tensor(s) that a {arch} model of {hp.n_layer} layers does not "
                         f"have: {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}")
    return Model(path, hp, tok_embd, output_norm, output, layers, rope_freqs, file_map)


def _hparams(header, path: str, arch: str) -> HParams:
    from .gguf_file import StringArray  # noqa: PLC0415
    def num(key, default=None, kind=int):
        v = gguf_field(header, f"{arch}.{key}")
        if v is None:
            if default is None:
                raise ModelError(f"'{path}' lacks {arch}.{key}")
            return default
        if isinstance(v, (list, tuple, StringArray)):
            if key not in PER_LAYER_KEYS:   # as llama.cpp: arrays only where a value may be per layer
                raise ModelError(f"'{path}': {arch}.{key} is an array of {len(v)}; expected one number")
            if isinstance(v, StringArray) or not v or not all(_is_num(x, kind) for x in v):
                raise ModelError(f"'{path}': {arch}.{key} must hold {kind.__name__}s, got {show_value(v)}")
            if n_layers and len(v) != n_layers[0]:   # llama.cpp: "wrong array length"
                raise ModelError(f"'{path}': {arch}.{key} has {len(v)} values for {n_layers[0]} layers")
            vals = {kind(x) for x in v}
            if len(vals) != 1:   # llama.cpp's block is uniform here
                raise ModelError(f"'{path}': {arch}.{key} differs between layers ({sorted(vals)}); "
                                 f"not supported")
            v = vals.pop()
        if not _is_num(v, kind):   # as llama.cpp's typed keys: no float where an integer belongs
            raise ModelError(f"'{path}': {arch}.{key} is {show_value(v)}; expected {'an integer' if kind is int else 'a float'}")
        v = kind(v)
        if kind is int and not 1 <= v <= 2**31 - 1:
            raise ModelError(f"'{path}': {arch}.{key} = {v}; expected 1..2^31-1")
        if kind is float and not (math.isfinite(v) and v > 0):
            raise ModelError(f"'{path}': {arch}.{key} = {v}; expected a positive number")
        return v

    n_layers: list = []
    n_layers.append(num("block_count"))   # (first: the per-layer arrays' length)
    n_embd = num("embedding_length")
    n_head = num("attention.head_count")
    n_head_kv = num("attention.head_count_kv", n_head)
    head_dim_k = num("attention.key_length", n_embd // n_head if n_embd >= n_head else None)
    head_dim_v = num("attention.value_length", head_dim_k)
    if head_dim_v != head_dim_k:
        raise ModelError(f"'{path}': key_length {head_dim_k} != value_length {head_dim_v}; not supported")
    if n_head % n_head_kv:
        raise ModelError(f"'{path}': head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
    n_vocab = num("vocab_size", 0) or None
    if n_vocab is None:
        toks = gguf_field(header, "tokenizer.ggml.tokens")
        if toks is not None and not isinstance(toks, (list, tuple, StringArray)):
            raise ModelError(f"'{path}': tokenizer.ggml.tokens is {show_value(toks)}; expected an array of strings")
        n_vocab = len(toks) if toks else None
    if n_vocab is None:
        raise ModelError(f"'{path}' has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    rope_dim = num("rope.dimension_count", head_dim_k)
    if rope_dim > head_dim_k or rope_dim % 2:
        raise ModelError(f"'{path}': rope.dimension_count {rope_dim} must be even and at most head size {head_dim_k}")
    scaling = gguf_field(header, f"{arch}.rope.scaling.type") or "none"
    freq_scale = 1.0
    if scaling == "linear":
        freq_scale = 1.0 / num("rope.scaling.factor", 1.0, float)
    elif scaling != "none":
        raise ModelError(f"'{path}': rope scaling {show_value(scaling)} is not supported (none, linear)")
    info = ARCHS[arch]
    if info.qk_norm and rope_dim != head_dim_k:   # (llama.cpp's qwen3 graph asserts it)
        raise ModelError(f"'{path}': rope.dimension_count {rope_dim} != head size {head_dim_k}; {arch} rotates whole heads")
    name = gguf_field(header, "general.name")
    if not isinstance(name, str) or not name:   # (a number or an array there: the file's name instead)
        name = os.path.splitext(os.path.basename(path))[0]
    n_layer, rope_base = n_layers[0], num("rope.freq_base", 10000.0, float)
    extra: dict = {}
    if info.gemma:
        extra.update(embd_scale=math.sqrt(n_embd), ffn_gelu=True)
    if info.softcap:   # gemma2 (llama.cpp's defaults where a key is absent)
        swa = has_swa_layers(gguf_field(header, f"{arch}.attention.sliding_window_pattern"), n_layer, path, arch)
        if swa and num("rope.freq_base_swa", rope_base, float) != rope_base:
            raise ModelError(f"'{path}': {arch}.rope.freq_base_swa differs from rope.freq_base; not supported")
        extra.update(attn_softcap=num("attn_logit_softcapping", 50.0, float),
                     final_softcap=num("final_logit_softcapping", 30.0, float),
                     # the 27B (46 layers) scales by its n_embd / n_head, the others by the head size
                     attn_scale=1.0 / math.sqrt(n_embd // n_head if n_layer == 46 else head_dim_k))
        if swa:
            extra["pos_limit"] = num("attention.sliding_window", 4096)
    return HParams(arch=arch, name=str(name), n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                   n_head_kv=n_head_kv, head_dim_k=head_dim_k, n_ff=num("feed_forward_length"),
                   n_vocab=int(n_vocab), n_ctx_train=num("context_length", 0) or 0,
                   rms_eps=num("attention.layer_norm_rms_epsilon", 1e-5, float),
                   rope_base=rope_base, rope_dim=rope_dim,
                   rope_mode=info.rope_mode, rope_freq_scale=freq_scale, **extra)


def has_swa_layers(pattern, n_layer: int, path: str, arch: str) -> bool:
    """Whether a gemma2 file has sliding-window layers: ``attention.sliding_window_pattern`` absent
    (llama.cpp's default 2: every other layer), an integer ``n`` (layer ``il`` has a window when
    ``n == 0`` or ``il % n < n - 1``) or one bool per layer."""
    if pattern is None:
        return n_layer > 0
    if isinstance(pattern, (list, tuple)):
        if len(pattern) < n_layer or not all(isinstance(v, (bool, int)) for v in pattern):
            raise ModelError(f"'{path}': {arch}.attention.sliding_window_pattern is {show_value(pattern)}; expected "
                             f"an integer or {n_layer} bools")
        return any(bool(v) for v in pattern[:n_layer])
    if not _is_num(pattern, int) or pattern < 0:
        raise ModelError(f"'{path}': {arch}.attention.sliding_window_pattern is {show_value(pattern)}; expected an "
                         f"integer >= 0")
    return any(pattern == 0 or il % pattern < pattern - 1 for il in range(n_layer))
