"""Which implementation runs one ``flash_attn_ext`` call, and why.

:func:`best_kernel` is the one place that decides (as llama.cpp's
``ggml_cuda_get_best_fattn_kernel`` answers both "can it run?" and "what runs?"). Two callers
ask it: the GPU backend through ``cuda_plan.decide`` (the plan keeps each decision: every
layer's call of a ubatch gets the first layer's, FlashInfer's plan/run split), and
the op for the calls the backend does not take whole (host data, no usable GPU). The facts
come from one builder, :func:`call_facts`, over the call's ``validate.AttnDims``. Inputs are
plain shape facts (ggml meaning): ``n_batch`` query tokens per stream, ``gqa`` query
heads per KV head, ``n_kv`` KV cells, head sizes, K/V type. Output: one of
``"prefill"`` (tensor-core tiles of 64 rows), ``"prefill-wgmma"`` (the sm_90a warp-specialised
prefill of ggml_attn/hopper_prefill.py: where it takes the call, auto prefers it to "prefill"), ``"decode"`` (CUDA-core split-KV),
``"decode-tc"`` (tensor-core split-KV, the query heads of one KV head as the rows of a 16-row
tile), ``"decode-tma"`` (the sm_90a persistent decode of cuda/fattn_decode_tma.cu: decode-tc's
rows, one balanced wave over every live tile, TMA loads; where it takes the call, auto prefers
it to "decode-tc"), ``"cells"`` (CUDA-core split-KV over each row's own list of visible cells, for decode
steps whose rows see few, interleaved cells: the plan's cell lists), ``"reference"`` (numpy, for what no kernel covers) or ``"cpu"`` (the op's numpy path on
host memory), plus a one-line reason.

The crossover table below comes from ``tools/dev/gpu_crossover.py`` run on the H200; its raw
numbers are in ``bench/results/`` (see bench/NOTES.md). The same table answers the question
FlashInfer users asked of its kernels -- prefill kernels use tensor cores, decode kernels CUDA
cores; is the prefill kernel always faster at decode? -- for this project's kernels.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .cuda_launch import decode_work
from .dtypes import GGML_TYPE_BF16, GGML_TYPE_F16, GGML_TYPE_F32, TYPE_NAMES
from .tensor import type_name
from .kernels import CELLS_HEADS, MMA_HEADS, QUANT_KV_CTYPES, VEC_HEADS, VEC_QUANT_HEADS
from .wgmma_shape import HEAD_SIZES_WS

if TYPE_CHECKING:
    from .tensor import TensorDesc
    from .validate import AttnDims

KERNELS = ("auto", "prefill", "prefill-wgmma", "decode", "decode-tc", "decode-tma", "cells", "reference")
GPU_KERNELS = ("prefill", "prefill-wgmma", "decode", "decode-tc", "decode-tma", "cells")

# Crossover (H200, f16 K/V, D=128, 8 KV heads, no mask; tools/dev/gpu_crossover.py, raw rows in
# bench/results/2026-11-29-372c6bd-crossover.json, discussion in bench/NOTES.md): per GQA
# bucket (largest power of 2 <= gqa), the largest n_batch (query tokens per stream) for which
# a decode kernel beat the prefill kernel at both n_kv = 4096 and 32768 -- i.e. while the
# packed rows per KV head (n_batch * gqa) stay <= 16, one 16-row mma tile. The tensor-core
# decode beat the CUDA-core decode everywhere except one tie (gqa 1, n_batch 1, n_kv 32768:
# 61.5 vs 62.0 us), so the CUDA-core kernel runs only where no mma variant exists
# (D 512/576) or when asked for explicitly.
DECODE_MAX_BATCH = {1: 16, 2: 8, 4: 4, 8: 2}
CROSSOVER_SOURCE = "H200 crossover 2026-11-29 (372c6bd)"

# Cell-list decode ("cells"): auto picks it when the plan measured that the tile kernel it would
# otherwise run reads at least CELLS_MIN_GAIN times the K/V cells (per token and KV head) that
# walking each row's own visible cells reads -- decode steps over a unified cache whose
# sequences' cells interleave (every KV tile live, each row seeing ~1/n_seq of the cells). Only
# for decode-shaped calls: at most CELLS_MAX_BATCH query tokens per stream, and cell lists
# (capacity n_kv per mask row, 8 bytes an entry) of at most CELLS_MAX_LIST_BYTES. The gain
# threshold is a guess to be measured (tools/dev/gpu_batched_attn_bench.py): the cell kernel gathers
# single K/V rows on CUDA cores and reuses nothing across tokens, the tile kernels read whole
# tiles through tensor cores and share them over a query tile.
CELLS_MIN_GAIN = 2.0
CELLS_MAX_BATCH = 256
CELLS_MAX_LIST_BYTES = 256 << 20


# The sm_90a prefill ("prefill-wgmma", cuda/fattn_wgmma.cu version 1): auto runs it in place of
# "prefill" on compute capability 9.0 for head_dim_k = head_dim_v of wgmma_shape.HEAD_SIZES_WS (instances at
# 64, 128 and 256; 40, 72-112 and 192 padded to the next: causal 4096 D 96 300.9 us against 395.1
# on mma.sync, D 192 295.3 against 635.1, every padded size ahead of mma.sync,
# bench/results/2026-12-03-b94a1da-wgmma-heads-final.json), f16 or bf16 K/V without sinks,
# softcap or ALiBi, when the mask (if any) has no MASKED tiles in the plan's 128-token tile map
# (Plan.read_wgmma_tiles; HIDDEN ones are fine: ragged prompts in one ubatch run tiles of several
# query heads there, cuda_launch.WGMMA_RAGGED_PACK), and for at least WGMMA_MIN_BATCH tokens per
# stream (a guess: its blocks take 128 query rows; below that the 64-row mma.sync tiles waste
# less). The kernel is right on every tile class (MASKED tiles' values read from global memory,
# HIDDEN columns' V rows zeroed), but MASKED tiles are slow there. H200, with Q through TMA
# (bench/results/2026-12-04-be0ea13-qtma.json): causal 8192 996.8 us against 1630.7 for
# "prefill", causal 2048 92.5 against 136.2; 16 / 64 ragged prompts in one unified ubatch 38.6 /
# 130.6 against 41.1 / 165.6; a 512 window over 4096 tokens 134.4 against 182.4
# (2026-12-02-ab8bee5.json).
WGMMA_ARCH = "sm_90"
WGMMA_MIN_BATCH = 128


def _sm90a_why_not(f: "CallFacts", heads: tuple[int, ...],
                   types: tuple = (GGML_TYPE_F16, GGML_TYPE_BF16)) -> str | None:
    """What the sm_90a kernels need: compute capability 9.0, head_dim_k = head_dim_v in ``heads`` (the head
    sizes of the kernel's instances), K/V of one of ``types`` (f16 or bf16; the decode also q8_0
    and q4_0), no sinks, softcap or ALiBi."""
    if f.arch != WGMMA_ARCH:
        return f"needs compute capability 9.0 (sm_90a programs); this GPU is {f.arch or 'unknown'}"
    if f.head_dim_k != f.head_dim_v or f.head_dim_k not in heads or f.kv_type not in types:
        sizes = ", ".join(map(str, heads))
        names = "/".join(TYPE_NAMES.get(t, str(t)) for t in types)
        return (f"D {sizes} (head_dim_k = head_dim_v) with {names} K/V only "
                f"(got {f.head_dim_k}/{f.head_dim_v}, {TYPE_NAMES.get(f.kv_type, f.kv_type)})")
    if not f.plain:
        return "no sinks, softcap or ALiBi in this kernel"
    return None


def wgmma_why_not(f: "CallFacts", auto: bool = True) -> str | None:
    """None when the sm_90a prefill can run this call, else why not; for ``auto``'s choice also
    a mask with MASKED or HIDDEN tiles (or none measured) and fewer than WGMMA_MIN_BATCH tokens
    per stream."""
    why = _sm90a_why_not(f, HEAD_SIZES_WS)
    if why is not None:
        return why
    if auto and f.mask_tiles == "masked":
        return ("the mask has tiles whose rows are not intervals of visible cells (or no plan measured it): "
                "the mma.sync kernel's measured path")
    if auto and f.n_batch < WGMMA_MIN_BATCH:
        return f"n_batch {f.n_batch} < {WGMMA_MIN_BATCH}: 128-row blocks would run mostly empty"
    return None


# The sm_90a decode ("decode-tma", cuda/fattn_decode_tma.cu): auto runs it in place of
# "decode-tc" on compute capability 9.0 for D 128 f16 or bf16 K/V without sinks, softcap or
# ALiBi (any mask: its tiles are classed by the plan as decode-tc's are), for calls of at least
# DECODE_TMA_MIN_WORK (group, KV tile) pairs, or DECODE_TMA_MIN_WORK_EVEN when its split can
# cut the groups on their own boundaries with balanced blocks (CallFacts.work_even: no mask, or
# a plan whose live counts allow it; cuda_launch.decode_tma_cap), so that few groups are merged
# and no block holds two parts. Measured on the H200 without a mask
# (bench/results/2026-12-02-44509ed.json, decode-tma against decode-tc, us): B=1 4k (512
# pairs) 17.4 against 14.9; B=1 32k (4096) 43.8 against 45.1; B=16 4k (8192) 67.7 against
# 70.4; B=64 4k 249.7 against 264.7; B=64 32k 1878.8 against 2046.0 (cuDNN 13.5 / 40.0 / 65.4
# / 243.5 / 1894.0). With groups of unequal work the equal shares cut groups anywhere, leave a
# 10-17 us spread between blocks' ends plus merges, which only long calls hide
# (2026-12-01-e44093d.json: B=16 4k 75.9 against 70.5; tools/dev/gpu_decode_tma_trace.py).
DECODE_TMA_MIN_WORK = 32768
DECODE_TMA_MIN_WORK_EVEN = 4096


def decode_tma_why_not(f: "CallFacts") -> str | None:
    """None when the sm_90a decode can run this call (D 128 only), else why not. q8_0/q4_0 K/V: its
    producer reads one raw box of blocks per tile (decode_tma_shape.quant_kv_map), so each
    cell's heads must be packed in its row and pointers and strides 16-byte aligned (CallFacts.kv_tma)."""
    why = _sm90a_why_not(f, (128,), (GGML_TYPE_F16, GGML_TYPE_BF16, *QUANT_KV_CTYPES))
    if why is None and f.kv_type in QUANT_KV_CTYPES and not f.kv_tma:
        return ("quantized K/V through TMA boxes needs each cell's heads packed in its row (a cache view) "
                "and 16-byte aligned pointers and cell/stream strides")
    return why


