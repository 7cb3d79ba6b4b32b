"""Speculation never changes what the target says: real llama.cpp behaves like the exact fake.

tests/test_plumbing.py proves the plumbing (tree layout, commit, rollback, every drafter) on an
exact fake model. Here real models show llama.cpp keeps the fake's promises:

* F32 SmolLM2 (batched logits within ~0.05 of one-token logits): speculative greedy output
  equals plain greedy output token for token, one test per drafter family.
* Q4_K_M Qwen pair (a real target and drafter): drafting happens and pays, and the rare
  divergences each sit at a measured near-tie: plain decoding's two candidates there are closer
  than batched evaluation moves those very logits.
* T = 0.8: the first tokens follow plain sampling's exact law (chi-square goodness of fit).
* KV integrity: after many steps with rejections the cache equals a fresh prefill.
"""
from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from scipy.stats import chisquare

from conftest import DRAFTER, SMALL, TARGET
from edgespec.llama.backend import ContextParams, LlamaContext, LlamaModel
from edgespec.engine import Engine, EngineConfig
from edgespec.errors import IncompatibleModels
from edgespec.decode.request import GenerationRequest
from edgespec.files.gguf import read_gguf
from edgespec.decode.sampling import SamplingParams, recent_window, target_probs
from edgespec.files.vocab import check_compatible
from f32_model import build_f32_copy
from near_ties import batched_vs_single_deviation, near_tie

log = logging.getLogger(__name__)

GREEDY = SamplingParams(temperature=0.0)

# Varied on purpose: free writing, code, lists, translation, and copy-heavy requests where the
# suffix drafter has long matches.
PROMPTS = [
    "Write a short story about a dragon who loves tea.",
    "def merge_sort(xs):\n    \"\"\"Sort a list.\"\"\"",
    "List the planets of the solar system with one fact each.",
    "Translate to French: The weather is lovely today and I want to walk in the park.",
    "Explain what a hash table is to a ten-year-old.",
    "Repeat the following text exactly: The quick brown fox jumps over the lazy dog. "
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.",
    "Write a haiku about autumn leaves.",
    "What are the main causes of the French Revolution?",
    "Convert this to a numbered list: apples, bananas, cherries, dates, elderberries, figs, grapes.",
    "Summarize: Photosynthesis is the process by which green plants use sunlight to make food "
    "from carbon dioxide and water, releasing oxygen.",
    "Add type hints to this function:\ndef add(a, b):\n    return a + b\n\n"
    "def scale(values, factor):\n    return [v * factor for v in values]\n",
    "Give me a recipe for pancakes.",
    "Write a SQL query that counts users per country.",
    "What is 17 multiplied by 23? Show your steps.",
    "Write a limerick about a cat named Bob.",
    "Rename the variable x to count in this code:\nx = 0\nfor item in items:\n    x += 1\nprint(x)\n",
    "Describe the water cycle in three sentences.",
    "Write a JSON object describing a book with title, author and year.",
    "Why is the sky blue?",
    "Continue the sequence: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
]
# One per drafter family; `none` and `auto` are proved on the fake (auto's choices depend on
# timing, so a real run would not be reproducible).
DRAFTS = [("suffix", False), ("model", False), ("model", True), ("hybrid", False)]
# The quantized pair: prompts where suffix drafts have long matches (copying) and where only a
# model can guess (free text), so both drafters really draft on them.
# Per family, F32: free text, code, a list and copy-heavy edits, so suffix, model and tree
# drafts all draft and get rejected. The fake (tests/test_plumbing.py) already checks thousands
# of random trees, acceptances and rollbacks per drafter; these show llama.cpp keeps the same
# promises, which ~150 real tokens per family do as well as thousands (6 x 24 = 144;
# 108-142 drafted and 54-106 accepted per family; an F32 token of SmolLM2-135M costs ~40 ms here,
# all of it in llama_decode): a KV or acceptance bug parts nearly every answer early.
F32_PROMPTS = [PROMPTS[i] for i in (0, 1, 5, 8, 10, 15)]
F32_TOKENS = 24
# The quantized pair proves what F32 cannot: a real target with a real drafter model, where
# batched numerics flip near-ties. Suffix drafting on the same target adds nothing the F32
# suffix test and this one do not already show.
QUANT_PROMPTS = [PROMPTS[i] for i in (0, 1, 5, 10)]
QUANT_DRAFTS = [("model", False)]
QUANT_TOKENS = 24


