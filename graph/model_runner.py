"""A real model through the decode loop: token ids in, logits out (``driver.decode`` on
:class:`ModelEngine`, kept with the cache: graphs reused from call to call), and greedy
generation on top.

Which tokens get logits (llama.cpp's ``batch.logits`` / output ids): :func:`output_flags` --
by default the last token of each sequence in the batch (a prompt's last token; every token of
a decode step), ``"all"`` for every token, or a bool array per batch token.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import driver
from .batch import Batch
from .engine import Engine, kept_engine
from .kv_cache import KVCache
from .model import Model
from .model_graph import output_flags  # noqa: F401  (re-exported: the API's, and tests')
from .plan import UBatchPlan

__all__ = ["ModelEngine", "ModelResult", "model_engine", "output_flags", "run_model_batch", "greedy"]


@dataclass(eq=False)
class ModelResult:
    """``logits`` float32 ``(n_out, n_vocab)`` in batch order of ``token_idx`` (int64 ``(n_out,)``,
    the batch tokens that asked for logits); ``plans``: every ubatch's plan."""

    logits: np.ndarray
    token_idx: np.ndarray
    plans: list[UBatchPlan]

    def by_seq(self, batch: Batch) -> dict[int, np.ndarray]:
        """The logits of each sequence's last flagged token (primary sequence id -> ``(n_vocab,)``)."""
        out = {}
        for row, i in enumerate(self.token_idx.tolist()):
            out[batch.seq_ids[i][0]] = self.logits[row]
        return out


class ModelEngine(Engine):
    """The engine of a real model on one cache (``engine.Engine`` with ``layer="model"``): graphs
    kept per structure and reused, replayed as CUDA graphs on a GPU (:attr:`CUDA_GRAPHS`). :func:`model_engine` keeps
    one per cache, model and form, so every call of :func:`run_model_batch` (each step of
    :func:`greedy`) reuses the graphs of the calls before."""

    # CUDA-graph replay, as the CLIs' engine: checked under the op's "auto" backend on an H100
    # (tools/dev/gpu_greedy_time.py, 8B-shaped Q4_K_M file, 4 sequences: the same tokens with and
    # without; a greedy step 6.89 ms without, 5.85 with, the CLI's replayed step 5.07:
    # bench/results/2026-12-05-059b9d1-h100-greedy.json)
    CUDA_GRAPHS = True

    def __init__(self, cache: KVCache, model: Model, *, fa=None, all_custom: bool | None = None, n_threads: int = 2):
        super().__init__(cache, model.attn_config(), layer="model", model=model, fa=fa, n_threads=n_threads,
                         all_custom=all_custom, cuda_graph=self.CUDA_GRAPHS)


def model_engine(cache: KVCache, model: Model, *, fa=None, all_custom: bool | None = None,
                 n_threads: int = 2) -> ModelEngine:
    """The :class:`ModelEngine` of ``cache``, ``model``, ``fa`` and ``all_custom``, made on the first
    call and kept with the cache (``engine.kept_engine``: its graphs view the cache's memory and
    go with it)."""
    e = kept_engine(cache, ("model", id(model), all_custom),
                    lambda: ModelEngine(cache, model, fa=fa, all_custom=all_custom, n_threads=n_threads),
                    fits=lambda e: e.model is model and e.fa is fa)   # (not a freed model's id, nor another op)
    if not e.device:
        e.n_threads = n_threads
    e.follow_current_stream()
    return e


def run_model_batch(cache: KVCache, batch: Batch, model: Model, n_ubatch: int = 512, mode: str = "auto", *,
                    logits="last", n_threads: int = 2, fa=None, validate: bool = True,
                    all_custom: bool | None = None) -> ModelResult:
    """``batch`` (token ids, positions, sequences) through ``model`` with ``cache``, split by
    ``mode`` into ubatches of at most ``n_ubatch`` tokens; logits of the flagged tokens
    (:func:`output_flags`). Failures as ``driver.decode``: nothing is claimed before every check
    passed; a failed ubatch is rolled back (:class:`~ggml_attn.graph.driver.BatchError`).
    ``all_custom``: as ``build.build_ubatch_graph``'s (None: all-custom exactly when the cache is
    CuPy's; True on a numpy cache: the device form of the model graph, computed with numpy)."""
    from ggml_attn.runtime import check_n_threads  # noqa: PLC0415
    from .build import check_build_args  # noqa: PLC0415
    check_n_threads(n_threads)   # before any cell is claimed
    cfg = model.attn_config()
    check_build_args(cache, cfg, fa=fa, layer="model", model=model, all_custom=all_custom)
    if batch.tokens.size and int(batch.tokens.max()) >= model.hp.n_vocab:
        i = int(np.argmax(batch.tokens >= model.hp.n_vocab))
        raise ValueError(f"tokens[{i}] = {int(batch.tokens[i])} is not in the model's vocabulary "
                         f"(n_vocab {model.hp.n_vocab})")
    if cache.shifted:
        raise ValueError("the KV cache's positions were moved by seq_add, and this package does not "
                         "re-rotate cached K (llama.cpp's K-shift): a RoPE model would attend with stale "
                         "rotations; empty the cache (seq_rm(-1)) or re-run the prompts")
    want = output_flags(batch, logits)
    n_out = int(want.sum())
    out = np.zeros((n_out, model.hp.n_vocab), dtype=np.float32)
    where = np.full(batch.n_tokens, -1, dtype=np.int64)
    where[want] = np.arange(n_out)

    engine = model_engine(cache, model, fa=fa, all_custom=all_custom, n_threads=n_threads)

    def done(plan: UBatchPlan, res) -> None:
        idx, lg = res
        if not isinstance(lg, np.ndarray):   # the device's: read once its stream is done
            engine.synchronize()
            lg = lg.get()
        out[where[idx]] = lg

    engine.batch, engine.logits = batch, want
    try:
        plans = driver.decode(cache, batch, n_ubatch, mode, engine, cfg, validate=validate, on_done=done)
    finally:
        engine.batch = None
    return ModelResult(out, np.flatnonzero(want), plans)


