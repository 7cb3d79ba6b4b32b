"""A bounded soak of `edgespec serve --exact`: greedy clients, stalled and abandoned uploads and
streams hung up on, all at once, twice over.

Checks: every answer is its own request's plain greedy answer bit for bit (the reference is a
fresh exact engine in another process, its cache reset before each prompt); the server's RSS
comes back to within 10% of its plateau; the log costs at most one line per failed connection
and no traceback; SIGTERM mid-stream ends the server within seconds.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import SMALL
from server_harness import CTX, THREADS, ServerProcess, raw_post, read_all, start_server, status_of, stop
from test_server_hostile import SECRET

MAX_TOKENS = 16
CHATS = ["Write one sentence about rivers.", "Name three planets.", "Why is bread soft?"]
PROMPTS = ["A short fact about trains:", "def fibonacci(n):", "The capital of France is"]

# Plain greedy answers of a fresh exact engine, each prompt from an empty cache.
_REFERENCE = """
import json, sys
from edgespec.engine import Engine, EngineConfig
chats, prompts, n_ctx, threads, max_tokens = json.loads(sys.argv[1])
out = {"chat": [], "completion": []}
with Engine(EngineConfig(model=%r, n_ctx=n_ctx, n_threads=threads, draft=None, exact=True)) as engine:
    for c in chats:
        engine.reset()
        d = engine.chat([{"role": "user", "content": c}], max_tokens=max_tokens, temperature=0)
        out["chat"].append([d.text, d.finish_reason, d.stats.generated_tokens])
    for p in prompts:
        engine.reset()
        d = engine.generate(p, max_tokens=max_tokens, temperature=0)
        out["completion"].append([d.text, d.finish_reason, d.stats.generated_tokens])
