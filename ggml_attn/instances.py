"""Kernel instances: their names and the rule for picking one.

Names: the C++ type of each K/V type in the kernels' templates, and the name expression of a
template instance (:func:`template_expr`: what ggml_attn/kernels.py compiles and loads by).
Picking: the one rule both sm_90a kernels' shape modules use (ggml_attn/wgmma_shape.py,
ggml_attn/decode_tma_shape.py): an override knob's instance when set, else the default for the
call's key (its K/V type, or K/V type and head size); never an instance compiled for another key
(it would run bf16 MMAs on f16 bits, or read D 128 rows as D 64)."""
from __future__ import annotations

from .dtypes import GGML_TYPE_BF16, GGML_TYPE_F16, GGML_TYPE_Q4_0, GGML_TYPE_Q8_0

KV_CTYPES = {GGML_TYPE_F16: "__half", GGML_TYPE_BF16: "__nv_bfloat16"}
# ggml's quantized blocks the kernels read themselves (fattn_common.cuh, load8; the sm_90a decode): tags
QUANT_KV_CTYPES = {GGML_TYPE_Q8_0: "fattn_q8_0", GGML_TYPE_Q4_0: "fattn_q4_0"}
VEC_KV_CTYPES = {**KV_CTYPES, **QUANT_KV_CTYPES}


def template_expr(template: str, *args) -> str:
    """The name expression of ``template``'s instance for ``args`` (C++ spelling: bools as
    true/false, the rest as str()), e.g. ``fattn_mma<128, 128, __half, 4, 1, 1, 2, false>``."""
    return f"{template}<{', '.join(str(a).lower() if isinstance(a, bool) else str(a) for a in args)}>"


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
