"""Peer adapters of the benchmark harness: the llama-speculative-simple output parser against
captured real output, the missing-binary error, and short real runs of each peer."""
from __future__ import annotations

import math
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from edgespec.bench import peers
from edgespec.errors import EdgespecError
from edgespec.llama.backend import ModelParams
from edgespec.config import EngineConfig
from edgespec.load.plan import DrafterPlacement
from edgespec.memory.placements import MODES

DATA = Path(__file__).parent / "data" / "peer_output"

TARGET = "qwen2.5-coder-1.5b"
DRAFTER = "qwen2.5-coder-0.5b"
SMALL = "smollm2-135m"
GEMMA = "gemma3-270m"

QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chatml(system: str, user: str) -> str:
    return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            "<|im_start|>assistant\n")


# Looked up in the user's store at import: the session's temporary $EDGESPEC_HOME has no peers.
NATIVE_BINARY = peers.find_peer_binary(peers.SPEC_BINARY)
needs_native = pytest.mark.skipif(
    NATIVE_BINARY is None, reason=f"{peers.SPEC_BINARY} not built; run: {peers.BUILD_COMMAND}")


@pytest.fixture
def native(monkeypatch):
    """The user's built binaries on PATH, where the adapter finds them under the session's home."""
    monkeypatch.setenv("PATH", f"{NATIVE_BINARY.parent}:{os.environ.get('PATH', '')}")


# -- parser against captured real output -----------------------------------------------------
# Captured from llama-speculative-simple built by benchmarks/build_peers.sh (llama.cpp vendored by
# llama-cpp-python 0.3.36), Qwen2.5-Coder-1.5B target, 2 threads, on busy 2-core machines:
# *.txt is stderr, *.stdout.txt stdout, *.prompt.txt the prompt, *.cmd.json the command.
def _captured(name: str) -> str:
    return (DATA / f"{name}.txt").read_text(encoding="utf-8")


def test_parse_captured_draft_output():
    r = peers.parse_speculative_simple(_captured("speculative_simple_draft"))
    assert r.new_tokens == r.gen_tokens == 35  # -n 31: the last step overshoots
    assert r.gen_s == pytest.approx(16.625)
    assert r.prefill_s == pytest.approx(15.527)
    assert (r.drafted, r.accepted) == (30, 27)
    assert r.raw["decoded_tokens"] == r.raw["n_predict"] == 35
    assert r.raw["decoded_tok_s"] == pytest.approx(2.105)
    assert r.raw["encoded_tokens"] == 144
    assert r.raw["encoded_tok_s"] == pytest.approx(9.274)
    assert r.raw["n_draft"] == 4
    assert r.raw["accept_pct"] == pytest.approx(90.0)
    assert r.raw["load_time_ms"] == pytest.approx(6342.07)
    assert r.raw["prompt_eval_time_ms"] == pytest.approx(31159.26)
    assert r.raw["prompt_eval_time_tokens"] == 183
    assert r.raw["eval_time_runs"] == 1
    assert r.raw["total_time_ms"] == pytest.approx(43771.38)
    assert r.tokens_per_s == pytest.approx(35 / 16.625)
    assert r.acceptance == pytest.approx(0.9)
    assert r.text is None  # the parser reads stats only; the text comes from stdout


def test_parse_captured_ngram_mod_output():
    r = peers.parse_speculative_simple(_captured("speculative_simple_ngram_mod"))
    assert r.new_tokens == 156  # -n 127: ngram-mod's last draft is not cut to the budget
    assert r.gen_s == pytest.approx(59.076)
    assert r.prefill_s == pytest.approx(11.492)
    assert (r.drafted, r.accepted) == (104, 68)
    assert r.raw["n_draft"] == 3  # --spec-draft-n-max's default, printed though unused here
    assert r.raw["n_predict"] == 156
    assert r.raw["accept_pct"] == pytest.approx(65.385)
    assert r.raw["encoded_tokens"] == 144
    assert r.raw["prompt_eval_time_tokens"] == 252
    assert r.raw["eval_time_ms"] == pytest.approx(45317.15)
    assert r.raw["eval_time_runs"] == 85
    assert r.raw["sampling_time_ms"] == pytest.approx(109.48)


