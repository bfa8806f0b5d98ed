"""K/V cache types (``-ctk`` / ``-ctv``): llama.cpp's names and where each can run.

llama.cpp's cache types are f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0 and q5_1. Here:

* the CPU path (``--device cpu``: ggml_attn's numpy path, ``--kernel ggml``, ``-fa off``)
  keeps K/V of that type in the ``KVCache`` (``type_k``/``type_v``), written by the host
  graph's ``ggml_set_rows``, so all of them run;
  as in llama.cpp, a quantized V cache needs flash attention (``-fa off`` transposes V,
  which ggml cannot do for quantized blocks);
* the CLI's CUDA engine keeps K and V of f16, q8_0 or q4_0 (:data:`GPU_TYPES`), the same or
  different: a CuPy ``KVCache`` whose rows the device store op writes (``cuda/dense.cu``
  ``dense_kv_store`` quantizes q8_0/q4_0 as ggml's CPU reference does) and the attention
  kernels read (``ggml_attn.dispatch.best_kernel``: decode steps read K and V of one quantized
  type as blocks; a prompt, or K and V of different types, runs on f16 copies of the quantized
  ones); a quantized cache runs on one GPU (``-sm row/layer`` over several GPUs keep f16).

A quantized type packs 32 values per block, so each head must be a multiple of 32 wide
(``ggml_attn.dtypes.check_head_blocks``, the KV cache's own rule).
"""
from __future__ import annotations

from .errors import UserError

from ggml_attn.dtypes import CACHE_TYPES, DEVICE_BLOCK_TYPES, FLOAT_CACHE_TYPES, check_head_blocks

QUANTIZED = frozenset(t for t in CACHE_TYPES if t not in FLOAT_CACHE_TYPES)
GPU_TYPES = ("f16",) + DEVICE_BLOCK_TYPES   # what the CUDA engine's cache holds (K and V each)


def check_cache_types(type_k: str, type_v: str, *, device: str, flash_attn: bool,
                      head_dim_k: int, head_dim_v: int, kernel: str = "auto", n_gpu: int = 1) -> None:
    """UserError (one line) when the chosen path cannot run these cache types. ``kernel``:
    ``--kernel``; ``n_gpu``: the GPUs of the run (``-sm row/layer`` ranks; 1: one GPU or the CPU)."""
    if device == "cuda":
        check_gpu_types(type_k, type_v, kernel=kernel, head_dim_k=head_dim_k, head_dim_v=head_dim_v)
        check_multi_gpu_types(type_k, type_v, n_gpu)
    if not flash_attn and type_v in QUANTIZED:
        raise UserError(f"-ctv {type_v}: a quantized V cache needs flash attention (-fa on or auto), "
                        f"as in llama.cpp: -fa off transposes V, which ggml cannot do for {type_v} blocks")
    for flag, arg, name, d in (("-ctk", "type_k", type_k, head_dim_k), ("-ctv", "type_v", type_v, head_dim_v)):
        try:
            check_head_blocks(arg, name, d)   # the KV cache's rule
        except ValueError as e:
            raise UserError(f"{flag} {str(e).split(' ', 1)[1]}") from None


def check_gpu_types(type_k: str, type_v: str, *, kernel: str = "auto", head_dim_k: int = 128,
                    head_dim_v: int = 128) -> None:
    """The CUDA engine's rule: K and V each of a :data:`GPU_TYPES` type, and a ``--kernel``
    asked for by name that reads them at these head sizes (``ggml_attn.dispatch.supports``; a
    pair of different types only the kernels that read f16 copies, not those that read blocks)."""
    if type_k not in GPU_TYPES or type_v not in GPU_TYPES:
        raise UserError(f"-ctk {type_k} -ctv {type_v}: the GPU engine keeps K and V of "
                        f"{', '.join(GPU_TYPES)} (what its kernels read); other types "
                        f"run on the CPU path (--device cpu)")
    from ggml_attn import dispatch
    from ggml_attn.graph.kv_graph import ggml_type_of
    if kernel in dispatch.GPU_KERNELS:
        if type_k != type_v and kernel in dispatch.QUANT_READERS:
            raise UserError(f"--kernel {kernel} -ctk {type_k} -ctv {type_v}: that kernel reads K and V of one "
                            f"type; --kernel auto picks one that reads f16 copies of the quantized one")
        for flag, t in (("-ctk", type_k), ("-ctv", type_v)):
            why = dispatch.supports(kernel, head_dim_k, head_dim_v, ggml_type_of(t))
            if why is not None:
                raise UserError(f"--kernel {kernel} {flag} {t}: {why}; --kernel auto picks a kernel that reads it")


def check_multi_gpu_types(type_k: str, type_v: str, n_gpu: int) -> None:
    """``-sm row/layer`` over ``n_gpu`` > 1 GPUs keep an f16 cache: a quantized one runs on one
    GPU (the ranks' sharded caches are not verified with block types)."""
    if n_gpu > 1 and (type_k, type_v) != ("f16", "f16"):
        raise UserError(f"-ctk {type_k} -ctv {type_v}: -sm row/layer over {n_gpu} GPUs keep an f16 KV cache; "
                        f"{', '.join(DEVICE_BLOCK_TYPES)} run on one GPU (-sm none)")
