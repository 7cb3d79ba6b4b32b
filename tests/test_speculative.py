"""Speculation never changes what the target says: real llama.cpp behaves like the exact fake.

tests/test_plumbing.py proves the plumbing (tree layout, commit, rollback, every drafter) on an
exact fake model. Here real models show llama.cpp keeps the fake's promises:

* F32 SmolLM2 (batched logits within ~0.05 of one-token logits): speculative greedy output
  equals plain greedy output token for token, one test per drafter family.
* Q4_K_M Qwen pair (a real target and drafter): drafting happens and pays, and the rare
  divergences each sit at a measured near-tie: plain decoding's two candidates there are closer
  than batched evaluation moves those very logits.
* T = 0.8: the distribution of the first tokens matches plain sampling (chi-square).
* KV integrity: after many steps with rejections the cache equals a fresh prefill.
"""
from __future__ import annotations

import json
import logging
from collections import Counter

import numpy as np
import pytest
from scipy.stats import chi2_contingency

from conftest import DRAFTER, SMALL, TARGET
from edgespec.llama.backend import ContextParams, LlamaContext
from edgespec.engine import Engine, EngineConfig
from edgespec.errors import IncompatibleModels
from edgespec.decode.request import GenerationRequest
from edgespec.files.gguf import read_gguf
from edgespec.decode.sampling import SamplingParams
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
# promises, which a few hundred real tokens per family do as well as thousands.
F32_PROMPTS = [PROMPTS[i] for i in (0, 1, 5, 8, 10, 15)]
F32_TOKENS = 64
# The quantized pair proves what F32 cannot: a real target with a real drafter model, where
# batched numerics flip near-ties. Suffix drafting on the same target adds nothing the F32
# suffix test and this one do not already show.
QUANT_PROMPTS = [PROMPTS[i] for i in (0, 1, 5, 10)]
QUANT_DRAFTS = [("model", False)]
QUANT_TOKENS = 40


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
        results = _generate_all(engine, QUANT_TOKENS, QUANT_PROMPTS)
        divergences = qwen_plain.divergences(engine, results)
    _report(store, "quantized", draft, tree, qwen_plain, results, divergences)
    _assert_drafting_happened(draft, results)
    _assert_near_ties(divergences)
    assert len(divergences) <= MAX_QUANT_DIVERGENCES, divergences


# -- sampling: the distribution is unchanged -------------------------------------------------
SAMPLING_PROMPT = ("Repeat exactly: the cat sat on the mat. the cat sat on the mat. "
                   "the cat sat on the mat. the cat sat on the")
# Seeds per configuration: the joint law of three tokens, cells of >= 10 counts. The exact fake
# (tests/test_acceptance.py) proves the test's power at thousands of samples; here it shows
# llama.cpp's rows feed the same law, which a wrong row or a lost rejection breaks grossly.
N_SEEDS = 200


def _first_tokens(engine: Engine, seeds) -> tuple[list[tuple[int, ...]], int]:
    """Tokens 2-4 of a T=0.8 answer for each seed, and how many tokens were drafted in all."""
    prompt = engine.text_tokens(SAMPLING_PROMPT)
    runner = engine.decoder
    out, drafted = [], 0
    for s in seeds:
        req = GenerationRequest(max_tokens=4, ignore_eos=True, sampling=SamplingParams(temperature=0.8, seed=s))
        done = list(runner.stream(prompt, req))[-1]
        out.append(done.token_ids[1:4])  # the first token comes from the prefill in both
        drafted += (done.stats.spec.drafted if done.stats.spec else 0)
    return out, drafted


def _contingency_p(a: list, b: list) -> float:
    counts_a, counts_b = Counter(a), Counter(b)
    common = [k for k in set(counts_a) | set(counts_b) if counts_a[k] + counts_b[k] >= 10]
    rows = [[counts_a[k] for k in common] + [sum(v for k, v in counts_a.items() if k not in common)],
            [counts_b[k] for k in common] + [sum(v for k, v in counts_b.items() if k not in common)]]
    rows = [r for r in zip(*rows) if sum(r) > 0]
    return float(chi2_contingency(np.array(rows).T)[1])


@pytest.fixture(scope="module")
def plain_samples(f32_path):
    with Engine(EngineConfig(model=str(f32_path), n_ctx=512)) as engine:
        return _first_tokens(engine, range(N_SEEDS))[0]


@pytest.mark.parametrize("draft", ["suffix", "model"])
def test_sampling_distribution_is_unchanged(draft, f32_path, plain_samples, model_path):
    cfg = EngineConfig(model=str(f32_path), n_ctx=512, draft=draft, draft_model=str(model_path(SMALL)),
                       draft_max=6)
    with Engine(cfg) as engine:
        spec, drafted = _first_tokens(engine, range(10_000, 10_000 + N_SEEDS))
    assert drafted > N_SEEDS  # speculation was really exercised
    assert len(set(plain_samples)) > 3  # the test has something to compare
    p = _contingency_p(plain_samples, spec)
    assert p > 1e-3, f"{draft}: speculative samples differ from plain sampling (p={p:.2e})"


# -- KV integrity ------------------------------------------------------------------------------
# Tree verification with path sequences (greedy) and sampled suffix trees; the fake checks the
# same invariant over thousands of steps, this shows llama.cpp's cache keeps it too.
@pytest.mark.parametrize("draft, tree, temperature", [("suffix", False, 1.0), ("model", True, 0.0)])
def test_cache_equals_fresh_prefill_after_rejections(draft, tree, temperature, f32_path, model_path):
    cfg = EngineConfig(model=str(f32_path), n_ctx=1024, draft=draft, draft_tree=tree,
                       draft_model=str(model_path(SMALL)), draft_max=8)
    with Engine(cfg) as engine:
        req = GenerationRequest(max_tokens=96, ignore_eos=True,
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
