"""GPU backend of ``flash_attn_ext``: validation, launch configuration, plans, staging.

Entry points (all tensor arguments are :class:`~ggml_attn.tensor.TensorDesc` in ggml order):

- :func:`available` -- CuPy importable and a CUDA device present (cached, never raises).
- :func:`flash_attn_ext_device` -- device pointers in, kernels launched directly (raw pointers,
  one ``cuLaunchKernel`` per kernel, no CuPy arrays on the hot path).
- :func:`flash_attn_ext_host` -- host pointers in; staged through reused pinned + device buffers.
- :func:`make_plan` -- the per-ubatch map of live (query tile, KV tile) pairs, built on the GPU
  once from the mask and reused by every layer.

Shapes (ggml_flash_attn_ext's, ggml order): q f32 [D_k, n_batch, n_head, ne3] (any byte strides, nb0 = 4);
k/v f16|bf16 [D, n_kv, n_head_kv, ne3] (rows contiguous, 16-byte aligned); mask f16
[n_kv, n_rows >= n_batch, ne32, ne33]; sinks f32 [n_head]; dst f32 contiguous
[D_v, n_head, n_batch, ne3].
"""
from __future__ import annotations

import ctypes
import math
import threading
import warnings
from dataclasses import dataclass, field, replace

import numpy as np

from . import dispatch
from . import kernels as K
from .dtypes import GGML_TYPE_BF16, GGML_TYPE_F16, GGML_TYPE_F32, TYPE_NAMES, TYPE_SIZES
from .tensor import TensorDesc
from .validate import check_flash_attn_args

__all__ = ["available", "bind", "BoundCall", "flash_attn_ext_device", "flash_attn_ext_host", "make_plan", "Plan",
           "LaunchConfig", "launch_config"]

_AVAILABLE: bool | None = None
_WARNED: set[str] = set()


def available() -> bool:
    """True when CuPy imports and at least one CUDA device is visible. Cached; never raises."""
    global _AVAILABLE
    if _AVAILABLE is None:
        try:
            K.ensure_cuda_namespace()
            import cupy
            _AVAILABLE = cupy.cuda.runtime.getDeviceCount() > 0
        except Exception:
            _AVAILABLE = False
    return _AVAILABLE


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        warnings.warn(f"ggml_attn.cuda_backend: {msg}", RuntimeWarning, stacklevel=3)


# ---------------------------------------------------------------------------------------
# validation
@dataclass(frozen=True)
class Shapes:
    d_k: int
    d_v: int
    n_batch: int
    n_head: int
    n_head_kv: int
    ne3: int
    n_kv: int
    kv_type: int
    ne32: int = 1
    ne33: int = 1

    @property
    def gqa(self) -> int:
        return self.n_head // self.n_head_kv


def validate(q: TensorDesc, k: TensorDesc, v: TensorDesc, mask: TensorDesc | None,
             sinks: TensorDesc | None, dst: TensorDesc, scale: float = 1.0, max_bias: float = 0.0,
             logit_softcap: float = 0.0) -> Shapes:
    """ggml's rules for the op (:func:`ggml_attn.validate.check_flash_attn_args`, the one set of
    rules and messages) plus what the GPU entry points add: K and V of one float type, a
    contiguous f32 ``dst`` of the result's shape. ValueError naming the tensor at fault."""
    dims = check_flash_attn_args(q, k, v, mask, sinks, max_bias, scale, logit_softcap, mask_rows_only=True)
    if k.type != v.type:
        raise ValueError(f"k and v must have the same type: {k.shape_str} vs {v.shape_str}")
    if k.type not in (GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16):
        raise ValueError(f"k/v type {TYPE_NAMES.get(k.type, k.type)} is not supported by the GPU "
                         f"entry points: {k.shape_str}")
    want = dims.out_ne
    if dst.type != GGML_TYPE_F32 or tuple(dst.ne) != want or not dst.is_contiguous():
        raise ValueError(f"dst must be contiguous f32 {list(want)}, got {dst.shape_str} nb={dst.nb}")
    return Shapes(dims.d_k, dims.d_v, dims.n_batch, dims.n_head, dims.n_head_kv, dims.ne3, dims.n_kv,
                  k.type, dims.mask_heads, dims.mask_streams)


def facts(sh: Shapes, kv_aligned: bool = True) -> dispatch.CallFacts:
    """The facts :func:`ggml_attn.dispatch.best_kernel` decides on, from validated shapes."""
    return dispatch.CallFacts(sh.n_batch, sh.gqa, sh.n_kv, sh.d_k, sh.d_v, sh.kv_type, kv_aligned)


def _kv_aligned(t: TensorDesc) -> bool:
    return all(x % 16 == 0 for x in (t.ptr, t.nb[1], t.nb[2], t.nb[3]))


# ---------------------------------------------------------------------------------------
# launch configuration
def _pow2_divisor(n: int) -> int:
    return n & -n


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


_NUM_SMS: int | None = None


def num_sms() -> int:
    global _NUM_SMS
    if _NUM_SMS is None:
        try:
            import cupy
            _NUM_SMS = int(cupy.cuda.Device().attributes["MultiProcessorCount"])
        except Exception:
            _NUM_SMS = 132
    return _NUM_SMS


@dataclass(frozen=True)
class LaunchConfig:
    kernel: str           # prefill | decode | decode-tc
    variant: K.Variant
    name: str             # name expression of the instance
    pack: int             # query heads per tile
    q_tile_tokens: int    # tokens per query tile (plan granularity)
    n_q_tiles: int
    n_kv_tiles: int
    n_splits: int
    block: int            # threads
    smem: int
    grid: tuple[int, int, int]
    rows: int = 0               # query rows (token, head) of one block
    fused_finish: bool = True   # the instance merges its own splits (split_finish): the tensor-core
    # kernels' 64-row and decode tiles up to D_K 256; not the 128-row prefill tiles or larger
    # heads (at the register limit) nor the CUDA-core decode kernel (ptxas then caps it at 128 registers and
    # spills): fattn_combine finishes those

    def finishes_splits(self) -> bool:
        """True when this launch's kernel merges its splits itself: an instance that can, and
        shared memory for the merge's per-split weights (``split_finish_floats``)."""
        return self.fused_finish and 4 * (self.rows * (self.n_splits + 2) + 2) <= self.smem


