"""`edgespec serve`: an OpenAI-compatible HTTP server over one loaded model."""
from __future__ import annotations

import sys
from typing import Optional

import typer

try:  # typer >= 0.2x vendors click; older releases depend on it
    from typer._click import exceptions as click_exc
except ImportError:  # pragma: no cover
    from click import exceptions as click_exc

from edgespec.cli import app
from edgespec.cli import common as c
from edgespec.errors import BudgetExceeded, InvalidRequest


def _ram_budget(value: Optional[str]) -> Optional[int]:
    if value is None:
        return None
    from edgespec.units import parse_bytes

    try:
        return parse_bytes(value)
    except InvalidRequest as exc:
        raise typer.BadParameter(str(exc)) from None


@app.command()
def serve(
    model: str = c.MODEL,
    draft: str = c.DRAFT,
    draft_max: Optional[int] = c.DRAFT_MAX,
    draft_tree: Optional[bool] = c.DRAFT_TREE,
    draft_model: Optional[str] = c.DRAFT_MODEL,
    onnx_provider: str = c.ONNX_PROVIDER,
    onnx_bits: str = c.ONNX_BITS,
    ctx: int = c.CTX,
    threads: Optional[int] = c.THREADS,
    n_gpu_layers: int = c.GPU_LAYERS,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8080, "--port", "-p", min=0, max=65535, help="TCP port (0: any free port)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="EDGESPEC_API_KEY",
                                          help="Require 'Authorization: Bearer KEY' on /v1/*."),
    ram_budget: Optional[str] = typer.Option(None, "--ram-budget", callback=_ram_budget,
                                             help="Refuse to start if weights + KV cache exceed it "
                                                  "(e.g. 2GiB, 2048MiB, 1.5GB, bytes)."),
    vram_budget: Optional[str] = c.VRAM_BUDGET,
    placement: Optional[str] = c.PLACEMENT,
    exact: bool = c.EXACT,
    flash_attn: Optional[bool] = c.FLASH_ATTN,
    max_queue: int = typer.Option(16, "--max-queue", min=0,
                                  help="Requests that may wait behind the running one; more get 503."),
    allow_host: Optional[list[str]] = typer.Option(None, "--allow-host",
                                                   help="Extra name accepted in the Host header (repeatable)."),
) -> None:
    """Serve MODEL over HTTP: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics."""
    try:
        from edgespec.server import app as srv
    except ImportError as exc:
        raise click_exc.ClickException(
            f"the server needs the [server] extra ({exc.name} is missing): "
            "pip install 'edgespec[server]'") from None
    from edgespec.drafters import check_onnx_options
    from edgespec.engine import Engine, EngineConfig
    from edgespec.files.store import ModelStore
    from edgespec.memory.machine import machine
    from edgespec.memory.placements import check_available
    from edgespec.units import format_bytes, parse_bytes

    store = ModelStore()
    path = store.resolve(model)  # ModelNotFound now, before anything listens
    check_onnx_options(onnx_provider, onnx_bits)  # UnknownProvider too
    if placement is not None:
        check_available(placement, machine())  # unknown, or needing a GPU: before anything listens
    vram = parse_bytes(vram_budget) if vram_budget is not None else None  # a bad size, before listening
    model_id, aliases = srv.model_names(model, path)
    budget: Optional[int] = ram_budget  # already parsed by the callback

    # Inconsistent options (e.g. --exact with --draft-tree) are refused here, before listening.
    engine_config = EngineConfig(model=model, n_ctx=ctx, n_threads=threads, n_gpu_layers=n_gpu_layers,
                                 draft=draft, draft_max=draft_max, draft_tree=draft_tree,
                                 draft_model=draft_model, max_queue=max_queue,
                                 onnx_provider=onnx_provider, onnx_bits=onnx_bits, placement=placement,
                                 vram_budget=vram, exact=exact, flash_attn=flash_attn)

    def load() -> Engine:
        engine = Engine(engine_config, store)
        if budget is not None:
            need = srv.engine_memory_bytes(engine)
            if need > budget:
                engine.close()
                raise BudgetExceeded(
                    f"{model_id} needs {format_bytes(need)} (weights + KV cache at --ctx {ctx}), over "
                    f"--ram-budget {format_bytes(budget)}: lower --ctx, pick a smaller model or raise the budget")
        return engine

    try:
        sock = srv.bind_socket(host, port)
    except OSError as exc:
        raise click_exc.ClickException(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    bound_port = sock.getsockname()[1]
    config = srv.ServerConfig(model_id=model_id, model_aliases=aliases, host=host, port=bound_port,
                              api_key=api_key or None, allowed_hosts=tuple(allow_host or ()))
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{bound_port}"
    typer.echo(f"edgespec: serving {model_id} on {url} (loading the model; /health says when ready)", err=True)
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        typer.echo(f"edgespec: warning: listening on {host} without --api-key", err=True)

    def ready() -> None:
        typer.echo(f"edgespec: ready: {url}/v1 (draft {draft}, queue up to {max_queue})", err=True)
        sys.stderr.flush()

    srv.serve(srv.ServerState(config), load, sock, on_ready=ready)
