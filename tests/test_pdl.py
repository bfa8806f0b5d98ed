"""Programmatic dependent launch on the host side (ggml_attn/pdl.py), without a GPU: the ctypes
mirrors of cuda.h's ``CUlaunchConfig`` / ``CUlaunchAttribute`` against the header (NVRTC
static_asserts), what a :class:`PdlLaunch` hands the driver (a recording stand-in for
``cuLaunchKernelEx``), its error, and where the 8-bit GEMV is launched so
(``matmul_dispatch.gemv_pdl``). The GPU side is tests/test_gpu_dense_q.py's ``pdl`` cases."""
import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

from ggml_attn import kernels as K
from ggml_attn import matmul_dispatch as md
from ggml_attn import pdl


def _offsets(cls):
    return [(name, getattr(cls, name).offset) for name, _ in cls._fields_]


def test_mirrors_match_cuda_h():
    checks = [(f"offsetof(CUlaunchConfig, {n})", o) for n, o in _offsets(pdl.LaunchConfig)]
    checks += [(f"offsetof(CUlaunchAttribute, {n})", o) for n, o in _offsets(pdl.LaunchAttribute)]
    checks += [("sizeof(CUlaunchConfig)", ctypes.sizeof(pdl.LaunchConfig)),
               ("sizeof(CUlaunchAttribute)", ctypes.sizeof(pdl.LaunchAttribute)),
               ("CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION", pdl.PROGRAMMATIC_STREAM_SERIALIZATION),
               ("offsetof(CUlaunchAttributeValue, programmaticStreamSerializationAllowed)", 0)]
    src = "#include <cuda.h>\n" + "".join(
        f'static_assert({e.replace("offsetof", "__builtin_offsetof")} == {v}, "{e}");\n' for e, v in checks)
    # cuda.h's system headers as NVRTC lacks them: nothing of stdlib.h is used, stdint.h's types
    stdint = ("typedef unsigned int uint32_t; typedef unsigned long long uint64_t; typedef int int32_t; "
              "typedef long long int64_t; typedef unsigned long size_t; typedef unsigned char uint8_t;")
    nv = K._nvrtc()
    prog = nv.createProgram(src, "pdl_mirror.cu", [b"", stdint.encode()], [b"stdlib.h", b"stdint.h"])
    try:
        try:
            nv.compileProgram(prog, ["-std=c++17", "-arch=sm_90", "-default-device"] + [f"-I{d}" for d in K.cuda_include_dirs()])
        except Exception as e:
            pytest.fail(f"a ctypes mirror differs from cuda.h: {e}\n{nv.getProgramLog(prog)}")
    finally:
        nv.destroyProgram(prog)


class _Driver:
    """cuLaunchKernelEx / cuGetErrorName stand-ins: record each launch's configuration."""

    def __init__(self, rc=0):
        self.rc, self.calls = rc, []

    def launch(self, cfg_ref, func, args, extra):
        c = cfg_ref._obj
        a = c.attrs.contents
        self.calls.append(dict(grid=(c.gridDimX, c.gridDimY, c.gridDimZ), block=(c.blockDimX, c.blockDimY, c.blockDimZ),
                               smem=c.sharedMemBytes, stream=c.hStream, n_attrs=c.numAttrs, attr=(a.id, a.value[0]),
                               func=func, args=args, extra=extra))
        return self.rc

    def name(self, rc, out):
        out._obj.value = b"CUDA_ERROR_INVALID_VALUE"
        return 0


def test_pdl_launch_hands_the_driver_its_configuration(monkeypatch):
    drv = _Driver()
    monkeypatch.setattr(pdl, "_DRIVER", [(drv.launch, drv.name)])
    fn = SimpleNamespace(func=0x1234, name="dense_gemv_q8x_v<12, 1, 0>", smem=512)
    p = K.GemvQ8Params()
    launch = pdl.PdlLaunch(fn, (7, 2, 1), (128, 1, 1), p)
    launch._stream = lambda: SimpleNamespace(ptr=0xBEEF)
    launch()
    launch._stream = lambda: SimpleNamespace(ptr=0xCAFE)   # the current stream at each call (a capture's)
    launch()
    first, second = drv.calls
    assert first["grid"] == (7, 2, 1) and first["block"] == (128, 1, 1) and first["smem"] == 512
    assert first["n_attrs"] == 1 and first["attr"] == (pdl.PROGRAMMATIC_STREAM_SERIALIZATION, 1)
    assert first["func"] == 0x1234 and first["args"] == ctypes.addressof(launch.args) and first["extra"] is None
    assert (first["stream"], second["stream"]) == (0xBEEF, 0xCAFE)


def test_pdl_launch_error_names_the_kernel_and_the_driver_error(monkeypatch):
    drv = _Driver(rc=1)
    monkeypatch.setattr(pdl, "_DRIVER", [(drv.launch, drv.name)])
    launch = pdl.PdlLaunch(SimpleNamespace(func=1, name="dense_gemv_q8x_s<14, 1>", smem=0), (1, 1, 1), (32, 1, 1),
                           K.GemvQ8Params())
    launch._stream = lambda: SimpleNamespace(ptr=0)
    with pytest.raises(RuntimeError, match=r"dense_gemv_q8x_s<14, 1>.*CUDA_ERROR_INVALID_VALUE \(1\)"):
        launch()


class _Dev:
    def __init__(self, shape, dtype=np.float32):
        self.a = np.zeros(shape, dtype)
        self.data = SimpleNamespace(ptr=int(self.a.ctypes.data))
        self.flags, self.shape, self.dtype = self.a.flags, self.a.shape, self.a.dtype


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("on, arch, want", [(False, "sm_90", False), (True, "sm_90", True), (True, "sm_90a", True),
                                            (True, "sm_100", True), (True, "sm_89", False), (True, "sm_80", False)])
def test_gemv_launched_with_pdl_where_dispatch_says(monkeypatch, on, arch, want, prefetch):
    from ggml_attn.block_types import block_layout
    from ggml_attn.graph import q8_matmul
    from ggml_attn.graph.model_device import QMatrix
    made = []

    def recorder(kind):
        def make(fn, grid, block, *params):
            made.append((kind, params[0].pdl))
            return lambda: None
        return make

    monkeypatch.setattr(md, "GEMV_PDL", on)
    monkeypatch.setattr(md, "GEMV_PDL_PREFETCH", prefetch)
    monkeypatch.setattr(K, "device_arch", lambda: arch if on else pytest.fail("asked for the GPU with GEMV_PDL off"))
    monkeypatch.setattr(K, "get_function", lambda variant, name, smem=None: SimpleNamespace(name=name, smem=0))
    monkeypatch.setattr(K, "BoundLaunch", recorder("plain"))
    monkeypatch.setattr(pdl, "PdlLaunch", recorder("pdl"))
    mode = (1 if prefetch else 2) if want else 0   # (GemvQ8Params.pdl: 1 with the rows' L2 prefetch, 2 without)
    assert md.gemv_pdl() == mode
    w = QMatrix("Q4_K", (32, 512), _Dev((32, block_layout("Q4_K").row_bytes(512)), np.uint8))
    x, xq, xd, xs = _Dev((1, 512)), _Dev((1, 512), np.int8), _Dev((1, 16)), _Dev((1, 16))
    assert q8_matmul.q8x_launches([w], x, [_Dev((1, 32))], xq, xd, xs, mode=0, quantize=False) is not None
    assert made == [("pdl", mode)] if want else made == [("plain", 0)]
