"""Live-tile plans: per ubatch, the (query tile, KV tile) pairs that the mask leaves visible,
built on the GPU once from the mask and reused by every layer; and the 16-byte aligned mask
copy the tensor-core kernels need.

Shapes (ggml order): mask f16 [n_kv, n_rows >= n_batch, ne32, ne33].
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field, replace

import numpy as np

from . import cuda_launch as L
from . import dispatch
from . import kernels as K
from . import knobs
from .cuda_device import stream_ptr
from .cuda_launch import launch_config
from .dtypes import GGML_TYPE_F16
from .tensor import TensorDesc
from .validate import AttnDims

# class bits of a live-tile entry (FATTN_TILE_* in cuda/fattn_common.cuh)
TILE_PARTIAL, TILE_MASKED, TILE_HIDDEN, TILE_FINITE = 1 << 30, 1 << 29, 1 << 28, 1 << 27
TILE_ID_MASK = (1 << 27) - 1


@dataclass
class Plan:
    """Live KV tiles per (mask stream plane, query tile), for one ubatch's mask.

    Built on the GPU by :func:`make_plan` (or lazily for a tile size not built yet) and valid
    as long as the mask's contents do not change. Layout per tile size ``tq`` (tokens per
    query tile): ``idx`` int32 [ne33][n_q_tiles][n_kv_tiles] (numpy order) of entries
    ``tile id | class bits`` (FULL / PARTIAL / PARTIAL|MASKED, with HIDDEN or FINITE;
    cuda/fattn_common.cuh),
    ``cnt`` int32 [ne33][n_q_tiles]; after the entries, in the same buffer (:func:`live_words`),
    u64 [ne33][n_q_tiles][n_kv_tiles][ne32] hidden-column words in list order (a HIDDEN tile's
    columns that no token of the query tile sees, per mask head plane: the kernels zero-fill
    their V rows). Shared by every tile size: ``lohi`` int32
    [ne33][ne32][n_batch][2], each mask row's visible interval [lo, hi), or (-1, -1) when the
    row is not one interval of zeros.

    Invariant: a plan is only used with the mask it was built from -- the op and
    :func:`ggml_attn.cuda_backend.flash_attn_ext_device` use it only when ``mask.ptr`` (and
    shape, strides, n_batch) equal the call's (:meth:`matches`), so a tile map built lazily by
    :meth:`live` reads the same mask as the maps built by :func:`make_plan`. Whoever keeps a
    plan across graphs must rebuild it when the mask tensor moves (graph/build.py does).

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
    #   "aligned" -> (TensorDesc, cupy array), the 16-byte aligned copy of the mask;
    #   "cells" -> (cells, cnt), the cell lists (_build_cell_lists)
    items: dict = field(default_factory=dict)
    # host statistics read once by make_plan (one synchronization per ubatch):
    wide: bool | None = None       # 128-row prefill tiles pay off (enough live tiles per row tile)
    max_live: dict = field(default_factory=dict)   # tq -> most live KV tiles of any query tile
    # tq -> the live-tile counts read back, numpy int32 [ne33 * n_q_tiles] (decode-tma's split
    # follows them: cuda_launch.decode_tma_cap)
    live_host: dict = field(default_factory=dict)
    _digests: dict = field(default_factory=dict)   # tq -> hash of live_host[tq]
    _live_key: tuple = ()                          # (tq, most, digest of the counts) per tq (kept by read_stats)
    max_cells: int | None = None   # longest cell list (read_cell_stats; sizes the "cells" splits)
    # (cell_reads, tile_reads) for dispatch.best_kernel (make_plan): K/V cells per query token and
    # KV head that the cell-list kernel and the tile kernel auto would otherwise run read; None:
    # not measured (no cell lists built)
    reads: tuple | None = None
    # the mask for the sm_90a prefill (read_wgmma_tiles): "plain" when the 128-token tile map has
    # no MASKED tiles, "masked" otherwise; None: not measured. A verdict only on speed: the kernel
    # is right on every tile class (a refreshed mask may change it)
    wgmma_tiles: str | None = None
    # every decision made for this plan's calls, by (kernel asked for, call facts, backend flags,
    # knob generation): bind asks :func:`decide`, which answers from here and never chooses twice
    # for the same facts (every layer of a ubatch gets the first layer's decision)
    decisions: dict = field(default_factory=dict)

    def hint(self) -> tuple:
        """What the launch configuration takes from the plan (part of the call cache key; read
        on every call, so nothing is computed here)."""
        return self.wide, self._live_key, self.max_cells, self.reads, self.wgmma_tiles

    def read_wgmma_tiles(self, stream: int) -> str:
        """Whether the sm_90a prefill suits this mask: its 128-token tile map (built if missing)
        checked for MASKED tiles on the device, the verdict read back (synchronizes ``stream``)
        into ``wgmma_tiles``: "masked" for MASKED tiles (their values read from global memory:
        right, not fast). HIDDEN tiles (V rows zeroed by the kernel's fixer warp) are "plain":
        with Q through TMA and tiles of several query heads for ragged plans it is ahead there
        too -- 16 / 64 short ragged prompts in one ubatch 38.6 / 130.6 us against 41.1 / 165.6 on
        mma.sync (bench/results/2026-12-04-be0ea13-qtma.json), a 512 window over 4096 tokens 134.4
        against 182.4 (2026-12-02-ab8bee5.json)."""
        import cupy
        flags = self._map(128, stream)[2]   # fattn_mask_scan's per-tile flags: 4 MASKED, 8 HIDDEN
        with cupy.cuda.ExternalStream(stream):
            bad = int((flags & 4).max()) if flags.size else 0
        self.wgmma_tiles = "masked" if bad else "plain"
        return self.wgmma_tiles

    def read_stats(self, tq: int, stream: int) -> tuple[int, float]:
        """(most, mean) live KV tiles per query tile of ``tq`` tokens; synchronizes ``stream``."""
        import cupy
        cnt_d = self._map(tq, stream)[1]
        with cupy.cuda.ExternalStream(stream):
            cnt = cnt_d.get()
        mx = int(cnt.max()) if cnt.size else 0
        self.max_live[tq] = mx
        self.live_host[tq] = cnt
        self._digests[tq] = hash(cnt.tobytes())
        self._live_key = tuple((t, m, self._digests[t]) for t, m in sorted(self.max_live.items()))
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
        return self._map(tq, stream_ptr(stream))[1].get().reshape(self.mask.ne[3], -1)

    def tile_classes(self, tq: int, stream: int = None) -> dict[str, int]:
        """Host count of live tiles per class over all (plane, query tile): FULL, PARTIAL
        (index comparisons) and MASKED (mask tile loaded); of those, HIDDEN (V rows zeroed) and
        FINITE (MASKED with no -inf cell: added with no select) -- for tests and benchmarks."""
        idx_d, cnt_d = self._map(tq, stream_ptr(stream))[:2]
        idx, cnt = idx_d.get(), cnt_d.get()
        n_kv_tiles = idx.size // max(cnt.size, 1)
        ent = np.concatenate([idx[i * n_kv_tiles:i * n_kv_tiles + c] for i, c in enumerate(cnt)]) \
            if cnt.size else np.zeros(0, np.int32)
        partial, masked = (ent & TILE_PARTIAL) != 0, (ent & TILE_MASKED) != 0
        return {"FULL": int((~partial).sum()), "PARTIAL": int((partial & ~masked).sum()),
                "MASKED": int(masked.sum()), "HIDDEN": int(((ent & TILE_HIDDEN) != 0).sum()),
                "FINITE": int(((ent & TILE_FINITE) != 0).sum())}

    def hidden_columns(self, tq: int, stream: int = None) -> dict:
        """Host copy of the hidden-column words of the HIDDEN tiles (for tests):
        {(i33, query tile, KV tile): [word per mask head plane]}, bit c of a word = column c of
        the tile is -inf for every token of the query tile in that plane (or past n_kv)."""
        m = self._map(tq, stream_ptr(stream))
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
                    if e & TILE_HIDDEN:
                        out[(i33, qt, e & TILE_ID_MASK)] = [int(w) for w in words[i33, qt, j]]
        return out

    def cell_lists(self, stream: int) -> tuple[int, int]:
        """(cells_ptr, cnt_ptr) of the per-row cell lists (FattnParams.cells / cell_cnt); builds
        them if missing."""
        cells, cnt = self._get("cells", stream, lambda st: _build_cell_lists(self.mask, self.n_batch, st))
        return cells.data.ptr, cnt.data.ptr

    def cell_counts(self, stream: int = None) -> np.ndarray:
        """Host copy of the cell-list lengths, numpy [ne33, ne32, n_batch] (tests and stats)."""
        self.cell_lists(stream_ptr(stream))
        return self.items["cells"][0][1].get().reshape(self.mask.ne[3], self.mask.ne[2], self.n_batch)

    def cell_entries(self, stream: int = None) -> np.ndarray:
        """Host copy of the cell lists, int32 [ne33, ne32, n_batch, n_kv, 2] (cell, float bits of
        the mask value); entries past a row's count are unspecified (tests)."""
        self.cell_lists(stream_ptr(stream))
        n_kv, _, ne32, ne33 = self.mask.ne
        return self.items["cells"][0][0].get().reshape(ne33, ne32, self.n_batch, n_kv, 2)

    def read_cell_stats(self, stream: int) -> tuple[int, float]:
        """(longest, mean) cell list over the mask rows; synchronizes ``stream``."""
        import cupy
        self.cell_lists(stream)
        with cupy.cuda.ExternalStream(stream):
            cnt = self.items["cells"][0][1].get()
        self.max_cells = int(cnt.max()) if cnt.size else 0
        return self.max_cells, float(cnt.mean()) if cnt.size else 0.0

    def keep_only(self, kern: str) -> None:
        """Drop what ``kern`` does not read -- the cell lists for a tile kernel, the row
        intervals and tile maps for "cells" -- so that :meth:`refresh` (every captured decode
        step) rebuilds only what runs; a later call that needs a dropped item builds it again."""
        for key in list(self.items):
            is_cells = key == "cells"
            is_tiles = key == "lohi" or (isinstance(key, tuple) and key[0] == "map")
            if (kern == "cells" and is_tiles) or (kern != "cells" and is_cells):
                del self.items[key]

    @property
    def nbytes(self) -> int:
        """Device bytes of what the plan has built (arrays that own their memory)."""
        def walk(x):
            if isinstance(x, tuple):
                return sum(walk(y) for y in x)
            own = hasattr(x, "data") and hasattr(x, "nbytes") and getattr(x, "base", None) is None
            return int(x.nbytes) if own else 0
        return sum(walk(val) for val, _, _ in self.items.values())

    def refresh(self, stream=None) -> None:
        """The mask's contents changed (same tensor, same shape): rebuild everything this plan
        built -- row intervals, each tile map, the aligned copy, the cell lists (capacity n_kv
        per row: they always fit) -- into the same buffers, on
        ``stream``, launches only (no allocation, no synchronization: a CUDA graph captures
        it). The statistics read at build time (tile height, split counts) are kept; the
        kernels stay right whatever they are (they only size the work)."""
        self.refresher(stream)()

    def refresher(self, stream=None) -> "Launches":
        """:meth:`refresh` of what the plan has built so far, as a callable of no arguments with
        every launch's arguments fixed now (what a bound call that owns its plan replays before
        its kernel). Items built after this are not in it."""
        st = stream_ptr(stream)
        out = Launches()
        got = self.items.get("lohi")
        lohi = got[0] if got is not None else None
        if lohi is not None:
            _row_interval_launches(self.mask, self.n_batch, st, lohi, out)
        for key, (val, _, _) in list(self.items.items()):
            if isinstance(key, tuple) and key[0] == "map":
                _live_map_launches(self.mask, self.n_batch, key[1], st, lohi, val, out)
        got = self.items.get("aligned")
        if got is not None:
            out.calls.append(lambda into=got[0]: _aligned_mask_copy(self.mask, self.n_batch, st, into=into))
        got = self.items.get("cells")
        if got is not None:
            _cell_list_launches(self.mask, self.n_batch, st, got[0], out)
        return out

    def aligned(self, stream: int) -> TensorDesc:
        """The mask with 16-byte aligned rows for the tensor-core kernels (copied once)."""
        return self._get("aligned", stream, lambda st: _aligned_mask_copy(self.mask, self.n_batch, st))[0]


