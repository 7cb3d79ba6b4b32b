"""Helpers shared by the generation verbs (run, chat): options, prompts, stats rendering."""
from __future__ import annotations

import json
import logging
import sys
from typing import TYPE_CHECKING, Any

import typer

from edgespec.config import DEFAULT_CTX, DEFAULT_DRAFT, DEFAULT_MODEL, EngineConfig, check_threads
from edgespec.errors import InvalidRequest
from edgespec.llama.kernels import KV_CACHE_TYPES
from edgespec.memory.placements import CHAINS, MAX_DRAFT, NAMES as PLACEMENTS, TREES
from edgespec.decode.events import GenerationStats
from edgespec.decode.sampling import SamplingParams
from edgespec.units import format_bytes, parse_bytes

if TYPE_CHECKING:
    from edgespec.engine import Engine

log = logging.getLogger(__name__)


def utf8_text(value):
    """Text from argv or stdin as valid Unicode: bytes that are not UTF-8 become U+FFFD.

    The policy for every text the CLI reads (the prompt argument or stdin, --system, --stop, chat
    lines): Python hands undecodable argv and stdin bytes over as lone surrogates
    (surrogateescape), which UTF-8 cannot encode for the tokenizer; they are turned back into
    their bytes and decoded with errors="replace". Takes a str, a list of them or None.
    """
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return type(value)(utf8_text(v) for v in value)
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        log.warning("input that is not valid UTF-8: its undecodable bytes became U+FFFD")
    try:
        raw = value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate no decoder made (U+D800-U+DC7F): kept as itself, then replaced
        raw = value.encode("utf-8", "surrogatepass")
    return raw.decode("utf-8", "replace")


def _threads(value: int | None) -> int | None:
    """--threads, refused as bad usage above what this machine can use (config.check_threads)."""
    try:
        return check_threads(value) if value is not None else None
    except InvalidRequest as exc:
        raise typer.BadParameter(str(exc)) from None


def _bytes(value: str | None) -> int | None:
    """A byte size option (2GiB, 2048M, bytes), refused as bad usage when it is not one."""
    try:
        return parse_bytes(value) if value is not None else None
    except InvalidRequest as exc:
        raise typer.BadParameter(str(exc)) from None


# Typer options reused by several verbs; defaults follow llama.cpp's sampler defaults.
MODEL = typer.Option(DEFAULT_MODEL, "--model", "-m", help="Model name from the store or path to a .gguf file.")
CTX = typer.Option(DEFAULT_CTX, "--ctx", "-c", min=16, help="Context size in tokens.")
THREADS = typer.Option(None, "--threads", "-t", min=1, callback=_threads, help="CPU threads (default: physical cores).")
GPU_LAYERS = typer.Option(0, "--n-gpu-layers", "-ngl", help="Layers to offload to a GPU (-1: all).")
TEMPERATURE = typer.Option(0.8, "--temperature", "--temp", min=0.0, help="0 means greedy decoding.")
TOP_K = typer.Option(40, "--top-k", min=0, help="Keep the k most likely tokens (0: off).")
TOP_P = typer.Option(0.95, "--top-p", min=0.0, max=1.0, help="Nucleus sampling mass (1: off).")
MIN_P = typer.Option(0.05, "--min-p", min=0.0, max=1.0, help="Drop tokens below min_p x the top probability.")
REPEAT_PENALTY = typer.Option(1.0, "--repeat-penalty", min=0.0, help="Penalty for the last 64 tokens (1: off).")
SEED = typer.Option(None, "--seed", "-s", min=0, help="Random seed for sampling, >= 0 (default: random).")
MAX_TOKENS = typer.Option(512, "--max-tokens", "-n", min=1, help="Most tokens to generate.")
SYSTEM = typer.Option(None, "--system", callback=utf8_text, help="System message.")
STOP = typer.Option(None, "--stop", callback=utf8_text, help="Stop string (repeatable).")
PROMPT = typer.Argument(None, callback=utf8_text, help="The prompt (default: read from stdin).")
DRAFT = typer.Option(DEFAULT_DRAFT, "--draft", "-d",
                     help="none | suffix | model | hybrid | auto | onnx, or a drafter model name/path.")
DRAFT_MAX = typer.Option(None, "--draft-max", min=1, max=MAX_DRAFT,
                         help=f"Most drafted tokens per step (default {CHAINS.draft_max}; for auto "
                              f"{TREES.draft_max} where the planner verifies through a GPU or puts the drafter on one).")
DRAFT_TREE = typer.Option(None, "--draft-tree/--no-draft-tree",
                          help=f"Greedy: the model drafter may draft best-first trees of up to {TREES.draft_max} nodes (`auto`: "
                               "a tree or a chain per step, whichever prices higher). Default: on for auto "
                               "where the planner verifies through a GPU or puts the drafter on one.")
RECHECK_GAP = typer.Option(0.0, "--recheck-gap", min=0.0,
                           help="Greedy: re-decode alone any verified position whose top-2 logit gap is "
                                "below this (batch numerics can flip such near-ties); 0: off.")
EXACT = typer.Option(False, "--exact",
                     help="Greedy speculation returns plain greedy's answer bit for bit: batch-invariant "
                          "CPU kernels, chain drafts, and a check at load. With edgespec's CPU kernels (which "
                          "`make` installs) these are the default kernels; without them, no weight repacking, "
                          "flash attention over a q8_0 cache and llama.cpp's tiled matmul off (plain decoding "
                          "5-10% slower, a 16-token verification about twice the cost). The target must run "
                          "on the CPU.")
