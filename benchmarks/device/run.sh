#!/usr/bin/env bash
# On the GPU machine, from the repository root, with .device/ carried (see prepare.sh):
#   bash benchmarks/device/run.sh [STAGE...]     stages: build clones curves bench spec modes
#   start receive models real trip graphtiming sizes kernels host hostwait sampled topk anchors (the real 1.5B + 0.5B: see "the real Qwen2.5-Coder" below)
#   overlap trees gputests offload beside pinned pinned2 floor graphs graphopt big ab numpy diag ram
#   make maketests imports (the Makefile's `make GPU=cuda` build, the GPU tests on it, and
#   which import orders of llama.cpp, numpy and onnxruntime crash beside it) rows (ROWS=FILE:
#   the drafter's Python per logits row on this CPU, no build needed)
# Idempotent within one machine (work in /tmp/es): a stage whose output exists is skipped,
# so a second call on the still-warm machine goes on where the first stopped.  Never stops
# at a failing step: failures are listed in $OUT/failures.txt.  BUDGET_S (default 560)
# bounds the whole call; what is measured by then is collected into $OUT.
set -uo pipefail
VERSION=0.3.36
ROOT="$(pwd)"
W=/tmp/es
OUT="${OUT:-$W/out}"
BUDGET_S="${BUDGET_S:-560}"
SRC="$W/src/llama_cpp_python-$VERSION"
# STOCK_LLAMA=1 builds llama.cpp without edgespec's patches (native/llama_cpp_patches.py), as a
# stock wheel has it. Graph measurements carry -per-shape when the source built has the patch.
STOCK_LLAMA="${STOCK_LLAMA:-0}"
CUDA_FILE="vendor/llama.cpp/ggml/src/ggml-cuda/ggml-cuda.cu"  # in llama-cpp-python's source
CUDA_SRC="$SRC/$CUDA_FILE"
shape() { grep -q 'edgespec: graphs-per-shape$' "$CUDA_SRC" 2>/dev/null && echo -per-shape; }
export PATH="/usr/local/cuda/bin:$PATH" LC_ALL=C PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
export LLAMA_CPP_LIB_PATH="$W/lib" PYTHONPATH="$W/site:$ROOT"
# The make stages' own install (stage_make's venv), away from run.sh's build above
OWN=(env -u PYTHONPATH -u LLAMA_CPP_LIB_PATH)
mkdir -p "$W/results" "$W/models" "$W/lib" "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
set -x

fail() { echo "$(date +%T) $*" | tee -a "$OUT/failures.txt"; }
left() { echo $(( BUDGET_S - SECONDS )); }
# run SECONDS_NEEDED CMD...: only when enough of the budget is left, never past it
run() { local need=$1; shift
        if (( $(left) < need )); then fail "skipped (budget): $*"; return 1; fi
        timeout $(( $(left) - 5 )) "$@" || { fail "failed ($?): $*"; return 1; }; }

stage_env() {
    { date -u; nvidia-smi; nvcc --version; lscpu | head -20; python3 --version; } > "$OUT/env.txt" 2>&1
}

stage_build() {
    [[ -x "$W/build/bin/llama-speculative-simple" && -x "$W/build/bin/llama-bench" ]] && return
    mkdir -p "$W/src" && tar xzf ".device/llama_cpp_python-$VERSION.tar.gz" -C "$W/src"
    [[ $STOCK_LLAMA == 1 ]] || python3 native/llama_cpp_patches.py "$SRC" || { fail "llama.cpp patches"; return 1; }
    # CPU kernels: AVX2/AVX512 but no AMX (a laptop has none, and AMX repacking died of
    # SIGILL in a VM of the development machine); 90-real: the H100/H200 only.
    local cpu=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
    grep -qw avx512f /proc/cpuinfo && cpu+=(-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON)
    cmake -S "$SRC/vendor/llama.cpp" -B "$W/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real -DBUILD_SHARED_LIBS=ON \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON "${cpu[@]}" > "$W/cmake.log" 2>&1 \
        || { tail -30 "$W/cmake.log"; fail "cmake configure"; return 1; }
    local t0=$SECONDS
    run 60 cmake --build "$W/build" -j 16 --target llama llama-bench llama-speculative-simple \
        > "$W/build.log" 2>&1 || { tail -40 "$W/build.log"; return 1; }
    echo "build took $(( SECONDS - t0 )) s"
}

stage_install() {
    find "$W/build" -name 'lib*.so*' -exec ln -sf {} "$W/lib/" \;
    # The engine and the GPU tests: psutil, pytest (with its two dependencies) if the image lacks them.
    python3 -c 'import psutil, pytest' 2>/dev/null || python3 -m pip install -q --no-index --no-deps \
        --target "$W/site" .device/wheels/{psutil,pytest,pluggy,iniconfig}-*.whl
    python3 -c 'import llama_cpp.llama_cpp' 2>/dev/null && return  # a real install, not a bare folder
    python3 -m pip install -q --no-index --no-deps --target "$W/site" .device/wheels/diskcache-*.whl
    # llama-cpp-python without its own llama.cpp: pure Python over $LLAMA_CPP_LIB_PATH.
    CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" python3 -m pip install -q --no-index \
        --no-deps --no-build-isolation --target "$W/site" "$SRC" \
        || { fail "pip install llama-cpp-python; copying its package"; cp -r "$SRC/llama_cpp" "$W/site/"; }
    # llama_cpp._ggml looks for libggml in the package's own lib/ folder only.
    mkdir -p "$W/site/llama_cpp/lib" && ln -sf "$W"/lib/lib*.so* "$W/site/llama_cpp/lib/"
    python3 -c 'import json, edgespec.llama.backend as b; print(json.dumps(b.system_info(), indent=1))' \
        > "$OUT/system_info.json" || fail "import edgespec.llama.backend"
}

