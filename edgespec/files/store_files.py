"""File primitives of the model store: hashing, atomic writes, durable renames, deletion."""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

CHUNK_SIZE = 1 << 20  # 1 MiB: large enough for throughput, small enough for a smooth bar

# errno values of the failed cache writes already warned about: one warning per reason and
# process, since a read-only store fails every write of a run (calibration, then policy).
_WARNED: set[int | None] = set()


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
    """Writes ``text`` to ``path`` through a synced temporary file and a rename.

    Raises:
        OSError: the write failed; the temporary file is gone and ``path`` is unchanged.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        discard(tmp)
        raise


def write_or_keep(path: Path, text: str, what: str) -> bool:
    """Writes a cache file of the store (calibration, policy, stamp) atomically, or degrades.

    A read-only or full store must not stop a run: the failure is logged (a warning the first
    time per reason in this process, then at debug level) and the caller keeps its value in
    memory.

    Args:
        path: the file to write; its directory is created if needed.
        text: the whole content.
        what: what is kept in memory instead, for the warning (e.g. "the calibration").

    Returns:
        True when written, False when the store could not take it.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text)
        return True
    except OSError as exc:
        reason = f"{exc.strerror or exc}: {path}"  # exc.filename may be the temporary file
        if exc.errno in _WARNED:
            log.debug("cannot write %s (%s)", path, reason)
        else:
            _WARNED.add(exc.errno)
            log.warning("cannot write to the model store (%s): keeping %s in memory for this run",
                        reason, what)
        return False


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


def discard(path: Path) -> None:
    """Deletes a temporary file while handling another error: never raises (on a read-only
    file system unlink fails with EROFS even for a file that was never created)."""
    with contextlib.suppress(OSError):
        path.unlink()
