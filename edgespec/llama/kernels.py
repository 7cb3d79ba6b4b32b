"""Facts about llama.cpp's kernels and cache formats that the engine and the planner share
(no llama_cpp import: the planner reads these without loading anything)."""
from __future__ import annotations

from dataclasses import dataclass


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


def default_flash_attn(on_gpu: bool, kv_type: str = "f16") -> bool | None:
    """The attention kernel a context gets when the user does not choose.

    On the CPU, llama.cpp's flash-attention kernel is slower for the multi-token batches that
    verification sends once the context is long: `llama-bench -p 1,2,4,8,16,32,64 -d
    128,512,1024,2048 -fa 0,1` of the 1.5B target (2-core AVX-512 VM) puts 4- to 32-token
    batches 4-29% slower with it at depth 1024 and 14-32% at 2048; at depth 128 every size is
    2-7% faster with it, and one-token decodes cost the same from depth 512 on. The default
    keeps the long contexts of code edits fast; ``--flash-attn`` serves short chats.
    A quantized V cache needs it (llama.cpp refuses the context otherwise). GPUs keep
    llama.cpp's own choice (None: on where the device supports it).
    """
    if kv_type != "f16":
        return True
    return None if on_gpu else False


def resolved_flash_attn(flash_attn: bool | None) -> bool:
    """What llama.cpp runs for a ContextParams.flash_attn value: None (auto) is on for the
    CPU and CUDA backends of this build."""
    return True if flash_attn is None else flash_attn
