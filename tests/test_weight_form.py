"""The device form of block-type matrices (graph/model_device.py ``keep_blocks``, the one place
deciding): in their blocks, or F16 (``GGML_ATTN_WEIGHTS=f16``); the F16 form's bytes
and jobs (a tied block head gets a folded copy of its own). The forms' logits on a GPU:
tests/test_model.py::test_gpu_logits_and_greedy_tokens (both forms of every quantized fixture)."""
import numpy as np
import pytest

import fixtures_gguf
from ggml_attn.graph import model_device
from ggml_attn.graph.model import load_gguf
from ggml_attn.graph.model_device import DeviceWeights, _jobs, keep_blocks


class FakeGPU:
    """An array module that is not numpy, with ``cuda.runtime.memGetInfo`` saying ``free``."""

    def __init__(self, free):
        free_bytes = free

        class runtime:
            @staticmethod
            def memGetInfo():
                return free_bytes, 2 * free_bytes

        class cuda:
            pass
        cuda.runtime = runtime
        self.cuda = cuda


@pytest.fixture(scope="module")
def q4km(tmp_path_factory):
    return load_gguf(fixtures_gguf.fixture_path("llama-q4_k_m", tmp_path_factory.mktemp("w")))


def test_auto_keeps_the_blocks(q4km, monkeypatch):
    """"auto" keeps block matrices in their blocks whatever the free memory (faster at one
    sequence than their F16 form, a quarter of its bytes); host arrays always do."""
    monkeypatch.setattr(model_device, "WEIGHTS", "auto")
    assert keep_blocks(q4km, FakeGPU(1 << 50)) == (True, "GGML_ATTN_WEIGHTS=auto")
    assert keep_blocks(q4km, FakeGPU(1))[0] is True
    assert keep_blocks(q4km, np) == (True, "host arrays")


@pytest.mark.parametrize("form, blocks", [("blocks", True), ("f16", False)])
def test_the_setting_forces_a_form(q4km, monkeypatch, form, blocks):
    monkeypatch.setattr(model_device, "WEIGHTS", form)
    assert keep_blocks(q4km, FakeGPU(1 << 50))[0] is blocks
    assert keep_blocks(q4km, FakeGPU(1))[0] is blocks


def test_an_unknown_setting_is_refused(q4km, monkeypatch):
    monkeypatch.setattr(model_device, "WEIGHTS", "fp16")
    with pytest.raises(ValueError, match="GGML_ATTN_WEIGHTS='fp16'.*auto, blocks, f16"):
        keep_blocks(q4km, FakeGPU(1 << 50))


def test_f16_bytes_and_a_tied_block_head(tmp_path_factory):
    """F16 form: 2 bytes a value for every matrix; a tied block head (gemma-q8_0) gets its own
    folded copy (a job of its own), where the block form shares the embedding's blocks."""
    m = load_gguf(fixtures_gguf.fixture_path("gemma-q8_0", tmp_path_factory.mktemp("t")))
    assert m.tied_output
    mats = [m.tok_embd] + [lw[k] for lw in m.layers for k in ("wq", "wk", "wv", "wo", "wg", "wu", "wd")]
    vec = DeviceWeights.expected_nbytes(m, blocks=True) - sum(w.nbytes for w in mats)
    f16 = sum(2 * int(np.prod(w.ne)) for w in mats) + 2 * int(np.prod(m.output.ne))
    assert DeviceWeights.expected_nbytes(m, blocks=False) == f16 + vec
    assert [k for k, _, _ in _jobs(m, True)][-1] != "output"
    assert [k for k, _, _ in _jobs(m, False)][-1] == "output"
