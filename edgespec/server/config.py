"""What the server serves and how it guards itself, and the engine it serves once loaded."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from edgespec.engine import Engine
from edgespec.server.metrics import Metrics

MAX_BODY_BYTES = 1 << 20
# A whole body must arrive within this; a stalled upload would otherwise hold its connection
# (and the server's shutdown) forever. 1 MiB in 30 s is 35 KB/s.
BODY_TIMEOUT_S = 30.0
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]", "::1"})
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]", ""})


@dataclass
class ServerConfig:
    """What the server serves and how it guards itself."""

    model_id: str
    model_aliases: frozenset[str] = frozenset()  # other names accepted in the "model" field
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = ()  # extra Host header names (besides the bound host)
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout_s: float = BODY_TIMEOUT_S

    def host_allowed(self, host_header: str | None) -> bool:
        """Whether a Host header names this server (protects loopback servers from DNS rebinding)."""
        extra = {h.lower() for h in self.allowed_hosts}
        bound = _normal_host(self.host)
        if bound in WILDCARD_HOSTS and not extra:
            return True  # listening everywhere: any name may reach it (use --api-key)
        if not host_header:
            return False
        name = _host_name(host_header)
        return name in LOOPBACK_NAMES or name == bound or name in extra

    def serves(self, model: str) -> bool:
        """Whether ``model`` names the served model: its id or one of its aliases."""
        return model == self.model_id or model in self.model_aliases


def _normal_host(host: str) -> str:
    host = host.strip().lower().rstrip(".")
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _host_name(header: str) -> str:
    """The host part of a Host header, lower-cased: 'LocalHost:8080' -> 'localhost'."""
    header = header.strip().lower()
    if header.startswith("["):
        end = header.find("]")
        return header[:end + 1] if end > 0 else header
    return header.split(":", 1)[0].rstrip(".")


def model_names(model_arg: str, path: str | Path) -> tuple[str, frozenset[str]]:
    """The id a served model goes by, and the other names a request may use for it.

    A store name is its own id; a path is known by its file stem. The name as given on the
    command line, the resolved path and the file name are accepted too.
    """
    path = Path(path)
    arg_is_path = Path(model_arg).suffix == ".gguf" or "/" in model_arg or "\\" in model_arg
    model_id = path.stem if arg_is_path else model_arg
    aliases = {model_arg, str(path), path.name, path.stem, str(path.resolve())} - {model_id}
    return model_id, frozenset(aliases)


@dataclass
class ServerState:
    """The engine once loaded, or why it is not there yet."""

    config: ServerConfig
    metrics: Metrics = field(default_factory=Metrics)
    engine: Engine | None = None
    load_error: BaseException | None = None
    started: float = field(default_factory=time.time)
    # Set on the event loop when the server starts shutting down: bodies still arriving are
    # answered 503 and no new generation is queued, so open connections finish at once.
    stopping: asyncio.Event = field(default_factory=asyncio.Event)

    def load(self, factory: Callable[[], Engine]) -> None:
        """Builds the engine (call from a thread); on failure records the error and re-raises."""
        try:
            self.engine = factory()
        except BaseException as exc:
            self.load_error = exc
            raise