def test_parse_tolerates_missing_log_prefix_and_stdout_mixed_in():
    """Without llama.cpp's "0.58.812.048 I " prefixes, and with stdout appended, same numbers."""
    err = _captured("speculative_simple_draft")
    bare = re.sub(r"^\d+\.\d+\.\d+\.\d+ [IWEDc] ", "", err, flags=re.MULTILINE)
    assert bare != err
    out = (DATA / "speculative_simple_draft.stdout.txt").read_text(encoding="utf-8")
    a, b = peers.parse_speculative_simple(err), peers.parse_speculative_simple(bare + "\n" + out)
    assert (a.new_tokens, a.gen_s, a.prefill_s, a.drafted, a.accepted) == \
           (b.new_tokens, b.gen_s, b.prefill_s, b.drafted, b.accepted)
    assert a.raw == b.raw


def test_generated_text_of_captured_runs():
    for name, head, tail in [
        ("speculative_simple_draft", "```python\nfrom typing import List, Tuple\n\ndef merge_intervals(",
         "    Merge"),
        ("speculative_simple_ngram_mod", "```python\ndef merge_intervals(intervals):\n    \"\"\"\n",
         "    return [tuple(iv) for iv in merged]\n```"),
    ]:
        out = (DATA / f"{name}.stdout.txt").read_text(encoding="utf-8")
        prompt = (DATA / f"{name}.prompt.txt").read_text(encoding="utf-8")
        assert prompt.endswith("<|im_start|>assistant\n")
        text = peers.generated_text(out, prompt)
        assert text is not None and text.startswith(head) and text.endswith(tail), text
    assert peers.generated_text(out, "a prompt that is not there") is None


def test_parse_run_of_captured_outputs():
    """Whole-run results: the end-of-generation token llama.cpp counts is counted neither as
    emitted nor in the tokens/s, the text comes from stdout, and "accept = -nan%" (nothing
    drafted) parses."""
    def load(name):
        return [(DATA / f"{name}{ext}").read_text(encoding="utf-8")
                for ext in (".txt", ".stdout.txt", ".prompt.txt")]

    err, out, prompt = load("speculative_simple_ngram_mod_eog")  # -n 15, stopped early
    r = peers.parse_run(err, out, prompt, max_tokens=16)
    assert r.raw["decoded_tokens"] == 11 and r.new_tokens == 10 and r.gen_tokens == 10
    assert r.raw["finish_reason"] == "stop" and r.raw["overshoot"] == 0
    assert (r.drafted, r.accepted) == (0, 0) and math.isnan(r.raw["accept_pct"])
    assert r.gen_s == pytest.approx(53.825) and r.prefill_s == pytest.approx(5.959)
    assert r.text == "The quick brown fox jumps over the lazy dog."

    err, out, prompt = load("speculative_simple_draft")  # -n 31
    r = peers.parse_run(err, out, prompt, max_tokens=32)
    assert r.new_tokens == 35 and r.raw["finish_reason"] == "length" and r.raw["overshoot"] == 3
    assert r.text.startswith("```python\nfrom typing import List, Tuple\n")


def test_parse_captured_native_plain_output():
    """peer:llama.cpp-plain on the ngram-mod capture's prompt, -n 31: exactly 32 tokens, none drafted
    ("accept = -nan%"), one token per step (31 single-token evals after the first token)."""
    err, out, prompt = [(DATA / f"speculative_simple_plain{ext}").read_text(encoding="utf-8")
                        for ext in (".txt", ".stdout.txt", ".prompt.txt")]
    r = peers.parse_run(err, out, prompt, max_tokens=32)
    assert r.new_tokens == r.gen_tokens == 32 and r.raw["overshoot"] == 0
    assert r.raw["finish_reason"] == "length"
    assert (r.drafted, r.accepted) == (0, 0) and math.isnan(r.raw["accept_pct"])
    assert r.gen_s == pytest.approx(2.858) and r.prefill_s == pytest.approx(1.897)
    assert r.raw["eval_time_runs"] == 31
    assert r.text.startswith("```python\ndef merge_intervals(intervals):\n")
    peers.check_plain(r)


