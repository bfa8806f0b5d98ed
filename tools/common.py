"""Small helpers both tools share: build info, CPU/GPU names, thread count, progress lines,
the wall-clock timer of the CPU engine and the CUDA-event timer of the GPU engine."""
from __future__ import annotations

import os
import platform
import sys
import time
from functools import lru_cache

from .errors import EXIT_USER_ERROR


@lru_cache(maxsize=1)
def build_info() -> tuple[str, int]:
    """(short commit, number of commits) of this ggml-attn: git in a checkout, what the build
    recorded in an installed copy, ("unknown", 0) otherwise; ``GGML_ATTN_COMMIT`` ("abc1234" or
    "abc1234:57") overrides it (``ggml_attn._build``)."""
    from ggml_attn._build import build_info as info
    return info()


@lru_cache(maxsize=1)
def cpu_info() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_info() -> str:
    try:
        import cupy
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        name = props["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - no GPU or no CuPy
        return ""


def default_threads() -> int:
    """Cores this process may use (llama-bench uses the number of physical cores)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


class Progress:
    """``--progress`` lines on stderr, in llama-bench's wording."""

    def __init__(self, prog: str, enabled: bool, total: int):
        self.prog, self.enabled, self.total = prog, enabled, total

    def __call__(self, index: int, what: str) -> None:
        if self.enabled:
            print(f"{self.prog}: benchmark {index}/{self.total}: {what}", file=sys.stderr, flush=True)


# Threading environment the tools want (read by libgomp and OpenBLAS when they load); the
# console scripts set it before those load (ggml_attn._cli_start), in-process callers here
from ggml_attn._cli_start import THREAD_ENV  # noqa: E402


def prefer_passive_omp(argv) -> None:
    """Apply :data:`THREAD_ENV` (values already in the environment win).

    The libraries read these when they are loaded (``import numpy`` / ``import ggml``).
    When they are loaded already and this is a real command line (``argv is None``), the
    tool re-executes itself once with the environment set; in-process calls (tests, argv
    given) just set the variables for child processes.
    """
    missing = {k: v for k, v in THREAD_ENV.items() if k not in os.environ}
    if not missing:
        return
    os.environ.update(missing)
    loaded = any(m in sys.modules for m in ("numpy", "ggml"))
    if not loaded or argv is not None:
        return
    main_mod = sys.modules.get("__main__")
    spec = getattr(main_mod, "__spec__", None)
    try:
        sys.stdout.flush()
        if spec is not None and spec.name:
            os.execv(sys.executable, [sys.executable, "-m", spec.name, *sys.argv[1:]])
        os.execv(sys.executable, [sys.executable, *sys.argv])
    except OSError:
        pass  # keep going with the libraries' defaults


class _DropInterrupts:
    """logging filter: Ctrl-C inside an op callback is not an op failure worth a traceback."""

    def filter(self, record) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, KeyboardInterrupt) and "KeyboardInterrupt" not in record.getMessage()


def quiet_interrupts() -> None:
    """Keep ggml_attn's op from logging a traceback when the user presses Ctrl-C."""
    import logging
    logger = logging.getLogger("ggml_attn")
    if not any(isinstance(f, _DropInterrupts) for f in logger.filters):
        logger.addFilter(_DropInterrupts())


# Ctrl-C. A KeyboardInterrupt raised while ggml runs a Python callback (the op's) is lost or
# turned into an op error, depending on where it lands. So the tools' SIGINT handler only
# sets a flag, and the runner raises KeyboardInterrupt between ubatches, where it is safe.
_interrupt = {"flag": False}


def install_sigint_flag() -> None:
    """Ctrl-C (or SIGTERM or SIGHUP, noted in errors.SIGNAL_SEEN for the exit code) sets a flag
    that :func:`check_interrupt` turns into KeyboardInterrupt; a second one interrupts at once.
    SIGHUP (an ssh session dropped) ended the process at once, leaving cut json; it is left alone
    where it is ignored already (``nohup``)."""
    import signal

    from .errors import SIGNAL_SEEN

    def handler(signum, frame):
        if signum != signal.SIGINT and not SIGNAL_SEEN["signum"]:
            SIGNAL_SEEN["signum"] = signum
        if _interrupt["flag"]:
            raise KeyboardInterrupt
        _interrupt["flag"] = True

    try:
        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)
        if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
            signal.signal(signal.SIGHUP, handler)
    except ValueError:  # not the main thread
        pass


def interruptible_sleep(seconds: float) -> None:
    """``time.sleep`` that a Ctrl-C ends at once: the SIGINT flag's handler does not raise, and
    a plain sleep resumes after it (PEP 475), so ``--delay 30`` ran on for 28 s after Ctrl-C."""
    end = time.monotonic() + seconds
    while True:
        check_interrupt()
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(0.1, left))


def check_interrupt() -> None:
    """Raise KeyboardInterrupt when Ctrl-C was pressed since :func:`install_sigint_flag`."""
    if _interrupt["flag"]:
        _interrupt["flag"] = False
        raise KeyboardInterrupt


def console_main(prog: str, main_fn, argv=None) -> int:
    """What both console scripts do around ``main_fn(argv)``: thread environment, quiet
    Ctrl-C inside op callbacks, a SIGINT flag on real command lines (not for tests calling in
    process), and user errors as one stderr line with exit 2 (:func:`errors.run_cli`); a
    stdout closed from the start is one such line too."""
    from .errors import UserError, fail_line, run_cli
    if sys.stdout is None:   # started with stdout closed (`>&-`): nowhere to print the rows
        try:
            print(fail_line(prog, str(UserError("cannot write to stdout: it is closed"))), file=sys.stderr)
        except (OSError, AttributeError):
            pass
        return EXIT_USER_ERROR
    if sys.stderr is None:   # started with stderr closed (`2>&-`): diagnostics go nowhere, not into stdout's rows
        sys.stderr = open(os.devnull, "w")   # noqa: SIM115 (for the process's life)
    prefer_passive_omp(argv)
    quiet_interrupts()
    if argv is None:
        install_sigint_flag()
    return run_cli(prog, main_fn, argv)


class WallTimer:
    """``with timer: ...`` then ``timer.ns``; wall clock (the CPU engine computes synchronously)."""

    def __init__(self):
        self.ns = 0

    def __enter__(self):
        self._t0 = time.perf_counter_ns()
        return self

    def __exit__(self, *exc):
        self.ns = time.perf_counter_ns() - self._t0
        return False


class CudaTimer:
    """``with timer: ...`` then ``timer.ns``: CUDA events on ``stream`` (default: the current
    stream), synchronized."""

    def __init__(self, stream=None):
        import cupy
        self.cupy = cupy
        self.stream = stream   # None: the current stream when entered
        self.ns = 0

    def __enter__(self):
        cp = self.cupy
        if self.stream is None:
            self.stream = cp.cuda.get_current_stream()
        self.stream.synchronize()
        self.start, self.end = cp.cuda.Event(), cp.cuda.Event()
        self.start.record(self.stream)
        return self

    def __exit__(self, *exc):
        self.end.record(self.stream)
        self.end.synchronize()
        self.ns = int(self.cupy.cuda.get_elapsed_time(self.start, self.end) * 1e6)
        return False
