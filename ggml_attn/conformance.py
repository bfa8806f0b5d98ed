"""llama.cpp's ``test-backend-ops`` FLASH_ATTN_EXT cases, ported.

:func:`grid` yields the evaluation grid of ggml 0.15.3's ``test-backend-ops.cpp`` for
F32/F16/BF16 and quantized K/V, plus cases of our own with garbage (NaN, inf, random bytes)
in masked KV cells (``FACase.nonfinite``); :func:`make_inputs` draws one case's tensors the
way that test does (uniform [-1, 1], sinks in [-10, 10], a random mask in [-1, 1] with about
20% of 128x64 blocks set to -inf or 0). Arrays come in **numpy order** and in ggml storage
dtypes (F16 ``float16``, BF16 ``uint16`` bits, quantized ``uint8`` rows).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .dtypes import GGML_TYPE_BF16, GGML_TYPE_F16, GGML_TYPE_F32, STORAGE_DTYPES, from_float, to_float
from .quant import dequantize_rows, quantize, type_info
from .tensor import type_name

# ggml type ids of the quantized K/V types in test-backend-ops' grid
GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1, GGML_TYPE_Q8_0 = 2, 3, 6, 7, 8
GGML_TYPE_IQ4_NL, GGML_TYPE_Q1_0 = 20, 41
FLOAT_TYPES = (GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16)
QUANT_TYPES = (GGML_TYPE_Q8_0, GGML_TYPE_Q5_1, GGML_TYPE_Q5_0, GGML_TYPE_Q4_1, GGML_TYPE_Q4_0, GGML_TYPE_IQ4_NL)


@dataclass(frozen=True)
class FACase:
    hsk: int                # K head size before padding to the block size (see dk)
    hsv: int                # V head size before padding (see dv)
    n_head_kv: int          # "nh" in test-backend-ops
    gqa: int                # nr2: query heads per KV head
    ne3: int                # nr3: streams
    n_kv: int
    n_batch: int
    mask: bool
    sinks: bool
    max_bias: float
    logit_softcap: float
    kv_type: int            # K's type (and V's unless v_type is set)
    permuted: bool = False  # q/k/v created permuted (0, 2, 1, 3), i.e. non-contiguous views
    v_type: int | None = None
    # not in test-backend-ops: a quarter of the KV cells are masked for every row and hold
    # garbage in K and V (random bytes, NaN, +-inf), as the unused cells of a ggml KV cache
    # (uninitialised memory) do. The output must be that of the clean inputs.
    nonfinite: bool = False

    @property
    def v_kind(self) -> int:
        return self.kv_type if self.v_type is None else self.v_type

    @property
    def dk(self) -> int:
        """K head size as stored: hsk padded to K's block size (test-backend-ops' hsk_padded)."""
        return _pad(self.hsk, self.kv_type)

    @property
    def dv(self) -> int:
        return _pad(self.hsv, self.v_kind)

    @property
    def n_head(self) -> int:
        return self.n_head_kv * self.gqa

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.hsk)

    @property
    def id(self) -> str:
        return (f"hsk{self.hsk}_hsv{self.hsv}_nh{self.n_head_kv}x{self.gqa}_s{self.ne3}_kv{self.n_kv}"
                f"_nb{self.n_batch}_m{int(self.mask)}_sk{int(self.sinks)}_ab{self.max_bias:g}"
                f"_sc{self.logit_softcap:g}_{type_name(self.kv_type)}"
                + (f"-{type_name(self.v_type)}" if self.v_type is not None else "")
                + ("_perm" if self.permuted else "") + ("_garbage" if self.nonfinite else ""))


def _pad(n: int, ggml_type: int) -> int:
    blck = 1 if ggml_type in STORAGE_DTYPES else type_info(ggml_type).blck_size
    return -(-n // blck) * blck


def grid(kv_types=FLOAT_TYPES + QUANT_TYPES):
    """All FLASH_ATTN_EXT cases of test-backend-ops (ggml 0.15.3) for ``kv_types``, then its
    mixed K/V type cases.

    ``prec`` is not a parameter here: ggml's CPU op and ours always accumulate in F32.
    """
    for hsk in (40, 64, 72, 80, 96, 128, 192, 256, 320, 512, 576):
        for hsv in (40, 64, 72, 80, 96, 128, 192, 256, 512):
            if hsk not in (192, 320, 576) and hsk != hsv:
                continue
            if hsk == 192 and hsv not in (128, 192):
                continue
            if hsk == 576 and hsv != 512:
                continue
            if hsk == 320 and hsv != 256:
                continue
            for mask in (True, False):
                for sinks in (True, False):
                    for max_bias in (0.0, 8.0):
                        if not mask and max_bias > 0:
                            continue
                        for softcap in (0.0, 10.0):
                            if hsk != 128 and softcap != 0:
                                continue
                            for nh in (1, 4):
                                if nh == 1 and hsk not in (320, 576):
                                    continue
                                for nr3 in (1, 3):
                                    if hsk > 64 and nr3 > 1:
                                        continue
                                    for nr2 in (1, 4, 8, 12, 16, 20, 32):
                                        if (nr2 == 8 and hsk != 192) or (nr2 == 12 and hsk != 128) \
                                                or (nr2 == 16 and hsk != 192) \
                                                or (nr2 == 20 and (nh != 1 or hsk != 576)) \
                                                or (nr2 == 32 and (nh != 1 or hsk != 320)):
                                            continue
                                        for kv in (113, 512, 1024):
                                            if nr2 != 1 and kv != 512:
                                                continue
                                            for nb in (1, 3, 32, 75):
                                                for t in kv_types:
                                                    if t != GGML_TYPE_F16 and hsk not in (64, 72):
                                                        continue
                                                    case = FACase(hsk, hsv, nh, nr2, nr3, kv, nb, mask, sinks,
                                                                  max_bias, softcap, t)
                                                    yield case
                                                    if mask and max_bias == 0 and softcap == 0 and kv == 512:
                                                        yield FACase(**{**case.__dict__, "permuted": True})
                                                    if mask and kv == 113 and sinks == (nb in (3, 75)):
                                                        yield FACase(**{**case.__dict__, "nonfinite": True})
    mixed = [(64, 64, 128, 2, True, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0), (64, 64, 128, 2, True, GGML_TYPE_Q4_0, GGML_TYPE_F16),
             (72, 72, 96, 2, True, GGML_TYPE_Q4_0, GGML_TYPE_Q8_0), (64, 64, 96, 2, True, GGML_TYPE_F16, GGML_TYPE_F32),
             (128, 128, 256, 1, False, GGML_TYPE_F16, GGML_TYPE_Q4_0), (128, 128, 96, 2, True, GGML_TYPE_Q1_0, GGML_TYPE_Q1_0),
             (128, 64, 128, 2, True, GGML_TYPE_Q1_0, GGML_TYPE_Q4_0), (64, 128, 128, 2, True, GGML_TYPE_Q4_0, GGML_TYPE_Q1_0),
             (128, 64, 64, 2, True, GGML_TYPE_Q1_0, GGML_TYPE_F16)]
    for hsk, hsv, kv, nb, mask, tk, tv in mixed:
        if tk in kv_types and tv in kv_types + (GGML_TYPE_Q1_0,) or tk == GGML_TYPE_Q1_0:
            yield FACase(hsk, hsv, 4, 1, 1, kv, nb, mask, False, 0.0, 0.0, tk, v_type=tv)


def random_kq_mask(rng: np.random.Generator, shape, lo=-1.0, hi=1.0) -> np.ndarray:
    """F16 mask, numpy order ``(ne3, ne2, ne1, ne0)``, uniform in [lo, hi] with about 20% of
    128x64 (ne0 x ne1) blocks set to -inf or 0, as test-backend-ops' init_tensor_kq_mask."""
    m = rng.uniform(lo, hi, size=shape).astype(np.float32)
    ne3, ne2, ne1, ne0 = shape
    for _ in range(int(0.2 * m.size / (128 * 64))):
        p3, p2, p1, p0 = (int(rng.integers(n)) for n in (ne3, ne2, ne1, ne0))
        m[p3, p2, p1:p1 + 64, p0:p0 + 128] = -np.inf if rng.integers(2) else 0.0
    return m.astype(np.float16)


