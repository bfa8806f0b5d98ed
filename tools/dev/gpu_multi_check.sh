#!/usr/bin/env bash
# Multi-GPU check in one call: the 2-GPU tests, the N-GPU vs 1-GPU comparison of both modes
# (-sm row and -sm layer; JSON and a table), and ggml-attn-bench -sm row and -sm layer against
# -sm none on llama-3-70b-shaped layers (JSON and a table), and the llama-3-8B batched run of 64
# ragged prompts and their decode steps on 1 vs N GPUs, CUDA graphs on and off (multi_8b.json/.txt).
#
#   [MULTI_BENCH_ONLY=1] tools/dev/gpu_multi_check.sh [N_GPU]   (default 2; writes under $OUT, default ./gpu_out:
#   multi_check.json / .log (both modes vs 1 GPU), multi_bench.json / .txt (t/s of none/row/layer))
#
# Install first as tools/dev/gpu_check.sh does (or run it once with --no-tests --no-bench); CuPy needs
# NCCL (carry the nvidia-nccl-cu13 wheel in .whl/ when cupy.cuda.nccl.available is False).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
N=${1:-2}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
status=0
nvidia-smi topo -m > "$OUT/multi_topo.txt" 2>&1
if [ "${MULTI_BENCH_ONLY:-0}" != 1 ]; then   # MULTI_BENCH_ONLY=1: the benchmarks only
  echo "== multi-GPU tests"
  $PY -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_multi.py -s > "$OUT/multi_tests.log" 2>&1 || status=1
  tail -3 "$OUT/multi_tests.log"
  echo "== $N GPUs vs 1 GPU, -sm row and -sm layer (NMSE, K/V slices, decode t/s)"
  $PY tools/dev/gpu_multi_check.py --n-gpu "$N" --out "$OUT/multi_check.json" > "$OUT/multi_check.log" 2>&1 || status=1
  tail -14 "$OUT/multi_check.log"
fi
echo "== the CLI's rank engines with CUDA graphs vs without, and vs one GPU"
$PY tools/dev/gpu_multi_graphs_check.py --n-gpu "$N" > "$OUT/multi_graphs_check.json" 2> "$OUT/multi_graphs_check.err" || status=1
$PY -c "import json,sys; r=json.load(open(sys.argv[1])); print('ok' if r['ok'] else 'MISMATCH', {m: round(v['out_nmse_vs_one_gpu'], 9) for m, v in r['modes'].items()})" "$OUT/multi_graphs_check.json" || tail -5 "$OUT/multi_graphs_check.err"
echo "== ggml-attn-bench llama-3-70b shape (8 layers), --layer full: -sm none vs -sm row vs -sm layer"
B=(-m llama-3-70b --n-layer 8 --layer full -p 512 -n 32 -r 3 -o jsonl --cuda-graph off)  # same setting on both sides
$PY -m ggml_attn.cli.bench "${B[@]}" -sm none > "$OUT/multi_bench_1gpu.jsonl" 2> "$OUT/multi_bench_1gpu.err" || status=1
for SM in row layer; do
  $PY -m ggml_attn.cli.bench "${B[@]}" -sm $SM --n-gpu "$N" > "$OUT/multi_bench_${N}gpu_$SM.jsonl" \
    2> "$OUT/multi_bench_${N}gpu_$SM.err" || status=1
done
# llama-3-70B shapes, all 80 layers, on N GPUs (head-parallel): t/s and the time in NCCL
$PY -m ggml_attn.cli.bench -m llama-3-70b --layer full -p 512 -n 32 -r 1 -o jsonl -sm row --n-gpu "$N" \
  > "$OUT/multi_70b80_${N}gpu_row.jsonl" 2> "$OUT/multi_70b80_${N}gpu_row.err" || status=1
