"""`edgespec models ...`: pull, list, inspect, import and remove models of the offline store.

Library errors propagate as :class:`edgespec.errors.EdgespecError`; ``edgespec.cli.main``
prints them as one ``error: ...`` line and exits with status 1. Progress and notes go to
stderr, results to stdout, and ``--json`` prints exactly one JSON document on stdout.
"""
from __future__ import annotations

import json
import sys
from typing import Any, Optional
from dataclasses import asdict

import typer
from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                           TimeRemainingColumn, TransferSpeedColumn)
from rich.table import Table

from edgespec.errors import IntegrityError, ModelNotFound, StoreError
from edgespec.files.clone import CloneShape, write_clone
from edgespec.files.gguf import model_info
from edgespec.onnx.convert import convert
from edgespec.cli import app
from edgespec.units import format_bytes
from edgespec.files.store import ModelStore
from edgespec.files.store_pull import (PHASE_ASSEMBLE, PHASE_DONE, PHASE_DOWNLOAD, PHASE_PRESENT,
                                       PHASE_VERIFY, PHASE_WAITING, PullEvent)

models_app = typer.Typer(
    help="Manage the offline model store: pull, list, verify, info, import, rm.",
    no_args_is_help=True,
)
app.add_typer(models_app, name="models")

# Results on stdout; progress bars and notes on stderr so that stdout stays parseable. When
# stdout is not a terminal, rich would wrap tables at 80 columns; give them their natural
# width instead, so that piped output keeps one row per line.
_out = Console(highlight=False, soft_wrap=True,
               width=None if sys.stdout.isatty() else 1000)
_err = Console(stderr=True, highlight=False)


def _store() -> ModelStore:
    return ModelStore()


def _human_count(count: int) -> str:
    for threshold, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= threshold:
            return f"{count / threshold:.2f}{suffix}"
    return str(count)


def _print_json(data: Any) -> None:
    # Plain stdout write: rich would wrap long lines and could add markup.
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


class _PullView:
    """Turns PullEvents into a rich progress bar on stderr, started on the first real work."""

    _LABELS = {
        PHASE_WAITING: "waiting for another pull",
        PHASE_VERIFY: "verifying",
        PHASE_DOWNLOAD: "fetching part {part}/{parts}",
        PHASE_ASSEMBLE: "assembling part {part}/{parts}",
        PHASE_DONE: "verified",
    }

    def __init__(self, console: Console):
        self.already_present = False
        self._task: Any = None
        self._progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
            TransferSpeedColumn(), TimeRemainingColumn(), console=console)

    def __call__(self, event: PullEvent) -> None:
        if event.phase == PHASE_PRESENT:
            self.already_present = True
            return
        label = self._LABELS.get(event.phase, event.phase).format(
            part=event.part, parts=event.parts)
        description = f"{event.name}: {label}"
        if self._task is None:
            self._progress.start()
            self._task = self._progress.add_task(description, total=event.total)
        self._progress.update(self._task, completed=event.done, description=description)

    def __enter__(self) -> "_PullView":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self._task is not None:
            self._progress.stop()


@models_app.command("pull")
def pull(
    names: list[str] = typer.Argument(..., help="Names of known models (see `edgespec models list`)."),
    force: bool = typer.Option(False, "--force", help="Fetch and verify again even if present."),
) -> None:
    """Download known models into the store and verify their size and sha256."""
    store = _store()
    for name in names:  # one process for all: a command starts in ~1 s
        with _PullView(_err) as view:
            path = store.pull(name, progress=view, force=force)
        if view.already_present:
            _out.print(f"{name} is already present: {path}")
        else:
            _out.print(f"pulled {name}: {path}")


