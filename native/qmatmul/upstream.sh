#!/usr/bin/env bash
# The kernels as one would propose them to llama.cpp: one diff against the llama.cpp that the
# pinned llama-cpp-python vendors, from llama.cpp's own root, new files included, without the
# markers edgespec's patch rules use to find their work again. The change is behind a CMake
# option, GGML_CPU_BATCH_INVARIANT (OFF): off, the build is llama.cpp's.
#
#   bash native/qmatmul/upstream.sh SDIST [OUT]
#
# SDIST: llama_cpp_python-VERSION.tar.gz (`pip download --no-binary :all: llama-cpp-python==VERSION`).
# OUT: default native/qmatmul/upstream/ggml-cpu-batch-invariant.patch. The script checks that the
# diff applies to a fresh copy of that llama.cpp with `git apply --check`.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SDIST=$1
OUT=${2:-$HERE/upstream/ggml-cpu-batch-invariant.patch}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
git_() { git -C "$1" -c user.name=edgespec -c user.email=edgespec@localhost "${@:2}"; }
tar xzf "$SDIST" -C "$WORK" --wildcards '*/vendor/llama.cpp/*'
SRC=$(echo "$WORK"/llama_cpp_python-*)
LLAMA="$SRC/vendor/llama.cpp"
rm -rf "$LLAMA/.git"  # a submodule's pointer in the archive
cp -a "$LLAMA" "$WORK/fresh"
git_ "$LLAMA" init -q && git_ "$LLAMA" add -A && git_ "$LLAMA" commit -qm "llama.cpp as vendored"
python3 "$HERE/llama_cpp_qmatmul.py" "$SRC" > /dev/null
# the patch rules' markers: "  // edgespec: NAME ..." after code, and whole comment lines
(cd "$LLAMA" && sed -i -E -e '/^ *(\/\/|#) edgespec: [a-z0-9-]+$/d' \
    -e 's@^(.*[^ ]) +(//|#) edgespec: [a-z0-9-]+(: .*)?$@\1@' $(git ls-files -m))
git_ "$LLAMA" add -A
mkdir -p "$(dirname "$OUT")"
git_ "$LLAMA" diff --cached > "$OUT"
git_ "$WORK/fresh" init -q && git_ "$WORK/fresh" apply --check "$OUT"
git_ "$LLAMA" diff --cached --stat | tail -1
grep -c edgespec: "$OUT" | sed 's/^/markers left: /' || true
