"""A real model's ops of all-custom (device-resident) graphs (``model_graph.py``'s device form)
as ggml custom ops (``xp_node``) over an array module ``xp`` (numpy or CuPy); on CuPy each is
one launch of a kernel of ``cuda/model_ops.cu`` (compiled with NVRTC when first built, not while
computing), besides the full block's matmuls (``xp_matmul``):

* :func:`get_rows`: rows ``ids`` of a table (the embedding: F16/F32, or a ``QMatrix`` of weight
  blocks; or the residual stream's output rows) -> F32 ``[n, n_ids]``;
* :func:`rope`: an optional bias add, then ggml's ``rope_ext`` (normal or NEOX pairs, frequency
  factors, linear scaling; no YaRN) of a layer's Q and K in one node -> F32 ``[head_dim_k,
  n_head, n_tokens]`` views;
* :func:`rope_store`: :func:`rope` of Q, and of K with V written straight into F16/F32 KV cache
  rows (the K/V store fused: one node, one ``xp_rope_store`` launch) -> Q's F32 view;
* :func:`add_bias`: ``t += bias`` in place;
* :func:`add_into`: ``x += y`` in place; the node's result is ``x``'s memory;
* :func:`scale_into`: ``x *= s`` in place (gemma's embedding scale);
* :func:`softcap_into`: ``x = c * tanh(x / c)`` in place (gemma2's final logits).

Each function takes the graph builder ``b`` (``build.GraphBuilder``) and tensors made by it,
and returns the result tensor; shapes in ggml order ``[ne0, ne1]`` = numpy ``(ne1, ne0)``.
"""
from __future__ import annotations

import ctypes

import numpy as np

from .xp_matmul import _is_q
from .xp_node import custom as _custom, dptr as _dptr, then as _then, views as _views

__all__ = ["add_into", "scale_into", "softcap_into", "get_rows", "rope", "rope_store", "add_bias", "rope_theta_scale"]


def add_into(b, x_t, y_t, name: str):
    """``x += y``; returns a node whose memory is ``x``'s (the residual stream, updated)."""
    xp = b.xp
    x, y = b.array(x_t), b.array(y_t)

    def run():
        xp.add(x, y, out=x)
    return _custom(b, run, [x_t, y_t], x, name, ptr=x_t.contents.data)   # x's memory is x_t's


def scale_into(b, t, s: float, name: str):
    """``t *= s`` in place (F32, ggml's ``scale``); returns a node whose memory is ``t``'s."""
    xp, x, s = b.xp, b.array(t), np.float32(s)

    def run():
        xp.multiply(x, s, out=x)
    return _custom(b, run, [t], x, name, ptr=t.contents.data)


def softcap_into(b, t, c: float, name: str):
    """``t = c * tanh(t / c)`` in place (F32; ggml's ``scale(1/c)``, ``tanh``, ``scale(c)``);
    returns a node whose memory is ``t``'s."""
    xp, x = b.xp, b.array(t)
    inv, c = np.float32(1.0) / np.float32(c), np.float32(c)   # (1.0f / c, as ggml's caller computes it)

    def run():
        xp.multiply(x, inv, out=x)
        xp.tanh(x, out=x)
        xp.multiply(x, c, out=x)
    return _custom(b, run, [t], x, name, ptr=t.contents.data)


def _model_launch(name: str, n: int, *params):
    """A bound grid-stride launch of model kernel ``name`` over ``n`` elements (ctypes params)."""
    from ggml_attn import kernels as K  # noqa: PLC0415
    return K.grid_launch(K.get_function(K.model_ops_variant(), name), n, *params)


ROPE_MAX_PAIRS = 256   # cuda/model_ops.cu's table of a token's angles
ROPE_BLOCKS = 2048   # blocks a rope launch aims at: a token's elements split over up to this / n_tok blocks


