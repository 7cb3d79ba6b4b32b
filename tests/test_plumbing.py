"""The speculative plumbing, proved on an exact fake model in seconds (no model files).

tests/fake_model.py keeps llama.cpp's KV semantics and raises on any row that does not attend
to exactly its own prefix, and its logits depend on exactly the tokens a row attends to. So:

* every row of a verified tree must equal the logits of plain decoding of that node's path;
* after a commit or a rollback the cache must hold exactly the token mirror, no stray cells;
* speculative greedy decoding must equal plain greedy decoding token for token, for every
  drafter, with no tolerance at all (the fake has no batch numerics);
* a failure between verification and commit must leave the cache as a fresh prefill would.
"""
from __future__ import annotations

import functools
import threading
from collections import Counter

import numpy as np
import pytest
from scipy.stats import chi2_contingency

from edgespec.decode.loop import Decoder
from edgespec.decode.request import GenerationRequest
from edgespec.decode.sampling import SamplingParams
from edgespec.decode.sequence import KVSequence
from edgespec.drafters.auto.drafter import AutoDrafter
from edgespec.drafters.auto.policy import CostModel
from edgespec.drafters.hybrid import HybridDrafter
from edgespec.drafters.model import MAX_TREE_NODES, ModelDrafter
from edgespec.drafters.none import NoDrafter
from edgespec.drafters.suffix import SuffixDrafter
from edgespec.errors import BackendError, InvalidRequest
from edgespec.memory.placements import VERIFY_ROWS
from edgespec.spec.step import SpeculativeStep
from edgespec.decode.tree import DraftTree
from edgespec.decode.verify import fit_draft, is_chain, leaves_of, main_path, path_layout
from fake_model import BOS, FakeContext, FakeModel, KVLayoutError
from edgespec.llama.backend import TOP_K_MAX

TARGET = FakeModel(n_vocab=96, seed=0)
# Shares the target's base logits, plus its own noise: agrees with the target most of the time.
DRAFT_MODEL = FakeModel(n_vocab=96, seed=0, perturb=1.0, perturb_seed=5)
N_CTX = 512
GREEDY = SamplingParams(temperature=0.0)
# Verification costs little more than a plain step and drafting is cheap: auto drafts.
CHEAP = CostModel((1, 2, 4, 8, 16, 32, 64), (1.0, 1.02, 1.05, 1.1, 1.2, 1.4, 1.8), 0.02)
# Every extra verified token costs a whole step: auto never drafts.
DEAR = CostModel((1, 2, 64), (1.0, 2.0, 64.0), 1.0)


# -- helpers ----------------------------------------------------------------------------------
def random_tree(rng: np.random.Generator, n: int, vocab: int = 96, chain: bool = False) -> DraftTree:
    """A random topologically ordered tree; small vocabularies give duplicate siblings."""
    parents = np.arange(-1, n - 1) if chain else np.array([rng.integers(-1, i) for i in range(n)], np.int64)
    return DraftTree(rng.integers(2, vocab, n).astype(np.int64), np.asarray(parents, np.int64))


