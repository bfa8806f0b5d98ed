#!/usr/bin/env bash
# Multi-GPU check in one call: the 2-GPU tests, the N-GPU vs 1-GPU comparison of both modes
# (-sm row and -sm layer; JSON and a table), and ggml-attn-bench -sm row and -sm layer against
# -sm none on llama-3-70b-shaped layers (JSON and a table).
#
#   tools/gpu_multi_check.sh [N_GPU]      (default 2; writes under $OUT, default ./gpu_out:
#   multi_check.json / .log (both modes vs 1 GPU), multi_bench.json / .txt (t/s of none/row/layer))
#
# Install first as tools/gpu_check.sh does (or run it once with --no-tests --no-bench); CuPy needs
# NCCL (carry the nvidia-nccl-cu13 wheel in .whl/ when cupy.cuda.nccl.available is False).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
N=${1:-2}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
status=0
nvidia-smi topo -m > "$OUT/multi_topo.txt" 2>&1
echo "== multi-GPU tests"
$PY -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_multi.py -s > "$OUT/multi_tests.log" 2>&1 || status=1
tail -3 "$OUT/multi_tests.log"
echo "== $N GPUs vs 1 GPU, -sm row and -sm layer (NMSE, K/V slices, decode t/s)"
$PY -m ggml_attn.cli.gpu_multi_check --n-gpu "$N" --out "$OUT/multi_check.json" > "$OUT/multi_check.log" 2>&1 || status=1
tail -14 "$OUT/multi_check.log"
echo "== ggml-attn-bench llama-3-70b shape (8 layers), --layer full: -sm none vs -sm row vs -sm layer"
B=(-m llama-3-70b --n-layer 8 --layer full -p 512 -n 32 -r 3 -o jsonl)
$PY -m ggml_attn.cli.bench "${B[@]}" -sm none > "$OUT/multi_bench_1gpu.jsonl" 2> "$OUT/multi_bench_1gpu.err" || status=1
for SM in row layer; do
  $PY -m ggml_attn.cli.bench "${B[@]}" -sm $SM --n-gpu "$N" > "$OUT/multi_bench_${N}gpu_$SM.jsonl" \
    2> "$OUT/multi_bench_${N}gpu_$SM.err" || status=1
done
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
