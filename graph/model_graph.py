"""A real model's ubatch graph pieces (``graph/model.py`` weights): token embedding, the llama
block with RoPE, the output head -- what ``build.build_ubatch_graph(..., model=...)`` runs.

Per ubatch (ggml order throughout; numpy order is the reverse):

* inputs (:class:`ModelInputs`): ``tokens`` I32 ``[n_tokens]`` (a pad row: token 0),
  ``positions`` I32 ``[n_tokens]`` (the ubatch's positions, as the cache assigns them),
  ``out_ids`` I32 ``[n_out]`` (the rows that need logits: llama.cpp's ``inp_out_ids``);
* :func:`embed`: ``x = get_rows(token_embd, tokens)`` -> F32 ``[n_embd, n_tokens]``
  (gemma: times ``sqrt(n_embd)``);
* :func:`model_layer` per layer, as llama.cpp's llama/qwen2/qwen3/gemma/gemma2 graphs build it:
  ``h = rms_norm(x) * attn_norm``; ``q = wq h (+ bq)``, ``k = wk h (+ bk)``, ``v = wv h (+ bv)``;
  qwen3: ``q``, ``k`` RMS-normalized per head (times ``q_norm`` / ``k_norm``); ``q``, ``k``
  rotated by ``rope_ext`` on the positions (normal or NEOX layout, ``rope_freqs`` as frequency
  factors); attention through the KV cache (``layers.attention``: store, views, our
  flash-attention op, with the model's scale and soft-cap); ``o = wo att`` (gemma2: ``o =
  rms_norm(o) * attn_post_norm``); ``x += o``; ``h = rms_norm(x) * ffn_norm``; ``f = wd
  (act(wg h) * (wu h))``, ``act`` SiLU (gemma: tanh GELU) (gemma2: ``f = rms_norm(f) *
  ffn_post_norm``); ``x += f``;
* :func:`head`: ``logits = output(rms_norm(get_rows(x, out_ids)) * output_norm)`` -> F32
  ``[n_vocab, n_out]`` (gemma2: then ``c * tanh(logits / c)``).

Host graphs run ggml's own ops on the weights in their file type (quantized ones included).
All-custom (device-resident) graphs (``b.device``) run the same block on ``xp_matmul``'s and ``xp_ops``' custom ops
over ``model.device_weights(xp)`` (``model_device.py``: block-type matrices in their blocks,
float ones F16 with the RMS-norm weights folded in; the ops take the norm weight for the blocks):

* :func:`embed`: ``xp_ops.get_rows`` of the embedding (F16 or blocks; an array of its own: the
  residual stream, updated in place by the layers);
* :func:`model_layer`: ``q, k, v = mul_mat_group([wq, wk, wv], x, norm_eps, attn_norm)``; qwen3's
  per-head norms (``xp_matmul.rms_norm``); ``q``, ``k`` through one ``xp_ops.rope`` node (biases
  added first); ``v += bv``; attention as on host graphs; ``x += wo att`` (``mul_mat_add``; gemma2:
  ``mul_mat``, ``rms_norm``, ``add_into``); ``f = mul_mat_gated(wg, wu, x, norm_eps, ffn_norm, down=wd)``;
  ``x += wd f`` (gemma2 likewise). The two residual adds name what reads ``x`` next (``norm_next``:
  the FFN's norm and gate/up, the next layer's norm and Q/K/V), and the gate/up node its down
  matrix, so that each can hand over its output's 8-bit form (``matmul_dispatch.GEMV_QUANT_OUT``),
  and the attention its output to the O projection (``matmul_dispatch.ATTN_QUANT_OUT``);
* :func:`head`: ``get_rows(x, out_ids)``, then ``mul_mat_group([output], ., norm_eps, output_norm)``
  (gemma2: ``xp_ops.softcap_into``).

Rounding differs from the host form: an F16 weight has ``g`` folded in (``W * g`` rounded to F16;
host: ``x̂ * g`` is rounded to F16 as ``mul_mat``'s activation); a block weight's values multiply
the F32 ``x̂ * g`` (host: ggml's quantized dot products against an activation quantized to
Q8). Sums are F32 in both.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import ggml
import numpy as np

from . import q8_handoff, xp_matmul, xp_ops
from .batch import Batch
from .layers import attention
from .model import Model, Weight

__all__ = ["ModelInputs", "input_values", "model_inputs", "embed", "model_layer", "head", "check_model", "output_flags",
           "output_rows"]

GGML_TYPE_I32 = 26
# All-custom graphs on F16/F32 caches: the layer's Q/K rope and its K/V store as one node
# (xp_ops.rope_store, one launch of cuda/model_ops.cu's xp_rope_store) instead of a rope node and
# a store node (one launch a layer fewer: the store took 3.4 us of a 105 us one-token layer on
# the H200, bench/results/2026-12-06-bb0e9e4-h200-gemv-run/step.json). Predicted tg128 +2-3%; on
# an H200 at 6336414 (bench/results/2026-12-06-6336414-h200-gemv-one-rope-store/, the 8B-shaped
# Q4_K_M file, 3 alternating rounds) 303.9 against 299.4 t/s (+1.5%); the two launches' 6.4 us a
# layer became 3.1 (step.json, step-all.json).
ROPE_STORE = True


@dataclass
class ModelInputs:
    tokens: object      # I32 [n_tokens]
    positions: object   # I32 [n_tokens]
    out_ids: object     # I32 [n_out]

    def tensors(self) -> tuple:
        return self.tokens, self.positions, self.out_ids


def input_values(ub, tokens: np.ndarray, out_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host values of :class:`ModelInputs`, numpy int32: the ubatch's token ids (``tokens``: the
    batch's, read through ``ub.token_idx``; a pad row gets token 0), its positions, its output
    rows (at least one entry: an empty list reads row 0, whose logits nobody takes)."""
    tok = np.zeros(ub.n_tokens, dtype=np.int32)
    real = ub.token_idx >= 0
    tok[real] = np.asarray(tokens)[ub.token_idx[real]]
    out = np.zeros(max(len(out_rows), 1), dtype=np.int32)
    out[:len(out_rows)] = out_rows
    return tok, np.asarray(ub.positions, dtype=np.int32), out


