"""The `edgespec` command as a user runs it: real processes, exit codes, one-line errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SMALL

EDGESPEC = str(Path(sys.executable).with_name("edgespec"))


def cli(*args, stdin: str | None = "", env_extra: dict | None = None, timeout: float = 300):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([EDGESPEC, *args], input=stdin, capture_output=True, text=True,
                          env=env, timeout=timeout)


def assert_one_line_error(proc, code: int, *fragments: str):
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


@pytest.fixture(scope="module")
def small(model_path):
    return str(model_path(SMALL))


# The commands below that draft with `auto` calibrate it on their first start: on a small context
# for chains of up to 8 (3.5 s against 11 s at the defaults), which what they check does not
# depend on. A default `run` calibrates in test_store_faults.
AUTO = ("--ctx", "256", "--draft-max", "8")


def test_missing_model_names_the_pull_command(tmp_path):
    proc = cli("run", "hello", env_extra={"EDGESPEC_HOME": str(tmp_path)})
    assert_one_line_error(proc, 1, "edgespec models pull qwen2.5-coder-1.5b")


def test_unknown_model(tmp_path):
    proc = cli("run", "hello", "--model", "no-such-model", env_extra={"EDGESPEC_HOME": str(tmp_path)})
    assert_one_line_error(proc, 1, "no-such-model")


def test_corrupt_file_is_rejected_before_llama_cpp(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)
    proc = cli("run", "hello", "--model", str(bad))
    assert_one_line_error(proc, 1, str(bad), "not a valid GGUF")


@pytest.mark.parametrize("args, fragment", [
    (["run", "hi", "--max-tokens", "0"], "--max-tokens"),
    (["run", "hi", "--temperature", "abc"], "--temperature"),
    (["run", "hi", "--temperature", "-1"], "--temperature"),
    (["run", "hi", "--no-such-flag"], "--no-such-flag"),
    (["frobnicate"], "frobnicate"),
])
def test_bad_flags_exit_2(args, fragment):
    assert_one_line_error(cli(*args), 2, fragment)


@pytest.mark.parametrize("prompt", ["", "   \n"])
def test_empty_prompt(small, prompt):
    assert_one_line_error(cli("run", prompt, "--model", small), 1, "prompt is empty")


def test_empty_stdin(small):
    assert_one_line_error(cli("run", "--model", small, stdin=""), 1, "prompt is empty")


def test_run_json(small):
    proc = cli("run", "What is 2 + 2?", "--model", small, "--temperature", "0", "-n", "16", "--json", *AUTO)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) >= {"text", "prompt_tokens", "generated_tokens", "stats"}
    assert 0 < out["generated_tokens"] <= 16
    assert out["stats"]["tokens_per_s"] >= 0 and out["stats"]["peak_rss_bytes"] > 0
    assert "ttft_s" in out["stats"]
    # Greedy is deterministic: the same request gives the same text.
    again = json.loads(cli("run", "What is 2 + 2?", "--model", small, "--temperature", "0", "-n", "16",
                           "--json", *AUTO).stdout)
    assert again["text"] == out["text"]


def test_run_streams_answer_then_stats_line(small):
    proc = cli("run", "--model", small, "--temperature", "0", "-n", "12", *AUTO, stdin="Name a color.")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    stats = [ln for ln in proc.stderr.splitlines() if "tok/s" in ln]
    assert len(stats) == 1 and "peak RSS" in stats[0] and "ttft" in stats[0]


def test_chat_keeps_history_and_reuses_the_cache(small):
    script = "My name is Ada.\nWhat is my name?\n/stats\n/reset\n/exit\n"
    proc = cli("chat", "--model", small, "--temperature", "0", "-n", "24", *AUTO, stdin=script)
    assert proc.returncode == 0, proc.stderr
    stats = [ln for ln in proc.stderr.splitlines() if ln.startswith("prompt ")]
    assert len(stats) == 2
    assert "reused" not in stats[0] and "reused" in stats[1]  # turn 2 did not re-evaluate turn 1
    assert "session: 2 turns" in proc.stderr
    assert "conversation cleared" in proc.stderr


def test_chat_multiline_and_unknown_command(small):
    script = '"""\nline one\nline two\n"""\n/bogus\n'
    proc = cli("chat", "--model", small, "--temperature", "0", "-n", "8", *AUTO, stdin=script)
    assert proc.returncode == 0, proc.stderr
    assert "unknown command /bogus" in proc.stderr
    assert len([ln for ln in proc.stderr.splitlines() if ln.startswith("prompt ")]) == 1


def test_doctor_json():
    proc = cli("doctor", "--json")
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert d["ram"]["total"] > 0 and d["cpu"]["physical_cores"] >= 1
    assert isinstance(d["llama_cpp"]["gpu_offload"], bool)
    assert any(dev["type"] == "cpu" for dev in d["llama_cpp"]["devices"])
    from edgespec.llama.kernels import op_offload_min_batch

    assert d["llama_cpp"]["op_offload_min_batch"] == op_offload_min_batch()  # the environment it passed down
    graphs = d["llama_cpp"]["cuda_graphs"]
    assert graphs is None if not d["llama_cpp"]["gpu_offload"] else graphs in ("per-shape", "per-context", "disabled")
    assert {m["name"] for m in d["store"]["models"]} >= {"qwen2.5-coder-1.5b", "smollm2-135m"}


def test_run_with_suffix_drafter_reports_speculation(small):
    prompt = "Repeat exactly: one two three four five six. one two three four five six. one two three"
    proc = cli("run", prompt, "--model", small, "--temperature", "0", "-n", "24", "--draft", "suffix", "--json")
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)["stats"]
    assert stats["mode"] == "suffix" and stats["steps"] >= 1
    assert stats["drafted"] >= stats["accepted"] >= 0
    assert stats["mean_emitted"] >= 1.0 and "suffix" in stats["by_drafter"]


def test_run_stats_line_shows_drafting(small):
    proc = cli("run", "one two three one two three one two", "--model", small, "--temperature", "0",
               "-n", "16", "--draft", "suffix")
    assert proc.returncode == 0, proc.stderr
    line = [ln for ln in proc.stderr.splitlines() if "tok/s" in ln][0]
    assert "draft suffix:" in line and "tok/step" in line


@pytest.mark.parametrize("args, fragment", [
    (["--draft", "bogus"], "--draft must be one of"),
    (["--draft", "model"], "no default drafter model"),
    (["--draft", "qwen2.5-coder-0.5b"], "cannot draft for"),
])
def test_bad_drafter_choices(small, args, fragment):
    assert_one_line_error(cli("run", "hi", "--model", small, *args), 1, fragment)


def test_draft_max_out_of_range():
    assert_one_line_error(cli("run", "hi", "--draft-max", "0"), 2, "--draft-max")
