"""The development scripts (tools/dev/) run on the device machine, where a mistake costs a device
call: each script's ``if __name__ == "__main__"`` block is its last statement (a function defined
after it is not defined when the block runs: the sanitizer case's dense_q section once failed so,
on the device)."""
import ast
import pathlib

import pytest

DEV = pathlib.Path(__file__).resolve().parents[1] / "tools" / "dev"


@pytest.mark.parametrize("path", sorted(DEV.glob("*.py")), ids=lambda p: p.name)
def test_the_main_block_comes_last(path):
    body = ast.parse(path.read_text()).body
    mains = [i for i, n in enumerate(body) if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    assert not mains or mains[-1] == len(body) - 1, f"{path.name}: statements after the __main__ block"


def test_ncu_kernel_table_sums_launches_by_kernel(tmp_path, capsys):
    import sys
    sys.path.insert(0, str(DEV))
    import ncu_kernel_table as m
    head = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
            '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n')
    row = '"{i}","1","python","h","{k}","1","7","(128, 1, 1)","(8, 1, 1)","0","9.0","m","gpu__time_duration.sum","{u}","{v}"\n'
    text = ("==PROF== Connected to process 1\n" + head + row.format(i=0, k="gemv<12, 1>", u="us", v="18.5")
            + row.format(i=1, k="quant", u="ns", v="2,500") + row.format(i=2, k="gemv<12, 1>", u="usecond", v="17.5"))
    t = m.table(m.read_rows(text))
    assert [(e["kernel"], e["launches"], e["total_us"]) for e in t] == [("gemv<12, 1>", 2, 36.0), ("quant", 1, 2.5)]
    assert abs(sum(e["share"] for e in t) - 1.0) < 1e-3
    p = tmp_path / "x.csv"
    p.write_text(text)
    assert m.main([str(p), "--per", "2", "--json", str(tmp_path / "t.json")]) == 0
    assert "19.2 us per 1/2" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no ncu CSV"):
        m.read_rows("nothing here")


def test_profile_cases_name_their_ncu_filter():
    import sys
    sys.path.insert(0, str(DEV))
    import gpu_profile_case as g
    assert set(g.NCU_FILTERS) <= set(g.CASES)
    from ggml_attn import kernels as K
    n_forms = sum(K.q8x_form_reads(f, "Q4_K") for f in K.Q8X_FORMS)   # (gemv_q8x_fns' calls: Q4_K's forms, F16)
    assert g.ncu_args("gemv-q8x") == f"-k regex:dense_gemv --launch-skip {n_forms} --launch-count {2 * (n_forms + 1)}"
    assert g.ncu_args("masked").startswith("-k regex:fattn_mma ")
    with pytest.raises(SystemExit, match="unknown case"):
        g.ncu_args("nope")


def test_decode_quant_profile_runs_each_shape_through_its_own_kinds_instances(monkeypatch):
    import sys
    sys.path.insert(0, str(DEV))
    import gpu_profile_case as g
    monkeypatch.setenv("DECODE_QUANT_SHAPES", "q8_0:1:32768,f16:64:4096")
    monkeypatch.setenv("DECODE_TMA_CONFIGS", "q8_0-scratch,q4_0-scratch")
    assert g.quant_calls() == [(("q8_0", 1, 32768), ""), (("q8_0", 1, 32768), "q8_0-scratch"),
                               (("f16", 64, 4096), "")]
    assert g.ncu_args("decode-quant").endswith("--launch-skip 0 --launch-count 6")   # (each call twice)
    monkeypatch.setenv("DECODE_QUANT_SHAPES", "q5_0:1:32768")
    with pytest.raises(SystemExit, match="not kind:B:cells"):
        g.quant_shapes()