# Waves of blocks wanted when the grid alone does not fill the GPU: decode splits the KV range
# until the grid covers this many waves of resident blocks (the occupancy API's count for the
# kernel, block size and shared memory), so that the last, partial wave costs little.
_WAVES = {"prefill": 1, "decode-tc": 1, "decode": 2}
# K/V ring depth of decode-tc: 2 stages (two blocks per SM at D 128) beat 3 (115.7 KB: one
# block per SM) at every decode size on the H200 (bench/NOTES.md, v7)
DECODE_TC_STAGES = 2
# query heads of one KV head packed into the rows of a 64-row prefill tile when the plan found
# a ragged batch (wide is False): K/V tiles shared by the packed heads and 16-token tiles that
# straddle fewer prompts; 4 took 16 / 64 short prompts from 42.9 / 173.4 to 39.5 / 158.0 us (v7)
PREFILL_PACK = 4
_MIN_TILES_PER_SPLIT = 4     # 256 KV cells: fewer makes the combine pass dominate
_MAX_SPLITS = 128            # <= FATTN_MAX_SPLITS in fattn_util.cu
_MAX_GRID_Y = 65535
# prefill switches to 128-row query tiles (MT = 2: 32 rows per warp, FA2 load order) from this
# many query tokens per stream on: half the shared-memory traffic per MMA of 64-row tiles
PREFILL_WIDE_MIN_BATCH = 256
# ... unless the plan finds fewer live KV tiles than this per 64-row query tile on average:
# ragged batches of short prompts (2-3 live tiles per query tile) ran 1.1-1.3x slower on the
# wide tiles on the H200 (bench/NOTES.md, v5), long causal prompts (8-130) 1.15-1.2x faster
PREFILL_WIDE_MIN_LIVE = 6.0


