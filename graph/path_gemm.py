"""Path ``gemm`` of the block matrices (``matmul_dispatch.best_matmul`` past the tiled GEMMs): per
chunk of a matrix's rows one dequantization (``cuda/dense_q.cu``, ``matmul_dispatch.DEQUANT_KERNEL``)
into an F16 scratch and one cuBLAS GEMM (``cublas_gemm.CublasGemm``) reading it.

With ``matmul_dispatch.DEQUANT_STREAMS`` 1 both run on the caller's stream, one after the other,
in the weights' one scratch. With 2 a graph's chunks take turns over two scratch slots (the two
halves of the weights' scratch, which ``model_device.DeviceWeights`` makes twice as large then)
and the dequantizations run on a side stream (:class:`DequantRing`): chunk j's dequantization
waits only for the GEMM of chunk j - 2 (the last reader of its slot), so it runs under the GEMM
of chunk j - 1 and whatever the caller's stream does between them (the attention, the norms) --
a memory-bound kernel beside a compute-bound one. Every wait is on an event recorded in the same
graph run, so a CUDA-graph capture of the run records the fork and the joins as they are.

Shapes are numpy order: a ``QMatrix`` ``(n_out, n_in)``, activations F16 ``(n_tokens, n_in)``,
outputs F32 ``(n_tokens, n_out)``.
"""
from __future__ import annotations

import ctypes

from .cublas_gemm import CublasGemm

__all__ = ["dequant_gemm_launches", "path_gemm_steps", "DequantRing", "SLOT_ALIGN"]

SLOT_ALIGN = 128   # F16 values: each slot of the ring starts 256-byte aligned


def dequant_gemm_launches(w, x16, out, *, accumulate: bool = False, scratch=None) -> list[tuple]:
    """Path ``gemm`` of ``out (+)= w·x16`` (``QMatrix`` ``w`` ``(n_out, n_in)`` with its F16 ``scratch``,
    or F16 ``scratch`` given; ``x16`` F16 ``(n_tokens, n_in)``, ``out`` F32 ``(n_tokens, n_out)``,
    C-contiguous): per chunk of rows (``matmul_dispatch.dequant_chunk``) the pair (dequantization into
    the scratch, cuBLAS GEMM into the chunk's columns of ``out``), functions of no arguments; the
    caller keeps the arrays. ValueError for a matrix without scratch or an ``out`` that does not fit."""
    from ggml_attn import kernels as K  # noqa: PLC0415
    from ggml_attn.matmul_dispatch import dequant_chunk  # noqa: PLC0415
    scratch = getattr(w, "scratch", None) if scratch is None else scratch
    (n_out, n_in), n_tok = (int(d) for d in w.shape), int(x16.shape[0])
    if scratch is None:
        raise ValueError(f"{w.type} matrix of shape {w.shape} on the GPU has no F16 scratch (DeviceWeights makes one)")
    if not out.flags.c_contiguous or out.shape != (n_tok, n_out):
        raise ValueError(f"output of shape {out.shape} for a {w.shape} weight and {n_tok} tokens")
    dequant, chunk = dequant_chunk(n_out, n_in, scratch.size)
    fn = K.get_function(K.dense_q_variant(w.type_id), f"{dequant}<{w.type_id}>")
    spans = [(r0, min(n_out, r0 + chunk)) for r0 in range(0, n_out, chunk)]
    return [(K.grid_launch(fn, (r1 - r0) * (n_in // 32), ctypes.c_uint64(w.blocks.data.ptr + r0 * w.row_bytes),
                           ctypes.c_uint64(scratch.data.ptr), ctypes.c_int64(w.row_bytes), ctypes.c_int32(n_in),
                           ctypes.c_int64(r1 - r0)),
             CublasGemm.of_ptrs(scratch.data.ptr, r1 - r0, n_in, x16.data.ptr, n_tok, out.data.ptr + 4 * r0, n_out,
                                beta=1.0 if accumulate else 0.0)) for r0, r1 in spans]


class DequantRing:
    """One graph's path-``gemm`` chunks over two scratch slots (``scratch``'s halves, each starting
    SLOT_ALIGN-aligned) with the dequantizations on a side stream of ``xp`` (CuPy). Chunks are
    numbered in the order the graph builds them, which is the order its runs call them; chunk j
    uses slot j % 2. Its run: (chunk 0: record ``start`` on the caller's stream) -- the side
    stream waits for the GEMM of chunk j - 2 (chunks 0 and 1: ``start``), dequantizes, records;
    the caller's stream waits for that, runs the GEMM, records."""

    def __init__(self, xp, scratch):
        half = scratch.size // 2 // SLOT_ALIGN * SLOT_ALIGN
        if half < 1:
            raise ValueError(f"an F16 scratch of {scratch.size} values has no room for two slots")
        self.xp, self.scratch = xp, scratch
        self.slots = (scratch[:half], scratch[half:2 * half])
        self.side = xp.cuda.Stream(non_blocking=True)
        self.start = xp.cuda.Event(disable_timing=True)
        self.dequantized, self.multiplied = [], []   # per chunk: its events on the side / caller's stream

    def steps(self, w, x16, out, *, accumulate: bool = False) -> list:
        """The chunks of ``out (+)= w·x16`` (:func:`dequant_gemm_launches`' shapes), each a function
        of no arguments running it as above."""
        both = zip(*(dequant_gemm_launches(w, x16, out, accumulate=accumulate, scratch=s) for s in self.slots))
        return [self._chunk(pair) for pair in both]

    def _chunk(self, pair):
        j, ev = len(self.dequantized), self.xp.cuda.Event
        self.dequantized.append(ev(disable_timing=True))
        self.multiplied.append(ev(disable_timing=True))
        dequant, gemm = pair[j % 2]
        side, deq_done, gemm_done = self.side, self.dequantized[j], self.multiplied[j]
        slot_free = self.start if j < 2 else self.multiplied[j - 2]
        cuda = self.xp.cuda

        def run():
            main = cuda.get_current_stream()
            if j == 0:
                self.start.record(main)
            side.wait_event(slot_free)
            with side:
                dequant()
            deq_done.record(side)
            main.wait_event(deq_done)
            gemm()
            gemm_done.record(main)
        return run


def path_gemm_steps(b, w, x16, out, *, accumulate: bool = False) -> list:
    """``out (+)= w·x16`` by path ``gemm`` in graph builder ``b``: functions of no arguments to run
    in order -- the pairs of :func:`dequant_gemm_launches` (``matmul_dispatch.DEQUANT_STREAMS`` 1),
    or the chunks of ``b``'s :class:`DequantRing` over ``w``'s scratch (2; made at the graph's first
    such matrix and kept with the graph). ValueError for another DEQUANT_STREAMS."""
    from ggml_attn.matmul_dispatch import DEQUANT_STREAMS  # noqa: PLC0415
    if DEQUANT_STREAMS == 1:
        return [launch for pair in dequant_gemm_launches(w, x16, out, accumulate=accumulate) for launch in pair]
    if DEQUANT_STREAMS != 2:
        raise ValueError(f"DEQUANT_STREAMS must be 1 or 2, not {DEQUANT_STREAMS!r}")
    if getattr(w, "scratch", None) is None:
        raise ValueError(f"{w.type} matrix of shape {w.shape} on the GPU has no F16 scratch (DeviceWeights makes one)")
    rings = b.dequant_rings
    ring = rings.get(id(w.scratch))
    if ring is None:
        ring = rings[id(w.scratch)] = DequantRing(b.xp, w.scratch)
        b.keep(ring)
    return ring.steps(w, x16, out, accumulate=accumulate)
