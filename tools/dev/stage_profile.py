"""Where a batched-bench run's host time goes, stage by stage, and how long the GPU needs for
each captured graph structure on its own.

Runs ``ggml-attn-batched-bench`` in this process with timers around the stages of every ubatch
(wall time, perf_counter): ``plan`` (``graph.driver``'s placement, mask and tile map),
``build`` (a new graph structure), ``load_plan`` (a built graph takes the ubatch's mask and row
indices: on the GPU the host-to-device copies, which wait when the host is ahead of the device),
``compute`` (a plain or warm-up compute through ggml), ``capture`` (recording a CUDA graph, its
warm-up compute included) and ``run`` (the engine's whole step: inputs, then replay, capture or
compute). After each run of a row (each repetition, and ``--warmup``'s run) it prints, per
phase (``prompt``: the row's prompt batch, ``decode``: its steps), each stage's calls and
milliseconds. With ``--replays N``
(GPU, one rank) it then replays each captured structure N times back to back and prints the GPU
milliseconds per replay: against the phase's time, that says whether the phase is bound by the
GPU or by the host. With ``-sm row|layer`` the stages are rank 0's (the other ranks run in their
own processes) and no replays are timed (a rank cannot replay its NCCL calls alone).

Usage: python tools/dev/stage_profile.py [--replays 10] [--json FILE] batched-bench ARGS...
e.g.   python tools/dev/stage_profile.py batched-bench -m llama-3-8b --layer full --prompt-dist 16-200 \\
           -npl 64 -ntg 32 -kvu -r 3 --cuda-graph on
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from contextlib import contextmanager

STAGES = ("plan", "build", "load_plan", "compute", "capture", "run")


class StageTimer:
    """Accumulates wall seconds and calls per (phase, stage) while :meth:`install`-ed patches
    are active; ``phase`` is set by the patched ``Runner.prompt_batch`` / ``step_batch``."""

    def __init__(self):
        self.phase = "other"
        self.secs: dict = collections.defaultdict(float)
        self.calls: collections.Counter = collections.Counter()

    def reset(self) -> None:
        self.secs.clear()
        self.calls.clear()

    def wrap(self, owner, name: str, stage: str):
        """Replace ``owner.name`` by a timed call; returns an undo function."""
        orig = getattr(owner, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                self.secs[self.phase, stage] += time.perf_counter() - t
                self.calls[self.phase, stage] += 1
        setattr(owner, name, timed)
        return lambda: setattr(owner, name, orig)

    def mark(self, owner, name: str, phase: str):
        """``owner.name`` (a batch maker) also sets the current phase, once it returned (a step
        batch is made by the prompt-batch maker: the outer call decides)."""
        orig = getattr(owner, name)

        def marked(*a, **k):
            out = orig(*a, **k)
            self.phase = phase
            return out
        setattr(owner, name, marked)
        return lambda: setattr(owner, name, orig)

    def table(self) -> list[dict]:
        return [dict(phase=ph, stage=st, calls=self.calls[ph, st], ms=round(self.secs[ph, st] * 1e3, 3))
                for ph in ("prompt", "decode", "other") for st in STAGES if self.calls[ph, st]]


@contextmanager
def installed(timer: StageTimer):
    """The stage patches on the graph driver, builder, engine and runner (undone on exit)."""
    from ggml_attn.graph import build, capture, driver
    from ggml_attn.cli import graph_engine, runner
    undo = [timer.wrap(driver, "plan_ubatch", "plan"), timer.wrap(driver, "apply_plan", "plan"),
            timer.wrap(build, "build_ubatch_graph", "build"),
            timer.wrap(build.UBatchGraph, "load_plan", "load_plan"),
            timer.wrap(graph_engine.GraphEngine, "_compute", "compute"),
            timer.wrap(capture, "capture", "capture"),
            timer.wrap(graph_engine.GraphEngine, "_run", "run"),
            timer.mark(runner.Runner, "prompt_batch", "prompt"),
            timer.mark(runner.Runner, "step_batch", "decode")]
    try:
        yield timer
    finally:
        for u in reversed(undo):
            u()


def replay_ms(engine, n: int) -> dict:
    """GPU milliseconds per replay of each captured structure of ``engine`` (its ``graph_key``
    as text), ``n`` replays back to back on its stream after 2 untimed ones. Replays rewrite
    what the last ubatch of that structure wrote (outputs, its K/V cells): call it after the
    run's results are no longer needed."""
    import cupy
    out = {}
    for key, entry in list(getattr(engine, "_graphs", {}).items()):
        if getattr(entry, "replay", None) is None:
            continue
        s = engine.stream
        for _ in range(2):
            entry.replay.launch(s)
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        e0.record(s)
        for _ in range(n):
            entry.replay.launch(s)
        e1.record(s)
        e1.synchronize()
        out[str(key)] = round(cupy.cuda.get_elapsed_time(e0, e1) / n, 3)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="stage_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--replays", type=int, default=10, help="timed replays per captured structure (0: none)")
    p.add_argument("--json", help="also write the tables as JSON here")
    p.add_argument("tool", choices=("batched-bench",), help="the benchmark to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    a = p.parse_args(argv)
    if a.replays < 0:
        p.error(f"--replays must be at least 0 (0: none), got {a.replays}")
    if a.json is not None:   # checked before the run, not after it
        folder = os.path.dirname(os.path.abspath(a.json))
        target = a.json if os.path.exists(a.json) else folder
        if os.path.isdir(a.json) or not os.path.isdir(folder) or not os.access(target, os.W_OK):
            p.error(f"--json '{a.json}': not a writable file path")
    from ggml_attn.cli import batched_bench as bb
    from ggml_attn.cli import runner as rn
    timer = StageTimer()
    report: dict = dict(args=a.args, rows=[], replays={})
    orig_row, orig_close = bb.run_row, rn.Runner.close

    def run_row(runner, row, pps, *rest):
        timer.reset()
        t0 = time.perf_counter()
        res = orig_row(runner, row, pps, *rest)
        wall = time.perf_counter() - t0
        rep = dict(pl=row["pl"], wall_ms=round(wall * 1e3, 3), t_pp_ms=round(res["t_pp"] * 1e3, 3),
                   t_tg_ms=round(res["t_tg"] * 1e3, 3), ubatches=res["ub"], stages=timer.table())
        report["rows"].append(rep)
        print(f"stage_profile: B={row['pl']}: wall {rep['wall_ms']:.1f} ms, T_PP {rep['t_pp_ms']:.1f} ms, "
              f"T_TG {rep['t_tg_ms']:.1f} ms", file=sys.stderr)
        for s in rep["stages"]:
            print(f"  {s['phase']:<7} {s['stage']:<10} {s['calls']:>6} calls {s['ms']:>10.1f} ms", file=sys.stderr)
        return res

    def close(self):
        eng = self.engine
        if a.replays > 0 and getattr(eng, "device", False) and self.cfg.tp is None:
            got = replay_ms(eng, a.replays)
            report["replays"].update(got)
            for k, ms in got.items():
                print(f"stage_profile: GPU {ms:.3f} ms per replay of structure {k}", file=sys.stderr)
        return orig_close(self)

    bb.run_row, rn.Runner.close = run_row, close
    try:
        with installed(timer):
            rc = bb.main(a.args)
    finally:
        bb.run_row, rn.Runner.close = orig_row, orig_close
    if a.json:
        try:
            with open(a.json, "w") as f:
                json.dump(report, f, indent=1)
        except OSError as e:
            p.exit(2, f"stage_profile: error: --json: cannot write {a.json}: {e.strerror or e}\n")
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
