"""A server's loop over the KV cache: requests arrive over time, each step is one batch of one
decode token per generating request plus prompt tokens of admitted requests, and every token
is timed (time to first token, inter-token latency).

A step is formed as llama-server's ``update_slots`` forms one:

1. *arrivals*: requests whose arrival time has come join the waiting queue (first come, first
   served); one that can never fit a sequence's cells is refused at once (:attr:`ServeRequest.
   refused` says why) and the others go on;
2. *admission*: a waiting request takes a free slot (a sequence id, ``n_slots`` of them:
   llama-server's ``-np``) when its cells fit -- on a unified cache the cells every admitted
   request will still need are reserved, so a step never runs out of cells; on a per-stream
   cache each sequence has its stream;
3. *the batch*: one token of every request that is generating (its last sampled token at its
   next position), then prompt tokens of admitted requests in admission order, at most
   ``prompt_budget`` of them and never past ``n_batch`` tokens in all (llama-server's rule:
   ``prompt_budget = n_batch``); ``prompt_budget = 0`` takes every admitted prompt whole. A
   prompt may so be cut over several steps (chunked prefill); only its last token asks for logits;
4. the step runs (``step_fn``: the batch through split -> KV cache -> plan -> graph, the same
   path as any batch) and returns the next token of every flagged token; a request that has
   its ``n_predict`` tokens is retired (``seq_rm``: its cells and slot are free for the next).

Time is a clock that advances by each step's measured duration and jumps over idle time to
the next arrival (:func:`serve`): a request arriving during a step waits for the next one, as
in a server, and an idle server costs no wall time.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .batch import Batch
from .kv_cache import KVCache

__all__ = ["ServeRequest", "Step", "Scheduler", "ServeStats", "serve", "cells_needed"]


def cells_needed(n_prompt: int, n_predict: int) -> int:
    """KV cells a request fills: its prompt and every generated token but the last (which is
    sampled, never decoded)."""
    return n_prompt + max(0, n_predict - 1)


@dataclass(eq=False)
class ServeRequest:
    """One request: ``prompt`` int32 token ids, ``n_predict`` tokens to generate (>= 1), arrival
    time in seconds from the trace's start. Filled in by the loop: ``seq`` (its sequence id while
    admitted), ``tokens`` (generated ids), ``token_times`` (clock time of each), ``admitted`` and
    ``finished`` times, ``refused`` (why, when it was refused; None otherwise)."""

    rid: int
    arrival: float
    prompt: np.ndarray
    n_predict: int
    seq: int = -1
    n_prompt_done: int = 0
    tokens: list = field(default_factory=list)
    token_times: list = field(default_factory=list)
    admitted: float | None = None
    finished: float | None = None
    refused: str | None = None

    def __post_init__(self):
        self.prompt = np.asarray(self.prompt, dtype=np.int32).reshape(-1)
        if self.prompt.size < 1:
            raise ValueError(f"request {self.rid}: empty prompt")
        if int(self.n_predict) < 1:
            raise ValueError(f"request {self.rid}: n_predict must be at least 1, got {self.n_predict}")
        if not np.isfinite(self.arrival) or self.arrival < 0:
            raise ValueError(f"request {self.rid}: arrival must be a finite time >= 0, got {self.arrival}")

    @property
    def n_prompt(self) -> int:
        return int(self.prompt.size)

    @property
    def cells(self) -> int:
        return cells_needed(self.n_prompt, self.n_predict)

    @property
    def generating(self) -> bool:
        return self.n_prompt_done == self.n_prompt and 0 < len(self.tokens) < self.n_predict

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def itl(self) -> list[float]:
        """Seconds between consecutive generated tokens."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    def reset(self) -> None:
        """Forget a run (to serve the same request again)."""
        self.seq, self.n_prompt_done = -1, 0
        self.tokens, self.token_times = [], []
        self.admitted = self.finished = self.refused = None


@dataclass(eq=False)
class Step:
    """A step's batch (decode tokens first, then prompt chunks), ``want`` (bool per batch token:
    it gets logits and so a next token), ``owner`` (the request of each batch token), and counts."""

    batch: Batch
    want: np.ndarray
    owner: list
    n_decode: int
    n_prompt: int

    @property
    def mixed(self) -> bool:
        """Prompt tokens and decode tokens in one step."""
        return self.n_decode > 0 and self.n_prompt > 0


