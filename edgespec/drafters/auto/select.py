"""Which drafter model `auto` runs beside the suffix index: the cheapest that can pay, or none.

A drafter pays only if, at the acceptance auto expects of it (learned on this placement,
edgespec.drafters.auto.memory, else its prior), a chain of its tokens emits more per second than
plain steps: k drafted tokens cost k drafter passes plus a (1 + k)-token verification. On the
2-core development VM the 0.5B drafter costs about a third of a 1.5B target pass per token and
a 9-token verification 2.7 passes, so it fails that test; loading it anyway cost 0.6-0.8 GiB of
peak RSS per `edgespec run` (2.73 GiB against 1.96 GiB). The candidates (the llama.cpp drafter; the ONNX
conversion when one is in the store) are priced from the calibration cache without loading
them; only a candidate never measured on this configuration is loaded to measure it, and every
loaded candidate but the winner is closed at once.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from edgespec.drafters.auto.calibrate import cached_draft_cost, draft_cost
from edgespec.drafters.auto.policy import CostModel, best_chain_length

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DrafterOption:
    """A drafter `auto` may run: its calibration key, how to load it, how to time a token."""

    name: str  # "model" (llama.cpp) | "onnx"
    key: str  # its drafted-token cost's calibration key
    load: Callable[[], object]
    measure: Callable[[object], float]  # seconds per drafted token of a loaded drafter
    owned: bool = True  # False: loaded by someone else (the bench shares one), never closed here


def pays(verify: CostModel, draft_token_s: float, budget: int, alphas: list[float] | None = None) -> bool:
    """Whether a drafter with acceptance ``alphas`` per depth (None: one that is always right),
    at this cost per token, beats plain steps."""
    alphas = alphas or [1.0] * budget
    return best_chain_length(alphas, replace(verify, draft_token_s=draft_token_s), budget)[0] > 0


def cheapest_paying(costs: dict[str, float], verify: CostModel, budget: int,
                    alphas: list[float] | None = None) -> str | None:
    """The option with the lowest cost per drafted token among those that can pay, or None.

    The options draft the same model (a conversion is exact to ~99% of greedy tokens), so they
    accept alike and the cheaper one is the faster one.
    """
    paying = [name for name, cost in costs.items() if pays(verify, cost, budget, alphas)]
    return min(paying, key=costs.__getitem__, default=None)


def choose(options: list[DrafterOption], verify: CostModel, home, budget: int,
           alphas: list[float] | None = None) -> tuple[object | None, float]:
    """The drafter `auto` should run (loaded) and its cost per token, or (None, 0.0).

    ``alphas``: the drafter model's acceptance per depth as auto believes it on this placement
    (edgespec.drafters.auto.memory: learned, else its prior); None: judged as if always right. Loads only options whose
    cost is not cached yet (to measure them) and the winner.
    """
    costs, loaded = _price(options, home)
    best = cheapest_paying(costs, verify, budget, alphas)
    chosen = _keep(options, loaded, best)
    for name, cost in costs.items():
        why = ("chosen" if name == best else "not loaded: another drafter is cheaper"
               if pays(verify, cost, budget, alphas) else "not loaded: at the acceptance auto expects "
               "of it, its chains would not beat plain steps")
        log.info("auto: %s drafter %s (%.1f ms per drafted token; one-token verify %.1f ms)", name, why,
                 cost * 1e3, verify.verify(1) * 1e3)
    return (chosen, costs[best]) if best is not None else (None, 0.0)


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
