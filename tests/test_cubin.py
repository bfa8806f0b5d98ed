"""ggml_attn/cubin.py reads variables from NVRTC's cubins on the host."""
from __future__ import annotations

import pytest

from ggml_attn import cubin as C
from ggml_attn import kernels as K

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
