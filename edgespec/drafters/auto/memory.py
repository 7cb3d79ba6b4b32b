"""What `auto` learned, kept across requests and runs, per placement (the target's calibration
key: its file, GPU layers, threads, kernel): how often the suffix index's drafts are accepted
per match-length class, how often each drafter model's chains are, per depth and per
confidence of the drafted token, and what its steps gained over the steps taken without it.

A request starts from it instead of from priors, so a short answer is drafted as well as the
end of a long one; and `auto` leaves out a drafter model whose steps measured no gain here
(edgespec.drafters.auto.select). Carried evidence
is scaled down to ``CARRY_WEIGHT`` pseudo-observations per depth, so a request whose text
differs (a copy-heavy edit after chat) overrides it within a few steps.
"""
from __future__ import annotations

import functools
import json
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from edgespec.files.store_files import write_or_keep

log = logging.getLogger(__name__)

CARRY_WEIGHT = 6.0
# A drafter left out is measured again (loaded for one request) after sitting out this many,
# if its measured loss was within the noise of a count of its tokens (1/sqrt(den)): otherwise
# one unlucky first answer decides for good. Beside the 9-layer offloaded 7B, a first
# Spec-Bench answer whose three 63-node trees missed measured 76/77 and kept trees out of the
# next 29 questions (replayed).
REPROBE_AFTER = 8


def drafter_key(drafter_path, tree: bool = False) -> str:
    """The name what a drafter model learned is kept under: its file name, whatever runtime
    drafts with it, and apart when it may draft trees (``--draft-tree``): steps that draft
    trees measure another gain than chains, so one must not decide the other's load."""
    return Path(drafter_path).name + ("+tree" if tree else "")


def draft_shape_name(memory: PolicyMemory | None, drafter_path, tree: bool) -> tuple[str, bool, str | None]:
    """How a drafter model drafts this request: (the name it learns under, whether it may draft
    trees, the name that sits the request out). Trees where asked (``tree``) unless their name
    measured a loss here; then chains, under the chain name, and the trees count a request left
    out (REPROBE_AFTER). A tree step's loss says nothing of a chain's: replayed on the Spec-Bench
    tuning questions beside the 4-layer offloaded 7B (one of three H100 curves of it), leaving the
    whole drafter out gave 1.30x against chains' 1.54x, drafting chains instead 1.52x."""
    chains = drafter_key(drafter_path)
    if not tree:
        return chains, False, None
    name = drafter_key(drafter_path, True)
    gain = memory.drafter_gain(name) if memory is not None else None
    if gain is None or gain[0] > gain[1]:
        return name, True, None
    return chains, False, name


def saved_gain(state: dict, drafter: str) -> list[float] | None:
    """``drafter``'s measured gain ([num, den]) in a loaded memory state, or None where there is
    none worth reading (never measured, or malformed)."""
    saved = state.get("gain", {}).get(drafter)
    return saved if saved and len(saved) == 2 and saved[1] > 0 else None


def _sit_out(state: dict, drafter: str, loaded: bool) -> None:
    """Counts the requests since ``drafter`` was last loaded (REPROBE_AFTER): 0 when it was."""
    sat_out = state.setdefault("sat_out", {})
    sat_out[drafter] = 0 if loaded else sat_out.get(drafter, 0) + 1


@functools.cache
def _writer() -> ThreadPoolExecutor:
    """The thread that writes what a request learned once it has ended (``save_after``): the
    read, the write and its fsync took ~1 ms on the dev VM, inside the request's clock, and an
    H200 decodes a 20-token answer in ~40 ms. Not the thread beside the prefill
    (edgespec.decode.sequence): a request's start reads the memory there, and would wait on a
    write queued behind it."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgespec-policy")


_WRITES: list[Future] = []  # saves not yet known to have finished; every read waits for them
_WRITES_LOCK = threading.Lock()  # reads come from the request's thread and the one beside it


def settle() -> None:
    """Waits for the saves still being written, so that a read sees every ended request's."""
    with _WRITES_LOCK:
        for write in _WRITES:
            error = write.exception()
            if error is not None:  # write_or_keep degrades on OSError; anything else is a bug
                log.error("saving what auto learned failed: %r", error)
        _WRITES.clear()


