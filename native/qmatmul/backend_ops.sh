#!/usr/bin/env bash
# llama.cpp's own op tests on the CPU backend with this folder's kernels patched in: test-backend-ops
# checks the CPU backend's MUL_MAT and FLASH_ATTN_EXT against the same backend's reference
# implementation (ggml_backend_cpu_set_use_ref, which the patches leave to llama.cpp's kernels).
#
#   bash native/qmatmul/backend_ops.sh SDIST [WORK] [OPS]
#
# SDIST: llama-cpp-python's source tarball (pip download --no-binary :all: --no-deps
# llama-cpp-python==VERSION); WORK: a scratch folder (default /tmp/qmm-backend-ops); OPS: which
# ops (default "MUL_MAT FLASH_ATTN_EXT"). Prints each op's summary; exit status 1 if any failed.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SDIST=${1:?usage: backend_ops.sh SDIST [WORK] [OPS]}
WORK=${2:-/tmp/qmm-backend-ops}
OPS=${3:-MUL_MAT FLASH_ATTN_EXT}
mkdir -p "$WORK"
if [[ ! -x "$WORK/build/bin/test-backend-ops" ]]; then
    tar xzf "$SDIST" -C "$WORK" --wildcards '*/vendor/llama.cpp/*' || exit 1
    SRC=$(echo "$WORK"/llama_cpp_python-*)
    python3 "$HERE/llama_cpp_qmatmul.py" "$SRC" || exit 1
    cmake -S "$SRC/vendor/llama.cpp" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DGGML_CPU_BATCH_INVARIANT=ON > "$WORK/cmake.log" 2>&1 \
        || { tail -20 "$WORK/cmake.log"; exit 1; }
    cmake --build "$WORK/build" --target test-backend-ops -j "$(nproc)" > "$WORK/build.log" 2>&1 \
        || { tail -30 "$WORK/build.log"; exit 1; }
fi
status=0
for op in $OPS; do
    "$WORK/build/bin/test-backend-ops" test -b CPU -o "$op" > "$WORK/$op.log" 2>&1 || status=1
    grep -c "OK" "$WORK/$op.log" | sed "s/^/$op: cases OK: /"
    grep -E "FAIL|tests passed|Backend .*: (OK|FAIL)" "$WORK/$op.log" | tail -8
done
exit $status
