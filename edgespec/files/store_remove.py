"""Removing models from the store, under the locks that pulls and ONNX conversions take."""
from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Iterator

from edgespec.errors import ModelNotFound, StoreError
from edgespec.files.manifest import Manifest
from edgespec.files.store_files import unlink
from edgespec.files.store_pull import stamp_path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks, removals are not serialized
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

ONNX_DIR_SUFFIX = ".onnx"  # edgespec.onnx.convert writes <gguf stem>.<bits>.onnx/ next to the GGUF


def converted_onnx_dirs(gguf: Path) -> list[Path]:
    """The ONNX conversions of ``gguf`` next to it: directories ``<stem>.<bits>.onnx`` (``bits``
    without a dot, so another model whose stem extends this one is never matched)."""
    prefix = gguf.stem + "."
    try:
        entries = list(gguf.parent.iterdir())
    except OSError:
        return []
    out = []
    for entry in entries:
        bits = entry.name[len(prefix):-len(ONNX_DIR_SUFFIX)]
        if (entry.name.startswith(prefix) and entry.name.endswith(ONNX_DIR_SUFFIX) and bits
                and "." not in bits and entry.is_dir() and not entry.is_symlink()):
            out.append(entry)
    return sorted(out)


@contextlib.contextmanager
def conversions_locked(name: str, conversions: list[Path],
                       tmp_dir: Path) -> Iterator[list[Path]]:
    """Yields the model's ONNX conversions while holding their conversion locks (the ones
    edgespec.onnx.convert takes); StoreError when one is being converted right now."""
    fds: list[int] = []
    try:
        if fcntl is not None and conversions:
            tmp_dir.mkdir(parents=True, exist_ok=True)
            for directory in conversions:
                fd = os.open(tmp_dir / f"{directory.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
                fds.append(fd)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise StoreError(f"'{name}' is being converted to ONNX ({directory.name}); "
                                     f"try again when it has finished") from None
        yield conversions
    finally:
        for fd in fds:
            os.close(fd)


def remove_builtin(manifest: Manifest, models_dir: Path, tmp_dir: Path) -> Path:
    """Deletes a built-in model's file and stamp unless a pull of it holds the pull lock."""
    final = models_dir / manifest.file
    if not final.exists():
        raise ModelNotFound(f"model '{manifest.name}' is not in the store; nothing to remove")
    tmp_dir.mkdir(parents=True, exist_ok=True)
    if fcntl is not None:
        fd = os.open(tmp_dir / f"{manifest.file}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StoreError(f"a pull of '{manifest.name}' is running; "
                                 f"try again when it has finished") from None
            unlink(final)
            unlink(stamp_path(final))
        finally:
            os.close(fd)
    else:  # pragma: no cover
        unlink(final)
        unlink(stamp_path(final))
    log.info("removed %s", final)
    return final
