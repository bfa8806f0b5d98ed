"""Ctrl-C and a closed stdout, on the console scripts as subprocesses: Ctrl-C ends the run
promptly at any point (exit 130, one line, no traceback), a closed stdout is one error line and
exit 2."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ggml_attn import _cli_start

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


def test_sighup_stops_like_sigterm_with_129():
    """SIGHUP (the terminal or ssh session gone) mid-run: as SIGTERM -- complete json, one line
    'hangup', exit 129 (it ended the process at once, leaving json cut after a row)."""
    import json

    def reset():   # SIGINT and SIGHUP as a login shell's job has them (a test runner may ignore them)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    p = subprocess.Popen([os.path.join(BIN, "ggml-attn-bench"), *ARGS["ggml-attn-bench"], "--delay", "86400",
                          "-o", "json", *FAST], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         preexec_fn=reset)
    assert p.stdout.read(1) == "["
    p.send_signal(signal.SIGHUP)
    out, err = p.communicate(timeout=60)
    assert (p.returncode, err) == (129, "ggml-attn-bench: hangup\n")
    assert json.loads("[" + out) == []


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


# ------------------------------------------------------------------ Ctrl-C during start-up
# A Ctrl-C at a chosen moment of a console script's start-up, deterministically: this
# sitecustomize (run by the interpreter before the script) sends SIGINT to the process as the
# module named in GGML_ATTN_TEST_SIGINT_AT starts to import; the handler runs at once.
SIGINT_AT = textwrap.dedent("""
    import os, signal, sys

    class _SigintAt:
        def __init__(self, name):
            self.name = name

        def find_spec(self, name, path=None, target=None):
            if name == self.name:
                sys.meta_path.remove(self)
                signal.raise_signal(signal.SIGINT)
            return None

    _at = os.environ.pop("GGML_ATTN_TEST_SIGINT_AT", "")
    if _at:
        sys.meta_path.insert(0, _SigintAt(_at))
""")
SCRIPTS = {"ggml-attn-bench": "bench", "ggml-attn-batched-bench": "batched_bench",
           "ggml-attn-serve-bench": "serve_bench"}


def test_early_setup_knows_every_console_script():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert set(_cli_start.CONSOLE_SCRIPTS) == set(scripts) == set(SCRIPTS)


def _start_with_sigint_at(tmp_path, exe, module):
    (tmp_path / "sitecustomize.py").write_text(SIGINT_AT)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(PYTHONPATH=str(tmp_path), GGML_ATTN_TEST_SIGINT_AT=module)
    # --version: imports all of the tool, then prints one line (the hook missed) and exits 0
    return subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=120, env=env,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.mark.parametrize("name", list(SCRIPTS))
@pytest.mark.parametrize("at", ["numpy", "ggml", "tool"])
def test_ctrl_c_during_start_up_is_one_line_and_130(tmp_path, name, at):
    """Ctrl-C while the script imports numpy, ggml, the tool: from ``import ggml_attn``'s first
    line on (``_cli_start``), one line and 130. ggml-attn-serve-bench printed a traceback: the
    early handler did not know its name."""
    module = f"ggml_attn.cli.{SCRIPTS[name]}" if at == "tool" else at
    r = _start_with_sigint_at(tmp_path, os.path.join(BIN, name), module)
    assert (r.returncode, r.stderr) == (130, f"{name}: interrupted\n"), r.stderr[-2000:]
    assert r.stdout == ""


def test_ctrl_c_during_start_up_through_a_symlink(tmp_path):
    """A llama.cpp user's ``ln -s .../ggml-attn-bench ~/bin/llama-bench``: the same tool, the
    same start-up (a traceback before: the early setup went by the name it was started as)."""
    link = tmp_path / "llama-bench"
    link.symlink_to(os.path.join(BIN, "ggml-attn-bench"))
    r = _start_with_sigint_at(tmp_path, str(link), "numpy")
    assert (r.returncode, r.stderr) == (130, "ggml-attn-bench: interrupted\n"), r.stderr[-2000:]


# ------------------------------------------------------------------ signals inside the op
# The tool run in a subprocess, its op's CPU path patched to send signals from inside the op's
# callback (ggml calls it through ctypes; an exception raised there cannot pass through C).
IN_OP = textwrap.dedent("""
    import inspect, os, signal, sys, threading, time
    tool, mode, signum = sys.argv[1], sys.argv[2], getattr(signal, sys.argv[3])
    import ggml_attn.cpu as cpu
    real, calls = cpu.flash_attn_ext_host, {0: 0, 1: 0}
    ith_of = lambda a, kw: inspect.signature(real).bind(*a, **kw).arguments.get("ith", 0)

    def host(*a, **kw):
        ith = ith_of(a, kw)
        if ith in calls:
            calls[ith] += 1
        if mode == "main" and ith == 0 and calls[0] == 1:
            for _ in range(2):   # from the main thread: each handler call runs before this returns
                try:
                    signal.raise_signal(signum)
                except BaseException as e:
                    os.write(2, f"RAISED INSIDE THE OP: {e!r}\\n".encode())
                    raise
        if mode == "thread" and ith == 1 and calls[1] <= 2:
            # from graph thread 1, while the main thread waits in ggml: its handler runs when it
            # next runs Python, the next op node's callback (an "Exception ignored" before)
            time.sleep(0.05)
            os.kill(os.getpid(), signum)
        return real(*a, **kw)

    cpu.flash_attn_ext_host = host
    sys.argv = [tool] + sys.argv[4:]
    from ggml_attn.cli.bench import main
    sys.exit(main())
