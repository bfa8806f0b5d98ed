"""Every CUDA kernel variant compiles for sm_80 and sm_90 with NVRTC (no GPU needed).

Skips only when the NVRTC library itself is missing (install the project's ``nvrtc`` extra).
Also checks that the ctypes mirror of ``struct FattnParams`` matches the C layout, and the
CPU-side launch configuration rules.
"""
from __future__ import annotations

import ctypes
import os
from concurrent.futures import ProcessPoolExecutor

import pytest

from ggml_attn import kernels as K
from ggml_attn.dtypes import GGML_TYPE_BF16, GGML_TYPE_F16

pytestmark = pytest.mark.skipif(not K.nvrtc_available(), reason="NVRTC library not installed "
                                "(pip install .[nvrtc])")

ARCHS = ("sm_80", "sm_90")


def _compile(args):
    variant, arch = args
    c = K.compile_variant(variant, arch, use_disk_cache=False,
                          extra_options=("-Xptxas=-v",) if arch == "sm_90" else ())
    inv = {m: n for n, m in c.lowered.items()}
    usage = {inv.get(k, k): u for k, u in K.resource_usage(c.log).items()}
    return variant.label, arch, len(c.cubin), c.lowered, usage


# Spill bytes ptxas reports for the instances that spill at all (sm_90, NVRTC 13.0,
# 2026-11-30, after the plan's hidden-column words replaced the per-tile V check; f16 and
# bf16 alike; 2026-12-01, MASKED tiles without bound checks and FINITE tiles: D 128 plain
# 24/36 -> 12/12 bytes, the rest as before), with the allowance each may not exceed: the 128-row prefill tiles (MT = 2) of
# D 96-128 hold 128-row accumulators at the 255-register limit; D 320/256 with softcap/ALiBi;
# the CUDA-core decode kernel's 4-row instance at D 320-576. Every other instance must not
# spill. Keys: ("mma", DK, DV, MT, EXT) / ("vec", DK, DV, R).
SPILL_ALLOWANCE = {("mma", 96, 96, 2, True): 12,
                   ("mma", 112, 112, 2, False): 4, ("mma", 112, 112, 2, True): 24,
                   ("mma", 128, 128, 2, False): 24, ("mma", 128, 128, 2, True): 20,
                   ("mma", 320, 256, 1, True): 20, ("vec", 320, 256, 4): 8,
                   ("vec", 512, 512, 4): 28, ("vec", 576, 512, 4): 16}


def _allowance_key(name):
    """fattn_mma<DK, DV, T, NWQ, NWK, MT, ST, EXT> / fattn_vec<DK, DV, T, R> -> SPILL_ALLOWANCE key"""
    if not name.startswith(("fattn_mma<", "fattn_vec<")):
        return None
    a = [x.strip() for x in name[name.index("<") + 1:-1].split(",")]
    if name.startswith("fattn_mma<"):
        return "mma", int(a[0]), int(a[1]), int(a[5]), a[7] == "true"
    return "vec", int(a[0]), int(a[1]), int(a[3])


def test_every_variant_compiles(tmp_path, monkeypatch):
    """Every program compiles for sm_80 and sm_90; on sm_90 every kernel uses <= 255 registers
    and spills no more than SPILL_ALLOWANCE says (nothing, for all but the listed instances)."""
    jobs = [(v, a) for v in K.all_variants() for a in ARCHS]
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers) as ex:
        results = list(ex.map(_compile, jobs))
    assert len(results) == len(jobs)
    seen = 0
    for label, arch, size, lowered, usage in results:
        assert size > 1000, f"{label} {arch}: empty cubin"
        assert all(lowered.values()), f"{label} {arch}: missing lowered names"
        if arch != "sm_90":
            continue
        assert set(usage) >= set(lowered), f"{label}: no ptxas report for some kernels"
        for name, u in usage.items():
            seen += 1
            assert u["registers"] <= 255, (name, u)
            allow = SPILL_ALLOWANCE.get(_allowance_key(name), 0)
            assert u["spill_stores"] <= allow and u["spill_loads"] <= 2 * allow, (name, u)
    assert seen >= len([v for v in K.all_variants()]) , "ptxas reports were parsed"


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


@pytest.mark.parametrize("struct, source", [("FattnParams", "fattn_common.cuh"), ("GemvParams", "dense.cu"),
                                            ("KVStoreParams", "dense.cu")])
