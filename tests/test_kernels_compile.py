"""Every CUDA kernel variant compiles for sm_80 and sm_90 with NVRTC (no GPU needed).

README's test command compiles a representative set (:data:`REPRESENTATIVE`: per architecture
one program of every family, so every source file, both K/V types, the smallest and largest head
sizes and the instances with spill allowances) and the sm_90a programs; the rest of
``all_variants() x ARCHS`` is the ``compile_all``-marked test, which the default run deselects
(tests/conftest.py) and ``.ci/run`` runs as its second line (``-m compile_all``): CI compiles every
program, each once. ``tests/test_kernels_compile.py::test_ci_runs_the_exhaustive_compile`` keeps
that line in ``.ci/run``.

Skips only when the NVRTC library itself is missing (install the project's ``nvrtc`` extra).
Also checks that the dynamic shared memory read back from each compiled program is the C++
value, that the ctypes mirror of ``struct FattnParams`` matches the C layout, and the CPU-side
launch configuration rules.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from ggml_attn import kernels as K
from ggml_attn.block_types import BLOCK_TYPES, block_layout
from ggml_attn.dtypes import GGML_TYPE_BF16, GGML_TYPE_F16, GGML_TYPE_Q4_0, GGML_TYPE_Q8_0

pytestmark = pytest.mark.skipif(not K.nvrtc_available(), reason="NVRTC library not installed "
                                "(pip install .[nvrtc])")

ARCHS = ("sm_80", "sm_90")
F16, BF16 = GGML_TYPE_F16, GGML_TYPE_BF16
Q8_0, Q4_0 = GGML_TYPE_Q8_0, GGML_TYPE_Q4_0

# The default run's compile: per architecture one program of every family of all_variants()
# (every source file), f16, bf16, q8_0 and q4_0 and the head sizes spread over the two (the smallest, D 40,
# and the largest, 576/512; the 128-row tiles of D 128), sm_90 with the instances that have a
# spill allowance. The remaining (program, arch) pairs: test_every_other_variant_compiles.
REPRESENTATIVE = {
    "sm_90": (K.util_variant(), K.dense_variant(), K.dense_q_variant(12), K.dense_q8x_variant(12), K.dense_q8x_qout_variant(12),
              K.model_ops_variant(), K.mma_variant(128, 128, F16),
              K.mma_variant(320, 256, BF16, ext=True), K.mma_variant(128, 128, BF16),
              K.vec_variant(576, 512, F16), K.vec_variant(128, 128, Q8_0), K.cells_variant(256, 256, BF16),
              K.cells_qo_variant(128, 128, F16), K.dense_qrm_variant(12), K.dense_qrg_variant(14)),
    "sm_80": (K.util_variant(), K.dense_variant(), K.dense_q_variant(14), K.dense_q8x_variant(14), K.dense_q8x_qout_variant(14),
              K.model_ops_variant(), K.mma_variant(40, 40, BF16),
              K.mma_variant(96, 96, F16, ext=True), K.mma_variant(64, 64, F16),
              K.vec_variant(80, 80, BF16), K.vec_variant(64, 64, Q4_0), K.cells_variant(128, 128, F16),
              K.cells_qo_variant(64, 64, BF16), K.dense_qrm_variant(14), K.dense_qrg_variant(12)),
}


def _every_job():
    return [(v, a) for v in K.all_variants() for a in ARCHS]


def _representative_jobs():
    return [(v, a) for a in ARCHS for v in REPRESENTATIVE[a]]


def _compile(args):
    """One NVRTC compile in a worker process: a summary of the result, or the error's text
    (``expect_error`` jobs: the compile is expected to fail)."""
    variant, arch, expect_error = args
    xopts = ("-Xptxas=-v",) if arch.startswith("sm_90") and not expect_error else ()
    try:
        c = K.compile_variant(variant, arch, use_disk_cache=False, extra_options=xopts)
    except RuntimeError as e:
        if expect_error:
            return dict(error=str(e))
        raise
    inv = {m: n for n, m in c.lowered.items()}
    usage = {inv.get(k, k): u for k, u in K.resource_usage(c.log).items()}
    # ptxas's C7511, C7518, ...: the wgmma pipeline serialized (each wgmma waited for before the
    # next issues)
    serialized = [ln for ln in c.log.splitlines() if "wgmma" in ln and "serialized" in ln]
    return dict(label=variant.label, arch=arch, size=len(c.cubin), lowered=c.lowered, usage=usage,
                sha=hashlib.sha256(c.cubin).hexdigest(), smem={n: c.smem(n) for n in variant.names}, error=None,
                serialized=serialized)


def _cost(job):
    """Rough compile time, for starting the long compiles first (2 workers end together)."""
    v, arch, expect_error = job
    heavy = {"mma": 3, "mma-ext": 3, "vec": 2, "wgmma": 6, "decode-tma": 5,
             "hopper-probe": 4}.get(v.family, 1)
    return heavy * len(v.names)


def compile_jobs(jobs):
    """``{job: _compile(job)}`` for ``(variant, arch, expect_error)`` jobs, each distinct job
    compiled once, in one process per core, longest first."""
    todo = sorted(set(jobs), key=_cost, reverse=True)
    workers = max(1, min(len(todo), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers) as ex:
        return dict(zip(todo, ex.map(_compile, todo)))


@pytest.fixture(scope="module")
def default_compiles():
    """Every compile of the default run's tests in one pool: the representative programs for
    sm_80 and sm_90, the sm_90a programs, and the sm_90a wgmma programs for plain sm_90 (which
    must fail)."""
    jobs = [(v, a, False) for v, a in _representative_jobs()]
    jobs += [(v, K.HOPPER_ARCH, False) for v in K.hopper_variants()]
    jobs += [(v, "sm_90", True) for v in K.hopper_variants() if v.family != "decode-tma"]
    return compile_jobs(jobs)


# Spill bytes ptxas reports for the instances that spill at all (sm_90, NVRTC 13.0,
# 2026-11-30, after the plan's hidden-column words replaced the per-tile V check; f16 and
# bf16 alike; 2026-12-01, MASKED tiles without bound checks and FINITE tiles: D 128 plain
# 24/36 -> 12/12 bytes, the rest as before), with the allowance each may not exceed: the 128-row prefill tiles (MT = 2) of
# D 96-128 hold 128-row accumulators at the 255-register limit; D 320/256 with softcap/ALiBi;
# the CUDA-core decode kernel's 4-row instance at D 320-576, with q8_0 / q4_0 K/V too (2026-12-03:
# the blocks' unpacking at the 255-register limit; q4_0 also at D 192). Every other instance must
# not spill. Keys: ("mma", DK, DV, MT, EXT) / ("vec", DK, DV, R) / ("vec", DK, DV, R, quant type).
SPILL_ALLOWANCE = {("mma", 96, 96, 2, True): 12,
                   ("mma", 112, 112, 2, False): 4, ("mma", 112, 112, 2, True): 24,
                   ("mma", 128, 128, 2, False): 24, ("mma", 128, 128, 2, True): 20,
                   ("mma", 320, 256, 1, True): 20, ("vec", 320, 256, 4): 8,
                   ("vec", 512, 512, 4): 28, ("vec", 576, 512, 4): 16,
                   ("vec", 512, 512, 4, "q8_0"): 20,
                   ("vec", 192, 192, 4, "q4_0"): 4, ("vec", 512, 512, 4, "q4_0"): 16, ("vec", 576, 512, 4, "q4_0"): 32}


def _allowance_key(name):
    """fattn_mma<DK, DV, T, NWQ, NWK, MT, ST, EXT> / fattn_vec<DK, DV, T, R> -> SPILL_ALLOWANCE key"""
    if not name.startswith(("fattn_mma<", "fattn_vec<")):
        return None
    a = [x.strip() for x in name[name.index("<") + 1:-1].split(",")]
    if name.startswith("fattn_mma<"):
        return "mma", int(a[0]), int(a[1]), int(a[5]), a[7] == "true"
    key = ("vec", int(a[0]), int(a[1]), int(a[3]))
    return key + (a[2][len("fattn_"):],) if a[2].startswith("fattn_q") else key


def _check_compiled(jobs, results):
    """Every (variant, arch) of ``jobs`` compiled to a cubin with all its lowered names; on
    sm_90 every kernel uses <= 255 registers and spills no more than SPILL_ALLOWANCE says
    (nothing, for all but the listed instances)."""
    seen = 0
    for v, arch in jobs:
        r = results[(v, arch, False)]
        label = r["label"]
        assert r["size"] > 1000, f"{label} {arch}: empty cubin"
        assert all(r["lowered"].values()), f"{label} {arch}: missing lowered names"
        if arch != "sm_90":
            continue
        usage = r["usage"]
        assert set(usage) >= set(r["lowered"]), f"{label}: no ptxas report for some kernels"
        for name, u in usage.items():
            seen += 1
            assert u["registers"] <= 255, (name, u)
            allow = SPILL_ALLOWANCE.get(_allowance_key(name), 0)
            assert u["spill_stores"] <= allow and u["spill_loads"] <= 2 * allow, (name, u)
    assert seen >= len({v for v, a in jobs if a == "sm_90"}), "ptxas reports were parsed"


def test_representative_variants_compile(default_compiles):
    """The representative programs compile for sm_80 and sm_90 (registers and spills as
    :func:`_check_compiled` says)."""
    _check_compiled(_representative_jobs(), default_compiles)


@pytest.mark.compile_all
def test_every_other_variant_compiles():
    """The rest of all_variants() x ARCHS (not in REPRESENTATIVE) compiles, with the same
    checks: with test_representative_variants_compile, every program for both architectures.
    ``.ci/run`` runs it (``-m compile_all``); the default run deselects it. Their dynamic shared
    memory read back from the cubins is the C++ value (:func:`_check_smem_read_back`)."""
    rep = set(_representative_jobs())
    jobs = [j for j in _every_job() if j not in rep]
    results = compile_jobs([(v, a, False) for v, a in jobs])
    _check_compiled(jobs, results)
    _check_smem_read_back(jobs, results)


def test_ab_dense_programs_compile():
    """The benchmark's A/B programs, outside all_variants() (not shipped): dense_gemv_q with 4
    and 16 warps a block, with the same checks (a K-quant and a 32-value type; sm_90)."""
    jobs = [(K.dense_q_x_variant(12, 4), "sm_90"), (K.dense_q_x_variant(8, 16), "sm_90")]
    _check_compiled(jobs, compile_jobs([(v, a, False) for v, a in jobs]))


def test_representative_set_covers_every_family_and_source():
    """REPRESENTATIVE holds, per architecture, a program of every family and source file of
    all_variants(), both K/V types, the smallest and the largest head sizes; the two compile
    tests together cover all_variants() x ARCHS, each pair once."""
    every = _every_job()
    rep = _representative_jobs()
    assert set(rep) <= set(every) and len(set(rep)) == len(rep)
    rest = [j for j in every if j not in set(rep)]
    assert sorted(map(str, rep + rest)) == sorted(map(str, every))
    for arch in ARCHS:
        got = REPRESENTATIVE[arch]
        assert {v.family for v in got} == {v.family for v in K.all_variants()}, arch
        assert {v.source for v in got} == {v.source for v in K.all_variants()}, arch
    names = " ".join(n for v, _ in rep for n in v.names)
    assert "__half" in names and "__nv_bfloat16" in names
    assert "fattn_q8_0" in names and "fattn_q4_0" in names   # the quantized K/V of the decode kernel
    assert "fattn_mma<40, 40" in names and "fattn_vec<576, 512" in names
    allowed = {_allowance_key(n) for v in REPRESENTATIVE["sm_90"] for n in v.names} & set(SPILL_ALLOWANCE)
    assert len(allowed) >= 3, "sm_90 compiles instances with a spill allowance"


def test_ci_runs_the_exhaustive_compile():
    """.ci/run runs the compile_all tests after README's test command, which deselects them."""
    ci = (Path(__file__).resolve().parent.parent / ".ci" / "run").read_text().splitlines()
    assert any(line.strip().endswith("python -m pytest -q -rs -m compile_all") for line in ci), \
        ".ci/run lost its exhaustive compile line"


