"""Exact replay of greedy speculative decoding from recorded traces, against any machine's costs.

For greedy decoding the target's token at every position is the plain greedy output, so what a
verification accepts is decided by the plain output alone: the longest path of the draft that
follows it. A *trace* records, per benchmark prompt, on the development machine with the real
models: the prompt's token ids, the plain greedy output (the EOG token appended when the answer
ended with one), and the drafter model's greedy chain along that output, teacher-forced
(``DrafterTrace``). Replay then runs the REAL request loop (``Decoder``), the real speculative
step and the real suffix / hybrid / auto drafters over a ``TraceSequence`` (the target as an
oracle that answers from the trace and books every batch it would decode), with
``TraceChainDrafter`` standing in for the drafter model, and prices the booked batches with a
``MachineCosts`` (verify cost vs batch size, drafter cost per batch). Steps, drafted and
accepted tokens are exact (modulo batch-numerics near-ties on the recording machine); seconds
are as good as the cost curves.

The chain drafter needs no drafting per position: its greedy chain from position p follows the
plain output while the drafter's argmax equals it (``top[q] == output[q]``) and its confidence
stays above ``min_confidence``; at the first miss it drafts ``top[q]`` and then ``off_run[q]``
further tokens off the plain path (recorded once per miss, since that continuation does not
depend on where the chain started). Model-drafted trees are replayed from their own records
(replay_trees.py).

Vocabulary as in edgespec.decode.tree. Record with ``benchmarks/replay/record.py``, replay with
``benchmarks/replay/simulate.py``.
"""
from __future__ import annotations

import contextlib
import gzip
import json
import logging
import statistics
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgespec.bench.summary import PLAIN, Record, summarize
from edgespec.decode.events import DoneEvent
from edgespec.decode.loop import Decoder
from edgespec.decode.request import GenerationRequest
from edgespec.decode.sampling import SamplingParams, greedy_logprob, log_softmax
from edgespec.decode.tokens import common_prefix
from edgespec.drafters.factory import suffix_drafter
from edgespec.drafters.auto.drafter import AutoDrafter
from edgespec.drafters.auto.memory import PolicyMemory, draft_shape_name
from edgespec.drafters.auto.policy import CostModel, TreeSizes
from edgespec.drafters.auto.select import pays
from edgespec.drafters.hybrid import HybridDrafter
from edgespec.drafters.model import TREE_SIZES
from edgespec.spec.step import SpeculativeStep
from edgespec.decode.tree import DraftTree

log = logging.getLogger(__name__)

VERSION = 1
OFF_PATH = -1  # token id standing for a drafted token off the plain path (never accepted)
# "model-overlap": the model drafter drafting ahead while the target verifies (SpeculativeStep's
# overlap), the drafting booked only where it outlasts the verification.
# "-tree": the model drafter drafting best-first trees sized by TreeSizes (replay_trees.py);
# "auto-tree": `auto` whose drafter model drafts, per step, a chain or a tree (`--draft-tree`).
CONFIGS = (PLAIN, "suffix", "model", "hybrid", "auto", "model-overlap", "model-tree", "hybrid-tree", "auto-tree")
TREE = "-tree"
OVERLAP = "-overlap"
N_BATCH = 512  # prompt / sync chunks (ContextParams.n_batch)
# Log-probs are stored to 5 places (traces before the confidence-sized chains: 3): a chain's
# length is decided on its confidences (edgespec.drafters.auto), a smooth function of them.
DECIMALS = 5


# -- trace format -------------------------------------------------------------------------------
@dataclass(frozen=True)
class DrafterTrace:
    """The drafter model teacher-forced over prompt + plain output; index q = output position.

    ``top_ids[q]`` / ``top_logprobs[q]``: its best few tokens for output[q] (given prompt +
    output[:q]) and their log-probs, best first; ``plain_logprob[q]``: log-prob of output[q];
    ``confident[q]``: its top probability is at least ``min_confidence`` (kept exactly, as the
    stored log-probs are rounded); ``off_run[q]``: at a confident miss (``top_ids[q][0] !=
    output[q]``), how many tokens its free-running greedy chain drafts after ``top_ids[q][0]``
    before its confidence falls below ``min_confidence`` (at most ``off_cap``); 0 elsewhere;
    ``off_logprobs[q]``: those tokens' log-probs (its confidence in each; None in traces
    recorded before they were kept, where replay assumes ``min_confidence``).
    """

    top_ids: tuple[tuple[int, ...], ...]
    top_logprobs: tuple[tuple[float, ...], ...]
    plain_logprob: tuple[float, ...]
    confident_at: tuple[bool, ...]
    off_run: tuple[int, ...]
    min_confidence: float
    off_cap: int
    off_logprobs: tuple[tuple[float, ...], ...] | None = None

    def top(self, q: int) -> int:
        return self.top_ids[q][0]

    def confident(self, q: int) -> bool:
        return q < len(self.confident_at) and self.confident_at[q]


