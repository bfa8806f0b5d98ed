"""``ggml-attn-bench``: llama-bench for ggml-attn's attention stack.

Same flags, defaults, test names and output formats as llama-bench (``-p``, ``-n``,
``-pg``, ``-d``, ``-b``, ``-ub``, ``-fa``, ``-r``, ``-o``, ``--progress``,
``--no-warmup``), on a model *shape* (a preset or a ``.gguf`` header) instead of a model:
every test runs the layers' attention (``--layer attn``) or whole blocks with random
weights (``--layer full``) through the graph builder. Ours on top: ``-kvu``, ``--split``,
``--kernel``, ``--device``, ``--layer``.

With no arguments and no GPU it benchmarks the ``tiny`` preset on the CPU (pp512, tg128,
5 repetitions), in well under a minute on two cores.
"""
from __future__ import annotations

import datetime
import sys

from . import format_bench as fmt
from .args import (INT32_MAX, LLAMA_BENCH_INERT, add_inert_flags, add_list, add_list_devices, add_version,
                   choice_list, combinations, int_at_least, parse_bool_list, parse_fa, parse_int_range,
                   parse_pair_list, Parser, str_list)
from .common import (Progress, build_info, console_main, cpu_info, default_threads, gpu_info,
                     interruptible_sleep)
from . import multi_gpu
from .errors import UserError
from .kv_types import CACHE_TYPES, GPU_TYPES, check_cache_types
from .output import SafeWriter
from .progress import ProgressBar
from .verbose import Verbose
from .placement import check_ngl, ngl_field, ngl_text, note_cpu_fallback, parse_ngl, resolve_ngl_device
from .models import (DEFAULT_CPU_MODEL, DEFAULT_GPU_MODEL, PRESETS, default_layer, resolve, say_synthetic_layers,
                     with_layers)
from .runner import (DEVICES, KERNELS, LAYERS, SPLITS, RunConfig, Runner,
                     check_context, check_kernel, check_threads, default_split, effective_ubatch,
                     kernel_help)