def _generate_all(engine: Engine, n_tokens: int, prompts) -> list[tuple[tuple[int, ...], dict]]:
    req = GenerationRequest(max_tokens=n_tokens, sampling=GREEDY, ignore_eos=True)
    out = []
    for prompt in prompts:
        engine.reset()
        done = engine.chat([{"role": "user", "content": prompt}], req)
        out.append((done.token_ids, done.stats.spec.to_dict() if done.stats.spec else {}))
    return out


class PlainRun:
    """Plain greedy answers to ``prompts`` and what is needed to judge a divergence."""

    def __init__(self, model: str, n_tokens: int, prompts, measure_deviation: bool = True):
        with Engine(EngineConfig(model=model, n_ctx=1024)) as engine:
            self.tokens = [t for t, _ in _generate_all(engine, n_tokens, prompts)]
            self.prompts = [engine.chat_tokens([{"role": "user", "content": p}]) for p in prompts]
            # The whole answer's worst batched-vs-one-token difference: the F32 test's bound.
            # Quantized divergences are judged by the deviation local to each one instead.
            self.deviation = batched_vs_single_deviation(engine.model, self.prompts[0] + list(self.tokens[0])) \
                if measure_deviation else None

    def divergences(self, engine: Engine, results) -> list[dict]:
        """Each prompt whose speculative answer differs, measured at its first divergence."""
        out = []
        for i, (spec, _) in enumerate(results):
            if spec == self.tokens[i]:
                continue
            j = next(k for k, (a, b) in enumerate(zip(spec, self.tokens[i])) if a != b)
            out.append({"prompt": i, **near_tie(engine, self.prompts[i], self.tokens[i], spec, j)})
        return out


def _assert_near_ties(divergences: list[dict]) -> None:
    for d in divergences:
        assert 0 <= d["gap"] <= 2 * d["local_deviation"], f"not a near-tie: {d}"


def _assert_drafting_happened(draft: str, results) -> tuple[int, int]:
    drafted = sum(s["drafted"] for _, s in results)
    accepted = sum(s["accepted"] for _, s in results)
    # The drafter really drafted and the engine really accepted: not plain decoding in disguise.
    assert drafted > 10 * len(results) and accepted > 5 * len(results), (draft, drafted, accepted)
    return drafted, accepted


def _report(store, name: str, draft: str, tree: bool, run: PlainRun, results, divergences: list[dict]) -> None:
    report = {"draft": draft, "tree": tree, "prompts": len(results), "diverged": len(divergences),
              "drafted": sum(s["drafted"] for _, s in results),
              "accepted": sum(s["accepted"] for _, s in results),
              "batched_vs_single_max_deviation": run.deviation, "divergences": divergences}
    out = store.home / "test-reports" / f"{name}-{draft}{'-tree' if tree else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    log.warning("%s %s%s: %d/%d prompts diverged at near-ties, deviation %s; report %s", name,
                draft, "/tree" if tree else "", len(divergences), len(results), run.deviation, out)


# -- strict: F32 target ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def f32_path(store, model_path):
    return build_f32_copy(model_path(SMALL), store.home / "test-cache" / "smollm2-135m-f32.gguf")


@pytest.fixture(scope="module")
def f32_plain(f32_path):
    return PlainRun(str(f32_path), F32_TOKENS, F32_PROMPTS)


@pytest.mark.parametrize("draft, tree", DRAFTS)
def test_f32_speculative_greedy_equals_plain(draft, tree, f32_path, f32_plain, model_path, store):
    """Token-for-token equality; the only admissible difference is a genuine tie.

    Even in F32, a prompt can reach a position where plain decoding's two best logits are
    closer than llama.cpp's batched-vs-one-token difference (0.002 apart was seen here): there
    no verifier can promise the same pick. Such a divergence must be a tie that small, and rare.
    """
    cfg = EngineConfig(model=str(f32_path), n_ctx=1024, draft=draft, draft_tree=tree,
                       draft_model=str(model_path(SMALL)), draft_max=8)
    with Engine(cfg) as engine:
        results = _generate_all(engine, F32_TOKENS, F32_PROMPTS)
        divergences = f32_plain.divergences(engine, results)
    _report(store, "f32", draft, tree, f32_plain, results, divergences)
    assert f32_plain.deviation < 0.1  # F32 batched numerics are tight
    _assert_near_ties(divergences)
    assert len(divergences) <= 1, divergences
    _assert_drafting_happened(draft, results)


# -- quantized: Qwen pair, modulo numerics near-ties -----------------------------------------
# Q4_K_M numerics: batched rows differ from one-token rows by up to ~2 logits on this CPU, so
# greedy answers part at near-ties often: 7-11 of 20 answers per drafter over 64 tokens (README,
# AVX-512 VM), at most 55%; the model drafter parted 1 of 6 answers over 48 tokens here (gap
# 0.004 against a local deviation of 0.59; 253 drafted, 211 accepted). Bound: 2 of 4 (50%). A
# KV or acceptance bug parts nearly every answer, and not only where the two candidates are
# within the deviation.
MAX_QUANT_DIVERGENCES = 2


