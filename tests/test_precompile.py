"""Compiling ahead (no GPU needed): ``cuda_plan.programs`` names every program the backend
loads for a model's calls, ``kernels.precompile`` puts them in the caches in parallel, and the
CLI's CUDA engine asks for them while it loads the weights (tools/cuda_engine.py)."""
from __future__ import annotations

import itertools

import pytest

from ggml_attn import cuda_launch as L
from ggml_attn import cuda_plan
from ggml_attn import dispatch, matmul_dispatch
from ggml_attn import kernels as K
from ggml_attn.dtypes import GGML_TYPE_BF16, GGML_TYPE_F16, GGML_TYPE_Q4_0, GGML_TYPE_Q8_0

F16, BF16, Q8, Q4 = GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0


def _loaded_program(sh: L.AttnDims, arch: str, mask_tiles: str, reads, plain: bool):
    """The program the backend loads for one call of ``sh`` under auto, or None when no GPU
    kernel runs it (the kernel cuda_backend.bind asks best_kernel for; its launch's variant)."""
    f = dispatch.call_facts(sh, reads=reads, arch=arch, plain=plain, mask_tiles=mask_tiles)
    try:
        c = dispatch.best_kernel("auto", f)
    except ValueError:
        return None
    if not c.on_gpu:
        return None
    t = F16 if dispatch.reads_f16_copies(c.kernel, sh.kv_type, sh.v_type or sh.kv_type) else sh.kv_type
    sh = L.AttnDims(sh.head_dim_k, sh.head_dim_v, sh.n_batch, sh.n_head, sh.n_head_kv, sh.ne3, sh.n_kv, t)
    return L.launch_config(c.kernel, sh, blocks_per_sm=1, ext=not plain).variant


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_programs_hold_every_program_auto_loads(arch):
    """For head sizes, cache types (mixed too), GQA ratios, batch sizes, context lengths, masks
    and cell-list verdicts, the program auto's call loads is among ``programs`` of the model's
    head sizes, types and GQA ratio -- so a run precompiled by them compiles nothing more."""
    heads = ((128, 128), (64, 64), (256, 256), (96, 96), (576, 512))
    types = ((F16, F16), (BF16, BF16), (Q8, Q8), (Q4, Q4), (Q8, F16))
    seen = set()
    for (dk, dv), (kt, vt), gqa, plain in itertools.product(heads, types, (1, 4, 8), (True, False)):
        if (kt != F16 or vt != F16) and not plain:
            continue
        want = set(cuda_plan.programs(dk, dv, kt, vt, gqa, arch, ext=not plain))
        for n_batch, n_kv, mask, reads in itertools.product((1, 3, 16, 200, 512), (256, 4096, 32768),
                                                            ("none", "plain", "masked"), (None, (10.0, 400.0))):
            sh = L.AttnDims(dk, dv, n_batch, gqa * 8, 8, 1, n_kv, kt, v_type=None if vt == kt else vt)
            v = _loaded_program(sh, arch, mask, reads, plain)
            if v is not None:
                assert v in want, (dk, dv, kt, vt, gqa, n_batch, n_kv, mask, reads, v.label, [w.label for w in want])
                seen.add(v.family)
    hopper = {"wgmma", "decode-tma"} if arch == "sm_90" else set()
    assert seen >= {"mma", "mma-ext", "vec", "cells"} | hopper, seen   # the test reached every family


def test_programs_for_a_named_kernel_and_for_no_gpu_kernel():
    """A kernel asked for by name: its own program and util's; one that cannot run the calls
    (the sm_90a prefill off compute capability 9.0, the reference): util's alone."""
    util = K.util_variant()
    got = cuda_plan.programs(128, 128, F16, F16, 4, "sm_90", "prefill-wgmma")
    assert [v.family for v in got] == ["util", "wgmma"] and got[0] == util
    assert cuda_plan.programs(128, 128, F16, F16, 4, "sm_80", "prefill-wgmma") == [util]
    assert cuda_plan.programs(128, 128, F16, F16, 4, "sm_90", "reference") == [util]
    # q8_0 on a kernel that reads f16 copies: its f16 program
    assert [v.names[0] for v in cuda_plan.programs(128, 128, Q8, Q8, 4, "sm_90", "decode-tc")][1] == \
        K.mma_name(128, 128, F16, 4, 1, 1, 2)


