"""The ONNX drafter against the llama.cpp drafter it was converted from, and its own life cycle.

Numerics: the graph multiplies 8-bit weights with int8-quantized activations (MatMulNBits
accuracy_level 4, the only fast 8-bit path on the CPU), and onnxruntime quantizes a one-row
batch differently from a many-row one. Measured on the 0.5B drafter over real text: a row's
logits move by at most 0.46 between the two paths (with float activations, accuracy_level 0,
the difference is 4e-5, i.e. the tree masking itself is exact). Comparisons of argmaxes
therefore skip positions whose top-two gap is under ``TIE`` logits.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnx")
from edgespec.bench.prompts import SUITES
from edgespec.decode.sampling import SamplingParams, target_probs
from edgespec.drafters.onnx import OnnxDrafter, make_onnx_drafter
from edgespec.errors import IncompatibleModels, InvalidRequest
from edgespec.llama.backend import ContextParams, LlamaContext, LlamaModel
from edgespec.onnx.session import OnnxLM

DRAFTER = "qwen2.5-coder-0.5b"
TIE = 1.0  # logits: above the 0.46 measured between one-row and many-row passes
N_CTX = 2048


@pytest.fixture(scope="module")
def source(model_path) -> Path:
    return Path(model_path(DRAFTER))


@pytest.fixture(scope="module")
def onnx_store(onnx_exact):
    """The session's store, holding its exact conversion of the drafter (conftest)."""
    return onnx_exact[0]


@pytest.fixture(scope="module")
def drafter(onnx_store, source):
    from edgespec.onnx.convert import onnx_dir_for

    d = OnnxDrafter(OnnxLM(onnx_dir_for(onnx_store, source, "exact"), n_ctx=N_CTX, n_threads=2))
    yield d
    d.close()


@pytest.fixture(scope="module")
def llama_drafter(source):
    return LlamaModel(source)


@pytest.fixture(scope="module")
def prompts(llama_drafter) -> list[list[int]]:
    """Two real code-edit requests, 160 tokens each."""
    lines = SUITES["code-edit"].read_text(encoding="utf-8").splitlines()
    texts = [json.loads(line)["turns"][0] for line in lines[:2]]
    return [llama_drafter.tokenize(t)[:160] for t in texts]


def _llama_logits(model: LlamaModel, tokens: list[int]) -> np.ndarray:
    ctx = LlamaContext(model, ContextParams(n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=2))
    try:
        n = len(tokens)
        return ctx.decode(tokens, range(n), [[0]] * n, [True] * n)
    finally:
        ctx.close()


def _onnx_logits(drafter: OnnxDrafter, tokens: list[int]) -> np.ndarray:
    drafter.cached = []
    n = len(tokens)
    out = drafter.lm.forward(tokens, range(n), 0, rows=range(n))
    drafter.cached = list(tokens)
    return out


def _decided(logits: np.ndarray) -> np.ndarray:
    """Rows whose top-two gap is at least TIE."""
    top2 = np.sort(np.partition(logits, -2, axis=-1)[..., -2:], axis=-1)
    return (top2[..., 1] - top2[..., 0]) >= TIE


def test_greedy_next_tokens_agree_with_llama_cpp(drafter, llama_drafter, prompts):
    agree = total = 0
    for tokens in prompts:
        ours = _onnx_logits(drafter, tokens).argmax(-1)
        theirs = _llama_logits(llama_drafter, tokens).argmax(-1)
        agree += int((ours == theirs).sum())
        total += len(tokens)
    assert total >= 300
    assert agree / total >= 0.97, f"{agree}/{total} greedy next tokens agree"


def _branch_logits(drafter: OnnxDrafter, context, tokens, parents, node) -> np.ndarray:
    path = []
    while node >= 0:
        path.append(int(tokens[node]))
        node = int(parents[node])
    drafter.sync(context)
    for t in reversed(path):
        logits = drafter.append(t)
    return logits


def test_a_tree_in_one_pass_equals_its_branches_decoded_one_by_one(drafter, prompts):
    context = prompts[0][:120]
    drafter.begin(context)
    drafter.tree, drafter.min_confidence = True, 0.0  # grow the full budget
    try:
        tree = drafter.propose(context, 12)
    finally:
        drafter.tree, drafter.min_confidence = False, 0.4
    assert len(tree) >= 6 and len(tree.children(-1)) >= 2  # a real tree, several branches
    one_pass = drafter.score_tree(context, tree.tokens, tree.parents)
    for node in range(len(tree)):
        branch = _branch_logits(drafter, context, tree.tokens, tree.parents, node)
        assert np.abs(one_pass[node] - branch).max() < TIE
        if _decided(branch):
            assert one_pass[node].argmax() == branch.argmax()