# The README's switch, `make demo GPU=cuda`, on this machine: the Makefile's own CUDA recipe
# into a venv. No registry is reached from here, so the recipe's first steps are stood in for
# (a venv over the image's packages, edgespec installed without its dependencies, the carried
# source archive in place of `pip download`, patched by the same script); the Makefile then
# builds llama-cpp-python with CUDA as a user's machine would. Then doctor and a short run.
make_venv() {
    local v="$W/venv" src=build/llama-cpp-python t0=$SECONDS
    local -a env_=("${OWN[@]}" PIP_NO_INDEX=1)
    if [[ ! -f "$v/.installed-cuda" ]]; then
        # the image's python3 is itself a venv: its packages reach the new one through a .pth
        python3 -m venv "$v" && python3 -c 'import site; print(site.getsitepackages()[0])' \
            > "$("$v/bin/python" -c 'import site; print(site.getsitepackages()[0])')/image.pth" \
            && "${env_[@]}" "$v/bin/python" -m pip install -q --no-deps --no-build-isolation \
            .device/wheels/diskcache-*.whl . || { fail "venv"; return 1; }
        rm -rf "$src" && mkdir -p "$src" && tar xzf ".device/llama_cpp_python-$VERSION.tar.gz" -C "$src"
        "$v/bin/python" native/llama_cpp_patches.py "$src/llama_cpp_python-$VERSION/" \
            || { fail "llama.cpp patches"; return 1; }
        local kernels=()  # KERNELS=1: the CPU backend with native/qmatmul (run.sh kernels)
        if [[ ${KERNELS:-0} == 1 ]]; then
            "$v/bin/python" native/qmatmul/llama_cpp_qmatmul.py "$src/llama_cpp_python-$VERSION/" \
                || { fail "qmatmul patch"; return 1; }
            kernels=(LLAMA_CMAKE=-DGGML_CPU_BATCH_INVARIANT=ON)
        fi
        touch "$v/.installed" "$src/.patched"
        t0=$SECONDS
        # PIP_NO_BUILD_ISOLATION=0 is pip's --no-build-isolation (its variable reads backwards)
        run 240 "${env_[@]}" PIP_NO_BUILD_ISOLATION=0 make GPU=cuda VENV="$v" "$v/.installed-cuda" \
            "${kernels[@]}" \
            > "$W/make.log" 2>&1 || { tail -40 "$W/make.log"; fail "make GPU=cuda"; return 1; }
        echo "make GPU=cuda built llama-cpp-python in $(( SECONDS - t0 )) s" | tee "$W/results/make.txt"
    fi
}

stage_make() {
    local v="$W/venv"
    local -a env_=("${OWN[@]}" PIP_NO_INDEX=1)
    make_venv || return 1
    [[ -f "$W/models/qwen1.5b.gguf" ]] || run 60 "${env_[@]}" "$v/bin/python" benchmarks/device/measure.py \
        clones .device/headers "$W/models"
    local es=("${env_[@]}" "$v/bin/edgespec")
    { run 30 "${es[@]}" doctor || fail "edgespec doctor"
      run 30 "${es[@]}" plan --model "$W/models/qwen7b.gguf" --placement gpu || fail "edgespec plan"
      run 60 "${es[@]}" run --model "$W/models/qwen1.5b.gguf" --placement gpu --draft-model \
          "$W/models/qwen0.5b.gguf" --temperature 0 --max-tokens 32 --json "Hello" || fail "edgespec run"
    } >> "$W/results/make.txt" 2>&1
    tail -60 "$W/results/make.txt"
}

# Which imports crash beside the llama.cpp stage_make built (doctor died importing onnxruntime
# there), each in its own process (a crash is the expected answer: its rc is printed, not a
# failure), then a backtrace of the crashing order under cuda-gdb.
stage_imports() {
    [[ -x "$W/venv/bin/python" ]] || { fail "imports: no venv (run the make stage first)"; return 1; }
    local py=("${OWN[@]}" "$W/venv/bin/python" -P) c
    probe() {  # probe LABEL ARG...: the venv's python with ARG..., its last lines and its exit status
        echo "== $1"; shift
        timeout 30 "${py[@]}" "$@" 2>&1 | grep -v '^llama_\|^load\|^print_info\|^create_tensor\|^\.' | tail -3
        echo "rc=${PIPESTATUS[0]}"
    }
    for c in "import llama_cpp" "import onnxruntime" "import llama_cpp; import onnxruntime" \
             "import onnxruntime; import llama_cpp" "import numpy; import llama_cpp; import onnxruntime" \
             "import ctypes; ctypes.CDLL('libgomp.so.1', mode=ctypes.RTLD_GLOBAL); import llama_cpp; import onnxruntime"; do
        probe "$c" -c "$c; print('ok')"
    done >> "$W/results/make.txt"
    for c in lib:libnccl.so.2 lib:libcublasLt.so.13 lib:libcublas.so.13 lib:libcudart.so.13 lib:libcuda.so.1 \
             lib:libgomp.so.1 lib:libggml-base.so.0 lib:libggml-cpu.so.0 lib:libggml-cuda.so.0 ort-first-load edgespec-onnx; do
        probe "imports.py $c" benchmarks/device/imports.py "$c" "$W/models/qwen0.5b.gguf"
    done >> "$W/results/make.txt"
    command -v cuda-gdb > /dev/null || { fail "imports: no cuda-gdb for a backtrace"; return 0; }
    { echo "== cuda-gdb: import llama_cpp; import onnxruntime"
      run 60 "${OWN[@]}" cuda-gdb -q -batch -ex run -ex bt -ex "info sharedlibrary" \
          --args "$W/venv/bin/python" -P -c "import llama_cpp; import onnxruntime" 2>&1 | grep -v "^\[New Thread\|^\[Thread" | tail -120
      echo "== ldd"; ldd "$W"/venv/lib/python3.12/site-packages/llama_cpp/lib/libggml-cpu.so \
          "$(python3 -c 'import site; print(site.getsitepackages()[0])')"/onnxruntime/capi/onnxruntime_pybind11_state*.so
    } >> "$W/results/make.txt" 2>&1
    tail -150 "$W/results/make.txt"
}

# The GPU tests on what stage_make installed (-P: edgespec from the venv, not ./); GPU_TESTS: a
# few of them (pytest node ids, space-separated), by default all.
stage_maketests() { gpu_tests maketests.txt "${OWN[@]}" "$W/venv/bin/python" -P; }

# Where each placement's RAM goes, phase by phase, against its plan (ram.py: a GPU
# request's RSS was once well above its plan). Named engine-ram-* so that collect
# brings them back with the engine results.
stage_ram() {
    local m="$W/models" d=(--drafter "$W/models/qwen0.5b.gguf") c
    for c in "gpu-1.5b gpu $m/qwen1.5b.gguf ${d[*]}" "gpu-7b gpu $m/qwen7b.gguf ${d[*]}" \
             "offload-7b offload $m/qwen7b.gguf ${d[*]} --vram-budget 1744" "draft-gpu-7b draft-gpu $m/qwen7b.gguf ${d[*]}" \
             "gpu-1.5b-suffix gpu $m/qwen1.5b.gguf" "cpu-7b cpu $m/qwen7b.gguf" \
             "cpu-7b-t2 cpu $m/qwen7b.gguf --threads 2" "draft-gpu-1.5b draft-gpu $m/qwen1.5b.gguf ${d[*]}"; do
        set -- $c
        local name=$1; shift
        [[ -f "$W/results/engine-ram-$name.json" ]] && continue
        run 60 python3 benchmarks/device/ram.py "$@" > "$W/results/engine-ram-$name.json.part" \
            && mv "$W/results/engine-ram-$name.json.part" "$W/results/engine-ram-$name.json"
    done
}

