"""The only package that imports llama_cpp: models, contexts, the memory probe and the in-process peer.

llama_cpp is imported here, first: on the GPU machine (run.sh's CUDA build, numpy 2.x wheels
bundling libgfortran/libquadmath/OpenBLAS) every model load died of SIGSEGV in llama.cpp's
print_info when numpy had been loaded before llama.cpp's libraries, and never the other way round
(benchmarks/device/diag.py; RESULTS-gpu.md). ``import edgespec`` comes here before anything else.

One library goes before it: onnxruntime, where llama.cpp is a CUDA build. On that machine, with
llama-cpp-python built by `make GPU=cuda`, importing onnxruntime after libggml-cuda was loaded
died in onnxruntime's module initialisation (SIGSEGV; "free(): invalid pointer" with libggml-cuda
alone preloaded), so `edgespec doctor` and `--draft onnx` crashed. onnxruntime (and the numpy it
imports) first, then GPU model loads, the CLI and the GPU tests passed on that build, where
numpy first did not crash
(benchmarks/device/imports.py, RESULTS-gpu.md section 19). A CPU build keeps onnxruntime's
import (~50 ms, ~20 MiB) for when an ONNX drafter is used.
"""
import importlib.util
import os
from pathlib import Path

from edgespec.llama.kernels import set_op_offload_min_batch  # no llama_cpp, no numpy


def _cuda_build() -> bool:
    """Whether the llama.cpp that llama_cpp will load has the CUDA backend (found without loading it)."""
    override = os.environ.get("LLAMA_CPP_LIB_PATH")
    spec = importlib.util.find_spec("llama_cpp")
    libs = Path(override) if override else Path(spec.origin).parent / "lib" if spec and spec.origin else None
    return libs is not None and any(libs.glob("libggml-cuda*"))


if _cuda_build() and importlib.util.find_spec("onnxruntime") is not None:
    import onnxruntime  # noqa: F401  (before llama.cpp's CUDA library: see above)

# op offload's threshold, before llama.cpp's CUDA backend can register (edgespec.llama.kernels)
OP_OFFLOAD_SET_BY_EDGESPEC = set_op_offload_min_batch()

import llama_cpp  # noqa: F401  isort: skip
