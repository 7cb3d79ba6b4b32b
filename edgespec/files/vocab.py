"""Can a drafter speak for a target? The vocabulary check, on GGUF metadata alone.

Mirrors llama.cpp's speculative compatibility rule: same tokenizer type, same BOS/EOS ids
and add-BOS behaviour, vocabulary sizes within 128, and identical token texts from id 5 on
(the first few ids are control tokens that differ harmlessly between exports).
"""
from __future__ import annotations

from edgespec.errors import IncompatibleModels
from edgespec.files.gguf import GGUFFile

MAX_SIZE_DIFFERENCE = 128
CHECK_START_ID = 5


def _meta(g: GGUFFile, key: str):
    return g.metadata.get(key)


def check_compatible(target: GGUFFile, drafter: GGUFFile) -> None:
    """Raises IncompatibleModels naming the first mismatch; returns None when compatible."""
    def fail(what: str) -> None:
        raise IncompatibleModels(f"drafter {drafter.path} cannot draft for {target.path}: {what}")

    for key, label in (("tokenizer.ggml.model", "tokenizer type"),
                       ("tokenizer.ggml.bos_token_id", "BOS token id"),
                       ("tokenizer.ggml.eos_token_id", "EOS token id"),
                       ("tokenizer.ggml.add_bos_token", "add-BOS setting")):
        a, b = _meta(target, key), _meta(drafter, key)
        if a != b:
            fail(f"{label} differs ({a!r} vs {b!r})")
    ta = _meta(target, "tokenizer.ggml.tokens") or []
    tb = _meta(drafter, "tokenizer.ggml.tokens") or []
    if not ta or not tb:
        fail("a vocabulary is missing")
    if abs(len(ta) - len(tb)) > MAX_SIZE_DIFFERENCE:
        fail(f"vocabulary sizes differ by more than {MAX_SIZE_DIFFERENCE} ({len(ta)} vs {len(tb)})")
    for i in range(CHECK_START_ID, min(len(ta), len(tb))):
        if ta[i] != tb[i]:
            fail(f"token {i} differs ({ta[i]!r} vs {tb[i]!r})")