class Scheduler:
    """Admission, step formation and retirement over ``cache`` (module docstring). ``n_slots``:
    sequence ids ``0..n_slots-1`` (at most the cache's ``n_seq_max``; on a per-stream cache
    sequence ``s`` is stream ``s``); ``n_batch``: tokens of a step at most, unless
    ``prompt_budget`` is 0 (whole prompts); ``prompt_budget``: prompt tokens of a step at most;
    ``pos_limit``: a model's position limit (``AttnConfig.pos_limit``: gemma2's window), a request
    whose positions would reach it is refused (0: none)."""

    def __init__(self, cache: KVCache, n_slots: int, *, n_batch: int = 2048, prompt_budget: int | None = None,
                 pos_limit: int = 0):
        if not 1 <= n_slots <= cache.n_seq_max:
            raise ValueError(f"n_slots must be 1..{cache.n_seq_max} (the cache's sequences), got {n_slots}")
        if n_batch < 1:
            raise ValueError(f"n_batch must be positive, got {n_batch}")
        budget = n_batch if prompt_budget is None else int(prompt_budget)
        if budget < 0:
            raise ValueError(f"prompt_budget must be >= 0 (0: whole prompts), got {prompt_budget}")
        self.cache, self.n_slots, self.n_batch, self.prompt_budget = cache, n_slots, n_batch, budget
        self.pos_limit = int(pos_limit)
        self.free_slots = list(range(n_slots))
        self.waiting: list[ServeRequest] = []
        self.running: list[ServeRequest] = []    # admission order

    @property
    def capacity(self) -> int:
        """Cells one sequence can hold: the whole cache when unified, its stream's otherwise."""
        return self.cache.kv_size

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def arrive(self, req: ServeRequest) -> bool:
        """Queue ``req``; False (and ``req.refused`` set) when it can never fit."""
        if req.cells > self.capacity:
            where = ("the cache" if self.cache.n_stream == 1
                     else f"a sequence's stream ({self.cache.n_stream} streams)")
            req.refused = (f"request {req.rid}: {req.n_prompt} prompt + {req.n_predict} output tokens need "
                           f"{req.cells} KV cells, {where} holds {self.capacity}")
            return False
        if self.pos_limit and req.cells > self.pos_limit:   # positions 0 .. cells - 1
            req.refused = (f"request {req.rid}: {req.n_prompt} prompt + {req.n_predict} output tokens reach "
                           f"position {req.cells - 1}, past the model's sliding window ({self.pos_limit})")
            return False
        self.waiting.append(req)
        return True

    def admit(self, now: float) -> list[ServeRequest]:
        """Admit waiting requests in arrival order while a slot and their cells are free (a
        request that does not fit yet waits; those behind it wait too, first come first served)."""
        got = []
        while self.waiting and self.free_slots:
            req = self.waiting[0]
            if self.cache.n_stream == 1 and self.reserved() + req.cells > self.capacity:
                break
            self.waiting.pop(0)
            req.seq = self.free_slots.pop(0)
            req.admitted = now
            self.running.append(req)
            got.append(req)
        return got

    def next_step(self) -> Step | None:
        """The next step's batch, or None when no admitted request has work."""
        toks, pos, seqs, want, owner = [], [], [], [], []
        next_pos = self.cache.next_positions([r.seq for r in self.running])
        for r in self.running:
            if r.generating:
                toks.append(r.tokens[-1])
                pos.append(next_pos[r.seq])
                seqs.append((r.seq,))
                want.append(True)
                owner.append(r)
        n_decode = len(toks)
        budget = (1 << 62) if self.prompt_budget == 0 else max(0, min(self.prompt_budget, self.n_batch - n_decode))
        for r in self.running:
            left = r.n_prompt - r.n_prompt_done
            if left == 0 or budget == 0:
                continue
            k = min(left, budget)
            budget -= k
            p0 = next_pos[r.seq]
            toks.extend(r.prompt[r.n_prompt_done:r.n_prompt_done + k].tolist())
            pos.extend(range(p0, p0 + k))
            seqs.extend([(r.seq,)] * k)
            want.extend([False] * (k - 1) + [r.n_prompt_done + k == r.n_prompt])
            owner.extend([r] * k)
        if not toks:
            return None
        batch = Batch(np.array(toks, dtype=np.int32), np.array(pos, dtype=np.int32), tuple(seqs))
        return Step(batch, np.array(want, dtype=bool), owner, n_decode, len(toks) - n_decode)

    def commit(self, step: Step, next_tokens: np.ndarray, now: float) -> list[ServeRequest]:
        """The step went through: its prompt tokens are in the cache, ``next_tokens`` (int, one
        per flagged token, batch order) are each owner's next token at time ``now``. Returns
        the requests that finished (retired: cells and slot free)."""
        idx = np.flatnonzero(step.want)
        if len(next_tokens) != idx.size:
            raise ValueError(f"the step flagged {idx.size} tokens for logits, got {len(next_tokens)} next tokens")
        for r in step.owner[step.n_decode:]:
            r.n_prompt_done += 1
        done = []
        for i, t in zip(idx.tolist(), np.asarray(next_tokens).tolist()):
            r = step.owner[i]
            r.tokens.append(int(t))
            r.token_times.append(now)
            if len(r.tokens) == r.n_predict:
                done.append(r)
        for r in done:
            self.retire(r, now)
        return done

    def retire(self, r: ServeRequest, now: float) -> None:
        self.cache.seq_rm(r.seq)
        self.running.remove(r)
        self.free_slots.append(r.seq)
        self.free_slots.sort()
        r.finished = now

    def reserved(self) -> int:
        """Cells the running requests fill when done."""
        return sum(r.cells for r in self.running)

    def cells_used(self) -> int:
        """Cells holding a token now, all streams."""
        return sum(self.cache.n_used(s) for s in range(self.cache.n_stream))


