"""File primitives of the model store: hashing, atomic writes, durable renames, deletion."""
from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path
from typing import Callable

CHUNK_SIZE = 1 << 20  # 1 MiB: large enough for throughput, small enough for a smooth bar


def hash_file(path: Path, on_progress: Callable[[int], None] | None = None) -> str:
    """Returns the sha256 of a file, calling ``on_progress`` with the bytes hashed so far."""
    digest = hashlib.sha256()
    done = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK_SIZE):
            digest.update(chunk)
            done += len(chunk)
            if on_progress is not None:
                on_progress(done)
    return digest.hexdigest()


def atomic_write_text(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` through a synced temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        unlink(tmp)
        raise


def fsync_dir(directory: Path) -> None:
    # Makes the rename durable; not possible (nor needed) on every platform.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def unlink(path: Path) -> None:
    """Deletes a file if it exists."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
