"""Expected decoding speed of a layout, so that the planner can compare layouts with plain decoding.

A layout's speed is priced from the bytes its passes read, with per-byte costs from measured
cost curves (benchmarks/device/results/curves.json: whole-model GPU decodes of 0.5B-32B shapes
on an H100, CPU decodes of the 0.5B, 1.5B and 7B on 8 threads of its host, and a 7B split with
its CPU layers pinned). Weights dominate a decode step: the KV cache and context size are not
priced. The figures are estimates for ranking layouts on one machine, not promises of tokens/s.

Plain decoding at a VRAM budget is the target alone with as many layers on the GPU as the budget
holds. A speculative layout is worth its plain speed, or a model drafter's chains at a prior
acceptance when those are expected faster (`auto` drafts only what pays, so never less).
Measured on an H200 with the real 1.5B and 0.5B: forcing `offload` into a 1400 MiB budget (16 of
29 target layers beside the drafter) ran 1.69x over plain in that split layout, but plain with
that budget holds the whole target at 476 tok/s: the speculative layout was 0.30x of plain.
This model prices that layout at 0.31x (170 against 550 tok/s; its split plain at 86, measured 85).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgespec.memory.footprint import ModelFootprint

GB = 1e9


@dataclass(frozen=True)
class PassCosts:
    """Seconds of one decode pass from the bytes of weights it reads.

    ``gpu_*`` and ``cpu_*`` price the part of the model on each processor; ``link_s_per_byte``
    the CPU-resident weights a split target copies to the GPU for a batch of at least
    ``op_offload_batch`` tokens (op offload from pinned memory), which then runs wholly on the
    GPU. ``*_batch``: (tokens, multiple of the one-token pass) points, interpolated.
    """

    gpu_pass_s: float = 1.2e-3        # H100, whole model on the GPU: 1.28 ms (0.5B) .. 13.3 ms (32B)
    gpu_s_per_byte: float = 0.62e-3 / GB
    cpu_s_per_byte: float = 27e-3 / GB  # 8 threads: 1.5B 26.3 ms, 7B 131 ms a token
    cpu_threads: int = 8               # the threads cpu_s_per_byte was measured with
    # Fewer threads read slower, less than in proportion: the 1.5B decoded at 76 ms a token on
    # 2 threads of the development VM against 26 ms on 8 of the H100's host: (8/2)**0.7 = 2.6.
    thread_exponent: float = 0.7
    link_s_per_byte: float = 26e-3 / GB  # 7B split, 2.9 GB of CPU blocks pinned: 2-64 tokens 80-86 ms
    gpu_batch: tuple = ((1, 1.0), (2, 1.15), (4, 1.55), (8, 2.1), (16, 2.3), (32, 2.85), (64, 3.8))
    cpu_batch: tuple = ((1, 1.0), (2, 1.42), (4, 1.58), (8, 2.85), (16, 3.75), (32, 6.6), (64, 11.7))

    @staticmethod
    def _scale(points: tuple, n: int) -> float:
        xs, ys = zip(*points)
        return float(np.interp(n, xs, ys)) if n <= xs[-1] else ys[-1] * n / xs[-1]

    def cpu_per_byte(self, threads: int) -> float:
        return self.cpu_s_per_byte * (self.cpu_threads / max(1, min(threads, 4 * self.cpu_threads))) ** self.thread_exponent

    def pass_s(self, gpu_bytes: int, cpu_bytes: int, n: int, threads: int, op_offload_batch: int | None) -> float:
        """One pass of ``n`` tokens over a model with ``gpu_bytes`` read on the GPU and
        ``cpu_bytes`` on the CPU (``op_offload_batch`` None: the CPU part never ships)."""
        gpu = lambda b: (self.gpu_pass_s + b * self.gpu_s_per_byte) * self._scale(self.gpu_batch, n)  # noqa: E731
        if cpu_bytes and gpu_bytes and op_offload_batch is not None and n >= max(op_offload_batch, 2):
            return cpu_bytes * self.link_s_per_byte + gpu(gpu_bytes + cpu_bytes)
        t = gpu(gpu_bytes) if gpu_bytes else 0.0
        return t + cpu_bytes * self.cpu_per_byte(threads) * self._scale(self.cpu_batch, n)


MEASURED = PassCosts()

# A drafted token's chance to be accepted, each depth alike: the 0.5B drafter's 32-token chains
# emitted 4.3 tokens a step on Spec-Bench against the 1.5B (benchmarks/results/specbench-limit5.json),
# which a per-token acceptance of 0.77 gives. Copied text accepts more; the suffix drafter's gain
# there is not priced (it costs no VRAM, so every layout has it alike).
ACCEPTANCE = 0.77


def read_bytes(fp: ModelFootprint, n_gpu_layers: int) -> tuple[int, int]:
    """(GPU, CPU) weight bytes a decode pass reads with ``n_gpu_layers`` on the GPU: the head
    first, then the last blocks, as llama.cpp assigns them; the embeddings are looked up by row."""
    k = max(0, min(n_gpu_layers, fp.n_layer + 1))
    gpu_blocks = max(k - 1, 0)
    cpu = sum(fp.layer_bytes[:fp.n_layer - gpu_blocks]) + fp.other_bytes
    gpu = sum(fp.layer_bytes[fp.n_layer - gpu_blocks:])
    if k:
        gpu += fp.head_bytes
    else:
        cpu += fp.head_bytes
    return gpu, cpu


@dataclass(frozen=True)
class SpeedModel:
    """Prices layouts of one target (and drafter model) on one machine."""

    target: ModelFootprint
    drafter: ModelFootprint | None
    threads: int
    op_offload_batch: int  # llama.cpp's op offload threshold (edgespec.llama.kernels)
    costs: PassCosts = MEASURED
    acceptance: float = ACCEPTANCE

    def target_pass_s(self, n_gpu_layers: int, n: int) -> float:
        gpu, cpu = read_bytes(self.target, n_gpu_layers)
        return self.costs.pass_s(gpu, cpu, n, self.threads, self.op_offload_batch)

    def plain(self, n_gpu_layers: int) -> float:
        """Tokens/s of plain decoding with ``n_gpu_layers`` of the target on the GPU."""
        return 1.0 / self.target_pass_s(n_gpu_layers, 1)

    def draft_token_s(self, on_gpu: bool) -> float:
        d = self.drafter
        gpu, cpu = read_bytes(d, d.n_layer + 1) if on_gpu else read_bytes(d, 0)
        return self.costs.pass_s(gpu, cpu, 1, self.threads, None)

    def speculative(self, n_gpu_layers: int, drafter: str, draft_max: int) -> float:
        """Tokens/s of a layout drafting with ``drafter`` ("gpu" | "cpu" | "none": the suffix
        drafter alone, priced at its plain speed): the best chain length at the prior acceptance,
        or plain steps where no chain pays."""
        best = self.plain(n_gpu_layers)
        if drafter == "none" or self.drafter is None:
            return best
        d = self.draft_token_s(drafter == "gpu")
        expected = survive = 1.0
        for k in range(1, draft_max + 1):
            survive *= self.acceptance
            expected += survive
            best = max(best, expected / (k * d + self.target_pass_s(n_gpu_layers, 1 + k)))
        return best