def block_causal_mask(lengths, n_kv: int, gaps=()) -> np.ndarray:
    """F16 mask ``(n_rows, n_kv)`` (numpy order) for sequences laid out one after another in
    one unified KV range: a token sees the earlier tokens of its own sequence (causal), every
    other cell is -inf, cells past the last sequence's too. ``gaps``: unused cells (seen by no
    row) after each of the first ``len(gaps)`` sequences' cells."""
    m = np.full((sum(lengths), n_kv), -np.inf, dtype=np.float16)
    row = cell = 0
    for i, length in enumerate(lengths):
        m[row:row + length, cell:cell + length] = np.triu(
            np.full((length, length), -np.inf, dtype=np.float16), 1)
        row, cell = row + length, cell + length + (gaps[i] if i < len(gaps) else 0)
    return m


@dataclass
class FAInputs:
    """One case's tensors in numpy order; k/v in ggml storage of their types (F16 float16,
    BF16 uint16 bits, quantized uint8 rows ``(..., row_bytes)``)."""
    q: np.ndarray                 # (ne3, n_head, n_batch, hsk) float32
    k: np.ndarray                 # (ne3, n_head_kv, n_kv, hsk)
    v: np.ndarray                 # (ne3, n_head_kv, n_kv, hsv)
    mask: np.ndarray | None       # (ne3, 1, n_batch, n_kv) float16
    sinks: np.ndarray | None      # (n_head,) float32
    k_type: int = GGML_TYPE_F16
    v_type: int = GGML_TYPE_F16
    clean: "FAInputs | None" = None  # nonfinite cases: the same inputs without the garbage

    def kv_float(self) -> tuple[np.ndarray, np.ndarray]:
        """K and V as float32 arrays, numpy order (quantized types dequantized by ggml)."""
        return _as_float(self.k, self.k_type), _as_float(self.v, self.v_type)


