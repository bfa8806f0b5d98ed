"""``ggml-attn-serve-bench``: requests that arrive over time, served by an engine loop that
mixes prompt tokens with decode steps, for each way of forming ubatches; throughput against
time to first token (TTFT) and inter-token latency (ITL).

Each step of the loop (``ggml_attn.graph.serve``) is one batch: a decode token of every
generating request, then prompt tokens of admitted requests up to ``--prompt-budget`` (a step
never past ``-b`` tokens: llama-server's rule; 0 = whole prompts). The batch goes through the
split strategy (``--split``), the KV cache (unified or per-stream, ``-kvu``), the plan and the
graph -- the path of every batch here -- and the next token of every request that asked for one
is its argmax (a ``.gguf``'s own logits) or, on a preset (shapes, random weights), a made-up id.
Requests arrive from ``--trace FILE.jsonl`` or as a Poisson process (``--rate``, a list sweeps
it); a request longer than a sequence's cells is refused with a note and the others go on::

    ggml-attn-serve-bench --rate 4,16,inf --split all
    ggml-attn-serve-bench -m model.gguf --trace bench/traces/sample.jsonl -np 64 -kvu --plot serve.png
"""
from __future__ import annotations

import copy
import math
import sys
from contextlib import nullcontext

import numpy as np

from ggml_attn.graph.batch import MAX_SEQ

from . import format_serve as fs
from . import plot
from .args import (LLAMA_BATCHED_INERT, add_inert_flags, add_kv_split_flags, add_list, add_version, int_at_least,
                   int_range, parse_fa_one, Parser)
from .given import StoreGiven
from .batched_rows import strategy_kv
from .common import Progress, console_main, default_threads
from .errors import UserError
from .format_bench import attention_path
from .kv_types import CACHE_TYPES, GPU_TYPES, check_cache_types
from .models import (DEFAULT_CPU_MODEL, DEFAULT_GPU_MODEL, PRESETS, default_layer, resolve_run_model,
                     say_synthetic_layers)
from .output import SafeWriter, save_error
from .progress import ProgressBar
from .placement import check_ngl, note_cpu_fallback, parse_one_ngl, resolve_ngl_device
from .runner import (DEVICES, KERNELS, LAYERS, SPLITS, RunConfig, Runner, check_kernel, check_threads,
                     effective_ubatch, free_device_memory, kernel_help, splits_of)
from .serve_trace import parse_dist, parse_rates, prompt_tokens, synth_trace, load_trace, write_trace
from .verbose import Verbose

PROG = "ggml-attn-serve-bench"
DEFAULT_SLOTS = 64


