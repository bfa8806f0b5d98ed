"""NVRTC compilation, cubin cache and raw-pointer launches of the kernels in ``cuda/``.

One job: turn a *variant* (the catalogue, ``variants.py``: kernel family, head sizes, K/V dtype)
into loaded CUDA functions and launch them with a packed parameter block. No tensor logic lives
here.

- Compilation uses the low-level NVRTC binding (``cupy_backends.cuda.libs.nvrtc``), which works
  without a GPU or driver (CI compiles every variant for sm_80 and sm_90 this way).
- Cubins are cached in memory and on disk (``$GGML_ATTN_CACHE_DIR`` or ``~/.cache/ggml-attn``),
  keyed by a hash of the sources, the instance names, the full option list (include
  directories too), the content of the CUDA headers' cuda_fp16.h, the NVRTC version and the
  target architecture. A cached cubin the driver refuses to load is recompiled.
- Each instance's dynamic shared memory is read from its compiled program (``Compiled.smem``:
  the size variable ``variants.smem_expr`` names, read from the cubin by ``cubin.py``), so the
  C++ expression is its only definition; :func:`get_function` launches with it.
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
from dataclasses import dataclass, field
from pathlib import Path

from .cubin import symbol_int, whole_cubin  # noqa: F401  (whole_cubin re-exported)
from .instances import KV_CTYPES, QUANT_KV_CTYPES, VEC_KV_CTYPES, template_expr  # noqa: F401  (re-exported)

from .variants import (  # noqa: F401  (re-exported: the catalogue, ggml_attn/variants.py)
    KV_TILE, MMA_HEADS, VEC_HEADS, VEC_QUANT_HEADS, MMA_LAYOUTS, WIDE_MAX_HEAD, mma_layouts, VEC_ROWS,
    vec_lanes, vec_rows_allowed, CELLS_HEADS, CELLS_ROWS, CellsTune, CELLS_DEFAULT,
    cells_rows_allowed, cells_qo_name, cells_qo_of, cells_qo_variant, SMEM_KERNELS, smem_expr, Variant, UTIL_NAMES,
    CELL_LIST_THREADS,
    util_variant, GEMV_MAX_TOKENS, GEMV_WARPS, GEMV_UNROLLS, GEMV_UNROLL, gemv_name, DENSE_NAMES, dense_variant,
    GEMVQ_TOKENS, GEMVQ_MAX_TOKENS, gemv_q_name, GEMVQ_WARPS, GEMVQ_WARPS_X, dense_q_x_variant,
    dense_q_variant, dense_qw_variant, qw_instance, dense_qrm_variant, dense_qrg_variant, qr_finish_variant, staged_instance,
    Q8X_TOKENS, Q8X_PLAIN_TOKENS, Q8X_WARPS, Q8X_SWARPS, Q8XV_TYPES, Q8XV_TYPE_IDS, Q8XV_TOKENS, Q8X_VWARPS,
    Q8XR_TYPES, Q8XR_TOKENS, Q8X_FORM_TYPES, Q8X_ONE_WAVE, Q8X_GATED_FORMS, q8x_form_reads,
    Q8X_FORMS, Q8X_SPLIT_TOKENS, Q8X_QOUT_TOKENS, q8x_name,
    dense_q8x_variant, dense_q8x_qout_variant, MODEL_OPS_NAMES, model_ops_variant,
    dense_q_variants, mma_name, vec_name, cells_name, cells_variant, mma_variant, vec_variant,
    hopper_probe_variant, wgmma_variant, decode_tma_variant, hopper_variants, HOPPER_ARCH, all_variants)
from .gemm_tiles import (  # noqa: F401  (re-exported: the tiled GEMMs' tiles, ggml_attn/gemm_tiles.py)
    GEMMQ_TILE, GEMMQ_THREADS, GEMMQ8_TILE, GEMMQ8_THREADS, GEMMQ8_NARROW, GEMMQ8_MIN_SPLIT, GEMMQ8_STAGES,
    GEMMQ8_LD, GEMMQ8_BLOCKS_PER_SM, gemm_q8_bn, gemm_q_grid,
    GEMMQS_TILE, GEMMQS_NARROW, GEMMQS_THREADS, GEMMQS_BLOCKS_PER_SM, GEMMQS_STAGES, GEMMQS_LD, gemm_qs_bn,
    GEMMQR_TILE, GEMMQR_BLOCKS_PER_SM, GEMMQR_TYPES, GEMMQR_TYPE_IDS, GEMMQR_NARROW_MAX_TOKENS, STAGED_GEMMS,
    GEMMQRM_TILE, GEMMQRG_TILE, GEMMQR_KERNELS, GEMMQR_FAMILY, gemm_tiling, GEMMQW_TILE, GEMMQW2_TYPES, GEMMQW_FORMS)


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


def _size_exprs(variant: Variant) -> dict[str, str]:
    """Kernel name -> the name expression of its size variable, for ``variant``'s instances
    that have one (variants.smem_expr)."""
    return {n: e for n in variant.names if (e := smem_expr(n)) is not None}


def cache_key(variant: Variant, arch: str, opts: list[str], ver: tuple) -> str:
    """Cache key of one compilation: sources, names (the size variables' too), every option
    (include dirs included), the cuda_fp16.h content of each include dir, NVRTC version, arch."""
    hdrs = [_header_hash(o[2:]) for o in opts if o.startswith("-I")]
    key_src = json.dumps([_SRC_HASH, variant.source, list(variant.names), list(_size_exprs(variant).values()),
                          list(opts), hdrs, list(ver), arch])
    return hashlib.sha256(key_src.encode()).hexdigest()[:32]


@dataclass
class Compiled:
    cubin: bytes
    lowered: dict[str, str]   # name expression -> mangled name (the kernels)
    log: str
    smem_lowered: dict[str, str] = field(default_factory=dict)   # kernel name -> its size variable's mangled name

    def smem(self, name: str) -> int:
        """Dynamic shared memory, in bytes, that kernel instance ``name`` (one of the program's
        name expressions) is launched with: its size variable's value in the cubin (the C++
        expression's, e.g. MmaCfg::SMEM), 0 for a kernel without one (variants.smem_expr)."""
        if name not in self.lowered:
            raise KeyError(f"{name} is not a kernel of this program")
        sym = self.smem_lowered.get(name)
        return 0 if sym is None else symbol_int(self.cubin, sym)


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


_MEM_CACHE: dict[tuple, Compiled] = {}
COMPILED: list[str] = []   # the labels of the programs NVRTC compiled in this process (not from a cache)


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
    sizes = _size_exprs(variant)
    if use_disk_cache and not refresh and path.is_file() and meta.is_file():
        try:
            m = json.loads(meta.read_text())
            c = Compiled(whole_cubin(path.read_bytes()), m["lowered"], "", m["smem_lowered"])
            if set(c.smem_lowered) == set(sizes):
                _MEM_CACHE[mk] = c
                return c
        except Exception:
            pass
    src_text = (source_dir() / variant.source).read_text()
    prog = nv.createProgram(src_text, variant.source, [], [])
    try:
        for n in [n for n in variant.names if "<" in n] + list(sizes.values()):
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
        smem_lowered = {n: nv.getLoweredName(prog, e) for n, e in sizes.items()}
        cubin = whole_cubin(nv.getCUBIN(prog))
    finally:
        nv.destroyProgram(prog)
    c = Compiled(bytes(cubin), lowered, log, smem_lowered)
    _MEM_CACHE[mk] = c
    COMPILED.append(variant.label)
    if use_disk_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")
            tmp.write_bytes(c.cubin)
            os.replace(tmp, path)
            meta.write_text(json.dumps({"variant": variant.label, "arch": arch, "nvrtc": ver,
                                        "lowered": lowered, "smem_lowered": smem_lowered}))
        except OSError:
            pass
    return c


def precompile(variants, arch: str, workers: int | None = None) -> tuple[int, int]:
    """Compile ``variants`` (each as its programs, ``Variant.shards``) for ``arch`` ("sm_90"; a
    Hopper program for ``arch`` + its arch_suffix) into the caches, in parallel threads (NVRTC releases the GIL:
    2 programs on 2 cores in 2.8 s against 4.7 s one after the other), so that the first calls
    that load them find them compiled. Cached programs cost a file read. A compile error
    raises as in :func:`compile_variant`. Returns (programs, how many NVRTC compiled now)."""
    jobs, before = list(dict.fromkeys((s, arch + v.arch_suffix) for v in variants for s in v.shards())), len(COMPILED)
    if jobs:
        with ThreadPoolExecutor(workers or min(len(jobs), os.cpu_count() or 1)) as ex:
            for f in [ex.submit(compile_variant, v, a) for v, a in jobs]:
                f.result()
    return len(jobs), len(COMPILED) - before


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
        ("use_alibi", ctypes.c_int32), ("head_dim_v", ctypes.c_int32),
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


class GemmQParams(ctypes.Structure):
    """Mirror of ``struct GemmQParams`` (dense_q.cu): the tiled block GEMM's operands."""
    _fields_ = [("w", ctypes.c_uint64), ("x", ctypes.c_uint64), ("out", ctypes.c_uint64), ("part", ctypes.c_uint64),
                ("row_bytes", ctypes.c_int64), ("rows", ctypes.c_int32), ("n_in", ctypes.c_int32),
                ("n_tok", ctypes.c_int32), ("k_chunk", ctypes.c_int32), ("mode", ctypes.c_int32), ("pad_", ctypes.c_int32),
                ("w2", ctypes.c_uint64), ("out16", ctypes.c_uint64), ("tile_done", ctypes.c_uint64)]


class GemvQ8Params(ctypes.Structure):
    """Mirror of ``struct GemvQ8Params`` (dense_q8x.cu); segments in ``GemvSeg``'s layout."""
    _fields_ = [("seg", GemvSeg * 3), ("xq", ctypes.c_uint64), ("xd", ctypes.c_uint64), ("xs", ctypes.c_uint64),
                ("row_bytes", ctypes.c_int64), ("n_in", ctypes.c_int32), ("n_tok", ctypes.c_int32),
                ("n_seg", ctypes.c_int32), ("mode", ctypes.c_int32), ("pdl", ctypes.c_int32), ("pad_", ctypes.c_int32)]


class GemmQ8Params(ctypes.Structure):
    """Mirror of ``struct GemmQ8Params`` (dense_q8x.cu): the block GEMM on 8-bit activations."""
    _fields_ = [("w", ctypes.c_uint64), ("xq", ctypes.c_uint64), ("xd", ctypes.c_uint64), ("xs", ctypes.c_uint64),
                ("out", ctypes.c_uint64), ("part", ctypes.c_uint64), ("row_bytes", ctypes.c_int64),
                ("rows", ctypes.c_int32), ("n_in", ctypes.c_int32), ("n_tok", ctypes.c_int32),
                ("k_chunk", ctypes.c_int32), ("mode", ctypes.c_int32), ("pad_", ctypes.c_int32)]


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
    """A loaded CUDA function launched with ``smem`` bytes of dynamic shared memory (its
    program's value: :meth:`Compiled.smem`); ``launch`` passes ctypes arguments by pointer."""

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


def then(*fns):
    """One function of no arguments running ``fns`` in order (None entries skipped): a node's or
    a call's launches as one callable."""
    fns = [f for f in fns if f is not None]
    if len(fns) == 1:
        return fns[0]

    def run():
        for f in fns:
            f()
    return run


def arg_block(*args):
    """The ``void*[]`` array of kernel argument addresses cuLaunchKernel takes, for ctypes
    objects ``args`` in kernel order (keep it and them alive while launching with it)."""
    return (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])


