"""Picking a kernel instance for a call's K/V type, the one rule both sm_90a kernels' shape
modules use (ggml_attn/wgmma_shape.py, ggml_attn/decode_tma_shape.py): an override knob's
instance when set, else the default for the type; never an instance compiled for another K/V
type (it would run bf16 MMAs on f16 bits)."""
from __future__ import annotations


def pick(configs: dict, for_type: dict, kv_type: int, override: str, type_of, what: str, knob: str) -> str:
    """The key of ``configs`` for K/V of ``kv_type``: ``override`` when set, else
    ``for_type[kv_type]``; ``type_of(configs[key])`` is an instance's K/V type. ValueError (naming
    ``what`` and ``knob``) for an unknown key or one of another K/V type."""
    name = override or for_type.get(kv_type)
    if name is None or name not in configs:
        raise ValueError(f"no {what} instance {name!r} for K/V type {kv_type}")
    if type_of(configs[name]) != kv_type:
        raise ValueError(f"{knob} {name!r} is for another K/V type than this call's")
    return name
