"""llama-server and ggml-attn-serve-bench on the same trace, the same GGUF and the same GPU
(a GPU-machine script).

    python tools/dev/llamaserver_side_by_side.py --src .lcpp/src.tar.gz --gguf /tmp/m8b.gguf --out $OUT
    python tools/dev/llamaserver_side_by_side.py --prebuilt .lcpp/server-sm90.tar.xz --rates 2,8,32,inf

Steps (logs and traces under ``--out``, or with ``$OUT`` set packed into its ``logs.tgz``;
``serve_side_by_side.json`` written after each, a table last, printed and ``table.md``):

1. llama.cpp's ``llama-server`` built with CUDA from the same source tarball as
   ``llamacpp_side_by_side.py`` (or unpacked from ``--prebuilt``), the 8B-shaped F16 GGUF written
   unless ``--gguf`` names one;
2. for each rate of ``--rates``: the workload ``ggml-attn-serve-bench --rate R`` draws (``-n``,
   ``--prompt-dist``, ``--gen-dist``, ``--seed``), saved as a trace (``--save-trace``), so both
   sides serve the same requests with the same token ids (``serve_trace.prompt_tokens``);
3. llama-server on ``127.0.0.1`` with ``-np`` slots (continuous batching, flash attention on,
   ``-c`` = slots x the longest request), once without and once with ``-kvu``; the trace
   replayed against ``/completion``: each request sent at its arrival time on its own
   connection, token-id prompt, ``n_predict``, ``ignore_eos``, greedy, ``stream``, so every
   token's arrival is timed (TTFT, ITL); the HTTP overhead alone is a ``/health`` round trip
   (median of 50, stated in the JSON, not subtracted);
4. ``ggml-attn-serve-bench --trace`` on the same trace, ``--split`` (default ``all``: ``simple`` on a
   unified cache, the others a stream per sequence) and with ``-kvu`` ``--split-kvu`` (default the
   four that are not ``simple``; an empty list skips a run), with ``--warmup`` (the trace served
   once untimed first; ``--cold``: not) -- llama-server gets a warm-up too, and a first pass is
   where ours builds each new ubatch structure's graph.

llama-server's rows use ``format_serve.row_of`` with ``split`` = ``llama-server``: the same
columns as ours (step counts, pads and KV cells are not known there and read 0).
"""
from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import llamacpp_side_by_side as lcs  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(host: str, port: int, timeout: float, proc=None) -> None:
    """Until ``GET /health`` answers 200 (the model is loaded); RuntimeError after ``timeout`` s
    or when ``proc`` exits."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode} before it was ready")
        try:
            c = http.client.HTTPConnection(host, port, timeout=5)
            c.request("GET", "/health")
            ok = c.getresponse().status == 200
            c.close()
            if ok:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"llama-server on {host}:{port} not ready after {timeout:.0f} s")


def http_overhead(host: str, port: int, n: int = 50) -> float:
    """Median seconds of a ``GET /health`` round trip on a fresh connection (what HTTP alone costs
    a request)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        c = http.client.HTTPConnection(host, port, timeout=10)
        c.request("GET", "/health")
        c.getresponse().read()
        c.close()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def stream_completion(host: str, port: int, prompt: list[int], n_predict: int, timeout: float = 120.0):
    """POST ``/completion`` (streaming, greedy, EOS ignored); ``[(seconds since the send, token
    count)]`` of each event that carried tokens. An event counts its ``tokens`` when llama-server
    sends them (``return_tokens``), else one token: llama-server may hold a token back (an
    incomplete UTF-8 character) and send it with the next. ``timeout``: seconds the server may
    stay silent (connecting, before its first event, between two), else ``TimeoutError`` -- a
    stalled server (its ``-kvu`` run at 16/s, 64 slots, on the H100 at 0ef699c) ends the
    request instead of the run."""
    body = json.dumps(dict(prompt=prompt, n_predict=n_predict, stream=True, ignore_eos=True, cache_prompt=False,
                           temperature=0.0, top_k=1, return_tokens=True))
    t0 = time.perf_counter()
    c = http.client.HTTPConnection(host, port, timeout=timeout)
    c.request("POST", "/completion", body=body, headers={"Content-Type": "application/json"})
    resp = c.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"/completion answered {resp.status}: {resp.read()[:200]!r}")
    events = []
    while True:
        line = resp.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        now = time.perf_counter() - t0
        ev = json.loads(line[5:])
        n = len(ev["tokens"]) if isinstance(ev.get("tokens"), list) else (0 if ev.get("stop") else 1)
        if n:
            events.append((now, n))
        if ev.get("stop"):
            break
    c.close()
    return events


