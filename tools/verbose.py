"""``-v``: what each run builds and does, as lines on stderr (off: nothing)."""
from __future__ import annotations

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
        model = getattr(runner.engine, "model", None)   # --layer model: the file's weights
        if model is None:
            return
        gib = 2 ** 30
        if cfg.device == "cuda":
            dw = model.device_weights(runner.cache.xp)
            parts = ", ".join(f"{k} {v / gib:.2f} GiB" for k, v in dw.bytes_by_type().items())
            self.say(f"weights on the GPU: {parts} (the file's tensors: {model.nbytes / gib:.2f} GiB)")
        else:
            self.say(f"weights: the file's, memory-mapped ({model.type_summary()}, {model.nbytes / gib:.2f} GiB)")

    def shapes(self, what: str, shapes: list[str]) -> None:
        """The ubatches (``n_seqs x n_seq_tokens``) that ``what`` was cut into."""
        self.say(f"{what}: ubatches {' '.join(compress_shapes(shapes))}")