def cell_list_bytes(n_batch: int, n_kv: int, mask_planes: int = 1) -> int:
    """Bytes of a plan's cell lists: (int2 entries, capacity n_kv) + one count per mask row."""
    return mask_planes * n_batch * (8 * n_kv + 4)


def cells_why_not(f: "CallFacts", auto: bool = True) -> str | None:
    """None when the cell-list kernel can run this call, else why not (head sizes, K/V type,
    lists over CELLS_MAX_LIST_BYTES; for ``auto``'s choice also more than CELLS_MAX_BATCH
    tokens per stream: a prompt's rows share their cells, which tiles reuse and cell lists do
    not -- asked for by name, such calls run, slowly)."""
    why = supports("cells", f.head_dim_k, f.head_dim_v, f.kv_type)
    if why is not None:
        return why
    if auto and f.n_batch > CELLS_MAX_BATCH:
        return f"n_batch {f.n_batch} > {CELLS_MAX_BATCH}: per-row cell lists are for decode-shaped calls"
    nbytes = cell_list_bytes(f.n_batch, f.n_kv, f.mask_planes)
    if nbytes > CELLS_MAX_LIST_BYTES:
        return f"cell lists of {nbytes >> 20} MiB > {CELLS_MAX_LIST_BYTES >> 20} MiB"
    return None