# The drafter's Python per logits row on this machine's CPU, before any build: rows of the real
# 0.5B saved on the development VM (ROWS=, `logits_rows.py --save`), timed by logits_rows.py with
# an empty llama_cpp module in place of the package edgespec imports first (nothing here uses it)
stage_rows() {
    [[ -f "${ROWS:-}" ]] || { fail "rows: ROWS names no file"; return 1; }
    run 30 python3 -c 'import importlib.machinery, runpy, sys, types
stub = types.ModuleType("llama_cpp"); stub.__spec__ = importlib.machinery.ModuleSpec("llama_cpp", None)
sys.modules["llama_cpp"] = stub
sys.argv = ["logits_rows.py", "--load", sys.argv[1]]
runpy.run_path("benchmarks/logits_rows.py", run_name="__main__")' "$ROWS" > "$W/results/engine-rows.json"
    cat "$W/results/engine-rows.json"
}

stage_clones() {
    run 60 python3 benchmarks/device/measure.py clones .device/headers "$W/models"
    ls -la "$W/models"
}

stage_diag() {
    local s
    for s in raw-auto raw-numpy-first backend-llama-first; do
        run 20 python3 benchmarks/device/diag.py $s "$W/models/qwen0.5b.gguf"
    done
}

stage_numpy() {  # why a model load dies when numpy was imported first (edgespec/llama/__init__.py)
    local M="$W/models/qwen0.5b.gguf" D=benchmarks/device/diag.py
    { for s in raw-numpy-first maps preload-ggml; do run 20 python3 $D $s "$M"; echo "$s rc=$?"; done
      CUDA_VISIBLE_DEVICES= run 20 python3 $D raw-numpy-first "$M"; echo "no-cuda-device rc=$?"
      OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 run 20 python3 $D raw-numpy-first "$M"; echo "one-thread rc=$?"
      command -v gdb && run 60 gdb -batch -ex run -ex bt --args python3 $D raw-numpy-first "$M" 2>&1 | tail -40
    } > "$W/results/numpy.txt" 2>&1
    cat "$W/results/numpy.txt" | tail -60
}

stage_modes() {  # the engine end to end in each placement mode
    run 60 python3 benchmarks/device/engine_modes.py "$W/models" "$W/results/engine-modes.json"
}

stage_overlap() {  # drafting beside verification: micro timings per placement, then end to end
    run 60 python3 benchmarks/device/overlap.py "$W/models" "$W/results/engine-overlap.json"
}

stage_trees() {  # best-first model-tree steps: the search's costs, then the engine per placement
    run 60 python3 benchmarks/device/tree_steps.py "$W/models" "$W/results/engine-trees.json"
}

stage_gputests() { gpu_tests gputests.txt python3; }  # tests marked gpu, on the clones

# gpu_tests OUT PYTHON...: the tests marked gpu on the clones (GPU_TESTS, else tests/test_gpu.py)
# under the interpreter PYTHON... names, into results/OUT. edgespec first: it orders llama.cpp,
# numpy and onnxruntime (edgespec/llama/__init__.py); the image's pytest (with its plugins) loads
# numpy before conftest does, and on 2026-11-26 `python3 -m pytest` died at the first model load
# (edgespec/llama/__init__.py)
gpu_tests() {
    local out="$W/results/$1"; shift
    EDGESPEC_GPU_MODELS="$W/models" EDGESPEC_HOME="$W/home" run 60 "$@" -c 'import edgespec, sys, pytest
print("edgespec from", edgespec.__file__)
sys.exit(pytest.main(["-q", "-m", "gpu", "-p", "no:cacheprovider", "--durations=5", *sys.argv[1:]]))' \
        ${GPU_TESTS:-tests/test_gpu.py} > "$out" 2>&1
    tail -30 "$out"
}

stage_curves() {
    local c
    for c in gpu-7b gpu-1.5b gpu-0.5b offload-7b cpu-0.5b cpu-1.5b cpu-7b offload-7b-no-op-offload; do
        curve_once "$c" "$W/results/curve-$c.json"
    done
}

stage_beside() {  # the 7B beside the drafter: 4 layers (today's plan) and 3 (beside a 256-sequence tree search)
    local c
    for c in offload-7b-beside-drafter offload-7b-beside-tree-drafter; do curve_once "$c" "$W/results/curve-$c.json"; done
}

# curve_once CONFIG OUT: a curve not measured yet on this machine (GGML_OP_OFFLOAD_MIN_BATCH from
# the caller's environment, read once per process)
curve_once() { measure_once curve "$@"; }
# measure_once CMD CONFIG OUT [ARG...]: measure.py CMD CONFIG MODELS [ARG...] OUT, once per machine
measure_once() { local cmd=$1 config=$2 out=$3; shift 3
    [[ -f "$out.done" ]] || { run 40 python3 benchmarks/device/measure.py "$cmd" "$config" "$W/models" "$@" "$out" \
                              && touch "$out.done"; }; }

stage_floor() {  # target and drafter wholly on the GPU: concurrent graph branches, one CPU
    # thread, and sizes in the order a verifier meets them against one size at a time
    local R="$W/results" c
    for c in gpu-0.5b gpu-7b; do  # -floor: section 1's curves keep their names
        curve_once $c "$R/curve-$c-floor.json"
        GGML_CUDA_GRAPH_OPT=1 curve_once $c "$R/curve-$c-graphopt.json"
        curve_once $c-t1 "$R/curve-$c-t1.json"
        measure_once mixed $c "$R/mixed-$c.json"
        GGML_CUDA_GRAPH_OPT=1 measure_once mixed $c "$R/mixed-$c-graphopt.json"
    done
}

stage_graphopt() {  # concurrent graph branches (GGML_CUDA_GRAPH_OPT=1) with a graph per batch
    # shape, interleaved with the same measurements without them on this machine
    local R="$W/results" c seq=benchmarks/device/sequences/gpu-7b-specbench-30.json
    for c in gpu-0.5b gpu-7b; do
        measure_once mixed $c "$R/mixed-$c$(shape)-again.json"
        GGML_CUDA_GRAPH_OPT=1 measure_once mixed $c "$R/mixed-$c$(shape)-graphopt.json"
    done
    measure_once sequence gpu-7b "$R/sequence-gpu-7b$(shape)-again.json" $seq
    GGML_CUDA_GRAPH_OPT=1 measure_once sequence gpu-7b "$R/sequence-gpu-7b$(shape)-graphopt.json" $seq
}

stage_big() {  # targets wholly on the GPU slow enough for the 0.5B drafter: 14B- and 32B-shaped
    local R="$W/results" m
    for m in 14b 32b; do
        run 60 python3 benchmarks/device/measure.py clones .device/headers "$W/models" qwen$m || continue
        curve_once gpu-$m "$R/curve-gpu-$m.json"
        measure_once mixed gpu-$m "$R/mixed-gpu-$m$(shape).json"
    done
}