def _rope_launch(name: str, n_tok: int, per_tok: int, n_dims: int, *params):
    """A bound launch of rope kernel ``name`` (``xp_rope``, ``xp_rope_store``: a block a token and
    slice of its ``per_tok`` elements, each block making its token's table of the ``n_dims / 2``
    angles): grid ``(n_tok, slices)``, 256 threads; a function doing nothing for no tokens.
    ValueError past the table's ROPE_MAX_PAIRS."""
    from ggml_attn import kernels as K  # noqa: PLC0415
    if n_dims // 2 > ROPE_MAX_PAIRS:
        raise ValueError(f"{name}: rope_dim {n_dims}: the device rope turns at most {2 * ROPE_MAX_PAIRS} dims")
    if n_tok == 0:
        return lambda: None
    slices = max(1, min(-(-per_tok // 256), -(-ROPE_BLOCKS // n_tok)))
    return K.BoundLaunch(K.get_function(K.model_ops_variant(), name), (n_tok, slices, 1), (256, 1, 1), *params)


def _contig(name: str, *arrays) -> None:
    for a in arrays:
        if a is not None and not a.flags.c_contiguous:
            raise ValueError(f"{name}: needs C-contiguous arrays (got strides {a.strides} for shape {a.shape})")


def get_rows(b, table, ids_t, name: str, *, own: bool = False):
    """Rows ``ids`` of ``table`` as F32 ``[n, n_ids]`` (ggml's ``get_rows``): ``table`` an xp
    array F16/F32 ``(n_rows, n)`` (a weight: the token embedding) or an F32 tensor ``[n,
    n_rows]`` of the graph (a source of the node: the residual stream's output rows); ``ids_t``
    an I32 tensor ``[n_ids]`` (values in range: the caller checked them). ``own``: the result
    gets an array of its own (not a reused scratch array: the residual stream)."""
    xp = b.xp
    srcs = [ids_t]
    if hasattr(table, "contents"):       # a tensor of the graph
        srcs.insert(0, table)
        table = b.array(table)
    if _is_q(table) and xp is np:       # weight blocks: ggml's dequantized values
        table = table.values()
    ids = b.array(ids_t).reshape(-1)
    n_ids, n = ids.shape[0], int(table.shape[1])
    out = xp.empty((n_ids, n), dtype=np.float32) if own else b.scratch((n_ids, n), np.float32)
    b.keep(table.blocks if _is_q(table) else table, ids)
    if _is_q(table):
        _contig(name, ids, out)
        run = table.rows_launch(ids, out)
    elif xp is np:
        if table.dtype == np.float32:
            def run():
                xp.take(table, ids, axis=0, out=out, mode="clip")
        else:
            tmp = b.scratch((n_ids, n), table.dtype)
            b.keep(tmp)

            def run():
                xp.take(table, ids, axis=0, out=tmp, mode="clip")
                xp.copyto(out, tmp, casting="same_kind")
    else:
        if table.dtype not in (np.float16, np.float32):
            raise ValueError(f"{name}: get_rows takes an F16 or F32 table, not {table.dtype}")
        _contig(name, table, ids, out)
        kern = "xp_get_rows_f16" if table.dtype == np.float16 else "xp_get_rows_f32"
        run = _model_launch(kern, out.size, _dptr(table), _dptr(ids), _dptr(out), ctypes.c_int64(n),
                            ctypes.c_int64(out.size))
    return _custom(b, run, srcs, out, name, ptr=b.ptr(out) if not own else None)


_POWF: list = []


def rope_theta_scale(hp) -> np.float32:
    """ggml's ``theta_scale = powf(freq_base, -2.0f / n_dims)``: the C library's ``powf`` (numpy's
    float32 power may be a SIMD approximation an ulp off, which the running product over the
    pairs would carry into every angle); without one, the float64 power rounded to float32."""
    expo = np.float32(-2.0) / np.float32(hp.rope_dim)
    if not _POWF:
        import ctypes.util  # noqa: PLC0415
        try:
            libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
            libm.powf.argtypes, libm.powf.restype = [ctypes.c_float, ctypes.c_float], ctypes.c_float
            _POWF.append(libm.powf)
        except (OSError, AttributeError):
            _POWF.append(None)
    powf = _POWF[0]
    if powf is not None:
        return np.float32(powf(float(np.float32(hp.rope_base)), float(expo)))
    return np.float32(np.float64(np.float32(hp.rope_base)) ** np.float64(expo))


def rope(b, ts: list, positions, hp, freq_factors=None, biases=None, name: str = "rope") -> list:
    """Each of ``ts`` (one or two tensors: a layer's Q and K; F32 ``[head_dim_k, n_head_i,
    n_tok]``, or ``[n_head_i * head_dim_k, n_tok]``) plus its bias (``biases[i]``: xp F32
    ``(n_head_i * head_dim_k,)``, or None), rotated as ggml's ``rope_ext`` with ext_factor 0 and
    attn_factor 1 (no YaRN): ``hp.rope_mode`` NORMAL (pairs ``(2i, 2i+1)``) or NEOX (pairs
    ``(i, i + n_dims/2)``), ``n_dims = hp.rope_dim`` (the dims after are copied), pair ``i``
    turned by ``theta_i = freq_scale * pos * base^(-2i/n_dims) / freq_factors[i]`` (xp F32
    ``(>= n_dims/2,)`` or None) at the token's ``positions`` (I32 tensor ``[n_tok]``); the power
    is taken as ggml's CPU op does, ``i`` float32 products of ``powf(base, -2/n_dims)``. One node
    (one ``xp_rope`` launch on the device); returns F32 tensors ``[head_dim_k, n_head_i, n_tok]``,
    views ``name.i`` of its memory (each contiguous). ``ts``' arrays must be readable with
    ``b.array``: tensors with arrays of their own, e.g. views of :func:`mul_mat_group`."""
    xp = b.xp
    if not 1 <= len(ts) <= 2:
        raise ValueError(f"{name}: rope takes one or two tensors, got {len(ts)}")
    biases = list(biases) if biases is not None else [None] * len(ts)
    if len(biases) != len(ts):
        raise ValueError(f"{name}: {len(biases)} biases for {len(ts)} tensors")
    D, n_dims, neox, ts_, fs = _rope_spec(hp, freq_factors, name)
    xs = [b.array(t) for t in ts]
    n_tok = xs[0].shape[0]
    heads = [_rope_heads(x, bias, n_tok, D, name) for x, bias in zip(xs, biases)]
    pos = b.array(positions).reshape(-1)
    sizes = [n_tok * nh * D for nh in heads]
    flat = b.scratch((sum(sizes),), np.float32)
    outs, off = [], 0
    for nh, n in zip(heads, sizes):
        outs.append(flat[off:off + n].reshape(n_tok, nh, D))
        off += n
    b.keep(*(a for a in (*xs, pos, freq_factors, *biases) if a is not None))
    if xp is not np:
        _contig(name, *xs, flat, pos, freq_factors, *biases)
        segs = []
        for i in range(2):   # (a second segment of no elements when there is one tensor)
            if i < len(xs):
                segs += [_dptr(xs[i]), _dptr(outs[i]), _dptr(biases[i]), ctypes.c_int32(heads[i]), ctypes.c_int64(sizes[i])]
            else:
                segs += [_dptr(None), _dptr(None), _dptr(None), ctypes.c_int32(1), ctypes.c_int64(0)]
        run = _rope_launch("xp_rope", n_tok, sum(heads) * D, n_dims, *segs, _dptr(pos), _dptr(freq_factors),
                           ctypes.c_int32(D), ctypes.c_int32(n_dims), ctypes.c_int32(int(neox)), ctypes.c_float(ts_),
                           ctypes.c_float(fs))
    else:
        run = _then(*(_rope_numpy(b, x.reshape(n_tok, nh, D), o, pos, n_dims, neox, ts_, fs, freq_factors,
                                  None if bias is None else bias.reshape(nh, D))
                      for x, o, nh, bias in zip(xs, outs, heads, biases)))
    base = b.ptr(flat)
    node = _custom(b, run, [*ts, positions], flat.reshape(1, -1), name, ptr=base)
    return _views(b, node, outs, base, name)   # (outs: flat's parts, in order)


def rope_store(b, q, k, v, positions, hp, store, row_idx, freq_factors=None, biases=None, name: str = "rope_store"):
    """:func:`rope` of ``q`` (F32 ``[n_head * head_dim_k, n_tok]`` or ``[head_dim_k, n_head,
    n_tok]``) into a tensor of its own, and of ``k`` (the same with ``n_head_kv``), whose rotated
    rows go -- with ``v``'s (F32 ``[n_embd_v, n_tok]``) -- straight into the KV cache as the store
    op would put them (``kv_graph``: row ``row_idx[t]`` (I64 tensor ``[n_tok]``) of ``store``,
    ``KVTensors.store_arrays``' F16/F32 ``(K, V)`` rows; F16 rounded to nearest). ``biases``:
    ``(bq, bk, bv)`` xp F32 (or None each). One node (one ``xp_rope_store`` launch on the device,
    instead of a rope and a store); returns Q rotated, F32 ``[head_dim_k, n_head, n_tok]``, a
    view of the node. Attention reads the cache after it (it reads the returned Q)."""
    xp = b.xp
    bq, bk, bv = biases if biases is not None else (None, None, None)
    D, n_dims, neox, ts_, fs = _rope_spec(hp, freq_factors, name)
    xq, xk, xv = (b.array(t) for t in (q, k, v))
    ck, cv = store
    n_tok = xq.shape[0]
    if xv.shape[0] != n_tok:
        raise ValueError(f"{name}: Q {xq.shape}, K {xk.shape}, V {xv.shape}: not the same tokens")
    nh_q, nh_k, n_v = _rope_heads(xq, bq, n_tok, D, name), _rope_heads(xk, bk, n_tok, D, name), xv.size // n_tok
    if ck.ndim != 2 or cv.ndim != 2 or ck.shape[1] != nh_k * D or cv.shape[1] != n_v or ck.dtype.kind != "f" \
            or cv.dtype.kind != "f" or ck.dtype.itemsize not in (2, 4) or cv.dtype.itemsize not in (2, 4):
        raise ValueError(f"{name}: cache rows {ck.shape} {ck.dtype} / {cv.shape} {cv.dtype} for K rows of "
                         f"{nh_k * D} and V rows of {n_v} values (F16 or F32)")
    if bv is not None and bv.shape != (n_v,):
        raise ValueError(f"{name}: bias of shape {bv.shape}, expected ({n_v},)")
    pos, rows = b.array(positions).reshape(-1), b.array(row_idx).reshape(-1)
    if pos.shape != (n_tok,) or rows.shape != (n_tok,):
        raise ValueError(f"{name}: {pos.size} positions and {rows.size} cache rows for {n_tok} tokens")
    yq = b.scratch((n_tok, nh_q, D), np.float32)
    b.keep(*(a for a in (xq, xk, xv, pos, rows, freq_factors, bq, bk, bv, ck, cv) if a is not None))
    if xp is not np:
        _contig(name, xq, xk, xv, yq, pos, rows, ck, cv, freq_factors, bq, bk, bv)
        n_q, n_k = n_tok * nh_q * D, n_tok * nh_k * D
        run = _rope_launch("xp_rope_store", n_tok, (nh_q + nh_k) * D + n_v, n_dims,
                           _dptr(xq), _dptr(yq), _dptr(bq), ctypes.c_int32(nh_q), ctypes.c_int64(n_q),
                           _dptr(xk), _dptr(bk), ctypes.c_int32(nh_k), ctypes.c_int64(n_k),
                           _dptr(xv), _dptr(bv), ctypes.c_int32(n_v), ctypes.c_int64(xv.size),
                           _dptr(ck), ctypes.c_int32(ck.dtype.itemsize == 2), _dptr(cv),
                           ctypes.c_int32(cv.dtype.itemsize == 2), _dptr(rows), _dptr(pos), _dptr(freq_factors),
                           ctypes.c_int32(D), ctypes.c_int32(n_dims), ctypes.c_int32(int(neox)), ctypes.c_float(ts_),
                           ctypes.c_float(fs))
    else:
        yk = b.scratch((n_tok, nh_k, D), np.float32)
        vb = b.scratch((n_tok, n_v), np.float32) if bv is not None else None
        b.keep(*(a for a in (yk, vb) if a is not None))
        steps = [_rope_numpy(b, x.reshape(n_tok, nh, D), o, pos, n_dims, neox, ts_, fs, freq_factors,
                             None if bias is None else bias.reshape(nh, D))
                 for x, o, nh, bias in ((xq, yq, nh_q, bq), (xk, yk, nh_k, bk))]

        def store():   # the store op's numpy form: cast on assignment
            ck[rows] = yk.reshape(n_tok, -1)
            if vb is None:
                cv[rows] = xv.reshape(n_tok, -1)
            else:
                np.add(xv.reshape(n_tok, -1), bv, out=vb)
                cv[rows] = vb
        run = _then(*steps, store)
    node = _custom(b, run, [q, k, v, positions, row_idx], yq.reshape(1, -1), name, ptr=b.ptr(yq))
    return _views(b, node, [yq], b.ptr(yq), name)[0]


def _rope_spec(hp, freq_factors, name: str):
    """``(head_dim_k, n_dims, neox, theta_scale, freq_scale)`` of ``hp``'s rope (:func:`rope`),
    checked with the frequency factors (xp F32 ``(>= n_dims / 2,)`` or None)."""
    from .model import ROPE_NEOX  # noqa: PLC0415
    D, n_dims = int(hp.head_dim_k), int(hp.rope_dim)
    if n_dims % 2 or n_dims > D:
        raise ValueError(f"{name}: rope_dim {n_dims} with head_dim_k {D}")
    if freq_factors is not None and freq_factors.shape[0] < n_dims // 2:
        raise ValueError(f"{name}: {freq_factors.shape[0]} frequency factors, rope_dim {n_dims} needs {n_dims // 2}")
    return D, n_dims, int(hp.rope_mode) == ROPE_NEOX, rope_theta_scale(hp), np.float32(hp.rope_freq_scale)


def _rope_heads(x, bias, n_tok: int, D: int, name: str) -> int:
    """The heads of head size ``D`` in ``x``'s rows (numpy order, ``n_tok`` tokens first), its
    bias (``(n_head * D,)`` or None) checked."""
    if x.shape[0] != n_tok or x.size % (n_tok * D):
        raise ValueError(f"{name}: rope of shape {x.shape} with head_dim_k {D} and {n_tok} tokens")
    nh = x.size // (n_tok * D)
    if bias is not None and bias.shape != (nh * D,):
        raise ValueError(f"{name}: bias of shape {bias.shape}, expected ({nh * D},)")
    return nh


def _rope_numpy(b, x3, o3, pos, n_dims: int, neox: bool, ts, fs, ff, bias2):
    """The numpy steps of :func:`rope` over ``x3`` -> ``o3`` (``(n_tok, n_head, D)`` views)."""
    n_tok, nh, _ = x3.shape
    half = n_dims // 2
    seed = b.scratch((n_tok, half), np.float32)     # [pos, ts, ts, ...]: a running product gives theta
    theta = b.scratch((n_tok, half), np.float32)
    cos = b.scratch((n_tok, 1, half), np.float32)
    sin = b.scratch((n_tok, 1, half), np.float32)
    t0, t1, t2 = (b.scratch((n_tok, nh, half), np.float32) for _ in range(3))
    b.keep(seed, theta, cos, sin, t0, t1, t2)
    ffh = None if ff is None else ff[:half]
    if neox:
        x0, x1 = o3[..., :half], o3[..., half:n_dims]
    else:
        x0, x1 = o3[..., 0:n_dims:2], o3[..., 1:n_dims:2]
    c2, s2 = cos.reshape(n_tok, half), sin.reshape(n_tok, half)

    def run():
        seed[:, 1:] = ts
        np.copyto(seed[:, 0], pos, casting="unsafe")
        np.multiply.accumulate(seed, axis=1, dtype=np.float32, out=theta)
        if ffh is not None:
            np.divide(theta, ffh, out=theta)
        np.multiply(theta, fs, out=theta)
        np.cos(theta, out=c2)
        np.sin(theta, out=s2)
        if bias2 is None:
            np.copyto(o3, x3)
        else:
            np.add(x3, bias2, out=o3)
        np.multiply(x0, cos, out=t0)        # x0 c - x1 s
        np.multiply(x1, sin, out=t1)
        np.subtract(t0, t1, out=t0)
        np.multiply(x0, sin, out=t1)        # x0 s + x1 c
        np.multiply(x1, cos, out=t2)
        np.add(t1, t2, out=t1)
        np.copyto(x0, t0)
        np.copyto(x1, t1)
    return run


def add_bias(b, t, bias, name: str):
    """``t += bias`` in place: ``t`` F32 ``[n, n_tok]``, ``bias`` xp F32 ``(n,)``; returns a node
    whose memory is ``t``'s."""
    xp = b.xp
    x = b.array(t)
    if bias.shape != (x.shape[-1],):
        raise ValueError(f"{name}: bias of shape {bias.shape} for rows of {x.shape[-1]}")
    b.keep(bias)
    if xp is np:
        def run():
            xp.add(x, bias, out=x)
    else:
        _contig(name, x, bias)
        run = _model_launch("xp_add_bias", x.size, _dptr(x), _dptr(bias), ctypes.c_int64(x.shape[-1]),
                            ctypes.c_int64(x.size))
    return _custom(b, run, [t], x, name, ptr=t.contents.data)   # t's memory
