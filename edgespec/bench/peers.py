"""Peer systems the benchmark harness runs side by side with edgespec, same prompts, same models.

Four peers, selectable like configurations:

``peer:llama-cpp-python-pld``
    llama-cpp-python's own prompt-lookup decoding (``Llama(draft_model=
    LlamaPromptLookupDecoding(num_pred_tokens=10))``), in process; its code lives in
    :func:`edgespec.llama.pld.prompt_lookup_generate` because the llama package is edgespec's only
    importer of ``llama_cpp``.
``peer:llama.cpp-draft``
    llama.cpp's native ``llama-speculative-simple --spec-type draft-simple -md DRAFT
    --spec-draft-n-max 4``, run as a subprocess.
``peer:llama.cpp-ngram-mod``
    the same binary with ``--spec-type ngram-mod`` (model-free n-gram drafting).
``peer:llama.cpp-plain``
    the same binary drafting nothing: native plain decoding, timed by the same "decoded" window
    as the two above, so each native peer has a native baseline. ``--spec-type none`` cannot
    serve: ``common_speculative_init`` returns NULL without an implementation and the binary
    exits ("failed to initialize speculative decoding"). Instead ``--spec-type ngram-simple``
    with a 1024-token lookup n-gram (the most the option takes) and a 1-token draft:
    ``common_ngram_simple_draft`` returns nothing while the context holds at most
    1024 + 1 + 1 tokens, and beyond that only when the last 1024 tokens occurred before
    verbatim. Every step is then one token in a batch of one, the loop plain decoding runs; the
    adapter refuses a run that drafted anything. ``-n max_tokens - 1`` decodes exactly
    ``max_tokens`` tokens (no draft, no overshoot).

The native binaries are built from the llama.cpp that llama-cpp-python's source archive vendors
by ``benchmarks/build_peers.sh`` into ``$EDGESPEC_HOME/peers/bin``; without them the native
peers raise :class:`PeerUnavailable`, whose one-line message names the build command.

What ``llama-speculative-simple`` (llama-cpp-python 0.3.36's vendored llama.cpp) does, from its
source and from runs here:

* It tokenizes the prompt with ``add_special=true, parse_special=true``: special tokens in the
  already-templated text become control tokens, and it prepends a BOS when the model wants one.
  It never applies a chat template (it has no conversation mode). A prompt whose template writes
  the BOS itself is passed without that leading BOS text, so the model sees one BOS, exactly as
  edgespec's ``Engine.chat_tokens`` does.
* Its "encoded N tokens" counts the whole prompt but times the prompt *minus its last token*
  (N - 1 tokens evaluated); its "decoded" time starts after that and covers evaluating the last
  prompt token (which yields the first new token) and everything after: the reported speed
  excludes prompt evaluation but includes the first token (``gen_tokens == new_tokens``), and a
  final end-of-generation token, which it counts (:func:`parse_run` does not).
* Its loop stops only once it has decoded *more* than ``-n`` tokens, and the last step
  overshoots: when the remaining budget reaches 0 it asks for a draft of "n_max = 0", which
  llama.cpp reads as *no limit*, so that last verification may accept a whole draft
  (``--spec-draft-n-max``, 4 here; ngram-mod's own n_max, 64). ``-n N`` therefore decodes
  between N + 1 and N + 1 + that many tokens (seen: -n 31 -> 35 with draft-simple, -n 127 ->
  156 with ngram-mod). The adapter passes ``-n max_tokens - 1`` and reports the count actually
  decoded and the time it took (``raw["overshoot"]`` = the excess). When an end-of-generation
  token ends the run, llama.cpp counts it in "decoded"; the adapter does not (as edgespec does
  not) when it can tell, i.e. when the run stopped short of ``max_tokens``.
* ``-f FILE`` drops one trailing newline of the file; the adapter writes one extra, so a chat
  prompt ending in "assistant\n" reaches the model intact.
* Its stats go to stderr, each line behind a "0.58.812.048 I " time/level prefix; stdout holds
  the prompt (detokenized) followed by the generated text.
* The target's perf block counts every multi-token batch (prompt *and* draft verifications)
  as "prompt eval" and only single-token decodes as "eval": it is kept in ``raw`` but is no
  measure of prefill.
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from edgespec.errors import EdgespecError, InvalidRequest
from edgespec.files.modelfile import model_file
from edgespec.files.store import default_home
from edgespec.llama import OP_OFFLOAD_SET_BY_EDGESPEC, pld
from edgespec.llama.invariant import TILED_MM_ENV
from edgespec.llama.kernels import OP_OFFLOAD_ENV

BUILD_COMMAND = "bash benchmarks/build_peers.sh"
SPEC_BINARY = "llama-speculative-simple"
BENCH_BINARY = "llama-bench"
NATIVE_KINDS = ("draft", "ngram-mod", "plain")
NATIVE_PLAIN = "peer:llama.cpp-plain"  # the native baseline the other native peers are also compared with
# ngram-simple's longest lookup n-gram (llama.cpp's option refuses more) and shortest draft: the
# plain peer's "drafter" needs the context to exceed 1024 + 1 + 1 tokens before it even searches.
NEVER_DRAFT_NGRAM_N = 1024
NEVER_DRAFT_NGRAM_M = 1
DEFAULT_TIMEOUT_S = 1800.0
DRAFT_N_MAX = 4          # --spec-draft-n-max of peer:llama.cpp-draft (as in ../shared/PEERS.md)
PLD_NUM_PRED_TOKENS = 10  # num_pred_tokens of peer:llama-cpp-python-pld


class PeerUnavailable(EdgespecError):
    """A peer cannot run here (its native binary was not built, or it needs a missing drafter)."""


class PeerFailed(EdgespecError):
    """A peer ran but failed: non-zero exit, timeout, or output without its statistics."""


@dataclass
class PeerResult:
    """One generation by a peer.

    Attributes:
        new_tokens: generated tokens, a final end-of-generation token not counted.
        gen_s: generation wall time, prompt evaluation excluded where the peer reports it.
        prefill_s: prompt evaluation time when the peer reports it (None otherwise).
        drafted: draft tokens the target verified.
        accepted: draft tokens the target accepted.
        text: the generated text when the peer shows it (None otherwise).
        raw: every parsed field, plus peer-specific extras (``command``, ``steps``, ...).
        gen_tokens: tokens produced within ``gen_s``. llama.cpp's "decoded" window includes the
            first new token (``gen_tokens == new_tokens``); the in-process peer's window starts
            at the first sampled token, as edgespec's own ``gen_s`` does
            (``gen_tokens == new_tokens - 1``).
    """

    new_tokens: int
    gen_s: float
    prefill_s: float | None = None
    drafted: int = 0
    accepted: int = 0
    text: str | None = None
    raw: dict = field(default_factory=dict)
    gen_tokens: int | None = None

    @property
    def tokens_per_s(self) -> float:
        """Tokens produced per second of ``gen_s`` (``gen_tokens`` when known)."""
        n = self.new_tokens if self.gen_tokens is None else self.gen_tokens
        return n / self.gen_s if n > 0 and self.gen_s > 0 else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


# -- parsing llama-speculative-simple's output ---------------------------------------------------
_NUM = r"([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|[-+]?nan|[-+]?inf)"
_RE_DECODED = re.compile(rf"decoded\s+(\d+)\s+tokens\s+in\s+{_NUM}\s+seconds,\s+speed:\s+{_NUM}\s+t/s")
_RE_ENCODED = re.compile(rf"encoded\s+(\d+)\s+tokens\s+in\s+{_NUM}\s+seconds,\s+speed:\s+{_NUM}\s+t/s")
# Lines carry a "0.58.812.048 I " time/level prefix when llama.cpp's log prefix is on.
_RE_KV = re.compile(rf"\b(n_draft|n_predict|n_drafted|n_accept|accept)\s*=\s*{_NUM}\s*%?\s*$", re.MULTILINE)
# llama_perf_context_print, after "target:" (the draft model's block, if any, comes before it)
_RE_PERF = re.compile(rf"\b(load time|prompt eval time|eval time|total time)\s*=\s*{_NUM}\s*ms"
                      rf"(?:\s*/\s*(\d+)\s*(tokens|runs))?")
_RE_SAMPLER = re.compile(rf"\bsampling time\s*=\s*{_NUM}\s*ms")


def _native_env() -> dict[str, str]:
    """The environment of a native peer: llama.cpp's default kernels even in an `--exact` run,
    and its own op offload threshold unless the user set one (edgespec's is for its pinned
    split targets; a native peer maps its weights)."""

    drop = {TILED_MM_ENV} | ({OP_OFFLOAD_ENV} if OP_OFFLOAD_SET_BY_EDGESPEC else set())
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "LC_ALL": "C"}


def _num(s: str) -> float:
    return float(s)


def parse_speculative_simple(output: str) -> PeerResult:
    """Statistics of one ``llama-speculative-simple`` run from its stderr (or stderr + stdout).

    Parses ``encoded N tokens in S seconds, speed: X t/s`` (N: the whole prompt; S: evaluating
    all but its last token), ``decoded N tokens in S seconds, speed: X t/s``, ``n_draft``, ``n_predict``,
    ``n_drafted``, ``n_accept``, ``accept = P%`` and, when printed, the target's perf block
    (``prompt eval time``, ``eval time ... / R runs``). ``new_tokens`` is the decoded count as
    printed; :func:`parse_run` corrects it for a counted end-of-generation token.

    Raises:
        PeerFailed: the output has no "decoded ... speed" line.
    """
    m = None
    for m in _RE_DECODED.finditer(output):
        pass  # the last one: the run's summary
    if m is None:
        tail = " | ".join(line.strip() for line in output.strip().splitlines()[-3:])
        raise PeerFailed(f"{SPEC_BINARY} printed no 'decoded ... speed' line (last output: {tail[:300]!r})")
    raw: dict = {"decoded_tokens": int(m.group(1)), "decoded_s": _num(m.group(2)),
                 "decoded_tok_s": _num(m.group(3))}
    e = None
    for e in _RE_ENCODED.finditer(output):
        pass
    if e is not None:
        raw.update(encoded_tokens=int(e.group(1)), encoded_s=_num(e.group(2)), encoded_tok_s=_num(e.group(3)))
    tail = output[m.end():]
    for k in _RE_KV.finditer(tail):
        key, val = k.group(1), k.group(2)
        raw["accept_pct" if key == "accept" else key] = _num(val) if key == "accept" else int(float(val))
    # The target's perf block follows "target:"; a draft model's (if printed) precedes it.
    tgt = tail.rsplit("target:", 1)[1] if "target:" in tail else ""
    for p in _RE_PERF.finditer(tgt):
        name = p.group(1).replace(" ", "_")
        raw[f"{name}_ms"] = _num(p.group(2))
        if p.group(3):
            raw[f"{name}_{p.group(4)}"] = int(p.group(3))
    s = _RE_SAMPLER.search(tgt)
    if s:
        raw["sampling_time_ms"] = _num(s.group(1))
    n = raw["decoded_tokens"]
    return PeerResult(new_tokens=n, gen_s=raw["decoded_s"], prefill_s=raw.get("encoded_s"),
                      drafted=raw.get("n_drafted", 0), accepted=raw.get("n_accept", 0),
                      raw=raw, gen_tokens=n)


def generated_text(stdout: str, prompt_shown: str) -> str | None:
    """The generated text from ``llama-speculative-simple``'s stdout, which is "\\n\\n", the
    detokenized prompt, the generated pieces, then "\\n\\n\\n\\n". None when the prompt is not
    found as shown (a tokenizer that does not round-trip it)."""
    i = stdout.find(prompt_shown)
    if i < 0:
        return None
    text = stdout[i + len(prompt_shown):]
    return text.removesuffix("\n\n\n\n")


# -- locating and running the native binaries ---------------------------------------------------
def peers_bin_dir() -> Path:
    """``$EDGESPEC_HOME/peers/bin`` (default ``~/.cache/edgespec/peers/bin``)."""

    return Path(default_home()) / "peers" / "bin"


def find_peer_binary(name: str) -> Path | None:
    """The executable ``name`` in ``$EDGESPEC_HOME/peers/bin``, else on ``PATH``, else None."""
    p = peers_bin_dir() / name
    if p.is_file() and os.access(p, os.X_OK):
        return p
    found = shutil.which(name)
    return Path(found) if found else None


def _require_binary(name: str) -> Path:
    p = find_peer_binary(name)
    if p is None:
        raise PeerUnavailable(f"{name} not found in {peers_bin_dir()} or on PATH; "
                              f"build it with: {BUILD_COMMAND}")
    return p


@functools.lru_cache(maxsize=16)
def _bos_text_to_strip(model_path: str, mtime_ns: int) -> str:
    """The BOS token's text when llama.cpp will prepend a BOS itself (else "")."""

    md = model_file(model_path).gguf.metadata
    add_bos = md.get("tokenizer.ggml.add_bos_token", md.get("tokenizer.ggml.model") == "llama")
    bos = md.get("tokenizer.ggml.bos_token_id")
    tokens = md.get("tokenizer.ggml.tokens") or []
    if not add_bos or not isinstance(bos, int) or not 0 <= bos < len(tokens):
        return ""
    return str(tokens[bos])


