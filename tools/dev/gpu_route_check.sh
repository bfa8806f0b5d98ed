#!/usr/bin/env bash
# The twenty-seventh session's routing changes on the device, in one call (carry .whl/; GGML_ATTN_COMMIT set;
# an sm_90 GPU):
#   1. install (tools/dev/gpu_check.sh's); the 8B-shaped Q4_K_M file written in the background
#   2. GPU tests: dense_gemm_qrg (9-128 tokens, every GEMMQR type), the sm_90a prefill's instances
#      (-k wgmma: the routed f16 instance pp-persistent-qtma-lazy-otma among them), and the model
#      forms that run dense_gemm_qrg, logits against llama.cpp's (tests/test_model.py: the shipped
#      "blocks" form's 16-token ubatches, "blocks-qr-ab" up to 128 tokens)
#   3. batched S_TG on the Q4_K_M file at B=16 (16-token steps): QR_GATED as shipped against off
#      (knob_ab, --rounds alternating rounds) -> $OUT/ab_qrg16.json
#   4. where a cached one-token CLI run's host seconds go (tools/dev/cli_profile.py, the load row's
#      command, bytecode kept as llamacpp_side_by_side.py keeps it) -> $OUT/load{1,2}/
#   tools/dev/gpu_route_check.sh [--no-install] [--no-tests] [--no-ab] [--no-load] [--rounds N] [-k EXPR]
#   (-k: the kernel tests' selection, default "qrg or wgmma")
set -uo pipefail
cd "$(dirname "$0")/../.."
. tools/dev/gpu_run_lib.sh
INSTALL=1; TESTS=1; AB=1; LOAD=1; ROUNDS=2; KSEL="qrg or wgmma"
while [ $# -gt 0 ]; do
  case "$1" in
    --no-install) INSTALL=0;; --no-tests) TESTS=0;; --no-ab) AB=0;; --no-load) LOAD=0;;
    --rounds) ROUNDS=$2; shift;;
    -k) KSEL=$2; shift;;
    *) echo "unknown option $1" >&2; exit 2;;
  esac
  shift
done
[ $INSTALL = 1 ] && gpu_install
M=/tmp/route-q4km.gguf
WRITER=
if [ $AB = 1 ] || [ $LOAD = 1 ]; then
  [ -f $M ] || { $PY tests/fixtures_gguf.py $M --preset llama-3-8b --ftype Q4_K_M > "$LOGS/write.log" 2>&1 & WRITER=$!; }
fi
if [ $TESTS = 1 ]; then
  echo "== GPU tests: dense_gemm_qrg, the sm_90a prefill's instances, the models' logits"
  timeout 240 $PY -m pytest -m gpu -q -p no:cacheprovider -n "$(nproc)" tests/test_gpu_dense_q.py tests/test_gpu_hopper.py \
      -k "$KSEL" > "$LOGS/tests_kernels.log" 2>&1 || status=1
  grep -E "^(FAILED|ERROR)" "$LOGS/tests_kernels.log" | head -10; tail -1 "$LOGS/tests_kernels.log"
  timeout 150 $PY -m pytest -m gpu -q -p no:cacheprovider -n 9 tests/test_model.py -k "blocks and not q8x and not gemm" \
      > "$LOGS/tests_model.log" 2>&1 || status=1
  grep -E "^(FAILED|ERROR)" "$LOGS/tests_model.log" | head -10; tail -1 "$LOGS/tests_model.log"
  say
fi
[ -n "$WRITER" ] && { wait $WRITER || { status=1; tail -3 "$LOGS/write.log"; }; }
if [ $AB = 1 ]; then
  echo "== batched S_TG at B=16: QR_GATED (shipped) against off"
  $PY tools/dev/knob_ab.py --rounds "$ROUNDS" --out "$OUT/ab_qrg16.json" --variant qrg \
      --variant off:matmul_dispatch.QR_GATED=False \
      batched-bench --device cuda -m $M -c 8192 -npp 128 -ntg 32 -npl 16 --warmup 2>&1 | tail -6 || status=1
  say
fi
if [ $LOAD = 1 ]; then
  echo "== a cached one-token run's host seconds"
  export PYTHONPYCACHEPREFIX=/tmp/ggml-attn-pycache; unset PYTHONDONTWRITEBYTECODE
  A="--device cuda -m $M -v -c 512 -npp 8 -ntg 1 -npl 1"
  for n in 1 2; do timeout 60 $PY tools/dev/cli_profile.py --out "$OUT/load$n" -- batched-bench $A 2>&1 | tail -3; done
  say
fi
echo "== done in $(( $(date +%s) - t0 ))s, status $status"
exit $status