def supports(kernel: str, head_dim_k: int, head_dim_v: int, kv_type: int) -> str | None:
    """None when ``kernel`` can run these head sizes and K/V type, else the reason it cannot.
    q8_0 / q4_0 K/V: the CUDA-core decode kernel (blocks dequantized in registers) and the sm_90a
    decode at D 128 (MMA fragments built from each tile's raw blocks in registers;
    decode_tma_why_not has its other rules) read the blocks; every other kernel runs on f16
    copies (QUANT_READERS), at its f16 head sizes."""
    if kernel == "reference":
        return None
    name = type_name(kv_type)
    if kv_type in QUANT_KV_CTYPES:
        if kernel not in QUANT_READERS:
            return supports(kernel, head_dim_k, head_dim_v, GGML_TYPE_F16)
        heads = VEC_QUANT_HEADS if kernel == "decode" else ((128, 128),)
    elif kv_type not in (GGML_TYPE_F16, GGML_TYPE_BF16):
        return (f"K/V type {name} has no GPU kernel "
                "(the kernels read f16/bf16 K/V, and q8_0/q4_0 in the CUDA-core decode kernel)")
    else:
        heads = VEC_HEADS if kernel == "decode" else CELLS_HEADS if kernel == "cells" else MMA_HEADS
    if (head_dim_k, head_dim_v) not in heads:
        return f"head sizes head_dim_k={head_dim_k}, head_dim_v={head_dim_v} are not compiled for the {kernel} kernel " \
               f"(compiled: {', '.join(f'{a}/{b}' for a, b in heads)})"
    return None


