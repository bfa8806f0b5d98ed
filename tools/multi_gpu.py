"""llama-bench's multi-GPU flags for both tools, and the launcher of one process per GPU.

Flags (:func:`add_args`): ``-sm/--split-mode none|layer|row``, ``-ts/--tensor-split``
(proportions, e.g. ``1,1``), ``-mg/--main-gpu``, ``--n-gpu N``.

* ``-sm none`` (default): one GPU, ``-mg`` picks it.
* ``-sm row``: head-parallel over ``--n-gpu`` GPUs (default: every visible GPU). Rank ``r``
  holds its share of KV heads, query heads and FFN columns (``graph/shard.py``) and all-reduces
  the O / FFN-down partial sums over NCCL (``graph/tp.py``). ``-ts`` must give equal shares (the
  heads split evenly); ``-mg`` is the GPU of rank 0, the others take the next GPUs in order.
* ``-sm layer``: layer-parallel over ``--n-gpu`` GPUs (default: one per ``-ts`` share, else
  every visible GPU). Rank ``r`` holds a contiguous range of layers, in proportion to the ``-ts``
  shares as llama.cpp splits them (``graph/pipe.py``: 32 layers, ``-ts 1,1`` -> 0-15 and 16-31),
  and the KV cache of those layers; per ubatch it receives the activations from rank ``r - 1``
  and sends its output to rank ``r + 1`` (NCCL send/recv). ``-mg`` as for ``-sm row``.

:func:`wrap` runs a tool's ``_main(argv)`` as rank 0 in this process and starts ranks
``1..N-1`` as processes of their own (multiprocessing ``spawn``; the NCCL unique id made here is
handed to each). Every rank runs the same tool loop with the same arguments, so every rank
makes the same batches, splits and plans; only rank 0 prints (the others' stdout goes to
``os.devnull``). A rank that dies ends the run: rank 0 stops the others and exits non-zero.
CUDA graphs are off with several GPUs unless ``--cuda-graph on`` is given (NCCL inside
captured graphs is not verified here). The CPU (``--device cpu``) runs one rank only; the
in-process ranks of ``graph/tp.py`` (``LockstepEngine``) are the CPU form of ``-sm row``, used
by the tests, and ``graph/pipe.py``'s ``PipelineEngine`` the CPU form of ``-sm layer``.
"""
from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass, field

from .errors import UserError

SPLIT_MODES = ("none", "layer", "row")


def parse_ts_list(text: str) -> list[tuple[float, ...]]:
    """llama-bench's ``-ts``: test values separated by ``,``, each value's GPU shares by ``/`` (or
    ``;``): ``1,1`` is two tests of one share, ``1/1`` one test over two GPUs, ``3/1,1/1`` two."""
    out = []
    for value in str(text).split(","):
        try:
            shares = tuple(float(x) for x in value.replace(";", "/").split("/") if x.strip())
        except ValueError:
            raise UserError(f"invalid -ts value '{value}' (expected proportions such as 1/1; ',' separates "
                            f"test values, as llama-bench's)") from None
        if not shares or not all(0 <= v < float("inf") for v in shares):   # (NaN fails the compare too)
            raise UserError(f"invalid -ts value '{value}': expected finite non-negative shares such as 3/1")
        out.append(shares)
    return out


def ts_text(shares) -> str:
    """A ``-ts`` value as llama-bench writes its tensor_split field: each share ``%.2f`` up to
    the last non-zero one, joined by ``/``; ``0.00`` for none."""
    shares = list(shares or ())
    last = max((i for i, v in enumerate(shares) if v > 0), default=0)
    return "/".join(f"{v:.2f}" for v in (shares[:last + 1] or [0.0]))


def _ts_value(ns) -> str:
    """The one ``-ts`` value of this run as ``P0,P1,...`` text ("" when not given). ggml-attn-bench's
    list (:func:`parse_ts_list`) may repeat one value (``-ts 1,1``: each test twice), not hold
    several: the GPUs' processes are started once for the run."""
    ts = ns.tensor_split
    if isinstance(ts, str):
        return ts
    values = list(dict.fromkeys(tuple(v) for v in ts or ()))
    if len(values) > 1:
        raise UserError(f"-ts {','.join('/'.join(f'{x:g}' for x in v) for v in values)}: one split per run here "
                        f"(the GPUs' processes are started once); run each -ts value separately")
    return ",".join(f"{x:g}" for x in values[0]) if values else ""