PROG = "ggml-attn-bench"
def build_parser() -> Parser:
    p = Parser(prog=PROG, description=(
        "Benchmark batched attention like llama-bench: prompt processing (pp), token generation "
        "(tg) and both (pp+tg) on a model shape. List flags take comma lists and ranges "
        "(a-b, a-b+s, a-b*m) and may be repeated; one test per combination."))
    add_list(p, "-m", "--model", type=str_list, default=["auto"], metavar="NAME|FILE.gguf",
             help=f"model preset ({', '.join(PRESETS)}) or a .gguf whose header gives the shapes; "
                  f"auto: {DEFAULT_CPU_MODEL} on the CPU, {DEFAULT_GPU_MODEL} on a GPU")
    add_list(p, "-p", "--n-prompt", type=parse_int_range, default=[512], metavar="N",
             help="prompt tokens of a pp test (0: none)")
    add_list(p, "-n", "--n-gen", type=parse_int_range, default=[128], metavar="N",
             help="generated tokens of a tg test, one decode step each (0: none)")
    add_list(p, "-pg", type=parse_pair_list, default=[], metavar="PP,TG",
             help="a pp+tg test: PP prompt tokens then TG generated tokens, timed together")
    add_list(p, "-d", "--n-depth", type=parse_int_range, default=[0], metavar="N",
             help="tokens already in the KV cache before each test (untimed)")
    add_list(p, "-b", "--batch-size", type=parse_int_range, default=[2048], metavar="N",
             help="logical batch size: tokens per decode call")
    add_list(p, "-ub", "--ubatch-size", type=parse_int_range, default=[512], metavar="N",
             help="physical batch size: rows per graph evaluation")
    add_list(p, "-fa", "--flash-attn", type=parse_fa, default=["auto"], metavar="on|off|auto",
             help="on: ggml_attn.flash_attn_ext; off: ggml's mul_mat+soft_max path; auto: on")
    add_list(p, "-kvu", "--kv-unified", type=parse_bool_list, default=[False], metavar="0|1",
             help="one KV buffer for all sequences (1; bare -kvu means 1) or one stream per "
                  "sequence (0)", nargs="?", const=[True])
    add_list(p, "--split", type=choice_list(SPLITS), default=[""], metavar="MODE",
             help="ubatch split: simple|equal|seq|padded|auto; default: simple with -kvu 1, "
                  "equal without (as llama.cpp)")
    add_list(p, "--kernel", type=choice_list(KERNELS), default=["auto"], metavar="KERNEL", help=kernel_help())
    add_list(p, "--layer", type=choice_list(LAYERS), default=[], metavar="attn|full|model",
             help="attn: attention only; full: with QKV/O projections and FFN (random weights of the "
                  "shape); model: a .gguf's own weights, token ids to logits (default: model with "
                  "-m FILE.gguf, else attn)")
    add_list(p, "-ctk", "--cache-type-k", type=choice_list(CACHE_TYPES), default=["f16"], metavar="TYPE",
             help=f"K cache type: {'|'.join(CACHE_TYPES)}; all on the CPU path, {', '.join(GPU_TYPES)} on the GPU")
    add_list(p, "-ctv", "--cache-type-v", type=choice_list(CACHE_TYPES), default=["f16"], metavar="TYPE",
             help="V cache type, as -ctk; a quantized V needs flash attention (as llama.cpp)")
    add_list(p, "-ngl", "--n-gpu-layers", type=parse_ngl, default=[], metavar="N",
             help="llama-bench's GPU layers: 0 runs the CPU path, N >= the model's layers (e.g. 99; -1, "
                  "auto, all) all layers on the GPU; a partial offload is an error; a list (0,99) runs a "
                  "row per value (default: per --device)")
    add_list(p, "-t", "--threads", type=parse_int_range, default=[default_threads()], metavar="N",
             help="CPU threads")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where to run: auto (GPU when usable), cpu or cuda (default: auto)")
    p.add_argument("--cuda-graph", choices=("on", "off"), default="on",
                   help="on the GPU, capture a ubatch's launches as a CUDA graph the second time its "
                        "shape comes and replay it after (backends column: CUDA+graphs); off: every "
                        "ubatch through ggml's graph loop and the op's callbacks (default: on)")
    p.add_argument("--n-layer", type=int_at_least(0, " (0: the model's own)"), default=0, metavar="N",
                   help="override the model's number of layers (quick runs of big shapes)")
    p.add_argument("-c", "--ctx-size", type=int_at_least(0, " (0: none)"), default=0, metavar="N",
                   help="context limit per test (not a llama-bench flag: its context is p + n + d); 0: none, "
                        "tests past the model's training context said once and run (default: 0)")
    p.add_argument("-r", "--repetitions", type=int_at_least(1, hi=INT32_MAX), default=5, metavar="N",
                   help="times to repeat each test (default: 5)")
    p.add_argument("-o", "--output", "--output-format", choices=fmt.FORMATS, default="md",
                   help="output format printed to stdout (default: md)")
    p.add_argument("-oe", "--output-err", choices=fmt.FORMATS + ("none",), default="none",
                   help="a second output format printed to stderr (default: none)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="describe each run on stderr: model shape, KV cache, ubatch shapes")
    p.add_argument("--delay", type=int_at_least(0, hi=86400), default=0, metavar="S",
                   help="seconds to wait before each test, e.g. to let a GPU cool; at most 86400 (default: 0)")
    p.add_argument("--progress", action="store_true",
                   help="print llama-bench's progress lines on stderr (without it a progress bar "
                        "shows when stderr is a terminal)")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the untimed warm-up runs before each test (a repetition's work until it runs "
                        "as the next will: on a GPU its prompt twice)")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="seed of the random inputs (default: 0)")
    p.add_argument("--list-models", action="store_true", help="list the model presets and exit")
    multi_gpu.add_args(p, add_list)
    add_list_devices(p)
    add_inert_flags(p, LLAMA_BENCH_INERT)
    add_version(p)
    return p


