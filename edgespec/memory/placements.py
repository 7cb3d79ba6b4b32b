"""Placement modes: which processor runs the target and which runs the drafter.

The planner chooses one from the devices and budgets (or takes the one ``--placement`` forces);
each mode declares where its parts go and what llama.cpp must be told for that:

* the target's CPU-resident weights are repacked for the CPU kernels only when a GPU build
  loads them outside its pinned host buffers (``no_host``), so a target verified on the CPU
  asks for that;
* op offload (batches of at least ``edgespec.llama.kernels.op_offload_min_batch()`` tokens
  copy CPU-resident weights to the GPU and multiply there) is what makes large drafts cheap
  for a partly offloaded target, and what a target verified on the CPU must not do.

Measured on an H100 machine with 8 CPU threads (7B-shaped clone): with its CPU layers pinned in host memory, a split target verifies 2 to 128
tokens for about what one token costs, while the same target wholly on the CPU pays 458 ms for
16 tokens and 1333 ms for 64 against 131 ms for one.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from edgespec.errors import InvalidRequest
from edgespec.llama.backend import ContextParams, padded_size
from edgespec.llama.rows import OUTPUT_ARGMAX
from edgespec.memory.machine import MachineInfo


@dataclass(frozen=True)
class PlacementMode:
    name: str
    target: str    # "gpu": every layer; "split": as many layers as the VRAM budget holds; "cpu"
    drafter: str   # where a drafter model runs: "gpu" | "cpu"
    help: str
    overlap: bool = False  # the drafter drafts ahead while the target verifies (SpeculativeStep)
    automatic: bool = True  # the planner may pick it; False: only when --placement names it

    @property
    def needs_gpu(self) -> bool:
        return self.target != "cpu" or self.drafter == "gpu"

    def long_drafts(self, drafter_on_gpu: bool) -> bool:
        """Whether `auto` drafts TREES here by default: where the target verifies through the
        GPU (64 rows cost a GPU-resident or op-offloaded target about what 32 do) or a drafter
        on the GPU searches a 63-node tree in a fraction of a target step (a replay of 16
        held-out code edits on 7B-shaped H100 curves put TREES 3-16% above CHAINS in each of
        these placements). `overlap` drafts chains ahead."""
        return not self.overlap and (self.target != "cpu" or drafter_on_gpu)


MODES = {m.name: m for m in (
    PlacementMode("gpu", "gpu", "gpu", "target and drafter on the GPU (ordinary speculation)"),
    PlacementMode("offload", "split", "gpu",
                  "target partly on the GPU (the layers the VRAM budget holds), drafter on the GPU; "
                  "its CPU layers pinned in host memory; drafts are verified by copying their weights to the GPU"),
    PlacementMode("draft-gpu", "cpu", "gpu",
                  "drafter on the GPU, target on the CPU with repacked weights (Dovetail)"),
    PlacementMode("overlap", "cpu", "gpu",
                  "draft-gpu, with the drafter drafting the next chain while the CPU verifies this one",
                  overlap=True, automatic=False),
    PlacementMode("cpu", "cpu", "cpu", "target and drafter on the CPU"),
)}
NAMES = tuple(MODES)


@dataclass(frozen=True)
class DraftShape:
    """How many tokens a step may draft, and whether a greedy model drafter may draft
    best-first trees (edgespec.drafters.auto.policy.TreeSizes) instead of chains."""

    draft_max: int
    tree: bool

    def given(self, draft_max: int | None, tree: bool | None) -> DraftShape:
        """This shape with what was asked (not None) in place of its own."""
        return DraftShape(self.draft_max if draft_max is None else draft_max, self.tree if tree is None else tree)


DEFAULT_CTX = 4096  # tokens of context a load gets unless told (EngineConfig.n_ctx)
MAX_DRAFT = 64  # the most tokens one step may draft (--draft-max)
# Logits rows the target's context allows one decode: the largest verification, the pending token
# and MAX_DRAFT drafted. llama.cpp reserves that many rows (512 unless told: 297 MiB for Qwen's
# vocabulary, VRAM for a GPU target, pinned RAM for a CPU one on CUDA). One size for every draft
# shape, so that a longer shape reserves no more (planner._longer_shape) and any drafter a bench
# builds over the engine's context fits; a 32-token chain leaves 32 rows (~19 MiB) unused.
VERIFY_ROWS = MAX_DRAFT + 1


CHAINS = DraftShape(32, False)
TREES = DraftShape(63, True)  # the largest tree: 63 nodes, a 64-row verification


def drafter_context_params(n_ctx: int, n_threads: int | None = None, on_gpu: bool = True) -> ContextParams:
    """The drafter model's context, chains or trees (edgespec.drafters.model builds it, the
    planner sizes it): a sequence per node a tree search holds and one for the context; a small
    ubatch keeps the compute buffer (ubatch x vocabulary logits) small. A drafter wholly on the
    CPU (``on_gpu`` False) of a GPU build never ships a batch to the GPU: at edgespec's op
    offload threshold every tree round of 2+ nodes would copy its weights there."""
    return ContextParams(n_ctx=n_ctx, n_batch=512, n_ubatch=64, n_seq_max=TREES.draft_max + 1, n_threads=n_threads,
                         op_offload=on_gpu)


def draft_shape(name: str, draft_max: int | None, tree: bool | None, drafter_on_gpu: bool = False) -> DraftShape:
    """What was asked, and the placement's default (TREES where ``long_drafts``, else CHAINS)
    for what was not (None)."""
    return (TREES if mode(name).long_drafts(drafter_on_gpu) else CHAINS).given(draft_max, tree)


class PlacementUnavailable(InvalidRequest):
    """A forced placement this machine or build cannot run."""


def mode(name: str) -> PlacementMode:
    try:
        return MODES[name]
    except KeyError:
        raise InvalidRequest(f"unknown placement {name!r}; choose from {', '.join(NAMES)}") from None


def unavailable(m: MachineInfo) -> dict[str, str]:
    """Why each mode cannot run here (modes absent from the result can)."""
    if not m.gpu_offload:
        why = ("this llama.cpp build is CPU-only; build it with CUDA (make demo GPU=cuda) "
               "or another GPU backend")
    elif not m.gpus:
        why = "llama.cpp reports no GPU device"
    else:
        return {}
    return {name: why for name, p in MODES.items() if p.needs_gpu}


def check_available(name: str, m: MachineInfo) -> PlacementMode:
    """The mode, or PlacementUnavailable naming why it cannot run here."""
    p = mode(name)
    why = unavailable(m).get(name)
    if why:
        raise PlacementUnavailable(f"placement {name} needs a GPU: {why}")
    return p


def cuda(m: MachineInfo) -> bool:
    """Whether this build offloads to a CUDA GPU (the one backend whose host memory edgespec has
    measured: the planner's GPU_HOST_* parts)."""
    return m.gpu_offload and any(g.name.startswith("CUDA") for g in m.gpus)


def cuda_pins(m: MachineInfo) -> bool:
    """Whether CUDA's host buffers here are pinned: llama.cpp's host buffer type, unless
    GGML_CUDA_NO_PINNED tells CUDA not to pin."""
    return cuda(m) and not os.environ.get("GGML_CUDA_NO_PINNED")


def pins_split_target(n_gpu_layers: int, n_layer: int, m: MachineInfo) -> bool:
    """Whether a target with ``n_gpu_layers`` GPU layers and blocks left on the CPU reads them
    into pinned host buffers instead of mapping them: op offload copies every CPU-resident
    weight to the GPU for a multi-token batch, by DMA from pinned memory instead of through the
    driver's staging of mapped pages, 5x faster on an H100. CUDA only (the one backend measured), and not where CUDA is told not to pin
    (GGML_CUDA_NO_PINNED) or on unified memory (an integrated GPU reads host memory in place)."""
    return cuda_pins(m) and not m.unified_memory and 0 < n_gpu_layers <= n_layer


def unplanned_target(n_gpu_layers: int, n_layer: int, m: MachineInfo, use_mmap: bool) -> tuple[bool, bool]:
    """(op_offload, use_mmap) for a target loaded as asked (``--n-gpu-layers``, no plan), by the
    planner's rules: a target wholly on the CPU never ships a batch to the GPU, and a split one
    reads its CPU weights into pinned host buffers (pins_split_target)."""
    return (target_flags(n_gpu_layers, m.gpu_offload)[1],
            use_mmap and not pins_split_target(n_gpu_layers, n_layer, m))


def greedy_on_backend(n_gpu_layers: int, m: MachineInfo) -> bool:
    """Whether greedy decoding may have the backend pick a target's tokens
    (edgespec.llama.rows): with its output layer on a GPU (any GPU layer: llama.cpp offloads the
    output first). A 1.5B on an H200 decoded 542 tok/s so against 523 reading logits. A stock
    build picks plain decoding's row only, and its host output buffer then holds four times the
    logits rows (OUTPUT_PICKED); loads with a drafter verify with picks only where the build has
    output argmax."""
    return m.gpu_offload and n_gpu_layers > 0


# Batch sizes a target wholly on a GPU keeps graphs for while it verifies drafts, and pads its
# batches to (ContextParams.graph_sizes): the one-token step, then the pending token with 1, 2,
# 4, 8 or 16 drafts, then steps of 8 rows. A change of size otherwise rebuilt the graph: 0.65-0.74
# ms of host time a decode on an H200 with the 1.5B, against 0.08-0.16 ms for a kept one
# (benchmarks/device/graph_timing.py); past 17 rows a padded row costs the GPU ~0.05 ms.
GRAPH_SIZES = (1, 2, 3, 5, 9, 17, 25, 33, 41, 49, 57, 65)


def graph_sizes(n_gpu_layers: int, n_layer: int, rows: int, gpu_build: bool) -> tuple[int, ...]:
    """The batch sizes a target's context keeps graphs for, up to the one that holds ``rows`` (its
    largest verification; 1: it never verifies): GRAPH_SIZES for a drafted target wholly on the GPU
    of a build with edgespec's llama.cpp patches (OUTPUT_ARGMAX marks them), else none."""
    whole = n_gpu_layers < 0 or n_gpu_layers > n_layer
    if rows < 2 or not (whole and gpu_build and OUTPUT_ARGMAX):
        return ()
    return tuple(s for s in GRAPH_SIZES if s < rows) + (padded_size(rows, GRAPH_SIZES),)


# The host output buffer of a context whose greedy picks the backend makes, over its logits
# rows alone: llama.cpp adds the sampler's logits, probabilities and candidates per row.
OUTPUT_PICKED = 4


def target_flags(n_gpu_layers: int, gpu_build: bool) -> tuple[bool, bool]:
    """(no_host, op_offload) for the target of a plan: a target wholly on the CPU of a GPU build
    is loaded outside the pinned host buffers (so its weights are repacked) and never ships a
    batch to the GPU; a split target ships large batches there."""
    on_cpu = n_gpu_layers == 0
    return gpu_build and on_cpu, not on_cpu
