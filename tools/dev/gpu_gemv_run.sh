#!/usr/bin/env bash
# #43's one-token GEMV on the device, in one call (carry .whl/; GGML_ATTN_COMMIT set):
#   1. install (tools/dev/gpu_check.sh's), then the GPU tests of the block matmuls, the model's
#      logits (every form of the 8-bit GEMV) and the device form's ops (TEST_K: a pytest -k
#      expression, default all of tests/test_gpu_dense_q.py, tests/test_model.py and
#      tests/test_model_device_form.py) -> $OUT/logs/tests_gemv.log, and compute-sanitizer
#      memcheck / racecheck on the block kernels (gpu_sanitize_case.py --dense-q)
#   2. ncu of the 8B gate matrix through each 8-bit GEMV form and F16's GEMV
#      (gpu_profile_case.py gemv-q8x) -> $OUT/logs/ncu_gemv.log, its summary printed
#   2b. one 8B layer through each 8-bit GEMV form at 1-4 tokens, and each matrix alone
#      (gpu_dense_q_bench.py --q8x-only, GEMV_TYPES: default Q4_K,Q5_K,Q6_K,Q8_0) -> $OUT/dense_q.json
#   3. where a one-token step's device time goes, kernel by kernel: ncu's durations of
#      ggml-attn-bench -p 0 -n 16 on an 8B-shaped Q4_K_M file (tests/fixtures_gguf.py)
#      (tools/dev/ncu_kernel_table.py) -> $OUT/step.json, and under STEP_VARIANT (a knob_ab
#      variant; default the A/B's "fused", where AB_VARIANTS has one) -> $OUT/step-<name>.json
#   4. tg128 with the shipped GEMV routing against each of AB_VARIANTS (knob_ab --variant
#      arguments, ';'-separated; default: no type through the one-operand instances, a check that
#      GEMV_ONE_TYPES still wins; "fused:matmul_dispatch.GEMV_QUANT_OUT=True" the GEMVs writing
#      their outputs' 8-bit form, -16% at 695471d; tools/dev/knob_ab.py, 2 alternating rounds)
#      -> $OUT/ab_gemv.json
#   5. (--qr) the tiled GEMMs at 16-64 tokens (gpu_dense_q_bench.py --tiled-only) -> $OUT/dense_qr.json
#   6. (--qw) the wgmma block GEMM (cuda/dense_qw.cu, sm_90): its GPU tests (-k qw) -> $OUT/logs/tests_qw.log,
#      memcheck / racecheck (gpu_sanitize_case.py --dense-qw), one 8B layer at 512 / 128 / 256
#      tokens against dense_gemm_qr, dequantize + cuBLAS and cuBLAS alone (QW_TYPES: default Q4_K,Q6_K)
#      -> $OUT/dense_qw.json, and pp512 on the Q4_K_M file shipped / qw / qw2 / their half-precision
#      decode qwh / qw2h (knob_ab) -> $OUT/ab_pp512.json
#   7. (--split) dense_gemm_qr's small matrices' split (gemm_tiles.GEMMQR_MIN_SPLIT, shipped 256, against
#      512 / 1024): one 8B layer at 64 / 16 tokens (every qr form and split) -> $OUT/dense_split.json, batched
#      B=16 / 64 S_TG shipped / ms512 / ms1024 (knob_ab) -> $OUT/ab_split.json
#   8. (--deq) path gemm (graph/path_gemm.py): GPU tests (test_gpu_dense_q.py -k dequant) -> $OUT/logs/tests_deq.log;
#      the dequantization alone on one 8B layer of every block type at 512 tokens -> $OUT/dense_deq_types.json;
#      Q4_K / Q6_K layers at 512 / 128 tokens, alone, with cuBLAS, cuBLAS alone -> $OUT/dense_deq.json; and last
#      of all (the numbers first where a call is cut) memcheck of the block kernels (gpu_sanitize_case.py --dense-q)
#   (--deq runs first, then --split, then --qw.)
# Steps in the order 8, 7, 6, 1, 2b, 4, 3, 2 (what a call cut at its limit finished comes back: each
# step writes as it goes); logs packed into $OUT/logs.tgz at the end.
#   tools/dev/gpu_gemv_run.sh [--no-install] [--no-tests] [--no-ncu] [--no-dense] [--no-step] [--no-ab] [--qr] [--qw] [--split] [--deq] [--rounds 2]
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/dev/gpu_run_lib.sh
INSTALL=1; TESTS=1; NCU=1; DENSE=1; STEP=1; AB=1; QR=0; QW=0; SPLIT=0; DEQ=0; ROUNDS=2
NO_ONE="matmul_dispatch.GEMV_ONE_TYPES=()"
AB_VARIANTS=${AB_VARIANTS-"no-one:$NO_ONE"}
while [ $# -gt 0 ]; do
  case "$1" in
    --no-install) INSTALL=0;; --no-tests) TESTS=0;; --no-ncu) NCU=0;; --no-dense) DENSE=0;; --no-step) STEP=0;; --no-ab) AB=0;; --qr) QR=1;; --qw) QW=1;; --split) SPLIT=1;; --deq) DEQ=1;; --rounds) ROUNDS="$2"; shift;;
    *) echo "unknown option $1" >&2; exit 2;;
  esac
  shift
