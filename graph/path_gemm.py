"""Path ``gemm`` of the block matrices (``matmul_dispatch.best_matmul`` past the tiled GEMMs): per
chunk of a matrix's rows (``matmul_dispatch.dequant_chunk``: as many as a scratch slot holds) one
dequantization (``cuda/dense_q.cu`` dense_dequant_f16) into the weights' F16 scratch and one cuBLAS
GEMM (``cublas_gemm.CublasGemm``) reading it.

With ``matmul_dispatch.DEQUANT_SIDE_SMS`` None both run on the caller's stream, one after the other,
in the one scratch. With ``s`` SMs a graph's chunks take turns over two scratch slots (the halves of
the scratch, which ``model_device.DeviceWeights`` makes twice as large then) and the dequantizations
run on a side stream of the least priority (:class:`DequantRing`): chunk j's dequantization waits
only for the GEMM of chunk j - 2 (the last reader of its slot), so it runs under the GEMM of chunk
j - 1. cuBLAS plans each GEMM for ``num_sms - s`` SMs and the engine's stream has the greatest
priority (:func:`engine_stream_priority`): a GEMM's blocks take the SMs they ask for first, the
dequantization the ``s`` left and any SM idle between GEMMs -- when the graph runs eagerly; a
CUDA-graph replay runs every node at its launch stream's priority (instantiating with the
driver's node priorities was refused, CUDA_ERROR_NOT_SUPPORTED, on the H100). Measured (H100,
pp512 on an 8B Q4_K_M file, without graphs): s 32 +3.9%; two streams without the SM target bought
~1% (cuBLAS's blocks filled every SM): bench/NOTES.md, twenty-third and twenty-fourth sessions.
Every wait is
on an event recorded in the same graph run, so a CUDA-graph capture of the run records the fork and
the joins as they are; a run that calls the chunks out of their build order is refused.

Shapes are numpy order: a ``QMatrix`` ``(n_out, n_in)``, activations F16 ``(n_tokens, n_in)``,
outputs F32 ``(n_tokens, n_out)``.
"""
from __future__ import annotations

import ctypes

from .cublas_gemm import CublasGemm

__all__ = ["dequant_gemm_launches", "path_gemm_steps", "DequantRing", "side_sms", "engine_stream_priority",
           "SLOT_ALIGN", "GREATEST_PRIORITY"]

SLOT_ALIGN = 128          # F16 values: each slot of the ring starts 256-byte aligned
GREATEST_PRIORITY = -100  # a stream priority past any device's greatest (CUDA clamps it to the greatest)
LEAST_PRIORITY = 0        # the least priority on every device (CUDA's default)


def side_sms(num_sms: int) -> int | None:
    """``matmul_dispatch.DEQUANT_SIDE_SMS`` checked against a GPU of ``num_sms`` SMs: None (one
    stream) or the SMs left to the dequantizations. ValueError for anything else."""
    from ggml_attn.matmul_dispatch import DEQUANT_SIDE_SMS as s  # noqa: PLC0415
    if s is None:
        return None
    if isinstance(s, bool) or not isinstance(s, int) or not 0 < s < num_sms:
        raise ValueError(f"DEQUANT_SIDE_SMS must be None or a whole number of SMs in 1..{num_sms - 1} "
                         f"(this GPU has {num_sms}), not {s!r}")
    return s


def engine_stream_priority() -> int | None:
    """The priority an engine's stream takes (None: the default): the greatest while
    ``matmul_dispatch.DEQUANT_SIDE_SMS`` puts path gemm's dequantizations on a side stream."""
    from ggml_attn.matmul_dispatch import DEQUANT_SIDE_SMS  # noqa: PLC0415
    return None if DEQUANT_SIDE_SMS is None else GREATEST_PRIORITY


