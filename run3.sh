#!/usr/bin/env bash
# session run 3 (not committed): graph bench modes, side by side with a prebuilt llama.cpp + logits, load profile
export PYTHONUNBUFFERED=1 GGML_ATTN_CACHE_DIR=/tmp/gac GGML_ATTN_COMMIT=${GGML_ATTN_COMMIT:-$(git rev-parse --short HEAD)}
t0=$(date +%s); el() { echo "   [$(( $(date +%s) - t0 ))s]"; }
python3 -m pip install -q --no-index --no-build-isolation --no-deps .whl/ggml_python-0.0.45.tar.gz > $OUT/install.log 2>&1
python3 -m pip install -q --no-index --no-deps .whl/*.whl >> $OUT/install.log 2>&1
python3 -m pip install -q --no-build-isolation --no-deps -e . >> $OUT/install.log 2>&1 || { tail $OUT/install.log; exit 1; }
(python3 tests/fixtures_gguf.py /tmp/m8b.gguf --preset llama-3-8b --vocab 32000 > $OUT/gguf.log 2>&1; echo done >> $OUT/gguf.log) &
mkdir -p /tmp/lc/build/bin && tar xf .lcpp/build-sm90.tar.xz -C /tmp/lc/build/bin
LD_LIBRARY_PATH=/tmp/lc/build/bin /tmp/lc/build/bin/llama-bench --help > /dev/null 2>&1; echo "llama-bench --help rc=$?"
python3 tools/dev/gpu_precompile.py -j 12 > $OUT/precompile.log 2>&1; tail -1 $OUT/precompile.log; el
echo "== graph bench"
timeout 150 python3 -c "
import sys; sys.path.insert(0,'tools/dev')
import gpu_timing, gpu_graph_bench, json
rows = gpu_graph_bench.run(gpu_timing.device_us, log=lambda *a: None)
json.dump(rows, open('$OUT/graph_bench.json','w'), indent=1)
for r in rows: print(r['case'][:52].ljust(52), r['impl'].ljust(26), r.get('us', r.get('host_us')), r.get('ratio',''))
" 2>&1 | tail -30; el
while ! grep -q done $OUT/gguf.log; do sleep 2; done; tail -2 $OUT/gguf.log
echo "== side by side"
timeout $(( 530 - ($(date +%s) - t0) )) python3 tools/dev/llamacpp_side_by_side.py --prebuilt .lcpp/build-sm90.tar.xz --out $OUT 2>&1 | tail -40; el
echo "== load profile"
timeout $(( 590 - ($(date +%s) - t0) )) python3 tools/dev/model_load_profile.py /tmp/m8b.gguf --json $OUT/load.json 2>&1 | tail -12; el
