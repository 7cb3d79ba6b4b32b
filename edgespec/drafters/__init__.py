"""Drafters, picked by name from a registry.

`--draft` accepts: none | suffix | model | hybrid | auto | a drafter model name or GGUF path
(meaning `model` with that file). Until the scheduler lands, `auto` is the suffix drafter:
model-free drafting costs nothing per step, so it never makes decoding much slower, while a
model drafter on a CPU shares the cores with the target and often does.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from edgespec.backend import LlamaModel
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
    return ModelDrafter(LlamaModel(path), n_ctx=cfg.n_ctx, n_threads=cfg.n_threads, tree=cfg.tree)


def _suffix_drafter():
    from edgespec.drafters.suffix import SuffixDrafter

    return SuffixDrafter()


def make_drafter(cfg: DraftConfig, target: LlamaModel, store: ModelStore):
    """Builds the drafter ``cfg`` names for ``target``.

    Raises:
        ModelNotFound / InvalidGGUF: the drafter model cannot be found or read.
        IncompatibleModels: its vocabulary does not match the target's.
    """
    kind = cfg.kind
    if kind == "none":
        from edgespec.drafters.none import NoDrafter

        return NoDrafter()
    if kind in ("suffix", "auto"):
        return _suffix_drafter()
    if kind == "model":
        return _model_drafter(target, store, cfg.draft_model, cfg)
    if kind == "hybrid":
        from edgespec.drafters.hybrid import HybridDrafter

        return HybridDrafter(_suffix_drafter(), _model_drafter(target, store, cfg.draft_model, cfg))
    # A model name or a path: the model drafter with that file.
    try:
        store.resolve(kind)
    except ModelNotFound as exc:
        raise InvalidRequest(f"--draft must be one of {', '.join(NAMES)} or a drafter model: {exc}") from exc
    return _model_drafter(target, store, kind, cfg)
