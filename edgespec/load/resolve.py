"""One resolution of options into what gets loaded.

``resolve(config, machine, store)`` reads the model files' metadata, the machine and `auto`'s
calibration cache (it loads nothing and writes nothing; in exact mode it turns llama.cpp's tiled
matmul off for the process, edgespec.llama.invariant) and decides the placement, the target's
model and context parameters, the drafter to build and how, the draft shape and the notes to
show. Engine loads exactly that; ``edgespec plan`` prints it.

Without a budget or a placement the target loads as asked (``n_gpu_layers``); with one, the
planner (edgespec.memory.planner) places target and drafter within the budgets, and raises
BudgetExceeded, naming the smallest budget that works, when nothing fits.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from edgespec.config import EngineConfig
from edgespec.errors import BudgetExceeded, InvalidRequest
from edgespec.files.modelfile import ModelFile, model_file
from edgespec.files.store import ModelStore
from edgespec.drafters import kind_of
from edgespec.llama import invariant
from edgespec.llama.backend import ContextParams, ModelParams
from edgespec.llama.kernels import default_flash_attn
from edgespec.llama.rows import OUTPUT_ARGMAX
from edgespec.load import drafter as drafter_files
from edgespec.load.plan import DrafterPlacement, LoadPlan
from edgespec.memory import placements, planner
from edgespec.memory.filebacked import RELEASE_MARGIN
from edgespec.memory.footprint import ModelFootprint, footprint_of
from edgespec.memory.machine import MachineInfo


def exact_plan(m: MachineInfo) -> dict:
    """What exact mode (edgespec.llama.invariant) forces on a plan for ``m``: flash attention
    follows the cache."""
    return {"target_repack": False, "kv_type": invariant.kv_type(m.qmatmul), "cpu_target": True}


def resolve(config: EngineConfig, machine: MachineInfo, store: ModelStore, *,
            keep_drafter: bool = False) -> LoadPlan:
    """What ``config`` loads on ``machine`` from ``store``.

    ``keep_drafter``: `auto`'s drafter model stays in the plan (where it fits) even where its
    calibration says it cannot pay, for a caller that also drafts with the model itself (the
    bench's `model` configurations beside `auto`, which then decides per step as ever).

    Raises:
        ModelNotFound / InvalidGGUF: a model cannot be found or read.
        IncompatibleModels: the drafter model's vocabulary does not match the target's.
        InvalidRequest: a context above the model's trained context, or inconsistent options.
        PlacementUnavailable: a forced placement needs a GPU this machine or build lacks.
        BudgetExceeded: nothing fits the budgets.
    """
    if config.exact:  # before a calibration key is read, and before any decode of this process
        invariant.enable()
    path = store.resolve(config.model)
    target = model_file(path)
    trained = target.info.context_length
    if trained and config.n_ctx > trained:
        raise InvalidRequest(f"context {config.n_ctx} exceeds the model's trained context {trained}; "
                             f"use --ctx {trained} or less")
    if config.planned:
        return _placed(config, path, target, machine, store, keep_drafter)
    return _as_asked(config, path, target, machine, store)


def _as_asked(config: EngineConfig, path: Path, target: ModelFile, m: MachineInfo, store: ModelStore) -> LoadPlan:
    """The target as asked (``n_gpu_layers``), with the planner's rules for a GPU build
    (placements.unplanned_target), drafting chains unless told otherwise."""
    shape = placements.CHAINS.given(config.draft_max, config.draft_tree)
    op_offload, use_mmap = placements.unplanned_target(config.n_gpu_layers, target.info.n_layers or 0, m,
                                                       config.use_mmap)
    model = ModelParams(n_gpu_layers=config.n_gpu_layers, use_mmap=use_mmap, use_mlock=config.use_mlock)
    kv_type = config.kv_type or "f16"
    flash = config.flash_attn if config.flash_attn is not None else \
        default_flash_attn(on_gpu=config.n_gpu_layers != 0, kv_type=kv_type, qmatmul=m.qmatmul)
    # one sequence per root-to-leaf path of a draft, plus the main one
    n_seq = config.n_seq_max or 1 + (shape.draft_max if config.draft is not None else 0)
    context = ContextParams(n_ctx=config.n_ctx, n_threads=config.n_threads, n_seq_max=n_seq, kv_type=kv_type,
                            n_outputs_max=placements.VERIFY_ROWS, flash_attn=flash, op_offload=op_offload,
                            greedy_on_backend=config.greedy_on_backend and (config.draft is None or OUTPUT_ARGMAX)
                            and placements.greedy_on_backend(config.n_gpu_layers, m),
                            graph_sizes=placements.graph_sizes(config.n_gpu_layers, target.info.n_layers or 0,
                                                               shape.draft_max + 1 if config.draft else 1, m.gpu_offload))
    if config.exact:
        model, context = invariant.model_params(model), invariant.context_params(context)
    notes = drafter_files.drafter_path(config, target, store)[1] if config.draft is not None else ()
    return LoadPlan(config, path, model, context, shape, config.draft, None, notes=tuple(notes))


@dataclass(frozen=True)
class _Drafters:
    """What the drafter asked for is, for the planner: its model's footprint (None: no drafter
    model), whether a suffix index runs, the ONNX drafter's footprint, and notes."""

    kind: object  # edgespec.drafters.DrafterKind, or None for the plain generator
    path: Path | None
    footprint: ModelFootprint | None
    suffix: bool
    onnx: object
    notes: tuple[str, ...]


