"""Runs plain decoding and each configuration on the same prompts, interleaved, in one process.

The target model is loaded once and shared by every edgespec configuration (each only adds
its drafter), and the KV cache is cleared before every run so each one pays the same
prefill, unless ``share_prefill``: then the prompt is evaluated once and the edgespec
configurations after the first reuse its KV cache (their records show the reused tokens and
a near-zero prefill). Generation is timed apart from the prefill either way, so speedups do
not change; long-prompt suites finish much sooner. Suffix drafters start fresh for every
prompt: a benchmark that repeats prompts must not let a drafter remember the answer from an
earlier run of the same prompt.

``turns="all"`` runs each conversation to its end. A later turn's prompt holds every earlier
user turn followed by *plain decoding's* answer to it in the same run and repeat, so all
configurations, peers included, are timed on identical histories (a speculative answer that
flipped a greedy near-tie would otherwise change what the next turn sees). Plain runs each turn
first (see ``interleaved_order``); every turn is timed on its own, its prompt evaluated like any
other. The history is in the prompt, so a suffix drafter, which indexes the whole prompt,
drafts from the earlier turns and answers.

The ``plain`` baseline is the best plain decoding at the run's budgets (``load_plans``): under a
VRAM budget, or a placement made for a drafter (offload, draft-gpu, overlap), the target alone
with as many layers on the GPU as the budget holds. Where that is another layout than the
speculative configurations' (a whole target on the GPU instead of a split one), plain runs first
with its own load, every prompt and turn in order, and the speculative layout's plain decoding
runs interleaved as the secondary ``plain-in-layout``.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

from edgespec.bench import peers
from edgespec.bench.machine import describe
from edgespec.bench.prompts import BenchPrompt, conversation, prompt_tokens
from edgespec.bench.summary import IN_LAYOUT, PLAIN, Record, interleaved_order, summarize
from edgespec.drafters import NAMES, DraftConfig, default_draft_model, kind_of
from edgespec.drafters.factory import make_drafter
from edgespec.engine import Engine, EngineConfig
from edgespec.files.store import ModelStore
from edgespec.load import LoadPlan, resolve
from edgespec.memory import placements
from edgespec.memory.machine import MachineInfo, default_ram_budget, machine
from edgespec.units import format_bytes
from edgespec.errors import InvalidRequest
from edgespec.decode.events import DoneEvent
from edgespec.decode.loop import Decoder
from edgespec.decode.request import GenerationRequest
from edgespec.decode.sampling import SamplingParams

log = logging.getLogger(__name__)

# Every registered drafter, plus the model drafter drafting trees.
EDGESPEC_CONFIGS = NAMES[:3] + ("model-tree",) + NAMES[3:]
# Configurations that always draft with the drafter model (declared by the drafter kinds).
MODEL_CONFIGS = tuple(c for c in EDGESPEC_CONFIGS if kind_of(c.removesuffix("-tree")).model == "always")
TURNS = ("first", "all")  # bench --turns: the first user turn only, or each conversation to its end
# `X+recheck`: configuration X re-checking greedy near-ties at --recheck-gap (SpeculativeStep),
# so one run compares X with and without re-checks on the same prompts and the same plain.
RECHECK = "+recheck"
# Placements that exist for a drafter (the target split or on the CPU beside a drafter on the
# GPU): plain decoding at the same budgets is placed by the planner instead.
DRAFTER_PLACEMENTS = tuple(n for n, m in placements.MODES.items() if m.drafter == "gpu" and m.target != "gpu")


def base_config(config: str) -> str:
    """The configuration without its ``+recheck`` modifier."""
    return config.removesuffix(RECHECK)


@dataclass(frozen=True)
class BenchSettings:
    """A bench run: the load (``engine``: target, budgets, placement, kernels, draft shape and
    the ``recheck_gap`` of the X+recheck configurations; each configuration adds its own
    drafter), and what every configuration generates."""

    engine: EngineConfig = EngineConfig()
    max_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    repeats: int = 1
    share_prefill: bool = False
    turns: str = "first"  # one of TURNS

    def __post_init__(self) -> None:
        if self.turns not in TURNS:
            raise InvalidRequest(f"--turns must be one of {', '.join(TURNS)}, got {self.turns!r}")

    def to_dict(self) -> dict:
        """The settings as a results file records them: the load's options, then the run's."""
        out = asdict(self.engine)
        out.update((k, v) for k, v in asdict(self).items() if k != "engine")
        return out


@dataclass
class BenchResult:
    machine: dict
    settings: dict
    records: list[Record] = field(default_factory=list)

    @property
    def summary(self) -> dict:
        return summarize(self.records)

    def to_dict(self) -> dict:
        return {"machine": self.machine, "settings": self.settings,
                "records": [r.to_dict() for r in self.records], "summary": self.summary}


def validate_configs(configs: list[str], recheck_gap: float = 0.0) -> list[str]:
    known = set(EDGESPEC_CONFIGS) | set(peers.PEERS) | {PLAIN}
    bad = [c for c in configs if c not in known and not (c.endswith(RECHECK) and base_config(c) in EDGESPEC_CONFIGS)]
    if bad:
        raise InvalidRequest(f"unknown config(s) {', '.join(bad)}; choose from {', '.join(sorted(known))}"
                             f" (an edgespec config X also as X{RECHECK})")
    rechecked = [c for c in configs if c.endswith(RECHECK)]
    if rechecked and recheck_gap <= 0:
        raise InvalidRequest(f"{rechecked[0]} needs --recheck-gap G > 0 (the top-2 logit gap re-checked)")
    if recheck_gap > 0 and not rechecked:
        raise InvalidRequest(f"--recheck-gap applies to configurations named X{RECHECK} (e.g. auto{RECHECK})")
    return [PLAIN] + [c for c in dict.fromkeys(configs) if c != PLAIN]


class _Runners:
    """Builds the generator for each configuration, sharing the target and the model drafter."""

    def __init__(self, engine: Engine, settings: BenchSettings, trees: bool = False):
        self.engine = engine
        self.settings = settings
        self._trees = trees  # the shared model drafter gets a tree search's sequences
        self._model_drafter = None

    @property
    def model_allowed(self) -> bool:
        """False when a RAM budget's plan had no room for the drafter model."""
        return self.engine.load_plan.model_drafter_allowed

    def model_drafter(self, tree: bool):
        if self._model_drafter is None:
            cfg = replace(self._draft_config("model"), tree=self._trees)
            self._model_drafter = make_drafter(cfg, self.engine.model, self.engine.store)
        self._model_drafter.tree = tree
        return self._model_drafter

    def _shape(self, kind: str) -> placements.DraftShape:
        """`auto`'s shape is the engine's (the placement's default); the others draft chains of
        ``--draft-max`` (32 unless given), as `edgespec run --draft KIND` would."""
        if kind == "auto":
            return self.engine.load_plan.shape
        return placements.CHAINS.given(self.settings.engine.draft_max, False)

    def _draft_config(self, kind: str) -> DraftConfig:
        """``kind`` placed as the engine's plan places drafters, over the engine's context."""
        cfg = self.engine.load_plan.draft_config(kind, self._shape(kind))
        return replace(cfg, n_ctx=self.engine.ctx.n_ctx)

    def runner(self, config: str):
        """A fresh drafter per call (no history carried between prompts), sharing the model."""
        if config in (PLAIN, IN_LAYOUT):
            return Decoder(self.engine.model, self.engine.seq)
        base = base_config(config)
        kind = "model" if base == "model-tree" else base
        cfg = self._draft_config(kind)
        wants_model = base in MODEL_CONFIGS or (kind == "auto" and cfg.allow_model)
        shared = self.model_drafter(tree=base == "model-tree" or cfg.tree) if wants_model else None
        drafter = make_drafter(cfg, self.engine.model, self.engine.store, target_ctx=self.engine.ctx,
                               shared_model=shared)
        gap = self.settings.engine.recheck_gap if config.endswith(RECHECK) else 0.0
        return Decoder(self.engine.model, self.engine.seq, self.engine.speculative_step(drafter, cfg.draft_max, gap))

    def close(self) -> None:
        if self._model_drafter is not None:
            self._model_drafter.close()


