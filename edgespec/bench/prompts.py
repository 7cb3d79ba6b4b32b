"""Benchmark prompt sets: Spec-Bench, the code-edit suite, or a user's JSONL file.

A prompt file has one JSON object per line: ``id``, ``category`` and either ``turns`` (user
messages, as in Spec-Bench, sent with the chat template: the first one alone, or each in turn
after the answers to the earlier ones, see :func:`conversation`) or ``prompt`` (raw text, sent
without a template).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from edgespec.errors import InvalidRequest

# One file per suite, shipped as package data (pyproject.toml) so `bench --suite` finds them in
# any install, not only in a checkout of the repository.
SUITE_DIR = Path(__file__).resolve().parent / "suites"
SUITES = {name: SUITE_DIR / f"{name}.jsonl" for name in (
    "specbench",
    "code-edit",
    # Built the same way from other installed packages (benchmarks/make_code_edit.py
    # --validation): code the policy was never tuned on.
    "code-edit-validation",
    # And from a third set of packages (--test): read once a policy is settled.
    "code-edit-test",
)}
# --split: `tune` takes --limit evenly spaced prompts per category (the ones every tuning run
# used); `validate` the prompts halfway between them, a disjoint set to report on; `test` those
# a quarter of the way, disjoint from both, for a policy settled after `validate` was seen;
# `test2` those three quarters of the way, for a policy settled after `test` was seen; `test3`
# an eighth and `test4` three eighths of the way, each recorded before a new policy saw it.
SPLITS = ("tune", "validate", "test", "test2", "test3", "test4")
_SHIFT = {"tune": (0, 1), "validate": (1, 2), "test": (1, 4), "test2": (3, 4), "test3": (1, 8), "test4": (3, 8)}  # split -> fraction of the spacing
# Spec-Bench reports the eight MT-bench sub-categories together as one category.
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
SPECBENCH_CATEGORY = "multi_turn"


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    text: str
    templated: bool  # True: a user message for the chat template; False: raw prompt text
    follow_ups: tuple[str, ...] = ()  # the user messages after ``text`` (templated prompts only)

    @property
    def n_turns(self) -> int:
        return 1 + len(self.follow_ups)


def _parse_line(obj: dict, where: str, specbench: bool) -> BenchPrompt:
    pid = obj.get("id", obj.get("question_id"))
    category = obj.get("category")
    if pid is None or not isinstance(category, str):
        raise InvalidRequest(f"{where}: needs 'id' and 'category'")
    if specbench and category in MT_BENCH:
        category = SPECBENCH_CATEGORY
    if "turns" in obj:
        turns = obj["turns"]
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t.strip() for t in turns)):
            raise InvalidRequest(f"{where}: 'turns' must be a non-empty list of non-empty strings")
        return BenchPrompt(str(pid), category, turns[0], True, tuple(turns[1:]))
    if isinstance(obj.get("prompt"), str) and obj["prompt"].strip():
        return BenchPrompt(str(pid), category, obj["prompt"], False)
    raise InvalidRequest(f"{where}: needs 'turns' (list of user messages) or 'prompt' (text)")


def load_prompts(path: str | Path, specbench: bool = False) -> list[BenchPrompt]:
    """Reads a prompt file; raises InvalidRequest naming the line of the first problem."""
    path = Path(path)
    if not path.is_file():
        raise InvalidRequest(f"prompt file not found: {path}")
    prompts = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidRequest(f"{path}:{n}: not JSON ({exc.msg})") from exc
            if not isinstance(obj, dict):
                raise InvalidRequest(f"{path}:{n}: each line must be a JSON object")
            prompts.append(_parse_line(obj, f"{path}:{n}", specbench))
    if not prompts:
        raise InvalidRequest(f"{path}: no prompts")
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        raise InvalidRequest(f"{path}: duplicate ids")
    return prompts


def load_suite(name: str) -> list[BenchPrompt]:
    if name not in SUITES:
        raise InvalidRequest(f"unknown suite {name!r}; choose from {', '.join(SUITES)}")
    return load_prompts(SUITES[name], specbench=(name == "specbench"))


def select(prompts: list[BenchPrompt], limit: int | None, split: str = "tune") -> list[BenchPrompt]:
    """Up to ``limit`` prompts per category, evenly spaced through the file (deterministic);
    with ``split="validate"`` the prompts halfway between those, with ``split="test"`` those a
    quarter of the way, with ``split="test2"`` three quarters, with ``split="test3"`` an eighth,
    with ``split="test4"`` three eighths (the six disjoint while a category has at least 8 prompts
    per pick).

    Even spacing rather than the first k keeps Spec-Bench's multi-turn category spread over
    its eight sub-categories, which sit in blocks in the file.
    """
    if split not in SPLITS:
        raise InvalidRequest(f"--split must be one of {', '.join(SPLITS)}, got {split!r}")
    if limit is None:
        if split != "tune":
            raise InvalidRequest(f"--split {split} needs --limit (it takes the prompts between the --limit picks)")
        return list(prompts)
    if limit < 1:
        raise InvalidRequest("--limit must be >= 1")
    by_cat: dict[str, list[BenchPrompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    chosen = set()
    for cat, items in by_cat.items():
        k, (num, den) = min(limit, len(items)), _SHIFT[split]
        if num and den * k > len(items):
            raise InvalidRequest(f"--split {split} needs --limit <= {len(items) // den} "
                                 f"({cat} has {len(items)} prompts)")
        shift = num * len(items) // (den * k)
        chosen.update(items[i * len(items) // k + shift].id for i in range(k))
    return [p for p in prompts if p.id in chosen]


def conversation(p: BenchPrompt, answers: Sequence[str] = ()) -> list[dict]:
    """The messages of turn ``len(answers) + 1``: each earlier user turn followed by its answer.

    Raises:
        InvalidRequest: ``p`` is raw text, or has no turn after that many answers.
    """
    if not p.templated and answers:
        raise InvalidRequest(f"prompt {p.id} is raw text: it has one turn")
    users = (p.text,) + p.follow_ups
    if len(answers) >= len(users):
        raise InvalidRequest(f"prompt {p.id} has {len(users)} turn(s), not {len(answers) + 1}")
    messages = []
    for user, answer in zip(users, answers):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return messages + [{"role": "user", "content": users[len(answers)]}]


def prompt_tokens(engine, p: BenchPrompt, answers: Sequence[str] = ()) -> list[int]:
    """What ``engine`` (edgespec.engine.Engine) decodes for turn ``len(answers) + 1`` of ``p``:
    the conversation in the model's chat template, or the raw text."""
    if p.templated:
        return engine.chat_tokens(conversation(p, answers))
    return engine.text_tokens(p.text)
