#!/usr/bin/env bash
# Build llama.cpp's shared library and the tools the serving benchmark runs, from the llama.cpp vendored in
# llama-cpp-python's sdist (get it with: pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36).
#
#   benchmarks/build_llamacpp.sh SRC BUILD [cuda|cpu] [JOBS]
#
# SRC: the sdist's vendor/llama.cpp folder (or a tarball of it); BUILD: the build folder (created).
# cuda builds for Hopper only (sm_90) to keep the build short. Writes BUILD/done when every target is built.
# MASK_TIMER=1: llama.cpp's KQ-mask build timed and logged when LLAMA_MASK_TIME is set (serve_llamacpp.py mask_timer).
set -euo pipefail
src=$1; build=$2; backend=${3:-cuda}; jobs=${4:-$(nproc)}
if [[ -f $src ]]; then  # a tarball of vendor/llama.cpp
    mkdir -p "$build/src" && tar xf "$src" -C "$build/src" && src=$(echo "$build"/src/*/)
fi
if [[ ${MASK_TIMER:-0} == 1 ]]; then
    python3 "$(dirname "$0")/serve_llamacpp.py" mask_timer --src "$src"
fi
flags=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
       -DLLAMA_BUILD_SERVER=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON)
if [[ $backend == cuda ]]; then
    flags+=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90)
fi
cmake -S "$src" -B "$build" -G Ninja "${flags[@]}"
targets=(llama llama-tokenize llama-quantize llama-perplexity)  # cpu: what serve_llamacpp.py's bytes step runs
if [[ $backend == cuda ]]; then
    targets+=(llama-batched-bench)
fi
cmake --build "$build" -j "$jobs" --target "${targets[@]}"
touch "$build/done"
