"""CPU engine: the builder's host graph per ubatch through every layer, computed by ggml's
CPU backend (``graph_engine.GraphEngine``, host flavour)."""
from __future__ import annotations

from .graph_engine import GraphEngine


class HostEngine(GraphEngine):
    flavour = "host"