def tests_of(ns) -> list[tuple[int, int]]:
    """(n_prompt, n_gen) per test in llama-bench's order: pp tests, tg tests, pg pairs."""
    out = [(p, 0) for p in ns.n_prompt if p > 0]
    out += [(0, n) for n in ns.n_gen if n > 0]
    out += [(pp, tg) for pp, tg in ns.pg if pp or tg]
    return out


def optional_columns(ns, insts: list[dict] | None = None) -> list[str]:
    """Markdown columns to show: flags with several or non-default values (llama-bench's rule),
    and a layer column when the rows' layers differ (a .gguf and a preset)."""
    defaults = {"n_batch": ("batch_size", [2048]), "n_ubatch": ("ubatch_size", [512]),
                "flash_attn": ("flash_attn", ["auto"]), "kernel": ("kernel", ["auto"]),
                "type_k": ("cache_type_k", ["f16"]), "type_v": ("cache_type_v", ["f16"]),
                "n_threads": ("threads", [default_threads()]), "kv_unified": ("kv_unified", [False]),
                "split": ("split", [""]), "layer": ("layer", [])}
    cols = [col for col, (dest, dflt) in defaults.items() if getattr(ns, dest) != dflt]
    if len({inst["layer"] for inst in insts or ()}) > 1 and "layer" not in cols:
        cols.append("layer")
    if len(set(ns.n_gpu_layers)) > 1:
        cols.append("n_gpu_layers")
    if ns.tensor_split:
        cols.append("tensor_split")
    return cols


def md_columns(ns, insts, backend: str) -> list[str]:
    """The markdown columns of this run (see format_bench.markdown_columns)."""
    weights = any(inst["layer"] in ("full", "model") for inst in insts)
    n_layer = any(inst["model"].n_layer != _own_layers(inst["model"]) for inst in insts)
    return fmt.markdown_columns(backend, optional_columns(ns, insts), weights=weights, n_layer=n_layer)


def _own_layers(model) -> int:
    """Layers of the preset or .gguf the shape came from (before --n-layer)."""
    return resolve(model.source if model.source != "preset" else model.name).n_layer


def ngl_devices(ns) -> dict:
    """The device of each ``-ngl`` value (None: not given): 0 the CPU path, N at least the
    model's layers the GPU (the CPU when there is none, :func:`placement.note_cpu_fallback`),
    as llama-bench's -ngl 0,99 sweep; a test runs on one device, so a partial offload is refused
    (:func:`placement.check_ngl`)."""
    return {n: resolve_ngl_device(None if n is None else [n], ns.device) for n in ns.n_gpu_layers or [None]}


