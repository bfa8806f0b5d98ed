"""What a ubatch graph may be, checked apart from building it (``build.py`` re-exports these):
:func:`check_build_args` -- everything :func:`build.build_ubatch_graph` refuses, checkable before
a cache cell is claimed -- with :func:`check_geometry` and :func:`check_layers`; and
:func:`check_device_graph`, run before a device-resident graph's first compute (only custom ops
and views: ggml's CPU backend would read device memory)."""
from __future__ import annotations

import ctypes

import ggml
import numpy as np

from ggml_attn import op as fa_op

from . import model_graph
from .attn_config import AttnConfig
from .kv_cache import KVCache
from .kv_graph import check_custom_store

__all__ = ["LAYERS", "GraphBuildError", "check_build_args", "check_device_graph", "check_geometry", "check_layers"]

LAYERS = ("attn", "full", "model")

_NO_COMPUTE_OPS = {ggml.GGML_OP_NONE, ggml.GGML_OP_VIEW, ggml.GGML_OP_RESHAPE, ggml.GGML_OP_PERMUTE,
                   ggml.GGML_OP_TRANSPOSE}
_DEVICE_OK_OPS = _NO_COMPUTE_OPS | {ggml.GGML_OP_CUSTOM}


class GraphBuildError(RuntimeError):
    """A graph that must not be computed (e.g. a built-in op on device memory)."""


_OP_OFFSET = ggml.ggml_tensor.op.offset   # byte offset of ``op`` (an enum, C int) in a ggml_tensor


def check_device_graph(graph) -> None:
    """Raise :class:`GraphBuildError` if a node of ``graph`` is a built-in compute op: on a
    device-resident graph ggml's CPU backend would read device memory."""
    n = ggml.ggml_graph_n_nodes(graph)
    if not n:
        return
    addrs = ctypes.cast(ggml.ggml_graph_nodes(graph), ctypes.POINTER(ctypes.c_void_p * n)).contents[:]
    read_op = ctypes.c_int.from_address
    bad = []
    for a in addrs:
        if read_op(a + _OP_OFFSET).value not in _DEVICE_OK_OPS:
            node = ctypes.cast(a, ctypes.POINTER(ggml.ggml_tensor))
            bad.append(f"{node.contents.name.decode(errors='replace') or '?'} "
                       f"({ggml.ggml_op_name(node.contents.op).decode()})")
    if bad:
        raise GraphBuildError(f"device-resident graph has built-in CPU op(s) that would touch device "
                              f"memory: {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}")


def check_layers(cfg: AttnConfig, layers) -> range:
    """``layers`` (None: every layer of ``cfg``) as a non-empty step-1 range inside
    ``range(cfg.n_layer)``; ValueError otherwise."""
    if layers is None:
        return range(cfg.n_layer)
    if not isinstance(layers, range) or layers.step != 1 or not len(layers) \
            or layers.start < 0 or layers.stop > cfg.n_layer:
        raise ValueError(f"layers must be a non-empty range inside range({cfg.n_layer}), got {layers!r}")
    return layers


def check_geometry(cache: KVCache, cfg: AttnConfig, layers=None) -> None:
    """ValueError when ``cfg``'s layers (or the ``layers`` range of them) or K/V geometry do not
    fit ``cache``."""
    if (cfg.n_head_kv, cfg.head_dim_k, cfg.head_dim_v) != (cache.n_head_kv, cache.head_dim_k, cache.head_dim_v):
        raise ValueError(f"AttnConfig K/V geometry {cfg.n_head_kv}x{cfg.head_dim_k}/{cfg.head_dim_v} (n_head_kv x "
                         f"head_dim_k/head_dim_v) does not match the cache's {cache.n_head_kv}x{cache.head_dim_k}/"
                         f"{cache.head_dim_v}")
    n = len(check_layers(cfg, layers))
    if n > cache.n_layer:
        what = f"AttnConfig n_layer={cfg.n_layer}" if layers is None else f"layers {layers.start}..{layers.stop - 1}"
        raise ValueError(f"{what} need {n} layer(s) but the cache holds {cache.n_layer} layer(s)")


def check_build_args(cache: KVCache, cfg: AttnConfig, *, fa=None, all_custom: bool | None = None,
                     layer="attn", flash_attn: bool = True, weights=None, layers=None, model=None) -> bool:
    """Everything :func:`build_ubatch_graph` refuses, checked without a plan (so a caller can
    check before claiming cache cells). Returns True when the graph will be all-custom."""
    if fa is not None and (isinstance(fa, (bool, str)) or not callable(fa)):
        raise ValueError(f"fa must be a flash-attention op (ggml_attn.flash_attn_ext or ggml.ggml_flash_attn_ext) "
                         f"or None (ours), got {fa!r}; llama.cpp's -fa off is flash_attn=False of the CLIs' engines")
    check_geometry(cache, cfg, layers)
    n_layer = len(check_layers(cfg, layers))
    on_device = cache.xp is not np
    device = on_device if all_custom is None else bool(all_custom)
    if on_device and not device:
        raise GraphBuildError("a CuPy cache needs an all-custom graph (all_custom must not be False)")
    if device and flash_attn and (fa or fa_op.flash_attn_ext) is ggml.ggml_flash_attn_ext:
        raise GraphBuildError("an all-custom (device-resident) graph needs ggml_attn.flash_attn_ext, "
                              "not ggml's built-in op")
    if device and not flash_attn:
        raise GraphBuildError("-fa off (ggml's mul_mat + soft_max_ext) builds host graphs only; an "
                              "all-custom (device-resident) graph needs flash attention")
    if device:   # the custom store op's types (f16/f32, and q8_0/q4_0 in a device cache)
        check_custom_store(cache.type_k, cache.type_v, on_device=on_device)
    if not flash_attn and cache.type_v not in ("f16", "f32", "bf16"):
        raise ValueError(f"-fa off transposes V, which ggml cannot do for a {cache.type_v} (block) V cache; "
                         f"use flash attention")
    if isinstance(layer, str) and layer not in LAYERS:
        raise ValueError(f"layer must be one of {LAYERS} or a layer function, got {layer!r}")
    if layer == "model":
        if model is None:
            raise ValueError("layer='model' needs model= (graph.model.load_gguf)")
        if cfg != model.attn_config():
            raise ValueError(f"layer='model': cfg {cfg} is not the model's {model.attn_config()}")
        model_graph.check_model(model, cache, device)
    if layer == "full":
        if weights is None or len(weights) < n_layer:
            raise ValueError(f"layer='full' needs weights for each of the {n_layer} layers")
        if cfg.n_head * cfg.head_dim_k != weights[0]["wq"].shape[0]:
            raise ValueError(f"wq has {weights[0]['wq'].shape[0]} outputs, the config "
                             f"n_head x head_dim_k = {cfg.n_head * cfg.head_dim_k}")
    return device