def add_args(p, add_list=None) -> None:
    """``add_list`` (``args.add_list``, given by llama-bench's tool): ``-ts`` as llama-bench takes
    it (a list of test values, ``/`` between GPUs); None: as llama.cpp's common arguments (``,``
    or ``/`` between GPUs, one value)."""
    from .given import StoreGiven
    p.add_argument("-sm", "--split-mode", choices=SPLIT_MODES, default="none", action=StoreGiven,
                   help="several GPUs: none (one GPU, -mg), row (head-parallel over --n-gpu GPUs, "
                        "NCCL all-reduce), layer (contiguous layer ranges per GPU, activations handed "
                        "on by NCCL send/recv) (default: none)")
    ts_help = ("share of each GPU: of the layers with -sm layer (as llama.cpp), of the heads with -sm row, "
               "which needs equal shares")
    if add_list is not None:
        add_list(p, "-ts", "--tensor-split", type=parse_ts_list, default=[], metavar="P0/P1/...",
                 help=ts_help + "; as llama-bench's, ',' separates test values and '/' the GPUs of one "
                                "(-ts 1/1: two GPUs; -ts 1,1: two tests on one), one distinct value per run "
                                "(default: equal)")
    else:
        p.add_argument("-ts", "--tensor-split", default="", metavar="P0,P1,...", help=ts_help + " (default: equal)")
    p.add_argument("-mg", "--main-gpu", type=int, default=0, metavar="I",
                   help="the GPU of -sm none, rank 0's GPU with -sm row/layer (default: 0)")
    p.add_argument("--n-gpu", type=int, default=0, metavar="N",
                   help="GPUs of -sm row/layer (default: one per -ts share, else every visible GPU)")


@dataclass
class RankContext:
    """This process's place among the ranks: ``rank`` of ``n_rank`` on CUDA ``device``,
    ``uid`` the NCCL unique id of the run, ``mode`` ``"row"`` or ``"layer"`` (``-sm``),
    ``shares`` the ``-ts`` proportions (layer mode; empty: equal). :meth:`comm` makes the
    communicator once; :meth:`layers` is the rank's layer range (layer mode)."""

    rank: int
    n_rank: int
    device: int
    uid: object = None
    mode: str = "row"
    shares: tuple = ()
    timed_ns: int = 0          # rank 0's timed runs (the tools' timers), nanoseconds
    nccl_s: float = 0.0        # GPU time inside all-reduces during those runs
    _comm: object = field(default=None, repr=False)

    def comm(self):
        if self._comm is None:
            from ggml_attn.graph.tp import NcclComm
            self._comm = NcclComm(self.rank, self.n_rank, self.uid)
        return self._comm

    def layers(self, n_layer: int) -> range:
        """This rank's global layers of a model of ``n_layer`` layers (``-sm layer``)."""
        from ggml_attn.graph.pipe import layer_ranges
        return layer_ranges(n_layer, self.n_rank, list(self.shares) or None)[self.rank]


CURRENT: RankContext | None = None


def current() -> RankContext | None:
    """The rank context of this process (None: a one-GPU or CPU run)."""
    return CURRENT


def n_gpu() -> int:
    """GPUs of this run: the ranks of ``-sm row/layer``, else 1 (one GPU or the CPU)."""
    return CURRENT.n_rank if CURRENT is not None else 1


