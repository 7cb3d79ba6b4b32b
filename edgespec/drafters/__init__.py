"""Drafters, picked by name from a registry in which each kind declares what it needs.

`--draft` accepts a name from ``KINDS`` or a drafter model name / GGUF path (meaning `model`
with that file). Each ``DrafterKind`` says whether it loads a drafter model and whether it
keeps a suffix index; the planner, the budget, `edgespec plan` and the bench read these
declarations instead of keeping their own lists. `auto` (edgespec.drafters.auto) decides every
step between the suffix draft, a model-drafted chain (when a drafter model for the target is in
the store) and a plain step, from calibrated costs and running acceptance estimates.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from edgespec.drafters.suffix import DEFAULT_HISTORY_TOKENS
from edgespec.errors import InvalidRequest, ModelNotFound
from edgespec.files.modelfile import model_file
from edgespec.files.store import ModelStore
from edgespec.files.vocab import check_compatible
from edgespec.llama.backend import LlamaModel, ModelParams
from edgespec.onnx.convert import BITS as ONNX_BITS

log = logging.getLogger(__name__)

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
    n_ctx: int = 4096
    n_threads: int | None = None
    suffix_history_tokens: int = DEFAULT_HISTORY_TOKENS  # the suffix index's memory cap
    allow_model: bool = True  # False under a RAM budget the drafter model does not fit
    model_params: ModelParams | None = None  # placement of the drafter model (planner's choice)
    calibration_tag: str = ""  # e.g. "-filebacked": costs differ from a resident load
    draft_max: int = 32  # most drafted tokens per step (auto prices drafters at this length)
    # auto may run the ONNX conversion of its drafter model when one is in the store; False under
    # a memory budget (the planner counts an ONNX drafter only for --draft onnx).
    allow_onnx: bool = True
    onnx_provider: str = "cpu"  # onnx drafter: execution provider (edgespec.onnx.providers.PROVIDERS)
    onnx_bits: str = "exact"  # onnx drafter: which conversion ("exact" | "4", edgespec.onnx.convert)
    # The suffix index proposes its main path only (exact mode verifies chains: `auto` then
    # prices what is verified, not the whole tree).
    chains: bool = False

    def __post_init__(self) -> None:
        check_onnx_options(self.onnx_provider, self.onnx_bits)


def check_onnx_options(provider: str, bits: str) -> None:
    """Raises UnknownProvider / InvalidRequest for an unknown --onnx-provider / --onnx-bits."""
    from edgespec.onnx.providers import check_provider

    check_provider(provider)
    if bits not in ONNX_BITS:
        raise InvalidRequest(f"--onnx-bits must be one of {', '.join(ONNX_BITS)}, not {bits!r}")


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


def load_model_drafter(target: LlamaModel, path: Path, cfg: DraftConfig):
    """A ModelDrafter over the model at ``path`` after checking its vocabulary against the target."""
    from edgespec.drafters.model import ModelDrafter

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
    from edgespec.drafters.auto.calibrate import cached_draft_cost, cached_verify, context_key

    verify = cached_verify(home, context_key(target_ctx, tag))
    draft = cached_draft_cost(home, context_key(model.ctx)) if verify is not None else None
    return replace(verify, draft_token_s=draft) if draft is not None else None


def suffix_drafter(draft_max: int, history_tokens: int = DEFAULT_HISTORY_TOKENS, chains: bool = False):
    """A suffix drafter whose drafts may reach ``draft_max`` tokens: the index's depth leaves
    room for a match of as many tokens again (edgespec.drafters.suffix). Depth costs little:
    137.5 bytes per held token at depth 64, 139.1 at 128 (the 30 Spec-Bench traces, native index).
    ``chains``: it proposes each tree's main path only."""
    from edgespec.drafters.suffix import SuffixDrafter

    spec = max(32, draft_max)
    return SuffixDrafter(max_depth=2 * spec, max_history_tokens=history_tokens, max_spec=spec, chains=chains)


def _hybrid_model(cfg: DraftConfig, target: LlamaModel, store: ModelStore, path: Path):
    """`hybrid`'s drafter model: llama.cpp's, or its ONNX conversion when one is in the store and
    drafts cheaper on this machine (edgespec.drafters.auto.select.cheapest)."""
    from edgespec.drafters.auto.select import cheapest

    return cheapest(drafter_options(cfg, target, store, path), store.home)


def _build_none(cfg, model, suffix, target_ctx, store):
    from edgespec.drafters.none import NoDrafter

    return NoDrafter()


def _build_hybrid(cfg, model, suffix, target_ctx, store):
    from edgespec.drafters.hybrid import HybridDrafter

    return HybridDrafter(suffix, model)


def _build_auto(cfg, target, suffix, target_ctx, store, shared_model=None):
    from edgespec.drafters.auto import AutoDrafter
    from edgespec.drafters.auto.calibrate import context_key, verify_costs
    from edgespec.drafters.auto.memory import PolicyMemory, draft_shape_name
    from edgespec.drafters.auto.select import choose

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
    from edgespec.drafters.auto.calibrate import calibration_key, measure_draft_token
    from edgespec.drafters.auto.select import DrafterOption
    from edgespec.drafters.model import ModelDrafter
    from edgespec.llama.backend import default_threads

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
    from edgespec.drafters.auto.calibrate import VERSION
    from edgespec.drafters.auto.select import DrafterOption
    from edgespec.drafters.onnx import make_onnx_drafter, measure_onnx_token
    from edgespec.onnx.convert import META, is_current, onnx_dir_for
    from edgespec.onnx.providers import used_provider

    directory = onnx_dir_for(store, path, cfg.onnx_bits)
    if not is_current(directory, model_file(path).gguf, cfg.onnx_bits):
        return None
    stamp = (directory / META).stat().st_mtime_ns
    key = f"{directory.name}-{stamp}-{used_provider(cfg.onnx_provider)}-t{threads}-{VERSION}"
    return DrafterOption("onnx", key, lambda: make_onnx_drafter(
        target, store, str(path), provider=cfg.onnx_provider, bits=cfg.onnx_bits, tree=cfg.tree,
        n_threads=cfg.n_threads, n_ctx=cfg.n_ctx), measure_onnx_token)


def _build_onnx(cfg, model, suffix, target_ctx, store):
    from edgespec.drafters.onnx import make_onnx_drafter

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