done
[ -n "$AB_VARIANTS" ] || AB=0   # (nothing to compare the shipped routing with)
[ $INSTALL = 1 ] && gpu_install
WRITER=
wait_writer() {   # the Q4_K_M file written in the background, once (a failure printed and counted)
  [ -z "$WRITER" ] || wait $WRITER || { status=1; tail -3 "$LOGS/write.log"; }
  WRITER=
}
if [ $STEP = 1 ] || [ $AB = 1 ] || [ $QW = 1 ] || [ $SPLIT = 1 ]; then   # (the file, written while the GPU works)
  $PY tests/fixtures_gguf.py /tmp/gemv-q4km.gguf --preset llama-3-8b --ftype Q4_K_M > "$LOGS/write.log" 2>&1 &
  WRITER=$!
fi
if [ $DEQ = 1 ]; then
  echo "== path gemm: tests, one 8B layer (its memcheck last)"
  timeout 150 $PY -m pytest -m gpu -q -p no:cacheprovider -n "$(nproc)" tests/test_gpu_dense_q.py -k dequant \
      > "$LOGS/tests_deq.log" 2>&1 || status=1
  grep -E "^(FAILED|ERROR)" "$LOGS/tests_deq.log" | head -10; tail -1 "$LOGS/tests_deq.log"
  (cd tools/dev && timeout 150 $PY gpu_dense_q_bench.py --types Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,Q2_K,Q3_K,Q4_K,Q5_K,Q6_K \
      --dequant-only 512 --dequant-alone --out "$OUT/dense_deq_types.json") 2>&1 | tee "$LOGS/dense_deq_types.log" \
      | grep -E "n_tok=|Error" || status=1
  (cd tools/dev && timeout 200 $PY gpu_dense_q_bench.py --types Q4_K,Q6_K --dequant-only 512,128 --out "$OUT/dense_deq.json") \
      2>&1 | tee "$LOGS/dense_deq.log" | grep -E "n_tok=|Error" || status=1
  say