def _record(p: BenchPrompt, config: str, repeat: int, turn: int, done: DoneEvent) -> Record:
    s, x = done.stats, done.stats.spec
    steps = x.steps if x is not None else max(s.generated_tokens - 1, 0)
    return Record(id=p.id, category=p.category, config=config, new_tokens=s.generated_tokens,
                  gen_s=s.gen_s, prefill_s=s.prompt_eval_s, steps=steps, drafted=x.drafted if x else 0,
                  accepted=x.accepted if x else 0, peak_rss_bytes=s.peak_rss_bytes, text=done.text,
                  repeat=repeat, gen_tokens=max(s.generated_tokens - 1, 0),
                  reused_prompt_tokens=s.reused_prompt_tokens, turn=turn, prompt_tokens=s.prompt_tokens,
                  rechecks=x.rechecks if x else 0)


def _peer_record(p: BenchPrompt, config: str, repeat: int, turn: int, r: peers.PeerResult) -> Record:
    raw = r.raw or {}
    return Record(id=p.id, category=p.category, config=config, new_tokens=r.new_tokens, gen_s=r.gen_s,
                  prefill_s=r.prefill_s or 0.0, steps=raw.get("steps", 0), drafted=r.drafted,
                  accepted=r.accepted, peak_rss_bytes=raw.get("peak_rss_bytes", 0), text=r.text or "",
                  repeat=repeat, gen_tokens=r.gen_tokens, turn=turn,
                  prompt_tokens=raw.get("encoded_tokens", raw.get("prompt_tokens", 0)))


