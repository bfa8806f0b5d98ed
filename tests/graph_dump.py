"""A built ubatch graph's structure as plain data, for comparing builds (``graph/build.py``):
every node in graph order and every tensor it reaches through its sources, with op, type,
``ne``/``nb`` (ggml order), view offset, name, flags, sources, op parameters and memory.

Numbers that differ from run to run are normalized: tensors are named by their first
appearance (``n3``: node 3, ``t7``: the 7th other tensor reached), data pointers by the order in
which distinct pointers first appear (so aliasing -- reused scratch, in-place results, views --
is compared, not addresses); a custom node's callback by which of the project's callbacks it is
(attention op ``ggml_attn/op.py``, dense ops ``graph/xp_matmul.py`` and ``graph/xp_ops.py``, K/V store
``graph/kv_graph.py``), its ``userdata`` kept only for the K/V store (host/device flag).

``python tests/graph_dump.py OUT.json`` writes the dumps of :data:`CASES` (the reference file
``tests/data/graph_structure.json`` was written this way before the builder's host-speed
changes; tests/test_graph_structure.py compares the builder's graphs with it).
"""
from __future__ import annotations

import ctypes
import json
import sys

import ggml
import numpy as np

from ggml_attn import op as fa_op
from ggml_attn.graph import AttnConfig, Batch, KVCache, kv_graph, split_ubatches, xp_node
from ggml_attn.graph.build import build_ubatch_graph
from ggml_attn.graph.plan import plan_ubatch

CFG = AttnConfig(n_layer=3, n_head=4, n_head_kv=2, head_dim_k=32)
N_EMBD, N_FF = 64, 96


def _fn_addr(cb) -> int:
    return ctypes.cast(cb, ctypes.c_void_p).value


def _callbacks() -> dict:
    return {_fn_addr(fa_op._CALLBACK): "flash_attn_ext", _fn_addr(xp_node._CB): "xp_op",
            _fn_addr(kv_graph._STORE_CB): "kv_store"}


def dump_graph(gf) -> list[dict]:
    """The structure of graph ``gf``: one dict per tensor (module doc)."""
    cbs = _callbacks()
    names, ptrs, rows = {}, {}, []
    nodes = [ggml.ggml_graph_node(gf, i) for i in range(ggml.ggml_graph_n_nodes(gf))]
    for i, t in enumerate(nodes):
        names[ctypes.addressof(t.contents)] = f"n{i}"
    n_other = [0]

    def ref(p) -> str | None:
        if not p:
            return None
        a = ctypes.addressof(p.contents)
        if a not in names:
            names[a] = f"t{n_other[0]}"
            n_other[0] += 1
            rows.append(describe(p))
        return names[a]

    def describe(p) -> dict:
        c = p.contents
        me = names[ctypes.addressof(c)]
        d = c.data or 0
        row = {"id": me, "name": c.name.decode(errors="replace"), "op": ggml.ggml_op_name(c.op).decode(),
               "type": int(c.type), "ne": [int(x) for x in c.ne], "nb": [int(x) for x in c.nb],
               "flags": int(c.flags), "view_offs": int(c.view_offs),
               "mem": None if not d else ptrs.setdefault(int(d), len(ptrs))}
        params = list(c.op_params)
        if c.op == ggml.GGML_OP_CUSTOM:
            # ggml's ggml_custom_op_params: fun (8 bytes), n_tasks (int), userdata (8 bytes, aligned)
            raw = ctypes.string_at(ctypes.addressof(c.op_params), 24)
            fun, userdata = int.from_bytes(raw[:8], "little"), int.from_bytes(raw[16:24], "little")
            n_tasks = int.from_bytes(raw[8:12], "little", signed=True)
            kind = cbs.get(fun, "?")
            row["custom"] = {"fun": kind, "n_tasks": n_tasks, "userdata": userdata if kind == "kv_store" else None}
        else:
            row["op_params"] = params
        row["src"] = [ref(c.src[j]) for j in range(10) if c.src[j]]
        row["view_src"] = ref(c.view_src)
        return row

    for t in nodes:
        rows.append(describe(t))
    return rows


