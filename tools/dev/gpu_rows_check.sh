#!/usr/bin/env bash
# #46's whole-rows decode (cuda/fattn_decode_rows.cu: decode_tma_shape's q8_0-rows / q4_0-rows) on
# the device, in one call (carry .whl/; an sm_90 GPU):
#   1. install (tools/dev/gpu_check.sh's), unless --no-install (after another script's in the same call)
#   2. GPU tests of every quantized decode-tma instance's cases on the whole-rows ones
#      (tests/test_gpu_quant_kv.py -k rows: ragged lengths, holes, masked tiles, the n_kv tail,
#      parts of many groups, 6 and 24 streams, NaN in hidden cells)
#   3. memcheck, racecheck and synccheck on gpu_sanitize_case.py --quant-kv with the whole-rows
#      instances beside the op's (DECODE_TMA_CONFIGS)
#   4. device time against f16 and the shipped instances (gpu_quant_kv_bench.py --configs) -> $OUT/qkv_rows.json
#   tools/dev/gpu_rows_check.sh [--no-install] [--no-tests] [--no-sanitize] [--no-bench]
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/dev/gpu_run_lib.sh
INSTALL=1; TESTS=1; SAN=1; BENCH=1
while [ $# -gt 0 ]; do
  case "$1" in
    --no-install) INSTALL=0;; --no-tests) TESTS=0;; --no-sanitize) SAN=0;; --no-bench) BENCH=0;;
    *) echo "unknown option $1" >&2; exit 2;;
  esac
  shift
done
[ $INSTALL = 1 ] && gpu_install
ROWS=q8_0-rows,q4_0-rows
if [ $TESTS = 1 ]; then
  echo "== GPU tests of the whole-rows instances"
  timeout 200 $PY -m pytest -m gpu -q -p no:cacheprovider -n 8 tests/test_gpu_quant_kv.py -k rows \
      > "$LOGS/tests_rows.log" 2>&1 || status=1
  grep -E "^(FAILED|ERROR)" "$LOGS/tests_rows.log" | head -10; tail -1 "$LOGS/tests_rows.log"
  say
fi
if [ $SAN = 1 ]; then
  for tool in memcheck racecheck synccheck; do
    DECODE_TMA_CONFIGS=$ROWS timeout 150 compute-sanitizer --tool $tool --error-exitcode 3 \
        $PY tools/dev/gpu_sanitize_case.py --quant-kv > "$LOGS/sanitize_rows_$tool.log" 2>&1
    rc=$?; [ $rc = 0 ] || status=1
    echo "   $tool rc=$rc: $(grep -c ' ok$' "$LOGS/sanitize_rows_$tool.log") ok, $(grep -c FAIL "$LOGS/sanitize_rows_$tool.log") FAIL"
    grep -E "ERROR SUMMARY|========= (Invalid|Race|Barrier)" "$LOGS/sanitize_rows_$tool.log" | head -3
  done
  say
fi
if [ $BENCH = 1 ]; then
  echo "== device time: whole rows against f16 and the shipped instances"
  timeout 200 $PY tools/dev/gpu_quant_kv_bench.py --configs $ROWS,q8_0-scratch,q4_0-scratch --out "$OUT/qkv_rows.json" \
      2>&1 | tail -24 || status=1
  say
fi
echo "== done in $(( $(date +%s) - t0 ))s, status $status"
exit $status
