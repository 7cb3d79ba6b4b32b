"""Bisects a crash of model loading through llama-cpp-python: diag.py STEP MODEL.gguf.

On the GPU machine (2026-11-26) every load through edgespec.llama.backend died of SIGSEGV in
llama.cpp's print_info (right after "n_layer_all"), with or without edgespec's log
callback, mmap or repacking, while plain llama-cpp-python loads of the same file passed:
what crashes is numpy imported before llama_cpp (raw-numpy-first crashes too).  Each step runs in
its own process (run.sh), so a segfault names its step; a step that passes prints "ok".

raw-*: llama-cpp-python alone (defaults; +mmap; numpy imported first; the backend's struct)
backend-*: edgespec.llama.backend (as is; no mmap; no repacking; llama_cpp imported first)
"""
import sys

step, path = sys.argv[1], sys.argv[2]
if step == "preload-ggml":  # llama.cpp's libraries loaded (globally) before numpy, llama_cpp after
    import ctypes
    import glob
    import os

    for name in ("libggml-base.so", "libggml-cpu.so", "libggml-cuda.so", "libggml.so", "libllama.so"):
        hits = glob.glob(os.path.join(os.environ.get("LLAMA_CPP_LIB_PATH", ""), name))
        if hits:
            ctypes.CDLL(hits[0], mode=ctypes.RTLD_GLOBAL)
    import numpy  # noqa: F401
    step = "raw-auto"
if step in ("raw-numpy-first", "maps"):
    import numpy  # noqa: F401 - the import order is what this step varies
    if step == "maps":  # which shared libraries numpy brought in
        with open("/proc/self/maps") as f:
            print("\n".join(sorted({ln.split()[-1] for ln in f if ".so" in ln})))
        step = "raw-numpy-first"
if step == "backend-llama-first":
    import llama_cpp  # noqa: F401
if step.startswith("raw"):
    import llama_cpp as lc

    lc.llama_backend_init()
    p = lc.llama_model_default_params()
    if step == "raw-struct":
        from edgespec.llama import backend
        p = backend.model_struct(backend.ModelParams(n_gpu_layers=999))
    if step == "raw-mmap":
        p.load_mode = lc.LLAMA_LOAD_MODE_MMAP
    p.n_gpu_layers = 999
    print(step, "load_mode", p.load_mode, "extra", p.use_extra_bufts, flush=True)
    assert lc.llama_model_load_from_file(path.encode(), p)
else:
    from edgespec.llama import backend

    mp = {"backend-nomap": backend.ModelParams(n_gpu_layers=999, use_mmap=False),
          "backend-norepack": backend.ModelParams(n_gpu_layers=999, repack=False)}.get(
        step, backend.ModelParams(n_gpu_layers=999))
    model = backend.LlamaModel(path, mp)
    ctx = backend.LlamaContext(model, backend.ContextParams(n_ctx=1024, n_threads=8))
    assert ctx.decode([1, 2, 3], [0, 1, 2], [[0]] * 3, [True] * 3).shape == (3, model.n_vocab)
print(step, "ok", flush=True)