grep -h "avg_ts\|NCCL" "$OUT/multi_70b80_${N}gpu_row.jsonl" "$OUT/multi_70b80_${N}gpu_row.err" | cut -c1-400
# issue targets: llama-3-8B --layer full, 64 ragged prompts (prompt phase) and their decode steps,
# 1 GPU vs N GPUs, with and without CUDA graphs (the same setting on both sides); each row run once
# untimed first (--warmup: graph structures built and captured), then 3 timed repetitions
BB=(-m llama-3-8b --layer full --prompt-dist 16-200 -npl 64 -ntg 32 -kvu -r 3 --warmup -o jsonl)
for G in on off; do
  $PY -m ggml_attn.cli.batched_bench "${BB[@]}" --cuda-graph $G -sm none > "$OUT/multi_8b_1gpu_g$G.jsonl" \
    2> "$OUT/multi_8b_1gpu_g$G.err" || status=1
  for SM in row layer; do
    $PY -m ggml_attn.cli.batched_bench "${BB[@]}" --cuda-graph $G -sm $SM --n-gpu "$N" \
      > "$OUT/multi_8b_${N}gpu_${SM}_g$G.jsonl" 2> "$OUT/multi_8b_${N}gpu_${SM}_g$G.err" || status=1
  done
done
$PY - "$OUT" "$N" <<'PY' | tee "$OUT/multi_8b.txt"
import json, sys, pathlib
out, n = pathlib.Path(sys.argv[1]), sys.argv[2]
res = {}
for g in ("on", "off"):
    for tag in ("1gpu", f"{n}gpu_row", f"{n}gpu_layer"):
        f = out / f"multi_8b_{tag}_g{g}.jsonl"
        rows = [json.loads(l) for l in f.read_text().splitlines() if l.startswith("{")] if f.exists() else []
        e = out / f"multi_8b_{tag}_g{g}.err"
        nccl = [l for l in (e.read_text().splitlines() if e.exists() else []) if "NCCL" in l]
        res[f"{tag} graphs {g}"] = dict(s_pp=round(rows[0]["speed_pp"], 1) if rows else None,
                                        s_tg=round(rows[0]["speed_tg"], 1) if rows else None, nccl=nccl)
(out / "multi_8b.json").write_text(json.dumps(res, indent=1) + "\n")
print(f"{'llama-3-8B, 64 prompts 16-200 + 32 steps':<28} {'S_PP t/s':>10} {'x1':>5} {'S_TG t/s':>10} {'x1':>5}")
for k, r in res.items():
    base = res[f"1gpu graphs {k.split()[-1]}"]
    f = lambda a, b: (a or 0) / b if b else 0  # noqa: E731
    print(f"{k:<28} {r['s_pp'] or 0:>10.1f} {f(r['s_pp'], base['s_pp']):>5.2f} {r['s_tg'] or 0:>10.1f} "
          f"{f(r['s_tg'], base['s_tg']):>5.2f}")
PY
$PY - "$OUT" "$N" <<'PY' | tee "$OUT/multi_bench.txt"
import json, sys, pathlib
out, n = pathlib.Path(sys.argv[1]), sys.argv[2]
res = {}
for tag in ("1gpu", f"{n}gpu_row", f"{n}gpu_layer"):
    f = out / f"multi_bench_{tag}.jsonl"
    rows = [json.loads(l) for l in f.read_text().splitlines() if l.startswith("{")] if f.exists() else []
    res[tag] = {f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}": round(r["avg_ts"], 2) for r in rows}
    e = out / f"multi_bench_{tag}.err"
    res[tag + "_nccl"] = [l for l in (e.read_text().strip().splitlines() if e.exists() else []) if "NCCL" in l]
(out / "multi_bench.json").write_text(json.dumps(res, indent=1) + "\n")
print(json.dumps(res, indent=1))
base = res["1gpu"]
print(f"{'mode':<12} " + " ".join(f"{k + ' t/s':>12} {'x1':>5}" for k in base))
for tag in res:
    if tag.endswith("_nccl"):
        continue
    cells = [(res[tag].get(k), v) for k, v in base.items()]
    print(f"{tag:<12} " + " ".join(f"{(a or 0):>12.2f} {(a or 0) / v if v else 0:>5.2f}" for a, v in cells))
PY
exit $status
