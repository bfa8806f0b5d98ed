"""ggml_attn.hopper_prefill's checks, without a GPU: what the sm_90a prefills take."""
from __future__ import annotations

from ggml_attn import hopper_prefill as hp
from ggml_attn.cuda_backend import Shapes
from ggml_attn.dtypes import GGML_TYPE_BF16, GGML_TYPE_F16
from ggml_attn.tensor import TensorDesc


def _t(ptr=256, nb1=256):
    return TensorDesc(ptr, GGML_TYPE_F16, (128, 64, 2, 1), (2, nb1, nb1 * 64, nb1 * 128))


def test_takes_d128_f16_aligned():
    sh = Shapes(128, 128, 64, 8, 2, 1, 64, GGML_TYPE_F16)
    assert hp.why_not(sh, _t(), _t(), _t()) is None
    assert "D 128" in hp.why_not(Shapes(64, 64, 64, 8, 2, 1, 64, GGML_TYPE_F16), _t(), _t(), _t())
    assert "f16" in hp.why_not(Shapes(128, 128, 64, 8, 2, 1, 64, GGML_TYPE_BF16), _t(), _t(), _t())
    assert "aligned" in hp.why_not(sh, _t(ptr=260), _t(), _t())
    assert "aligned" in hp.why_not(sh, _t(), _t(nb1=264), _t())
    assert "dst" in hp.why_not(sh, _t(), _t(), _t(), TensorDesc(4, 0, (128, 2, 64, 1), (4, 512, 1024, 65536)))


def test_kv_map_rejects_strides_tma_cannot_take():
    """kv_map's tensor map: a stride that is not a multiple of 16 bytes is refused with a message
    naming it (before the driver, which answers only "invalid value")."""
    import pytest
    with pytest.raises(ValueError, match="stride of dim 2"):
        hp.kv_map(TensorDesc(256, GGML_TYPE_F16, (128, 64, 2, 1), (2, 256, 256 * 64 + 8, 256 * 128 + 16)), 128)


def test_ws_configs_fit_shared_memory():
    """Every version-1 instance's ring fits the H100/H200's 227 KB of shared memory per block."""
    for name, bk, stages in hp.WS_CONFIGS.values():
        assert hp.smem_ws(bk, stages) <= 227 * 1024, name
