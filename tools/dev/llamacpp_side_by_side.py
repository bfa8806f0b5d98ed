"""llama.cpp and ggml-attn side by side on one GPU and one GGUF file (a GPU-machine script).

    python tools/dev/llamacpp_side_by_side.py --src .lcpp/src.tar.gz --out $OUT [--gguf F] [--build-only]
    python tools/dev/llamacpp_side_by_side.py --prebuilt .lcpp/build-sm90.tar.xz --out $OUT

Steps (each logged under ``--out``, or with ``$OUT`` set -- a device machine, which returns at
most 8 files -- packed into ``--out``'s ``logs.tgz`` after each step; one JSON
``side_by_side.json`` and a markdown table, printed and ``table.md``, last):

1. build llama.cpp's ``llama-bench`` and ``llama-batched-bench`` with CUDA (one architecture,
   ``-DCMAKE_CUDA_ARCHITECTURES=90``) from a source tarball of its ``CMakeLists.txt cmake common
   ggml include src tools vendor`` (the ``vendor/llama.cpp`` of the llama-cpp-python sdist on
   PyPI is one), into ``--build`` (kept between calls on a warm machine: built once), with
   ``tools/dev/llamacpp_logits.cpp`` linked against it; or unpack ``--prebuilt``, a tarball of
   such a build's ``bin/`` (binaries and shared libraries; ``--pack`` writes one after a build;
   ``tools/dev/build_llamacpp_sm90.sh`` makes one on a CPU-only machine);
2. write an 8B-shaped F16 GGUF (llama-3-8B shapes, random weights, a dummy vocab of 32000:
   ``tests/fixtures_gguf.py --preset llama-3-8b``) unless ``--gguf`` names one;
3. run, on that file: llama-bench ``-p 512 -n 128 -fa 1 -ngl 99`` and ``ggml-attn-bench`` (the
   file's own weights, ``--layer model``); llama-batched-bench ``-npp 128 -ntg 32 -npl 1,16,64``
   with and without ``-kvu`` and ours with the same flags; 64 ragged prompts of 16-200 tokens
   (ours, unified KV, ``auto`` split) against llama.cpp's equal-length rows that hold at least
   as many prompt tokens (``-npp`` = the ragged total / 64, rounded up; with and without
   ``-kvu``: its best S_PP counts); the load time of each (wall time of a one-token run);
4. the logits: ``tools/dev/model_vs_llamacpp.py`` on the same file (step ``logits``;
   ``model_vs_llamacpp.json``);
5. a q8_0 KV cache against f16 (step ``kvq``): both batched benches with ``-ctk/-ctv f16`` and
   ``q8_0``, 64 sequences of ``KVQ_NPP`` prompt tokens and 32 generated (decode bound by the
   cache's bytes; llama.cpp's flash attention reads the q8_0 blocks in its CUDA kernels).

The logits and the load rows run first, the benchmarks after them (a run cut short keeps the
steps done: the JSON is written after each).
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def sh(cmd: list[str], log: str, timeout: int, env=None) -> tuple[int, str, float]:
    """Run ``cmd``, output to ``log``; (returncode, output, seconds)."""
    t0 = time.time()
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                           env=env)
        rc, out = p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        rc, out = 124, (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    dt = time.time() - t0
    with open(log, "w") as f:
        f.write(" ".join(cmd) + f"\n# rc={rc} {dt:.1f}s\n" + out)
    print(f"  {os.path.basename(log)}: rc={rc} {dt:.1f}s", flush=True)
    return rc, out, dt


TARGETS = ("llama-bench", "llama-batched-bench", "llamacpp_logits")



def log_dir(out: str) -> str:
    """Where a run's logs go: ``out`` itself, or on a device machine (``$OUT`` set: at most 8 of
    its files come back) a temporary folder that :func:`pack_logs` packs into ``out/logs.tgz``
    after every step, so that a run cut short still returns its JSON and every log."""
    if not os.environ.get("OUT"):
        return out
    import tempfile
    return tempfile.mkdtemp(prefix="side_by_side_logs_")


def save_at_exit(save) -> None:
    """Call ``save()`` (the results so far and the packed logs) once more as the process ends,
    however it ends: done, an error, Ctrl-C, or SIGTERM -- a ``timeout`` around the script, whose
    signal becomes a SystemExit here, so that the children in flight are killed by their
    ``subprocess`` calls and what the last step wrote into the logs comes back (a device call
    returns only what is under $OUT)."""
    import atexit
    import signal
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    atexit.register(save)


def pack_logs(logs: str, out: str) -> None:
    """``logs`` (a :func:`log_dir` other than ``out``) as ``out/logs.tgz``, written anew."""
    if os.path.abspath(logs) == os.path.abspath(out):
        return
    import tarfile
    tmp = os.path.join(out, "logs.tgz.part")
    with tarfile.open(tmp, "w:gz") as t:
        t.add(logs, arcname="logs")
    os.replace(tmp, os.path.join(out, "logs.tgz"))

def build(src: str, bdir: str, out: str, jobs: int, prebuilt: str = "", targets=TARGETS) -> str:
    """The folder with llama.cpp's binaries (``targets``: ``TARGETS``, or e.g. ``("llama-server",)``),
    built from ``src`` or unpacked from ``prebuilt``."""
    bin_dir = os.path.join(bdir, "build", "bin")
    if all(os.path.exists(os.path.join(bin_dir, t)) for t in targets):
        print("llama.cpp: built already", flush=True)
        return bin_dir
    os.makedirs(bin_dir, exist_ok=True)
    if prebuilt:
        subprocess.run(["tar", "xf", os.path.abspath(prebuilt), "-C", bin_dir], check=True)
        return bin_dir
    subprocess.run(["tar", "xzf", os.path.abspath(src)], cwd=bdir, check=True)
    cfg = ["cmake", "-S", bdir, "-B", os.path.join(bdir, "build"), "-DGGML_CUDA=ON",
           "-DCMAKE_CUDA_ARCHITECTURES=90", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
           "-DLLAMA_BUILD_EXAMPLES=OFF", f"-DLLAMA_BUILD_SERVER={'ON' if 'llama-server' in targets else 'OFF'}",
           "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DCMAKE_BUILD_RPATH=$ORIGIN"]
    rc, _, _ = sh(cfg, os.path.join(out, "lc_cmake.log"), 300)
    if rc:
        raise SystemExit("llama.cpp cmake failed (lc_cmake.log)")
    rc, _, _ = sh(["cmake", "--build", os.path.join(bdir, "build"), "-j", str(jobs), "--target",
                   *[t for t in targets if t != "llamacpp_logits"]], os.path.join(out, "lc_build.log"), 1500)
    if rc:
        raise SystemExit("llama.cpp build failed (lc_build.log)")
    if "llamacpp_logits" in targets:
        build_logits_tool(bdir, bin_dir, out)
    return bin_dir


def library_path(bins: str) -> str:
    """``LD_LIBRARY_PATH`` for llama.cpp's processes only: its own libraries next to its binaries,
    then CUDA's (a prebuilt llama.cpp finds cuBLAS there). Never for a process that imports ggml:
    llama.cpp's libggml-base.so would replace ggml-python's."""
    libs = [bins, "/usr/local/cuda/lib64", *sorted(glob.glob(os.path.join(
        os.path.dirname(os.__file__), "..", "python3*", "site-packages", "nvidia", "*", "lib")))]
    libs += sorted(glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages", "nvidia", "*", "lib")))
    return ":".join(libs + [os.environ.get("LD_LIBRARY_PATH", "")])


def build_logits_tool(src_dir: str, bin_dir: str, out: str) -> None:
    """tools/dev/llamacpp_logits.cpp against the build's shared libraries, into ``bin_dir``."""
    rc, _, _ = sh(["g++", "-O2", "-std=c++17", os.path.join(HERE, "llamacpp_logits.cpp"),
                   "-I", os.path.join(src_dir, "include"), "-I", os.path.join(src_dir, "ggml", "include"),
                   "-L", bin_dir, "-lllama", "-lggml", "-lggml-base", "-Wl,-rpath,$ORIGIN",
                   "-Wl,--allow-shlib-undefined", "-o", os.path.join(bin_dir, "llamacpp_logits")],
                  os.path.join(out, "lc_logits_build.log"), 300)
    if rc:
        raise SystemExit("building llamacpp_logits failed (lc_logits_build.log)")


