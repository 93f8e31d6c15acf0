#!/usr/bin/env bash
# Batched decode against llama.cpp's own server, side by side (benches/batch.py):
# builds llama-server from the vendor/llama.cpp tree of the llama-cpp-python
# 0.3.36 sdist (CMake, -DGGML_NATIVE=ON, or AVX2 only with --avx2-only), once,
# into ${MLXCEL_CACHE_DIR:-~/.cache/mlxcel}/peers/llama-server, then runs the
# comparison on the Q4_1 GGUF that benches/peers.sh fetches (run it once first).
# Takes about 10 minutes to build on 2 cores.
#
# Usage: benches/batch.sh [--avx2-only] [batch.py options: --batch 1,8 --prompt-tokens 16 ...]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache=${MLXCEL_CACHE_DIR:-$HOME/.cache/mlxcel}/peers
kind=native
flags=(-DGGML_NATIVE=ON)
if [[ ${1:-} == --avx2-only ]]; then
    shift
    kind=avx2
    flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF
           -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF)
fi
gguf=$cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
[[ -f $gguf ]] || { echo "no $gguf: run benches/peers.sh once first (it fetches the GGUF)" >&2; exit 1; }
sdist=$cache/src/llama_cpp_python-0.3.36.tar.gz
if [[ ! -f $sdist ]]; then
    mkdir -p "$cache/src"
    python3 -m pip download --quiet --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$cache/src"
fi
root=$cache/llama-server
build=$root/build-$kind
# The native build of earlier sessions lives in build/.
[[ $kind == native && -x $root/build/bin/llama-server ]] && build=$root/build
if [[ ! -x $build/bin/llama-server ]]; then
    mkdir -p "$root"
    [[ -d $root/llama_cpp_python-0.3.36 ]] || tar xzf "$sdist" -C "$root"
    echo "building llama-server ($kind) into $build (about 10 minutes)" >&2
    cmake -S "$root/llama_cpp_python-0.3.36/vendor/llama.cpp" -B "$build" -DCMAKE_BUILD_TYPE=Release "${flags[@]}" \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF >"$root/cmake-$kind.log"
    cmake --build "$build" --target llama-server -j "${CMAKE_BUILD_PARALLEL_LEVEL:-2}" >"$root/build-$kind.log"
fi
cargo build --release -p mlxcel --quiet --manifest-path "$here/../Cargo.toml"
extra=()
[[ $kind == avx2 ]] && export MLXCEL_KERNELS=avx2-int8
exec python3 "$here/batch.py" --server "$build/bin/llama-server" --gguf "$gguf" "${extra[@]}" "$@"
