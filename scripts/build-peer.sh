#!/usr/bin/env bash
# Builds llama.cpp's llama-server, the peer of the benchmarks' side-by-side figures, from the llama.cpp
# source inside the llama-cpp-python sdist on the package registry. Once per machine (~9 min on 2 cores).
#
#   scripts/build-peer.sh [DIR]     # DIR defaults to ../chatd-peer beside the checkout (kept out of the repo)
#
# Prints the binary's path last; `make bench` finds it through LLAMA_SERVER=<that path>.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
DIR=${1:-$(cd .. && pwd)/chatd-peer}
BIN="$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp/build/bin/llama-server"
if [[ -x $BIN ]]; then
    echo "$BIN"
    exit 0
fi
mkdir -p "$DIR"
PY=${PYTHON:-python3}
[[ -x .venv/bin/python ]] && PY=.venv/bin/python
if [[ ! -f "$DIR/llama_cpp_python-$VERSION.tar.gz" ]]; then
    "$PY" -m pip download --disable-pip-version-check -q --no-binary :all: --no-deps -d "$DIR" "llama-cpp-python==$VERSION"
fi
tar -xzf "$DIR"/llama_cpp_python-$VERSION.tar.gz -C "$DIR"
cd "$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"
# Native code for this CPU, but without AMX: virtual machines often advertise the AMX flags without
# enabling the tile state, and llama.cpp's AMX kernels then crash at start-up (SIGSEGV / SIGILL).
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake -B build -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" >/dev/null
cmake --build build --target llama-server -j"$(nproc)" >/dev/null
echo "$BIN"
