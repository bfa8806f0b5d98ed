"""The full block's matmuls as ggml custom ops (``xp_node``) over an array module ``xp`` (numpy or CuPy),
for all-custom (device-resident) graphs. On numpy each op is a few numpy calls (the CPU tests
check them against ggml's own ops); on CuPy the same math is fused into fewer launches and
checked against the host graph by tests/test_graph_device.py: for up to
``kernels.GEMV_MAX_TOKENS`` tokens (decode) one ``dense_gemv`` launch per :func:`mul_mat_group`
(Q, K and V together), :func:`mul_mat_gated` (gate, up and SiLU) and :func:`mul_mat_add` (a
projection added into the residual stream), reading the F16 weights once; for more tokens
one F16 cast of the input and one cuBLAS GEMM per weight (f16 in, f32 accumulate and out;
:func:`mul_mat_add` accumulates through the GEMM's beta). The group and gated ops take the
block's RMS norm too (``norm_eps``): inside the GEMV on the first path, one ``dense_rms_norm``
launch (``cuda/dense.cu``) before the cast on the second.

Weights are F16 arrays or ``model_device.QMatrix`` (a matrix kept in ggml's blocks, a real
model's Q4_0 .. Q6_K matrices): ``matmul_dispatch.best_matmul`` picks, per weight type and token count,
one ``dense_gemv_q`` launch (``cuda/dense_q.cu``: the blocks decoded in registers, F32
activations; the norm's weight ``norm_w`` applied to the normalized activations there), or its
8-bit-activation twin (:func:`q8x_launches`, ``cuda/dense_q8x.cu``), the tiled block GEMM on the
tensor cores (``tiled_gemm.gemm_q_launch``), or the blocks dequantized a chunk of rows at a time into
the weights' F16 scratch and a cuBLAS GEMM; numpy multiplies ggml's dequantized values in F32. F16 weights of a model carry their norm weight folded (``model_device.py``).

Every op's result memory and scratch is an array made at build time (``b.scratch``); the callback only runs
``xp`` functions with ``out=`` on arrays bound at build time: nothing is allocated while the
graph computes, nothing synchronizes (on CuPy each op launches work on the current stream).
Shapes at the function boundaries, ggml order ``[ne0, ne1]`` = numpy ``(ne1, ne0)``:

* :func:`mul_mat`: weight F16 numpy ``(n_out, n_in)`` = ggml ``[n_in, n_out]`` times
  ``h`` F32 ``[n_in, n_tokens]`` -> F32 ``[n_out, n_tokens]``; ``h`` is rounded to F16 first
  and the products summed in F32, as ggml's CPU ``mul_mat`` with an F16 weight does (numpy:
  the F16 product widened to F32; CuPy: F32 out of the GEMM);
* :func:`mul_mat_group`: several weights times the same ``h`` (RMS-normalized first with
  ``norm_eps``: ``h / sqrt(mean(h^2) + eps)`` per token): a list of F32 ``[n_out_i, n_tokens]``
  tensors, views of one result node;
* :func:`mul_mat_gated`: ``silu(wg·h) * (wu·h)`` (``norm_eps`` as above), F32 ``[n_ff, n_tokens]``;
* :func:`mul_mat_add`: ``x += w·h`` in place (``x`` F32 ``[n_out, n_tokens]``); the node's
  result is ``x``'s memory;
* :func:`add_into`: ``x += y`` in place; the node's result is ``x``'s memory.

Each function takes the graph builder ``b`` (``build.GraphBuilder``) and tensors made by it,
and returns the result tensor.
"""
from __future__ import annotations

import ctypes

import numpy as np

from .cublas_gemm import CublasGemm as _CublasGemm
from .model_device import QMatrix
from .path_gemm import dequant_gemm_launches
from . import q8_handoff
from .q8_matmul import gemm_q8_launch, q8x_launches, quant_q8x_launch, rows_aligned
from .tiled_gemm import gemm_q_launch, gemm_qrg_launch, tile_counters
from .xp_node import custom as _custom, dptr as _dptr, then as _then, views as _views

__all__ = ["mul_mat", "mul_mat_group", "mul_mat_gated", "mul_mat_add", "rms_norm", "gemv_launch", "gemv_q_launch",
           "gemm_q_launch", "gemm_qrg_launch"]


def mul_mat(b, w, h, name: str):
    """``w`` (xp F16 ``(n_out, n_in)``, or a ``model_device.QMatrix``) x ``h`` (tensor F32
    ``[n_in, n_tokens]``)."""
    return mul_mat_group(b, [w], h, name)[0]


