"""A pure-Python reader and validator of GGUF model files.

llama.cpp trusts much of a GGUF header: a corrupt or hostile file can make it abort, allocate
gigabytes or read past a mapping.  Before any file reaches llama.cpp, :func:`read_gguf` parses
the header here, in bounded Python: every count and length is checked against the bytes left in
the file *before* anything is allocated or looped over, so a bad file costs a few microseconds
and a few kilobytes, and ends in one :class:`~edgespec.errors.InvalidGGUF` whose message names
the file and the exact problem.  The bounded reads live in :mod:`edgespec.files.gguf_reader`,
the checks of the file's layout in :mod:`edgespec.files.gguf_structure`, the hyperparameter
bounds llama.cpp asserts on (layer, expert and head counts) in :mod:`edgespec.files.gguf_hparams`.
Every path to llama.cpp (run, --draft-model, serve, plan, models info, import) reads the file
through :func:`read_gguf`, so the checks cannot be skipped.

:func:`model_info` summarises a validated file (architecture, size, quantisation, tokenizer),
and :func:`tokenizer_fingerprint` gives a short hash that is equal for two models exactly when
their vocabularies are, which speculative decoding needs of a draft and a target model.
"""
from __future__ import annotations

import collections
import hashlib
import logging
import os
from dataclasses import asdict, dataclass
from typing import Any, Callable

from edgespec.errors import InvalidGGUF
from edgespec.files.gguf_hparams import check_hparams
from edgespec.files.gguf_reader import Reader, mapped
from edgespec.files.gguf_structure import (
    GGML_TYPES,
    TensorInfo,
    check_packed,
    parse_infos,
    place_tensors,
)

log = logging.getLogger(__name__)

#: llama.cpp's llama_ftype (the `general.file_type` key) -> the usual quantisation name.
LLAMA_FTYPES: dict[int, str] = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    4: "Q4_1_SOME_F16",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    19: "IQ2_XXS",
    20: "IQ2_XS",
    21: "Q2_K_S",
    22: "IQ3_XS",
    23: "IQ3_XXS",
    24: "IQ1_S",
    25: "IQ4_NL",
    26: "IQ3_S",
    27: "IQ3_M",
    28: "IQ2_S",
    29: "IQ2_M",
    30: "IQ4_XS",
    31: "IQ1_M",
    32: "BF16",
    36: "TQ1_0",
    37: "TQ2_0",
    38: "MXFP4_MOE",
    39: "NVFP4",
    40: "Q1_0",
    41: "Q2_0",
}
_LLAMA_FTYPE_GUESSED = 1024


@dataclass(frozen=True)
class GGUFFile:
    """A parsed and validated GGUF header."""

    path: str
    version: int
    alignment: int
    data_offset: int  # absolute offset of the tensor data section
    file_size: int
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]