# Kernels that read q8_0/q4_0 blocks themselves; the others run on f16 copies of quantized K/V
# made once per call (cuda/fattn_util.cu fattn_dequant_kv; cuda_backend._F16Copies).
QUANT_READERS = ("decode", "decode-tma")


def reads_f16_copies(kernel: str, *kv_types: int) -> bool:
    """True when GPU kernel ``kernel`` runs on f16 copies of K/V of these types (K's, V's): one
    of them is quantized, and the kernel does not read blocks itself (:data:`QUANT_READERS`) or
    K and V differ in type (the readers read K and V of one type: best_kernel runs such calls
    on the f16 kernels, the sm_90a decode among them)."""
    quantized = any(t in QUANT_KV_CTYPES for t in kv_types)
    return quantized and (kernel not in QUANT_READERS or len(set(kv_types)) > 1)


def _quant_direct(f: "CallFacts") -> "Choice | None":
    """``auto``'s choice for q8_0/q4_0 K/V read as blocks: decode-shaped calls (n_batch within
    the decode limit) and head sizes no tensor-core kernel has, on the sm_90a decode where it
    runs, else the CUDA-core decode; None: a tensor-core kernel over f16 copies."""
    name = type_name(f.kv_type)
    mma = supports("prefill", f.head_dim_k, f.head_dim_v, GGML_TYPE_F16) is None
    if mma and f.n_batch > DECODE_MAX_BATCH[_bucket(f.gqa)]:
        return None
    if decode_tma_why_not(f) is None:
        return Choice("decode-tma", f"{name} K/V, n_batch {f.n_batch} <= decode limit: the sm_90a decode "
                                    f"dequantizes each tile's blocks into its MMA fragments")
    why = supports("decode", f.head_dim_k, f.head_dim_v, f.kv_type)
    if why is None:
        return Choice("decode", f"{name} K/V, n_batch {f.n_batch}: the CUDA-core kernel dequantizes the blocks "
                                f"in registers")
    if mma:
        return None
    return Choice("reference", f"{why}; running the numpy reference on the host")


def _bucket(gqa: int) -> int:
    b = 1
    while b * 2 <= gqa and b < 8:
        b *= 2
    return b


def _choose_gpu(n_batch: int, gqa: int, head_dim_k: int, head_dim_v: int, kv_type: int) -> tuple[str, str]:
    """The GPU kernel for one call when ``auto`` is asked: (kernel, reason); "reference" when no
    kernel covers these head sizes / K/V type."""
    why = supports("decode", head_dim_k, head_dim_v, kv_type)
    if why is not None:
        return "reference", why
    if kv_type in QUANT_KV_CTYPES:
        return "decode", (f"{TYPE_NAMES.get(kv_type, kv_type)} K/V: the CUDA-core kernel dequantizes "
                          f"the blocks in registers (the only kernel that reads them)")
    if supports("prefill", head_dim_k, head_dim_v, kv_type) is not None:
        return "decode", f"head sizes {head_dim_k}/{head_dim_v} have only the CUDA-core kernel"
    if n_batch <= DECODE_MAX_BATCH[_bucket(gqa)]:
        return "decode-tc", f"n_batch {n_batch} <= decode limit ({CROSSOVER_SOURCE})"
    return "prefill", f"n_batch {n_batch} above the decode limit ({CROSSOVER_SOURCE})"


