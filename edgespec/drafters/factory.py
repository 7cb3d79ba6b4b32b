"""Builds the drafter a DraftConfig names (edgespec.drafters registers the kinds), loading its
model where it has one; `auto` calibrates on the target's context and picks its runtimes."""
from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from edgespec.drafters import DraftConfig, drafter_model_path, kind_of
from edgespec.drafters.auto import AutoDrafter
from edgespec.drafters.auto.calibrate import (VERSION, cached_draft_cost, cached_verify, calibration_key,
                                              context_key, measure_draft_token, verify_costs)
from edgespec.drafters.auto.memory import PolicyMemory, draft_shape_name
from edgespec.drafters.auto.select import DrafterOption, cheapest, choose
from edgespec.drafters.hybrid import HybridDrafter
from edgespec.drafters.model import ModelDrafter
from edgespec.drafters.none import NoDrafter
from edgespec.drafters.onnx import make_onnx_drafter, measure_onnx_token
from edgespec.drafters.suffix import DEFAULT_HISTORY_TOKENS, SuffixDrafter
from edgespec.files.modelfile import model_file
from edgespec.files.store import ModelStore
from edgespec.files.vocab import check_compatible
from edgespec.llama.backend import LlamaModel, ModelParams, default_threads
from edgespec.memory.placements import CHAINS
from edgespec.onnx.convert import META, is_current, onnx_dir_for
from edgespec.onnx.providers import used_provider

log = logging.getLogger(__name__)


def load_model_drafter(target: LlamaModel, path: Path, cfg: DraftConfig):
    """A ModelDrafter over the model at ``path`` after checking its vocabulary against the target."""
    check_compatible(target.gguf, model_file(path).gguf)
    model = LlamaModel(path, cfg.model_params or ModelParams())
    try:
        return ModelDrafter(model, n_ctx=cfg.n_ctx, n_threads=cfg.n_threads, tree=cfg.tree, owns_model=True)
    except BaseException:
        model.close()
        raise


def make_drafter(cfg: DraftConfig, target: LlamaModel, store: ModelStore, target_ctx=None,
                 shared_model=None):
    """Builds the drafter ``cfg`` names for ``target``.

    ``target_ctx`` is needed by `auto` (it calibrates on the target's context);
    ``shared_model`` lets several drafters reuse one loaded model drafter.

    Raises:
        ModelNotFound / InvalidGGUF: the drafter model cannot be found or read.
        IncompatibleModels: its vocabulary does not match the target's.
    """
    kind = kind_of(cfg.kind)
    suffix = suffix_drafter(cfg.draft_max, cfg.suffix_history_tokens, cfg.chains) if kind.suffix else None
    if kind.name == "auto":
        return _build_auto(cfg, target, suffix, target_ctx, store, shared_model)
    model = None
    if kind.may_load_model and cfg.allow_model:
        model = shared_model
        path = drafter_model_path(cfg.kind, cfg.draft_model, target.file.fingerprint, store) if model is None else None
        if path is not None and kind.name == "hybrid":
            model = _hybrid_model(cfg, target, store, path)
        elif path is not None:
            model = load_model_drafter(target, path, cfg)
    if cfg.tree and target_ctx is not None and hasattr(model, "sizes"):
        model.cost = cached_tree_costs(target_ctx, model, store.home, cfg.calibration_tag)
    return _BUILDERS[kind.name](cfg, model, suffix, target_ctx, store)


def cached_tree_costs(target_ctx, model, home: Path, tag: str = ""):
    """The costs a model drafter sizes its trees by (edgespec.drafters.auto.policy.TreeSizes):
    this placement's calibration when `auto` already made it, else None (trees of the largest
    size the step allows); loading never waits for a calibration."""
    verify = cached_verify(home, context_key(target_ctx, tag))
    draft = cached_draft_cost(home, context_key(model.ctx)) if verify is not None else None
    return replace(verify, draft_token_s=draft) if draft is not None else None


def suffix_drafter(draft_max: int, history_tokens: int = DEFAULT_HISTORY_TOKENS, chains: bool = False):
    """A suffix drafter whose drafts may reach ``draft_max`` tokens: the index's depth leaves
    room for a match of as many tokens again (edgespec.drafters.suffix). Depth costs little:
    137.5 bytes per held token at depth 64, 139.1 at 128 (the 30 Spec-Bench traces, native index).
    ``chains``: it proposes each tree's main path only."""
    spec = max(CHAINS.draft_max, draft_max)
    return SuffixDrafter(max_depth=2 * spec, max_history_tokens=history_tokens, max_spec=spec, chains=chains)


