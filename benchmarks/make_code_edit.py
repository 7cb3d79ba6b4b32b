"""Builds the ``code-edit`` benchmark suite: ``edgespec/bench/suites/code-edit.jsonl``.

Every request asks the model to edit real Python code and answer with the full modified code,
the workload where drafting from the prompt (suffix index) and from a small model pays most.
The code comes from open-source packages installed in this virtual environment (never from the
standard library): whole self-contained modules, or single top-level functions or classes cut
out with ``ast``, each 40-160 lines and at most ``MAX_CODE_CHARS`` characters, so that a prompt
stays under ~1800 Qwen tokens and the full answer roughly fits 1024 new tokens of a 4096-token
context.

Four categories, ``PER_CATEGORY`` requests each:

* ``type-hints``  code whose functions carry (almost) no annotations;
* ``rename``      identifier X bound in the code (local, parameter, ``self.X`` attribute or
                  function defined there) that occurs >= 3 times as a name, renamed to Y, a
                  sensible new name built from a fixed word table; Y occurs nowhere in the code;
* ``docstrings``  code whose functions and classes (almost) all lack docstrings;
* ``dataclass``   a class whose ``__init__`` mostly does ``self.x = x``.

Only packages of ``PACKAGES`` whose metadata declares a permissive licence are read (MPL-2.0
packages such as certifi, hypothesis and tqdm are left out on purpose: file-level copyleft).
Each line records the package, its version, the file's path relative to site-packages, the
object's qualified name (null for a whole module) and the licence.

The output is deterministic for a given set of installed packages: files are traversed in
sorted order and every choice is made by sorting on fixed keys (a SHA-256 of names, no RNG).
When package versions change, rerun it and check the new files in (in edgespec/bench/suites/,
package data)::

    .venv/bin/python benchmarks/make_code_edit.py               # writes code-edit.jsonl
    .venv/bin/python benchmarks/make_code_edit.py --check       # exit 1 if the file would change
    .venv/bin/python benchmarks/make_code_edit.py --validation  # code-edit-validation.jsonl
    .venv/bin/python benchmarks/make_code_edit.py --test        # code-edit-test.jsonl

Stdlib only.
"""
from __future__ import annotations

import argparse
import ast
import builtins
import collections
import hashlib
import importlib.metadata as md
import io
import json
import keyword
import re
import sys
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

# The suites ship as package data, where `edgespec bench --suite` reads them.
OUT = Path(__file__).resolve().parents[1] / "edgespec" / "bench" / "suites" / "code-edit.jsonl"

# Distributions read, in no particular order (the selection orders them by hash).
PACKAGES = (
    "annotated-types", "charset-normalizer", "diskcache", "gguf", "idna", "iniconfig", "jinja2",
    "markdown-it-py", "markupsafe", "mdurl", "numpy", "packaging", "pluggy", "psutil",
    "pygments", "pyyaml", "requests", "rich", "shellingham", "sortedcontainers", "typer",
    "urllib3",
)
# The validation suite (``--validation``): other installed distributions, none of the above, so
# that a policy tuned on code-edit.jsonl is reported on code it never saw.
VALIDATION_PACKAGES = (
    "anyio", "click", "contourpy", "cycler", "fonttools", "h11", "httpcore2", "httpx2",
    "kiwisolver", "onnx", "openai", "pydantic", "pyparsing", "pytest", "python-dateutil", "scipy",
    "sniffio", "starlette", "uvicorn",
)
VALIDATION_OUT = OUT.with_name("code-edit-validation.jsonl")
# The test suite (``--test``): distributions in neither list above, read once a policy is
# settled on the tuning suite and the validation suite has been looked at (typing-inspection
# yields no request under the rules below: nine packages do).
TEST_PACKAGES = (
    "execnet", "matplotlib", "ml-dtypes", "onnxruntime", "pillow", "protobuf", "pytest-xdist",
    "setuptools", "truststore", "typing-inspection",
)
TEST_OUT = OUT.with_name("code-edit-test.jsonl")
# SPDX ids (or classifier names mapped to them) accepted as permissive.
PERMISSIVE = {"MIT", "BSD", "BSD-2-Clause", "BSD-3-Clause", "0BSD", "Apache-2.0", "ISC", "Zlib",
              "CC0-1.0", "PSF-2.0", "MIT-CMU"}