fi
if [ $SPLIT = 1 ]; then
  echo "== dense_gemm_qr's small matrices' split: one 8B layer, batched S_TG"
  (cd tools/dev && timeout 90 $PY gpu_dense_q_bench.py --types Q4_K,Q6_K --tiled-only 64,16 --out "$OUT/dense_split.json") \
      2>&1 | tee "$LOGS/dense_split.log" | grep -E "gemm_qr|cublas f16|Error" || status=1
  wait_writer
  timeout 150 $PY tools/dev/knob_ab.py --rounds "$ROUNDS" --out "$OUT/ab_split.json" --variant shipped \
      --variant "ms512:gemm_tiles.GEMMQR_MIN_SPLIT=512" --variant "ms1024:gemm_tiles.GEMMQR_MIN_SPLIT=1024" \
      batched-bench --device cuda -m /tmp/gemv-q4km.gguf -c 16384 -npp 128 -ntg 32 -npl 16,64 2>&1 | tail -7 || status=1
  say
fi
if [ $QW = 1 ]; then
  echo "== the wgmma block GEMM: tests, sanitizers, one 8B layer, pp512"
  timeout 150 $PY -m pytest -m gpu -q -p no:cacheprovider -n "$(nproc)" tests/test_gpu_dense_q.py -k qw \
      > "$LOGS/tests_qw.log" 2>&1 || status=1
  grep -E "^(FAILED|ERROR)" "$LOGS/tests_qw.log" | head -10; tail -1 "$LOGS/tests_qw.log"
  for t in memcheck racecheck; do
    timeout 120 compute-sanitizer --tool $t --error-exitcode 1 $PY tools/dev/gpu_sanitize_case.py --dense-qw \
        > "$LOGS/san_qw_$t.log" 2>&1 || { status=1; echo "$t: see logs/san_qw_$t.log"; }
    tail -1 "$LOGS/san_qw_$t.log"
  done
  (cd tools/dev && timeout 240 $PY gpu_dense_q_bench.py --types "${QW_TYPES:-Q4_K,Q6_K}" --tiled-only 512,128,256,64,16 \
      --out "$OUT/dense_qw.json") 2>&1 | grep -E "gemm_qw|gemm_qr |dequant|cublas f16" || status=1
  wait_writer
  timeout 200 $PY tools/dev/knob_ab.py --rounds "$ROUNDS" --out "$OUT/ab_pp512.json" --variant shipped \
      --variant "qw:matmul_dispatch.QWGEMM_MIN_TOKENS=129" \
      --variant "qw2:matmul_dispatch.QWGEMM_MIN_TOKENS=129,matmul_dispatch.QWGEMM_ROWS=256" \
      --variant "qwh:matmul_dispatch.QWGEMM_MIN_TOKENS=129,matmul_dispatch.QWGEMM_HALF=True" \
      --variant "qw2h:matmul_dispatch.QWGEMM_MIN_TOKENS=129,matmul_dispatch.QWGEMM_ROWS=256,matmul_dispatch.QWGEMM_HALF=True" \
      bench --device cuda -m /tmp/gemv-q4km.gguf -p 512 -n 0 -r 3 2>&1 | tail -6 || status=1
  say
fi
if [ $TESTS = 1 ]; then
  echo "== GPU tests: the block matmuls (every 8-bit GEMV form, with PDL), the models' logits, the device form's ops; sanitizers on the block kernels"
  $PY -m pytest -m gpu -q -p no:cacheprovider -n "$(nproc)" tests/test_gpu_dense_q.py tests/test_model.py \
      tests/test_model_device_form.py ${TEST_K:+-k "$TEST_K"} > "$LOGS/tests_gemv.log" 2>&1 || status=1
  grep -E "^(FAILED|ERROR)" "$LOGS/tests_gemv.log" | head -20; tail -1 "$LOGS/tests_gemv.log"
  bash tools/dev/gpu_sanitize_dense_q.sh "$LOGS" || status=1
  say
fi
if [ $DENSE = 1 ]; then
  echo "== one 8B layer through each 8-bit GEMV form"
  (cd tools/dev && $PY gpu_dense_q_bench.py --types "${GEMV_TYPES:-Q4_K,Q5_K,Q6_K,Q8_0}" --q8x-only --out "$OUT/dense_q.json") 2>&1 \
      | grep -E "n_tok=  1|wg alone|wd alone|wq alone" | sed -n 1,60p || status=1   # (sed reads it all: no SIGPIPE)
  say