@dataclass(frozen=True)
class CallFacts:
    """What the choice depends on, for one call (ggml meaning): query tokens per stream, query
    heads per KV head, KV cells, head sizes, K/V type, and whether K/V pointers and byte
    strides are multiples of 16 (the tensor-core kernels load 16-byte chunks)."""
    n_batch: int
    gqa: int
    n_kv: int
    head_dim_k: int
    head_dim_v: int
    kv_type: int
    kv_aligned: bool = True
    mask_planes: int = 1               # ne32 * ne33 of the mask (cell lists: one per plane and token)
    # from the plan (None without one, or when it built no cell lists): K/V cells read per query
    # token and KV head by the cell-list kernel, and by the tile kernel auto would otherwise run
    cell_reads: float | None = None
    tile_reads: float | None = None
    arch: str = ""                     # the device's architecture ("sm_90"); "" when not known
    plain: bool = True                 # no sinks, softcap or ALiBi
    # the mask as the plan's 128-token tile map saw it: "none" (no mask), "plain" (FULL and
    # PARTIAL-interval tiles only), "masked" (MASKED or HIDDEN tiles, or not measured)
    mask_tiles: str = "none"
    # (16-row group, KV tile) pairs of decode-tc's layout over every KV tile: the work a decode
    # call streams (0: not known)
    work_tiles: int = 0
    # decode-tma's split would cut the groups on their own boundaries, blocks balanced
    # (cuda_launch.decode_tma_cap > 0: no mask, or a plan's live counts that allow it)
    work_even: bool = False
    # K and V readable through the sm_90a decode's TMA maps (16-byte aligned; q8_0/q4_0 also
    # with each cell's heads packed in its row: cuda_backend._kv_tma)
    kv_tma: bool = True
    # V's type when it differs from K's (``kv_type``); None: the same. On the GPU only f16 beside
    # q8_0/q4_0 (or those two together), through f16 copies of the quantized one
    v_type: int | None = None


def call_facts(dims: "AttnDims", *, kv_aligned: bool = True, kv_tma: bool = True, reads: tuple | None = None,
               arch: str = "", plain: bool = True, mask_tiles: str = "none", live_counts: dict | None = None,
               masked: bool | None = None) -> CallFacts:
    """The one builder of :class:`CallFacts`, from a call's validated dimensions
    (``validate.AttnDims``) and what else is known of it: ``kv_aligned`` / ``kv_tma``
    (:func:`kv_access` of its K and V; True: as the kernels want them), ``arch`` (the device's,
    "sm_90"; "": not known), ``plain`` (no sinks, softcap or ALiBi), and from a live-tile plan
    (``cuda_plan.Plan``) its ``reads`` (cell_reads, tile_reads), its verdict on the mask for the
    sm_90a prefill (``mask_tiles``: "none" without a mask, "plain" / "masked") and its live-tile
    counts per query tile size (``live_counts``); ``masked``: whether the call has a mask
    (default ``mask_tiles != "none"``) -- with a mask and no counts the decode's groups count as
    unequal."""
    cr, tr = reads if reads is not None else (None, None)
    masked = mask_tiles != "none" if masked is None else masked
    work, even = decode_work(dims, live_counts, masked)
    return CallFacts(dims.n_batch, dims.gqa, dims.n_kv, dims.head_dim_k, dims.head_dim_v, dims.kv_type, kv_aligned,
                     dims.ne32 * dims.ne33, cr, tr, arch, plain, mask_tiles, work, even, kv_tma, dims.v_type)