@pytest.fixture(scope="module")
def qwen_plain(model_path):
    model_path(DRAFTER)
    return PlainRun(TARGET, QUANT_TOKENS, QUANT_PROMPTS, measure_deviation=False)


@pytest.mark.parametrize("draft, tree", QUANT_DRAFTS)
def test_quantized_speculation_drafts_and_diverges_only_at_rare_near_ties(draft, tree, qwen_plain, store):
    with Engine(EngineConfig(model=TARGET, n_ctx=1024, draft=draft, draft_tree=tree, draft_max=8)) as engine:
        assert engine.ctx.n_outputs_max == 65  # logits rows: the pending token and 64 drafted
        results = _generate_all(engine, QUANT_TOKENS, QUANT_PROMPTS)
        divergences = qwen_plain.divergences(engine, results)
    _report(store, "quantized", draft, tree, qwen_plain, results, divergences)
    _assert_drafting_happened(draft, results)
    _assert_near_ties(divergences)
    assert len(divergences) <= MAX_QUANT_DIVERGENCES, divergences


# -- sampling: the distribution is unchanged -------------------------------------------------
SAMPLING_PROMPT = ("Repeat exactly: the cat sat on the mat. the cat sat on the mat. "
                   "the cat sat on the mat. the cat sat on the")
# Seeds per configuration, tested against the exact joint law of the first five tokens: a
# one-sample test, whose statistic has half the variance of a two-sample one, so 120 seeds test
# as sharply as 240 against 240 plain samples would. The exact fake (tests/test_acceptance.py)
# proves the test's power at thousands of samples; here it shows llama.cpp's rows feed the same
# law, which a wrong row or a lost rejection breaks grossly.
N_SEEDS = 120
N_TOKENS = 5
# Sequences less likely than this under the exact law are not enumerated: cells need n * p >= 5
# (p >= 0.042 at 120 seeds), and all the rest is pooled into one cell.
ENUMERATE_MIN_P = 0.002
SAMPLING = SamplingParams(temperature=0.8)


def _answers(engine: Engine, seeds) -> tuple[list[tuple[int, ...]], int]:
    """The first N_TOKENS tokens of a T=0.8 answer for each seed, and how many were drafted."""
    prompt = engine.text_tokens(SAMPLING_PROMPT)
    out, drafted = [], 0
    for s in seeds:
        req = GenerationRequest(max_tokens=N_TOKENS, ignore_eos=True, sampling=replace(SAMPLING, seed=s))
        done = list(engine.decoder.stream(prompt, req))[-1]
        out.append(tuple(done.token_ids))
        drafted += (done.stats.spec.drafted if done.stats.spec else 0)
    return out, drafted


