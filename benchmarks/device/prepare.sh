#!/usr/bin/env bash
# Prepare, on the development machine, everything the GPU machine needs for run.sh, in
# .device/ (ignored by git through .git/info/exclude; carried with `carry: [".device"]`):
#   .device/llama_cpp_python-<v>.tar.gz   the PyPI source archive, stripped (77 MB -> ~8 MB)
#   .device/wheels/                       pure-Python wheels that installing it needs
#   .device/headers/*.hdr                 header-only GGUFs of the real models (~6 MB each):
#                                         run.sh makes shape clones from them on the device
# Nothing here is committed: the GPU machine reaches no package registry, and real weights
# do not fit through its 64 MiB limit.
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEV="$ROOT/.device"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
EDGESPEC="${EDGESPEC:-$ROOT/.venv/bin/edgespec}"
cd "$ROOT"

exclude="$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$exclude")"
grep -qx '/.device/' "$exclude" 2>/dev/null || echo '/.device/' >> "$exclude"
mkdir -p "$DEV/wheels" "$DEV/headers"

archive="$DEV/llama_cpp_python-$VERSION.tar.gz"
if [[ ! -f "$archive" ]]; then
    tmp="$(mktemp -d)"
    "$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$tmp"
    tar xzf "$tmp/llama_cpp_python-$VERSION.tar.gz" -C "$tmp"
    src="$tmp/llama_cpp_python-$VERSION"
    v="$src/vendor/llama.cpp"
    # What the CUDA build does not read: docs, test models, web UI, other GPU backends.
    rm -rf "$src/.git" "$v/.git" "$v/docs" "$v/benches" "$v/tools/ui" "$v/models" "$v/media" \
           "$v/ggml/src/ggml-"{sycl,vulkan,metal,opencl,cann,musa,webgpu,hexagon,openvino,zdnn,virtgpu,zendnn,et}
    mkdir -p "$v/models"  # its CMakeLists may glob here; an empty folder is enough
    tar czf "$archive" -C "$tmp" "llama_cpp_python-$VERSION"
    rm -rf "$tmp"
fi

# Python 3.12 wheels (the GPU machine's python3); most are in its image already, but a
# version mismatch there must not stop the install.
"$PY" -m pip download --quiet --only-binary :all: --python-version 3.12 --no-deps -d "$DEV/wheels" \
    scikit-build-core pathspec packaging diskcache typing_extensions jinja2 MarkupSafe \
    pytest pluggy iniconfig psutil \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any

for m in qwen2.5-coder-1.5b qwen2.5-coder-0.5b; do
    "$EDGESPEC" models clone "$m" --header-only --out "$DEV/headers/$m.hdr"
done
du -sh "$DEV"/* "$DEV"