def output_flags(batch: Batch, logits="last") -> np.ndarray:
    """bool ``(batch.n_tokens,)``: the tokens that get logits. ``"last"``: the last token of each
    sequence (its largest position; a token shared by several sequences counts for each);
    ``"all"``; or a bool array of one flag per token."""
    if isinstance(logits, str):
        if logits == "all":
            return np.ones(batch.n_tokens, dtype=bool)
        if logits != "last":
            raise ValueError(f"logits must be 'last', 'all' or one bool per token, got {logits!r}")
        last: dict[int, tuple[int, int]] = {}
        for i, (p, ids) in enumerate(zip(batch.positions.tolist(), batch.seq_ids)):
            for s in ids:
                if s not in last or p >= last[s][0]:
                    last[s] = (p, i)
        want = np.zeros(batch.n_tokens, dtype=bool)
        want[[i for _, i in last.values()]] = True
        return want
    want = np.asarray(logits)
    if want.dtype != bool or want.shape != (batch.n_tokens,):
        raise ValueError(f"logits flags must be a bool array of shape ({batch.n_tokens},), got "
                         f"{want.dtype} {want.shape}")
    return want


def output_rows(ub, want: np.ndarray) -> np.ndarray:
    """int32 ubatch rows that need logits: real rows whose batch token is flagged in ``want``
    (bool ``(batch.n_tokens,)``), ubatch order."""
    idx = ub.token_idx
    rows = np.flatnonzero(idx >= 0)
    return rows[want[idx[rows]]].astype(np.int32)