def _prompt_for_llama_cpp(model_path: str, prompt_text: str) -> tuple[str, str]:
    """(text to pass, text llama.cpp will echo as the prompt): one BOS, never two."""
    bos = _bos_text_to_strip(model_path, os.stat(model_path).st_mtime_ns)
    if bos and prompt_text.startswith(bos):
        return prompt_text[len(bos):], prompt_text
    return prompt_text, (bos + prompt_text) if bos else prompt_text


def write_prompt_file(path: str | os.PathLike, prompt_text: str) -> Path:
    """Writes a prompt for ``-f``, which drops one trailing newline: one extra keeps the text's."""
    path = Path(path)
    path.write_bytes((prompt_text + "\n").encode("utf-8"))
    return path


def llama_cpp_command(kind: str, binary: str | os.PathLike, target_path: str | os.PathLike,
                      draft_path: str | os.PathLike | None, prompt_file: str | os.PathLike,
                      max_tokens: int, threads: int, ctx: int,
                      draft_n_max: int = DRAFT_N_MAX, flash_attn: bool = True,
                      gpu_layers: tuple[int, int] = (0, 0)) -> list[str]:
    """The argument vector of one greedy ``llama-speculative-simple`` run; ``gpu_layers``: the
    target's and the drafter's layers on the GPU (as edgespec placed its own)."""
    if kind not in NATIVE_KINDS:
        raise InvalidRequest(f"unknown llama.cpp peer kind {kind!r} (known: {', '.join(NATIVE_KINDS)})")
    cmd = [str(binary), "-m", str(target_path), "-f", str(prompt_file),
           # -n N decodes at least N + 1 tokens (the loop stops at n_predict > N)
           "-n", str(max(max_tokens - 1, 0)),
           "-t", str(threads), "-tb", str(threads),
           "-c", str(ctx), "-b", str(ctx), "-ub", "512",
           "-fa", "on" if flash_attn else "off", "-ngl", str(gpu_layers[0]),
           "--temp", "0", "--top-k", "1", "--seed", "0"]
    if kind == "draft":
        cmd += ["--spec-type", "draft-simple", "-md", str(draft_path),
                "--spec-draft-n-max", str(draft_n_max),
                "-td", str(threads), "-tbd", str(threads), "-ngld", str(gpu_layers[1])]
    elif kind == "plain":
        cmd += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(NEVER_DRAFT_NGRAM_N),
                "--spec-ngram-simple-size-m", str(NEVER_DRAFT_NGRAM_M)]
    else:
        cmd += ["--spec-type", "ngram-mod"]
    return cmd


