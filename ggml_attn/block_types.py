"""ggml's quantized weight types that stay in their blocks on the GPU: names, ggml type ids and
byte layouts, the Python side of ``cuda/quant_blocks.cuh`` (whose ``QB_*`` ids and
``QBlock<T>`` sizes these mirror; tests/test_quant_blocks.py checks both against ggml).

Every type of llama.cpp's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K_*, Q4_K_*, Q5_K_* and Q6_K
files. Others (IQ*, TQ*) are dequantized at load (``graph/model_device.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BlockLayout", "BLOCK_TYPES", "block_layout", "is_block_type"]


@dataclass(frozen=True)
class BlockLayout:
    """``values`` per block of ``nbytes`` bytes; ``half_offsets``: byte offsets of the block's
    half-precision scales (d, and dmin / m where the type has one)."""

    name: str
    type_id: int
    values: int
    nbytes: int
    half_offsets: tuple[int, ...]

    def row_bytes(self, n: int) -> int:
        """Bytes of a row of ``n`` values (a multiple of :attr:`values`)."""
        if n % self.values:
            raise ValueError(f"{self.name}: a row of {n} values is not whole blocks of {self.values}")
        return n // self.values * self.nbytes


_LAYOUTS = {lay.name: lay for lay in (
    BlockLayout("Q4_0", 2, 32, 18, (0,)),
    BlockLayout("Q4_1", 3, 32, 20, (0, 2)),
    BlockLayout("Q5_0", 6, 32, 22, (0,)),
    BlockLayout("Q5_1", 7, 32, 24, (0, 2)),
    BlockLayout("Q8_0", 8, 32, 34, (0,)),
    BlockLayout("Q2_K", 10, 256, 84, (80, 82)),
    BlockLayout("Q3_K", 11, 256, 110, (108,)),
    BlockLayout("Q4_K", 12, 256, 144, (0, 2)),
    BlockLayout("Q5_K", 13, 256, 176, (0, 2)),
    BlockLayout("Q6_K", 14, 256, 210, (208,)),
)}

BLOCK_TYPES = tuple(_LAYOUTS)


def is_block_type(name: str) -> bool:
    return name in _LAYOUTS


def block_layout(name: str) -> BlockLayout:
    try:
        return _LAYOUTS[name]
    except KeyError:
        raise ValueError(f"{name!r} is not a block type the GPU reads (one of {', '.join(BLOCK_TYPES)})") from None
