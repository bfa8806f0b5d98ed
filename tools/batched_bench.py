"""``ggml-attn-batched-bench``: llama-batched-bench for ggml-attn's batching strategies.

For every combination of prompt length (``-npp``), generated tokens (``-ntg``) and
parallel sequences (``-npl``): ``B`` prompts are decoded together (timed: T_PP), then
``TG`` decode steps of one token per sequence (timed: T_TG), with llama-batched-bench's
columns, plus the split strategy and ``UB``, the number of ubatches the prompts took.

Ragged prompts on a split KV cache (where llama.cpp's ``equal`` split must give every
sequence of a ubatch the same number of tokens, so prompts of different lengths become many
small ubatches, and ``padded`` pads them to one length instead) are one command::

    ggml-attn-batched-bench --prompt-lens 1-10 -ntg 4 --split all
    ggml-attn-batched-bench --prompt-dist 16-200 -npl 16,64 --seed 1 --split all --plan
"""
from __future__ import annotations

import sys

from ggml_attn.graph.batch import MAX_SEQ

from . import format_batched as fb
from . import plot
from .args import (INT32_MAX, LLAMA_BATCHED_INERT, add_inert_flags, add_kv_split_flags, add_list, add_version,
                   int_at_least, int_range, parse_fa_one, parse_int_range, Parser)
from .batched_rows import cache_capacity, ctx_needed, lens_of, rows_of, strategy_kv
from .common import Progress, console_main, default_threads
from . import multi_gpu
from .errors import OutOfMemory, UserError
from .kv_types import CACHE_TYPES, GPU_TYPES, check_cache_types
from .models import (DEFAULT_CPU_MODEL, DEFAULT_GPU_MODEL, PRESETS, default_layer, resolve_run_model,
                     say_synthetic_layers)
from .output import SafeWriter
from .placement import check_ngl, ngl_field, note_cpu_fallback, parse_one_ngl, resolve_ngl_device
from .plans import print_plans
from .progress import ProgressBar
from .format_bench import FA_INT, attention_path
from .runner import (DEVICES, KERNELS, LAYERS, SPLITS, RunConfig, Runner, check_kernel, kernel_help,
                     check_threads, effective_ubatch, free_device_memory, splits_of)
from .verbose import Verbose

PROG = "ggml-attn-batched-bench"


def parse_dist(text: str) -> tuple[int, int]:
    parts = str(text).split("-")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise UserError(f"invalid --prompt-dist '{text}' (expected MIN-MAX, e.g. 16-200)")
    lo, hi = int(parts[0]), int(parts[1])
    if lo < 1 or hi < lo or hi > INT32_MAX:   # positions are int32
        raise UserError(f"invalid --prompt-dist '{text}': need 1 <= MIN <= MAX <= {INT32_MAX}")
    return lo, hi


