#!/usr/bin/env bash
# session run 1 (not committed): install, targeted GPU tests, graph bench modes, 8B load profile, full GPU tests
export PYTHONUNBUFFERED=1 GGML_ATTN_CACHE_DIR=/tmp/gac
t0=$(date +%s); el() { echo "   [$(( $(date +%s) - t0 ))s]"; }
python3 -m pip install -q --no-index --no-build-isolation --no-deps .whl/ggml_python-0.0.45.tar.gz > $OUT/install.log 2>&1
python3 -m pip install -q --no-index --no-deps .whl/*.whl >> $OUT/install.log 2>&1
python3 -m pip install -q --no-build-isolation --no-deps -e . >> $OUT/install.log 2>&1 || { tail $OUT/install.log; exit 1; }
(python3 tests/fixtures_gguf.py /tmp/m8b.gguf --preset llama-3-8b --vocab 32000 > $OUT/gguf.log 2>&1; echo done >> $OUT/gguf.log) &
el; python3 tools/dev/gpu_precompile.py -j 12 > $OUT/precompile.log 2>&1; tail -1 $OUT/precompile.log; el
echo "== targeted GPU tests"
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_gpu_op_fast_path.py tests/test_graph_device.py tests/test_model.py -m gpu -k "gpu or device or replay or plan" > $OUT/t1.log 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/t1.log | head -20; el
echo "== graph bench"
timeout 120 python3 -c "
import sys; sys.path.insert(0,'tools/dev')
import gpu_timing, gpu_graph_bench, json
rows = gpu_graph_bench.run(gpu_timing.device_us, log=lambda *a: None)
json.dump(rows, open('$OUT/graph_bench.json','w'), indent=1)
for r in rows: print(r['case'][:60].ljust(60), r['impl'].ljust(26), r.get('us', r.get('host_us')), r.get('ratio',''))
" 2>&1 | tail -30; el
echo "== wait gguf"; while ! grep -q done $OUT/gguf.log; do sleep 2; done; tail -2 $OUT/gguf.log; el
echo "== load profile"
sync; timeout 200 python3 tools/dev/model_load_profile.py /tmp/m8b.gguf --cli --json $OUT/load.json 2>&1 | tail -20; el
echo "== all GPU tests"
timeout $(( 560 - ($(date +%s) - t0) )) python3 -m pytest -m gpu -q -p no:cacheprovider -n 12 tests/ > $OUT/tests.log 2>&1
grep -E "^(FAILED|ERROR)" $OUT/tests.log | head -30; tail -2 $OUT/tests.log; el
