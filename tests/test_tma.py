"""ggml_attn.tma's checks of a tiled tensor map, before the driver is called (no GPU needed:
the driver answers only CUDA_ERROR_INVALID_VALUE, these say which rule was broken)."""
from __future__ import annotations

import pytest

from ggml_attn import tma


def test_valid_maps_pass():
    tma.check_tiled(tma.DTYPE_F16, 0x7F0000000000, (128, 4096, 8), (256, 256 * 4096), (64, 64, 1))
    tma.check_tiled(tma.DTYPE_BF16, 256, (160, 100), (512,), (64, 32))
    tma.check_tiled(tma.DTYPE_F16, 256, (128, 64), (256,), (64, 64), tma.SWIZZLE_128B)
    # a permuted view (ggml K with heads interleaved per token): strides need not grow
    tma.check_tiled(tma.DTYPE_F16, 256, (128, 8, 4096), (8 * 256, 256), (64, 1, 64))


@pytest.mark.parametrize("args,match", [
    ((tma.DTYPE_F16, 8, (128, 64), (256,), (64, 64)), "16-byte aligned"),
    ((tma.DTYPE_F16, 256, (128, 64), (264,), (64, 64)), "multiple of 16"),
    ((tma.DTYPE_F16, 256, (128, 64), (0,), (64, 64)), r"\(0, 2\^40\)"),
    ((tma.DTYPE_F16, 256, (128, 64), (1 << 40,), (64, 64)), r"\(0, 2\^40\)"),
    ((tma.DTYPE_F16, 256, (128, 64), (256,), (64, 512)), "1..256"),
    ((tma.DTYPE_F16, 256, (128, 64), (256,), (12, 64)), "multiple of 16"),
    ((tma.DTYPE_F16, 256, (128, 64), (256,), (64,)), "box sides"),
    ((tma.DTYPE_F16, 256, (128, 64), (), (64, 64)), "strides"),
    ((3, 256, (128, 64), (256,), (64, 64)), "element type"),
])
def test_broken_rules_say_which(args, match):
    with pytest.raises(ValueError, match=match):
        tma.check_tiled(*args)


def test_swizzle_span_limits_the_box():
    with pytest.raises(ValueError, match="64-byte swizzle"):
        tma.check_tiled(tma.DTYPE_F16, 256, (128, 64), (256,), (64, 64), tma.SWIZZLE_64B)


def test_encode_checks_before_the_driver(monkeypatch):
    """A map that breaks a rule never reaches cuTensorMapEncodeTiled (no libcuda needed)."""
    monkeypatch.setattr(tma, "_driver", lambda: pytest.fail("the driver was called"))
    with pytest.raises(ValueError, match="16-byte aligned"):
        tma.encode_tiled(tma.DTYPE_F16, 8, (128, 64), (256,), (64, 64))
