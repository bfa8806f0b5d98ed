"""Layer functions of the ubatch graph: what ``build.build_ubatch_graph`` runs per layer.

A layer function is ``layer(b, il, cur) -> cur``: ``b`` the graph builder
(``build.GraphBuilder``: context, plan, K/V via ``b.kv``, the attention of ``b.attention``),
``il`` the layer index, ``cur`` the layer's input tensor (ggml order) or None.

* :func:`attn_layer` -- attention only: Q/K/V are graph inputs per layer (or one set shared by
  all layers), ``q_cur [D, n_head, n_tokens]``, ``k_cur [n_embd_k_gqa, n_tokens]``,
  ``v_cur [n_embd_v_gqa, n_tokens]`` F32; the result is the attention output.
* :func:`full_layer` -- the block as llama.cpp's llama graph builds it (no RoPE): RMS norm,
  Q/K/V projections of the residual stream ``x [n_embd, n_tokens]`` F32, attention, O
  projection, residual add, RMS norm, gated FFN (gate, up, SiLU, down), residual add. Weights
  come from ``b.weights[il]``: F16 arrays of ``xp``, numpy order ``(n_out, n_in)`` = ggml
  ``[n_in, n_out]``, keys ``wq wk wv wo wg wu wd``. Host graphs use ggml's ops, all-custom
  graphs the ops of ``xp_matmul`` and ``xp_ops``.

The attention step (:func:`attention`) is shared: store K/V (``KVTensors.cpy_kv``), view
Q per stream, view K/V (``get_k/get_v``), then ``b.attention``: flash attention (our op or
ggml's) or, for ``-fa off``, :func:`softmax_attention` (llama.cpp's ``mul_mat`` +
``soft_max_ext`` path, host graphs only). Output ``[head_dim_v, n_head, n_tps, n_stream]`` F32.
"""
from __future__ import annotations

import ggml
import numpy as np

from ggml_attn import op as fa_op

from . import xp_matmul, xp_ops

__all__ = ["attn_layer", "full_layer", "attention", "softmax_attention", "flash_attention",
           "pad_rows_see_own_cell", "RMS_EPS"]

RMS_EPS = 1e-5


def pad_rows_see_own_cell(mask: np.ndarray, ub, slot) -> None:
    """For ``-fa off``: unmask each pad row's own cell in ``mask`` (numpy ``(ns, 1, n_tps,
    n_kv)``, in place). ``soft_max_ext`` of a fully masked row is NaN (FA gives zeros); the NaN
    would become the pad's K/V in the next layer and reach real rows as 0 * NaN. Real rows
    never see pad cells, so this changes nothing for them."""
    pad = ub.is_pad.reshape(slot.n_stream, -1)
    for j, cells in enumerate(slot.cells):
        rows = np.flatnonzero(pad[j])
        mask[j, 0, rows, cells[rows]] = 0


def flash_attention(fa):
    """The attention step with flash-attention op ``fa`` (``ggml_attn.flash_attn_ext`` or
    ``ggml.ggml_flash_attn_ext``)."""
    def run(b, q, k, v, mask, q8_out=None):
        cfg = b.cfg
        if fa is fa_op.flash_attn_ext:   # the ubatch's tile map (device graphs), shared by every layer
            kplan = b.plan.kernel_plan if b.xp is not np else None
            out = fa(b.ctx, q, k, v, mask, cfg.scale, cfg.max_bias, cfg.logit_softcap, plan=kplan, q8_out=q8_out)
        elif q8_out is not None:
            raise ValueError(f"attention: the output's 8-bit form (q8_out) is ggml_attn.flash_attn_ext's, not {fa!r}'s")
        else:
            out = fa(b.ctx, q, k, v, mask, cfg.scale, cfg.max_bias, cfg.logit_softcap)
        if fa is ggml.ggml_flash_attn_ext:
            ggml.ggml_flash_attn_ext_set_prec(out, ggml.GGML_PREC_F32)
        return b.result(out)
    return run


def softmax_attention(b, q, k, v, mask):
    """llama.cpp's non-FA path: ``KQ = mul_mat(k, q)``, ``soft_max_ext`` with the mask, ``KQV``."""
    cfg = b.cfg
    kq = b.call(ggml.ggml_mul_mat, k, q)                        # [n_kv, n_tps, n_head, ns]
    if cfg.logit_softcap:
        kq = b.call(ggml.ggml_scale, kq, cfg.scale / cfg.logit_softcap)
        kq = b.call(ggml.ggml_scale, b.call(ggml.ggml_tanh, kq), cfg.logit_softcap)
        kq = b.call(ggml.ggml_soft_max_ext, kq, mask, 1.0, cfg.max_bias)
    else:
        kq = b.call(ggml.ggml_soft_max_ext, kq, mask, cfg.scale, cfg.max_bias)
    vt = b.call(ggml.ggml_cont, b.call(ggml.ggml_permute, v, 1, 0, 2, 3))  # [n_kv, head_dim_v, n_head_kv, ns]
    kqv = b.call(ggml.ggml_mul_mat, vt, kq)                     # [head_dim_v, n_tps, n_head, ns]
    return b.call(ggml.ggml_cont, b.call(ggml.ggml_permute, kqv, 0, 2, 1, 3))  # [head_dim_v, n_head, n_tps, ns]



