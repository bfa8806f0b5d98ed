"""tools/dev/llamaserver_side_by_side.py's client half against a stand-in llama-server on the
loopback: a trace replayed at its arrival times, every streamed token timed, the rows in
ggml-attn-serve-bench's columns. (The real server runs on the GPU machine only.)"""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

import llamaserver_side_by_side as lss
from ggml_attn.cli.serve_trace import TraceRequest

TOKEN_S = 0.004   # the stand-in's time per generated token


class _Server(BaseHTTPRequestHandler):
    """``GET /health`` and a streaming ``POST /completion`` as llama-server answers them: one SSE
    event per token (``tokens`` with its id), then a ``stop`` event; every third event holds its
    token back and sends it with the next (as llama-server does with an incomplete UTF-8 character)."""

    protocol_version = "HTTP/1.1"
    seen: list = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        body = b'{"status":"ok"}'
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(req)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        held = []
        for i in range(req["n_predict"]):
            time.sleep(TOKEN_S)
            held.append(i)
            if i % 3 == 1 and i < req["n_predict"] - 1:
                continue
            self.wfile.write(b"data: " + json.dumps({"content": "x", "tokens": held, "stop": False}).encode() + b"\n\n")
            self.wfile.flush()
            held = []
        self.wfile.write(b'data: {"content": "", "stop": true}\n\n')
        self.wfile.flush()
        self.close_connection = True


@pytest.fixture()
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    _Server.seen = []
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_replay_times_every_token_at_its_arrival(server):
    lss.wait_healthy("127.0.0.1", server, 10)
    assert 0 < lss.http_overhead("127.0.0.1", server, 5) < 1.0
    trace = [TraceRequest(0.0, 3, 4), TraceRequest(0.05, 5, 2), TraceRequest(0.1, 2, 7)]
    prompts = [np.arange(r.prompt_len, dtype=np.int32) + 10 * i for i, r in enumerate(trace)]
    reqs, elapsed = lss.replay("127.0.0.1", server, trace, prompts)
    # what went out: token-id prompts, n_predict, greedy and streamed
    sent = sorted(_Server.seen, key=lambda r: r["prompt"][0])
    assert [r["prompt"] for r in sent] == [p.tolist() for p in prompts]
    assert all(r["stream"] and r["ignore_eos"] and r["top_k"] == 1 for r in sent)
    assert [r["n_predict"] for r in sent] == [4, 2, 7]
    for r, tr in zip(reqs, trace):
        assert len(r.token_times) == tr.n_predict
        assert r.admitted >= tr.arrival - 1e-3                    # sent at its arrival, not before
        assert TOKEN_S * 0.9 <= r.ttft < 1.0
        assert all(d >= 0 for d in r.itl) and r.token_times == sorted(r.token_times)
    # the held-back token arrives with the next one: an ITL of 0 beside one of two tokens' time
    assert min(reqs[2].itl) == 0 and max(reqs[2].itl) >= 2 * TOKEN_S * 0.9
    assert elapsed == pytest.approx(max(r.token_times[-1] for r in reqs))
    row = lss.server_row(reqs, elapsed, dict(rate=20.0, split="llama-server", kv_unified=False, n_requests=3))
    assert (row["n_done"], row["split"]) == (3, "llama-server")
    assert row["out_tok_per_s"] == pytest.approx(13 / elapsed)
    assert row["ttft_ms_p50"] >= TOKEN_S * 1e3 * 0.9


def test_a_server_that_is_gone_is_an_error():
    port = lss.free_port()
    with pytest.raises(RuntimeError, match="not ready"):
        lss.wait_healthy("127.0.0.1", port, 1.0)


class _Trickle(BaseHTTPRequestHandler):
    """A server that answers ``/completion`` with a comment line every 50 ms and never a token:
    no read waits past the stall timeout, yet the request never ends."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            for _ in range(200):
                self.wfile.write(b": waiting\n\n")
                self.wfile.flush()
                time.sleep(0.05)
        except OSError:
            pass


def test_a_replay_that_never_ends_is_an_error_in_bounded_time():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Trickle)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        trace = [TraceRequest(0.0, 3, 4), TraceRequest(0.05, 2, 2)]
        prompts = [np.arange(r.prompt_len, dtype=np.int32) for r in trace]
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError, match="2 request.s. still open"):
            lss.replay("127.0.0.1", httpd.server_address[1], trace, prompts, stall=0.3, slack=0.3)
        assert time.perf_counter() - t0 < 3.0
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_server_that_ignores_sigterm_is_killed():
    import signal
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; "
                             "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE)
    proc.stdout.readline()   # (its handler is set)
    t0 = time.perf_counter()
    lss.stop_server(proc, grace=0.3)
    assert proc.returncode == -signal.SIGKILL and time.perf_counter() - t0 < 5.0


def _row(tool, rate, split, kvu, out, itl99, ttft50):
    return dict(tool=tool, rate=rate, split=split, kv_unified=kvu, out_tok_per_s=out, itl_ms_p99=itl99,
                ttft_ms_p50=ttft50)


def test_verdict_reads_the_issues_targets_off_the_rows(tmp_path, capsys):
    """The saturated ratio of the best rows; the latency ratios at the rate where llama-server's
    best row is nearest 80% of its peak (8/s here: 800 of 1000), ours the lowest there; an error
    row is left out; runs merged from several files by --verdict."""
    runs = [[_row("llama-server", "inf", "llama-server", True, 1000.0, 200.0, 900.0),
             _row("llama-server", "inf", "llama-server", False, 600.0, 150.0, 800.0),
             _row("ggml-attn", "inf", "simple", False, 2500.0, 60.0, 300.0),
             _row("ggml-attn", "inf", "auto", True, 2000.0, 50.0, 250.0)],
            [_row("llama-server", 8.0, "llama-server", True, 800.0, 100.0, 50.0),
             _row("ggml-attn", 8.0, "simple", False, 900.0, 30.0, 40.0),
             _row("ggml-attn", 8.0, "auto", True, 905.0, 20.0, 45.0),
             dict(tool="llama-server", rate="12", kv_unified=True, error="stalled")],
            [_row("llama-server", 2.0, "llama-server", True, 300.0, 40.0, 30.0),
             _row("ggml-attn", 2.0, "simple", False, 300.0, 10.0, 10.0)]]
    text = lss.verdict([r for run in runs for r in run])
    assert "ours 2500 out t/s (simple) / llama-server 1000 (llama-server -kvu) = 2.50x" in text
    assert "at 8/s llama-server (llama-server -kvu) gives 80% of its peak 1000" in text
    assert "ITL p99 ours 20.0 ms / 100.0 = 0.20x" in text and "TTFT p50 ours 40.0 ms / 50.0 = 0.80x" in text
    paths = []
    for i, run in enumerate(runs):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps({"rows": run}))
    assert lss.main(["--verdict", *map(str, paths)]) == 0
    assert capsys.readouterr().out.strip() == text
    assert "no rate-inf rows" in lss.verdict(runs[1]) and "no finite rate" in lss.verdict(runs[0])
    assert "need rows of both" in lss.verdict(runs[0][:2])
