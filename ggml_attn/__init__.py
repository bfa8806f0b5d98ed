"""ggml-attn: batched flash attention for ggml, with a numpy reference and CUDA kernels.

``import ggml_attn`` needs neither CuPy nor a GPU.
"""
from .op import (FlashAttnError, active_plans, compute_graph, flash_attn_ext,  # noqa: F401
                 gpu_available, raise_pending, set_backend)
from .reference import nmse  # noqa: F401

__version__ = "0.1.0"