def test_resource_usage_parser():
    log = ("ptxas info    : Compiling entry function '_Z3fooILi1EEvv' for 'sm_90'\n"
           "ptxas info    : Function properties for _Z3fooILi1EEvv\n"
           "ptxas         .     8 bytes stack frame, 4 bytes spill stores, 8 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers\n")
    # a non-inlined device function's properties follow the kernel's and are not the kernel's
    log += ("ptxas info    : Function properties for _Z3barv\n"
            "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n")
    assert K.resource_usage(log) == {"_Z3fooILi1EEvv": dict(stack=8, spill_stores=4, spill_loads=8,
                                                           registers=255)}


def test_variant_list_covers_required_heads():
    for dk in (64, 96, 128, 256):
        for t in (Q8_0, Q4_0):
            assert K.vec_variant(dk, dk, t) in K.all_variants()
    for dk in (64, 80, 96, 112, 128, 256):
        for t in (GGML_TYPE_F16, GGML_TYPE_BF16):
            assert K.mma_variant(dk, dk, t) in K.all_variants()
            assert K.vec_variant(dk, dk, t) in K.all_variants()
            if (dk, dk) in K.CELLS_HEADS:
                assert K.cells_variant(dk, dk, t) in K.all_variants()


def _flat_fields(struct, prefix=""):
    """(C member path, offset) of a ctypes structure's scalar and array members (nested
    structure arrays expanded element by element)."""
    out = []
    for name, typ in struct._fields_:
        off = getattr(struct, name).offset
        if isinstance(typ, type) and issubclass(typ, ctypes.Array) and issubclass(typ._type_, ctypes.Structure):
            for i in range(typ._length_):
                base = off + i * ctypes.sizeof(typ._type_)
                out += [(f"{prefix}{name}[{i}].{n}", base + o) for n, o in _flat_fields(typ._type_)]
        else:
            out.append((f"{prefix}{name}", off))
    return out


