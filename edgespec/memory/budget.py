"""Turns a RAM budget into concrete load settings through the planner, and enforces it.

The engine calls ``placement`` before loading anything: it estimates the target (and the
drafter it would use) from GGUF metadata, asks the planner for a plan within the budget
(BudgetExceeded, with the smallest budget that would work, when none fits) and returns the
model / context parameters, the drafter to actually use (a model drafter that does not fit is
dropped for the suffix drafter, and said so), and whether the weights run file-backed.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from edgespec.memory import placements, planner
from edgespec.llama import invariant
from edgespec.llama.backend import ContextParams, ModelParams
from edgespec.drafters import KINDS, DraftConfig, drafter_model_path, kind_of
from edgespec.files.modelfile import model_file
from edgespec.errors import BudgetExceeded, InvalidRequest, ModelNotFound
from edgespec.files.store import ModelStore
from edgespec.memory.filebacked import RELEASE_MARGIN

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    plan: planner.Plan
    model_params: ModelParams
    context_params: ContextParams
    draft: str | None  # the drafter kind to build (may differ from the request: stated)
    model_drafter_allowed: bool  # False: the drafter model did not fit (auto runs without it)
    draft_model_params: ModelParams | None
    suffix_cap_tokens: int
    file_backed: bool
    release_limit: int  # resident bytes above which file-backed weights are dropped
    notes: tuple[str, ...] = ()

    def drafter_config(self, cfg: DraftConfig) -> DraftConfig:
        """``cfg`` with the drafter as this plan placed it: whether its model may load, where
        (the drafter model's GPU layers), the suffix index's cap and the calibration tag. An ONNX
        drafter is counted only for --draft onnx, so `auto` may not pick one under the plan."""
        return replace(cfg, allow_model=self.model_drafter_allowed, allow_onnx=False,
                       model_params=self.draft_model_params,
                       suffix_history_tokens=self.suffix_cap_tokens,
                       calibration_tag="-filebacked" if self.file_backed else "")


def _optional_drafter(draft: str, draft_model: str | None, fingerprint: str, store: ModelStore):
    """The drafter model a budgeted load plans for: a `model`/`hybrid` default that is not pulled
    plans without it (the engine then reports the missing model when it builds the drafter)."""
    try:
        return drafter_model_path(draft, draft_model, fingerprint, store)
    except (InvalidRequest, ModelNotFound):
        if draft_model or draft not in KINDS:
            raise
        return None


def onnx_drafter_footprint(draft_model: str | None, target_fingerprint: str, store: ModelStore,
                           provider: str = "cpu", bits: str = "exact"):
    """What `--draft onnx` would hold (edgespec.memory.footprint.OnnxDrafterFootprint), or None when
    the default drafter model is not pulled (the engine then reports it when it builds the drafter).

    Sized from the conversion's files when it exists (else from the GGUF), on the provider the
    session would really use: one this onnxruntime lacks falls back to the CPU, so RAM is counted.
    Raises:
        ModelNotFound: a named drafter model is not in the store.
        InvalidRequest: no default drafter model for this tokenizer and none named.
    """
    from edgespec.drafters import DEFAULT_DRAFT_MODELS, check_onnx_options
    from edgespec.memory.footprint import estimate_onnx_drafter
    from edgespec.onnx.convert import onnx_dir_for
    from edgespec.onnx.providers import used_provider

    check_onnx_options(provider, bits)
    name = draft_model or DEFAULT_DRAFT_MODELS.get(target_fingerprint)
    if name is None:
        raise InvalidRequest("no default drafter model for this target; pass --draft-model NAME|PATH")
    if draft_model is None and not store.is_present(name):
        return None
    path = store.resolve(name)
    fp = replace(model_file(path).footprint, name=name)
    return estimate_onnx_drafter(fp, onnx_dir_for(store, path, bits), bits, used_provider(provider))


# What exact mode (edgespec.llama.invariant) forces on a plan: flash attention follows the cache.
EXACT_PLAN = {"target_repack": False, "kv_type": invariant.KV_TYPE, "cpu_target": True}


def placement(target_path: str, store: ModelStore, ram_budget: int | None, n_ctx: int, draft: str | None,
              draft_model: str | None, draft_max: int | None, draft_tree: bool | None, threads: int | None,
              n_seq_max: int, vram_budget: int | None = None, mode: str | None = None,
              onnx_provider: str = "cpu", onnx_bits: str = "exact", exact: bool = False,
              flash_attn: bool | None = None) -> Placement:
    """Plans the load within the budgets (None: what the machine has free, minus a margin) and,
    when ``mode`` is given, in that placement; raises BudgetExceeded when nothing fits and
    PlacementUnavailable when the mode needs a GPU this build lacks. ``draft_max`` and
    ``draft_tree`` None: the placement's default (the plan's ``draft_max``/``draft_tree``).
    ``exact``: the target as exact mode loads it (edgespec.llama.invariant: no repacking, a q8_0
    cache), so that the memory counted and the calibration keys read are those of that load.
    ``flash_attn``: the target's attention kernel as the user forced it (None: the planner's)."""
    target = model_file(target_path)
    kind = kind_of(draft) if draft is not None else None
    dpath = _optional_drafter(draft, draft_model, target.fingerprint, store) if kind else None
    drafter_fp = model_file(dpath).footprint if dpath else None
    uses_suffix = kind is not None and kind.suffix
    onnx_fp = (onnx_drafter_footprint(draft_model, target.fingerprint, store, onnx_provider, onnx_bits)
               if kind is not None and kind.onnx_model else None)

    def plan_with(drafter):
        return planner.make_plan(target.footprint, drafter, ram_budget=ram_budget, vram_budget=vram_budget,
                                 n_ctx=n_ctx, suffix=uses_suffix, draft_max=draft_max, draft_tree=draft_tree,
                                 long_drafts=draft == "auto",
                                 threads=threads, placement=mode, external_drafter=onnx_fp,
                                 drafter_required=kind is not None and kind.model == "always",
                                 flash_attn=flash_attn, **(EXACT_PLAN if exact else {}))

    plan = plan_with(drafter_fp)
    notes = []
    if kind is not None and kind.name == "auto" and drafter_fp is not None and plan.drafter_placement != "none":
        why = auto_skips_drafter(plan, target_path, str(dpath), store, plan.draft_max, plan.draft_tree)
        if why:  # calibration says it cannot pay here: plan (and load) without it
            notes.append(why)
            skipped = plan
            plan = plan_with(None)
            _count_left_out(skipped, plan, target_path, str(dpath), store)
            dpath = drafter_fp = None
    # The drafter model may be loaded only where the plan counted it.
    effective, allowed = draft, drafter_fp is not None and plan.drafter_placement != "none"
    if drafter_fp is not None and plan.drafter_placement == "none":
        effective = "auto" if draft == "auto" else "suffix"
        notes.append(f"the drafter model does not fit the {planner.fmt_bytes(plan.ram_budget)} RAM / "
                     f"{planner.fmt_bytes(plan.vram_budget)} VRAM budgets of the {plan.placement} "
                     "placement: using the suffix drafter instead")
        if not uses_suffix:  # plan the stand-in: its index and the target's draft rows
            uses_suffix = True
            try:
                plan = plan_with(None)
            except BudgetExceeded:
                uses_suffix = False  # what fits: the sequences alone (_sequences)
    model_params = target_model_params(plan)
    context_params = ContextParams(n_ctx=plan.n_ctx, n_batch=plan.n_batch, n_ubatch=plan.n_ubatch,
                                   n_seq_max=max(plan.n_seq_max, n_seq_max, _sequences(plan, effective)),
                                   n_threads=plan.threads, n_outputs_max=placements.VERIFY_ROWS,
                                   kv_type=plan.kv_type, flash_attn=plan.flash_attn, op_offload=plan.op_offload)
    draft_model_params = drafter_model_params(plan) if plan.drafter_placement != "none" and drafter_fp else None
    file_backed = plan.weights_mode == "file-backed"
    for note in notes:
        log.warning("%s", note)
    return Placement(plan, model_params, context_params, effective, allowed, draft_model_params,
                     plan.suffix_cap_tokens, file_backed, max(plan.ram_budget - RELEASE_MARGIN, 1), tuple(notes))


def _sequences(plan: planner.Plan, draft: str | None) -> int:
    """The target context's sequences when it drafts: one per root-to-leaf path, plus the main
    one (a drafter swapped for the suffix drafter drafts although the plan counted none)."""
    return 1 + plan.draft_max if draft not in (None, "none") else 1


def target_model_params(plan: planner.Plan) -> ModelParams:
    return ModelParams(n_gpu_layers=plan.n_gpu_layers, use_mmap=plan.use_mmap, use_mlock=plan.use_mlock,
                       repack=plan.repack, no_host=plan.no_host)


def drafter_model_params(plan: planner.Plan) -> ModelParams:
    """The drafter as the plan counted it: a CPU drafter repacked only where its copy was
    planned (a plan that drops repacking counts none); a GPU drafter keeps llama.cpp's default,
    nothing of it being repacked."""
    on_cpu = plan.drafter_n_gpu_layers == 0
    return ModelParams(n_gpu_layers=plan.drafter_n_gpu_layers, use_mmap=plan.drafter_use_mmap,
                       repack=plan.drafter_repack or not on_cpu, no_host=on_cpu and plan.no_host)


def _target_key(plan: planner.Plan, target_path: str) -> str:
    """The placement key `auto` calibrates and learns under, for the target as ``plan`` loads it."""
    from edgespec.drafters.auto.calibrate import calibration_key
    from edgespec.llama.backend import default_threads

    tag = "-filebacked" if plan.weights_mode == "file-backed" else ""
    return calibration_key(target_path, target_model_params(plan), plan.threads or default_threads(),
                           plan.flash_attn, tag)


def _count_left_out(skipped: planner.Plan, plan: planner.Plan, target_path: str, drafter_path: str,
                    store: ModelStore) -> None:
    """Counts the drafter as left out (REPROBE_AFTER) under the key the load rule read, and its
    trees where they sat out (draft_shape_name), when the target planned without it learns under
    another key (more GPU layers, another shape) and its AutoDrafter therefore cannot."""
    from edgespec.drafters.auto.memory import PolicyMemory, draft_shape_name

    memory = PolicyMemory(store.home, _target_key(skipped, target_path))
    name, _, trees_out = draft_shape_name(memory, drafter_path, skipped.draft_tree)
    new = PolicyMemory(store.home, _target_key(plan, target_path))
    new_name, _, new_out = draft_shape_name(new, drafter_path, plan.draft_tree)
    if (memory.path, name) != (new.path, new_name):
        memory.left_out(name)
    if trees_out is not None and (memory.path, trees_out) != (new.path, new_out):
        memory.left_out(trees_out)


def auto_skips_drafter(plan: planner.Plan, target_path: str, drafter_path: str, store: ModelStore,
                       draft_max: int, draft_tree: bool = False) -> str | None:
    """Why `auto` will not load the drafter model this plan places, from this placement's cached
    calibration (edgespec.drafters.auto.select), or None when it may (or nothing is measured)."""
    from edgespec.drafters.auto.calibrate import cached_draft_cost, cached_verify, calibration_key
    from edgespec.drafters.auto.memory import PolicyMemory, draft_shape_name
    from edgespec.drafters.auto.select import no_gain, pays
    from edgespec.drafters.model import ModelDrafter
    from edgespec.llama.backend import default_threads

    threads = plan.threads or default_threads()
    target_key = _target_key(plan, target_path)
    verify = cached_verify(store.home, target_key)
    cost = cached_draft_cost(store.home, calibration_key(drafter_path, drafter_model_params(plan), threads,
                                                         ModelDrafter.context_params(plan.n_ctx).flash_attn))
    memory = PolicyMemory(store.home, target_key)
    learned = memory.drafter_gain(draft_shape_name(memory, drafter_path, draft_tree)[0])
    if verify is None or cost is None or pays(verify, cost, draft_max, learned):
        return None
    return (f"auto: the drafter model is not loaded: calibrated here, a drafted token costs "
            f"{cost * 1e3:.0f} ms against {verify.verify(1) * 1e3:.0f} ms for a target step, and "
            f"{no_gain(learned)} (suffix drafts only)")