def _plain_law(model, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """The exact law of plain sampling's first N_TOKENS tokens, as plain decoding computes it:
    the probability of every prefix (lengths 0..N_TOKENS) of probability >= ENUMERATE_MIN_P,
    each next-token distribution from a one-token decode after the prefix (plain decoding's own
    path) through ``target_probs``."""
    ctx = LlamaContext(model, ContextParams(n_ctx=512))
    law: dict[tuple[int, ...], float] = {(): 1.0}

    def expand(prefix: list[int], logits) -> None:
        probs = target_probs(logits, SAMPLING, recent_window(prompt + prefix, SAMPLING))
        for tok in np.flatnonzero(probs * law[tuple(prefix)] >= ENUMERATE_MIN_P):
            seq = prefix + [int(tok)]
            law[tuple(seq)] = law[tuple(prefix)] * float(probs[tok])
            if len(seq) < N_TOKENS:
                pos = len(prompt) + len(prefix)
                expand(seq, ctx.decode([int(tok)], [pos], [[0]], [True])[0])
                ctx.seq_rm(0, pos, -1)

    try:
        last = ctx.decode(prompt, range(len(prompt)), [[0]] * len(prompt),
                          [False] * (len(prompt) - 1) + [True])[0]
        expand([], last)
    finally:
        ctx.close()
    return law


def _cells(law: dict[tuple[int, ...], float], n: int) -> dict[tuple[int, ...], float]:
    """Cells of the answer tree, each expected >= 5 times in n draws: a prefix stands for the
    answers under it that no deeper cell takes; its own remainder below 5 goes to the root's."""
    cells: dict[tuple[int, ...], float] = {}
    spill = 0.0

    def visit(node: tuple[int, ...]) -> None:
        nonlocal spill
        kids = [k for k in law if len(k) == len(node) + 1 and k[:-1] == node and n * law[k] >= 5]
        for k in kids:
            visit(k)
        rest = law[node] - sum(law[k] for k in kids)
        if node and n * rest < 5:
            spill += rest
        else:
            cells[node] = rest
    visit(())
    cells[()] += spill
    return cells


def _cell_of(answer: tuple[int, ...], cells) -> tuple[int, ...]:
    """The deepest cell whose prefix the answer starts with."""
    return max((c for c in cells if answer[:len(c)] == c), key=len)


def _goodness_of_fit_p(samples: list[tuple[int, ...]], law: dict[tuple[int, ...], float]) -> tuple[float, int]:
    """Chi-square of the samples against the exact law over the answer tree's cells; and how
    many cells there were."""
    cells = _cells(law, len(samples))
    counts = Counter(_cell_of(tuple(s), cells) for s in samples)
    observed = [counts[c] for c in cells]
    expected = [len(samples) * p for p in cells.values()]
    return float(chisquare(observed, expected)[1]), len(cells)


@pytest.fixture(scope="module")
def plain_law(f32_path):
    model = LlamaModel(str(f32_path))
    try:
        prompt = model.tokenize(SAMPLING_PROMPT, add_special=True, parse_special=False)
        return _plain_law(model, prompt)
    finally:
        model.close()


@pytest.mark.parametrize("draft", ["suffix", "model"])
def test_sampling_distribution_is_unchanged(draft, f32_path, plain_law, model_path):
    """Speculative samples follow plain sampling's exact law (joint law of the first tokens)."""
    cfg = EngineConfig(model=str(f32_path), n_ctx=512, draft=draft, draft_model=str(model_path(SMALL)),
                       draft_max=6)
    with Engine(cfg) as engine:
        spec, drafted = _answers(engine, range(10_000, 10_000 + N_SEEDS))
    assert drafted > N_SEEDS  # speculation was really exercised
    p, cells = _goodness_of_fit_p(spec, plain_law)
    assert cells >= 5  # the answer tree is split finely enough to compare
    assert p > 1e-3, f"{draft}: speculative samples do not follow plain sampling's law (p={p:.2e})"


# -- KV integrity ------------------------------------------------------------------------------
# Tree verification with path sequences (greedy) and sampled suffix trees; the fake checks the
# same invariant over thousands of steps, this shows llama.cpp's cache keeps it too.
@pytest.mark.parametrize("draft, tree, temperature", [("suffix", False, 1.0), ("model", True, 0.0)])
def test_cache_equals_fresh_prefill_after_rejections(draft, tree, temperature, f32_path, model_path):
    cfg = EngineConfig(model=str(f32_path), n_ctx=1024, draft=draft, draft_tree=tree,
                       draft_model=str(model_path(SMALL)), draft_max=8)
    with Engine(cfg) as engine:
        req = GenerationRequest(max_tokens=64, ignore_eos=True,
                                sampling=SamplingParams(temperature=temperature, seed=3))
        done = engine.chat([{"role": "user", "content": PROMPTS[0]}], req)
        assert done.stats.spec.accepted < done.stats.spec.drafted  # there were rejections
        cached = list(engine.seq.tokens)
        assert engine.ctx.seq_pos_max(0) == len(cached) - 1
        assert all(engine.ctx.seq_pos_max(s) == -1 for s in range(1, engine.ctx.n_seq_max))
        probe = done.token_ids[-1]
        after_steps = engine.ctx.decode([probe], [len(cached)], [[0]], [True])[0]
        fresh = LlamaContext(engine.model, ContextParams(n_ctx=1024))
        try:
            seq = cached + [probe]
            ref = fresh.decode(seq, range(len(seq)), [[0]] * len(seq), [False] * (len(seq) - 1) + [True])[0]
        finally:
            fresh.close()
    assert np.abs(after_steps - ref).max() < 0.1
    assert int(np.argmax(after_steps)) == int(np.argmax(ref))


# -- vocabulary check --------------------------------------------------------------------------
def test_vocabulary_check(model_path):
    qwen, qwen_small = read_gguf(model_path(TARGET)), read_gguf(model_path(DRAFTER))
    check_compatible(qwen, qwen_small)
    with pytest.raises(IncompatibleModels, match="vocabulary sizes differ|token 5 differs|BOS"):
        check_compatible(qwen, read_gguf(model_path(SMALL)))
    with pytest.raises(IncompatibleModels, match="tokenizer type"):
        check_compatible(qwen, read_gguf(model_path("gemma3-270m")))