def run_llama_cpp_peer(kind: str, target_path: str | os.PathLike, draft_path: str | os.PathLike | None,
                       prompt_text: str, max_tokens: int, threads: int, ctx: int,
                       timeout: float | None = DEFAULT_TIMEOUT_S, draft_n_max: int = DRAFT_N_MAX,
                       flash_attn: bool = True, gpu_layers: tuple[int, int] = (0, 0)) -> PeerResult:
    """Runs llama.cpp's ``llama-speculative-simple`` greedily on an already-templated prompt.

    ``kind`` is ``"draft"`` (needs ``draft_path``, a drafter with the target's vocabulary),
    ``"ngram-mod"`` or ``"plain"`` (drafts nothing). The prompt travels in a file (``-f``), so
    no quoting is involved. ``flash_attn``: the attention kernel (llama.cpp's default: on).
    ``gpu_layers``: the target's and the drafter's layers on the GPU.

    Raises:
        PeerUnavailable: the binary is not built, or ``draft`` has no drafter.
        PeerFailed: the run failed, timed out or printed no statistics, or ``plain`` drafted.
        InvalidRequest: an unknown kind or a non-positive ``max_tokens``.
    """
    if kind not in NATIVE_KINDS:
        raise InvalidRequest(f"unknown llama.cpp peer kind {kind!r} (known: {', '.join(NATIVE_KINDS)})")
    if max_tokens < 1:
        raise InvalidRequest("max_tokens must be at least 1")
    binary = _require_binary(SPEC_BINARY)
    if kind == "draft" and not draft_path:
        raise PeerUnavailable("peer:llama.cpp-draft needs a draft model with the target's vocabulary")
    target_path = str(target_path)
    to_send, shown = _prompt_for_llama_cpp(target_path, prompt_text)
    with tempfile.TemporaryDirectory(prefix="edgespec-peer-") as tmp:
        pfile = write_prompt_file(Path(tmp) / "prompt.txt", to_send)
        cmd = llama_cpp_command(kind, binary, target_path, draft_path, pfile, max_tokens, threads,
                                ctx, draft_n_max, flash_attn, gpu_layers)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, check=False, stdin=subprocess.DEVNULL, capture_output=True,
                                  timeout=timeout, env=_native_env())
        except subprocess.TimeoutExpired as exc:
            raise PeerFailed(f"{SPEC_BINARY} ({kind}) did not finish within {timeout:g} s") from exc
        wall_s = time.perf_counter() - t0
    out = proc.stdout.decode("utf-8", errors="replace")
    err = proc.stderr.decode("utf-8", errors="replace")
    if proc.returncode != 0:
        tail = " | ".join(line.strip() for line in err.strip().splitlines()[-3:])
        raise PeerFailed(f"{SPEC_BINARY} ({kind}) exited with {proc.returncode}: {tail[:400]}")
    r = parse_run(err, out, shown, max_tokens)
    if kind == "plain":
        check_plain(r)
    r.raw.update(command=cmd, bos_stripped=to_send != prompt_text, wall_s=wall_s, kind=kind)
    return r


