"""The plan search: where every part goes within a RAM and a VRAM budget, and why.

:func:`make_plan` enumerates candidate placements (resident or file-backed weights, repacking,
KV cache type, micro-batch, context, drafter placement, suffix history cap), sizes each
(edgespec.memory.candidates), keeps those that fit, and picks the best by the ranking in
``RANKING``; edgespec.memory.explain states the reason for every choice. When nothing fits it
raises :class:`~edgespec.errors.BudgetExceeded` with the smallest budget that would work.
GPU figures are estimates (see edgespec.memory.footprint).
"""
from __future__ import annotations

from dataclasses import asdict, replace
from itertools import product

from edgespec.errors import BudgetExceeded, InvalidRequest
from edgespec.llama.kernels import KV_CACHE_TYPES
from edgespec.memory import placements
from edgespec.memory.candidates import (RANKING, SUFFIX_CAPS, UBATCH_CHOICES, Candidate, Decision, Evaluation,
                                        Evaluator, Part, Plan, ShapeChoice, ctx_options, describe, fmt_bytes,
                                        layouts)
from edgespec.llama.kernels import op_offload_min_batch
from edgespec.memory.explain import build_plan
from edgespec.memory.footprint import ENGINE_N_BATCH, ContextFootprint, ModelFootprint, estimate_context, estimate_model
from edgespec.memory.machine import (GPUDevice, MachineInfo, default_ram_budget, default_threads,
                                     default_vram_budget, machine)
from edgespec.memory.speed import MEASURED, PassCosts, SpeedModel

# A speculative layout counts as below plain decoding when its expected speed is more than this
# much under plain's at the same budget: the speed model ranks layouts, it does not time them.
BELOW_PLAIN = 0.02

# The planner's public surface includes the footprint and machine types it plans with.
__all__ = ["RANKING", "ContextFootprint", "Decision", "GPUDevice", "KV_CACHE_TYPES", "MachineInfo",
           "ModelFootprint", "Part", "Plan", "default_ram_budget", "default_threads", "default_vram_budget",
           "estimate_context", "estimate_model", "fmt_bytes", "machine", "make_plan"]


def make_plan(target: ModelFootprint, drafter: ModelFootprint | None = None, ram_budget: int | None = None,
              vram_budget: int | None = None, n_ctx: int | None = None, *, machine_info: MachineInfo | None = None,
              suffix: bool = True, draft_max: int | None = None, draft_tree: bool | None = None, mlock: bool = False,
              kv_type: str | None = None, n_ubatch: int | None = None, mmap: bool | None = None,
              repack: bool | None = None, threads: int | None = None, placement: str | None = None,
              external_drafter=None, drafter_required: bool = False, long_drafts: bool = True,
              cpu_target: bool = False, target_repack: bool | None = None,
              flash_attn: bool | None = None, pass_costs: PassCosts | None = None,
              compare_plain: bool = True) -> Plan:
    """Chooses a placement for ``target`` (+ ``drafter`` and the suffix drafter) within the budgets.

    Budgets in bytes (None: what is available minus a margin); ``n_ctx`` None: the engine default
    (4096, at most the trained context), halved while it does not fit (down to 512). The draft
    shape None: 32-token chains, or with ``long_drafts`` (`auto`) the chosen placement's default.
    ``kv_type``, ``n_ubatch``, ``mmap``, ``repack``, ``placement`` (a placements.MODES name),
    ``flash_attn`` (off: f16 caches only) and ``target_repack`` force a choice; ``mlock`` locks
    the weights where possible. ``external_drafter``: a drafter outside llama.cpp, counted in
    every candidate. ``drafter_required``: plans without the drafter model rank last.
    ``cpu_target``: the target stays on the CPU (exact mode). ``pass_costs``: a decode pass's
    costs (None: the measured curves). ``compare_plain``: with a GPU, no layout expected slower
    than plain decoding at the same budgets; a forced one that is gets ``Plan.plain_note``.

    Raises InvalidRequest (a context above the trained one, out-of-range arguments),
    PlacementUnavailable (a forced placement needs a GPU this machine or build lacks) or
    BudgetExceeded (no placement fits; the message names the smallest budget that would).
    """
    m, kv_type = _checked(machine_info, placement, target, n_ctx, kv_type, flash_attn, n_ubatch, draft_max)
    ram_given, vram_given = ram_budget is not None, vram_budget is not None
    ram_budget, vram_budget = _budgets(m, ram_budget, vram_budget)

    speed = SpeedModel(target, drafter, threads or default_threads(m), op_offload_min_batch(),
                       pass_costs or MEASURED)
    gpu = bool(m.gpus) and m.gpu_offload and vram_budget > 0
    plain = _plain_at_budget(target, m, ram_budget, vram_budget, n_ctx, mmap, repack, threads, target_repack,
                             flash_attn, kv_type) if compare_plain and gpu and not cpu_target else None

    def search(shape: placements.DraftShape, where: str | None,
               floor: float | None = None) -> tuple[Evaluator, Evaluation, list[Evaluation]]:
        pl = Evaluator(target, drafter, m, ram_budget, vram_budget, suffix, shape.draft_max, shape.tree, mmap,
                       repack, external_drafter, drafter_required, target_repack, flash_attn)
        evals = _candidates(pl, target, drafter, where, kv_type, n_ubatch, mmap, repack, n_ctx, cpu_target)
        rate = None if floor is None else (lambda e: speed.speculative(e.ngl, e.cfg.drafter, shape.draft_max))
        return pl, _best(pl, evals, target, drafter, where, n_ctx, ram_given, rate, floor), evals

    # Chosen with chains (what was asked stays asked), then again with `auto`'s longer default.
    chains = placements.CHAINS.given(draft_max, draft_tree)
    floor = None if plain is None or placement is not None else speed.plain(plain.n_gpu_layers)
    pl, best, evals = search(chains, placement, floor)
    choice = _longer_shape(search, best, chains, draft_max, draft_tree) if long_drafts else \
        ShapeChoice(chains, (draft_max, draft_tree), auto=False)
    if choice.plan is not None:
        pl, best, evals = choice.plan
    out = build_plan(pl, best, evals, target, drafter, m, ram_given, vram_given, n_ctx, mlock, threads, placement,
                     choice)
    out.expected_tokens_per_s = speed.speculative(best.ngl, best.cfg.drafter, choice.shape.draft_max)
    if plain is not None:
        _compare_with_plain(out, plain, speed, target, placement)
    return out