def _split_count(base: int, slots: int, waves: int, n_kv_tiles: int) -> int:
    """KV splits for ``base`` blocks on ``slots`` resident-block slots: the smallest count that
    reaches ``waves`` waves, raised to the count whose last wave is fullest among those up to
    twice that (wave quantisation: 528 blocks on 264 slots run as 2 full waves, 530 as 3)."""
    if base >= slots * waves:
        return 1
    cap = max(1, min(_MAX_SPLITS, n_kv_tiles // _MIN_TILES_PER_SPLIT))
    want = min(-(-slots * waves // base), cap)
    best, best_eff = want, 0.0
    for n in range(want, min(2 * want, cap) + 1):
        blocks = base * n
        eff = blocks / (-(-blocks // slots) * slots)   # fraction of the last wave's slots used
        if eff > best_eff + 1e-9:
            best, best_eff = n, eff
    return best


def launch_config(kernel: str, sh: Shapes, n_splits: int | None = None, *, ext: bool = False,
                  blocks_per_sm: int | None = None, wide: bool | None = None,
                  max_live: dict | None = None) -> LaunchConfig:
    """Tile shape, packing, grid and KV split count for ``kernel`` on shapes ``sh``.
    ``ext``: softcap or ALiBi in use (the tensor-core kernels' EXT instance).
    ``blocks_per_sm``: resident blocks per SM (default: the occupancy API on the current
    device, 2 without one). ``wide``: the plan's verdict on 128-row prefill tiles (None: by
    n_batch alone). ``max_live``: the plan's most live KV tiles of any query tile, per tile
    size (the split count is sized from it instead of n_kv)."""
    gqa_p2 = _pow2_divisor(sh.gqa)
    n_kv_tiles = max(1, -(-sh.n_kv // K.KV_TILE))
    if kernel == "prefill":
        want = _pow2_ceil(max(1, -(-64 // max(sh.n_batch, 1))))
        pack = min(gqa_p2, 16, max(want, PREFILL_PACK if wide is False else 1))
        mt = 2 if (pack == 1 and sh.n_batch >= PREFILL_WIDE_MIN_BATCH and wide is not False
                   and max(sh.d_k, sh.d_v) <= K.WIDE_MAX_HEAD) else 1
        tq = 64 * mt // pack
        st = 1 if mt == 2 else 2
        variant = K.mma_variant(sh.d_k, sh.d_v, sh.kv_type, ext)
        name = K.mma_name(sh.d_k, sh.d_v, sh.kv_type, 4, 1, mt, st, ext)
        block, smem = 128, K.mma_smem_bytes(sh.d_k, sh.d_v, 4, 1, mt, st)
    elif kernel == "decode-tc":
        pack = min(gqa_p2, 16)
        tq = 16 // pack
        variant = K.mma_variant(sh.d_k, sh.d_v, sh.kv_type, ext)
        name = K.mma_name(sh.d_k, sh.d_v, sh.kv_type, 1, 4, 1, DECODE_TC_STAGES, ext)
        block, smem = 128, K.mma_smem_bytes(sh.d_k, sh.d_v, 1, 4, 1, DECODE_TC_STAGES)
    elif kernel == "decode":
        allowed = K.vec_rows_allowed(sh.d_k, sh.d_v)
        rmax = max(allowed)
        pack = min(gqa_p2, rmax)
        need = pack * min(sh.n_batch, rmax // pack)
        rows = min(r for r in allowed if r >= need)
        tq = rows // pack
        variant = K.vec_variant(sh.d_k, sh.d_v, sh.kv_type)
        name = K.vec_name(sh.d_k, sh.d_v, sh.kv_type, rows)
        block, smem = 128, K.vec_smem_bytes(sh.d_k, sh.d_v, rows)
    else:
        raise ValueError(f"no launch configuration for kernel {kernel!r}")
    n_q_tiles = -(-sh.n_batch // tq)
    base = n_q_tiles * (sh.n_head // pack) * sh.ne3
    if n_splits is None:
        if blocks_per_sm is None:
            blocks_per_sm = _occupancy(variant, name, block, smem)
        live = (max_live or {}).get(tq, n_kv_tiles)
        n_splits = _split_count(base, num_sms() * blocks_per_sm, _WAVES[kernel], max(1, live))
    n_splits = max(1, min(int(n_splits), n_kv_tiles, 256))
    if kernel == "decode":
        grid = (n_q_tiles, sh.n_head // pack, sh.ne3 * n_splits)
    else:   # tensor-core kernels: heads fastest, query tiles (reversed in the kernel) second
        if n_q_tiles > _MAX_GRID_Y:
            raise ValueError(f"n_batch {sh.n_batch} needs {n_q_tiles} query tiles of {tq} tokens "
                             f"for kernel {kernel!r}; at most {_MAX_GRID_Y}")
        grid = (sh.n_head // pack, n_q_tiles, sh.ne3 * n_splits)
    return LaunchConfig(kernel, variant, name, pack, tq, n_q_tiles, n_kv_tiles, n_splits,
                        block, smem, grid, rows=tq * pack,
                        fused_finish=sh.d_k <= 256 and (kernel == "decode-tc" or (kernel == "prefill" and mt == 1)))


_OCCUPANCY: dict[tuple, int] = {}


def _occupancy(variant: K.Variant, name: str, block: int, smem: int) -> int:
    """Resident blocks per SM of one kernel instance (occupancy API; 2 without a GPU)."""
    if not available():
        return 2
    import cupy
    key = (variant, name, block, smem, cupy.cuda.runtime.getDevice())
    n = _OCCUPANCY.get(key)
    if n is None:
        n = max(1, K.get_function(variant, name, smem=smem).occupancy(block))
        _OCCUPANCY[key] = n
    return n


# ---------------------------------------------------------------------------------------
# plans: live (query tile, KV tile) lists built from the mask on the GPU
def _stream_ptr(stream) -> int:
    if stream is None:
        import cupy
        return cupy.cuda.get_current_stream().ptr
    if isinstance(stream, int):
        return stream
    return int(stream.ptr)


def _params_common(q, k, v, mask, sinks, dst, sh: Shapes, scale, max_bias, softcap) -> K.FattnParams:
    p = K.FattnParams()
    p.q, p.k, p.v, p.dst = q.ptr, k.ptr, v.ptr, dst.ptr
    p.mask = mask.ptr if mask is not None else 0
    p.sinks = sinks.ptr if sinks is not None else 0
    p.q_nb1, p.q_nb2, p.q_nb3 = q.nb[1], q.nb[2], q.nb[3]
    p.k_nb1, p.k_nb2, p.k_nb3 = k.nb[1], k.nb[2], k.nb[3]
    p.v_nb1, p.v_nb2, p.v_nb3 = v.nb[1], v.nb[2], v.nb[3]
    if mask is not None:
        p.m_nb1, p.m_nb2, p.m_nb3 = mask.nb[1], mask.nb[2], mask.nb[3]
    p.n_batch, p.n_kv, p.n_head, p.n_head_kv = sh.n_batch, sh.n_kv, sh.n_head, sh.n_head_kv
    p.ne3, p.ne32, p.ne33, p.gqa = sh.ne3, sh.ne32, sh.ne33, sh.gqa
    if softcap != 0.0:
        scale = scale / softcap
    p.scale, p.softcap = float(scale), float(softcap)
    p.use_alibi = int(max_bias > 0.0)
    n_head_log2 = 1 << int(math.floor(math.log2(sh.n_head)))
    p.n_head_log2 = n_head_log2
    if max_bias > 0.0:
        p.m0 = 2.0 ** (-max_bias / n_head_log2)
        p.m1 = 2.0 ** (-(max_bias / 2.0) / n_head_log2)
    p.d_v = sh.d_v
    return p


@dataclass
class Plan:
    """Live KV tiles per (mask stream plane, query tile), for one ubatch's mask.

    Built on the GPU by :func:`make_plan` (or lazily for a tile size not built yet) and valid
    as long as the mask's contents do not change. Layout per tile size ``tq`` (tokens per
    query tile): ``idx`` int32 [ne33][n_q_tiles][n_kv_tiles] (numpy order) of entries
    ``tile id | class bits`` (FULL / PARTIAL / PARTIAL|MASKED, cuda/fattn_common.cuh),
    ``cnt`` int32 [ne33][n_q_tiles]; after the entries, in the same buffer (:func:`live_words`),
    u64 [ne33][n_q_tiles][n_kv_tiles][ne32] hidden-column words in list order (a HIDDEN tile's
    columns that no token of the query tile sees, per mask head plane: the kernels zero-fill
    their V rows). Shared by every tile size: ``lohi`` int32
    [ne33][ne32][n_batch][2], each mask row's visible interval [lo, hi), or (-1, -1) when the
    row is not one interval of zeros.

    Invariant: a plan is only used with the mask it was built from -- the op and
    :func:`flash_attn_ext_device` use it only when ``mask.ptr`` (and shape, strides, n_batch)
    equal the call's (:meth:`matches`), so a tile map built lazily by :meth:`live` reads the
    same mask as the maps built by :func:`make_plan`. Whoever keeps a plan across graphs must
    rebuild it when the mask tensor moves (graph/build.py does).

    Streams: each thing the plan builds (row intervals, each tile map, the aligned mask) is
    built on some stream and a CUDA event is recorded after it; using it on another stream
    makes that stream wait for the event (nothing is added when the streams are the same).
    """
    mask: TensorDesc
    n_batch: int
    n_head: int
    n_head_kv: int
    # what the plan built on the GPU, each as (value, built-on stream, event recorded after it):
    #   "lohi" -> the row intervals; ("map", tq) -> (idx, cnt, flags, (idx_ptr, cnt_ptr, lohi_ptr),
    #   buf, hidden) (_build_live_map);
    #   "aligned" -> (TensorDesc, cupy array), the 16-byte aligned copy of the mask
    items: dict = field(default_factory=dict)
    # host statistics read once by make_plan (one synchronization per ubatch):
    wide: bool | None = None       # 128-row prefill tiles pay off (enough live tiles per row tile)
    max_live: dict = field(default_factory=dict)   # tq -> most live KV tiles of any query tile
    _live_key: tuple = ()                          # max_live as a sorted tuple (kept by read_stats)

    def hint(self) -> tuple:
        """What the launch configuration takes from the plan (part of the call cache key; read
        on every call, so nothing is computed here)."""
        return self.wide, self._live_key

    def read_stats(self, tq: int, stream: int) -> tuple[int, float]:
        """(most, mean) live KV tiles per query tile of ``tq`` tokens; synchronizes ``stream``."""
        import cupy
        cnt_d = self._map(tq, stream)[1]
        with cupy.cuda.ExternalStream(stream):
            cnt = cnt_d.get()
        mx = int(cnt.max()) if cnt.size else 0
        self.max_live[tq] = mx
        self._live_key = tuple(sorted(self.max_live.items()))
        return mx, float(cnt.mean()) if cnt.size else 0.0

    def matches(self, mask: TensorDesc | None, n_batch: int) -> bool:
        return mask is not None and mask.ptr == self.mask.ptr and mask.ne == self.mask.ne \
            and mask.nb == self.mask.nb and n_batch == self.n_batch

    def _get(self, key, stream: int, build):
        """The plan's item ``key``, built by ``build(stream)`` on first use with an event recorded
        after it; a stream other than the one it was built on waits for that event first."""
        got = self.items.get(key)
        if got is None:
            import cupy
            value = build(stream)
            ev = cupy.cuda.Event(block=False, disable_timing=True)
            cupy.cuda.runtime.eventRecord(ev.ptr, stream)
            self.items[key] = got = (value, stream, ev)
        elif got[1] != stream:   # built on another stream: order this one after it
            import cupy
            cupy.cuda.runtime.streamWaitEvent(stream, got[2].ptr, 0)
        return got[0]

    def _map(self, tq: int, stream: int):
        def build(st):   # the map's event covers the row intervals it read
            lohi = self._get("lohi", st, lambda s2: _build_row_intervals(self.mask, self.n_batch, s2))
            return _build_live_map(self.mask, self.n_batch, tq, st, lohi)
        return self._get(("map", tq), stream, build)

    def live(self, tq: int, stream: int):
        """(idx_ptr, cnt_ptr, lohi_ptr) for query tiles of ``tq`` tokens; builds the map if missing."""
        return self._map(tq, stream)[3]

    def live_counts(self, tq: int, stream: int = None) -> np.ndarray:
        """Host copy of the live-tile counts, numpy [ne33, n_q_tiles] (for tests and stats)."""
        return self._map(tq, _stream_ptr(stream))[1].get().reshape(self.mask.ne[3], -1)

    def tile_classes(self, tq: int, stream: int = None) -> dict[str, int]:
        """Host count of live tiles per class over all (plane, query tile): FULL, PARTIAL
        (index comparisons) and MASKED (mask tile loaded) -- for tests and benchmarks."""
        idx_d, cnt_d = self._map(tq, _stream_ptr(stream))[:2]
        idx, cnt = idx_d.get(), cnt_d.get()
        n_kv_tiles = idx.size // max(cnt.size, 1)
        ent = np.concatenate([idx[i * n_kv_tiles:i * n_kv_tiles + c] for i, c in enumerate(cnt)]) \
            if cnt.size else np.zeros(0, np.int32)
        partial, masked = (ent & (1 << 30)) != 0, (ent & (1 << 29)) != 0
        return {"FULL": int((~partial).sum()), "PARTIAL": int((partial & ~masked).sum()),
                "MASKED": int(masked.sum()), "HIDDEN": int(((ent & (1 << 28)) != 0).sum())}

    def hidden_columns(self, tq: int, stream: int = None) -> dict:
        """Host copy of the hidden-column words of the HIDDEN tiles (for tests):
        {(i33, query tile, KV tile): [word per mask head plane]}, bit c of a word = column c of
        the tile is -inf for every token of the query tile in that plane (or past n_kv)."""
        m = self._map(tq, _stream_ptr(stream))
        idx, cnt, buf = m[0].get(), m[1].get(), m[4]
        ne32, ne33 = self.mask.ne[2], self.mask.ne[3]
        n_q_tiles = cnt.size // ne33
        n_kv_tiles = idx.size // max(cnt.size, 1)
        off, _ = live_words(ne33, n_q_tiles, n_kv_tiles, ne32)
        words = buf[off:].get().view(np.uint64).reshape(ne33, n_q_tiles, n_kv_tiles, ne32)
        out = {}
        for i33 in range(ne33):
            for qt in range(n_q_tiles):
                slot = i33 * n_q_tiles + qt
                for j in range(int(cnt[slot])):
                    e = int(idx[slot * n_kv_tiles + j])
                    if e & (1 << 28):
                        out[(i33, qt, e & ((1 << 28) - 1))] = [int(w) for w in words[i33, qt, j]]
        return out

    def refresh(self, stream=None) -> None:
        """The mask's contents changed (same tensor, same shape): rebuild everything this plan
        built -- row intervals, each tile map, the aligned copy -- into the same buffers, on
        ``stream``, launches only (no allocation, no synchronization: a CUDA graph captures
        it). The statistics read at build time (tile height, split counts) are kept; the
        kernels stay right whatever they are (they only size the work)."""
        st = _stream_ptr(stream)
        got = self.items.get("lohi")
        if got is None:
            return
        lohi = _build_row_intervals(self.mask, self.n_batch, st, into=got[0])
        for key, (val, _, _) in list(self.items.items()):
            if isinstance(key, tuple) and key[0] == "map":
                _build_live_map(self.mask, self.n_batch, key[1], st, lohi, into=val)
        got = self.items.get("aligned")
        if got is not None:
            _aligned_mask_copy(self.mask, self.n_batch, st, into=got[0])

    def aligned(self, stream: int) -> TensorDesc:
        """The mask with 16-byte aligned rows for the tensor-core kernels (copied once)."""
        return self._get("aligned", stream, lambda st: _aligned_mask_copy(self.mask, self.n_batch, st))[0]


def _mask_params(mask: TensorDesc, n_batch: int) -> K.FattnParams:
    p = K.FattnParams()
    p.mask = mask.ptr
    p.m_nb1, p.m_nb2, p.m_nb3 = mask.nb[1], mask.nb[2], mask.nb[3]
    p.n_batch, p.n_kv, p.ne32, p.ne33 = n_batch, mask.ne[0], mask.ne[2], mask.ne[3]
    return p


def _build_row_intervals(mask: TensorDesc, n_batch: int, stream: int, into=None):
    """Pass 0 of the plan: each row's visible interval, cupy int32 [ne33][ne32][n_batch][2]
    (written into ``into``, the array of an earlier build, when given: nothing allocated)."""
    import cupy
    _, _, ne32, ne33 = mask.ne
    lohi = into
    if lohi is None:
        with cupy.cuda.ExternalStream(stream):
            lohi = cupy.empty((ne33, ne32, n_batch, 2), dtype=cupy.int32)
    fn = K.get_function(K.util_variant(), "fattn_mask_rows")
    fn.launch((n_batch, ne32, ne33), (128, 1, 1), stream, _mask_params(mask, n_batch),
              ctypes.c_uint64(lohi.data.ptr))
    return lohi


def live_words(ne33: int, n_q_tiles: int, n_kv_tiles: int, ne32: int) -> tuple[int, int]:
    """int32 words of a tile map's live_idx buffer: (offset of the hidden-column words, total).
    The entries [ne33][n_q_tiles][n_kv_tiles] come first, rounded up to an even count, then one
    u64 per (entry, mask head plane): live_hidden() in cuda/fattn_common.cuh reads the same."""
    n = ne33 * n_q_tiles * n_kv_tiles
    off = n + (n & 1)
    return off, off + 2 * n * ne32


def _build_live_map(mask: TensorDesc, n_batch: int, tq: int, stream: int, lohi, into=None):
    """Passes 1-2 of the plan for query tiles of ``tq`` tokens: (idx, cnt, flags, (idx_ptr,
    cnt_ptr, lohi_ptr), buf, hidden). ``idx`` is a view of the first entries of ``buf``, whose
    tail holds the hidden-column words in list order (:func:`live_words`); ``hidden`` the
    scan's words in tile order (kept alive with the map, read by the compaction). ``into``: the
    tuple of an earlier build, whose buffers are written again (nothing allocated)."""
    import cupy
    n_kv, _, ne32, ne33 = mask.ne
    n_q_tiles = -(-n_batch // tq)
    n_kv_tiles = max(1, -(-n_kv // K.KV_TILE))
    n = ne33 * n_q_tiles * n_kv_tiles
    off, total = live_words(ne33, n_q_tiles, n_kv_tiles, ne32)
    if into is not None:
        _, cnt, flags, _, buf, hidden = into
    else:
        with cupy.cuda.ExternalStream(stream):
            flags = cupy.empty(n, dtype=cupy.uint8)
            buf = cupy.empty(total, dtype=cupy.int32)
            hidden = cupy.empty(n * ne32, dtype=cupy.uint64)
            cnt = cupy.empty(ne33 * n_q_tiles, dtype=cupy.int32)
    idx = buf[:n]
    p = _mask_params(mask, n_batch)
    p.q_tile_tokens, p.n_q_tiles, p.n_kv_tiles = tq, n_q_tiles, n_kv_tiles
    var = K.util_variant()
    scan = K.get_function(var, "fattn_mask_scan")
    compact = K.get_function(var, "fattn_mask_compact")
    scan.launch((n_kv_tiles, n_q_tiles, ne33), (128, 1, 1), stream, p, ctypes.c_uint64(flags.data.ptr),
                ctypes.c_uint64(lohi.data.ptr), ctypes.c_uint64(hidden.data.ptr))
    compact.launch((n_q_tiles, ne33, 1), (32, 1, 1), stream, p, ctypes.c_uint64(flags.data.ptr),
                   ctypes.c_uint64(buf.data.ptr), ctypes.c_uint64(cnt.data.ptr),
                   ctypes.c_uint64(hidden.data.ptr))
    return idx, cnt, flags, (buf.data.ptr, cnt.data.ptr, lohi.data.ptr), buf, hidden


def mask_needs_aligned_copy(mask: TensorDesc) -> bool:
    """True when the mask's pointer or a byte stride is not a multiple of 16: the tensor-core
    kernels load mask tiles with 16-byte cp.async."""
    return mask.ptr % 16 != 0 or any(nb % 16 for n, nb in zip(mask.ne[1:], mask.nb[1:]) if n > 1)


def _aligned_mask_copy(mask: TensorDesc, n_batch: int, stream: int, into=None):
    """f16 copy of the first n_batch rows of ``mask`` (ggml order [n_kv, rows, ne32, ne33])
    with rows padded to a multiple of 8 cells: (its desc, the CuPy array); ``into``: the result
    of an earlier copy, written again."""
    import cupy
    from .tensor import from_array
    n_kv, _, ne32, ne33 = mask.ne
    src_mem = cupy.cuda.UnownedMemory(mask.ptr, mask.nbytes_span(), None)
    src = cupy.ndarray((ne33, ne32, n_batch, n_kv), cupy.float16, cupy.cuda.MemoryPointer(src_mem, 0),
                       strides=tuple(reversed(mask.nb)))
    with cupy.cuda.ExternalStream(stream):
        buf = into[1] if into is not None else cupy.empty((ne33, ne32, n_batch, -(-n_kv // 8) * 8),
                                                          dtype=cupy.float16)
        view = buf[..., :n_kv]
        cupy.copyto(view, src)
    return from_array(view, GGML_TYPE_F16, mask.name), buf


def make_plan(mask: TensorDesc, n_batch: int, n_head: int, n_head_kv: int, *,
              d_k: int = 128, d_v: int | None = None, kv_type: int = GGML_TYPE_F16,
              ne3: int | None = None, kernel: str = "auto", stream=None) -> Plan:
    """Build the live-tile plan of one ubatch from its device-resident ``mask``.

    ``mask`` f16 [n_kv, n_rows >= n_batch, ne32, ne33] (ggml order). The map for the tile shape
    that ``kernel`` (with "auto": dispatch) uses at these shapes is built now; other tile
    shapes are built on first use. Reuse the plan for every layer of the ubatch. Reads the
    live-tile counts back to the host once (one synchronization of ``stream``): the prefill
    tile height and the decode split count follow the live tiles, not n_kv.
    """
    if mask is None:
        raise ValueError("make_plan needs a mask")
    d_v = d_k if d_v is None else d_v
    ne3 = mask.ne[3] if ne3 is None else ne3
    plan = Plan(mask, n_batch, n_head, n_head_kv)
    sh = Shapes(d_k, d_v, n_batch, n_head, n_head_kv, ne3, mask.ne[0], kv_type, mask.ne[2], mask.ne[3])
    kern = dispatch.best_kernel(kernel, facts(sh)).kernel
    if kern in dispatch.GPU_KERNELS:
        st = _stream_ptr(stream)
        if kern == "prefill":   # mean live KV tiles per 64-token query tile decide the height
            _, mean = plan.read_stats(64 if n_batch >= 64 else launch_config(kern, sh).q_tile_tokens, st)
            plan.wide = mean >= PREFILL_WIDE_MIN_LIVE
        cfg = launch_config(kern, sh, wide=plan.wide)
        plan.read_stats(cfg.q_tile_tokens, st)
        if kern != "decode" and mask_needs_aligned_copy(mask):
            plan.aligned(st)
    return plan


# ---------------------------------------------------------------------------------------
# workspace (split partials), per (device, stream, thread), grown as needed: the null stream
# is 0 on every device and in every thread, so the stream alone must not pick the buffer
_WS: dict[tuple, object] = {}


def _workspace(dev: int, stream: int, nbytes: int):
    """(pointer, buffer) of at least ``nbytes``; a bound call keeps the buffer, so growing it
    for a later call never frees memory an earlier bound call still launches with."""
    import cupy
    key = (dev, stream, threading.get_ident())
    buf = _WS.get(key)
    if buf is None or buf.size < nbytes:
        with cupy.cuda.ExternalStream(stream):
            buf = cupy.empty(max(nbytes, 1 << 20), dtype=cupy.uint8)
        _WS[key] = buf
    return buf.data.ptr, buf


# Split-KV finish: True -- the attention kernel's last block of each row group merges the
# splits (one launch per call; LaunchConfig.fused_finish says which instances can); False -- a
# fattn_combine launch after the kernel. The launch is the default: on the H200 the fused merge,
# done by one block per row group, costs 0.6-3 us more device time than a combine kernel spread
# over one block per row (bench/NOTES.md, "Split finish"); it saves one launch of host time.
FUSED_SPLIT_FINISH = False
_CNT: dict[tuple, object] = {}


def _split_counters(dev: int, stream: int, n: int):
    """(pointer, buffer) of at least ``n`` int32 counters, zero between launches: made zeroed,
    and every kernel that counts in them sets its counters back to 0 (``split_finish``). Per
    (device, stream, thread) like the workspace; calls on one stream run one after another."""
    import cupy
    key = (dev, stream, threading.get_ident())
    buf = _CNT.get(key)
    if buf is None or buf.size < n:
        with cupy.cuda.ExternalStream(stream):
            buf = cupy.zeros(max(n, 4096), dtype=cupy.int32)
        _CNT[key] = buf
    return buf.data.ptr, buf


# ---------------------------------------------------------------------------------------
# entry points
def _resolve_kernel(kernel: str, sh: Shapes, k: TensorDesc, v: TensorDesc) -> str:
    """The kernel for device data (:func:`ggml_attn.dispatch.best_kernel`); warns once when it
    falls back to the numpy reference."""
    choice = dispatch.best_kernel(kernel, facts(sh, _kv_aligned(k) and _kv_aligned(v)))
    if choice.kernel == "reference" and kernel != "reference":
        _warn_once(choice.reason)
    return choice.kernel


@dataclass
class _Prepared:
    """Everything about a call that depends only on shapes, strides, types and scalars."""
    kern: str
    cfg: LaunchConfig | None = None
    fn: K.Kernel | None = None
    comb: K.Kernel | None = None
    template: K.FattnParams | None = None
    ws_o_bytes: int = 0
    ws_bytes: int = 0
    comb_grid: tuple = (1, 1, 1)
    n_groups: int = 0          # split counters the kernel needs (fused split finish), 0: none


_PREPARED: dict[tuple, _Prepared] = {}


def _call_key(q, k, v, mask, sinks, dst, scale, max_bias, softcap, kernel, n_splits, dev, hint=None):
    return (FUSED_SPLIT_FINISH, hint, q.type, q.ne, q.nb, k.type, k.ne, k.nb, k.ptr % 16, v.type, v.ne, v.nb, v.ptr % 16,
            None if mask is None else (mask.type, mask.ne, mask.nb),
            None if sinks is None else (sinks.type, sinks.ne, sinks.nb),
            dst.type, dst.ne, dst.nb, float(scale), float(max_bias), float(softcap), kernel,
            n_splits, dev)


def _prepare(q, k, v, mask, sinks, dst, scale, max_bias, softcap, kernel, n_splits,
             plan: Plan | None = None) -> _Prepared:
    sh = validate(q, k, v, mask, sinks, dst, scale, max_bias, softcap)
    kern = _resolve_kernel(kernel, sh, k, v)
    if kern == "reference":
        return _Prepared(kern)
    cfg = launch_config(kern, sh, n_splits, ext=softcap != 0.0 or max_bias > 0.0,
                        wide=plan.wide if plan is not None else None,
                        max_live=plan.max_live if plan is not None else None)
    p = _params_common(q, k, v, mask, sinks, dst, sh, scale, max_bias, softcap)
    p.pack, p.q_tile_tokens = cfg.pack, cfg.q_tile_tokens
    p.n_q_tiles, p.n_kv_tiles, p.n_splits = cfg.n_q_tiles, cfg.n_kv_tiles, cfg.n_splits
    prep = _Prepared(kern, cfg, K.get_function(cfg.variant, cfg.name, smem=cfg.smem), template=p)
    if cfg.n_splits > 1:
        n_rows = sh.ne3 * sh.n_batch * sh.n_head
        prep.ws_o_bytes = cfg.n_splits * n_rows * sh.d_v * 4
        prep.ws_bytes = prep.ws_o_bytes + cfg.n_splits * n_rows * 8
        if FUSED_SPLIT_FINISH and cfg.finishes_splits():   # the last block of each row group merges
            prep.n_groups = cfg.grid[0] * cfg.grid[1] * sh.ne3
        else:
            prep.comb = K.get_function(K.util_variant(), "fattn_combine")
            prep.comb_grid = (n_rows, 1, 1)
    return prep


def q_needs_aligned_copy(q: TensorDesc) -> bool:
    """True when Q's pointer or a byte stride is not a multiple of 16.

    The kernels load Q rows with 16-byte vector loads; their scalar fallback for other
    alignments gave wrong results on the H200 (tests/test_gpu_kernels.py::
    test_q_view_at_4_byte_offset, 2026-11-29), so such a Q is copied to an aligned,
    contiguous buffer first (Q is small next to K/V: one row per query token)."""
    return q.ptr % 16 != 0 or any(nb % 16 for n, nb in zip(q.ne[1:], q.nb[1:]) if n > 1)


def _aligned_q_copy(q: TensorDesc, stream: int):
    """Contiguous copy of device f32 ``q`` (ggml order) on ``stream``: (its desc, the CuPy array)."""
    import cupy
    from .tensor import from_array
    src_mem = cupy.cuda.UnownedMemory(q.ptr, q.nbytes_span(), None)
    src = cupy.ndarray(tuple(reversed(q.ne)), cupy.float32, cupy.cuda.MemoryPointer(src_mem, 0),
                       strides=tuple(reversed(q.nb)))
    with cupy.cuda.ExternalStream(stream):
        copy = src.copy(order="C")  # always a new, pool-aligned buffer (ascontiguousarray would
        # hand back an already-contiguous view at the same misaligned pointer)
    return from_array(copy, GGML_TYPE_F32, q.name), copy


class BoundCall:
    """One call with everything filled in -- kernel, grid, parameter block, plan buffers,
    workspace, stream -- so that repeating it is one or two ``cuLaunchKernel``.

    ``ptrs`` are the six data pointers (q, k, v, mask, sinks, dst; 0 when absent) and ``stream``
    the stream it was bound for: the op's callback replays the call while both are unchanged
    (:meth:`launch`), and binds again otherwise. ``replayable`` is False when the call copies
    its inputs (a misaligned Q) or runs the numpy reference: those do per-call work."""

    __slots__ = ("ptrs", "stream", "kern", "replayable", "_fn", "_comb", "_grid", "_block", "_comb_grid",
                 "_params", "_args", "_keep", "_ref")

    def launch(self) -> None:
        if self._ref is not None:
            _reference_device(*self._ref, self.stream)
            return
        self._fn.launch_raw(self._grid, self._block, self.stream, self._args)
        if self._comb is not None:
            self._comb.launch_raw(self._comb_grid, (128, 1, 1), self.stream, self._args)


def bind(q: TensorDesc, k: TensorDesc, v: TensorDesc, mask: TensorDesc | None, sinks: TensorDesc | None,
         dst: TensorDesc, scale: float, max_bias: float = 0.0, logit_softcap: float = 0.0, *,
         kernel: str = "auto", plan: Plan | None = None, stream=None, n_splits: int | None = None) -> BoundCall:
    """Validate, choose, configure and fill in one call on device pointers (the work of
    :func:`flash_attn_ext_device` short of launching). Validation, dispatch and launch
    configuration are cached per (shapes, strides, types, scalars, plan statistics)."""
    import cupy
    st = _stream_ptr(stream)
    b = BoundCall()
    b.ptrs = tuple(t.ptr if t is not None else 0 for t in (q, k, v, mask, sinks, dst))
    b.stream, b._keep, b._ref, b.replayable = st, None, None, True
    if q_needs_aligned_copy(q):
        q, b._keep = _aligned_q_copy(q, st)  # the copy: alive until launched
        b.replayable = False
    dev = cupy.cuda.runtime.getDevice()
    key = _call_key(q, k, v, mask, sinks, dst, scale, max_bias, logit_softcap, kernel, n_splits, dev,
                    plan.hint() if plan is not None else None)
    prep = _PREPARED.get(key)
    if prep is None:
        prep = _prepare(q, k, v, mask, sinks, dst, scale, max_bias, logit_softcap, kernel, n_splits, plan)
        if len(_PREPARED) > 4096:
            _PREPARED.clear()
        _PREPARED[key] = prep
    b.kern = prep.kern
    if prep.kern == "reference":
        b._ref, b.replayable = (q, k, v, mask, sinks, dst, scale, max_bias, logit_softcap), False
        return b
    cfg = prep.cfg
    p = K.FattnParams.from_buffer_copy(prep.template)
    p.q, p.k, p.v, p.dst = q.ptr, k.ptr, v.ptr, dst.ptr
    if sinks is not None:
        p.sinks = sinks.ptr
    if mask is not None:
        n_batch = q.ne[1]
        if plan is None:
            plan = Plan(mask, n_batch, q.ne[2], k.ne[2])
            b._keep = (b._keep, plan)   # its tile map: alive as long as the call
        elif not plan.matches(mask, n_batch):
            raise ValueError("plan was built for another mask or n_batch "
                             f"(plan: {plan.mask.shape_str} n_batch={plan.n_batch}; "
                             f"call: {mask.shape_str} n_batch={n_batch})")
        p.live_idx, p.live_cnt, p.row_lohi = plan.live(cfg.q_tile_tokens, st)
        if prep.kern != "decode" and mask_needs_aligned_copy(mask):
            mask = plan.aligned(st)
            p.m_nb1, p.m_nb2, p.m_nb3 = mask.nb[1], mask.nb[2], mask.nb[3]
        p.mask = mask.ptr
    if prep.ws_bytes:
        ws, buf = _workspace(dev, st, prep.ws_bytes)
        p.ws_o, p.ws_ml = ws, ws + prep.ws_o_bytes
        b._keep = (b._keep, buf)
    if prep.n_groups:
        p.split_cnt, cnt = _split_counters(dev, st, prep.n_groups)
        b._keep = (b._keep, cnt)
    b._fn, b._comb, b._grid, b._block, b._comb_grid = prep.fn, prep.comb, cfg.grid, (cfg.block, 1, 1), prep.comb_grid
    b._params = p
    arr = K.arg_block(p)
    b._args, b._keep = ctypes.addressof(arr), (b._keep, arr)
    return b


def flash_attn_ext_device(q: TensorDesc, k: TensorDesc, v: TensorDesc, mask: TensorDesc | None,
                          sinks: TensorDesc | None, dst: TensorDesc, scale: float,
                          max_bias: float = 0.0, logit_softcap: float = 0.0, *,
                          kernel: str = "auto", plan: Plan | None = None, stream=None,
                          n_splits: int | None = None) -> None:
    """Attention on device pointers; writes ``dst``. Asynchronous on ``stream`` (default:
    CuPy's current stream). ``plan``: from :func:`make_plan` for this mask (built per call
    when None and a mask is given). ``n_splits`` overrides the KV split count (tests).
    A repeated call costs a cache lookup, a parameter copy and the launches; the op's callback
    keeps the :func:`bind` result per node and replays it instead."""
    bind(q, k, v, mask, sinks, dst, scale, max_bias, logit_softcap, kernel=kernel, plan=plan,
         stream=stream, n_splits=n_splits).launch()


def _reference_host(q, k, v, mask, sinks, dst, scale, max_bias, softcap) -> None:
    """numpy reference on host descriptors, result written through dst."""
    from .reference import flash_attn_ext
    from .tensor import as_numpy
    out = flash_attn_ext(as_numpy(q), as_numpy(k), as_numpy(v),
                         as_numpy(mask) if mask is not None else None, scale, max_bias, softcap,
                         as_numpy(sinks).reshape(-1) if sinks is not None else None,
                         kv_type=k.type, dtype=np.float32)
    as_numpy(dst)[...] = out.astype(np.float32)


def _reference_device(q, k, v, mask, sinks, dst, scale, max_bias, softcap, stream: int) -> None:
    import cupy
    rt = cupy.cuda.runtime
    rt.streamSynchronize(stream)
    keep = []

    def down(t):
        if t is None:
            return None
        buf = np.empty(max(t.nbytes_span(), 1), dtype=np.uint8)
        if t.nbytes_span():
            rt.memcpy(buf.ctypes.data, t.ptr, t.nbytes_span(), rt.memcpyDeviceToHost)
        keep.append(buf)
        return replace(t, ptr=buf.ctypes.data)
    hq, hk, hv, hm, hs = (down(t) for t in (q, k, v, mask, sinks))
    out = np.empty(dst.nbytes_span(), dtype=np.uint8)
    hd = replace(dst, ptr=out.ctypes.data)
    _reference_host(hq, hk, hv, hm, hs, hd, scale, max_bias, softcap)
    rt.memcpy(dst.ptr, out.ctypes.data, dst.nbytes_span(), rt.memcpyHostToDevice)


class _Staging:
    """Pinned host + device buffers per slot, grown as needed and reused. One per (thread,
    device) (:func:`_staging`): a call synchronizes its stream before returning, so a buffer
    freed when its slot grows has no copy of this thread in flight, and no other thread
    ever sees it."""

    def __init__(self):
        self.pinned: dict[str, object] = {}
        self.device: dict[str, object] = {}

    def get(self, slot: str, nbytes: int):
        import cupy
        nbytes = max(nbytes, 1)
        pm = self.pinned.get(slot)
        if pm is None or pm.size() < nbytes:
            pm = cupy.cuda.alloc_pinned_memory(nbytes * 5 // 4)
            self.pinned[slot] = pm
        dm = self.device.get(slot)
        if dm is None or dm.size < nbytes:
            dm = cupy.empty(nbytes * 5 // 4, dtype=cupy.uint8)
            self.device[slot] = dm
        return pm.ptr, dm.data.ptr


_STAGING = threading.local()   # .by_dev: device id -> _Staging of this thread


def _staging(dev: int) -> _Staging:
    by_dev = getattr(_STAGING, "by_dev", None)
    if by_dev is None:
        by_dev = _STAGING.by_dev = {}
    st = by_dev.get(dev)
    if st is None:
        st = by_dev[dev] = _Staging()
    return st


def flash_attn_ext_host(q: TensorDesc, k: TensorDesc, v: TensorDesc, mask: TensorDesc | None,
                        sinks: TensorDesc | None, dst: TensorDesc, scale: float,
                        max_bias: float = 0.0, logit_softcap: float = 0.0, *,
                        kernel: str = "auto") -> None:
    """Attention on host pointers: inputs staged to the GPU through pinned buffers, the result
    copied back into ``dst``; synchronous. Without a GPU, or with kernel="reference", the numpy
    reference runs on the host."""
    sh = validate(q, k, v, mask, sinks, dst, scale, max_bias, logit_softcap)
    choice = dispatch.best_kernel(kernel, facts(sh), gpu=available(), backend="auto", on_device=False)
    if not choice.on_gpu:   # host data, no kernel for it: the numpy reference on the host
        if kernel != "reference":
            _warn_once(f"{choice.reason}; running the numpy reference on the host")
        _reference_host(q, k, v, mask, sinks, dst, scale, max_bias, logit_softcap)
        return
    import cupy
    rt = cupy.cuda.runtime
    stream = cupy.cuda.get_current_stream().ptr
    staging = _staging(cupy.cuda.runtime.getDevice())

    def up(slot, t):
        """Copy the byte span of host tensor ``t`` to the device (keeping its address mod 16)."""
        if t is None:
            return None
        off = t.ptr % 16
        n = t.nbytes_span() + off
        hp, dp = staging.get(slot, n)
        ctypes.memmove(hp, t.ptr - off, n)
        rt.memcpyAsync(dp, hp, n, rt.memcpyHostToDevice, stream)
        return replace(t, ptr=dp + off)
    dq = up("q", q)
    dk = up("k", k)
    if v.ptr == k.ptr and v.nbytes_span() <= k.nbytes_span():   # V a view of K (MLA)
        dv = replace(v, ptr=dk.ptr)
    else:
        dv = up("v", v)
    dm = up("mask", mask)
    ds = up("sinks", sinks)
    n_out = dst.nbytes_span()
    hp_out, dp_out = staging.get("dst", n_out)
    dd = replace(dst, ptr=dp_out)
    flash_attn_ext_device(dq, dk, dv, dm, ds, dd, scale, max_bias, logit_softcap,
                          kernel=kernel, stream=stream)
    rt.memcpyAsync(hp_out, dp_out, n_out, rt.memcpyDeviceToHost, stream)
    rt.streamSynchronize(stream)
    ctypes.memmove(dst.ptr, hp_out, n_out)
