"""What both benchmark tools drive: batch -> ubatches -> KV cache -> graph -> compute.

The one place that talks to ``ggml_attn.graph`` (Batch, KVCache, the decode loop
``driver.decode``) and makes the *engine* that computes one planned ubatch through all layers
with the graph builder's ubatch graph (``graph_engine.GraphEngine``):

* :class:`~ggml_attn.cli.host_engine.HostEngine` - a host graph on ggml's CPU backend, attention
  by ``ggml_attn.flash_attn_ext`` (or ggml's own kernels with ``--kernel ggml`` / ``-fa off``);
* :class:`~ggml_attn.cli.cuda_engine.CudaEngine` - an all-custom graph over a CuPy KV cache,
  attention by ``ggml_attn.flash_attn_ext`` on the CUDA backend.

:class:`Runner.decode` mirrors ``llama_decode`` as llama-batched-bench calls it: the batch
is cut into ``n_batch`` views in token order, each view goes through ``driver.decode``
(validate, split with the configured strategy, check that the ubatches fit the cache, then
place, mask and compute them one after another; pad cells freed after their ubatch). With
``auto`` the ubatches and their plans are the ones its choice dry-ran (``choose_split``),
applied as they are: nothing is split, checked or planned twice.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from ggml_attn import dispatch, runtime

from .common import check_interrupt
from .errors import OutOfMemory, UserError
from .models import ModelShape

SPLITS = ("simple", "equal", "seq", "padded", "auto")
KERNELS = dispatch.KERNELS + ("ggml",)   # ggml: ggml's own flash attention (CPU)
DEVICES = ("auto", "cpu", "cuda")
LAYERS = ("attn", "full", "model")   # model: a .gguf file's own weights (graph/model.py)


def default_split(kv_unified: bool) -> str:
    """llama.cpp's choice: ``simple`` with one KV stream, ``equal`` with one per sequence."""
    return "simple" if kv_unified else "equal"


def splits_of(values, kv_unified: bool) -> list[str]:
    """``--split`` list values (a strategy, ``all`` for every one of :data:`SPLITS`, ``""`` for
    :func:`default_split`) -> the strategies to run, each once, in the order first named."""
    out = []
    for s in values:
        for x in (SPLITS if s == "all" else [s or default_split(kv_unified)]):
            if x not in out:
                out.append(x)
    return out