_MODULES: dict[tuple, dict[str, tuple[int, int]]] = {}   # (variant, arch, device) -> name -> (CUfunction, smem bytes)


def device_arch() -> str:
    import cupy
    cc = cupy.cuda.Device().compute_capability  # e.g. "90"
    return f"sm_{cc}"


def get_function(variant: Variant, name: str, *, smem: int | None = None) -> Kernel:
    """Compile (cached), load into the current context (once) and return ``name`` of ``variant``,
    launched with ``smem`` bytes of dynamic shared memory: by default the instance's own, read
    from its program (:meth:`Compiled.smem`; 0 for a kernel without a size variable)."""
    import cupy
    arch = device_arch() + variant.arch_suffix
    if variant.arch_suffix and arch != HOPPER_ARCH:
        raise RuntimeError(f"{variant.label} is built for {HOPPER_ARCH} only; this GPU is {device_arch()}")
    dev = cupy.cuda.Device().id
    mkey = (variant.shard_of(name), arch, dev)   # (the program holding it: Variant.shards)
    funcs = _MODULES.get(mkey)
    if funcs is None:
        funcs = _MODULES[mkey] = _load_module(mkey[0], arch)
    func, own = funcs[name]
    smem = own if smem is None else smem
    kkey = (mkey, name, smem)
    k = _KERNELS.get(kkey)
    if k is None:
        k = Kernel(func, name, smem)
        _KERNELS[kkey] = k
    return k


_KERNELS: dict[tuple, Kernel] = {}


def _load_module(variant: Variant, arch: str) -> dict[str, tuple[int, int]]:
    """Load ``variant``'s cubin into the current context: name -> (CUfunction, its dynamic shared
    memory in bytes, :meth:`Compiled.smem`). A cached cubin that fails to load (stale or corrupt
    cache file) is recompiled once, ignoring the caches."""
    from cupy.cuda import driver
    comp = compile_variant(variant, arch)
    try:
        mod = driver.moduleLoadData(comp.cubin)
    except Exception:
        comp = compile_variant(variant, arch, refresh=True)
        mod = driver.moduleLoadData(comp.cubin)
    return {n: (driver.moduleGetFunction(mod, comp.lowered[n]), comp.smem(n)) for n in variant.names}
