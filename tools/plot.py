"""``ggml-attn-batched-bench --plot``: S_PP and S t/s per strategy as grouped bars (matplotlib)."""
from __future__ import annotations

from . import format_batched as fb
from .errors import UserError
from .output import check_plot_path, save_error


def check_plot_available(path):
    if path is None:
        return
    check_plot_path(path)
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise UserError("--plot needs matplotlib (pip install 'ggml-attn[plot]')") from e


def write(prog: str, path: str, draw, results: list[dict], title: str) -> None:
    """``draw(path, results, title)`` (:func:`draw_plot`, :func:`draw_serve_plot`), a file that
    cannot be written as a UserError (``output.save_error``), then one stderr line saying so."""
    import sys
    try:
        draw(path, results, title)
    except OSError as e:
        raise save_error(path, e) from None
    print(f"{prog}: wrote {path}", file=sys.stderr)


def draw_plot(path: str, results: list[dict], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = []
    for r in results:
        lab = f"B={r['pl']} PP={fb.pp_label(r)} TG={r['tg']}"
        if lab not in labels:
            labels.append(lab)
    splits = []
    for r in results:
        if r["split"] not in splits:
            splits.append(r["split"])
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(labels) * len(splits) / 2), 4.5))
    width = 0.8 / max(1, len(splits))
    for ax, key, name in ((axes[0], "speed_pp", "S_PP t/s (prompt)"), (axes[1], "speed", "S t/s (total)")):
        for i, sp in enumerate(splits):
            vals = []
            for lab in labels:
                hit = [r[key] for r in results if r["split"] == sp
                       and f"B={r['pl']} PP={fb.pp_label(r)} TG={r['tg']}" == lab]
                vals.append(hit[0] if hit else 0.0)
            ax.bar([x + i * width for x in range(len(labels))], vals, width, label=sp)
        ax.set_xticks([x + width * (len(splits) - 1) / 2 for x in range(len(labels))])
        ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(name)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def serve_label(r: dict) -> str:
    """A serve-bench strategy: split, KV mode and prompt budget."""
    budget = "whole" if r["prompt_budget"] == 0 else r["prompt_budget"]
    return f"{r['split']} kvu={int(bool(r['kv_unified']))} budget={budget}"


def draw_serve_plot(path: str, results: list[dict], title: str) -> None:
    """``ggml-attn-serve-bench --plot``: ITL p99 (ms) against output tokens/s, one line per
    strategy through its rates (a rate sweep), and TTFT p50 beside it."""
    import math

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    labels = list(dict.fromkeys(serve_label(r) for r in results))
    for lab in labels:
        pts = sorted((r for r in results if serve_label(r) == lab),
                     key=lambda r: math.inf if r["rate"] is None else r["rate"])
        x = [r["out_tok_per_s"] for r in pts]
        for ax, key in ((axes[0], "itl_ms_p99"), (axes[1], "ttft_ms_p50")):
            ax.plot(x, [r[key] for r in pts], marker="o", label=lab)
    for ax, name in ((axes[0], "ITL p99 (ms)"), (axes[1], "TTFT p50 (ms)")):
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
