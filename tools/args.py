"""Argument parsing shared by ``ggml-attn-bench`` and ``ggml-attn-batched-bench``.

Value lists follow llama-bench: comma lists and ranges, ``first[-last[(+|*)step]]``,
so ``-p 128,256``, ``-p 128-512*2`` (128,256,512), ``-ub 64-256+64`` (64,128,192,256).
Giving a flag again extends its list (``-p 128 -p 256``). The tools run one row per
combination of all list values (:func:`combinations`).

Parsing errors are :class:`~ggml_attn.cli.errors.UserError`: one line on stderr, exit 2.
"""
from __future__ import annotations

import argparse
import itertools
import re

from .errors import EXIT_USER_ERROR, UserError, fail_line
from .given import given

# one item of a range list, as llama-bench's parse_int_range: first[-last[(+|*)step]]
_RANGE_ITEM = re.compile(r"^(\d+)(?:-(\d+)(?:([+*])(\d+))?)?$")

INT32_MAX = 2**31 - 1     # token counts, positions and sizes are int32 in llama.cpp
MAX_LIST_VALUES = 10000   # values one list flag may expand to (each is at least one test)


def int_range(hi: int = INT32_MAX, note: str = " (int32, as llama.cpp)", max_count: int = MAX_LIST_VALUES):
    """argparse ``type`` of a llama-bench value list (:func:`parse_int_range`) whose values are
    at most ``hi`` (``note`` says why) and that expands to at most ``max_count`` values. Both
    are checked on the range's bounds and arithmetic count, before any list is built: ``-p
    1-100000000`` is refused at once instead of after minutes and GBs."""

    def parse(text: str) -> list[int]:
        return parse_int_range(text, hi=hi, note=note, max_count=max_count)

    parse.__name__ = "int_range"
    return parse


def _range_values(item: str, first: int, last: int, op: str, step: int, hi: int, note: str,
                  have: int, max_count: int):
    """The values of one range item, after checking (arithmetically) that none is above ``hi``
    and that with the ``have`` values before it the list holds at most ``max_count``."""
    if last < first:
        return []  # b < a: no values, as llama-bench
    if op == "+":
        if step <= 0:
            raise UserError(f"invalid range '{item}': the step does not increase the value")
        count = (last - first) // step + 1
        top = first + (count - 1) * step
    else:
        if first <= 0 or step <= 1:
            raise UserError(f"invalid range '{item}': the step does not increase the value")
        count, top = 1, first
        while top * step <= last and top <= hi:   # a geometric range: at most log2(hi) steps
            top *= step
            count += 1
    if top > hi:
        raise UserError(f"{top} is more than {hi}{note}")
    if have + count > max_count:
        raise UserError(f"'{item}' gives {count} values" + (f" (after {have})" if have else "")
                        + f"; a list holds at most {max_count}")
    if op == "+":
        return list(range(first, top + 1, step))
    return [first * step ** j for j in range(count)]


def parse_int_range(text: str, *, hi: int = INT32_MAX, note: str = " (int32, as llama.cpp)",
                    max_count: int = MAX_LIST_VALUES) -> list[int]:
    """``"1,2,8-32*2,100-300+100"`` -> ``[1, 2, 8, 16, 32, 100, 200, 300]``.

    Raises UserError on bad syntax, an empty item, a range that does not grow (``a-b*1``,
    ``0-4*2``, ``a-b+0``), a value above ``hi`` or more than ``max_count`` values in all; the
    last two are found from the bounds, before anything is expanded. ``b < a`` gives no
    values, as in llama-bench.
    """
    text = str(text).strip()
    if not text:
        raise UserError("empty value list")
    out: list[int] = []
    for item in text.split(","):
        item = item.strip()
        m = _RANGE_ITEM.match(item)
        if not m:
            raise UserError(f"invalid range format '{item}' in '{text}' "
                            "(expected N, A-B, A-B+S or A-B*M)")
        first = int(m.group(1))
        last = int(m.group(2)) if m.group(2) is not None else first
        op = m.group(3) or "+"
        step = int(m.group(4)) if m.group(4) is not None else 1
        out += _range_values(item, first, last, op, step, hi, note, len(out), max_count)
    return out


