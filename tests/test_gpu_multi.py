"""Head-parallel (-sm row) and layer-parallel (-sm layer) ranks on 2 GPUs over NCCL against one
GPU (tools/dev/gpu_multi_check.py), and the CLI's -sm row / -sm layer on 2 GPUs. GPU-only: skipped
without 2 GPUs and NCCL."""
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
    import gpu_multi_check  # tools/dev/ (on sys.path via conftest)
    report = gpu_multi_check.run(2)
    print(json.dumps(report, indent=1))
    print(gpu_multi_check.table(report))
    assert len(report["cases"]) == 8
    assert {c["mode"] for c in report["cases"]} == {"row", "layer"}
    for c in report["cases"]:
        assert c["out_nmse"] <= 5e-4, c
        assert c["kv_nmse"] <= 5e-4, c
        if c["mode"] == "row" and c["layer"] == "attn":
            assert c["kv_nmse"] == 0.0, c            # no communication: the same rows stored
            assert c["comm_calls"] == 0, c
        else:   # row/full: all-reduces; layer: a send per ubatch, the drain per batch
            assert c["comm_calls"] > 0 and c["nccl_ms"] > 0, c
        if c["mode"] == "layer":
            assert c["kv_nmse"] == 0.0, c            # each layer computed as on one GPU, from the same x
        assert c["tg_ts_n_gpu"] > 0 and c["tg_ts_1_gpu"] > 0


@needs_two
@pytest.mark.parametrize("tool,args", [
    ("bench", ["-m", "llama-3-8b", "--n-layer", "2", "-p", "64", "-n", "4", "-r", "1", "--layer", "full"]),
    ("batched_bench", ["-m", "llama-3-8b", "--n-layer", "2", "-npp", "32", "-ntg", "4", "-npl", "2", "--layer", "full"]),
])
@pytest.mark.parametrize("sm", ["row", "layer"])
def test_cli_two_gpus(tool, args, sm, capfd):
    import importlib
    mod = importlib.import_module(f"ggml_attn.cli.{tool}")
    rc = mod.main(args + ["-sm", sm, "--n-gpu", "2", "-o", "jsonl"])
    out, err = capfd.readouterr()
    assert rc == 0, err
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert rows                                  # one table: rank 0's rows only
    assert all(r["avg_ts" if tool == "bench" else "speed"] > 0 for r in rows)
    assert ("NCCL all-reduces" if sm == "row" else "NCCL send/recv") in err


@needs_two
def test_cli_rank_engines_with_cuda_graphs_equal_without():
    """The CLI's -sm row / -sm layer rank engines (NCCL calls inside captured graphs, decode steps
    without a sync between them) leave the same outputs and K/V as without CUDA graphs, and
    match one GPU (tools/dev/gpu_multi_graphs_check.py)."""
    import gpu_multi_graphs_check  # tools/dev/
    rep = gpu_multi_graphs_check.run(2, steps=8)
    print(json.dumps(rep, indent=1))
    for mode in ("row", "layer"):
        m = rep["modes"][mode]
        assert m["out_nmse_vs_one_gpu"] <= 5e-4, (mode, m)
        for r in m["ranks"]:
            assert max(r["out_nmse"], r["k_nmse"], r["v_nmse"]) <= 5e-4, (mode, r)
            assert r["captures"] >= 1 and r["replays"] >= 1, (mode, r)
    assert rep["ok"]
