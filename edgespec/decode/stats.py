"""Speculation counters of one request, typed: the CLI line, the server, /metrics and the bench
read these fields (vocabulary in edgespec.decode.tree)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class DrafterCounts:
    steps: int = 0
    drafted: int = 0
    accepted: int = 0


@dataclass
class SpecStats:
    """Steps, drafted and accepted tokens, in total and per drafter that made the draft."""

    mode: str = "none"  # the drafter the request ran with (auto splits by_drafter per decision)
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    rechecks: int = 0  # greedy positions re-decoded alone because the batch left a near-tie
    drafted_ahead: int = 0  # steps whose draft was drafted during the previous verification (overlap)
    by_drafter: dict[str, DrafterCounts] = field(default_factory=dict)

    def add(self, source: str, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        counts = self.by_drafter.setdefault(source or "none", DrafterCounts())
        counts.steps += 1
        counts.drafted += drafted
        counts.accepted += accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_emitted(self) -> float:
        """Tokens per step: accepted + one bonus each."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["acceptance_rate"] = self.acceptance_rate
        d["mean_emitted"] = self.mean_emitted
        return d
