"""Which flags a command line gave (``ns.explicit``, the set :class:`args.Parser` leaves), for the
tools whose default and a given value mean different things; no imports of the other modules
(``multi_gpu`` and ``args`` both use it)."""
from __future__ import annotations

import argparse


def given(namespace) -> set:
    """The dests given on the command line so far (the parser's ``ns.explicit`` once parsed)."""
    seen = getattr(namespace, "_explicit", None)
    if seen is None:
        seen = set()
        setattr(namespace, "_explicit", seen)
    return seen


class StoreGiven(argparse.Action):
    """Store a value as "store" does, and count the flag as given (``ns.explicit``) where its
    default and a given value mean different things (llama-bench's ``split_mode`` column)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        given(namespace).add(self.dest)
