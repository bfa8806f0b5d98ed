"""Human-readable plans, for the CLI and the README.

* :func:`describe_plan` - one dict per ubatch of ``batch`` split by ``mode``.
* :func:`compare_strategies` - one dict per strategy (ubatch count, shapes, rows, pads,
  live KV tiles, estimated cost).
* :func:`format_table` - a markdown table of such rows.

Nothing here changes a cache: plans are dry runs (``plan.dry_run_plans``). Without a cache, a
fresh one is assumed: unified for ``simple``, one stream per sequence otherwise (llama.cpp's
pairing).
"""
from __future__ import annotations

from .auto import CostModel, choose_split, cost_of, _scratch_cache
from .batch import Batch
from .kv_cache import KVCache
from .plan import dry_run_plans
from .attn_config import AttnConfig
from .split import split_ubatches  # fixed modes; auto goes through choose_split

__all__ = ["describe_plan", "compare_strategies", "format_table", "STRATEGIES"]

#: (mode, unified KV) pairs compared by default: llama.cpp's two setups, seq, padded, auto
STRATEGIES = (("simple", True), ("equal", False), ("seq", False), ("padded", False), ("auto", False))


def _split(batch, n_ubatch, mode, cache, cfg, model):
    if mode == "auto":
        choice = choose_split(batch, n_ubatch, cache=cache, cfg=cfg, model=model)
        return choice.ubatches, choice
    return split_ubatches(batch, n_ubatch, mode), None


def _plans(cache, ubs, choice, cfg):
    """The dry-run plans of ``ubs`` on ``cache``: ``auto``'s own when its choice made them."""
    if choice is not None and choice.plans is not None:
        return choice.plans
    return dry_run_plans(cache, ubs, n_swa=cfg.n_swa, alibi=cfg.alibi)


def describe_plan(batch: Batch, n_ubatch: int, mode: str, *, unified: bool | None = None,
                  cache: KVCache | None = None, cfg: AttnConfig | None = None) -> list[dict]:
    """One row per ubatch: ``ubatch, mode, shape (n_seqs x n_seq_tokens), n_tokens, n_pad,
    seq_ids, n_stream, n_kv, kv_tiles_live, kv_tiles_tail, kv_tiles_total`` (+ ``reason`` for
    ``auto``)."""
    cfg = cfg or AttnConfig(n_head=32, n_head_kv=8, head_dim_k=128)
    if cache is None:
        cache = _scratch_cache(batch, n_ubatch, (mode == "simple") if unified is None else unified)
    ubs, choice = _split(batch, n_ubatch, mode, cache, cfg, None)
    rows = []
    for i, p in enumerate(_plans(cache, ubs, choice, cfg)):
        row = {"ubatch": i, **p.describe()}
        if choice is not None:
            row["reason"] = choice.reason
        rows.append(row)
    return rows


def compare_strategies(batch: Batch, n_ubatch: int, strategies=STRATEGIES, *, cfg: AttnConfig | None = None,
                       model: CostModel | None = None) -> list[dict]:
    """One row per (mode, unified) strategy: ``strategy, kv, n_ubatches, shapes, rows,
    n_pad, kv_tiles, est_us`` (per the ``auto`` cost model), ``note``."""
    cfg = cfg or AttnConfig(n_head=32, n_head_kv=8, head_dim_k=128)
    model = model or CostModel()
    out = []
    for mode, unified in strategies:
        cache = _scratch_cache(batch, n_ubatch, unified)
        ubs, choice = _split(batch, n_ubatch, mode, cache, cfg, model)
        plans = _plans(cache, ubs, choice, cfg)
        c = cost_of(mode, plans, cfg, model)
        shapes = [u.shape_str for u in ubs]
        out.append({"strategy": mode, "kv": "unified" if unified else "split",
                    "n_ubatches": len(ubs), "shapes": _compress(shapes), "rows": c.rows,
                    "n_pad": c.n_pad, "kv_tiles": c.kv_tiles, "est_us": round(c.est_us, 1),
                    "note": f"-> {choice.mode}" if choice is not None else ""})
    return out


def _compress(shapes: list[str]) -> str:
    """'10x1, 9x1, ... 1x1' style: at most 4 shapes then the count of the rest."""
    if len(shapes) <= 4:
        return ", ".join(shapes)
    return ", ".join(shapes[:3]) + f", ... {shapes[-1]}"


def format_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """Markdown table of ``rows`` (dicts), columns in the given or first row's order."""
    if not rows:
        return ""
    cols = columns or [c for c in rows[0] if c != "reason"]
    cells = [[str(r.get(c, "")) for c in cols] for r in rows]
    width = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    line = lambda xs: "| " + " | ".join(x.ljust(w) for x, w in zip(xs, width)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in width) + "|"
    return "\n".join([line(cols), sep] + [line(x) for x in cells])
