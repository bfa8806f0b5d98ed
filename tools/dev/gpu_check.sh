#!/usr/bin/env bash
# One command for every GPU run: install, GPU tests, compute-sanitizer, benchmark.
#
#   tools/dev/gpu_check.sh [--quick] [--no-precompile] [--no-tests] [--no-sanitize] [--no-bench] [--no-cli] [--no-ggml] [--llamacpp] [--crossover] [--profile]
#                      [--profile-case CASE] [--ab-prompt] [--quant-kv] [--grid-sample N] [--only CASE[,CASE...]]
#                      [--san-case ARG] [--ws-ab KEY[,KEY...]] [-- extra pytest args]
#
# --san-case ARG: the sanitizers on a part of tools/dev/gpu_sanitize_case.py's cases (--wgmma,
# --quant-kv, --dense-q) instead of all of them.
#
# --ws-ab KEYS: the sm_90a prefill's A/B (wgmma_shape.WS_CONFIGS keys, tools/dev/gpu_bench.py's
# WS_AB) on the causal and ragged prefill rows; $OUT/<date>-<commit>-ws-ab.json.
#
# --quant-kv: #32's rows, q8_0/q4_0 K/V against f16 (tools/dev/gpu_quant_kv_bench.py), every
# quantized decode-tma instance as an A/B row; $OUT/<date>-<commit>-quant-kv.json.
#
# --profile: ncu on tools/dev/gpu_profile_case.py's "masked" case (the mma.sync prefill);
# --profile-case CASE: on another of its cases ("wgmma": the sm_90a prefill; WGMMA_CONFIG).
#
# --llamacpp: llama.cpp and ours on one 8B-shaped F16 GGUF (tools/dev/llamacpp_side_by_side.py; carry
# .lcpp/src.tar.gz, llama.cpp's source tree: the vendor/llama.cpp of the llama-cpp-python sdist);
# $OUT/side_by_side.json and a table. The GPU tests include the model's logits against llama.cpp's
# (tests/test_model.py, gpu-marked).
#
# --ab-prompt: the 8B batched bench's prompt phase with whole-cache prompt ubatches against the
# coarse n_kv of before (tools/dev/knob_ab.py, 2 alternating rounds; $OUT/ab-prompt.json).
#
# --no-ggml: ggml-python not installed -- only on a machine that already has it (ggml_attn imports it:
# on a fresh machine every test module fails to import).
#
# Carry .whl/ (ggml-python's sdist: pip download --no-deps --no-binary :all: -d .whl
# ggml-python==0.0.45; the wheels of gguf and of its build backend, scikit-build-core and
# pathspec: the device image's own did not import on 2026-12-04) with the device tool. Set
# GGML_ATTN_COMMIT: the device's copy of the tree may not know the commit.
#
# Writes logs and bench/results/<date>-<commit>.json under $OUT (default ./gpu_out) and
# prints a short table last. --quick: sampled conformance grid, short benchmark.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
PRE=1; TESTS=1; SAN=1; BENCH=1; CLI=1; GGML=1; LCPP=0; XOVER=0; PROF=0; PCASE=masked; QUICK=0; ABP=0; QKV=0; SAMPLE=""; ONLY=""; EXTRA=()
SANCASE=""; WSAB=""
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1;;
    --no-tests) TESTS=0;;
    --no-sanitize) SAN=0;;
    --no-bench) BENCH=0;;
    --no-cli) CLI=0;;
    --no-precompile) PRE=0;;
    --llamacpp) LCPP=1;;
    --no-ggml) GGML=0;;
    --crossover) XOVER=1;;
    --profile) PROF=1;;
    --profile-case) PROF=1; PCASE="$2"; shift;;
    --ab-prompt) ABP=1;;
    --quant-kv) QKV=1;;
    --grid-sample) SAMPLE="$2"; shift;;
    --only) ONLY="$2"; shift;;
    --san-case) SANCASE="$2"; shift;;
    --ws-ab) WSAB="$2"; shift;;
    --) shift; EXTRA=("$@"); break;;
    *) echo "unknown option $1" >&2; exit 2;;
  esac
  shift
