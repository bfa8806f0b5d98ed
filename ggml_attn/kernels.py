"""NVRTC compilation, cubin cache and raw-pointer launches of the kernels in ``cuda/``.

One job: turn a *variant* (kernel family, head sizes, K/V dtype) into loaded CUDA functions
and launch them with a packed parameter block. No tensor logic lives here.

- Compilation uses the low-level NVRTC binding (``cupy_backends.cuda.libs.nvrtc``), which works
  without a GPU or driver (CI compiles every variant for sm_80 and sm_90 this way).
- Cubins are cached in memory and on disk (``$GGML_ATTN_CACHE_DIR`` or ``~/.cache/ggml-attn``),
  keyed by a hash of the sources, the instance names, the full option list (include
  directories too), the content of the CUDA headers' cuda_fp16.h, the NVRTC version and the
  target architecture. A cached cubin the driver refuses to load is recompiled.
- Launches go through ``cuLaunchKernel`` with a ctypes parameter block: no CuPy array is built
  on the hot path.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import re
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .instances import KV_CTYPES, QUANT_KV_CTYPES, VEC_KV_CTYPES, template_expr  # noqa: F401  (re-exported)

# ---------------------------------------------------------------------------------------
# variants
KV_TILE = 64  # FATTN_KV_TILE in fattn_common.cuh

# (D_k, D_v) pairs per family. Head sizes outside these fall back to the reference.
MMA_HEADS = ((40, 40), (64, 64), (72, 72), (80, 80), (96, 96), (112, 112), (128, 128),
             (192, 128), (192, 192), (256, 256), (320, 256))
VEC_HEADS = MMA_HEADS + ((512, 512), (576, 512))
# the vec kernel's quantized instances: rows of whole 32-value blocks
VEC_QUANT_HEADS = tuple(h for h in VEC_HEADS if h[0] % 32 == 0 and h[1] % 32 == 0)
# (NWQ, NWK, MT, ST): prefill 64 rows (2-stage ring) / 128 rows (FA2 order), decode-tc with a
# 2-stage ring (two blocks per SM at D 128; a 3-stage ring fits one, and was slower)
MMA_LAYOUTS = ((4, 1, 1, 2), (4, 1, 2, 1), (1, 4, 1, 2))
WIDE_MAX_HEAD = 128   # the 128-row prefill (MT = 2) is compiled for D_k, D_v <= this (registers)


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
# D_k 256; larger ones spill with 4 cells in flight per group) and query heads per block (R, a
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
# The variants tools/dev/gpu_batched_attn_bench.py times (rows "cells-<label>") and the GPU tests run
# (tests/test_gpu_kernels.py), selected by cuda_launch.CELLS_TUNE. Only the default is in
# all_variants() (the CI compile); tests/test_cells.py compiles these. Device time of the batched
# bench's 64-sequence step at b95d488 (H200, L2-cold K/V; bench/NOTES.md, "cells v2 sweep"): the
# default (then labelled u2-pf1) 30.1 us, the other variants 31.0-43.5. Labels name the fields
# that differ from the default, so that run's labels (default U 4, PF 0) read differently now.
CELLS_SWEEP = (
    CELLS_DEFAULT,                                        # U 2, PF 1, R 4 at gqa 4: 128 registers, 4 blocks/SM
    CellsTune(u=4, pf=0),                                 # the first default: 35.2 us
    CellsTune(pf=0),                                      # no prefetch: 32.4
    CellsTune(pf=2, rmax=4),                              # K/V rows a step ahead: 33.4
    CellsTune(u=4, pf=0, rmax=2),                         # 2 heads per block: 31.0
    CellsTune(minb=6, rmax=2),                            # 80 registers, 6 blocks/SM: 31.5
    CellsTune(pf=2, minb=8, rmax=1),                      # one head per block, 64 registers: 35.1
)


def cells_rows_allowed(dk: int, dv: int, tune: CellsTune | None = None) -> tuple[int, ...]:
    """R values compiled for (dk, dv): Q + accumulator registers per lane <= 160, as fattn_vec,
    and R <= ``tune.rmax``."""
    rmax = (tune or CELLS_DEFAULT).rmax
    return _rows_fit(dk, dv, (r for r in CELLS_ROWS if r <= rmax)) or (1,)


def cells_smem_bytes(dk: int, dv: int, rows: int) -> int:
    """Dynamic shared memory of fattn_cells (mirror of CellsCfg::SMEM in fattn_cells.cu)."""
    ng = 4 * (32 // vec_lanes(dk))
    return 4 * ng * rows * (dv + 3)


def mma_smem_bytes(dk: int, dv: int, nwq: int, nwk: int, mt: int = 1, st: int = 2) -> int:
    """Dynamic shared memory of fattn_mma (mirror of MmaCfg::SMEM in fattn_mma.cu)."""
    bk = KV_TILE
    dkp, dvp = -(-dk // 16) * 16, -(-dv // 16) * 16
    stages = 1 if mt > 1 else st if dkp + dvp <= 512 else 2   # MmaCfg::STAGES
    sk, sv, so = dkp + 8, dvp + 8, dvp + 4
    bm = 16 * mt * nwq
    pipe = 2 * (bm * sk + stages * bk * (sk + sv) + stages * bm * (bk + 8))
    epi = 4 * nwk * bm * (so + 2) if nwk > 1 else 0
    return max(pipe, epi)


def vec_smem_bytes(dk: int, dv: int, rows: int) -> int:
    """Dynamic shared memory of fattn_vec (mirror of VecCfg::SMEM in fattn_vec.cu)."""
    ng = 4 * (32 // vec_lanes(dk))
    return 4 * (rows * KV_TILE + 3 * rows + ng * rows * dv)


@dataclass(frozen=True)
class Variant:
    """One NVRTC program: a source file and the kernel instances compiled from it."""
    family: str            # "util" | "mma" | "mma-ext" | "mma-nat" | "vec" | "cells" | "dense"
    source: str            # file name in cuda/
    names: tuple[str, ...]  # name expressions (templates) or extern "C" names
    options: tuple[str, ...] = ()   # NVRTC options of this program (e.g. "-DNAME=1")
    # "a": compiled for the architecture-specific target (sm_90a: wgmma, setmaxnreg), which
    # loads on that compute capability only; "": the portable sm_XY target
    arch_suffix: str = ""

    @property
    def label(self) -> str:
        return f"{self.family}:{','.join(self.names)}"


UTIL_NAMES = ("fattn_mask_rows", "fattn_mask_scan", "fattn_mask_compact", "fattn_combine", "fattn_cell_lists",
              "fattn_dequant_kv")
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


def gemv_q_name(type_id: int, n_tok: int) -> str:
    """The ``dense_gemv_q`` instance of ggml type ``type_id`` that runs ``n_tok`` tokens (the
    smallest NT >= n_tok)."""
    nt = next(t for t in GEMVQ_TOKENS if t >= n_tok)
    return f"dense_gemv_q<{type_id}, {nt}>"


def dense_q_variant(type_id: int) -> Variant:
    """The matmuls over one weight block type (``cuda/dense_q.cu``; ``type_id``: a ggml type id of
    ``block_types``): one program per type, so a model loads the types it holds."""
    return Variant("dense-q", "dense_q.cu", tuple(gemv_q_name(type_id, nt) for nt in GEMVQ_TOKENS) +
                   (f"dense_dequant_f16<{type_id}>", f"dense_get_rows_q<{type_id}>"))


MODEL_OPS_NAMES = ("xp_get_rows_f16", "xp_get_rows_f32", "xp_add_bias", "xp_rope")


def model_ops_variant() -> Variant:
    """A real model's device-graph ops (``cuda/model_ops.cu``: get_rows, rope, add_bias; used by
    ``graph/xp_ops.py``)."""
    return Variant("model-ops", "model_ops.cu", MODEL_OPS_NAMES)


def dense_q_variants() -> list[Variant]:
    from .block_types import BLOCK_TYPES, block_layout
    return [dense_q_variant(block_layout(n).type_id) for n in BLOCK_TYPES]


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


def mma_variant(dk: int, dv: int, kv_type: int, ext: bool = False, nat: bool = False) -> Variant:
    """One program per (head sizes, K/V type, ext): plain calls never compile the ext code.
    ``nat`` (plain instances only): scores in natural units (FATTN_NAT_SCORES in fattn_mma.cu)."""
    if nat and ext:
        raise ValueError("natural-unit scores are for the plain instances (ext keeps the log2 domain)")
    return Variant("mma-ext" if ext else "mma-nat" if nat else "mma", "fattn_mma.cu",
                   tuple(mma_name(dk, dv, kv_type, *lay, ext=ext) for lay in mma_layouts(dk, dv)),
                   ("-DFATTN_NAT_SCORES=1",) if nat else ())


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
    """The program of one sm_90a decode instance (cuda/fattn_decode_tma.cu; ``name``: a
    decode_tma_shape.Cfg's name), one program per instance as :func:`wgmma_variant`."""
    return Variant("decode-tma", "fattn_decode_tma.cu", (name,), arch_suffix="a")


def hopper_variants() -> list[Variant]:
    """Every sm_90a program (the CI compile test walks this list for sm_90a): the probe, and
    every instance of wgmma_shape's WS_CONFIGS and WS_DIAG and of decode_tma_shape's CONFIGS."""
    from .decode_tma_shape import CONFIGS
    from .wgmma_shape import WS_CONFIGS, WS_DIAG
    return [hopper_probe_variant()] + [wgmma_variant(c.name) for c in (*WS_CONFIGS.values(), *WS_DIAG.values())] + \
        [decode_tma_variant(c.name) for c in CONFIGS.values()]


HOPPER_ARCH = "sm_90a"   # the target of every Variant with arch_suffix "a" (compile tests)


def all_variants() -> list[Variant]:
    """Every program the backend can compile (the CI compile test walks this list)."""
    out = [util_variant(), dense_variant(), model_ops_variant(), *dense_q_variants()]
    for t in KV_CTYPES:
        out += [mma_variant(dk, dv, t, ext) for dk, dv in MMA_HEADS for ext in (False, True)]
        out += [mma_variant(dk, dv, t, nat=True) for dk, dv in MMA_HEADS]
        out += [vec_variant(dk, dv, t) for dk, dv in VEC_HEADS]
        out += [cells_variant(dk, dv, t) for dk, dv in CELLS_HEADS]
    for t in QUANT_KV_CTYPES:
        out += [vec_variant(dk, dv, t) for dk, dv in VEC_QUANT_HEADS]
    return out


# ---------------------------------------------------------------------------------------
# sources and toolchain
def source_dir() -> Path:
    """Folder holding fattn_*.cu/cuh: the installed package data or the source tree."""
    here = Path(__file__).resolve().parent
    for cand in (here / "cuda", here.parent / "cuda"):
        if (cand / "fattn_common.cuh").is_file():
            return cand
    try:
        from importlib.resources import files
        cand = Path(str(files("ggml_attn.cuda")))
        if (cand / "fattn_common.cuh").is_file():
            return cand
    except Exception:  # pragma: no cover - depends on the install layout
        pass
    raise FileNotFoundError("ggml_attn CUDA sources (fattn_common.cuh) not found next to the package")


def cuda_include_dirs() -> list[str]:
    """Directories holding cuda_fp16.h; raises with what was searched when none does."""
    cands: list[Path] = []
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            cands.append(Path(os.environ[env]) / "include")
    for entry in sys.path:
        for sub in ("nvidia/cu13/include", "nvidia/cu12/include", "nvidia/cuda_runtime/include",
                    "nvidia/cuda_nvrtc/include"):
            cands.append(Path(entry) / sub)
    cands += [Path("/usr/local/cuda/include"), Path("/opt/cuda/include")]
    found = [str(c) for c in cands if (c / "cuda_fp16.h").is_file()]
    if not found:
        raise RuntimeError(
            "CUDA headers (cuda_fp16.h) not found; searched $CUDA_PATH/include, $CUDA_HOME/include, "
            "site-packages nvidia/cu13|cu12/include and /usr/local/cuda/include. Install the "
            "project's 'nvrtc' extra (nvidia-cuda-runtime) or set CUDA_PATH.")
    # cuda_fp16.h may include headers from a sibling dir (e.g. crt/); one dir is enough normally
    return found[:1]


def ensure_cuda_namespace() -> None:
    """Make ``import cuda`` resolve to NVIDIA's ``cuda`` namespace (cuda.pathfinder, used by
    CuPy), not to this repository's ``cuda/`` source folder, which is a Python package and
    shadows it whenever the repository root is on sys.path (``python -m pytest`` from the root).
    Call before the first CuPy import; harmless otherwise."""
    mod = sys.modules.get("cuda")
    if mod is not None and getattr(mod, "__file__", None) and \
            Path(mod.__file__).resolve().parent.joinpath("fattn_common.cuh").is_file():
        del sys.modules["cuda"]
        mod = None
    if mod is not None:
        return
    saved = sys.path[:]
    try:
        sys.path[:] = [p for p in saved
                       if not (Path(p or ".").resolve() / "cuda" / "fattn_common.cuh").is_file()]
        import cuda  # noqa: F401  (NVIDIA's namespace package, if installed)
    except ImportError:
        pass
    finally:
        sys.path[:] = saved


def _nvrtc():
    try:
        ensure_cuda_namespace()
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
        return nvrtc
    except Exception as e:  # ImportError, or libnvrtc missing
        raise RuntimeError(f"NVRTC is not available ({type(e).__name__}: {e}); install the "
                           "project's 'nvrtc' extra (cupy-cuda13x + nvidia-cuda-nvrtc)") from e


def nvrtc_available() -> bool:
    try:
        _nvrtc()
        return True
    except RuntimeError:
        return False


def nvrtc_version() -> tuple[int, int]:
    return tuple(_nvrtc().getVersion())


def cache_dir() -> Path:
    d = os.environ.get("GGML_ATTN_CACHE_DIR")
    return Path(d) if d else Path.home() / ".cache" / "ggml-attn"


BASE_OPTIONS = ("-std=c++17", "-default-device")


def _sources_hash() -> str:
    h = hashlib.sha256()
    d = source_dir()
    for f in sorted(d.glob("*.cu*")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


_SRC_HASH: str | None = None
_HDR_HASH: dict[str, str] = {}   # include dir -> sha256 of its cuda_fp16.h


def _header_hash(inc_dir: str) -> str:
    h = _HDR_HASH.get(inc_dir)
    if h is None:
        try:
            h = hashlib.sha256((Path(inc_dir) / "cuda_fp16.h").read_bytes()).hexdigest()
        except OSError:
            h = ""
        _HDR_HASH[inc_dir] = h
    return h


def cache_key(variant: Variant, arch: str, opts: list[str], ver: tuple) -> str:
    """Cache key of one compilation: sources, names, every option (include dirs included),
    the cuda_fp16.h content of each include dir, NVRTC version, arch."""
    hdrs = [_header_hash(o[2:]) for o in opts if o.startswith("-I")]
    key_src = json.dumps([_SRC_HASH, variant.source, list(variant.names), list(opts), hdrs,
                          list(ver), arch])
    return hashlib.sha256(key_src.encode()).hexdigest()[:32]


@dataclass
class Compiled:
    cubin: bytes
    lowered: dict[str, str]   # name expression -> mangled name
    log: str


_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PTXAS_PROPS = re.compile(r"Function properties for (\S+)")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def resource_usage(log: str) -> dict[str, dict[str, int]]:
    """Per kernel (mangled name) of a ``-Xptxas=-v`` compile log: registers, stack frame and
    spill bytes, as ptxas reports them. Properties of non-inlined device functions, which
    ptxas lists after the kernels that call them, are not attributed to any kernel."""
    out: dict[str, dict[str, int]] = {}
    entry = props = None
    for line in log.splitlines():
        m = _PTXAS_ENTRY.search(line)
        if m:
            entry = m.group(1)
            out.setdefault(entry, {})
            continue
        m = _PTXAS_PROPS.search(line)
        if m:
            props = m.group(1) if m.group(1) in out else None
            continue
        m = _PTXAS_FRAME.search(line)
        if m and props is not None:
            out[props].update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                              spill_loads=int(m.group(3)))
        m = _PTXAS_REGS.search(line)
        if m and entry is not None:
            out[entry]["registers"] = int(m.group(1))
    return out


def whole_cubin(data: bytes) -> bytes:
    """The cubin ``data`` with its last byte back: CuPy's ``nvrtc.getCUBIN`` returns one byte less
    than ``nvrtcGetCUBINSize`` (it drops a final NUL, as of PTX text), which leaves the ELF's
    program header table one byte short (the driver read the byte past the buffer, CPython's
    hidden NUL; nvdisasm refuses the file). The table's end, from the ELF header, says whether
    the byte is missing (0, the high byte of the last entry's alignment)."""
    if len(data) < 64 or data[:4] != b"\x7fELF":
        return data
    import struct
    phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
    end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    return data + b"\0" if end == len(data) + 1 else data


_MEM_CACHE: dict[tuple, Compiled] = {}


def compile_variant(variant: Variant, arch: str, *, use_disk_cache: bool = True,
                    refresh: bool = False, extra_options: tuple = ()) -> Compiled:
    """Compile ``variant`` for ``arch`` (e.g. "sm_90") to a cubin; memory + disk cached.
    ``refresh``: ignore both caches and compile (the result replaces the cached cubin).
    ``extra_options``: more NVRTC options (e.g. "-Xptxas=-v" for :func:`resource_usage`).

    Raises RuntimeError with the NVRTC log on a compile error.
    """
    global _SRC_HASH
    if _SRC_HASH is None:
        _SRC_HASH = _sources_hash()
    nv = _nvrtc()
    ver = tuple(nv.getVersion())
    opts = list(BASE_OPTIONS) + list(variant.options) + list(extra_options) + [f"-arch={arch}", f"-I{source_dir()}"] + \
        [f"-I{d}" for d in cuda_include_dirs()]
    key = cache_key(variant, arch, opts, ver)
    mk = (key,)
    if mk in _MEM_CACHE and not refresh:
        return _MEM_CACHE[mk]
    path = cache_dir() / f"{variant.family}-{key}.cubin"
    meta = path.with_suffix(".json")
    if use_disk_cache and not refresh and path.is_file() and meta.is_file():
        try:
            c = Compiled(whole_cubin(path.read_bytes()), json.loads(meta.read_text())["lowered"], "")
            _MEM_CACHE[mk] = c
            return c
        except Exception:
            pass
    src_text = (source_dir() / variant.source).read_text()
    prog = nv.createProgram(src_text, variant.source, [], [])
    try:
        templated = [n for n in variant.names if "<" in n]
        for n in templated:
            nv.addNameExpression(prog, n)
        try:
            nv.compileProgram(prog, opts)
        except Exception as e:
            log = ""
            try:
                log = nv.getProgramLog(prog)
            except Exception:
                pass
            raise RuntimeError(f"NVRTC failed to compile {variant.label} for {arch}: {e}\n{log}") from e
        log = nv.getProgramLog(prog)
        lowered = {n: (nv.getLoweredName(prog, n) if "<" in n else n) for n in variant.names}
        cubin = whole_cubin(nv.getCUBIN(prog))
    finally:
        nv.destroyProgram(prog)
    c = Compiled(bytes(cubin), lowered, log)
    _MEM_CACHE[mk] = c
    if use_disk_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")
            tmp.write_bytes(c.cubin)
            os.replace(tmp, path)
            meta.write_text(json.dumps({"variant": variant.label, "arch": arch, "nvrtc": ver,
                                        "lowered": lowered}))
        except OSError:
            pass
    return c


def precompile(variants, arch: str, workers: int | None = None) -> None:
    """Compile ``variants`` for ``arch`` ("sm_90"; a Hopper program for ``arch`` + its
    arch_suffix) into the memory and disk caches, in parallel threads (NVRTC releases the GIL:
    2 programs on 2 cores in 2.8 s against 4.7 s one after the other), so that the first calls
    that load them find them compiled. Cached programs cost a file read. A compile error
    raises as in :func:`compile_variant`."""
    jobs = list(dict.fromkeys((v, arch + v.arch_suffix) for v in variants))
    if not jobs:
        return
    with ThreadPoolExecutor(workers or min(len(jobs), os.cpu_count() or 1)) as ex:
        for f in [ex.submit(compile_variant, v, a) for v, a in jobs]:
            f.result()


# ---------------------------------------------------------------------------------------
# parameter block (mirror of struct FattnParams in fattn_common.cuh)
class FattnParams(ctypes.Structure):
    _fields_ = [
        ("q", ctypes.c_uint64), ("k", ctypes.c_uint64), ("v", ctypes.c_uint64),
        ("mask", ctypes.c_uint64), ("sinks", ctypes.c_uint64), ("dst", ctypes.c_uint64),
        ("ws_o", ctypes.c_uint64), ("ws_ml", ctypes.c_uint64),
        ("live_idx", ctypes.c_uint64), ("live_cnt", ctypes.c_uint64), ("row_lohi", ctypes.c_uint64),
        ("q_nb1", ctypes.c_int64), ("q_nb2", ctypes.c_int64), ("q_nb3", ctypes.c_int64),
        ("k_nb1", ctypes.c_int64), ("k_nb2", ctypes.c_int64), ("k_nb3", ctypes.c_int64),
        ("v_nb1", ctypes.c_int64), ("v_nb2", ctypes.c_int64), ("v_nb3", ctypes.c_int64),
        ("m_nb1", ctypes.c_int64), ("m_nb2", ctypes.c_int64), ("m_nb3", ctypes.c_int64),
        ("n_batch", ctypes.c_int32), ("n_kv", ctypes.c_int32),
        ("n_head", ctypes.c_int32), ("n_head_kv", ctypes.c_int32),
        ("ne3", ctypes.c_int32), ("ne32", ctypes.c_int32), ("ne33", ctypes.c_int32),
        ("gqa", ctypes.c_int32),
        ("pack", ctypes.c_int32), ("q_tile_tokens", ctypes.c_int32),
        ("n_q_tiles", ctypes.c_int32), ("n_kv_tiles", ctypes.c_int32),
        ("n_splits", ctypes.c_int32), ("n_head_log2", ctypes.c_int32),
        ("scale", ctypes.c_float), ("softcap", ctypes.c_float),
        ("m0", ctypes.c_float), ("m1", ctypes.c_float),
        ("use_alibi", ctypes.c_int32), ("d_v", ctypes.c_int32),
        ("split_cnt", ctypes.c_uint64),
        ("cells", ctypes.c_uint64), ("cell_cnt", ctypes.c_uint64),
        ("work_cap", ctypes.c_int32), ("pad_", ctypes.c_int32),
    ]


class GemvSeg(ctypes.Structure):
    """Mirror of ``struct GemvSeg`` (dense.cu)."""
    _fields_ = [("w", ctypes.c_uint64), ("out", ctypes.c_uint64), ("rows", ctypes.c_int32),
                ("pad_", ctypes.c_int32)]


class GemvParams(ctypes.Structure):
    """Mirror of ``struct GemvParams`` (dense.cu)."""
    _fields_ = [("seg", GemvSeg * 3), ("x", ctypes.c_uint64), ("x_stride", ctypes.c_int64),
                ("n_in", ctypes.c_int32), ("n_seg", ctypes.c_int32), ("mode", ctypes.c_int32),
                ("norm_eps", ctypes.c_float)]


class GemvQParams(ctypes.Structure):
    """Mirror of ``struct GemvQParams`` (dense_q.cu); the segments are ``GemvSeg``'s layout
    (``struct GemvQSeg``: a byte pointer in place of the F16 one)."""
    _fields_ = [("seg", GemvSeg * 3), ("x", ctypes.c_uint64), ("x_stride", ctypes.c_int64),
                ("g", ctypes.c_uint64), ("row_bytes", ctypes.c_int64), ("n_in", ctypes.c_int32),
                ("n_tok", ctypes.c_int32), ("n_seg", ctypes.c_int32), ("mode", ctypes.c_int32),
                ("norm_eps", ctypes.c_float), ("pad_", ctypes.c_int32)]


class DequantKVParams(ctypes.Structure):
    """Mirror of ``struct DequantKVParams`` (fattn_util.cu): a q8_0/q4_0 K or V view (pointer,
    byte strides nb[1..3], ggml order [d, n_kv, n_head, ne3]) and its contiguous f16 copy."""
    _fields_ = [("src", ctypes.c_uint64), ("dst", ctypes.c_uint64),
                ("nb1", ctypes.c_int64), ("nb2", ctypes.c_int64), ("nb3", ctypes.c_int64),
                ("d", ctypes.c_int32), ("n_kv", ctypes.c_int32), ("n_head", ctypes.c_int32),
                ("ne3", ctypes.c_int32), ("type", ctypes.c_int32), ("pad_", ctypes.c_int32)]


class KVStoreParams(ctypes.Structure):
    """Mirror of ``struct KVStoreParams`` (dense.cu); ``type[i]``: the cache's ggml type id
    (F32, F16, Q8_0 or Q4_0)."""
    _fields_ = [("src", ctypes.c_uint64 * 2), ("dst", ctypes.c_uint64 * 2), ("rows", ctypes.c_uint64),
                ("n", ctypes.c_int32 * 2), ("type", ctypes.c_int32 * 2), ("n_tok", ctypes.c_int32),
                ("pad_", ctypes.c_int32)]


# ---------------------------------------------------------------------------------------
# loaded functions and launches (need a GPU)
class Kernel:
    """A loaded CUDA function; ``launch`` passes ctypes arguments by pointer."""

    def __init__(self, func: int, name: str, smem: int):
        from cupy.cuda import driver
        self.func = func
        self.name = name
        self.smem = smem
        self._launch = driver.launchKernel
        if smem > 48 * 1024:
            driver.funcSetAttribute(func, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)

    def attribute(self, attr: str) -> int:
        from cupy.cuda import driver
        return driver.funcGetAttribute(getattr(driver, attr), self.func)

    def occupancy(self, block: int) -> int:
        """Resident blocks per SM at ``block`` threads and this kernel's dynamic shared memory."""
        from cupy.cuda import driver
        return driver.occupancyMaxActiveBlocksPerMultiprocessor(self.func, block, self.smem)

    def launch(self, grid, block, stream: int, *args) -> None:
        """``args``: ctypes objects (a FattnParams, c_uint64 pointers, ...) in kernel order."""
        arr = arg_block(*args)   # a local: the array must outlive the launch call
        self.launch_raw(grid, block, stream, ctypes.addressof(arr))

    def launch_raw(self, grid, block, stream: int, args_addr: int) -> None:
        """Launch with a prebuilt argument block (the address of :func:`arg_block`'s array; the
        caller keeps it and the objects it points at alive)."""
        self._launch(self.func, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                     self.smem, stream, args_addr, 0)

    def partial(self, grid, block, stream: int, args_addr: int):
        """:meth:`launch_raw` with every argument fixed, as a callable of none (a
        ``functools.partial`` of the driver's launch: no Python frame per call)."""
        return functools.partial(self._launch, self.func, grid[0], grid[1], grid[2], block[0], block[1],
                                 block[2], self.smem, stream, args_addr, 0)

    def bound(self, grid, block, stream: int, *args):
        """:meth:`launch` with every argument fixed, as a callable of none: the argument block
        is built once and kept (with ``args``) on the callable."""
        arr = arg_block(*args)
        call = self.partial(grid, block, stream, ctypes.addressof(arr))
        call.keep = (args, arr)
        return call


class BoundLaunch:
    """Kernel ``fn`` with its grid, block and ctypes parameters fixed (the parameters copied into
    an argument block once); calling it launches on CuPy's current stream, nothing looked up
    or allocated per call (a CUDA-graph capture records it as it is)."""

    def __init__(self, fn: "Kernel", grid, block, *params):
        import cupy
        self.fn, self.grid, self.block, self.params = fn, grid, block, params
        self.args = arg_block(*params)
        self._stream = cupy.cuda.get_current_stream

    def __call__(self) -> None:
        self.fn.launch_raw(self.grid, self.block, self._stream().ptr, ctypes.addressof(self.args))


def grid_launch(fn: "Kernel", n: int, *params) -> BoundLaunch:
    """A :class:`BoundLaunch` of grid-stride kernel ``fn`` over ``n`` work items: blocks of 256
    threads, enough to cover ``n`` up to 4096 of them (the threads loop over the rest)."""
    return BoundLaunch(fn, (max(1, min(-(-n // 256), 4096)), 1, 1), (256, 1, 1), *params)


def arg_block(*args):
    """The ``void*[]`` array of kernel argument addresses cuLaunchKernel takes, for ctypes
    objects ``args`` in kernel order (keep it and them alive while launching with it)."""
    return (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])


_MODULES: dict[tuple, dict[str, int]] = {}   # (variant, arch, device) -> name -> CUfunction


def device_arch() -> str:
    import cupy
    cc = cupy.cuda.Device().compute_capability  # e.g. "90"
    return f"sm_{cc}"


def get_function(variant: Variant, name: str, *, smem: int = 0) -> Kernel:
    """Compile (cached), load into the current context (once) and return ``name`` of ``variant``."""
    import cupy
    arch = device_arch() + variant.arch_suffix
    if variant.arch_suffix and arch != HOPPER_ARCH:
        raise RuntimeError(f"{variant.label} is built for {HOPPER_ARCH} only; this GPU is {device_arch()}")
    dev = cupy.cuda.Device().id
    mkey = (variant, arch, dev)
    funcs = _MODULES.get(mkey)
    if funcs is None:
        funcs = _load_module(variant, arch)
        _MODULES[mkey] = funcs
    kkey = (mkey, name, smem)
    k = _KERNELS.get(kkey)
    if k is None:
        k = Kernel(funcs[name], name, smem)
        _KERNELS[kkey] = k
    return k


_KERNELS: dict[tuple, Kernel] = {}


def _load_module(variant: Variant, arch: str) -> dict[str, int]:
    """Load ``variant``'s cubin into the current context: name -> CUfunction. A cached cubin
    that fails to load (stale or corrupt cache file) is recompiled once, ignoring the caches."""
    from cupy.cuda import driver
    comp = compile_variant(variant, arch)
    try:
        mod = driver.moduleLoadData(comp.cubin)
    except Exception:
        comp = compile_variant(variant, arch, refresh=True)
        mod = driver.moduleLoadData(comp.cubin)
    return {n: driver.moduleGetFunction(mod, comp.lowered[n]) for n in variant.names}
