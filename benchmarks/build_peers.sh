#!/usr/bin/env bash
# Build llama.cpp's native peer binaries (llama-speculative-simple, llama-bench) from the
# llama.cpp that the llama-cpp-python 0.3.36 source archive vendors, so that the benchmark
# harness compares edgespec with exactly the llama.cpp it runs on.
#
# Idempotent: the source archive, the extracted tree and the CMake build directory are cached
# under $EDGESPEC_HOME/peers/ (default ~/.cache/edgespec/peers/); a second run re-configures
# (a no-op when the options did not change), rebuilds nothing and re-copies the binaries.
# A first build takes 10-15 minutes on 2 cores.
#
# llama and ggml are linked statically (-DBUILD_SHARED_LIBS=OFF), so the copies in
# $EDGESPEC_HOME/peers/bin/ need only system libraries (libstdc++, libgomp). Only the two
# targets are built: no tests, server, web UI, unified app, curl or OpenSSL.
#
# Environment: EDGESPEC_HOME, PYTHON (interpreter whose pip downloads the archive),
# JOBS (parallel build jobs, default nproc), LLAMA_CPP_PYTHON_VERSION (default 0.3.36).
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
HOME_DIR="${EDGESPEC_HOME:-$HOME/.cache/edgespec}"
PEERS_DIR="$HOME_DIR/peers"
SRC_CACHE="$PEERS_DIR/src"
BIN_DIR="$PEERS_DIR/bin"
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"
TARGETS=(llama-speculative-simple llama-bench)

if [[ -z "${PYTHON:-}" ]]; then
    here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    if [[ -x "$here/.venv/bin/python" ]]; then PYTHON="$here/.venv/bin/python"; else PYTHON=python3; fi
fi

for tool in cmake tar; do
    command -v "$tool" >/dev/null || { echo "build_peers.sh: '$tool' is required" >&2; exit 1; }
done

mkdir -p "$SRC_CACHE" "$BIN_DIR"

archive="$SRC_CACHE/llama_cpp_python-$VERSION.tar.gz"
if [[ ! -f "$archive" ]]; then
    echo "==> downloading llama-cpp-python==$VERSION source archive"
    tmpd="$(mktemp -d "$SRC_CACHE/dl.XXXXXX")"
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: \
        "llama-cpp-python==$VERSION" -d "$tmpd"
    found="$(ls "$tmpd"/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)"
    [[ -n "$found" ]] || { echo "build_peers.sh: pip did not produce the sdist" >&2; exit 1; }
    mv "$found" "$archive"
    rm -rf "$tmpd"
fi

src="$SRC_CACHE/llama_cpp_python-$VERSION"
if [[ ! -f "$src/vendor/llama.cpp/CMakeLists.txt" ]]; then
    echo "==> extracting $archive"
    rm -rf "$src"
    tar xzf "$archive" -C "$SRC_CACHE"
fi
llama="$src/vendor/llama.cpp"
build="$PEERS_DIR/build-$VERSION"

generator=()
if command -v ninja >/dev/null && [[ ! -f "$build/CMakeCache.txt" || -f "$build/build.ninja" ]]; then
    generator=(-G Ninja)
fi

# AMX off, as the Makefile builds llama-cpp-python: the development VMs report AMX tiles but do
# not enable the tile state, and a GGML_NATIVE build died with SIGILL (exit 132) at its first
# decode there. GCC's explicit -mno-* flags win over -march=native whatever their order.
cflags=""
if [[ "$(uname -m)" == x86_64 ]]; then cflags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"; fi

# Configuring again is cheap and a no-op when nothing changed; it keeps the cache's options in
# step with this script.
echo "==> configuring $llama"
cmake -S "$llama" -B "$build" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_C_FLAGS="$cflags" \
    -DCMAKE_CXX_FLAGS="$cflags" \
    -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_EXAMPLES=ON \
    -DLLAMA_BUILD_TOOLS=ON \
    -DGGML_NATIVE=ON >/dev/null

echo "==> building ${TARGETS[*]} with $JOBS jobs"
start=$(date +%s)
cmake --build "$build" --config Release -j "$JOBS" --target "${TARGETS[@]}"
echo "==> build step took $(( $(date +%s) - start ))s"

for t in "${TARGETS[@]}"; do
    bin="$(find "$build" -type f -name "$t" -perm -u+x | head -n1)"
    [[ -n "$bin" ]] || { echo "build_peers.sh: $t was not built" >&2; exit 1; }
    install -m 0755 "$bin" "$BIN_DIR/$t.tmp"
    mv -f "$BIN_DIR/$t.tmp" "$BIN_DIR/$t"
done

echo "peer binaries (llama.cpp vendored by llama-cpp-python $VERSION):"
for t in "${TARGETS[@]}"; do echo "  $BIN_DIR/$t"; done