def _static_asserts(source: str, checks: list[tuple[str, int, str]], arch: str, prelude: tuple = ()) -> None:
    """Compile ``#include source``, the ``prelude`` lines and one static_assert(expr == value)
    per check with NVRTC (front end only: no kernel is instantiated); fail naming the checks'
    labels (a Python mirror differs from the C++ value)."""
    lines = [f'#include "{source}"', *prelude] + [f'static_assert({e} == {v}, "{label}");' for e, v, label in checks]
    nv = K._nvrtc()
    prog = nv.createProgram("\n".join(lines), "mirror.cu", [], [])
    try:
        opts = ["-std=c++17", f"-arch={arch}", f"-I{K.source_dir()}"] + [f"-I{d}" for d in K.cuda_include_dirs()]
        try:
            nv.compileProgram(prog, opts)
        except Exception as e:
            pytest.fail(f"{source}: a host-side value differs from the C++ one: {e}\n{nv.getProgramLog(prog)}")
    finally:
        nv.destroyProgram(prog)


@pytest.mark.parametrize("struct, source", [("FattnParams", "fattn_common.cuh"), ("GemvParams", "dense.cu"),
                                            ("KVStoreParams", "dense.cu"), ("GemvQParams", "dense_q.cu"),
                                            ("GemmQParams", "dense_q.cu"), ("GemvQ8Params", "dense_q8x.cu"),
                                            ("GemmQ8Params", "dense_q8x.cu")])
