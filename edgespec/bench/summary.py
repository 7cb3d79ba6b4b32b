"""Per-prompt records and the Spec-Bench style summary (pure functions, no I/O).

Speedup follows Spec-Bench: the mean of per-prompt tokens/s of a configuration over the same
mean for plain decoding in the same run, per category and overall. Tokens/s of a prompt is
new tokens over the generation phase (prefill excluded and reported apart). Mean emitted
tokens per step is the tokens produced by steps over the steps: one per step plus its accepted
drafts, the step that produced the end-of-generation token included (1.00 for plain decoding;
the first token comes out of the prefill, not a step).

Records of a later conversation turn (``bench --turns all``) form a group of their own,
"CATEGORY (turn N)", beside their category's first turns; "overall" covers every turn. When the
run has native plain decoding (``peer:llama.cpp-plain``), every cell also carries
``speedup_native``: the same ratio over native plain, so native peers are measured against
their own baseline as well as against edgespec's plain.

``plain`` is the best plain decoding at the run's budgets: under a VRAM budget or a drafter's
placement (offload, draft-gpu, overlap) that is the target alone with as many layers on the GPU
as the budget holds, which may be another load than the speculative configurations' (bench
runs it first, on its own). Plain decoding in the speculative configurations' layout is then the
secondary ``plain-in-layout``, and every cell carries ``speedup_in_layout`` over it as well.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from statistics import mean

from edgespec.bench.peers import NATIVE_PLAIN

PLAIN = "plain"
IN_LAYOUT = "plain-in-layout"  # plain decoding in the speculative layout, where that is not the best plain
OVERALL = "overall"


@dataclass
class Record:
    """One prompt under one configuration (one repeat)."""

    id: str
    category: str
    config: str
    new_tokens: int
    gen_s: float
    prefill_s: float
    steps: int
    drafted: int
    accepted: int
    peak_rss_bytes: int
    text: str
    repeat: int = 0
    same_as_plain: bool | None = None  # plain's answer in the same layout (plain-in-layout's if it ran)
    # Tokens produced inside the gen_s window: edgespec's window starts after the first token
    # (which comes out of the prefill), llama.cpp's "decoded" window includes it.
    gen_tokens: int | None = None
    reused_prompt_tokens: int = 0  # prompt tokens found in the KV cache (bench --share-prefill)
    turn: int = 1  # the conversation turn: its prompt holds the earlier turns and plain's answers
    prompt_tokens: int = 0  # 0: the peer did not report it
    rechecks: int = 0  # greedy positions re-decoded alone (X+recheck configurations)

    @property
    def group(self) -> str:
        """The summary column: the category, with the turn after the first."""
        return self.category if self.turn == 1 else f"{self.category} (turn {self.turn})"

    @property
    def tokens_per_s(self) -> float:
        n = self.new_tokens if self.gen_tokens is None else self.gen_tokens
        return n / self.gen_s if n > 0 and self.gen_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tokens_per_s"] = self.tokens_per_s
        return d


def _cell(records: list[Record], plain_tps: float | None, native_tps: float | None,
          in_layout_tps: float | None = None) -> dict:
    tps = mean(r.tokens_per_s for r in records)
    steps = sum(r.steps for r in records)
    # A step's accepted drafts past an end token or stop string never reach the output: at most
    # the answer's tokens after the first one, plus the end token, came out of steps.
    emitted = sum(min(r.steps + r.accepted, r.new_tokens) for r in records if r.steps)
    return {
        "tokens_per_s": tps,
        "speedup": tps / plain_tps if plain_tps else None,
        "speedup_native": tps / native_tps if native_tps else None,
        "speedup_in_layout": tps / in_layout_tps if in_layout_tps else None,
        "mean_emitted": emitted / steps if steps else None,
        "prompts": len({r.id for r in records}),
        "acceptance_rate": (sum(r.accepted for r in records) / sum(r.drafted for r in records)
                            if sum(r.drafted for r in records) else None),
    }


def _baseline(records: list[Record], config: str) -> tuple[dict[str, float], float | None]:
    """Mean tokens/s of ``config`` per group, and over all its records (None: it never ran)."""
    mine = [r for r in records if r.config == config]
    groups = dict.fromkeys(r.group for r in mine)
    per_group = {g: mean(r.tokens_per_s for r in mine if r.group == g) for g in groups}
    return per_group, mean(r.tokens_per_s for r in mine) if mine else None


def summarize(records: list[Record]) -> dict[str, dict[str, dict]]:
    """summary[config][group or "overall"] = {tokens_per_s, speedup, speedup_native,
    speedup_in_layout, mean_emitted, ...}, plain first."""
    configs = list(dict.fromkeys([PLAIN] * any(r.config == PLAIN for r in records) + [r.config for r in records]))
    groups = list(dict.fromkeys(r.group for r in records))
    plain, plain_all = _baseline(records, PLAIN)
    native, native_all = _baseline(records, NATIVE_PLAIN)
    in_layout, in_layout_all = _baseline(records, IN_LAYOUT)
    out: dict[str, dict[str, dict]] = {}
    for cfg in configs:
        rows = [r for r in records if r.config == cfg]
        out[cfg] = {g: _cell([r for r in rows if r.group == g], plain.get(g), native.get(g), in_layout.get(g))
                    for g in groups if any(r.group == g for r in rows)}
        out[cfg][OVERALL] = _cell(rows, plain_all, native_all, in_layout_all)
        spread = _repeat_spread(records, cfg)
        if spread is not None:
            out[cfg][OVERALL]["speedup_min"], out[cfg][OVERALL]["speedup_max"] = spread
    return out


def has_native_plain(summary: dict[str, dict[str, dict]]) -> bool:
    """Whether any cell of ``summary`` has a ratio over native plain decoding."""
    return any(c.get("speedup_native") is not None for cells in summary.values() for c in cells.values())


def _repeat_spread(records: list[Record], cfg: str) -> tuple[float, float] | None:
    """Min and max of the overall speedup computed within each repeat separately."""
    repeats = sorted({r.repeat for r in records})
    if len(repeats) < 2 or cfg == PLAIN:
        return None
    values = []
    for k in repeats:
        mine = [r.tokens_per_s for r in records if r.config == cfg and r.repeat == k]
        base = [r.tokens_per_s for r in records if r.config == PLAIN and r.repeat == k]
        if mine and base and mean(base) > 0:
            values.append(mean(mine) / mean(base))
    return (min(values), max(values)) if values else None


def interleaved_order(prompt_ids: list[str], configs: list[str], repeats: int,
                      turns: dict[str, int] | None = None, first: str | None = PLAIN) -> list[tuple[int, str, int, str]]:
    """(repeat, prompt id, turn, config) in the order runs happen: every config of a prompt's
    turn back to back (``first`` first, plain unless told), so machine noise hits all
    configurations alike, and plain has answered a turn before any configuration runs the next.
    ``turns``: how many turns each prompt runs (default 1)."""
    configs = ([first] if first else []) + [c for c in configs if c != first]
    turns = turns or {}
    return [(k, pid, t, cfg) for k in range(repeats) for pid in prompt_ids
            for t in range(1, turns.get(pid, 1) + 1) for cfg in configs]
