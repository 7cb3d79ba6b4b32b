"""Importing a user's own GGUF file into the model store: its name, its bytes, its record."""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgespec.errors import StoreError
from edgespec.files.store_files import discard, hash_file, unlink

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")


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


def read_imported(meta_path: Path) -> ImportedModel:
    """Reads ``imported/<name>.json``; StoreError if it cannot be read."""
    try:
        data = json.loads(meta_path.read_text(encoding="utf-8"))
        return ImportedModel(**data)
    except (OSError, ValueError, TypeError) as exc:
        raise StoreError(f"{meta_path}: unreadable imported-model manifest ({exc})") from exc


def import_name(name: str | None, source: Path) -> str:
    """The store name for an import: ``name``, else the file's stem; StoreError if invalid."""
    if name is None:
        # "SmolLM2 135M.Q4_1.gguf" -> "smollm2-135m.q4_1"
        name = re.sub(r"[^a-z0-9._-]+", "-", source.stem.lower()).strip("-._")
    if not NAME_RE.match(name):
        raise StoreError(f"invalid model name {name!r}: use lowercase letters, digits, "
                         f"'.', '_' or '-' (pick one with --name)")
    return name


def place_file(source: Path, dest: Path, tmp_dir: Path) -> str:
    """Links or copies ``source`` to ``dest`` atomically; returns the sha256 of the bytes."""
    tmp = tmp_dir / f"{dest.name}.{os.getpid()}.importing"
    try:
        unlink(tmp)
        try:
            os.link(source, tmp)
        except OSError as exc:
            # Another filesystem, or one without hard links: copy instead.
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP,
                                 errno.EACCES):
                raise
            shutil.copyfile(source, tmp)
        sha256 = hash_file(tmp)
        os.replace(tmp, dest)
    except BaseException:
        discard(tmp)
        raise
    return sha256
