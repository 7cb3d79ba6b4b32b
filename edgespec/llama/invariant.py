"""Batch-invariant kernels: the settings under which llama.cpp computes every row of a batch bit
for bit as it computes that token decoded alone, so that greedy speculation returns exactly the
answer plain greedy decoding returns under the same settings.

With llama.cpp's default CPU kernels a row's logits depend on the batch it is computed in: on
the 2-core AVX-512 VM, Qwen2.5-Coder-1.5B Q4_K_M, rows of 2- to 64-token batches differed from
one-token decodes by up to 0.6-0.9 logits (benchmarks/results/batch-invariance.md), enough to
flip a near-tie. Three kernel choices depend on the batch:

- repacked weights (Q4_K 8x8) multiply 4 rows at a time with another kernel than one row;
- the tiled K-quant matmul (``GGML_CPU_TILED_MM``, on for weights left unrepacked) takes
  batches of 8 rows and more;
- attention: without flash attention the KQ product differs from 2 rows on; with it and an f16
  cache, a one-token decode splits the cache across threads once the cache view reaches 512
  cells, and batches of 64 rows or more take a tiled kernel.

Without repacking, with flash attention over a q8_0 cache and the tiled matmul off, every row
of batches of 2 to 64 tokens equalled its one-token decode exactly after 150 and 1000 tokens of
context. The price, in the same file: past 4 rows a batch grows by about a row's arithmetic per
token, so drafts pay less. Measured on x86 (AVX-512) only.

The tiled-matmul switch is an environment variable that llama.cpp reads once per process, at its
first matrix multiplication: ``enable()`` must run before anything is decoded. ``deviation``
checks the result on a loaded context rather than trusting that it did.
"""
from __future__ import annotations

import os
from dataclasses import replace

import numpy as np

from edgespec.errors import BackendError
from edgespec.llama.backend import ContextParams, LlamaContext, ModelParams, qmatmul_loaded

TILED_MM_ENV = "GGML_CPU_TILED_MM"


def kv_type(qmatmul: bool) -> str:
    """The cache type of exact mode (the planner plans it: edgespec.load.resolve.exact_plan): f16
    with edgespec's kernels (qmatmul: backend.qmatmul_loaded), whose attention over it keeps a
    row's bits; else q8_0, since llama.cpp splits an f16 cache across threads for one-token
    decodes."""
    return "f16" if qmatmul else "q8_0"

PROBE_TEXT = "def mean(values):\n    total = sum(values)\n    return total / len(values)\n\nprint(mean([1, 2, 3]))\n"
PROBE_HEAD = 4   # tokens decoded before the probed rows
# The tiled matmul's threshold (8 rows); even, since ARM's two-row int8 kernels need an even
# batch (never measured here: invariance is measured on x86 AVX-512 only).
PROBE_ROWS = 8


class NotBatchInvariant(BackendError):
    """A context meant to be batch-invariant computes a batch's rows unlike one-token decodes."""


def enable() -> None:
    """Turns llama.cpp's tiled K-quant matmul off for this process (read at its first matmul)."""
    os.environ[TILED_MM_ENV] = "0"


def tiled_matmul_requested() -> bool:
    """Whether this process asks llama.cpp for the tiled matmul (its default), as it reads the variable."""
    value = os.environ.get(TILED_MM_ENV)
    try:
        return value is None or int(value) != 0
    except ValueError:  # llama.cpp's atoi reads a non-number as 0
        return False


def model_params(p: ModelParams) -> ModelParams:
    """``p`` without weight repacking."""
    return replace(p, repack=False)


def context_params(p: ContextParams) -> ContextParams:
    """``p`` with flash attention over exact mode's cache type, and batches kept on the CPU (op
    offload would multiply them on a GPU)."""
    return replace(p, flash_attn=True, kv_type=kv_type(qmatmul_loaded()), op_offload=False)


def deviation(ctx: LlamaContext, seq: int = 0) -> float:
    """Largest |logit| difference between the rows of one batch and the same tokens decoded one at
    a time on ``seq`` (which must be empty; it is left empty). 0.0 exactly when invariant. The
    batch has PROBE_ROWS rows, fewer where the context's verifications are smaller."""
    n = PROBE_HEAD + min(PROBE_ROWS, ctx.n_outputs_max)
    tokens = ctx.model.tokenize(PROBE_TEXT)[:n]
    if len(tokens) < n:  # a vocabulary of very long tokens: repeat the text
        tokens = (tokens * n)[:n]
    head, rows = tokens[:PROBE_HEAD], tokens[PROBE_HEAD:]
    positions = range(PROBE_HEAD, PROBE_HEAD + len(rows))
    try:
        ctx.decode(head, range(PROBE_HEAD), [[seq]] * PROBE_HEAD, [False] * PROBE_HEAD)
        batched = ctx.decode(rows, positions, [[seq]] * len(rows), [True] * len(rows))
        ctx.seq_rm(seq, PROBE_HEAD, -1)
        single = np.stack([ctx.decode([t], [p], [[seq]], [True])[0] for t, p in zip(rows, positions)])
    finally:
        ctx.seq_rm(seq, -1, -1)
    return float(np.abs(batched - single).max())


def check(ctx: LlamaContext, seq: int = 0) -> None:
    """Raises NotBatchInvariant unless ``ctx`` computes batched rows exactly as one-token decodes."""
    d = deviation(ctx, seq)
    if d != 0.0:
        raise NotBatchInvariant(
            f"exact mode: batched rows differ from one-token decodes by up to {d:.3g} logits: either "
            f"llama.cpp read {TILED_MM_ENV} before exact mode set it (load exact mode before anything "
            f"decodes in this process, or start it with {TILED_MM_ENV}=0), or this model's weight "
            "types take batch-dependent kernels (exact mode is measured on K-quant targets)")
