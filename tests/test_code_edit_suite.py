"""The checked-in ``code-edit`` suites (edgespec/bench/suites/code-edit*.jsonl) are well formed.

They are made by benchmarks/make_code_edit.py from real source files of installed packages; these
tests check the files themselves: shape, categories, valid code, meaningful edit targets, sizes that
fit the benchmark's 4096-token context, and (where the same versions are installed) that each
piece of code really is what the recorded package file contains.
"""
from __future__ import annotations

import ast
import collections
import importlib.metadata as md
import io
import json
import re
import tokenize
from pathlib import Path

import pytest

from edgespec.bench.prompts import SUITES as FILES

SUITES = {"code-edit-": FILES["code-edit"], "code-edit-v": FILES["code-edit-validation"],
          "code-edit-t": FILES["code-edit-test"]}
CATEGORIES = ("type-hints", "rename", "docstrings", "dataclass")
MAX_PROMPT_CHARS = 6000
MAX_PROMPT_TOKENS = 2000
PERMISSIVE = {"MIT", "BSD", "BSD-2-Clause", "BSD-3-Clause", "0BSD", "Apache-2.0", "ISC", "Zlib",
              "CC0-1.0", "PSF-2.0", "MIT-CMU"}
_CODE_RE = re.compile(r"\n\n```python\n(.*)\n```\Z", re.DOTALL)
_RENAME_RE = re.compile(r"^Rename the identifier `(\w+)` to `(\w+)` ")
_CLASS_RE = re.compile(r"^Convert the class `(\w+)` ")


@pytest.fixture(scope="module", params=list(SUITES), ids=["tuning", "validation", "test"])
def prefix(request) -> str:
    """Each suite: tuning, validation and test (three sets of packages), by id prefix."""
    return request.param


@pytest.fixture(scope="module")
def records(prefix) -> list[dict]:
    return [json.loads(line) for line in SUITES[prefix].read_text(encoding="utf-8").splitlines()]


def _split(rec: dict) -> tuple[str, str]:
    """The prompt's instruction and its code block."""
    text = rec["turns"][0]
    m = _CODE_RE.search(text)
    assert m, f"{rec['id']}: no ```python block at the end of the prompt"
    return text[:m.start()], m.group(1)


def _name_counts(code: str) -> collections.Counter:
    return collections.Counter(t.string for t in tokenize.generate_tokens(io.StringIO(code).readline)
                               if t.type == tokenize.NAME)


def test_every_line_is_a_request_object(records, prefix):
    assert SUITES[prefix].read_text(encoding="utf-8").endswith("\n")
    for rec in records:
        assert isinstance(rec, dict)
        assert isinstance(rec["id"], str) and isinstance(rec["category"], str)
        # The harness format: a list of user turns (the first goes through the chat template).
        assert "prompt" not in rec
        assert isinstance(rec["turns"], list) and len(rec["turns"]) == 1
        assert isinstance(rec["turns"][0], str) and rec["turns"][0].strip()
        src = rec["source"]
        assert set(src) == {"package", "version", "path", "object", "license"}
        assert src["package"] and src["version"] and src["path"].endswith(".py")
        assert src["object"] is None or src["object"].isidentifier()


def test_size_and_categories(records, prefix):
    assert len(records) >= 30
    counts = collections.Counter(r["category"] for r in records)
    assert set(counts) == set(CATEGORIES), counts
    # The test suite's packages hold six classes fit for a dataclass conversion: enough for the
    # --limit 4 it is run with.
    least = 4 if prefix == "code-edit-t" else 8
    for cat in CATEGORIES:
        assert counts[cat] >= least, (cat, counts[cat])


def test_ids_are_unique_and_numbered(records, prefix):
    ids = [r["id"] for r in records]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(re.escape(prefix) + r"\d{3}", i) for i in ids)


def test_each_piece_of_code_is_used_once(records):
    keys = [(r["source"]["package"], r["source"]["path"], r["source"]["object"]) for r in records]
    assert len(set(keys)) == len(keys)


def test_code_blocks_are_valid_python(records):
    for rec in records:
        instruction, code = _split(rec)
        ast.parse(code)  # raises SyntaxError with the position on failure
        assert 40 <= code.count("\n") + 1 <= 160, rec["id"]
        assert "Return the full modified code and nothing else." in instruction


def test_rename_targets_occur_at_least_three_times(records):
    renames = [r for r in records if r["category"] == "rename"]
    assert renames
    for rec in renames:
        instruction, code = _split(rec)
        m = _RENAME_RE.match(instruction)
        assert m, rec["id"]
        old, new = m.groups()
        assert rec["rename"] == {"from": old, "to": new}
        counts = _name_counts(code)
        assert counts[old] >= 3, (rec["id"], old, counts[old])
        assert counts[new] == 0, (rec["id"], new)   # the new name must not clash
        assert new.isidentifier() and new != old


def test_dataclass_targets_exist_with_an_init(records):
    conversions = [r for r in records if r["category"] == "dataclass"]
    assert conversions
    for rec in conversions:
        instruction, code = _split(rec)
        m = _CLASS_RE.match(instruction)
        assert m, rec["id"]
        name = m.group(1)
        assert rec["class"] == name
        classes = {n.name: n for n in ast.parse(code).body if isinstance(n, ast.ClassDef)}
        assert name in classes, (rec["id"], name)
        assert any(isinstance(s, ast.FunctionDef) and s.name == "__init__"
                   for s in classes[name].body), (rec["id"], name)


def test_prompts_fit_in_characters(records):
    for rec in records:
        assert len(rec["turns"][0]) <= MAX_PROMPT_CHARS, (rec["id"], len(rec["turns"][0]))


def test_sources_are_permissive_site_packages(records):
    for rec in records:
        src = rec["source"]
        ids = [t for t in re.split(r"[\s()]+", src["license"]) if t and t not in ("AND", "OR")]
        assert ids and all(t in PERMISSIVE for t in ids), (rec["id"], src["license"])


def test_code_matches_the_installed_package_file(records):
    """Provenance: where the recorded version is installed, the code is cut from that file."""
    checked = 0
    for rec in records:
        src = rec["source"]
        try:
            dist = md.distribution(src["package"])
        except md.PackageNotFoundError:
            continue
        if dist.version != src["version"]:
            continue
        text = Path(dist.locate_file(src["path"])).read_text(encoding="utf-8")
        _, code = _split(rec)
        assert code in text, (rec["id"], src["path"])
        if src["object"] is not None:
            names = {n.name for n in ast.parse(text).body
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
            assert src["object"] in names, rec["id"]
            top = ast.parse(code).body
            assert len(top) == 1 and top[0].name == src["object"], rec["id"]
        checked += 1
    if not checked:
        pytest.skip("none of the recorded package versions is installed")


@pytest.fixture(scope="module")
def qwen():
    from edgespec.llama.backend import LlamaModel, ModelParams
    from edgespec.errors import ModelNotFound
    from edgespec.files.store import ModelStore
    try:
        path = ModelStore().resolve("qwen2.5-coder-1.5b")
    except ModelNotFound as exc:
        pytest.skip(f"Qwen tokenizer unavailable: {exc}")
    return LlamaModel(path, ModelParams(repack=False))  # only its tokenizer is used: no repacked copy


def test_prompts_fit_in_qwen_tokens(records, qwen):
    for rec in records:
        n = len(qwen.tokenize(rec["turns"][0], add_special=False))
        assert n <= MAX_PROMPT_TOKENS, (rec["id"], n)