def attention(b, il: int, q_cur, k_cur, v_cur, q8_out=None):
    """Store ``k_cur``/``v_cur`` in the cache, attend ``q_cur [D, n_head, n_tokens]`` over the
    ubatch's K/V; returns ``[head_dim_v, n_head, n_tps, n_stream]`` F32. ``k_cur`` and ``v_cur``
    None: the node that made ``q_cur`` stored them already (``xp_ops.rope_store``: attention,
    which reads ``q_cur``, runs after it). ``q8_out``: the output in 8-bit form as well
    (``flash_attn_ext``'s; ``q8_handoff.attention_arrays``)."""
    cfg, plan = b.cfg, b.plan
    ns, n_tps, n_kv, s0 = plan.n_stream, plan.n_tps, plan.n_kv, plan.slot.s0
    if (k_cur is None) != (v_cur is None):
        raise ValueError(f"attention layer {il}: K and V are stored together (both given, or neither: stored already)")
    st_k = st_v = None
    if k_cur is not None:
        st_k, st_v = b.kv.cpy_kv(b.ctx, il, k_cur, v_cur, b.row_idx, all_custom=b.device, out_alloc=b.result)
        b.expand(st_k)
        if st_v is not st_k:   # (all-custom: one store node for both; expanding it again adds nothing)
            b.expand(st_v)
    qc = q_cur.contents
    q4 = ggml.ggml_view_4d(b.ctx, q_cur, cfg.head_dim_k, cfg.n_head, n_tps, ns,
                           qc.nb[1], qc.nb[2], qc.nb[2] * n_tps, 0)
    q4 = ggml.ggml_permute(b.ctx, q4, 0, 2, 1, 3)               # [D, n_tps, n_head, ns]
    k = b.kv.get_k(b.ctx, il, s0, n_kv, ns, after=st_k)         # [D, n_kv, n_head_kv, ns]
    v = b.kv.get_v(b.ctx, il, s0, n_kv, ns, after=st_v)
    b.kv_views += [(k, b.kv.stream_bytes("k")), (v, b.kv.stream_bytes("v"))]   # (UBatchGraph.load_plan moves them)
    out = b.attention(b, q4, k, v, b.mask, q8_out) if q8_out is not None else b.attention(b, q4, k, v, b.mask)
    ggml.ggml_set_name(out, f"attn_out_l{il}".encode())
    return out


def attn_layer(b, il: int, cur):
    """Attention only; inputs ``b.qkv_inputs(il)``; returns the attention output."""
    q, k, v = b.qkv_inputs(il)
    return attention(b, il, q, k, v)


def full_layer(b, il: int, x, reduce=None):
    """One block over the residual stream ``x [n_embd, n_tokens]`` F32; returns the new ``x``.
    ``reduce(b, t, name) -> t``: applied to the O projection's and the FFN down projection's
    outputs before they are added to ``x`` (a head-parallel rank all-reduces its partial sums
    there, ``tp.tp_full_layer``); None: nothing."""
    if reduce is None:
        reduce = _no_reduce
    if b.device:
        return _full_layer_custom(b, il, x, reduce)
    cfg, n_tok = b.cfg, b.plan.ubatch.n_tokens
    wt = {k: b.weight_tensor(il, k) for k in ("wq", "wk", "wv", "wo", "wg", "wu", "wd")}
    mm = lambda name, h: b.call(ggml.ggml_mul_mat, wt[name], h)  # noqa: E731
    h = b.call(ggml.ggml_rms_norm, x, RMS_EPS)
    q = ggml.ggml_reshape_3d(b.ctx, mm("wq", h), cfg.head_dim_k, cfg.n_head, n_tok)
    att = attention(b, il, q, mm("wk", h), mm("wv", h))
    att = ggml.ggml_reshape_2d(b.ctx, att, cfg.n_head * cfg.head_dim_v, n_tok)
    x = b.call(ggml.ggml_add, x, reduce(b, mm("wo", att), f"attn_allreduce_l{il}"))
    h = b.call(ggml.ggml_rms_norm, x, RMS_EPS)
    f = b.call(ggml.ggml_mul, b.call(ggml.ggml_silu, mm("wg", h)), mm("wu", h))
    return b.call(ggml.ggml_add, x, reduce(b, mm("wd", f), f"ffn_allreduce_l{il}"))


def _full_layer_custom(b, il: int, x, reduce):
    """:func:`full_layer` on an all-custom graph (``xp_matmul``, ``xp_ops``): the attention norm and Q/K/V in one
    node, the FFN norm and gate/up/SiLU in one, the O and down projections added into ``x`` by
    their own nodes (or, with a ``reduce`` hook, reduced first and then added)."""
    cfg, w = b.cfg, b.weights[il]
    n_tok = b.plan.ubatch.n_tokens
    q, k, v = xp_matmul.mul_mat_group(b, [w["wq"], w["wk"], w["wv"]], x, f"qkv_l{il}", norm_eps=RMS_EPS)
    q = ggml.ggml_reshape_3d(b.ctx, q, cfg.head_dim_k, cfg.n_head, n_tok)
    att = attention(b, il, q, k, v)
    att = ggml.ggml_reshape_2d(b.ctx, att, cfg.n_head * cfg.head_dim_v, n_tok)

    def project_add(x, name, h, what):
        if reduce is _no_reduce:
            return xp_matmul.mul_mat_add(b, w[name], h, x, f"{name}_res_l{il}")
        o = reduce(b, xp_matmul.mul_mat(b, w[name], h, f"{name}_l{il}"), f"{what}_allreduce_l{il}")
        return xp_ops.add_into(b, x, o, f"{what}_res_l{il}")
    x = project_add(x, "wo", att, "attn")
    f = xp_matmul.mul_mat_gated(b, w["wg"], w["wu"], x, f"ffn_act_l{il}", norm_eps=RMS_EPS)
    return project_add(x, "wd", f, "ffn")


def _no_reduce(b, t, name):
    return t
