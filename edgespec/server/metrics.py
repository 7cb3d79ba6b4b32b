"""The counters behind ``GET /metrics``, rendered in Prometheus' text format."""
from __future__ import annotations

import math
import threading

from edgespec.decode.events import DoneEvent
from edgespec.engine import Engine

# Paths counted by name; anything else is counted as "other" so a scan cannot grow the label set.
KNOWN_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


class Metrics:
    """Counters behind /metrics; every update takes a lock (worker threads and the loop write)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.http: dict[tuple[str, str], int] = {}
        self.completions: dict[tuple[str, str], int] = {}
        self.rejected: dict[str, int] = {}
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.generation_s = 0.0
        self.last_tokens_per_s = 0.0
        self.drafters: dict[str, dict[str, int]] = {}

    def http_response(self, path: str, status: int) -> None:
        key = (path if path in KNOWN_PATHS else "other", str(status))
        with self._lock:
            self.http[key] = self.http.get(key, 0) + 1

    def rejected_request(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def generation(self, endpoint: str, done: DoneEvent) -> None:
        st = done.stats
        with self._lock:
            key = (endpoint, st.finish_reason or "unknown")
            self.completions[key] = self.completions.get(key, 0) + 1
            self.prompt_tokens += st.prompt_tokens
            self.generated_tokens += st.generated_tokens
            self.generation_s += st.gen_s
            if st.tokens_per_s > 0:
                self.last_tokens_per_s = st.tokens_per_s
            for name, d in (st.spec.by_drafter if st.spec else {}).items():
                tot = self.drafters.setdefault(name, {"steps": 0, "drafted": 0, "accepted": 0})
                for k in tot:
                    tot[k] += getattr(d, k)

    def render(self, engine: Engine | None, model_id: str) -> str:
        """Prometheus text exposition format (version 0.0.4)."""
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[dict, float]]) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lab = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels.items())
                out.append(f"{name}{{{lab}}} {_num(value)}" if lab else f"{name} {_num(value)}")

        with self._lock:
            metric("edgespec_model_loaded", "gauge", "1 once the model serves requests.",
                   [({"model": model_id}, 1 if engine is not None else 0)])
            metric("edgespec_http_requests_total", "counter", "HTTP responses by path and status code.",
                   [({"path": p, "code": c}, n) for (p, c), n in sorted(self.http.items())])
            metric("edgespec_requests_total", "counter",
                   "Generations that ended, by endpoint and finish reason.",
                   [({"endpoint": e, "finish_reason": r}, n) for (e, r), n in sorted(self.completions.items())])
            metric("edgespec_requests_rejected_total", "counter", "Requests refused before generating.",
                   [({"reason": r}, n) for r, n in sorted(self.rejected.items())])
            metric("edgespec_prompt_tokens_total", "counter", "Prompt tokens of ended generations.",
                   [({}, self.prompt_tokens)])
            metric("edgespec_generated_tokens_total", "counter", "Tokens generated.",
                   [({}, self.generated_tokens)])
            metric("edgespec_generation_seconds_total", "counter",
                   "Decoding time after each first token (rate of tokens: divide the token counter).",
                   [({}, self.generation_s)])
            avg = self.generated_tokens / self.generation_s if self.generation_s > 0 else 0.0
            metric("edgespec_tokens_per_second", "gauge", "Decoding speed of the last generation.",
                   [({}, self.last_tokens_per_s)])
            metric("edgespec_tokens_per_second_average", "gauge",
                   "Generated tokens over decoding time, since the start.", [({}, avg)])
            for key, help_ in (("drafted", "Draft tokens proposed, per drafter."),
                               ("accepted", "Draft tokens the target accepted, per drafter."),
                               ("steps", "Speculative verification steps, per drafter.")):
                name = "edgespec_speculation_steps_total" if key == "steps" else f"edgespec_{key}_tokens_total"
                metric(name, "counter", help_,
                       [({"drafter": d}, v[key]) for d, v in sorted(self.drafters.items())])
        queue = engine.queue if engine is not None else None
        metric("edgespec_queue_length", "gauge", "Requests waiting behind the running one.",
               [({}, queue.waiting if queue else 0)])
        metric("edgespec_requests_running", "gauge", "Generations running now (0 or 1).",
               [({}, 1 if queue and queue.busy else 0)])
        return "\n".join(out) + "\n"


def _escape_label(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return repr(float(value)) if math.isfinite(value) else "NaN"