def jsonl(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


def json_block(text: str) -> list[dict]:
    """The JSON array llama-bench ``-o json`` prints (other lines around it ignored)."""
    i, j = text.find("["), text.rfind("]")
    try:
        return json.loads(text[i:j + 1]) if 0 <= i < j else []
    except json.JSONDecodeError:
        return []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default=os.path.join(ROOT, ".lcpp", "src.tar.gz"), help="llama.cpp source tarball")
    ap.add_argument("--build", default="/tmp/lc", help="llama.cpp build folder (kept: built once)")
    ap.add_argument("--out", default=os.environ.get("OUT", "side_by_side_out"))
    ap.add_argument("--gguf", default="/tmp/m8b.gguf", help="the file both run (written if missing)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--prebuilt", default="", help="tarball of a llama.cpp build's bin/ (instead of building)")
    ap.add_argument("--skip", default="", help="comma list of steps to skip: bench,batched,ragged,load,logits,kvq")
    ap.add_argument("--quant", default="", help="comma list of llama-quantize types (Q4_K_M,Q5_K_M,Q6_K,Q8_0): "
                                              "each made from --gguf by llama.cpp's llama-quantize, then the load, "
                                              "bench and batched rows on it (step 'quant')")
    ap.add_argument("--npl", default="1,16,64",
                    help="llama-batched-bench -npl of the --quant files' batched rows (both tools), e.g. 1,16,32,64")
    ap.add_argument("--weights", default="auto",
                    help="comma list of GGML_ATTN_WEIGHTS forms ours runs each --quant file in (auto,blocks,f16): "
                         "a bench and batched row set per form, the form in each row's 'weights'")
    a = ap.parse_args(argv)
    quants = [q.strip() for q in a.quant.split(",") if q.strip()]
    os.makedirs(a.out, exist_ok=True)
    a.logs = log_dir(a.out)
    skip = set(filter(None, a.skip.split(",")))
    jobs = os.cpu_count() or 8
    writer = None
    if not os.path.exists(a.gguf):   # written while llama.cpp builds
        writer = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "fixtures_gguf.py"), a.gguf,
                                   "--preset", "llama-3-8b", "--vocab", "32000"],
                                  stdout=open(os.path.join(a.logs, "gguf.log"), "w"), stderr=subprocess.STDOUT)
    t0 = time.time()
    bins = build(a.src, a.build, a.logs, jobs, a.prebuilt,
                 targets=TARGETS + (("llama-quantize",) if quants and "quant" not in skip else ()))
    # llama.cpp's processes only: its libraries next to it ($ORIGIN) and cuBLAS; a process that
    # imports ggml (ours, the Python steps) must not see its libggml-base.so
    lc_env = dict(os.environ, LD_LIBRARY_PATH=library_path(bins))
    print(f"build: {time.time() - t0:.0f}s", flush=True)
    if writer is not None and writer.wait() != 0:
        raise SystemExit("writing the GGUF failed (gguf.log)")
    if a.build_only:
        return 0
    lb, lbb = os.path.join(bins, "llama-bench"), os.path.join(bins, "llama-batched-bench")
    ours_b, ours_bb = shutil.which("ggml-attn-bench"), shutil.which("ggml-attn-batched-bench")
    res: dict = {"gguf": a.gguf, "gpu": _gpu(), "date": time.strftime("%Y-%m-%d"),
                 "commit": os.environ.get("GGML_ATTN_COMMIT", ""), "rows": []}
    rows = res["rows"]
    out = a.out

    def save():   # after every step: a run cut short keeps what it measured
        with open(os.path.join(out, "side_by_side.json"), "w") as f:
            json.dump(res, f, indent=1)
        pack_logs(a.logs, out)
    save_at_exit(save)
    if "logits" not in skip:
        rc, _, _ = sh([sys.executable, os.path.join(HERE, "model_vs_llamacpp.py"), "--gguf", a.gguf, "--tool",
                       os.path.join(bins, "llamacpp_logits"), "--out", os.path.join(out, "model_vs_llamacpp.json")],
                      os.path.join(a.logs, "logits.log"), 400, env=dict(os.environ, LLAMACPP_LIBS=lc_env["LD_LIBRARY_PATH"]))
        try:
            res["logits"] = json.load(open(os.path.join(out, "model_vs_llamacpp.json")))
        except (OSError, ValueError):
            res["logits"] = dict(error=f"model_vs_llamacpp.py rc={rc} (logits.log)")
    save()
    if "load" not in skip:
        rows += load_rows(a, a.gguf, lbb, ours_bb, lc_env, "")
    save()
    if "bench" not in skip:
        _, t, _ = sh([lb, "-m", a.gguf, "-ngl", "99", "-fa", "1", "-p", "512", "-n", "128", "-r", str(a.reps),
                      "-o", "json"], os.path.join(a.logs, "lc_bench.log"), 300, env=lc_env)
        for r in json_block(t):
            rows.append(dict(tool="llama.cpp", case="bench", n_prompt=r.get("n_prompt"), n_gen=r.get("n_gen"),
                             ts=r.get("avg_ts"), ts_sd=r.get("stddev_ts")))
        _, t, _ = sh([ours_b, "--device", "cuda", "-m", a.gguf, "-p", "512", "-n", "128", "-r", str(a.reps),
                      "-o", "json"], os.path.join(a.logs, "ours_bench.log"), 400)
        for r in json_block(t):
            rows.append(dict(tool="ggml-attn", case="bench", n_prompt=r.get("n_prompt"), n_gen=r.get("n_gen"),
                             ts=r.get("avg_ts"), ts_sd=r.get("stddev_ts")))
    save()
    if "batched" not in skip:
        for kvu in (False, True):
            flag = ["-kvu"] if kvu else []
            _, t, _ = sh([lbb, "-m", a.gguf, "-ngl", "99", "-fa", "on", "-c", "40960", "-b", "2048", "-ub", "512",
                          "-npp", "128", "-ntg", "32", "-npl", "1,16,64", "--output-format", "jsonl"] + flag,
                         os.path.join(a.logs, f"lc_batched{'_kvu' if kvu else ''}.log"), 300, env=lc_env)
            rows += [dict(tool="llama.cpp", case="batched", kvu=kvu, **_bb(r)) for r in jsonl(t)]
            _, t, _ = sh([ours_bb, "--device", "cuda", "-m", a.gguf, "-c", "40960", "-npp", "128", "-ntg", "32",
                          "-npl", "1,16,64", "--warmup", "-r", str(a.reps), "-o", "jsonl"] + flag,
                         os.path.join(a.logs, f"ours_batched{'_kvu' if kvu else ''}.log"), 400)
            rows += [dict(tool="ggml-attn", case="batched", kvu=kvu, **_bb(r)) for r in jsonl(t)]
    save()
    if "ragged" not in skip:
        _, t, _ = sh([ours_bb, "--device", "cuda", "-m", a.gguf, "--prompt-dist", "16-200", "-npl", "64", "-ntg", "32",
                      "-kvu", "--split", "auto", "--warmup", "-r", str(a.reps), "-o", "jsonl"],
                     os.path.join(a.logs, "ours_ragged.log"), 400)
        ours = [dict(tool="ggml-attn", case="ragged", kvu=True, **_bb(r)) for r in jsonl(t)]
        rows += ours
        total = sum(ours[0].get("prompt_lens") or []) if ours else 64 * 108
        npp = max(1, math.ceil(total / 64))
        for kvu in (False, True):
            _, t, _ = sh([lbb, "-m", a.gguf, "-ngl", "99", "-fa", "on", "-c", "40960", "-b", "2048", "-ub", "512",
                          "-npp", str(npp), "-ntg", "32", "-npl", "64", "--output-format", "jsonl"]
                         + (["-kvu"] if kvu else []), os.path.join(a.logs, f"lc_ragged{'_kvu' if kvu else ''}.log"), 300, env=lc_env)
            rows += [dict(tool="llama.cpp", case="ragged-equal", kvu=kvu, **_bb(r)) for r in jsonl(t)]
    save()
    if "kvq" not in skip:   # a q8_0 KV cache against f16, 64 sequences of 4096 tokens (attention-heavy decode)
        for t in ("f16", "q8_0"):
            types = ["-ctk", t, "-ctv", t]
            _, out_t, _ = sh([lbb, "-m", a.gguf, "-ngl", "99", "-fa", "on", "-c", str(64 * (KVQ_NPP + 32)), "-b", "2048",
                              "-ub", "512", "-npp", str(KVQ_NPP), "-ntg", "32", "-npl", "64", "--output-format", "jsonl"]
                             + types, os.path.join(a.logs, f"lc_kvq_{t}.log"), 600, env=lc_env)
            rows += [dict(tool="llama.cpp", case=f"kv {t}", kvu=False, **_bb(r)) for r in jsonl(out_t)]
            save()
            _, out_t, _ = sh([ours_bb, "--device", "cuda", "-m", a.gguf, "-npp", str(KVQ_NPP), "-ntg", "32", "-npl", "64",
                              "-r", "1", "-o", "jsonl"] + types, os.path.join(a.logs, f"ours_kvq_{t}.log"), 600)
            rows += [dict(tool="ggml-attn", case=f"kv {t}", kvu=False, **_bb(r)) for r in jsonl(out_t)]
            save()
    if quants and "quant" not in skip:
        for q in quants:
            quant_rows(a, q, bins, lc_env, (lb, lbb, ours_b, ours_bb), rows)
            save()
    print(table(rows))
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table(rows) + "\n")
    return 0