def test_params_struct_layouts_match_c(struct, source):
    """The ctypes mirror of each kernel parameter struct has the C layout: static_asserts of
    every member's offset and the size, compiled by NVRTC."""
    cls = getattr(K, struct)
    lines = [f'#include "{source}"', f"__device__ {struct} probe_;"]
    for path, off in _flat_fields(cls):
        lines.append(f"static_assert(__builtin_offsetof({struct}, {path}) == {off}, \"{path}\");")
    lines.append(f"static_assert(sizeof({struct}) == {ctypes.sizeof(cls)}, \"size\");")
    nv = K._nvrtc()
    prog = nv.createProgram("\n".join(lines), "layout.cu", [], [])
    try:
        opts = ["-std=c++17", "-arch=sm_80", f"-I{K.source_dir()}"] + [f"-I{d}" for d in K.cuda_include_dirs()]
        try:
            nv.compileProgram(prog, opts)
        except Exception as e:
            pytest.fail(f"{struct} layout mismatch: {e}\n{nv.getProgramLog(prog)}")
    finally:
        nv.destroyProgram(prog)


def test_smem_fits_h200():
    for (dk, dv) in K.MMA_HEADS:
        for lay in K.mma_layouts(dk, dv):
            assert K.mma_smem_bytes(dk, dv, *lay) <= 227 * 1024, (dk, dv, lay)
    for (dk, dv) in K.VEC_HEADS:
        for r in K.vec_rows_allowed(dk, dv):
            assert K.vec_smem_bytes(dk, dv, r) <= 227 * 1024
    for (dk, dv) in K.CELLS_HEADS:
        for r in K.cells_rows_allowed(dk, dv):
            assert K.cells_smem_bytes(dk, dv, r) <= 48 * 1024   # no opt-in attribute needed


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
    from ggml_attn.cuda_backend import Shapes, launch_config
    sh = Shapes(128, 128, 1, 32, 8, 1, 32768, GGML_TYPE_F16)
    c = launch_config("decode", sh, blocks_per_sm=2)
    # 8 head groups; splits for 2 whole waves of 132 SMs x 2 slots: 8 * 66 = 528 = 2 * 264
    assert c.pack == 4 and c.q_tile_tokens == 1 and c.n_splits == 66
    c = launch_config("decode-tc", sh, blocks_per_sm=1)
    assert c.pack == 4 and c.q_tile_tokens == 4 and c.grid == (8, 1, 33)   # 264 blocks: 2 full waves
    sh = Shapes(128, 128, 2048, 32, 8, 1, 2048, GGML_TYPE_F16)
    c = launch_config("prefill", sh, blocks_per_sm=2)
    # tensor-core grid: (head groups, query tiles, streams * splits); 128-row tiles from 256 tokens
    assert c.pack == 1 and c.q_tile_tokens == 128 and c.n_splits == 1 and c.grid == (32, 16, 1)
    assert c.name.endswith(", 4, 1, 2, 1, false>")
    c = launch_config("prefill", sh, blocks_per_sm=2, wide=False)   # the plan found a ragged batch
    assert c.pack == 4 and c.q_tile_tokens == 16 and c.grid == (8, 128, 1)
    c = launch_config("prefill", sh, blocks_per_sm=2, ext=True)
    assert c.name.endswith(", 4, 1, 2, 1, true>") and c.variant.family == "mma-ext"
    sh1 = Shapes(128, 128, 1, 32, 8, 1, 32768, GGML_TYPE_F16)
    few = launch_config("decode-tc", sh1, blocks_per_sm=2, max_live={4: 64}).n_splits
    assert few < launch_config("decode-tc", sh1, blocks_per_sm=2).n_splits and few <= 64 // 4
    sh = Shapes(128, 128, 3, 32, 8, 1, 113, GGML_TYPE_F16)
    c = launch_config("prefill", sh)
    assert c.pack == 4 and c.q_tile_tokens == 16 and c.n_kv_tiles == 2


def test_fused_split_finish_needs_its_shared_memory():
    """A kernel merges its own splits only when it can (not the 128-row tiles) and its shared
    memory holds the merge's weights: rows * (n_splits + 2) + 2 floats."""
    from ggml_attn.cuda_backend import LaunchConfig
    v = K.util_variant()

    def cfg(rows, n_splits, smem, fused=True):
        return LaunchConfig("decode", v, "x", 1, rows, 1, 64, n_splits, 128, smem, (1, 1, n_splits),
                            rows=rows, fused_finish=fused)
    assert cfg(16, 64, 4 * (16 * 66 + 2)).finishes_splits()
    assert not cfg(16, 64, 4 * (16 * 66 + 2) - 4).finishes_splits()
    assert not cfg(16, 2, 1 << 16, fused=False).finishes_splits()


