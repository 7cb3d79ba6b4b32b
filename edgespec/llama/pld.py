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

import llama_cpp as lc

from edgespec.errors import InvalidRequest
from edgespec.files.modelfile import model_file
from edgespec.llama.backend import ensure_initialized

log = logging.getLogger(__name__)

_peer_llamas: dict[tuple, object] = {}
_peer_lock = threading.Lock()


def _peer_llama(model_path: str, n_threads: int, n_ctx: int, num_pred_tokens: int, flash_attn: bool):
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

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
    import time

    if max_tokens < 1:
        raise InvalidRequest("max_tokens must be at least 1")
    if not prompt_text:
        raise InvalidRequest("the prompt is empty")
    ensure_initialized()
    llm = _peer_llama(str(model_path), n_threads, n_ctx, num_pred_tokens, flash_attn)
    vocab = llm._model.vocab
    bos = int(lc.llama_vocab_bos(vocab))
    bos_text = llm.detokenize([bos], special=True).decode("utf-8", errors="replace") if bos >= 0 else ""
    add_bos = bool(lc.llama_vocab_get_add_bos(vocab)) and not (bos_text and prompt_text.startswith(bos_text))
    prompt = llm.tokenize(prompt_text.encode("utf-8"), add_bos=add_bos, special=True)
    if len(prompt) + max_tokens > n_ctx:
        raise InvalidRequest(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceed n_ctx={n_ctx}")

    # Count by wrapping the instance's eval/sample (Llama.generate calls them through self):
    # each eval after the prefill verifies [last token, draft...]; a sample at position idx
    # checks the draft token at idx + 1 when one was evaluated there.
    counts = {"evals": 0, "drafted": 0, "accepted": 0, "sampled": 0, "eog": 0}
    t = {"first": None}
    orig_eval, orig_sample = llm.eval, llm.sample

    def eval_(tokens):
        if counts["evals"] > 0:
            counts["drafted"] += max(len(tokens) - 1, 0)
        counts["evals"] += 1
        return orig_eval(tokens)

    def sample(*args, **kwargs):
        tok = orig_sample(*args, **kwargs)
        idx = kwargs.get("idx")
        if t["first"] is None:
            t["first"] = time.perf_counter()
        counts["sampled"] += 1
        if idx is not None and idx + 1 < llm.n_tokens and tok == int(llm._input_ids[idx + 1]):
            counts["accepted"] += 1
        if lc.llama_vocab_is_eog(vocab, tok):
            counts["eog"] += 1
        return tok

    pieces: list[str] = []
    finish = ""
    llm.reset()  # no prefix reuse from the previous call: every prompt is evaluated in full
    llm.eval, llm.sample = eval_, sample
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
    t_first = t["first"] if t["first"] is not None else t_end
    return {
        "text": "".join(pieces),
        "new_tokens": counts["sampled"] - counts["eog"],
        "gen_s": t_end - t_first,
        "prefill_s": t_first - t0,
        "prompt_tokens": len(prompt),
        "steps": max(counts["evals"] - 1, 0),
        "drafted": counts["drafted"],
        "accepted": counts["accepted"],
        "finish_reason": finish,
    }
