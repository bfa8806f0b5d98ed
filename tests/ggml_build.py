"""Test helpers: ggml-python tensors for flash-attention cases (ggml order at ggml calls,
numpy order for the arrays)."""
from __future__ import annotations

import ctypes

import ggml
import numpy as np

from ggml_attn.conformance import FACase, FAInputs
from ggml_attn.tensor import as_numpy, from_ggml


def new_context(n_bytes: int):
    params = ggml.ggml_init_params(mem_size=n_bytes + 64 * 1024 * 1024, mem_buffer=None)
    ctx = ggml.ggml_init(params)
    assert ctx is not None
    return ctx


def tensor_4d(ctx, type_: int, ne, permuted=False, view_of_double=False):
    """A ggml tensor with logical ggml shape ``ne``; ``permuted`` creates it with dims 1 and 2
    swapped and permutes back (0, 2, 1, 3); ``view_of_double`` makes it a view of a tensor with
    twice the rows (as K/V are views of a cache) -- both as test-backend-ops does."""
    ne_phys = (ne[0], ne[2], ne[1], ne[3]) if permuted else tuple(ne)
    if view_of_double:
        base = ggml.ggml_new_tensor_4d(ctx, type_, ne_phys[0], 2 * ne_phys[1], ne_phys[2], ne_phys[3])
        t = ggml.ggml_view_4d(ctx, base, *ne_phys, base.contents.nb[1], base.contents.nb[2],
                              base.contents.nb[3], 0)
    else:
        t = ggml.ggml_new_tensor_4d(ctx, type_, *ne_phys)
    if permuted:
        t = ggml.ggml_permute(ctx, t, 0, 2, 1, 3)
    return t


def set_data(t, arr: np.ndarray) -> None:
    """Copy ``arr`` (numpy order, storage dtype) into host tensor ``t`` through its strides."""
    view = as_numpy(from_ggml(t))
    assert view.size == arr.size, (view.shape, arr.shape)
    view[...] = arr.reshape(view.shape)


def get_data(t) -> np.ndarray:
    return np.array(as_numpy(from_ggml(t)))


def case_bytes(c: FACase) -> int:
    kv = 4 * 2 * c.n_kv * c.n_head_kv * c.ne3 * (c.dk + c.dv) * 2
    return 4 * c.ne3 * c.n_head * c.n_batch * (c.dk + c.dv) * 2 + kv + 2 * c.n_kv * c.n_batch * c.ne3


def build_case(ctx, c: FACase, x: FAInputs):
    """q, k, v, mask, sinks ggml tensors holding ``x``; k/v are views like a KV cache's."""
    q = tensor_4d(ctx, 0, (c.dk, c.n_batch, c.n_head, c.ne3), c.permuted)
    k = tensor_4d(ctx, c.kv_type, (c.dk, c.n_kv, c.n_head_kv, c.ne3), c.permuted, True)
    if c.hsk == 576 and c.hsv == 512:
        kc = k.contents
        v = ggml.ggml_view_4d(ctx, k, 512, c.n_kv, c.n_head_kv, c.ne3, kc.nb[1], kc.nb[2], kc.nb[3], 0)
    else:
        v = tensor_4d(ctx, c.v_kind, (c.dv, c.n_kv, c.n_head_kv, c.ne3), c.permuted, True)
    set_data(q, x.q)
    set_data(k, x.k)
    if not (c.hsk == 576 and c.hsv == 512):
        set_data(v, x.v)
    mask = sinks = None
    if x.mask is not None:
        mask = ggml.ggml_new_tensor_4d(ctx, 1, c.n_kv, c.n_batch, 1, c.ne3)
        set_data(mask, x.mask)
    if x.sinks is not None:
        sinks = ggml.ggml_new_tensor_1d(ctx, 0, c.n_head)
        set_data(sinks, x.sinks)
    return q, k, v, mask, sinks


def ggml_reference_node(ctx, q, k, v, mask, sinks, c: FACase):
    out = ggml.ggml_flash_attn_ext(ctx, q, k, v, mask, c.scale, c.max_bias, c.logit_softcap)
    ggml.ggml_flash_attn_ext_add_sinks(out, sinks)
    ggml.ggml_flash_attn_ext_set_prec(out, 10)  # GGML_PREC_F32
    return out


def graph_of(ctx, *nodes):
    gf = ggml.ggml_new_graph(ctx)
    for n in nodes:
        ggml.ggml_build_forward_expand(gf, n)
    return gf


__all__ = ["new_context", "tensor_4d", "set_data", "get_data", "case_bytes", "build_case",
           "ggml_reference_node", "graph_of", "ctypes"]