_LICENSE_SPELLINGS = {
    "apache 2.0": "Apache-2.0", "apache-2.0": "Apache-2.0", "apache license 2.0": "Apache-2.0",
    "mit": "MIT", "mit license": "MIT", "isc license": "ISC", "isc": "ISC",
    "bsd-3-clause": "BSD-3-Clause", "bsd-2-clause": "BSD-2-Clause", "bsd": "BSD",
    "3-clause bsd license": "BSD-3-Clause",
}
_CLASSIFIER_LICENSES = {
    "License :: OSI Approved :: MIT License": "MIT",
    "License :: OSI Approved :: BSD License": "BSD",
    "License :: OSI Approved :: Apache Software License": "Apache-2.0",
    "License :: OSI Approved :: ISC License (ISCL)": "ISC",
    "License :: OSI Approved :: Python Software Foundation License": "PSF-2.0",
}

PER_CATEGORY = 12
MIN_LINES, MAX_LINES = 40, 160
MAX_CODE_CHARS = 5400          # hard limit: the whole prompt stays <= 6000 characters
# Softer limits per category, so the full answer (code plus what the edit adds) fits ~1024
# new tokens: docstrings add the most text, a dataclass conversion removes some.
CATEGORY_MAX_CHARS = {"type-hints": 3800, "rename": 4200, "docstrings": 3000, "dataclass": 4200}
MAX_LINE_LEN = 100             # longer lines are usually data tables, not code
MAX_PER_PACKAGE = 2            # per category, while other packages still have candidates

CATEGORIES = ("type-hints", "rename", "docstrings", "dataclass")
# Scarcest candidates choose first (a unit serves one request only).
SELECTION_ORDER = ("dataclass", "docstrings", "type-hints", "rename")
INSTRUCTIONS = {
    "type-hints": "Add type hints to every function in this Python code. "
                  "Return the full modified code and nothing else.",
    "rename": "Rename the identifier `{old}` to `{new}` everywhere in this code: its definition "
              "and every use, including attribute accesses and parameters. Change nothing else. "
              "Return the full modified code and nothing else.",
    "docstrings": "Add a Google-style docstring to every function and class in this Python code "
                  "(a one-line summary, then Args, Returns and Raises sections where they apply). "
                  "Return the full modified code and nothing else.",
    "dataclass": "Convert the class `{name}` in this code to a @dataclass: turn the attributes "
                 "set in `__init__` into annotated fields with the same defaults, keep every "
                 "other method and the behaviour unchanged, and add the needed imports. "
                 "Return the full modified code and nothing else.",
}

# Rename: one word of a snake_case name replaced by a sensible alternative.
RENAME_WORDS = {
    "buf": "buffer", "idx": "index", "msg": "message", "val": "value", "num": "number",
    "cnt": "count", "pos": "position", "obj": "instance", "res": "result", "attr": "attribute",
    "ctx": "context", "cfg": "config", "req": "request", "resp": "response", "src": "source",
    "dst": "destination", "err": "error", "exc": "exception", "prev": "previous",
    "cur": "current", "curr": "current", "tmp": "temp", "ret": "retval", "sep": "separator",
    "col": "column", "char": "character", "chars": "characters", "elem": "element",
    "seq": "sequence", "opts": "options", "opt": "option", "params": "parameters",
    "param": "parameter", "lineno": "line_number", "fname": "file_name", "ts": "timestamp",
    "fp": "file_obj", "fn": "function", "func": "function",
    "result": "outcome", "results": "outcomes", "data": "payload", "text": "content",
    "count": "total", "size": "length", "index": "position", "items": "entries",
    "item": "entry", "name": "label", "names": "labels", "path": "file_path",
    "start": "begin", "end": "finish", "line": "row", "lines": "rows", "token": "lexeme",
    "tokens": "lexemes", "parts": "pieces", "part": "piece", "options": "settings",
    "config": "settings", "callback": "handler", "handler": "callback", "errors": "failures",
    "cache": "memo", "pattern": "regex", "match": "found", "nodes": "elements",
    "node": "element", "parent": "owner", "children": "kids", "target": "destination",
    "value": "val", "values": "vals", "key": "lookup_key", "keys": "lookup_keys",
    "width": "columns", "height": "rows_count", "length": "size", "offset": "shift",
    "output": "rendered", "source": "origin", "string": "chars", "message": "note",
    "prefix": "head", "suffix": "tail", "stream": "channel", "header": "heading",
    "headers": "heading_map", "url": "address", "host": "hostname", "port": "port_number",
    "timeout": "time_limit", "style": "look", "styles": "looks",
    "segment": "chunk", "segments": "chunks", "state": "status", "stack": "pile",
    "level": "depth", "depth": "level", "total": "sum_total", "default": "fallback",
    "label": "caption", "block": "section",
}