@dataclass(frozen=True)
class TreeTrace:
    """Per output position q (a tree drafted after ``output[:q]``), per budget k of ``budgets``:
    accepted nodes, rounds and expansions of the search; ``ranks[q]``: node indices of the
    accepted path in the tree of the largest budget. Recorded by replay_trees.py."""

    budgets: tuple[int, ...]
    accepted: tuple[tuple[int, ...], ...]
    rounds: tuple[tuple[int, ...], ...]
    expansions: tuple[tuple[int, ...], ...]
    ranks: tuple[tuple[int, ...], ...]
    branch: int  # the search's settings (edgespec.spec.tree_search.best_first)
    round_size: int | None
    max_expansions: int

    def round_rows(self, q: int, k: int) -> list[int]:
        """Rows decoded by each search round of the tree after output[:q] of budget index k: the
        rounds' sizes are not kept, so an even split of the recorded expansions."""
        rounds, expansions = self.rounds[q][k], self.expansions[q][k]
        return [expansions // rounds + (r < expansions % rounds) for r in range(rounds)]

    def to_dict(self) -> dict:
        return {"budgets": list(self.budgets), "accepted": [list(x) for x in self.accepted],
                "rounds": [list(x) for x in self.rounds], "expansions": [list(x) for x in self.expansions],
                "ranks": [list(x) for x in self.ranks], "branch": self.branch, "round_size": self.round_size,
                "max_expansions": self.max_expansions}

    @classmethod
    def from_dict(cls, d: dict) -> TreeTrace:
        t = lambda xs: tuple(tuple(x) for x in xs)
        return cls(tuple(d["budgets"]), t(d["accepted"]), t(d["rounds"]), t(d["expansions"]), t(d["ranks"]),
                   d["branch"], d["round_size"], d["max_expansions"])


@dataclass(frozen=True)
class PromptTrace:
    """One benchmark prompt: its tokens, the plain greedy output and the drafter's chain."""

    id: str
    category: str
    prompt: tuple[int, ...]
    output: tuple[int, ...]  # plain greedy output; ends with the EOG token when finish == "stop"
    finish: str  # "stop" (EOG) | "length"
    drafter: DrafterTrace | None = None
    trees: TreeTrace | None = None  # best-first model trees (replay_trees.py)

    @property
    def eog(self) -> int | None:
        return self.output[-1] if self.finish == "stop" else None


@dataclass(frozen=True)
class Trace:
    """A suite's traces and how they were recorded (model, max_tokens, machine)."""

    suite: str
    max_tokens: int
    prompts: tuple[PromptTrace, ...]
    meta: dict = field(default_factory=dict)


def _prompt_to_dict(p: PromptTrace) -> dict:
    d = {"id": p.id, "category": p.category, "prompt": list(p.prompt), "output": list(p.output),
         "finish": p.finish}
    if p.drafter is not None:
        t = p.drafter
        d["drafter"] = {"top_ids": [list(x) for x in t.top_ids],
                        "top_logprobs": [[round(v, DECIMALS) for v in x] for x in t.top_logprobs],
                        "plain_logprob": [round(v, 3) for v in t.plain_logprob],
                        "confident": [int(c) for c in t.confident_at], "off_run": list(t.off_run),
                        "min_confidence": t.min_confidence, "off_cap": t.off_cap}
        if t.off_logprobs is not None:
            d["drafter"]["off_logprobs"] = [[round(v, DECIMALS) for v in x] for x in t.off_logprobs]
    if p.trees is not None:
        d["trees"] = p.trees.to_dict()
    return d


def _prompt_from_dict(d: dict) -> PromptTrace:
    t = d.get("drafter")
    drafter = None if t is None else DrafterTrace(
        tuple(tuple(x) for x in t["top_ids"]), tuple(tuple(x) for x in t["top_logprobs"]),
        tuple(t["plain_logprob"]), tuple(bool(c) for c in t["confident"]), tuple(t["off_run"]),
        t["min_confidence"], t["off_cap"],
        tuple(tuple(x) for x in t["off_logprobs"]) if "off_logprobs" in t else None)
    trees = TreeTrace.from_dict(d["trees"]) if "trees" in d else None
    return PromptTrace(d["id"], d["category"], tuple(d["prompt"]), tuple(d["output"]), d["finish"], drafter, trees)


def save_trace(trace: Trace, path: str | Path) -> None:
    """Writes gzip JSON (one object; token ids and log-probs to ``DECIMALS`` places)."""
    obj = {"version": VERSION, "suite": trace.suite, "max_tokens": trace.max_tokens, "meta": trace.meta,
           "prompts": [_prompt_to_dict(p) for p in trace.prompts]}
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump(obj, f, separators=(",", ":"))


def load_trace(path: str | Path) -> Trace:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        obj = json.load(f)
    if obj.get("version") != VERSION:
        raise ValueError(f"{path}: trace version {obj.get('version')}, expected {VERSION}")
    return Trace(obj["suite"], obj["max_tokens"], tuple(_prompt_from_dict(d) for d in obj["prompts"]),
                 obj.get("meta", {}))


# -- costs --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MachineCosts:
    """What a machine's decodes cost, in seconds.

    ``target``: verify-cost curves (``CostModel.verify``: seconds for a batch of n tokens) at
    one or more context depths, linearly interpolated in depth (clamped outside). ``drafter``:
    the drafter model's batch curve (its n = 1 entry is the cost of one drafted token).
    ``policy``: the CostModel the auto drafter decides with (its calibration on that machine);
    default: the target curve nearest 512 tokens of context and the drafter's one-token cost.
    ``step_s``: Python-side seconds every step adds beyond its decodes; ``node_s``: Python-side
    seconds per tree node a best-first search expands (its children's log-probabilities);
    ``pick_s``: Python-side seconds per greedy pick of a drafted chain (a token and its
    confidence from a row: decode.sampling.greedy_logprob), one more than the chain decodes;
    `auto`'s calibration times it with a drafted token.
    ``graph_miss_s``: (target, drafter) seconds a decode costs beyond its curve when it cannot
    replay its context's CUDA graph. The curves repeat one batch size, so their decodes replay
    one; llama.cpp keeps one graph per context and replays it only for a batch shaped like the
    two decodes before it (the first after a change runs kernel by kernel, the second captures,
    priced alike though a 7B's capture measured 0.36 ms dearer). ``graphs_per_shape``: a
    llama.cpp that keeps a graph per batch shape (edgespec's patch, native/llama_cpp_patches.py)
    pays its miss whenever the size differs from the decode before it (the CPU rebuilds the
    graph it replays). ``calibration_miss_s``: what `auto`'s calibration adds to a batch of 2+
    on the target (None: the target's ``graph_miss_s``); a size's first two decodes run
    without a graph on either build, so on a per-shape build it is a stock build's miss. Each
    replayed request starts with no graph in either context, though the bench shares one
    drafter between requests.
    """

    name: str
    target: tuple[tuple[int, CostModel], ...]  # (context depth, curve), increasing depth
    drafter: CostModel | None = None
    policy: CostModel | None = None
    step_s: float = 0.0
    node_s: float = 0.0
    pick_s: float = 0.0
    graph_miss_s: tuple[float, float] = (0.0, 0.0)
    graphs_per_shape: bool = False
    calibration_miss_s: float | None = None

    def verify(self, n: int, depth: int) -> float:
        depths = [d for d, _ in self.target]
        costs = [c.verify(n) for _, c in self.target]
        return float(np.interp(depth, depths, costs))

    def draft(self, n: int) -> float:
        if self.drafter is None:
            raise ValueError(f"cost model {self.name!r} has no drafter curve")
        return self.drafter.verify(n)

    def policy_model(self) -> CostModel:
        """What `auto`'s calibration would measure here: its timings repeat a size twice and keep
        the faster, so on a GPU a batch of n > 1 (its first decode and the graph's capture) is
        priced without the graph, and one token (timed after a warm-up) and a drafted token with it;
        a drafted token includes its greedy pick (``pick_s``)."""
        if self.policy is not None:
            return self.policy
        _, curve = min(self.target, key=lambda dc: abs(dc[0] - 512))
        miss = self.graph_miss_s[0] if self.calibration_miss_s is None else self.calibration_miss_s
        verify_s = tuple(s + (miss if n > 1 else 0.0) for n, s in zip(curve.batch_sizes, curve.verify_s))
        return CostModel(curve.batch_sizes, verify_s, self.draft(1) + self.pick_s if self.drafter else 0.0)


def curve(points: dict[int, float], scale: float = 1.0) -> CostModel:
    """A CostModel from {batch size: cost}; ``scale`` converts units (1e-3 for milliseconds)."""
    sizes = sorted(points)
    return CostModel(tuple(sizes), tuple(points[n] * scale for n in sizes))


class Ledger:
    """Seconds booked by the oracle target and the chain drafter during one replayed request."""

    def __init__(self, costs: MachineCosts):
        self.costs = costs
        self.target_s = 0.0
        self.drafter_s = 0.0
        self.target_rows = 0
        self.target_decodes = 0  # steps, the EOG step of a plain answer included
        self.drafter_rows = 0
        self.drafter_decodes = 0
        self.picks_booked = 0  # greedy picks of drafted chains (MachineCosts.pick_s)
        self.hidden_s = 0.0  # drafter seconds spent while the target verified (overlap)
        self.graph_misses = [0, 0]  # (target, drafter) decodes that could not replay a CUDA graph
        self._shapes: list[tuple[int, ...]] = [(), ()]  # each context's last two batch sizes

    @property
    def seconds(self) -> float:
        return self.target_s + self.drafter_s - self.hidden_s

    def _graph_miss(self, who: int, n: int) -> float:
        """Seconds beyond the curve for a batch of ``n`` in context ``who`` (0 target, 1 drafter)."""
        last = self._shapes[who]
        self._shapes[who] = (*last[-1:], n)
        warm = last[-1:] == (n,) if self.costs.graphs_per_shape else last == (n, n)
        if warm or not self.costs.graph_miss_s[who]:
            return 0.0
        self.graph_misses[who] += 1
        return self.costs.graph_miss_s[who]

    def target(self, n: int, depth: int) -> None:
        self.target_s += self.costs.verify(n, depth) + self._graph_miss(0, n)
        self.target_rows += n
        self.target_decodes += 1

    def drafter(self, n: int, expanded: int = 0) -> None:
        """A drafter decode of ``n`` rows; ``expanded``: tree nodes whose children it priced."""
        self.drafter_s += self.costs.draft(n) + expanded * self.costs.node_s + self._graph_miss(1, n)
        self.drafter_rows += n
        self.drafter_decodes += 1

    def picks(self, n: int) -> None:
        """``n`` greedy picks of a drafted chain, in Python beside its decodes."""
        self.drafter_s += n * self.costs.pick_s
        self.picks_booked += n


def costs_from_json(obj: dict, name: str = "") -> MachineCosts:
    """MachineCosts from ``{"target": {depth: {n: seconds}}, "drafter": {n: seconds},
    "policy": {"batch_sizes", "verify_s", "draft_token_s"}, "step_s"}`` (keys may be strings)."""
    target = tuple(sorted((int(d), curve({int(n): s for n, s in pts.items()})) for d, pts in obj["target"].items()))
    drafter = obj.get("drafter")
    policy = obj.get("policy")
    return MachineCosts(
        name or obj.get("name", ""), target,
        curve({int(n): s for n, s in drafter.items()}) if drafter else None,
        CostModel(tuple(policy["batch_sizes"]), tuple(policy["verify_s"]), policy["draft_token_s"]) if policy else None,
        obj.get("step_s", 0.0))


def device_curve(entry: dict) -> CostModel:
    """A curve of benchmarks/device/measure.py (one ``curve-*.json`` entry), in seconds.

    Its n = 1 cost is the chain cost (consecutive one-token decodes, as decoding and drafting
    run them); a 512-token prefill timing fills in n = 512 where the curve stops short.
    """
    points = {int(p["n"]): p["ms"] for p in entry["curve"]}
    points[1] = entry.get("chain_ms_per_token", points.get(1))
    if 512 not in points and entry.get("prefill_512_ms"):
        points[512] = entry["prefill_512_ms"]
    return curve(points, 1e-3)


def mixed_key(config: str, per_shape: bool = False) -> str:
    """The name of ``config``'s ``measure.py mixed`` entry in results/mixed.json: a stock
    llama.cpp's, or with ``per_shape`` edgespec's patched build's."""
    return f"mixed-{config}{'-per-shape' if per_shape else ''}.json"


def graph_miss(entry: dict) -> float:
    """Seconds a decode costs beyond its curve without its context's CUDA graph, from one
    ``measure.py mixed`` entry: the median over batch sizes of the cost in random order over
    the cost one size at a time, both measured in the same process (its noise is per size)."""
    warm = {str(p["n"]): p["ms"] for p in entry["curve"]}
    return statistics.median(ms - warm[n] for n, ms in entry["mixed_ms"].items()) * 1e-3


def costs_from_device_curves(curves: dict, target: str, drafter: str | None, name: str = "",
                             step_s: float = 0.0, mixed: dict | None = None,
                             per_shape: bool = False) -> MachineCosts:
    """MachineCosts from benchmarks/device/results/curves.json: ``target`` and ``drafter`` name
    placements in it (e.g. "gpu-7b", "gpu-0.5b"); the target curve was measured after 512
    tokens of context, so it stands for every depth. ``mixed`` (results/mixed.json) prices a
    decode that misses its CUDA graph, for each of the two that has an entry there (mixed_key):
    a stock llama.cpp's, or with ``per_shape`` the patched one's, whose policy still calibrates
    at the stock miss."""
    def entry(config: str) -> dict:
        found = curves.get(f"curve-{config}.json")
        if found is None:
            raise ValueError(f"no curve {config!r}; have {', '.join(sorted(curves))}")
        return found

    def miss(config: str | None, shaped: bool = per_shape) -> float:
        found = (mixed or {}).get(mixed_key(config, shaped))
        return graph_miss(found) if found else 0.0

    t = entry(target)
    return MachineCosts(name or f"{target}+{drafter}", ((t.get("context", 512), device_curve(t)),),
                        device_curve(entry(drafter)) if drafter else None, step_s=step_s,
                        graph_miss_s=(miss(target), miss(drafter)), graphs_per_shape=per_shape,
                        calibration_miss_s=miss(target, False) if per_shape else None)


# -- the oracle target and the chain drafter -----------------------------------------------------
class TraceModel:
    """The model-facing part the request loop needs: EOG and (empty) token text."""

    def __init__(self, trace: PromptTrace):
        self._eog = trace.eog

    def is_eog(self, token: int) -> bool:
        return token == self._eog

    def token_piece(self, token: int) -> bytes:
        return b""


@dataclass(frozen=True)
class _Ctx:
    n_ctx: int

    def pick_on_backend(self, on: bool, every_row: bool = False) -> bool:
        return False  # a trace's rows are logits

    def top_on_backend(self, k: int) -> bool:
        return False


class _Row:
    """One row of a trace (edgespec.llama.rows.Row's interface)."""

    def __init__(self, logits: np.ndarray):
        self._logits = logits

    def logits(self) -> np.ndarray:
        return self._logits

    def greedy(self) -> int:
        return int(np.argmax(self._logits))

    def top(self) -> None:
        return None  # a trace's rows are logits


class _Verification:
    def __init__(self, seq: TraceSequence, pending: int, draft: DraftTree):
        self._seq, self._pending, self._draft = seq, pending, draft
        self._depth = draft.depth()
        self.committed = False
        self.rows = self  # edgespec.llama.rows.Rows's interface: rows(r), rows.greedy(r)

    def row(self, r: int) -> _Row:
        return _Row(self(r))

    def greedy(self, r: int) -> int:
        return int(np.argmax(self(r)))

    def __call__(self, r: int) -> np.ndarray:
        """Row r's logits (one-hot at the plain token); only rows on the plain path are known."""
        seq, q0 = self._seq, len(self._seq.tokens) + 1 - len(self._seq.prompt)
        path = self._draft.path_to(r - 1) if r > 0 else []
        if [int(self._draft.tokens[i]) for i in path] != list(seq.output[q0:q0 + len(path)]):
            raise AssertionError(f"row {r} is off the plain path: the trace does not know it")
        return seq.logits(q0 + len(path))

    def commit(self, path: Sequence[int]) -> None:
        self._seq.tokens.extend([self._pending] + [int(self._draft.tokens[i]) for i in path])
        self.committed = True


class TraceSequence:
    """KVSequence's interface over a trace: answers with the plain output, books each decode.

    The prompt's prefill (``sync``) is not booked: the bench times generation apart from it.
    """

    def __init__(self, trace: PromptTrace, ledger: Ledger, n_ctx: int, max_paths: int):
        self.prompt, self.output = trace.prompt, trace.output
        self.ledger, self.ctx, self.max_paths = ledger, _Ctx(n_ctx), max_paths
        self.tokens: list[int] = []
        self._unknown = max(max(self.prompt, default=0), max(self.output, default=0)) + 1

    def __len__(self) -> int:
        return len(self.tokens)

    def logits(self, q: int) -> np.ndarray:
        """One-hot at output[q]; past the recorded output at a token no draft holds."""
        row = np.zeros(self._unknown + 1, np.float32)
        row[self.output[q] if q < len(self.output) else self._unknown] = 1.0
        return row

    def sync(self, tokens: Sequence[int]) -> tuple[_Row, int]:
        keep = min(common_prefix(self.tokens, tokens), len(tokens) - 1)
        self.tokens = list(tokens)
        return _Row(self.logits(len(tokens) - len(self.prompt))), keep

    def append(self, token: int) -> _Row:
        self.ledger.target(1, len(self.tokens))
        self.tokens.append(int(token))
        return _Row(self.logits(len(self.tokens) - len(self.prompt)))

    def trim(self, n: int) -> None:
        del self.tokens[n:]

    @contextlib.contextmanager
    def verifying(self, pending: int, draft: DraftTree, alongside=None) -> Iterator[_Verification]:
        verify_s = self.ledger.target_s
        self.ledger.target(1 + len(draft), len(self.tokens))
        if alongside is not None:  # it runs on the other processor while the target verifies
            verify_s, drafter_s = self.ledger.target_s - verify_s, self.ledger.drafter_s
            alongside()
            self.ledger.hidden_s += min(self.ledger.drafter_s - drafter_s, verify_s)
        v = _Verification(self, pending, draft)
        yield v
        if not v.committed:
            raise AssertionError("a replayed verification must commit")


class TraceChainDrafter:
    """The `model` drafter's greedy chains, read from a DrafterTrace instead of a model.

    Mirrors ModelDrafter + draft_chain: it syncs its cache (``cache``: the drafter's KV tokens,
    shared the way the bench shares one drafter model between configurations and prompts),
    decodes one token per drafted token but the last of a budget-limited chain, and stops when
    its confidence falls below ``min_confidence``. Every decode is booked on the ledger.
    """

    name = "model"
    drafts_ahead = True

    def __init__(self, trace: PromptTrace, ledger: Ledger, n_ctx: int, cache: list[int] | None = None):
        if trace.drafter is None:
            raise ValueError(f"trace {trace.id} has no drafter data")
        self.trace, self.ledger, self.n_ctx = trace, ledger, n_ctx
        self.cache = cache if cache is not None else []

    def begin(self, prompt: Sequence[int], sampling=None, rng=None) -> None:
        pass

    def observe(self, emitted: Sequence[int]) -> None:
        pass

    def end(self) -> None:
        pass

    @property
    def nbytes(self) -> int:
        return 0

    def propose(self, context: Sequence[int], budget: int, stop=None) -> DraftTree:
        if budget <= 0 or len(context) + budget + 1 >= self.n_ctx:
            return DraftTree.empty(self.name)
        self._sync(context)
        tokens, confidences, decoded = self.chain(len(context) - len(self.trace.prompt), budget, stop)
        self.cache.extend(tokens[:decoded])
        for _ in range(decoded):
            self.ledger.drafter(1)
        self.ledger.picks(decoded + 1)  # the first reads the catch-up's row
        return DraftTree.chain(tokens, self.name, scores=np.cumprod(confidences))

    def guess(self, context: Sequence[int]) -> int:
        """Its greedy token after ``context``: recorded along the plain output (the only context
        where a guess is ever used); OFF_PATH past it."""
        self._sync(context)
        q = len(context) - len(self.trace.prompt)
        return self.trace.drafter.top(q) if q < len(self.trace.drafter.top_ids) else OFF_PATH

    def _sync(self, context: Sequence[int]) -> None:
        keep = min(common_prefix(self.cache, context), len(context) - 1)
        del self.cache[keep:]
        for start in range(keep, len(context), N_BATCH):
            self.ledger.drafter(min(N_BATCH, len(context) - start))
        self.cache.extend(context[keep:])

    def chain(self, p: int, budget: int, stop=None) -> tuple[list[int], list[float], int]:
        """The greedy chain drafted after output[:p] (OFF_PATH marks tokens past its first
        miss), its confidences, and how many of its tokens draft_chain decodes: all but the
        last unless low confidence ended it (seen only after decoding the last)."""
        d = self.trace.drafter
        tokens: list[int] = []
        confidences: list[float] = []
        for token, confidence in self._walk(p):
            if len(tokens) == budget:
                return tokens, confidences, budget - 1
            if confidence is None:
                raise ValueError(f"budget {budget} exceeds the recorded off-path cap {d.off_cap}")
            if confidence < d.min_confidence:
                return tokens, confidences, len(tokens)
            tokens.append(token)
            confidences.append(confidence)
            if len(tokens) < budget and stop is not None and stop(confidences):
                return tokens, confidences, len(tokens) - 1
        return tokens, confidences, len(tokens)

    def _walk(self, p: int):
        """(token, confidence) of the greedy chain from output position p, as far as recorded:
        past an off-path run the next confidence is below ``min_confidence``, or unknown (None)
        where the run reached the recorded cap."""
        d, out = self.trace.drafter, self.trace.output
        q = p
        while q < len(d.top_ids):
            # the stored log-prob is rounded: the recorded flag decides whether it was confident
            confidence = max(float(np.exp(d.top_logprobs[q][0])), d.min_confidence) if d.confident(q) else 0.0
            yield d.top(q), confidence  # the caller stops here unless it was confident
            if d.top(q) != out[q]:
                run = d.off_logprobs[q] if d.off_logprobs is not None else (np.log(d.min_confidence),) * d.off_run[q]
                for lp in run:
                    yield OFF_PATH, max(float(np.exp(lp)), d.min_confidence)
                yield OFF_PATH, (None if d.off_run[q] >= d.off_cap else 0.0)
                return
            q += 1
        yield OFF_PATH, 0.0  # past the recorded output: not confident


# -- simulation -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplaySettings:
    """The bench settings replay mirrors (BenchSettings' defaults); greedy only."""

    max_tokens: int = 256
    draft_max: int = 32
    n_ctx: int = 4096
    # auto carries what it learned from prompt to prompt (PolicyMemory), as it does in the
    # bench and for a user: the first prompt starts from priors, later ones from the earlier
    remember: bool = True


GREEDY = SamplingParams(temperature=0.0)


def make_drafter(config: str, trace: PromptTrace, ledger: Ledger, costs: MachineCosts,
                 settings: ReplaySettings, cache: list[int] | None = None, sizes=None, memory=None):
    """A fresh drafter for one (prompt, config), as the bench builds one per run; ``sizes``: the
    tree-size policy (TreeSizes) the shared drafter model carries between runs; ``memory``:
    auto's PolicyMemory."""
    if config == "suffix":
        return suffix_drafter(settings.draft_max)
    if config.endswith(TREE):
        from replay_trees import TraceTreeDrafter

        auto = config == "auto" + TREE  # auto sizes the trees itself: the drafter takes its size
        model = TraceTreeDrafter(trace, ledger, settings.n_ctx, cache, sizes, None if auto else costs.policy_model())
        if auto:
            return _auto(model, ledger, costs, settings, memory, tree=True)
        return model if config == "model" + TREE else HybridDrafter(suffix_drafter(settings.draft_max), model)
    model = TraceChainDrafter(trace, ledger, settings.n_ctx, cache) if trace.drafter is not None else None
    if config in ("model", "model" + OVERLAP) and model is not None:
        return model
    if config == "hybrid" and model is not None:
        return HybridDrafter(suffix_drafter(settings.draft_max), model)
    if config == "auto":
        return _auto(model, ledger, costs, settings, memory)
    raise ValueError(f"config {config!r} cannot be replayed from trace {trace.id} (replayable: {CONFIGS})")


def _auto(model, ledger: Ledger, costs: MachineCosts, settings: ReplaySettings, memory,
          tree: bool = False) -> AutoDrafter:
    """`auto` over the trace's drafter model (None: none recorded), loaded only where the load
    rule says; what it learns is kept under the drafter's name for its shape (draft_shape_name:
    chains where trees measured a loss)."""
    name = draft_shape_name(memory, "model", tree)[0]
    loads = model is not None and costs.drafter is not None and auto_loads(costs, settings, memory, name)
    return AutoDrafter(suffix_drafter(settings.draft_max), costs.policy_model(), model=model if loads else None,
                       memory=memory, model_name=name if memory is not None else None, clock=lambda: ledger.seconds,
                       shape=(lambda: draft_shape_name(memory, "model", tree)) if memory is not None else None)


def auto_loads(costs: MachineCosts, settings: ReplaySettings, memory=None, name: str = "model") -> bool:
    """Whether `auto` would load the drafter model (edgespec.drafters.auto.select's rule): only
    if its steps gain (as measured in ``memory`` under ``name``, else by its prior). The bench
    builds auto per run, so replay asks per prompt."""
    policy = costs.policy_model()
    learned = memory.drafter_gain(name) if memory is not None else None
    return pays(policy, policy.draft_token_s, settings.draft_max, learned)


def run_replay(trace: PromptTrace, config: str, costs: MachineCosts, settings: ReplaySettings = ReplaySettings(),
               cache: list[int] | None = None, sizes=None, memory=None, *,
               new_ledger: Callable[[MachineCosts], Ledger] = Ledger) -> tuple[DoneEvent, Ledger]:
    """Runs the real request loop for one (prompt, config) over the trace: its DoneEvent (token
    ids, SpecStats) and the ledger of booked decodes (made by ``new_ledger``).

    ``cache``: the drafter model's KV tokens carried over from earlier runs (the bench shares
    one drafter model between configurations and prompts); None: an empty cache.
    """
    ledger = new_ledger(costs)
    seq = TraceSequence(trace, ledger, settings.n_ctx, settings.draft_max)
    step = None if config == PLAIN else SpeculativeStep(
        make_drafter(config, trace, ledger, costs, settings, cache, sizes, memory), settings.draft_max,
        overlap=config.endswith(OVERLAP))
    done = Decoder(TraceModel(trace), seq, step).generate(
        list(trace.prompt), GenerationRequest(max_tokens=settings.max_tokens, sampling=GREEDY))
    if list(done.token_ids) != list(trace.output[:len(done.token_ids)]):
        raise AssertionError(f"{trace.id}/{config}: replayed output left the plain output")
    return done, ledger


def replay_prompt(trace: PromptTrace, config: str, costs: MachineCosts, settings: ReplaySettings = ReplaySettings(),
                  cache: list[int] | None = None, sizes=None, memory=None, *,
                  new_ledger: Callable[[MachineCosts], Ledger] = Ledger) -> Record:
    """Replays one prompt under one configuration: a bench Record with simulated seconds."""
    done, ledger = run_replay(trace, config, costs, settings, cache, sizes, memory, new_ledger=new_ledger)
    n = len(done.token_ids)
    spec = done.stats.spec
    steps = spec.steps if spec is not None else max(n - 1, 0)
    seconds = ledger.seconds + ledger.target_decodes * costs.step_s
    return Record(id=trace.id, category=trace.category, config=config, new_tokens=n, gen_s=seconds,
                  prefill_s=0.0, steps=steps, drafted=spec.drafted if spec else 0,
                  accepted=spec.accepted if spec else 0, peak_rss_bytes=0, text="",
                  gen_tokens=max(n - 1, 0), same_as_plain=True)


def check_settings(trace: Trace, settings: ReplaySettings, configs: Sequence[str] = ("model",)) -> None:
    """Refuses settings the trace cannot answer for (chains: ``draft_max`` within the recorded
    off-path runs; trees: every position up to ``max_tokens`` recorded)."""
    if settings.max_tokens > trace.max_tokens:
        raise ValueError(f"trace recorded {trace.max_tokens} tokens per prompt; max_tokens {settings.max_tokens} "
                         "needs a longer recording")
    chains = [c for c in configs if c not in (PLAIN, "suffix") and not c.endswith(TREE)]
    caps = {p.drafter.off_cap for p in trace.prompts if p.drafter is not None}
    short = bool(caps) and settings.draft_max > min(caps) + 1  # chains recorded shorter than draft_max
    if chains and short:
        raise ValueError(f"draft_max {settings.draft_max} exceeds the recorded chains ({min(caps) + 1} tokens)")
    if "auto" + TREE in configs and short:
        log.warning("%s: auto-tree's chains are replayed up to %d tokens (the runs recorded after a miss), not "
                    "draft_max %d (trees and suffix drafts use all of it)", trace.suite, min(caps) + 1,
                    settings.draft_max)
    if ("auto" in configs or "auto" + TREE in configs) and any(
            p.drafter is not None and p.drafter.off_logprobs is None for p in trace.prompts):
        log.warning("%s: recorded before off-path confidences were kept; auto's chains past a miss are "
                    "priced at min_confidence (record.py --redraft records them)", trace.suite)
    if any(c.endswith(TREE) for c in configs):
        for p in trace.prompts:
            if p.trees is None or len(p.trees.accepted) < min(len(p.output), settings.max_tokens) - 1:
                raise ValueError(f"trace {p.id} has no tree records up to {settings.max_tokens} tokens")
            if p.trees.budgets != trace.prompts[0].trees.budgets:
                raise ValueError(f"trace {p.id} recorded other tree sizes than {trace.prompts[0].id}")


def replay(trace: Trace, configs: Sequence[str], costs: MachineCosts, settings: ReplaySettings = ReplaySettings(),
           ids: Sequence[str] | None = None, *,
           new_ledger: Callable[[MachineCosts], Ledger] = Ledger) -> list[Record]:
    """Every (prompt, config) in the bench's interleaved order (plain first), one shared
    drafter cache; ``ids`` restricts the prompts; each run books its decodes on a ledger
    ``new_ledger`` makes. Summarize with edgespec.bench.summary."""
    wanted = None if ids is None else set(ids)
    chosen = tuple(p for p in trace.prompts if wanted is None or p.id in wanted)
    check_settings(Trace(trace.suite, trace.max_tokens, chosen), settings, configs)
    configs = [PLAIN] + [c for c in dict.fromkeys(configs) if c != PLAIN]
    cache: list[int] = []
    recorded = [p.trees.budgets for p in chosen if p.trees is not None]
    sizes = TreeSizes(recorded[0] if recorded else TREE_SIZES)  # one drafter model, one policy, as the bench shares
    records = []
    with tempfile.TemporaryDirectory() as home:
        memory = PolicyMemory(Path(home), "replay") if settings.remember else None
        for p in chosen:
            for config in configs:
                records.append(replay_prompt(p, config, costs, settings, cache, sizes, memory,
                                             new_ledger=new_ledger))
    log.info("replayed %d runs of %s on %s", len(records), trace.suite, costs.name)
    return records


def overall(records: list[Record]) -> dict[str, dict]:
    """summary[config]["overall"] of edgespec.bench.summary (tokens_per_s, speedup, ...)."""
    return {cfg: cells["overall"] for cfg, cells in summarize(records).items()}


# -- recording (any context with LlamaContext's interface: the real one or tests' exact fake) ----
def record_plain(decoder: Decoder, prompt: Sequence[int], max_tokens: int) -> tuple[tuple[int, ...], str]:
    """The plain greedy output and its finish reason; an EOG ending is appended to the output.

    The EOG token is not in the answer, so it is read again from the last row, decoded alone
    as plain decoding decoded it.
    """
    done = decoder.generate(list(prompt), GenerationRequest(max_tokens=max_tokens, sampling=GREEDY))
    output = list(done.token_ids)
    if done.stats.finish_reason == "stop":
        logits = decoder.seq.sync(list(prompt) + output)[0].logits()
        output.append(int(np.argmax(logits)))
        if not decoder.model.is_eog(output[-1]):
            raise ValueError("a stop without an EOG token (stop strings are not replayable)")
    return tuple(output), done.stats.finish_reason


def teacher_forced(ctx, tokens: Sequence[int], first: int):
    """Decodes ``tokens`` in sequence 0 in ``n_batch`` chunks; yields (i - first, logits after
    tokens[:i + 1]) for every i >= first."""
    for start in range(0, len(tokens), ctx.n_batch):
        chunk = list(tokens[start:start + ctx.n_batch])
        flags = [start + i >= first for i in range(len(chunk))]
        rows = ctx.decode(chunk, range(start, start + len(chunk)), [[0]] * len(chunk), flags)
        for k, i in enumerate(i for i in range(len(chunk)) if flags[i]):
            yield start + i - first, rows[k]


def _free_runs(ctx, base: int, misses: dict[int, int], min_confidence: float,
               cap: int) -> dict[int, tuple[float, ...]]:
    """For each miss q -> drafted token: the log-probs of the tokens the greedy chain drafts
    after it (their count is the run's length).

    Sequence 0 holds prompt + output; each miss gets its own sequence sharing the prefix, and
    all chains advance together, one batch per round.
    """
    state = {}  # seq id -> [token, position, log-probs drafted after the miss, q]
    for s, (q, token) in enumerate(misses.items(), start=1):
        ctx.seq_cp(0, s, 0, base + q)
        state[s] = [token, base + q, [], q]
    runs = {}
    try:
        while state:
            seqs = list(state)
            rows = ctx.decode([state[s][0] for s in seqs], [state[s][1] for s in seqs], [[s] for s in seqs],
                              [True] * len(seqs))
            for s, row in zip(seqs, rows):
                t, lp = greedy_logprob(row)
                st = state[s]
                if np.exp(lp) >= min_confidence and len(st[2]) < cap:
                    st[0], st[1] = t, st[1] + 1
                    st[2].append(lp)
                if np.exp(lp) < min_confidence or len(st[2]) >= cap:
                    runs[st[3]] = tuple(st[2])
                    del state[s]
    finally:
        for s in range(1, len(misses) + 1):
            ctx.seq_rm(s, -1, -1)
    return runs


def record_drafter(ctx, prompt: Sequence[int], output: Sequence[int], min_confidence: float = 0.4,
                   off_cap: int = 31, top_k: int = 3) -> DrafterTrace:
    """The drafter's DrafterTrace for one prompt (``ctx``: the drafter's context, cleared here;
    it needs ``n_seq_max`` >= 2 and room for prompt + output + (n_seq_max - 1) * off_cap cells)."""
    ctx.clear()
    n = len(output)
    top_ids, top_lps, plain_lp = [()] * n, [()] * n, [0.0] * n
    # prompt + output[:-1]: row q (from the prompt's last token on) predicts output[q]
    for q, row in teacher_forced(ctx, list(prompt) + list(output[:-1]), len(prompt) - 1):
        lp = log_softmax(row)
        ids = np.argsort(-lp, kind="stable")[:top_k]
        top_ids[q], top_lps[q] = tuple(int(i) for i in ids), tuple(float(lp[i]) for i in ids)
        plain_lp[q] = float(lp[output[q]])
    confident = tuple(bool(np.exp(lps[0]) >= min_confidence) for lps in top_lps)
    misses = {q: top_ids[q][0] for q in range(n) if top_ids[q][0] != output[q] and confident[q]}
    off: list[tuple[float, ...]] = [()] * n
    group = ctx.n_seq_max - 1
    items = list(misses.items())
    for g in range(0, len(items), group):
        for q, run in _free_runs(ctx, len(prompt), dict(items[g:g + group]), min_confidence, off_cap).items():
            off[q] = run
    ctx.clear()
    return DrafterTrace(tuple(top_ids), tuple(top_lps), tuple(plain_lp), confident, tuple(len(r) for r in off),
                        min_confidence, off_cap, tuple(off))
