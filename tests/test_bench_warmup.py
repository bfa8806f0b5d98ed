"""ggml-attn-bench's warm-up: the prompt run as a repetition runs it, as many times as the engine
needs before a run of it is like every later one (on the device the second run of a prompt
structure captures it as a CUDA graph: a first repetition measured 6,600 t/s against ~16,000 for
the rest on the 8B Q4_K_M file with a single warm-up run)."""
from types import SimpleNamespace

from ggml_attn.cli.bench import run_test
from ggml_attn.cli.runner import Runner
from ggml_attn.graph.engine import Engine


class _Timer:
    ns = 1000

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Runner:
    """What run_test calls, recorded: ("clear",) and ("decode", lengths, start position)."""

    def __init__(self, runs: int):
        self.calls, self.runs, self.pos = [], runs, 0

    def runs_to_steady(self, decode_step):
        return 1 if decode_step else self.runs

    def clear(self):
        self.calls.append(("clear",))
        self.pos = 0

    def prompt_batch(self, lengths):
        return ("prompt", tuple(lengths))

    def step_batch(self, ids):
        return ("prompt", (1,) * len(ids))

    def decode(self, batch, sync=True):
        self.calls.append(("decode", batch[1], self.pos))
        self.pos += sum(batch[1])
        return SimpleNamespace(n_ubatches=1, shapes=[batch[1]])

    def timer(self):
        return _Timer()


def test_warmup_repeats_the_prompt_run_as_a_repetition_runs_it():
    for runs in (1, 2, 3):
        r = _Runner(runs)
        run_test(r, dict(n_prompt=512, n_gen=0, n_depth=0), reps=1, warmup=True, progress=lambda *a: None, idx=0)
        prompt_runs = [c for c in r.calls if c[0] == "decode" and c[1] == (512,)]
        assert len(prompt_runs) == runs + 1                    # warm-ups, then the repetition
        assert all(c[2] == 0 for c in prompt_runs)             # each from an empty cache
    r = _Runner(2)
    run_test(r, dict(n_prompt=64, n_gen=0, n_depth=100), reps=1, warmup=True, progress=lambda *a: None, idx=0)
    decodes = [c for c in r.calls if c[0] == "decode"]
    # each warm-up run as the repetition: the depth, then the prompt at that depth
    assert decodes == [("decode", (100,), 0), ("decode", (64,), 100)] * 3


def test_no_warmup_and_generation_only_runs():
    r = _Runner(2)
    run_test(r, dict(n_prompt=32, n_gen=0, n_depth=0), reps=2, warmup=False, progress=lambda *a: None, idx=0)
    assert [c for c in r.calls if c[0] == "decode"] == [("decode", (32,), 0)] * 2
    r = _Runner(2)
    out = run_test(r, dict(n_prompt=0, n_gen=3, n_depth=0), reps=1, warmup=True, progress=lambda *a: None, idx=0)
    assert [c for c in r.calls if c[0] == "decode"] == [("decode", (1,), 0)] + [("decode", (1,), i) for i in range(3)]
    assert out["ub"] == 3
    # generation at a depth: the warm-up step at that depth too (the steps' graph structure)
    r = _Runner(2)
    run_test(r, dict(n_prompt=0, n_gen=2, n_depth=50), reps=1, warmup=True, progress=lambda *a: None, idx=0)
    assert [c for c in r.calls if c[0] == "decode"] == \
        [("decode", (50,), 0), ("decode", (1,), 50), ("decode", (50,), 0), ("decode", (1,), 50), ("decode", (1,), 51)]
    # prompt and generation (-pg): the prompt runs, then one step after the last of them
    r = _Runner(2)
    run_test(r, dict(n_prompt=8, n_gen=1, n_depth=0), reps=1, warmup=True, progress=lambda *a: None, idx=0)
    assert [c for c in r.calls if c[0] == "decode"] == \
        [("decode", (8,), 0), ("decode", (8,), 0), ("decode", (1,), 8), ("decode", (8,), 0), ("decode", (1,), 8)]


def test_engine_runs_to_steady():
    """A prompt structure on the device: 2 runs (the second captures it); a decode step (captured
    at its first run), the host, or no kept graphs (flash attention off): 1."""
    def eng(device, flash_attn=True):
        return SimpleNamespace(device=device, flash_attn=flash_attn)
    assert Engine.runs_to_steady(eng(True), decode_step=False) == 2
    assert Engine.runs_to_steady(eng(True), decode_step=True) == 1
    assert Engine.runs_to_steady(eng(False), decode_step=False) == 1
    assert Engine.runs_to_steady(eng(True, flash_attn=False), decode_step=False) == 1
    # the runner asks its engine, and an engine without the method needs one run
    runner = object.__new__(Runner)
    runner.engine = eng(True)
    assert Runner.runs_to_steady(runner, False) == 1
    runner.engine = SimpleNamespace(runs_to_steady=lambda decode_step: 5 if not decode_step else 1)
    assert Runner.runs_to_steady(runner, False) == 5 and Runner.runs_to_steady(runner, True) == 1
