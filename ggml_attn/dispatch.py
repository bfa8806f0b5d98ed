"""Which implementation runs one ``flash_attn_ext`` call, and why.

Inputs are plain shape facts (ggml meaning): ``n_batch`` query tokens per stream, ``gqa`` query
heads per KV head, ``n_kv`` KV cells, head sizes, K/V type. Output: one of
``"prefill"`` (tensor-core tiles of 64 rows), ``"decode"`` (CUDA-core split-KV),
``"decode-tc"`` (tensor-core split-KV, the query heads of one KV head as the rows of a 16-row
tile) or ``"reference"`` (numpy, for what no kernel covers), plus a one-line reason.

The crossover table below comes from ``tools/gpu_crossover.py`` run on the H200; its raw
numbers are in ``bench/results/`` (see bench/NOTES.md). The same table answers the question
FlashInfer users asked of its kernels -- prefill kernels use tensor cores, decode kernels CUDA
cores; is the prefill kernel always faster at decode? -- for this project's kernels.
"""
from __future__ import annotations

from .dtypes import GGML_TYPE_BF16, GGML_TYPE_F16, TYPE_NAMES
from .kernels import MMA_HEADS, VEC_HEADS

KERNELS = ("auto", "prefill", "decode", "decode-tc", "reference")

# Crossover (H200, f16 K/V, D=128, 8 KV heads, no mask; tools/gpu_crossover.py, raw rows in
# bench/results/2026-11-29-372c6bd-crossover.json, discussion in bench/NOTES.md): per GQA
# bucket (largest power of 2 <= gqa), the largest n_batch (query tokens per stream) for which
# a decode kernel beat the prefill kernel at both n_kv = 4096 and 32768 -- i.e. while the
# packed rows per KV head (n_batch * gqa) stay <= 16, one 16-row mma tile. The tensor-core
# decode beat the CUDA-core decode everywhere except one tie (gqa 1, n_batch 1, n_kv 32768:
# 61.5 vs 62.0 us), so the CUDA-core kernel runs only where no mma variant exists
# (D 512/576) or when asked for explicitly.
DECODE_MAX_BATCH = {1: 16, 2: 8, 4: 4, 8: 2}
DECODE_TC_MIN_GQA = 1
CROSSOVER_SOURCE = "H200 crossover 2026-11-29 (372c6bd)"


def supports(kernel: str, d_k: int, d_v: int, kv_type: int) -> str | None:
    """None when ``kernel`` can run these head sizes and K/V type, else the reason it cannot."""
    if kernel == "reference":
        return None
    if kv_type not in (GGML_TYPE_F16, GGML_TYPE_BF16):
        return (f"K/V type {TYPE_NAMES.get(kv_type, kv_type)} has no GPU kernel "
                "(the kernels read f16/bf16 K/V)")
    heads = VEC_HEADS if kernel == "decode" else MMA_HEADS
    if (d_k, d_v) not in heads:
        return f"head sizes D_k={d_k}, D_v={d_v} are not compiled for the {kernel} kernel " \
               f"(compiled: {', '.join(f'{a}/{b}' for a, b in heads)})"
    return None


def _bucket(gqa: int) -> int:
    b = 1
    while b * 2 <= gqa and b < 8:
        b *= 2
    return b


def choose(n_batch: int, gqa: int, n_kv: int, d_k: int, d_v: int, kv_type: int) -> tuple[str, str]:
    """Pick a kernel for one call; returns (kernel, reason)."""
    if supports("decode", d_k, d_v, kv_type) is not None:
        return "reference", supports("decode", d_k, d_v, kv_type)
    mma_ok = supports("prefill", d_k, d_v, kv_type) is None
    if not mma_ok:
        return "decode", f"head sizes {d_k}/{d_v} have only the CUDA-core kernel"
    if n_batch <= DECODE_MAX_BATCH[_bucket(gqa)]:
        if gqa >= DECODE_TC_MIN_GQA:
            return "decode-tc", f"n_batch {n_batch} <= decode limit, gqa {gqa} >= {DECODE_TC_MIN_GQA} ({CROSSOVER_SOURCE})"
        return "decode", f"n_batch {n_batch} <= decode limit, gqa {gqa} < {DECODE_TC_MIN_GQA} ({CROSSOVER_SOURCE})"
    return "prefill", f"n_batch {n_batch} above the decode limit ({CROSSOVER_SOURCE})"