def plain_config(engine: EngineConfig, m: MachineInfo) -> EngineConfig | None:
    """Plain decoding's load at the run's budgets: the target alone, no drafter, placed by the
    planner with the same budgets (those not given: what the machine has free, as the run's);
    a placement made for a drafter (DRAFTER_PLACEMENTS) is not plain's, `gpu` and `cpu` are
    kept. None when nothing is planned (no budget, no placement)."""
    if not engine.planned:
        return None
    plain = replace(engine, draft=None, draft_max=None, draft_tree=None, n_seq_max=1,
                    placement=None if engine.placement in DRAFTER_PLACEMENTS else engine.placement)
    return plain if plain.planned else replace(plain, ram_budget=default_ram_budget(m))


def load_plans(settings: BenchSettings, configs: list[str], m: MachineInfo | None = None,
               store: ModelStore | None = None) -> tuple[LoadPlan, LoadPlan | None]:
    """What the run loads: the speculative configurations' shared target, and plain decoding's
    own load where the best plain at the run's budgets is another layout (None: plain runs in
    the speculative layout, which is then the best plain). A `model` configuration keeps the
    drafter model in the shared plan wherever it fits, whatever `auto`'s calibration says of it
    (`auto` still decides per step)."""
    m, store = m or machine(), store or ModelStore()
    shared = resolve(_engine_config(settings.engine, configs), m, store,
                     keep_drafter=any(base_config(c) in MODEL_CONFIGS for c in configs))
    alone = plain_config(settings.engine, m)
    if alone is None:
        return shared, None
    plain = resolve(alone, m, store)
    return shared, (None if _layout(plain) == _layout(shared) else plain)


def _layout(lp: LoadPlan) -> tuple:
    """What sets a load's plain decoding speed: where the target's layers are and how its weights
    and attention run."""
    return (lp.model.n_gpu_layers, lp.model.no_host, lp.model.repack, lp.model.use_mmap, lp.file_backed,
            lp.context.kv_type, lp.context.flash_attn, lp.context.op_offload)


