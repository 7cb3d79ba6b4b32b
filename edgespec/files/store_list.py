"""The rows of the model store's listing: built-in models (pulled or not) and imported ones."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgespec.files.manifest import Manifest
from edgespec.files.store_import import ImportedModel


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
        present: whether the file is in the store and verified (its stamp matches, or a
            fresh sha256 does).
        description: a one-line description (for an imported model: where it came from).
        problem: why a file that is there cannot be used (corrupt, unreadable), with the fix;
            empty otherwise.
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
    problem: str = ""

    @property
    def state(self) -> str:
        """``present``, ``corrupt`` (there but unusable: see ``problem``) or ``missing``."""
        return "present" if self.present else "corrupt" if self.problem else "missing"

    def to_dict(self) -> dict[str, Any]:
        """Returns a JSON-ready dict of this entry."""
        return {
            "name": self.name, "kind": self.kind, "role": self.role, "family": self.family,
            "file": self.file, "path": str(self.path), "size": self.size,
            "present": self.present, "state": self.state, "problem": self.problem,
            "description": self.description,
        }


def builtin_entry(manifest: Manifest, path: Path, present: bool, problem: str = "") -> StoreEntry:
    """The row of a built-in model whose file is (or would be) at ``path``."""
    return StoreEntry(
        name=manifest.name, kind="builtin", role=manifest.role, family=manifest.family,
        file=manifest.file, path=path, size=manifest.size, present=present,
        description=manifest.description, problem=problem)


def imported_entry(imported: ImportedModel, path: Path, present: bool,
                   problem: str = "") -> StoreEntry:
    """The row of an imported model whose file is at ``path``."""
    return StoreEntry(
        name=imported.name, kind="imported", role=None, family=imported.family,
        file=imported.file, path=path, size=imported.size, present=present,
        description=f"imported from {imported.source}", problem=problem)