def weights(n_layer: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)

    def w(n_in, n_out):
        return (rng.standard_normal((n_out, n_in), dtype=np.float32) / np.sqrt(n_in)).astype(np.float16)
    return [dict(wq=w(N_EMBD, 128), wk=w(N_EMBD, 64), wv=w(N_EMBD, 64), wo=w(128, N_EMBD),
                 wg=w(N_EMBD, N_FF), wu=w(N_EMBD, N_FF), wd=w(N_FF, N_EMBD)) for _ in range(n_layer)]


# name -> (build kwargs, unified KV, prompt lengths, decode step after the prompts)
CASES = {
    "full_custom_prompt": (dict(layer="full", all_custom=True), False, [3, 5], False),
    "full_custom_decode": (dict(layer="full", all_custom=True), True, [3, 5, 2], True),
    "full_custom_layers": (dict(layer="full", all_custom=True, layers=range(1, 3)), True, [4], False),
    "full_host_prompt": (dict(layer="full"), True, [3, 5], False),
    "attn_custom_prompt": (dict(all_custom=True), False, [3, 5], False),
    "attn_custom_shared": (dict(all_custom=True, shared_inputs=True), True, [6], False),
    "attn_host_decode": (dict(), True, [3, 5], True),
    "attn_host_fa_off": (dict(flash_attn=False), False, [3, 5], False),
}


def build_case(name: str):
    """``(graph, plan)`` of case ``name`` of :data:`CASES`, built with fixed inputs set (free it)."""
    kw, unified, lengths, decode = CASES[name]
    kw = dict(kw)
    n_layer = len(kw["layers"]) if "layers" in kw else CFG.n_layer
    c = KVCache(1024, len(lengths), unified=unified, n_layer=n_layer, n_head_kv=CFG.n_head_kv,
                head_dim_k=CFG.head_dim_k)
    batch = Batch.from_lengths(lengths)
    if decode:
        for ub in split_ubatches(batch, 512, "simple"):
            c.free_pads(plan_ubatch(c, ub).slot)
        batch = Batch.from_lengths([1] * len(lengths), start_pos=c.next_positions(range(len(lengths))))
    (ub,) = split_ubatches(batch, 512, "simple" if unified else "padded")
    plan = plan_ubatch(c, ub)
    if kw.get("layer") == "full":
        kw["weights"] = weights(n_layer)
    g = build_ubatch_graph(c, plan, CFG, **kw)
    g._cache = c   # kept alive with the graph
    rng = np.random.default_rng(1)
    n = ub.n_tokens
    if g.layer == "full":
        g.set_x(rng.standard_normal((n, N_EMBD)).astype(np.float32))
    else:
        k = 1 if kw.get("shared_inputs") else n_layer
        g.set_inputs([rng.standard_normal((n, CFG.n_head, CFG.head_dim_k)).astype(np.float32) for _ in range(k)],
                     [rng.standard_normal((n, CFG.n_head_kv, CFG.head_dim_k)).astype(np.float32) for _ in range(k)],
                     [rng.standard_normal((n, CFG.n_head_kv, CFG.head_dim_v)).astype(np.float32) for _ in range(k)])
    return g, plan


def dump_case(name: str) -> dict:
    """Structure of case ``name`` and a digest of its results (per output: sum and sum of
    squares of the real rows, float64)."""
    g, plan = build_case(name)
    try:
        rows = dump_graph(g.graph)
        g.compute(1)
        real = ~plan.ubatch.is_pad
        outs = [np.asarray(o, dtype=np.float64)[real] for o in g.outputs()]
        return {"nodes": rows, "outputs": [[float(o.sum()), float((o * o).sum())] for o in outs]}
    finally:
        g.free()


if __name__ == "__main__":
    out = {name: dump_case(name) for name in CASES}
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=0, sort_keys=True)
        f.write("\n")
