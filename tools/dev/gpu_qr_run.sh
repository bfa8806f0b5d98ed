#!/usr/bin/env bash
# #43's staged block GEMMs at 16-64 tokens on the device, in one call (carry .whl/; GGML_ATTN_COMMIT set;
# an sm_90 GPU: dense_gemm_qrm's stages need its shared memory):
#   1. install (tools/dev/gpu_check.sh's); the Q4_K_M fixture written in the background
#   2. GPU tests of dense_gemm_qrm, dense_gemm_qrg, the fused split finish and qr's bit-for-bit test
#      (tests/test_gpu_dense_q.py -k "qrm or qrg or qr_equals or split_finish") -> $OUT/logs/tests_qr.log, and
#      the fixtures' logits against llama.cpp's with the three knobs on (tests/test_model.py -k qr-ab);
#      memcheck of the block kernels (gpu_sanitize_case.py --dense-q, qrm, qrg and the finish among them)
#   3. tools/dev/qr_probe.py: one 8B layer through dense_gemm_qr and dense_gemm_qrm (shipped and staging
#      only, Q4_K / Q6_K at 64 / 32 tokens), with --stagger the stagger A/Bs too (QR_STAGGER on qr at 64 / 16,
#      QW_STAGGER on qwh at 512 / 64) -> $OUT/probe_*.json; every program compiled first, all at once
#   3b. tools/dev/qrg_ab.py: an 8B layer's gate and up products and silu, as two dense_gemm_qr / qrm
#      launches + dense_silu_mul against one dense_gemm_qrg (Q4_K, Q6_K, Q8_0 at 16-128 tokens) -> $OUT/qrg_ab.json
#   4. batched S_TG (-npp 128 -ntg 32 -npl 16,32,64) on the Q4_K_M file, a ladder: base, + QRGEMM_ROWS 256,
#      + QR_GATED up to 128 tokens (shipped: up to 16), + QR_SPLIT_FINISH (knob_ab, 2 alternating rounds)
#      -> $OUT/ab_qrm.json
#   tools/dev/gpu_qr_run.sh [--no-install] [--no-tests] [--no-probes] [--no-qrg-ab] [--no-ab] [--no-sanitize] [--stagger] [--rounds N]
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/dev/gpu_run_lib.sh
INSTALL=1; TESTS=1; SAN=1; PROBES=1; QRG=1; AB=1; STAGGER=0; ROUNDS=2
while [ $# -gt 0 ]; do
  case "$1" in
    --no-install) INSTALL=0;; --no-tests) TESTS=0;; --no-probes) PROBES=0;; --no-qrg-ab) QRG=0;; --no-sanitize) SAN=0;; --no-ab) AB=0;; --stagger) STAGGER=1;;
    --rounds) ROUNDS=$2; shift;;
    *) echo "unknown option $1" >&2; exit 2;;
  esac
  shift
done
[ $INSTALL = 1 ] && gpu_install
WRITER=
if [ $AB = 1 ]; then
  $PY tests/fixtures_gguf.py /tmp/qr-q4km.gguf --preset llama-3-8b --ftype Q4_K_M > "$LOGS/write.log" 2>&1 &
  WRITER=$!
fi
RUNS=("--kernel dense_gemm_qr --types Q4_K,Q6_K --tokens 64,32 --probes 0,3"
      "--kernel dense_gemm_qrm --types Q4_K,Q6_K --tokens 64,32 --probes 0,3")
[ $STAGGER = 1 ] && RUNS+=("--kernel dense_gemm_qr --types Q4_K --tokens 64,16 --probes 0,3 --define QR_STAGGER=1"
                          "--kernel dense_gemm_qwh --types Q4_K --tokens 512,64 --probes 0,3 --define QW_STAGGER=1")
if [ $PROBES = 1 ] || [ $TESTS = 1 ] || [ $QRG = 1 ]; then
echo "== compile the probes' programs and dense_gemm_qrg's"
PIDS=()   # (not the fixture's writer: wait for the compiles only)
if [ $PROBES = 1 ]; then
  for r in "${RUNS[@]}"; do (cd tools/dev && $PY qr_probe.py $r --compile-only) > /dev/null 2>&1 & PIDS+=($!); done
