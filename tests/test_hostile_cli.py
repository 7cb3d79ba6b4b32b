"""Hostile input at the CLI and the library boundary: one-line errors with the documented exit
codes (2 for usage, 1 for runtime, 130 for Ctrl-C), typed exceptions, never a traceback.

Text that is not valid UTF-8 is decoded with U+FFFD (cli.common.utf8_text); the library refuses
a str with lone surrogates (InvalidRequest).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SMALL, TARGET

from edgespec.cli.common import utf8_text
from edgespec.config import EngineConfig
from edgespec.decode.request import make_request
from edgespec.decode.sampling import SamplingParams
from edgespec.errors import InvalidRequest

EDGESPEC = str(Path(sys.executable).with_name("edgespec"))
FAST = ("--draft", "none", "--temperature", "0", "-n", "2")  # a load and two tokens, no calibration


def cli(*args, stdin: bytes = b"", timeout: float = 300) -> subprocess.CompletedProcess:
    """The CLI as a user runs it; arguments and stdin may be bytes that are not UTF-8."""
    proc = subprocess.run([EDGESPEC, *args], input=stdin, capture_output=True, timeout=timeout)
    proc.stderr = proc.stderr.decode("utf-8", "replace")
    return proc


def error_lines(stderr: str) -> list[str]:
    """stderr without the log lines ("edgespec: ...") and blank lines."""
    return [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("edgespec: ")]


def assert_usage_error(proc, *fragments: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def assert_answered(proc, answers: int = 1) -> None:
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    assert len([ln for ln in proc.stderr.splitlines() if ln.startswith("prompt ")]) == answers, proc.stderr


@pytest.fixture(scope="module")
def small(model_path) -> bytes:
    return os.fsencode(model_path(SMALL))


# -- 1. text that is not valid UTF-8 ------------------------------------------------------------
def test_utf8_text_replaces_undecodable_bytes():
    assert utf8_text("caf\udce9") == "caf\ufffd"  # b"caf\xe9" as argv / stdin hand it over
    assert utf8_text(["ok", "\udcff"]) == ["ok", "\ufffd"]
    assert utf8_text("caf\u00e9") == "caf\u00e9" and utf8_text(None) is None
    cleaned = utf8_text("a\ud800")  # a surrogate no decoder made (JSON "\ud800")
    assert cleaned.startswith("a\ufffd") and cleaned.encode("utf-8")


def test_run_with_non_utf8_prompt_system_and_stop(small):
    proc = cli("run", b"caf\xe9 au lait?", "--model", small, "--system", b"be \xff brief",
               "--stop", b"\xfe", *FAST)
    assert_answered(proc)
    assert "not valid UTF-8" in proc.stderr  # one warning line says what happened


def test_run_with_non_utf8_stdin_and_model_path(small, tmp_path):
    link = os.path.join(os.fsencode(tmp_path), b"caf\xe9.gguf")  # a file name is bytes: kept as they are
    os.symlink(small, link)
    assert_answered(cli("run", "--model", link, *FAST, stdin=b"caf\xe9\n"))


def test_chat_keeps_going_after_a_non_utf8_line(small):
    proc = cli("chat", "--model", small, *FAST, "--system", b"\xff", stdin=b"caf\xe9\nhi\n/exit\n")
    assert_answered(proc, answers=2)


def test_tokenize_refuses_lone_surrogates(small_model):
    with pytest.raises(InvalidRequest, match="not valid Unicode"):
        small_model.tokenize("a\udcff")
    assert small_model.tokenize("a\ufffd", add_special=False)


# -- 2. seeds ------------------------------------------------------------------------------------
@pytest.mark.parametrize("verb", ["run", "chat"])
def test_negative_seed_is_bad_usage(verb):
    assert_usage_error(cli(verb, "--seed", "-5", *(["hi"] if verb == "run" else [])), "--seed")


@pytest.mark.parametrize("seed", [-1, True, 1.5, "7"])
def test_library_refuses_bad_seeds(seed):
    with pytest.raises(InvalidRequest, match="seed"):
        SamplingParams(seed=seed)


def test_library_takes_any_non_negative_seed():
    assert SamplingParams(seed=0).seed == 0 and SamplingParams(seed=2**64).seed == 2**64  # numpy takes both
    with pytest.raises(InvalidRequest, match="seed"):
        make_request(seed=-5)


# -- 3. Ctrl-C while a model loads ---------------------------------------------------------------
def test_ctrl_c_during_load_exits_130_promptly(model_path):
    target = model_path(TARGET)
    proc = subprocess.Popen([EDGESPEC, "run", "--model", str(target), "--draft", "none", "hi"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=dict(os.environ, EDGESPEC_LOG="DEBUG"), text=True, errors="replace")
    seen = []
    try:
        for line in proc.stderr:  # llama.cpp's loader logs (at debug level) once the load began
            seen.append(line)
            if "llama_model_loader" in line:
                break
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        _, rest = proc.communicate(timeout=60)
    finally:
        proc.kill()
    stderr = "".join(seen) + rest
    assert proc.returncode == 130, stderr[-2000:]
    assert time.monotonic() - sent < 15, "the load went on after Ctrl-C"
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-2000:]
    assert "cancelled model load" in stderr  # llama.cpp stopped loading, not the end of the run


# -- 4. threads and budgets -------------------------------------------------------------------------
def test_too_many_threads():
    with pytest.raises(InvalidRequest, match="n_threads must be at most"):
        EngineConfig(n_threads=1000)
    assert EngineConfig(n_threads=os.cpu_count() or 1).n_threads
    assert_usage_error(cli("run", "--threads", "1000", "hi"), "--threads", "at most")


@pytest.mark.parametrize("verb, value", [("run", "abc"), ("chat", "0"), ("plan", "-1GiB"),
                                         ("bench", "2 parsecs"), ("serve", "")])
def test_bad_ram_budget_is_bad_usage(verb, value):
    assert_usage_error(cli(verb, "--ram-budget", value), "--ram-budget")
