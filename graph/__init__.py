"""llama.cpp-style batching for ggml-attn: batches, ubatch splits (incl. a padded split),
a unified / per-stream KV cache, ubatch masks, plans and ggml graphs.

Typical use::

    from ggml_attn.graph import Batch, split_ubatches, KVCache, build_mask
    batch = Batch.from_lengths(range(1, 11))           # 10 prompts of 1..10 tokens
    ubatches = split_ubatches(batch, 512, "padded")    # one ubatch 10x10, 45 pads
"""
from .batch import Batch, validate_batch
from .split import MODES, UBatch, split_ubatches
from .kv_cache import KVCache, KVCacheFullError, SlotInfo
from .mask import build_mask, visible_cells

__all__ = ["Batch", "validate_batch", "MODES", "UBatch", "split_ubatches", "KVCache",
           "KVCacheFullError", "SlotInfo", "build_mask", "visible_cells"]