def _mask_params(mask: TensorDesc, n_batch: int) -> K.FattnParams:
    p = K.FattnParams()
    p.mask = mask.ptr
    p.m_nb1, p.m_nb2, p.m_nb3 = mask.nb[1], mask.nb[2], mask.nb[3]
    p.n_batch, p.n_kv, p.ne32, p.ne33 = n_batch, mask.ne[0], mask.ne[2], mask.ne[3]
    return p


class Launches:
    """Kernel launches with their arguments fixed (``Kernel.bound``), run in order by a call of
    no arguments."""
    __slots__ = ("calls",)

    def __init__(self):
        self.calls = []

    def add(self, fn: K.Kernel, grid, block, stream: int, *args) -> None:
        """``fn`` on ``grid`` x ``block`` on ``stream`` with ctypes ``args`` in kernel order."""
        self.calls.append(fn.bound(grid, block, stream, *args))

    def __call__(self) -> None:
        for call in self.calls:
            call()


def _row_interval_launches(mask: TensorDesc, n_batch: int, stream: int, lohi, out: Launches) -> None:
    _, _, ne32, ne33 = mask.ne
    out.add(K.get_function(K.util_variant(), "fattn_mask_rows"), (n_batch, ne32, ne33), (128, 1, 1), stream,
            _mask_params(mask, n_batch), ctypes.c_uint64(lohi.data.ptr))