def _explicit(argv, flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def gpu_count() -> int:
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - no CuPy or no driver: no GPU
        return 0


def parse_shares(text: str, n: int, shown: str | None = None) -> list[float]:
    """The GPUs' shares of ``text`` (``,`` or ``/`` between them; ``""``: ``n`` equal ones);
    ``shown``: the value as the user typed it, for the messages."""
    if not text:
        return [1.0] * n
    shown = text if shown is None else shown
    try:
        vals = [float(x) for x in text.replace("/", ",").split(",") if x.strip()]
    except ValueError:
        raise UserError(f"-ts {shown}: expected proportions such as 1/1") from None
    if not all(0 <= v < float("inf") for v in vals) or not any(vals):
        raise UserError(f"-ts {shown}: proportions must be finite, non-negative and not all zero")
    return vals


def plan_ranks(ns) -> tuple[int, list[int]]:
    """``(n_rank, devices)`` that the parsed flags ``ns`` ask for; UserError for what cannot run."""
    sm, ts = ns.split_mode, _ts_value(ns)
    shown = ns.tensor_split if isinstance(ns.tensor_split, str) else ts.replace(",", "/")   # as typed
    sep = "," if isinstance(ns.tensor_split, str) else "/"   # between GPUs: llama-bench's '/'
    if sm == "none":
        if ns.n_gpu > 1:
            raise UserError(f"--n-gpu {ns.n_gpu} needs -sm row (head-parallel) or -sm layer; -sm none runs on one GPU")
        if len([v for v in parse_shares(ts, 0, shown) if v > 0]) > 1:
            raise UserError(f"-ts {shown} splits tensors over several GPUs; it needs -sm row or -sm layer")
        return 1, [ns.main_gpu]
    if ns.device == "cpu":
        mod = "tp" if sm == "row" else "pipe"
        raise UserError(f"-sm {sm} runs on GPUs (one process each, NCCL); --device cpu runs one rank "
                        f"(the in-process CPU ranks of ggml_attn.graph.{mod} are for tests)")
    if ns.n_gpu < 0:
        raise UserError(f"--n-gpu must be at least 1, got {ns.n_gpu}")
    n_vis = gpu_count()
    given = parse_shares(ts, 0, shown)
    if sm == "row":
        n = ns.n_gpu or len([s for s in given if s > 0]) or n_vis
    else:   # layer: one rank per share (a zero share is refused by the layer split, not dropped)
        n = ns.n_gpu or len(given) or n_vis
    if n < 1:
        raise UserError(f"-sm {sm}: no GPU visible")
    shares = parse_shares(ts, n, shown)
    if sm == "row" and (len(shares) != n or len(set(shares)) != 1):
        raise UserError(f"-sm row splits heads evenly: -ts {shown} must give {n} equal shares "
                        f"(e.g. {sep.join(['1'] * n)})")
    if sm == "layer" and len(shares) != n:
        raise UserError(f"-sm layer on {n} GPUs: -ts {shown} gives {len(shares)} share(s), "
                        f"one per GPU is needed (e.g. {sep.join(['1'] * n)})")
    if n_vis < n:
        raise UserError(f"-sm {sm} on {n} GPUs: only {n_vis} GPU(s) visible")
    if not 0 <= ns.main_gpu < n_vis:
        raise UserError(f"-mg {ns.main_gpu}: GPUs are 0..{n_vis - 1}")
    if n > 1:
        from ggml_attn.graph.tp import nccl_available
        if not nccl_available():
            raise UserError(f"-sm {sm} on several GPUs needs NCCL: cupy.cuda.nccl is not available "
                            "(install NCCL for CuPy's CUDA, e.g. the nvidia-nccl-cu13 wheel for cupy-cuda13x)")
    devices = [ns.main_gpu] + [d for d in range(n_vis) if d != ns.main_gpu][: n - 1]
    return n, devices


def check_model(model, n_rank: int, layer: str, mode: str = "row", shares=None) -> None:
    """UserError unless the model splits over ``n_rank`` ranks: ``mode="row"``: its heads (and
    FFN columns, ``--layer full``); ``"layer"``: its layers, in proportion to ``shares``."""
    if n_rank <= 1:
        return
    from ggml_attn.graph.shard import ShardError, check_shardable
    try:
        if mode == "layer":
            from ggml_attn.graph.pipe import check_layer_split
            check_layer_split(model.n_layer, n_rank, list(shares) if shares else None)
        else:
            check_shardable(model.n_head, model.n_head_kv, n_rank, n_ff=model.n_ff if layer == "full" else None)
    except ShardError as e:
        raise UserError(f"-sm {mode} over {n_rank} GPUs, {model.name}: {e}") from None


def _as_list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _shares(ns, n: int) -> tuple:
    ts = _ts_value(ns)
    return tuple(parse_shares(ts, n)) if ns.split_mode == "layer" and ts else ()


def _check_models(ns, n_rank: int) -> None:
    """Before any process starts: the models' heads (``-sm row``) or layers (``-sm layer``, after
    ``--n-layer``) must split over ``n_rank`` (the ranks' Runners check again; a model that does
    not resolve is left to the tool to report), and the cache types run on several GPUs
    (``kv_types.check_multi_gpu_types``)."""
    from .kv_types import check_multi_gpu_types
    from .models import DEFAULT_GPU_MODEL, resolve, with_layers
    for tk in _as_list(getattr(ns, "cache_type_k", "f16")):
        for tv in _as_list(getattr(ns, "cache_type_v", "f16")):
            check_multi_gpu_types(tk, tv, n_rank)
    names, layers = _as_list(ns.model), _as_list(ns.layer)
    for name in names:
        try:
            model = with_layers(resolve(DEFAULT_GPU_MODEL if name == "auto" else name), ns.n_layer)
        except Exception:  # noqa: BLE001
            continue
        check_model(model, n_rank, "full" if "full" in layers else "attn", ns.split_mode, _shares(ns, n_rank))


class _NotATerminal:
    """A stream that says it is not a terminal (the tools draw a progress bar on terminals)."""

    def __init__(self, f):
        self._f = f

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self._f, name)


