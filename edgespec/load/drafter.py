"""The drafter side of a load plan: which drafter model a config means, what it holds, the
settings the planner gives it, and `auto`'s cached verdict on whether it can pay."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from edgespec.config import EngineConfig
from edgespec.drafters import DEFAULT_DRAFT_MODELS, KINDS, drafter_model_path, kind_of
from edgespec.drafters.auto.calibrate import cached_draft_cost, cached_verify, calibration_key
from edgespec.drafters.auto.memory import LeftOut, PolicyMemory, draft_shape_name
from edgespec.drafters.auto.select import no_gain, pays
from edgespec.errors import InvalidRequest, ModelNotFound
from edgespec.files.modelfile import ModelFile, model_file
from edgespec.files.store import ModelStore
from edgespec.files.vocab import check_compatible
from edgespec.llama.backend import ModelParams, default_threads, graph_sizes
from edgespec.memory import planner
from edgespec.memory.footprint import estimate_onnx_drafter, footprint_of
from edgespec.memory.placements import drafter_context_params
from edgespec.onnx.convert import onnx_dir_for
from edgespec.onnx.providers import used_provider


def drafter_path(config: EngineConfig, target: ModelFile, store: ModelStore) -> tuple[Path | None, list[str]]:
    """The drafter model file ``config`` loads for ``target`` (None: none), its vocabulary
    checked, and notes on a model `auto` runs without.

    Raises:
        ModelNotFound: a named model (or `model`/`hybrid`'s default) is not in the store.
        InvalidRequest: `model`/`hybrid` with no default drafter model for this tokenizer.
        IncompatibleModels: the drafter's vocabulary does not match the target's.
    """
    kind, notes = kind_of(config.draft), []
    try:
        path = drafter_model_path(config.draft, config.draft_model, target.fingerprint, store)
    except (InvalidRequest, ModelNotFound) as exc:
        if kind.model != "optional" or config.draft_model is not None or config.draft not in KINDS:
            raise
        return None, [f"no drafter model ({exc}): suffix drafter only"]
    if path is None:
        if kind.model == "optional" and config.draft_model is None:
            notes.append("no default drafter model is pulled for this target: suffix drafter only")
        return None, notes
    check_compatible(target.gguf, model_file(path).gguf)
    return path, notes


def label(config: EngineConfig, target: ModelFile, path: Path) -> str:
    """The drafter model's name in a plan: as the user named it, else the store's default name."""
    if config.draft_model:
        return config.draft_model
    if config.draft not in KINDS:
        return config.draft
    return DEFAULT_DRAFT_MODELS.get(target.fingerprint, path.stem)


def onnx_footprint(config: EngineConfig, target: ModelFile, store: ModelStore, notes: list[str]):
    """What `--draft onnx` would hold (edgespec.memory.footprint.OnnxDrafterFootprint), or None
    when the default drafter model is not pulled (the engine reports it when it builds the
    drafter). Sized from the conversion's files when it exists (else from the GGUF), on the
    provider the session would really use: one this onnxruntime lacks falls back to the CPU.

    Raises:
        ModelNotFound: a named drafter model is not in the store.
        InvalidRequest: no default drafter model for this tokenizer and none named.
    """
    name = config.draft_model or DEFAULT_DRAFT_MODELS.get(target.fingerprint)
    if name is None:
        raise InvalidRequest("no default drafter model for this target; pass --draft-model NAME|PATH")
    if config.draft_model is None and not store.is_present(name):
        notes.append("the default drafter model is not pulled: the onnx drafter is not counted")
        return None
    path = store.resolve(name)
    check_compatible(target.gguf, model_file(path).gguf)
    fp = replace(footprint_of(model_file(path)), name=name)
    used = used_provider(config.onnx_provider)
    if used != config.onnx_provider:
        notes.append(f"onnx provider {config.onnx_provider} is not in this onnxruntime: planned on the CPU")
    return estimate_onnx_drafter(fp, onnx_dir_for(store, path, config.onnx_bits), config.onnx_bits, used)


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


def calibration_tag(plan: planner.Plan) -> str:
    """What sets a plan's calibrations apart: file-backed weights cost more than resident ones."""
    return "-filebacked" if plan.weights_mode == "file-backed" else ""


def target_key(plan: planner.Plan, target_path: Path) -> str:
    """The placement key `auto` calibrates and learns under, for the target as ``plan`` loads it."""
    return calibration_key(target_path, target_model_params(plan), plan.threads or default_threads(),
                           plan.flash_attn, calibration_tag(plan), graph_sizes(plan.graph_sizes))


def auto_skips_drafter(plan: planner.Plan, target_path: Path, drafter: Path, store: ModelStore) -> str | None:
    """Why `auto` will not load the drafter model this plan places, from this placement's cached
    calibration (edgespec.drafters.auto.select), or None when it may (or nothing is measured)."""
    threads = plan.threads or default_threads()
    key = target_key(plan, target_path)
    verify = cached_verify(store.home, key)
    cost = cached_draft_cost(store.home, calibration_key(drafter, drafter_model_params(plan), threads,
                                                         drafter_context_params(plan.n_ctx).flash_attn))
    memory = PolicyMemory(store.home, key)
    learned = memory.drafter_gain(draft_shape_name(memory, drafter, plan.draft_tree)[0])
    if verify is None or cost is None or pays(verify, cost, plan.draft_max, learned):
        return None
    return (f"auto: the drafter model is not loaded: calibrated here, a drafted token costs "
            f"{cost * 1e3:.0f} ms against {verify.verify(1) * 1e3:.0f} ms for a target step, and "
            f"{no_gain(learned)} (suffix drafts only)")


def left_out(skipped: planner.Plan, kept: planner.Plan, target_path: Path, drafter: Path) -> LeftOut:
    """What the load must record when `auto` left ``drafter`` out of ``skipped`` for ``kept``."""
    return LeftOut(str(drafter), target_key(skipped, target_path), skipped.draft_tree,
                   target_key(kept, target_path), kept.draft_tree)