fi
for t in 8 12 14; do $PY -c "from ggml_attn import kernels as K; a = K.device_arch()
for v in (K.dense_qrg_variant($t), K.qr_finish_variant(K.dense_qrg_variant($t)), K.qr_finish_variant(K.dense_qrm_variant($t)),
          K.qr_finish_variant(K.dense_q_variant($t)).shard_of('dense_gemm_qr<$t, 64>')): K.compile_variant(v, a)" \
    > /dev/null 2>&1 & PIDS+=($!); done
wait "${PIDS[@]}"
say
fi
if [ $TESTS = 1 ]; then
  echo "== GPU tests: dense_gemm_qrm, dense_gemm_qrg, qr / qrm against qs bit for bit; memcheck of the block kernels"
  timeout 200 $PY -m pytest -m gpu -q -p no:cacheprovider -n "$(nproc)" tests/test_gpu_dense_q.py -k "qrm or qrg or qr_equals or split_finish" \
      > "$LOGS/tests_qr.log" 2>&1 || status=1
  grep -E "^(FAILED|ERROR)" "$LOGS/tests_qr.log" | head -10; tail -1 "$LOGS/tests_qr.log"
  timeout 150 $PY -m pytest -m gpu -q -p no:cacheprovider -n 5 tests/test_model.py -k "qr-ab" \
      > "$LOGS/tests_model_qr.log" 2>&1 || status=1   # (the fixtures' logits with the three knobs on)
  grep -E "^(FAILED|ERROR)" "$LOGS/tests_model_qr.log" | head -10; tail -1 "$LOGS/tests_model_qr.log"
  if [ $SAN = 1 ]; then
    timeout 150 compute-sanitizer --tool memcheck --print-limit 20 $PY tools/dev/gpu_sanitize_case.py --dense-q \
        > "$LOGS/san_dense_q.log" 2>&1 || status=1
    grep -E "ERROR SUMMARY|FAIL" "$LOGS/san_dense_q.log" | head -5
  fi
  say
fi
if [ $PROBES = 1 ]; then
echo "== one 8B layer: qr against qrm, the stagger A/Bs"
i=0
for r in "${RUNS[@]}"; do
  (cd tools/dev && timeout 120 $PY qr_probe.py $r --out "$OUT/probe_$i.json") 2>&1 | grep -v Warning || status=1
  i=$((i + 1))
done
say
fi
if [ $QRG = 1 ]; then
echo "== the gated FFN's products: qr / qrm + silu against dense_gemm_qrg"
(cd tools/dev && timeout 120 $PY qrg_ab.py --out "$OUT/qrg_ab.json") 2>&1 | grep -v Warning || status=1
say
fi
if [ $AB = 1 ]; then
  wait $WRITER || { status=1; tail -3 "$LOGS/write.log"; }
  echo "== batched S_TG: base, + QRGEMM_ROWS 256, + QR_GATED, + QR_SPLIT_FINISH"
  $PY tools/dev/knob_ab.py --rounds "$ROUNDS" --out "$OUT/ab_qrm.json" --variant base \
      --variant qrm:matmul_dispatch.QRGEMM_ROWS=256 \
      --variant qrm_qrg:matmul_dispatch.QRGEMM_ROWS=256,matmul_dispatch.QR_GATED_MAX_TOKENS=128 \
      --variant qrm_qrg_fin:matmul_dispatch.QRGEMM_ROWS=256,matmul_dispatch.QR_GATED_MAX_TOKENS=128,matmul_dispatch.QR_SPLIT_FINISH=True \
      batched-bench --device cuda -m /tmp/qr-q4km.gguf \
      -c 40960 -npp 128 -ntg 32 -npl 16,32,64 2>&1 | tail -12 || status=1
  say
fi
echo "== done in $(( $(date +%s) - t0 ))s, status $status"
exit $status
