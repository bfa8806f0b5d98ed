"""ggml-attn: batched flash attention for ggml, with a numpy reference and CUDA kernels.

``import ggml_attn`` needs neither CuPy nor a GPU.
"""
import os as _os

from . import _cli_start

_cli_start.early_setup()   # the console scripts only: Ctrl-C and thread settings before the imports

# ggml's graph threads are OpenMP threads. With OpenMP's default active waiting, the threads
# that finished a node spin while another runs the op's Python callback, which made the
# numpy path about 20x slower on 2 cores. Passive waiting, unless the user chose otherwise
# (it only takes effect when OpenMP is not loaded yet, i.e. ggml_attn is imported first).
_os.environ.setdefault("OMP_WAIT_POLICY", "passive")
from .op import flash_attn_ext, gpu_available, set_backend  # noqa: F401
from .runtime import FlashAttnError, compute_graph, raise_pending  # noqa: F401
from ._ggml_check import check_one_ggml as _check_one_ggml

_check_one_ggml()   # llama.cpp's libggml-base.so beside ggml-python's: refuse here, not at the first graph
from .reference import nmse  # noqa: F401

__version__ = "0.1.0"