def _as_float(x: np.ndarray, t: int) -> np.ndarray:
    if t in STORAGE_DTYPES:
        return to_float(x, t)
    x = np.ascontiguousarray(x)
    info = type_info(t)
    ne0 = x.shape[-1] // info.type_size * info.blck_size
    n_rows = x.size // x.shape[-1]
    return dequantize_rows(x.ctypes.data, t, ne0, n_rows, x.shape[-1]).reshape(x.shape[:-1] + (ne0,))


def _storage(x: np.ndarray, t: int) -> np.ndarray:
    return from_float(x, t) if t in STORAGE_DTYPES else quantize(x, t)


def make_inputs(case: FACase, rng: np.random.Generator) -> FAInputs:
    q = rng.uniform(-1, 1, (case.ne3, case.n_head, case.n_batch, case.dk)).astype(np.float32)
    k = _storage(rng.uniform(-1, 1, (case.ne3, case.n_head_kv, case.n_kv, case.dk)), case.kv_type)
    if case.hsk == 576 and case.hsv == 512:  # MLA: V is a view of K's first 512 columns
        v = k[..., :512]
    else:
        v = _storage(rng.uniform(-1, 1, (case.ne3, case.n_head_kv, case.n_kv, case.dv)), case.v_kind)
    mask = random_kq_mask(rng, (case.ne3, 1, case.n_batch, case.n_kv)) if case.mask else None
    sinks = rng.uniform(-10, 10, case.n_head).astype(np.float32) if case.sinks else None
    x = FAInputs(q, k, v, mask, sinks, case.kv_type, case.v_kind)
    return _with_garbage(case, x, rng) if case.nonfinite else x


def _with_garbage(case: FACase, x: FAInputs, rng: np.random.Generator) -> FAInputs:
    """Hide a quarter of the KV cells of each stream from every row and fill K and V there with
    garbage: random bytes, then NaN, +inf and -inf in the first elements (float types) or a NaN
    / inf scale in the first block (quantized types). ``clean`` keeps the mask change only."""
    mask = x.mask.copy()
    k, v = x.k.copy(), (None if np.shares_memory(x.v, x.k) else x.v.copy())
    cells = [np.sort(rng.choice(case.n_kv, case.n_kv // 4, replace=False)) for _ in range(case.ne3)]
    for s, cs in enumerate(cells):
        mask[s, :, :, cs] = -np.inf
    clean = FAInputs(x.q, x.k, x.v, mask, x.sinks, x.k_type, x.v_type)
    for arr, t in ((k, x.k_type), (v, x.v_type)):
        if arr is None:
            continue
        raw = arr.view(np.uint8).reshape(arr.shape[:3] + (-1,))  # (ne3, n_head_kv, n_kv, row bytes)
        for s, cs in enumerate(cells):
            raw[s][:, cs] = rng.integers(0, 256, raw[s][:, cs].shape, dtype=np.uint8)
            if t in STORAGE_DTYPES:
                vals = from_float(np.array([np.nan, np.inf, -np.inf], np.float32), t)
                arr[s][:, cs, :3] = vals
            else:  # quantized: every type here starts its block with an f16 scale
                f16 = np.array([np.nan, np.inf, -np.inf], np.float16).view(np.uint8).reshape(3, 2)
                raw[s][:, cs, 0:2] = f16[np.arange(len(cs)) % 3][None]
    if v is None:  # MLA: V is a view of K
        v = k[..., :x.v.shape[-1]]
    return FAInputs(x.q, k, v, mask, x.sinks, x.k_type, x.v_type, clean)


__all__ = ["FACase", "FAInputs", "grid", "make_inputs", "random_kq_mask", "block_causal_mask", "FLOAT_TYPES", "QUANT_TYPES",
           "GGML_TYPE_F32", "GGML_TYPE_F16", "GGML_TYPE_BF16"]