def random_prompt(rng: np.random.Generator, n: int) -> list[int]:
    """BOS + random tokens, with a copied span now and then (as code edits have)."""
    toks = [BOS] + rng.integers(2, TARGET.n_vocab, n - 1).tolist()
    if n > 12 and rng.random() < 0.5:
        a = int(rng.integers(1, n // 2))
        toks += toks[a:a + int(rng.integers(4, n // 2))]
    return toks


def assert_cache_is_mirror(seq: KVSequence, tail_ok: bool = False) -> None:
    """The cache holds exactly seq.tokens in sequence 0 and nothing else.

    ``tail_ok``: after a decode that raised *after* llama_decode ran (a failed logits read in
    ``sync`` or ``append``), sequence 0 may hold cells past the mirror; the next ``sync``
    trims from the common prefix, so they never reach another request.
    """
    ctx = seq.ctx
    cells = ctx.cells(0)
    assert all(ctx.seq_pos_max(s) == -1 for s in range(1, ctx.n_seq_max))
    if tail_ok:
        assert cells[:len(seq.tokens)] == list(enumerate(seq.tokens)) and ctx.used_cells == len(cells)
    else:
        assert cells == list(enumerate(seq.tokens)) and ctx.used_cells == len(seq.tokens)


def model_drafter(tree: bool = False) -> ModelDrafter:
    ctx = FakeContext(DRAFT_MODEL, n_ctx=N_CTX, n_seq_max=MAX_TREE_NODES + 1, n_ubatch=64)
    return ModelDrafter(DRAFT_MODEL, tree=tree, ctx=ctx)


DRAFTERS = {
    "none": lambda: NoDrafter(),
    "suffix": lambda: SuffixDrafter(),
    "model-chain": lambda: model_drafter(),
    "model-tree": lambda: model_drafter(tree=True),
    "hybrid": lambda: HybridDrafter(SuffixDrafter(), model_drafter()),
    "auto": lambda: AutoDrafter(SuffixDrafter(), CHEAP, model=model_drafter()),
    "auto-suffix-only": lambda: AutoDrafter(SuffixDrafter(), CHEAP),
    "auto-dear": lambda: AutoDrafter(SuffixDrafter(), DEAR, model=model_drafter()),
    "model-overlap": lambda: model_drafter(),  # drafts ahead while the target verifies
}
OVERLAP = {"model-overlap"}


def make_decoder(kind: str | None, draft_max: int = 8, n_ctx: int = N_CTX, n_batch: int = 64,
                 greedy_on_backend: bool = False, output_argmax: bool = False):
    """A decoder on a fresh fake target context: plain for ``kind=None``."""
    ctx = FakeContext(TARGET, n_ctx=n_ctx, n_batch=n_batch, n_seq_max=1 + draft_max, n_outputs_max=VERIFY_ROWS,
                      greedy_on_backend=greedy_on_backend, output_argmax=output_argmax)
    step = None if kind is None else SpeculativeStep(DRAFTERS[kind](), draft_max, overlap=kind in OVERLAP)
    return Decoder(TARGET, KVSequence(ctx), step)


def request(n: int, **kw) -> GenerationRequest:
    sampling = kw.pop("sampling", GREEDY)
    return GenerationRequest(max_tokens=n, sampling=sampling, **kw)


# -- the fake itself ----------------------------------------------------------------------------
def test_fake_refuses_more_logits_rows_than_its_context_allows():
    """LlamaContext's rule: llama.cpp would abort on a batch past n_outputs_max (its output_reserve)."""
    ctx = FakeContext(TARGET, n_ctx=128, n_batch=512, n_outputs_max=VERIFY_ROWS)
    n = VERIFY_ROWS + 1
    toks = [1 + i % 20 for i in range(n)]
    with pytest.raises(InvalidRequest, match=f"{n} logits rows; the context allows {VERIFY_ROWS}"):
        ctx.decode(toks, range(n), [[0]] * n, [True] * n)
    assert ctx.decode(toks, range(n), [[0]] * n, [False] + [True] * VERIFY_ROWS).shape[0] == VERIFY_ROWS


def test_fake_batches_equal_one_token_decoding_and_refuse_layout_bugs():
    toks = random_prompt(np.random.default_rng(0), 40)
    ref = np.array([TARGET.logits(toks[:i + 1]) for i in range(len(toks))])
    ctx = FakeContext(TARGET, n_ctx=64, n_seq_max=3)
    batched = ctx.decode(toks, range(len(toks)), [[0]] * len(toks), [True] * len(toks))
    ctx.clear()
    single = np.array([ctx.decode([t], [i], [[0]], [True])[0] for i, t in enumerate(toks)])
    assert np.array_equal(batched, ref) and np.array_equal(single, ref)
    assert not np.array_equal(ref[-1], TARGET.logits(toks[:-2] + toks[-1:]))  # the past matters

    with pytest.raises(KVLayoutError, match="not exactly one cell per position"):
        ctx.decode([5], [3], [[1]], [True])  # sequence 1 holds nothing at 0..2
    ctx.seq_cp(0, 1, 0, 10)
    with pytest.raises(KVLayoutError):
        ctx.decode([7, 8], [10, 10], [[1], [1]], [True, True])  # two cells at position 10
    with pytest.raises(BackendError, match="starts at"):
        ctx.decode([5], [len(toks) + 1], [[0]], [True])  # a gap after the last position
    # A cell computed after one prefix, made visible after another: its keys would be wrong.
    ctx.seq_cp(0, 2, 0, 5)
    ctx.decode([9], [5], [[2]], [False])
    ctx.seq_cp(0, 1, 0, len(toks))  # sequence 1: positions 0..len-1 of sequence 0
    ctx.seq_rm(1, 5, 6)
    ctx.seq_cp(2, 1, 5, 6)  # position 5 of sequence 1 is now the cell computed in sequence 2
    with pytest.raises(KVLayoutError):
        ctx.decode([3], [len(toks)], [[1]], [True])  # position 6.. were computed after toks[5]
    assert ctx.cells(0) == list(enumerate(toks))  # a refused batch changed nothing


def test_fake_cache_edits_follow_llama_cpp():
    ctx = FakeContext(TARGET, n_ctx=32, n_seq_max=4)
    ctx.decode([0, 5, 6, 7], range(4), [[0]] * 4, [False] * 4)
    ctx.seq_cp(0, 1, 0, 2)
    assert ctx.seq_pos_max(1) == 1 and ctx.used_cells == 4
    ctx.seq_rm(0, 2, -1)
    assert ctx.cells(0) == [(0, 0), (1, 5)] and ctx.used_cells == 2
    ctx.seq_keep(1)
    assert ctx.seq_pos_max(0) == -1 and ctx.cells(1) == [(0, 0), (1, 5)]
    ctx.seq_rm(-1, 1, -1)
    assert ctx.cells(1) == [(0, 0)]
    ctx.decode(list(range(2, 22)), range(1, 21), [[1]] * 20, [False] * 20)  # 21 of 32 cells
    with pytest.raises(BackendError, match="no room"):
        ctx.decode(list(range(2, 14)), range(12), [[2]] * 12, [False] * 12)
    assert ctx.used_cells == 21
    ctx.clear()
    assert ctx.used_cells == 0


# -- verify.py: the pure layout ---------------------------------------------------------------
def _ancestors(draft: DraftTree, i: int) -> set[int]:
    return set(draft.path_to(i))


def test_layout_gives_every_node_exactly_its_ancestors():
    rng = np.random.default_rng(1)
    for _ in range(3000):
        draft = random_tree(rng, int(rng.integers(1, 24)), vocab=5)
        leaves, node_paths = path_layout(draft)
        depth = draft.depth()
        has_child = {int(p) for p in draft.parents if p >= 0}
        assert leaves == [i for i in range(len(draft)) if i not in has_child] == leaves_of(draft)
        for i in range(len(draft)):
            through = {k + 1 for k, leaf in enumerate(leaves) if i in _ancestors(draft, leaf)}
            assert node_paths[i] == sorted(through)
            # llama.cpp masks with a row's first sequence: it must see ancestors and itself only.
            first = node_paths[i][0]
            seen = {j for j in range(len(draft)) if first in node_paths[j] and depth[j] <= depth[i]}
            assert seen == _ancestors(draft, i)
        assert is_chain(draft) == (len(leaves) == 1 and list(draft.parents) == list(range(-1, len(draft) - 1)))


def test_layout_hand_cases():
    chain = DraftTree.chain([5, 6, 7])
    assert is_chain(chain) and path_layout(chain) == ([2], [[1], [1], [1]])
    star = DraftTree(np.array([5, 6, 7]), np.array([-1, -1, -1]))
    assert not is_chain(star) and path_layout(star) == ([0, 1, 2], [[1], [2], [3]])
    fork = DraftTree(np.array([5, 6, 7, 8]), np.array([-1, 0, 0, 1]))
    assert path_layout(fork) == ([2, 3], [[1, 2], [2], [1], [2]])
    assert is_chain(DraftTree.empty()) and path_layout(DraftTree.empty()) == ([], [])


def test_main_path_follows_first_children():
    # 0 -> 1 -> 3 -> 4 is the main path; 2 (a sibling of 1) and 5 (a sibling of 3) are not on it
    tree = DraftTree(np.array([10, 11, 12, 13, 14, 15]), np.array([-1, 0, 0, 1, 3, 1]),
                     scores=np.array([0.9, 0.8, 0.1, 0.7, 0.6, 0.05]), source="suffix", match_len=3)
    path = main_path(tree)
    assert is_chain(path)
    assert path.tokens.tolist() == [10, 11, 13, 14]
    assert path.scores.tolist() == [0.9, 0.8, 0.7, 0.6]
    assert (path.source, path.match_len) == ("suffix", 3)
    assert main_path(DraftTree.empty()).tokens.tolist() == []
    # a sampled tree: each kept node keeps the draft distribution it was drawn from
    q_ids = tuple(np.array([t, t + 1]) for t in tree.tokens)
    q_probs = tuple(np.array([0.5 + 0.01 * i, 0.5 - 0.01 * i]) for i in range(len(tree)))
    sampled = main_path(DraftTree(tree.tokens, tree.parents, q_ids, q_probs))
    assert [q.tolist() for q in sampled.q_ids] == [[10, 11], [11, 12], [13, 14], [14, 15]]
    assert [round(float(q[0]), 2) for q in sampled.q_probs] == [0.5, 0.51, 0.53, 0.54]


class _ChainsSeen(KVSequence):
    """A KVSequence that records whether each verified draft was a chain."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self.shapes: list[tuple[bool, int]] = []

    def verifying(self, pending, draft, alongside=None):
        self.shapes.append((is_chain(draft), len(draft)))
        return super().verifying(pending, draft, alongside)


@pytest.mark.parametrize("kind", ["suffix", "model-tree", "hybrid", "auto"])
def test_chains_only_verifies_chains_and_keeps_greedy_answers(kind):
    """Exact mode's step: drafters that draft trees (the suffix index always does) are cut to their
    main path, so the cache never holds a later position in an earlier cell."""
    rng = np.random.default_rng(8)
    seq = _ChainsSeen(FakeContext(TARGET, n_ctx=N_CTX, n_batch=64, n_seq_max=9))
    spec = Decoder(TARGET, seq, SpeculativeStep(DRAFTERS[kind](), 8, chains_only=True))
    plain = make_decoder(None)
    for _ in range(4):
        # a phrase seen with several continuations: the suffix index drafts a tree after it
        stem, tails = random_prompt(rng, 4)[1:], [random_prompt(rng, 5)[1:] for _ in range(3)]
        prompt = random_prompt(rng, 8) + [t for tail in tails for t in stem + tail] + stem
        assert spec.generate(prompt, request(48)).token_ids == plain.generate(prompt, request(48)).token_ids
    assert all(chain for chain, _ in seq.shapes)
    assert sum(n > 1 for _, n in seq.shapes) > 4, seq.shapes  # multi-token drafts were verified


def test_a_chains_only_suffix_index_proposes_its_main_path():
    """DraftConfig.chains (exact mode): the suffix drafter proposes the main path of the tree it
    would draft, so `auto` prices what is verified, and make_drafter passes the flag through."""
    from edgespec.drafters import DraftConfig
    from edgespec.drafters.factory import make_drafter

    rng = np.random.default_rng(9)
    stem, tails = random_prompt(rng, 4)[1:], [random_prompt(rng, 5)[1:] for _ in range(3)]
    prompt = random_prompt(rng, 8) + [t for tail in tails for t in stem + tail] + stem
    trees, chains = SuffixDrafter(), make_drafter(DraftConfig(kind="suffix", chains=True), TARGET, None)
    for d in (trees, chains):
        d.begin(prompt)
    tree, chain = trees.propose(prompt, 8), chains.propose(prompt, 8)
    assert not is_chain(tree)  # the phrase has three continuations
    assert chain.tokens.tolist() == main_path(tree).tokens.tolist() and is_chain(chain)
    assert chain.scores.tolist() == main_path(tree).scores.tolist()


def test_fit_draft_keeps_the_largest_valid_prefix():
    rng = np.random.default_rng(2)
    for _ in range(2000):
        draft = random_tree(rng, int(rng.integers(0, 30)))
        max_paths, max_nodes = int(rng.integers(1, 8)), int(rng.integers(0, 30))
        fitted = fit_draft(draft, max_paths, max_nodes)
        n = len(fitted)
        assert leaves_of(draft) == [i for i in range(len(draft)) if i not in set(draft.parents.tolist())]
        assert np.array_equal(fitted.tokens, draft.tokens[:n])
        assert np.array_equal(fitted.parents, draft.parents[:n])
        assert n <= max_nodes and len(leaves_of(fitted)) <= max_paths
        if n < min(len(draft), max_nodes):
            assert len(leaves_of(draft.prefix(n + 1))) > max_paths


# -- KVSequence: verification, commit and rollback against plain decoding ----------------------
def test_random_trees_commits_and_rollbacks_match_plain_decoding():
    """Thousands of steps: every verified row, every commit, every rollback checked."""
    rng = np.random.default_rng(3)
    max_paths = 12
    seq = KVSequence(FakeContext(TARGET, n_ctx=256, n_batch=32, n_seq_max=1 + max_paths))
    context = random_prompt(rng, 30)
    row, kept = seq.sync(context)
    assert kept == 0 and np.array_equal(row.logits(), TARGET.logits(context))
    outcomes = Counter()
    for step in range(1000):
        if len(seq) > 200 or rng.random() < 0.03:  # a new request: prefix reuse, maybe a new prompt
            cut = int(rng.integers(1, len(seq.tokens)))
            context = seq.tokens[:cut] + random_prompt(rng, int(rng.integers(2, 20)))[1:]
            old = list(seq.tokens)
            row, kept = seq.sync(context)
            common = next((i for i, (a, b) in enumerate(zip(old, context)) if a != b), min(len(old), len(context)))
            assert kept == min(common, len(context) - 1) >= cut
            assert np.array_equal(row.logits(), TARGET.logits(context))
        base = list(seq.tokens)
        pending = int(rng.integers(2, TARGET.n_vocab))
        draft = fit_draft(random_tree(rng, int(rng.integers(0, 20)), vocab=6, chain=rng.random() < 0.3),
                          seq.max_paths, 20)
        action = rng.choice(["commit", "commit", "raise", "leave"])
        path: list[int] = []
        try:
            with seq.verifying(pending, draft) as v:
                for r in rng.permutation(len(draft) + 1)[: int(rng.integers(1, len(draft) + 2))]:
                    node_path = draft.path_to(r - 1) if r > 0 else []
                    want = TARGET.logits(base + [pending] + [int(draft.tokens[i]) for i in node_path])
                    assert np.array_equal(v.rows(int(r)), want), (step, r)
                if action == "commit":
                    path = draft.path_to(int(rng.integers(-1, len(draft)))) if len(draft) else []
                    v.commit(path)
                elif action == "raise":
                    raise KeyError("between verification and commit")
        except KeyError:
            pass
        outcomes[action] += 1
        expect = base + ([pending] + [int(draft.tokens[i]) for i in path] if action == "commit" else [])
        assert seq.tokens == expect
        assert_cache_is_mirror(seq)
        if rng.random() < 0.3:
            nxt = int(rng.integers(2, TARGET.n_vocab))
            assert np.array_equal(seq.append(nxt).logits(), TARGET.logits(seq.tokens[:-1] + [nxt]))
        if rng.random() < 0.1:
            seq.trim(int(rng.integers(1, len(seq) + 1)))
            assert_cache_is_mirror(seq)
    assert min(outcomes.values()) > 150


def test_a_tree_with_more_paths_than_sequences_is_refused_without_stray_cells():
    seq = KVSequence(FakeContext(TARGET, n_ctx=64, n_seq_max=3))
    seq.sync([BOS, 5, 6])
    star = DraftTree(np.array([7, 8, 9]), np.array([-1, -1, -1]))
    with pytest.raises(ValueError, match="3 paths"):
        with seq.verifying(4, star) as v:
            v.commit([])
    assert_cache_is_mirror(seq)


def test_a_failed_tree_decode_rolls_the_path_sequences_back():
    """The decode raises after the context was shared into the path sequences."""
    seq = KVSequence(FakeContext(TARGET, n_ctx=64, n_seq_max=4))
    seq.sync([BOS, 5, 6, 7])
    fork = DraftTree(np.array([8, 9, 10]), np.array([-1, 0, 0]))
    seq.ctx.fail_decode_at(1)
    with pytest.raises(BackendError, match="injected"):
        with seq.verifying(4, fork) as v:
            v.commit([0, 1])
    assert_cache_is_mirror(seq)
    bad = DraftTree(np.array([8, 9, TARGET.n_vocab]), np.array([-1, 0, 0]))  # a token out of range
    with pytest.raises(InvalidRequest):
        with seq.verifying(4, bad) as v:
            v.commit([])
    assert_cache_is_mirror(seq)
    with seq.verifying(4, fork) as v:
        assert np.array_equal(v.rows(3), TARGET.logits([BOS, 5, 6, 7, 4, 8, 10]))
        v.commit([0, 2])
    assert seq.tokens == [BOS, 5, 6, 7, 4, 8, 10]
    assert_cache_is_mirror(seq)


# -- the request loop: speculative greedy == plain greedy, exactly ------------------------------
CASES = [  # (draft_max, max_tokens, n_batch, request options)
    (1, 40, 64, {}),
    (3, 64, 64, {"ignore_eos": True}),
    (8, 120, 16, {"ignore_eos": True}),
    (16, 90, 64, {}),
    (8, 70, 64, {"sampling": SamplingParams(temperature=0.0, repeat_penalty=1.3, repeat_last_n=16)}),
    (63, 120, 512, {"ignore_eos": True}),  # the longest drafts, in the engine's 65 logits rows
]


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_speculative_greedy_equals_plain_greedy_exactly(kind):
    rng = np.random.default_rng(4)
    drafted = accepted = requests = 0
    for draft_max, n, n_batch, options in CASES:
        spec = make_decoder(kind, draft_max, n_batch=n_batch)
        plain = make_decoder(None, n_batch=n_batch)
        for _ in range(6):  # one decoder for several requests: prefix reuse and drafter history
            prompt = random_prompt(rng, int(rng.integers(3, 70)))
            want = plain.generate(prompt, request(n, **options))
            if not options:  # the plain loop itself equals the cache-free reference
                ref = TARGET.greedy(prompt, n, stop_at_eos=True)
                assert list(want.token_ids) == ref
            got = spec.generate(prompt, request(n, **options))
            assert got.token_ids == want.token_ids, (kind, draft_max, prompt)
            assert (got.text, got.finish_reason) == (want.text, want.finish_reason)
            stats = got.stats.spec
            assert stats.steps + stats.accepted + 1 == len(got.token_ids) + (got.finish_reason == "stop")
            drafted, accepted, requests = drafted + stats.drafted, accepted + stats.accepted, requests + 1
        assert_cache_is_mirror(spec.seq)
    if kind in ("none", "auto-dear"):
        assert drafted == 0
    else:  # speculation really happened, and really paid
        assert drafted > 10 * requests and accepted > 5 * requests, (drafted, accepted, requests)


@pytest.mark.parametrize("output_argmax", [False, True], ids=["sampler", "output-argmax"])
@pytest.mark.parametrize("kind", ["suffix", "model-tree", "auto", "model-overlap"])
def test_greedy_picks_on_the_backend_give_plain_greedys_answers(kind, output_argmax):
    """Plain greedy decoding has the backend pick its tokens (no logits come back for those
    rows). Speculative steps verify with picks of every row (trees' branches included) on a
    build with output argmax, and on the sampler's build detach it and read logits. A sampled
    request gets logits in both. Every answer is the reference's."""
    rng = np.random.default_rng(11)
    plain = make_decoder(None, greedy_on_backend=True, output_argmax=output_argmax)
    spec = Decoder(TARGET, plain.seq, SpeculativeStep(DRAFTERS[kind](), 8, overlap=kind in OVERLAP))
    accepted = 0
    for _ in range(4):
        prompt = random_prompt(rng, int(rng.integers(3, 40)))
        want = TARGET.greedy(prompt, 40, stop_at_eos=True)
        assert list(plain.generate(prompt, request(40)).token_ids) == want
        assert plain.seq.ctx._picking
        with pytest.raises(BackendError, match="picked on the backend"):
            plain.seq.append(want[0]).logits()
        plain.seq.trim(len(plain.seq) - 1)
        done = spec.generate(prompt, request(40))
        assert list(done.token_ids) == want, (kind, prompt)
        assert spec.seq.ctx._picking is output_argmax
        accepted += done.stats.spec.accepted
    assert accepted > 0  # drafts were verified, not only one-token steps
    sampled = plain.generate(prompt, request(16, sampling=SamplingParams(temperature=0.8, seed=1)))
    assert not plain.seq.ctx._picking and len(sampled.token_ids) == 16
    assert_cache_is_mirror(plain.seq)


@pytest.mark.parametrize("kind", ["suffix", "model-chain", "model-tree", "auto"])
def test_sampling_from_the_backends_largest_logits_draws_what_whole_rows_draw(kind):
    """With output top-k a sampled request's rows come back as their largest logits only (ids
    and logits, in no order; reading a whole row raises). Plain and speculative sampling then
    draw the same tokens from the same seed as with whole rows, greedy requests still get
    picks, and the context's rows are whole again for a request that needs them."""
    rng = np.random.default_rng(13)
    sampling = [SamplingParams(temperature=0.9, top_k=12, seed=3),
                SamplingParams(temperature=1.2, top_k=8, top_p=0.9, repeat_penalty=1.3, repeat_last_n=6, seed=4)]
    for params in sampling:
        prompt = random_prompt(rng, 30)
        answers = {}
        for on in (False, True):
            ctx = FakeContext(TARGET, n_ctx=N_CTX, n_batch=64, n_seq_max=9, n_outputs_max=VERIFY_ROWS,
                              greedy_on_backend=True, output_argmax=True, output_topk=on)
            plain = Decoder(TARGET, KVSequence(ctx))
            spec = Decoder(TARGET, plain.seq, SpeculativeStep(DRAFTERS[kind](), 8))
            answers["plain", on] = plain.generate(prompt, request(40, sampling=params)).token_ids
            assert ctx._top_k == (params.top_k + (params.repeat_last_n if params.repeat_penalty > 1 else 0)) * on
            if on:
                with pytest.raises(BackendError, match="picked on the backend"):
                    plain.seq.append(answers["plain", on][0]).logits()
                plain.seq.trim(len(plain.seq) - 1)
            done = spec.generate(prompt, request(40, sampling=params))
            answers["spec", on] = done.token_ids
            assert done.stats.spec.drafted > 0
            assert list(plain.generate(prompt, request(20)).token_ids) == TARGET.greedy(prompt, 20, stop_at_eos=True)
            assert ctx._picking and ctx._top_k == 0
            assert_cache_is_mirror(plain.seq)
        assert answers["plain", True] == answers["plain", False]
        assert answers["spec", True] == answers["spec", False]


def test_a_top_k_past_the_largest_the_backend_returns_reads_whole_rows():
    ctx = FakeContext(TARGET, n_ctx=N_CTX, greedy_on_backend=True, output_topk=True)
    plain = Decoder(TARGET, KVSequence(ctx))
    for top_k, taken in ((40, 40), (TOP_K_MAX, TARGET.n_vocab), (TOP_K_MAX + 1, 0), (0, 0)):
        params = SamplingParams(temperature=0.9, top_k=top_k, seed=2)
        done = plain.generate(random_prompt(np.random.default_rng(top_k), 10), request(8, sampling=params))
        assert ctx._top_k == taken and len(done.token_ids) == 8


@pytest.mark.parametrize("kind", ["suffix", "model-tree", "auto"])
def test_exact_up_to_a_full_context(kind):
    """The context-length check ends both loops at the same token."""
    rng = np.random.default_rng(5)
    for n_ctx in (40, 57, 64):
        prompt = random_prompt(rng, 20)
        want = make_decoder(None, n_ctx=n_ctx).generate(prompt, request(500, ignore_eos=True))
        got = make_decoder(kind, 16, n_ctx=n_ctx).generate(prompt, request(500, ignore_eos=True))
        assert want.finish_reason == got.finish_reason == "length"
        assert got.token_ids == want.token_ids and len(prompt) + len(want.token_ids) == n_ctx


def test_stop_strings_end_speculative_and_plain_output_alike():
    rng = np.random.default_rng(6)
    for _ in range(10):
        prompt = random_prompt(rng, 30)
        ref = TARGET.greedy(prompt, 60, stop_at_eos=True)
        if len(ref) < 10:
            continue
        stop = TARGET.token_piece(ref[int(rng.integers(3, len(ref)))]).decode()
        want = make_decoder(None).generate(prompt, request(60, stop=(stop,)))
        got = make_decoder("suffix", 8).generate(prompt, request(60, stop=(stop,)))
        assert want.finish_reason == "stop" and stop not in want.text
        assert (got.text, got.finish_reason) == (want.text, want.finish_reason)


# -- sampling -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", [k for k in DRAFTERS if k != "model-tree"])
def test_sampling_is_reproducible_by_seed(kind):
    rng = np.random.default_rng(7)
    for seed in range(4):
        prompt = random_prompt(rng, 40)
        req = request(48, ignore_eos=True, sampling=SamplingParams(temperature=0.8, seed=seed))
        first = make_decoder(kind, 8).generate(prompt, req)
        again = make_decoder(kind, 8).generate(prompt, req)
        assert first.token_ids == again.token_ids
        other = make_decoder(kind, 8).generate(prompt, GenerationRequest(
            max_tokens=48, ignore_eos=True, sampling=SamplingParams(temperature=0.8, seed=seed + 100)))
        assert other.token_ids != first.token_ids


SAMPLING_PROMPT = [BOS] + [5, 6, 7, 8, 9] * 6  # a loop the suffix drafter and the copy rule both see
N_SEEDS = 1000


def _first_tokens(decoder: Decoder, prompt: list[int], seeds, temperature: float):
    """Tokens 2-4 of each seed's answer, and how many tokens were drafted in all."""
    out, drafted = [], 0
    for s in seeds:
        done = decoder.generate(prompt, request(4, ignore_eos=True, sampling=SamplingParams(
            temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, seed=s)))
        out.append(done.token_ids[1:4])  # the first token comes from the prefill in both
        drafted += done.stats.spec.drafted if done.stats.spec else 0
    return out, drafted


@functools.lru_cache(maxsize=None)
def _plain_samples(temperature: float) -> list[tuple[int, ...]]:
    return _first_tokens(make_decoder(None), SAMPLING_PROMPT, range(N_SEEDS), temperature)[0]


def _contingency_p(a: list, b: list) -> float:
    ca, cb = Counter(a), Counter(b)
    keys = [k for k in set(ca) | set(cb) if ca[k] + cb[k] >= 10]
    rest_a = sum(v for k, v in ca.items() if k not in keys)
    rest_b = sum(v for k, v in cb.items() if k not in keys)
    table = np.array([[ca[k] for k in keys] + [rest_a], [cb[k] for k in keys] + [rest_b]])
    return float(chi2_contingency(table[:, table.sum(0) > 0])[1])


@pytest.mark.parametrize("kind", ["suffix", "model-chain", "hybrid"])
def test_sampled_tokens_are_distributed_as_plain_sampling(kind):
    """Chi-square on tokens 2-4 over 1000 seeds; fixed seeds, so the verdict is fixed."""
    prompt = SAMPLING_PROMPT
    plain = _plain_samples(1.0)
    spec, drafted = _first_tokens(make_decoder(kind, 4), prompt, range(10_000, 10_000 + N_SEEDS), 1.0)
    assert drafted > N_SEEDS // 2 and len(set(plain)) > 10, drafted
    assert _contingency_p(plain, spec) > 1e-3


def test_the_sampling_check_has_power():
    """The same check tells T=1 from T=0.8 apart: it would catch a skewed distribution."""
    assert _contingency_p(_plain_samples(1.0), _plain_samples(0.8)) < 1e-3


# -- failures between verification and commit --------------------------------------------------
def _run_until_failure(decoder: Decoder, prompt, req) -> Exception:
    with pytest.raises(BackendError, match="injected") as info:
        decoder.generate(prompt, req)
    return info.value


@pytest.mark.parametrize("kind", ["suffix", "model-tree", "hybrid", "auto"])
@pytest.mark.parametrize("fault", ["read", "decode"])
def test_a_failed_step_leaves_the_cache_as_a_fresh_prefill(kind, fault):
    """A backend error mid-request (a logits read after the tree decode, or the tree decode
    itself after the path sequences were shared): no stray cell survives, and the next
    request answers exactly as a fresh decoder does."""
    rng = np.random.default_rng(8)
    req = request(80, ignore_eos=True)
    failures = 0
    for k in (1, 2, 5, 9, 17, 40):
        decoder = make_decoder(kind, 8)
        prompt, follow = random_prompt(rng, 40), random_prompt(rng, 30)
        ctx = decoder.seq.ctx
        ctx.fail_read_at(k) if fault == "read" else ctx.fail_decode_at(k + 1)  # + 1: the prefill
        try:
            decoder.generate(prompt, req)
        except BackendError as exc:
            assert "injected" in str(exc)
            failures += 1
        ctx.fail_read_at(None), ctx.fail_decode_at(None)
        assert_cache_is_mirror(decoder.seq, tail_ok=fault == "read")
        again = decoder.generate(follow + prompt[1:], req)
        fresh = make_decoder(kind, 8).generate(follow + prompt[1:], req)
        assert again.token_ids == fresh.token_ids
        assert list(again.token_ids) == TARGET.greedy(follow + prompt[1:], 80)
        assert_cache_is_mirror(decoder.seq)
    assert failures >= 5  # the faults really hit mid-request


@pytest.mark.parametrize("tree", [False, True])
def test_a_failure_inside_the_model_drafter_leaves_its_cache_clean(tree):
    rng = np.random.default_rng(9)
    req = request(60, ignore_eos=True)
    for k in (1, 3, 6, 11):
        drafter = model_drafter(tree)
        decoder = Decoder(TARGET, KVSequence(FakeContext(TARGET, n_ctx=N_CTX, n_seq_max=9)),
                          SpeculativeStep(drafter, 8))
        prompt = random_prompt(rng, 30)
        drafter.ctx.fail_decode_at(k)
        with pytest.raises(BackendError, match="injected"):
            decoder.generate(prompt, req)
        assert_cache_is_mirror(decoder.seq)
        assert_cache_is_mirror(drafter.seq)
        again = decoder.generate(prompt, req)
        assert list(again.token_ids) == TARGET.greedy(prompt, 60)
        assert again.stats.spec.accepted > 0


def test_auto_forgets_a_step_that_never_finished():
    """A request that failed between propose and observe must not teach the next one: its
    draft was never verified, so it says nothing about acceptance."""
    auto = AutoDrafter(SuffixDrafter(), CHEAP, model=model_drafter())
    loop = [BOS] + [11, 12, 13, 14, 15, 16] * 5
    prompt = loop + TARGET.greedy(loop, 4)  # ends where the drafter continues confidently
    first = TARGET.greedy(prompt, 1)[0]
    auto.begin(prompt)
    auto.observe([first])
    draft = auto.propose(prompt + [first], 8)
    assert draft.source == "model" and len(draft) > 0  # the step drafted with the model
    before = auto.model_acceptance.alphas()
    auto.end()  # the step raised before observe (see the failure tests above)
    auto.begin(random_prompt(np.random.default_rng(10), 30))
    auto.observe([9])  # the next request's first token, as SpeculativeStep.begin reports it
    assert auto.model_acceptance.alphas() == before


def test_the_target_drafting_for_itself_is_always_accepted():
    """Drafts by the target model itself are its own greedy choices: every one is accepted,
    which an off-by-one between draft nodes and verification rows would break."""
    drafter = ModelDrafter(TARGET, ctx=FakeContext(TARGET, n_ctx=N_CTX, n_seq_max=MAX_TREE_NODES + 1))
    decoder = Decoder(TARGET, KVSequence(FakeContext(TARGET, n_ctx=N_CTX, n_seq_max=9)), SpeculativeStep(drafter, 8))
    rng = np.random.default_rng(11)
    for _ in range(5):
        prompt = random_prompt(rng, 40)
        done = decoder.generate(prompt, request(100, ignore_eos=True))
        assert list(done.token_ids) == TARGET.greedy(prompt, 100)
        assert done.stats.spec.drafted > 0 and done.stats.spec.accepted == done.stats.spec.drafted


def _self_drafting(overlap: bool) -> Decoder:
    drafter = ModelDrafter(TARGET, ctx=FakeContext(TARGET, n_ctx=N_CTX, n_seq_max=MAX_TREE_NODES + 1))
    ctx = FakeContext(TARGET, n_ctx=N_CTX, n_seq_max=9)
    return Decoder(TARGET, KVSequence(ctx), SpeculativeStep(drafter, 8, overlap=overlap))


def test_overlap_drafts_ahead_and_uses_the_draft_only_when_the_guess_was_right():
    """With the target drafting for itself every chain is accepted and every guessed bonus is
    right: after the first step every draft was made during the previous verification (the
    last step, with no budget left, drafts nothing: source `none`)."""
    rng = np.random.default_rng(12)
    for _ in range(3):
        prompt = random_prompt(rng, 40)
        done = _self_drafting(overlap=True).generate(prompt, request(100, ignore_eos=True))
        s = done.stats.spec
        assert list(done.token_ids) == TARGET.greedy(prompt, 100)
        assert s.accepted == s.drafted and s.drafted_ahead == s.by_drafter["model"].steps - 1, s
    # A drafter that is often wrong: drafts ahead are used only after fully accepted steps.
    rng = np.random.default_rng(13)
    spec, plain = make_decoder("model-overlap", 8), make_decoder(None)
    ahead = steps = 0
    for _ in range(6):
        prompt = random_prompt(rng, 30)
        done = spec.generate(prompt, request(80, ignore_eos=True))
        assert done.token_ids == plain.generate(prompt, request(80, ignore_eos=True)).token_ids
        ahead, steps = ahead + done.stats.spec.drafted_ahead, steps + done.stats.spec.steps
    assert 0 < ahead < steps - 6


def test_a_failure_while_drafting_ahead_leaves_the_cache_as_a_fresh_prefill():
    decoder = _self_drafting(overlap=True)
    drafter = decoder.step.drafter
    real, calls = drafter.propose, []

    def propose(context, budget):
        calls.append(len(context))
        if len(calls) == 3:  # the second step's draft ahead, beside its verification
            raise BackendError("drafter lost its device")
        return real(context, budget)

    drafter.propose = propose
    prompt = random_prompt(np.random.default_rng(14), 30)
    with pytest.raises(BackendError):
        decoder.generate(prompt, request(40, ignore_eos=True))
    assert_cache_is_mirror(decoder.seq)
    drafter.propose = real
    done = decoder.generate(prompt, request(40, ignore_eos=True))
    assert list(done.token_ids) == TARGET.greedy(prompt, 40)


def test_a_stopped_greedy_chain_is_the_unstopped_chains_prefix_and_skips_its_last_decode():
    context = [BOS] + list(range(5, 25))
    full = model_drafter()
    full.min_confidence = 0.0  # the fake drafter is rarely sure
    chain = full.propose(context, 8)
    assert len(chain) == 8 and chain.scores is not None and np.all(np.diff(chain.scores) <= 0)
    stopped = model_drafter()
    stopped.min_confidence, seen = 0.0, []
    before = stopped.ctx.decodes
    short = stopped.propose(context, 8, stop=lambda conf: seen.append(list(conf)) or len(conf) == 3)
    assert short.tokens.tolist() == chain.tokens[:3].tolist()
    assert short.scores == pytest.approx(chain.scores[:3]) and seen[-1] == pytest.approx(
        (chain.scores[:3] / np.concatenate(([1.0], chain.scores[:2]))).tolist())
    assert stopped.ctx.decodes - before == 1 + 2  # the context, then tokens 1 and 2, not token 3


def test_freeing_an_engine_frees_every_part_even_when_one_fails(caplog):
    """Engine._free (used by close() and by a refused load) closes the drafter, the context, the
    releaser and the model in that order; a part that raises is logged, the rest are still
    freed, and the first failure is raised."""
    from edgespec.engine import Engine

    closed = []

    class Part:
        def __init__(self, name, fails=False):
            self.name, self.fails = name, fails

        def close(self):
            closed.append(self.name)
            if self.fails:
                raise RuntimeError(f"{self.name} would not close")

    engine = Engine.__new__(Engine)
    engine.drafter, engine.ctx = Part("drafter"), Part("ctx", fails=True)
    engine.releaser, engine.model = None, Part("model", fails=True)
    with pytest.raises(RuntimeError, match="ctx would not close"):
        engine._free()
    assert closed == ["drafter", "ctx", "model"]
    assert [r.getMessage() for r in caplog.records].count("freeing Part failed: model would not close") == 1


# -- a request's start beside its prefill ---------------------------------------------------------
class _Recording(SuffixDrafter):
    """The suffix drafter, noting the thread its begin ran in and each end."""

    def __init__(self):
        super().__init__()
        self.began, self.began_in, self.ended = threading.Event(), None, 0

    def begin(self, prompt, sampling=None, rng=None) -> None:
        self.began_in = threading.current_thread()
        self.began.set()
        super().begin(prompt, sampling, rng)

    def end(self) -> None:
        self.ended += 1
        super().end()


def test_a_request_starts_beside_its_prefill_and_a_failed_prefill_reports_its_own_error():
    decoder, drafter = make_decoder(None), _Recording()
    decoder.step = SpeculativeStep(drafter, 8)
    prefill = decoder.seq.sync

    def after_begin(tokens):  # the prefill waits for the step's start: they run side by side
        assert drafter.began.wait(10), "the step did not start beside the prefill"
        return prefill(tokens)
    decoder.seq.sync = after_begin
    prompt = random_prompt(np.random.default_rng(3), 30)
    plain = make_decoder(None).generate(prompt, request(24)).token_ids
    assert decoder.generate(prompt, request(24)).token_ids == plain
    assert drafter.began_in is not threading.main_thread() and drafter.ended == 1

    def refused(tokens):  # a prefill llama.cpp refuses, with the drafter started beside it
        raise BackendError("no room in the KV cache")
    decoder.seq.sync = refused
    with pytest.raises(BackendError, match="no room"):
        decoder.generate(prompt, request(4))
    assert drafter.ended == 2  # the request ended for the drafter too
