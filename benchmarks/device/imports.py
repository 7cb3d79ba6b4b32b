"""Bisects the SIGSEGV of `import onnxruntime` beside llama.cpp's CUDA build: imports.py STEP MODEL,
each step in its own process (edgespec/llama/__init__.py); a step that survives prints "ok".

lib:NAME        one library loaded first (libggml-* from LLAMA_LIBS, default run.sh's venv), then onnxruntime
ort-first-load  onnxruntime (and its numpy) first, then llama.cpp and MODEL loaded on the GPU
edgespec-onnx   edgespec first (its own import order), then onnxruntime
"""
import ctypes
import os
import sys

step, model = sys.argv[1], sys.argv[2]
LIBS = os.environ.get("LLAMA_LIBS", "/tmp/es/venv/lib/python3.12/site-packages/llama_cpp/lib")
if step.startswith("lib:"):
    name = step[4:]
    ctypes.CDLL(os.path.join(LIBS, name) if name.startswith("libggml") else name)
    import onnxruntime  # isort: skip
elif step == "ort-first-load":
    import onnxruntime  # isort: skip
    import llama_cpp as lc  # isort: skip

    lc.llama_backend_init()
    p = lc.llama_model_default_params()
    p.n_gpu_layers = 99
    assert lc.llama_model_load_from_file(model.encode(), p)
elif step == "edgespec-onnx":
    import edgespec  # noqa: F401  isort: skip
    import onnxruntime  # noqa: F401  isort: skip
print("ok", step)
