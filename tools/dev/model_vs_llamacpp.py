"""The project's model graph against llama.cpp itself on one GGUF file, on the GPU: prompt
logits under every split and both KV modes, greedy tokens, and decode logits with llama.cpp's
tokens fed in. For files too large to commit a reference for (the 8B-shaped F16 GGUF of
tools/dev/llamacpp_side_by_side.py); tests/test_model.py does the same on the small fixtures
against committed references.

    python tools/dev/model_vs_llamacpp.py --gguf F.gguf --tool BUILD/bin/llamacpp_logits --out OUT.json

``--tool``: tools/dev/llamacpp_logits.cpp built against llama.cpp (CUDA, flash attention on,
F16 K/V, every layer on the GPU). Five prompts of 7, 19, 3, 33 and 12 random token ids
(``--seed``), each run alone by llama.cpp, twice: the prompt as one ubatch (as llama.cpp runs
it: F16 weights through cuBLAS GEMMs) and one token per ubatch (its matrix-vector kernels, F32
accumulation, as at decode); ours runs them together in one batch of 16-token ubatches.
Reported: ours against both, llama.cpp's two runs against each other, the decode logits with
llama.cpp's tokens fed in, and the greedy tokens (the leading tokens that agree per sequence,
with llama.cpp's top1 - top2 margin where they part; llama.cpp's two runs' agreement beside).
``pass``: prompt logits against the one-token-per-ubatch run and the decode logits within NMSE
5e-4 (the project's bound for non-F32 weights).
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

from ggml_attn.reference import nmse

LENGTHS = (7, 19, 3, 33, 12)
SPLITS = [("simple", True), ("equal", True), ("equal", False), ("seq", True), ("seq", False),
          ("padded", True), ("padded", False), ("auto", True), ("auto", False)]
BOUND = 5e-4


def llamacpp_run(tool: str, gguf: str, prompts: list[np.ndarray], n_gen: int, n_ubatch: int = 512) -> list[dict]:
    """llama.cpp's rows per prompt: ``tokens`` (prompt + greedy) and ``logits`` (one row per token);
    ``n_ubatch`` 1: the prompt one token per ubatch."""
    with tempfile.TemporaryDirectory() as d:
        tok, out = os.path.join(d, "tokens.bin"), os.path.join(d, "out.bin")
        with open(tok, "wb") as f:
            f.write(struct.pack("<i", len(prompts)))
            for p in prompts:
                f.write(struct.pack("<i", len(p)) + np.asarray(p, "<i4").tobytes())
        env = dict(os.environ)   # the tool's libraries (and CUDA's: LLAMACPP_LIBS), its process only
        env["LD_LIBRARY_PATH"] = ":".join(filter(None, [os.path.dirname(os.path.abspath(tool)),
                                                        os.environ.get("LLAMACPP_LIBS", ""),
                                                        env.get("LD_LIBRARY_PATH", "")]))
        p = subprocess.run([tool, gguf, tok, out, str(n_gen), "99", str(n_ubatch)], capture_output=True, text=True,
                           env=env)
        if p.returncode:
            raise SystemExit(f"llamacpp_logits failed (rc {p.returncode}):\n{p.stderr[-3000:]}")
        raw = open(out, "rb").read()
    n_vocab, n_prompts = struct.unpack_from("<ii", raw, 0)
    at, res = 8, []
    for _ in range(n_prompts):
        n, g = struct.unpack_from("<ii", raw, at)
        at += 8
        toks = np.frombuffer(raw, "<i4", n + g, at)
        at += 4 * (n + g)
        logits = np.frombuffer(raw, "<f4", (n + g) * n_vocab, at).reshape(n + g, n_vocab)
        at += 4 * (n + g) * n_vocab
        res.append(dict(n_prompt=n, tokens=toks.copy(), logits=logits.copy()))
    return res


def _agree(a: list, b: list) -> int:
    """Leading tokens that two greedy runs share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--tool", required=True, help="llamacpp_logits built against llama.cpp")
    ap.add_argument("--out", required=True, help="JSON summary")
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument("--seed", type=int, default=20240607)
    a = ap.parse_args(argv)

    from ggml_attn.graph import Batch, KVCache, load_gguf
    from ggml_attn.graph.model_runner import greedy, run_model_batch

    m = load_gguf(a.gguf)
    hp = m.hp
    rng = np.random.default_rng(a.seed)
    prompts = [rng.integers(3, hp.n_vocab, n).astype(np.int32) for n in LENGTHS]
    t = time.time()
    ref = llamacpp_run(a.tool, a.gguf, prompts, a.n_gen)
    inc = llamacpp_run(a.tool, a.gguf, prompts, a.n_gen, n_ubatch=1)
    print(f"llama.cpp: {time.time() - t:.1f}s", flush=True)

    def dev_cache(unified, n_seq=len(prompts)):
        return KVCache(1024, n_seq, unified=unified, n_layer=hp.n_layer, n_head_kv=hp.n_head_kv,
                       head_dim_k=hp.head_dim_k, xp="cupy")
    out = dict(gguf=os.path.basename(a.gguf), n_layer=hp.n_layer, n_vocab=hp.n_vocab, lengths=list(LENGTHS),
               n_gen=a.n_gen, bound=BOUND, prompt_nmse={}, logit_std=float(np.std(ref[0]["logits"])))
    # llama.cpp against itself: its prompt as one ubatch (cuBLAS GEMMs) and one token per ubatch
    out["llamacpp_prompt_batch_vs_incremental"] = max(nmse(r["logits"][:len(p)], i["logits"][:len(p)])
                                                      for p, r, i in zip(prompts, ref, inc))
    out["llamacpp_greedy_agree_batch_vs_incremental"] = [
        _agree(r["tokens"][len(p):].tolist(), i["tokens"][len(p):].tolist()) for p, r, i in zip(prompts, ref, inc)]
    print(f"llama.cpp prompt logits, one ubatch vs one token per ubatch: NMSE "
          f"{out['llamacpp_prompt_batch_vs_incremental']:.3g}; greedy tokens equal "
          f"{out['llamacpp_greedy_agree_batch_vs_incremental']}", flush=True)
    out["prompt_nmse_vs_incremental"] = {}
    for mode, unified in SPLITS:
        res = run_model_batch(dev_cache(unified), Batch.from_sequences(prompts), m, 16, mode, logits="all")
        off, worst, worst_inc = 0, 0.0, 0.0
        for p, r, i in zip(prompts, ref, inc):
            worst = max(worst, nmse(res.logits[off:off + len(p)], r["logits"][:len(p)]))
            worst_inc = max(worst_inc, nmse(res.logits[off:off + len(p)], i["logits"][:len(p)]))
            off += len(p)
        key = f"{mode}{'+kvu' if unified else ''}"
        out["prompt_nmse"][key], out["prompt_nmse_vs_incremental"][key] = worst, worst_inc
        print(f"prompt logits {mode:7s} {'unified' if unified else 'per-stream':10s} worst NMSE {worst:.3g} "
              f"(llama.cpp one token per ubatch: {worst_inc:.3g})", flush=True)
    gen = greedy(dev_cache(False), m, [list(p) for p in prompts], a.n_gen, mode="equal")
    agree, part = [], []
    for g, p, r in zip(gen, prompts, ref):
        want = r["tokens"][len(p):].tolist()
        k = _agree(g, want)
        agree.append(k)
        if k < len(want):
            row = np.sort(r["logits"][len(p) - 1 + k])[::-1]
            part.append(dict(step=k, ours=g[k], llamacpp=want[k], llamacpp_margin=float(row[0] - row[1])))
    out["greedy_agree"], out["greedy_parted"] = agree, part
    print(f"greedy: leading tokens equal per sequence {agree} of {a.n_gen}", flush=True)
    c = dev_cache(True)
    res = run_model_batch(c, Batch.from_sequences(prompts), m, 64, "auto")
    got = [res.logits]
    ids = list(range(len(prompts)))
    for step in range(a.n_gen - 1):
        toks = [int(r["tokens"][len(p) + step]) for p, r in zip(prompts, ref)]
        pos = [len(p) + step for p in prompts]
        got.append(run_model_batch(c, Batch(np.array(toks, np.int32), np.array(pos, np.int32),
                                            tuple((s,) for s in ids)), m).logits)
    got = np.stack(got, axis=1)
    want = np.stack([r["logits"][len(p) - 1:len(p) - 1 + a.n_gen] for p, r in zip(prompts, ref)])
    out["decode_nmse_teacher_forced"] = nmse(got, want)
    print(f"decode logits, llama.cpp's tokens fed: NMSE {out['decode_nmse_teacher_forced']:.3g}", flush=True)
    out["pass"] = bool(max(out["prompt_nmse_vs_incremental"].values()) <= BOUND
                       and out["decode_nmse_teacher_forced"] <= BOUND)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0 if out["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