def baseline(shared: LoadPlan, plain: LoadPlan | None) -> dict:
    """The run's baseline, as its results record it (settings["baseline"])."""
    best = plain or shared
    p = best.plan
    return {"config": PLAIN, "separate_load": plain is not None, "in_layout": IN_LAYOUT if plain else None,
            "placement": best.mode.name if best.mode else None, "n_gpu_layers": best.model.n_gpu_layers,
            "layout_n_gpu_layers": shared.model.n_gpu_layers,
            "expected_tokens_per_s": p.plain_tokens_per_s if p is not None else None,
            "layout_expected_tokens_per_s": shared.plan.expected_tokens_per_s if shared.plan is not None else None}


def run_bench(prompts: list[BenchPrompt], configs: list[str], settings: BenchSettings,
              progress: Callable[[int, int, str, str], None] | None = None) -> BenchResult:
    """Runs every (repeat, prompt, config) in interleaved order and returns all records; plain
    first on its own load where the best plain at the budgets is another layout (load_plans)."""
    configs = validate_configs(configs, settings.engine.recheck_gap)
    if settings.engine.exact and "model-tree" in map(base_config, configs):
        raise InvalidRequest("model-tree drafts trees, which exact mode does not verify: drop it or --exact")
    shared, alone = load_plans(settings, configs)
    by_id = {p.id: p for p in prompts}
    turns = {p.id: p.n_turns for p in prompts} if settings.turns == "all" else None
    ids = [p.id for p in prompts]
    # (load, its order of runs): plain alone first where it has a load of its own
    phases = [(shared, interleaved_order(ids, configs, settings.repeats, turns))]
    if alone is not None:
        phases = [(alone, interleaved_order(ids, [], settings.repeats, turns)),
                  (shared, interleaved_order(ids, [IN_LAYOUT if c == PLAIN else c for c in configs],
                                             settings.repeats, turns, first=IN_LAYOUT))]
    total = sum(len(order) for _, order in phases)
    trees = shared.shape.tree or any(base_config(c) == "model-tree" for c in configs)
    records: list[Record] = []
    plain_text: dict[tuple[int, str, int], str] = {}  # plain's answer per (repeat, prompt, turn)
    layout_text: dict[tuple[int, str, int], str] = {}  # plain-in-layout's: what exactness compares with
    n = 0
    for lp, order in phases:
        engine = Engine(lp.config, plan=lp)
        runners = _Runners(engine, settings, trees=trees)
        try:
            if lp is shared:
                threads = engine.ctx.n_threads
            for repeat, pid, turn, config in order:
                p = by_id[pid]
                if progress:
                    progress(n, total, pid if turn == 1 else f"{pid} turn {turn}", config)
                n += 1
                answers = [plain_text[(repeat, pid, t)] for t in range(1, turn)]
                rec = _run_one(engine, runners, p, answers, config, repeat, settings)
                if rec is None:
                    continue
                key = (repeat, pid, turn)
                if config == PLAIN:
                    plain_text[key] = rec.text
                else:  # another layout's kernels may part at near-ties: exactness is within a layout
                    ref = layout_text if config != IN_LAYOUT and key in layout_text else plain_text
                    if key in ref and settings.temperature == 0:  # sampled answers follow their drafts
                        rec.same_as_plain = rec.text == ref[key]
                    if config == IN_LAYOUT:
                        layout_text[key] = rec.text
                records.append(rec)
        finally:
            runners.close()
            engine.close()
    shape = shared.shape  # what auto drafted (the others: chains of draft_max)
    return BenchResult(describe(threads), dict(settings.to_dict(), configs=configs, draft_max=shape.draft_max,
                                               draft_tree=shape.tree, baseline=baseline(shared, alone)), records)