def test_params_struct_layouts_match_c(struct, source):
    """The ctypes mirror of each kernel parameter struct has the C layout: static_asserts of
    every member's offset and the size, compiled by NVRTC."""
    cls = getattr(K, struct)
    checks = [(f"__builtin_offsetof({struct}, {path})", off, path) for path, off in _flat_fields(cls)]
    _static_asserts(source, checks + [(f"sizeof({struct})", ctypes.sizeof(cls), "size")], "sm_80",
                    (f"__device__ {struct} probe_;",))


def test_gemm_q_tile_mirror_matches_c():
    """kernels.GEMMQ_TILE / GEMMQ_THREADS (the host's grid and block for dense_gemm_q) are the
    kernel's GQ_BM, GQ_BN, GQ_BK and GQ_THREADS."""
    names = ("GQ_BM", "GQ_BN", "GQ_BK")
    checks = [(n, v, n) for n, v in zip(names, K.GEMMQ_TILE)] + [("GQ_THREADS", K.GEMMQ_THREADS, "GQ_THREADS"),
                                                                  ("GEMVQ_WARPS", K.GEMVQ_WARPS, "GEMVQ_WARPS")]
    _static_asserts("dense_q.cu", checks, "sm_80")
    _static_asserts("dense_q8x.cu", [("Q8X_WARPS", K.Q8X_WARPS, "Q8X_WARPS"), ("Q8X_SWARPS", K.Q8X_SWARPS, "Q8X_SWARPS")]
                    + [(n, v, n) for n, v in zip(("Q8G_BM", "Q8G_BN", "Q8G_BK"), K.GEMMQ8_TILE)]
                    + [("Q8G_THREADS", K.GEMMQ8_THREADS, "Q8G_THREADS"), ("Q8G_STAGES", K.GEMMQ8_STAGES, "Q8G_STAGES"),
                       ("Q8G_LD", K.GEMMQ8_LD, "Q8G_LD")], "sm_80")


def _smem_cxx(name: str) -> tuple[str, str]:
    """(source, C++ expression) of the dynamic shared memory kernel instance ``name`` (a name
    expression of variants.SMEM_KERNELS) is written for: the constant its body lays out, spelled
    here from the template's parameters, independently of the size variable the host reads."""
    base, _, rest = name.partition("<")
    a = [x.strip() for x in rest[:-1].split(",")]
    if base == "fattn_mma":     # <DK, DV, T, NWQ, NWK, MT, ST, EXT>
        return "fattn_mma.cu", f"MmaCfg<{a[0]}, {a[1]}, {a[3]}, {a[4]}, {a[5]}, {a[6]}>::SMEM"
    if base == "fattn_vec":     # <DK, DV, T, R>
        return "fattn_vec.cu", f"VecCfg<{a[0]}, {a[1]}, {a[3]}>::SMEM"
    if base == "fattn_cells":   # <DK, DV, T, R, U, PF, MINB>
        return "fattn_cells.cu", f"CellsCfg<{a[0]}, {a[1]}, {a[3]}, {a[4]}>::SMEM"
    if base == "dense_gemm_q8":   # <T, BN>
        return "dense_q8x.cu", f"Q8gTile<{a[0]}, {a[1]}>::SMEM"
    if base == "dense_gemm_qs":   # <T, BN>
        return "dense_q.cu", f"QsTile<{a[0]}, {a[1]}>::SMEM"
    if base == "dense_gemm_qr":   # <T, BN[, MI]>: MI 2 the two row halves (dense_gemm_qrm)
        return "dense_q.cu", f"QrTile<{a[0]}, {a[1]}, {a[2] if len(a) > 2 else 1}>::SMEM"
    if base == "dense_gemm_qw":   # <T, RM, H>: the stages' x tiles and staged rows
        return "dense_qw.cu", f"QW_STAGES * (QW_BN * QW_BK * 2 + QW_BM * {a[1]} * QwTile<{a[0]}, {a[1]}>::SLOT)"
    if base == "fattn_wgmma_ws":   # <T, D, STAGES, PINGPONG, DIAG, PERSISTENT, QTMA, SMX, EPI>: EPI 1 stages in Q's f32 space
        return "fattn_wgmma.cu", f"ws::smem_bytes<{a[1]}, {a[2]}, {a[6]}, {'true' if a[8] == '1' else 'false'}>()"
    if base == "fattn_decode_tma":   # <KT, D, STAGES, WHOLE, NW, REG>: scratch = quantized and not REG
        scratch = "false" if a[0] in ("__half", "__nv_bfloat16") or a[5] == "true" else "true"
        return "fattn_decode_tma.cu", f"dtma::smem_bytes<{a[0]}, {a[1]}, {a[2]}, {a[4]}, {scratch}, {a[3]}>()"
    if base == "fattn_decode_rows":   # <KT, D, STAGES, NW, NKV>
        return "fattn_decode_rows.cu", f"drows::smem_bytes<{a[0]}, {a[1]}, {a[2]}, {a[4]}>()"
    raise AssertionError(f"no dynamic shared memory expression for {name}")


