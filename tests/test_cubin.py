"""ggml_attn/cubin.py reads variables from NVRTC's cubins on the host, and kernels.Compiled.smem
gives each kernel instance the dynamic shared memory its program states (fresh or from the disk
cache). The read-back of every family against the C++ values: tests/test_kernels_compile.py."""
from __future__ import annotations

import json

import pytest

from ggml_attn import cubin as C
from ggml_attn import kernels as K
from ggml_attn.dtypes import GGML_TYPE_F16

pytestmark = pytest.mark.skipif(not K.nvrtc_available(), reason="NVRTC library not installed "
                                "(pip install .[nvrtc])")

_SRC = r"""
template <int A, typename T> struct Cfg { static constexpr int SMEM = A * sizeof(T) + 7; };
template <int A, typename T> __global__ void kern(T* p) { extern __shared__ char s[]; p[threadIdx.x] = s[threadIdx.x] + A; }
template <int A, typename T> __device__ const int kern_smem = Cfg<A, T>::SMEM;
__device__ int zero_;
__device__ long long wide_ = -3;
"""


def _program(names):
    """(cubin, name expression -> mangled name) of _SRC with ``names`` requested, for sm_80."""
    nv = K._nvrtc()
    prog = nv.createProgram(_SRC, "probe.cu", [], [])
    try:
        for n in names:
            nv.addNameExpression(prog, n)
        nv.compileProgram(prog, ["-std=c++17", "-arch=sm_80", "-default-device"])
        return K.whole_cubin(nv.getCUBIN(prog)), {n: nv.getLoweredName(prog, n) for n in names}
    finally:
        nv.destroyProgram(prog)


def test_symbol_int_reads_variable_templates():
    """An instance of a __device__ variable template requested as a name expression stays in the
    cubin, and its value reads back by its lowered name, per instance; a zero-initialized one from
    its NOBITS section; a variable that is not a 4-byte int, or no such symbol, raises."""
    names = ["kern<3, float>", "kern<5, double>", "&kern_smem<3, float>", "&kern_smem<5, double>", "&zero_", "&wide_"]
    cub, low = _program(names)
    assert C.symbol_int(cub, low["&kern_smem<3, float>"]) == 3 * 4 + 7
    assert C.symbol_int(cub, low["&kern_smem<5, double>"]) == 5 * 8 + 7
    assert C.symbol_int(cub, low["&zero_"]) == 0
    assert C.symbol_bytes(cub, low["&wide_"]) == (-3).to_bytes(8, "little", signed=True)
    with pytest.raises(ValueError, match="not an int"):
        C.symbol_int(cub, low["&wide_"])
    with pytest.raises(KeyError):
        C.symbol_int(cub, "_Z9kern_smemILi4EfE")   # an instance not requested: not in the cubin
    assert any(n.startswith(".text.") for n in C.sections(cub))
    with pytest.raises(ValueError, match="not a 64-bit"):
        C.symbol_int(b"\x7fELF\x01" + bytes(64), "x")


def test_compiled_smem_fresh_and_from_disk(tmp_path, monkeypatch):
    """Compiled.smem: each instance's size from its program, the same read from the disk cache
    (the size variables' lowered names kept in the cache's metadata); a cached entry without
    them is compiled again; 0 for a kernel without a size variable; a name the program lacks raises."""
    monkeypatch.setenv("GGML_ATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(K, "_MEM_CACHE", {})
    v = K.cells_variant(64, 64, GGML_TYPE_F16)
    fresh = K.compile_variant(v, "sm_80")
    sizes = {n: fresh.smem(n) for n in v.names}
    assert all(s > 0 for s in sizes.values()) and len(set(sizes.values())) == len(v.names)   # R differs
    assert set(fresh.smem_lowered) == set(v.names)
    monkeypatch.setattr(K, "_MEM_CACHE", {})
    cached = K.compile_variant(v, "sm_80")
    assert cached is not fresh and cached.log == "" and {n: cached.smem(n) for n in v.names} == sizes
    (meta,) = tmp_path.glob("cells-*.json")
    m = json.loads(meta.read_text())
    del m["smem_lowered"]
    meta.write_text(json.dumps(m))
    monkeypatch.setattr(K, "_MEM_CACHE", {})
    again = K.compile_variant(v, "sm_80")
    assert {n: again.smem(n) for n in v.names} == sizes
    assert "smem_lowered" in json.loads(meta.read_text()), "compiled again, the metadata rewritten"
    with pytest.raises(KeyError):
        fresh.smem("fattn_cells<64, 64, __half, 3, 2, 1, 0>")
    util = K.Compiled(fresh.cubin, {"fattn_combine": "fattn_combine"}, "")
    assert util.smem("fattn_combine") == 0


def test_loaded_functions_carry_their_programs_smem(monkeypatch):
    """kernels._load_module pairs each loaded function with its instance's dynamic shared memory
    (Compiled.smem), which get_function launches with unless told otherwise (the driver mocked:
    no GPU)."""
    K.ensure_cuda_namespace()
    pytest.importorskip("cupy")
    from cupy.cuda import driver
    monkeypatch.setattr(driver, "moduleLoadData", lambda data: 1)
    monkeypatch.setattr(driver, "moduleGetFunction", lambda mod, name: name)
    v = K.cells_variant(64, 64, GGML_TYPE_F16)
    comp = K.compile_variant(v, "sm_80")
    funcs = K._load_module(v, "sm_80")
    assert funcs == {n: (comp.lowered[n], comp.smem(n)) for n in v.names}
    assert all(smem > 0 for _, smem in funcs.values())


def test_smem_expr_names_the_size_variable():
    assert K.smem_expr("fattn_vec<128, 128, __half, 4>") == "&fattn_vec_smem<128, 128, __half, 4>"
    assert K.smem_expr("dense_gemm_q8<12, 16>") == "&dense_gemm_q8_smem<12, 16>"
    assert K.smem_expr("dense_gemv_q8x_s<12, 4>") is None and K.smem_expr("fattn_combine") is None
