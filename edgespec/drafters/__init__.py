"""Drafters, picked by name from a registry in which each kind declares what it needs.

`--draft` accepts a name from ``KINDS`` or a drafter model name / GGUF path (meaning `model`
with that file). Each ``DrafterKind`` says whether it loads a drafter model and whether it
keeps a suffix index; the load plan (edgespec.load) and the bench read these declarations
instead of keeping their own lists; edgespec.drafters.factory builds them. `auto` (edgespec.drafters.auto) decides every
step between the suffix draft, a model-drafted chain (when a drafter model for the target is in
the store) and a plain step, from calibrated costs and running acceptance estimates.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edgespec.errors import InvalidRequest, ModelNotFound
from edgespec.files.store import ModelStore
from edgespec.config import DEFAULT_CTX
from edgespec.llama.backend import LlamaModel, ModelParams
from edgespec.memory.footprint import SUFFIX_HISTORY_TOKENS
from edgespec.memory.placements import CHAINS
from edgespec.onnx.providers import check_options as check_onnx_options

# Default drafter model per target tokenizer fingerprint (manifests pin the fingerprints).
DEFAULT_DRAFT_MODELS = {"efc0bd6f520a5959": "qwen2.5-coder-0.5b"}


@dataclass(frozen=True)
class DrafterKind:
    """What a drafter needs, declared once."""

    name: str
    model: str  # "never" | "always" | "optional" (auto: uses a drafter model if one is present)
    suffix: bool  # keeps a suffix index over requests (~BYTES_PER_TOKEN a held token)
    help: str
    # Runs the drafter model converted to ONNX on onnxruntime (not a llama.cpp load): the planner
    # counts its graph, KV buffer and arena (edgespec.memory.footprint.estimate_onnx_drafter).
    onnx_model: bool = False

    @property
    def may_load_model(self) -> bool:
        return self.model != "never"


KINDS = {k.name: k for k in (
    DrafterKind("none", "never", False, "plain decoding through the speculative loop"),
    DrafterKind("suffix", "never", True, "model-free drafts from a suffix index"),
    DrafterKind("model", "always", False, "a small GGUF model of the same tokenizer"),
    DrafterKind("hybrid", "always", True, "the suffix draft when its match is long, else the model "
                "(llama.cpp's, or its ONNX conversion when in the store and cheaper)"),
    DrafterKind("auto", "optional", True, "per step, whichever the calibrated cost model expects to pay"),
    # Its model is an ONNX conversion run by onnxruntime, not a llama.cpp load: "never" here.
    DrafterKind("onnx", "never", False, "the drafter model converted to ONNX, run by onnxruntime",
                onnx_model=True),
)}
NAMES = tuple(KINDS)


def kind_of(draft: str) -> DrafterKind:
    """The kind a --draft value means: a registry name, or `model` for a model name/path."""
    return KINDS.get(draft, KINDS["model"])


@dataclass(frozen=True)
class DraftConfig:
    """Which drafter, and its knobs."""

    kind: str = "auto"  # a name from KINDS, or a model name / GGUF path
    draft_model: str | None = None  # the model for `model`/`hybrid` (default: per target)
    tree: bool = False  # model drafter: best-first tree instead of a chain (greedy only)
    n_ctx: int = DEFAULT_CTX
    n_threads: int | None = None
    suffix_history_tokens: int = SUFFIX_HISTORY_TOKENS  # the suffix index's memory cap
    allow_model: bool = True  # False under a RAM budget the drafter model does not fit
    model_params: ModelParams | None = None  # placement of the drafter model (planner's choice)
    calibration_tag: str = ""  # e.g. "-filebacked": costs differ from a resident load
    draft_max: int = CHAINS.draft_max  # most drafted tokens per step (auto prices drafters at this length)
    # auto may run the ONNX conversion of its drafter model when one is in the store; False under
    # a memory budget (the planner counts an ONNX drafter only for --draft onnx).
    allow_onnx: bool = True
    onnx_provider: str = "cpu"  # onnx drafter: execution provider (edgespec.onnx.providers.PROVIDERS)
    onnx_bits: str = "exact"  # onnx drafter: which conversion ("exact" | "4", edgespec.onnx.convert)
    # The suffix index proposes its main path only (where the plan drafts chains, and in exact
    # mode, which verifies chains: `auto` then prices what is verified, not the whole tree).
    chains: bool = False

    def __post_init__(self) -> None:
        check_onnx_options(self.onnx_provider, self.onnx_bits)


def drafter_model_path(draft: str, draft_model: str | None, target_fingerprint: str,
                       store: ModelStore) -> Path | None:
    """The drafter model file ``--draft draft`` would load for a target, or None.

    `auto` without an explicit model takes the default drafter only if it is in the store.
    Raises:
        ModelNotFound: a named model (or `model`/`hybrid`'s default) is not in the store.
        InvalidRequest: `model`/`hybrid` with no default drafter model for this tokenizer.
    """
    kind = kind_of(draft)
    if not kind.may_load_model:
        return None
    if draft not in KINDS:
        return _resolve_model(store, draft)
    if draft_model:
        return store.resolve(draft_model)
    name = DEFAULT_DRAFT_MODELS.get(target_fingerprint)
    if kind.model == "optional":
        return store.resolve(name) if name and store.is_present(name) else None
    if name is None:
        raise InvalidRequest("no default drafter model for this target; pass --draft-model NAME|PATH")
    return store.resolve(name)


def default_draft_model(target: LlamaModel, store: ModelStore) -> str:
    """The store name of the default drafter model for ``target``'s tokenizer."""
    name = DEFAULT_DRAFT_MODELS.get(target.file.fingerprint)
    if name is None:
        raise InvalidRequest(f"no default drafter model for {target.path}; pass --draft-model NAME|PATH")
    return name


def _resolve_model(store: ModelStore, name: str) -> Path:
    try:
        return store.resolve(name)
    except ModelNotFound as exc:
        raise InvalidRequest(f"--draft must be one of {', '.join(NAMES)} or a drafter model: {exc}") from exc