def mul_mat_group(b, ws: list, h, name: str, *, norm_eps: float | None = None, norm_w=None) -> list:
    """``[w·h for w in ws]``: each ``w`` xp F16 ``(n_out_i, n_in)`` or a ``model_device.QMatrix``
    (weight blocks), ``h`` tensor F32 ``[n_in, n_tokens]``; returns F32 tensors ``[n_out_i,
    n_tokens]``, views of one node whose memory holds them one after another (numpy
    ``(n_tokens, n_out_i)`` each, contiguous). ``norm_eps``: ``h`` is RMS-normalized first
    (:func:`rms_norm`), inside this node; ``norm_w`` (xp F32 ``(n_in,)``): the norm's weight,
    which block matrices apply to the normalized ``h`` (an F16 one carries it folded). An ``h``
    whose node made its normalized 8-bit form (:func:`mul_mat_add`'s ``norm_next``) is read so."""
    x = b.array(h)                                  # (n_tokens, n_in) F32
    n_tok = x.shape[0]
    sizes = [n_tok * int(w.shape[0]) for w in ws]
    flat = b.scratch((sum(sizes),), np.float32)
    outs, off = [], 0
    for w, n in zip(ws, sizes):
        outs.append(flat[off:off + n].reshape(n_tok, int(w.shape[0])))
        off += n
    run = _gemv(b, ws, x, outs, mode=0, norm_eps=norm_eps, norm_w=norm_w, q8=q8_handoff.form_of(b, h, norm_eps, norm_w)) or \
        _general(b, ws, x, outs, norm_eps=norm_eps, norm_w=norm_w, name=name)
    base = b.ptr(flat)
    node = _custom(b, run, [h], flat.reshape(1, -1), name, ptr=base)
    return _views(b, node, outs, base, name)   # (outs: flat's parts, in order)


def mul_mat_gated(b, wg, wu, h, name: str, *, norm_eps: float | None = None, norm_w=None, gelu: bool = False,
                  down=None):
    """``silu(wg·h) * (wu·h)`` (``gelu``: ggml's tanh GELU instead of SiLU): ``wg``, ``wu`` xp
    F16 ``(n_ff, n_in)`` or ``QMatrix``, ``h`` F32 ``[n_in, n_tokens]`` -> F32 ``[n_ff,
    n_tokens]``; ``norm_eps``, ``norm_w``: of the RMS-normalized ``h``, as :func:`mul_mat_group`
    (its 8-bit form read where ``h``'s node made it). SiLU is fused into the GEMV; GELU runs after
    the two products (one more launch). ``down``: the matrix :func:`mul_mat_add` multiplies the
    result by next; where both run the 8-bit GEMV (``matmul_dispatch.gemv_quant_out``) the gated
    one writes the result's 8-bit form as well (``b.q8_forms``), which that GEMV reads instead of
    quantizing it; where the product runs apart and ``down``'s GEMM reads F16
    (``q8_handoff.f16_for``), it writes the result's F16 form as well (``b.f16_forms``), which that
    GEMM reads instead of casting it."""
    x = b.array(h)
    pre = q8_handoff.form_of(b, h, norm_eps, norm_w)
    out = b.scratch((x.shape[0], int(wg.shape[0])), np.float32)
    out_q = None if gelu or down is None else q8_handoff.arrays_for(b, [wg, down], x.shape[0], int(wg.shape[0]))
    run = None if gelu else _gemv(b, [wg, wu], x, [out], mode=2, norm_eps=norm_eps, norm_w=norm_w, q8=pre, out_q=out_q)
    if run is None and out_q is not None:   # (the output's 8-bit form did not fit the launch)
        out_q = None
        run = _gemv(b, [wg, wu], x, [out], mode=2, norm_eps=norm_eps, norm_w=norm_w, q8=pre)
    out16 = None
    if run is None and not gelu:
        run, out16 = _gated_gemm(b, wg, wu, x, out, down, norm_eps=norm_eps, norm_w=norm_w, name=name)
    if run is None:
        g = b.scratch(out.shape, np.float32)
        u = b.scratch(out.shape, np.float32)
        both = _gemv(b, [wg, wu], x, [g, u], mode=0, norm_eps=norm_eps, norm_w=norm_w, q8=pre) or \
            _general(b, [wg, wu], x, [g, u], norm_eps=norm_eps, norm_w=norm_w, name=name)
        out16 = q8_handoff.f16_for(b, down, x.shape[0], out.shape)   # (the down GEMM's input, no cast between)
        run = _then(both, _act_mul_fn("gelu" if gelu else "silu", b.xp, g, u, out, out16))
        b.keep(g, u)
    node = q8_handoff.remember(b, _custom(b, run, [h], out, name, ptr=b.ptr(out)), out_q, None, None)
    return q8_handoff.remember_f16(b, node, out16)