def load_rows(a, path: str, lbb: str, ours_bb: str, lc_env: dict, sfx: str, **tag) -> list[dict]:
    """The load rows of ``path``: each tool's wall time for a one-token run (``-npp 8 -ntg 1``),
    ours twice -- the first compiling what the kernel cache lacks (a first run on a machine), the
    second (``cached``) reading it -- each ``-v`` (its log says where the time went: kernels,
    weights, process start to ready)."""
    one = ["-c", "512", "-npp", "8", "-ntg", "1", "-npl", "1"]
    _, _, dt = sh([lbb, "-m", path, "-ngl", "99", "-fa", "on"] + one, os.path.join(a.logs, f"lc_load{sfx}.log"), 300,
                  env=lc_env)
    rows = [dict(tool="llama.cpp", case="load", seconds=dt, **tag)]
    # Python's bytecode written where it can be: the device image writes none (no __pycache__, or
    # PYTHONDONTWRITEBYTECODE), so each of our runs compiled ~325 modules again, 0.93 of the cached
    # row's 3.7 s at 4191ed9 (bench/NOTES.md, twenty-seventh session) -- what an installed copy,
    # whose bytecode pip writes, never pays. The first row writes it, the cached one reads it.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = env.get("PYTHONPYCACHEPREFIX") or "/tmp/ggml-attn-pycache"
    for cached in (False, True):
        _, _, dt = sh([ours_bb, "--device", "cuda", "-m", path, "-v"] + one,
                      os.path.join(a.logs, f"ours_load{sfx}{'_cached' if cached else ''}.log"), 300, env=env)
        rows.append(dict(tool="ggml-attn", case="load", seconds=dt, cached=cached, **tag))
    return rows