def check_plain(r: PeerResult) -> None:
    """Refuses a native plain run that drafted (its last 1024 tokens had occurred before).

    Raises:
        PeerFailed: ``r`` verified drafted tokens, so it was not plain decoding.
    """
    if r.drafted:
        raise PeerFailed(f"{NATIVE_PLAIN} drafted {r.drafted} tokens: the text repeated "
                         f"{NEVER_DRAFT_NGRAM_N} tokens verbatim, so this run was no plain decoding")


def parse_run(stderr: str, stdout: str, prompt_shown: str, max_tokens: int) -> PeerResult:
    """A whole run's result: statistics from stderr, text from stdout, and the token count
    without a final end-of-generation token. A run of ``-n max_tokens - 1`` decodes at least
    ``max_tokens`` tokens unless an end-of-generation token (which llama.cpp counts) ends it
    sooner; one that ends within the last step's overshoot is not detected (counted as length)."""
    try:
        r = parse_speculative_simple(stderr)  # the stats go to stderr; generated text can't fake them
    except PeerFailed:
        r = parse_speculative_simple(stderr + "\n" + stdout)
    r.text = generated_text(stdout, prompt_shown)
    decoded = r.raw["decoded_tokens"]
    if decoded < max_tokens:
        # The end-of-generation token is decoded inside the window but not emitted: edgespec's
        # own records count it the same way. Counting it made native tok/s 1/n higher on an
        # n-token answer (5% on Spec-Bench's 20-token translations).
        r.new_tokens = r.gen_tokens = max(decoded - 1, 0)
        r.raw["finish_reason"] = "stop"
    else:
        r.raw["finish_reason"] = "length"
    r.raw["overshoot"] = max(r.new_tokens - max_tokens, 0)
    return r


