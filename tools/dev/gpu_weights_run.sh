#!/usr/bin/env bash
# #43's and #45's device rows in one call, after tools/dev/gpu_check.sh has installed the package on
# the same machine (or with --install):
#   (--tests) the GPU tests of the weight path (tests/test_gpu_dense_q.py, test_model.py,
#      test_weight_form.py, test_graph_device.py) and compute-sanitizer memcheck / racecheck on
#      the block kernels (tools/dev/gpu_sanitize_case.py --dense-q) -> $OUT/logs/tests_weights.log (every log packed into $OUT/logs.tgz)
#   0. one 8B layer's projections over each block type: the GEMV at 1..16 tokens against the
#      4.2 TB/s floor, dequantize + cuBLAS and the tiled dense_gemm_q at 16..512
#      (tools/dev/gpu_dense_q_bench.py) -> $OUT/dense_q.json
#   1. llama.cpp and ours on the 8B-shaped F16 file and on the Q4_K_M / Q8_0 files llama.cpp's
#      llama-quantize makes from it (tools/dev/llamacpp_side_by_side.py --quant; carry
#      .lcpp/build-sm90.tar.xz, llama.cpp's bin/ built for sm_90): llama-bench pp512/tg128 and
#      llama-batched-bench rows of both, ours in each --weights form (GGML_ATTN_WEIGHTS, default
#      auto,f16) -> $OUT/side_by_side.json
#   2. graph.greedy's step with the library engine's CUDA-graph replay off and on, against the
#      CLI's step (tools/dev/gpu_greedy_time.py) on the Q4_K_M file -> $OUT/greedy.json
#   (--ab-vector) the 8-bit GEMV's vector form against the staged one end to end: tg128 of
#      ggml-attn-bench on 8B-shaped Q4_K_M and Q8_0 files written by tests/fixtures_gguf.py, each
#      form in its own process, alternating (tools/dev/knob_ab.py) -> $OUT/ab_vector_<ftype>.json
#   3. a 70B-shaped Q4_K_M file (tests/fixtures_gguf.py --preset llama-3-70b: 40 GB, which did not
#      fit one H200 while weights were dequantized to F16): ggml-attn-bench pp512/tg128 -> $OUT/m70.jsonl
#
# Steps in that order (--ab-vector, 0, 1, 3, 2): what a call cut at its limit finished comes back (each step
# writes its JSON as it goes).
#
#   tools/dev/gpu_weights_run.sh [--install] [--tests] [--ab-vector] [--quant Q4_K_M,Q8_0] [--npl 1,16,64] [--reps 3] [--skip-dense] [--skip-side]
#                                [--skip-greedy] [--skip-70b] [--weights auto,f16] [--types Q4_K,Q6_K,Q8_0]
#                                [--bench-args "--warps 8 --max-tokens 64"] (gpu_dense_q_bench.py's; "" for all its rows)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}; LOGS="$OUT/logs"; mkdir -p "$LOGS"
# The device tool returns at most 8 files from $OUT: the JSON results stay at its top, every log
# goes into $OUT/logs, packed into $OUT/logs.tgz when the script ends (a run cut short included).
trap 'tar czf "$OUT/logs.tgz" -C "$OUT" logs 2>/dev/null && rm -rf "$LOGS"' EXIT
PY=${PYTHON:-python3}
INSTALL=0; TESTS=0; ABV=0; DENSE=1; SIDE=1; GREEDY=1; M70=1; QUANT=Q4_K_M,Q8_0; NPL=1,16,64; REPS=3; FORMS=auto,f16; DTYPES=Q4_K,Q6_K,Q8_0; DARGS="--warps 8 --max-tokens 64"
while [ $# -gt 0 ]; do
  case "$1" in
    --install) INSTALL=1;; --tests) TESTS=1;; --ab-vector) ABV=1;; --skip-dense) DENSE=0;; --skip-side) SIDE=0;; --skip-greedy) GREEDY=0;; --skip-70b) M70=0;;
    --quant) QUANT="$2"; shift;; --npl) NPL="$2"; shift;; --reps) REPS="$2"; shift;; --weights) FORMS="$2"; shift;; --types) DTYPES="$2"; shift;; --bench-args) DARGS="$2"; shift;;
    *) echo "unknown option $1" >&2; exit 2;;
  esac
  shift
done
export PYTHONUNBUFFERED=1 GGML_ATTN_CACHE_DIR=${GGML_ATTN_CACHE_DIR:-/tmp/ggml-attn-cache}
status=0; t0=$(date +%s)
if [ $INSTALL = 1 ] || ! command -v ggml-attn-bench >/dev/null; then
  OUT="$LOGS" bash tools/dev/gpu_check.sh --no-precompile --no-tests --no-sanitize --no-bench --no-cli > "$LOGS/install_run.log" 2>&1 \
    || { echo "install failed"; tail -20 "$LOGS/install_run.log"; exit 1; }
