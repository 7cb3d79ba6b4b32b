"""Drafters, picked by name from a registry.

`--draft` accepts: none | suffix | model | hybrid | auto | a drafter model name or GGUF path
(meaning `model` with that file). `auto` (edgespec.drafters.auto) decides every step between
the suffix draft, a model-drafted chain (when a drafter model for the target is in the store)
and a plain step, from calibrated costs and running acceptance estimates.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from edgespec.backend import LlamaModel, ModelParams
from edgespec.errors import InvalidRequest, ModelNotFound
from edgespec.store import ModelStore
from edgespec.vocab import check_compatible

log = logging.getLogger(__name__)

NAMES = ("none", "suffix", "model", "hybrid", "auto")
# Default drafter model per target tokenizer fingerprint (manifests pin the fingerprints).
DEFAULT_DRAFT_MODELS = {"efc0bd6f520a5959": "qwen2.5-coder-0.5b"}


@dataclass(frozen=True)
class DraftConfig:
    """Which drafter, and its knobs."""

    kind: str = "auto"  # a name from NAMES, or a model name / GGUF path
    draft_model: str | None = None  # the model for `model`/`hybrid` (default: per target)
    tree: bool = False  # model drafter: best-first tree instead of a chain (greedy only)
    n_ctx: int = 4096
    n_threads: int | None = None
    suffix_history_tokens: int = 1 << 18  # the suffix index's memory cap (~115 bytes a token)
    allow_model: bool = True  # False under a RAM budget the drafter model does not fit
    model_params: ModelParams | None = None  # placement of the drafter model (planner's choice)
    calibration_tag: str = ""  # e.g. "-filebacked": costs differ from a resident load


def _default_draft_model(target: LlamaModel, store: ModelStore) -> str:
    from edgespec.gguf import tokenizer_fingerprint

    fp = tokenizer_fingerprint(target.gguf)
    name = DEFAULT_DRAFT_MODELS.get(fp)
    if name is None:
        raise InvalidRequest(f"no default drafter model for {target.path}; pass --draft-model NAME|PATH")
    return name


def _model_drafter(target: LlamaModel, store: ModelStore, name: str | None, cfg: DraftConfig):
    from edgespec.drafters.model import ModelDrafter

    path = store.resolve(name or _default_draft_model(target, store))
    from edgespec.gguf import read_gguf

    check_compatible(target.gguf, read_gguf(path))
    return ModelDrafter(LlamaModel(path, cfg.model_params or ModelParams()), n_ctx=cfg.n_ctx,
                        n_threads=cfg.n_threads, tree=cfg.tree)


def _suffix_drafter(cfg: DraftConfig):
    from edgespec.drafters.suffix import SuffixDrafter

    return SuffixDrafter(max_history_tokens=cfg.suffix_history_tokens)


def _auto_drafter(cfg: DraftConfig, target: LlamaModel, store: ModelStore, target_ctx, shared_model=None):
    from edgespec.calibrate import cost_model
    from edgespec.drafters.auto import AutoDrafter

    model = shared_model if cfg.allow_model else None
    if model is None and cfg.allow_model and (cfg.draft_model or _has_default_drafter(target, store)):
        model = _model_drafter(target, store, cfg.draft_model, cfg)
    cost = cost_model(target_ctx, model.ctx if model is not None else None, store.home, cfg.calibration_tag)
    return AutoDrafter(_suffix_drafter(cfg), cost, model=model)


def _has_default_drafter(target: LlamaModel, store: ModelStore) -> bool:
    try:
        return store.is_present(_default_draft_model(target, store))
    except InvalidRequest:
        return False


def make_drafter(cfg: DraftConfig, target: LlamaModel, store: ModelStore, target_ctx=None,
                 shared_model=None):
    """Builds the drafter ``cfg`` names for ``target``.

    ``target_ctx`` is needed by `auto` (it calibrates on the target's context);
    ``shared_model`` lets several drafters reuse one loaded model drafter.

    Raises:
        ModelNotFound / InvalidGGUF: the drafter model cannot be found or read.
        IncompatibleModels: its vocabulary does not match the target's.
    """
    kind = cfg.kind
    if kind == "none":
        from edgespec.drafters.none import NoDrafter

        return NoDrafter()
    if kind == "suffix":
        return _suffix_drafter(cfg)
    if kind == "auto":
        if target_ctx is None:
            raise ValueError("the auto drafter needs the target context to calibrate on")
        return _auto_drafter(cfg, target, store, target_ctx, shared_model)
    if kind == "model":
        return shared_model or _model_drafter(target, store, cfg.draft_model, cfg)
    if kind == "hybrid":
        from edgespec.drafters.hybrid import HybridDrafter

        return HybridDrafter(_suffix_drafter(cfg),
                             shared_model or _model_drafter(target, store, cfg.draft_model, cfg))
    # A model name or a path: the model drafter with that file.
    try:
        store.resolve(kind)
    except ModelNotFound as exc:
        raise InvalidRequest(f"--draft must be one of {', '.join(NAMES)} or a drafter model: {exc}") from exc
    return _model_drafter(target, store, kind, cfg)