def test_precompile_fills_the_disk_cache(tmp_path, monkeypatch):
    """precompile compiles each distinct program once into the disk cache, and says so
    (programs, compiled now); a later load reads the cached cubin (no compile: NVRTC is not
    called again), and precompile then counts none compiled."""
    if not K.nvrtc_available():
        pytest.skip("NVRTC library not installed (pip install .[nvrtc])")
    monkeypatch.setenv("GGML_ATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(K, "_MEM_CACHE", {})
    v = K.util_variant()
    assert K.precompile([v, v], "sm_80") == (1, 1) and K.precompile([v], "sm_80") == (1, 0)
    cubins = sorted(p.name for p in tmp_path.glob("*.cubin"))
    assert len(cubins) == 1 and cubins[0].startswith("util-")
    monkeypatch.setattr(K, "_MEM_CACHE", {})
    nv = _no_compile(K._nvrtc())
    monkeypatch.setattr(K, "_nvrtc", lambda: nv)
    assert K.compile_variant(v, "sm_80").cubin == (tmp_path / cubins[0]).read_bytes()
    assert K.precompile([v], "sm_80") == (1, 0)   # (from the disk cache)


def _no_compile(nv):
    class NoCompile:
        def __getattr__(self, name):
            if name == "compileProgram":
                raise AssertionError("compiled again")
            return getattr(nv, name)
    return NoCompile()


def test_precompile_raises_a_compile_error(monkeypatch):
    """A program that does not compile raises from precompile, as from its first call."""
    if not K.nvrtc_available():
        pytest.skip("NVRTC library not installed (pip install .[nvrtc])")
    bad = K.Variant("util", "fattn_util.cu", ("no_such_kernel<1>",))
    with pytest.raises(RuntimeError, match="NVRTC failed"):
        K.precompile([bad], "sm_80")


def test_cuda_engine_precompiles_the_runs_programs(monkeypatch):
    """The CUDA engine's precompile: the model's attention programs under --kernel, and the
    device graph's dense ops (the cache's store op) -- for a q8_0 cache the sm_90a decode's q8_0
    instance; nothing compiled here (precompile replaced)."""
    from ggml_attn.cli import cuda_engine
    from ggml_attn.cli.models import PRESETS
    from ggml_attn.cli.runner import RunConfig
    asked = []
    monkeypatch.setattr(K, "device_arch", lambda: "sm_90")
    monkeypatch.setattr(K, "precompile", lambda variants, arch: (asked.append((variants, arch)), (len(variants), 2))[1])
    cfg = RunConfig(PRESETS["llama-3-8b"], 4096, device="cpu", type_k="q8_0", type_v="q8_0")
    load = cuda_engine.start_precompile(cfg).result()
    (variants, arch), = asked
    assert (load.programs, load.compiled) == (len(variants), 2) and load.seconds >= 0.0   # (cuda_engine.KernelLoad)
    names = {n for v in variants for n in v.names}
    assert arch == "sm_90" and K.dense_variant() in variants and K.util_variant() in variants
    assert "fattn_decode_tma<fattn_q8_0, 128, 11, true, 7, true, true>" in names
    assert "fattn_wgmma_ws<__half, 128, 2, true, 0, true, true, 1, 1>" in names   # prompts on f16 copies


def _engine_programs(monkeypatch, arch: str = "sm_90") -> list:
    """The programs tools/cuda_engine.start_precompile asks for a --layer model run of the 8B preset
    with a Q4_K + Q6_K + F32 file on a GPU of ``arch`` (precompile recorded, nothing compiled)."""
    from types import SimpleNamespace

    from ggml_attn.cli import cuda_engine
    from ggml_attn.cli.models import PRESETS
    asked = []
    monkeypatch.setattr(K, "device_arch", lambda: arch)
    monkeypatch.setattr(K, "precompile", lambda variants, arch: (asked.append(variants), (len(variants), 0))[1])
    p = PRESETS["llama-3-8b"]
    m = SimpleNamespace(head_dim_k=p.head_dim_k, head_dim_v=p.head_dim_v, n_head=p.n_head, n_head_kv=p.n_head_kv, logit_softcap=0.0,
                        file_type="Q4_K+Q6_K+F32")
    cfg = SimpleNamespace(model=m, type_k="f16", type_v="f16", kernel="auto", layer="model")
    cuda_engine.start_precompile(cfg).result()
    (variants,) = asked
    return variants


@pytest.mark.parametrize("q8x", [0, 2])
@pytest.mark.parametrize("qout", [False, True])
def test_cuda_engine_precompiles_the_block_matmuls_it_will_run(monkeypatch, q8x, qout):
    """--layer model: the block programs of each block type in the file, and the 8-bit-activation
    GEMV's too exactly when dispatch routes GEMVs to it (Q8X_MAX_TOKENS); its instances with the
    8-bit output only when those run as well (GEMV_QUANT_OUT; F32 has none)."""
    monkeypatch.setattr(matmul_dispatch, "Q8X_MAX_TOKENS", q8x)
    monkeypatch.setattr(matmul_dispatch, "GEMV_QUANT_OUT", qout)
    variants = _engine_programs(monkeypatch)
    assert K.dense_q_variant(12) in variants and K.dense_q_variant(14) in variants
    assert (K.dense_q8x_variant(12) in variants) == bool(q8x) and (K.dense_q8x_variant(14) in variants) == bool(q8x)
    assert (K.dense_q8x_qout_variant(12) in variants) == (K.dense_q8x_qout_variant(14) in variants) == bool(q8x and qout)
    assert None not in variants
    assert not any(v.family == "dense-qw" for v in variants)   # (QWGEMM_MIN_TOKENS None: not routed)


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_cuda_engine_precompiles_the_wgmma_gemm_where_routed(monkeypatch, arch):
    """--layer model with matmul_dispatch.QWGEMM_MIN_TOKENS set: on an sm_90 GPU the wgmma block
    GEMM's program of each type of the file it reads (Q4_K and Q6_K, not F32); elsewhere none."""
    monkeypatch.setattr(matmul_dispatch, "QWGEMM_MIN_TOKENS", 129)
    qw = [v for v in _engine_programs(monkeypatch, arch) if v.family == "dense-qw"]
    assert qw == ([K.dense_qw_variant(12), K.dense_qw_variant(14)] if arch == "sm_90" else []), qw


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_cuda_engine_precompiles_the_qr_ab_programs_where_routed(monkeypatch, arch):
    """--layer model with the staged GEMM's A/B knobs on: on an sm_90 GPU dense_gemm_qrm's and
    dense_gemm_qrg's programs of the file's qr types (Q4_K, Q6_K) and, with QR_SPLIT_FINISH, the
    shards holding the dense_gemm_qr instances of each of those programs with the fused split
    finish (each once); elsewhere none of them. As shipped (QR_GATED alone): dense_gemm_qrg's
    programs on sm_90, nothing else of them anywhere."""
    def family(fam, variants):
        return [v for v in variants if v.family == fam]
    shipped = [v for v in _engine_programs(monkeypatch, arch) if v.source == "dense_q.cu"]
    assert not any(v.family == "dense-qrm" or v.options for v in shipped)
    assert family("dense-qrg", shipped) == ([K.dense_qrg_variant(12), K.dense_qrg_variant(14)] if arch == "sm_90" else [])
    monkeypatch.setattr(matmul_dispatch, "QR_GATED", False)
    assert not any(v.family == "dense-qrg" for v in _engine_programs(monkeypatch, arch))
    monkeypatch.setattr(matmul_dispatch, "QRGEMM_ROWS", 256)
    monkeypatch.setattr(matmul_dispatch, "QR_GATED", True)
    monkeypatch.setattr(matmul_dispatch, "QR_SPLIT_FINISH", True)
    variants = _engine_programs(monkeypatch, arch)
    hopper = arch == "sm_90"
    assert family("dense-qrm", [v for v in variants if not v.options]) == \
        ([K.dense_qrm_variant(12), K.dense_qrm_variant(14)] if hopper else [])
    assert family("dense-qrg", [v for v in variants if not v.options]) == \
        ([K.dense_qrg_variant(12), K.dense_qrg_variant(14)] if hopper else [])
    fin = [v for v in variants if "-DQR_SPLIT_FINISH=1" in v.options]
    assert len(fin) == len(set(fin)) and all(any(n.startswith("dense_gemm_qr<") for n in v.names) for v in fin)
    want = {K.qr_finish_variant(K.dense_q_variant(t)).shard_of(f"dense_gemm_qr<{t}, {bn}>") for t in (12, 14)
            for bn in (32, 64)}
    if hopper:
        want |= {K.qr_finish_variant(m(t)) for t in (12, 14) for m in (K.dense_qrm_variant, K.dense_qrg_variant)}
    assert set(fin) == want


def test_large_programs_are_compiled_and_loaded_as_shards(monkeypatch):
    """A program of more instances than its family's SHARD_NAMES is several programs: its names
    in order, each shard within the bound (an mma family's instance each), every name in exactly
    one (``shard_of``); get_function loads only the shard holding the instance it is asked for,
    once per device; a small program is its one shard."""
    import sys
    import types
    from ggml_attn import variants as V
    for v in [K.dense_q8x_variant(14), K.dense_q_variant(12), K.dense_variant(), K.util_variant()] + \
            cuda_plan.programs(128, 128, F16, F16, 4, "sm_90"):
        parts = v.shards()
        k = V.SHARD_NAMES.get(v.family, V.SHARD_NAMES_DEFAULT)
        assert sum((p.names for p in parts), ()) == v.names and all(len(p.names) <= k for p in parts)
        assert all(v.shard_of(n).names == p.names for p in parts for n in p.names)
        assert (len(parts) == 1) == (len(v.names) <= k) and (parts == (v,)) == (len(parts) == 1)
        assert all(p.family == v.family and p.source == v.source and p.options == v.options for p in parts)
    q8 = K.dense_q8x_variant(14)
    assert len(q8.shards()) >= 3
    mma = next(v for v in cuda_plan.programs(128, 128, F16, F16, 4, "sm_90") if v.family == "mma")
    assert len(mma.shards()) == len(mma.names) > 1
    loads = []
    dev = types.SimpleNamespace(id=0, compute_capability="90")
    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(Device=lambda *a: dev)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(K, "_MODULES", {})
    monkeypatch.setattr(K, "_KERNELS", {})
    monkeypatch.setattr(K, "_load_module", lambda part, arch: loads.append(part) or {n: (7, 0) for n in part.names})
    want = q8.names[-1]
    assert K.get_function(q8, want).name == want and loads == [q8.shard_of(want)]
    K.get_function(q8, q8.shard_of(want).names[0])
    assert len(loads) == 1, "the same shard is loaded once"
    K.get_function(q8, q8.names[0])
    assert loads[1] == q8.shards()[0] and len(loads) == 2


def test_precompile_counts_shards(tmp_path, monkeypatch):
    """precompile compiles a large program's shards, each into its own cached cubin."""
    if not K.nvrtc_available():
        pytest.skip("NVRTC library not installed (pip install .[nvrtc])")
    monkeypatch.setenv("GGML_ATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(K, "_MEM_CACHE", {})
    v = K.dense_variant()
    n = len(v.shards())
    assert n > 1 and K.precompile([v], "sm_80") == (n, n)
    assert len(list(tmp_path.glob("dense-*.cubin"))) == n