def _engine_config(engine: EngineConfig, configs: list[str]) -> EngineConfig:
    """The target every configuration shares. A budget is planned for the target with the
    suffix drafter, or `auto` when a configuration uses the drafter model (which adds it on top
    only where the plan leaves room); the placement's longer default shape is auto's alone.
    Unplanned, the engine builds no drafter but holds the drafts' sequences."""
    chains = placements.CHAINS.given(engine.draft_max, engine.draft_tree)
    auto = any(base_config(c) == "auto" for c in configs)
    return replace(engine, draft_max=engine.draft_max if auto else chains.draft_max,
                   draft_tree=engine.draft_tree if auto else chains.tree,
                   n_seq_max=1 if engine.planned else 1 + chains.draft_max,
                   draft=_planned_draft(configs) if engine.planned else None)


def _planned_draft(configs: list[str]) -> str:
    """What a budget is planned for: the drafter model too when a configuration uses one."""
    return "auto" if any(base_config(c) in MODEL_CONFIGS or base_config(c) == "auto" for c in configs) else "suffix"


def _run_one(engine, runners, p: BenchPrompt, answers: list[str], config: str, repeat: int,
             settings: BenchSettings):
    """One turn (``len(answers) + 1``) of ``p`` under ``config``; None when it was skipped."""
    turn = len(answers) + 1
    if config.startswith("peer:"):
        try:
            r = peers.run(config, _render(engine, p, answers),
                          target_path=engine.model.path, draft_path=_peer_draft_path(engine, settings),
                          max_tokens=settings.max_tokens, threads=engine.ctx.n_threads, ctx=settings.engine.n_ctx,
                          flash_attn=settings.engine.flash_attn is not False,
                          gpu_layers=peers.gpu_layers_of(engine.load_plan))
        except peers.PeerUnavailable as exc:
            log.warning("%s skipped: %s", config, exc)
            return None
        return _peer_record(p, config, repeat, turn, r)
    if base_config(config) in MODEL_CONFIGS and not runners.model_allowed:
        p_ = engine.load_plan.plan
        log.warning("%s skipped: the drafter model does not fit the %s RAM / %s VRAM budgets of the %s placement",
                    config, format_bytes(p_.ram_budget), format_bytes(p_.vram_budget), p_.placement)
        return None
    tokens = prompt_tokens(engine, p, answers)
    shared_s = 0.0
    if not settings.share_prefill:
        engine.reset()
    else:
        shared_s = _share_prefill(engine.seq, tokens)
    request = GenerationRequest(max_tokens=settings.max_tokens,
                                sampling=SamplingParams(temperature=settings.temperature, seed=settings.seed))
    done = None
    for ev in runners.runner(config).stream(tokens, request):
        done = ev
    rec = _record(p, config, repeat, turn, done)
    rec.prefill_s += shared_s
    return rec


def _share_prefill(seq, tokens: list[int]) -> float:
    """Puts all but the last prompt token in the cache, once per prompt; returns its seconds.

    Every configuration then evaluates the last prompt token alone (prefix reuse always
    re-evaluates it), so all of them, plain included, start from the same cache and the same
    first logits: llama.cpp's numerics depend on the batch a row is computed in, and a last
    token computed inside the prompt batch for one configuration and alone for another would
    flip near-ties at the very first token.
    """
    head = tokens[:-1]
    if len(head) < 1 or seq.tokens[:len(head)] == head:
        return 0.0
    t0 = time.perf_counter()
    seq.sync(head)
    return time.perf_counter() - t0


def _render(engine: Engine, p: BenchPrompt, answers: Sequence[str] = ()) -> str:
    """The exact prompt text edgespec feeds the model, for peers that tokenize themselves."""
    if p.templated:
        return engine.template.render(conversation(p, answers), add_generation_prompt=True)
    return p.text


def _peer_draft_path(engine: Engine, settings: BenchSettings) -> str | None:
    try:
        name = settings.engine.draft_model or default_draft_model(engine.model, engine.store)
        return str(engine.store.resolve(name))
    except Exception:  # noqa: BLE001 - a peer without a drafter is reported by the peer itself
        return None
