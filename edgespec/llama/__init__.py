"""The only package that imports llama_cpp: models, contexts, the memory probe and the in-process peer.

llama_cpp is imported here, first: on the GPU machine (run.sh's CUDA build, numpy 2.x wheels
bundling libgfortran/libquadmath/OpenBLAS) every model load died of SIGSEGV in llama.cpp's
print_info when numpy had been loaded before llama.cpp's libraries, and never the other way round
(benchmarks/device/diag.py; RESULTS-gpu.md). ``import edgespec`` comes here before anything else.

One library goes before it: onnxruntime, where llama.cpp is a CUDA build. On that machine, with
llama-cpp-python built by `make GPU=cuda`, importing onnxruntime after libggml-cuda was loaded
died in onnxruntime's module initialisation (SIGSEGV; "free(): invalid pointer" with libggml-cuda
alone preloaded), so `edgespec doctor` and `--draft onnx` crashed. onnxruntime (and the numpy it
imports) first, then a GPU model load, doctor, the CLI and three GPU tests passed on that build:
numpy first did not crash there (benchmarks/device/imports.py, RESULTS-gpu.md section 19), nor
on run.sh's own build, where the 36 GPU tests passed this way (section 20). A CPU
build keeps onnxruntime's import (~50 ms, ~20 MiB) for when an ONNX drafter is used.
"""
import importlib.util
import logging
import os
import sys
from pathlib import Path

from edgespec.llama.kernels import set_op_offload_min_batch  # no llama_cpp, no numpy

log = logging.getLogger(__name__)


def _cuda_build() -> bool:
    """Whether the llama.cpp that llama_cpp will load has the CUDA backend, found without loading
    it: in LLAMA_CPP_LIB_PATH (read as llama_cpp reads it: empty is the working directory) or in
    the package's lib/ folder, which llama_cpp's ggml bindings load whatever the variable says."""
    folders = []
    if (override := os.environ.get("LLAMA_CPP_LIB_PATH")) is not None:
        folders.append(Path(override))
    spec = importlib.util.find_spec("llama_cpp")
    if spec is not None and spec.origin:
        folders.append(Path(spec.origin).parent / "lib")
    return any(any(folder.glob("*ggml-cuda*")) for folder in folders)


def _onnxruntime_first() -> None:
    """Imports onnxruntime now, before llama.cpp's CUDA library (see above), where it can."""
    if "llama_cpp" in sys.modules:
        log.warning("llama_cpp was imported before edgespec: importing onnxruntime after a CUDA llama.cpp "
                    "crashed on the GPU machine, so --draft onnx and doctor may crash here; import edgespec first")
        return
    try:
        import onnxruntime  # noqa: F401
    except ImportError as exc:  # reported where an ONNX drafter is asked for
        log.debug("onnxruntime not importable: %s", exc)


if _cuda_build():
    _onnxruntime_first()

# op offload's threshold, before llama.cpp's CUDA backend can register (edgespec.llama.kernels)
OP_OFFLOAD_SET_BY_EDGESPEC = set_op_offload_min_batch()

import llama_cpp  # noqa: F401  isort: skip
