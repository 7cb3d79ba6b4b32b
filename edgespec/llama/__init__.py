"""The only package that imports llama_cpp: models, contexts, the memory probe and the in-process peer.

llama_cpp is imported here, first: on the GPU machine (CUDA build, numpy 2.x wheels bundling
libgfortran/libquadmath/OpenBLAS) every model load died of SIGSEGV in llama.cpp's print_info when
numpy had been loaded before llama.cpp's libraries, and never the other way round
(benchmarks/device/diag.py; RESULTS-gpu.md). ``import edgespec`` comes here before anything else.
"""
import os

# The smallest batch for which a CUDA build copies CPU-resident weights to the GPU and multiplies
# there (llama.cpp reads it once, when its CUDA backend registers; its default is 32). A target
# split between GPU and CPU keeps its CPU weights in pinned host buffers (the planner), and from
# there the copy costs about one token on the CPU: H100 host, 7B with 4 of 29 layers on the GPU,
# 8 threads, 2 to 16 rows cost 92-100 ms through the GPU against 129-420 ms on the CPU, one token
# 88-101 ms either way (benchmarks/RESULTS-gpu.md section 16). One token stays on the CPU, where
# a slower link than this machine's PCIe 5 cannot make plain decoding slower. Set it in the
# environment to override.
OP_OFFLOAD_MIN_BATCH = 2
os.environ.setdefault("GGML_OP_OFFLOAD_MIN_BATCH", str(OP_OFFLOAD_MIN_BATCH))

import llama_cpp  # noqa: F401  isort: skip
