"""tools/dev/stage_profile.py on the CPU: per phase, one plan and one engine step per ubatch, a build
per new structure, one report per run of a row, and every patch undone afterwards."""
import json
import os

import pytest

import stage_profile  # tools/dev/ (on sys.path via conftest)
from ggml_attn.cli import batched_bench, runner
from ggml_attn.graph import build, driver

FAST = ["-m", "tiny", "-t", "1", "--device", "cpu", "--prompt-lens", "5,9,3", "-ntg", "3", "-kvu"]


def test_stage_tables_per_run(tmp_path, capsys):
    orig = (driver.plan_ubatch, build.build_ubatch_graph, runner.Runner.step_batch, batched_bench.run_row)
    out = tmp_path / "s.json"
    assert stage_profile.main(["--json", str(out), "batched-bench", *FAST, "-r", "2", "--warmup"]) == 0
    err = capsys.readouterr().err
    rep = json.loads(out.read_text())
    assert len(rep["rows"]) == 3 and err.count("stage_profile: B=3:") == 3   # warm-up + 2 repetitions
    for row in rep["rows"]:
        st = {(s["phase"], s["stage"]): s for s in row["stages"]}
        assert st["prompt", "plan"]["calls"] == row["ubatches"] == st["prompt", "run"]["calls"]
        assert st["decode", "plan"]["calls"] == 3 == st["decode", "run"]["calls"]   # one ubatch per step
        assert all(s["ms"] >= 0 for s in row["stages"])
    first = {(s["phase"], s["stage"]) for s in rep["rows"][0]["stages"]}
    later = {(s["phase"], s["stage"]) for s in rep["rows"][-1]["stages"]}
    assert ("prompt", "build") in first   # the warm-up run builds; later runs may reuse
    assert ("prompt", "load_plan") in later or ("prompt", "build") in later
    assert rep["replays"] == {}            # CPU: nothing captured
    assert (driver.plan_ubatch, build.build_ubatch_graph, runner.Runner.step_batch,
            batched_bench.run_row) == orig


def test_json_path_checked_before_running(tmp_path, capsys, monkeypatch):
    ran = []
    monkeypatch.setattr(batched_bench, "main", lambda argv: ran.append(argv) or 0)
    for bad in (tmp_path / "no" / "s.json", tmp_path):
        with pytest.raises(SystemExit) as e:
            stage_profile.main(["--json", str(bad), "batched-bench", *FAST])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "--json" in err and "Traceback" not in err
    assert ran == []


def test_json_write_error_is_one_line(capsys, monkeypatch):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    monkeypatch.setattr(batched_bench, "main", lambda argv: 0)
    with pytest.raises(SystemExit) as e:
        stage_profile.main(["--json", "/dev/full", "batched-bench", *FAST])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith("stage_profile: error: --json: cannot write /dev/full")


def test_negative_replays_is_a_usage_error(capsys, monkeypatch):
    ran = []
    monkeypatch.setattr(batched_bench, "main", lambda argv: ran.append(argv) or 0)
    with pytest.raises(SystemExit) as e:
        stage_profile.main(["--replays", "-1", "batched-bench", *FAST])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--replays must be at least 0" in err and ran == []