def instances(ns, devices: dict) -> list[dict]:
    """The tests in llama-bench's order: one per combination of the flags' values (``devices``:
    :func:`ngl_devices`) and test (:func:`tests_of`), each checked (UserError)."""
    models = []
    for name in ns.model:
        if name == "auto":   # the GPU's default model when any -ngl value runs there
            name = DEFAULT_GPU_MODEL if "cuda" in devices.values() else DEFAULT_CPU_MODEL
        models.append(with_layers(resolve(name), ns.n_layer))
    # llama-bench's nesting (get_cmd_params_instances: model, n_gpu_layers, tensor_split, n_batch,
    # n_ubatch, type_k, type_v, flash_attn, n_threads, n_depth); ours: layer with the model, the
    # attention's settings after flash_attn
    params = combinations({
        "model": models, "layer": ns.layer or [None], "n_gpu_layers": list(devices),
        "tensor_split": ns.tensor_split or [()], "n_batch": ns.batch_size, "n_ubatch": ns.ubatch_size,
        "type_k": ns.cache_type_k, "type_v": ns.cache_type_v, "flash_attn": ns.flash_attn,
        "kv_unified": ns.kv_unified, "split": ns.split, "kernel": ns.kernel,
        "n_threads": ns.threads, "n_depth": ns.n_depth})
    out = []
    for inst in params:
        if inst["layer"] is None:
            inst["layer"] = default_layer(inst["model"])
        inst["device"] = device = devices[inst["n_gpu_layers"]]
        inst["n_ubatch"] = effective_ubatch(inst["n_batch"], inst["n_ubatch"])
        check_threads(inst["n_threads"])
        check_ngl([inst["n_gpu_layers"]] if inst["n_gpu_layers"] is not None else None, inst["model"])
        check_cache_types(inst["type_k"], inst["type_v"], device=device, flash_attn=inst["flash_attn"] != "off",
                          head_dim_k=inst["model"].head_dim_k, head_dim_v=inst["model"].head_dim_v, kernel=inst["kernel"],
                          n_gpu=multi_gpu.n_gpu())
        check_kernel(inst["kernel"], inst["flash_attn"] != "off", device)
        for n_prompt, n_gen in tests_of(ns):
            out.append(dict(inst, n_prompt=n_prompt, n_gen=n_gen))
    say_synthetic_layers(PROG, ((inst["model"], inst["layer"]) for inst in out))
    past = []
    for inst in out:
        m = inst["model"]
        need = inst["n_prompt"] + inst["n_gen"] + inst["n_depth"]
        name = f"test {fmt.test_name(inst['n_prompt'], inst['n_gen'], inst['n_depth'])} on {m.name}"
        if ns.ctx_size:   # our own flag: a hard limit
            check_context(need, ns.ctx_size, name)
        elif m.n_ctx_train and need > m.n_ctx_train:   # llama-bench's context is p + n + d, whatever the model's
            past.append(f"{name} ({need})")
    if past:   # (llama.cpp warns "possible training context overflow" and runs)
        print(f"{PROG}: {len(past)} test(s) past the model's training context, run as llama-bench runs them: "
              f"{', '.join(sorted(set(past))[:4])}{' ...' if len(set(past)) > 4 else ''}", file=sys.stderr, flush=True)
    return out


def _runner_key(inst):
    return tuple(inst[k] for k in ("model", "n_batch", "n_ubatch", "flash_attn", "kv_unified", "split",
                                   "kernel", "layer", "type_k", "type_v", "n_threads", "device")) + \
        (inst["n_prompt"] + inst["n_gen"] + inst["n_depth"],)


def run_config(inst: dict, ns) -> RunConfig:
    """The runner configuration of test ``inst`` (its checks run here: UserError)."""
    return RunConfig(inst["model"], n_ctx=_runner_key(inst)[-1], n_seq=1, kv_unified=inst["kv_unified"],
                     split=inst["split"], n_batch=inst["n_batch"], n_ubatch=inst["n_ubatch"],
                     flash_attn=inst["flash_attn"] != "off", kernel=inst["kernel"], layer=inst["layer"],
                     device=inst["device"], n_threads=inst["n_threads"], seed=ns.seed, type_k=inst["type_k"],
                     type_v=inst["type_v"], cuda_graph=ns.cuda_graph == "on", tp=multi_gpu.current())


