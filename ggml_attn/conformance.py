"""llama.cpp's ``test-backend-ops`` FLASH_ATTN_EXT cases, ported (REFERENCE.md section 2).

:func:`grid` yields the evaluation grid of ggml 0.15.3's ``test-backend-ops.cpp``
restricted to F32/F16/BF16 K/V (quantized types are out of scope); :func:`make_inputs`
draws one case's tensors the way that test does (uniform [-1, 1], sinks in [-10, 10], a
random mask in [-1, 1] with about 20% of 128x64 blocks set to -inf or 0). Arrays come in
**numpy order** and in ggml storage dtypes (F16 ``float16``, BF16 ``uint16`` bits).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .dtypes import GGML_TYPE_BF16, GGML_TYPE_F16, GGML_TYPE_F32, TYPE_NAMES, from_float


@dataclass(frozen=True)
class FACase:
    hsk: int                # K head size (D_k)
    hsv: int                # V head size (D_v)
    n_head_kv: int          # "nh" in test-backend-ops
    gqa: int                # nr2: query heads per KV head
    ne3: int                # nr3: streams
    n_kv: int
    n_batch: int
    mask: bool
    sinks: bool
    max_bias: float
    logit_softcap: float
    kv_type: int
    permuted: bool = False  # q/k/v created permuted (0, 2, 1, 3), i.e. non-contiguous views

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
                f"_sc{self.logit_softcap:g}_{TYPE_NAMES[self.kv_type]}{'_perm' if self.permuted else ''}")


def grid(kv_types=(GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16)):
    """All FLASH_ATTN_EXT cases of test-backend-ops (ggml 0.15.3) for ``kv_types``.

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


def random_kq_mask(rng: np.random.Generator, shape, lo=-1.0, hi=1.0) -> np.ndarray:
    """F16 mask, numpy order ``(ne3, ne2, ne1, ne0)``, uniform in [lo, hi] with about 20% of
    128x64 (ne0 x ne1) blocks set to -inf or 0, as test-backend-ops' init_tensor_kq_mask."""
    m = rng.uniform(lo, hi, size=shape).astype(np.float32)
    ne3, ne2, ne1, ne0 = shape
    for _ in range(int(0.2 * m.size / (128 * 64))):
        p3, p2, p1, p0 = (int(rng.integers(n)) for n in (ne3, ne2, ne1, ne0))
        m[p3, p2, p1:p1 + 64, p0:p0 + 128] = -np.inf if rng.integers(2) else 0.0
    return m.astype(np.float16)


@dataclass
class FAInputs:
    """One case's tensors in numpy order; k/v in ggml storage dtype of ``kv_type``."""
    q: np.ndarray                 # (ne3, n_head, n_batch, hsk) float32
    k: np.ndarray                 # (ne3, n_head_kv, n_kv, hsk)
    v: np.ndarray                 # (ne3, n_head_kv, n_kv, hsv)
    mask: np.ndarray | None       # (ne3, 1, n_batch, n_kv) float16
    sinks: np.ndarray | None      # (n_head,) float32


def make_inputs(case: FACase, rng: np.random.Generator) -> FAInputs:
    q = rng.uniform(-1, 1, (case.ne3, case.n_head, case.n_batch, case.hsk)).astype(np.float32)
    k = from_float(rng.uniform(-1, 1, (case.ne3, case.n_head_kv, case.n_kv, case.hsk)), case.kv_type)
    if case.hsk == 576 and case.hsv == 512:  # MLA: V is a view of K's first 512 columns
        v = k[..., :512]
    else:
        v = from_float(rng.uniform(-1, 1, (case.ne3, case.n_head_kv, case.n_kv, case.hsv)), case.kv_type)
    mask = random_kq_mask(rng, (case.ne3, 1, case.n_batch, case.n_kv)) if case.mask else None
    sinks = rng.uniform(-10, 10, case.n_head).astype(np.float32) if case.sinks else None
    return FAInputs(q, k, v, mask, sinks)


__all__ = ["FACase", "FAInputs", "grid", "make_inputs", "random_kq_mask",
           "GGML_TYPE_F32", "GGML_TYPE_F16", "GGML_TYPE_BF16"]
