"""Plain generation with real models: equal to llama-cpp-python's greedy, prefix reuse, stops."""
from __future__ import annotations

import gc

import numpy as np
import pytest

from conftest import DRAFTER, SMALL
from edgespec.llama.backend import ContextParams, LlamaContext
from edgespec.engine import Engine, EngineConfig
from edgespec.errors import InvalidRequest
from edgespec.decode.loop import Decoder
from edgespec.decode.request import GenerationRequest
from edgespec.decode.sequence import KVSequence
from edgespec.decode.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)

PROMPTS = [
    "def quicksort(arr):",
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "import numpy as np\n\n# compute the mean of each column\n",
]


@pytest.fixture(scope="module")
def small_engine():
    with Engine(EngineConfig(model=SMALL, n_ctx=1024)) as e:
        yield e


@pytest.fixture(scope="module")
def reference(model_path):
    """llama-cpp-python's own high-level Llama per model, loaded once for the module."""
    from llama_cpp import Llama  # the reference implementation, used only by this test

    from edgespec.llama.backend import qmatmul_loaded
    from edgespec.llama.kernels import default_flash_attn

    loaded = {}

    def greedy(name: str, prompt: str, n: int) -> str:
        if name not in loaded:
            # Flash attention as the engine sets it on the CPU (default_flash_attn): the two
            # attention kernels round differently and would flip near-ties.
            flash = default_flash_attn(on_gpu=False, qmatmul=qmatmul_loaded())
            loaded[name] = Llama(model_path=str(model_path(name)), n_ctx=512, verbose=False,
                                 n_threads=2, flash_attn=flash)
        llm = loaded[name]
        llm.reset()  # evaluate every prompt in full, as a fresh Llama would
        out = llm.create_completion(prompt, max_tokens=n, temperature=0.0, top_k=1, repeat_penalty=1.0)
        return out["choices"][0]["text"]

    yield greedy
    for llm in loaded.values():
        llm.close()


# Tokens generated per prompt. SmolLM2 (llama architecture) runs the long comparison cheaply.
# The Qwen family is compared on the 0.5B drafter, which has the 1.5B target's qwen2
# architecture and tokenizer (test_speculative's vocabulary check): fewer tokens, as each costs
# ~0.1 s here twice over (ours and the reference), still show its tokenizer, prompt evaluation,
# decode loop and detokenizer equal llama-cpp-python's on code, prose and a comment prompt.
TOKENS = {SMALL: 48, DRAFTER: 16}


@pytest.mark.parametrize("name", [SMALL, DRAFTER])
def test_greedy_equals_llama_cpp_python(name, reference):
    n = TOKENS[name]
    with Engine(EngineConfig(model=name, n_ctx=512)) as engine:
        ours = [engine.decoder.generate(engine.text_tokens(p), GenerationRequest(
            max_tokens=n, sampling=GREEDY, ignore_eos=True)).text for p in PROMPTS]
    for prompt, text in zip(PROMPTS, ours):
        assert text == reference(name, prompt, n), prompt


def test_prefix_reuse_gives_the_same_answer(small_engine):
    gen = small_engine.decoder
    req = GenerationRequest(max_tokens=24, sampling=GREEDY)
    first = small_engine.text_tokens("List three prime numbers: 2, 3,")
    done1 = gen.generate(first, req)
    # The next prompt extends the previous prompt and answer, like the next turn of a chat.
    follow = first + list(done1.token_ids) + small_engine.text_tokens(" and more:")[1:]
    done2 = gen.generate(follow, req)
    assert done2.stats.reused_prompt_tokens >= len(first) + len(done1.token_ids) - 1
    small_engine.reset()
    fresh = gen.generate(follow, req)
    assert fresh.stats.reused_prompt_tokens == 0
    assert fresh.token_ids == done2.token_ids


def test_stop_string_is_not_emitted(small_engine):
    prompt = small_engine.text_tokens("Count: 1, 2, 3, 4, 5, 6, 7, 8")
    full = small_engine.decoder.generate(prompt, GenerationRequest(max_tokens=20, sampling=GREEDY))
    assert "10" in full.text
    stopped = small_engine.decoder.generate(prompt, GenerationRequest(
        max_tokens=20, sampling=GREEDY, stop=("10",)))
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index("10")]