stage_graphs() {  # a replay's target decodes timed in its order, and sizes in random order,
    # with the build's CUDA graphs: one per batch shape (patched) or one per context (STOCK_LLAMA=1)
    local R="$W/results" c
    measure_once sequence gpu-7b "$R/sequence-gpu-7b$(shape).json" benchmarks/device/sequences/gpu-7b-specbench-30.json
    for c in gpu-7b gpu-0.5b gpu-1.5b; do measure_once mixed $c "$R/mixed-$c$(shape).json"; done
}

stage_ab() {  # the engine on the 1.5B clone with stock and patched llama.cpp, interleaved on one
    # machine (a rebuild of ggml-cuda.cu between: ~14 s); the build is left patched
    local R="$W/results" i kind
    mkdir -p "$W/stock" && tar xzf ".device/llama_cpp_python-$VERSION.tar.gz" -C "$W/stock" "llama_cpp_python-$VERSION/$CUDA_FILE"
    for i in 1 2; do
        for kind in stock per-shape; do
            if [[ $kind == stock ]]; then cp "$W/stock/llama_cpp_python-$VERSION/$CUDA_FILE" "$CUDA_SRC"
            else python3 native/llama_cpp_patches.py "$SRC" || return 1; fi
            run 40 cmake --build "$W/build" -j 16 --target llama > "$W/rebuild.log" 2>&1 || return 1
            run 30 python3 benchmarks/device/engine_modes.py "$W/models" "$R/engine-ab-$kind-$i.json" gpu-1.5b
        done
    done
}

stage_pinned() {  # the offloaded 7B's weights pinned (no mmap), by op offload threshold; mmap beside
    local c ob R="$W/results"
    for c in offload-7b-beside-drafter offload-7b-beside-drafter-pinned; do curve_once $c "$R/curve-$c.json"; done
    c=offload-7b-beside-drafter-pinned
    for ob in 1 2 4 8 16; do GGML_OP_OFFLOAD_MIN_BATCH=$ob curve_once $c "$R/curve-$c-ob$ob.json"; done
    for c in offload-7b-pinned offload-7b; do curve_once $c "$R/curve-$c.json"; done
}

stage_pinned2() {  # thresholds 2 and 1 again, alternating (one token is noisy on the CPU); 9 layers at 2
    local c=offload-7b-beside-drafter-pinned i ob R="$W/results"
    for i in 2 3; do
        for ob in 2 1; do GGML_OP_OFFLOAD_MIN_BATCH=$ob curve_once $c "$R/curve-$c-ob$ob-$i.json"; done
    done
    GGML_OP_OFFLOAD_MIN_BATCH=2 curve_once offload-7b-pinned "$R/curve-offload-7b-pinned-ob2.json"
}

stage_offload() {  # only the offload placement, e.g. after a change of its layer count
    local c k M="$W/models"
    for c in offload-7b offload-7b-no-op-offload; do
        run 30 python3 benchmarks/device/measure.py curve "$c" "$M" "$W/results/curve-$c.json"
    done
    k=$(python3 benchmarks/device/measure.py third "$M/qwen7b.gguf")
    run 60 "$W/build/bin/llama-bench" -m "$M/qwen7b.gguf" -ngl "$k" -p 1,2,4,8,16,32,64,128,256,512 \
        -n 16 -d 512 -r 2 -t 8 -o json > "$W/results/bench-offload-qwen7b.json"
}

stage_bench() {
    local B="$W/build/bin/llama-bench" M="$W/models" sizes=1,2,4,8,16,32,64,128,256,512 k m
    for m in qwen7b qwen1.5b qwen0.5b; do
        [[ -s "$W/results/bench-gpu-$m.json" ]] && continue
        run 40 "$B" -m "$M/$m.gguf" -ngl 99 -p $sizes -n 32 -d 512 -r 3 -t 8 -o json \
            > "$W/results/bench-gpu-$m.json"
    done
    k=$(python3 benchmarks/device/measure.py third "$M/qwen7b.gguf")
    [[ -s "$W/results/bench-offload-qwen7b.json" ]] || run 60 "$B" -m "$M/qwen7b.gguf" -ngl "$k" \
        -p $sizes -n 16 -d 512 -r 2 -t 8 -o json > "$W/results/bench-offload-qwen7b.json"
    # CPU: depth 0 (a 512-token prefill per test would cost ~10 s each)
    for m in qwen1.5b qwen7b; do
        [[ -s "$W/results/bench-cpu-$m.json" ]] && continue
        run 60 "$B" -m "$M/$m.gguf" -ngl 0 --no-host 1 -nopo 1 -p 1,4,16,64 -n 16 -r 2 -t 8 \
            -o json > "$W/results/bench-cpu-$m.json"
    done
}

stage_spec() {
    local S="$W/build/bin/llama-speculative-simple" M="$W/models" args
    python3 -c 'print("<|im_start|>user\nWrite a Python function that merges two sorted lists, with tests.<|im_end|>\n<|im_start|>assistant\n")' > "$W/prompt.txt"
    # name target n_max p_min: the default p_min (0.75) is what the native peer runs; with
    # random weights it stops drafts early, so p_min 0 gives the cost of full drafts.
    while read -r name target nmax pmin; do
        [[ -s "$W/results/spec-$name.txt" ]] && continue
        args=(-m "$M/$target.gguf" -md "$M/qwen0.5b.gguf" -ngl 99 -ngld 99 -f "$W/prompt.txt"
              -n 256 -c 4096 -b 4096 -ub 512 -fa on -t 8 -tb 8 -td 8 -tbd 8 --temp 0 --top-k 1
              --seed 0 --spec-type draft-simple --spec-draft-n-max "$nmax")
        [[ $pmin == default ]] || args+=(--spec-draft-p-min "$pmin")
        echo "${S##*/} ${args[*]}" > "$W/results/spec-$name.txt"
        run 30 "$S" "${args[@]}" >> "$W/results/spec-$name.txt" 2>&1
    done <<'LIST'
1.5b-n4 qwen1.5b 4 default
1.5b-n4-p0 qwen1.5b 4 0
1.5b-n16-p0 qwen1.5b 16 0
7b-n4-p0 qwen7b 4 0
14b-n4-p0 qwen14b 4 0
32b-n4-p0 qwen32b 4 0
LIST
}

# -- the real Qwen2.5-Coder 1.5B + 0.5B (benchmarks/device/slices.sh) ------------------------------
# Call 1: `run.sh start` builds both in the background: the Makefile's `make GPU=cuda` venv for
# edgespec and, from the same patched source, llama.cpp's own binaries for the native peers.
# Then one call per slice: `run.sh receive`. Then `run.sh models real` (again until done).
REAL=(qwen2.5-coder-1.5b qwen2.5-coder-0.5b)
HOME_ES="$W/home"