def kv_access(k: "TensorDesc", v: "TensorDesc") -> tuple[bool, bool]:
    """(kv_aligned, kv_tma) of a call's K and V (ggml order descriptors): pointers and byte
    strides as the kernels load them -- 16 bytes, 2 for q8_0/q4_0 rows (blocks start with an
    f16 scale, read 2 bytes at a time) -- and readable through the sm_90a decode's TMA maps
    (f16/bf16 as aligned; q8_0/q4_0 as ``decode_tma_shape.quant_why_not`` says: D 128, a cell's
    heads packed in its row)."""
    def aligned(t):
        a = 2 if t.type in QUANT_KV_CTYPES else 16
        return all(x % a == 0 for x in (t.ptr, t.nb[1], t.nb[2], t.nb[3]))

    def tma(t):
        if t.type in QUANT_KV_CTYPES:
            from .decode_tma_shape import quant_why_not   # noqa: PLC0415
            return quant_why_not(t) is None
        return aligned(t)
    return aligned(k) and aligned(v), tma(k) and tma(v)


def kernels_for(kernel: str, f: CallFacts) -> list[Choice]:
    """What runs calls of facts ``f`` under ``kernel``: for ``auto`` each GPU kernel asked for
    by name that can run them, else ``kernel``'s own answer; refusals and host answers left
    out (``cuda_plan.programs``: the programs a process may load for such calls)."""
    out = []
    for name in GPU_KERNELS if kernel == "auto" else (kernel,):
        try:
            c = best_kernel(name, f)
        except ValueError:
            continue
        if c.on_gpu:
            out.append(c)
    return out


@dataclass(frozen=True)
class Choice:
    """``kernel``: "prefill" | "prefill-wgmma" | "decode" | "decode-tc" | "decode-tma" | "cells" (CUDA kernels), "reference" (numpy, on host
    copies when the data is on the device) or "cpu" (the op's threaded numpy path on host
    memory); ``reason``: one line saying why."""
    kernel: str
    reason: str

    @property
    def on_gpu(self) -> bool:
        return self.kernel in GPU_KERNELS