def run_test(runner: Runner, inst: dict, reps: int, warmup: bool, progress, idx: int) -> dict:
    """llama-bench's test loop: warm-up, then per repetition clear, fill depth, time pp/tg. The
    warm-up runs a repetition's work untimed until it runs as every repetition's will (on the
    device a prompt twice, after its depth: the second run captures its CUDA graphs), where
    llama-bench's runs the prompt once (its own steady state)."""
    n_prompt, n_gen, n_depth = inst["n_prompt"], inst["n_gen"], inst["n_depth"]
    if warmup:   # the untimed runs of a repetition's work until it runs as every repetition's will
        # (the prompt after its depth, on the device twice: the second run captures its graphs;
        # then one generation step, after the depth when there is no prompt)
        runs = runner.runs_to_steady(decode_step=False) if n_prompt > 0 else int(n_gen > 0)
        for _ in range(runs):
            runner.clear()
            if n_depth > 0:
                progress(idx, "warmup depth run")
                runner.decode(runner.prompt_batch([n_depth]))
            if n_prompt > 0:
                progress(idx, "warmup prompt run")
                runner.decode(runner.prompt_batch([n_prompt]))
        if n_gen > 0:
            progress(idx, "warmup generation run")
            runner.decode(runner.step_batch([0]))
    samples, n_ub = [], 0
    for rep in range(reps):
        runner.clear()
        if n_depth > 0:
            progress(idx, f"depth run {rep + 1}/{reps}")
            runner.decode(runner.prompt_batch([n_depth]))
        n_ub = 0
        with runner.timer() as t:
            shapes = []
            if n_prompt > 0:
                progress(idx, f"prompt run {rep + 1}/{reps}")
                st = runner.decode(runner.prompt_batch([n_prompt]), sync=False)   # the timer waits
                n_ub += st.n_ubatches
                shapes += st.shapes
            if n_gen > 0:
                progress(idx, f"generation run {rep + 1}/{reps}")
                for _ in range(n_gen):
                    st = runner.decode(runner.step_batch([0]), sync=False)
                    n_ub += st.n_ubatches
                    shapes += st.shapes
        samples.append(max(1, t.ns))
    return {"samples_ns": samples, "ub": n_ub, "_shapes": shapes}


def make_row(inst: dict, result: dict, cuda_graph: bool = False, ns=None) -> dict:
    """A result row: llama-bench's fields (``format_bench.FIELDS``; ``flash_attn`` as its integer,
    n_gpu_layers the -ngl value given (-1 by default), tensor_split as llama-bench writes it, the settings this
    tool has no flag for at llama-bench's defaults) and ours. ``ns``: the parsed flags (-mg)."""
    m, device = inst["model"], inst["device"]
    ctx = multi_gpu.current()
    commit, number = build_info()
    split = inst["split"] or default_split(inst["kv_unified"])
    row = dict(
        build_commit=commit, build_number=number, cpu_info=cpu_info(),
        gpu_info=gpu_info() if device == "cuda" else "",
        backends=("CUDA+graphs" if cuda_graph else "CUDA") if device == "cuda" else "CPU",
        model_filename=m.source if m.source != "preset" else m.name,
        model_type=m.desc, model_name=m.name,
        model_size=m.file_bytes if inst["layer"] == "model" else m.size_bytes,
        model_n_params=m.file_params if inst["layer"] == "model" else m.n_params, n_layer=m.n_layer, n_head=m.n_head,
        n_head_kv=m.n_head_kv, head_dim=m.head_dim_k, n_batch=inst["n_batch"], n_ubatch=inst["n_ubatch"],
        n_threads=inst["n_threads"], type_k=inst["type_k"], type_v=inst["type_v"],
        n_gpu_layers=ngl_field(inst["n_gpu_layers"]), flash_attn=fmt.FA_INT[inst["flash_attn"]],
        # (one device: llama-bench's default "layer" unless -sm was given, so that its rows join ours)
        split_mode=ctx.mode if ctx is not None and ctx.n_rank > 1 else
        ("none" if "split_mode" in getattr(ns, "explicit", ()) else "layer"),
        main_gpu=getattr(ns, "main_gpu", 0), tensor_split=multi_gpu.ts_text(inst.get("tensor_split")),
        **fmt.LLAMA_BENCH_DEFAULTS,
        kv_unified=inst["kv_unified"], split=split, kernel=inst["kernel"], device=device,
        path=fmt.attention_path(device, inst["flash_attn"], inst["kernel"]),
        layer=inst["layer"], n_prompt=inst["n_prompt"], n_gen=inst["n_gen"], n_depth=inst["n_depth"],
        test_time=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        **{k: v for k, v in result.items() if not k.startswith("_")})
    return fmt.finish_row(row)


