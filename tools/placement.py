"""``-ngl`` as llama-bench users type it, mapped onto where ggml-attn runs.

llama-bench's ``-ngl N`` offloads N layers to the GPU (99: all of them). ggml-attn runs a
whole test on one device, so ``-ngl 0`` means the CPU path and ``-ngl N`` with N at least
the model's layer count means all layers on the GPU (when there is one, as ``--device
auto``); a partial offload is a UserError that says so. ``ggml-attn-bench`` takes a list
(``-ngl 0,99``) and maps each value on its own, a row per value. llama.cpp's spellings of "all
layers" are taken too: ``-1`` (llama-bench's default), ``auto`` and ``all`` (common/arg.cpp) --
:data:`ALL_LAYERS` here (:func:`parse_ngl`).
"""
from __future__ import annotations

import sys

from .errors import UserError

ALL_LAYERS = 1 << 30   # -ngl -1 / auto / all: every layer on the GPU


def parse_ngl(text: str) -> list[int]:
    """``-ngl``'s values: a list of counts and ranges (``args.parse_int_range``), where ``-1``,
    ``-2``, ``auto`` and ``all`` (llama.cpp's "as many as fit" / "all") are :data:`ALL_LAYERS`."""
    from .args import parse_int_range   # noqa: PLC0415
    out: list[int] = []
    for item in str(text).split(","):
        word = item.strip().lower()
        out += [ALL_LAYERS] if word in ("auto", "all", "-1", "-2") else parse_int_range(item)
    return out


def ngl_field(n: int | None) -> int:
    """The ``n_gpu_layers`` a row records, as llama.cpp's tools record it: the ``-ngl`` value given
    (-1, their default, when none or :data:`ALL_LAYERS`), whatever device ran it -- so that
    llama.cpp's scripts/compare-llama-bench.py joins our rows with llama-bench's."""
    return -1 if n is None or n == ALL_LAYERS else int(n)


def ngl_text(n: int) -> str:
    """An ``-ngl`` value as the user meant it (:data:`ALL_LAYERS` is ``all``)."""
    return "all" if n == ALL_LAYERS else str(n)


def parse_one_ngl(text: str) -> int:
    """One ``-ngl`` value (batched-bench, serve-bench): :func:`parse_ngl` of a single value."""
    vals = parse_ngl(text)
    if len(vals) != 1:
        raise UserError(f"-ngl takes one value here, got '{text}'")
    return vals[0]


def device_for_ngl(ngl: list[int] | None, device: str) -> str:
    """The ``--device`` value that ``-ngl`` (None or empty: not given) asks for."""
    if not ngl:
        return device
    values = sorted(set(ngl))
    if len(values) > 1:
        raise UserError(f"-ngl {','.join(map(ngl_text, values))}: one -ngl value per run here (a test runs "
                        f"on one device); run -ngl 0 (CPU path) and -ngl 99 (GPU) separately")
    n = values[0]
    if n == 0 and device == "cuda":
        raise UserError("-ngl 0 asks for the CPU path but --device cuda for the GPU; give one of them")
    if n > 0 and device == "cpu":
        raise UserError(f"-ngl {ngl_text(n)} offloads layers to the GPU but --device cpu keeps them on the CPU; "
                        f"give one of them (-ngl 0 is the CPU path)")
    return "cpu" if n == 0 else device


def check_ngl(ngl: list[int] | None, model) -> None:
    """A partial offload (0 < N < the model's layers) cannot run here: UserError."""
    for n in ngl or ():
        if 0 < n < model.n_layer:
            raise UserError(f"-ngl {n}: ggml-attn runs all layers on one device, so partial offload "
                            f"has no meaning here; -ngl 0 (CPU path) or -ngl {model.n_layer} or more "
                            f"(all {model.n_layer} layers of {model.name} on the GPU)")


def resolve_ngl_device(ngl: list[int] | None, device: str) -> str:
    """``cpu`` or ``cuda`` for ``-ngl`` and ``--device`` (``runner.resolve_device`` of
    :func:`device_for_ngl`); ``-ngl N > 0`` with ``--device auto`` and no usable GPU is the CPU,
    as in llama-bench, and :func:`note_cpu_fallback` says so."""
    from .runner import resolve_device
    return resolve_device(device_for_ngl(ngl, device))


def note_cpu_fallback(ngl: list[int] | None, device: str, prog: str) -> None:
    """One stderr line when ``-ngl N > 0`` runs on the CPU for want of a GPU (the rows record
    backends CPU); the tools call it once their arguments are checked, before running."""
    if device == "cpu" and ngl and max(ngl) > 0:
        print(f"{prog}: -ngl {ngl_text(max(ngl))}: no GPU is available (CuPy and a CUDA device are needed), "
              f"so it runs on the CPU (the rows' backends say CPU)", file=sys.stderr, flush=True)
