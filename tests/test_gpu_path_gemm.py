"""Path ``gemm`` over two streams (graph/path_gemm.py, ``matmul_dispatch.DEQUANT_SIDE_SMS``) on a GPU,
through the CLI's CUDA engine: prompts of more than the tiled GEMMs' tokens, built, captured into a
CUDA graph and replayed, give every token's logits as one stream gives them, with the GEMMs
planned for fewer SMs (needs a GPU; skipped otherwise). The ring's order of events and slots
without a GPU: tests/test_path_gemm.py."""
import numpy as np
import pytest

import fixtures_gguf
from ggml_attn import matmul_dispatch as md
from ggml_attn.cli.models import resolve
from ggml_attn.cli.runner import RunConfig, Runner, cuda_available
from ggml_attn.graph import path_gemm

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a GPU with ggml_attn.cuda_backend")]


@pytest.mark.parametrize("name", ["llama-q4_k_m", "llama-q8_0"])
def test_two_streams_give_the_one_stream_logits(tmp_path_factory, name, monkeypatch):
    path = fixtures_gguf.fixture_path(name, str(tmp_path_factory.mktemp("q")))
    lens = [300, 170, 41]   # 511 tokens: one ubatch past QRGEMM_MAX_TOKENS
    flags = np.ones(sum(lens), dtype=bool)
    got, made, init = {}, [], path_gemm.DequantRing.__init__

    def counted(self, *a):
        made.append(self)
        init(self, *a)
    monkeypatch.setattr(path_gemm.DequantRing, "__init__", counted)
    for streams, side in ((1, None), (2, 24)):
        monkeypatch.setattr(md, "DEQUANT_SIDE_SMS", side)
        made.clear()
        r = Runner(RunConfig(resolve(path), n_ctx=2048, n_seq=len(lens), kv_unified=True, split="simple",
                             n_ubatch=512, device="cuda", layer="model"))
        try:
            runs = []
            for _ in range(3):   # built, captured, replayed
                r.clear()
                rows = []
                # (the logits on the engine's stream, as run_ubatch says: the caller's stream does not wait for it)
                r.decode(r.prompt_batch(lens), logits=flags,
                         on_logits=lambda idx, lg: rows.append(lg.get(stream=r.engine.stream)))
                runs.append(np.concatenate(rows))
            eng = r.engine
            assert (eng.builds, eng.captures, eng.replays) == (1, 1, 1)
            import cupy
            assert all(ring.scratch is eng.model.device_weights(cupy).scratch for ring in made)
            dw = eng.model.device_weights(cupy)
            layer_max = max(m.shape[0] * m.shape[1] for m in dw.layers[0].values() if hasattr(m, "scratch"))
            assert dw.scratch.size >= streams * layer_max   # two slots of a layer matrix with two streams
            assert all(np.isfinite(x).all() for x in runs)
            assert (eng.stream.priority < 0) is (streams == 2)   # the engine's stream first where the ring runs
            for i in (1, 2):   # the captured run, the replay: the same bits
                np.testing.assert_array_equal(runs[i], runs[0], err_msg=f"{name}: {streams} stream(s), run {i} against 0")
            got[streams] = runs[0]
            assert bool(made) is (streams == 2)   # the ring ran the GEMMs where asked, only there
        finally:
            r.close()
    # the same dequantization; cuBLAS planned for 108 SMs may pick another kernel (its own sums)
    np.testing.assert_allclose(got[2], got[1], rtol=2e-3, atol=2e-3 * float(np.abs(got[1]).max()))