fi
if [ $TESTS = 1 ]; then
  echo "== GPU tests of the weight path (block kernels, model logits in both forms, device graphs)"
  $PY -m pytest -m gpu -q -p no:cacheprovider -n "$(nproc)" tests/test_gpu_dense_q.py tests/test_model.py tests/test_weight_form.py \
      tests/test_graph_device.py > "$LOGS/tests_weights.log" 2>&1 || status=1
  grep -E "^(FAILED|ERROR)" "$LOGS/tests_weights.log" | head -30; tail -2 "$LOGS/tests_weights.log"
  bash tools/dev/gpu_sanitize_dense_q.sh "$LOGS" || status=1
  echo "   ($(( $(date +%s) - t0 ))s so far)"
fi
if [ $ABV = 1 ]; then
  echo "== the vector GEMV against the staged one, tg128 end to end"
  for ft in Q4_K_M Q8_0; do
    $PY tests/fixtures_gguf.py /tmp/ab-$ft.gguf --preset llama-3-8b --ftype $ft > "$LOGS/ab_write_$ft.log" 2>&1 \
      || { status=1; tail -5 "$LOGS/ab_write_$ft.log"; continue; }
    $PY tools/dev/knob_ab.py --rounds 2 --out "$OUT/ab_vector_$ft.json" --variant staged \
        --variant "vector:matmul_dispatch.Q8XV_TYPES=('Q4_K','Q5_K','Q6_K','Q8_0')" \
        bench --device cuda -m /tmp/ab-$ft.gguf -p 0 -n 128 -r 3 2>&1 | tail -6 || status=1
    rm -f /tmp/ab-$ft.gguf
  done
  echo "   ($(( $(date +%s) - t0 ))s so far)"
fi
if [ $DENSE = 1 ]; then
  echo "== block GEMV / GEMM (one 8B layer per type)"
  (cd tools/dev && $PY gpu_dense_q_bench.py --types "$DTYPES" $DARGS --out "$OUT/dense_q.json") 2>&1 | tail -90 || status=1
  echo "   ($(( $(date +%s) - t0 ))s so far)"
fi
if [ $SIDE = 1 ]; then
  echo "== llama.cpp side by side: F16, $QUANT"
  $PY tools/dev/llamacpp_side_by_side.py --prebuilt .lcpp/build-sm90.tar.xz --out "$LOGS/sbs" --gguf /tmp/m8b.gguf \
      --quant "$QUANT" --npl "$NPL" --weights "$FORMS" --reps "$REPS" --skip logits,ragged,kvq,batched,load 2>&1 | tail -30 || status=1
  cp "$LOGS/sbs/side_by_side.json" "$OUT/" 2>/dev/null || status=1
  echo "   ($(( $(date +%s) - t0 ))s so far)"
fi
if [ $M70 = 1 ]; then
  echo "== 70B-shaped Q4_K_M"
  rm -f /tmp/m8b.gguf /tmp/m8b-Q*_0.gguf /tmp/m8b-Q[5-6]_K*.gguf   # the disk holds 64 GB (Q4_K_M stays: greedy)
  $PY tests/fixtures_gguf.py /tmp/m70q.gguf --preset llama-3-70b --ftype Q4_K_M --vocab 32000 > "$LOGS/m70_write.log" 2>&1 \
    || { status=1; tail -5 "$LOGS/m70_write.log"; }
  echo "   written ($(( $(date +%s) - t0 ))s so far)"
  ggml-attn-bench --device cuda -m /tmp/m70q.gguf -p 512 -n 128 -r 2 -o jsonl > "$OUT/m70.jsonl" 2> "$LOGS/m70.log" \
    || { status=1; tail -5 "$LOGS/m70.log"; }
  cat "$OUT/m70.jsonl"; grep -iE "memory|GiB|weights" "$LOGS/m70.log" | head -5
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv
  rm -f /tmp/m70q.gguf
  echo "   ($(( $(date +%s) - t0 ))s so far)"
fi
if [ $GREEDY = 1 ] && [ -f /tmp/m8b-Q4_K_M.gguf ]; then
  echo "== greedy's step, engine replay off / on (Q4_K_M)"
  $PY tools/dev/gpu_greedy_time.py /tmp/m8b-Q4_K_M.gguf --out "$OUT/greedy.json" 2>&1 | tail -8 || status=1
  echo "   ($(( $(date +%s) - t0 ))s so far)"
fi
echo "== done in $(( $(date +%s) - t0 ))s, status $status"
exit $status