def test_llamaserver_replay_fails_a_stalled_server_instead_of_hanging():
    """A server that sends one token event and then stays silent: the replay raises within its
    stall timeout (the llama-server run is recorded as failed) instead of waiting forever."""
    import http.server
    import sys
    import threading
    import time
    from types import SimpleNamespace

    import numpy as np
    sys.path.insert(0, str(DEV))
    import llamaserver_side_by_side as ls

    class Stall(http.server.BaseHTTPRequestHandler):
        def do_POST(self):   # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(b'data: {"tokens": [5]}\n\n')
            self.wfile.flush()
            time.sleep(5)

        def log_message(self, *args):
            pass
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stall)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="request 0"):
            ls.replay("127.0.0.1", srv.server_address[1], [SimpleNamespace(arrival=0.0, n_predict=4)],
                      [np.arange(3, dtype=np.int32)], stall=0.5)
        assert time.monotonic() - t0 < 4
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("script", sorted(p.name for p in DEV.glob("*.sh")))
def test_shell_scripts_parse(script):
    import subprocess
    r = subprocess.run(["bash", "-n", str(DEV / script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_commit_ab_refuses_what_it_cannot_run(tmp_path):
    """tools/dev/commit_ab.sh: usage without arguments, an unknown CLI and an unprepared commit
    are refused with exit status 2 and a line saying why (nothing installed or run)."""
    import subprocess
    sh = str(DEV / "commit_ab.sh")
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)}
    r = subprocess.run(["bash", sh], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "--prepare COMMIT" in r.stdout
    r = subprocess.run(["bash", sh, "abc1234", "1", "nope", "-p", "1"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "unknown CLI nope" in r.stderr
    r = subprocess.run(["bash", sh, "0000000", "1", "bench", "-p", "1"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "build/ab-0000000 missing" in r.stderr


def test_side_by_side_logs_come_back_packed(tmp_path, monkeypatch):
    """On a device machine ($OUT set) the side-by-side scripts log into a folder of their own
    and pack it into out/logs.tgz after every step (the machine returns at most 8 files);
    elsewhere the logs stay loose in out."""
    import sys
    import tarfile
    sys.path.insert(0, str(DEV))
    import llamacpp_side_by_side as lcs
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.delenv("OUT", raising=False)
    assert lcs.log_dir(str(out)) == str(out)
    lcs.pack_logs(str(out), str(out))
    assert not (out / "logs.tgz").exists()
    monkeypatch.setenv("OUT", str(out))
    logs = lcs.log_dir(str(out))
    assert logs != str(out)
    for name in ("a.log", "b.log"):
        (pathlib.Path(logs) / name).write_text(name)
    lcs.pack_logs(logs, str(out))
    (pathlib.Path(logs) / "c.log").write_text("c")
    lcs.pack_logs(logs, str(out))   # written anew: every log so far
    with tarfile.open(out / "logs.tgz") as t:
        assert sorted(t.getnames()) == ["logs", "logs/a.log", "logs/b.log", "logs/c.log"]
    assert sorted(p.name for p in out.iterdir()) == ["logs.tgz"]


def test_side_by_side_load_rows_time_ours_cold_and_cached(tmp_path, monkeypatch):
    """The load rows: llama.cpp's one-token run once, ours twice with -v (the first compiling what
    the kernel cache lacks, the second reading it), each its own log; the table shows both of
    ours against llama.cpp's one load."""
    import sys
    from types import SimpleNamespace
    sys.path.insert(0, str(DEV))
    import llamacpp_side_by_side as lcs
    calls, times = [], iter([1.0, 4.6, 1.5])
    monkeypatch.setattr(lcs, "sh", lambda cmd, log, timeout, env=None: (calls.append((cmd, log)), (0, "", next(times)))[1])
    a = SimpleNamespace(logs=str(tmp_path))
    rows = lcs.load_rows(a, "/m.gguf", "lbb", "obb", {}, "_Q4_K_M", file="Q4_K_M")
    assert [(r["tool"], r["seconds"], r.get("cached")) for r in rows] == \
        [("llama.cpp", 1.0, None), ("ggml-attn", 4.6, False), ("ggml-attn", 1.5, True)]
    assert [pathlib.Path(log).name for _, log in calls] == ["lc_load_Q4_K_M.log", "ours_load_Q4_K_M.log",
                                                            "ours_load_Q4_K_M_cached.log"]
    assert all("-v" in cmd for cmd, _ in calls[1:]) and calls[0][0][:3] == ["lbb", "-m", "/m.gguf"]
    table = lcs.table(rows).splitlines()
    assert table[2:] == ["| Q4_K_M load time (s) | 1.0 | 4.6 | 4.60 |",
                         "| Q4_K_M load time, our kernels cached (s) | 1.0 | 1.5 | 1.50 |"]


def test_side_by_side_saves_what_it_has_when_a_timeout_stops_it(tmp_path):
    """save_at_exit: SIGTERM (what `timeout` sends) ends the script with status 143 after one more
    save -- the results and the packed logs so far -- and a child it was waiting on is killed."""
    import os
    import signal
    import subprocess
    import sys
    script = tmp_path / "run.py"
    script.write_text(
        "import os, pathlib, subprocess, sys\n"
        f"sys.path.insert(0, {str(DEV)!r})\n"
        "import llamacpp_side_by_side as lcs\n"
        f"out = pathlib.Path({str(tmp_path)!r})\n"
        "lcs.save_at_exit(lambda: (out / 'saved.json').write_text('{}'))\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "(out / 'child').write_text(str(child.pid))\n"
        "try:\n"   # ('ready' inside: a SIGTERM handled just after the print still kills the child)
        "    print('ready', flush=True)\n"
        "    child.wait()\n"
        "finally:\n"
        "    child.kill()\n")
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 143
    assert (tmp_path / "saved.json").read_text() == "{}"
    pid = int((tmp_path / "child").read_text())
    import time
    state, deadline = "R", time.monotonic() + 10   # (SIGKILL lands asynchronously: a loaded machine
    while time.monotonic() < deadline:             # showed the child still running just after)
        try:   # the child is gone (or a zombie of a dead parent, reaped by init)
            os.kill(pid, 0)
            state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (ProcessLookupError, FileNotFoundError):
            state = "gone"
        if state in ("Z", "X", "gone"):
            break
        time.sleep(0.05)
    assert state in ("Z", "X", "gone"), state


def test_serve_structures_counts_builds_as_the_kept_graphs_allow(capsys):
    """tools/dev/serve_structures.py: a second pass of the same trace builds fewer graphs than the
    first when every structure stays kept, and more with a byte bound too small to keep them."""
    import serve_structures as ss

    def builds(*extra):
        assert ss.main(["--rate", "20", "-n", "24", "-np", "16", "-c", "8192", "--passes", "2", *extra]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert [ln.split(":")[0] for ln in lines] == ["pass 1", "pass 2"]
        return [int(ln.split("builds ")[1].split(",")[0]) for ln in lines]
    for extra in ((), ("--per-stream",)):   # one buffer, a stream per sequence
        roomy, tight = builds("--graph-gib", "0", *extra), builds("--graph-gib", "0.01", *extra)
        assert roomy[0] > 0 and roomy[1] < roomy[0], (extra, roomy)
        assert tight[1] > roomy[1], (extra, tight, roomy)


def test_cli_profile_writes_the_profile_and_passes_the_cli_exit_code(tmp_path, capsys):
    import pstats
    import sys
    sys.path.insert(0, str(DEV))
    import cli_profile as m
    assert m.main(["--out", str(tmp_path), "--top", "5", "bench", "-p", "8", "-n", "2", "-r", "1"]) == 0
    text = (tmp_path / "cli_profile.txt").read_text()
    assert text.startswith("ggml-attn-bench -p 8 -n 2 -r 1\nrc 0,") and "== top 5 by tottime" in text
    assert pstats.Stats(str(tmp_path / "cli.prof")).total_calls > 0
    assert m.main(["--out", str(tmp_path / "bad"), "bench", "-p", "x"]) == 2   # (argparse's error exit)
    assert "rc 2," in (tmp_path / "bad" / "cli_profile.txt").read_text()
