"""llama.cpp-style batching for ggml-attn: batches, ubatch splits (incl. a padded split),
a unified / per-stream KV cache, ubatch masks, per-ubatch plans and ggml graphs.

Typical use::

    from ggml_attn.graph import Batch, KVCache, AttnConfig, split_ubatches, run_batch
    batch = Batch.from_lengths(range(1, 11))           # 10 prompts of 1..10 tokens, ids 0..9
    split_ubatches(batch, 512, "equal")                 # llama.cpp: 10 ubatches 10x1 .. 1x1
    split_ubatches(batch, 512, "padded")                # one ubatch 10x10 with 45 pads
    cfg = AttnConfig(n_layer=2, n_head=4, n_head_kv=2, head_dim_k=16)
    cache = KVCache(2560, 10, unified=False, n_layer=2, n_head_kv=2, head_dim_k=16)
    result = run_batch(cache, batch, 512, "padded", cfg, compute="ggml")
    print(format_table(compare_strategies(batch, 512)))

Modules, one line each, in the order of the data path (batch -> ubatch -> cache -> mask -> plan
-> graph -> op); ``split_ubatches`` here is ``auto.split_ubatches`` (every mode, ``auto`` too):

* ``batch``: tokens, positions and sequence sets of a batch, validated as llama.cpp does;
* ``split``: the ubatch splits (simple, equal, seq, padded), pure functions of a batch;
* ``auto``: chooses a split by dry-running plans (``split`` knows nothing of it);
* ``kv_cache`` (``kv_cells``: its cells, as llama-kv-cells.h; ``kv_changes``: their change log):
  streams, slots, storage and ``seq_*`` operations;
* ``mask`` (``mask_step``: a decode step's from the previous step's): a ubatch's mask;
* ``plan``: a ubatch placed in the cache, its mask and live-tile map, once for every layer;
* ``attn_config``: the attention stack's geometry (``AttnConfig``); ``qkv``: deterministic Q/K/V;
* ``build``: a ubatch's ggml graph (``build_checks`` what it may be, ``kv_graph`` the cache's
  views and store op, ``layers`` the layer functions, ``model_graph`` a real model's block,
  ``xp_node`` / ``xp_matmul`` / ``xp_ops`` the device graphs' custom ops (``cublas_gemm``: one
  capturable cuBLAS GEMM; ``path_gemm``: block matrices dequantized to F16 for it;
  ``q8_matmul``: the block matmuls on 8-bit activations; ``tiled_gemm``: the tiled block
  GEMMs' launches on F16 tensor cores; ``q8_handoff``: a
  GEMV's output in 8-bit form for the next GEMVs), ``staging`` their
  per-ubatch inputs, ``capture`` CUDA graphs);
* ``engine``: runs planned ubatches on built graphs, reused per structure (the CLIs' engines,
  ``model_runner``'s and ``qkv_runner``'s are its subclasses);
* ``driver``: the decode loop (validate, split, check room, plan, run, commit or roll back);
* ``qkv_runner``: ``run_batch`` with deterministic Q/K/V; ``describe``: plans as tables;
* ``model`` (``gguf_file`` the header, ``example_model`` a small file to try): a GGUF model;
  ``model_device``: its weights for device graphs (block matrices kept as ``QMatrix``);
  ``upload``: file bytes to the GPU through pinned buffers;
* ``model_runner``: token ids to logits (``run_model_batch``) and ``greedy``;
* ``serve``: a server's step loop (arrivals, admission, decode tokens and prompt chunks per step,
  retirement; ``ggml-attn-serve-bench``);
* ``shard`` / ``tp``: head-parallel ranks (``-sm row``); ``pipe``: layer-parallel ranks (``-sm layer``).
"""
from .batch import Batch, validate_batch
from .split import MODES, UBatch
from .kv_cache import KVCache, KVCacheFullError, SlotInfo
from .mask import build_mask, visible_cells
from .attn_config import AttnConfig
from .plan import UBatchPlan, apply_plan, dry_run_plans, plan_ubatch
from .auto import AutoChoice, CostModel, choose_split, split_ubatches
from . import driver
from .driver import BatchError, BatchInterrupted, BatchResult
from .qkv_runner import run_batch
from .describe import compare_strategies, describe_plan, format_table
from .model import Model, ModelError, load_gguf
from .example_model import write_example_model
from .model_runner import ModelResult, greedy, run_model_batch

__all__ = ["Batch", "validate_batch", "MODES", "UBatch", "split_ubatches", "KVCache",
           "KVCacheFullError", "SlotInfo", "build_mask", "visible_cells", "AttnConfig",
           "UBatchPlan", "plan_ubatch", "dry_run_plans", "apply_plan", "AutoChoice", "CostModel", "choose_split",
           "BatchResult", "BatchError", "BatchInterrupted", "run_batch", "driver", "compare_strategies", "describe_plan",
           "format_table",
           "Model", "ModelError", "load_gguf", "write_example_model", "ModelResult", "run_model_batch", "greedy"]
