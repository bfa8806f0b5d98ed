"""``ggml-attn-batched-bench --plan``: each strategy's ubatches for every batch, computed
nothing (md: one line per strategy; jsonl: one object per strategy and batch)."""
from __future__ import annotations

import json

from .batched_rows import lens_of
from .runner import compress_shapes, ubatch_shape


def print_plans(ns, runner_for, rows, splits, out) -> None:
    seen = set()
    for row in rows:
        key = (tuple(lens_of(row)), ns.pps)
        if key in seen:
            continue
        seen.add(key)
        lens = lens_of(row)
        if ns.output == "md":
            desc = (f"{len(lens)} x {lens[0]}" if min(lens) == max(lens)
                    else f"{len(lens)} prompts of {min(lens)}..{max(lens)} tokens")
            out.write(f"batch: {desc} ({sum(lens)} tokens), n_batch {ns.batch_size}, "
                      f"n_ubatch {ns.ubatch_size}\n")
        for split in splits:
            runner = runner_for(split, row)
            batch = runner.prompt_batch([lens[0]] if ns.pps else lens)
            ubs = runner.split(batch)
            kvu = runner.cfg.kv_unified
            shapes = [ubatch_shape(u) for u in ubs]
            n_pad = sum(u.n_pad for u in ubs)
            if ns.output == "jsonl":
                out.write(json.dumps({"split": split, "kv_unified": kvu, "pl": row["pl"],
                                      "prompt_lens": lens, "ub": len(ubs), "n_pad": n_pad,
                                      "shapes": shapes,
                                      "reason": ubs[0].reason if ubs and ubs[0].reason else ""}) + "\n")
            else:
                pad = f", {n_pad} pad rows" if n_pad else ""
                kv = "unified KV" if kvu else "split KV"
                out.write(f"  {split:<7} ({kv}): {len(ubs)} ubatch{'es' if len(ubs) != 1 else ''}{pad}: "
                          f"{' '.join(compress_shapes(shapes))}\n")
                if split == "auto" and ubs and ubs[0].reason:
                    out.write(f"          {ubs[0].reason}\n")
        out.flush()