stage_start() {
    mkdir -p "$W/bg"
    # The builds run from a copy of this tree: the next call's tree no longer has .device (its
    # wheels are gone by the time the make build's pip runs).
    [[ -d "$W/repo/.device" ]] || { rm -rf "$W/repo" && cp -a "$ROOT" "$W/repo"; }
    cd "$W/repo" || return 1
    # (if, not ||: a backgrounded list would keep this call's output open until the build ends)
    if [[ ! -f "$W/venv/.installed-cuda" ]]; then
        BUDGET_S=1500 OUT="$W/bg/make" setsid nohup bash benchmarks/device/run.sh makebuild > "$W/bg/make.log" 2>&1 < /dev/null &
    fi
    if [[ ! -f "$W/bg/test-backend-ops.o" ]]; then  # llama.cpp's op tests, for stage_topk
        mkdir -p "$W/tbo" && tar xzf "$ROOT/.device/llama_cpp_python-$VERSION.tar.gz" -C "$W/tbo" --wildcards \
            '*/vendor/llama.cpp/tests/test-backend-ops.cpp' '*/vendor/llama.cpp/ggml/include/*'
        local v="$W/tbo/llama_cpp_python-$VERSION/vendor/llama.cpp"
        setsid nohup bash -c "g++ -O1 -std=c++17 -I$v/ggml/include -c $v/tests/test-backend-ops.cpp \
            -o $W/bg/tbo.o && mv $W/bg/tbo.o $W/bg/test-backend-ops.o" > "$W/bg/tbo.log" 2>&1 < /dev/null &
    fi
    if [[ ! -x "$W/build/bin/llama-speculative-simple" && ${PEERS:-1} == 1 ]]; then  # PEERS=0: no native peers
        BUDGET_S=1500 OUT="$W/bg/out" setsid nohup bash benchmarks/device/run.sh build > "$W/bg/build.log" 2>&1 < /dev/null &
    fi
    cd "$ROOT" && echo started
}
stage_makebuild() { make_venv; }