def replay(host: str, port: int, trace, prompts, stall: float = 120.0, slack: float = 30.0) -> tuple[list, float]:
    """Send each request of ``trace`` (``serve_trace.TraceRequest``) at its arrival time, on a thread
    of its own; ``(graph.serve.ServeRequest list with token times, seconds from the first arrival
    to the last token)``. Clock: seconds since the replay started (request 0 at 0). RuntimeError
    when a request failed, the server silent past ``stall`` seconds among them, or when requests
    are still open ``2 * stall + slack`` seconds after the last arrival (a server that keeps a
    connection alive without answering)."""
    from ggml_attn.graph.serve import ServeRequest
    reqs = [ServeRequest(i, r.arrival, prompts[i], r.n_predict) for i, r in enumerate(trace)]
    errors = []
    start = time.perf_counter()

    def one(req):
        try:
            delay = req.arrival - (time.perf_counter() - start)
            if delay > 0:
                time.sleep(delay)
            sent = time.perf_counter() - start
            for t, n in stream_completion(host, port, req.prompt.tolist(), req.n_predict, stall):
                req.token_times += [sent + t] * n
                req.tokens += [0] * n
            req.admitted = sent
            req.finished = req.token_times[-1] if req.token_times else None
        except Exception as e:  # noqa: BLE001 - reported after the replay
            errors.append(f"request {req.rid}: {e!r}")
    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in reqs]
    for t in threads:
        t.start()
    # A bound on the whole replay, not only on each read: at 16/s with -kvu (H100, d650257) the
    # server went silent and the replay outlived every read timeout (the call ran into its limit).
    deadline = start + max(r.arrival for r in reqs) + 2 * stall + slack
    for t in threads:
        t.join(max(0.0, deadline - time.perf_counter()))
    stuck = sum(t.is_alive() for t in threads)   # (daemon threads: left behind, the server stopped next)
    if stuck:
        errors.insert(0, f"{stuck} request(s) still open {2 * stall + slack:.0f} s after the last arrival")
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed, first: {errors[0]}")
    end = max(r.finished for r in reqs)
    return reqs, end - reqs[0].arrival


def server_row(reqs, elapsed: float, inputs: dict) -> dict:
    """llama-server's row in ``format_serve``'s columns (what a server does not report reads 0)."""
    from ggml_attn.cli import format_serve
    from ggml_attn.graph.serve import ServeStats
    stats = ServeStats(elapsed=elapsed, busy=elapsed, n_prompt_tokens=sum(r.n_prompt for r in reqs))
    return format_serve.row_of([dict(requests=reqs, stats=stats)], inputs)