def main(argv=None) -> int:
    """Console-script entry: user mistakes -> one line on stderr and exit 2."""
    return console_main(PROG, multi_gpu.wrap(_main, __name__, build_parser), argv)


def _main(argv=None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.list_models:
        out = SafeWriter(sys.stdout)
        for m in PRESETS.values():
            out.write(m.describe() + "\n")
        out.flush()
        return 0
    for dest, flag in (("n_depth", "-d"), ("batch_size", "-b"), ("ubatch_size", "-ub"), ("threads", "-t"),
                       ("n_gpu_layers", "-ngl")):
        if dest in ns.explicit and not getattr(ns, dest):   # a range A-B with B < A gives no values
            raise UserError(f"{flag} gives no values (a range A-B with B < A is empty)")
    devices = ngl_devices(ns)
    insts = instances(ns, devices)
    if not insts:
        raise UserError("no tests to run (all of -p, -n and -pg are 0 or empty)")
    note_cpu_fallback([n for n, dev in devices.items() if n and dev == "cpu"], "cpu", PROG)
    if len(devices) > 1:
        print(f"{PROG}: -ngl {','.join(map(ngl_text, devices))}: a row per value; 0 runs the CPU path, N >= the "
              f"model's layers all layers on the GPU (n_gpu_layers: the value given, as llama-bench's)",
              file=sys.stderr, flush=True)
    if ns.tensor_split and ns.split_mode == "none":
        print(f"{PROG}: -ts: with -sm none the model runs on one device (-mg's); the value is recorded in the "
              f"rows' tensor_split", file=sys.stderr, flush=True)
    backend = "CUDA" if "cuda" in devices.values() else "CPU"
    commit, number = build_info()
    columns, build = md_columns(ns, insts, backend), f"{commit} ({number})"
    bar = ProgressBar(len(insts), PROG, enabled=False if ns.progress else None)
    printer = fmt.make_printer(ns.output, SafeWriter(bar.writer(sys.stdout)), md_columns=columns, build=build)
    if ns.output_err != "none":
        printer = fmt.Tee(printer, fmt.make_printer(ns.output_err, SafeWriter(bar.writer(sys.stderr), "stderr"),
                                                    md_columns=columns, build=build))
    verbose = Verbose(PROG, ns.verbose)
    progress = Progress(PROG, ns.progress, len(insts))
    configs = {_runner_key(inst): run_config(inst, ns) for inst in insts}   # every check, before any output
    printer.header()
    runner, key = None, None
    try:
        for idx, inst in enumerate(insts, 1):
            if ns.delay:
                interruptible_sleep(ns.delay)
            progress(idx, "starting")
            if _runner_key(inst) != key:
                if runner is not None:
                    runner.close()
                runner, key = None, _runner_key(inst)
                runner = Runner(configs[key])
                verbose.runner(runner)
            result = run_test(runner, inst, ns.repetitions, not ns.no_warmup, progress, idx)
            verbose.shapes(f"test {idx} {fmt.test_name(inst['n_prompt'], inst['n_gen'], inst['n_depth'])}, "
                           f"{result['ub']} ubatches per repetition", result["_shapes"])
            printer.row(make_row(inst, result, ns.cuda_graph == "on", ns))
            bar.update(fmt.test_name(inst["n_prompt"], inst["n_gen"], inst["n_depth"]))
    finally:
        bar.close()
        # after Ctrl-C too: the rows printed so far stay a complete table / valid json
        printer.footer()
        if runner is not None:
            runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
