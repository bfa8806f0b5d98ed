"""``-v``: what each run builds and does, as lines on stderr (off: nothing)."""
from __future__ import annotations

import os
import sys

from .text import printable
from .runner import compress_shapes


class Verbose:
    def __init__(self, prog: str, enabled: bool):
        self.prog, self.enabled = prog, enabled

    def say(self, text: str) -> None:
        if self.enabled:
            print(f"{self.prog}: {printable(text)}", file=sys.stderr, flush=True)

    def runner(self, runner) -> None:
        """The model shape and the KV cache / split / batch sizes a Runner was built with."""
        if not self.enabled:
            return
        cfg = runner.cfg
        self.say(cfg.model.describe())
        self.say(f"KV cache {runner.cache!r}, K {cfg.type_k}, V {cfg.type_v}, split {cfg.split}, "
                 f"n_batch {cfg.n_batch}, n_ubatch {cfg.n_ubatch}, {cfg.n_threads} threads, "
                 f"device {cfg.device}")
        kl = getattr(runner.engine, "kernel_load", None)   # (the CUDA engine's: cuda_engine.KernelLoad)
        if kl is not None:
            self.say(f"kernels: {kl.programs} programs ready in {kl.seconds:.2f} s beside the engine's start "
                     f"({kl.compiled} compiled by NVRTC now, the others from the kernel cache)")
        model = getattr(runner.engine, "model", None)   # --layer model: the file's weights
        if model is not None:
            gib = 2 ** 30
            if cfg.device == "cuda":
                dw = model.device_weights(runner.cache.xp)
                parts = ", ".join(f"{k} {v / gib:.2f} GiB" for k, v in dw.bytes_by_type().items())
                rate = f", {model.nbytes / dw.load_s / 1e9:.1f} GB/s of the file" if dw.load_s > 0 else ""
                self.say(f"weights on the GPU: {parts} (the file's tensors: {model.nbytes / gib:.2f} GiB; "
                         f"read, uploaded and folded in {dw.load_s:.2f} s{rate})")
            else:
                self.say(f"weights: the file's, memory-mapped ({model.type_summary()}, {model.nbytes / gib:.2f} GiB)")
        up = process_seconds()
        if up is not None:
            self.say(f"ready {up:.2f} s after the process started")

    def shapes(self, what: str, shapes: list[str]) -> None:
        """The ubatches (``n_seqs x n_seq_tokens``) that ``what`` was cut into."""
        self.say(f"{what}: ubatches {' '.join(compress_shapes(shapes))}")


def process_seconds() -> float | None:
    """Wall seconds since this process started (Linux's ``/proc``: the start time in clock ticks
    since boot against the uptime; None where they cannot be read)."""
    try:
        with open("/proc/self/stat") as f:
            start = int(f.read().rsplit(")", 1)[1].split()[19])   # (field 22, starttime)
        with open("/proc/uptime") as f:
            up = float(f.read().split()[0])
        return max(0.0, up - start / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None
