"""`edgespec models convert-onnx`: a GGUF drafter -> an ONNX drafter directory in the store.

A converted model is a directory next to its GGUF (``<stem>.<bits>.onnx/``; for a GGUF outside
the store, under ``onnx/`` of the store) holding ``model.onnx``, ``weights.bin`` and
``edgespec.json``: the converter version, the bits, the graph's shape, and the source's size,
mtime and tokenizer fingerprint, so the vocabulary check against a target still applies and a
changed source is noticed. The directory is built under ``tmp/`` and renamed into place only
when complete: an interrupted conversion leaves nothing behind but a partial directory that the
next conversion removes.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

from edgespec.errors import InvalidRequest, StoreError
from edgespec.files.gguf import GGUFFile, read_gguf, tokenizer_fingerprint
from edgespec.files.store import ModelStore
from edgespec.onnx.providers import BITS

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: conversions are not serialized
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

CONVERTER_VERSION = 1
META = "edgespec.json"


def onnx_dir_for(store: ModelStore, gguf: Path, bits: str) -> Path:
    """Where the conversion of ``gguf`` with ``bits`` lives (it may not exist)."""
    gguf = gguf.resolve()
    home = store.home.resolve()
    parent = gguf.parent if home in gguf.parents else home / "onnx"
    return parent / f"{gguf.stem}.{bits}.onnx"


def _source_meta(g: GGUFFile) -> dict:
    st = os.stat(g.path)
    return {"path": str(Path(g.path).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "tokenizer_fingerprint": tokenizer_fingerprint(g)}


def read_meta(directory: Path) -> dict | None:
    """The converted model's edgespec.json, or None when absent or unreadable."""
    try:
        return json.loads((directory / META).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def is_current(directory: Path, g: GGUFFile, bits: str) -> bool:
    """Whether ``directory`` holds a complete conversion of exactly this source and bits."""
    meta = read_meta(directory)
    return (meta is not None and meta.get("version") == CONVERTER_VERSION and meta.get("bits") == bits
            and meta.get("source") == _source_meta(g)
            and all((directory / f).is_file() for f in ("model.onnx", "weights.bin")))


@contextlib.contextmanager
def _locked(store: ModelStore, name: str):
    store.tmp_dir.mkdir(parents=True, exist_ok=True)
    with open(store.tmp_dir / f"{name}.lock", "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def convert(store: ModelStore, model: str | os.PathLike, bits: str = "exact",
            force: bool = False) -> Path:
    """Converts a GGUF model (name or path) to an ONNX drafter; returns its directory.

    Idempotent: a current conversion is returned as it is unless ``force``.

    Raises:
        InvalidRequest: ``bits`` is not one of BITS.
        ModelNotFound / InvalidGGUF: the source cannot be found or read.
        UnsupportedModel: its architecture or a tensor format cannot be converted.
        StoreError: the `onnx` package is missing (it is the `onnx` extra).
    """
    if bits not in BITS:
        raise InvalidRequest(f"--bits must be one of {', '.join(BITS)}, not {bits!r}")
    g = read_gguf(store.resolve(model))
    try:
        from edgespec.onnx.graph import ModelShape, write_graph
    except ImportError as exc:
        raise StoreError("converting to ONNX needs the onnx package: "
                         "pip install 'edgespec[onnx]'") from exc
    shape = ModelShape.from_gguf(g)  # refuses an unsupported architecture before any work
    final = onnx_dir_for(store, Path(g.path), bits)
    with _locked(store, final.name):
        if not force and is_current(final, g, bits):
            log.info("%s is already converted: %s", g.path, final)
            return final
        _discard_partials(store, final.name)
        partial = store.tmp_dir / f"{final.name}.{os.getpid()}.partial"
        partial.mkdir(parents=True)
        try:
            start = time.perf_counter()
            write_graph(g, partial, bits)
            meta = {"version": CONVERTER_VERSION, "bits": bits, "shape": shape.to_dict(),
                    "source": _source_meta(g)}
            (partial / META).write_text(json.dumps(meta, indent=2), encoding="utf-8")
            _replace_dir(partial, final)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    log.info("converted %s to %s in %.1f s", g.path, final, time.perf_counter() - start)
    return final


def _discard_partials(store: ModelStore, name: str) -> None:
    for stale in store.tmp_dir.glob(f"{name}.*.partial"):
        shutil.rmtree(stale, ignore_errors=True)


def _replace_dir(partial: Path, final: Path) -> None:
    """Renames ``partial`` to ``final``; an old ``final`` is moved aside first, then removed."""
    final.parent.mkdir(parents=True, exist_ok=True)
    old = None
    if final.exists():
        old = partial.with_name(partial.name + ".old")
        os.rename(final, old)
    os.rename(partial, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
