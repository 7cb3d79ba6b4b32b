"""Memory probe: llama.cpp's own buffer sizes, for the planner's checks and tests.

edgespec.memory.planner estimates memory from GGUF metadata alone; these functions let a test (or a
user checking a plan) compare its numbers with what llama.cpp itself allocates. llama.cpp
reports every buffer it allocates in its log ("CPU KV buffer size = 56.00 MiB"); the log is
routed to the "edgespec.llama_cpp" logger, so capturing it needs no change to llama.cpp.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Sequence

import llama_cpp as lc

from edgespec.errors import BackendError
from edgespec.files.modelfile import model_file
from edgespec.llama.backend import (ContextParams, ModelParams, context_struct, ensure_initialized,
                                    LLAMA_LOG, model_struct, default_threads)

_BUFFER_LINE = None  # compiled on first use


class _LogCapture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def capture_llama_log():
    """Collects llama.cpp's log lines while open: ``with capture_llama_log() as cap: ... cap.lines``.

    The lines are kept from the rest of the logging tree while captured, so a CLI running at
    WARNING does not print llama.cpp's debug chatter. Not meant for concurrent use.
    """
    handler = _LogCapture()
    saved = (LLAMA_LOG.level, LLAMA_LOG.propagate)
    LLAMA_LOG.setLevel(logging.DEBUG)
    LLAMA_LOG.propagate = False
    LLAMA_LOG.addHandler(handler)
    try:
        yield handler
    finally:
        LLAMA_LOG.removeHandler(handler)
        LLAMA_LOG.setLevel(saved[0])
        LLAMA_LOG.propagate = saved[1]


def reported_buffers(lines: Sequence[str]) -> dict[str, int]:
    """Sums llama.cpp's "<name> buffer size = X MiB" log lines by name, in bytes.

    Names look like "CPU_Mapped model", "CPU_REPACK model", "CPU KV", "CPU compute",
    "CPU output" (with the device name first, e.g. "CUDA0 KV"). A model with a sliding-window
    cache logs one KV line per cache; they are summed. Values are rounded to 0.01 MiB by
    llama.cpp.
    """
    global _BUFFER_LINE
    if _BUFFER_LINE is None:
        _BUFFER_LINE = re.compile(r"(\S+)\s+(\w+) buffer size =\s*([0-9.]+) MiB")
    out: dict[str, int] = {}
    for line in lines:
        m = _BUFFER_LINE.search(line)
        if m:
            key = f"{m.group(1)} {m.group(2)}"
            out[key] = out.get(key, 0) + round(float(m.group(3)) * 1024 * 1024)
    return out


def probe_context_buffers(path: str | os.PathLike, n_ctx: int, n_batch: int = 512, n_ubatch: int = 512,
                          n_seq_max: int = 1, kv_type: str = "f16", flash_attn: bool | None = None,
                          n_gpu_layers: int = 0, use_mmap: bool = True, repack: bool = True,
                          n_outputs_max: int | None = None) -> dict[str, int]:
    """Loads a model, creates one context and returns llama.cpp's reported buffer sizes (bytes).

    A dry run of context construction: the context is freed at once and nothing is decoded.
    The context is configured as ``LlamaContext`` configures its own (unified KV cache,
    ``n_outputs_max`` = ``n_batch`` unless given), plus the knobs ``ContextParams`` does not have
    yet: the KV cache type and the CPU weight repacking (``use_extra_bufts``). Keep the two in
    step. Raises BackendError when llama.cpp refuses the configuration (e.g. a quantized V
    cache without flash attention).
    """
    model_file(path)  # the validator sees every file before llama.cpp does
    ensure_initialized()
    with capture_llama_log() as cap:
        mp = model_struct(ModelParams(n_gpu_layers=n_gpu_layers, use_mmap=use_mmap, repack=repack))
        model = lc.llama_model_load_from_file(os.fspath(path).encode(), mp)
        if not model:
            raise BackendError(f"llama.cpp could not load {path}")
        try:
            cp = context_struct(ContextParams(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch,
                                               n_seq_max=n_seq_max, kv_type=kv_type, flash_attn=flash_attn,
                                               n_outputs_max=n_outputs_max), default_threads())
            ctx = lc.llama_init_from_model(model, cp)
            if not ctx:
                raise BackendError(f"llama.cpp could not create a context of {n_ctx} tokens "
                                   f"(kv {kv_type}, flash attention {flash_attn})")
            lc.llama_free(ctx)
        finally:
            lc.llama_model_free(model)
    return reported_buffers(cap.lines)
