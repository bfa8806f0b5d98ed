"""ggml-attn: batched flash attention for ggml, with a numpy reference and CUDA kernels."""
from .reference import nmse  # noqa: F401

__version__ = "0.1.0"