def test_parse_rejects_output_without_stats():
    with pytest.raises(peers.PeerFailed, match="decoded"):
        peers.parse_speculative_simple("error: failed to load model 'x.gguf'\n")


# -- missing binaries --------------------------------------------------------------------------
def test_missing_binary_raises_peer_unavailable(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert peers.find_peer_binary(peers.SPEC_BINARY) is None
    for name in ("peer:llama.cpp-draft", "peer:llama.cpp-ngram-mod", peers.NATIVE_PLAIN):
        with pytest.raises(peers.PeerUnavailable) as exc:
            peers.run(name, "hello", target_path=tmp_path / "m.gguf", draft_path=tmp_path / "d.gguf",
                      max_tokens=8, threads=1, ctx=256)
        msg = str(exc.value)
        assert isinstance(exc.value, EdgespecError)
        assert "\n" not in msg and peers.BUILD_COMMAND in msg and peers.SPEC_BINARY in msg
        assert peers.unavailable_reason(name) == msg
    assert peers.unavailable_reason("peer:llama-cpp-python-pld") is None


def test_peers_run_with_the_kernel_asked(tmp_path, monkeypatch, model_path):
    """peers.run passes flash_attn down to the native command line (a stand-in binary that
    records its arguments and replays captured output)."""
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    b = tmp_path / "peers" / "bin" / peers.SPEC_BINARY
    b.parent.mkdir(parents=True)
    cap = DATA / "speculative_simple_ngram_mod"
    b.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/argv\ncat {cap}.stdout.txt\ncat {cap}.txt >&2\n')
    b.chmod(0o755)
    prompt = (DATA / "speculative_simple_ngram_mod.prompt.txt").read_text(encoding="utf-8")
    for fa in (True, False):
        peers.run("peer:llama.cpp-ngram-mod", prompt, target_path=model_path(TARGET), max_tokens=128,
                  threads=2, ctx=2048, flash_attn=fa)
    assert [line.split("-fa ")[1].split()[0] for line in (tmp_path / "argv").read_text().splitlines()] == ["on", "off"]


def test_find_peer_binary_prefers_edgespec_home(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    b = tmp_path / "peers" / "bin" / peers.SPEC_BINARY
    b.parent.mkdir(parents=True)
    b.write_text("#!/bin/sh\n")
    assert peers.find_peer_binary(peers.SPEC_BINARY) is None  # not executable
    b.chmod(0o755)
    assert peers.find_peer_binary(peers.SPEC_BINARY) == b


def test_unknown_peer_is_an_invalid_request():
    with pytest.raises(EdgespecError, match="unknown peer"):
        peers.run("peer:nope", "x", target_path="m", max_tokens=1, threads=1, ctx=64)


def test_command_line_is_greedy_and_file_based(tmp_path):
    cmd = peers.llama_cpp_command("draft", "bin", "t.gguf", "d.gguf", tmp_path / "p.txt", 16, 2, 4096)
    s = " ".join(cmd)
    for part in ("-m t.gguf", f"-f {tmp_path / 'p.txt'}", "-n 15", "-t 2", "-c 4096", "--temp 0",
                 "--top-k 1", "--spec-type draft-simple", "-md d.gguf", "--spec-draft-n-max 4"):
        assert part in s
    cmd = peers.llama_cpp_command("ngram-mod", "bin", "t.gguf", None, "p.txt", 16, 2, 4096)
    assert "--spec-type ngram-mod" in " ".join(cmd) and "-md" not in cmd
    assert cmd[cmd.index("-fa") + 1] == "on"  # llama.cpp's default kernel unless the bench asks otherwise
    off = peers.llama_cpp_command("plain", "bin", "t.gguf", None, "p.txt", 16, 2, 4096, flash_attn=False)
    assert off[off.index("-fa") + 1] == "off"


def test_native_peers_are_placed_as_edgespec_placed_itself(tmp_path):
    """A placement's GPU layers reach the native command line: target (-ngl) and drafter (-ngld)."""
    cmd = peers.llama_cpp_command("draft", "bin", "t.gguf", "d.gguf", "p.txt", 16, 2, 4096, gpu_layers=(29, 25))
    assert cmd[cmd.index("-ngl") + 1] == "29" and cmd[cmd.index("-ngld") + 1] == "25"
    cpu = peers.llama_cpp_command("draft", "bin", "t.gguf", "d.gguf", "p.txt", 16, 2, 4096)
    assert cpu[cpu.index("-ngl") + 1] == "0" and cpu[cpu.index("-ngld") + 1] == "0"
    drafter = DrafterPlacement(True, ModelParams(n_gpu_layers=25), 0, "")
    plan = SimpleNamespace(model=ModelParams(n_gpu_layers=0), drafter=drafter, mode=MODES["draft-gpu"])
    assert peers.gpu_layers_of(plan) == (0, 25)  # draft-gpu: the drafter alone on the GPU
    left_out = DrafterPlacement(False, None, 0, "")
    gpu = SimpleNamespace(model=ModelParams(n_gpu_layers=29), drafter=left_out, mode=MODES["gpu"],
                          config=EngineConfig(placement="gpu"))
    assert peers.gpu_layers_of(gpu) == (29, peers.ALL_LAYERS)  # where edgespec would put it
    budget = SimpleNamespace(model=ModelParams(n_gpu_layers=14), drafter=left_out, mode=MODES["offload"],
                             config=EngineConfig(vram_budget=900 << 20))
    assert peers.gpu_layers_of(budget) == (14, 0)  # not past the VRAM budget edgespec kept to
    as_asked = SimpleNamespace(model=ModelParams(n_gpu_layers=99), drafter=None, mode=None, config=EngineConfig())
    assert peers.gpu_layers_of(as_asked) == (99, 0)
    with pytest.raises(peers.PeerUnavailable, match="CPU only"):
        peers.run("peer:llama-cpp-python-pld", "x", target_path="m", max_tokens=1, threads=1, ctx=64,
                  gpu_layers=(99, 0))


def test_native_plain_command_drafts_nothing_and_times_like_the_others():
    """Same binary, same options as the speculative peers; only the spec type differs: an
    ngram-simple lookup of 1024 tokens (llama.cpp's limit) proposing 1 token."""
    plain = peers.llama_cpp_command("plain", "bin", "t.gguf", None, "p.txt", 16, 2, 4096)
    mod = peers.llama_cpp_command("ngram-mod", "bin", "t.gguf", None, "p.txt", 16, 2, 4096)
    i = plain.index("--spec-type")
    assert plain[:i] == mod[:mod.index("--spec-type")]
    assert plain[i:] == ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "1024",
                         "--spec-ngram-simple-size-m", "1"]
    assert peers.NATIVE_PLAIN in peers.PEERS


def test_native_plain_refuses_a_run_that_drafted():
    peers.check_plain(peers.PeerResult(new_tokens=16, gen_s=1.0))
    with pytest.raises(peers.PeerFailed, match="drafted 1 tokens"):
        peers.check_plain(peers.PeerResult(new_tokens=16, gen_s=1.0, drafted=1, accepted=1))


def test_template_bos_is_not_doubled(model_path):
    """Gemma's template writes "<bos>" and its GGUF asks for a BOS: llama.cpp adds its own, so the
    adapter strips the template's. ChatML models (no add_bos) get the text unchanged."""
    gemma = str(model_path(GEMMA))
    sent, shown = peers._prompt_for_llama_cpp(gemma, "<bos><start_of_turn>user\nhi<end_of_turn>\n")
    assert sent == "<start_of_turn>user\nhi<end_of_turn>\n" and shown.startswith("<bos><start_of_turn>")
    qwen = str(model_path(TARGET))
    p = chatml(QWEN_SYSTEM, "hi")
    assert peers._prompt_for_llama_cpp(qwen, p) == (p, p)


# -- real short runs ---------------------------------------------------------------------------
CODE = ("def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n"
        "    return total / len(xs)\n")


@needs_native
def test_real_llama_cpp_plain_run(model_path, native):
    prompt = chatml(SMOL_SYSTEM, "Count from one to twenty in words, separated by commas.")
    r = peers.run(peers.NATIVE_PLAIN, prompt, target_path=model_path(SMALL), max_tokens=16, threads=2,
                  ctx=1024)
    assert r.new_tokens == r.gen_tokens == 16  # -n 15: exactly the budget, no draft to overshoot
    assert r.raw["finish_reason"] == "length" and r.raw["overshoot"] == 0
    assert (r.drafted, r.accepted) == (0, 0) and r.gen_s > 0 and r.prefill_s > 0
    assert r.text and "one" in r.text.lower()


@needs_native
def test_real_llama_cpp_draft_run(model_path, native):
    prompt = chatml(QWEN_SYSTEM, f"Add type hints to this function and return the full code:\n{CODE}")
    r = peers.run("peer:llama.cpp-draft", prompt, target_path=model_path(TARGET),
                  draft_path=model_path(DRAFTER), max_tokens=16, threads=2, ctx=1024)
    # at least the budget (no end-of-generation this early); the last step may overshoot by up
    # to --spec-draft-n-max tokens
    assert 16 <= r.new_tokens <= 16 + peers.DRAFT_N_MAX
    assert r.gen_s > 0 and r.prefill_s and r.prefill_s > 0
    assert 0 < r.drafted and 0 <= r.accepted <= r.drafted
    assert r.text and "mean" in r.text
    assert r.raw["finish_reason"] == "length"


@needs_native
def test_real_llama_cpp_ngram_mod_run(model_path, native):
    prompt = chatml(SMOL_SYSTEM, "Repeat this text exactly: the quick brown fox jumps over the lazy dog.")
    r = peers.run("peer:llama.cpp-ngram-mod", prompt, target_path=model_path(SMALL),
                  max_tokens=16, threads=2, ctx=1024)
    assert r.new_tokens > 0 and r.gen_s > 0  # may exceed 16: ngram-mod's last draft is not cut
    assert r.accepted <= r.drafted
    assert r.text is not None and "quick brown fox" in r.text.lower()


def test_real_llama_cpp_python_pld_run(model_path, small_model):
    prompt = chatml(SMOL_SYSTEM, "Repeat this text exactly: the quick brown fox jumps over the lazy dog.")
    try:
        r = peers.run("peer:llama-cpp-python-pld", prompt, target_path=model_path(SMALL),
                      max_tokens=16, threads=2, ctx=512)
        again = peers.run("peer:llama-cpp-python-pld", prompt, target_path=model_path(SMALL),
                          max_tokens=16, threads=2, ctx=512)
    finally:
        peers.close()
    assert 0 < r.new_tokens <= 16 and r.gen_s > 0 and r.prefill_s > 0
    assert r.gen_tokens == r.new_tokens - 1
    assert r.text and "quick brown fox" in r.text.lower()
    assert r.accepted <= r.drafted
    # special tokens parsed, no BOS added (SmolLM2 wants none): the tokens edgespec feeds itself
    assert r.raw["prompt_tokens"] == len(small_model.tokenize(prompt, add_special=True, parse_special=True))
    assert r.raw["prompt_tokens"] < len(small_model.tokenize(prompt, add_special=True, parse_special=False))
    # the cached model is reused and the second run starts from scratch: same greedy output
    assert (again.text, again.new_tokens) == (r.text, r.new_tokens)
