"""The requests of ``ggml-attn-serve-bench``: a trace file, or Poisson arrivals drawn from a seed.

A trace is JSON lines, one request each, in any order::

    {"arrival": 0.125, "prompt_len": 57, "n_predict": 100}
    {"arrival": 0.5, "prompt": [1, 15043, 3186], "n_predict": 32}

``arrival``: seconds from the trace's start (>= 0); ``prompt_len``: a prompt of that many token
ids (:func:`prompt_tokens` makes them, the same ids for every tool that reads the trace), or
``prompt``: the token ids themselves; ``n_predict``: tokens to generate. Blank lines and lines
starting with ``#`` are skipped. ``bench/traces/sample.jsonl`` is one.

Synthetic workloads (``--rate``): ``n`` requests whose gaps are exponential with mean ``1/rate``
(a Poisson process; ``inf``: all at time 0), prompt and output lengths uniform in their ranges,
all from one seed, so a row's inputs (rate, n, ranges, seed) are enough to make it again.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from .args import INT32_MAX
from .errors import UserError

SYNTH_VOCAB = 32000   # token ids of presets (shapes only: attention does not read them)


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: ``prompt`` None means ``prompt_len`` made-up ids (:func:`prompt_tokens`)."""

    arrival: float
    prompt_len: int
    n_predict: int
    prompt: tuple | None = None


def parse_rates(text: str) -> list[float]:
    """``--rate`` list: ``"2,4,8"``, ``"0.5"``, ``"inf"`` (every request at time 0)."""
    out = []
    for item in str(text).split(","):
        item = item.strip().lower()
        try:
            value = math.inf if item in ("inf", "max") else float(item)
        except ValueError:
            raise UserError(f"invalid rate '{item}' (requests per second, e.g. 4 or 0.5, or inf)") from None
        if not value > 0 or math.isnan(value):
            raise UserError(f"a rate must be positive (requests per second, or inf), got '{item}'")
        out.append(value)
    return out


def parse_dist(text: str, what: str) -> tuple[int, int]:
    """``MIN-MAX`` (or ``N``) -> (min, max) lengths, 1 <= min <= max."""
    parts = str(text).split("-")
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise UserError(f"invalid {what} '{text}' (expected MIN-MAX or N, e.g. 16-200)")
    lo, hi = int(parts[0]), int(parts[1])
    if lo < 1 or hi < lo or hi > INT32_MAX:
        raise UserError(f"invalid {what} '{text}': need 1 <= MIN <= MAX")
    return lo, hi


# The latest arrival a workload may have, seconds (~11.6 days): the clock adds a step's
# milliseconds to it, and at 1e300 s they were lost (every TTFT and ITL read 0).
MAX_ARRIVAL_S = 1e6


def synth_trace(rate: float, n: int, prompt_dist: tuple[int, int], gen_dist: tuple[int, int],
                seed: int) -> list[TraceRequest]:
    """``n`` requests: Poisson arrivals at ``rate`` per second (``inf``: all at 0), lengths
    uniform in the inclusive ranges. The lengths depend on ``seed`` only, not on the rate, so a
    rate sweep serves the same requests, arriving faster. UserError when the arrivals would pass
    :data:`MAX_ARRIVAL_S`."""
    rng = np.random.default_rng([seed, 1])
    plen = rng.integers(prompt_dist[0], prompt_dist[1] + 1, size=n)
    glen = rng.integers(gen_dist[0], gen_dist[1] + 1, size=n)
    if math.isinf(rate):
        arrival = np.zeros(n)
    else:
        gaps = np.random.default_rng([seed, 2]).exponential(1.0 / rate, size=n)
        arrival = np.cumsum(gaps) - gaps[0]   # the first request at time 0
        if not arrival[-1] <= MAX_ARRIVAL_S:
            raise UserError(f"--rate {rate:g} spreads {n} requests over {arrival[-1]:.3g} s, past the "
                            f"{MAX_ARRIVAL_S:g} s a workload may span (a higher rate, or fewer requests)")
    return [TraceRequest(float(a), int(p), int(g)) for a, p, g in zip(arrival, plen, glen)]


def _field(obj: dict, key: str, where: str, lo: int) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= INT32_MAX:
        raise UserError(f"{where}: '{key}' must be an integer >= {lo}, got {v!r}")
    return v


def load_trace(path: str) -> list[TraceRequest]:
    """The requests of the JSON-lines trace at ``path`` (module docstring); UserError naming the
    file and line of anything wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as e:
        raise UserError(f"cannot read --trace '{path}': {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise UserError(f"--trace '{path}' is not UTF-8 text (JSON lines expected)") from None
    out = []
    for no, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        where = f"{path}:{no}"
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: not JSON ({e.msg})") from None
        except (ValueError, RecursionError) as e:   # (an integer of >4300 digits; nesting past the stack)
            raise UserError(f"{where}: not JSON this reader takes "
                            f"({'nested too deeply' if isinstance(e, RecursionError) else 'a number of too many digits'})") from None
        if not isinstance(obj, dict):
            raise UserError(f"{where}: a request is a JSON object, got {type(obj).__name__}")
        arrival = obj.get("arrival")
        if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not 0 <= arrival <= MAX_ARRIVAL_S:
            shown = repr(arrival) if not isinstance(arrival, int) or abs(arrival) < 10 ** 30 else f"an integer of {len(str(arrival))} digits"
            raise UserError(f"{where}: 'arrival' must be seconds from 0 to {MAX_ARRIVAL_S:g}, got {shown}")
        n_predict = _field(obj, "n_predict", where, 1)
        prompt = obj.get("prompt")
        if prompt is not None:
            if "prompt_len" in obj:
                raise UserError(f"{where}: give 'prompt' (token ids) or 'prompt_len', not both")
            if (not isinstance(prompt, list) or not prompt
                    or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX for t in prompt)):
                raise UserError(f"{where}: 'prompt' must be a non-empty list of token ids (integers >= 0)")
            out.append(TraceRequest(float(arrival), len(prompt), n_predict, tuple(prompt)))
        else:
            out.append(TraceRequest(float(arrival), _field(obj, "prompt_len", where, 1), n_predict))
    if not out:
        raise UserError(f"--trace '{path}' holds no request")
    return out


def write_trace(path: str, reqs: list[TraceRequest]) -> None:
    """The trace as JSON lines (token-id prompts as ids, made-up ones as their length)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in reqs:
            obj = {"arrival": round(r.arrival, 6)}
            obj.update({"prompt": list(r.prompt)} if r.prompt is not None else {"prompt_len": r.prompt_len})
            obj["n_predict"] = r.n_predict
            f.write(json.dumps(obj) + "\n")


def prompt_tokens(rid: int, r: TraceRequest, n_vocab: int, seed: int) -> np.ndarray:
    """int32 token ids of request ``rid``'s prompt: its own ids, else ``prompt_len`` ids drawn
    from (``seed``, ``rid``) in ``[0, n_vocab)`` (0: :data:`SYNTH_VOCAB`). UserError when an
    own id is not in the vocabulary."""
    vocab = n_vocab or SYNTH_VOCAB
    if r.prompt is not None:
        ids = np.asarray(r.prompt, dtype=np.int64)
        if int(ids.max()) >= vocab:
            raise UserError(f"request {rid}: token id {int(ids.max())} is not in the model's vocabulary "
                            f"(n_vocab {vocab})")
        return ids.astype(np.int32)
    return np.random.default_rng([seed, 3, rid]).integers(0, vocab, size=r.prompt_len).astype(np.int32)