def _drafters(config: EngineConfig, target: ModelFile, store: ModelStore) -> _Drafters:
    if config.draft is None:
        return _Drafters(None, None, None, False, None, ())
    kind = kind_of(config.draft)
    path, notes = drafter_files.drafter_path(config, target, store)
    fp = None
    if path is not None:
        fp = replace(footprint_of(model_file(path)), name=drafter_files.label(config, target, path))
    onnx = drafter_files.onnx_footprint(config, target, store, notes) if kind.onnx_model else None
    return _Drafters(kind, path, fp, kind.suffix, onnx, tuple(notes))


def _plan(config: EngineConfig, target: ModelFootprint, drafters: _Drafters, drafter: ModelFootprint | None,
          suffix: bool, m: MachineInfo) -> planner.Plan:
    """The planner's plan for ``config`` with ``drafter`` (None: no drafter model)."""
    kind = drafters.kind
    options = dict(kv_type=config.kv_type, draft_tree=config.draft_tree)
    if config.exact:  # EngineConfig refused a cache type or trees exact mode cannot keep
        options.update(exact_plan(m), draft_tree=False)
    return planner.make_plan(target, drafter, ram_budget=config.ram_budget, vram_budget=config.vram_budget,
                             n_ctx=config.n_ctx, machine_info=m, suffix=suffix, draft_max=config.draft_max,
                             long_drafts=config.draft == "auto", threads=config.n_threads,
                             placement=config.placement, external_drafter=drafters.onnx,
                             drafter_required=kind is not None and kind.model == "always",
                             flash_attn=config.flash_attn, mlock=config.use_mlock, **options)


