"""Head-parallel ranks on 2 GPUs over NCCL against one GPU (tools/gpu_multi_check.py), and the
CLI's -sm row on 2 GPUs. GPU-only: skipped without 2 GPUs and NCCL."""
import json

import pytest

pytestmark = pytest.mark.gpu


def _two_gpus() -> bool:
    try:
        import cupy
        from ggml_attn.graph.tp import nccl_available
        return cupy.cuda.runtime.getDeviceCount() >= 2 and nccl_available()
    except Exception:  # noqa: BLE001
        return False


needs_two = pytest.mark.skipif(not _two_gpus(), reason="needs 2 GPUs and NCCL")


@needs_two
def test_two_gpus_equal_one_gpu():
    from ggml_attn.cli import gpu_multi_check
    report = gpu_multi_check.run(2)
    print(json.dumps(report, indent=1))
    assert len(report["cases"]) == 4
    for c in report["cases"]:
        assert c["out_nmse"] <= 5e-4, c
        assert c["kv_nmse"] <= 5e-4, c
        if c["layer"] == "attn":
            assert c["kv_nmse"] == 0.0, c            # no communication: the same rows stored
            assert c["allreduce_calls"] == 0, c
        else:
            assert c["allreduce_calls"] > 0 and c["nccl_ms"] > 0, c
        assert c["tg_ts_n_gpu"] > 0 and c["tg_ts_1_gpu"] > 0


@needs_two
@pytest.mark.parametrize("tool,args", [
    ("bench", ["-m", "llama-3-8b", "--n-layer", "2", "-p", "64", "-n", "4", "-r", "1", "--layer", "full"]),
    ("batched_bench", ["-m", "llama-3-8b", "--n-layer", "2", "-npp", "32", "-ntg", "4", "-npl", "2", "--layer", "full"]),
])
def test_cli_row_two_gpus(tool, args, capfd):
    import importlib
    mod = importlib.import_module(f"ggml_attn.cli.{tool}")
    rc = mod.main(args + ["-sm", "row", "--n-gpu", "2", "-o", "jsonl"])
    out, err = capfd.readouterr()
    assert rc == 0, err
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert rows                                  # one table: rank 0's rows only
    assert "NCCL all-reduces" in err
