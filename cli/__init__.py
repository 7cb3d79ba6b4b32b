"""The `edgespec` command: a thin typer layer over the library.

Each verb lives in its own module and registers itself on ``app``; this file only wires them
and turns library errors into one-line messages with a non-zero exit code.
"""
from __future__ import annotations

import logging
import sys

import typer

from edgespec.errors import EdgespecError

app = typer.Typer(
    name="edgespec",
    help="On-device speculative decoding for GGUF models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register() -> None:
    # Imported for their side effect of adding commands to `app`.
    from edgespec.cli import chat, doctor, models, run  # noqa: F401


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    logging.basicConfig(level=logging.WARNING, format="edgespec: %(message)s")
    _register()
    try:
        app(args=argv, standalone_mode=True)
    except EdgespecError as exc:
        typer.secho(f"error: {exc}", err=True, fg=typer.colors.RED)
        sys.exit(1)
