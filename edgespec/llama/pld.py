"""In-process peer for the benchmark: llama-cpp-python's own prompt-lookup decoding.

The benchmark harness (edgespec.bench.peers) compares edgespec with llama-cpp-python's own
prompt-lookup speculative decoding, ``Llama(draft_model=LlamaPromptLookupDecoding(...))``.
It lives here because this module is edgespec's only importer of ``llama_cpp``. Nothing else in
edgespec uses it.

Tokenization: ``Llama.create_completion`` given a *string* prompt tokenizes it itself with
``special=True`` (so "<|im_start|>" becomes its control token) and prepends the BOS when the
model's GGUF asks for one, whether or not the text already begins with it; it may also append
an EOS/SEP to the prompt for models whose vocabulary sets add_eos or a separator token. To feed
the peer exactly the tokens edgespec feeds itself, the prompt is tokenized here with the same
rule as ``Engine.chat_tokens`` (parse special tokens; add the BOS only when the text does not
already start with it) and given to ``create_completion`` as a token list, which it uses
verbatim (no BOS, no EOS added).
"""
from __future__ import annotations

import logging
import os
import threading
import time

import llama_cpp as lc
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

from edgespec.errors import InvalidRequest
from edgespec.files.modelfile import model_file
from edgespec.llama.backend import ensure_initialized

log = logging.getLogger(__name__)

_peer_llamas: dict[tuple, object] = {}
_peer_lock = threading.Lock()


def _peer_llama(model_path: str, n_threads: int, n_ctx: int, num_pred_tokens: int, flash_attn: bool):
    key = (os.path.abspath(model_path), int(n_threads), int(n_ctx), int(num_pred_tokens), flash_attn)
    with _peer_lock:
        llm = _peer_llamas.get(key)
        if llm is None:
            model_file(model_path)  # the validator sees every file before llama.cpp does
            # logits_all=True: llama-cpp-python 0.3.36 raises "could not broadcast input array"
            # with a draft model unless every row's logits are kept.
            llm = lc.Llama(model_path=model_path,
                           draft_model=LlamaPromptLookupDecoding(num_pred_tokens=num_pred_tokens),
                           logits_all=True, n_ctx=n_ctx, n_threads=n_threads,
                           n_threads_batch=n_threads, verbose=False, flash_attn=flash_attn,
                           op_offload=False)  # wholly on the CPU: no batch goes to a GPU
            _peer_llamas[key] = llm
        return llm


def close_peer_models() -> None:
    """Frees every llama-cpp-python model the peer loaded."""
    with _peer_lock:
        models = list(_peer_llamas.values())
        _peer_llamas.clear()
    for llm in models:
        try:
            llm.close()
        except Exception:  # best effort at shutdown
            log.debug("closing a peer model failed", exc_info=True)


def prompt_lookup_generate(model_path: str | os.PathLike, prompt_text: str, max_tokens: int,
                           n_threads: int, n_ctx: int, num_pred_tokens: int = 10,
                           flash_attn: bool = True) -> dict:
    """Greedy generation with llama-cpp-python's ``LlamaPromptLookupDecoding``.

    ``prompt_text`` is already chat-templated. Returns ``text``, ``new_tokens`` (generated tokens,
    a final end-of-generation token not counted, as in edgespec's own stats), ``gen_s`` (wall time
    from the first sampled token to the end, as edgespec's ``GenerationStats.gen_s``),
    ``prefill_s`` (call start to the first sampled token: tokenization, prompt evaluation and
    the first sample), ``prompt_tokens``, ``steps`` (target evaluations after the prefill, one per
    verified draft), ``drafted`` and ``accepted`` (draft tokens evaluated and matched) and
    ``finish_reason``. The model stays loaded for the next call with the same settings; every
    call evaluates its prompt from scratch (no prefix reuse between calls).
    """
    if max_tokens < 1:
        raise InvalidRequest("max_tokens must be at least 1")
    if not prompt_text:
        raise InvalidRequest("the prompt is empty")
    ensure_initialized()
    llm = _peer_llama(str(model_path), n_threads, n_ctx, num_pred_tokens, flash_attn)
    prompt = _prompt_tokens(llm, prompt_text)
    if len(prompt) + max_tokens > n_ctx:
        raise InvalidRequest(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceed n_ctx={n_ctx}")
    counter = _DraftCounter(llm)
    t0, t_end, text, finish = _greedy_completion(llm, prompt, max_tokens, counter)
    t_first = counter.first if counter.first is not None else t_end
    return {
        "text": text,
        "new_tokens": counter.sampled - counter.eog,
        "gen_s": t_end - t_first,
        "prefill_s": t_first - t0,
        "prompt_tokens": len(prompt),
        "steps": max(counter.evals - 1, 0),
        "drafted": counter.drafted,
        "accepted": counter.accepted,
        "finish_reason": finish,
    }


def _prompt_tokens(llm, prompt_text: str) -> list[int]:
    """Tokenizes chat-templated text as Engine.chat_tokens does: BOS added only when not already there."""
    vocab = llm._model.vocab
    bos = int(lc.llama_vocab_bos(vocab))
    bos_text = llm.detokenize([bos], special=True).decode("utf-8", errors="replace") if bos >= 0 else ""
    add_bos = bool(lc.llama_vocab_get_add_bos(vocab)) and not (bos_text and prompt_text.startswith(bos_text))
    return llm.tokenize(prompt_text.encode("utf-8"), add_bos=add_bos, special=True)


class _DraftCounter:
    """Stands in for a Llama's eval and sample to count target evaluations and drafted tokens."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.vocab = llm._model.vocab
        self.evals = self.drafted = self.accepted = self.sampled = self.eog = 0
        self.first: float | None = None  # perf_counter() of the first sampled token
        self._eval, self._sample = llm.eval, llm.sample

    def eval(self, tokens):
        """Evaluates ``tokens``; after the prefill each evaluation verifies [last token, draft...]."""
        if self.evals > 0:
            self.drafted += max(len(tokens) - 1, 0)
        self.evals += 1
        return self._eval(tokens)

    def sample(self, *args, **kwargs):
        """Samples at ``idx``; a match with the draft token evaluated at ``idx + 1`` is accepted."""
        tok = self._sample(*args, **kwargs)
        idx = kwargs.get("idx")
        if self.first is None:
            self.first = time.perf_counter()
        self.sampled += 1
        if idx is not None and idx + 1 < self.llm.n_tokens and tok == int(self.llm._input_ids[idx + 1]):
            self.accepted += 1
        if lc.llama_vocab_is_eog(self.vocab, tok):
            self.eog += 1
        return tok


def _greedy_completion(llm, prompt: list[int], max_tokens: int,
                       counter: _DraftCounter) -> tuple[float, float, str, str]:
    """Streams one greedy completion with ``counter`` hooked in; returns (t0, t_end, text, finish_reason)."""
    pieces: list[str] = []
    finish = ""
    llm.reset()  # no prefix reuse from the previous call: every prompt is evaluated in full
    llm.eval, llm.sample = counter.eval, counter.sample  # Llama.generate calls both through self
    try:
        t0 = time.perf_counter()
        for chunk in llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0, top_k=1,
                                           top_p=1.0, min_p=0.0, repeat_penalty=1.0, stream=True):
            choice = chunk["choices"][0]
            pieces.append(choice.get("text") or "")
            finish = choice.get("finish_reason") or finish
        t_end = time.perf_counter()
    finally:
        del llm.eval, llm.sample  # back to the class's methods
    return t0, t_end, "".join(pieces), finish