def _plain_at_budget(target: ModelFootprint, m: MachineInfo, ram_budget: int, vram_budget: int,
                     n_ctx: int | None, mmap: bool | None, repack: bool | None, threads: int | None,
                     target_repack: bool | None, flash_attn: bool | None, kv_type: str | None) -> Plan | None:
    """The planner's plan for plain decoding at these budgets: the target alone, no drafter and no
    suffix index, as many layers on the GPU as the budget holds (None: it fits nowhere)."""
    try:
        return make_plan(target, None, ram_budget, vram_budget, n_ctx, machine_info=m, suffix=False, mmap=mmap,
                         repack=repack, threads=threads, target_repack=target_repack, flash_attn=flash_attn,
                         kv_type=kv_type, long_drafts=False, compare_plain=False)
    except BudgetExceeded:
        return None


def _compare_with_plain(p: Plan, plain: Plan, speed: SpeedModel, target: ModelFootprint,
                        forced: str | None) -> None:
    """Records plain decoding at the plan's budgets and notes a layout that is not worth it."""
    p.plain_n_gpu_layers, p.plain_placement = plain.n_gpu_layers, plain.placement
    p.plain_tokens_per_s = speed.plain(plain.n_gpu_layers)
    whole = target.n_layer + 1
    at = (f"plain decoding at this budget (the target alone, {plain.n_gpu_layers}/{whole} layers on the GPU) "
          f"is expected at ~{p.plain_tokens_per_s:.0f} tok/s")
    if forced is not None and placements.mode(forced).target == "split" and plain.n_gpu_layers == whole:
        p.plain_note = (f"placement {forced} is pointless here: the {fmt_bytes(p.vram_budget)} VRAM budget holds "
                        f"the whole target, and {at} against ~{p.expected_tokens_per_s:.0f} for this layout; "
                        "drop --placement (or use --placement gpu)")
    elif p.expected_tokens_per_s < p.plain_tokens_per_s * (1 - BELOW_PLAIN):
        how = f"placement {forced}" if forced else "no layout with the drafter"
        p.plain_note = (f"{how} is expected at ~{p.expected_tokens_per_s:.0f} tok/s, below plain: {at}"
                        + ("; drop --placement to let the planner choose" if forced else ""))


def _best(pl: Evaluator, evals: list[Evaluation], target: ModelFootprint, drafter: ModelFootprint | None,
          where: str | None, n_ctx: int | None, ram_given: bool, rate=None, floor: float | None = None) -> Evaluation:
    """The fitting candidate of least penalty (then least RAM) among those whose expected speed
    (``rate``) is not below plain decoding's at the same budget (``floor``; where none is, the
    fastest); BudgetExceeded, with the smallest RAM budget any plan at this context fits in,
    when none fits."""
    fitting = [e for e in evals if e.fits]
    if fitting and floor is not None:
        fitting = [e for e in fitting if rate(e) >= floor * (1 - BELOW_PLAIN)] or [max(fitting, key=rate)]
    if not fitting and where is not None and placements.mode(where).needs_gpu:
        _refuse_vram(pl, evals, target, where)
    if not fitting:
        msg, smallest = _refusal(pl, evals, target, drafter, n_ctx, ctx_options(n_ctx, target.n_ctx_train),
                                 ram_given)
        err = BudgetExceeded(msg)
        err.smallest_budget = smallest  # bytes
        raise err
    return min(fitting, key=lambda e: (e.penalty, e.ram))


