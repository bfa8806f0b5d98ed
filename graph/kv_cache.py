"""KV cache with llama.cpp's cell bookkeeping, unified (one stream) or split (one stream per
sequence), storage in an array module chosen once (numpy on the CPU path, CuPy on the GPU).

Follows ``src/llama-kv-cache.cpp`` / ``llama-kv-cells.h``:

* ``n_stream = 1`` when unified, else ``n_seq_max``; sequence ``s`` lives in stream ``s``
  (split) or 0 (unified).
* ``n_ctx`` is padded to 256; ``kv_size = n_ctx`` (unified) or ``PAD(n_ctx / n_seq_max, 256)``
  (split), cells per stream.
* Storage per layer in ggml order ``K [n_embd_k_gqa, kv_size, n_stream]`` and
  ``V [n_embd_v_gqa, kv_size, n_stream]`` (V not transposed, the flash-attention layout);
  :attr:`KVCache.k` / :attr:`KVCache.v` hold all layers in **numpy order**
  ``(n_layer, n_stream, kv_size, n_embd_gqa)``.
* A cell holds a position (-1 when empty), a set of sequence ids and a pad flag. Pad cells
  (rows of a padded ubatch) are never visible to any query (see ``mask.py``) and are freed by
  :meth:`KVCache.free_pads` right after their ubatch.
* ``find_slot`` scans for empty cells from each stream's head like llama.cpp's non-contiguous
  search (no SWA cell reuse); ``n_kv`` of a ubatch is the max over its streams of the used
  range, padded to 256.

Cache types: ``type_k`` / ``type_v`` name a ggml type (llama.cpp's ``-ctk`` / ``-ctv``: f16, f32,
bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1). F16 and F32 are float arrays of ``xp``; the other
types are uint8 byte arrays ``(n_layer, n_stream, kv_size, row_bytes)`` (ggml's blocks) that only
ggml and the kernels read and write: host arrays for every block type (``kv_graph.KVTensors``:
``ggml_set_rows`` on host graphs), arrays of a CuPy ``xp`` for q8_0 and q4_0 only
(:data:`DEVICE_BLOCK_TYPES`: the device store op quantizes them, the GPU kernels read them); the
numpy paths (:meth:`KVCache.write_rows`, :meth:`KVCache.sequence_contents`) raise ``ValueError``
for block types.

Cell metadata always lives in numpy (it is host bookkeeping); only K/V use ``xp``. It changes
only through the methods here and ``kv_cells.KVCells`` (each change is recorded by ``KVCells.touch``):
queries that scan a whole stream (``find_slot``, ``seq_pos_min/max``, ``used_max_p1``,
``n_used``) remember their answer until the next change, so a decode step asks each once. The
cell-to-sequence table is dense (``n_stream x kv_size x n_seq_max`` bools), so ``n_seq_max``
is capped at 256 (:data:`batch.MAX_SEQ`, llama.cpp's LLAMA_MAX_SEQ). Positions are int32:
``seq_add`` refuses a shift that would move one past 2**31-1 (ValueError, cache unchanged).
Sequence ids, positions and shifts must be integers (ValueError naming the argument).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ggml_attn.dtypes import CACHE_TYPES, DEVICE_BLOCK_TYPES, block_size, check_head_blocks  # noqa: F401 (re-exported)

from .batch import INT32_MAX, MAX_SEQ, Batch, as_int, validate_batch
from .kv_cells import KVCells, ubatch_streams
from .split import UBatch

__all__ = ["KVCache", "SlotInfo", "KVCacheFullError", "pad_to", "coarse_pad", "CACHE_TYPES", "block_size",
           "check_head_blocks", "DEVICE_BLOCK_TYPES"]

_FLOAT_TYPES = {"f16": np.dtype(np.float16), "f32": np.dtype(np.float32)}   # caches held as float arrays

KV_PAD = 256  # llama.cpp pads n_ctx, kv_size and n_kv to 256


class KVCacheFullError(RuntimeError):
    """No room for a ubatch; the cache is left unchanged."""


def coarse_pad(n: int, kv_size: int | None = None) -> int:
    """``n`` rounded up to a multiple of a quarter of its power of two, at least 256: 300 ->
    512, 1100 -> 1280, 7424 -> 8192, 8448 -> 10240 (at most 25% more cells, and a new value
    only every 1/8 to 1/4 of the way to the next power of two). With ``kv_size``: a value
    past three quarters of the cache becomes the whole cache (near the end the quarter steps
    would be few, each a new graph structure: 7536 -> 9072 for a 9072-cell cache)."""
    q = max(KV_PAD, (1 << max(int(n).bit_length() - 1, 0)) // 4)
    p = pad_to(int(n), q)
    if kv_size is not None and 4 * p >= 3 * int(kv_size):
        return max(int(kv_size), int(n))
    return p


# coarse_n_kv: the largest f16 mask (n_tokens x kv_size x 2 bytes) for which a prompt ubatch
# attends over the whole cache (KVCache.n_kv); 0 turns that off (A/B runs)
PROMPT_WHOLE_CACHE_MASK_BYTES = 16 << 20


def _check_xp_type(name: str, type_name: str, xp) -> None:
    """A cache of array module ``xp`` holds ``type_name``: numpy any cache type, another module
    (CuPy) f16, f32 and :data:`DEVICE_BLOCK_TYPES`. ``ValueError`` naming the argument (``name``:
    ``type_k`` / ``type_v``), the type and what that module holds."""
    if xp is np or type_name in _FLOAT_TYPES or type_name in DEVICE_BLOCK_TYPES:
        return
    raise ValueError(f"{name} {type_name}: a {xp.__name__} (device) cache holds f16, f32, "
                     f"{', '.join(DEVICE_BLOCK_TYPES)} only (the types the device store op writes and the "
                     f"GPU kernels read); {type_name} runs in a host (numpy) cache")


def pad_to(x: int, n: int) -> int:
    """``GGML_PAD``: ``x`` rounded up to a multiple of ``n``."""
    return (x + n - 1) // n * n


@dataclass(frozen=True)
class SlotInfo:
    """Where a ubatch's rows go.

    streams  cache stream of each of the ubatch's streams (ubatch stream ``j`` holds rows
             ``j*size .. (j+1)*size-1``); consecutive, ascending.
    cells    per ubatch stream, int64 ``(size,)`` cell index of each row in that stream.
    """

    streams: tuple[int, ...]
    cells: tuple[np.ndarray, ...]

    @property
    def n_stream(self) -> int:
        return len(self.streams)

    @property
    def size(self) -> int:
        """Rows per ubatch stream (``n_tokens / n_stream``)."""
        return int(self.cells[0].shape[0])

    @property
    def s0(self) -> int:
        return self.streams[0]

    @property
    def s1(self) -> int:
        return self.streams[-1]

    def row_indices(self, kv_size: int) -> np.ndarray:
        """int64 ``(n_tokens,)``: global row ``stream * kv_size + cell`` of every ubatch row,
        in ubatch row order: the ``idxs`` input of ``ggml_set_rows`` on the cache reshaped to
        ``[n_embd_gqa, kv_size * n_stream]``."""
        if len(self.streams) == 1:
            return (self.cells[0] + self.streams[0] * kv_size).astype(np.int64, copy=False)
        return np.concatenate([s * kv_size + c for s, c in zip(self.streams, self.cells)]).astype(np.int64)


def _resolve_xp(xp):
    if xp is None or xp == "numpy":
        return np
    if xp == "cupy":
        import cupy  # noqa: PLC0415  (GPU path only)
        return cupy
    return xp


class KVCache:
    """Cells, streams and K/V storage for ``n_layer`` attention layers.

    n_ctx       total context (padded to 256 as llama.cpp does).
    n_seq_max   sequences served (ids ``0 .. n_seq_max-1``).
    unified     True: one stream shared by all sequences; False: one stream per sequence.
    n_head_kv, head_dim_k, head_dim_v   K/V geometry; ``n_embd_gqa = n_head_kv * head_dim_k``.
    dtype       storage dtype of K and V (``float16`` = ggml F16, or ``float32``).
    type_k, type_v   cache type names (:data:`CACHE_TYPES`) overriding ``dtype`` for K / V
                (None: ``dtype``'s); a block type needs ``head_dim_k`` / ``head_dim_v`` to be
                whole blocks (:func:`check_head_blocks`).
    xp          array module for K/V: ``numpy`` (default), ``"cupy"`` or a module.
    coarse_n_kv  True: ``n_kv`` rounded up further, to a quarter of its power of two, the
                whole cache past three quarters of it (:func:`coarse_pad`), so that decode
                steps keep one graph structure for longer, and the whole cache for prompt
                ubatches whose mask stays small (:meth:`n_kv`)
                (graphs are reused and replayed per structure); for engines whose attention
                skips masked KV tiles (the CUDA kernels), where the extra cells cost only their
                mask bytes. On one stream the decode loop then pads each ubatch to a bucket of
                rows too (``driver.decode``, ``split.pad_to_bucket``). False: llama.cpp's
                padding to 256, ubatches as split.
    """

    def __init__(self, n_ctx: int, n_seq_max: int = 1, *, unified: bool = True, n_layer: int = 1,
                 n_head_kv: int = 1, head_dim_k: int = 64, head_dim_v: int | None = None,
                 dtype=np.float16, xp=None, type_k: str | None = None, type_v: str | None = None,
                 coarse_n_kv: bool = False):
        n_ctx, n_seq_max, n_layer, n_head_kv, head_dim_k = (
            as_int(x, name) for x, name in ((n_ctx, "n_ctx"), (n_seq_max, "n_seq_max"), (n_layer, "n_layer"),
                                            (n_head_kv, "n_head_kv"), (head_dim_k, "head_dim_k")))
        head_dim_v = None if head_dim_v is None else as_int(head_dim_v, "head_dim_v")
        if n_ctx <= 0 or n_seq_max <= 0 or n_layer <= 0 or n_head_kv <= 0 or head_dim_k <= 0 \
                or (head_dim_v is not None and head_dim_v <= 0):
            raise ValueError(f"KVCache needs positive sizes, got n_ctx={n_ctx} n_seq_max={n_seq_max} "
                             f"n_layer={n_layer} n_head_kv={n_head_kv} head_dim_k={head_dim_k} "
                             f"head_dim_v={head_dim_v}")
        if n_seq_max > MAX_SEQ:
            raise ValueError(f"n_seq_max={n_seq_max} exceeds {MAX_SEQ} sequences (llama.cpp's LLAMA_MAX_SEQ; "
                             f"the cell-to-sequence table here is dense: n_stream x kv_size x n_seq_max)")
        self.xp = _resolve_xp(xp)
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.dtype(np.float16), np.dtype(np.float32)):
            raise ValueError(f"K/V storage dtype must be float16 or float32, got {self.dtype}")
        default = "f16" if self.dtype == np.float16 else "f32"
        # None: the dtype's type; anything else must name a cache type ('' is not None)
        self.type_k = default if type_k is None else type_k
        self.type_v = default if type_v is None else type_v
        for flag, t, d in (("type_k", self.type_k, head_dim_k), ("type_v", self.type_v, head_dim_v or head_dim_k)):
            check_head_blocks(flag, t, d)
            _check_xp_type(flag, t, self.xp)
        self.unified = bool(unified)
        self.n_seq_max = int(n_seq_max)
        self.n_stream = 1 if unified else self.n_seq_max
        n_ctx = pad_to(int(n_ctx), KV_PAD)
        self.kv_size = n_ctx if unified else pad_to(n_ctx // self.n_seq_max, KV_PAD)
        if self.kv_size == 0:
            raise ValueError(f"n_ctx {n_ctx} / n_seq_max {n_seq_max} leaves no cell per stream")
        self.n_ctx = self.kv_size * self.n_stream
        self.n_layer = int(n_layer)
        self.n_head_kv = int(n_head_kv)
        self.head_dim_k = int(head_dim_k)
        self.head_dim_v = int(head_dim_v or head_dim_k)
        self.coarse_n_kv = bool(coarse_n_kv)
        self.cells = KVCells(self.n_stream, self.kv_size, self.n_seq_max)   # positions, sequences, pads, heads
        # storage, numpy order (n_layer, n_stream, kv_size, n_embd_gqa)
        self.k = self._storage(self.type_k, self.n_embd_k_gqa)
        self.v = self._storage(self.type_v, self.n_embd_v_gqa)

    def _storage(self, type_name: str, n_embd: int):
        """All layers of K or V, numpy order ``(n_layer, n_stream, kv_size, n_embd)`` of the
        float dtype, or ``(..., row_bytes)`` uint8 for the block types; arrays of ``xp`` (block
        types on a CuPy ``xp``: :data:`DEVICE_BLOCK_TYPES` only, checked in ``__init__``)."""
        shape = (self.n_layer, self.n_stream, self.kv_size)
        if type_name in _FLOAT_TYPES:
            return self.xp.zeros(shape + (n_embd,), dtype=_FLOAT_TYPES[type_name])
        import ggml  # noqa: PLC0415   (whole blocks per head: check_head_blocks, in __init__)
        gtype = getattr(ggml, f"GGML_TYPE_{type_name.upper()}")
        return self.xp.zeros(shape + (int(ggml.ggml_row_size(gtype, n_embd)),), dtype=np.uint8)

    @property
    def float_storage(self) -> bool:
        """True when K and V are float arrays (f16/f32), readable and writable without ggml."""
        return self.type_k in _FLOAT_TYPES and self.type_v in _FLOAT_TYPES

    def _need_float(self, what: str) -> None:
        if not self.float_storage:
            raise ValueError(f"{what} needs an f16/f32 cache; this one is K {self.type_k} / V "
                             f"{self.type_v} (ggml graphs read and write those)")

    # ------------------------------------------------------------ geometry
    @property
    def n_embd_k_gqa(self) -> int:
        return self.n_head_kv * self.head_dim_k

    @property
    def n_embd_v_gqa(self) -> int:
        return self.n_head_kv * self.head_dim_v

    def __repr__(self) -> str:
        mode = "unified" if self.unified else "split"
        return (f"KVCache({mode}, {self.n_stream} stream(s) x {self.kv_size} cells, {self.n_layer} layer(s), "
                f"K/V {self.n_head_kv}x{self.head_dim_k}/{self.head_dim_v} {self.type_k}/{self.type_v}, "
                f"{self.xp.__name__})")

    def seq_to_stream(self, seq_id: int) -> int:
        seq_id = self._check_seq(seq_id)
        return 0 if self.unified else seq_id

    def _check_seq(self, seq_id: int) -> int:
        seq_id = as_int(seq_id, "seq_id")
        if not 0 <= seq_id < self.n_seq_max:
            raise ValueError(f"seq_id {seq_id} out of range [0, {self.n_seq_max})")
        return seq_id

    # ------------------------------------------------------------ cells (kv_cells.KVCells)
    @property
    def pos(self) -> np.ndarray:
        """int32 ``(n_stream, kv_size)``: each cell's position, -1 when empty."""
        return self.cells.pos

    @property
    def seqs(self) -> np.ndarray:
        """bool ``(n_stream, kv_size, n_seq_max)``: the sequences of each cell."""
        return self.cells.seqs

    @property
    def pad(self) -> np.ndarray:
        """bool ``(n_stream, kv_size)``: the cell holds a pad row."""
        return self.cells.pad

    @property
    def head(self) -> list[int]:
        """Per stream, the cell the next search starts at."""
        return self.cells.head

    @head.setter
    def head(self, value) -> None:
        self.cells.head = list(value)

    @property
    def changes(self):
        """Every cell change (``kv_changes.CellChanges``)."""
        return self.cells.changes

    @property
    def shifted(self) -> bool:
        """``seq_add`` moved cached positions (K is stale until those cells are gone)."""
        return self.cells.shifted

    @property
    def _memo(self) -> dict:
        return self.cells.memo

    def transaction(self):
        """``with cache.transaction():`` -- a block that raises leaves the cells as they were
        (``KVCells.transaction``); K/V it wrote stays only in cells free again, and ``seq_cp``
        across streams (which overwrites occupied cells) has its destination's K/V restored."""
        return self.cells.transaction()

    def _snapshot(self):
        return self.cells.snapshot()

    def _restore(self, snap) -> None:
        self.cells.restore(snap)

    # ---------------------------------------------------------- cell queries
    def used_max_p1(self, stream: int) -> int:
        """One past the highest occupied cell of ``stream`` (0 when empty)."""
        return self.cells.used_max_p1(stream)

    def n_used(self, stream: int) -> int:
        return self.cells.n_used(stream)

    def _seq_pos(self, seq_id: int, largest: bool) -> int:
        if type(seq_id) is int:   # a remembered answer: its id was checked when it was computed
            got = self.cells.memo.get(("seq_pos", seq_id, largest))
            if got is not None:
                return got
        return self.cells.seq_pos(self.seq_to_stream(seq_id), int(seq_id), largest)

    def known_seq_pos_max(self, seq_id: int) -> int | None:
        """``seq_pos_max(seq_id)`` when it is remembered (no scan), else None."""
        return self.cells.memo.get(("seq_pos", seq_id, True))

    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest position of ``seq_id`` in the cache (pads excluded); -1 when none."""
        return self._seq_pos(seq_id, False)

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position of ``seq_id`` in the cache (pads excluded); -1 when none."""
        return self._seq_pos(seq_id, True)

    def next_positions(self, seq_ids) -> dict[int, int]:
        """``{seq_id: seq_pos_max + 1}``: where each sequence continues (for ``Batch.from_lengths``)."""
        return {int(s): self.seq_pos_max(int(s)) + 1 for s in seq_ids}

    def validate(self, batch: Batch) -> None:
        """llama.cpp's batch checks against this cache (``batch.validate_batch``)."""
        validate_batch(batch, self.n_seq_max, unified=self.unified,
                       seq_pos_min=self.seq_pos_min, seq_pos_max=self.seq_pos_max)

    # ----------------------------------------------------------------- slots
    def _ubatch_streams(self, ub: UBatch) -> list[tuple[int, np.ndarray]]:
        """(cache stream, ubatch rows) per ubatch stream; checks the split-mode layout.
        Depends on nothing but ``ub`` and the cache's geometry: remembered (``find_slot`` and
        ``apply_ubatch`` of one ubatch ask for it in turn; do not modify the rows)."""
        key = ("streams", id(ub))
        got = self._memo.get(key)
        if got is not None and got[0] is ub:
            return got[1]
        out = self._ubatch_streams_of(ub)
        self._memo[key] = (ub, out)
        return out

    def _ubatch_streams_of(self, ub: UBatch) -> list[tuple[int, np.ndarray]]:
        return ubatch_streams(ub, self.n_seq_max, self.unified)

    def find_slot(self, ub: UBatch) -> SlotInfo:
        """Cells for every row of ``ub`` (llama.cpp ``find_slot(ubatch, cont=false)``:
        ``KVCells.find_empty`` per stream); changes nothing. Raises :class:`KVCacheFullError`
        when a stream has too few empty cells. The answer is remembered until the cells or heads
        change (``prepare`` then ``place`` of the one ubatch of a decode step search once)."""
        key, heads = ("find_slot", id(ub)), tuple(self.cells.head)
        got = self.cells.memo.get(key)
        if got is not None and got[0] is ub and got[1] == heads:
            return got[2]
        streams, cells = [], []
        for st, rows in self._ubatch_streams(ub):
            n = rows.shape[0]
            found = self.cells.find_empty(st, n)
            if found is None:
                free = self.kv_size - self.n_used(st)
                raise KVCacheFullError(
                    f"no room for {n} rows in KV stream {st}: {free} of {self.kv_size} cells "
                    f"free ({ub!r}); raise n_ctx or free sequences")
            streams.append(st)
            cells.append(found)
        slot = SlotInfo(tuple(streams), tuple(cells))
        self.cells.memo[key] = (ub, heads, slot)
        return slot

    def apply_ubatch(self, slot: SlotInfo, ub: UBatch) -> None:
        """Occupy the slot's cells with the ubatch's positions, sequence ids and pad flags."""
        rows_per = self._ubatch_streams(ub)
        for (st, rows), st2 in zip(rows_per, slot.streams):
            if st != st2:
                raise ValueError(f"slot stream {st2} does not match ubatch stream {st}")
        still_true = self.cells.answers_after_fill(rows_per, slot.cells, ub)
        for (st, rows), cells in zip(rows_per, slot.cells):
            self.cells.fill(st, rows, cells, ub)
        self.cells.memo.update(still_true)

    def place(self, ub: UBatch) -> SlotInfo:
        """``find_slot`` + ``apply_ubatch``; on :class:`KVCacheFullError` nothing changed."""
        slot = self.find_slot(ub)
        self.apply_ubatch(slot, ub)
        return slot

    def prepare(self, ubatches: list[UBatch]) -> list[SlotInfo]:
        """Check that all ubatches fit one after another (pads freed after each), as llama.cpp's
        ``prepare`` does; the cache is unchanged afterwards. Raises :class:`KVCacheFullError`
        naming the first ubatch that does not fit."""
        if len(ubatches) == 1:   # one ubatch (every decode step): finding its cells is the check
            try:
                return [self.find_slot(ubatches[0])]
            except KVCacheFullError as e:
                raise KVCacheFullError(f"ubatch 0 of 1: {e}") from None
        snap = self.cells.snapshot()
        slots = []
        try:
            for i, ub in enumerate(ubatches):
                try:
                    slot = self.place(ub)
                except KVCacheFullError as e:
                    raise KVCacheFullError(f"ubatch {i} of {len(ubatches)}: {e}") from None
                self.free_pads(slot)
                slots.append(slot)
        finally:
            self.cells.restore(snap)
        return slots

    def free_pads(self, slot: SlotInfo) -> int:
        """Free the pad cells of a slot (call right after its ubatch); returns how many."""
        return self.cells.free_pads(slot.streams, slot.cells)

    def n_kv(self, slot: SlotInfo, ub=None) -> int:
        """KV cells the ubatch attends over: max over its streams of the used range, padded to
        256 (:func:`coarse_pad` with ``coarse_n_kv``) and at most ``kv_size`` (llama.cpp
        ``get_n_kv``). With ``coarse_n_kv``, a prompt ubatch ``ub`` (not a decode step) whose
        mask over the whole cache takes at most :data:`PROMPT_WHOLE_CACHE_MASK_BYTES` attends
        over the whole cache: every prompt ubatch of one size is then one graph structure
        (built once, then replayed) instead of one per coarse ``n_kv`` value, for a larger mask
        whose extra cells the kernels skip. Call after ``apply_ubatch``."""
        if self.coarse_n_kv and ub is not None and not ub.decode_step \
                and 2 * ub.n_tokens * self.kv_size <= PROMPT_WHOLE_CACHE_MASK_BYTES:
            return self.kv_size
        pad = (lambda n: coarse_pad(n, self.kv_size)) if self.coarse_n_kv else (lambda n: pad_to(n, KV_PAD))
        return max(min(self.kv_size, max(KV_PAD, pad(self.used_max_p1(st)))) for st in slot.streams)

    # --------------------------------------------------------- seq operations
    @staticmethod
    def _range(p0: int | None, p1: int | None) -> tuple[int, int]:
        """``[p0, p1)`` as int64-safe bounds: negative or None = open; past int32 = open."""
        lo = 0 if p0 is None else max(as_int(p0, "p0"), 0)
        hi = INT32_MAX + 1 if p1 is None or as_int(p1, "p1") < 0 else min(int(p1), INT32_MAX + 1)
        return min(lo, INT32_MAX + 1), hi

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> None:
        """Remove ``seq_id`` (all sequences when -1) from cells with position in ``[p0, p1)``
        (negative bounds: open). A cell left with no sequence is freed."""
        seq_id = as_int(seq_id, "seq_id")
        lo, hi = self._range(p0, p1)
        for st in range(self.n_stream) if seq_id == -1 else [self.seq_to_stream(seq_id)]:
            self.cells.seq_rm(st, seq_id, lo, hi)
        if self.cells.shifted and not (self.cells.pos >= 0).any():   # emptied: no stale K left
            self.cells.shifted = False

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Make ``dst`` share ``src``'s cells in ``[p0, p1)``. Across streams (split cache) the
        whole stream is copied (K/V data included) and only full ranges are allowed, as in
        llama.cpp."""
        s0, s1 = self.seq_to_stream(src), self.seq_to_stream(dst)
        src, dst = int(src), int(dst)
        lo, hi = self._range(p0, p1)
        if src == dst:
            return
        if s0 == s1:
            self.cells.seq_cp(s0, src, dst, lo, hi)
            return
        if (p0 is not None and p0 > 0) or (p1 is not None and p1 >= 0):
            raise ValueError(f"seq_cp({src} -> {dst}) across KV streams supports only the full range "
                             f"(p0 < 0, p1 < 0); got [{p0}, {p1})")
        if self.cells.journals:   # a failed transaction gets the destination's K/V back too
            k_old, v_old = self.k[:, s1].copy(), self.v[:, s1].copy()

            def undo():
                self.k[:, s1] = k_old
                self.v[:, s1] = v_old
            self.cells.on_undo(undo)
        self.cells.copy_stream(s0, s1, src, dst)
        self.k[:, s1] = self.k[:, s0]
        self.v[:, s1] = self.v[:, s0]

    def seq_keep(self, seq_id: int) -> None:
        """In ``seq_id``'s stream, drop every other sequence; cells left empty are freed."""
        self.cells.seq_keep(self.seq_to_stream(seq_id), int(seq_id))

    def seq_add(self, seq_id: int, p0: int = -1, p1: int = -1, shift: int = 0) -> None:
        """Add ``shift`` to the positions of ``seq_id``'s cells in ``[p0, p1)``; a cell whose
        position drops below 0 is freed. K is not re-rotated (llama.cpp's K-shift): the cache
        is marked :attr:`shifted` until it is emptied, and a RoPE model refuses it."""
        shift = as_int(shift, "shift")
        st = self.seq_to_stream(seq_id)
        seq_id = int(seq_id)
        lo, hi = self._range(p0, p1)
        if shift > INT32_MAX:
            raise ValueError(f"seq_add(seq_id={seq_id}): shift={shift} moves positions past the int32 "
                             f"maximum {INT32_MAX}")
        if shift == 0 or lo >= hi:
            return
        self.cells.seq_add(st, seq_id, lo, hi, shift)

    # ---------------------------------------------------------------- storage
    def write_rows(self, layer: int, slot: SlotInfo, k_rows, v_rows) -> None:
        """Store K/V rows of a ubatch: ``k_rows (n_tokens, n_embd_k_gqa)``, ``v_rows (n_tokens,
        n_embd_v_gqa)`` in numpy order, ubatch row order, any float dtype of ``xp`` (the
        host path; graphs do this with ``ggml_set_rows``)."""
        self._need_float("KVCache.write_rows")
        rows = slot.row_indices(self.kv_size)
        k_flat = self.k[layer].reshape(self.n_stream * self.kv_size, self.n_embd_k_gqa)
        v_flat = self.v[layer].reshape(self.n_stream * self.kv_size, self.n_embd_v_gqa)
        xp = self.xp
        k_flat[xp.asarray(rows)] = xp.asarray(k_rows).astype(self.k.dtype)
        v_flat[xp.asarray(rows)] = xp.asarray(v_rows).astype(self.v.dtype)

    def sequence_contents(self, seq_id: int, layer: int = 0):
        """What the cache holds for ``seq_id`` (pads excluded), sorted by position:
        ``(positions int32 (n,), K float32 (n, n_embd_k_gqa), V float32 (n, n_embd_v_gqa))``,
        numpy arrays on the host."""
        self._need_float("KVCache.sequence_contents")
        st = self.seq_to_stream(seq_id)
        cells = self.cells.seq_cells(st, int(seq_id))
        order = np.argsort(self.pos[st, cells], kind="stable")
        cells = cells[order]
        k = self.k[layer, st][self.xp.asarray(cells)]
        v = self.v[layer, st][self.xp.asarray(cells)]
        if self.xp is not np:
            k, v = k.get(), v.get()
        return self.pos[st, cells].copy(), np.asarray(k, np.float32), np.asarray(v, np.float32)
