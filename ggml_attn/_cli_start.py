"""What the console scripts (:data:`CONSOLE_SCRIPTS`) need before anything heavy loads; run by
``ggml_attn/__init__.py`` first, a no-op in any other program.

The scripts' first line is ``from ggml_attn.cli.<tool> import main``: importing numpy, ggml and
the tools takes about a second, before the tools' own Ctrl-C handling exists. So here, for those
programs only (also when started through a symlink of another name, ``llama-bench`` say):

* :data:`THREAD_ENV` goes into the environment before numpy and ggml load (values already set
  win), so the tools need not re-execute themselves to apply it (``cli.common.prefer_passive_omp``);
* Ctrl-C until the tool installs its own handler ends the process at once: one line
  ``<tool>: interrupted`` on stderr and exit code 130, as later (nothing was printed yet), instead
  of a KeyboardInterrupt traceback from the middle of an import.

What comes before this is the interpreter's own start-up (about 10-20 ms: its I/O, ``site`` and
the ``.pth`` files, the script's import statement finding ``ggml_attn``): a Ctrl-C then kills the
process silently, or is Python's traceback; no code of the project runs yet.
"""
from __future__ import annotations

import os
import sys

try:   # the C module: signal.py builds its enums first (~0.4 ms more start-up without a handler)
    import _signal as _sig
except ImportError:  # pragma: no cover - other Pythons
    import signal as _sig

# pyproject.toml's [project.scripts] (tests/test_cli_signals.py checks that they are the same)
CONSOLE_SCRIPTS = ("ggml-attn-bench", "ggml-attn-batched-bench", "ggml-attn-serve-bench")
EXIT_INTERRUPTED = 130

# Threading environment the tools want, read by libgomp and OpenBLAS when they load.
THREAD_ENV = {
    # ggml's CPU backend uses OpenMP; with libgomp's default (active) waiting its idle
    # threads spin on the cores the Python side needs between ubatches and while
    # flash_attn_ext's callbacks wait for the GIL: a decode step of the tiny preset took
    # ~45 ms on 2 threads instead of ~2 ms.
    "OMP_WAIT_POLICY": "passive",
    # flash_attn_ext's CPU path calls numpy inside ggml's OpenMP threads; a multithreaded
    # OpenBLAS there nests thread pools ("Detect OpenMP Loop and this application may hang").
    "OPENBLAS_NUM_THREADS": "1",
}


def console_script() -> str:
    """The tool's name when this process is one of :data:`CONSOLE_SCRIPTS` (by its name, or
    the name of the file a symlink points at), else ''."""
    argv0 = (sys.argv[0] if getattr(sys, "argv", None) else "") or ""
    name = os.path.basename(argv0).removesuffix(".exe")
    if name not in CONSOLE_SCRIPTS and argv0 and os.path.islink(argv0):
        name = os.path.basename(os.path.realpath(argv0)).removesuffix(".exe")
    return name if name in CONSOLE_SCRIPTS else ""


def _interrupted_now(prog: str):
    line = f"{prog}: interrupted\n".encode()

    def handler(signum, frame):
        try:
            os.write(2, line)
        except OSError:
            pass
        os._exit(EXIT_INTERRUPTED)
    return handler


def early_setup() -> None:
    prog = console_script()
    if not prog:
        return
    try:   # a SIGINT ignored (a shell's background job) stays ignored
        if _sig.getsignal(_sig.SIGINT) is _sig.default_int_handler:
            _sig.signal(_sig.SIGINT, _interrupted_now(prog))
    except (ValueError, OSError):  # not the main thread / interpreter
        pass
    for key, value in THREAD_ENV.items():
        os.environ.setdefault(key, value)
