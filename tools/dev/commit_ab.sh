#!/usr/bin/env bash
# One of our CLIs at an earlier commit against the working tree's, on one machine, alternating
# rounds: a number that moved between device calls on different machines (pp512 on the 8B Q4_K_M
# file: 16,130 t/s at f354706, ~13,500 at 0ef699c / bca6c0e, llama.cpp's unchanged) is the code's
# doing only if it moves on one machine too.
#   here:    tools/dev/commit_ab.sh --prepare COMMIT
#            (writes build/ab-COMMIT/: `git archive COMMIT` without bench/ and docs/)
#   device:  tools/dev/commit_ab.sh COMMIT ROUNDS CLI ARGS...
#            (carry [".whl", "build/ab-COMMIT"]; the working tree installed first, e.g. by
#            tools/dev/gpu_check.sh --no-precompile --no-tests --no-sanitize --no-bench --no-cli)
#   CLI: bench | batched-bench | serve-bench; e.g.
#            tools/dev/commit_ab.sh f354706 2 bench --device cuda -m /tmp/q.gguf -p 512 -n 0 -r 5
# The earlier commit is installed into /tmp/ab-COMMIT (pip --target) and run with PYTHONPATH; each
# side has its own kernel cache. Every output line is written prefixed "<side> <round>" to stdout
# and $OUT/commit_ab.txt; a side's failure is a line of its own and the next round goes on.
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-}" = "--prepare" ]; then
  c=${2:?usage: commit_ab.sh --prepare COMMIT}
  rm -rf "build/ab-$c" && mkdir -p "build/ab-$c" && git archive "$c" | tar -x -C "build/ab-$c" && rm -rf "build/ab-$c/bench" "build/ab-$c/docs"
  du -sh "build/ab-$c"; exit 0
fi
[ $# -ge 3 ] || { sed -n 2,16p "$0"; exit 2; }
c=$1; rounds=$2; cli=$3; shift 3
case "$cli" in
  bench) mod=bench;; batched-bench) mod=batched_bench;; serve-bench) mod=serve_bench;;
  *) echo "commit_ab.sh: unknown CLI $cli (bench, batched-bench, serve-bench)" >&2; exit 2;;
esac
src="build/ab-$c"; [ -d "$src" ] || { echo "commit_ab.sh: $src missing (run --prepare $c here and carry it)" >&2; exit 2; }
PY=${PYTHON:-python3}; OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
GGML_ATTN_COMMIT=$c $PY -m pip install -q --no-deps --no-build-isolation --target "/tmp/ab-$c" "$src" > "/tmp/ab-$c.log" 2>&1 \
  || { echo "commit_ab.sh: install of $c failed"; tail -5 "/tmp/ab-$c.log"; exit 1; }
# the earlier side: its directory on the path, not the current one, and no editable install's finder (the working
# tree's, which would answer `import ggml_attn` before the path is searched)
old_side='import sys; sys.path[:] = [p for p in sys.path if p not in ("", ".")]; sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]'
where=$(PYTHONPATH="/tmp/ab-$c" $PY -c "$old_side; import ggml_attn; print(ggml_attn.__file__)")
case "$where" in /tmp/ab-$c/*) ;; *) echo "commit_ab.sh: $c's package shadowed by $where" >&2; exit 1;; esac
run="import sys; from ggml_attn.cli.$mod import main; sys.exit(main(sys.argv[1:]))"   # (argv given: no re-exec, which would lose -c)
for r in $(seq 1 "$rounds"); do
  for side in head "$c"; do
    if [ "$side" = head ]; then pp=""; pre="pass"; else pp="/tmp/ab-$c"; pre="$old_side"; fi
    PYTHONPATH="$pp" GGML_ATTN_CACHE_DIR="/tmp/ab-cache-$side" $PY -c "$pre; $run" "$@" 2>/tmp/ab-err.log \
      | sed "s/^/$side $r /" | tee -a "$OUT/commit_ab.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || { echo "$side $r FAILED: $(tail -1 /tmp/ab-err.log)" | tee -a "$OUT/commit_ab.txt"; }
  done
done