def _check_smem_read_back(jobs, results) -> None:
    """Every kernel of ``jobs``' programs read back from its cubin (Compiled.smem) the C++ value of
    :func:`_smem_cxx` (static_asserts compiled by NVRTC), a positive size for each instance of
    variants.SMEM_KERNELS and 0 for every other kernel."""
    checks: dict[tuple[str, str], list] = {}
    for v, arch in jobs:
        r = results[(v, arch, False)]
        for name, got in r["smem"].items():
            if K.smem_expr(name) is None:
                assert got == 0, (name, got)
                continue
            assert got > 0, (name, arch, got)
            src, expr = _smem_cxx(name)
            checks.setdefault((src, K.HOPPER_ARCH if v.arch_suffix else "sm_80"), []).append(
                (expr, got, f"{name} {arch}"))
    for (src, arch), c in checks.items():
        _static_asserts(src, list(dict.fromkeys(c)), arch)


def test_smem_read_back_matches_c(default_compiles):
    """The dynamic shared memory each kernel of the default run's programs is launched with, read
    from its compiled program (the size variable of variants.smem_expr, ggml_attn/cubin.py), is
    the C++ constant its body is laid out for: every family of SMEM_KERNELS, every sm_90a
    instance (the rest of all_variants(): test_every_other_variant_compiles)."""
    jobs = _representative_jobs() + [(v, K.HOPPER_ARCH) for v in K.hopper_variants()]
    _check_smem_read_back(jobs, default_compiles)
    fams = {n.partition("<")[0] for v, _ in jobs for n in v.names}
    assert set(K.SMEM_KERNELS) <= fams, "every family with dynamic shared memory is read back"


def test_sources_define_a_size_variable_per_dynamic_kernel():
    """The kernels with dynamic shared memory (an ``extern __shared__`` array) are the templates of
    variants.SMEM_KERNELS, each source defining their size variables (cuda/hopper_probe.cu's
    checks, launched by tests with their own sizes, aside): a kernel left out would launch with none."""
    src = K.source_dir()
    dyn = {f.name for f in src.glob("*.cu*") if "extern __shared__" in f.read_text()} - {"hopper_probe.cu"}
    homes = {}
    for base in K.SMEM_KERNELS:
        homes[base] = [f.name for f in src.glob("*.cu") if f"__device__ const int {base}_smem =" in f.read_text()]
        assert len(homes[base]) == 1, (base, homes[base])
    assert dyn == {h[0] for h in homes.values()}, (dyn, homes)