def dequant_gemm_launches(w, x16, out, *, accumulate: bool = False, scratch=None, sm_target: int = 0) -> list[tuple]:
    """Path ``gemm`` of ``out (+)= w·x16`` (``QMatrix`` ``w`` ``(n_out, n_in)`` with its F16 ``scratch``,
    or F16 ``scratch`` given: a slot; ``x16`` F16 ``(n_tokens, n_in)``, ``out`` F32 ``(n_tokens, n_out)``,
    C-contiguous): per chunk of rows (``matmul_dispatch.dequant_chunk``) the pair (dequantization into
    the scratch, cuBLAS GEMM into the chunk's columns of ``out``, planned for ``sm_target`` SMs where
    not 0), functions of no arguments; the caller keeps the arrays. ValueError for a matrix without
    scratch or an ``out`` that does not fit."""
    from ggml_attn import kernels as K  # noqa: PLC0415
    from ggml_attn.matmul_dispatch import dequant_chunk  # noqa: PLC0415
    scratch = getattr(w, "scratch", None) if scratch is None else scratch
    (n_out, n_in), n_tok = (int(d) for d in w.shape), int(x16.shape[0])
    if scratch is None:
        raise ValueError(f"{w.type} matrix of shape {w.shape} on the GPU has no F16 scratch (DeviceWeights makes one)")
    if not out.flags.c_contiguous or out.shape != (n_tok, n_out):
        raise ValueError(f"output of shape {out.shape} for a {w.shape} weight and {n_tok} tokens")
    chunk = dequant_chunk(n_out, n_in, scratch.size)
    fn = K.get_function(K.dense_q_variant(w.type_id), f"dense_dequant_f16<{w.type_id}>")
    spans = [(r0, min(n_out, r0 + chunk)) for r0 in range(0, n_out, chunk)]
    return [(K.grid_launch(fn, (r1 - r0) * (n_in // 32), ctypes.c_uint64(w.blocks.data.ptr + r0 * w.row_bytes),
                           ctypes.c_uint64(scratch.data.ptr), ctypes.c_int64(w.row_bytes), ctypes.c_int32(n_in),
                           ctypes.c_int64(r1 - r0)),
             CublasGemm.of_ptrs(scratch.data.ptr, r1 - r0, n_in, x16.data.ptr, n_tok, out.data.ptr + 4 * r0, n_out,
                                beta=1.0 if accumulate else 0.0, sm_target=sm_target)) for r0, r1 in spans]


class DequantRing:
    """One graph's path-``gemm`` chunks over two scratch slots (``scratch``'s halves, each starting
    SLOT_ALIGN-aligned) with the dequantizations on a side stream of ``xp`` (CuPy) of the least
    priority and each GEMM planned for ``gemm_sms`` SMs. Chunks are numbered in the order the graph
    builds them, which must be the order its runs call them (checked: RuntimeError otherwise); chunk
    j uses slot j % 2. Its run: (chunk 0: record ``start`` on the caller's stream) -- the side stream
    waits for the GEMM of chunk j - 2 (chunks 0 and 1: ``start``), dequantizes, records; the
    caller's stream waits for that, runs the GEMM, records."""

    def __init__(self, xp, scratch, gemm_sms: int):
        half = scratch.size // 2 // SLOT_ALIGN * SLOT_ALIGN
        if half < 1:
            raise ValueError(f"an F16 scratch of {scratch.size} values has no room for two slots")
        self.xp, self.scratch, self.gemm_sms = xp, scratch, int(gemm_sms)
        self.slots = (scratch[:half], scratch[half:2 * half])
        self.side = xp.cuda.Stream(non_blocking=True, priority=LEAST_PRIORITY)
        self.start = xp.cuda.Event(disable_timing=True)
        self.dequantized, self.multiplied = [], []   # per chunk: its events on the side / caller's stream
        self.next = 0   # the chunk a run calls next

    def steps(self, w, x16, out, *, accumulate: bool = False) -> list:
        """The chunks of ``out (+)= w·x16`` (:func:`dequant_gemm_launches`' shapes), each a function
        of no arguments running it as above."""
        both = zip(*(dequant_gemm_launches(w, x16, out, accumulate=accumulate, scratch=s, sm_target=self.gemm_sms)
                     for s in self.slots))
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
            if j == 0:
                self.next = 0
            if self.next != j:   # (an event of another run would be waited for: a race, not an error)
                raise RuntimeError(f"path gemm's chunk {j} called after chunk {self.next - 1}: the graph's "
                                   "nodes ran out of their build order, which DequantRing's events follow")
            self.next = j + 1
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
    in order -- the pairs of :func:`dequant_gemm_launches` (``matmul_dispatch.DEQUANT_SIDE_SMS``
    None), or the chunks of ``b``'s :class:`DequantRing` over ``w``'s scratch (made at the graph's
    first such matrix and kept with the graph). ValueError for a bad DEQUANT_SIDE_SMS."""
    from ggml_attn.cuda_device import num_sms  # noqa: PLC0415
    if getattr(w, "scratch", None) is None:
        raise ValueError(f"{w.type} matrix of shape {w.shape} on the GPU has no F16 scratch (DeviceWeights makes one)")
    sms = num_sms()
    side = side_sms(sms)
    if side is None:
        return [launch for pair in dequant_gemm_launches(w, x16, out, accumulate=accumulate) for launch in pair]
    ring = b.dequant_rings.get(id(w.scratch))
    if ring is None:
        ring = b.dequant_rings[id(w.scratch)] = DequantRing(b.xp, w.scratch, sms - side)
        b.keep(ring)
    return ring.steps(w, x16, out, accumulate=accumulate)
