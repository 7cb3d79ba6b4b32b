"""Per-prompt records and the Spec-Bench style summary (pure functions, no I/O).

Speedup follows Spec-Bench: the mean of per-prompt tokens/s of a configuration over the same
mean for plain decoding in the same run, per category and overall. Tokens/s of a prompt is
new tokens over the generation phase (prefill excluded and reported apart). Mean emitted
tokens per step is the tokens produced by steps over the steps (1.00 for plain decoding; the
first token comes out of the prefill, not a step).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from statistics import mean

PLAIN = "plain"
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
    same_as_plain: bool | None = None
    # Tokens produced inside the gen_s window: edgespec's window starts after the first token
    # (which comes out of the prefill), llama.cpp's "decoded" window includes it.
    gen_tokens: int | None = None
    reused_prompt_tokens: int = 0  # prompt tokens found in the KV cache (bench --share-prefill)

    @property
    def tokens_per_s(self) -> float:
        n = self.new_tokens if self.gen_tokens is None else self.gen_tokens
        return n / self.gen_s if n > 0 and self.gen_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tokens_per_s"] = self.tokens_per_s
        return d


def _cell(records: list[Record], plain_tps: float | None) -> dict:
    tps = mean(r.tokens_per_s for r in records)
    steps = sum(r.steps for r in records)
    emitted = sum(max(r.new_tokens - 1, 0) for r in records if r.steps)
    return {
        "tokens_per_s": tps,
        "speedup": tps / plain_tps if plain_tps else None,
        "mean_emitted": emitted / steps if steps else None,
        "prompts": len({r.id for r in records}),
        "acceptance_rate": (sum(r.accepted for r in records) / sum(r.drafted for r in records)
                            if sum(r.drafted for r in records) else None),
    }


def summarize(records: list[Record]) -> dict[str, dict[str, dict]]:
    """summary[config][category or "overall"] = {tokens_per_s, speedup, mean_emitted, ...}."""
    configs = list(dict.fromkeys(r.config for r in records))
    categories = list(dict.fromkeys(r.category for r in records))
    plain = {c: mean(r.tokens_per_s for r in records if r.config == PLAIN and r.category == c)
             for c in categories if any(r.config == PLAIN and r.category == c for r in records)}
    plain_all = [r.tokens_per_s for r in records if r.config == PLAIN]
    out: dict[str, dict[str, dict]] = {}
    for cfg in configs:
        rows = [r for r in records if r.config == cfg]
        out[cfg] = {c: _cell([r for r in rows if r.category == c], plain.get(c))
                    for c in categories if any(r.category == c for r in rows)}
        out[cfg][OVERALL] = _cell(rows, mean(plain_all) if plain_all else None)
        spread = _repeat_spread(records, cfg)
        if spread is not None:
            out[cfg][OVERALL]["speedup_min"], out[cfg][OVERALL]["speedup_max"] = spread
    return out


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


def interleaved_order(prompt_ids: list[str], configs: list[str], repeats: int) -> list[tuple[int, str, str]]:
    """(repeat, prompt id, config) in the order runs happen: every config of a prompt back to
    back (plain first), so machine noise hits all configurations alike."""
    configs = [PLAIN] + [c for c in configs if c != PLAIN]
    return [(k, pid, cfg) for k in range(repeats) for pid in prompt_ids for cfg in configs]
