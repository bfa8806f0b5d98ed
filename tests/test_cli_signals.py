"""Ctrl-C and a closed stdout, on the console scripts as subprocesses: Ctrl-C ends the run
promptly at any point (exit 130, one line, no traceback), a closed stdout is one error line and
exit 2."""
import os
import signal
import subprocess
import sys
import time

import pytest

BIN = os.path.dirname(sys.executable)
FAST = ["-t", "1", "--n-layer", "1", "--device", "cpu"]
ARGS = {"ggml-attn-bench": ["-p", "8", "-n", "0", "-r", "1"],
        "ggml-attn-batched-bench": ["-npp", "8", "-npl", "1", "-ntg", "1"]}


def start(name, *args, **kw):
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.Popen([os.path.join(BIN, name), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env,
                            # a shell's background job starts with SIGINT ignored; undo that
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **kw)


def interrupted(p, name):
    """The process ended on its own after the SIGINT (a day's --delay otherwise) with exit 130
    and one line, no traceback; returns stdout."""
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, (p.returncode, err)
    assert err == f"{name}: interrupted\n", err
    return out


@pytest.mark.parametrize("after", [0.2, 0.5, 1.0])
def test_ctrl_c_early_is_one_line_and_130(after):
    """While Python imports numpy, ggml and the tool (a traceback from the middle of an import
    before) or once the tool runs; --delay 86400 keeps the run from finishing first."""
    p = start("ggml-attn-bench", *ARGS["ggml-attn-bench"], "--delay", "86400", *FAST)
    time.sleep(after)
    p.send_signal(signal.SIGINT)
    interrupted(p, "ggml-attn-bench")


def test_ctrl_c_during_delay_ends_the_wait():
    """The table's header is out, the tool sleeps --delay before the first test: Ctrl-C ends
    the sleep (it ran on to the end of the delay before), the header stays a complete table."""
    p = start("ggml-attn-bench", *ARGS["ggml-attn-bench"], "--delay", "86400", *FAST)
    head = ""
    while head.count("\n") < 2:   # the column names and the rule under them
        ch = p.stdout.read(1)
        assert ch, p.stderr.read()
        head += ch
    p.send_signal(signal.SIGINT)
    out = head + interrupted(p, "ggml-attn-bench")
    lines = out.splitlines()
    assert lines[1].startswith("| --") and "t/s" in lines[0] and lines[2:] == ["", lines[3]]   # no row, the footer


@pytest.mark.parametrize("name", list(ARGS))
@pytest.mark.parametrize("extra", [[], ["--help"]])
def test_closed_stdout_is_one_line_exit_2(name, extra):
    """``tool >&-``: an AttributeError traceback on None.flush before."""
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    p = subprocess.run([os.path.join(BIN, name), *ARGS[name], *FAST, *extra], stdout=None,
                       stderr=subprocess.PIPE, text=True, timeout=120, env=env,
                       preexec_fn=lambda: os.close(1))
    assert p.returncode == 2
    assert p.stderr == f"{name}: error: cannot write to stdout: it is closed\n"


def test_sigterm_stops_like_ctrl_c_with_143():
    """SIGTERM (timeout, kill, a batch scheduler) mid-run: the tool stops as for Ctrl-C -- what it
    printed is complete json, one line 'terminated', exit 143 (it died mid-write before, leaving
    cut json and no message). bench: once its json array has begun (--delay holds the first
    test); batched-bench: once its first row of 200 is out."""
    import json
    p = start("ggml-attn-bench", *ARGS["ggml-attn-bench"], "--delay", "86400", "-o", "json", *FAST)
    assert p.stdout.read(1) == "["
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert (p.returncode, err) == (143, "ggml-attn-bench: terminated\n")
    assert json.loads("[" + out) == []
    p = start("ggml-attn-batched-bench", "-npp", "8", "-ntg", "1", "-npl", "1-200", "-o", "jsonl", *FAST)
    first = json.loads(p.stdout.readline())
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert (p.returncode, err) == (143, "ggml-attn-batched-bench: terminated\n")
    rows = [first] + [json.loads(line) for line in out.splitlines()]
    assert 1 <= len(rows) < 200 and [r["pl"] for r in rows] == list(range(1, len(rows) + 1))
