"""The only package that imports llama_cpp: models, contexts, the memory probe and the in-process peer.

The import order of native libraries is fixed here, because ``import edgespec`` comes here first:
- llama.cpp's libraries before numpy's: with numpy 2.x wheels (bundling OpenBLAS and its runtime)
  loaded first, every model load of a CUDA build died of SIGSEGV in llama.cpp's print_info
  (benchmarks/device/diag.py).
- onnxruntime before both on a CUDA build: imported after libggml-cuda it died in its module
  initialisation (benchmarks/device/imports.py). A CPU build keeps onnxruntime's import
  (~50 ms, ~20 MiB) for when an ONNX drafter is used.
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
