"""Which drafter model `auto` runs beside the suffix index: the cheapest that can pay, or none.

A drafter pays if its steps gain over the steps `auto` takes without it
(edgespec.drafters.auto.policy.drafter_gain): as measured on this placement (tokens its steps
emitted over the tokens the suffix draft or a plain step was expected to emit in the same
seconds, drafting included), else priced on typical chains sized by their confidence against a
plain step. Replayed with real acceptance (benchmarks/replay): on the 2-core development VM,
where a drafted token costs half a target pass, loading the 0.5B drafter made `auto` 17-25%
slower than suffix drafts alone (Spec-Bench, code edits), as on one GPU (7B: 1.49x -> 1.39x);
beside a partly offloaded 7B, where a drafted token costs 2% of a step, it made it 40% faster
(1.14x -> 1.61x). Loading it anyway cost 0.6-0.8 GiB of peak RSS per `edgespec run` on the VM.
The candidates (the llama.cpp drafter; the ONNX conversion when one is in the store) are
priced from the calibration cache without loading them; only a candidate never measured on
this configuration is loaded to measure it, and every loaded candidate but the winner is
closed at once.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from edgespec.drafters.auto.calibrate import cached_draft_cost, draft_cost
from edgespec.drafters.auto.policy import CostModel, drafter_gain

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DrafterOption:
    """A drafter `auto` may run: its calibration key, how to load it, how to time a token."""

    name: str  # "model" (llama.cpp) | "onnx"
    key: str  # its drafted-token cost's calibration key
    load: Callable[[], object]
    measure: Callable[[object], float]  # seconds per drafted token of a loaded drafter
    owned: bool = True  # False: loaded by someone else (the bench shares one), never closed here


def pays(verify: CostModel, draft_token_s: float, budget: int, learned: list[float] | None = None) -> bool:
    """Whether a drafter at this cost per token gains over the steps taken without it: as
    measured here (``learned``, PolicyMemory.drafter_gain), else by its prior."""
    return drafter_gain(replace(verify, draft_token_s=draft_token_s), budget, learned) > 1.0


def cheapest_paying(costs: dict[str, float], verify: CostModel, budget: int,
                    learned: list[float] | None = None) -> str | None:
    """The option with the lowest cost per drafted token among those that can pay, or None.

    The options draft the same model (a conversion is exact to ~99% of greedy tokens), so they
    accept alike and the cheaper one is the faster one.
    """
    paying = [name for name, cost in costs.items() if pays(verify, cost, budget, learned)]
    return min(paying, key=costs.__getitem__, default=None)


def choose(options: list[DrafterOption], verify: CostModel, home, budget: int,
           learned: list[float] | None = None) -> tuple[object | None, float]:
    """The drafter `auto` should run (loaded) and its cost per token, or (None, 0.0).

    ``learned``: the drafter model's gain measured on this placement (PolicyMemory.drafter_gain),
    None before it ever drafted here. Loads only options whose cost is not cached yet (to
    measure them) and the winner.
    """
    costs, loaded = _price(options, home)
    best = cheapest_paying(costs, verify, budget, learned)
    chosen = _keep(options, loaded, best)
    for name, cost in costs.items():
        why = ("chosen" if name == best else "not loaded: another drafter is cheaper"
               if pays(verify, cost, budget, learned) else "not loaded: " + no_gain(learned))
        log.info("auto: %s drafter %s (%.1f ms per drafted token; one-token verify %.1f ms)", name, why,
                 cost * 1e3, verify.verify(1) * 1e3)
    return (chosen, costs[best]) if best is not None else (None, 0.0)


def no_gain(learned: list[float] | None) -> str:
    """Why a drafter that does not pay does not: measured here, or by its prior."""
    if learned is not None:
        return f"its steps here emitted {learned[0] / learned[1]:.2f}x what the steps without it would have"
    return "chains like its typical ones, sized by their confidence, would not beat plain steps at these costs"


def cheapest(options: list[DrafterOption], home) -> object | None:
    """The cheapest of several runtimes of one drafter model (`hybrid`, which always drafts with
    a model): priced from the calibration cache, measuring (loading) only what is not cached."""
    if len(options) <= 1:
        return options[0].load() if options else None
    costs, loaded = _price(options, home)
    best = min(costs, key=costs.__getitem__)
    log.info("hybrid: drafting with the %s runtime (%.1f ms per drafted token)", best, costs[best] * 1e3)
    return _keep(options, loaded, best)


def _price(options: list[DrafterOption], home) -> tuple[dict[str, float], dict[str, object]]:
    """Each option's seconds per drafted token, from the calibration cache; an option never
    measured on this configuration is loaded and measured (returned loaded, by name)."""
    costs = {o.name: cached_draft_cost(home, o.key) for o in options}
    loaded = {}
    for o in options:
        if costs[o.name] is None:
            drafter = loaded[o.name] = o.load()
            costs[o.name] = draft_cost(home, o.key, functools.partial(o.measure, drafter))
    return costs, loaded


def _keep(options: list[DrafterOption], loaded: dict[str, object], best: str | None) -> object | None:
    """Closes every loaded option but ``best`` (those it owns) and returns ``best`` loaded."""
    for o in options:
        if o.name in loaded and o.name != best and o.owned:
            loaded[o.name].close()
    if best is None:
        return None
    return loaded.get(best) or next(o for o in options if o.name == best).load()