def _worker(modname: str, argv: list, ctx: RankContext) -> None:
    """Rank ``ctx.rank``: the tool's ``_main(argv)``, quiet."""
    global CURRENT
    import importlib
    import cupy
    cupy.cuda.Device(ctx.device).use()
    CURRENT = ctx
    sys.stdout = open(os.devnull, "w")
    sys.stderr = _NotATerminal(sys.stderr)   # errors still show; no second progress bar
    try:
        rc = importlib.import_module(modname)._main(argv)
    except UserError:   # rank 0 reports the same mistake
        sys.exit(2)
    sys.exit(int(rc or 0))


def wrap(main_fn, modname: str, build_parser):
    """``run(argv)``: ``main_fn(argv)`` on the GPU(s) the flags ask for (module doc); the flags
    are read with the tool's ``build_parser()``."""

    if modname == "__main__":   # python -m ...: the workers import the module by its real name
        modname = sys.modules["__main__"].__spec__.name

    def run(argv=None):
        global CURRENT
        args = list(sys.argv[1:] if argv is None else argv)
        if CURRENT is not None:          # a worker, or already inside a launched run
            return main_fn(argv)
        import contextlib
        import io
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                ns = build_parser().parse_args(args)
        except (SystemExit, UserError):   # --help, a usage error: the tool itself says it
            return main_fn(argv)
        n, devices = plan_ranks(ns)
        if n == 1:
            if devices[0] != 0:
                if not 0 <= devices[0] < gpu_count():
                    raise UserError(f"-mg {devices[0]}: {gpu_count()} GPU(s) visible")
                import cupy
                cupy.cuda.Device(devices[0]).use()
            return main_fn(argv)
        _check_models(ns, n)
        if not _explicit(args, "--cuda-graph"):
            args += ["--cuda-graph", "off"]
        import multiprocessing as mp
        import cupy
        from ggml_attn.graph.tp import nccl_unique_id
        uid = nccl_unique_id()
        ctx = mp.get_context("spawn")
        mode, shares = ns.split_mode, _shares(ns, n)
        procs = [ctx.Process(target=_worker, args=(modname, args, RankContext(r, n, devices[r], uid, mode, shares)),
                             name=f"ggml-attn-rank{r}", daemon=True) for r in range(1, n)]
        for p in procs:
            p.start()
        stop = threading.Event()
        threading.Thread(target=_watch, args=(procs, stop), daemon=True).start()
        cupy.cuda.Device(devices[0]).use()
        CURRENT = RankContext(0, n, devices[0], uid, mode, shares)
        ok = False
        try:
            rc = main_fn(args)
            ok = True
            return rc
        finally:
            me, comm = CURRENT, CURRENT._comm
            CURRENT = None
            stop.set()
            for p in procs:
                p.join(timeout=60 if ok else 1)
                if p.is_alive():
                    p.terminate()
            if comm is not None and ok:
                share = f" ({100 * me.nccl_s * 1e9 / me.timed_ns:.1f}%)" if me.timed_ns else ""
                what = ("NCCL all-reduces" if mode == "row" else
                        "NCCL send/recv (handovers to rank 1 and the pipeline drain; includes waiting for the "
                        "other ranks)")
                print(f"multi-GPU: -sm {mode} on {n} GPUs {devices}: rank 0 spent {me.nccl_s * 1e3:.1f} ms inside "
                      f"{what} of {me.timed_ns / 1e6:.1f} ms timed{share}; {comm.calls} calls in all"
                      + (f"; {comm.captured} of them captured in CUDA graphs, whose replays are not in that time"
                         if comm.captured else ""),
                      file=sys.stderr)

    return run


def _watch(procs, stop) -> None:
    """A rank that exits with an error ends the run (the others would wait in NCCL for ever)."""
    while not stop.wait(0.5):
        for p in procs:
            if p.exitcode not in (None, 0):
                if stop.wait(5):     # rank 0 is ending on its own (the same error)
                    return
                print(f"multi-GPU: {p.name} exited with code {p.exitcode}; stopping", file=sys.stderr)
                for q in procs:
                    if q.is_alive():
                        q.terminate()
                sys.stderr.flush()
                os._exit(p.exitcode if p.exitcode > 0 else 1)