def _parse(r: Reader) -> GGUFFile:
    """Parse a whole header from the reader; raise InvalidGGUF on the first problem."""
    version, metadata, alignment, raw, data_offset = parse_infos(r)
    if data_offset > r.size:
        r.fail(f"data section starts at offset {data_offset}, past the end of the file "
               f"({r.size} bytes)")
    tensors = place_tensors(r, raw, data_offset, alignment)
    check_hparams(r.path, metadata)
    return GGUFFile(r.path, version, alignment, data_offset, r.size, metadata, tensors)


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse and validate the header of the GGUF file at ``path``.

    Raises InvalidGGUF(path, problem) for anything wrong, including a missing or unreadable
    path or a directory, and hyperparameters llama.cpp would abort the process on.  The tensor data is not read, only checked to lie within the file.
    """
    path = os.fspath(path)
    with mapped(path) as r:
        g = _parse(r)
    log.debug("read %s: GGUF v%d, %d keys, %d tensors", path, g.version, len(g.metadata),
              len(g.tensors))
    return g


@dataclass(frozen=True)
class GGUFHeader:
    """A GGUF file's header read without its tensor data (enough to rebuild the file's shape).

    ``raw_kv`` holds each key-value pair's exact encoding (key, type, value), so a writer can
    copy metadata byte for byte whatever its value types.  Tensor offsets are absolute, as if
    the data section followed the header; a file cut after the header has none of that data.
    """

    path: str
    version: int
    alignment: int
    data_offset: int
    metadata: dict[str, Any]
    raw_kv: dict[str, bytes]
    tensors: tuple[TensorInfo, ...]


def read_gguf_header(path: str | os.PathLike) -> GGUFHeader:
    """Parse and check a GGUF header; the tensor data may be absent (a header-only file).

    Everything :func:`read_gguf` checks is checked except that the data lies in the file.
    Raises InvalidGGUF.
    """
    path = os.fspath(path)
    with mapped(path) as r:
        spans: dict[str, tuple[int, int]] = {}
        version, metadata, alignment, raw, data_offset = parse_infos(r, spans)
        check_packed(r, raw, alignment)
        check_hparams(r.path, metadata)
        raw_kv = {k: r.buf[a:b] for k, (a, b) in spans.items()}
    tensors = tuple(TensorInfo(t.name, t.shape, t.ggml_type, GGML_TYPES[t.ggml_type][0],
                               data_offset + t.rel_offset, t.nbytes) for t in raw)
    return GGUFHeader(path, version, alignment, data_offset, metadata, raw_kv, tensors)


@dataclass(frozen=True)
class ModelInfo:
    """What a user or a scheduler wants to know of a model file, without loading it."""

    path: str
    architecture: str
    name: str | None
    parameters: int
    quantization: str
    context_length: int | None
    vocab_size: int
    tokenizer_model: str | None
    tokenizer_fingerprint: str
    n_layers: int | None
    embedding_length: int | None
    head_count: int | None
    head_count_kv: int | None
    file_size: int
    chat_template: str | None

    def to_dict(self) -> dict:
        """JSON-ready fields; the chat template is replaced by ``has_chat_template``."""
        d = asdict(self)
        d["has_chat_template"] = d.pop("chat_template") is not None
        return d


def tokenizer_fingerprint(g: GGUFFile) -> str:
    """A 16-hex-digit hash of the tokenizer model and the exact bytes of every token.

    Two models can share speculative drafts only when their fingerprints are equal.
    """
    model = g.metadata.get("tokenizer.ggml.model")
    tokens = g.metadata.get("tokenizer.ggml.tokens") or []
    h = hashlib.sha256()
    h.update((model if isinstance(model, str) else "").encode("utf-8") + b"\n")
    # Tokens were decoded with surrogateescape: encoding the same way restores their bytes.
    h.update(b"\0".join(t.encode("utf-8", "surrogateescape") for t in tokens))
    return h.hexdigest()[:16]


def _quantization(g: GGUFFile) -> str:
    """The llama_ftype name of `general.file_type`, else the tensor type holding most bytes."""
    ftype = g.metadata.get("general.file_type")
    if isinstance(ftype, int) and not isinstance(ftype, bool):
        name = LLAMA_FTYPES.get(ftype & ~_LLAMA_FTYPE_GUESSED)
        if name is not None:
            return name
    by_type: collections.Counter[str] = collections.Counter()
    for t in g.tensors:
        by_type[t.type_name] += t.nbytes
    return by_type.most_common(1)[0][0] if by_type else "unknown"


def _int_or_none(value: Any) -> int | None:
    """An integer metadata value; per-layer arrays (some models vary heads by layer) give their max."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return max(value)
    return None


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def model_info(path: str | os.PathLike) -> ModelInfo:
    """Validate the file at ``path`` and summarise it; raises InvalidGGUF."""
    g = read_gguf(path)
    return info_from_gguf(g)


def info_from_gguf(g: GGUFFile) -> ModelInfo:
    """Summarise an already validated GGUFFile."""
    md = g.metadata
    arch = md.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise InvalidGGUF(g.path, "missing general.architecture (not a model file?)")
    key: Callable[[str], Any] = lambda suffix: md.get(f"{arch}.{suffix}")  # noqa: E731
    tokens = md.get("tokenizer.ggml.tokens")
    return ModelInfo(
        path=g.path,
        architecture=arch,
        name=_str_or_none(md.get("general.name")),
        parameters=sum(t.n_elements for t in g.tensors),
        quantization=_quantization(g),
        context_length=_int_or_none(key("context_length")),
        vocab_size=len(tokens) if isinstance(tokens, list) else 0,
        tokenizer_model=_str_or_none(md.get("tokenizer.ggml.model")),
        tokenizer_fingerprint=tokenizer_fingerprint(g),
        n_layers=_int_or_none(key("block_count")),
        embedding_length=_int_or_none(key("embedding_length")),
        head_count=_int_or_none(key("attention.head_count")),
        head_count_kv=_int_or_none(key("attention.head_count_kv")),
        file_size=g.file_size,
        chat_template=_str_or_none(md.get("tokenizer.chat_template")),
    )
