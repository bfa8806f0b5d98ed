"""llama.cpp-style batching for ggml-attn: batches, ubatch splits (incl. a padded split),
a unified / per-stream KV cache, ubatch masks, per-ubatch plans and ggml graphs.

Typical use::

    from ggml_attn.graph import Batch, KVCache, AttnConfig, split_ubatches, run_batch
    batch = Batch.from_lengths(range(1, 11))           # 10 prompts of 1..10 tokens, ids 0..9
    split_ubatches(batch, 512, "equal")                 # llama.cpp: 10 ubatches 10x1 .. 1x1
    split_ubatches(batch, 512, "padded")                # one ubatch 10x10 with 45 pads
    cfg = AttnConfig(n_layer=2, n_head=4, n_head_kv=2, head_dim=16)
    cache = KVCache(2560, 10, unified=False, n_layer=2, n_head_kv=2, head_dim_k=16)
    result = run_batch(cache, batch, 512, "padded", cfg, compute="ggml")
    print(format_table(compare_strategies(batch, 512)))

Modules, in pipeline order: ``batch`` -> ``split`` -> ``kv_cache`` -> ``mask`` -> ``plan`` ->
``auto`` (chooses a split by dry-running plans; ``split`` knows nothing of it) -> ``build``
(ggml graph: ``kv_graph`` the cache's views and store op, ``layers`` the layer functions,
``xp_matmul`` and ``xp_ops`` the device graphs' custom ops); ``model`` loads a GGUF model, ``model_graph`` builds its
block (RoPE, norms, embedding, head), ``model_runner`` runs token ids to logits
(``run_model_batch``, ``greedy``) on ``engine`` (graphs kept per structure and reused, CUDA-graph
replay on a GPU: the CLIs' engines are its subclasses); ``serve`` is a server's step loop (arrivals, admission,
decode tokens and prompt chunks per step, retirement; ``ggml-attn-serve-bench``); ``driver`` is
the decode loop over an engine,
``runner.run_batch`` drives it with deterministic Q/K/V; ``describe`` prints plans. ``split_ubatches`` here is
``auto.split_ubatches``: every mode, ``auto`` included.
"""
from .batch import Batch, validate_batch
from .split import MODES, UBatch
from .kv_cache import KVCache, KVCacheFullError, SlotInfo
from .mask import build_mask, visible_cells
from .qkv import AttnConfig
from .plan import UBatchPlan, apply_plan, dry_run_plans, plan_ubatch
from .auto import AutoChoice, CostModel, choose_split, split_ubatches
from . import driver
from .driver import BatchError, BatchInterrupted, BatchResult
from .runner import run_batch
from .describe import compare_strategies, describe_plan, format_table
from .model import Model, ModelError, load_gguf
from .example_model import write_example_model
from .model_runner import ModelResult, greedy, run_model_batch

__all__ = ["Batch", "validate_batch", "MODES", "UBatch", "split_ubatches", "KVCache",
           "KVCacheFullError", "SlotInfo", "build_mask", "visible_cells", "AttnConfig",
           "UBatchPlan", "plan_ubatch", "dry_run_plans", "apply_plan", "AutoChoice", "CostModel", "choose_split",
           "BatchResult", "BatchError", "BatchInterrupted", "run_batch", "driver", "compare_strategies", "describe_plan", "format_table",
           "Model", "ModelError", "load_gguf", "write_example_model", "ModelResult", "run_model_batch", "greedy"]
