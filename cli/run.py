"""`edgespec run`: one prompt in, a streamed answer and one stats line out."""
from __future__ import annotations

import signal
import sys
import threading
from typing import Optional

import typer

from edgespec.cli import app
from edgespec.cli import common as c
from edgespec.decode.events import DoneEvent, TokenEvent
from edgespec.decode.request import GenerationRequest


@app.command()
def run(
    prompt: Optional[str] = c.PROMPT,
    model: str = c.MODEL,
    max_tokens: int = c.MAX_TOKENS,
    temperature: float = c.TEMPERATURE,
    top_k: int = c.TOP_K,
    top_p: float = c.TOP_P,
    min_p: float = c.MIN_P,
    repeat_penalty: float = c.REPEAT_PENALTY,
    seed: Optional[int] = c.SEED,
    system: Optional[str] = c.SYSTEM,
    stop: Optional[list[str]] = c.STOP,
    raw: bool = typer.Option(False, "--raw", help="Send the prompt as is, without the chat template."),
    draft: str = c.DRAFT,
    draft_max: Optional[int] = c.DRAFT_MAX,
    draft_tree: Optional[bool] = c.DRAFT_TREE,
    draft_model: Optional[str] = c.DRAFT_MODEL,
    onnx_provider: str = c.ONNX_PROVIDER,
    onnx_bits: str = c.ONNX_BITS,
    recheck_gap: float = c.RECHECK_GAP,
    exact: bool = c.EXACT,
    flash_attn: Optional[bool] = c.FLASH_ATTN,
    ram_budget: Optional[str] = c.RAM_BUDGET,
    vram_budget: Optional[str] = c.VRAM_BUDGET,
    placement: Optional[str] = c.PLACEMENT,
    ctx: int = c.CTX,
    threads: Optional[int] = c.THREADS,
    n_gpu_layers: int = c.GPU_LAYERS,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming."),
) -> None:
    """Generate an answer to PROMPT with the chat template applied, then print its stats."""
    text = c.read_prompt(prompt)
    request = GenerationRequest(
        max_tokens=max_tokens, stop=tuple(stop or ()),
        sampling=c.sampling_from_options(temperature, top_k, top_p, min_p, repeat_penalty, seed))
    with c.engine_from_options(
            model=model, ctx=ctx, threads=threads, n_gpu_layers=n_gpu_layers, draft=draft, draft_max=draft_max,
            draft_tree=draft_tree, draft_model=draft_model, ram_budget=ram_budget, recheck_gap=recheck_gap,
            onnx_provider=onnx_provider, onnx_bits=onnx_bits, vram_budget=vram_budget, placement=placement,
            exact=exact, flash_attn=flash_attn) as engine:
        if raw:
            tokens = engine.text_tokens(text)
        else:
            messages = ([{"role": "system", "content": system}] if system else [])
            tokens = engine.chat_tokens(messages + [{"role": "user", "content": text}])
        done = _generate(engine, tokens, request, stream=not as_json)
    if as_json:
        c.print_json({"text": done.text, "prompt_tokens": done.stats.prompt_tokens,
                      "generated_tokens": done.stats.generated_tokens,
                      "finish_reason": done.finish_reason, "model": model,
                      "stats": done.stats.to_dict()})
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
        typer.echo(c.stats_line(done.stats), err=True)
    if done.finish_reason == "cancelled":
        raise typer.Exit(130)


def _generate(engine, tokens, request, stream: bool) -> DoneEvent:
    """Streams to stdout; the first Ctrl-C ends the answer cleanly instead of killing llama.cpp."""
    cancel = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: cancel.set())
    try:
        for ev in engine.stream_tokens(tokens, request, cancel):
            if isinstance(ev, TokenEvent) and stream and ev.text:
                sys.stdout.write(ev.text)
                sys.stdout.flush()
            elif isinstance(ev, DoneEvent):
                return ev
    finally:
        signal.signal(signal.SIGINT, previous)
    raise AssertionError("generation ended without a DoneEvent")