def build_parser() -> Parser:
    p = Parser(prog=PROG, description=(
        "Serve requests that arrive over time (a trace or Poisson arrivals) with an engine loop "
        "that mixes prompt tokens with decode steps, for each ubatch split strategy and KV mode; "
        "report throughput, time to first token and inter-token latency. Lists take commas."))
    p.add_argument("-m", "--model", type=str, default="auto", metavar="NAME|FILE.gguf",
                   help=f"model preset ({', '.join(PRESETS)}) or a .gguf (its own weights: greedy tokens "
                        f"from its logits); auto: {DEFAULT_CPU_MODEL} on the CPU, {DEFAULT_GPU_MODEL} on a "
                        f"GPU (default: auto)")
    p.add_argument("--trace", metavar="FILE.jsonl", default=None,
                   help="requests from a JSON-lines trace (arrival s, prompt_len or prompt ids, n_predict; "
                        "bench/traces/sample.jsonl is one); replaces --rate and the length ranges")
    add_list(p, "--rate", type=parse_rates, default=[], metavar="R",
             help="Poisson arrivals, requests per second; a list sweeps it (e.g. 2,4,8,16); inf: "
                  "all requests at once (default: 8,inf)")
    p.add_argument("-n", "--n-requests", type=int_at_least(1, hi=100000), default=64, metavar="N",
                   action=StoreGiven,
                   help="requests of a --rate workload (default: 64)")
    p.add_argument("--prompt-dist", type=lambda t: parse_dist(t, "--prompt-dist"), default=(16, 200),
                   action=StoreGiven,
                   metavar="MIN-MAX", help="prompt tokens of a --rate workload, uniform (default: 16-200)")
    p.add_argument("--gen-dist", type=lambda t: parse_dist(t, "--gen-dist"), default=(32, 256),
                   action=StoreGiven,
                   metavar="MIN-MAX", help="generated tokens per request, uniform (default: 32-256)")
    p.add_argument("-s", "--seed", type=int_at_least(0), default=0,
                   help="seed of the arrivals, lengths, made-up token ids and inputs (default: 0)")
    p.add_argument("-np", "--parallel", "--max-concurrent", dest="max_concurrent", type=int_at_least(0, hi=MAX_SEQ),
                   default=0, metavar="N",
                   help=f"requests served at once (llama-server's -np slots: sequence ids); 0: "
                        f"min(requests, {DEFAULT_SLOTS}) (default: 0)")
    add_list(p, "--prompt-budget", type=int_range(), default=[], metavar="N",
             help="prompt tokens a step may carry after its decode tokens, a list; a step never "
                  "exceeds -b tokens in all; 0: whole prompts, every admitted prompt in the next step "
                  "(cut into -b pieces as llama_decode cuts a batch) (default: -b, llama-server's rule)")
    add_kv_split_flags(p, SPLITS)
    p.add_argument("--kernel", choices=KERNELS, default="auto", help=kernel_help() + " (default: auto)")
    p.add_argument("--layer", choices=LAYERS, default=None,
                   help="attn: attention only; full: with projections and FFN (random weights); model: a "
                        ".gguf's own weights (default: model with -m FILE.gguf, else attn)")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="auto (GPU when usable), cpu or cuda (default: auto)")
    p.add_argument("-ngl", "--n-gpu-layers", type=parse_one_ngl, default=None, metavar="N",
                   help="llama.cpp's GPU layers: 0 runs the CPU path, N >= the model's layers (e.g. 99; auto, "
                        "all, -1) all layers on the GPU; a partial offload is an error (default: per --device)")
    p.add_argument("--cuda-graph", choices=("on", "off"), default="on",
                   help="on the GPU, replay repeated step shapes as CUDA graphs (default: on)")
    p.add_argument("-fa", "--flash-attn", type=parse_fa_one, default="auto", metavar="on|off|auto",
                   help="on/auto: ggml_attn.flash_attn_ext; off: ggml's mul_mat+soft_max (default: auto)")
    p.add_argument("-c", "--ctx-size", type=int_at_least(0, " (0: sized automatically)"), default=0, metavar="N",
                   help="KV cells in all (per-stream: -c / -np per sequence); 0: room for -np of the "
                        "longest request (default: 0)")
    p.add_argument("-b", "--batch-size", type=int_at_least(1), default=2048, metavar="N",
                   help="logical batch size: tokens of a step at most (default: 2048)")
    p.add_argument("-ub", "--ubatch-size", type=int_at_least(1), default=512, metavar="N",
                   help="physical batch size (default: 512)")
    p.add_argument("-ctk", "--cache-type-k", choices=CACHE_TYPES, default="f16", metavar="TYPE",
                   help=f"K cache type: {'|'.join(CACHE_TYPES)}; {', '.join(GPU_TYPES)} on the GPU "
                        f"(default: f16)")
    p.add_argument("-ctv", "--cache-type-v", choices=CACHE_TYPES, default="f16", metavar="TYPE",
                   help="V cache type, as -ctk (default: f16)")
    p.add_argument("-t", "--threads", type=int_at_least(1), default=default_threads(), metavar="N",
                   help=f"CPU threads (default: {default_threads()})")
    p.add_argument("--n-layer", type=int_at_least(0, " (0: the model's own)"), default=0, metavar="N",
                   help="override the model's number of layers")
    p.add_argument("-r", "--repetitions", type=int_at_least(1, hi=1000), default=1, metavar="N",
                   help="serve the trace N times per row; latencies pooled, rates averaged (default: 1)")
    p.add_argument("--warmup", action="store_true",
                   help="serve each row's trace untimed first until its step shapes are built and captured, "
                        "as in a server that has seen such traffic (on a GPU twice: a prompt shape is captured "
                        "at its second run); default: one short warm-up per strategy")
    p.add_argument("-o", "--output", "--output-format", choices=fs.FORMATS, default="md",
                   help="output format on stdout: md, csv, json or jsonl (default: md)")
    p.add_argument("--plot", metavar="OUT.png", default=None,
                   help="draw ITL p99 against output tokens/s per strategy into OUT.png, a point per "
                        "rate (needs matplotlib)")
    p.add_argument("--save-trace", metavar="FILE.jsonl", default=None,
                   help="write the requests of each rate (a --rate workload) to FILE.jsonl (FILE-RATE.jsonl "
                        "for several rates), to replay them elsewhere (tools/dev/llamaserver_side_by_side.py)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="describe each strategy's model, KV cache and batch sizes on stderr")
    p.add_argument("--progress", action="store_true",
                   help="print a line per row on stderr (without it a progress bar shows when stderr "
                        "is a terminal)")
    p.epilog = fs.TERMS
    add_inert_flags(p, [t for t in LLAMA_BATCHED_INERT if "-np" not in t[0]] +   # (-np: the slots here)
                    [(("-cb", "--cont-batching"), "requests join and leave the running batch here always", 0)])
    add_version(p)
    return p



def workloads(ns) -> list[tuple[float | None, list]]:
    """``[(rate or None for a trace file, [TraceRequest])]``."""
    if ns.trace is not None:
        if ns.rate:
            raise UserError("--trace gives the arrival times; --rate is for a synthetic workload, not both")
        synthetic = [f for f, dest in (("-n", "n_requests"), ("--prompt-dist", "prompt_dist"),
                                       ("--gen-dist", "gen_dist")) if dest in ns.explicit]
        if synthetic:   # (they were ignored: the trace ran as it is)
            raise UserError(f"--trace gives the requests and their lengths; {', '.join(synthetic)} "
                            f"{'is' if len(synthetic) == 1 else 'are'} for a --rate workload, not both")
        return [(None, load_trace(ns.trace))]
    rates = ns.rate or [8.0, math.inf]
    return [(rate, synth_trace(rate, ns.n_requests, ns.prompt_dist, ns.gen_dist, ns.seed)) for rate in rates]


def save_traces(path: str, loads) -> None:
    for rate, reqs in loads:
        out = path
        if len(loads) > 1:
            stem, dot, ext = path.rpartition(".")
            tag = "inf" if math.isinf(rate) else f"{rate:g}"
            out = f"{stem}-{tag}.{ext}" if dot else f"{path}-{tag}"
        try:
            write_trace(out, reqs)
        except OSError as e:
            raise save_error(out, e, "--save-trace") from None
        print(f"{PROG}: wrote {out}", file=sys.stderr)


def make_step_fn(runner: Runner, model_logits: bool, n_vocab: int):
    """``graph.serve``'s step function on ``runner``: the step's batch through ``Runner.decode``,
    then every flagged token's next id -- the argmax of its logits (on the engine's stream, only
    the ids copied back) or, without logits (a preset), a made-up id -- and the step's counts
    (ubatches, pad rows, graphs the engine built)."""
    engine = runner.engine
    stream = getattr(engine, "stream", None)
    xp = runner.cache.xp

    def counts(st, built0):
        return dict(ubatches=st.n_ubatches, pads=st.n_pad, builds=getattr(engine, "builds", 0) - built0)

    def step_fn(step):
        want, b = step.want, step.batch
        built0 = getattr(engine, "builds", 0)
        if not model_logits:   # a preset: any id in the vocabulary (attention does not read it)
            st = runner.decode(b, logits=want)
            out = (b.tokens[want].astype(np.int64) * 31 + b.positions[want] + 7) % n_vocab
            return out, counts(st, built0)
        where = np.full(want.size, -1, dtype=np.int64)
        where[want] = np.arange(int(want.sum()))
        got = []

        def on_logits(idx, logits):
            with stream if stream is not None else nullcontext():
                got.append((where[idx], xp.argmax(logits, axis=1)))

        st = runner.decode(b, logits=want, on_logits=on_logits)
        out = np.zeros(int(want.sum()), dtype=np.int64)
        for rows, ids in got:
            out[rows] = ids if xp is np else xp.asnumpy(ids)
        return out, counts(st, built0)

    return step_fn


def main(argv=None) -> int:
    """Console-script entry: user mistakes -> one line on stderr and exit 2."""
    return console_main(PROG, _main, argv)


def _main(argv=None) -> int:
    from ggml_attn.graph.kv_cache import KV_PAD, pad_to
    from ggml_attn.graph.serve import ServeRequest, cells_needed
    from .serve_trace import SYNTH_VOCAB

    ns = build_parser().parse_args(argv)
    ns.ubatch_size = effective_ubatch(ns.batch_size, ns.ubatch_size)
    check_threads(ns.threads)
    plot.check_plot_available(ns.plot)
    ngl = None if ns.n_gpu_layers is None else [ns.n_gpu_layers]
    device = resolve_ngl_device(ngl, ns.device)
    check_kernel(ns.kernel, ns.flash_attn != "off", device)
    model = resolve_run_model(ns.model, device, ns.n_layer)
    check_ngl(ngl, model)
    ns.layer = ns.layer or default_layer(model)
    check_cache_types(ns.cache_type_k, ns.cache_type_v, device=device, flash_attn=ns.flash_attn != "off",
                      head_dim_k=model.head_dim_k, head_dim_v=model.head_dim_v, kernel=ns.kernel)
    say_synthetic_layers(PROG, [(model, ns.layer)])
    note_cpu_fallback(ngl, device, PROG)
    budgets = list(dict.fromkeys(ns.prompt_budget or [ns.batch_size]))
    loads = workloads(ns)
    if ns.save_trace is not None:
        if not ns.save_trace.strip():
            raise UserError("--save-trace needs a file name (FILE.jsonl)")
        if ns.trace is not None:
            raise UserError("--save-trace writes a --rate workload's requests; --trace is a file already")
        save_traces(ns.save_trace, loads)
    model_logits = ns.layer == "model"
    n_vocab = model.n_vocab if model_logits else SYNTH_VOCAB
    n_req_max = max(len(reqs) for _, reqs in loads)
    n_slots = ns.max_concurrent or min(n_req_max, DEFAULT_SLOTS)
    longest = max(cells_needed(r.prompt_len, r.n_predict) for _, reqs in loads for r in reqs)
    past = max(sum(cells_needed(r.prompt_len, r.n_predict) > model.n_ctx_train for r in reqs)
               for _, reqs in loads) if model.n_ctx_train else 0
    if past:   # (bench says so too, and runs them)
        print(f"{PROG}: {past} request(s) need more positions than the model's training context "
              f"({model.n_ctx_train}; the longest {longest}), served as asked", file=sys.stderr, flush=True)
    # 0: room for n_slots of the longest request in every layout (a stream holds one sequence),
    # plus one ubatch of pad rows on a unified cache
    n_ctx = ns.ctx_size or n_slots * pad_to(longest, KV_PAD) + ns.ubatch_size
    splits = splits_of(ns.split, ns.kv_unified)
    path = attention_path(device, ns.flash_attn, ns.kernel)
    configs = {split: RunConfig(   # every check (the model file's too), before any output
        model, n_ctx=n_ctx, n_seq=n_slots, kv_unified=strategy_kv(split, ns.kv_unified), split=split,
        n_batch=ns.batch_size, n_ubatch=ns.ubatch_size, flash_attn=ns.flash_attn != "off", kernel=ns.kernel,
        layer=ns.layer, device=device, n_threads=ns.threads, seed=ns.seed, type_k=ns.cache_type_k,
        type_v=ns.cache_type_v, cuda_graph=ns.cuda_graph == "on") for split in splits}

    def prompt(i, r):   # a request longer than the whole cache is refused in every layout: its ids are never read
        if cells_needed(r.prompt_len, r.n_predict) > n_ctx and r.prompt is None:
            return np.broadcast_to(np.int32(0), (r.prompt_len,))
        return prompt_tokens(i, r, n_vocab, ns.seed)
    # the requests of every workload, token ids made once (the same for every strategy)
    served = [(rate, [ServeRequest(i, r.arrival, prompt(i, r), r.n_predict) for i, r in enumerate(reqs)])
              for rate, reqs in loads]
    runners: dict = {}
    try:
        return _run(ns, served, splits, budgets, configs, runners, n_slots, n_vocab, model, device, path)
    finally:
        for r in runners.values():
            r.close()


def _run(ns, served, splits, budgets, configs, runners, n_slots, n_vocab, model, device, path) -> int:
    from ggml_attn.graph.serve import Scheduler, serve

    verbose = Verbose(PROG, ns.verbose)
    rows_total = len(served) * len(budgets) * len(splits)
    reps = ns.repetitions + int(ns.warmup)
    bar = ProgressBar(sum(len(reqs) for _, reqs in served) * len(budgets) * len(splits) * reps, PROG,
                      enabled=False if ns.progress else None, unit="req")
    printer = fs.make_printer(ns.output, SafeWriter(bar.writer(sys.stdout)), ns.repetitions)
    progress = Progress(PROG, ns.progress, rows_total)
    results = []
    printer.header()
    idx = 0
    empty_rows = 0   # rows whose every request was refused
    try:
        # one strategy's runner at a time (its KV cache, kept graphs and their CUDA graphs; with
        # the five of an 8B F16 model and 16 slots kept together a graph launch ran out of memory
        # on an 80 GB H100): every row of a strategy, then the next
        for split in splits:
            runner = runners[split] = Runner(configs[split])
            step_fn = make_step_fn(runner, ns.layer == "model", n_vocab)
            verbose.runner(runner)
            runner.warm_up()
            warm = runner.runs_to_steady(decode_step=False) if ns.warmup else 0   # untimed passes of a row
            bar.add((warm - int(ns.warmup)) * sum(len(reqs) for _, reqs in served) * len(budgets))
            for rate, reqs in served:
                for budget in budgets:
                    idx += 1
                    kvu = runner.cfg.kv_unified
                    what = (f"rate {'trace' if rate is None else f'{rate:g}'} split {split} kvu {int(kvu)} "
                            f"budget {budget or 'whole'}")
                    progress(idx, f"starting {what}")
                    runs = []
                    for rep in range(warm + ns.repetitions):
                        runner.clear()
                        sched = Scheduler(runner.cache, n_slots, n_batch=ns.batch_size, prompt_budget=budget,
                                          pos_limit=runner.attn_config().pos_limit)
                        refused = []
                        stats = serve(reqs, sched, step_fn, on_finish=lambda r: bar.update(what),
                                      on_refuse=lambda r: (refused.append(r), bar.update(what)))
                        if len(refused) == len(reqs) and rep == 0:
                            empty_rows += 1
                        if refused and rep == 0:
                            which = (f"all {len(reqs)} request(s) refused" if len(refused) == len(reqs) else
                                     f"{len(refused)} of {len(reqs)} request(s) refused, the others served")
                            print(f"{PROG}: {what}: {which}: {refused[0].refused}" +
                                  (" (and more)" if len(refused) > 1 else ""), file=sys.stderr, flush=True)
                        if rep < warm:
                            continue
                        runs.append(dict(requests=[copy.copy(r) for r in reqs], stats=stats))
                    row = fs.row_of(runs, dict(
                        rate=rate, split=split, kv_unified=kvu, prompt_budget=budget, n_slots=n_slots,
                        n_requests=len(reqs), model=model.name, device=device, path=path, layer=ns.layer,
                        kernel=ns.kernel, n_ctx=runner.cache.kv_size * runner.cache.n_stream,   # (the cells made)
                        n_batch=ns.batch_size, n_ubatch=ns.ubatch_size,
                        type_k=ns.cache_type_k, type_v=ns.cache_type_v, trace=ns.trace,
                        prompt_dist=None if ns.trace else "-".join(map(str, ns.prompt_dist)),
                        gen_dist=None if ns.trace else "-".join(map(str, ns.gen_dist)),
                        seed=ns.seed, n_threads=ns.threads, flash_attn=ns.flash_attn,
                        cuda_graph=ns.cuda_graph == "on", warmup=ns.warmup))
                    printer.row(row)
                    results.append(row)
            runners.pop(split).close()
            free_device_memory(device)
    finally:
        bar.close()
        printer.footer()
    for line in fs.summary(results):   # (stderr: the table's formats stay as they are)
        print(f"{PROG}: {line}", file=sys.stderr)
    if ns.plot and results:
        plot.write(PROG, ns.plot, plot.draw_serve_plot, results,
                   f"{model.name}, {device}, --layer {ns.layer}, {n_slots} slots")
    if empty_rows:   # nothing measured there: not a success (the refusals' reason is said above)
        print(f"{PROG}: error: {empty_rows} of {len(results)} row(s) served no request: every one was refused",
              file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
