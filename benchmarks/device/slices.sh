#!/usr/bin/env bash
# The real target and drafter in slices the GPU machine can receive (one run call carries at most
# 64 MiB), on the development machine, each slice in its own ignored folder:
#   .slices/NN/<model file>.partKK      45 MiB each (the working tree travels too); carry: [".slices/NN"], one call per slice
# On the device, `run.sh receive` keeps each call's slice in /tmp/es/slices and `run.sh models`
# joins them and checks each file's size and sha256 against its manifest in models/ before
# anything reads it (edgespec models pull re-verifies a file placed in the store).
#   bash benchmarks/device/slices.sh [MODEL...]     default: qwen2.5-coder-1.5b qwen2.5-coder-0.5b
# Prints the number of slice folders.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
SLICE_BYTES=47185920
cd "$ROOT"
exclude="$(git rev-parse --git-common-dir)/info/exclude"
grep -qx '/.slices/' "$exclude" 2>/dev/null || echo '/.slices/' >> "$exclude"
models=("$@")
(( ${#models[@]} )) || models=(qwen2.5-coder-1.5b qwen2.5-coder-0.5b)
rm -rf .slices && mkdir -p .slices/tmp
for m in "${models[@]}"; do
    path="$("$PY" -c 'import sys; from edgespec.files.store import ModelStore; print(ModelStore().path_for(sys.argv[1]))' "$m")"
    [[ -f "$path" ]] || { echo "$m is not in the store: edgespec models pull $m" >&2; exit 1; }
    split -b "$SLICE_BYTES" -d -a 2 "$path" ".slices/tmp/$(basename "$path").part"
done
n=0
for part in .slices/tmp/*.part*; do
    dir=$(printf '.slices/%02d' "$n")
    mkdir -p "$dir" && mv "$part" "$dir/"
    n=$((n + 1))
done
rmdir .slices/tmp
echo "$n"
