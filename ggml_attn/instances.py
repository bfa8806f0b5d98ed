"""Picking a kernel instance for a call, the one rule both sm_90a kernels' shape modules use
(ggml_attn/wgmma_shape.py, ggml_attn/decode_tma_shape.py): an override knob's instance when
set, else the default for the call's key (its K/V type, or K/V type and head size); never an
instance compiled for another key (it would run bf16 MMAs on f16 bits, or read D 128 rows as
D 64)."""
from __future__ import annotations


def pick(configs: dict, for_key: dict, key, override: str, key_of, what: str, knob: str) -> str:
    """The key of ``configs`` for a call of ``key``: ``override`` when set, else
    ``for_key[key]``; ``key_of(configs[name])`` is an instance's key. ValueError (naming ``what``
    and ``knob``) for an unknown instance or one for another key."""
    name = override or for_key.get(key)
    if name is None or name not in configs:
        raise ValueError(f"no {what} instance {name!r} for this call ({key!r})")
    if key_of(configs[name]) != key:
        raise ValueError(f"{knob} {name!r} is for another K/V type or head size than this call's")
    return name
