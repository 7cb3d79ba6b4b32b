"""The candidates of the plan search and what each costs: every part of a placement sized in
bytes (edgespec.memory.footprint), whether it fits the budgets, and its rank (``RANKING``).

edgespec.memory.planner enumerates the candidates and picks one; edgespec.memory.explain states
the reason for every setting of the one picked.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from edgespec.llama.kernels import KV_CACHE_TYPES, default_flash_attn, resolved_flash_attn
from edgespec.memory import placements
from edgespec.memory.filebacked import RELEASE_MARGIN
from edgespec.memory.footprint import (SUFFIX_BYTES_PER_TOKEN, MiB, ContextFootprint, ModelFootprint,
                                       estimate_context, verify_graph_bytes)
from edgespec.memory.footprint import SUFFIX_HISTORY_TOKENS as SUFFIX_DEFAULT_CAP
from edgespec.memory.machine import MachineInfo
from edgespec.units import format_bytes

UBATCH_CHOICES = (512, 256, 128, 64)
PROCESS_BASE_BYTES = 64 * MiB   # Python, numpy, llama.cpp libraries before any model (CLI: ~51)
GPU_RUNTIME_BYTES = 256 * MiB   # CUDA/Metal context and library workspaces (assumed)
# What a CUDA build's runtime keeps in host RAM beyond PROCESS_BASE_BYTES, measured on an H200
# with CUDA 13 (benchmarks/device/ram.py): the driver and libraries once llama.cpp's device query
# made the CUDA context (323 MiB RSS against a CPU build's 46), then each llama.cpp context's CUDA
# backend, made even when its model stays on the CPU (+50 MiB, +52). Other backends: not counted.
GPU_HOST_RUNTIME_BYTES = 280 * MiB
GPU_HOST_PER_CONTEXT_BYTES = 56 * MiB

SUFFIX_CAPS = (SUFFIX_DEFAULT_CAP, 1 << 16, 1 << 14)  # history caps tried, largest first


@dataclass(frozen=True)
class Weight:
    cost: float
    why: str


# The plan search keeps every candidate that fits and picks the one with the lowest sum of
# these weights (ties: least RAM). Their order is what matters: each says what a user loses.
RANKING = {
    "required_drafter_dropped": Weight(5000, "--draft model asked for the drafter model: it is given up only "
                                             "when no plan holds it, file-backed ones included"),
    "file_backed": Weight(1000, "weights re-read from storage every token: decoding is storage-bound, "
                                "far slower than any resident plan, so only when nothing resident fits"),
    "cpu_layers": Weight(200, "times the fraction of target layers left on the CPU: a GPU layer decodes "
                              "an order of magnitude faster, worth more than any cache or batch setting"),
    "no_drafter_beside_gpu": Weight(60, "a GPU without the drafter model: a third of a 7B on the GPU verifies "
                                        "32-512 tokens for 4-5 plain steps, repaid only by deep acceptance, and "
                                        "off copied text only a model drafter (1.3 ms/token there) drafts that "
                                        "deep; worth about 30% of the target's layers on the GPU"),
    "drafter_cpu_beside_gpu": Weight(40, "drafter on the CPU of a machine with a GPU: the 0.5B drafts a token "
                                         "in 14.8 ms on 8 CPU threads against 1.3 ms on an H100, most of what "
                                         "a draft saves; worth a fifth of the target's layers on the GPU"),
    "kv_q4_0": Weight(40, "4-bit cache: visible quality loss on long contexts; before giving up the drafter"),
    "ctx_halving": Weight(30, "per halving of the default context: the user's prompts may no longer fit"),
    "no_drafter_model": Weight(25, "the drafter model's speed-up on free text is lost (suffix drafts remain)"),
    "ubatch_64": Weight(12, "prefill in micro-batches of 64: several times slower prompt evaluation"),
    "kv_q8_0": Weight(10, "8-bit cache: near-lossless, but changes greedy answers at near-ties"),
    "ubatch_128": Weight(5, "prefill in micro-batches of 128"),
    "no_repack": Weight(3, "the interleaved CPU kernels are lost: decoding 10-15% slower"),
    "ubatch_256": Weight(2, "prefill in micro-batches of 256: slightly slower prompt evaluation"),
    "suffix_cap_step": Weight(1, "per step down of the suffix history cap: fewer earlier requests to copy from"),
}

fmt_bytes = format_bytes  # the planner's explanations use the one byte formatter

# =============================================================================================
# Plans
# =============================================================================================

@dataclass(frozen=True)
class Part:
    """One line of a plan: what, where, how many bytes, and why."""

    component: str
    where: str                # "RAM", "GPU0", "file" (page cache, outside the budget), "-"
    bytes: int
    note: str = ""


@dataclass(frozen=True)
class Decision:
    name: str
    value: object
    why: str


@dataclass
class Plan:
    """A placement of the target (and drafters) within the budgets, with its reasons."""

    target: str
    drafter: str | None
    n_ctx: int
    n_ctx_train: int
    n_batch: int
    n_ubatch: int
    n_seq_max: int
    kv_type: str
    flash_attn: bool
    n_gpu_layers: int
    weights_mode: str              # "resident" | "file-backed"
    use_mmap: bool
    repack: bool
    use_mlock: bool
    drafter_placement: str         # "gpu" | "cpu" | "none"
    placement: str                 # edgespec.memory.placements: gpu | offload | draft-gpu | overlap | cpu
    no_host: bool                  # target weights outside pinned host buffers (repacked for the CPU)
    op_offload: bool               # multi-token batches run CPU-resident target layers on the GPU
    graph_sizes: tuple[int, ...]   # batch sizes the target keeps graphs for (ContextParams.graph_sizes)
    drafter_n_gpu_layers: int
    drafter_use_mmap: bool
    drafter_repack: bool           # the drafter's CPU-resident weights get a repacked copy
    suffix_drafter: bool
    suffix_cap_tokens: int
    draft_max: int                 # most tokens a step drafts (edgespec.memory.placements.DraftShape)
    draft_tree: bool               # a greedy model drafter may draft best-first trees
    threads: int
    threads_batch: int
    ram_budget: int
    vram_budget: int
    ram_bytes: int                 # planned resident RAM (parts on "RAM" summed)
    vram_bytes: int
    file_backed_bytes: int         # weights left in the mapped file (not resident)
    parts: list[Part] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    llama_cpp_reports: dict = field(default_factory=dict)  # what llama.cpp's log will say
    warnings: list[str] = field(default_factory=list)
    # Expected decoding speeds (edgespec.memory.speed: estimates for comparing layouts): this
    # layout's, and plain decoding's at the same budgets (the target alone, as many layers on the
    # GPU as they hold; None without a GPU to compare on), with a note when this layout is slower
    # or splits a target the budget holds whole.
    expected_tokens_per_s: float | None = None
    plain_tokens_per_s: float | None = None
    plain_n_gpu_layers: int | None = None
    plain_placement: str | None = None
    plain_note: str | None = None

    @property
    def reasons(self) -> list[str]:
        return [f"{d.name}: {d.value} - {d.why}" for d in self.decisions]

    def engine_settings(self) -> dict:
        """The settings edgespec.load turns into model and context parameters."""
        return {
            "n_ctx": self.n_ctx, "n_threads": self.threads, "n_gpu_layers": self.n_gpu_layers,
            "placement": self.placement, "no_host": self.no_host, "op_offload": self.op_offload,
            "use_mmap": self.use_mmap, "use_mlock": self.use_mlock,
            "draft_max": self.draft_max, "draft_tree": self.draft_tree,
            "draft": ("hybrid" if self.suffix_drafter else "model") if self.drafter_placement != "none"
            else ("suffix" if self.suffix_drafter else "none"),
            "draft_model": self.drafter if self.drafter_placement != "none" else None,
            "n_batch": self.n_batch, "n_ubatch": self.n_ubatch, "kv_type": self.kv_type,
            "type_k": KV_CACHE_TYPES[self.kv_type].ggml_id, "type_v": KV_CACHE_TYPES[self.kv_type].ggml_id,
            "flash_attn": self.flash_attn, "repack": self.repack, "weights_mode": self.weights_mode,
            "drafter_n_gpu_layers": self.drafter_n_gpu_layers, "drafter_use_mmap": self.drafter_use_mmap,
            "drafter_repack": self.drafter_repack,
            "suffix_max_history_tokens": self.suffix_cap_tokens,
        }

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("parts", "decisions")}
        d["parts"] = [asdict(p) for p in self.parts]
        d["decisions"] = [{"name": x.name, "value": x.value, "why": x.why} for x in self.decisions]
        d["reasons"] = self.reasons
        d["engine"] = self.engine_settings()
        return d


@dataclass(frozen=True)
class Candidate:
    resident: bool
    repack: bool
    kv_type: str
    n_ubatch: int
    n_ctx: int
    drafter: str          # "gpu" | "cpu" | "none"
    suffix_cap: int       # 0: no suffix drafter
    placement: str = "cpu"  # edgespec.memory.placements mode

    @property
    def mode(self) -> placements.PlacementMode:
        return placements.MODES[self.placement]

    @property
    def target_on_gpu(self) -> bool:
        """Whether the target's attention runs on a GPU (the attention kernel's default follows)."""
        return self.resident and self.mode.target != "cpu"


@dataclass
class Evaluation:
    cfg: Candidate
    fits: bool
    ram: int
    vram: int
    penalty: float
    parts: list[Part]
    ngl: int
    drafter_ngl: int
    use_mmap: bool
    drafter_mmap: bool
    drafter_repack: bool
    repack_active: bool
    target_ctx: ContextFootprint
    drafter_ctx: ContextFootprint | None
    repack_bytes: int
    file_bytes: int
    graph_sizes: tuple[int, ...] = ()  # batch sizes the target keeps graphs for (placements.graph_sizes)


class Evaluator:
    def __init__(self, target: ModelFootprint, drafter: ModelFootprint | None, m: MachineInfo,
                 ram_budget: int, vram_budget: int, suffix: bool, draft_max: int, draft_tree: bool,
                 mmap: bool | None, repack: bool | None, external=None, drafter_required: bool = False,
                 target_repack: bool | None = None, flash_attn: bool | None = None):
        self.t, self.d, self.m = target, drafter, m
        self.ram_budget, self.vram_budget = ram_budget, vram_budget
        self.suffix, self.draft_max, self.draft_tree = suffix, draft_max, draft_tree
        self.force_mmap, self.force_repack, self.force_target_repack = mmap, repack, target_repack
        self.force_flash_attn = flash_attn
        self.gpu = bool(m.gpus) and m.gpu_offload and vram_budget > 0
        self.feats = m.cpu_features
        self.external = external  # a drafter outside llama.cpp (make_plan's external_drafter)
        self.drafter_required = drafter_required
        self._repack_memo: dict[tuple, int] = {}

    def target_repack(self, cfg: Candidate) -> bool:
        """Whether the candidate repacks the target's CPU weights (exact mode forces it off
        for the target alone: the drafter's kernels do not touch the answer)."""
        return cfg.repack if self.force_target_repack is None else self.force_target_repack and cfg.repack

    def _repack(self, fp: ModelFootprint, n_cpu_blocks: int, head: bool) -> int:
        k = (id(fp), n_cpu_blocks, head)
        if k not in self._repack_memo:
            self._repack_memo[k] = fp.repack_bytes(self.feats, range(n_cpu_blocks), head=head)
        return self._repack_memo[k]

    # -- pieces -------------------------------------------------------------------------------
    def _drafting(self, cfg: Candidate) -> bool:
        return cfg.suffix_cap > 0 or cfg.drafter != "none" or self.external is not None

    def flash_attn(self, cfg: Candidate) -> bool:
        """The attention kernel the engine will build for this candidate (asked, not copied)."""
        if self.force_flash_attn is not None:
            return self.force_flash_attn
        return resolved_flash_attn(default_flash_attn(cfg.target_on_gpu, cfg.kv_type, self.m.qmatmul))

    def _target_ctx(self, cfg: Candidate) -> ContextFootprint:
        drafting = self._drafting(cfg)
        return estimate_context(self.t, cfg.n_ctx, cfg.n_ubatch, 1 + self.draft_max if drafting else 1,
                                cfg.kv_type, self.flash_attn(cfg), n_outputs=self.draft_max + 1 if drafting else 1,
                                n_outputs_max=placements.VERIFY_ROWS)

    def _drafter_ctx(self, cfg: Candidate) -> ContextFootprint:
        """The context ModelDrafter declares it builds (its own cache type and micro-batch)."""
        p = placements.drafter_context_params(cfg.n_ctx)
        rows = placements.TREES.draft_max if self.draft_tree else 1  # a search round decodes at most a tree's nodes
        return estimate_context(self.d, p.n_ctx, p.n_ubatch, p.n_seq_max, p.kv_type,
                                resolved_flash_attn(p.flash_attn), n_batch=p.n_batch, n_outputs=rows)

    def _gpu_need(self, fp: ModelFootprint, cf: ContextFootprint, k: int, runtime: bool) -> int:
        """VRAM for ``n_gpu_layers = k``: head + last k-1 blocks, their KV, compute buffer."""
        if k <= 0:
            return 0
        blocks = range(fp.n_layer - min(k - 1, fp.n_layer), fp.n_layer)
        weights = fp.head_bytes + sum(fp.layer_bytes[i] for i in blocks)
        kv = cf.n_cells * fp.kv_bytes_per_token(cf.kv_type, blocks)
        compute = 4 * cf.n_outputs * (fp.n_vocab + 2 * fp.n_embd)
        if len(blocks):
            compute = max(compute, cf.compute_layer)
        # Device memory is allocated, not touched page by page: with the output head on the GPU
        # the compute buffer holds llama.cpp's whole reservation (H100, llama.cpp's default of 512
        # logits rows: 314 MiB for the 1.5B all on the GPU, 151 MiB split at n_ubatch 256; H200,
        # the engine's 65: 101 MiB).
        compute = max(compute, cf.compute_reserved)
        return weights + kv + compute + (GPU_RUNTIME_BYTES if runtime else 0)

    def _model_ram(self, fp: ModelFootprint, cf: ContextFootprint, k: int, resident: bool,
                   repack: bool, label: str, pin: bool = False,
                   picked: bool = False) -> tuple[list[Part], bool, bool, int, int]:
        """RAM parts of one model with k layers on the GPU; returns parts, mmap, repack, repack bytes,
        file-backed bytes. ``pin``: resident CPU weights are read into the GPU build's pinned host
        buffers (no mmap), which op offload copies to the GPU by DMA. ``picked``: the backend
        makes its greedy picks (placements.greedy_on_backend), which widens its output buffer."""
        n_cpu_blocks = fp.n_layer - min(max(k - 1, 0), fp.n_layer)
        cpu_blocks = range(n_cpu_blocks)
        head_on_cpu = k == 0
        cpu_weights = fp.embd_bytes + fp.other_bytes + sum(fp.layer_bytes[i] for i in cpu_blocks) \
            + (fp.output_bytes if head_on_cpu else 0)
        parts: list[Part] = []
        file_bytes = 0
        rp = self._repack(fp, n_cpu_blocks, head_on_cpu) if repack and resident else 0
        if resident:
            if self.force_mmap is not None:
                use_mmap = self.force_mmap and self.m.mmap_supported
            else:
                use_mmap = self.m.mmap_supported and rp == 0 and not pin
            if use_mmap:
                parts.append(Part(f"{label} weights", "RAM", cpu_weights,
                                  "mapped from the file, all pages resident"))
                if rp:
                    parts.append(Part(f"{label} repacked weights", "RAM", rp,
                                      "CPU_REPACK copy for the interleaved kernels; the mapped originals stay resident too"))
            else:
                how = "full load" if rp else "pinned host buffers, no mmap" if pin else "no mmap"
                parts.append(Part(f"{label} weights", "RAM", cpu_weights - rp, f"read into memory ({how})"))
                if rp:
                    parts.append(Part(f"{label} repacked weights", "RAM", rp,
                                      "read straight into the CPU_REPACK buffer (no second copy without mmap)"))
        else:
            use_mmap = True
            row = fp.embd_bytes // max(fp.n_vocab, 1)
            head = fp.head_bytes if head_on_cpu else 0
            embd_rows = 0 if (fp.tied_output and head_on_cpu) else min(fp.embd_bytes, 2 * cf.n_ubatch * row)
            max_block = max((fp.layer_bytes[i] for i in cpu_blocks), default=0)
            ws = 2 * max_block + head + embd_rows + fp.other_bytes
            parts.append(Part(f"{label} weights (working set)", "RAM", ws,
                              f"2 x largest layer ({fmt_bytes(max_block)}) + output head ({fmt_bytes(head)})"
                              " + embedding rows of one batch; dropped from memory layer by layer"))
            file_bytes = cpu_weights
            parts.append(Part(f"{label} weights (in the file)", "file", cpu_weights,
                              "stay in the mapped file, read again each token (page cache, not budgeted)"))
        parts.append(Part(f"{label} vocabulary & metadata", "RAM", fp.runtime_bytes,
                          f"{fp.n_vocab} tokens, {fp.n_merges} merges"))
        cpu_kv = cf.n_cells * fp.kv_bytes_per_token(cf.kv_type, cpu_blocks)
        parts.append(Part(f"{label} KV cache", "RAM", cpu_kv,
                          f"{cf.kv_type}, {cf.n_cells} cells x {n_cpu_blocks} layers"))
        parts.append(self._compute_part(fp, cf, k, n_cpu_blocks, label))
        parts.append(Part(f"{label} work buffer", "RAM", cf.work_bytes if (k == 0 or n_cpu_blocks) else MiB,
                          "quantized activations for the CPU kernels"))
        widen = placements.OUTPUT_PICKED if picked else 1
        parts.append(Part(f"{label} logits buffer", "RAM", widen * cf.output_bytes,
                          f"{max(cf.n_seq, cf.n_outputs)} rows x {fp.n_vocab} floats"
                          + (f" x {widen} (greedy picks on the GPU)" if picked else "")))
        return parts, use_mmap, bool(rp), rp, file_bytes

    def _compute_part(self, fp: ModelFootprint, cf: ContextFootprint, k: int, n_cpu_blocks: int,
                      label: str) -> Part:
        """The CPU compute buffer of a model with k layers on the GPU. llama.cpp gives it the
        GPU's host buffer type when the model has a GPU device, even with no layer there; on
        CUDA that memory is pinned, so all of the reservation is resident, where a CPU build
        faults in only what the engine touches."""
        pinned = k == 0 and placements.cuda_pins(self.m)
        if pinned:
            compute = cf.compute_reserved
        elif k == 0:
            compute = cf.compute_bytes
        elif n_cpu_blocks:
            compute = cf.compute_layer
        else:
            compute = 8 * cf.n_ubatch * fp.n_embd  # the input embeddings only
        how = "pinned by CUDA (CUDA_Host), all resident" if pinned else "the engine touches this much"
        return Part(f"{label} compute buffer", "RAM", compute, f"n_ubatch {cf.n_ubatch}; llama.cpp reserves "
                    f"{fmt_bytes(cf.compute_reserved)} for {cf.n_outputs_max} logits rows, {how}")

    # -- one configuration ----------------------------------------------------------------------
    def _target_layers(self, cfg: Candidate, tc: ContextFootprint, drafter_vram: int) -> int:
        """Target layers on the GPU for the candidate's placement (0: none fits a split target).
        A split target gets as many as the VRAM left by the drafter holds (head first, then the
        last blocks, as llama.cpp assigns them), and keeps at least one block on the CPU."""
        mode = cfg.mode
        if mode.target == "cpu" or not cfg.resident:
            return 0
        if mode.target == "gpu":
            return self.t.n_layer + 1
        room = self.vram_budget - drafter_vram
        return next((k for k in range(self.t.n_layer, 0, -1) if self._gpu_need(self.t, tc, k, True) <= room), 0)

    def evaluate(self, cfg: Candidate) -> Evaluation:
        t = self.t
        tc = self._target_ctx(cfg)
        parts: list[Part] = [Part("process (Python, libraries)", "RAM", PROCESS_BASE_BYTES, "baseline")]
        gname = self.m.gpus[0].name if self.m.gpus else "GPU"
        dc = self._drafter_ctx(cfg) if cfg.drafter != "none" and self.d is not None else None
        dngl = self.d.n_layer + 1 if dc is not None and cfg.drafter == "gpu" else 0
        dvram = self._gpu_need(self.d, dc, dngl, False) if dngl else 0
        ngl = self._target_layers(cfg, tc, dvram)
        vram = self._gpu_need(t, tc, ngl, True) + dvram
        if ngl:
            parts.append(Part("target layers on GPU", gname, vram - dvram,
                              f"{ngl}/{t.n_layer + 1} layers (head + {ngl - 1} blocks) with their KV cache "
                              f"and compute buffer, + {fmt_bytes(GPU_RUNTIME_BYTES)} runtime"))
        elif dvram:
            vram += GPU_RUNTIME_BYTES
        sizes, kept = self._kept_graphs(cfg, tc, ngl, vram)
        if sizes:
            vram += kept
            parts.append(Part("target's graphs kept by size", gname, kept,
                              f"a compute buffer for each of {len(sizes)} batch sizes, 1 to {sizes[-1]} tokens"))
        # A GPU build repacks CPU weights only outside its pinned host buffers, which a split
        # target keeps (their weights are what op offload streams to the GPU).
        repack = self.target_repack(cfg) and not (self.m.gpu_offload and 0 < ngl)
        tparts, use_mmap, rp_on, rp_bytes, file_bytes = self._model_ram(
            t, tc, ngl, cfg.resident, repack, "target", pin=placements.pins_split_target(ngl, t.n_layer, self.m),
            picked=placements.greedy_on_backend(ngl, self.m) and cfg.drafter == "none" and not cfg.suffix_cap)
        parts += tparts
        d_mmap = d_repack = False
        if dc is not None:
            if dngl:
                parts.append(Part("drafter on GPU", gname, dvram, "all layers, KV cache and compute buffer"))
            dparts, d_mmap, d_repack, _, _ = self._model_ram(self.d, dc, dngl, True, cfg.repack, "drafter")
            parts += dparts
        if placements.cuda(self.m):  # the device query made the runtime, whatever this plan places on the GPU
            n_contexts = 1 + (dc is not None)
            host = GPU_HOST_RUNTIME_BYTES + n_contexts * GPU_HOST_PER_CONTEXT_BYTES
            parts.append(Part("GPU runtime (host)", "RAM", host, f"the CUDA driver's and libraries' host memory, + "
                              f"{fmt_bytes(GPU_HOST_PER_CONTEXT_BYTES)} for each of {n_contexts} llama.cpp context(s)"))
        if cfg.suffix_cap:
            parts.append(Part("suffix index", "RAM", SUFFIX_BYTES_PER_TOKEN * (cfg.suffix_cap + cfg.n_ctx),
                              f"history cap {cfg.suffix_cap} tokens + the current context, "
                              f"~{SUFFIX_BYTES_PER_TOKEN} B/token"))
        if not cfg.resident:
            parts.append(Part("weight releaser headroom", "RAM", RELEASE_MARGIN,
                              "what a pass may fault in before the watcher drops the mapped weights"))
        if self.external is not None:  # e.g. the ONNX drafter: its own runtime, sized by itself
            parts += [Part(c, self.external.where, nbytes, note) for c, nbytes, note in self.external.parts(cfg.n_ctx)]
        ram = sum(p.bytes for p in parts if p.where == "RAM")
        if self.m.unified_memory:
            ram += vram  # one pool: GPU allocations come out of the same RAM
        fits = ram <= self.ram_budget and vram <= max(self.vram_budget, 0)
        if cfg.mode.target == "split" and ngl == 0:
            fits = False  # not one layer fits beside the drafter: that is draft-gpu or cpu
        penalty = self._penalty(cfg, ngl)
        return Evaluation(cfg, fits, ram, vram, penalty, parts, ngl, dngl, use_mmap, d_mmap, d_repack, rp_on, tc, dc,
                          rp_bytes, file_bytes, sizes)

    def _kept_graphs(self, cfg: Candidate, tc: ContextFootprint, ngl: int,
                     vram: int) -> tuple[tuple[int, ...], int]:
        """(sizes, bytes): the batch sizes the target keeps graphs for (placements.graph_sizes),
        each with a compute buffer for that many rows; none where the VRAM budget does not hold
        them beside the rest."""
        rows = tc.n_outputs if self._drafting(cfg) else 1
        sizes = placements.graph_sizes(ngl, self.t.n_layer, rows, self.m.gpu_offload)
        kept = sum(verify_graph_bytes(self.t, tc, s) for s in sizes)
        return (sizes, kept) if sizes and vram + kept <= self.vram_budget else ((), 0)

    def _penalty(self, cfg: Candidate, ngl: int) -> float:
        """The candidate's cost under RANKING: the sum of the weights of what it gives up."""
        w = {k: v.cost for k, v in RANKING.items()}
        p = 0.0 if cfg.resident else w["file_backed"]
        p += {"f16": 0.0, "q8_0": w["kv_q8_0"], "q4_0": w["kv_q4_0"]}[cfg.kv_type]
        p += {512: 0.0, 256: w["ubatch_256"], 128: w["ubatch_128"]}.get(cfg.n_ubatch, w["ubatch_64"])
        if self.d is not None:
            p += {"gpu": 0.0, "cpu": w["drafter_cpu_beside_gpu"] if self.gpu else 0.0,
                  "none": w["no_drafter_model"] + (w["no_drafter_beside_gpu"] if self.gpu else 0.0)
                  + (w["required_drafter_dropped"] if self.drafter_required else 0.0)}[cfg.drafter]
        if cfg.suffix_cap:
            p += w["suffix_cap_step"] * SUFFIX_CAPS.index(cfg.suffix_cap)
        unrepacked = not self.target_repack(cfg) and self._repack(self.t, self.t.n_layer, True)
        if unrepacked or (cfg.drafter == "cpu" and not cfg.repack and self._repack(self.d, self.d.n_layer, True)):
            p += w["no_repack"]
        if self.gpu:
            p += w["cpu_layers"] * (1 - ngl / (self.t.n_layer + 1))
        return p


