"""LoadPlan: what one EngineConfig loads on this machine, decided before anything is loaded."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

from edgespec.config import EngineConfig
from edgespec.drafters import DraftConfig
from edgespec.drafters.auto.memory import LeftOut
from edgespec.llama.backend import ContextParams, ModelParams
from edgespec.memory import placements
from edgespec.memory.planner import Plan


@dataclass(frozen=True)
class DrafterPlacement:
    """Where the plan put the drafter: whether its model may load, how, and the suffix cap."""

    model_allowed: bool  # False: the drafter model did not fit (auto runs without it)
    model_params: ModelParams | None
    suffix_cap_tokens: int
    calibration_tag: str  # "-filebacked": costs differ from a resident load


@dataclass(frozen=True)
class LoadPlan:
    """Everything Engine loads for a config: the target's model and context parameters, the
    drafter to build, the draft shape, and the notes to show (``edgespec plan`` prints it)."""

    config: EngineConfig
    target_path: Path
    model: ModelParams
    context: ContextParams
    shape: placements.DraftShape
    draft: str | None  # the drafter kind to build (may differ from the config's: see notes)
    mode: placements.PlacementMode | None  # None: loaded as asked (no budget, no placement)
    plan: Plan | None = None  # the planner's parts and decisions, when it placed the load
    drafter: DrafterPlacement | None = None  # None: as asked
    release_limit: int | None = None  # file-backed weights: resident bytes above which they drop
    notes: tuple[str, ...] = ()
    left_out: LeftOut | None = None  # `auto` planned its drafter model, then left it out

    @property
    def overlap(self) -> bool:
        """Whether speculative steps draft ahead during verification."""
        return self.config.overlap or (self.mode is not None and self.mode.overlap)

    @property
    def file_backed(self) -> bool:
        """Whether the target's weights stay in the mapped file, dropped above ``release_limit``."""
        return self.release_limit is not None

    @property
    def model_drafter_allowed(self) -> bool:
        return self.drafter is None or self.drafter.model_allowed

    def draft_config(self, kind: str | None = None, shape: placements.DraftShape | None = None) -> DraftConfig:
        """The drafter ``kind`` (default: the plan's) drafting ``shape`` (default: the plan's),
        placed as this plan places drafters. The suffix index drafts chains where the shape is
        chains (a CPU target, unless --draft-tree) and in exact mode: a tree's accepted tokens sit
        in cache cells out of position order, which parted 2 of 30 Spec-Bench answers from plain
        decoding's on an AVX-512 VM whose kernels keep every row's bits."""
        c, shape = self.config, shape or self.shape
        cfg = DraftConfig(kind=kind or self.draft, draft_model=c.draft_model, tree=shape.tree, n_ctx=self.context.n_ctx,
                          n_threads=c.n_threads, draft_max=shape.draft_max, onnx_provider=c.onnx_provider,
                          onnx_bits=c.onnx_bits, chains=c.exact or not shape.tree)
        d = self.drafter
        if d is None:
            return cfg
        # An ONNX drafter is counted only for --draft onnx, so `auto` may not pick one here.
        return replace(cfg, allow_model=d.model_allowed, allow_onnx=False, model_params=d.model_params,
                       suffix_history_tokens=d.suffix_cap_tokens, calibration_tag=d.calibration_tag)

    def to_dict(self) -> dict:
        """The plan as JSON: the planner's plan (when placed) and the load settings."""
        out = self.plan.to_dict() if self.plan is not None else {}
        out.update(model=self.config.model, target_path=str(self.target_path), placement=self.mode.name
                   if self.mode else None, draft=self.draft, draft_max=self.shape.draft_max,
                   draft_tree=self.shape.tree, overlap=self.overlap, notes=list(self.notes),
                   model_params=asdict(self.model), context_params=asdict(self.context))
        if self.plan is None:
            out.update(n_gpu_layers=self.model.n_gpu_layers, n_ctx=self.context.n_ctx,
                       kv_type=self.context.kv_type, flash_attn=self.context.flash_attn,
                       repack=self.model.repack, use_mmap=self.model.use_mmap)
        return out