def test_a_63_node_tree_is_the_exact_top_tree_of_the_drafter(drafter, prompts):
    """The search may decode more nodes than the tree keeps (as the llama.cpp drafter's does):
    the tree is what a search without any cap finds over the same passes."""
    context = prompts[0][:140]  # a search of 95 expansions: 24 of its 63 nodes were out of reach at 63
    drafter.begin(context)
    drafter.tree, drafter.min_confidence = True, 0.0
    drafter.cached.clear()  # the root's logits from one pass over the context, as below
    try:
        tree = drafter.propose(context, 63)
    finally:
        drafter.tree, drafter.min_confidence = False, 0.4
    drafter.cached.clear()  # (a one-row pass quantizes differently: see TIE)
    exact = drafter.search(context, drafter.sync(context), 63, max_expansions=10_000)
    assert exact.expansions > 63  # a search capped at its tree's size would have stopped short
    assert len(tree) == 63
    assert {_path(tree, i) for i in range(63)} == {_path(exact.tree, i) for i in range(63)}


def _path(tree, node: int) -> tuple[int, ...]:
    return tuple(int(tree.tokens[i]) for i in tree.path_to(node))


def test_rollback_leaves_the_drafter_as_if_the_rejected_tokens_never_came(drafter, prompts):
    context = prompts[1][:150]
    drafter.begin(context)
    draft = drafter.propose(context, 8)  # fills slots 150..157
    assert len(draft) >= 3
    rejected_at = 2
    bonus = (int(draft.tokens[rejected_at]) + 1) % 1000  # the target disagreed here
    after = list(context) + [int(t) for t in draft.tokens[:rejected_at]] + [bonus]
    rolled_back = drafter.sync(after)
    assert drafter.cached == after
    fresh = _onnx_logits(drafter, after)[-1]  # a buffer that never saw the draft
    assert np.abs(rolled_back - fresh).max() < TIE
    assert not _decided(fresh) or rolled_back.argmax() == fresh.argmax()


def test_a_tree_leaves_the_buffer_holding_only_the_context(drafter, prompts):
    context = prompts[0][:100]
    drafter.begin(context)
    drafter.sync(context)
    drafter.tree = True
    try:
        drafter.propose(context, 10)
    finally:
        drafter.tree = False
    assert drafter.cached == context
    chain_after_tree = drafter.propose(context, 6)
    _onnx_logits(drafter, context)
    assert np.array_equal(drafter.propose(context, 6).tokens, chain_after_tree.tokens)


def test_sampled_drafts_record_the_draft_distribution(drafter, prompts):
    context = prompts[0][:80]
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
    drafts = []
    drafter.cached.clear()
    for _ in range(2):
        drafter.begin(context, params, np.random.default_rng(3))
        drafts.append(drafter.propose(context, 6))
    a, b = drafts
    assert a.stochastic and len(a) >= 1 and np.array_equal(a.tokens, b.tokens)  # seeded
    for i, token in enumerate(a.tokens):
        assert token in a.q_ids[i] and abs(a.q_probs[i].sum() - 1) < 1e-9
    drafter.cached.clear()  # the context's logits from one pass, as the first draft read them:
    # after a rollback the last token is decoded alone, and ONNX's numerics differ by ~5%
    q0 = target_probs(drafter.sync(context), params, np.zeros(0, np.int64))
    assert np.array_equal(np.flatnonzero(q0), a.q_ids[0]) and np.allclose(q0[a.q_ids[0]], a.q_probs[0])


@pytest.mark.parametrize("provider", ["cuda", "openvino"])
def test_a_missing_provider_falls_back_to_the_cpu_with_one_line(onnx_store, source, caplog, provider):
    from edgespec.onnx.convert import onnx_dir_for

    with caplog.at_level(logging.WARNING, logger="edgespec.onnx.session"):
        lm = OnnxLM(onnx_dir_for(onnx_store, source, "exact"), provider, n_ctx=64, n_threads=1)
    assert lm.provider == "cpu"
    assert [r.getMessage() for r in caplog.records] == [
        f"onnx provider {provider} is not installed in this onnxruntime; drafting on the CPU"]
    assert lm.forward([1, 2, 3], [0, 1, 2], 0).shape == (1, lm.n_vocab)


def test_an_unknown_provider_is_refused(onnx_store, source):
    from edgespec.onnx.convert import onnx_dir_for

    with pytest.raises(InvalidRequest, match="--onnx-provider must be one of cpu, cuda"):
        OnnxLM(onnx_dir_for(onnx_store, source, "exact"), "tpu")


def test_factory_checks_the_vocabulary_and_reuses_the_conversion(onnx_store, source, target_model, small_model):
    d = make_onnx_drafter(target_model, onnx_store, draft_model=str(source), n_threads=1, n_ctx=256)
    try:
        assert d.lm.provider == "cpu" and d.nbytes > (d.lm.directory / "weights.bin").stat().st_size
    finally:
        d.close()
    with pytest.raises(IncompatibleModels):
        make_onnx_drafter(small_model, onnx_store, draft_model=str(source))