done
export PYTHONUNBUFFERED=1
export GGML_ATTN_CACHE_DIR=${GGML_ATTN_CACHE_DIR:-/tmp/ggml-attn-cache}
PY=${PYTHON:-python3}
status=0
t0=$(date +%s)
echo "== install" | tee "$OUT/install.log"
# wheels the device image lacks (gguf for the CLI test modules, ggml-python's build backend;
# setuptools >= 77 for pyproject's SPDX license when the image's is older), carried in .whl/ and
# installed first:
#   pip download --no-deps --only-binary=:all: -d .whl gguf scikit-build-core pathspec "setuptools>=77"
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps .whl/*.whl >>"$OUT/install.log" 2>&1 || echo "wheel install failed (see install.log)"
fi
if [ $GGML = 1 ] && ls .whl/ggml_python-0.0.45.tar.gz >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-build-isolation --no-deps .whl/ggml_python-0.0.45.tar.gz >>"$OUT/install.log" 2>&1 \
    || echo "ggml-python install failed (see install.log)"
fi
if ! $PY -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" 2>/dev/null; then
  echo "setuptools $($PY -c 'import setuptools; print(setuptools.__version__)' 2>/dev/null) is older than 77 (pyproject's SPDX license): carry a setuptools wheel in .whl/" | tee -a "$OUT/install.log"
fi
$PY -m pip install -q --no-build-isolation --no-deps -e . >>"$OUT/install.log" 2>&1 || { echo "install failed"; tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee -a "$OUT/install.log"
if [ $PRE = 1 ]; then
  echo "== precompile"
  $PY tools/dev/gpu_precompile.py -j "$(nproc)" 2>&1 | tee "$OUT/precompile.log" | tail -3
fi
echo "   ($(( $(date +%s) - t0 ))s so far)"

if [ $TESTS = 1 ]; then
  echo "== GPU tests"
  args=(-m gpu -q -p no:cacheprovider -n "$(nproc)" tests/)  # every gpu-marked test: kernels, device graphs, CLI
  [ -n "$SAMPLE" ] && args+=(--grid-sample "$SAMPLE")
  [ $QUICK = 1 ] && [ -z "$SAMPLE" ] && args+=(--grid-sample 300)
  $PY -m pytest "${args[@]}" "${EXTRA[@]}" > "$OUT/tests.log" 2>&1
  rc=$?; [ $rc != 0 ] && status=1
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -40
  tail -3 "$OUT/tests.log"
  echo "   ($(( $(date +%s) - t0 ))s so far)"
fi

if [ $SAN = 1 ]; then
  for tool in memcheck racecheck synccheck; do
    echo "== compute-sanitizer $tool"
    compute-sanitizer --tool $tool --error-exitcode 3 $PY tools/dev/gpu_sanitize_case.py $SANCASE > "$OUT/sanitize_$tool.log" 2>&1
    rc=$?; [ $rc != 0 ] && status=1
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|FAIL" "$OUT/sanitize_$tool.log" | head -8; echo "   $(grep -c "ok$" "$OUT/sanitize_$tool.log") cases ok"
    echo "   rc=$rc ($(( $(date +%s) - t0 ))s so far)"
  done
fi

if [ $PROF = 1 ]; then
  echo "== ncu ($PCASE)"
  ncu --clock-control none $($PY tools/dev/gpu_profile_case.py --ncu-args "$PCASE") \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
      --section MemoryWorkloadAnalysis --section SchedulerStats --section ComputeWorkloadAnalysis \
      --section InstructionStats ${NCU_EXTRA:-} \
      $PY tools/dev/gpu_profile_case.py "$PCASE" > "$OUT/ncu.log" 2>&1 || echo "ncu failed (see ncu.log)"
  grep -E "fattn_|dense_gemm|dense_gemv|Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Stall|Warp Cycles Per Issued|Issued Ipc|L1/TEX Hit|L2 Hit|Grid Size|No Eligible|Pipe|Executed Ipc|SM Busy" "$OUT/ncu.log" | head -60
fi

if [ $XOVER = 1 ]; then
  echo "== crossover (prefill / decode / decode-tc)"
  $PY tools/dev/gpu_crossover.py --out "$OUT/crossover.json" > "$OUT/crossover.log" 2>&1 || status=1
  grep -E "^(n_kv=|DECODE)" "$OUT/crossover.log"
fi

if [ $BENCH = 1 ]; then
  echo "== benchmark"
  commit=${GGML_ATTN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
  export GGML_ATTN_COMMIT=$commit
  name="$(date -u +%Y-%m-%d)-$commit"
  bargs=(--out "$OUT/$name.json")
  [ $QUICK = 1 ] && bargs+=(--quick)
  [ -n "$ONLY" ] && bargs+=(--only "$ONLY")
  $PY tools/dev/gpu_bench.py "${bargs[@]}" > "$OUT/bench.log" 2>&1 || status=1
  tail -45 "$OUT/bench.log"
fi
if [ -n "$WSAB" ]; then
  echo "== sm_90a prefill A/B: $WSAB"
  commit=${GGML_ATTN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
  WS_AB="$WSAB" $PY tools/dev/gpu_bench.py --out "$OUT/$(date -u +%Y-%m-%d)-$commit-ws-ab.json" \
      --only "prefill N=2048 causal,prefill N=8192 causal,heads, D,prompts 16-200" > "$OUT/ws-ab.log" 2>&1 || status=1
  grep -E " ours |ours-unified |ours-ws-|cudnn |fa2" "$OUT/ws-ab.log" | cut -c1-100
  echo "   ($(( $(date +%s) - t0 ))s so far)"
fi
if [ $QKV = 1 ]; then
  echo "== quantized K/V (q8_0/q4_0 against f16; every quantized decode-tma instance)"
  commit=${GGML_ATTN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
  cfgs=$($PY -c "from ggml_attn import decode_tma_shape as dt
print(','.join(k for k, c in dt.CONFIGS.items() if c.kv_type in dt.QUANT_TYPES))")
  $PY tools/dev/gpu_quant_kv_bench.py --configs "$cfgs" --out "$OUT/$(date -u +%Y-%m-%d)-$commit-quant-kv.json" \
      > "$OUT/quant-kv.log" 2>&1 || status=1
  tail -30 "$OUT/quant-kv.log"
  echo "   ($(( $(date +%s) - t0 ))s so far)"
fi
if [ $LCPP = 1 ]; then
  echo "== llama.cpp side by side (8B-shaped F16 GGUF)"
  $PY tools/dev/llamacpp_side_by_side.py --out "$OUT" || status=1
  echo "   ($(( $(date +%s) - t0 ))s so far)"
fi

if [ $CLI = 1 ]; then
  # the CLI on the GPU (llama-3-8B shapes): tg128, attention only and the full block, with and
  # without CUDA-graph replay; one JSON row per run appended to $OUT/cli.jsonl (one file: the
  # device tool brings a limited number of files back), stderr to $OUT/cli.log
  echo "== CLI (ggml-attn-bench tg128, llama-3-8B shapes)"
  : > "$OUT/cli.jsonl"
  for layer in attn full; do
    for cg in on off; do
      $PY -m ggml_attn.cli.bench --device cuda -p 0 -n 128 -r 3 --layer $layer --cuda-graph $cg -o jsonl \
        >> "$OUT/cli.jsonl" 2>> "$OUT/cli.log" || { status=1; echo "$layer graphs $cg: failed"; tail -5 "$OUT/cli.log"; }
    done
  done
  $PY -c "import json,sys; [print(f\"{r['layer']:5s} {r['backends']:12s} tg128 {r['avg_ts']:9.1f} t/s\") for r in map(json.loads, open(sys.argv[1]))]" "$OUT/cli.jsonl"
  echo "   ($(( $(date +%s) - t0 ))s so far)"
fi
if [ $ABP = 1 ]; then
  echo "== A/B: whole-cache prompt ubatches vs coarse n_kv (llama-3-8B --layer full, 64 prompts)"
  $PY tools/dev/knob_ab.py --rounds 2 --out "$OUT/ab-prompt.json" --variant whole \
      --variant coarse:graph.kv_cache.PROMPT_WHOLE_CACHE_MASK_BYTES=0 batched-bench -m llama-3-8b \
      --layer full --prompt-dist 16-200 -npl 64 -ntg 32 -kvu -r 1 --cuda-graph on 2> "$OUT/ab-prompt.log" \
    || { status=1; echo "A/B failed"; tail -5 "$OUT/ab-prompt.log"; }
fi
echo "== done in $(( $(date +%s) - t0 ))s, status $status"
exit $status