def stop_server(proc, grace: float = 30.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds: a stalled llama-server ignores the first."""
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_server(bins: str, gguf: str, port: int, n_slots: int, n_ctx: int, kvu: bool, log: str, extra=()):
    cmd = [os.path.join(bins, "llama-server"), "-m", gguf, "-ngl", "99", "-fa", "on", "-np", str(n_slots),
           "-c", str(n_ctx), "-b", "2048", "-ub", "512", "--host", "127.0.0.1", "--port", str(port),
           *(["-kvu"] if kvu else []), *extra]
    env = dict(os.environ, LD_LIBRARY_PATH=lcs.library_path(bins))   # llama.cpp's libraries, its process only
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default=os.path.join(ROOT, ".lcpp", "src.tar.gz"), help="llama.cpp source tarball")
    ap.add_argument("--prebuilt", default="", help="tarball of a llama.cpp build's bin/ with llama-server")
    ap.add_argument("--build", default="/tmp/lc", help="llama.cpp build folder (kept: built once)")
    ap.add_argument("--out", default=os.environ.get("OUT", "serve_side_by_side_out"))
    ap.add_argument("--gguf", default="/tmp/m8b.gguf", help="the file both serve (written if missing)")
    ap.add_argument("--rates", default="2,8,32,inf", help="Poisson rates, requests/s (inf: all at once)")
    ap.add_argument("-n", type=int, default=256, help="requests per rate")
    ap.add_argument("-np", type=int, default=64, help="slots (concurrent requests) of both")
    ap.add_argument("--prompt-dist", default="16-200")
    ap.add_argument("--gen-dist", default="32-256")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--split", default="all", help="ours' strategies without -kvu ('': none)")
    ap.add_argument("--split-kvu", default="equal,seq,padded,auto",
                    help="ours' strategies with -kvu ('': none; simple is unified in the run without it)")
    ap.add_argument("--stall-timeout", type=float, default=120.0,
                    help="seconds llama-server may stay silent on a request before its run is recorded as failed")
    ap.add_argument("--cold", action="store_true",
                    help="ours without --warmup (the trace served once untimed first: llama-server is warmed "
                         "up too, and ours builds each new ubatch structure's graph on first sight)")
    ap.add_argument("--verdict", nargs="+", metavar="JSON", default=None,
                    help="print the targets' verdict of these runs' serve_side_by_side.json, rows merged, and exit")
    a = ap.parse_args(argv)
    if a.verdict:
        rows = [r for path in a.verdict for r in json.load(open(path))["rows"]]
        print(verdict(rows))
        return 0
    from ggml_attn.cli import format_serve
    from ggml_attn.cli.models import resolve
    from ggml_attn.cli.serve_trace import load_trace, parse_dist, parse_rates, prompt_tokens, synth_trace, write_trace
    from ggml_attn.graph.serve import cells_needed
    os.makedirs(a.out, exist_ok=True)
    logs = lcs.log_dir(a.out)   # (its traces too: every input of a row)
    if not os.path.exists(a.gguf):
        subprocess.run([sys.executable, os.path.join(ROOT, "tests", "fixtures_gguf.py"), a.gguf, "--preset",
                        "llama-3-8b", "--vocab", "32000"], check=True)
    bins = lcs.build(a.src, a.build, logs, os.cpu_count() or 8, a.prebuilt, targets=("llama-server",))
    n_vocab = resolve(a.gguf).n_vocab
    res = dict(gguf=a.gguf, gpu=lcs._gpu(), date=time.strftime("%Y-%m-%d"),
               commit=os.environ.get("GGML_ATTN_COMMIT", ""), n_slots=a.np, rows=[])

    def save():
        with open(os.path.join(a.out, "serve_side_by_side.json"), "w") as f:
            json.dump(res, f, indent=1)
        lcs.pack_logs(logs, a.out)
    lcs.save_at_exit(save)   # (a timeout's SIGTERM: the server stopped, the logs so far packed)
    ours = shutil.which("ggml-attn-serve-bench")
    for rate in parse_rates(a.rates):
        tag = "inf" if math.isinf(rate) else f"{rate:g}"
        trace_path = os.path.join(logs, f"trace-{tag}.jsonl")
        write_trace(trace_path, synth_trace(rate, a.n, parse_dist(a.prompt_dist, "--prompt-dist"),
                                            parse_dist(a.gen_dist, "--gen-dist"), a.seed))
        trace = load_trace(trace_path)
        prompts = [prompt_tokens(i, r, n_vocab, a.seed) for i, r in enumerate(trace)]
        n_ctx = a.np * max(cells_needed(r.prompt_len, r.n_predict) for r in trace) + 512
        for kvu in (False, True):
            port = free_port()
            log = os.path.join(logs, f"server-{tag}{'-kvu' if kvu else ''}.log")
            proc = start_server(bins, a.gguf, port, a.np, n_ctx, kvu, log)
            try:
                wait_healthy("127.0.0.1", port, 600, proc)
                res["http_overhead_ms"] = http_overhead("127.0.0.1", port) * 1e3
                replay("127.0.0.1", port, trace[:2], prompts[:2], a.stall_timeout)   # warm-up
                reqs, elapsed = replay("127.0.0.1", port, trace, prompts, a.stall_timeout)
                row = server_row(reqs, elapsed, dict(
                    rate=rate, split="llama-server", kv_unified=kvu, prompt_budget=2048, n_slots=a.np,
                    n_requests=len(trace), model=os.path.basename(a.gguf), device="cuda", n_ctx=n_ctx,
                    trace=trace_path, seed=a.seed))
                res["rows"].append(dict(tool="llama-server", **format_serve.row_json(row)))
            except RuntimeError as e:
                res["rows"].append(dict(tool="llama-server", rate=tag, kv_unified=kvu, error=str(e)))
            finally:
                stop_server(proc)
            save()
            splits = a.split_kvu if kvu else a.split
            if not splits:
                continue
            rc, out, _ = lcs.sh([ours, "--device", "cuda", "-m", a.gguf, "--trace", trace_path, "-np", str(a.np),
                                 "--seed", str(a.seed), "--split", splits, "-o", "jsonl"] + (["-kvu"] if kvu else [])
                                + ([] if a.cold else ["--warmup"]),
                                os.path.join(logs, f"ours-{tag}{'-kvu' if kvu else ''}.log"), 900)
            res["rows"] += [dict(tool="ggml-attn", **dict(r, rate=format_serve.row_json(dict(rate=rate))["rate"]))
                            for r in lcs.jsonl(out)]
            if rc != 0:   # the rows it wrote stand; the failure is a row of its own
                res["rows"].append(dict(tool="ggml-attn", rate=tag, kv_unified=kvu,
                                        error=f"exit status {rc} (ours-{tag}{'-kvu' if kvu else ''}.log)"))
            save()
    print(table(res["rows"]) + "\n\n" + verdict(res["rows"]))
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(table(res["rows"]) + "\n\n" + verdict(res["rows"]) + "\n")
    return 0


def verdict(rows: list[dict]) -> str:
    """#44's targets from side-by-side rows (one run's, or several runs' merged: ``--verdict``):
    the saturated throughput (rate inf) of our best row against llama-server's best; and at the
    measured rate where llama-server's best row comes closest to 80% of its peak (its best row at
    any rate), our lowest ITL p99 and TTFT p50 there against that llama-server row's. A line says
    what the rows cannot tell (no saturated run, no finite rate)."""
    ok = [r for r in rows if "error" not in r]
    srv = [r for r in ok if r["tool"] == "llama-server"]
    ours = [r for r in ok if r["tool"] == "ggml-attn"]
    if not srv or not ours:
        return "targets: need rows of both llama-server and ggml-attn"

    def at(rs, rate):
        return [r for r in rs if float(r["rate"]) == rate]

    def name(r):
        return f"{r['split']}{' -kvu' if r['kv_unified'] else ''}"
    top = lambda rs: max(rs, key=lambda r: r["out_tok_per_s"])   # noqa: E731
    peak = top(srv)
    lines = []
    s_inf, o_inf = at(srv, math.inf), at(ours, math.inf)
    if s_inf and o_inf:
        s, o = top(s_inf), top(o_inf)
        lines.append(f"saturated: ours {o['out_tok_per_s']:.0f} out t/s ({name(o)}) / llama-server "
                     f"{s['out_tok_per_s']:.0f} ({name(s)}) = {o['out_tok_per_s'] / s['out_tok_per_s']:.2f}x "
                     f"(target >= 1.5x)")
    else:
        lines.append("saturated: no rate-inf rows of both")
    rates = sorted({float(r["rate"]) for r in srv} & {float(r["rate"]) for r in ours} - {math.inf})
    if not rates:
        lines.append("latency: no finite rate with rows of both")
        return "\n".join(lines)
    rate = min(rates, key=lambda x: abs(top(at(srv, x))["out_tok_per_s"] / peak["out_tok_per_s"] - 0.8))
    s, o = top(at(srv, rate)), at(ours, rate)
    share = s["out_tok_per_s"] / peak["out_tok_per_s"]
    itl, ttft = min(r["itl_ms_p99"] for r in o), min(r["ttft_ms_p50"] for r in o)
    lines.append(f"at {rate:g}/s llama-server ({name(s)}) gives {100 * share:.0f}% of its peak "
                 f"{peak['out_tok_per_s']:.0f}: ITL p99 ours {itl:.1f} ms / {s['itl_ms_p99']:.1f} = "
                 f"{itl / s['itl_ms_p99']:.2f}x, TTFT p50 ours {ttft:.1f} ms / {s['ttft_ms_p50']:.1f} = "
                 f"{ttft / s['ttft_ms_p50']:.2f}x (targets <= 0.7x)")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    """One markdown line per row: tool, rate, strategy, throughput, TTFT and ITL percentiles."""
    lines = ["| tool | rate | split | KVU | out t/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['tool']} | {r['rate']} | error: {r['error']} | | | | | | |")
            continue
        lines.append(f"| {r['tool']} | {r['rate']} | {r['split']} | {int(bool(r['kv_unified']))} | "
                     f"{r['out_tok_per_s']:.1f} | {r['ttft_ms_p50']:.1f} | {r['ttft_ms_p99']:.1f} | "
                     f"{r['itl_ms_p50']:.2f} | {r['itl_ms_p99']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
