"""The best any draft-size policy could do with the drafts a trace records: a replay ceiling.

A policy decides, before each step, what to verify: a prefix of the drafter model's greedy
chain, a recorded best-first tree of some size, a prefix of the suffix index's proposal, or
nothing. For greedy decoding what each choice would accept at every output position is known
from the trace (the chain follows the plain output while the drafter's argmax equals it and it
is confident enough to go on, as the drafter stops below ``min_confidence``; trees and suffix
proposals accept their longest path along it), and so is what it costs on a machine. The
fastest sequence of choices is then a shortest path over output positions, solved backwards:

    best[p] = min over choices c at p of  cost(c, p) + best[p + accepted(c, p) + 1]

``best[1]`` is the decode time of an oracle that knows every step's outcome before choosing.
No policy over the same drafts (auto's, TreeSizes', a confidence rule) can beat it, so a goal
above it is out of reach for these drafters on that machine, whatever the policy. It is
optimistic on purpose: drafting is priced as decodes alone (one per chain token, the recorded
search rounds for a tree, nothing for the suffix index), with no sync of the drafter's cache;
drafting beside verification (overlap) is not modelled, so ``model-overlap`` may pass it; and
every decode is priced at its curve, without the CUDA graph misses a replay books
(``MachineCosts.graph_miss_s``), so on a GPU it stands above replays that price them.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from replay import MachineCosts, PromptTrace, ReplaySettings

from edgespec.bench.summary import Record
from edgespec.drafters.factory import suffix_drafter
from edgespec.spec.tree_search import accepted_by, accepted_path

SOURCES = ("model", "tree", "suffix")
CEILING = "ceiling"
DEFAULT = ReplaySettings()


@dataclass(frozen=True)
class Choice:
    """One way to spend a step at a position: what it verifies, accepts and costs."""

    source: str  # "plain" | "model" | "tree" | "suffix"
    drafted: int
    accepted: int
    seconds: float


def chain_runs(trace: PromptTrace) -> list[int]:
    """runs[q]: how many drafter-argmax tokens from output position q on follow the output
    before the drafter misses or is too unsure to go on."""
    d, out = trace.drafter, trace.output
    runs = [0] * (len(out) + 1)
    for q in range(min(len(out), len(d.top_ids)) - 1, -1, -1):
        runs[q] = runs[q + 1] + 1 if d.top(q) == out[q] and d.confident(q) else 0
    return runs


def suffix_accepts(trace: PromptTrace, n: int, draft_max: int) -> list[list[int]]:
    """What each prefix of the suffix index's proposal after output[:p] accepts (entry m - 1:
    its first m nodes), for p < n, the index fed the prompt and the output so far (one request,
    as replay's runs start fresh). A policy may verify any prefix (auto does)."""
    drafter = suffix_drafter(draft_max)
    drafter.begin(list(trace.prompt))
    context = list(trace.prompt)
    out = []
    for p in range(n):
        if p:
            drafter.observe([trace.output[p - 1]])
            context.append(trace.output[p - 1])
        tree = drafter.propose(context, draft_max)
        by_prefix = accepted_by(accepted_path(tree, trace.output[p:]), range(1, len(tree) + 1))
        out.append([by_prefix[m] for m in range(1, len(tree) + 1)])
    drafter.end()
    return out


def choices(trace: PromptTrace, p: int, costs: MachineCosts, settings: ReplaySettings, sources: Sequence[str],
            runs: list[int], suffix: list[list[int]]) -> list[Choice]:
    """Every choice at output position p (p tokens emitted; output[p] is the next one)."""
    depth = len(trace.prompt) + p - 1
    verify = lambda n: costs.verify(n, depth) + costs.step_s
    found = [Choice("plain", 0, 0, verify(1))]
    if "model" in sources and trace.drafter is not None:
        one = costs.draft(1)
        found += [Choice("model", k, min(k, runs[p]), verify(k + 1) + k * one)
                  for k in range(1, settings.draft_max + 1)]
    t = trace.trees
    if "tree" in sources and t is not None and p < len(t.accepted):
        for k, size in enumerate(t.budgets):
            search = sum(costs.draft(n) for n in t.round_rows(p, k))
            found.append(Choice("tree", size, t.accepted[p][k],
                                verify(size + 1) + search + t.expansions[p][k] * costs.node_s))
    if "suffix" in sources:
        found += [Choice("suffix", m, a, verify(m + 1)) for m, a in enumerate(suffix[p], start=1)]
    return found


def ceiling(trace: PromptTrace, costs: MachineCosts, settings: ReplaySettings = DEFAULT,
            sources: Sequence[str] = SOURCES) -> tuple[float, list[Choice]]:
    """The oracle's decode seconds for the answer's first ``max_tokens`` tokens (the EOG's
    decode included, as plain pays it) and its steps."""
    unknown = set(sources) - set(SOURCES)
    if unknown:
        raise ValueError(f"unknown ceiling sources {sorted(unknown)} (known: {', '.join(SOURCES)})")
    n = min(len(trace.output), settings.max_tokens)
    runs = chain_runs(trace) if trace.drafter is not None else []
    suffix = suffix_accepts(trace, n, settings.draft_max) if "suffix" in sources else []
    best = [0.0] * (n + 1)
    pick: list[Choice | None] = [None] * (n + 1)
    for p in range(n - 1, 0, -1):
        for c in choices(trace, p, costs, settings, sources, runs, suffix):
            s = c.seconds + best[min(n, p + c.accepted + 1)]
            if pick[p] is None or s < best[p]:
                best[p], pick[p] = s, c
    steps, p = [], 1
    while p < n:  # accepted counts only what is left of the answer
        steps.append(replace(pick[p], accepted=min(pick[p].accepted, n - p - 1)))
        p += pick[p].accepted + 1
    return best[1] if n > 1 else 0.0, steps


def ceiling_record(trace: PromptTrace, costs: MachineCosts, settings: ReplaySettings = DEFAULT,
                   sources: Sequence[str] = SOURCES) -> Record:
    """The ceiling as a bench Record (config ``ceiling``), comparable with replayed runs."""
    seconds, steps = ceiling(trace, costs, settings, sources)
    n = min(len(trace.output), settings.max_tokens)
    n -= trace.finish == "stop" and n == len(trace.output)  # the EOG ends the answer, not in it
    drafted = [c for c in steps if c.source != "plain"]
    return Record(id=trace.id, category=trace.category, config=CEILING, new_tokens=n, gen_s=seconds,
                  prefill_s=0.0, steps=len(steps), drafted=sum(c.drafted for c in drafted),
                  accepted=sum(c.accepted for c in drafted), peak_rss_bytes=0, text="",
                  gen_tokens=max(n - 1, 0), same_as_plain=True)