def greedy(cache: KVCache, model: Model, prompts, n_predict: int, *, seq_ids=None, n_ubatch: int = 512,
           mode: str = "auto", n_threads: int = 2, fa=None, all_custom: bool | None = None) -> list[list[int]]:
    """Greedy decoding: ``prompts`` (lists of token ids) continue sequences ``seq_ids`` (default
    ``0..n-1``) from where the cache has them; then ``n_predict`` steps, one token per sequence
    each (the argmax of its last logits), all sequences in one batch per step. Returns the
    generated tokens of each sequence. ``all_custom``: as :func:`run_model_batch`'s."""
    from ggml_attn.runtime import check_n_threads  # noqa: PLC0415
    from .batch import as_int  # noqa: PLC0415
    check_n_threads(n_threads)
    n_predict = as_int(n_predict, "n_predict", 0)
    ids = list(range(len(prompts))) if seq_ids is None else [as_int(s, f"seq_ids[{j}]", 0)
                                                             for j, s in enumerate(seq_ids)]
    batch = Batch.from_sequences(prompts, ids, start_pos=cache.next_positions(ids))
    _check_room(cache, batch, ids, n_predict)   # before any token enters the cache
    last_pos = int(batch.positions.max()) + max(0, n_predict - 1)
    if model.hp.pos_limit and last_pos >= model.hp.pos_limit:
        raise ValueError(f"greedy: the prompts and {n_predict} steps reach position {last_pos}, past the model's "
                         f"sliding window ({model.hp.pos_limit}); nothing was decoded")
    res = run_model_batch(cache, batch, model, n_ubatch, mode, n_threads=n_threads, fa=fa,
                          all_custom=all_custom)
    last = res.by_seq(batch)
    gen: list[list[int]] = [[] for _ in ids]
    try:
        for step in range(n_predict):
            toks = [int(np.argmax(last[s])) for s in ids]
            for g, t in zip(gen, toks):
                g.append(t)
            if step == n_predict - 1:
                break
            pos = cache.next_positions(ids)
            step_batch = Batch(np.array(toks, dtype=np.int32), np.array([pos[s] for s in ids], dtype=np.int32),
                               tuple((s,) for s in ids))
            res = run_model_batch(cache, step_batch, model, n_ubatch, mode, n_threads=n_threads, fa=fa,
                                  all_custom=all_custom)
            last = res.by_seq(step_batch)
    except BaseException as e:   # what was generated goes with the error (Ctrl-C included)
        e.generated = gen
        raise
    return gen


def _check_room(cache: KVCache, batch: Batch, ids: list[int], n_predict: int) -> None:
    """ValueError when the prompts of ``batch`` and ``n_predict`` steps of each sequence cannot
    all fit the free cells of their streams (every generated token but the last is decoded)."""
    need: dict[int, int] = {}
    per_seq = max(0, n_predict - 1)
    counts = dict(zip(*np.unique(np.fromiter((s[0] for s in batch.seq_ids), dtype=np.int64), return_counts=True)))
    for s in ids:
        st = cache.seq_to_stream(s)
        need[st] = need.get(st, 0) + int(counts.get(s, 0)) + per_seq
    for st, n in need.items():
        free = cache.kv_size - cache.n_used(st)
        if n > free:
            where = "the cache" if cache.n_stream == 1 else f"stream {st}"
            raise ValueError(f"greedy: the prompts and {n_predict} steps need {n} KV cells in {where}, which has "
                             f"{free} free of {cache.kv_size}; nothing was decoded")