def test_nat_scores_pick_their_own_program(monkeypatch):
    """cuda_launch.NAT_SCORES: plain tensor-core calls run the "mma-nat" program (compiled with
    FATTN_NAT_SCORES=1, which changes the code), softcap/ALiBi calls keep the log2-domain one."""
    from ggml_attn import cuda_launch
    from ggml_attn.cuda_launch import Shapes, launch_config
    f16 = GGML_TYPE_F16
    prefill, decode = Shapes(64, 64, 300, 32, 8, 1, 4096, f16), Shapes(64, 64, 1, 32, 8, 1, 4096, f16)
    monkeypatch.setattr(cuda_launch, "NAT_SCORES", True)
    for kernel, sh in (("prefill", prefill), ("decode-tc", decode)):
        v = launch_config(kernel, sh, blocks_per_sm=2).variant
        assert v.family == "mma-nat" and v.options == ("-DFATTN_NAT_SCORES=1",), v
        assert launch_config(kernel, sh, ext=True, blocks_per_sm=2).variant.family == "mma-ext"
    monkeypatch.setattr(cuda_launch, "NAT_SCORES", False)
    assert launch_config("prefill", prefill, blocks_per_sm=2).variant.family == "mma"
    with pytest.raises(ValueError):
        K.mma_variant(64, 64, f16, ext=True, nat=True)
    plain, nat = (K.compile_variant(K.mma_variant(64, 64, f16, nat=n), "sm_90", use_disk_cache=False)
                  for n in (False, True))
    assert plain.cubin != nat.cubin, "FATTN_NAT_SCORES did not reach the compiler"


def test_decode_tc_grid_filling_the_sms_is_not_split(monkeypatch):
    """A decode-tc grid of >= 0.9 blocks per SM without a mask plan runs unsplit (B=16, 4k: 128
    blocks on 132 SMs); a smaller one, or one with a plan, keeps the wave-filling split count;
    the other kernels are unchanged."""
    from ggml_attn import cuda_launch
    from ggml_attn.cuda_backend import Shapes, launch_config

    def splits(kernel, ne3, sms=132, **plan):
        monkeypatch.setattr(cuda_launch, "num_sms", lambda: sms)
        return launch_config(kernel, Shapes(128, 128, 1, 32, 8, ne3, 4096, GGML_TYPE_F16),
                             blocks_per_sm=2, **plan).n_splits
    assert splits("decode-tc", 16) == 1 and splits("decode-tc", 15) == 1   # 120 >= 118.8 blocks
    assert splits("decode-tc", 14) > 1                                      # 112 < 118.8
    assert splits("decode-tc", 16, sms=144) > 1                             # 128 < 129.6 on 144 SMs
    assert splits("decode-tc", 1) == 16                                     # B=1: up to the cap
    assert splits("decode", 16) > 1 and splits("prefill", 16) > 1           # their rules as before
    assert splits("decode-tc", 16, max_live={4: 64}) > 1                    # a mask plan: split


def test_hopper_programs_compile_for_sm_90a_only():
    """The Hopper programs (cuda/hopper_common.cuh: wgmma, TMA, mbarriers) compile for sm_90a
    with no spills; they carry arch_suffix "a" and get_function loads them only on compute
    capability 9.0. NVRTC refuses the wgmma ones for plain sm_90 (the decode's TMA and
    mbarriers alone would compile there)."""
    for v in K.hopper_variants():
        assert v.arch_suffix == "a" and v not in K.all_variants()
        c = K.compile_variant(v, K.HOPPER_ARCH, use_disk_cache=False, extra_options=("-Xptxas=-v",))
        usage = K.resource_usage(c.log)
        assert set(usage) >= set(c.lowered.values()), (v.label, usage)
        assert all(u["spill_stores"] == 0 and u["registers"] <= 255 for u in usage.values()), (v.label, usage)
        if v.family != "decode-tma":
            with pytest.raises(RuntimeError, match="sm_90"):
                K.compile_variant(v, "sm_90", use_disk_cache=False)