def _gated_gemm(b, wg, wu, x, out, down, *, norm_eps, norm_w, name: str):
    """``(run, out16)``: ``out = silu(wg·h) * (wu·h)`` of ``x`` (numpy ``(n_tokens, n_in)`` F32,
    RMS-normalized and times ``norm_w`` first with ``norm_eps``, rounded to F16 by the norm's
    launch or a cast) by one ``tiled_gemm.gemm_qrg_launch`` where ``matmul_dispatch.gated_kernel`` says so
    for block weights ``wg`` and ``wu``, and ``out16`` the result's F16 form where ``down``'s GEMM
    reads it (``q8_handoff.f16_for``); ``(None, None)`` elsewhere."""
    if b.xp is np or not (_is_q(wg) and _is_q(wu)):
        return None, None
    from ggml_attn import kernels as K  # noqa: PLC0415
    from ggml_attn.cuda_device import num_sms  # noqa: PLC0415
    from ggml_attn.matmul_dispatch import gated_kernel, split_finish  # noqa: PLC0415
    n_tok, (n_ff, n_in) = x.shape[0], (int(d) for d in wg.shape)
    if gated_kernel(wg.type, wu.type, n_tok, aligned=rows_aligned([wg, wu])) is None:
        return None, None
    norm, x16 = _rms_fn(b, x, norm_eps, name, norm_w, f16=True) if norm_eps is not None else _f16_input(b, x, None)
    grid, _ = K.gemm_q_grid(n_ff, n_tok, n_in, num_sms(), "dense_gemm_qrg")
    part = b.scratch((grid[2], 2, n_tok, n_ff), np.float32) if grid[2] > 1 else None
    out16 = q8_handoff.f16_for(b, down, n_tok, out.shape)
    done = tile_counters(b, grid) if split_finish("dense_gemm_qrg", grid[2]) else None
    run = _then(norm, gemm_qrg_launch(wg, wu, x16, out, out16, part, done=done))
    b.keep(wg.blocks, wu.blocks, x16, out, *(a for a in (part, norm_w) if a is not None))
    return run, out16


def mul_mat_add(b, w, h, x_t, name: str, *, norm_next=None):
    """``x += w·h``: ``w`` xp F16 ``(n_out, n_in)`` or ``QMatrix``, ``h`` F32 ``[n_in, n_tokens]``,
    ``x_t`` F32 ``[n_out, n_tokens]``; returns a node whose memory is ``x``'s. An ``h`` whose
    8-bit form its node made (``b.q8_forms``, :func:`mul_mat_gated`'s ``down``) is not quantized
    again, nor one whose F16 form it made (``b.f16_forms``) cast again. ``norm_next``: ``(g, eps,
    ws)``, the RMS norm (weight xp F32 ``(n_out,)``, eps) and the matrices of what multiplies ``x`` next (:func:`mul_mat_group`, :func:`mul_mat_gated`); where
    this GEMV and theirs run the 8-bit GEMV (``matmul_dispatch.gemv_quant_out``) it writes the
    normalized ``x``'s 8-bit form as well, which theirs read instead of quantizing it."""
    x_in, x = b.array(h), b.array(x_t)
    pre = q8_handoff.form_of(b, h, None, None)
    g, eps, nxt = norm_next if norm_next is not None else (None, None, None)
    out_q = None if nxt is None else q8_handoff.arrays_for(b, [w, *nxt], x.shape[0], x.shape[1])
    run = _gemv(b, [w], x_in, [x], mode=1, q8=pre, out_q=out_q, out_norm=(g, eps))
    if run is None and out_q is not None:   # (the output's 8-bit form did not fit the launch)
        out_q = None
        run = _gemv(b, [w], x_in, [x], mode=1, q8=pre)
    run = run or _general(b, [w], x_in, [x], name=name, accumulate=True, x16=q8_handoff.f16_of(b, h))
    node = _custom(b, run, [h, x_t], x, name, ptr=x_t.contents.data)   # x's memory is x_t's
    return q8_handoff.remember(b, node, out_q, eps, g)


