# Two commands for a fresh machine (Python >= 3.10 and a C compiler):
#   make demo   - create .venv, install edgespec, pull the default models, generate, show stats
#   make test   - the same set-up, then the whole test suite (real llama.cpp, real models)
# GPU=cuda (e.g. `make demo GPU=cuda`, needs the CUDA toolkit's nvcc) builds llama.cpp with CUDA
# instead, from the pinned source with edgespec's patches (native/llama_cpp_patches.py): the GPU
# placement modes (gpu, offload, draft-gpu) need it.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
EDGESPEC := $(BIN)/edgespec
# The multimodal library of llama-cpp-python is not used: skip building it. AMX is off: on the
# development VMs the CPU reports AMX tiles but the first AMX kernel dies with SIGILL (the
# hypervisor does not enable the tile state), so every decode crashed with a native build.
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
GPU ?= cpu
ifeq ($(GPU),cuda)
# The native GPU generation only (smaller, faster to build); one flash-attention variant set.
GPU_CMAKE := -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=native
else ifneq ($(GPU),cpu)
$(error GPU must be cpu or cuda, not $(GPU))
endif
# LLAMA_CMAKE: more of llama.cpp's CMake options for a GPU build's wheel (benchmarks/device/run.sh
# passes -DGGML_CPU_BATCH_INVARIANT=ON with native/qmatmul applied to the source).
export CMAKE_ARGS ?= -DLLAVA_BUILD=OFF -DCMAKE_C_FLAGS="$(NO_AMX)" -DCMAKE_CXX_FLAGS="$(NO_AMX)" $(GPU_CMAKE) $(LLAMA_CMAKE)
NPROC := $(shell nproc 2>/dev/null || echo 2)
export CMAKE_BUILD_PARALLEL_LEVEL ?= $(NPROC)
# Bytecode is written even where the environment says PYTHONDONTWRITEBYTECODE: the tests start
# many Python children (commands, servers, fresh interpreters), and each would compile edgespec
# and what it imports afresh (edgespec alone: ~0.2 s a child).
unexport PYTHONDONTWRITEBYTECODE

DEMO_MODELS := qwen2.5-coder-1.5b qwen2.5-coder-0.5b
TEST_MODELS := $(DEMO_MODELS) smollm2-135m gemma3-270m

.PHONY: demo test install models test-models clean

# pip and the build backends go in with the interpreter's own pip where it has `--python` (pip
# 22.3+): 3 s, against 6.5 for the venv's bundled pip and its upgrade; else that way. The install
# runs without build isolation, so llama-cpp-python's backend (scikit-build-core) must be here too:
# where pip has no built wheel of it cached, it builds from its source archive.
BUILD_TOOLS := pip "setuptools>=70.1" wheel "scikit-build-core[pyproject]>=0.9.2"
$(BIN)/python:
	$(PYTHON) -m venv --without-pip $(VENV)
	$(PYTHON) -m pip --python $(BIN)/python install --quiet --no-compile --upgrade $(BUILD_TOOLS) 2>/dev/null \
		|| ($(BIN)/python -m ensurepip && $(BIN)/python -m pip install --quiet --no-compile --upgrade $(BUILD_TOOLS))

# --no-compile: pip would compile every file of every dependency (20 of its 42 s here); a module
# is compiled when first imported instead, and its bytecode kept (PYTHONDONTWRITEBYTECODE below).
# --no-build-isolation: the venv has the build backend already (4 s less).
$(VENV)/.installed: $(BIN)/python pyproject.toml setup.py $(wildcard native/*.c)
	$(BIN)/python -m pip install --no-compile --no-build-isolation -e '.[test]'
	touch $@

# A CUDA build of the pinned llama-cpp-python from its source archive, never pip's cached CPU
# wheel, with edgespec's llama.cpp patches (native/llama_cpp_patches.py: one CUDA graph per batch
# shape) applied first. Its CPU backend stays llama.cpp's: on an H200 host's Xeon (AVX-512) the
# CPU kernels (native/qmatmul) made draft-gpu's one-token decodes of the 1.5B 5-15% slower
# (though its speculation up to 17% faster).
LLAMA_SRC := build/llama-cpp-python
$(LLAMA_SRC)/.patched: $(BIN)/python pyproject.toml native/llama_cpp_patches.py
	rm -rf $(LLAMA_SRC) && mkdir -p $(LLAMA_SRC)
	$(BIN)/python -m pip download --quiet --no-deps --no-binary :all: --dest $(LLAMA_SRC) \
		"$$(grep -o 'llama-cpp-python==[0-9.]*' pyproject.toml)"
	tar xzf $(LLAMA_SRC)/llama_cpp_python-*.tar.gz -C $(LLAMA_SRC)
	$(BIN)/python native/llama_cpp_patches.py $(LLAMA_SRC)/llama_cpp_python-*/
	touch $@

$(VENV)/.installed-cuda: $(VENV)/.installed $(LLAMA_SRC)/.patched
	$(BIN)/python -m pip install --no-cache-dir --force-reinstall --no-deps $(LLAMA_SRC)/llama_cpp_python-*/
	touch $@

# The CPU build's CPU backend with qmatmul (native/qmatmul): a verification batch of n tokens
# reads the weights once (2 tokens: 1.2x one token's time, stock 1.7x) and each row keeps the
# one-token decode's bits. Only that library is built (about a minute on 2 cores, once per
# machine: it is cached outside the tree) and copied over the wheel's.
$(VENV)/.installed-qmatmul: $(VENV)/.installed native/llama_cpp_patches.py $(wildcard native/qmatmul/*.[ch] native/qmatmul/*.py)
	$(BIN)/python native/qmatmul/install_cpu.py
	touch $@

install: $(VENV)/.installed $(if $(filter cuda,$(GPU)),$(VENV)/.installed-cuda,$(VENV)/.installed-qmatmul)

models: install
	@$(EDGESPEC) models pull $(DEMO_MODELS)

test-models: install
	@$(EDGESPEC) models pull $(TEST_MODELS)

demo: models
	$(EDGESPEC) doctor
	$(EDGESPEC) run --model qwen2.5-coder-1.5b --temperature 0 --max-tokens 128 \
		"Write a Python function that checks whether a string is a palindrome."

# The tests in two steps (docs/testing.md): all but a few on two workers, each llama.cpp process
# held to one thread (OMP_THREAD_LIMIT), every worker running the tests that load no model before
# the others; then alone, with llama.cpp's own thread count, the few timed against a child's
# progress and the GPU tests. Both steps run; the target fails if either failed.
test: test-models
	@rc=0; \
	OMP_THREAD_LIMIT=1 $(BIN)/python -m pytest -q -m "not serial and not gpu" -n 2 --dist loadgroup || rc=1; \
	$(BIN)/python -m pytest -q -m "serial or gpu" || rc=1; \
	exit $$rc

clean:
	rm -rf $(VENV) build *.egg-info edgespec/*.so