def quant_rows(a, qtype: str, bins: str, lc_env: dict, tools, rows: list) -> None:
    """The load, llama-bench and llama-batched-bench rows of both on the ``qtype`` file that
    llama-quantize makes from ``a.gguf`` (kept beside it), each row with ``file`` and the weights'
    bytes (``weight_bytes``: the file's tensors) for the effective bandwidth (:func:`table`); the
    batched rows at ``a.npl`` sequences."""
    lb, lbb, ours_b, ours_bb = tools
    src = a.gguf
    path = f"{os.path.splitext(src)[0]}-{qtype}.gguf"
    if not os.path.exists(path):
        rc, _, _ = sh([os.path.join(bins, "llama-quantize"), src, path, qtype, str(os.cpu_count() or 8)],
                      os.path.join(a.logs, f"quantize_{qtype}.log"), 900, env=lc_env)
        if rc:
            rows.append(dict(tool="llama.cpp", case="quantize", file=qtype, error=f"rc={rc} (quantize_{qtype}.log)"))
            return
    from ggml_attn.cli.models import read_gguf
    tag = dict(file=qtype, weight_bytes=read_gguf(path).file_bytes)
    rows += load_rows(a, path, lbb, ours_bb, lc_env, f"_{qtype}", **tag)
    bench = ["-p", "512", "-n", "128", "-r", str(a.reps), "-o", "json"]
    _, t, _ = sh([lb, "-m", path, "-ngl", "99", "-fa", "1"] + bench, os.path.join(a.logs, f"lc_bench_{qtype}.log"), 400,
                 env=lc_env)
    rows += [dict(tool="llama.cpp", case="bench", n_prompt=r.get("n_prompt"), n_gen=r.get("n_gen"), ts=r.get("avg_ts"),
                  ts_sd=r.get("stddev_ts"), **tag) for r in json_block(t)]
    _, t, _ = sh([lbb, "-m", path, "-ngl", "99", "-fa", "on", "-c", "40960", "-b", "2048", "-ub", "512", "-npp", "128",
                  "-ntg", "32", "-npl", a.npl, "--output-format", "jsonl"],
                 os.path.join(a.logs, f"lc_batched_{qtype}.log"), 300, env=lc_env)
    rows += [dict(tool="llama.cpp", case="batched", kvu=False, **_bb(r), **tag) for r in jsonl(t)]
    for form in [w.strip() for w in a.weights.split(",") if w.strip()]:   # ours in each weight form
        env, sfx = dict(os.environ, GGML_ATTN_WEIGHTS=form), f"_{qtype}" + ("" if form == "auto" else f"_{form}")
        _, t, _ = sh([ours_b, "--device", "cuda", "-m", path] + bench, os.path.join(a.logs, f"ours_bench{sfx}.log"), 400,
                     env=env)
        rows += [dict(tool="ggml-attn", case="bench", n_prompt=r.get("n_prompt"), n_gen=r.get("n_gen"),
                      ts=r.get("avg_ts"), ts_sd=r.get("stddev_ts"), weights=form, **tag) for r in json_block(t)]
        _, t, _ = sh([ours_bb, "--device", "cuda", "-m", path, "-c", "40960", "-npp", "128", "-ntg", "32", "-npl", a.npl,
                      "--warmup", "-r", str(a.reps), "-o", "jsonl"], os.path.join(a.logs, f"ours_batched{sfx}.log"), 400,
                     env=env)
        rows += [dict(tool="ggml-attn", case="batched", kvu=False, weights=form, **_bb(r), **tag) for r in jsonl(t)]