def _hybrid_model(cfg: DraftConfig, target: LlamaModel, store: ModelStore, path: Path):
    """`hybrid`'s drafter model: llama.cpp's, or its ONNX conversion when one is in the store and
    drafts cheaper on this machine (edgespec.drafters.auto.select.cheapest)."""
    return cheapest(drafter_options(cfg, target, store, path), store.home)


def _build_none(cfg, model, suffix, target_ctx, store):
    return NoDrafter()


def _build_hybrid(cfg, model, suffix, target_ctx, store):
    return HybridDrafter(suffix, model)


def _build_auto(cfg, target, suffix, target_ctx, store, shared_model=None):
    if target_ctx is None:
        raise ValueError("the auto drafter needs the target context to calibrate on")
    verify = verify_costs(target_ctx, store.home, cfg.calibration_tag, largest=cfg.draft_max + 1)
    memory = PolicyMemory(store.home, context_key(target_ctx, cfg.calibration_tag))
    path = drafter_model_path(cfg.kind, cfg.draft_model, target.file.fingerprint, store)
    if path is None:
        return AutoDrafter(suffix, verify, memory=memory)
    name = draft_shape_name(memory, path, cfg.tree)[0]  # chains where trees measured a loss
    options = drafter_options(cfg, target, store, path, shared_model)
    model, draft_s = choose(options, verify, store.home, cfg.draft_max, memory.drafter_gain(name))
    if cfg.tree and model is not None and getattr(model, "sizes", None) is None:
        log.info("auto: the %s drafter drafts chains only; --draft-tree needs llama.cpp's", model.name)
    return AutoDrafter(suffix, replace(verify, draft_token_s=draft_s), model=model, memory=memory, model_name=name,
                       shape=lambda: draft_shape_name(memory, path, cfg.tree))


def drafter_options(cfg: DraftConfig, target: LlamaModel, store: ModelStore, path: Path,
                    shared_model=None) -> list:
    """The runtimes that may draft with the drafter model at ``path`` (edgespec.drafters.auto.select):
    llama.cpp's, and its ONNX conversion when one is in the store."""
    threads = cfg.n_threads or default_threads()
    options = []
    if cfg.allow_model:
        key = calibration_key(path, cfg.model_params or ModelParams(), threads,
                              ModelDrafter.context_params(cfg.n_ctx).flash_attn)
        load = (lambda: shared_model) if shared_model is not None else (lambda: load_model_drafter(target, path, cfg))
        options.append(DrafterOption("model", key, load, lambda d: measure_draft_token(d.ctx),
                                     owned=shared_model is None))
    onnx = _onnx_option(cfg, target, store, path, threads) if cfg.allow_onnx else None
    return options + ([onnx] if onnx is not None else [])


def _onnx_option(cfg: DraftConfig, target: LlamaModel, store: ModelStore, path: Path, threads: int):
    """The ONNX conversion of the drafter at ``path``, if it is in the store and current."""
    directory = onnx_dir_for(store, path, cfg.onnx_bits)
    if not is_current(directory, model_file(path).gguf, cfg.onnx_bits):
        return None
    stamp = (directory / META).stat().st_mtime_ns
    key = f"{directory.name}-{stamp}-{used_provider(cfg.onnx_provider)}-t{threads}-{VERSION}"
    return DrafterOption("onnx", key, lambda: make_onnx_drafter(
        target, store, str(path), provider=cfg.onnx_provider, bits=cfg.onnx_bits, tree=cfg.tree,
        n_threads=cfg.n_threads, n_ctx=cfg.n_ctx), measure_onnx_token)


def _build_onnx(cfg, model, suffix, target_ctx, store):
    if target_ctx is None:
        raise ValueError("the onnx drafter needs the target context (its model's vocabulary)")
    return make_onnx_drafter(target_ctx.model, store, cfg.draft_model, provider=cfg.onnx_provider,
                             bits=cfg.onnx_bits, tree=cfg.tree, n_threads=cfg.n_threads, n_ctx=cfg.n_ctx)


_BUILDERS = {
    "none": _build_none,
    "suffix": lambda cfg, model, suffix, target_ctx, store: suffix,
    "model": lambda cfg, model, suffix, target_ctx, store: model,
    "hybrid": _build_hybrid,
    "onnx": _build_onnx,
}
