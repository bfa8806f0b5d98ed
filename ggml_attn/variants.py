"""The catalogue of the kernels in ``cuda/``: which programs (:class:`Variant`: a source file and
the instances compiled from it) exist for which head sizes, K/V types and tunings, the instance
names, and which instances state their dynamic shared memory in the program (:func:`smem_expr`:
the launches read it from the cubin, the C++ formulas its one home).
``kernels.py`` compiles, caches, loads and launches them (and re-exports these names).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import lru_cache

from .block_types import BLOCK_TYPES, block_layout
from .gemm_tiles import (GEMMQ8_BLOCKS_PER_SM, GEMMQR_BLOCKS_PER_SM, GEMMQR_TYPE_IDS, GEMMQR_TYPES, GEMMQRM_TILE,
                         GEMMQS_BLOCKS_PER_SM, GEMMQW2_TYPES, GEMMQW_FORMS)
from .instances import KV_CTYPES, QUANT_KV_CTYPES, VEC_KV_CTYPES, template_expr

KV_TILE = 64  # FATTN_KV_TILE in fattn_common.cuh

# (head_dim_k, head_dim_v) pairs per family. Head sizes outside these fall back to the reference.
MMA_HEADS = ((40, 40), (64, 64), (72, 72), (80, 80), (96, 96), (112, 112), (128, 128),
             (192, 128), (192, 192), (256, 256), (320, 256))
VEC_HEADS = MMA_HEADS + ((512, 512), (576, 512))
# the vec kernel's quantized instances: rows of whole 32-value blocks
VEC_QUANT_HEADS = tuple(h for h in VEC_HEADS if h[0] % 32 == 0 and h[1] % 32 == 0)
# (NWQ, NWK, MT, ST): prefill 64 rows (2-stage ring) / 128 rows (FA2 order), decode-tc with a
# 2-stage ring (two blocks per SM at D 128; a 3-stage ring fits one, and was slower)
MMA_LAYOUTS = ((4, 1, 1, 2), (4, 1, 2, 1), (1, 4, 1, 2))
WIDE_MAX_HEAD = 128   # the 128-row prefill (MT = 2) is compiled for head_dim_k, head_dim_v <= this (registers)


def mma_layouts(dk: int, dv: int) -> tuple[tuple[int, int, int, int], ...]:
    """The (NWQ, NWK, MT, ST) instances compiled for head sizes (dk, dv)."""
    return tuple(l for l in MMA_LAYOUTS if l[2] == 1 or max(dk, dv) <= WIDE_MAX_HEAD)
VEC_ROWS = (1, 4, 8)             # R: query rows per vec block


def _chunks(d: int, lanes: int) -> int:
    return -(-(d // 8) // lanes)


def vec_lanes(dk: int) -> int:
    chk = dk // 8
    return 32 if chk >= 32 else 16 if chk > 8 else 8 if chk > 4 else 4


def _rows_fit(dk: int, dv: int, rows) -> tuple[int, ...]:
    """The R of ``rows`` whose Q + accumulator registers per lane stay <= 160 (the CUDA-core
    kernels fattn_vec and fattn_cells: 8 floats per 16-byte chunk of a lane, per query row)."""
    lanes = vec_lanes(dk)
    per_row = 8 * (_chunks(dk, lanes) + _chunks(dv, lanes))
    return tuple(r for r in rows if per_row * r <= 160)


def vec_rows_allowed(dk: int, dv: int) -> tuple[int, ...]:
    """R values compiled for (dk, dv): keep Q + accumulator registers per lane <= 160."""
    return _rows_fit(dk, dv, VEC_ROWS)


# Cell-list decode (fattn_cells.cu): head sizes (the pairs the CUDA-core decode kernel takes up to
# head_dim_k 256; larger ones spill with 4 cells in flight per group) and query heads per block (R, a
# power of 2 that divides gqa; the GQA group of one KV head, or part of it)
CELLS_HEADS = tuple(h for h in VEC_HEADS if h[0] <= 256)
CELLS_ROWS = (1, 2, 4, 8)


@dataclass(frozen=True)
class CellsTune:
    """Compile-time tuning of fattn_cells (its template parameters after R; bench/NOTES.md, "cells
    v2 sweep"): ``u`` list entries per group and step (cells in flight per group), ``pf`` prefetch
    depth (0: none; 1: the next step's list entries loaded before this step's math; 2: the next
    step's K/V rows too, list entries two steps ahead), ``minb`` the minimum resident blocks per
    SM of ``__launch_bounds__`` (caps registers at 64K / (128 minb); 0: no hint), ``rmax`` the
    most query heads per block (R)."""
    u: int = 2
    pf: int = 1
    minb: int = 0
    rmax: int = 8

    @property
    def label(self) -> str:
        """Short name: "" for the default, else e.g. "u8-pf1-minb3-r2" (non-default fields)."""
        d = CellsTune()
        parts = [f"{k}{getattr(self, k)}" for k in ("u", "pf", "minb")
                 if getattr(self, k) != getattr(d, k)]
        if self.rmax != d.rmax:
            parts.append(f"r{self.rmax}")
        return "-".join(parts)

    @classmethod
    def parse(cls, label: str) -> "CellsTune":
        """The tune of a :attr:`label` ("" or "default": the default; "cells-" prefix allowed)."""
        label = label.strip()
        label = label[len("cells"):].lstrip("-") if label.startswith("cells") else label
        kw = {}
        for part in filter(None, ("" if label == "default" else label).split("-")):
            m = re.fullmatch(r"(u|pf|minb|r)(\d+)", part)
            if not m:
                raise ValueError(f"bad cells tune {label!r}: parts are u<N>, pf<N>, minb<N>, r<N>")
            kw["rmax" if m.group(1) == "r" else m.group(1)] = int(m.group(2))
        t = cls(**kw)
        if t.u not in (1, 2, 4, 8, 16) or t.pf not in (0, 1, 2) or not 0 <= t.minb <= 8 or t.rmax not in CELLS_ROWS:
            raise ValueError(f"bad cells tune {label!r}: u 1/2/4/8/16, pf 0-2, minb 0-8, r 1/2/4/8")
        return t


CELLS_DEFAULT = CellsTune()
def cells_rows_allowed(dk: int, dv: int, tune: CellsTune | None = None) -> tuple[int, ...]:
    """R values compiled for (dk, dv): Q + accumulator registers per lane <= 160, as fattn_vec,
    and R <= ``tune.rmax``."""
    rmax = (tune or CELLS_DEFAULT).rmax
    return _rows_fit(dk, dv, (r for r in CELLS_ROWS if r <= rmax)) or (1,)


# The kernel templates launched with dynamic shared memory: each source defines, next to the
# template, a __device__ int variable template ``<kernel>_smem`` of the same parameters holding the
# bytes an instance takes (e.g. fattn_mma_smem, the end of cuda/fattn_mma.cu). Every other kernel
# takes none (static shared memory only).
SMEM_KERNELS = ("fattn_mma", "fattn_vec", "fattn_cells", "dense_gemm_q8", "dense_gemm_qs", "dense_gemm_qr",
                "dense_gemm_qw", "fattn_wgmma_ws", "fattn_decode_tma", "fattn_decode_rows")


def smem_expr(name: str) -> str | None:
    """The NVRTC name expression of the size variable of kernel instance ``name`` (a name
    expression, e.g. "fattn_vec<128, 128, __half, 4>" -> "&fattn_vec_smem<128, 128, __half, 4>"),
    or None for a kernel without one (not a template of SMEM_KERNELS)."""
    base, lt, args = name.partition("<")
    return f"&{base}_smem<{args}" if lt and base in SMEM_KERNELS else None


# A program of more instances than SHARD_NAMES (per family; SHARD_NAMES_DEFAULT else) is compiled
# and loaded as several (Variant.shards): NVRTC's time grows faster than a program's instances
# -- on 2 cores the 24 Q6_K 8-bit GEMVs took 6.0 s as one program and 1.4-1.7 s as each of three
# of 8, the three F16 mma instances 5.0 s together and ~1 s each apart -- and the shards compile
# in parallel threads (kernels.precompile: a first run's kernels are ready when its longest shard
# is, 7.3 s of a 9.5 s load on the H100 at dc1de0f) and load on first use (kernels.get_function).
SHARD_NAMES = {"mma": 1, "mma-ext": 1, "vec": 1, "util": 8}   # (util: small kernels, one program)
SHARD_NAMES_DEFAULT = 6


@dataclass(frozen=True)
class Variant:
    """One NVRTC program: a source file and the kernel instances compiled from it."""
    family: str            # "util" | "mma" | "mma-ext" | "vec" | "cells" | "dense" ...
    source: str            # file name in cuda/
    names: tuple[str, ...]  # name expressions (templates) or extern "C" names
    options: tuple[str, ...] = ()   # NVRTC options of this program (e.g. "-DNAME=1")
    # "a": compiled for the architecture-specific target (sm_90a: wgmma, setmaxnreg), which
    # loads on that compute capability only; "": the portable sm_XY target
    arch_suffix: str = ""

    @property
    def label(self) -> str:
        return f"{self.family}:{','.join(self.names)}"

    def shards(self) -> tuple["Variant", ...]:
        """The programs this one is compiled and loaded as: its names in order, at most
        SHARD_NAMES of its family's each (itself when they fit one)."""
        return _shards(self, SHARD_NAMES.get(self.family, SHARD_NAMES_DEFAULT))

    def shard_of(self, name: str) -> "Variant":
        """The shard that holds instance ``name`` (KeyError when none does)."""
        return _shard_index(self, SHARD_NAMES.get(self.family, SHARD_NAMES_DEFAULT))[name]


@lru_cache(maxsize=4096)
def _shards(v: Variant, k: int) -> tuple[Variant, ...]:
    k = max(1, int(k))
    if len(v.names) <= k:
        return (v,)
    return tuple(replace(v, names=v.names[i:i + k]) for i in range(0, len(v.names), k))


@lru_cache(maxsize=4096)
def _shard_index(v: Variant, k: int) -> dict[str, Variant]:
    return {n: s for s in _shards(v, k) for n in s.names}


UTIL_NAMES = ("fattn_mask_rows", "fattn_mask_scan", "fattn_mask_compact", "fattn_combine", "fattn_cell_lists",
              "fattn_dequant_kv", "fattn_quant_q8x")
CELL_LIST_THREADS = 256   # FATTN_CELL_THREADS in fattn_util.cu (fattn_cell_lists' block)


def util_variant() -> Variant:
    return Variant("util", "fattn_util.cu", UTIL_NAMES)


GEMV_MAX_TOKENS = 4   # dense_gemv instances: 1..4 tokens
GEMV_WARPS = 4        # rows per dense_gemv block (one warp each; GEMV_WARPS in dense.cu)
GEMV_UNROLLS = (4, 8)  # 16-byte weight loads in flight per lane (instances)
GEMV_UNROLL = 4       # the one the graphs use (bench/NOTES.md, "dense")


def gemv_name(n_tok: int, unroll: int = GEMV_UNROLL) -> str:
    return f"dense_gemv<{n_tok}, {unroll}>"


DENSE_NAMES = tuple(gemv_name(nt, u) for nt in range(1, GEMV_MAX_TOKENS + 1) for u in GEMV_UNROLLS) + \
    ("dense_rms_norm", "dense_kv_store", "dense_cast_f16", "dense_silu_mul", "dense_gelu_mul")


def dense_variant() -> Variant:
    """The full block's dense ops (``cuda/dense.cu``, used by ``graph/xp_matmul.py``)."""
    return Variant("dense", "dense.cu", DENSE_NAMES)


GEMVQ_TOKENS = (1, 2, 4, 8, 16)   # dense_gemv_q instances: NT, each running n_tok <= NT tokens
GEMVQ_MAX_TOKENS = GEMVQ_TOKENS[-1]


GEMVQ_WARPS = 8   # warps a dense_gemv_q block (GEMVQ_WARPS in dense_q.cu): 8 beat 4 everywhere (H100, 56bffb3)
# The benchmark's A/B instances of dense_gemv_q: warps a block -> their token counts NT (512
# threads cap a thread at 128 registers: 16 warps spill from NT 4).
GEMVQ_WARPS_X = {4: GEMVQ_TOKENS, 16: (1, 2)}


def gemv_q_name(type_id: int, n_tok: int, warps: int = GEMVQ_WARPS) -> str:
    """The ``dense_gemv_q`` instance of ggml type ``type_id`` that runs ``n_tok`` tokens (the
    smallest NT >= n_tok) in blocks of ``warps`` warps."""
    nt = next(t for t in GEMVQ_TOKENS if t >= n_tok)
    return f"dense_gemv_q<{type_id}, {nt}>" if warps == GEMVQ_WARPS else f"dense_gemv_q<{type_id}, {nt}, {warps}>"


def dense_q_x_variant(type_id: int, warps: int) -> Variant:
    """The A/B instances of ``dense_gemv_q`` with ``warps`` (one of GEMVQ_WARPS_X) warps a block
    for ``tools/dev/gpu_dense_q_bench.py``; not shipped (the backend runs dense_q_variant's)."""
    if warps not in GEMVQ_WARPS_X:
        raise ValueError(f"dense_gemv_q A/B instances have {tuple(GEMVQ_WARPS_X)} warps a block, not {warps}")
    return Variant("dense-q-x", "dense_q.cu", tuple(gemv_q_name(type_id, nt, warps) for nt in GEMVQ_WARPS_X[warps]))


def dense_q_variant(type_id: int) -> Variant:
    """The matmuls over one weight block type (``cuda/dense_q.cu``; ``type_id``: a ggml type id of
    ``block_types``): one program per type, so a model loads the types it holds."""
    return Variant("dense-q", "dense_q.cu", tuple(gemv_q_name(type_id, nt) for nt in GEMVQ_TOKENS) +
                   (f"dense_gemm_q<{type_id}>",) +
                   tuple(staged_instance("dense_gemm_qs", type_id, bn) for bn in GEMMQS_BLOCKS_PER_SM) +
                   tuple(staged_instance("dense_gemm_qr", type_id, bn) for bn in GEMMQR_BLOCKS_PER_SM
                         if type_id in GEMMQR_TYPE_IDS) +
                   ("dense_splitk_sum", f"dense_dequant_f16<{type_id}>",
                    f"dense_get_rows_q<{type_id}>"))


def dense_qrm_variant(type_id: int) -> Variant:
    """dense_gemm_qr's wide tile over two row halves (kernel ``dense_gemm_qrm``: the instance
    ``dense_gemm_qr<T, 64, 2>`` of cuda/dense_q.cu) for a type of GEMMQR_TYPE_IDS: a program of its
    own, compiled where it is routed (an A/B: matmul_dispatch.QRGEMM_ROWS)."""
    if type_id not in GEMMQR_TYPE_IDS:
        raise ValueError(f"dense_gemm_qrm decodes {', '.join(GEMMQR_TYPES)} blocks, not ggml type {type_id}")
    return Variant("dense-qrm", "dense_q.cu", (staged_instance("dense_gemm_qrm", type_id, GEMMQRM_TILE[1]),))


def dense_qrg_variant(type_id: int) -> Variant:
    """The gated FFN's two products in one launch (kernel ``dense_gemm_qrg``: the instance
    ``dense_gemm_qr<T, 64, 2, 1>`` of cuda/dense_q.cu, the gate's rows in one row half and the up's
    in the other, silu(gate) * up stored) and the sum of its split's partial sums
    (``dense_splitk_gated``) for a type of GEMMQR_TYPE_IDS: a program of its own, compiled where it
    is routed (an A/B: matmul_dispatch.QR_GATED)."""
    if type_id not in GEMMQR_TYPE_IDS:
        raise ValueError(f"dense_gemm_qrg decodes {', '.join(GEMMQR_TYPES)} blocks, not ggml type {type_id}")
    return Variant("dense-qrg", "dense_q.cu", (staged_instance("dense_gemm_qrg", type_id, GEMMQRM_TILE[1]),
                                               "dense_splitk_gated"))


def qr_finish_variant(v: Variant) -> Variant:
    """Program ``v`` (dense_q_variant's, dense_qrm_variant's or dense_qrg_variant's) with
    dense_gemm_qr's fused split finish compiled in (cuda/dense_q.cu QR_SPLIT_FINISH 1: a split
    launch with tile counters adds its splits itself, no dense_splitk_sum): an A/B program
    (matmul_dispatch.QR_SPLIT_FINISH)."""
    if v.source != "dense_q.cu":
        raise ValueError(f"the fused split finish is dense_gemm_qr's (cuda/dense_q.cu), not {v.source}'s")
    return replace(v, options=v.options + ("-DQR_SPLIT_FINISH=1",))


def staged_instance(kernel: str, type_id: int, bn: int) -> str:
    """The instance of staged GEMM ``kernel`` (dense_gemm_qs, dense_gemm_qr, dense_gemm_qrm: that
    is dense_gemm_qr<T, 64, 2>, two row halves; dense_gemm_qrg: dense_gemm_qr<T, 64, 2, 1>, the
    gated form) for blocks of ``type_id`` at tile ``bn``."""
    if kernel in ("dense_gemm_qrm", "dense_gemm_qrg"):
        if bn != GEMMQRM_TILE[1]:
            raise ValueError(f"{kernel} has tiles of {GEMMQRM_TILE[1]} tokens, not {bn}")
        return f"dense_gemm_qr<{type_id}, {bn}, 2{', 1' if kernel == 'dense_gemm_qrg' else ''}>"
    return f"{kernel}<{type_id}, {bn}>"


MODEL_OPS_NAMES = ("xp_get_rows_f16", "xp_get_rows_f32", "xp_add_bias", "xp_rope", "xp_rope_store")


def model_ops_variant() -> Variant:
    """A real model's device-graph ops (``cuda/model_ops.cu``: get_rows, rope, add_bias; used by
    ``graph/xp_ops.py``)."""
    return Variant("model-ops", "model_ops.cu", MODEL_OPS_NAMES)


Q8X_TOKENS = (1, 2, 4, 8, 16)  # its instances: NT, each running n_tok <= NT tokens
Q8X_PLAIN_TOKENS = (1, 2, 4)   # dense_gemv_q8x's (the fallback for unaligned rows; 8 spilled Q4_0's words)
Q8X_WARPS = 8                 # warps a dense_gemv_q8x block (Q8X_WARPS in dense_q8x.cu)
Q8X_SWARPS = 4                # warps a dense_gemv_q8x_s block (Q8X_SWARPS: its slots' shared memory)
Q8XV_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0")  # dense_gemv_q8x_v's block types (qb_k4_lane; groups staged: Q8xVGroup)
Q8XV_TYPE_IDS = tuple(block_layout(t).type_id for t in Q8XV_TYPES)
Q8XV_TOKENS = (1, 2, 4)        # its instances
Q8X_VWARPS = 4                # warps a dense_gemv_q8x_v block (Q8X_VWARPS in dense_q8x.cu)
Q8XR_TYPES = Q8XV_TYPES        # dense_gemv_q8x_r's block types (a chunk is the vector form's step or group)
Q8XR_TOKENS = (1, 2, 4)        # its instances (Q8X_SWARPS warps a block)
# The 8-bit-activation GEMV's forms: kernel, instances (NT), warps a block.
Q8X_FORMS = {"staged": ("dense_gemv_q8x_s", Q8X_TOKENS, Q8X_SWARPS),
             "plain": ("dense_gemv_q8x", Q8X_PLAIN_TOKENS, Q8X_WARPS),
             "vector": ("dense_gemv_q8x_v", Q8XV_TOKENS, Q8X_VWARPS),
             "ring": ("dense_gemv_q8x_r", Q8XR_TOKENS, Q8X_SWARPS)}
# The forms that read some block types only (the others read every one), and those whose grid is one wave.
Q8X_FORM_TYPES = {"vector": Q8XV_TYPES, "ring": Q8XR_TYPES}
Q8X_ONE_WAVE = ("ring",)
Q8X_GATED_FORMS = ("vector", "ring")   # forms with an instance for every mode (G 1) and one for modes 0 / 1 (G 0)
Q8X_SPLIT_TOKENS = {"vector": (1,)}    # forms' instances running a row on two warps (modes 0 / 1, G 2), their NT
Q8X_QOUT_TOKENS = (1,)                 # NT of the gated forms' instances that write their output's 8-bit form too (G + 4)


def q8x_form_reads(form: str, weight_type: str) -> bool:
    """Whether the 8-bit GEMV's ``form`` (Q8X_FORMS) has instances for ``weight_type``."""
    return weight_type in Q8X_FORM_TYPES.get(form, (weight_type,))


def q8x_name(type_id: int, n_tok: int, form: str = "staged", gated: bool = False, split: bool = False,
             qout: bool = False) -> str:
    """The 8-bit-activation GEMV instance of ``type_id`` for ``n_tok`` tokens (the smallest NT >=
    n_tok) in ``form``: ``staged`` (``dense_gemv_q8x_s``, rows streamed through shared memory; rows
    16-byte aligned), ``plain`` (``dense_gemv_q8x``, any alignment), ``vector``
    (``dense_gemv_q8x_v``, 16-byte loads straight from global memory; Q8XV_TYPES, rows 16-byte
    aligned) or ``ring`` (``dense_gemv_q8x_r``, the vector form's arithmetic over a wave of warps
    each streaming several rows through a ring of shared-memory slots; Q8XR_TYPES, rows 16-byte
    aligned); at most max(NT) of the form's instances (Q8X_FORMS). The vector and ring forms have an
    instance for every mode (``gated`` True) and one for modes 0 / 1 only (``gated`` False; Q8X_GATED_FORMS);
    the vector form at one token also one for modes 0 / 1 that runs a row on two warps (``split``:
    Q8X_SPLIT_TOKENS, G 2). ``qout``: the instance that also writes its output's 8-bit form (G + 4;
    the forms of Q8X_GATED_FORMS at the tokens of Q8X_QOUT_TOKENS)."""
    kernel, tokens, _ = Q8X_FORMS[form]
    if split:
        assert not gated, "the split instances run modes 0 / 1"
        tokens = Q8X_SPLIT_TOKENS[form]
    nt = next(t for t in tokens if t >= n_tok)
    g = (2 if split else int(gated)) + 4 * bool(qout)
    assert not qout or (form in Q8X_GATED_FORMS and nt in Q8X_QOUT_TOKENS), "8-bit output: vector / ring, one token"
    return f"{kernel}<{type_id}, {nt}, {g}>" if form in Q8X_GATED_FORMS else f"{kernel}<{type_id}, {nt}>"


def dense_q8x_variant(type_id: int) -> Variant:
    """The block matmuls with 8-bit activations (``cuda/dense_q8x.cu``) over one block type
    (``type_id``: a ggml type id of ``block_types``): the GEMV staged and not, the tiled GEMM
    (``dense_gemm_q8`` with its wide and narrow tiles: gemm_tiling, gemm_q_grid) and the
    activations' quantization."""
    wtype = next(t for t in BLOCK_TYPES if block_layout(t).type_id == type_id)
    gemvs = tuple(q8x_name(type_id, nt, form, g) for form, (_, tokens, _) in Q8X_FORMS.items()
                  if q8x_form_reads(form, wtype) for nt in tokens
                  for g in ((False, True) if form in Q8X_GATED_FORMS else (False,)))
    gemvs += tuple(q8x_name(type_id, nt, form, split=True) for form, tokens in Q8X_SPLIT_TOKENS.items()
                   if q8x_form_reads(form, wtype) for nt in tokens)
    return Variant("dense-q8x", "dense_q8x.cu", gemvs +
                   tuple(f"dense_gemm_q8<{type_id}, {bn}>" for bn in GEMMQ8_BLOCKS_PER_SM) + ("dense_quant_q8x",))


def dense_q8x_qout_variant(type_id: int) -> Variant | None:
    """The one-token 8-bit GEMVs of ``cuda/dense_q8x.cu`` that also write their output's 8-bit
    form (q8x_name's ``qout``: the vector and ring forms, each of their modes' instances), a
    program of its own -- compiled and loaded only where they run (matmul_dispatch.GEMV_QUANT_OUT)
    -- for block type ``type_id``; None for a type those forms do not read."""
    wtype = next(t for t in BLOCK_TYPES if block_layout(t).type_id == type_id)
    names = tuple(q8x_name(type_id, nt, form, gated=g, split=sp, qout=True) for form in Q8X_GATED_FORMS
                  if q8x_form_reads(form, wtype) for nt in Q8X_QOUT_TOKENS
                  for g, sp in ((False, False), (True, False)) + (((False, True),) if nt in Q8X_SPLIT_TOKENS.get(form, ()) else ()))
    return Variant("dense-q8x-qout", "dense_q8x.cu", names) if names else None


def dense_q_variants(make=dense_q_variant) -> list[Variant]:
    """``make`` (dense_q_variant, dense_q8x_variant, dense_q8x_qout_variant) of every block type
    (those it has one for)."""
    return [v for v in (make(block_layout(n).type_id) for n in BLOCK_TYPES) if v is not None]


def mma_name(dk: int, dv: int, kv_type: int, nwq: int, nwk: int, mt: int = 1, st: int = 2,
             ext: bool = False) -> str:
    """``ext``: the instance with softcap and ALiBi (the plain one folds the scale into Q)."""
    return template_expr("fattn_mma", dk, dv, KV_CTYPES[kv_type], nwq, nwk, mt, st, ext)


def vec_name(dk: int, dv: int, kv_type: int, rows: int) -> str:
    return f"fattn_vec<{dk}, {dv}, {VEC_KV_CTYPES[kv_type]}, {rows}>"


def cells_name(dk: int, dv: int, kv_type: int, rows: int, tune: CellsTune | None = None) -> str:
    t = tune or CELLS_DEFAULT
    return f"fattn_cells<{dk}, {dv}, {KV_CTYPES[kv_type]}, {rows}, {t.u}, {t.pf}, {t.minb}>"


def cells_variant(dk: int, dv: int, kv_type: int, tune: CellsTune | None = None) -> Variant:
    """One program per (head sizes, K/V type, tuning): its R instances (cells_rows_allowed)."""
    t = tune or CELLS_DEFAULT
    return Variant("cells" if t == CELLS_DEFAULT else "cells-x", "fattn_cells.cu",
                   tuple(cells_name(dk, dv, kv_type, r, t) for r in cells_rows_allowed(dk, dv, t)))


def cells_qo_name(name: str) -> str:
    """The QO instance of ``cells_name``'s ``name``: its output in 8-bit form as well
    (cuda/fattn_cells.cu, ggml_attn/q8_out.py)."""
    return f"{name[:-1]}, 1>"


def cells_qo_variant(dk: int, dv: int, kv_type: int, tune: CellsTune | None = None) -> Variant:
    """The QO instances of :func:`cells_variant`'s program (head_dim_v a multiple of 32), a program
    of their own: compiled where a graph asks for the attention's 8-bit output."""
    if dv % 32:
        raise ValueError(f"fattn_cells' QO instances need head_dim_v a multiple of 32, got {dv}")
    return cells_qo_of(cells_variant(dk, dv, kv_type, tune))


def cells_qo_of(variant: Variant) -> Variant:
    """:func:`cells_qo_variant` of a :func:`cells_variant` program."""
    return Variant("cells-qo", variant.source, tuple(cells_qo_name(n) for n in variant.names))


def mma_variant(dk: int, dv: int, kv_type: int, ext: bool = False) -> Variant:
    """One program per (head sizes, K/V type, ext): plain calls never compile the ext code."""
    return Variant("mma-ext" if ext else "mma", "fattn_mma.cu",
                   tuple(mma_name(dk, dv, kv_type, *lay, ext=ext) for lay in mma_layouts(dk, dv)))


def vec_variant(dk: int, dv: int, kv_type: int) -> Variant:
    return Variant("vec", "fattn_vec.cu",
                   tuple(vec_name(dk, dv, kv_type, r) for r in vec_rows_allowed(dk, dv)))


def hopper_probe_variant() -> Variant:
    """The checks of cuda/hopper_common.cuh's building blocks (tests/test_gpu_hopper.py), for
    sm_90a only; not part of :func:`all_variants` (sm_80/sm_90 cannot compile it)."""
    return Variant("hopper-probe", "hopper_probe.cu",
                   ("hopper_probe_gemm", "hopper_probe_gemm_rs", "hopper_probe_tma", "hopper_probe_sw128"),
                   arch_suffix="a")


def wgmma_variant(name: str) -> Variant:
    """The program of one sm_90a prefill instance (cuda/fattn_wgmma.cu; ``name``: a
    wgmma_shape.WsConfig's name): one program per instance, so that a first call compiles the
    instance it runs alone (1.4 s on a 2-core x86-64 machine, against 17.6 s for every instance
    of the file)."""
    return Variant("wgmma", "fattn_wgmma.cu", (name,), arch_suffix="a")


def decode_tma_variant(name: str) -> Variant:
    """The program of one sm_90a decode instance (cuda/fattn_decode_tma.cu, or for the whole-rows
    instances cuda/fattn_decode_rows.cu; ``name``: a decode_tma_shape.Cfg's name), one program
    per instance as :func:`wgmma_variant`."""
    from .decode_tma_shape import whole_rows
    src = "fattn_decode_rows.cu" if whole_rows(name) else "fattn_decode_tma.cu"
    return Variant("decode-tma", src, (name,), arch_suffix="a")


def dense_qw_variant(type_id: int) -> Variant:
    """The wgmma tiled block GEMM of one block type of GEMMQR_TYPE_IDS (cuda/dense_qw.cu, sm_90a):
    ``dense_gemm_qw<T, RM, H>`` of each of GEMMQW_FORMS (RM 2 for GEMMQW2_TYPES only)."""
    if type_id not in GEMMQR_TYPE_IDS:
        raise ValueError(f"dense_gemm_qw decodes {', '.join(GEMMQR_TYPES)} blocks, not ggml type {type_id}")
    names = (qw_instance(type_id, kernel) for kernel in GEMMQW_FORMS)
    return Variant("dense-qw", "dense_qw.cu", tuple(n for n in names if n), arch_suffix="a")


def qw_instance(type_id: int, kernel: str) -> str | None:
    """The instance of dense_gemm_qw form ``kernel`` (gemm_tiles.GEMMQW_FORMS) for blocks of
    ``type_id``, None where that form's stages do not fit (RM 2 past GEMMQW2_TYPES)."""
    rm, h = GEMMQW_FORMS[kernel]
    if rm == 2 and type_id not in (block_layout(t).type_id for t in GEMMQW2_TYPES):
        return None
    return f"dense_gemm_qw<{type_id}, {rm}, {h}>"


def hopper_variants() -> list[Variant]:
    """Every sm_90a program (the CI compile test walks this list for sm_90a): the probe, every
    instance of wgmma_shape's WS_CONFIGS and WS_DIAG and of decode_tma_shape's CONFIGS, and the
    wgmma block GEMM of each type it reads."""
    from .decode_tma_shape import CONFIGS
    from .wgmma_shape import WS_CONFIGS, WS_DIAG
    return [hopper_probe_variant()] + [wgmma_variant(c.name) for c in (*WS_CONFIGS.values(), *WS_DIAG.values())] + \
        [decode_tma_variant(c.name) for c in CONFIGS.values()] + [dense_qw_variant(t) for t in GEMMQR_TYPE_IDS]


HOPPER_ARCH = "sm_90a"   # the target of every Variant with arch_suffix "a" (compile tests)


def all_variants() -> list[Variant]:
    """Every program the backend can compile (the CI compile test walks this list)."""
    out = [util_variant(), dense_variant(), model_ops_variant(), *dense_q_variants(),
           *(dense_qrm_variant(t) for t in GEMMQR_TYPE_IDS), *(dense_qrg_variant(t) for t in GEMMQR_TYPE_IDS),
           *dense_q_variants(dense_q8x_variant), *dense_q_variants(dense_q8x_qout_variant)]
    for t in KV_CTYPES:
        out += [mma_variant(dk, dv, t, ext) for dk, dv in MMA_HEADS for ext in (False, True)]
        out += [vec_variant(dk, dv, t) for dk, dv in VEC_HEADS]
        out += [cells_variant(dk, dv, t) for dk, dv in CELLS_HEADS]
        out += [cells_qo_variant(dk, dv, t) for dk, dv in CELLS_HEADS if dv % 32 == 0]
    for t in QUANT_KV_CTYPES:
        out += [vec_variant(dk, dv, t) for dk, dv in VEC_QUANT_HEADS]
    return out
