"""The backend's tuning knobs, counted: ``cuda_launch`` and ``dispatch`` keep their knobs as
module globals, read at call time (set ``ggml_attn.cuda_launch.<KNOB> = v``, ``monkeypatch``,
``tools/dev/gpu_bench.py``'s ``knobs``). Each of the two modules counts every set of an
upper-case name from outside (:func:`count_sets`), and the call cache keys on :func:`version`
(``cuda_backend._call_key``): a call prepared under one setting is prepared again under
another, whichever knob changed -- none is listed by hand."""
from __future__ import annotations

import sys
import types

__all__ = ["count_sets", "version"]

_COUNTED: list = []   # the counted modules


class _Counted(types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if name.isupper():   # a knob (private ones, _WAVES, included)
            super().__setattr__("knob_sets", self.__dict__.get("knob_sets", 0) + 1)


def count_sets(module_name: str) -> None:
    """Count the knob sets of module ``module_name`` (call at the end of that module)."""
    mod = sys.modules[module_name]
    mod.__class__ = _Counted
    mod.__dict__.setdefault("knob_sets", 0)
    _COUNTED.append(mod)


def version() -> tuple:
    """How many knob sets each counted module has seen: changes with every knob set."""
    return tuple(m.knob_sets for m in _COUNTED)