def build_parser() -> Parser:
    p = Parser(prog=PROG, description=(
        "Benchmark batched decoding like llama-batched-bench, comparing ubatch split strategies: "
        "B prompts of PP tokens (or ragged lengths) are processed together, then TG steps of one "
        "token per sequence. Lists take commas and ranges (a-b, a-b+s, a-b*m)."))
    p.add_argument("-m", "--model", type=str, default="auto", metavar="NAME|FILE.gguf",
                   help=f"model preset ({', '.join(PRESETS)}) or a .gguf (header only); auto: "
                        f"{DEFAULT_CPU_MODEL} on the CPU, {DEFAULT_GPU_MODEL} on a GPU (default: auto)")
    add_list(p, "-npp", type=parse_int_range, default=[128, 256, 512], metavar="N",
             help="prompt tokens per sequence")
    add_list(p, "-ntg", type=parse_int_range, default=[128, 256], metavar="N",
             help="generated tokens per sequence (decode steps)")
    add_list(p, "-npl", type=int_range(MAX_SEQ, f": at most {MAX_SEQ} sequences run together "
                                                "(llama.cpp's LLAMA_MAX_SEQ)"),
             default=[1, 2, 4, 8, 16, 32], metavar="N", help=f"parallel sequences (B), at most {MAX_SEQ}")
    p.add_argument("--prompt-lens", type=parse_int_range, default=None, metavar="LIST",
                   help="ragged prompts: one sequence per length, e.g. 1-10 or 5,80,200 "
                        "(replaces -npp and -npl)")
    p.add_argument("--prompt-dist", type=parse_dist, default=None, metavar="MIN-MAX",
                   help="ragged prompts: B lengths drawn uniformly from MIN..MAX for each -npl "
                        "value (replaces -npp)")
    p.add_argument("-s", "--seed", type=int_at_least(0), default=0,
                   help="seed of --prompt-dist and the inputs (default: 0)")
    p.add_argument("-pps", action="store_true",
                   help="one shared prompt: decode it once for sequence 0 and copy it to the others")
    p.add_argument("-tgs", action="store_true",
                   help="text generation separated across the sequences (llama.cpp's is_tg_separate): "
                        "each sequence's TG tokens are decoded one per step, one sequence after the "
                        "other, instead of one token of every sequence per step")
    add_kv_split_flags(p, SPLITS)
    p.add_argument("--kernel", choices=KERNELS, default="auto", help=kernel_help() + " (default: auto)")
    p.add_argument("--layer", choices=LAYERS, default=None,
                   help="attn: attention only; full: with QKV/O projections and FFN (random weights of "
                        "the shape); model: a .gguf's own weights, token ids to logits (default: model "
                        "with -m FILE.gguf, else attn)")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="auto (GPU when usable), cpu or cuda (default: auto)")
    p.add_argument("--cuda-graph", choices=("on", "off"), default="on",
                   help="on the GPU, capture a ubatch's launches as a CUDA graph the second time its "
                        "shape comes and replay it after; off: ggml's graph loop every time (default: on)")
    p.add_argument("-fa", "--flash-attn", type=parse_fa_one, default="auto", metavar="on|off|auto",
                   help="on/auto (1/-1): ggml_attn.flash_attn_ext; off (0): ggml's mul_mat+soft_max "
                        "(default: auto)")
    p.add_argument("-c", "--ctx-size", type=int_at_least(0, " (0: the model's training context)"), default=0,
                   metavar="N", help="KV cells in all, rows that need more are skipped; 0: the model's training "
                                     "context limits the rows (as llama.cpp) and the cache holds what the largest "
                                     "row that runs needs (default: 0)")
    p.add_argument("-b", "--batch-size", type=int, default=2048, metavar="N",
                   help="logical batch size (default: 2048)")
    p.add_argument("-ub", "--ubatch-size", type=int, default=512, metavar="N",
                   help="physical batch size (default: 512)")
    p.add_argument("-ctk", "--cache-type-k", choices=CACHE_TYPES, default="f16", metavar="TYPE",
                   help=f"K cache type: {'|'.join(CACHE_TYPES)}; all on the CPU path, {', '.join(GPU_TYPES)} "
                        f"on the GPU (default: f16)")
    p.add_argument("-ctv", "--cache-type-v", choices=CACHE_TYPES, default="f16", metavar="TYPE",
                   help="V cache type, as -ctk; a quantized V needs flash attention (default: f16)")
    p.add_argument("-ngl", "--n-gpu-layers", type=parse_one_ngl, default=None, metavar="N",
                   help="llama.cpp's GPU layers: 0 runs the CPU path, N >= the model's layers (e.g. 99; auto, "
                        "all, -1) all layers on the GPU; a partial offload is an error (default: per --device)")
    p.add_argument("-t", "--threads", type=int_at_least(1), default=default_threads(), metavar="N",
                   help=f"CPU threads (default: {default_threads()})")
    p.add_argument("--n-layer", type=int_at_least(0, " (0: the model's own)"), default=0, metavar="N",
                   help="override the model's number of layers")
    p.add_argument("-o", "--output", "--output-format", choices=fb.FORMATS, default="md",
                   help="output format on stdout: md or jsonl (default: md)")
    p.add_argument("--plan", action="store_true",
                   help="print each strategy's ubatch plan for every row and exit (no compute)")
    p.add_argument("--plot", metavar="OUT.png", default=None,
                   help="draw S_PP and S t/s per strategy into OUT.png (needs matplotlib)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="describe each run on stderr: model shape, KV caches, each row's prompt ubatches")
    p.add_argument("-r", "--repetitions", type=int_at_least(1, hi=INT32_MAX), default=1, metavar="N",
                   help="times to run each row; with N > 1 speeds are mean ± stddev as in llama-bench "
                        "(default: 1)")
    p.add_argument("--warmup", action="store_true",
                   help="run each row untimed before its repetitions until its ubatch shapes' graphs "
                        "are built and captured, as in a server that has seen them (on a GPU twice: a "
                        "prompt shape is captured at its second run); default: only llama-batched-bench's "
                        "16-token warm-up, the first repetitions pay for them")
    p.add_argument("--progress", action="store_true",
                   help="print llama-bench's progress lines on stderr (without it a progress bar "
                        "shows when stderr is a terminal)")
    p.epilog = fb.TERMS
    multi_gpu.add_args(p)
    add_inert_flags(p, LLAMA_BATCHED_INERT)
    add_version(p)
    return p



def row_label(row) -> str:
    return f"B={row['pl']} PP={fb.pp_label(dict(row, pp=row['pp'] or 0))} TG={row['tg']}"


def n_ctx_req(ns, row, splits: list[str]) -> int:
    """llama-batched-bench's n_ctx_req (its N_KV) of ``row``: the least over the ``splits``
    (a shared prompt takes fewer cells on the unified KV cache of ``simple``)."""
    return min(ctx_needed(row, ns.pps, strategy_kv(split, ns.kv_unified), ns.ubatch_size)[0] for split in splits)


def rows_that_fit(ns, rows: list[dict], splits: list[str], n_ctx_train: int = 0) -> list[dict]:
    """The rows that fit the context, as llama-batched-bench runs them: a row whose N_KV (its
    n_ctx_req) exceeds the context is skipped (llama-batched-bench's usage line, ``-c 2048 -npl
    1,2,4,8,16,32``, has such rows). The context is ``-c``'s or, with ``-c 0`` (llama.cpp's
    "loaded from model"), the model's training context ``n_ctx_train`` (0: unknown, no limit);
    only with ``-c`` is the KV cache that size, so only then is a row also skipped whose
    sequences do not fit the streams of a split KV cache (each of B streams holds -c/B cells).
    One line on stderr names the skipped rows; when none is left, the first one's overflow is
    the UserError."""
    c = ns.ctx_size or n_ctx_train
    if not c:
        return rows
    # llama_n_ctx: the context padded as llama.cpp pads it (n_seq_max: the largest -npl value)
    limit = cache_capacity(c, max(r["pl"] for r in rows), ns.kv_unified)
    where = "the context" if ns.ctx_size else "the model's training context (-c 0)"
    skipped, first = [], None
    fits = []
    for r in rows:
        req = n_ctx_req(ns, r, splits)
        if req > limit:
            skipped.append(f"{row_label(r)} (N_KV {req})")
            first = first or (f"context overflow: {row_label(r)} needs {req} KV cells but {where} holds {limit}"
                              + ("" if ns.ctx_size else "; raise it with -c"))
        else:
            fits.append(r)
    if not ns.ctx_size:   # -c 0: the cache is sized for the rows that run (main())
        if not fits:
            raise UserError(first)
        if skipped:
            print(f"{PROG}: skipping {len(skipped)} row(s) that do not fit the model's training context "
                  f"({limit} cells; -c 0, as llama-batched-bench): {', '.join(skipped)}", file=sys.stderr, flush=True)
        return fits
    def layout_miss(r, n_seq):
        """(split, cells needed, cells held) when ``r`` does not fit ``n_seq`` streams, else None."""
        for split in splits:
            kvu = strategy_kv(split, ns.kv_unified)
            ours = ctx_needed(r, ns.pps, kvu, ns.ubatch_size, n_seq=n_seq, pads=False)[1]
            if ours > cache_capacity(c, n_seq, kvu):
                return split, kvu, ours
        return None

    # the cache has as many streams as the largest B it serves; fewer streams are larger, so
    # keep the stream count that lets the most rows run (ties: the larger B)
    best = []
    for n_seq in sorted({r["pl"] for r in fits}, reverse=True):
        kept = [r for r in fits if r["pl"] <= n_seq and layout_miss(r, n_seq) is None]
        if len(kept) > len(best):
            best = kept
    kept = best
    n_seq = max((r["pl"] for r in kept), default=max((r["pl"] for r in fits), default=1))
    for r in fits:
        if r in kept:
            continue
        n = max(n_seq, r["pl"])
        miss = layout_miss(r, n)
        if miss is None:   # it fits its own streams, but fewer rows fit those
            skipped.append(f"{row_label(r)} (its {n} streams would leave out more rows)")
            continue
        split, kvu, ours = miss
        skipped.append(f"{row_label(r)} (split '{split}' needs {ours} cells in {n} streams)")
        kv = "unified KV" if kvu else f"split KV, {n} streams of -c/{n} cells"
        first = first or (f"context overflow: split '{split}' ({kv}) needs {ours} KV cells but "
                          f"-c {c} holds {cache_capacity(c, n, kvu)}; raise -c (or 0: sized for the rows)")
    if not kept:
        raise UserError(first)
    if skipped:
        print(f"{PROG}: skipping {len(skipped)} row(s) that do not fit -c {c}: {', '.join(skipped)}",
              file=sys.stderr, flush=True)
    return kept


def run_row(runner: Runner, row: dict, pps: bool, tgs: bool = False) -> dict:
    """llama-batched-bench's body for one row on an empty cache; returns timings and counts.
    ``tgs`` (``-tgs``): the TG phase decodes sequence 0's tokens one per step, then sequence 1's,
    ... (B x TG steps of one token) instead of TG steps of one token per sequence."""
    lens = lens_of(row)
    pl, tg = row["pl"], row["tg"]
    runner.clear()
    batch = runner.prompt_batch([lens[0]] if pps else lens)
    with runner.timer() as t_pp:   # the timer waits for the device; steps do not (as llama.cpp's decode)
        st = runner.decode(batch, sync=False)
        if pps:
            for j in range(1, pl):
                runner.seq_cp(0, j)
    n_ub_tg = 0
    steps = [[j] for j in range(pl) for _ in range(tg)] if tgs else [list(range(pl))] * tg
    with runner.timer() as t_tg:
        for seqs in steps:
            n_ub_tg += runner.decode(runner.step_batch(seqs), sync=False).n_ubatches
    return dict(t_pp=t_pp.ns / 1e9, t_tg=t_tg.ns / 1e9, ub=st.n_ubatches, n_pad=st.n_pad, ub_tg=n_ub_tg,
                _shapes=st.shapes)


def main(argv=None) -> int:
    """Console-script entry: user mistakes -> one line on stderr and exit 2."""
    return console_main(PROG, multi_gpu.wrap(_main, __name__, build_parser), argv)


def _main(argv=None) -> int:
    ns = build_parser().parse_args(argv)
    ns.ubatch_size = effective_ubatch(ns.batch_size, ns.ubatch_size)
    check_threads(ns.threads)
    plot.check_plot_available(ns.plot)
    ngl = None if ns.n_gpu_layers is None else [ns.n_gpu_layers]
    device = resolve_ngl_device(ngl, ns.device)
    check_kernel(ns.kernel, ns.flash_attn != "off", device)
    model = resolve_run_model(ns.model, device, ns.n_layer)
    ns.layer = ns.layer or default_layer(model)
    check_ngl(ngl, model)
    say_synthetic_layers(PROG, [(model, ns.layer)])
    check_cache_types(ns.cache_type_k, ns.cache_type_v, device=device, flash_attn=ns.flash_attn != "off",
                      head_dim_k=model.head_dim_k, head_dim_v=model.head_dim_v, kernel=ns.kernel, n_gpu=multi_gpu.n_gpu())
    rows = rows_of(ns)
    splits = splits_of(ns.split, ns.kv_unified)
    if ns.pps and (ns.prompt_lens is not None or ns.prompt_dist is not None):
        raise UserError("-pps shares one prompt; it cannot be combined with ragged prompts")
    n_seq_max = max(r["pl"] for r in rows)   # llama-batched-bench's context serves the largest -npl
    rows = rows_that_fit(ns, rows, splits, model.n_ctx_train)
    note_cpu_fallback(ngl, device, PROG)
    n_seq = max(r["pl"] for r in rows)
    # size the caches once, for the largest row of every strategy; -c is a hard limit (a padded
    # ubatch whose pads do not fit it runs as equal: graph.driver), 0 leaves room for the pads
    cells = {}
    for split in splits:
        kvu = strategy_kv(split, ns.kv_unified)
        need = max(ctx_needed(r, ns.pps, kvu, ns.ubatch_size, n_seq=n_seq,
                              pads=split in ("padded", "auto"))[1] for r in rows)
        cells[split] = ns.ctx_size or need  # an explicit -c is what the cache gets

    runners: dict = {}
    noted = []
    configs = {split: RunConfig(   # every check (the model file's too), before any output
        model, n_ctx=cells[split], n_seq=n_seq, kv_unified=strategy_kv(split, ns.kv_unified),
        split=split, n_batch=ns.batch_size, n_ubatch=ns.ubatch_size,
        flash_attn=ns.flash_attn != "off", kernel=ns.kernel, layer=ns.layer, device=device,
        n_threads=ns.threads, seed=ns.seed, type_k=ns.cache_type_k, type_v=ns.cache_type_v,
        cuda_graph=ns.cuda_graph == "on", tp=multi_gpu.current()) for split in splits}

    def make(split):
        return Runner(configs[split])

    def runner_for(split, row=None):
        """The split's runner (cache, weights, engine), kept for the next rows. When it does not
        fit beside the other splits' runners, those are closed and it is made alone (then warmed
        up as the first ones were): each split's runner is made again when its turn comes."""
        if split not in runners:
            try:
                runners[split] = make(split)
            except OutOfMemory:
                if not runners:
                    raise
                if not noted:
                    noted.append(split)
                    print(f"{PROG}: note: the splits' runners do not fit in memory together; each is made "
                          f"alone when its turn comes (slower, same measurements)", file=sys.stderr)
                for r in runners.values():
                    r.close()
                runners.clear()
                free_device_memory(device)
                runners[split] = make(split)
                runners[split].warm_up()
        return runners[split]

    try:
        if ns.plan:
            print_plans(ns, runner_for, rows, splits, SafeWriter(sys.stdout))
            return 0
        return _run(ns, rows, splits, runner_for, model, device, cells, n_seq_max)
    finally:
        for r in runners.values():
            r.close()


def _run(ns, rows, splits, runner_for, model, device, cells, n_seq_max: int) -> int:
    kvus = {strategy_kv(split, ns.kv_unified) for split in splits}
    # n_kv_max: llama_n_ctx, -c's or (-c 0) the model's training context; the cache may hold less
    c = ns.ctx_size or model.n_ctx_train
    info = dict(n_kv_max=cache_capacity(c, n_seq_max, ns.kv_unified) if c else max(cells.values()),
                n_batch=ns.batch_size,
                n_ubatch=ns.ubatch_size, flash_attn=FA_INT[ns.flash_attn], is_pp_shared=int(ns.pps),
                is_tg_separate=int(ns.tgs), n_gpu_layers=ngl_field(ns.n_gpu_layers),
                n_threads=ns.threads,
                kv_cells=max(cache_capacity(n, max(r["pl"] for r in rows), strategy_kv(s, ns.kv_unified))
                             for s, n in cells.items()),
                n_threads_batch=ns.threads, kv_unified=kvus.pop() if len(kvus) == 1 else None, model=model.name,
                device=device + ("+graphs" if device == "cuda" and ns.cuda_graph == "on" else ""),
                kernel=ns.kernel, layer=ns.layer, type_k=ns.cache_type_k, type_v=ns.cache_type_v,
                path=attention_path(device, ns.flash_attn, ns.kernel))
    reps = ns.repetitions
    info["repetitions"] = reps
    total = len(rows) * len(splits)
    bar = ProgressBar(total * reps, PROG, enabled=False if ns.progress else None)
    printer = fb.make_printer(ns.output, SafeWriter(bar.writer(sys.stdout)), info)
    progress = Progress(PROG, ns.progress, total)
    verbose = Verbose(PROG, ns.verbose)
    results = []
    printer.header()
    idx = 0
    try:
        for split in splits:  # warm up every strategy once (Runner.warm_up)
            r = runner_for(split)
            verbose.runner(r)
            r.warm_up()
        for row in rows:
            for split in splits:  # side by side: every strategy on the same batch
                idx += 1
                what = f"{row_label(row)} split={split}"
                progress(idx, f"starting {what}")
                runner = runner_for(split)
                for _ in range(runner.runs_to_steady(decode_step=False) if ns.warmup else 0):
                    progress(idx, f"warm-up run of {what}")
                    run_row(runner, row, ns.pps, ns.tgs)
                samples = []
                for _ in range(reps):
                    samples.append(run_row(runner, row, ns.pps, ns.tgs))
                    bar.update(what)
                verbose.shapes(f"{what}: prompt", samples[0].pop("_shapes"))
                res = dict(samples[0], t_pp_samples=[x["t_pp"] for x in samples],
                           t_tg_samples=[x["t_tg"] for x in samples])
                out = dict(pp=row["pp"], tg=row["tg"], pl=row["pl"], is_pp_shared=int(ns.pps),
                           is_tg_separate=int(ns.tgs),
                           split=split, kv_unified=runner.cfg.kv_unified, model=model.name,
                           device=device, path=info["path"], kernel=ns.kernel, layer=ns.layer,
                           repetitions=reps, **res)
                if row["prompt_lens"]:
                    out["prompt_lens"] = list(row["prompt_lens"])
                fb.finish_row(out)
                printer.row(out)
                results.append(out)
    finally:
        bar.close()
        printer.footer()
    if ns.plot and results and getattr(multi_gpu.current(), "rank", 0) == 0:   # -sm row: rank 0 draws
        plot.write(PROG, ns.plot, plot.draw_plot, results,
                   f"{model.name}, {device}, --layer {ns.layer}, kernel {ns.kernel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
