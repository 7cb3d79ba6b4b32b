"""What one request asks for: token budget, stop conditions and sampler settings, validated here
(the CLI, the server and the Python API all build requests through this module)."""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field

from edgespec.decode.sampling import SamplingParams
from edgespec.errors import InvalidRequest


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate after a prompt: budget, stop conditions and sampler settings."""

    max_tokens: int = 512
    stop: tuple[str, ...] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if any(not isinstance(s, str) for s in self.stop):
            raise InvalidRequest("stop strings must be strings")


REQUEST_OPTIONS = frozenset({"max_tokens", "stop", "ignore_eos"})
SAMPLING_OPTIONS = frozenset({"temperature", "top_k", "top_p", "min_p", "repeat_penalty",
                              "repeat_last_n", "seed"})
_INTEGRAL = frozenset({"top_k", "repeat_last_n", "seed"})


def make_request(request: GenerationRequest | None = None, **options) -> GenerationRequest:
    """A GenerationRequest from keyword options (or ``request`` itself when there are none).

    Options: max_tokens, stop (a string or strings), ignore_eos, and the SamplingParams fields
    temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed. The defaults are
    those of GenerationRequest / SamplingParams (greedy, 512 tokens).

    Raises:
        InvalidRequest: an unknown option, a value of the wrong type or out of range, or both
            ``request`` and options.
    """
    if request is not None:
        if options:
            raise InvalidRequest("pass either a GenerationRequest or keyword options, not both")
        if not isinstance(request, GenerationRequest):
            raise InvalidRequest(f"request must be a GenerationRequest, got {type(request).__name__}")
        return request
    unknown = sorted(set(options) - REQUEST_OPTIONS - SAMPLING_OPTIONS)
    if unknown:
        raise InvalidRequest(f"unknown option(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(REQUEST_OPTIONS | SAMPLING_OPTIONS))}")
    sampling = {k: _number(k, v) for k, v in options.items() if k in SAMPLING_OPTIONS}
    return GenerationRequest(max_tokens=options.get("max_tokens", GenerationRequest.max_tokens),
                             stop=_stop_strings(options.get("stop", ())),
                             sampling=SamplingParams(**sampling),
                             ignore_eos=bool(options.get("ignore_eos", False)))


def _number(key: str, value):
    if value is None and key == "seed":
        return None
    integral = key in _INTEGRAL
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if integral else numbers.Real):
        raise InvalidRequest(f"{key} must be {'an integer' if integral else 'a number'}, got {value!r}")
    return int(value) if integral else float(value)


def _stop_strings(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if not isinstance(stop, (list, tuple)):
        raise InvalidRequest(f"stop must be a string or a list of strings, got {stop!r}")
    return tuple(stop)
