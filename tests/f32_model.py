"""Builds an F32 copy of a quantized GGUF model for strict greedy-equality tests.

llama.cpp's batched logits differ from its one-token logits by up to ~0.65 on a Q4_K_M model,
enough to flip near-ties, but by ~0.02 on an F32 model. Dequantizing SmolLM2-135M (Q4_1)
with the `gguf` package gives a model on which speculative and plain greedy decoding must
agree token for token.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def build_f32_copy(src: Path, dst: Path) -> Path:
    """Writes ``dst`` (atomically) as ``src`` with every tensor dequantized to F32."""
    import gguf

    if dst.exists():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    tmp = dst.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        if key == "general.file_type":
            value = int(gguf.LlamaFileType.ALL_F32)
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)
    return dst