class PolicyMemory:
    """One JSON file per placement: {"suffix": {class: [num, den]}, "drafters": {name: [[num, den]...]},
    "confidence": {name: [nums, dens]} (ConfidenceCalibration's bins), "gain": {name: [num, den]},
    "sat_out": {name: requests since it was last loaded}}."""

    def __init__(self, home: Path, placement_key: str):
        self.path = Path(home) / "policy" / f"{placement_key}.json"

    def load(self) -> dict:
        settle()
        return self._read()

    def _read(self) -> dict:
        try:
            state = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return state if isinstance(state, dict) else {}

    def drafter_gain(self, drafter: str) -> list[float] | None:
        """What ``drafter``'s steps measured to gain here ([num, den]; edgespec.drafters.auto.policy.drafter_gain),
        or None before it ever drafted here and when a re-probe is due (REPROBE_AFTER)."""
        state = self.load()
        gain = saved_gain(state, drafter)
        if gain is None or state.get("sat_out", {}).get(drafter, 0) < REPROBE_AFTER:
            return gain
        return None if 1.0 - gain[1] ** -0.5 < gain[0] / gain[1] < 1.0 else gain

    def left_out(self, drafter: str) -> None:
        """Counts a request that left ``drafter`` out where no AutoDrafter of this placement
        will: a planned load that dropped it and planned the target anew (LeftOut)."""
        state = self.load()
        _sit_out(state, drafter, loaded=False)
        self._write(state)

    def save(self, suffix: dict, drafter: str | None, drafter_state: list | None,
             confidence_state: list | None = None, gain_state: list | None = None,
             sits_out: str | None = None) -> None:
        """One request's end: what it learned, under ``drafter`` (loaded when ``drafter_state``
        is given), and ``sits_out`` counted as left out (trees while the drafter drafts chains:
        draft_shape_name), in one write."""
        settle()
        self._save(suffix, drafter, drafter_state, confidence_state, gain_state, sits_out)

    def save_after(self, *args, **kwargs) -> None:
        """``save`` in the writer thread, after the request's answer (_writer); reads wait for it."""
        with _WRITES_LOCK:
            _WRITES.append(_writer().submit(self._save, *args, **kwargs))

    def _save(self, suffix: dict, drafter: str | None, drafter_state: list | None,
              confidence_state: list | None = None, gain_state: list | None = None,
              sits_out: str | None = None) -> None:
        state = self._read()
        state["suffix"] = suffix
        if drafter is not None and drafter_state is not None:
            state.setdefault("drafters", {})[drafter] = drafter_state
        if drafter is not None and confidence_state is not None:
            state.setdefault("confidence", {})[drafter] = confidence_state
        if drafter is not None and gain_state is not None:
            state.setdefault("gain", {})[drafter] = gain_state
        if drafter is not None:
            _sit_out(state, drafter, loaded=drafter_state is not None)
        if sits_out is not None:
            _sit_out(state, sits_out, loaded=False)
        self._write(state)

    def _write(self, state: dict) -> None:
        # A read-only or full store: one warning, and the next run starts from priors.
        write_or_keep(self.path, json.dumps(state), "what auto learned")


@dataclass(frozen=True)
class LeftOut:
    """A planned load that placed the drafter model, then left it out because `auto`'s
    calibration says it cannot pay there, and planned the target anew: the placement keys
    (calibration_key) of both plans, so that the request counts as one the drafter sat out
    (REPROBE_AFTER) under the key the decision read, which the AutoDrafter of the new load,
    learning under its own key, cannot do."""

    drafter_path: str
    skipped_key: str
    skipped_tree: bool
    kept_key: str
    kept_tree: bool

    def record(self, home: Path) -> None:
        """Counts the drafter (and its trees where they sat out) as left out under the skipped
        plan's key, where that is not the key the new load learns under."""
        memory = PolicyMemory(home, self.skipped_key)
        name, _, trees_out = draft_shape_name(memory, self.drafter_path, self.skipped_tree)
        new = PolicyMemory(home, self.kept_key)
        new_name, _, new_out = draft_shape_name(new, self.drafter_path, self.kept_tree)
        if (memory.path, name) != (new.path, new_name):
            memory.left_out(name)
        if trees_out is not None and (memory.path, trees_out) != (new.path, new_out):
            memory.left_out(trees_out)
