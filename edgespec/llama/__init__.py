"""The only package that imports llama_cpp: models, contexts, the memory probe and the in-process peer.

llama_cpp is imported here, first: on the GPU machine (CUDA build, numpy 2.x wheels bundling
libgfortran/libquadmath/OpenBLAS) every model load died of SIGSEGV in llama.cpp's print_info when
numpy had been loaded before llama.cpp's libraries, and never the other way round
(benchmarks/device/diag.py; RESULTS-gpu.md). ``import edgespec`` comes here before anything else.
"""
from edgespec.llama.kernels import set_op_offload_min_batch  # no llama_cpp, no numpy

# op offload's threshold, before llama.cpp's CUDA backend can register (edgespec.llama.kernels)
OP_OFFLOAD_SET_BY_EDGESPEC = set_op_offload_min_batch()

import llama_cpp  # noqa: F401  isort: skip
