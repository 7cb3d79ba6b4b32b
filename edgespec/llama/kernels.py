"""Facts about llama.cpp's kernels and cache formats that the engine and the planner share
(no llama_cpp import: the planner reads these without loading anything)."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

# The smallest batch for which a CUDA build copies CPU-resident weights to the GPU and multiplies
# there (op offload). llama.cpp reads the variable once, when its CUDA backend registers; its own
# default is 32. edgespec sets 2 (unless the user set it), for a split target whose CPU weights
# the planner pins in host memory: from there the copy costs about one token on the CPU, so a
# 2-token verification costs 0.7x and an 8- to 31-token one a quarter of what the CPU charges.
# One token stays on the CPU: over a slower link than
# that machine's PCIe 5 a copy per token would slow plain decoding.
OP_OFFLOAD_ENV = "GGML_OP_OFFLOAD_MIN_BATCH"
LLAMA_CPP_OP_OFFLOAD_MIN_BATCH = 32
OP_OFFLOAD_MIN_BATCH = 2


def set_op_offload_min_batch() -> bool:
    """Sets edgespec's threshold unless the user set one (an empty value counts as unset);
    True when edgespec set it. Call before llama.cpp's CUDA backend registers."""
    if os.environ.get(OP_OFFLOAD_ENV, "").strip():
        return False
    os.environ[OP_OFFLOAD_ENV] = str(OP_OFFLOAD_MIN_BATCH)
    return True


def op_offload_min_batch() -> int:
    """The threshold llama.cpp reads: the environment's, parsed as its atoi does, else its own."""
    value = os.environ.get(OP_OFFLOAD_ENV)
    if value is None:
        return LLAMA_CPP_OP_OFFLOAD_MIN_BATCH
    m = re.match(r"\s*([+-]?\d+)", value)
    return int(m.group(1)) if m else 0


# The feature a CUDA build reports in llama_print_system_info() when it carries edgespec's patch
# (native/llama_cpp_patches.py, applied by `make demo GPU=cuda`): CUDA graphs kept per batch
# shape. A stock build keeps one per context, and a decode whose batch size differs from the two
# before it runs without it: +0.76 ms on a 3.8 ms step of a 7B on an H100, +0.47 ms per change
# of size with the patch.
GRAPHS_PER_SHAPE = "GRAPHS_PER_SHAPE"


def cuda_graphs(system_info: str) -> str | None:
    """How a llama.cpp build keeps CUDA graphs, from its system info: "per-shape", "per-context",
    "disabled" (GGML_CUDA_DISABLE_GRAPHS is set, to any value, as llama.cpp reads it), or None
    (no CUDA graphs: a CPU build, or graphs compiled out)."""
    if not re.search(r"\bUSE_GRAPHS = 1\b", system_info):
        return None
    if os.environ.get("GGML_CUDA_DISABLE_GRAPHS") is not None:
        return "disabled"
    return "per-shape" if re.search(rf"\b{GRAPHS_PER_SHAPE} = 1\b", system_info) else "per-context"


@dataclass(frozen=True)
class KVCacheType:
    ggml_id: int       # type_k / type_v of llama_context_params
    block_bytes: int   # bytes of one quantization block
    block_elems: int   # elements per block

    def nbytes(self, elements: int) -> int:
        return -(-elements // self.block_elems) * self.block_bytes


KV_CACHE_TYPES = {
    "f16": KVCacheType(1, 2, 1),
    "q8_0": KVCacheType(8, 34, 32),
    "q4_0": KVCacheType(2, 18, 32),
}


def default_flash_attn(on_gpu: bool, kv_type: str = "f16", qmatmul: bool = False) -> bool | None:
    """The attention kernel a context gets when the user does not choose.

    On the CPU with edgespec's kernels (``qmatmul``: backend.qmatmul_loaded), flash attention is
    on: its f16 path is native/qmatmul/qattn.c, whose rows have a one-token decode's bits in any
    batch. With it, `auto` ran 28.4 and 19.9 tok/s on held-out code edits and Spec-Bench against
    28.5 and 20.3 with llama.cpp's attention without flash attention (2-core AMD EPYC VM, the
    1.5B target; a 16- to 64-token batch alone cost up to 15% more at 1024 tokens of context).
    Otherwise, on the CPU, llama.cpp's flash-attention kernel is slower for the multi-token
    batches that verification sends once the context is long: `llama-bench -p 1,2,4,8,16,32,64 -d
    128,512,1024,2048 -fa 0,1` of the 1.5B target (2-core AVX-512 VM) puts 4- to 32-token
    batches 4-29% slower with it at depth 1024 and 14-32% at 2048; at depth 128 every size is
    2-7% faster with it, and one-token decodes cost the same from depth 512 on. The default
    keeps the long contexts of code edits fast; ``--flash-attn`` serves short chats.
    A quantized V cache needs it (llama.cpp refuses the context otherwise). GPUs keep
    llama.cpp's own choice (None: on where the device supports it).
    """
    if kv_type != "f16" or (qmatmul and not on_gpu):
        return True
    return None if on_gpu else False


def resolved_flash_attn(flash_attn: bool | None) -> bool:
    """What llama.cpp runs for a ContextParams.flash_attn value: None (auto) is on for the
    CPU and CUDA backends of this build."""
    return True if flash_attn is None else flash_attn