stage_receive() {  # the slice folders this call carried
    mkdir -p "$W/slices" && cp -n .slices/*/*.part* "$W/slices/" && ls "$W/slices" | wc -l
}

stage_models() {  # joined, size and sha256 checked against models/*.json before anything reads them
    mkdir -p "$HOME_ES/models" "$HOME_ES/peers"
    ln -sfn "$W/build/bin" "$HOME_ES/peers/bin"
    local m file
    for m in "${REAL[@]}"; do
        file=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["file"])' "models/$m.json")
        [[ -s "$HOME_ES/models/$file" ]] && continue
        cat "$W/slices/$file".part* > "$HOME_ES/models/$file.joining"
        python3 - "models/$m.json" "$HOME_ES/models/$file.joining" <<'PY' || { fail "models: $m corrupt"; return 1; }
import hashlib, json, os, sys
m = json.load(open(sys.argv[1])); h = hashlib.sha256()
with open(sys.argv[2], "rb") as f:
    for block in iter(lambda: f.read(1 << 24), b""):
        h.update(block)
ok = os.path.getsize(sys.argv[2]) == m["size"] and h.hexdigest() == m["sha256"]
print(m["name"], "size and sha256", "match" if ok else "DO NOT MATCH the manifest")
sys.exit(0 if ok else 1)
PY
        mv "$HOME_ES/models/$file.joining" "$HOME_ES/models/$file"
    done
}

wait_for() {  # wait_for FILE SECONDS: until FILE exists (a background build's product)
    local t=0
    while [[ ! -e "$1" ]] && (( t < $2 )); do sleep 5; t=$((t + 5)); done
    [[ -e "$1" ]] || { fail "not built: $1"; tail -20 "$W"/bg/*.log; return 1; }
}

# real NAME SECONDS_NEEDED BENCH_ARGS...: one `edgespec bench` on the real pair, skipped once done
ENVS=()  # environment edits for real's runs, in env's syntax (stage_sizes)
real() {
    local name=$1 need=$2; shift 2
    [[ -s "$W/results/real-$name.json" ]] && return
    run "$need" env "${OWN[@]}" "${ENVS[@]}" EDGESPEC_HOME="$HOME_ES" PATH="$W/build/bin:$PATH" "$W/venv/bin/edgespec" bench \
        --model qwen2.5-coder-1.5b --threads 8 --share-prefill --json "$W/results/real-$name.json" \
        --markdown "$W/results/real-$name.md" "$@" > "$W/results/real-$name.log" 2>&1 \
        || { tail -5 "$W/results/real-$name.log"; return 1; }
    tail -25 "$W/results/real-$name.md"
}

stage_real() {
    wait_for "$W/venv/.installed-cuda" 420 || return 1
    wait_for "$W/build/bin/llama-speculative-simple" 120
    local es=(env "${OWN[@]}" EDGESPEC_HOME="$HOME_ES" "$W/venv/bin/edgespec") m
    for m in "${REAL[@]}"; do "${es[@]}" models pull "$m" > /dev/null || fail "models pull $m"; done
    # output argmax (native/llama_cpp_patches.py): the GPU's picks against the host's argmax
    [[ -s "$W/results/real-argmax-check.json" ]] || run 90 env "${OWN[@]}" EDGESPEC_HOME="$HOME_ES" \
        "$W/venv/bin/python" benchmarks/device/argmax_check.py qwen2.5-coder-1.5b "$W/results/real-argmax-check.json" \
        gpu > "$W/results/real-argmax-check.log" 2>&1; tail -3 "$W/results/real-argmax-check.log"
    [[ -s "$W/results/real-profile.json" ]] || run 120 env "${OWN[@]}" EDGESPEC_HOME="$HOME_ES" \
        "$W/venv/bin/python" benchmarks/device/profile_step.py qwen2.5-coder-1.5b "$W/results/real-profile.json" gpu
    local peers=peer:llama.cpp-plain,peer:llama.cpp-draft sb=(--suite specbench --split test) ce=(--suite code-edit-test)
    { "${es[@]}" plan --model qwen2.5-coder-1.5b --draft auto --placement offload --vram-budget 1400MiB
      "${es[@]}" plan --model qwen2.5-coder-1.5b --draft auto --vram-budget 900MiB; } > "$W/results/real-plans.txt" 2>&1
    real gpu-specbench 90 "${sb[@]}" --limit 2 --max-tokens 256 --placement gpu --configs plain,suffix,auto,$peers
    real gpu-codeedit 90 "${ce[@]}" --limit 2 --max-tokens 256 --placement gpu --configs plain,suffix,auto,$peers
    real gpu-codeedit-host-greedy 60 "${ce[@]}" --limit 2 --max-tokens 256 --placement gpu --no-backend-greedy \
        --configs plain,suffix,auto
    real draft-gpu-specbench 150 "${sb[@]}" --limit 1 --max-tokens 128 --placement draft-gpu --configs plain,suffix,auto,$peers
    real budget-900-specbench 90 "${sb[@]}" --limit 1 --max-tokens 128 --vram-budget 900MiB --configs plain,auto,$peers
    real overlap-specbench 120 "${sb[@]}" --limit 1 --max-tokens 128 --placement overlap --configs plain,auto,$peers
    real draft-gpu-codeedit 120 "${ce[@]}" --limit 1 --max-tokens 128 --placement draft-gpu --configs plain,suffix,auto,$peers
    real gpu-specbench-host-greedy 60 "${sb[@]}" --limit 2 --max-tokens 256 --placement gpu --no-backend-greedy \
        --configs plain,suffix,auto
    # what auto decided there, step by step, and what its calibration measured (auto_diag.py)
    [[ -s "$W/results/real-auto-diag.json" ]] || run 150 env "${OWN[@]}" EDGESPEC_HOME="$HOME_ES" \
        "$W/venv/bin/python" benchmarks/device/auto_diag.py qwen2.5-coder-1.5b "$W/results/real-auto-diag.json" \
        gpu 8 1 256 > "$W/results/real-auto-diag.log" 2>&1 || tail -20 "$W/results/real-auto-diag.log"
}

# `auto` priced with the plain step that follows each verification (calibrate.py): host time per
# step where it drafts little, Spec-Bench on two held-out splits and code edits, and its choices
stage_trip() {
    wait_for "$W/venv/.installed-cuda" 420 || return 1
    local es=(env "${OWN[@]}" EDGESPEC_HOME="$HOME_ES" "$W/venv/bin/edgespec") m py=(env "${OWN[@]}" EDGESPEC_HOME="$HOME_ES" "$W/venv/bin/python")
    for m in "${REAL[@]}"; do "${es[@]}" models pull "$m" > /dev/null || fail "models pull $m"; done
    [[ -s "$W/results/real-trip-profile.json" ]] || run 90 "${py[@]}" benchmarks/device/profile_step.py qwen2.5-coder-1.5b \
        "$W/results/real-trip-profile.json" gpu 8 256 --draft auto --suite specbench \
        --categories translation,qa,math_reasoning,multi_turn --limit 1 --no-warm > "$W/results/real-trip-profile.log" 2>&1
    local sb=(--suite specbench --limit 2 --max-tokens 256 --placement gpu --configs plain,suffix,auto)
    real trip-gpu-specbench 90 "${sb[@]}" --split test
    real trip-gpu-codeedit 90 --suite code-edit-test --limit 2 --max-tokens 256 --placement gpu --configs plain,suffix,auto
    real trip-gpu-specbench-test2 90 "${sb[@]}" --split test2
    [[ -s "$W/results/real-trip-auto-diag.json" ]] || run 150 "${py[@]}" benchmarks/device/auto_diag.py qwen2.5-coder-1.5b \
        "$W/results/real-trip-auto-diag.json" gpu 8 1 256 > "$W/results/real-trip-auto-diag.log" 2>&1 \
        || tail -20 "$W/results/real-trip-auto-diag.log"
    real trip-budget-900-specbench 90 --suite specbench --split test --limit 1 --max-tokens 128 --vram-budget 900MiB \
        --configs plain,auto
}

stage_graphtiming() {  # where a change of batch shape spends its host time (graph_timing.py),
    # on run.sh build's llama.cpp, its llama-context.cpp timed and rebuilt: as built, then with
    # graphs kept by size (placements.GRAPH_SIZES)
    [[ -s "$W/results/real-graph-timing-sizes.json" ]] && return
    wait_for "$W/build/bin/llama-speculative-simple" 300 && stage_install || return 1
    python3 benchmarks/device/graph_timing.py patch "$SRC" || { fail "graph timing patch"; return 1; }
    run 120 cmake --build "$W/build" -j 16 --target llama > "$W/rebuild.log" 2>&1 || { tail -20 "$W/rebuild.log"; return 1; }
    local sizes k target="$HOME_ES/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    sizes=$(python3 -c 'from edgespec.memory.placements import GRAPH_SIZES as s; print(",".join(map(str, s)))')
    for k in "" -sizes; do
        [[ $k ]] && export LLAMA_GRAPH_SIZES=$sizes
        run 60 python3 benchmarks/device/graph_timing.py run "$target" "$W/results/real-graph-timing$k.json" \
            > "$W/results/real-graph-timing$k.log" 2>&1
        unset LLAMA_GRAPH_SIZES
    done
    tail -20 "$W/results/real-graph-timing-sizes.log"
}

# Graphs kept by batch size (native/llama_cpp_patches.py) and batches padded to those sizes
# (edgespec.llama.backend.padded_size), on by default for a drafted target wholly on the GPU:
# plain, suffix and `auto` with them off (LLAMA_GRAPH_SIZES=0), on (the default) or dense (1..9,17..65; ARMS picks),
# alternating, on the real pair (SETS: which; REPEATS: how many times each), and the GPU's memory
# in use sampled every 100 ms during each run
stage_sizes() {
    wait_for "$W/venv/.installed-cuda" 420 || return 1
    local es=(env "${OWN[@]}" EDGESPEC_HOME="$HOME_ES" "$W/venv/bin/edgespec") m arm i set name
    for m in "${REAL[@]}"; do "${es[@]}" models pull "$m" > /dev/null || fail "models pull $m"; done
    local common=(--limit 2 --max-tokens 256 --placement gpu --configs plain,suffix,auto)
    for i in $(seq 1 "${REPEATS:-2}"); do
        for arm in ${ARMS:-off on}; do
            for set in ${SETS:-specbench:test code-edit-test}; do
                name="sizes$arm-$i-gpu-${set/:/-}"
                [[ -s "$W/results/real-$name.json" ]] && continue
                nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 \
                    > "$W/results/real-$name.vram" 2>/dev/null & local smi=$!
                case $arm in
                    off) ENVS=(LLAMA_GRAPH_SIZES=0) ;;
                    dense) ENVS=(LLAMA_GRAPH_SIZES=1,2,3,4,5,6,7,8,9,17,25,33,41,49,57,65) ;;
                    *) ENVS=(-u LLAMA_GRAPH_SIZES) ;;
                esac
                if [[ $set == *:* ]]; then
                    real "$name" 90 --suite "${set%%:*}" --split "${set#*:}" "${common[@]}"
                else
                    real "$name" 90 --suite "$set" "${common[@]}"
                fi
                ENVS=()
                kill $smi 2>/dev/null; wait $smi 2>/dev/null
                echo "peak MiB: $(sort -n "$W/results/real-$name.vram" | tail -1)" >> "$W/results/real-$name.log"
            done
        done
    done
}

# draft-gpu's CPU target with edgespec's CPU kernels (native/qmatmul: a make build started with
# KERNELS=1 carries them) and with llama.cpp's (the CPU backend of run.sh build: the same source
# without native/qmatmul), arms in turn on the real pair; then the costs of n-token decodes of the
# CPU target with each
stage_kernels() {
    wait_for "$W/venv/.installed-cuda" 420 || return 1
    wait_for "$W/build/bin/llama-speculative-simple" 300 || return 1
    local es=(env "${OWN[@]}" EDGESPEC_HOME="$HOME_ES" "$W/venv/bin/edgespec") m arm f lib stock
    local py=(env "${OWN[@]}" EDGESPEC_HOME="$HOME_ES" "$W/venv/bin/python")
    for m in "${REAL[@]}"; do "${es[@]}" models pull "$m" > /dev/null || fail "models pull $m"; done
    lib=$("${py[@]}" -c 'import llama_cpp, pathlib; print(pathlib.Path(llama_cpp.__file__).parent / "lib")')
    stock=$(find "$W/build" -name 'libggml-cpu.so*' -type f | head -1)
    for f in "$lib"/libggml-cpu.so*; do
        [[ $f == *.edgespec || -e $f.edgespec ]] || cp "$f" "$f.edgespec"
    done
    for arm in ${ARMS:-edgespec stock}; do
        for f in "$lib"/libggml-cpu.so*; do
            [[ $f == *.edgespec ]] && continue
            if [[ $arm == stock ]]; then cp "$stock" "$f"; else cp "$f.edgespec" "$f"; fi
        done
        "${es[@]}" doctor 2>&1 | grep -A1 "CPU kernels" | tee "$W/results/real-kernels-$arm-doctor.txt"
        real "kernels-$arm-draft-gpu-specbench" 150 --suite specbench --split test --limit 1 --max-tokens 128 \
            --placement draft-gpu --configs plain,suffix,auto
        real "kernels-$arm-draft-gpu-codeedit" 120 --suite code-edit-test --limit 1 --max-tokens 128 \
            --placement draft-gpu --configs plain,suffix,auto
        [[ -s "$W/results/real-kernels-$arm-diag.json" ]] || run 120 "${py[@]}" benchmarks/device/auto_diag.py \
            qwen2.5-coder-1.5b "$W/results/real-kernels-$arm-diag.json" draft-gpu 8 1 64 \
            > "$W/results/real-kernels-$arm-diag.log" 2>&1 || tail -20 "$W/results/real-kernels-$arm-diag.log"
    done
    for f in "$lib"/libggml-cpu.so*.edgespec; do cp "$f" "${f%.edgespec}"; done
}

# Where a step's host time goes on the gpu placement (profile_step.py, its parts), then the
# placement end to end: code edits (suffix's steps) and Spec-Bench's low-acceptance categories (auto)
stage_host() {
    wait_for "$W/venv/.installed-cuda" 420 || return 1
    local es=(env "${OWN[@]}" EDGESPEC_HOME="$HOME_ES" "$W/venv/bin/edgespec") m py=(env "${OWN[@]}" EDGESPEC_HOME="$HOME_ES" "$W/venv/bin/python")
    for m in "${REAL[@]}"; do "${es[@]}" models pull "$m" > /dev/null || fail "models pull $m"; done
    # the step's Python alone (llama_decode a no-op, each row's pick from the answer decoded first)
    local d suite
    for d in suffix:code-edit-test auto:specbench plain:specbench; do
        suite=${d#*:} d=${d%%:*}
        [[ -s "$W/results/real-host-replay-$d.json" ]] || run 60 "${py[@]}" benchmarks/host_replay.py \
            "$W/results/real-host-replay-$d.json" --model qwen2.5-coder-1.5b --placement gpu --threads 8 \
            --draft "$d" --suite "$suite" $([[ $suite == specbench ]] && echo --categories translation,qa,math_reasoning,multi_turn) \
            > "$W/results/real-host-replay-$d.log" 2>&1; tail -1 "$W/results/real-host-replay-$d.log"
    done
    [[ -s "$W/results/real-host-profile.json" ]] || run 90 "${py[@]}" benchmarks/device/profile_step.py qwen2.5-coder-1.5b \
        "$W/results/real-host-profile.json" gpu > "$W/results/real-host-profile.log" 2>&1
    [[ -s "$W/results/real-host-profile-auto.json" ]] || run 90 "${py[@]}" benchmarks/device/profile_step.py \
        qwen2.5-coder-1.5b "$W/results/real-host-profile-auto.json" gpu 8 256 --draft auto --suite specbench \
        --categories translation,qa,math_reasoning,multi_turn --limit 1 --no-warm > "$W/results/real-host-profile-auto.log" 2>&1
    real host-gpu-codeedit 90 --suite code-edit-test --limit 2 --max-tokens 256 --placement gpu --configs plain,suffix,auto
    real host-gpu-specbench-test2 90 --suite specbench --split test2 --limit 2 --max-tokens 256 --placement gpu \
        --configs plain,suffix,auto
}

# Where a step's host time goes beyond its Python: the CPU threads of a target wholly on the GPU,
# and the step's Python after a wait (spun or slept) as long as a verification's kernels.
stage_hostwait() {
    wait_for "$W/venv/.installed-cuda" 500 || return 1
    local es=(env "${OWN[@]}" EDGESPEC_HOME="$HOME_ES" "$W/venv/bin/edgespec") m t w
    local py=(env "${OWN[@]}" EDGESPEC_HOME="$HOME_ES" "$W/venv/bin/python")
    for m in "${REAL[@]}"; do "${es[@]}" models pull "$m" > /dev/null || fail "models pull $m"; done
    for w in none spin sleep; do
        [[ -s "$W/results/real-hostwait-replay-$w.json" ]] || run 40 "${py[@]}" benchmarks/host_replay.py \
            "$W/results/real-hostwait-replay-$w.json" --model qwen2.5-coder-1.5b --placement gpu --threads 8 \
            --wait $w --wait-ms 5 --repeats 5 > "$W/results/real-hostwait-replay-$w.log" 2>&1
        tail -1 "$W/results/real-hostwait-replay-$w.log"
    done
    for t in 1 8; do
        [[ -s "$W/results/real-hostwait-profile-t$t.json" ]] || run 60 "${py[@]}" benchmarks/device/profile_step.py \
            qwen2.5-coder-1.5b "$W/results/real-hostwait-profile-t$t.json" gpu $t 256 --no-warm \
            > "$W/results/real-hostwait-profile-t$t.log" 2>&1
        tail -1 "$W/results/real-hostwait-profile-t$t.log"
    done
}

# Sampled requests with each verified row's largest logits taken on the GPU (output top-k) and,
# with --no-backend-greedy, with whole rows copied back: the step's profile and bench, each way.
stage_sampled() {
    wait_for "$W/venv/.installed-cuda" 500 || return 1
    local es=(env "${OWN[@]}" EDGESPEC_HOME="$HOME_ES" "$W/venv/bin/edgespec") m s
    local py=(env "${OWN[@]}" EDGESPEC_HOME="$HOME_ES" "$W/venv/bin/python")
    for m in "${REAL[@]}"; do "${es[@]}" models pull "$m" > /dev/null || fail "models pull $m"; done
    for s in code-edit-test specbench; do
        [[ -s "$W/results/real-sampled-profile-$s.json" ]] || run 120 "${py[@]}" benchmarks/device/profile_step.py \
            qwen2.5-coder-1.5b "$W/results/real-sampled-profile-$s.json" gpu 8 256 --temperature 0.7 --suite $s \
            > "$W/results/real-sampled-profile-$s.log" 2>&1
        tail -4 "$W/results/real-sampled-profile-$s.log"
    done
    local sets=("specbench-test2:--suite specbench --split test2" "codeedit:--suite code-edit-test") x
    for x in "${sets[@]}"; do
        real "sampled-gpu-${x%%:*}" 150 ${x#*:} --limit 2 --max-tokens 256 --placement gpu --temperature 0.7 \
            --configs plain,suffix,auto
        real "sampled-gpu-${x%%:*}-rows" 150 ${x#*:} --limit 2 --max-tokens 256 --placement gpu --temperature 0.7 \
            --configs plain,suffix,auto --no-backend-greedy
        ENVS=(GGML_CUDA_TOPK_PER_ROW=1)  # the top k as llama.cpp takes it, row by row
        real "sampled-gpu-${x%%:*}-per-row" 150 ${x#*:} --limit 2 --max-tokens 256 --placement gpu --temperature 0.7 \
            --configs plain,suffix,auto
        ENVS=()
    done
}

# The anchors on this build: llama.cpp's plain decoding and its own speculative decoding with the
# 0.5B draft, beside plain and auto on the gpu placement (held-out Spec-Bench and code edits), and
# the automatic placement under a VRAM budget below the target's size, against plain at that budget.
stage_anchors() {
    wait_for "$W/venv/.installed-cuda" 420 || return 1
    wait_for "$W/build/bin/llama-speculative-simple" 400 || return 1
    local es=(env "${OWN[@]}" EDGESPEC_HOME="$HOME_ES" "$W/venv/bin/edgespec") m
    local peers=peer:llama.cpp-plain,peer:llama.cpp-draft
    for m in "${REAL[@]}"; do "${es[@]}" models pull "$m" > /dev/null || fail "models pull $m"; done
    real anchors-gpu-specbench 150 --suite specbench --split test2 --limit 2 --max-tokens 256 --placement gpu \
        --configs plain,auto,$peers
    real anchors-gpu-codeedit 150 --suite code-edit-test --limit 2 --max-tokens 256 --placement gpu \
        --configs plain,auto,$peers
    real anchors-budget-900 120 --suite specbench --split test2 --limit 1 --max-tokens 128 --vram-budget 900MiB \
        --configs plain,auto,$peers
}

# llama.cpp's own TOP_K tests (tests/test-backend-ops.cpp of the pinned source, compiled by
# stage_start, linked against the make stage's libraries): the patched top k of every row in one
# radix select against the CPU backend, then its times beside llama.cpp's way of taking each row
# on its own (GGML_CUDA_TOPK_PER_ROW=1), for vocabulary-wide rows.
stage_topk() {
    wait_for "$W/venv/.installed-cuda" 500 || return 1
    wait_for "$W/bg/test-backend-ops.o" 120 || return 1
    local lib tbo="$W/test-backend-ops" rows='ne=\[(65000|131072|151936|200000),'
    lib=$(dirname "$(ls "$W"/venv/lib/python3*/site-packages/llama_cpp/lib/libggml.so | head -1)")
    [[ -x $tbo ]] || g++ "$W/bg/test-backend-ops.o" -L"$lib" -lggml -lggml-base -Wl,-rpath,"$lib" -lpthread \
        -o "$tbo" || { fail "link test-backend-ops"; return 1; }
    run 150 "$tbo" test -o TOP_K -b CUDA0 > "$W/results/real-topk-test.txt" 2>&1
    tail -4 "$W/results/real-topk-test.txt"
    run 90 "$tbo" perf -o TOP_K -b CUDA0 -p "$rows" > "$W/results/real-topk-perf.txt" 2>&1
    run 90 env GGML_CUDA_TOPK_PER_ROW=1 "$tbo" perf -o TOP_K -b CUDA0 -p "$rows" \
        > "$W/results/real-topk-perf-per-row.txt" 2>&1
    paste <(grep -o 'TOP_K.*' "$W/results/real-topk-perf.txt") \
          <(grep -o '[0-9.]* us/run' "$W/results/real-topk-perf-per-row.txt") | tail -40
}

