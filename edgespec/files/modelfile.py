"""A model file read once per process: its validated GGUF, info and tokenizer fingerprint,
cached by (real path, size, mtime) so that building an engine — load plan, backend, drafters
and vocabulary check all need the same facts — parses each file once."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

from edgespec.files.gguf import GGUFFile, ModelInfo, info_from_gguf, read_gguf, tokenizer_fingerprint


@dataclass(frozen=True, eq=False)
class ModelFile:
    path: Path
    gguf: GGUFFile

    @functools.cached_property
    def info(self) -> ModelInfo:
        return info_from_gguf(self.gguf)

    @functools.cached_property
    def fingerprint(self) -> str:
        return tokenizer_fingerprint(self.gguf)


def model_file(path: str | os.PathLike) -> ModelFile:
    """The validated model file at ``path``; raises InvalidGGUF (or OSError) like read_gguf."""
    real = os.path.realpath(path)
    st = os.stat(real)
    return _cached(real, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _cached(real: str, size: int, mtime_ns: int) -> ModelFile:
    return ModelFile(Path(real), read_gguf(real))