def rms_norm(b, t, eps: float, g, name: str, *, row: int | None = None):
    """``rms_norm(t) * g`` over rows of ``row`` values (default: ``t``'s ``ne0``): ``t`` an F32
    tensor whose array :meth:`build.GraphBuilder.array` reads, ``g`` xp F32 ``(row,)``; returns a
    new F32 tensor of ``t``'s shape (ggml's ``rms_norm`` then ``mul``: a head's Q/K norm with
    ``row = head_dim_k``, an output norm with ``row = n_embd``)."""
    x = b.array(t)
    row = int(t.contents.ne[0]) if row is None else int(row)
    if x.size % row or g.shape != (row,):
        raise ValueError(f"{name}: rms_norm of {x.size} values in rows of {row} with a weight of shape {g.shape}")
    run, out = _rms_fn(b, x.reshape(-1, row), eps, name, g)
    return _custom(b, run, [t], out.reshape(x.shape), name, ptr=b.ptr(out))


def _is_q(w) -> bool:
    """A matrix in ggml's blocks (``model_device.QMatrix``), not an F16 array."""
    return isinstance(w, QMatrix)


def _wtype(w) -> str:
    return w.type if _is_q(w) else "F16"


def _gemv(b, ws: list, x, outs: list, *, mode: int, norm_eps: float | None = None, norm_w=None, out_q=None,
          out_norm=(None, None), q8=None):
    """One GEMV launch per weight type (F16: :func:`gemv_launch`; blocks: :func:`gemv_q_launch`,
    or :func:`q8x_launches` where ``matmul_dispatch.best_matmul`` says ``gemv-q8x``) for graph builder
    ``b`` when ``matmul_dispatch.best_matmul`` says GEMV for every weight; None on
    numpy, for more tokens, or when a launch cannot take the arrays (mixed types are split only
    for mode 0). ``out_q``, ``out_norm``: :func:`q8x_launches`' (None where the weights do not run it);
    ``q8``: ``x`` already in 8-bit form (xq, xd, xs), for the 8-bit GEMVs to read unquantized.
    The arrays are kept with the graph."""
    if b.xp is np:
        return None
    kinds = [_wtype(w) for w in ws]
    groups = [(k, [i for i, kk in enumerate(kinds) if kk == k]) for k in dict.fromkeys(kinds)]
    paths = {k: q8_handoff.matmul_choice([ws[i] for i in idx], x.shape[0]).path for k, idx in groups}
    if any(not p.startswith("gemv") for p in paths.values()):
        return None
    if len(groups) > 1 and mode != 0:
        return None
    if out_q is not None and any(p != "gemv-q8x" for p in paths.values()):
        return None
    runs, made = [], q8 is not None
    for k, idx in groups:
        gw = [ws[i] for i in idx]
        go = outs if mode == 2 else [outs[i] for i in idx]
        if k == "F16":   # (its norm weight folded at load)
            run = gemv_launch(gw, x, go, mode=mode, norm_eps=norm_eps, unroll=None)
        elif paths[k] == "gemv-q8x":   # x quantized once for every such group of the call
            first = not made
            if first:
                n_tok, n_in = x.shape
                q8 = (b.scratch((n_tok, n_in), np.int8), b.scratch((n_tok, n_in // 32), np.float32),
                      b.scratch((n_tok, n_in // 32), np.float32))
                b.keep(*q8)   # (a handed-over form is kept by its producer: q8_handoff.remember)
                made = True
            run = q8x_launches(gw, x, go, *q8, mode=mode, norm_eps=norm_eps, norm_w=norm_w, quantize=first,
                               out_q=out_q, out_norm=out_norm)
        else:
            run = gemv_q_launch(gw, x, go, mode=mode, norm_eps=norm_eps, norm_w=norm_w)
        if run is None:
            return None
        runs.append(run)
    b.keep(*(w.blocks if _is_q(w) else w for w in ws), x, *outs, *([norm_w] if norm_w is not None else []))
    return _then(*runs)


def gemv_q_launch(ws: list, x, outs: list, *, mode: int, norm_eps: float | None = None, norm_w=None,
                  warps: int | None = None):
    """One ``dense_gemv_q`` launch (``cuda/dense_q.cu``) over ``QMatrix`` weights of one block
    type (CuPy blocks, at most three), ``x`` F32 ``(n_tokens, n_in)`` with at most
    ``GEMVQ_MAX_TOKENS`` tokens, ``outs`` as :func:`gemv_launch`'s; with ``norm_eps`` of the
    RMS-normalized ``x`` times ``norm_w`` (F32 ``(n_in,)``, or None); ``warps`` a block (default
    ``kernels.GEMVQ_WARPS``; one of ``GEMVQ_WARPS_X``: the benchmark's A/B instances). Returns a
    function of no arguments launching on the current stream, or None when the arrays do not fit
    the kernel; the caller keeps the arrays alive."""
    from ggml_attn import kernels as K  # noqa: PLC0415
    n_tok, n_in = x.shape
    if warps not in (None, K.GEMVQ_WARPS) and (warps not in K.GEMVQ_WARPS_X or n_tok > max(K.GEMVQ_WARPS_X[warps])):
        return None
    if n_tok > K.GEMVQ_MAX_TOKENS or len(ws) > 3 or len({w.type for w in ws}) != 1 or \
            (norm_eps is not None and not norm_eps > 0.0) or (norm_w is not None and norm_eps is None):
        return None
    if not all(a.flags.c_contiguous and a.data.ptr % 16 == 0 for a in (x, *outs)) \
            or any(w.shape[1] != n_in for w in ws) or n_in % ws[0].layout.values:
        return None
    if norm_w is not None and (norm_w.shape != (n_in,) or norm_w.data.ptr % 16 or not norm_w.flags.c_contiguous):
        return None
    p = K.GemvQParams()
    for i, w in enumerate(ws):
        o = outs[0] if mode == 2 else outs[i]
        p.seg[i].w, p.seg[i].out, p.seg[i].rows = w.blocks.data.ptr, o.data.ptr, int(w.shape[0])
    p.x, p.x_stride, p.g, p.row_bytes = x.data.ptr, n_in, 0 if norm_w is None else norm_w.data.ptr, ws[0].row_bytes
    p.n_in, p.n_tok, p.n_seg, p.mode = n_in, n_tok, len(ws), mode
    p.norm_eps = 0.0 if norm_eps is None else float(norm_eps)
    rows = int(ws[0].shape[0]) if mode == 2 else sum(int(w.shape[0]) for w in ws)
    t, w = ws[0].type_id, warps or K.GEMVQ_WARPS
    fn = K.get_function(K.dense_q_variant(t) if w == K.GEMVQ_WARPS else K.dense_q_x_variant(t, w),
                        K.gemv_q_name(t, n_tok, w))
    return K.BoundLaunch(fn, (-(-rows // w), 1, 1), (32 * w, 1, 1), p)


def _general(b, ws: list, x, outs: list, *, norm_eps: float | None = None, norm_w=None, name: str = "",
             accumulate: bool = False, x16=None):
    """``outs[i] (+)= ws[i]·x`` of any weights and token count: F16 ones through
    :func:`_matmuls` on the normalized ``x`` (their norm weight folded), block ones through
    :func:`_qmatmuls` on the normalized ``x`` times ``norm_w``. On a device graph whose GEMMs read
    F16 only (``q8_handoff.reads_f16``) the norm writes their F16 input itself (no cast launch);
    ``x16``: ``x`` already in F16 (its node's form, ``q8_handoff.f16_of``; without a norm)."""
    steps = []
    n_tok = x.shape[0]
    for q in (False, True):
        idx = [i for i, w in enumerate(ws) if _is_q(w) == q]
        if not idx:
            continue
        sub, mm = [ws[i] for i in idx], (_qmatmuls if q else _matmuls)
        if norm_eps is not None and b.xp is not np and q8_handoff.reads_f16(sub, n_tok):
            norm, h16 = _rms_fn(b, x, norm_eps, name, norm_w if q else None, f16=True)
            steps.append(_then(norm, mm(b, sub, None, [outs[i] for i in idx], accumulate=accumulate, x16=h16)))
            continue
        norm, xn = _normed(b, x, norm_eps, name, norm_w if q else None)
        steps.append(_then(norm, mm(b, sub, xn, [outs[i] for i in idx], accumulate=accumulate,
                                    x16=x16 if norm is None else None)))
    return _then(*steps)


def gemv_launch(ws: list, x, outs: list, *, mode: int, norm_eps: float | None = None, unroll: int | None = None):
    """One ``dense_gemv`` launch over CuPy arrays (numpy order), for at most
    ``GEMV_MAX_TOKENS`` tokens: ``ws`` F16 ``(rows_i, n_in)``, ``x`` F32 ``(n_tokens, n_in)``;
    ``mode`` 0: ``outs[i] = ws[i]·x``; 1: ``outs[0] += ws[0]·x``; 2: ``outs[0] = silu(ws[0]·x) *
    (ws[1]·x)``; with ``norm_eps``, of the RMS-normalized ``x`` (each block computing the norm).
    ``unroll``: the instance (default ``kernels.GEMV_UNROLL``). Returns a function of no
    arguments launching on the current stream, or None when the arrays do not fit the kernel
    (more tokens, unaligned or strided); the caller keeps the arrays alive."""
    from ggml_attn import kernels as K  # noqa: PLC0415
    if x.shape[0] > K.GEMV_MAX_TOKENS or len(ws) > 3 or \
            (norm_eps is not None and not norm_eps > 0.0):   # (the kernel reads eps <= 0 as "no norm")
        return None
    n_in = x.shape[1]
    if n_in % 8 or not all(a.flags.c_contiguous and a.data.ptr % 16 == 0 for a in (*ws, x, *outs)) \
            or any(w.shape[1] != n_in for w in ws):
        return None
    p = K.GemvParams()
    for i, w in enumerate(ws):
        o = outs[0] if mode == 2 else outs[i]
        p.seg[i].w, p.seg[i].out, p.seg[i].rows = w.data.ptr, o.data.ptr, int(w.shape[0])
    p.x, p.x_stride, p.n_in, p.n_seg, p.mode = x.data.ptr, n_in, n_in, len(ws), mode
    p.norm_eps = 0.0 if norm_eps is None else float(norm_eps)
    rows = int(ws[0].shape[0]) if mode == 2 else sum(int(w.shape[0]) for w in ws)
    fn = K.get_function(K.dense_variant(), K.gemv_name(x.shape[0], unroll or K.GEMV_UNROLL))
    return K.BoundLaunch(fn, (-(-rows // K.GEMV_WARPS), 1, 1), (32 * K.GEMV_WARPS, 1, 1), p)


def _matmuls(b, ws: list, x, outs: list, *, accumulate: bool = False, x16=None):
    """``outs[i] (+)= ws[i]·x`` with ``x`` rounded to F16 once: numpy matmuls, or one cuBLAS
    GEMM per weight on CuPy (``accumulate`` through beta = 1), of ``x16`` where given (``x``'s F16
    form; ``x`` may be None then)."""
    xp = b.xp
    if xp is np:
        x16 = b.scratch(x.shape, np.float16)
        b.keep(x16, *ws)
        o16 = [b.scratch(o.shape, np.float16) for o in outs]
        b.keep(*o16)

        def run():
            xp.copyto(x16, x, casting="same_kind")
            for w, o, t in zip(ws, outs, o16):
                xp.matmul(x16, w.T, out=t)
                if accumulate:
                    xp.add(o, t, out=o)
                else:
                    xp.copyto(o, t)
        return run
    cast, x16 = _f16_input(b, x, x16)
    b.keep(x16, *ws)
    return _then(cast, *[_CublasGemm(w, x16, o, beta=1.0 if accumulate else 0.0) for w, o in zip(ws, outs)])


def _f16_input(b, x, x16):
    """``(cast or None, x16)``: a device GEMM's F16 input -- ``x16`` as given (no launch), else a
    new scratch array and the function rounding F32 ``x`` into it (one ``dense_cast_f16`` launch,
    CuPy's copy for a strided ``x``)."""
    if x16 is not None:
        return None, x16
    x16 = b.scratch(x.shape, np.float16)
    cast = _elementwise_launch("dense_cast_f16", (x, x16), x.size)
    if cast is None:   # a strided x: CuPy's copy
        def cast():
            b.xp.copyto(x16, x, casting="same_kind")
    return cast, x16


def _qmatmuls(b, ws: list, x, outs: list, *, accumulate: bool = False, x16=None):
    """``outs[i] (+)= ws[i]·x`` for ``QMatrix`` weights: numpy, F32 products with ggml's
    dequantized values; CuPy, per weight ``matmul_dispatch.best_matmul``'s path: ``gemm-q8`` (``x``
    quantized to int8 once, :func:`q8_matmul.gemm_q8_launch`), ``gemm-q`` / ``gemm-qs`` / ``gemm-qr`` / ``gemm-qw`` (``x``
    rounded to F16 once, ``tiled_gemm.gemm_q_launch``), else path ``gemm`` (``path_gemm.dequant_gemm_launches``: per
    chunk of rows one dequantization into the weights' F16 scratch and one cuBLAS GEMM). ``x16``:
    ``x``'s F16 form, read by every path but ``gemm-q8`` (``x`` may be None where none runs it)."""
    xp = b.xp
    if xp is np:
        vals = [w.values() for w in ws]
        tmp = [b.scratch(o.shape, np.float32) for o in outs] if accumulate else outs
        b.keep(*vals, *tmp)

        def run():
            for v, o, t in zip(vals, outs, tmp):
                np.matmul(x, v.T, out=t)
                if accumulate:
                    np.add(o, t, out=o)
        return run
    from ggml_attn import kernels as K  # noqa: PLC0415
    from ggml_attn.cuda_device import num_sms  # noqa: PLC0415
    from ggml_attn.matmul_dispatch import TILED_PATHS, best_matmul, split_finish, tiled_kernel  # noqa: PLC0415
    n_tok, n_in = (x if x is not None else x16).shape
    paths = [best_matmul(w.type, n_tok, gemv=False, aligned=rows_aligned([w])).path for w in ws]   # (not _gemv's)
    steps, q8 = [], None
    if any(p != "gemm-q8" for p in paths):   # the F16 copy of x
        cast, x16 = _f16_input(b, x, x16)
        steps.append(cast)
    if "gemm-q8" in paths:   # x quantized once for every such weight
        if x is None:   # (q8_handoff.reads_f16 said F16 only: the callers ask it first)
            raise ValueError("the int8 block GEMM quantizes F32 activations; only their F16 form was given")
        q8 = (b.scratch((n_tok, n_in), np.int8), b.scratch((n_tok, n_in // 32), np.float32),
              b.scratch((n_tok, n_in // 32), np.float32))
        quant = quant_q8x_launch(ws[paths.index("gemm-q8")].type_id, x, *q8)
        if quant is None:
            raise ValueError(f"activations of shape {x.shape} for the int8 block GEMM (C-contiguous, 16-byte aligned, "
                             "n_in a multiple of 32)")
        steps.append(quant)
        b.keep(*q8)
    for w, o, path in zip(ws, outs, paths):
        if path in TILED_PATHS:
            kernel = tiled_kernel(path, w.type, n_tok)
            grid, _ = K.gemm_q_grid(int(w.shape[0]), n_tok, int(w.shape[1]), num_sms(), kernel)
            part = b.scratch((grid[2], n_tok, int(w.shape[0])), np.float32) if grid[2] > 1 else None
            done = tile_counters(b, grid) if split_finish(kernel, grid[2]) else None
            steps.append(gemm_q8_launch(w, *q8, o, part, accumulate=accumulate) if path == "gemm-q8" else
                         gemm_q_launch(w, x16, o, part, accumulate=accumulate, kernel=kernel, done=done))
            b.keep(w.blocks, *([part] if part is not None else []))
            continue
        steps += [launch for pair in dequant_gemm_launches(w, x16, o, accumulate=accumulate) for launch in pair]
        b.keep(w.blocks, w.scratch)
    b.keep(*([x16] if x16 is not None else []), *outs)
    return _then(*steps)


def _elementwise_launch(name: str, arrays, n: int):
    """One launch of ``dense.cu``'s elementwise kernel ``name(arrays..., n)`` over C-contiguous
    CuPy ``arrays`` of ``n`` elements (None: a null pointer; a grid-stride loop, enough blocks to
    fill the GPU), as a function of no arguments on the current stream -- a few us of host time
    where a CuPy elementwise call costs tens; None when an array is not contiguous."""
    from ggml_attn import kernels as K  # noqa: PLC0415 (device graphs only)
    if not all(a is None or a.flags.c_contiguous for a in arrays):
        return None
    fn = K.get_function(K.dense_variant(), name)
    blocks = max(1, min(-(-n // 256), 1024))
    return K.BoundLaunch(fn, (blocks, 1, 1), (256, 1, 1), *[ctypes.c_uint64(0 if a is None else a.data.ptr)
                                                            for a in arrays], ctypes.c_int64(n))


def _rms_fn(b, x, eps: float, name: str, g=None, *, f16: bool = False):
    """``(fn, out)``: ``fn()`` writes the RMS norm of ``x`` (numpy ``(n_tokens, n)`` F32), times
    ``g`` (xp F32 ``(n,)``) when given, into ``out``, a new scratch array (F32; ``f16``: F16, a
    GEMM's input rounded to nearest, device graphs only): numpy steps, or one ``dense_rms_norm``
    launch (a block per token)."""
    xp = b.xp
    out = b.scratch(x.shape, np.float16 if f16 else np.float32)
    if xp is np:
        assert not f16, "an F16 norm is the device graphs' (numpy multiplies F32)"
        ms = b.scratch((x.shape[0], 1), np.float32)
        inv_n = np.float32(1.0 / x.shape[1])
        b.keep(ms, *([g] if g is not None else []))

        def run():
            xp.multiply(x, x, out=out)
            xp.sum(out, axis=1, keepdims=True, out=ms)
            xp.multiply(ms, inv_n, out=ms)
            xp.add(ms, np.float32(eps), out=ms)
            xp.sqrt(ms, out=ms)
            xp.divide(x, ms, out=out)
            if g is not None:
                xp.multiply(out, g, out=out)
        return run, out
    from ggml_attn import kernels as K  # noqa: PLC0415
    if not (x.flags.c_contiguous and out.flags.c_contiguous) or (g is not None and not g.flags.c_contiguous):
        raise ValueError(f"{name}: rms_norm needs contiguous rows")
    fn = K.get_function(K.dense_variant(), "dense_rms_norm")
    b.keep(x, out, *([g] if g is not None else []))
    return K.BoundLaunch(fn, (x.shape[0], 1, 1), (256, 1, 1), ctypes.c_uint64(x.data.ptr),
                         ctypes.c_uint64(0 if f16 else out.data.ptr), ctypes.c_int32(x.shape[1]), ctypes.c_float(eps),
                         _dptr(g), ctypes.c_uint64(out.data.ptr if f16 else 0)), out


def _normed(b, x, norm_eps, name, g=None):
    """``(fn or None, array)``: with ``norm_eps`` the RMS-normalized copy of ``x`` (times ``g``
    when given) and the function that makes it; else ``(None, x)``."""
    if norm_eps is None:
        return None, x
    return _rms_fn(b, x, norm_eps, name, g)


def _silu_steps(g, u, out) -> None:
    """``out = silu(g) * u = g / (1 + exp(-g)) * u`` in numpy steps."""
    np.negative(g, out=out)
    np.exp(out, out=out)
    np.add(out, np.float32(1.0), out=out)
    np.divide(g, out, out=out)
    np.multiply(out, u, out=out)


_GELU_A, _SQRT_2_OVER_PI = np.float32(0.044715), np.float32(0.7978845608028654)   # ggml's tanh GELU


def _gelu_steps(g, u, out) -> None:
    """``out = gelu(g) * u`` with ggml's tanh GELU, ``0.5 g (1 + tanh(sqrt(2/pi) g (1 + 0.044715
    g^2)))``, in numpy steps."""
    np.multiply(g, g, out=out)
    np.multiply(out, _GELU_A, out=out)
    np.add(out, np.float32(1.0), out=out)
    np.multiply(out, g, out=out)
    np.multiply(out, _SQRT_2_OVER_PI, out=out)
    np.tanh(out, out=out)
    np.add(out, np.float32(1.0), out=out)
    np.multiply(out, g, out=out)
    np.multiply(out, np.float32(0.5), out=out)
    np.multiply(out, u, out=out)


# the gated FFN's activations: numpy steps, dense.cu's kernel, and a CuPy expression (strided arrays)
_ACTS = {"silu": (_silu_steps, "dense_silu_mul", "y = g / (1.0f + expf(-g)) * u;"),
         "gelu": (_gelu_steps, "dense_gelu_mul",
                  "y = 0.5f * g * (1.0f + tanhf(0.7978845608028654f * g * (1.0f + 0.044715f * g * g))) * u;")}
_FUSED: dict = {}


def _act_mul_fn(act: str, xp, g, u, out, out16=None):
    """``out = act(g) * u`` (``act`` "silu" or "gelu", F32 arrays of one shape) as a function of no
    arguments, and ``out16`` the same rounded to F16 where given (device graphs): numpy steps, or
    one ``dense_<act>_mul`` launch (a fused CuPy kernel and a copy for strided arrays)."""
    steps, kernel, expr = _ACTS[act]
    if xp is np:
        assert out16 is None, "an F16 form is the device graphs' (numpy multiplies F32)"
        return lambda: steps(g, u, out)
    launch = _elementwise_launch(kernel, (g, u, out, out16), out.size)
    if launch is not None:
        return launch
    fused = _FUSED.get(act)
    if fused is None:
        import cupy  # noqa: PLC0415
        fused = _FUSED[act] = cupy.ElementwiseKernel("float32 g, float32 u", "float32 y", expr,
                                                     f"ggml_attn_xp_{act}_mul")

    def run():
        fused(g, u, out)
        if out16 is not None:
            xp.copyto(out16, out, casting="same_kind")
    return run