def _checked(machine_info: MachineInfo | None, placement: str | None, target: ModelFootprint, n_ctx: int | None,
             kv_type: str | None, flash_attn: bool | None, n_ubatch: int | None,
             draft_max: int | None) -> tuple[MachineInfo, str | None]:
    """make_plan's machine and cache type, once its arguments are checked."""
    m = machine_info or machine()
    if placement is not None:
        placements.check_available(placement, m)
    _check_arguments(target, n_ctx, kv_type, flash_attn, n_ubatch, draft_max)
    return m, "f16" if flash_attn is False else kv_type  # the only cache llama.cpp runs without flash attention


def _check_arguments(target: ModelFootprint, n_ctx: int | None, kv_type: str | None, flash_attn: bool | None,
                     n_ubatch: int | None, draft_max: int | None) -> None:
    """Raises InvalidRequest for a context, cache, micro-batch or draft length out of range."""
    if n_ctx is not None:
        if n_ctx < 16:
            raise InvalidRequest(f"context size {n_ctx} is too small (minimum 16)")
        if target.n_ctx_train and n_ctx > target.n_ctx_train:
            raise InvalidRequest(f"context {n_ctx} exceeds the trained context {target.n_ctx_train} of "
                                 f"{target.name}; use --ctx {target.n_ctx_train} or less")
    if kv_type is not None and kv_type not in KV_CACHE_TYPES:
        raise InvalidRequest(f"KV cache type must be one of {', '.join(KV_CACHE_TYPES)}, got {kv_type!r}")
    if flash_attn is False and kv_type not in (None, "f16"):
        raise InvalidRequest(f"a {kv_type} KV cache needs flash attention: drop --no-flash-attn or the cache type")
    if n_ubatch is not None and not 1 <= n_ubatch <= ENGINE_N_BATCH:
        raise InvalidRequest(f"n_ubatch must be in [1, {ENGINE_N_BATCH}], got {n_ubatch}")
    if draft_max is not None and not 1 <= draft_max <= placements.MAX_DRAFT:
        raise InvalidRequest(f"draft_max must be in [1, {placements.MAX_DRAFT}], got {draft_max}")


def _budgets(m: MachineInfo, ram_budget: int | None, vram_budget: int | None) -> tuple[int, int]:
    """The budgets to plan in: those given, else what the machine has free minus a margin (on
    unified memory the VRAM comes out of the RAM)."""
    if ram_budget is None:
        ram_budget = default_ram_budget(m)
    if vram_budget is None:
        vram_budget = ram_budget if m.unified_memory and m.gpus else default_vram_budget(m)
    if ram_budget <= 0:
        raise BudgetExceeded(f"no RAM budget: {fmt_bytes(m.ram_available)} available, less than the "
                             "safety margin; pass --ram-budget")
    return ram_budget, vram_budget


def _longer_shape(search, best: Evaluation, chains: placements.DraftShape, draft_max: int | None,
                  draft_tree: bool | None) -> ShapeChoice:
    """The placement's default shape where it is longer than chains, in the best plan of that
    shape that gives up nothing (_given_way)."""
    asked = (draft_max, draft_tree)
    shape = placements.draft_shape(best.cfg.placement, draft_max, draft_tree, best.cfg.drafter == "gpu")
    if shape == chains:
        return ShapeChoice(chains, asked)
    try:
        longer = search(shape, best.cfg.placement)
    except BudgetExceeded:
        return ShapeChoice(chains, asked, shape, "more memory than the budgets hold")
    pl, top, evals = longer
    kept = [e for e in evals if e.fits and _given_way(best, e) is None]
    if not kept:
        return ShapeChoice(chains, asked, shape, _given_way(best, top))
    e = min(kept, key=lambda e: (e.penalty, e.ram))
    return ShapeChoice(shape, asked, plan=(pl, e, evals))


