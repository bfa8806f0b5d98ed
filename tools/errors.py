"""User-facing errors of the command-line tools.

A user mistake (unknown model, bad range, ubatch larger than batch, context overflow)
raises :class:`UserError`; :func:`run_cli` turns it into one line on stderr and exit
code 2, never a traceback. Ctrl-C is handled by the tools themselves (they print the
rows finished so far) and then :func:`run_cli` exits with 130; SIGTERM (``timeout``, ``kill``,
a batch scheduler) the same way, with 143, and SIGHUP (the terminal or ssh session gone) with 129.
"""
from __future__ import annotations

import sys

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143     # 128 + SIGTERM, as a shell reports a process SIGTERM ended
EXIT_HANGUP = 129         # 128 + SIGHUP


class UserError(Exception):
    """A mistake in what the user asked for; the message is printed as is, on one line."""


# set by the tools' signal handler (common.install_sigint_flag), which then stops the run as
# Ctrl-C does: the KeyboardInterrupt that ends it was a SIGTERM (exit 143, not 130) or a SIGHUP
# (129); 0: Ctrl-C
SIGNAL_SEEN = {"signum": 0}


class OutOfMemory(UserError):
    """What was asked for does not fit the device's (or the host's) memory: a KV cache, or the
    weights and buffers beside it. A tool that holds other runs' memory may free it and retry."""


def fail_line(prog: str, message: str) -> str:
    """The single stderr line for an error: ``prog: error: message`` with newlines folded and
    other control characters escaped (``output.printable``: a path or name from a file)."""
    from .text import printable
    return f"{prog}: error: {printable(message)}"


def run_cli(prog: str, main_fn, argv=None) -> int:
    """Run ``main_fn(argv)`` and map user errors and Ctrl-C to exit codes."""
    try:
        return int(main_fn(argv) or 0)
    except UserError as e:
        _say(fail_line(prog, str(e)))
        _drop_stdout()
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        import signal
        word, code = {signal.SIGTERM: ("terminated", EXIT_TERMINATED),
                      signal.SIGHUP: ("hangup", EXIT_HANGUP)}.get(SIGNAL_SEEN["signum"], ("interrupted", EXIT_INTERRUPTED))
        _say(f"{prog}: {word}")
        return code
    except SystemExit as e:  # argparse: --help (0) or a usage error (2, already printed)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_USER_ERROR)
    except BrokenPipeError:  # e.g. `| head`
        _drop_stdout()
        return 0


def _say(line: str) -> None:
    """The error line on stderr; a stderr that cannot take it (a full disk, e.g. ``-oe`` to it)
    must not turn the exit code into a traceback's 1."""
    try:
        print(line, file=sys.stderr)
    except OSError:
        pass


def _drop_stdout() -> None:
    """When stdout cannot take what is buffered, point it at /dev/null, so the interpreter's
    final flush does not print a second error (the recipe of Python's signal docs). Only for
    the real stdout: tests that replaced ``sys.stdout`` keep theirs."""
    import os
    if sys.stdout is not sys.__stdout__ or sys.stdout is None:
        return
    try:
        sys.stdout.flush()
        return
    except OSError:
        pass
    try:
        fd = sys.stdout.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    except (OSError, ValueError):
        pass
