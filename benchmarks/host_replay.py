"""The host's share of a speculative step, without the kernels: a step's Python measured alone.

    host_replay.py OUT.json [--model M] [--placement P] [--draft suffix|auto|plain] [--suite S]
        [--categories A,B] [--limit N] [--tokens N] [--repeats N] [--profile]
        [--wait spin|sleep --wait-ms MS]

Plain greedy decoding first writes each prompt's answer with the real model on this machine.
Then every step runs again with llama_decode turned into a no-op, and each row's greedy pick
served from that answer: a row at position p whose token is the answer's token there gets the
answer's next token, any other row a token no draft holds. So the drafts, the acceptance, the
KV edits (on the real context, left empty), the batch, the output and the drafter's work are
what the real run does, and the kernels cost nothing: the generation time is host time.

What it leaves out: the kernels themselves and the wait for them, and reading a row's pick
through ctypes (~1-3 µs a row). ``--profile`` prints the functions that took the time. A drafter
model is not replayed: where `auto` asks one for a draft (it probes the 0.5B on the CPU), its
logits do not exist and the run stops; on the GPU placement `auto` prices the model out.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time

from edgespec.bench.prompts import load_suite, prompt_tokens, select
from edgespec.decode.loop import Decoder
from edgespec.decode.request import GenerationRequest
from edgespec.decode.sampling import SamplingParams
from edgespec.engine import Engine, EngineConfig
from edgespec.decode import sequence
from edgespec.llama import backend, rows

NOT_DRAFTED = -1  # a pick no draft holds: the row is not on the answer's path


def answers(engine: Engine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Each prompt followed by plain greedy decoding's answer, from the real model."""
    out, plain = [], Decoder(engine.model, engine.seq)
    for prompt in prompts:
        engine.reset()
        done = plain.generate(prompt, GenerationRequest(max_tokens=tokens, sampling=SamplingParams()))
        end = [engine.model.eos] if done.stats.finish_reason == "stop" else []  # an EOG token ended it
        out.append(list(prompt) + list(done.token_ids) + end)
    return out


class Replay:
    """Serves every row's pick from the recorded text ``truth`` (prompt + answer)."""

    def __init__(self, wait: str = "none", wait_ms: float = 0.0) -> None:
        """``wait``: what the host does in place of each decode's kernels for ``wait_ms`` ms:
        nothing, sleep (an idle core, as a blocking wait for a GPU leaves it) or spin."""
        self.truth: list[int] = []
        real_decode_rows = backend.LlamaContext.decode_rows

        def decode_rows(ctx, tokens, positions, seq_ids, logits, trims_after=False):
            out = real_decode_rows(ctx, tokens, positions, seq_ids, logits, trims_after)
            out.replayed = (list(tokens), list(positions))
            out._picking = None  # nothing was decoded: the backend's picks are not read
            return out

        def greedy(r, i):
            r._picked(i)  # the real checks: current, flagged (``_picking`` off)
            tokens, positions = r.replayed
            p, truth = positions[i], self.truth
            return truth[p + 1] if p + 1 < len(truth) and truth[p] == tokens[i] else NOT_DRAFTED

        backend.LlamaContext.decode_rows = decode_rows
        self.waits: list[float] = []  # seconds of each stand-in wait
        pause = {"none": None, "sleep": time.sleep, "spin": _spin}[wait]

        real_sync, self.prefilling = sequence.KVSequence.sync, False

        def sync(seq, tokens):  # the prefill: no stand-in wait, not in the generation's clock
            self.prefilling = True
            try:
                return real_sync(seq, tokens)
            finally:
                self.prefilling = False

        sequence.KVSequence.sync = sync

        def decode(ctx, batch):
            if pause is not None and not self.prefilling:
                start = time.perf_counter()
                pause(wait_ms / 1e3)
                self.waits.append(time.perf_counter() - start)
            return 0

        backend.lc.llama_decode = decode
        rows.Rows.greedy = greedy


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def measure(engine: Engine, texts: list[list[int]], prompts: list[list[int]], tokens: int, replay: Replay) -> dict:
    gen = steps = emitted = 0.0
    for text, prompt in zip(texts, prompts):
        replay.truth = text
        engine.reset()
        replay.waits.clear()
        done = engine.decoder.generate(prompt, GenerationRequest(max_tokens=tokens, sampling=SamplingParams()))
        if list(prompt) + list(done.token_ids) != text[:len(prompt) + len(done.token_ids)]:
            raise SystemExit("the replay left the recorded answer: a bug in the replay")
        gen += done.stats.gen_s - sum(replay.waits)
        steps += done.stats.spec.steps if done.stats.spec else done.stats.generated_tokens
        emitted += done.stats.generated_tokens
    return {"steps": steps, "tokens": emitted, "host_ms_per_step": 1e3 * gen / steps,
            "tokens_per_step": emitted / steps}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--draft", default="suffix", help="a drafter, or plain")
    ap.add_argument("--suite", default="code-edit-test")
    ap.add_argument("--categories", default="")
    ap.add_argument("--limit", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=10, help="the least host time of this many runs counts")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--placement", default="cpu", help="where the answers are decoded (the replay decodes nothing)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--wait", choices=("none", "sleep", "spin"), default="none",
                    help="in place of each decode's kernels: nothing, a sleep or a spin of --wait-ms")
    ap.add_argument("--wait-ms", type=float, default=2.0)
    a = ap.parse_args()
    wanted = set(filter(None, a.categories.split(",")))
    suite = [p for p in load_suite(a.suite) if not wanted or p.category in wanted]
    chosen = select(suite, a.limit, "test")
    config = EngineConfig(model=a.model, draft=None if a.draft == "plain" else a.draft, placement=a.placement, n_threads=a.threads)
    with Engine(config) as engine:
        prompts = [prompt_tokens(engine, p) for p in chosen]
        texts = answers(engine, prompts, a.tokens)
    runs = []
    replay = Replay(a.wait, a.wait_ms)
    for _ in range(a.repeats):  # a fresh engine each: the suffix index remembers earlier answers
        with Engine(config) as engine:
            start = time.perf_counter()
            profiler = cProfile.Profile() if a.profile else None
            if profiler:
                profiler.enable()
            runs.append(measure(engine, texts, prompts, a.tokens, replay))
            if profiler:
                profiler.disable()
                buf = io.StringIO()
                pstats.Stats(profiler, stream=buf).sort_stats(os.environ.get("PROFILE_SORT", "cumulative")).print_stats(30)
                print(buf.getvalue())
            runs[-1]["wall_s"] = time.perf_counter() - start
            print(json.dumps(runs[-1]), flush=True)
    best = min(r["host_ms_per_step"] for r in runs)
    with open(a.out, "w") as f:
        json.dump({"model": a.model, "draft": a.draft, "suite": a.suite, "categories": sorted(wanted),
                   "tokens": a.tokens, "prompts": len(prompts), "runs": runs,
                   "host_ms_per_step_min": best}, f, indent=1)
    print(f"host ms per step (min of {a.repeats}): {best:.3f}")


if __name__ == "__main__":
    main()