@dataclass
class Unit:
    """A piece of code offered to the model: a whole module or one top-level def/class."""
    package: str
    version: str
    license: str
    path: str                 # relative to site-packages, e.g. "rich/markup.py"
    object: str | None        # top-level name, None for the whole module
    code: str
    tree: ast.Module = field(repr=False)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.package, self.path, self.object or "")


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


# -- packages ------------------------------------------------------------------------------------

def license_of(dist: md.Distribution) -> str | None:
    """SPDX-like licence from the metadata: License-Expression, else License, else classifiers."""
    meta = dist.metadata
    expr = meta.get("License-Expression")
    if expr:
        return expr.strip()
    text = (meta.get("License") or "").strip()
    if text and "\n" not in text and len(text) <= 40:
        return _LICENSE_SPELLINGS.get(text.lower(), text)
    found = sorted({_CLASSIFIER_LICENSES[c] for c in meta.get_all("Classifier") or []
                    if c in _CLASSIFIER_LICENSES})
    return " AND ".join(found) or None


def is_permissive(expr: str | None) -> bool:
    if not expr:
        return False
    ids = [t for t in re.split(r"[\s()]+", expr) if t and t not in ("AND", "OR")]
    return bool(ids) and all(t in PERMISSIVE for t in ids)


def _skip_path(rel: str) -> bool:
    parts = rel.split("/")
    return (not rel.endswith(".py")
            or any(p in ("tests", "test", "testing", "_vendor", "vendor", "_examples", "examples")
                   for p in parts[:-1])
            or parts[-1].startswith(("test_", "conftest")))


def iter_units(dist_name: str):
    """Yields every acceptable unit of one distribution, in sorted path then line order."""
    try:
        dist = md.distribution(dist_name)
    except md.PackageNotFoundError:
        print(f"warning: {dist_name} is not installed; skipped", file=sys.stderr)
        return
    lic = license_of(dist)
    if not is_permissive(lic):
        print(f"warning: {dist_name} licence {lic!r} is not permissive; skipped", file=sys.stderr)
        return
    name, version = dist.metadata["Name"], dist.version
    files = sorted(str(f).replace("\\", "/") for f in dist.files or ())
    for rel in files:
        if _skip_path(rel) or ".dist-info/" in rel or rel.startswith(".."):
            continue
        full = Path(dist.locate_file(rel))
        try:
            source = full.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if "\t" in source or "\r" in source or source.count("\n") < MIN_LINES:
            continue
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        lines = source.splitlines()
        pieces: list[tuple[str | None, str]] = [(None, source.strip("\n"))]
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                # The node's source segment (what ast.get_source_segment gives, but whole
                # lines, which is the same for a top-level node), with its decorators.
                first = min([d.lineno for d in node.decorator_list] + [node.lineno])
                if MIN_LINES <= node.end_lineno - first + 1 <= MAX_LINES:
                    pieces.append((node.name, "\n".join(lines[first - 1:node.end_lineno])))
        for obj, code in pieces:
            n_lines = code.count("\n") + 1
            if not MIN_LINES <= n_lines <= MAX_LINES or len(code) > MAX_CODE_CHARS:
                continue
            if any(len(line) > MAX_LINE_LEN for line in code.splitlines()):
                continue
            if not code.isascii():
                continue
            try:
                sub = ast.parse(code)
            except SyntaxError:
                continue
            if not any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                       for n in ast.walk(sub)):
                continue
            yield Unit(name, version, lic, rel, obj, code, sub)


# -- eligibility per category --------------------------------------------------------------------

def _functions(tree: ast.AST):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def type_hints_target(unit: Unit):
    """Eligible when >= 3 functions and at most 10% of annotation slots are filled."""
    funcs = _functions(unit.tree)
    if len(funcs) < 3:
        return None
    slots = filled = 0
    for f in funcs:
        a = f.args
        params = a.posonlyargs + a.args + a.kwonlyargs + [p for p in (a.vararg, a.kwarg) if p]
        params = [p for p in params if p.arg not in ("self", "cls")]
        slots += len(params) + 1
        filled += sum(p.annotation is not None for p in params) + (f.returns is not None)
    if filled > 0.1 * slots or slots < 4:
        return None
    return {}


