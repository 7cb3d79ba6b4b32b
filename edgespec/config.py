"""EngineConfig: every option of a load, checked once; the one carrier of options.

The CLI verbs, the server and embedding apps fill one EngineConfig; edgespec.load.resolve turns
it into what gets loaded. Each default lives here (or, for the draft shape, in
edgespec.memory.placements).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from edgespec.errors import InvalidRequest
from edgespec.llama import invariant
from edgespec.llama.backend import qmatmul_loaded
from edgespec.llama.kernels import KV_CACHE_TYPES
from edgespec.memory import placements
from edgespec.onnx.providers import check_options as check_onnx_options

DEFAULT_MODEL = "qwen2.5-coder-1.5b"
DEFAULT_CTX = placements.DEFAULT_CTX
DEFAULT_DRAFT = "auto"  # what `run`, `chat` and `serve` draft with unless told


@dataclass(frozen=True)
class EngineConfig:
    """Where the target comes from, how it is placed, and what drafts for it."""

    model: str = DEFAULT_MODEL
    n_ctx: int = DEFAULT_CTX
    n_threads: int | None = None
    n_gpu_layers: int = 0
    use_mmap: bool = True
    use_mlock: bool = False
    # None: for a target on the CPU with an f16 cache, on with edgespec's kernels and off without
    # them, else llama.cpp's choice (edgespec.llama.kernels.default_flash_attn); planned loads
    # plan the kernel given.
    flash_attn: bool | None = None
    # The KV cache type (edgespec.llama.kernels.KV_CACHE_TYPES); None: f16, or the planner's choice.
    kv_type: str | None = None
    # Speculation: None = the plain baseline generator; otherwise a drafter name from
    # edgespec.drafters (none | suffix | model | hybrid | auto | onnx) or a drafter model name/path.
    draft: str | None = None
    draft_model: str | None = None
    # The draft shape (edgespec.memory.placements.DraftShape); None: the placement's default for
    # `auto` in a planned load (placements.draft_shape), else placements.CHAINS.
    draft_max: int | None = None
    draft_tree: bool | None = None
    # Greedy: verified positions whose top-2 logit gap is below this are re-decoded alone
    # (edgespec.spec.step.SpeculativeStep); 0 decides every position from the batch.
    recheck_gap: float = 0.0
    # Greedy chains: the drafter drafts ahead while the target verifies; on whenever the
    # placement is `overlap`. Pays only with drafter and target on different processors.
    overlap: bool = False
    n_seq_max: int | None = None  # default: enough sequences for the drafts' trees
    # Budgets in bytes and a placement mode (edgespec.memory.placements.NAMES). All None: the
    # load as asked above; any of them set: the planner places everything within the budgets
    # (an unset budget: what the machine has free, minus a margin).
    ram_budget: int | None = None
    vram_budget: int | None = None
    placement: str | None = None
    # Requests that may wait behind the running one (None: no limit); one more raises QueueFull.
    max_queue: int | None = None
    # The onnx drafter: onnxruntime execution provider (edgespec.onnx.providers.PROVIDERS; one
    # absent or refusing the graph falls back to the CPU) and which conversion ("exact" | "4").
    onnx_provider: str = "cpu"
    onnx_bits: str = "exact"
    # Batch-invariant kernels for a target on the CPU (edgespec.llama.invariant): every verified
    # row is computed bit for bit as a one-token decode, so greedy speculation returns exactly
    # the answer plain greedy decoding gives under the same kernels. Verifies chains only.
    exact: bool = False
    # With the target's output layer on a GPU, the GPU picks greedy tokens (a token id comes back
    # instead of the logits) and a sampled row's largest logits (edgespec.llama.rows).
    greedy_on_backend: bool = True

    def __post_init__(self) -> None:
        _check_int("n_ctx", self.n_ctx, 16)
        if self.n_threads is not None:
            check_threads(self.n_threads)
        if self.draft_max is not None:
            _check_int("draft_max", self.draft_max, 1, placements.MAX_DRAFT)
        if self.n_gpu_layers < -1:
            raise InvalidRequest(f"n_gpu_layers must be >= -1, got {self.n_gpu_layers}")
        if not self.recheck_gap >= 0:
            raise InvalidRequest(f"recheck_gap must be >= 0, got {self.recheck_gap!r}")
        if self.ram_budget is not None and self.ram_budget <= 0:
            raise InvalidRequest(f"ram_budget must be positive, got {self.ram_budget}")
        if self.vram_budget is not None and self.vram_budget < 0:
            raise InvalidRequest(f"vram_budget must be >= 0, got {self.vram_budget}")
        if self.placement is not None:
            placements.mode(self.placement)
        if self.max_queue is not None:
            _check_int("max_queue", self.max_queue, 0)
        self._check_kv_type()
        if self.exact:
            self._check_exact()
        check_onnx_options(self.onnx_provider, self.onnx_bits)

    def _check_kv_type(self) -> None:
        if self.kv_type is None:
            return
        if self.kv_type not in KV_CACHE_TYPES:
            raise InvalidRequest(f"--kv-type must be one of {', '.join(KV_CACHE_TYPES)}, got {self.kv_type!r}")
        if self.flash_attn is False and self.kv_type != "f16":
            raise InvalidRequest(f"a {self.kv_type} KV cache needs flash attention: drop --no-flash-attn "
                                 "or the cache type")

    def _check_exact(self) -> None:
        if self.flash_attn is False:
            raise InvalidRequest("exact mode runs flash attention (without it the attention product "
                                 "depends on the batch); drop --no-flash-attn (flash_attn=False)")
        kv = invariant.kv_type(qmatmul_loaded())
        if self.kv_type not in (None, kv):
            raise InvalidRequest(f"--exact plans a {kv} KV cache (its attention kernel does not "
                                 f"depend on the batch); drop --kv-type {self.kv_type}")
        if self.recheck_gap > 0:
            raise InvalidRequest("exact mode computes every verified row as plain decoding does: "
                                 "near-tie re-checks would only cost time; drop --recheck-gap")
        if self.draft_tree:
            raise InvalidRequest("exact mode drafts chains: a tree's accepted path leaves its cache cells "
                                 "out of position order; drop --draft-tree")
        if self.n_gpu_layers != 0 or (self.placement is not None and placements.mode(self.placement).target != "cpu"):
            raise InvalidRequest("exact mode needs the target on the CPU (GPU kernels depend on the batch "
                                 "size): use --placement cpu or draft-gpu, and no --n-gpu-layers")

    @property
    def planned(self) -> bool:
        """Whether the planner places the load (a budget or a placement is given)."""
        return self.ram_budget is not None or self.vram_budget is not None or self.placement is not None


# llama.cpp's GGML_MAX_N_THREADS; more threads than a few per CPU only contend for the cores.
_LLAMA_MAX_THREADS = 512
_THREADS_PER_CPU = 4


def check_threads(n_threads) -> int:
    """Returns ``n_threads`` if it is a thread count this machine can use, else raises InvalidRequest."""
    _check_int("n_threads", n_threads, 1)
    cpus = os.cpu_count() or 1
    most = min(_LLAMA_MAX_THREADS, _THREADS_PER_CPU * cpus)
    if n_threads > most:
        raise InvalidRequest(f"n_threads must be at most {most} ({_THREADS_PER_CPU} per CPU of this machine's {cpus}; "
                             f"llama.cpp allows {_LLAMA_MAX_THREADS}), got {n_threads}")
    return n_threads


def _check_int(name: str, value, low: int, high: int | None = None) -> None:
    """Raises InvalidRequest unless ``value`` is an int (not a bool) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise InvalidRequest(f"{name} must be an integer {bound}, got {value!r}")