def check_model(model: Model, cache, device: bool) -> None:
    """ValueError when ``model`` cannot run on ``cache`` in this kind of graph."""
    hp = model.hp
    if (hp.n_head_kv, hp.head_dim_k, hp.head_dim_k) != (cache.n_head_kv, cache.head_dim_k, cache.head_dim_v):
        raise ValueError(f"model {hp.name!r} has K/V {hp.n_head_kv}x{hp.head_dim_k}, the cache "
                         f"{cache.n_head_kv}x{cache.head_dim_k}/{cache.head_dim_v}")
    if hp.n_layer > cache.n_layer:
        raise ValueError(f"model {hp.name!r} has {hp.n_layer} layers, the cache holds {cache.n_layer}")


def model_inputs(b, ub, out_rows: np.ndarray) -> ModelInputs:
    """The ubatch's input tensors, filled (:func:`input_values`)."""
    vals = input_values(ub, b.batch_tokens, out_rows)
    return ModelInputs(*(b.new(GGML_TYPE_I32, a.shape, np.int32, name, b.xp.array(a))
                         for a, name in zip(vals, ("tokens", "positions", "out_ids"))))


def _weight(b, w: Weight):
    """A ggml tensor over the weight's bytes (its file type); 1-D weights as F32 (ggml's
    binary ops broadcast an F32 row)."""
    t = b._weights.get(id(w))
    if t is not None:
        return t
    if len(w.ne) == 1 and w.type_name != "F32":
        arr = w.to_float(np.float32)
        t = ggml.ggml_new_tensor_1d(b.ctx, ggml.GGML_TYPE_F32, w.ne[0])
        b.attach(t, arr)
    else:
        ne = (ctypes.c_int64 * 4)(*(list(w.ne) + [1] * (4 - len(w.ne))))
        t = ggml.ggml_new_tensor(b.ctx, w.type, len(w.ne), ne)
        b.attach(t, w.data, w.ptr)
    ggml.ggml_set_name(t, w.name.encode())
    b._weights[id(w)] = t
    return t


def _norm(b, x, w: Weight, eps: float):
    return b.call(ggml.ggml_mul, b.call(ggml.ggml_rms_norm, x, eps), _weight(b, w))


def embed(b, inp: ModelInputs):
    """``get_rows(token_embd, tokens)`` -> F32 ``[n_embd, n_tokens]``, memory of its own (the
    layers' scratch arrays may not alias it)."""
    s = b.model.hp.embd_scale
    if b.device:
        t = xp_ops.get_rows(b, _dw(b).tok_embd, inp.tokens, "inp_embd", own=True)
        return t if s == 1.0 else xp_ops.scale_into(b, t, s, "inp_scaled")
    t = _fresh(b, ggml.ggml_get_rows(b.ctx, _weight(b, b.model.tok_embd), inp.tokens))
    ggml.ggml_set_name(t, b"inp_embd")
    if s != 1.0:
        t = _fresh(b, ggml.ggml_scale(b.ctx, t, s))
        ggml.ggml_set_name(t, b"inp_scaled")
    return t


def _rope(b, t, inp: ModelInputs):
    hp, m = b.model.hp, b.model
    ff = _weight(b, m.rope_freqs) if m.rope_freqs is not None else None
    return b.call(ggml.ggml_rope_ext, t, inp.positions, ff, hp.rope_dim, hp.rope_mode, hp.n_ctx_train,
                  hp.rope_base, hp.rope_freq_scale, 0.0, 1.0, 32.0, 1.0)