def docstrings_target(unit: Unit):
    """Eligible when >= 3 functions/classes and at most a third of them have a docstring."""
    defs = [n for n in ast.walk(unit.tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    if len(defs) < 3:
        return None
    with_doc = sum(ast.get_docstring(n) is not None for n in defs)
    if with_doc * 3 > len(defs):
        return None
    return {}


_BUILTINS = set(dir(builtins))


def _name_tokens(code: str) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type == tokenize.NAME:
            counts[tok.string] += 1
    return counts


def _new_name(old: str) -> str | None:
    stripped = old.lstrip("_")
    lead = old[:len(old) - len(stripped)]
    words = stripped.split("_")
    for i, word in enumerate(words):
        repl = RENAME_WORDS.get(word)
        if repl:
            return lead + "_".join(words[:i] + [repl] + words[i + 1:])
    return None


def rename_target(unit: Unit):
    """Picks X: bound in the code, >= 3 name occurrences, every occurrence owned by the code."""
    tree = unit.tree
    bound: set[str] = set()
    foreign: set[str] = set()           # names also used in ways the code does not own
    self_attrs: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in ("self", "cls") and isinstance(node.ctx, ast.Store):
            self_attrs.add(node.attr)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            foreign.update((a.asname or a.name).split(".")[0] for a in node.names)
            foreign.update(a.name.split(".")[-1] for a in node.names)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            foreign.update(node.names)
    bound |= self_attrs
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owned = (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                     and node.attr in self_attrs)
            if not owned:
                foreign.add(node.attr)
        elif isinstance(node, ast.keyword) and node.arg:
            foreign.add(node.arg)
        elif isinstance(node, ast.alias):
            foreign.add(node.name)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value.isidentifier():
            foreign.add(node.value)     # "x" in __slots__, __all__, getattr(): ambiguous
    counts = _name_tokens(unit.code)
    best = None
    for old in sorted(bound - foreign):
        if (len(old) < 3 or old in _BUILTINS or keyword.iskeyword(old)
                or (old.startswith("__") and old.endswith("__")) or old in ("self", "cls")):
            continue
        n = counts[old]
        if not 3 <= n <= 25:
            continue
        new = _new_name(old)
        if not new or new == old or counts[new] or new in _BUILTINS or keyword.iskeyword(new) \
                or not new.isidentifier() or re.search(rf"\b{re.escape(new)}\b", unit.code):
            continue
        rank = (-n, old)
        if best is None or rank < best[0]:
            best = (rank, old, new, n)
    if best is None:
        return None
    return {"old": best[1], "new": best[2], "occurrences": best[3]}


def _is_self_assign(stmt: ast.stmt, params: set[str]) -> str | None:
    """`self.x = x` (plain or annotated, same name on both sides) -> 'x'; else None."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        target, value = stmt.targets[0], stmt.value
    elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
        target, value = stmt.target, stmt.value
    else:
        return None
    if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
            and target.value.id == "self" and isinstance(value, ast.Name)
            and value.id in params and target.attr == value.id):
        return value.id
    return None


def dataclass_candidates(tree: ast.Module):
    """Top-level classes whose __init__ mostly assigns parameters to same-named attributes."""
    out = []
    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef) or cls.decorator_list:
            continue
        if any(isinstance(s, (ast.Assign, ast.AnnAssign)) and any(
                isinstance(t, ast.Name) and t.id == "__slots__"
                for t in (s.targets if isinstance(s, ast.Assign) else [s.target]))
               for s in cls.body):
            continue
        if any(isinstance(b, ast.Name) and b.id in ("Enum", "IntEnum", "NamedTuple", "TypedDict",
                                                   "Exception", "Protocol")
               or isinstance(b, ast.Attribute) and b.attr in ("Enum", "NamedTuple")
               for b in cls.bases):
            continue
        init = next((s for s in cls.body if isinstance(s, ast.FunctionDef)
                     and s.name == "__init__"), None)
        if init is None:
            continue
        a = init.args
        if a.vararg or a.kwarg or a.posonlyargs:
            continue
        params = [p.arg for p in a.args[1:] + a.kwonlyargs]
        if len(params) < 2:
            continue
        body = init.body[1:] if ast.get_docstring(init) is not None else init.body
        if any("super" in ast.unparse(s) or "__init__" in ast.unparse(s) for s in body):
            continue
        assigned = {p for p in (_is_self_assign(s, set(params)) for s in body) if p}
        simple = sum(_is_self_assign(s, set(params)) is not None for s in body)
        if len(assigned) < max(2, 0.75 * len(params)) or simple < 0.6 * len(body):
            continue
        out.append(cls.name)
    return out


def dataclass_target(unit: Unit):
    names = dataclass_candidates(unit.tree)
    if unit.object is not None:
        names = [n for n in names if n == unit.object]
    if not names:
        return None
    return {"name": min(names, key=lambda n: _digest(unit.path, n))}


TARGETS = {"type-hints": type_hints_target, "rename": rename_target,
           "docstrings": docstrings_target, "dataclass": dataclass_target}


# -- selection -----------------------------------------------------------------------------------

def build(packages=PACKAGES, per_category=PER_CATEGORY, id_prefix="code-edit-") -> list[dict]:
    units = [u for pkg in packages for u in iter_units(pkg)]
    used: set[tuple[str, str, str]] = set()
    used_files: collections.Counter = collections.Counter()
    records: list[dict] = []
    for category in SELECTION_ORDER:
        by_pkg: dict[str, list[tuple[Unit, dict]]] = collections.defaultdict(list)
        for u in units:
            if len(u.code) > CATEGORY_MAX_CHARS[category]:
                continue
            extra = TARGETS[category](u)
            if extra is not None:
                by_pkg[u.package].append((u, extra))
        for lst in by_pkg.values():
            lst.sort(key=lambda ue: _digest(category, *ue[0].key))
        order = sorted(by_pkg, key=lambda p: _digest(category, p))
        taken: collections.Counter = collections.Counter()
        chosen: list[tuple[Unit, dict]] = []
        cap = MAX_PER_PACKAGE      # raised only when the packages with candidates run out
        while len(chosen) < per_category and cap <= per_category:
            progress = False
            for pkg in order:
                if len(chosen) >= per_category or taken[pkg] >= cap:
                    continue
                for u, extra in by_pkg[pkg]:
                    # One request per unit, and at most two per source file over the suite.
                    if u.key in used or used_files[(u.package, u.path)] >= 2:
                        continue
                    if u.object is None and used_files[(u.package, u.path)]:
                        continue
                    if (u.package, u.path, "") in used:
                        continue
                    used.add(u.key)
                    used_files[(u.package, u.path)] += 1
                    taken[pkg] += 1
                    chosen.append((u, extra))
                    progress = True
                    break
            if not progress:
                cap += 1
        if len(chosen) < per_category:
            print(f"warning: only {len(chosen)} {category} requests", file=sys.stderr)
        chosen.sort(key=lambda ue: ue[0].key)
        for u, extra in chosen:
            instruction = INSTRUCTIONS[category].format(**extra)
            source = {"package": u.package, "version": u.version, "path": u.path,
                      "object": u.object, "license": u.license}
            rec = {"id": "", "category": category,
                   "turns": [f"{instruction}\n\n```python\n{u.code}\n```"], "source": source}
            if category == "rename":
                rec["rename"] = {"from": extra["old"], "to": extra["new"]}
            elif category == "dataclass":
                rec["class"] = extra["name"]
            records.append(rec)
    records.sort(key=lambda r: CATEGORIES.index(r["category"]))   # stable: keeps unit order
    for i, rec in enumerate(records, 1):
        rec["id"] = f"{id_prefix}{i:03d}"
    return records


def render(records: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def summary(records: list[dict]) -> str:
    cats = collections.Counter(r["category"] for r in records)
    pkgs = collections.Counter(f'{r["source"]["package"]} {r["source"]["version"]} '
                               f'({r["source"]["license"]})' for r in records)
    sizes = sorted(len(r["turns"][0]) for r in records)
    lines = [f"{len(records)} requests: " + ", ".join(f"{c} {cats[c]}" for c in CATEGORIES),
             f"prompt chars: min {sizes[0]}, median {sizes[len(sizes) // 2]}, max {sizes[-1]}",
             "packages:"]
    lines += [f"  {p}: {n}" for p, n in sorted(pkgs.items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help=f"output file (default {OUT})")
    ap.add_argument("--check", action="store_true",
                    help="do not write; exit 1 when the output would differ from --out")
    ap.add_argument("--validation", action="store_true",
                    help=f"the validation suite from VALIDATION_PACKAGES (default out {VALIDATION_OUT})")
    ap.add_argument("--test", action="store_true",
                    help=f"the test suite from TEST_PACKAGES (default out {TEST_OUT})")
    args = ap.parse_args(argv)
    if args.validation:
        args.out = args.out or VALIDATION_OUT
        records = build(VALIDATION_PACKAGES, id_prefix="code-edit-v")
    elif args.test:
        args.out = args.out or TEST_OUT
        records = build(TEST_PACKAGES, id_prefix="code-edit-t")
    else:
        args.out = args.out or OUT
        records = build()
    text = render(records)
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is out of date; rerun without --check", file=sys.stderr)
            return 1
        print(f"{args.out} is up to date")
    else:
        args.out.write_text(text, encoding="utf-8")
        print(f"wrote {args.out}")
    print(summary(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
