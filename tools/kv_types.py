"""K/V cache types (``-ctk`` / ``-ctv``): llama.cpp's names and where each can run.

llama.cpp's cache types are f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0 and q5_1. Here:

* the CPU path (``--device cpu``: ggml_attn's numpy path, ``--kernel ggml``, ``-fa off``)
  keeps K/V of that type in the ``KVCache`` (``type_k``/``type_v``), written by the host
  graph's ``ggml_set_rows``, so all of them run;
  as in llama.cpp, a quantized V cache needs flash attention (``-fa off`` transposes V,
  which ggml cannot do for quantized blocks);
* the CLI's CUDA engine keeps an f16 cache (CuPy has no bf16 or block types), so f16 only.

A quantized type packs 32 values per block, so each head must be a multiple of 32 wide
(``graph.kv_cache.check_head_blocks``, the KV cache's own rule).
"""
from __future__ import annotations

from .errors import UserError

from ggml_attn.graph.kv_cache import CACHE_TYPES, check_head_blocks

QUANTIZED = frozenset(CACHE_TYPES[3:])


def check_cache_types(type_k: str, type_v: str, *, device: str, flash_attn: bool,
                      head_dim_k: int, head_dim_v: int) -> None:
    """UserError (one line) when the chosen path cannot run these cache types."""
    if device == "cuda" and (type_k, type_v) != ("f16", "f16"):
        raise UserError(f"-ctk {type_k} -ctv {type_v}: the GPU engine keeps an f16 KV cache "
                        f"(f16 only); other cache types run on the CPU path (--device cpu)")
    if not flash_attn and type_v in QUANTIZED:
        raise UserError(f"-ctv {type_v}: a quantized V cache needs flash attention (-fa on or auto), "
                        f"as in llama.cpp: -fa off transposes V, which ggml cannot do for {type_v} blocks")
    for flag, arg, name, d in (("-ctk", "type_k", type_k, head_dim_k), ("-ctv", "type_v", type_v, head_dim_v)):
        try:
            check_head_blocks(arg, name, d)   # the KV cache's rule
        except ValueError as e:
            raise UserError(f"{flag} {str(e).split(' ', 1)[1]}") from None
