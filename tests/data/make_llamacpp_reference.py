"""Compute llama.cpp reference logits for the GGUF fixtures of tests/fixtures_gguf.py.

Runs in a separate venv with llama-cpp-python (NOT the project venv, NOT in CI):

    # 1. write the fixtures with the project venv (needs ggml-python for quantization)
    /work/main/.venv/bin/python tests/fixtures_gguf.py /tmp/fx
    # 2. llama.cpp reference
    /tmp/lcpp-venv/bin/python tests/data/make_llamacpp_reference.py --fixtures /tmp/fx \
        --project-python /work/main/.venv/bin/python

Per fixture it writes tests/data/llamacpp_ref/<name>.npz (compressed) with

  tokens_i (int32), n_prompt_i, logits_i (float32, (len(tokens_i), n_vocab); row j = logits
      after token j), greedy_margins_i (float32, top1-top2 at each of the 32 greedy choices)
      for the 5 prompts i = 0..4: prompt evaluated as one batch, then 32 greedy steps, each
      generated token fed back alone (the last generated token is evaluated too).
  tokens_rm / logits_rm / new_tokens_rm / n_keep_rm: first 10 tokens of prompt 1 + 6 fixed
      new tokens (the seq_rm scenario: evaluate prompt 1, drop positions >= 10, feed the 6
      new tokens).  logits_rm come from a fresh evaluation of tokens_rm as one batch;
      nmse_rm_edit_vs_fresh compares them with llama.cpp's own edit path (prompt 1, then
      KV positions >= 10 removed with llama_memory_seq_rm, then the 6 tokens in one batch).
  tokens_cp / logits_cp / new_tokens_cp / n_keep_cp: prompt 0 + 5 fixed new tokens (the
      seq_cp scenario: copy the prompt's cache to another sequence and continue there),
      fresh one-batch evaluation.
  min_greedy_margin: smallest top1-top2 gap over all greedy choices of the 5 sequences.
  nmse_fa_on_off: NMSE sum((a-b)^2)/sum(a^2) of the 5 prompts' logits, flash attention on
      (a, stored) vs off (b): llama.cpp's own noise floor.
  greedy_agree_fa_off: per sequence, how many of the 32 greedy tokens llama.cpp with flash
      attention off generates identically before the first difference (32 = all).
  nmse_batch_vs_incremental: each full tokens_i evaluated as one batch vs the stored
      incremental (prompt batch + single-token steps) logits, all sequences together.

and MANIFEST.json (versions, settings, date, each .gguf's sha256).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/
import fixtures_gguf as F  # noqa: E402

PROMPT_LENS = (7, 19, 3, 33, 12)
PROMPT_SEED = 20240607
N_GEN = 32
N_KEEP_RM, N_NEW_RM = 10, 6     # prompt 1[:10] + 6 new
N_NEW_CP = 5                     # prompt 0 + 5 new
SETTINGS = dict(n_ctx=512, n_batch=512, n_ubatch=512, logits_all=True, n_threads=2,
                n_threads_batch=2, seed=0, n_gpu_layers=0, type_k="f16 (default)",
                type_v="f16 (default)", flash_attn=True, calibration_flash_attn=False)


def prompts(n_vocab: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """The 5 prompts and the fixed new tokens of the rm / cp scenarios (ids in [3, n_vocab))."""
    rng = np.random.default_rng(PROMPT_SEED)
    ps = [rng.integers(3, n_vocab, n).astype(np.int32) for n in PROMPT_LENS]
    new_rm = rng.integers(3, n_vocab, N_NEW_RM).astype(np.int32)
    new_cp = rng.integers(3, n_vocab, N_NEW_CP).astype(np.int32)
    return ps, new_rm, new_cp


def nmse(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.sum((a - b) ** 2) / np.sum(a ** 2))


def top2_margin(row: np.ndarray) -> float:
    s = np.sort(row.astype(np.float64))
    return float(s[-1] - s[-2])


class Runner:
    def __init__(self, path: str, flash_attn: bool):
        import llama_cpp
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=SETTINGS["n_ctx"],
                                   n_batch=SETTINGS["n_batch"], n_ubatch=SETTINGS["n_ubatch"],
                                   logits_all=True, flash_attn=flash_attn,
                                   n_threads=SETTINGS["n_threads"],
                                   n_threads_batch=SETTINGS["n_threads_batch"],
                                   n_gpu_layers=0, seed=SETTINGS["seed"], verbose=False)
        self.n_vocab = self.llm.n_vocab()

    def fresh(self, tokens) -> np.ndarray:
        """Evaluate tokens from an empty cache in one batch; all-position logits."""
        llm = self.llm
        llm.reset()
        llm._ctx.kv_cache_clear()
        llm.eval([int(t) for t in tokens])
        return np.array(llm.scores[:len(tokens)], dtype=np.float32)

    def greedy(self, prompt, n_gen: int):
        llm = self.llm
        llm.reset()
        llm._ctx.kv_cache_clear()
        llm.eval([int(t) for t in prompt])
        toks = [int(t) for t in prompt]
        margins = []
        for _ in range(n_gen):
            last = np.array(llm.scores[len(toks) - 1], dtype=np.float32)
            nxt = int(np.argmax(last))
            margins.append(top2_margin(last))
            toks.append(nxt)
            llm.eval([nxt])
        logits = np.array(llm.scores[:len(toks)], dtype=np.float32)
        return np.array(toks, np.int32), logits, np.array(margins, np.float32)

    def edit_rm(self, prompt, n_keep: int, new) -> np.ndarray:
        """prompt in one batch; drop KV positions >= n_keep (Llama.eval does
        kv_cache_seq_rm(-1, n_tokens, -1)); feed `new` in one batch."""
        llm = self.llm
        llm.reset()
        llm._ctx.kv_cache_clear()
        llm.eval([int(t) for t in prompt])
        head = np.array(llm.scores[:n_keep], dtype=np.float32)
        llm.n_tokens = n_keep
        llm.eval([int(t) for t in new])
        return np.concatenate([head, np.array(llm.scores[n_keep:n_keep + len(new)], np.float32)])

    def close(self):
        self.llm.close()


def run_fixture(path: str, spec: F.Spec) -> tuple[dict, dict]:
    t0 = time.time()
    r = Runner(path, flash_attn=True)
    assert r.n_vocab == spec.n_vocab, (r.n_vocab, spec.n_vocab)
    ps, new_rm, new_cp = prompts(spec.n_vocab)
    out: dict[str, np.ndarray] = {}
    margins = []
    prompt_logits = []
    for i, p in enumerate(ps):
        toks, logits, m = r.greedy(p, N_GEN)
        out[f"tokens_{i}"] = toks
        out[f"n_prompt_{i}"] = np.int32(len(p))
        out[f"logits_{i}"] = logits
        out[f"greedy_margins_{i}"] = m
        margins.append(m)
        prompt_logits.append(logits[:len(p)])
    # batch vs incremental
    inc, bat = [], []
    for i in range(len(ps)):
        bat.append(r.fresh(out[f"tokens_{i}"]))
        inc.append(out[f"logits_{i}"])
    out["nmse_batch_vs_incremental"] = np.float64(nmse(np.concatenate(inc), np.concatenate(bat)))
    # rm scenario
    tok_rm = np.concatenate([ps[1][:N_KEEP_RM], new_rm]).astype(np.int32)
    out["tokens_rm"] = tok_rm
    out["new_tokens_rm"] = new_rm
    out["n_keep_rm"] = np.int32(N_KEEP_RM)
    out["logits_rm"] = r.fresh(tok_rm)
    out["nmse_rm_edit_vs_fresh"] = np.float64(nmse(out["logits_rm"], r.edit_rm(ps[1], N_KEEP_RM, new_rm)))
    # cp scenario
    tok_cp = np.concatenate([ps[0], new_cp]).astype(np.int32)
    out["tokens_cp"] = tok_cp
    out["new_tokens_cp"] = new_cp
    out["n_keep_cp"] = np.int32(len(ps[0]))
    out["logits_cp"] = r.fresh(tok_cp)
    r.close()
    # calibration: flash attention off
    r2 = Runner(path, flash_attn=False)
    off = [r2.fresh(p) for p in ps]
    agree = []
    for i, p in enumerate(ps):
        toks_off = r2.greedy(p, N_GEN)[0][len(p):]
        same = toks_off == out[f"tokens_{i}"][len(p):]
        agree.append(N_GEN if same.all() else int(np.argmin(same)))
    r2.close()
    out["nmse_fa_on_off"] = np.float64(nmse(np.concatenate(prompt_logits), np.concatenate(off)))
    out["greedy_agree_fa_off"] = np.array(agree, np.int32)
    out["min_greedy_margin"] = np.float64(min(float(m.min()) for m in margins))
    for k, v in out.items():
        if k.startswith("logits"):
            assert np.all(np.isfinite(v)), k
    info = dict(min_greedy_margin=float(out["min_greedy_margin"]),
                nmse_fa_on_off=float(out["nmse_fa_on_off"]),
                greedy_agree_fa_off=[int(x) for x in out["greedy_agree_fa_off"]],
                nmse_batch_vs_incremental=float(out["nmse_batch_vs_incremental"]),
                nmse_rm_edit_vs_fresh=float(out["nmse_rm_edit_vs_fresh"]),
                logit_std=float(np.concatenate(prompt_logits).std()),
                seconds=round(time.time() - t0, 2))
    return out, info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixtures", required=True,
                    help="directory with <name>.gguf written by tests/fixtures_gguf.py "
                         "(missing ones are written here if ggml-python is importable)")
    ap.add_argument("--out", default=os.path.join(HERE, "llamacpp_ref"))
    ap.add_argument("--only", nargs="+", metavar="NAME")
    ap.add_argument("--project-python", default=None,
                    help="python of the venv that wrote the fixtures (versions go into MANIFEST)")
    a = ap.parse_args(argv)

    import llama_cpp
    os.makedirs(a.out, exist_ok=True)
    man_path = os.path.join(a.out, "MANIFEST.json")
    manifest = {}
    if a.only and os.path.exists(man_path):
        with open(man_path) as f:
            manifest = json.load(f)
    writer = manifest.get("fixture_writer", {})
    if a.project_python:
        code = ("import json, numpy, importlib.metadata as m; print(json.dumps({'numpy': numpy.__version__,"
                " 'gguf': m.version('gguf'), 'ggml-python': m.version('ggml-python')}))")
        writer = json.loads(subprocess.check_output([a.project_python, "-c", code], text=True))
    try:
        sysinfo = llama_cpp.llama_print_system_info().decode()
    except Exception:  # pragma: no cover
        sysinfo = ""
    manifest.update({
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp_commit": LLAMA_CPP_COMMIT,
        "llama_cpp_system_info": sysinfo.strip(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": SETTINGS,
        "prompt_lens": list(PROMPT_LENS), "prompt_seed": PROMPT_SEED, "n_gen": N_GEN,
        "logits_dtype": "float32",
        "fixture_writer": {"script": "tests/fixtures_gguf.py", **writer},
        "generator": "tests/data/make_llamacpp_reference.py",
    })
    fixtures = manifest.setdefault("fixtures", {})
    for name in (a.only or list(F.SPECS)):
        spec = F.SPECS[name]
        path = F.fixture_path(name, a.fixtures)
        out, info = run_fixture(path, spec)
        np.savez_compressed(os.path.join(a.out, f"{name}.npz"), **out)
        fixtures[name] = {"sha256": F.sha256(path), "bytes": os.path.getsize(path), **info}
        print(name, json.dumps(fixtures[name]), flush=True)
    manifest["fixtures"] = {k: fixtures[k] for k in F.SPECS if k in fixtures}
    with open(man_path, "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    return 0


# commit of vendor/llama.cpp in the llama-cpp-python 0.3.36 sdist
# (git -C vendor/llama.cpp rev-parse HEAD; the sdist ships its .git)
LLAMA_CPP_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"

if __name__ == "__main__":
    sys.exit(main())