@models_app.command("list")
def list_models(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """List known and imported models, and whether each is in the store (or corrupt)."""
    entries = _store().list()
    if as_json:
        _print_json([entry.to_dict() for entry in entries])
        return
    table = Table(title=None, show_lines=False)
    for column in ("name", "role", "family", "size", "present"):
        table.add_column(column, no_wrap=True)
    table.add_column("path", overflow="fold")
    for entry in entries:
        present = {"present": "yes", "missing": "no", "corrupt": "CORRUPT"}[entry.state]
        table.add_row(entry.name, entry.role or entry.kind, entry.family or "-",
                      format_bytes(entry.size), present, str(entry.path))
    _out.print(table)
    for entry in entries:
        if entry.problem:
            _err.print(f"{entry.name}: {entry.problem}", markup=False, soft_wrap=True)


@models_app.command("verify")
def verify(
    name: Optional[str] = typer.Argument(None, help="A model name (default: every model in the store)."),
) -> None:
    """Hash stored models now and compare with their pinned sha256 (exit 1 if one is corrupt)."""
    store = _store()
    if name is not None:
        path = store.verify(name)
        _out.print(f"ok {name}: {path}")
        return
    names = store.stored()
    corrupt = []
    for stored in names:
        try:
            path = store.verify(stored)
        except (IntegrityError, ModelNotFound, StoreError) as exc:
            corrupt.append(stored)
            _out.print(f"CORRUPT {stored}: {exc}", markup=False)
        else:
            _out.print(f"ok {stored}: {path}", markup=False)
    if corrupt:
        raise IntegrityError(f"{len(corrupt)} of {len(names)} stored models failed verification: "
                             f"{', '.join(corrupt)}")
    if not names:
        _err.print("no model in the store to verify")


@models_app.command("info")
def info(
    model: str = typer.Argument(..., help="A model name or a path to a GGUF file."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """Show what a GGUF model is: architecture, size, quantization, tokenizer."""
    path = _store().resolve(model)
    data = dict(model_info(path).to_dict())
    data.setdefault("path", str(path))
    if as_json:
        _print_json(data)
        return
    table = Table(show_header=False, box=None, padding=(0, 2, 0, 0))
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for key, value in data.items():
        table.add_row(key, _format_info_value(key, value))
    _out.print(table)


def _format_info_value(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, int):
        return str(value)
    if key == "file_size":
        return f"{format_bytes(value)} ({value:,} bytes)"
    if key == "parameters":
        return f"{_human_count(value)} ({value:,})"
    return f"{value:,}"


@models_app.command("import")
def import_model(
    path: str = typer.Argument(..., help="A GGUF file of your own."),
    name: Optional[str] = typer.Option(None, "--name", help="Store name (default: file stem)."),
    force: bool = typer.Option(False, "--force", help="Replace an imported model of that name."),
) -> None:
    """Add your own GGUF file to the store under a name."""
    dest = _store().import_model(path, name=name, force=force)
    _out.print(f"imported {dest.stem}: {dest}")


@models_app.command("rm")
def remove(
    name: str = typer.Argument(..., help="A model name (built-in or imported)."),
) -> None:
    """Delete a model's file from the store, and the ONNX drafters converted from it."""
    store = _store()
    conversions = store.onnx_conversions(name)
    path = store.remove(name)
    _out.print(f"removed {name}: {path}")
    for directory in conversions:
        _out.print(f"removed ONNX drafter of {name}: {directory}")


@models_app.command("clone")
def clone(
    src: str = typer.Argument(..., help="A model name, a GGUF file or a header-only file."),
    out: str = typer.Option(..., "--out", help="Path of the clone to write."),
    layers: Optional[int] = typer.Option(None, "--layers", help="Blocks (default: SRC's)."),
    hidden: Optional[int] = typer.Option(None, "--hidden", help="Embedding width."),
    ffn: Optional[int] = typer.Option(None, "--ffn", help="Feed-forward width."),
    heads: Optional[int] = typer.Option(None, "--heads", help="Attention heads."),
    kv_heads: Optional[int] = typer.Option(None, "--kv-heads", help="Key/value heads."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random weights."),
    header_only: bool = typer.Option(False, "--header-only",
                                     help="Write only the header (a few MB) to clone from elsewhere."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """Write a shape clone: SRC's metadata, tokenizer, tensor names, shapes and types, random weights."""
    result = write_clone(_store().resolve(src), out, CloneShape(layers, hidden, ffn, heads, kv_heads),
                         seed=seed, header_only=header_only)
    if as_json:
        _print_json(asdict(result))
        return
    kind = "header of a clone" if header_only else "clone"
    _out.print(f"wrote {kind} {result.path}: {result.tensors} tensors, "
               f"{format_bytes(result.file_size)}, shape {result.shape}")


@models_app.command("convert-onnx")
def convert_onnx(
    model: str = typer.Argument(..., help="A model name or a path to a GGUF file."),
    bits: str = typer.Option("exact", "--bits",
                             help="exact: every GGUF block as it is; 4: 8-bit blocks requantized to 4 bits."),
    force: bool = typer.Option(False, "--force", help="Convert again even if a current conversion exists."),
) -> None:
    """Convert a GGUF drafter to an ONNX graph for onnxruntime, next to it in the store."""
    path = convert(_store(), model, bits=bits, force=force)
    _out.print(f"onnx drafter of {model} ({bits}): {path}")