def _placed(config: EngineConfig, path: Path, target_file: ModelFile, m: MachineInfo,
            store: ModelStore, keep_drafter: bool = False) -> LoadPlan:
    """The planner's placement within the budgets, with `auto`'s drafter left out where its
    calibration says it cannot pay (unless ``keep_drafter``), a drafter model that does not fit
    swapped for the suffix drafter, and a layout expected slower than plain decoding at the same
    budgets (planner.Plan.plain_note), all stated in the notes."""
    target = replace(footprint_of(target_file), name=config.model)
    d = _drafters(config, target_file, store)
    notes, suffix, dfp = list(d.notes), d.suffix, d.footprint
    plan = _plan(config, target, d, dfp, suffix, m)
    left_out = None
    if config.draft == "auto" and dfp is not None and plan.drafter_placement != "none" and not keep_drafter:
        why = drafter_files.auto_skips_drafter(plan, path, d.path, store)
        if why:  # calibration says it cannot pay here: plan (and load) without it
            notes.append(why)
            skipped, plan, dfp = plan, _plan(config, target, d, None, suffix, m), None
            left_out = drafter_files.left_out(skipped, plan, path, d.path)
    draft, allowed = config.draft, dfp is not None and plan.drafter_placement != "none"
    if dfp is not None and plan.drafter_placement == "none":
        draft = "auto" if config.draft == "auto" else "suffix"
        notes.append(f"the drafter model does not fit the {planner.fmt_bytes(plan.ram_budget)} RAM / "
                     f"{planner.fmt_bytes(plan.vram_budget)} VRAM budgets of the {plan.placement} "
                     "placement: using the suffix drafter instead")
        if not suffix:  # plan the stand-in: its index and the target's draft rows
            try:
                plan = _plan(config, target, d, None, True, m)
            except BudgetExceeded:
                pass  # what fits: the sequences alone (_sequences)
    if plan.plain_note:
        notes.append(plan.plain_note)
    plan.warnings[:0] = notes
    return _from_plan(config, path, plan, draft, allowed, tuple(notes), left_out)


def _from_plan(config: EngineConfig, path: Path, plan: planner.Plan, draft: str | None, drafter_loads: bool,
               notes: tuple[str, ...], left_out) -> LoadPlan:
    """The load settings of the planner's ``plan``."""
    model = drafter_files.target_model_params(plan)
    n_seq = max(plan.n_seq_max, config.n_seq_max or 1, _sequences(plan, draft))
    context = ContextParams(n_ctx=plan.n_ctx, n_batch=plan.n_batch, n_ubatch=plan.n_ubatch, n_seq_max=n_seq,
                            n_threads=plan.threads, n_outputs_max=placements.VERIFY_ROWS, kv_type=plan.kv_type,
                            flash_attn=plan.flash_attn, op_offload=plan.op_offload,
                            greedy_on_backend=config.greedy_on_backend and (draft is None or OUTPUT_ARGMAX)
                            and plan.n_gpu_layers > 0,
                            graph_sizes=plan.graph_sizes if draft is not None else ())
    if config.exact:
        model, context = invariant.model_params(model), invariant.context_params(context)
    file_backed = plan.weights_mode == "file-backed"
    drafter = DrafterPlacement(drafter_loads, drafter_files.drafter_model_params(plan) if drafter_loads else None,
                               plan.suffix_cap_tokens, drafter_files.calibration_tag(plan))
    return LoadPlan(config, path, model, context, placements.DraftShape(plan.draft_max, plan.draft_tree), draft,
                    placements.mode(plan.placement), plan, drafter,
                    max(plan.ram_budget - RELEASE_MARGIN, 1) if file_backed else None, notes, left_out)


def _sequences(plan: planner.Plan, draft: str | None) -> int:
    """The target context's sequences when it drafts: one per root-to-leaf path, plus the main
    one (a drafter swapped for the suffix drafter drafts although the plan counted none)."""
    return 1 + plan.draft_max if draft not in (None, "none") else 1


def each_placement(config: EngineConfig, m: MachineInfo, store: ModelStore) -> dict[str, LoadPlan | str]:
    """What each placement mode would load with ``config``'s budgets, or why it cannot."""
    out: dict[str, LoadPlan | str] = {}
    for name in placements.NAMES:
        try:
            out[name] = resolve(replace(config, placement=name), m, store)
        except placements.PlacementUnavailable:
            out[name] = "needs a GPU: " + placements.unavailable(m)[name]
        except (BudgetExceeded, InvalidRequest) as exc:
            out[name] = str(exc)
    return out
