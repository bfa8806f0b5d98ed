"""tools/dev/knob_ab.py: variants parsed and checked up front, knobs set in the child before the
benchmark runs, rows read back per variant and round."""
import pytest

import knob_ab  # tools/dev/ (on sys.path via conftest)


def test_parse_variant_checks_modules_attributes_and_values():
    v = knob_ab.parse_variant("coarse:graph.kv_cache.PROMPT_WHOLE_CACHE_MASK_BYTES=0,dispatch.CELLS_MIN_GAIN=1e9")
    assert v.name == "coarse"
    assert v.knobs == [("ggml_attn.graph.kv_cache", "PROMPT_WHOLE_CACHE_MASK_BYTES", 0),
                       ("ggml_attn.dispatch", "CELLS_MIN_GAIN", 1e9)]
    assert knob_ab.parse_variant("base").knobs == []
    v = knob_ab.parse_variant("vec:matmul_dispatch.Q8XV_TYPES=('Q4_K', 'Q6_K'),dispatch.CELLS_MIN_GAIN=2")
    assert v.knobs == [("ggml_attn.matmul_dispatch", "Q8XV_TYPES", ("Q4_K", "Q6_K")),   # (a tuple's own commas)
                       ("ggml_attn.dispatch", "CELLS_MIN_GAIN", 2)]
    for bad, what in (("x:graph.kv_cache.NOPE=1", "no attribute"), ("x:nomodule.A=1", "no module"),
                      ("x:dispatch.CELLS_MIN_GAIN=abc", "not a Python literal"), ("x:dispatch=1", "MODULE.ATTR"),
                      (":dispatch.CELLS_MIN_GAIN=1", "no name")):
        with pytest.raises(ValueError, match=what):
            knob_ab.parse_variant(bad)


def test_knobs_are_set_in_the_child_before_the_benchmark():
    # an empty preset table makes the benchmark refuse "-m tiny": the knob took effect
    v = knob_ab.parse_variant("nopresets:cli.models.PRESETS={}")
    with pytest.raises(RuntimeError, match="nopresets"):
        knob_ab.run_once(v, "bench", ["-m", "tiny", "-p", "0", "-n", "2", "-r", "1"])


def test_two_variants_two_rounds_one_table(capsys):
    rc = knob_ab.main(["--rounds", "2", "--variant", "a", "--variant", "b:dispatch.CELLS_MIN_GAIN=3.0",
                       "bench", "-m", "tiny", "-p", "0", "-n", "2", "-r", "1", "--device", "cpu"])
    assert rc == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["variant", "row", "avg_ts"]
    rows = [line.split() for line in out[1:]]
    assert [r[0] for r in rows] == ["a", "b"]
    assert all(r[3].count("/") == 1 for r in rows), "each variant: both rounds' numbers"


def test_output_flag_is_refused():
    with pytest.raises(SystemExit):
        knob_ab.main(["--variant", "a", "bench", "-o", "json"])


def test_code_prints_one_variants_program(capsys):
    """--code: the child program of the one variant (to run under a profiler), nothing run; more
    than one variant is refused."""
    import subprocess
    import sys
    assert knob_ab.main(["--code", "--variant", "p:matmul_dispatch.GEMV_PDL_PREFETCH=False", "bench"]) == 0
    code = capsys.readouterr().out
    assert "setattr(importlib.import_module('ggml_attn.matmul_dispatch'), 'GEMV_PDL_PREFETCH', False)" in code
    r = subprocess.run([sys.executable, "-c", code, "-m", "tiny", "-p", "0", "-n", "1", "-r", "1", "--device", "cpu",
                        "-o", "jsonl"], capture_output=True, text=True)
    assert r.returncode == 0 and '"n_gen": 1' in r.stdout
    with pytest.raises(SystemExit):
        knob_ab.main(["--code", "--variant", "a", "--variant", "b", "bench"])


def test_serve_bench_rows_under_two_variants(capsys):
    """serve-bench as a tool: its rows read back per variant (throughput, TTFT p50, ITL p99,
    graphs built), here the CPU run of a short synthetic trace under the graph engine's knob."""
    rc = knob_ab.main(["--rounds", "1", "--variant", "a", "--variant", "b:graph.engine.GRAPH_MEMORY_SHARE=0.0",
                       "serve-bench", "-m", "tiny", "--device", "cpu", "--rate", "inf", "-n", "4", "-np", "2",
                       "--prompt-dist", "4-8", "--gen-dist", "2-3", "--split", "simple"])
    assert rc == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:6] == ["variant", "row", "out_tok_per_s", "ttft_ms_p50", "itl_ms_p99", "graph_builds"]
    assert [line.split()[0] for line in out[1:]] == ["a", "b"]