def test_max_tokens_and_streamed_text_match(small_engine):
    prompt = small_engine.text_tokens("Write a poem about the sea.")
    events = list(small_engine.decoder.stream(prompt, GenerationRequest(max_tokens=17, sampling=GREEDY,
                                                                       ignore_eos=True)))
    done = events[-1]
    assert done.stats.generated_tokens == 17 and done.finish_reason == "length"
    assert "".join(e.text for e in events[:-1]) == done.text
    assert done.stats.tokens_per_s > 0 and done.stats.peak_rss_bytes > 0


def test_seeded_sampling_is_reproducible_and_varies_with_seed(small_engine):
    prompt = small_engine.chat_tokens([{"role": "user", "content": "Tell me a story."}])
    def run(seed):  # from an empty cache: a reused prompt prefix is computed in another batch
        small_engine.reset()
        return small_engine.decoder.generate(prompt, GenerationRequest(
            max_tokens=24, sampling=SamplingParams(temperature=1.0, seed=seed))).token_ids
    assert run(1) == run(1)
    assert len({run(s) for s in range(2, 6)}) > 1


def test_end_of_generation_token_ends_the_answer(small_engine):
    prompt = small_engine.chat_tokens([{"role": "user", "content": "Say just the word yes."}])
    done = small_engine.decoder.generate(prompt, GenerationRequest(max_tokens=64, sampling=GREEDY))
    assert done.finish_reason == "stop"
    assert done.stats.generated_tokens < 64
    assert "<|im_end|>" not in done.text


def test_prompt_too_long_for_context(small_model):
    ctx = LlamaContext(small_model, ContextParams(n_ctx=32))
    try:
        # llama.cpp may round the context up; the limit is what it reports.
        with pytest.raises(InvalidRequest, match="does not fit"):
            Decoder(small_model, KVSequence(ctx)).generate(list(range(100, 110 + ctx.n_ctx)))
    finally:
        ctx.close()


def test_generation_stops_at_a_full_context(small_model):
    ctx = LlamaContext(small_model, ContextParams(n_ctx=64))
    try:
        # llama.cpp may round the context up: a prompt that leaves room for only a few tokens
        # reaches the end of whatever context it built without generating hundreds first.
        prompt = small_model.tokenize("Once upon a time")
        prompt += [prompt[-1]] * (ctx.n_ctx - 8 - len(prompt))
        done = Decoder(small_model, KVSequence(ctx)).generate(prompt, GenerationRequest(
            max_tokens=500, sampling=GREEDY, ignore_eos=True))
        assert done.finish_reason == "length"
        assert 0 < done.stats.generated_tokens < 500
        assert done.stats.prompt_tokens + done.stats.generated_tokens <= ctx.n_ctx
    finally:
        ctx.close()


def test_a_refused_engine_frees_what_it_loaded(monkeypatch):
    """A context beyond the trained one is refused before anything loads; a load that fails
    after the model is in memory frees the model before raising, not at garbage collection."""
    from edgespec import engine as engine_module
    from edgespec.llama import backend

    gc.collect()  # no model of an earlier test is freed while the spy counts
    freed = []
    close = backend.LlamaModel.close

    def spy(model):
        freed.append(model._model is not None)
        close(model)
    monkeypatch.setattr(backend.LlamaModel, "close", spy)
    with pytest.raises(InvalidRequest, match="exceeds the model's trained context"):
        Engine(EngineConfig(model=SMALL, n_ctx=10 ** 6))
    assert freed == []  # refused by the load plan, before any model was loaded

    def refuse(*args, **kwargs):
        raise InvalidRequest("no context")
    monkeypatch.setattr(engine_module, "LlamaContext", refuse)
    try:
        Engine(EngineConfig(model=SMALL, n_ctx=1024))
    except InvalidRequest as e:  # the traceback still holds the half-built engine here
        assert "no context" in str(e)
        assert freed == [True]
    else:
        pytest.fail("the failing context was not reported")


def test_bad_requests():
    with pytest.raises(InvalidRequest):
        GenerationRequest(max_tokens=0)
    with pytest.raises(InvalidRequest):
        SamplingParams(temperature=-1)
    with pytest.raises(InvalidRequest):
        SamplingParams(top_p=0)


def test_multibyte_text_streams_whole_characters(small_engine):
    # Emoji and CJK are split over several byte tokens in SmolLM2's vocabulary.
    text = "naïve café 世界 🎉🎉 ok"
    toks = small_engine.model.tokenize(text, add_special=False)
    assert len(toks) > len(text.split())
    from edgespec.decode.detok import Detokenizer
    d = Detokenizer()
    pieces = [d.feed(small_engine.model.token_piece(t)) for t in toks] + [d.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert np.any([p == "" for p in pieces])  # some tokens completed no character yet
