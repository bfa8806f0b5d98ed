"""Output that cannot be written: one line on stderr, exit 2, checked before the run where it
can be."""
import os
import subprocess
import sys

import pytest

from ggml_attn.cli import batched_bench, bench, plot

BIN = os.path.dirname(sys.executable)
BATCHED = ["-npp", "8", "-npl", "1", "-ntg", "1", "-t", "1", "--n-layer", "1", "--device", "cpu"]


def _batched(capsys, *args):
    rc = batched_bench.main(list(args) + BATCHED)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _one_line(rc, err):
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("name, msg", [
    ("missing/dir/out.png", "folder"),
    ("out.xyz", "extension"),
    ("out", "extension"),
    (".", "folder"),
])
def test_plot_path_checked_before_running(tmp_path, capsys, monkeypatch, name, msg):
    ran = []
    monkeypatch.setattr(batched_bench, "run_row", lambda *a, **k: ran.append(1))
    target = str(tmp_path) if name == "." else str(tmp_path / name)
    rc, out, err = _batched(capsys, "--plot", target)
    _one_line(rc, err)
    assert msg in err and "--plot" in err and out == "" and not ran


def test_plot_file_that_cannot_be_made_is_refused_before_running(tmp_path, capsys, monkeypatch):
    """A folder that refuses new files whatever its mode says (/proc; /sys, a read-only mount,
    as root): refused before the run (the whole table ran first, then the write failed); the
    check leaves no file behind and an existing one as it was."""
    ran = []
    monkeypatch.setattr(batched_bench, "run_row", lambda *a, **k: ran.append(1))
    rc, out, err = _batched(capsys, "--plot", "/proc/ggml-attn-plot.png")
    _one_line(rc, err)
    assert "--plot" in err and out == "" and not ran
    from ggml_attn.cli.output import check_plot_path
    check_plot_path(str(tmp_path / "new.png"))
    assert not (tmp_path / "new.png").exists()
    (tmp_path / "old.png").write_bytes(b"an old plot")
    check_plot_path(str(tmp_path / "old.png"))
    assert (tmp_path / "old.png").read_bytes() == b"an old plot"


def test_plot_write_error_is_one_line(tmp_path, capsys, monkeypatch):
    def fail(path, results, title):
        raise PermissionError(13, "Permission denied", path)
    monkeypatch.setattr(plot, "draw_plot", fail)
    monkeypatch.setattr(plot, "check_plot_available", lambda path: None)
    rc, out, err = _batched(capsys, "--plot", str(tmp_path / "p.png"))
    _one_line(rc, err)
    assert "Permission denied" in err and "p.png" in err and "|" in out  # the table came first


class _FullStdout:
    def write(self, text):
        raise OSError(28, "No space left on device")

    def flush(self):
        raise OSError(28, "No space left on device")


@pytest.mark.parametrize("tool", ["bench", "batched"])
def test_stdout_write_error_in_process(capsys, monkeypatch, tool):
    monkeypatch.setattr(sys, "stdout", _FullStdout())
    if tool == "bench":
        rc = bench.main(["-p", "8", "-n", "0", "-r", "1", "--no-warmup", "-t", "1", "--device", "cpu"])
    else:
        rc = batched_bench.main(BATCHED)
    err = capsys.readouterr().err
    _one_line(rc, err)
    assert "No space left on device" in err and "stdout" in err


@pytest.mark.parametrize("name, args", [
    ("ggml-attn-bench", ["-p", "8", "-n", "0", "-r", "1", "--no-warmup"]),
    ("ggml-attn-batched-bench", ["-npp", "8", "-npl", "1", "-ntg", "1"]),
])
def test_stdout_on_a_full_device(name, args):
    with open("/dev/full", "w") as full:
        p = subprocess.run([os.path.join(BIN, name), *args, "-t", "1", "--device", "cpu"],
                           stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    _one_line(p.returncode, p.stderr)
    assert "No space left on device" in p.stderr


@pytest.mark.parametrize("name, args", [
    ("ggml-attn-bench", ["--help"]),
    ("ggml-attn-batched-bench", ["--help"]),
    ("ggml-attn-bench", ["--list-models"]),
    ("ggml-attn-batched-bench", ["--plan", "-npp", "8", "-npl", "1", "-ntg", "1"]),
])
def test_help_and_listings_on_a_full_device(name, args):
    with open("/dev/full", "w") as full:
        p = subprocess.run([os.path.join(BIN, name), *args], stdout=full, stderr=subprocess.PIPE,
                           text=True, timeout=120)
    _one_line(p.returncode, p.stderr)
    assert "No space left on device" in p.stderr


@pytest.mark.parametrize("name, args", [
    ("ggml-attn-bench", ["-p", "8", "-n", "0", "-r", "1", "--no-warmup", "-oe", "csv"]),
    ("ggml-attn-bench", ["-m", "nope"]),
    ("ggml-attn-batched-bench", ["-m", "nope"]),
])
def test_stderr_on_a_full_device_keeps_exit_2(name, args):
    with open("/dev/full", "w") as full:
        p = subprocess.run([os.path.join(BIN, name), *args, "-t", "1", "--device", "cpu"],
                           stdout=subprocess.PIPE, stderr=full, text=True, timeout=120)
    assert p.returncode == 2