print(json.dumps(out))
"""


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _ask(port: int, kind: str, i: int, stream: bool) -> tuple[str, str, int]:
    """One greedy request over a bare socket: (text, finish_reason, completion tokens)."""
    if kind == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": CHATS[i]}]}
    else:
        path, body = "/v1/completions", {"prompt": PROMPTS[i]}
    body.update(max_tokens=MAX_TOKENS, temperature=0, stream=stream,
                stream_options={"include_usage": True} if stream else None)
    sock = raw_post(port, path, "Connection: close\r\n", json.dumps(body).encode())
    try:
        raw = read_all(sock, 120)
    finally:
        sock.close()
    assert status_of(raw) == 200, raw[:500]
    payload = raw.split(b"\r\n\r\n", 1)[1]
    if not stream:
        reply = json.loads(payload)
        choice = reply["choices"][0]
        text = choice["message"]["content"] if kind == "chat" else choice["text"]
        return text, choice["finish_reason"], reply["usage"]["completion_tokens"]
    text, finish, n = "", None, None
    for line in payload.decode().splitlines():  # chunked framing lines are skipped
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage") and not chunk["choices"]:
            n = chunk["usage"]["completion_tokens"]
            continue
        choice = chunk["choices"][0]
        text += (choice["delta"].get("content") or "") if kind == "chat" else choice["text"]
        finish = choice["finish_reason"] or finish
    assert "data: [DONE]" in payload.decode()
    return text, finish, n


def _load(srv: ServerProcess, rounds: int, stalls: int, hangups: int, drops: int) -> tuple[list, list, int]:
    """Every client asks its own prompt ``rounds`` times (streamed and not) while uploads stall
    (408), uploads hang up (499) and streams are dropped mid-answer. Returns the answers, the
    errors, and how many connections failed on purpose."""
    answers, errors = [], []

    def client(kind: str, i: int) -> None:
        try:
            for k in range(rounds):
                answers.append((kind, i, _ask(srv.port, kind, i, stream=(i + k) % 2 == 0)))
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors.append((kind, i, repr(exc)))

    def stalled() -> None:
        socks = [raw_post(srv.port, "/v1/completions", "", b'{"prompt": "' + SECRET.encode(), declared=4000)
                 for _ in range(stalls)]
        for s in socks:
            if status_of(read_all(s, 15)) != 408:
                errors.append(("stall", "no 408"))
            s.close()

    def hangups_and_drops() -> None:
        socks = [raw_post(srv.port, "/v1/chat/completions", "", b'{"messages": [', declared=4000)
                 for _ in range(hangups)]
        time.sleep(0.3)
        for s in socks:
            s.close()
        for _ in range(drops):
            body = {"prompt": SECRET, "max_tokens": 300, "ignore_eos": True, "stream": True}
            s = raw_post(srv.port, "/v1/completions", "", json.dumps(body).encode())
            head = b""
            while b"data: " not in head:
                chunk = s.recv(65536)
                if not chunk:
                    break
                head += chunk
            s.close()

    threads = ([threading.Thread(target=client, args=("chat", i)) for i in range(len(CHATS))]
               + [threading.Thread(target=client, args=("completion", i)) for i in range(len(PROMPTS))]
               + [threading.Thread(target=stalled), threading.Thread(target=hangups_and_drops)])
    for th in threads:
        th.start()
    for th in threads:
        th.join(300)
    return answers, errors, stalls + hangups + drops


@pytest.fixture(scope="module")
def reference(model_path) -> dict:
    path = str(model_path(SMALL))
    proc = subprocess.run([sys.executable, "-c", _REFERENCE % path,
                           json.dumps([CHATS, PROMPTS, CTX, THREADS, MAX_TOKENS])],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    texts = [t for kind in out.values() for t, _, _ in kind]
    assert len(set(texts)) == len(texts)  # the answers tell the requests apart
    return out


def test_soak_exact_server(model_path, reference, tmp_path):
    model_path(SMALL)
    # Drafts of up to 8 tokens, as in test_server: `auto` calibrates batches of up to 9 on start
    # (~5 s less at one thread than up to 33); every answer is still checked against plain greedy.
    srv = start_server(tmp_path, "--exact", "--max-queue", "64", "--body-timeout", "1", "--draft-max", "8")
    try:
        # Warm-up: the same kinds of traffic, smaller; the plateau is the idle RSS after it.
        answers, errors, failed = _load(srv, rounds=1, stalls=10, hangups=10, drops=2)
        srv.wait_metric("edgespec_requests_running", lambda v: v == 0)
        plateau = _rss(srv.proc.pid)
        t0 = time.monotonic()
        more, more_errors, more_failed = _load(srv, rounds=3, stalls=40, hangups=40, drops=6)
        elapsed = time.monotonic() - t0
        answers, errors, failed = answers + more, errors + more_errors, failed + more_failed
        srv.wait_metric("edgespec_requests_running", lambda v: v == 0)
        srv.wait_metric("edgespec_queue_length", lambda v: v == 0)
        time.sleep(0.5)
        after = _rss(srv.proc.pid)
        assert not errors, errors

        # Every answer is its own request's plain greedy answer, bit for bit.
        assert len(answers) == 4 * (len(CHATS) + len(PROMPTS))
        for kind, i, (text, finish, n) in answers:
            ref_text, ref_finish, ref_n = reference[kind][i]
            assert (text, finish, n) == (ref_text, ref_finish, ref_n), (kind, i, text, ref_text)

        assert after <= 1.10 * plateau, (after, plateau)
        text = srv.log.read_text(errors="replace")
        lines = srv.log_lines()
        assert "Traceback" not in text and SECRET not in text, text[-3000:]
        assert len(lines) <= failed, (len(lines), failed, lines[:10])
        m = srv.metrics()
        assert m['edgespec_http_requests_total{path="/v1/completions",code="408"}'] == 50
        assert m['edgespec_http_requests_total{path="/v1/chat/completions",code="499"}'] == 50

        # SIGTERM mid-stream ends it within seconds.
        body = {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "stream": True}
        sock = raw_post(srv.port, "/v1/completions", "", json.dumps(body).encode())
        head = b""
        while b"data: " not in head:
            head += sock.recv(65536)
        code, took = srv.signal_and_wait(signal.SIGTERM, 5)
        tail = read_all(sock, 5)
        sock.close()
        assert code == 0 and b"data: [DONE]" in head + tail, (code, srv.log.read_text()[-2000:])
        print(f"soak: {len(answers)} answers, {failed} failed connections, main load {elapsed:.1f} s; "
              f"RSS plateau {plateau / 2**20:.1f} MiB, after {after / 2**20:.1f} MiB; "
              f"{len(lines)} log lines; SIGTERM exit in {took:.2f} s")
    finally:
        stop(srv)
