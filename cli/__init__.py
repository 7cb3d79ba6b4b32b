"""The `edgespec` command: a thin typer layer over the library.

Each verb lives in its own module and registers itself on ``app``; this file only wires them
and turns every failure into one line on stderr with a meaningful exit code:
1 for a library error (bad model, bad request), 2 for bad usage, 130 for Ctrl-C.
"""
from __future__ import annotations

import importlib
import logging
import os
import sys

import typer

try:  # typer >= 0.2x vendors click; older releases depend on it
    from typer._click import exceptions as click_exc
except ImportError:  # pragma: no cover
    from click import exceptions as click_exc

from edgespec.errors import EdgespecError

app = typer.Typer(
    name="edgespec",
    help="On-device speculative decoding for GGUF models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


# The verbs, one module each, imported for its side effect of adding its command to `app`. A
# command imports only its own verb's module: all seven cost 0.6 s of imports, one 0.4-0.5 s.
VERBS = ("bench", "chat", "doctor", "models", "plan", "run", "serve")


@app.callback()
def _app() -> None:
    """Keeps `app` a group of commands when only one verb is registered."""


def _register(args: list[str]) -> None:
    for verb in args[:1] if args and args[0] in VERBS else VERBS:
        importlib.import_module(f"edgespec.cli.{verb}")


def _fail(message: str, code: int) -> None:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    level = os.environ.get("EDGESPEC_LOG", "WARNING").upper()
    logging.basicConfig(level=getattr(logging, level, logging.WARNING), format="edgespec: %(message)s")
    args = sys.argv[1:] if argv is None else argv
    try:
        _register(args)  # inside the try: a Ctrl-C during the imports must not print a traceback
        rv = app(args=args, prog_name="edgespec", standalone_mode=False)
    except click_exc.NoArgsIsHelpError:
        sys.exit(0)  # typer has already printed the help
    except click_exc.UsageError as exc:
        hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx else ""
        _fail(exc.format_message().replace("\n", " ") + hint, 2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except click_exc.ClickException as exc:
        _fail(exc.format_message(), exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        typer.echo("", err=True)
        sys.exit(130)
    except EdgespecError as exc:
        _fail(str(exc), 1)
    sys.exit(rv if isinstance(rv, int) else 0)