def best_kernel(kernel: str, f: CallFacts, *, backend: str = "cuda", gpu: bool = True,
                on_device: bool = True) -> Choice:
    """The one place that answers both "can this call run?" and "what runs?".

    ``kernel``: the request (``auto`` or a name from :data:`KERNELS`); ``backend``: the op's
    setting (``auto``, ``reference``, ``cuda``; the CUDA backend's own entry points pass
    ``cuda``); ``gpu``: a usable GPU is present; ``on_device``: the call's data is in GPU
    memory. Raises ``ValueError`` (or ``RuntimeError`` without a GPU: for ``backend="cuda"``, or
    for data on the device unless ``backend="reference"``) when the request cannot run, naming
    why; never returns a choice that cannot run (``"cpu"`` only for host data)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    floats = (GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16)
    v_type = f.kv_type if f.v_type is None else f.v_type
    mixed = v_type != f.kv_type
    quantized = f.kv_type not in floats or v_type not in floats
    if backend == "reference":
        if on_device:
            return Choice("reference", "backend 'reference' (data copied to the host)")
        return Choice("cpu", "backend 'reference'")
    if not gpu:
        if backend == "cuda":
            raise RuntimeError("backend 'cuda' requested but no usable CUDA device/CuPy")
        if on_device:   # the numpy path reads host memory only: device pointers there are a segfault
            raise RuntimeError("the data is in GPU memory but there is no usable CUDA device/CuPy backend "
                               "(ggml_attn.gpu_available() is False); the numpy path reads host memory only")
        return Choice("cpu", "no usable GPU")
    if quantized:
        name = type_name(f.kv_type) if not mixed else f"{type_name(f.kv_type)}/{type_name(v_type)}"
        if not on_device:   # host data: the op's CPU path reads every type ggml dequantizes
            what = f"quantized K/V ({name}) in host memory run on the CPU path"
            if backend == "cuda":
                raise ValueError(f"{what}: backend 'cuda' runs them from GPU memory only "
                                 f"(q8_0/q4_0); use 'auto' or 'reference'")
            return Choice("cpu", what)
        gpu_types = (GGML_TYPE_F16, *QUANT_KV_CTYPES) if mixed else QUANT_KV_CTYPES
        if f.kv_type not in gpu_types or v_type not in gpu_types:
            raise ValueError(f"quantized K/V ({name}) in GPU memory: no GPU kernel reads them (the GPU "
                             f"reads f16/bf16, q8_0 and q4_0, K and V of one type or f16/q8_0/q4_0 mixed); "
                             f"use those, or keep them on the host")
    elif mixed and on_device:
        raise ValueError(f"K {type_name(f.kv_type)} / V {type_name(v_type)} in GPU memory: the kernels read K "
                         f"and V of one float type (or f16 beside q8_0/q4_0)")
    if kernel == "reference":
        return Choice("reference", "kernel 'reference' requested")
    if mixed and f.kv_aligned:   # K and V of different types: the quantized one(s) as f16 copies
        if kernel in QUANT_READERS:
            raise ValueError(f"kernel {kernel!r} cannot run this call: it reads K and V of one type "
                             f"(K {type_name(f.kv_type)}, V {type_name(v_type)})")
        c = best_kernel(kernel, replace(f, kv_type=GGML_TYPE_F16, v_type=None, kv_aligned=True, kv_tma=True))
        return Choice(c.kernel, f"{c.reason}; K {type_name(f.kv_type)} / V {type_name(v_type)}: the quantized "
                                f"one converted to f16 once per call first")
    if quantized and f.kv_aligned and kernel not in QUANT_READERS:
        direct = _quant_direct(f) if kernel == "auto" else None
        if direct is not None:
            return direct
        c = best_kernel(kernel, replace(f, kv_type=GGML_TYPE_F16, kv_aligned=True, kv_tma=True))
        return Choice(c.kernel, f"{c.reason}; {type_name(f.kv_type)} K/V converted to f16 once per call "
                                f"first (as llama.cpp's tensor-core kernels do)")
    if kernel == "auto":
        kern, why = _choose_gpu(f.n_batch, f.gqa, f.head_dim_k, f.head_dim_v, f.kv_type)
        if kern == "reference":
            return Choice("reference", f"{why}; running the numpy reference on the host")
        if f.cell_reads is not None and f.tile_reads is not None and cells_why_not(f) is None \
                and f.cell_reads * CELLS_MIN_GAIN <= f.tile_reads:
            kern, why = "cells", (f"rows see few cells: {f.cell_reads:.0f} K/V cells per token and KV head "
                                  f"on their cell lists against {f.tile_reads:.0f} for {kern} "
                                  f"(gain >= {CELLS_MIN_GAIN:g}, the plan's counts)")
        if kern == "prefill" and f.kv_aligned and wgmma_why_not(f) is None:
            kern, why = "prefill-wgmma", f"{why}; sm_90a wgmma prefill (D {f.head_dim_k}, plain mask tiles)"
        min_work = DECODE_TMA_MIN_WORK_EVEN if f.work_even else DECODE_TMA_MIN_WORK
        if kern == "decode-tc" and f.work_tiles >= min_work \
                and f.kv_aligned and decode_tma_why_not(f) is None:
            kern, why = "decode-tma", (f"{why}; sm_90a persistent decode (D 128, plain, "
                                       f"{f.work_tiles} >= {min_work} group tiles"
                                       f"{', groups cut on their boundaries' if f.work_even else ''})")
    else:
        if kernel == "prefill-wgmma":
            why = wgmma_why_not(f, auto=False)
        elif kernel == "decode-tma":
            why = decode_tma_why_not(f)
        elif kernel == "cells":
            why = cells_why_not(f, auto=False)
        else:
            why = supports(kernel, f.head_dim_k, f.head_dim_v, f.kv_type)
        if why is not None:
            raise ValueError(f"kernel {kernel!r} cannot run this call: {why}")
        kern, why = kernel, f"kernel {kernel!r} requested"
    if not f.kv_aligned:
        return Choice("reference", "k/v pointers or byte strides are not aligned for the kernels (16 bytes; "
                                   "2 for q8_0/q4_0 blocks); running the numpy reference on the host")
    return Choice(kern, why)


from .knobs import count_sets as _count_sets  # noqa: E402  (the module is complete now)

_count_sets(__name__)   # every knob set from outside re-keys the call cache (knobs.py)