def int_at_least(lo: int, note: str = "", hi: int | None = None):
    """argparse ``type``: an integer ``>= lo`` (and ``<= hi`` if given; UserError otherwise);
    ``note`` ends the message."""

    def parse(text: str) -> int:
        try:
            value = int(str(text).strip())
        except ValueError:
            raise UserError(f"invalid integer '{text}'") from None
        if value < lo:
            raise UserError(f"must be at least {lo}{note}, got {value}")
        if hi is not None and value > hi:
            raise UserError(f"must be at most {hi}{note}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def parse_pair_list(text: str) -> list[tuple[int, int]]:
    """``-pg`` value ``"pp,tg"`` -> ``[(pp, tg)]``; several pairs may be separated by ``;``."""
    pairs = []
    for chunk in str(text).split(";"):
        parts = [p.strip() for p in chunk.split(",")]
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise UserError(f"invalid -pg value '{chunk}' (expected pp,tg, e.g. 512,128)")
        pairs.append((int(parts[0]), int(parts[1])))
    return pairs


_BOOL_WORDS = {"on": True, "1": True, "true": True, "yes": True,
               "off": False, "0": False, "false": False, "no": False}


def _words(text: str, table: dict, expected: str) -> list:
    """A comma list of ``table``'s keys (case-insensitive) -> their values; UserError naming the
    first item that is not one."""
    out = []
    for item in str(text).split(","):
        key = item.strip().lower()
        if key not in table:
            raise UserError(f"invalid value '{item}' (expected {expected})")
        out.append(table[key])
    return out


def _one(values: list, text: str):
    if len(values) != 1:
        raise UserError(f"one value expected, got '{text}'")
    return values[0]


def parse_bool_list(text: str) -> list[bool]:
    """``"on,off"`` / ``"1,0"`` / ``"true"`` -> list of bools."""
    return _words(text, _BOOL_WORDS, "on|off, 1|0 or true|false")


def parse_bool(text: str) -> bool:
    """One 0|1 (on|off, true|false) value: ``-kvu 1`` as llama.cpp takes it."""
    return _one(parse_bool_list(text), text)


# llama.cpp's -fa takes on|off|auto (and 1|0|-1); rows and help show the word
FA_VALUES = {"on": "on", "off": "off", "auto": "auto", "1": "on", "0": "off", "-1": "auto"}


def parse_fa(text: str) -> list[str]:
    """``-fa`` values, llama.cpp's spellings (on|off|auto, 1|0|-1) -> words; a comma list."""
    return _words(text, FA_VALUES, "on, off or auto; 1, 0 or -1")


def parse_fa_one(text: str) -> str:
    """One ``-fa`` value (ggml-attn-batched-bench, as llama-batched-bench takes one)."""
    return _one(parse_fa(text), text)


def choice_list(choices):
    """argparse ``type`` for a comma list whose items must be in ``choices``."""
    choices = tuple(choices)

    def parse(text: str) -> list[str]:
        out = []
        for item in str(text).split(","):
            item = item.strip()
            if item not in choices:
                raise UserError(f"invalid value '{item}' (choose from {', '.join(choices)})")
            out.append(item)
        return out

    parse.__name__ = "choice_list"
    return parse


def str_list(text: str) -> list[str]:
    """Comma list of non-empty strings (model names or paths)."""
    out = [s.strip() for s in str(text).split(",")]
    if not all(out):
        raise UserError(f"empty item in list '{text}'")
    return out


class ExtendList(argparse.Action):
    """Store a parsed list; a repeated flag extends it, replacing the default on first use."""

    def __call__(self, parser, namespace, values, option_string=None):
        seen = given(namespace)
        if self.dest not in seen:
            setattr(namespace, self.dest, [])
            seen.add(self.dest)
        getattr(namespace, self.dest).extend(values)


class Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line on stderr and exit code 2.

    ``type=`` functions may raise UserError; its message is kept as is. Flags match exactly:
    no abbreviations (``--rep`` is not ``--repetitions``) and no value glued to a short flag
    (``-ngl`` is not ``-n gl``), so a llama-bench flag we lack is reported by its own name.
    """

    def __init__(self, *args, **kw):
        kw.setdefault("allow_abbrev", False)
        super().__init__(*args, **kw)

    def _get_option_tuples(self, option_string):
        # argparse's prefix matching: for "-ngl" it offers "-n" with the value "gl"
        return []

    def error(self, message):  # noqa: D401 - argparse API
        import sys
        print(fail_line(self.prog, message), file=sys.stderr)
        raise SystemExit(EXIT_USER_ERROR)

    def _print_message(self, message, file=None):
        # --help and usage text: a failed write is one line and exit 2 (output.SafeWriter)
        import sys
        from .output import SafeWriter
        if message:
            name = "stderr" if file is sys.stderr else "stdout"
            out = SafeWriter(file or sys.stderr, name)
            out.write(message)
            out.flush()

    def _get_value(self, action, arg_string):
        try:
            return super()._get_value(action, arg_string)
        except UserError as e:
            opt = "/".join(action.option_strings) or action.dest
            self.error(f"argument {opt}: {e}")

    def parse_args(self, args=None, namespace=None):
        import sys
        argv = list(sys.argv[1:] if args is None else args)
        ns = super().parse_args([self._dashes(a) for a in argv], namespace)
        ns.explicit = set(getattr(ns, "_explicit", set()) or set())
        if hasattr(ns, "_explicit"):
            delattr(ns, "_explicit")
        for line in dict.fromkeys(getattr(ns, "_inert", None) or ()):   # each flag's note once
            print(f"{self.prog}: {line}", file=sys.stderr, flush=True)
        if hasattr(ns, "_inert"):
            delattr(ns, "_inert")
        return ns

    def _dashes(self, arg):
        """``--n_prompt`` (an underscore spelling) as ``--n-prompt`` when only the latter is a flag."""
        if not isinstance(arg, str) or not arg.startswith("--") or "_" not in arg.split("=", 1)[0]:
            return arg
        name, eq, value = arg.partition("=")
        if name in self._option_string_actions:
            return arg
        alt = name.replace("_", "-")
        return alt + eq + value if alt in self._option_string_actions else arg


class _Version(argparse.Action):
    """``--version``: the package's version and the build's commit, then exit 0 (the commit is
    looked up only when asked: it may run git)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from ggml_attn import __version__
        from .common import build_info
        commit, number = build_info()
        import sys
        parser._print_message(f"{parser.prog} {__version__} (build: {commit} ({number}))\n", sys.stdout)
        parser.exit()


class _Inert(argparse.Action):
    """A llama.cpp flag with nothing to change here: taken (a llama.cpp command line runs as it
    is) and said once on stderr (``Parser.parse_args``), never given another meaning."""

    def __init__(self, option_strings, dest, note="", **kw):
        self.note = note
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        notes = getattr(namespace, "_inert", None)
        if notes is None:
            notes = []
            setattr(namespace, "_inert", notes)
        notes.append(f"{self.option_strings[0]}: {self.note}")   # (one line whichever spelling)


def add_inert(parser, flags: tuple, note: str, nargs=1, metavar: str = "V") -> None:
    """Take llama.cpp's ``flags`` (with ``nargs`` values) and say ``note`` once when given."""
    parser.add_argument(*flags, action=_Inert, note=note, nargs=nargs, metavar=metavar if nargs else None,
                        help=f"llama.cpp's; {note}")


# llama-bench's flags that change nothing here (llama-bench runs llama.cpp's backends; this tool
# runs one device through its own graph) -- each said once when given
LLAMA_BENCH_INERT = [
    (("-nkvo", "--no-kv-offload"), "the KV cache is where the tool runs (--device): nothing is offloaded"),
    (("-C", "--cpu-mask"), "CPU affinity is left to the OS"),
    (("--cpu-strict",), "CPU affinity is left to the OS"),
    (("--poll",), "ggml's CPU threads wait passively here (OMP_WAIT_POLICY)"),
    (("--numa",), "no NUMA placement here"),
    (("--prio",), "the process keeps its priority"),
    (("-embd", "--embeddings"), "the benchmarks compute attention or logits, not embeddings"),
    (("-nopo", "--no-op-offload"), "there is no host/device op offload here"),
    (("-dev",), "the device is --device's (cpu, cuda or auto), one device; -sm row/layer for several"),
    (("-lm", "--load-mode"), "the weights are memory-mapped on the CPU and read with preadv into the GPU"),
    (("--no-mmap",), "the CPU path maps the file; the GPU path reads it without a map anyway", 0),
    (("-mmp", "--mmap"), "the CPU path maps the file; the GPU path reads it without a map anyway"),
    (("-ncmoe", "--n-cpu-moe"), "the models here have no experts to keep on the CPU (the rows' n_cpu_moe: 0)"),
    (("-ot", "--override-tensors"), "every weight goes where --device / -ngl put the layers (the rows' "
                                    "tensor_buft_overrides: none)"),
    (("-rpc", "--rpc"), "no RPC servers here: the run is local (--device; -sm row/layer for several GPUs)"),
]
# llama-batched-bench's (llama.cpp's common arguments)
LLAMA_BATCHED_INERT = [
    (("-tb", "--threads-batch"), "-t's threads compute every batch here"),
    (("-np", "--parallel"), "the parallel sequences are -npl's"),
    (("--no-mmap",), "the CPU path maps the file; the GPU path reads it without a map anyway", 0),
]


def add_inert_flags(parser, table) -> None:
    """``table``: ``(flags, note[, nargs])`` entries (one value unless said)."""
    for flags, note, *nargs in table:
        add_inert(parser, flags, note, nargs[0] if nargs else 1)


class _ListDevices(argparse.Action):
    """``--list-devices`` (llama-bench's): the devices this tool can run on, then exit 0."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        import sys
        from .common import cpu_info, gpu_info
        from .runner import cuda_available
        lines = ["Available devices:", f"  CPU: {cpu_info()} (--device cpu)"]
        if cuda_available():
            lines.append(f"  CUDA0: {gpu_info()} (--device cuda)")
        parser._print_message("\n".join(lines) + "\n", sys.stdout)
        parser.exit()


def add_list_devices(parser) -> None:
    parser.add_argument("--list-devices", action=_ListDevices, help="list the devices this tool can run on and exit")


def add_kv_split_flags(parser, splits) -> None:
    """``-kvu`` / ``-no-kvu`` (llama.cpp's KV mode) and ``--split`` (a list of ``splits`` or
    ``all``), as the batched and serving benches take them."""
    parser.add_argument("-kvu", "--kv-unified", type=parse_bool, nargs="?", const=True, default=False, metavar="0|1",
                        help="one KV buffer for all sequences (1; bare -kvu means 1) or one stream per "
                             "sequence (0) (default: 0)")
    parser.add_argument("-no-kvu", "--no-kv-unified", dest="kv_unified", action="store_const", const=False,
                        help="one stream per sequence (llama.cpp's spelling of -kvu 0)")
    add_list(parser, "--split", type=choice_list(tuple(splits) + ("all",)), default=[""], metavar="MODE",
             help="ubatch split: simple|equal|seq|padded|auto, a list, or all (every strategy on the "
                  "same input); simple always runs on a unified KV cache; default: simple with -kvu, "
                  "equal without (as llama.cpp)")


def add_version(parser) -> None:
    """``--version``, as llama.cpp's tools have it."""
    parser.add_argument("--version", action=_Version, help="print the version and the build's commit, then exit")


def add_list(parser, *flags, type, default, help, metavar=None, **kw):
    """Add a list-valued flag (comma lists, ranges, repeatable) with a default list.
    Extra keywords go to ``add_argument`` (e.g. ``nargs="?", const=[True]`` for a bare flag)."""
    shown = ",".join(_show(d) for d in default) if default else "none"
    if "(default: " not in help:   # a help that says its own default (one that depends on other flags)
        help = f"{help} (default: {shown})"
    parser.add_argument(*flags, type=type, action=ExtendList, default=list(default),
                        metavar=metavar, help=help, **kw)


def _show(value) -> str:
    if isinstance(value, bool):
        return str(int(value))
    return str(value) if value != "" else "per -kvu"


def combinations(lists: dict) -> list[dict]:
    """Cartesian product of ``{name: [values]}`` in key order, last key varying fastest."""
    keys = list(lists)
    return [dict(zip(keys, vals)) for vals in itertools.product(*(lists[k] for k in keys))]