fi
if [ $STEP = 1 ] || [ $AB = 1 ]; then
  wait_writer
fi
if [ $AB = 1 ]; then
  echo "== tg128: the 8-bit GEMV as shipped / AB_VARIANTS"
  VARIANTS=(--variant shipped)
  IFS=';' read -ra EXTRA <<< "$AB_VARIANTS"
  for v in "${EXTRA[@]}"; do [ -n "$v" ] && VARIANTS+=(--variant "$v"); done
  $PY tools/dev/knob_ab.py --rounds "$ROUNDS" --out "$OUT/ab_gemv.json" "${VARIANTS[@]}" \
      bench --device cuda -m /tmp/gemv-q4km.gguf -p 0 -n 128 -r 3 2>&1 | tail -6 || status=1
  say
fi
if [ $STEP = 1 ]; then
  # as shipped, then under STEP_VARIANT (a knob_ab --variant; default the A/B's "fused", if any)
  STEP_VARIANT=${STEP_VARIANT-$(tr ';' '\n' <<< "$AB_VARIANTS" | grep '^fused:' || true)}
  for v in shipped ${STEP_VARIANT:+"$STEP_VARIANT"}; do
    tag=${v%%:*}; sfx=$([ "$tag" = shipped ] || echo "-$tag")
    echo "== one-token steps kernel by kernel (Q4_K_M, -p 0 -n 16): $tag"
    ncu --csv --cache-control none --clock-control none --metrics gpu__time_duration.sum \
        $PY -c "$($PY tools/dev/knob_ab.py --code --variant "$v" bench)" --device cuda -m /tmp/gemv-q4km.gguf \
        -p 0 -n 16 -r 1 > "$LOGS/step$sfx.csv" 2> "$LOGS/step$sfx.err" || status=1
    $PY tools/dev/ncu_kernel_table.py "$LOGS/step$sfx.csv" --json "$OUT/step$sfx.json" --top 30 \
        || { status=1; tail -5 "$LOGS/step$sfx.err"; }
  done
  say
fi
if [ $NCU = 1 ]; then
  echo "== ncu: the gate matrix through each 8-bit GEMV form, then F16's GEMV"
  ncu --clock-control none $($PY tools/dev/gpu_profile_case.py --ncu-args gemv-q8x) --section SpeedOfLight --section Occupancy \
      --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis --section SchedulerStats \
      $PY tools/dev/gpu_profile_case.py gemv-q8x > "$LOGS/ncu_gemv.log" 2>&1 || status=1
  grep -E "dense_gemv|Duration|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Warp Cycles Per Issued|Issued Ipc|L2 Hit|No Eligible|Block Limit Reg|Waves Per SM" \
      "$LOGS/ncu_gemv.log" | head -100; say
fi
if [ $QR = 1 ]; then
  echo "== the tiled GEMMs at 16-64 tokens"
  (cd tools/dev && $PY gpu_dense_q_bench.py --types Q4_K,Q6_K,Q8_0 --tiled-only 16,32,64 --out "$OUT/dense_qr.json") 2>&1 | tail -40 || status=1
  say
fi
if [ $DEQ = 1 ]; then   # (after the other steps: the numbers first where the call is short)
  echo "== memcheck of the block kernels (the dequantizations among them)"
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 1 $PY tools/dev/gpu_sanitize_case.py --dense-q \
      > "$LOGS/san_deq_memcheck.log" 2>&1 || { status=1; echo "memcheck: see logs/san_deq_memcheck.log"; }
  grep -E "^dequant|ERROR SUMMARY" "$LOGS/san_deq_memcheck.log" | head -12
fi
rm -f /tmp/gemv-q4km.gguf
echo "== done in $(( $(date +%s) - t0 ))s, status $status"
exit $status
