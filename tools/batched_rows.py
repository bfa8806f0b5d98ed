"""The rows of a ``ggml-attn-batched-bench`` run (prompt lengths x TG x B, or ragged prompts)
and the KV cells each strategy's cache needs for them."""
from __future__ import annotations

import numpy as np

from .errors import UserError


def check_ragged_flags(ns) -> None:
    """--prompt-lens sets every length and B; --prompt-dist sets the lengths of each -npl.
    A flag they replace, given too, would be dropped silently: a UserError instead."""
    given = ns.explicit
    if ns.prompt_lens is not None:
        if ns.prompt_dist is not None:
            raise UserError("--prompt-lens and --prompt-dist both set the prompt lengths; give one")
        for flag in ("npp", "npl"):
            if flag in given:
                raise UserError(f"--prompt-lens gives one sequence per length (B = {len(ns.prompt_lens)}) "
                                f"and replaces -npp and -npl; drop -{flag}")
    elif ns.prompt_dist is not None and "npp" in given:
        raise UserError("--prompt-dist draws each prompt's length and replaces -npp; drop -npp")


def rows_of(ns) -> list[dict]:
    """One dict per (prompt set, tg) with pp, pl and prompt_lens (None when uniform)."""
    check_ragged_flags(ns)
    for flag in ("npp", "ntg", "npl"):
        if not getattr(ns, flag):   # a range A-B with B < A gives no values
            raise UserError(f"-{flag} gives no values (a range A-B with B < A is empty)")
    # checked before any prompt is drawn or sized (-npl 99999999999999999999 overflowed there)
    from ggml_attn.graph.batch import MAX_SEQ
    n_seq = len(ns.prompt_lens) if ns.prompt_lens is not None else max(ns.npl)
    if n_seq > MAX_SEQ:
        what = f"--prompt-lens gives {n_seq} sequences" if ns.prompt_lens is not None else f"-npl {n_seq}"
        raise UserError(f"{what}: at most {MAX_SEQ} sequences run together (llama.cpp's LLAMA_MAX_SEQ)")
    rng = np.random.default_rng(ns.seed)
    if ns.prompt_lens is not None:
        lens = [x for x in ns.prompt_lens]
        if not lens or min(lens) < 1:
            raise UserError("--prompt-lens needs at least one length, all >= 1")
        prompts = [dict(pp=max(lens) if min(lens) == max(lens) else None, pl=len(lens), prompt_lens=lens)]
    elif ns.prompt_dist is not None:
        lo, hi = ns.prompt_dist
        prompts = []
        for pl in ns.npl:
            if pl < 1:
                raise UserError("-npl values must be >= 1")
            lens = [int(x) for x in rng.integers(lo, hi + 1, size=pl)]
            prompts.append(dict(pp=None if min(lens) != max(lens) else lens[0], pl=pl, prompt_lens=lens))
    else:
        prompts = [dict(pp=pp, pl=pl, prompt_lens=None) for pp in ns.npp for pl in ns.npl]
    for pr in prompts:
        if pr["pl"] < 1:
            raise UserError("-npl values must be >= 1")
        if pr["pp"] is not None and pr["pp"] < 1 and pr["prompt_lens"] is None:
            raise UserError("-npp values must be >= 1")
    if ns.prompt_lens is None and ns.prompt_dist is None:   # llama-batched-bench's loop order: pp, tg, pl
        return [dict(pp=pp, pl=pl, prompt_lens=None, tg=tg) for pp in ns.npp for tg in ns.ntg for pl in ns.npl]
    return [dict(pr, tg=tg) for pr in prompts for tg in ns.ntg]


def lens_of(row) -> list[int]:
    return list(row["prompt_lens"]) if row["prompt_lens"] else [row["pp"]] * row["pl"]


def ctx_needed(row, pps: bool, unified: bool, n_ubatch: int, n_seq: int | None = None,
               pads: bool = True) -> tuple[int, int]:
    """(llama-batched-bench's n_ctx_req, cells our cache needs for this row); a shared prompt
    (``pps``) takes its cells once in a ``unified`` cache, once per sequence otherwise.

    A split cache gives every one of its ``n_seq`` streams (default: B) n_ctx / n_seq cells, so
    it needs n_seq times this row's longest sequence; padded ubatches of ragged prompts
    (``pads``: a split that may pad) hold pad cells for a moment: at most one ubatch, and
    fewer than the longest prompt for each but the longest sequence."""
    lens = lens_of(row)
    tg, pl = row["tg"], row["pl"]
    # llama-batched-bench: is_pp_shared ? (kv_unified ? pp : pl*pp) + pl*tg : pl*(pp + tg)
    req = ((max(lens) if unified else pl * max(lens)) + pl * tg) if pps else (sum(lens) + pl * tg)
    if unified:  # only ragged prompts get pad rows, fewer than max(lens) per padded sequence
        ragged = pads and not pps and min(lens) != max(lens)
        return req, req + (min(n_ubatch, (pl - 1) * max(lens)) if ragged else 0)
    return req, (n_seq or pl) * (max(lens) + tg)


def cache_capacity(n_ctx: int, n_seq: int, unified: bool) -> int:
    """Cells a KVCache built with ``n_ctx`` has in all, as llama.cpp's context counts them
    (``llama_n_ctx``: ``n_ctx`` padded to 256, then, split, per stream again)."""
    from ggml_attn.graph.kv_cache import KV_PAD, pad_to
    n = pad_to(n_ctx, KV_PAD)
    return n if unified else n_seq * pad_to(n // n_seq, KV_PAD)


def strategy_kv(split: str, kv_unified: bool) -> bool:
    return True if split == "simple" else kv_unified