def cuda_available() -> bool:
    """True when CuPy sees a GPU and the project's CUDA backend loads (the op's own probe,
    ``ggml_attn.gpu_available``)."""
    from ggml_attn import gpu_available
    try:
        return bool(gpu_available())
    except Exception:  # noqa: BLE001 - any import/driver problem means "no GPU"
        return False


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when usable else ``cpu``; ``cuda`` without a GPU is a UserError."""
    if device == "cpu":
        return "cpu"
    ok = cuda_available()
    if device == "cuda" and not ok:
        raise UserError("--device cuda: no usable GPU (CuPy and ggml_attn.cuda_backend are needed)")
    return "cuda" if ok else "cpu"


def free_device_memory(device: str) -> None:
    """Give the memory of closed runners back to the device (CuPy keeps freed blocks in its
    pool for the process; a runner of another size may need them in one piece)."""
    import gc
    gc.collect()
    if device == "cuda":
        import cupy
        cupy.get_default_memory_pool().free_all_blocks()


@dataclass
class RunConfig:
    model: ModelShape
    n_ctx: int                      # cells of the KV cache (all streams together)
    n_seq: int = 1                  # sequences served (streams when not unified)
    kv_unified: bool = False
    split: str = ""                 # "" = default_split(kv_unified)
    n_batch: int = 2048
    n_ubatch: int = 512
    flash_attn: bool = True
    kernel: str = "auto"
    layer: str = "attn"
    device: str = "cpu"             # resolved: cpu or cuda
    n_threads: int = 1
    seed: int = 0
    type_k: str = "f16"             # K/V cache types (kv_types.CACHE_TYPES)
    type_v: str = "f16"
    cuda_graph: bool = True         # device engine: capture repeated ubatch shapes, replay them
    tp: object = None               # multi_gpu.RankContext of a -sm row/layer rank (None: one device)

    def __post_init__(self):
        self.split = self.split or default_split(self.kv_unified)
        check_batch_sizes(self.n_batch, self.n_ubatch)
        if self.split not in SPLITS:
            raise UserError(f"unknown split '{self.split}' (choose from {', '.join(SPLITS)})")
        if self.kernel not in KERNELS:
            raise UserError(f"unknown kernel '{self.kernel}' (choose from {', '.join(KERNELS)})")
        if self.layer not in LAYERS:
            raise UserError(f"unknown layer '{self.layer}' (choose from {', '.join(LAYERS)})")
        if self.layer == "model" and self.tp is not None and self.tp.n_rank > 1:
            raise UserError(f"--layer model (a .gguf's own weights) runs on one GPU or the CPU; -sm "
                            f"{self.tp.mode} over {self.tp.n_rank} GPUs runs --layer attn or full")
        if self.layer == "model" and not self.model.is_file:
            raise UserError(f"--layer model runs a model file's own weights: give -m FILE.gguf "
                            f"('{self.model.name}' is a preset: shapes only, random weights)")
        if self.layer == "model":
            from .models import check_model_file
            check_model_file(self.model.source, self.model.n_layer)
        from .kv_types import check_cache_types
        check_cache_types(self.type_k, self.type_v, device=self.device, flash_attn=self.flash_attn,
                          head_dim_k=self.model.head_dim_k, head_dim_v=self.model.head_dim_v, kernel=self.kernel,
                          n_gpu=self.tp.n_rank if self.tp is not None else 1)
        check_kv_fits(self)

    def kv_bytes(self) -> int:
        """Bytes of the KV cache this config asks for (all layers, the cache types' row sizes)."""
        return self.model.kv_bytes_per_token(self.type_k, self.type_v) * self.n_ctx


GPU_KERNELS = dispatch.GPU_KERNELS


def kernel_help() -> str:
    """``--kernel``'s help in both tools, from ``ggml_attn.dispatch``'s lists (never hard-coded:
    new kernels, e.g. sm_90a's prefill-wgmma and decode-tma, show up by themselves)."""
    return (f"attention kernel: {'|'.join(KERNELS)}; {', '.join(GPU_KERNELS)} run on the GPU only "
            f"(auto picks per call there, reference is ggml_attn's numpy path); ggml: ggml's own "
            f"flash attention (CPU baseline)")


def check_kernel(kernel: str, flash_attn: bool, device: str) -> None:
    """A row must not carry the name of a kernel that does not run: GPU-only kernels on the
    CPU (which runs ggml_attn's numpy path) and any kernel with ``-fa off`` (ggml's
    mul_mat+soft_max path) are UserErrors."""
    if not flash_attn and kernel != "auto":
        raise UserError(f"-fa off runs ggml's mul_mat+soft_max path, not the flash-attention "
                        f"kernel '{kernel}'; use -fa on with --kernel {kernel}, or -fa off alone")
    if device == "cpu" and kernel in GPU_KERNELS:
        raise UserError(f"--kernel {kernel} runs on the GPU only (the CPU runs ggml_attn's numpy "
                        f"path); on the CPU use --kernel auto, reference or ggml")


MAX_THREADS = runtime.MAX_THREADS   # the op's rule (runtime.check_n_threads), shared with compute_graph


def check_threads(n_threads: int) -> None:
    """``-t``: :func:`ggml_attn.runtime.check_n_threads`'s rule (1..MAX_THREADS), as a UserError
    (one line, exit 2)."""
    try:
        runtime.check_n_threads(n_threads, "-t")
    except ValueError as e:
        note = ""
        if isinstance(n_threads, int) and n_threads > MAX_THREADS:
            from .common import default_threads
            note = f"; this machine has {default_threads()} cores"
        raise UserError(f"{e}{note}") from None


def check_batch_sizes(n_batch: int, n_ubatch: int) -> None:
    if n_batch < 1 or n_ubatch < 1:
        raise UserError(f"batch sizes must be positive (n_batch {n_batch}, n_ubatch {n_ubatch})")
    if n_ubatch > n_batch:
        raise UserError(f"n_ubatch ({n_ubatch}) is larger than n_batch ({n_batch}); "
                        "a ubatch is a piece of a batch")


def effective_ubatch(n_batch: int, n_ubatch: int) -> int:
    """llama.cpp's ``llama_context``: ``n_ubatch = min(n_batch, n_ubatch)``, so ``-b 16 -ub 64``
    runs ubatches of 16 (and the rows report 16)."""
    if n_batch < 1 or n_ubatch < 1:
        raise UserError(f"batch sizes must be positive (n_batch {n_batch}, n_ubatch {n_ubatch})")
    return min(n_batch, n_ubatch)


def check_context(n_needed: int, n_ctx: int, what: str) -> None:
    """Context overflow -> UserError (one line, exit 2)."""
    if n_ctx and n_needed > n_ctx:
        raise UserError(f"context overflow: {what} needs {n_needed} KV cells but the context holds {n_ctx}")


@dataclass
class DecodeStats:
    """What one :meth:`Runner.decode` call did."""
    n_ubatches: int = 0
    n_pad: int = 0
    n_kv_max: int = 0
    shapes: list = field(default_factory=list)

    def add(self, other: "DecodeStats") -> None:
        self.n_ubatches += other.n_ubatches
        self.n_pad += other.n_pad
        self.n_kv_max = max(self.n_kv_max, other.n_kv_max)
        self.shapes.extend(other.shapes)


def ubatch_shape(ub) -> str:
    """``n_seqs x n_seq_tokens`` of a ubatch as llama.cpp's ``llama_ubatch`` holds them: a
    ``simple`` ubatch of N tokens is Nx1 (``split_simple`` adds every token as its own
    sequence row), an ``equal``/``padded`` one is sequences x tokens each, ``seq`` is 1xN."""
    if not ub.equal_seqs:
        return f"{ub.n_tokens}x1"
    return f"{ub.n_seqs}x{ub.n_seq_tokens}"


def compress_shapes(shapes: list[str]) -> list[str]:
    """``['10x1', '10x1', '9x1']`` -> ``['2*10x1', '9x1']``."""
    out, i = [], 0
    while i < len(shapes):
        j = i
        while j < len(shapes) and shapes[j] == shapes[i]:
            j += 1
        out.append(shapes[i] if j - i == 1 else f"{j - i}*{shapes[i]}")
        i = j
    return out


def _graph():
    try:
        from ggml_attn import graph
    except ImportError as e:  # pragma: no cover - graph/ is part of the package
        raise RuntimeError(f"ggml_attn.graph is missing: {e}") from e
    return graph


def n_rank(cfg: RunConfig) -> int:
    return cfg.tp.n_rank if cfg.tp is not None else 1


def split_mode(cfg: RunConfig) -> str:
    """``none`` (one device), ``row`` or ``layer``."""
    return cfg.tp.mode if n_rank(cfg) > 1 else "none"


def make_engine(cfg: RunConfig, cache):
    if cfg.device == "cuda" and split_mode(cfg) == "layer":
        from .layer_engine import LayerCudaEngine
        return LayerCudaEngine(cfg, cache)
    if cfg.device == "cuda" and n_rank(cfg) > 1:
        from .tp_engine import TPCudaEngine
        return TPCudaEngine(cfg, cache)
    if cfg.device == "cuda":
        from .cuda_engine import CudaEngine
        return CudaEngine(cfg, cache)
    from .host_engine import HostEngine
    return HostEngine(cfg, cache)


def memory_bytes(device: str) -> int | None:
    """The memory a KV cache of ``device`` could take at most: the GPU's (``cuda``) or the host's
    physical memory; None when it cannot be read."""
    try:
        if device == "cuda":
            import cupy
            return int(cupy.cuda.Device().mem_info[1])
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except Exception:  # noqa: BLE001 - unknown: the allocation itself decides
        return None


def check_kv_fits(cfg: RunConfig) -> None:
    """OutOfMemory (Runner's message) when ``cfg``'s KV cache -- a rank's share of it with ``-sm
    row`` (its heads) or ``-sm layer`` (its layers) -- could not fit its device's whole memory:
    one of RunConfig's checks, which the tools make before they print anything or make what a
    larger run needs (serve-bench's token ids, 4 bytes a prompt token against a cache's hundreds a
    cell), not when the cache is allocated."""
    m, sm = cfg.model, split_mode(cfg)
    share = 1 / n_rank(cfg) if sm == "row" else len(cfg.tp.layers(m.n_layer)) / m.n_layer if sm == "layer" else 1
    need, have = cfg.kv_bytes() * share, memory_bytes(cfg.device)
    if have is not None and need > have:
        raise OutOfMemory(f"not enough memory for a KV cache of {cfg.n_ctx} cells ({need / 2**30:.1f} GiB of "
                          f"{cfg.type_k}/{cfg.type_v}; the {'GPU' if cfg.device == 'cuda' else 'host'} has "
                          f"{have / 2**30:.1f} GiB)")


class Runner:
    """A KV cache, model weights and an engine; ``decode`` batches, ``clear`` the cache."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        g = _graph()
        m = cfg.model
        xp = "cupy" if cfg.device == "cuda" else None
        sm, n_layer, n_head_kv = split_mode(cfg), m.n_layer, m.n_head_kv
        if sm != "none":
            if cfg.device != "cuda":
                raise UserError(f"-sm {sm} ranks run on GPUs (--device cuda)")
            from .multi_gpu import check_model
            check_model(m, n_rank(cfg), cfg.layer, sm, cfg.tp.shares)
        if sm == "row":      # a -sm row rank holds n_head_kv / N heads of every cell (graph/shard.py)
            n_head_kv //= n_rank(cfg)
        elif sm == "layer":  # a -sm layer rank holds every head of its layers (graph/pipe.py)
            n_layer = len(cfg.tp.layers(m.n_layer))
        try:
            self.cache = g.KVCache(cfg.n_ctx, max(1, cfg.n_seq), unified=cfg.kv_unified,
                                   n_layer=n_layer, n_head_kv=n_head_kv, head_dim_k=m.head_dim_k,
                                   head_dim_v=m.head_dim_v, dtype=np.float16, xp=xp,
                                   type_k=cfg.type_k, type_v=cfg.type_v,
                                   # the CUDA kernels skip masked KV tiles: coarser n_kv, fewer graph shapes
                                   coarse_n_kv=cfg.device == "cuda" and cfg.flash_attn)
        except MemoryError as e:   # numpy's, or CuPy's OutOfMemoryError (a MemoryError)
            raise OutOfMemory(f"not enough memory for a KV cache of {cfg.n_ctx} cells "
                              f"({self._kv_gib():.1f} GiB of {cfg.type_k}/{cfg.type_v})") from e
        except ValueError as e:  # e.g. more than 256 sequences (LLAMA_MAX_SEQ)
            raise UserError(f"KV cache: {e}") from e
        try:
            self.engine = make_engine(cfg, self.cache)
        except MemoryError as e:
            self.cache = None   # the cache's memory goes back with this runner
            what = "the model's weights" if cfg.layer in ("full", "model") else "the engine's buffers"
            raise OutOfMemory(f"not enough memory for {what} (--layer {cfg.layer}, {m.size_bytes / 2**30:.1f} GiB of "
                              f"f16 weights at most) beside a KV cache of {cfg.n_ctx} cells "
                              f"({self._kv_gib():.1f} GiB)") from e

    def _kv_gib(self) -> float:
        """GiB of the KV cache this runner asks for (RunConfig.kv_bytes)."""
        return self.cfg.kv_bytes() / 2**30

    # ------------------------------------------------------------ batches
    def prompt_batch(self, lengths, seq_ids=None):
        """Prompts of ``lengths`` tokens for ``seq_ids`` (default 0..), continuing the cache."""
        g = _graph()
        ids = list(range(len(lengths))) if seq_ids is None else list(seq_ids)
        b = g.Batch.from_lengths(list(lengths), ids, start_pos=self.cache.next_positions(ids))
        if self.cfg.layer == "model":   # token ids inside the vocabulary (fixed pseudo-random, as llama-bench's)
            toks = (b.positions.astype(np.int64) * 7919 + b.primary_seq_ids * 104729 + 17) % self.cfg.model.n_vocab
            b = g.Batch(toks, b.positions, b.seq_ids)
        return b

    def step_batch(self, seq_ids):
        """One token for each of ``seq_ids`` at its next position (a decode step)."""
        return self.prompt_batch([1] * len(seq_ids), seq_ids)

    def split(self, batch):
        """The ubatches of ``batch`` under the configured strategy (no cache change)."""
        g = _graph()
        out = []
        for view in _batch_views(batch, self.cfg.n_batch):
            out.extend(self._split_view(g, view)[0])
        return out

    def attn_config(self):
        """The graph package's description of the attention stack (for ``auto``'s cost model);
        made once per model and seed (every decode step asks)."""
        m, seed = self.cfg.model, self.cfg.seed
        got = getattr(self, "_attn_config", None)  # (model, seed, config)
        if got is not None and got[0] is m and got[1] == seed:
            return got[2]
        own = getattr(getattr(self, "engine", None), "model", None)
        if own is not None:   # a GGUF's own (its scale, soft-cap and window's position limit: gemma2)
            self._attn_config = (m, seed, own.attn_config())
            return self._attn_config[2]
        g = _graph()
        acfg = g.AttnConfig(n_layer=m.n_layer, n_head=m.n_head, n_head_kv=m.n_head_kv,
                            head_dim_k=m.head_dim_k, head_dim_v=m.head_dim_v or None,
                            logit_softcap=m.logit_softcap, pos_limit=m.pos_limit, seed=self.cfg.seed)
        self._attn_config = (m, seed, acfg)
        return acfg

    def _split_view(self, g, view):
        """``(ubatches, plans)`` of ``view`` on the cache as it is now (``driver.split_batch``):
        ``auto`` hands back the plans it dry-ran; the other strategies split only."""
        try:
            return g.driver.split_batch(self.cache, view, self.cfg.n_ubatch, self.cfg.split, self.attn_config())
        except ValueError as e:
            raise UserError(f"split '{self.cfg.split}': {e}") from e

    def _user_error(self, stage: str, e: Exception) -> UserError:
        """The driver's checks before the first cell is claimed, as one-line UserErrors."""
        if stage == "validate":
            return UserError(str(e))
        if stage == "split":
            return UserError(f"split '{self.cfg.split}': {e}")
        if isinstance(e, _graph().KVCacheFullError):
            return UserError(f"context overflow: {e}")
        # e.g. simple split of several sequences into split KV
        return UserError(f"split '{self.cfg.split}' does not fit this KV cache: {e} "
                         f"(use -kvu or another --split)")

    # ------------------------------------------------------------ compute
    def decode(self, batch, *, sync: bool = True, logits=None, on_logits=None) -> DecodeStats:
        """Process ``batch`` like ``llama_decode`` in n_batch views (``graph.driver.decode``);
        returns what it did. A failed ubatch is rolled back and its cause raised (Ctrl-C as
        ``graph.driver.BatchInterrupted``). ``sync``: return after the device finished; with
        False the device may still be computing (the next step's host work overlaps it, as
        llama.cpp's decode does; a timer or :meth:`synchronize` waits for it): read nothing
        the device writes (cache, outputs) before :meth:`synchronize`.

        ``--layer model``: ``logits`` flags the tokens that get logits (bool ``(batch.n_tokens,)``;
        None: each sequence's last token, ``model_runner.output_flags``), and ``on_logits(idx,
        logits)`` is called after each ubatch with the int64 batch indices of its flagged tokens
        and their logits (an ``xp`` array valid until the next ubatch: ``GraphEngine.run_ubatch``)."""
        g = _graph()
        stats = DecodeStats()
        acfg = self.attn_config()
        start = 0
        for view in _batch_views(batch, self.cfg.n_batch):
            self.engine.batch = view   # --layer model: the token ids and which rows get logits
            self.engine.logits = "last" if logits is None else logits[start:start + view.n_tokens]
            done = None if on_logits is None else _logits_done(on_logits, start)
            start += view.n_tokens
            try:
                plans = g.driver.decode(self.cache, view, self.cfg.n_ubatch, self.cfg.split, self.engine, acfg,
                                        on_error=self._user_error, before_ubatch=check_interrupt, on_done=done)
            except g.BatchError as e:  # the cache holds the ubatches before it; report the cause
                if g.engine.out_of_device_memory(e.__cause__):   # a clear line, not a CUDA traceback
                    raise OutOfMemory(f"the device ran out of memory running ubatch {e.failed} of "
                                      f"{len(e.ubatches)} ({ubatch_shape(e.ubatches[e.failed])}; split "
                                      f"{self.cfg.split}, a KV cache of {self.cfg.n_ctx} cells, "
                                      f"{self._kv_gib():.1f} GiB): {e.__cause__}") from e.__cause__
                raise e.__cause__ from None
            for plan in plans:
                stats.n_ubatches += 1
                stats.n_pad += plan.ubatch.n_pad
                stats.n_kv_max = max(stats.n_kv_max, plan.n_kv)
                stats.shapes.append(ubatch_shape(plan.ubatch))
        if sync:
            self.engine.synchronize()
        check_interrupt()
        return stats

    def warm_up(self) -> None:
        """One prompt of 16 tokens (llama-batched-bench's warm-up) and one decode step, so that
        decode-shaped kernels load untimed too; the cache is cleared first."""
        self.clear()
        self.decode(self.prompt_batch([min(16, max(1, self.cache.kv_size // 2))]))
        self.decode(self.step_batch([0]))

    def runs_to_steady(self, decode_step: bool) -> int:
        """How many identical runs a warm-up needs before one runs as the next will (the engine's
        ``runs_to_steady``; 1 for an engine without one)."""
        f = getattr(self.engine, "runs_to_steady", None)
        return 1 if f is None else f(decode_step)

    def synchronize(self) -> None:
        """Wait until the device finished everything decoded so far."""
        self.engine.synchronize()

    def clear(self) -> None:
        """Empty the KV cache (``llama_memory_clear``)."""
        self.cache.seq_rm(-1)
        self.cache.head = [0] * self.cache.n_stream

    def seq_cp(self, src: int, dst: int) -> None:
        """Share ``src``'s cells with ``dst`` (``-pps``: one prompt for all sequences). Across
        split-KV streams this copies K/V: on the GPU engine's stream, ordered with its work."""
        stream = getattr(self.engine, "stream", None)
        if stream is None:
            self.cache.seq_cp(src, dst)
            return
        with stream:
            self.cache.seq_cp(src, dst)

    def timer(self):
        return self.engine.timer()

    def close(self) -> None:
        self.engine.close()


def _logits_done(on_logits, start: int):
    """``driver.decode``'s ``on_done`` for a view starting at batch token ``start``: the engine's
    ``(token_idx, logits)`` to ``on_logits`` with indices into the whole batch."""
    def done(plan, res):
        if res is not None:
            on_logits(res[0] + start, res[1])
    return done


def _batch_views(batch, n_batch: int):
    """Consecutive views of at most ``n_batch`` tokens (llama-batched-bench's decode_helper)."""
    if batch.n_tokens <= n_batch:
        yield batch
        return
    for i in range(0, batch.n_tokens, n_batch):
        yield batch.view(i, min(i + n_batch, batch.n_tokens))