# -- the registry -----------------------------------------------------------------------------
def _run_pld(prompt_text: str, *, target_path, draft_path=None, max_tokens: int, threads: int,
             ctx: int, timeout: float | None = None, flash_attn: bool = True, gpu_layers=(0, 0)) -> PeerResult:
    if gpu_layers[0]:
        raise PeerUnavailable("peer:llama-cpp-python-pld runs on the CPU only")
    d = pld.prompt_lookup_generate(str(target_path), prompt_text, max_tokens, threads, ctx,
                                       num_pred_tokens=PLD_NUM_PRED_TOKENS, flash_attn=flash_attn)
    raw = dict(d, num_pred_tokens=PLD_NUM_PRED_TOKENS)
    return PeerResult(new_tokens=d["new_tokens"], gen_s=d["gen_s"], prefill_s=d["prefill_s"],
                      drafted=d["drafted"], accepted=d["accepted"], text=d["text"], raw=raw,
                      gen_tokens=max(d["new_tokens"] - 1, 0))


def _native(kind: str) -> Callable[..., PeerResult]:
    def run_native(prompt_text: str, *, target_path, draft_path=None, max_tokens: int, threads: int,
                   ctx: int, timeout: float | None = DEFAULT_TIMEOUT_S, flash_attn: bool = True,
                   gpu_layers: tuple[int, int] = (0, 0)) -> PeerResult:
        return run_llama_cpp_peer(kind, target_path, draft_path, prompt_text, max_tokens, threads,
                                  ctx, timeout=timeout, flash_attn=flash_attn, gpu_layers=gpu_layers)

    run_native.__name__ = f"run_llama_cpp_{kind.replace('-', '_')}"
    return run_native