def _candidates(pl: Evaluator, target: ModelFootprint, drafter: ModelFootprint | None, where: str | None,
                kv_type: str | None, n_ubatch: int | None, mmap: bool | None, repack: bool | None,
                n_ctx: int | None, cpu_target: bool = False) -> list[Evaluation]:
    """Every candidate configuration, evaluated (fitting or not)."""
    m = pl.m
    can_repack = target.repack_bytes(m.cpu_features) > 0 or (
        drafter is not None and drafter.repack_bytes(m.cpu_features) > 0)
    repack_opts = [repack] if repack is not None else ([True, False] if can_repack else [False])
    resident_opts = [True, False] if m.mmap_supported and mmap is not False else [True]
    kv_opts = [kv_type] if kv_type else list(KV_CACHE_TYPES)
    ub_opts = [n_ubatch] if n_ubatch else list(UBATCH_CHOICES)
    ctx_opts = ctx_options(n_ctx, target.n_ctx_train)
    suffix_opts = list(SUFFIX_CAPS) if pl.suffix else [0]
    evals: list[Evaluation] = []
    for resident, rp, kv, ub, ctx, (where_, dr), sc in product(resident_opts, repack_opts, kv_opts, ub_opts,
                                                               ctx_opts, layouts(pl, where, cpu_target), suffix_opts):
        if not resident and (rp or dr != "none" or where_ != "cpu"):
            continue  # file-backed weights: on the CPU, no repacked copy, no drafter model
        cfg = Candidate(resident, rp, kv, ub, ctx, dr, sc, where_)
        e = pl.evaluate(cfg)
        e.penalty += RANKING["ctx_halving"].cost * ctx_opts.index(ctx)
        evals.append(e)
    return evals


def _given_way(chains: Evaluation, longer: Evaluation) -> str | None:
    """What the longer drafts' plan gives up against the chains' (None: nothing). A tree drafter
    builds a chain drafter's context (ModelDrafter.SEQUENCES), so what may differ is the
    target's: 64 verified rows instead of 33."""
    if longer.ngl < chains.ngl:
        lost = chains.ngl - longer.ngl
        return f"{lost} fewer target layer{'s' if lost > 1 else ''} on the GPU"
    a, b = asdict(chains.cfg), asdict(longer.cfg)
    worse = [k for k in a if a[k] != b[k] and (k not in _BETTER or _BETTER[k](b[k]) < _BETTER[k](a[k]))]
    return ", ".join(f"{k.replace('_', ' ')} {b[k]} instead of {a[k]}" for k in worse) or None


# Which way each setting of a plan is better (larger rank): a longer shape that changes one
# the better way gives nothing up; a change of any other setting counts as a cost.
_BETTER = {"resident": int, "n_ubatch": int, "n_ctx": int, "suffix_cap": int,
           "kv_type": {"q4_0": 0, "q8_0": 1, "f16": 2}.__getitem__,
           "drafter": {"none": 0, "cpu": 1, "gpu": 2}.__getitem__}


def _refuse_vram(pl: Evaluator, evals: list[Evaluation], target: ModelFootprint, placement: str) -> None:
    """A forced GPU placement whose RAM fits but whose VRAM does not: say what VRAM it needs."""
    in_ram = [e for e in evals if e.ram <= pl.ram_budget]
    if not in_ram:
        return  # the RAM refusal says more
    low = min(in_ram, key=lambda e: e.vram)
    need = "not one target layer beside the drafter" if placements.mode(placement).target == "split" \
        and low.ngl == 0 else f"{fmt_bytes(low.vram)} of VRAM"
    others = [n for n in placements.NAMES if n != placement]
    raise BudgetExceeded(f"placement {placement} does not fit the {fmt_bytes(pl.vram_budget)} VRAM budget "
                         f"for {target.name}: it needs {need}; raise --vram-budget or choose --placement "
                         f"{' / '.join(others)}")


def _refusal(pl: Evaluator, evals: list[Evaluation], target: ModelFootprint, drafter: ModelFootprint | None,
             n_ctx: int | None, ctx_opts: list[int], ram_given: bool) -> tuple[str, int]:
    ctx = ctx_opts[0] if n_ctx is not None else ctx_opts[-1]
    at_ctx = [e for e in evals if e.cfg.n_ctx == ctx]
    low = min(at_ctx, key=lambda e: (e.ram, e.penalty))
    # The largest context that the budget holds with the leanest settings.
    lean = low.cfg
    fit_ctx = 0
    lo, hi = 1, ctx // 256  # in units of 256 tokens
    while lo <= hi:
        mid = (lo + hi) // 2
        if pl.evaluate(replace(lean, n_ctx=mid * 256)).fits:
            fit_ctx, lo = mid * 256, mid + 1
        else:
            hi = mid - 1
    where = "--ram-budget" if ram_given else "free memory (or pass --ram-budget)"
    msg = (f"RAM budget {fmt_bytes(pl.ram_budget)} is too small for {target.name} with a {ctx}-token context: "
           f"the smallest plan needs {fmt_bytes(low.ram)} ({describe(lean, drafter is not None)}); "
           f"raise {where} to at least {fmt_bytes(low.ram)}")
    if fit_ctx and fit_ctx < ctx:
        msg += f" or use --ctx {fit_ctx}"
    elif not fit_ctx:
        smallest = pl.evaluate(replace(lean, n_ctx=256))
        msg += f" (even --ctx 256 needs {fmt_bytes(smallest.ram)})"
    return msg, low.ram