collect() {
    set +x
    python3 - "$W/results" "$OUT" <<'PY'
import glob, json, os, sys
res, out = sys.argv[1], sys.argv[2]
def load(pattern):
    d = {}
    for p in sorted(glob.glob(os.path.join(res, pattern))):
        try:
            with open(p) as f:
                # llama.cpp prints the clones' random tokens: not always UTF-8
                d[os.path.basename(p)] = (json.load(f) if p.endswith(".json")
                                          else open(p, errors="replace").read())
        except Exception as e:  # a run cut off mid-write
            d[os.path.basename(p)] = f"unreadable: {e}"
    return d
for name, pattern in (("curves", "curve-*.json"), ("bench", "bench-*.json"), ("spec", "spec-*.txt"),
                      ("engine", "engine-*.json"), ("mixed", "mixed-*.json"), ("sequence", "sequence-*.json"), ("diag", "*tests.txt"), ("make", "make.txt"), ("numpy", "numpy.txt"),
                      ("real", "real-*")):
    found = load(pattern)
    if found:  # only 8 files come back: none spent on an empty one
        with open(os.path.join(out, name + ".json"), "w") as f:
            json.dump(found, f, indent=1)
PY
    python3 benchmarks/device/measure.py table "$W/results" | tee "$OUT/table.txt"
    grep -h "decoded\|n_drafted\|n_accept\|accept " "$W"/results/spec-*.txt 2>/dev/null | tail -20
    cat "$OUT/failures.txt" 2>/dev/null
}

stages=("$@")
[[ " ${stages[*]} " =~ ^(\ (start|receive))+\ $ ]] || trap collect EXIT  # nothing to collect yet
(( ${#stages[@]} )) || stages=(build clones curves bench spec)
stage_env
for s in "${stages[@]}"; do
    case $s in
        build) stage_build && stage_install ;;
        make|maketests|imports|start|makebuild|receive|models|real|trip|graphtiming|sizes|kernels|host|hostwait|sampled|topk|anchors) "stage_$s" ;;  # not run.sh's build
        *) stage_install; "stage_$s" ;;
    esac
done
