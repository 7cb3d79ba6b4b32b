#!/usr/bin/env bash
# Reproduces every table in benchmarks/RESULTS.md (about 2 hours on a 2-core machine).
# Needs the native peers first: bash benchmarks/build_peers.sh. Run on a quiet machine:
# speedups are same-run ratios, but other load still adds noise.
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results
mkdir -p "$out"
run() { local name=$1; shift; edgespec bench "$@" --share-prefill --json "$out/$name.json" \
          --markdown "$out/$name.md" --plot "$out/$name.png"; }
# Code-edit, all 48 requests: the configurations that compete on copy-heavy text.
run code-edit --suite code-edit --max-tokens 256 \
    --configs plain,suffix,auto,peer:llama.cpp-ngram-mod
# Spec-Bench, 5 questions per category (30), every configuration and peer.
run specbench-limit5 --suite specbench --limit 5 --max-tokens 128 \
    --configs plain,suffix,model,hybrid,auto,peer:llama-cpp-python-pld,peer:llama.cpp-draft,peer:llama.cpp-ngram-mod
# Code-edit, 3 requests per category (12): the slow draft-model configurations and PLD.
run code-edit-limit3 --suite code-edit --limit 3 --max-tokens 256 \
    --configs plain,model,peer:llama-cpp-python-pld
# The same 12 requests: hybrid and llama.cpp's own draft-model speculation.
run code-edit-limit3b --suite code-edit --limit 3 --max-tokens 256 \
    --configs plain,hybrid,peer:llama.cpp-draft
# The 1.1 GB target file-backed under a 600 MiB budget, plain vs auto under the same budget.
run filebacked-code-edit --suite code-edit --limit 1 --max-tokens 64 --ram-budget 600MiB \
    --configs plain,auto
