"""OpenAI response bodies: model cards, whole completions, stream chunks, usage and edgespec's stats."""
from __future__ import annotations

from edgespec import __version__
from edgespec.decode.events import DoneEvent
from edgespec.server.config import ServerState

FINGERPRINT = f"edgespec-{__version__}"


def model_card(state: ServerState) -> dict:
    return {"id": state.config.model_id, "object": "model", "created": int(state.started),
            "owned_by": "edgespec"}


def completion_body(done: DoneEvent, chat: bool, ident: str, created: int, model_id: str) -> dict:
    """The one JSON object answering a request that did not ask to stream."""
    finish = done.finish_reason
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": done.text},
                  "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": done.text, "logprobs": None, "finish_reason": finish}
    return {
        "id": ident, "object": "chat.completion" if chat else "text_completion",
        "created": created, "model": model_id, "system_fingerprint": FINGERPRINT,
        "choices": [choice], "usage": usage(done), "edgespec": edgespec_stats(done)}


def chunk_base(chat: bool, ident: str, created: int, model_id: str) -> dict:
    """The fields every chunk of one stream shares."""
    return {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model_id, "system_fingerprint": FINGERPRINT}


def stream_chunk(base: dict, chat: bool, text: str | None, finish: str | None, first: bool = False,
                 **extra) -> dict:
    """One chunk: a chat delta (the first carries the role) or a completion's text piece."""
    if chat:
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    return {**base, "choices": [choice], **extra}


def usage(done: DoneEvent) -> dict:
    st = done.stats
    return {"prompt_tokens": st.prompt_tokens, "completion_tokens": st.generated_tokens,
            "total_tokens": st.prompt_tokens + st.generated_tokens}


def edgespec_stats(done: DoneEvent) -> dict:
    """edgespec's own numbers for one generation: speculation counts, speeds and peak memory."""
    st = done.stats
    spec = st.spec.to_dict() if st.spec is not None else {}
    return {
        "mode": spec.get("mode", "plain"),
        "steps": spec.get("steps", 0),
        "drafted": spec.get("drafted", 0),
        "accepted": spec.get("accepted", 0),
        "acceptance_rate": spec.get("acceptance_rate", 0.0),
        "mean_emitted": spec.get("mean_emitted", 0.0),
        "by_drafter": spec.get("by_drafter", {}),
        "tokens_per_s": st.tokens_per_s,
        "prompt_tokens_per_s": st.prompt_tokens_per_s,
        "reused_prompt_tokens": st.reused_prompt_tokens,
        "ttft_s": st.ttft_s,
        "peak_rss_bytes": st.peak_rss_bytes,
        "peak_anon_bytes": st.peak_anon_bytes,
        "process_peak_rss_bytes": st.process_peak_rss_bytes,
    }