@dataclass
class ServeStats:
    """What a :func:`serve` run did: ``elapsed`` (clock seconds from the first arrival to the last
    token), ``busy`` (seconds spent in steps), step counts, ``cells_peak`` (cells in use after a
    step, at most), and the step function's own counts summed (``counts``: e.g. ubatches, pads)."""

    elapsed: float = 0.0
    busy: float = 0.0
    n_steps: int = 0
    n_mixed: int = 0
    n_prompt_tokens: int = 0
    cells_peak: int = 0
    counts: dict = field(default_factory=dict)


def serve(requests, sched: Scheduler, step_fn, *, clock=time.perf_counter, on_finish=None,
          on_refuse=None) -> ServeStats:
    """Serve ``requests`` (:class:`ServeRequest`, any order) with ``sched``; ``step_fn(step)``
    runs a :class:`Step`'s batch and returns ``(next_tokens, counts)``: one int per flagged token
    (batch order) and a dict of numbers to sum (or None). Each step is timed with ``clock``
    (seconds; it must return after the step's work is done). ``on_finish(req)``, ``on_refuse(req)``
    report each request as it ends.
    The cache must have no cells of sequences ``0..n_slots-1`` when it starts."""
    pending = sorted(requests, key=lambda r: (r.arrival, r.rid))
    for r in pending:
        r.reset()
    stats = ServeStats()
    t0 = pending[0].arrival if pending else 0.0
    now = t0
    last = t0
    i = 0
    while i < len(pending) or sched.busy:
        while i < len(pending) and pending[i].arrival <= now:
            r = pending[i]
            i += 1
            if not sched.arrive(r) and on_refuse is not None:
                on_refuse(r)
        sched.admit(now)
        step = sched.next_step()
        if step is None:
            if i < len(pending):      # idle until the next arrival
                now = max(now, pending[i].arrival)
                continue
            if sched.waiting:         # cannot happen: arrive() refuses what can never fit
                raise RuntimeError(f"{len(sched.waiting)} request(s) wait with nothing running")
            break
        start = clock()
        next_tokens, counts = step_fn(step)
        dt = clock() - start
        now += dt
        stats.busy += dt
        stats.n_steps += 1
        stats.n_mixed += int(step.mixed)
        stats.n_prompt_tokens += step.n_prompt
        for k, v in (counts or {}).items():
            stats.counts[k] = stats.counts.get(k, 0) + v
        stats.cells_peak = max(stats.cells_peak, sched.cells_used())   # before the finished retire
        for r in sched.commit(step, next_tokens, now):
            last = now
            if on_finish is not None:
                on_finish(r)
    stats.elapsed = last - t0
    return stats