KVQ_NPP = 4096   # the kvq step's prompt per sequence: 64 x 4128 cells, decode bound by K/V bytes


def _bb(r: dict) -> dict:
    keys = ("pp", "tg", "pl", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg", "prompt_lens", "split")
    return {k: r[k] for k in keys if k in r}


def _gpu() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.strip()
    except Exception:  # noqa: BLE001
        return ""


def table(rows: list[dict]) -> str:
    """One markdown table: each case with llama.cpp's number, ours, and ours / theirs."""
    def key(r):   # ours in a weight form other than auto: its own rows, against llama.cpp's on the file
        f = f"{r['file']}{'[' + r['weights'] + ']' if r.get('weights', 'auto') != 'auto' else ''} " if r.get("file") else ""
        if r["case"] == "bench":
            return (f + "bench", f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}")
        if r["case"] in ("batched",):
            return (f + "batched", f"B={r.get('pl')}{' -kvu' if r.get('kvu') else ''}")
        if r["case"].startswith("ragged"):
            return ("ragged", "64 x 16-200")
        return (f + r["case"], "cached" if r.get("cached") else "")
    best: dict = {}
    for r in rows:
        if "error" in r:
            continue
        k = key(r)
        slot = best.setdefault(k, {})
        if r["case"] == "load":
            slot[r["tool"]] = (r["seconds"], None)
        elif r["case"] == "bench":
            slot[r["tool"]] = (r["ts"], None)
        else:   # each column's best row (llama.cpp's equal-length rows with and without -kvu)
            old = slot.get(r["tool"], (0.0, 0.0))
            slot[r["tool"]] = (max(old[0], r.get("speed_pp") or 0.0), max(old[1], r.get("speed_tg") or 0.0))
    wbytes = {r["file"]: r["weight_bytes"] for r in rows if r.get("weight_bytes")}
    lines = ["| case | llama.cpp | ggml-attn | ours / theirs |", "|---|---:|---:|---:|"]
    for (case, what), slot in best.items():
        file, _, base = case.rpartition(" ")
        lc, us = slot.get("llama.cpp"), slot.get("ggml-attn")
        if lc is None and "[" in file:
            lc = best.get((file.split("[")[0] + " " + base, what), {}).get("llama.cpp")
        if base == "load":   # (ours with its kernels cached against llama.cpp's one load)
            lc = lc or best.get((case, ""), {}).get("llama.cpp")
            what = ", our kernels cached" if what == "cached" else ""
            lines.append(f"| {file} load time{what} (s) | {_f(lc and lc[0])} | {_f(us and us[0])} | "
                         f"{_r(us and us[0], lc and lc[0])} |".replace("|  load", "| load"))
        elif base == "bench":
            bw = ""
            wf = file.split("[")[0]
            if what.startswith("tg") and wf in wbytes:   # the file's weight bytes once per token
                bw = " (weights " + " / ".join(f"{_f(x and x[0] * wbytes[wf] / 1e9)}" for x in (lc, us)) + " GB/s)"
            lines.append(f"| {file + ' ' if file else ''}llama-bench {what} t/s{bw} | {_f(lc and lc[0])} | "
                         f"{_f(us and us[0])} | {_r(us and us[0], lc and lc[0])} |")
        else:
            for i, name in ((0, "S_PP"), (1, "S_TG")):
                a, b = lc and lc[i], us and us[i]
                lines.append(f"| {case} {what} {name} | {_f(a)} | {_f(b)} | {_r(b, a)} |")
    return "\n".join(lines)


def _f(x) -> str:
    return "-" if x is None else f"{x:,.1f}"


def _r(a, b) -> str:
    return "-" if not a or not b else f"{a / b:.2f}"


if __name__ == "__main__":
    sys.exit(main())
