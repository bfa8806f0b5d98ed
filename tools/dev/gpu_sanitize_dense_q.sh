#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck on the block kernels (tools/dev/gpu_sanitize_case.py
# --dense-q), each tool's log in LOGDIR/sanitize_dense_q_<tool>.log and one line of it printed;
# exit status 1 when a tool found an error or a case failed.
#   tools/dev/gpu_sanitize_dense_q.sh LOGDIR
set -uo pipefail
cd "$(dirname "$0")/../.."
LOGS=${1:?usage: gpu_sanitize_dense_q.sh LOGDIR}; PY=${PYTHON:-python3}; status=0
for tool in memcheck racecheck; do
  log="$LOGS/sanitize_dense_q_$tool.log"
  compute-sanitizer --tool $tool --error-exitcode 3 $PY tools/dev/gpu_sanitize_case.py --dense-q > "$log" 2>&1 || status=1
  echo "   $tool: $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | head -2 | tr '\n' ' ')" \
       "$(grep -c "ok$" "$log") ok, $(grep -c "FAIL$" "$log") FAIL"
done
exit $status
