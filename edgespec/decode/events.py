"""Typed records the library yields while generating; the CLI and server only consume them."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from edgespec.decode.stats import SpecStats


@dataclass(frozen=True)
class TokenEvent:
    """New text and the token ids that produced it.

    ``text`` may be empty when a token completes no character yet (a split multi-byte
    character) or is held back because it may start a stop string.
    """

    text: str
    token_ids: tuple[int, ...]
    from_draft: bool = False


@dataclass
class GenerationStats:
    """Counters and timings of one request; every rate is derived, never stored."""

    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0  # prompt tokens whose KV entries were kept from the last request
    prompt_eval_s: float = 0.0
    generated_tokens: int = 0
    gen_s: float = 0.0  # wall time from the first sampled token to the end
    ttft_s: float = 0.0  # request start to first token
    peak_rss_bytes: int = 0  # largest RSS sampled during the request (edgespec.memory.rss)
    peak_anon_bytes: int = 0  # largest RssAnon + RssShmem sampled: what cannot be reclaimed
    process_peak_rss_bytes: int = 0  # VmHWM: the process's peak RSS ever, model loading included
    finish_reason: str = ""
    spec: SpecStats | None = None  # None: the request ran plain decoding

    @property
    def prompt_tokens_per_s(self) -> float:
        evaluated = self.prompt_tokens - self.reused_prompt_tokens
        return evaluated / self.prompt_eval_s if self.prompt_eval_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        # The first token comes out of the prefill; the rate covers the tokens decoded after it.
        n = self.generated_tokens - 1
        return n / self.gen_s if n > 0 and self.gen_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("spec")
        if self.spec is not None:
            d.update(self.spec.to_dict())
        d["prompt_tokens_per_s"] = self.prompt_tokens_per_s
        d["tokens_per_s"] = self.tokens_per_s
        return d


@dataclass(frozen=True)
class DoneEvent:
    """The last event of a request: the whole text and the statistics."""

    text: str
    token_ids: tuple[int, ...]
    stats: GenerationStats

    @property
    def finish_reason(self) -> str:
        return self.stats.finish_reason