GREEDY_ON_BACKEND = typer.Option(True, "--backend-greedy/--no-backend-greedy",
                                 help="With the target's output layer on a GPU, the GPU picks each greedy token "
                                      "and a sampled row's largest logits, and only those come back (default), "
                                      "or whole rows of logits come back and the CPU picks.")
FLASH_ATTN = typer.Option(None, "--flash-attn/--no-flash-attn",
                          help="The target's attention kernel (default for a target on the CPU: on with edgespec's "
                               "CPU kernels, whose rows keep their bits in any batch; off without them, where it "
                               "slows multi-token verification at long contexts. Else llama.cpp's choice).")
DRAFT_MODEL = typer.Option(None, "--draft-model", help="Drafter model for model/hybrid (default: per target).")
ONNX_PROVIDER = typer.Option("cpu", "--onnx-provider",
                             help="--draft onnx: onnxruntime execution provider, cpu | cuda | tensorrt | dml | "
                                  "openvino | qnn | coreml (one absent or refusing the graph falls back to cpu).")
ONNX_BITS = typer.Option("exact", "--onnx-bits",
                         help="--draft onnx: which conversion, exact (the GGUF's blocks) | 4 (4-bit, smaller, faster).")
RAM_BUDGET = typer.Option(None, "--ram-budget", callback=_bytes,
                          help="Resident memory limit (2GiB, 2048M, bytes): the planner fits everything under it.")
VRAM_BUDGET = typer.Option(None, "--vram-budget", callback=_bytes,
                           help="GPU memory limit, like --ram-budget (default with --placement: free VRAM - margin).")
KV_TYPE = typer.Option(None, "--kv-type",
                       help=f"KV cache type: {' | '.join(KV_CACHE_TYPES)} (default: f16, or the planner's choice).")
PLACEMENT = typer.Option(None, "--placement",
                         help=f"Where target and drafter run: {' | '.join(PLACEMENTS)} "
                              "(default: the planner's choice when a budget is given; see `edgespec plan`). "
                              "overlap: draft-gpu with the drafter drafting ahead during verification.")


def engine_config(ctx: int = DEFAULT_CTX, threads: int | None = None, **options) -> EngineConfig:
    """The EngineConfig of a verb's options (the CLI's short names for n_ctx and n_threads)."""
    return EngineConfig(n_ctx=ctx, n_threads=threads, **options)


def engine_from_options(**options) -> Engine:
    """Loads the target and its drafter (errors are typed and become one-line CLI messages)."""
    # Imported here: 0.13 s of a command's start-up that a refused option never needs.
    from edgespec.engine import Engine

    return Engine(engine_config(**options))


def sampling_from_options(temperature: float, top_k: int, top_p: float, min_p: float,
                          repeat_penalty: float, seed: int | None) -> SamplingParams:
    if top_p <= 0.0:
        raise InvalidRequest("--top-p must be > 0")
    if repeat_penalty <= 0.0:
        raise InvalidRequest("--repeat-penalty must be > 0")
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                          repeat_penalty=repeat_penalty, seed=seed)


def read_prompt(prompt: str | None) -> str:
    """The prompt from the argument, else from a piped stdin (utf8_text); never blocks on a terminal."""
    if prompt is None:
        if sys.stdin is None or sys.stdin.isatty():
            raise InvalidRequest("no prompt: pass it as an argument or pipe it on stdin")
        raw = getattr(sys.stdin, "buffer", None)
        prompt = utf8_text(raw.read().decode("utf-8", "surrogateescape") if raw else sys.stdin.read())
    if not prompt.strip():
        raise InvalidRequest("the prompt is empty")
    return prompt


def stats_line(stats: GenerationStats) -> str:
    """One line a person can read at a glance after an answer."""
    parts = [
        f"prompt {stats.prompt_tokens} tok"
        + (f" ({stats.reused_prompt_tokens} reused)" if stats.reused_prompt_tokens else "")
        + f" @ {stats.prompt_tokens_per_s:.1f} tok/s",
        f"generated {stats.generated_tokens} tok @ {stats.tokens_per_s:.1f} tok/s",
        f"ttft {stats.ttft_s:.2f} s",
        # Anon is what a memory limit is hit by; the rest of the RSS is mapped weights the
        # kernel can drop. The process peak includes loading, which can fault in every weight.
        f"peak RSS {format_bytes(stats.peak_rss_bytes)} (anon {format_bytes(stats.peak_anon_bytes)}, "
        f"process {format_bytes(stats.process_peak_rss_bytes)})",
        f"finish {stats.finish_reason}",
    ]
    spec = stats.spec
    if spec is not None and spec.steps:
        split = ", ".join(f"{name} {d.accepted}/{d.drafted}" for name, d in spec.by_drafter.items())
        parts.append(f"draft {spec.mode}: {spec.steps} steps, {spec.accepted}/{spec.drafted} "
                     f"accepted ({100 * spec.acceptance_rate:.0f}%), {spec.mean_emitted:.2f} tok/step"
                     + (f" [{split}]" if len(spec.by_drafter) > 1 else ""))
    return " | ".join(parts)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, ensure_ascii=False) + "\n")
    sys.stdout.flush()