def model_layer(b, il: int, x):
    """One block over the residual stream ``x [n_embd, n_tokens]`` F32; returns the new ``x``
    (module docstring). ``il``: the cache's (local) layer index."""
    if b.device:
        return _model_layer_custom(b, il, x)
    hp, lw, inp = b.model.hp, b.model.layers[il], b.model_inputs
    n_tok = b.plan.ubatch.n_tokens

    def proj(key, h):
        y = b.call(ggml.ggml_mul_mat, _weight(b, lw[key]), h)
        bias = lw.get("b" + key[1])
        return y if bias is None else b.call(ggml.ggml_add, y, _weight(b, bias))

    def post_norm(key, t):   # gemma2's norm of a sub-block's output (absent: nothing)
        return t if key not in lw else _norm(b, t, lw[key], hp.rms_eps)

    h = _norm(b, x, lw["attn_norm"], hp.rms_eps)
    q = ggml.ggml_reshape_3d(b.ctx, proj("wq", h), hp.head_dim_k, hp.n_head, n_tok)
    k = ggml.ggml_reshape_3d(b.ctx, proj("wk", h), hp.head_dim_k, hp.n_head_kv, n_tok)
    if "q_norm" in lw:   # qwen3: each head RMS-normalized (rms_norm runs along ne0 = head_dim_k)
        q, k = _norm(b, q, lw["q_norm"], hp.rms_eps), _norm(b, k, lw["k_norm"], hp.rms_eps)
    q, k = _rope(b, q, inp), _rope(b, k, inp)
    k = ggml.ggml_reshape_2d(b.ctx, k, hp.n_embd_kv, n_tok)
    att = attention(b, il, q, k, proj("wv", h))
    att = ggml.ggml_reshape_2d(b.ctx, att, hp.n_embd_q, n_tok)
    x = b.call(ggml.ggml_add, x, post_norm("attn_post_norm", b.call(ggml.ggml_mul_mat, _weight(b, lw["wo"]), att)))
    h = _norm(b, x, lw["ffn_norm"], hp.rms_eps)
    act = ggml.ggml_gelu if hp.ffn_gelu else ggml.ggml_silu
    g = b.call(act, b.call(ggml.ggml_mul_mat, _weight(b, lw["wg"]), h))
    f = b.call(ggml.ggml_mul, g, b.call(ggml.ggml_mul_mat, _weight(b, lw["wu"]), h))
    return b.call(ggml.ggml_add, x, post_norm("ffn_post_norm", b.call(ggml.ggml_mul_mat, _weight(b, lw["wd"]), f)))


def head(b, x, inp: ModelInputs):
    """Logits of the output rows: F32 ``[n_vocab, n_out]``, memory of its own."""
    m = b.model
    if b.device:
        xo = xp_ops.get_rows(b, x, inp.out_ids, "x_out")
        dw = _dw(b)
        (logits,) = xp_matmul.mul_mat_group(b, [dw.output], xo, "result_output", norm_eps=m.hp.rms_eps,
                                         norm_w=dw.output_norm)
        if m.hp.final_softcap:
            logits = xp_ops.softcap_into(b, logits, m.hp.final_softcap, "result_softcap")
        ggml.ggml_set_name(logits, b"logits")
        return logits
    xo = ggml.ggml_get_rows(b.ctx, x, inp.out_ids)
    xo = _fresh(b, xo)
    h = _fresh(b, ggml.ggml_mul(b.ctx, _fresh(b, ggml.ggml_rms_norm(b.ctx, xo, m.hp.rms_eps)),
                                _weight(b, m.output_norm)))
    logits = _fresh(b, ggml.ggml_mul_mat(b.ctx, _weight(b, m.output), h))
    c = m.hp.final_softcap
    if c:   # llama.cpp's gemma2 head: scale(1/c), tanh, scale(c)
        logits = _fresh(b, ggml.ggml_scale(b.ctx, _fresh(b, ggml.ggml_tanh(
            b.ctx, _fresh(b, ggml.ggml_scale(b.ctx, logits, float(np.float32(1.0) / np.float32(c)))))), c))
    ggml.ggml_set_name(logits, b"logits")
    return logits


def _fresh(b, t):
    """``t`` with a new F32 array of its own (not a scratch array a layer may reuse)."""
    ne = t.contents.ne
    b.attach(t, b.xp.empty((ne[1], ne[0]), dtype=np.float32))
    return t


# ----------------------------------------------------------------- all-custom (device) form
def _dw(b):
    """The model's device weights in the graph's array module (built once per model)."""
    return b.model.device_weights(b.xp)