def _build_row_intervals(mask: TensorDesc, n_batch: int, stream: int, into=None):
    """Pass 0 of the plan: each row's visible interval, cupy int32 [ne33][ne32][n_batch][2]
    (written into ``into``, the array of an earlier build, when given: nothing allocated)."""
    import cupy
    _, _, ne32, ne33 = mask.ne
    lohi = into
    if lohi is None:
        with cupy.cuda.ExternalStream(stream):
            lohi = cupy.empty((ne33, ne32, n_batch, 2), dtype=cupy.int32)
    out = Launches()
    _row_interval_launches(mask, n_batch, stream, lohi, out)
    out()
    return lohi


def live_words(ne33: int, n_q_tiles: int, n_kv_tiles: int, ne32: int) -> tuple[int, int]:
    """int32 words of a tile map's live_idx buffer: (offset of the hidden-column words, total).
    The entries [ne33][n_q_tiles][n_kv_tiles] come first, rounded up to an even count, then one
    u64 per (entry, mask head plane): live_hidden() in cuda/fattn_common.cuh reads the same."""
    n = ne33 * n_q_tiles * n_kv_tiles
    off = n + (n & 1)
    return off, off + 2 * n * ne32


def _live_map_launches(mask: TensorDesc, n_batch: int, tq: int, stream: int, lohi, built, out: Launches) -> None:
    """The scan and compaction of a tile map into ``built`` (:func:`_build_live_map`'s tuple)."""
    n_kv, _, ne32, ne33 = mask.ne
    _, cnt, flags, _, buf, hidden = built
    n_q_tiles = -(-n_batch // tq)
    n_kv_tiles = max(1, -(-n_kv // K.KV_TILE))
    p = _mask_params(mask, n_batch)
    p.q_tile_tokens, p.n_q_tiles, p.n_kv_tiles = tq, n_q_tiles, n_kv_tiles
    var = K.util_variant()
    out.add(K.get_function(var, "fattn_mask_scan"), (n_kv_tiles, n_q_tiles, ne33), (128, 1, 1), stream, p,
            ctypes.c_uint64(flags.data.ptr), ctypes.c_uint64(lohi.data.ptr), ctypes.c_uint64(hidden.data.ptr),
            ctypes.c_int32(1 if L.FINITE_MASK_TILES else 0))
    out.add(K.get_function(var, "fattn_mask_compact"), (n_q_tiles, ne33, 1), (32, 1, 1), stream, p,
            ctypes.c_uint64(flags.data.ptr), ctypes.c_uint64(buf.data.ptr), ctypes.c_uint64(cnt.data.ptr),
            ctypes.c_uint64(hidden.data.ptr))


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
    built = (buf[:n], cnt, flags, (buf.data.ptr, cnt.data.ptr, lohi.data.ptr), buf, hidden)
    out = Launches()
    _live_map_launches(mask, n_batch, tq, stream, lohi, built, out)
    out()
    return built


def _cell_list_launches(mask: TensorDesc, n_batch: int, stream: int, built, out: Launches) -> None:
    _, _, ne32, ne33 = mask.ne
    cells, cnt = built
    out.add(K.get_function(K.util_variant(), "fattn_cell_lists"), (n_batch, ne32, ne33),
            (K.CELL_LIST_THREADS, 1, 1), stream, _mask_params(mask, n_batch),
            ctypes.c_uint64(cells.data.ptr), ctypes.c_uint64(cnt.data.ptr))


def _build_cell_lists(mask: TensorDesc, n_batch: int, stream: int, into=None):
    """Each mask row's visible cells (fattn_cell_lists, fattn_util.cu): (cells, cnt), cupy int32
    [ne33][ne32][n_batch][n_kv][2] entries (cell, float bits of the mask value) in ascending cell
    order, and int32 [ne33][ne32][n_batch] counts. Capacity n_kv per row, fixed by the shapes:
    ``into`` (an earlier build's pair) is written again, nothing allocated, nothing read back."""
    import cupy
    n_kv, _, ne32, ne33 = mask.ne
    if into is None:
        with cupy.cuda.ExternalStream(stream):
            into = (cupy.empty((ne33, ne32, n_batch, n_kv, 2), dtype=cupy.int32),
                    cupy.empty((ne33, ne32, n_batch), dtype=cupy.int32))
    out = Launches()
    _cell_list_launches(mask, n_batch, stream, into, out)
    out()
    return into


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
              head_dim_k: int = 128, head_dim_v: int | None = None, kv_type: int = GGML_TYPE_F16,
              ne3: int | None = None, kernel: str = "auto", stream=None) -> Plan:
    """Build the live-tile plan of one ubatch from its device-resident ``mask``.

    ``mask`` f16 [n_kv, n_rows >= n_batch, ne32, ne33] (ggml order). The map for the tile shape
    that ``kernel`` (with "auto": dispatch) uses at these shapes is built now; other tile
    shapes are built on first use. Reuse the plan for every layer of the ubatch. Reads the
    live-tile counts back to the host once (one synchronization of ``stream``): the prefill
    tile height and the decode split count follow the live tiles, not n_kv. With ``auto`` on a
    decode-shaped call (dispatch.cells_why_not) the per-row cell lists are built as well and
    their lengths read back after the tile counts (a second copy to the host): ``Plan.reads``
    then lets best_kernel choose the cell-list kernel when the rows see few, interleaved cells,
    and the plan keeps only what the chosen kernel reads (:meth:`Plan.keep_only`).
    """
    if mask is None:
        raise ValueError("make_plan needs a mask")
    head_dim_v = head_dim_k if head_dim_v is None else head_dim_v
    ne3 = mask.ne[3] if ne3 is None else ne3
    plan = Plan(mask, n_batch, n_head, n_head_kv)
    sh = AttnDims(head_dim_k, head_dim_v, n_batch, n_head, n_head_kv, ne3, mask.ne[0], kv_type, mask.ne[2], mask.ne[3])
    # the kernel family first, by shapes alone: which tile maps and statistics to build (the
    # sm_90a kernels asked for by name check the device's architecture; auto's sm_90a choices
    # follow the statistics, below)
    arch = K.device_arch() if kernel in ("prefill-wgmma", "decode-tma") else ""
    kern = decide(kernel, sh, arch=arch, masked=False).kernel
    if kern not in dispatch.GPU_KERNELS:
        return plan
    if dispatch.reads_f16_copies(kern, kv_type):
        sh = replace(sh, kv_type=GGML_TYPE_F16)   # that kernel reads f16 copies of the blocks
    st = stream_ptr(stream)
    if kern == "cells":   # asked for by name: only its lists
        plan.read_cell_stats(st)
        return plan
    # auto on a decode-shaped call: the cell lists too, queued before the first read-back, and
    # what each kernel would read (Plan.reads) for best_kernel's choice (not for quantized K/V:
    # the cell-list kernel would need f16 copies of every cell at each decode step)
    cells = kernel == "auto" and kv_type not in K.QUANT_KV_CTYPES and dispatch.cells_why_not(dispatch.call_facts(sh)) is None
    if cells:
        plan.cell_lists(st)
    if kern == "prefill":   # mean live KV tiles per 64-token query tile decide the height
        _, mean = plan.read_stats(64 if n_batch >= 64 else launch_config(kern, sh).q_tile_tokens, st)
        plan.wide = mean >= L.PREFILL_WIDE_MIN_LIVE
    if kern == "prefill" and kernel == "auto" and \
            dispatch.wgmma_why_not(dispatch.call_facts(sh, arch=K.device_arch(), mask_tiles="plain")) is None:
        plan.read_wgmma_tiles(st)   # the sm_90a prefill runs it if the mask's tiles are plain
    cfg = launch_config(kern, sh, wide=plan.wide)
    _, mean_tiles = plan.read_stats(cfg.q_tile_tokens, st)
    if cells:
        _, mean_cells = plan.read_cell_stats(st)
        pack_cells = launch_config("cells", sh, blocks_per_sm=1, max_cells=plan.max_cells).pack
        tile_reads = mean_tiles * K.KV_TILE * cfg.n_q_tiles * (sh.gqa // cfg.pack) / max(1, n_batch)
        plan.reads = (mean_cells * sh.gqa / pack_cells, tile_reads)
        kern = decide(kernel, sh, plan=plan, arch="").kernel   # cell lists or tiles: the family is enough
        plan.keep_only(kern)
    if kern not in ("decode", "cells") and mask_needs_aligned_copy(mask):
        plan.aligned(st)
    return plan


def decide(kernel: str, dims: AttnDims, *, plan: Plan | None = None, k: TensorDesc | None = None,
           v: TensorDesc | None = None, plain: bool = True, masked: bool | None = None, arch: str | None = None,
           backend: str = "cuda", gpu: bool = True, on_device: bool = True) -> "dispatch.Choice":
    """The kernel of one call on the GPU backend: :func:`ggml_attn.dispatch.best_kernel` on the
    facts the call and its plan give -- the backend's one place that asks (bind,
    flash_attn_ext_host and make_plan come here; the op asks best_kernel itself only for calls
    it keeps off the GPU backend).

    ``dims``: the call's (``validate.AttnDims``); ``plan``: its mask's live-tile plan (the reads,
    the mask verdict and the live counts it measured), which keeps each decision by (kernel,
    facts, backend flags, knob generation): a call with the same facts, e.g. every layer of a
    ubatch, gets the decision made before; ``k``/``v``: the call's K/V (alignment and TMA
    readability, ``dispatch.kv_access``; None: as the kernels want them); ``plain``: no sinks,
    softcap or ALiBi; ``masked``: the call has a mask (default: a plan is given); ``arch``: the
    device's (default: the current device's when ``gpu``, "" otherwise); ``backend``, ``gpu``,
    ``on_device``: as best_kernel's. Raises as best_kernel does."""
    masked = plan is not None if masked is None else masked
    if arch is None:
        arch = K.device_arch() if gpu and kernel != "reference" else ""
    aligned, tma = dispatch.kv_access(k, v) if k is not None and v is not None else (True, True)
    tiles = "none" if not masked else (plan.wgmma_tiles if plan is not None and plan.wgmma_tiles else "masked")
    f = dispatch.call_facts(dims, kv_aligned=aligned, kv_tma=tma, arch=arch, plain=plain, mask_tiles=tiles,
                            masked=masked, reads=plan.reads if plan is not None else None,
                            live_counts=plan.live_host if plan is not None else None)
    key = (kernel, f, backend, gpu, on_device, knobs.version())
    c = plan.decisions.get(key) if plan is not None else None
    if c is None:
        c = dispatch.best_kernel(kernel, f, backend=backend, gpu=gpu, on_device=on_device)
        if plan is not None:
            plan.decisions[key] = c
    return c


def programs(head_dim_k: int, head_dim_v: int, k_type: int, v_type: int, gqa: int, arch: str, kernel: str = "auto",
             ext: bool = False) -> list[K.Variant]:
    """The programs the backend may load for calls of head sizes ``head_dim_k``/``head_dim_v``, K/V of types
    ``k_type``/``v_type`` and ``gqa`` query heads per KV head, on a GPU of ``arch`` ("sm_90"),
    under ``kernel`` ("auto": every GPU kernel best_kernel lets run decode- or prompt-shaped such
    calls; a name: that one; ``ext``: with softcap or ALiBi): the kernels' own programs (f16 ones
    where the kernel runs on f16 copies of quantized K/V) and the plan's and copies' kernels
    (util) -- what first calls would otherwise compile one at a time (:func:`K.precompile`). A
    kernel that cannot run such calls is left out: its calls say why."""
    out = [K.util_variant()]
    # K and V of different types run on f16 copies of the quantized one: every f16 program too
    pairs = [(k_type, v_type)] + ([(GGML_TYPE_F16, GGML_TYPE_F16)] if k_type != v_type else [])
    for (kt, vt) in pairs:
        for n_batch in (1, dispatch.WGMMA_MIN_BATCH):   # a decode step's call, a prompt's
            dims = AttnDims(head_dim_k, head_dim_v, n_batch, gqa, 1, 1, 4096, kt, v_type=None if vt == kt else vt)
            for c in dispatch.kernels_for(kernel, dispatch.call_facts(dims, arch=arch, plain=not ext)):
                t = GGML_TYPE_F16 if dispatch.reads_f16_copies(c.kernel, kt, vt) else kt
                v = launch_config(c.kernel, AttnDims(head_dim_k, head_dim_v, n_batch, gqa, 1, 1, 4096, t), n_splits=1, ext=ext,
                                  blocks_per_sm=1).variant
                if v not in out:
                    out.append(v)
    return out
