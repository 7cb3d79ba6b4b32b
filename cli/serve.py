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
from edgespec.engine import Engine
from edgespec.files.store import ModelStore
from edgespec.load import resolve
from edgespec.memory.machine import machine


def _server():
    """The server module; its web framework is an optional dependency (the [server] extra)."""
    try:
        from edgespec.server import app
    except ImportError as exc:
        raise click_exc.ClickException(f"the server needs the [server] extra ({exc.name} is missing): "
                                       "pip install 'edgespec[server]'") from None
    return app


def _listen(srv, host: str, port: int):
    """The listening socket, or one line saying why it cannot be had."""
    try:
        return srv.bind_socket(host, port)
    except OSError as exc:
        raise click_exc.ClickException(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _api_key(ctx: typer.Context, key: str | None, path: str | None) -> str | None:
    """The key from --api-key, EDGESPEC_API_KEY or the first line of --api-key-file (only one);
    a file that is missing, unreadable or empty is a one-line usage error."""
    if path is None:
        return key or None
    if key:
        source = ctx.get_parameter_source("api_key")
        given = "EDGESPEC_API_KEY" if source is not None and source.name == "ENVIRONMENT" else "--api-key"
        raise click_exc.UsageError(f"{given} and --api-key-file both give a key: use one")
    try:
        with open(path, encoding="utf-8") as f:
            first = f.readline().strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise typer.BadParameter(f"cannot read {path}: {reason}", param_hint="--api-key-file") from None
    if not first:
        raise typer.BadParameter(f"{path}: the first line is empty", param_hint="--api-key-file")
    return first


@app.command()
def serve(
    cli_ctx: typer.Context,
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
                                          help="Require 'Authorization: Bearer KEY' on /v1/*. Visible in "
                                               "ps: prefer EDGESPEC_API_KEY or --api-key-file."),
    api_key_file: Optional[str] = typer.Option(None, "--api-key-file", metavar="PATH",
                                               help="Read the API key from the first line of PATH."),
    body_timeout: float = typer.Option(30.0, "--body-timeout", min=0.1, metavar="SECONDS",
                                       help="A request body must arrive within this; slower uploads get 408."),
    ram_budget: Optional[str] = c.RAM_BUDGET,
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
    srv = _server()
    api_key = _api_key(cli_ctx, api_key, api_key_file)
    # Bad options, a missing model, an unavailable placement or a budget nothing fits are
    # refused here, before anything listens.
    config = c.engine_config(model=model, ctx=ctx, threads=threads, n_gpu_layers=n_gpu_layers, draft=draft,
                             draft_max=draft_max, draft_tree=draft_tree, draft_model=draft_model,
                             max_queue=max_queue, onnx_provider=onnx_provider, onnx_bits=onnx_bits,
                             ram_budget=ram_budget, vram_budget=vram_budget, placement=placement,
                             exact=exact, flash_attn=flash_attn)
    store = ModelStore()
    plan = resolve(config, machine(), store)
    model_id, aliases = srv.model_names(model, plan.target_path)
    sock = _listen(srv, host, port)
    server = srv.ServerConfig(model_id=model_id, model_aliases=aliases, host=host, port=sock.getsockname()[1],
                              api_key=api_key, allowed_hosts=tuple(allow_host or ()),
                              body_timeout_s=body_timeout)
    url = _announce(server)
    srv.serve(srv.ServerState(server), lambda: Engine(config, store, plan), sock,
              on_ready=lambda: _say(f"edgespec: ready: {url}/v1 (draft {draft}, queue up to {max_queue})"))


def _say(line: str) -> None:
    typer.echo(line, err=True)
    sys.stderr.flush()


def _announce(server) -> str:
    """Says where the server listens (and warns when it is open without a key); returns its URL."""
    host = server.host
    url = f"http://{f'[{host}]' if ':' in host else host}:{server.port}"
    _say(f"edgespec: serving {server.model_id} on {url} (loading the model; /health says when ready)")
    if host not in ("127.0.0.1", "localhost", "::1") and not server.api_key:
        _say(f"edgespec: warning: listening on {host} without an API key")
    return url