def layouts(pl: Evaluator, forced: str | None, cpu_target: bool = False) -> list[tuple[str, str]]:
    """(placement, drafter location) pairs to try: a drafter model runs where its placement puts
    it, or not at all; draft-gpu without a drafter model is the cpu placement."""
    names = [forced] if forced else [n for n, p in placements.MODES.items()
                                     if p.automatic and (pl.gpu or not p.needs_gpu)
                                     and not (cpu_target and p.target != "cpu")]
    out = []
    for name in names:
        mode = placements.mode(name)
        if pl.d is not None:
            out.append((name, mode.drafter))
        if mode.target != "cpu" or mode.drafter != "gpu" or forced:
            out.append((name, "none"))
    return out


def ctx_options(n_ctx: int | None, n_ctx_train: int) -> list[int]:
    if n_ctx is not None:
        return [n_ctx]
    top = min(placements.DEFAULT_CTX, n_ctx_train) if n_ctx_train else placements.DEFAULT_CTX
    out = [top]
    while out[-1] // 2 >= 512:
        out.append(out[-1] // 2)
    return out


def describe(cfg: Candidate, has_drafter: bool) -> str:
    bits = ["resident weights" if cfg.resident else "file-backed weights", f"{cfg.kv_type} KV cache",
            f"n_ubatch {cfg.n_ubatch}"]
    if has_drafter:
        bits.append("no model drafter" if cfg.drafter == "none" else f"drafter on {cfg.drafter.upper()}")
    if cfg.suffix_cap:
        bits.append(f"suffix cap {cfg.suffix_cap} tokens")
    return ", ".join(bits)


@dataclass(frozen=True)
class ShapeChoice:
    """The draft shape a plan takes (edgespec.memory.placements.DraftShape) and why."""

    shape: placements.DraftShape
    asked: tuple[int | None, bool | None]  # (draft_max, draft_tree) as given; None: the default
    rejected: placements.DraftShape | None = None  # the placement's longer default, not taken ...
    given_way: str | None = None  # ... because it would cost this
    plan: tuple | None = None  # (planner, best, evals) of the longer shape, when taken
    auto: bool = True  # the placement's longer default applies (`auto` only)

    @property
    def long_default(self) -> bool:
        """Whether the plan took the placement's longer default."""
        return self.plan is not None