def test_dynamic_shared_memory_fits():
    """Each instance's C++ dynamic shared memory fits a block of the H100 / H200 (227 KB; the
    cell-list kernel's 48 KB, no opt-in needed), and GEMMQ8_BLOCKS_PER_SM / GEMMQS_BLOCKS_PER_SM /
    GEMMQR_BLOCKS_PER_SM blocks of dense_gemm_q8 / dense_gemm_qs / dense_gemm_qr fit an SM (228 KB,
    1 KB reserved a block), for every
    instance that ships (static_asserts, NVRTC's front end: no kernel compiled)."""
    names = [n for v in K.all_variants() + K.hopper_variants() for n in v.names if K.smem_expr(n)]
    checks: dict[tuple[str, str], list] = {}
    for n in names:
        src, expr = _smem_cxx(n)
        base = n.partition("<")[0]
        if base in ("dense_gemm_q8", "dense_gemm_qs", "dense_gemm_qr"):
            tiles = {"dense_gemm_q8": K.GEMMQ8_BLOCKS_PER_SM, "dense_gemm_qs": K.GEMMQS_BLOCKS_PER_SM,
                     "dense_gemm_qr": K.GEMMQR_BLOCKS_PER_SM}[base]
            per_sm = tiles[int(n.split(",")[1].strip(" >"))]
            expr = f"{per_sm} * ({expr} + 1024) <= 228 * 1024"
        else:
            expr = f"{expr} <= {48 if base == 'fattn_cells' else 227} * 1024"
        arch = K.HOPPER_ARCH if base in ("fattn_wgmma_ws", "fattn_decode_tma", "fattn_decode_rows", "dense_gemm_qw") \
            else "sm_80"
        checks.setdefault((src, arch), []).append((expr, "true", n))
    assert {s for s, _ in checks} == {"fattn_mma.cu", "fattn_vec.cu", "fattn_cells.cu", "dense_q8x.cu", "dense_q.cu",
                                      "fattn_wgmma.cu", "fattn_decode_tma.cu", "fattn_decode_rows.cu", "dense_qw.cu"}
    # the sm_90a prefill's rings one stage deeper do not fit: Q's f32 rows through TMA (64 KB at D 128)
    # leave room for 2 stages of 128 cells, not 3; at D 256 (64-cell chunks) for none
    checks[("fattn_wgmma.cu", K.HOPPER_ARCH)] += [
        ("ws::chunk<256>() == 64 && ws::smem_bytes<128, 3, true>() > 227 * 1024", "true", "qtma D 128: 3 stages"),
        ("ws::smem_bytes<256, 1, true>() > 227 * 1024", "true", "qtma D 256: 1 stage")]
    # the whole-rows decode's rings are as deep as fit (8 KV heads' rows: 69.6 / 36.9 KB a stage)
    checks[("fattn_decode_rows.cu", K.HOPPER_ARCH)] += [
        ("drows::smem_bytes<fattn_q8_0, 128, 4, 8>() > 227 * 1024", "true", "q8_0 rows: 4 stages"),
        ("drows::smem_bytes<fattn_q4_0, 128, 7, 8>() > 227 * 1024", "true", "q4_0 rows: 7 stages")]
    for (src, arch), c in checks.items():
        _static_asserts(src, c, arch)
    assert [K.gemm_q8_bn(n) for n in (1, 16, 17, 64, 512)] == [16, 16, 64, 64, 64]


def test_gemm_qs_tile_mirror_matches_c():
    """The host's dense_gemm_qs and dense_gemm_qr tile constants and dense_gemm_qr's types are the
    C's (its shared memory, read from the
    program: test_dynamic_shared_memory_fits, test_smem_read_back_matches_c)."""
    checks = [(n, v, n) for n, v in (("QS_BM", K.GEMMQS_TILE[0]), ("QS_BK", K.GEMMQS_TILE[2]),
                                     ("QS_THREADS", K.GEMMQS_THREADS), ("QS_STAGES", K.GEMMQS_STAGES),
                                     ("QS_LD", K.GEMMQS_LD))]
    checks += [("QR_BM", K.GEMMQR_TILE[0], "QR_BM"), ("QS_BK", K.GEMMQR_TILE[2], "dense_gemm_qr's step")]
    # the fragment decode's types (QbFrag<T>::OK) are the ones the host instantiates dense_gemm_qr for
    checks += [(f"QbFrag<{block_layout(t).type_id}>::OK", "true" if t in K.GEMMQR_TYPES else "false", t)
               for t in BLOCK_TYPES]
    _static_asserts("dense_q.cu", checks, "sm_80")
    assert max(K.GEMMQS_BLOCKS_PER_SM) == K.GEMMQS_TILE[1] == max(K.GEMMQR_BLOCKS_PER_SM) == K.GEMMQR_TILE[1]
    assert sorted(K.GEMMQR_BLOCKS_PER_SM) == sorted(K.GEMMQS_BLOCKS_PER_SM)   # (gemm_qs_bn picks both tiles)
    assert [K.gemm_qs_bn(n) for n in (1, 32, 33, 64, 512)] == [32, 32, 64, 64, 64]
    assert [K.gemm_qs_bn(n, "dense_gemm_qr") for n in (1, 16, 17, 32, 64)] == [32, 32, 64, 64, 64]