PEERS: dict[str, Callable[..., PeerResult]] = {
    "peer:llama-cpp-python-pld": _run_pld,
    "peer:llama.cpp-draft": _native("draft"),
    "peer:llama.cpp-ngram-mod": _native("ngram-mod"),
    NATIVE_PLAIN: _native("plain"),
}


ALL_LAYERS = 999


def gpu_layers_of(plan) -> tuple[int, int]:
    """The target's and the drafter's GPU layers of an edgespec LoadPlan: a native peer placed
    as edgespec placed itself. A drafter the plan left out (``auto``'s calibration) goes where
    the placement puts drafters, unless a VRAM budget is in force; loads as asked keep it on
    the CPU."""
    d, mode = plan.drafter, plan.mode
    if d is not None and d.model_params is not None:
        return plan.model.n_gpu_layers, d.model_params.n_gpu_layers
    on_gpu = mode is not None and mode.drafter == "gpu" and plan.config.vram_budget is None
    return plan.model.n_gpu_layers, ALL_LAYERS if on_gpu else 0


def unavailable_reason(peer_name: str) -> str | None:
    """Why ``peer_name`` cannot run here (one line), or None when it can."""
    if peer_name not in PEERS:
        return f"unknown peer {peer_name!r}"
    if peer_name.startswith("peer:llama.cpp-") and find_peer_binary(SPEC_BINARY) is None:
        return f"{SPEC_BINARY} not found in {peers_bin_dir()} or on PATH; build it with: {BUILD_COMMAND}"
    return None


def run(peer_name: str, prompt_text: str, *, target_path, draft_path=None, max_tokens: int,
        threads: int, ctx: int, timeout: float | None = None, flash_attn: bool = True,
        gpu_layers: tuple[int, int] = (0, 0)) -> PeerResult:
    """Runs one peer by its configuration name on an already-templated prompt, with flash
    attention unless ``flash_attn`` is False (llama.cpp's default is on), with ``gpu_layers``
    of the target and the drafter on the GPU (edgespec's own placement, ``gpu_layers_of``)."""
    fn = PEERS.get(peer_name)
    if fn is None:
        raise InvalidRequest(f"unknown peer {peer_name!r} (known: {', '.join(PEERS)})")
    kwargs = {} if timeout is None else {"timeout": timeout}
    return fn(prompt_text, target_path=target_path, draft_path=draft_path, max_tokens=max_tokens,
              threads=threads, ctx=ctx, flash_attn=flash_attn, gpu_layers=gpu_layers, **kwargs)


def close() -> None:
    """Frees what the in-process peer keeps loaded (no-op if it never ran)."""
    pld = sys.modules.get("edgespec.llama.pld")  # loaded only if the peer ran
    if pld is not None:
        pld.close_peer_models()