def _model_layer_custom(b, il: int, x):
    """:func:`model_layer` on an all-custom graph (module docstring): five custom nodes (QKV, the
    Q/K rope, O, gate/up, down; qwen2's V bias and qwen3's Q/K norms besides) plus the K/V store
    and attention; ``x``'s memory is updated in place by the two residual adds."""
    hp, inp, w = b.model.hp, b.model_inputs, _dw(b).layers[il]
    n_tok = b.plan.ubatch.n_tokens
    ff = _dw(b).rope_freqs
    q, k, v = xp_matmul.mul_mat_group(b, [w["wq"], w["wk"], w["wv"]], x, f"qkv_l{il}", norm_eps=hp.rms_eps,
                                   norm_w=w["attn_norm"])
    if "q_norm" in w:   # qwen3: each head RMS-normalized
        q = xp_matmul.rms_norm(b, q, hp.rms_eps, w["q_norm"], f"q_norm_l{il}", row=hp.head_dim_k)
        k = xp_matmul.rms_norm(b, k, hp.rms_eps, w["k_norm"], f"k_norm_l{il}", row=hp.head_dim_k)
    store = b.kv.store_arrays(il) if ROPE_STORE else None
    att_q8 = q8_handoff.attention_arrays(b, w["wo"], n_tok, hp.n_embd_q)   # the O projection's 8-bit input, or None
    if store is not None:   # Q rotated; K rotated and V stored into the cache by the same node
        q = xp_ops.rope_store(b, q, k, v, inp.positions, hp, store, b.row_idx, ff,
                              (w.get("bq"), w.get("bk"), w.get("bv")), f"qk_rope_kv_store_l{il}")
        att = attention(b, il, q, None, None, q8_out=att_q8)
    else:
        q, k = xp_ops.rope(b, [q, k], inp.positions, hp, ff, [w.get("bq"), w.get("bk")], f"qk_rope_l{il}")  # [D, n_head(_kv), n_tok]
        k = ggml.ggml_reshape_2d(b.ctx, k, hp.n_embd_kv, n_tok)
        if "bv" in w:
            v = xp_ops.add_bias(b, v, w["bv"], f"v_bias_l{il}")
        att = attention(b, il, q, k, v, q8_out=att_q8)
    att = q8_handoff.remember(b, ggml.ggml_reshape_2d(b.ctx, att, hp.n_embd_q, n_tok), att_q8, None, None)

    def add_projection(wkey, h, post, what, nxt):   # x += w·h, or gemma2's x += rms_norm(w·h) * post
        if post not in w:   # (nxt: the norm and matrices that read x next, for its 8-bit form)
            return xp_matmul.mul_mat_add(b, w[wkey], h, x, f"{what}_res_l{il}", norm_next=nxt)
        o = xp_matmul.mul_mat(b, w[wkey], h, f"{wkey}_l{il}")
        o = xp_matmul.rms_norm(b, o, hp.rms_eps, w[post], f"{post}_l{il}")
        return xp_ops.add_into(b, x, o, f"{what}_res_l{il}")
    x = add_projection("wo", att, "attn_post_norm", "wo", (w["ffn_norm"], hp.rms_eps, [w["wg"], w["wu"]]))
    f = xp_matmul.mul_mat_gated(b, w["wg"], w["wu"], x, f"ffn_act_l{il}", norm_eps=hp.rms_eps, norm_w=w["ffn_norm"],
                                gelu=hp.ffn_gelu, down=None if "ffn_post_norm" in w else w["wd"])
    nxt = None
    if il + 1 < len(b.layers or range(hp.n_layer)):   # the next layer's Q/K/V read x next (in this graph)
        wn = _dw(b).layers[il + 1]
        nxt = (wn["attn_norm"], hp.rms_eps, [wn["wq"], wn["wk"], wn["wv"]])
    return add_projection("wd", f, "ffn_post_norm", "ffn", nxt)
