# Sourced by the tools/dev/gpu_*_run.sh and gpu_route_check.sh device scripts, from the repository
# root: $OUT and its logs/ folder (packed into $OUT/logs.tgz at exit, a timeout's signal included),
# PY, the environment of every step, the clock (status, t0, say) and gpu_install (gpu_check.sh's
# install alone, its log in logs/install_run.log; the script stops when it fails).
OUT=${OUT:-$PWD/gpu_out}; LOGS="$OUT/logs"; mkdir -p "$LOGS"
trap 'tar czf "$OUT/logs.tgz" -C "$OUT" logs 2>/dev/null && rm -rf "$LOGS"' EXIT
trap 'exit 143' TERM INT
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 GGML_ATTN_CACHE_DIR=${GGML_ATTN_CACHE_DIR:-/tmp/ggml-attn-cache}
status=0; t0=$(date +%s)
say() { echo "   ($(( $(date +%s) - t0 ))s so far)"; }
gpu_install() {
  OUT="$LOGS" bash tools/dev/gpu_check.sh --no-precompile --no-tests --no-sanitize --no-bench --no-cli > "$LOGS/install_run.log" 2>&1 \
    || { echo "install failed"; tail -20 "$LOGS/install_run.log"; exit 1; }
}