""")


def _in_op_env():
    """The console scripts' thread settings (``_cli_start``), so the tool does not re-execute
    itself (``python -c`` is no script it could re-execute)."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    return {**_cli_start.THREAD_ENV, **env}


@pytest.mark.parametrize("signum,line,code", [("SIGINT", "interrupted", 130), ("SIGTERM", "terminated", 143)])
def test_second_signal_inside_the_op_is_one_line(signum, line, code):
    """Two Ctrl-C inside the op's callback (the tool's handler: a flag, then KeyboardInterrupt):
    the KeyboardInterrupt was raised inside the callback, which logged 'flash_attn_ext:
    interrupted (Ctrl-C) in graph thread 0' besides the tool's line; now the compute holds the
    handler and raises after ggml returns."""
    r = subprocess.run([sys.executable, "-c", IN_OP, "ggml-attn-bench", "main", signum,
                        "-p", "8", "-n", "0", "-r", "1", *FAST], capture_output=True, text=True, timeout=120,
                       env=_in_op_env())
    assert (r.returncode, r.stderr) == (code, f"ggml-attn-bench: {line}\n"), r.stderr[-2000:]


def test_second_ctrl_c_from_a_graph_thread_is_one_line():
    """Ctrl-C twice while ggml's worker thread runs the op and the main thread waits in C: the
    second one's KeyboardInterrupt came out at the entry of the main thread's next op callback,
    "Exception ignored on calling ctypes callback function" and a traceback."""
    r = subprocess.run([sys.executable, "-c", IN_OP, "ggml-attn-bench", "thread", "SIGINT", "-p", "64", "-n", "0",
                        "-r", "1", "-t", "2", "--n-layer", "4", "--device", "cpu"], capture_output=True, text=True,
                       timeout=120, env=_in_op_env())
    assert (r.returncode, r.stderr) == (130, "ggml-attn-bench: interrupted\n"), r.stderr[-2000:]


def test_closed_stderr_keeps_diagnostics_out_of_the_rows():
    """``tool 2>&-``: Python's sys.stderr is None and print(file=None) wrote the warning lines into
    stdout, before the json; now they go nowhere and stdout is the rows alone."""
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    p = subprocess.run([os.path.join(BIN, "ggml-attn-bench"), "-p", "16", "-n", "4", "-r", "1", "-nkvo", "1",
                        "-o", "json"], stdout=subprocess.PIPE, stderr=None, text=True, timeout=120, env=env,
                       preexec_fn=lambda: os.close(2))
    assert p.returncode == 0 and p.stdout.startswith("[") and len(json.loads(p.stdout)) == 2


def test_an_ascii_stdout_gets_plus_minus():
    """An ASCII stdout (PYTHONIOENCODING=ascii, a C locale): the table's "±" as "+-", not a
    UnicodeEncodeError traceback after the run."""
    env = dict(os.environ, PYTHONIOENCODING="ascii")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    p = subprocess.run([os.path.join(BIN, "ggml-attn-bench"), "-p", "16", "-n", "4", "-r", "2"], capture_output=True,
                       text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    assert " +- " in p.stdout and "Traceback" not in p.stderr