def test_gemm_qw_tile_mirror_matches_c():
    """The host's dense_gemm_qw tile (kernels.GEMMQW_TILE, its launch's GEMMQS_THREADS block, one
    block an SM: gemm_tiling) is the C's QW_BM, QW_BN, QW_BK and QW_THREADS, its step is
    dense_gemm_qr's (the same staged rows), and GEMMQW2_TYPES are the types whose 256-row tile fits."""
    checks = [(n, v, n) for n, v in zip(("QW_BM", "QW_BN", "QW_BK"), K.GEMMQW_TILE)]
    checks += [("QW_THREADS", K.GEMMQS_THREADS, "QW_THREADS"), ("QW_BK", K.GEMMQR_TILE[2], "dense_gemm_qr's step")]
    # the 256-row tile (dense_gemm_qw2) for exactly the types whose two stages fit a block
    checks += [(f"QwTile<{block_layout(t).type_id}, 2>::FITS", "true" if t in K.GEMMQW2_TYPES else "false", t)
               for t in K.GEMMQR_TYPES]
    # the half-precision decode (its forms dense_gemm_qwh / qw2h) for the same types
    checks += [(f"QbFragH<{block_layout(t).type_id}>::OK", "true" if t in K.GEMMQR_TYPES else "false", t)
               for t in BLOCK_TYPES]
    _static_asserts("dense_qw.cu", checks, K.HOPPER_ARCH)
    assert K.gemm_tiling("dense_gemm_qw", 512) == K.gemm_tiling("dense_gemm_qwh", 512) == \
        (K.GEMMQW_TILE, 1, K.GEMMQ8_MIN_SPLIT)
    assert K.gemm_tiling("dense_gemm_qw2", 512) == K.gemm_tiling("dense_gemm_qw2h", 512)
    assert K.gemm_tiling("dense_gemm_qw2", 512)[0] == (2 * K.GEMMQW_TILE[0], *K.GEMMQW_TILE[1:])
    # every form's instance, where its stages fit, in the type's program
    for t in K.GEMMQR_TYPES:
        tid = block_layout(t).type_id
        want = [f"dense_gemm_qw<{tid}, {rm}, {h}>" for rm in (1, 2) for h in (0, 1) if rm == 1 or t in K.GEMMQW2_TYPES]
        assert sorted(K.dense_qw_variant(tid).names) == sorted(want)


def test_split_count_fills_whole_waves():
    from ggml_attn.cuda_launch import _split_count
    for base in (1, 3, 8, 16, 40, 100):
        for slots in (132, 264, 396):
            n = _split_count(base, slots, 2, 512)
            assert base * n >= min(2 * slots, base * 128)          # at least two waves (or the cap)
            blocks = base * n
            last = blocks - (-(-blocks // slots) - 1) * slots
            # the last wave is at least as full as with the plain ceil(2 waves / base) count
            n0 = min(-(-2 * slots // base), 128)
            last0 = base * n0 - (-(-(base * n0) // slots) - 1) * slots
            assert last / slots >= last0 / slots - 1e-9 or blocks % slots == 0
    assert _split_count(1000, 264, 2, 512) == 1


def test_launch_config_rules():
    from ggml_attn.cuda_backend import AttnDims, launch_config
    sh = AttnDims(128, 128, 1, 32, 8, 1, 32768, GGML_TYPE_F16)
    c = launch_config("decode", sh, blocks_per_sm=2)
    # 8 head groups; splits for 2 whole waves of 132 SMs x 2 slots: 8 * 66 = 528 = 2 * 264
    assert c.pack == 4 and c.q_tile_tokens == 1 and c.n_splits == 66
    c = launch_config("decode-tc", sh, blocks_per_sm=1)
    assert c.pack == 4 and c.q_tile_tokens == 4 and c.grid == (8, 1, 33)   # 264 blocks: 2 full waves
    sh = AttnDims(128, 128, 2048, 32, 8, 1, 2048, GGML_TYPE_F16)
    c = launch_config("prefill", sh, blocks_per_sm=2)
    # tensor-core grid: (head groups, query tiles, streams * splits); 128-row tiles from 256 tokens
    assert c.pack == 1 and c.q_tile_tokens == 128 and c.n_splits == 1 and c.grid == (32, 16, 1)
    assert c.name.endswith(", 4, 1, 2, 1, false>")
    c = launch_config("prefill", sh, blocks_per_sm=2, wide=False)   # the plan found a ragged batch
    assert c.pack == 4 and c.q_tile_tokens == 16 and c.grid == (8, 128, 1)
    c = launch_config("prefill", sh, blocks_per_sm=2, ext=True)
    assert c.name.endswith(", 4, 1, 2, 1, true>") and c.variant.family == "mma-ext"
    sh1 = AttnDims(128, 128, 1, 32, 8, 1, 32768, GGML_TYPE_F16)
    few = launch_config("decode-tc", sh1, blocks_per_sm=2, max_live={4: 64}).n_splits
    assert few < launch_config("decode-tc", sh1, blocks_per_sm=2).n_splits and few <= 64 // 4
    sh = AttnDims(128, 128, 3, 32, 8, 1, 113, GGML_TYPE_F16)
    c = launch_config("prefill", sh)
    assert c.pack == 4 and c.q_tile_tokens == 16 and c.n_kv_tiles == 2


def test_fused_split_finish_needs_its_shared_memory():
    """A kernel merges its own splits only when it can (not the 128-row tiles) and its shared
    memory holds the merge's weights: rows * (n_splits + 2) + 2 floats."""
    from ggml_attn.cuda_backend import LaunchConfig
    v = K.util_variant()

    def cfg(rows, n_splits, fused=True):
        return LaunchConfig("decode", v, "x", 1, rows, 1, 64, n_splits, 128, (1, 1, n_splits),
                            rows=rows, fused_finish=fused)
    assert cfg(16, 64).finishes_splits(4 * (16 * 66 + 2))
    assert not cfg(16, 64).finishes_splits(4 * (16 * 66 + 2) - 4)
    assert not cfg(16, 2, fused=False).finishes_splits(1 << 16)


def test_decode_tc_grid_filling_the_sms_is_not_split(monkeypatch):
    """A decode-tc grid of >= 0.9 blocks per SM without a mask plan runs unsplit (B=16, 4k: 128
    blocks on 132 SMs); a smaller one, or one with a plan, keeps the wave-filling split count;
    the other kernels are unchanged."""
    from ggml_attn import cuda_launch
    from ggml_attn.cuda_backend import AttnDims, launch_config

    def splits(kernel, ne3, sms=132, **plan):
        monkeypatch.setattr(cuda_launch, "num_sms", lambda: sms)
        return launch_config(kernel, AttnDims(128, 128, 1, 32, 8, ne3, 4096, GGML_TYPE_F16),
                             blocks_per_sm=2, **plan).n_splits
    assert splits("decode-tc", 16) == 1 and splits("decode-tc", 15) == 1   # 120 >= 118.8 blocks
    assert splits("decode-tc", 14) > 1                                      # 112 < 118.8
    assert splits("decode-tc", 16, sms=144) > 1                             # 128 < 129.6 on 144 SMs
    assert splits("decode-tc", 1) == 16                                     # B=1: up to the cap
    assert splits("decode", 16) > 1 and splits("prefill", 16) > 1           # their rules as before
    assert splits("decode-tc", 16, max_live={4: 64}) > 1                    # a mask plan: split


def test_hopper_programs_compile_for_sm_90a_only(default_compiles):
    """The Hopper programs (cuda/hopper_common.cuh: wgmma, TMA, mbarriers) compile for sm_90a
    with no spills and no serialized wgmma pipeline (ptxas's C7511, C7518, ...: a register
    shortage, an integer op on a value the pipeline holds, or a wgmma wait count that differs
    between paths makes every wgmma wait for the one before: found with the softmax's first
    polynomial exponential and with a next-tile S GEMM issued early); they carry arch_suffix "a" and
    get_function loads them only on compute capability 9.0. NVRTC refuses the wgmma ones for
    plain sm_90 (the decode's TMA and mbarriers alone would compile there)."""
    for v in K.hopper_variants():
        assert v.arch_suffix == "a" and v not in K.all_variants()
        r = default_compiles[(v, K.HOPPER_ARCH, False)]
        usage = r["usage"]
        assert set(usage) >= set(r["lowered"]), (v.label, usage)
        assert all(u["spill_stores"] == 0 and u["registers"] <= 255 for u in usage.values()), (v.label, usage)
        if v.family != "hopper-probe":   # (the operand probes run one GEMM each: serialized or not)
            assert not r["serialized"], (v.label, r["serialized"])
        if v.family != "decode-tma":
            err = default_compiles[(v, "sm_90", True)].get("error")
            assert err and "sm_90" in err, (v.label, err)


def test_cubins_are_whole_elf_files():
    """A compiled cubin ends where its ELF header says (program and section header tables
    inside it): CuPy's getCUBIN drops the last byte, kernels.whole_cubin puts it back (nvdisasm
    and cuobjdump read the cached files; the driver no longer reads past the buffer)."""
    import struct
    c = K.compile_variant(K.util_variant(), "sm_80", use_disk_cache=False, refresh=True)
    b = c.cubin
    phoff, shoff = struct.unpack_from("<QQ", b, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", b, 0x36)
    assert max(phoff + phentsize * phnum, shoff + shentsize * shnum) == len(b)
    assert K.whole_cubin(b[:-1]) == b and K.whole_cubin(b) == b and K.whole_cubin(b"not elf") == b"not elf"


# The development probes' macros (tools/dev/qr_probe.py compiles programs with them set): the
# programs the package ships are their defaults, with no option naming them.
PROBE_DEFAULTS = {"dense_q.cu": {"QR_PROBE": "0", "QR_STAGGER": "0"},
                  "dense_qw.cu": {"QW_PROBE": "0", "QW_GROUP": "1", "QW_STAGGER": "0"}}


@pytest.mark.parametrize("source", sorted(PROBE_DEFAULTS))
def test_shipped_programs_are_the_probes_defaults(source):
    text = (Path(K.source_dir()) / source).read_text()
    for name, value in PROBE_DEFAULTS[source].items():
        assert f"#ifndef {name}\n#define {name} {value}\n#endif" in text, (source, name)
    variants = [v for t in K.GEMMQR_TYPE_IDS
                for v in (K.dense_q_variant(t), K.dense_qrm_variant(t), K.dense_qrg_variant(t), K.dense_qw_variant(t))]
    assert variants and not any(o.startswith(("-DQR_", "-DQW_")) for v in variants for o in v.options)
