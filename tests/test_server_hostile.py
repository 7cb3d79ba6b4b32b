"""`edgespec serve` against hostile clients: every bad input is a JSON error with its own status
(never a 500), a client's fault is at most one log line and never a traceback or its prompt,
nothing hangs, and SIGTERM / SIGINT end the server within seconds even mid-stream.

Each server is the real command on a loopback port with SmolLM2-135M, logging at INFO so that
every line a failed connection costs is visible. Every wait is bounded.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import SMALL
from server_harness import CTX, EDGESPEC, ServerProcess, raw_post, read_all, start_server, status_of, stop
from edgespec.errors import InvalidRequest

SECRET = "PROMPT-TEXT-MUST-NOT-BE-LOGGED"


def error_of(got: tuple[int, dict, bytes], status: int, code: str | None = None) -> dict:
    """The OpenAI-shaped error of a response that must have ``status``."""
    got_status, headers, body = got
    assert got_status == status, (got_status, body[:300])
    assert headers.get("content-type", "").startswith("application/json"), headers
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if code is not None:
        assert err["code"] == code, err
    return err


def assert_quiet_log(server: ServerProcess, failed_connections: int) -> None:
    """No traceback, no request text, and at most one line per failed connection."""
    text = server.log.read_text(errors="replace")
    assert "Traceback" not in text and SECRET not in text, text[-3000:]
    lines = server.log_lines()
    assert len(lines) <= failed_connections, lines[:20]


# -- one server for the request-level cases -------------------------------------------------------
@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    model_path(SMALL)  # pulled into the session's store if missing
    srv = start_server(tmp_path_factory.mktemp("hostile"), "--draft", "none", "--body-timeout", "1")
    yield srv
    stop(srv)


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def test_lone_surrogates_and_deep_nesting_are_400(server):
    """Each was a 500 whose log line quoted the whole prompt; now a 400 and no log line."""
    r = server.request
    bodies = [
        (CHAT, ('{"messages":[{"role":"user","content":"%s a\\udcff"}],"max_tokens":3}' % SECRET).encode()),
        (COMPLETIONS, ('{"prompt":"%s a\\udcff","max_tokens":3}' % SECRET).encode()),
        (COMPLETIONS, ('{"prompt":"%s ' % SECRET).encode() + b'a\xed\xb3\xbf","max_tokens":3}'),  # raw bytes
        (COMPLETIONS, ('{"prompt":"%s","stop":["\\ud800"]}' % SECRET).encode()),
        (COMPLETIONS, b'{"model":"\\udcff","prompt":"hi"}'),
        (CHAT, b"[" * 100_000 + b"]" * 100_000),
        (CHAT, b'{"a":' * 100_000 + b"1" + b"}" * 100_000),
        (COMPLETIONS, b'{"prompt":"hi","user":' + b"[" * 990 + b"]" * 990 + b"}"),  # near the limit
    ]
    for path, body in bodies:
        t0 = time.monotonic()
        error_of(r("POST", path, body, timeout=30), 400, "invalid_json")
        assert time.monotonic() - t0 < 10
    # a surrogate pair is valid Unicode and served
    ok = r("POST", COMPLETIONS, b'{"prompt":"smile \\ud83d\\ude00","max_tokens":1,"temperature":0}')
    assert ok[0] == 200, ok
    assert_quiet_log(server, 0)


def test_post_needs_a_json_content_type(server):
    """A cross-origin text/plain (or form) POST is a CORS simple request: refused with 415."""
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    for ctype in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                  "multipart/form-data; boundary=x", None, "application/jsonp"):
        for path in (CHAT, COMPLETIONS):
            error_of(server.request("POST", path, body, content_type=ctype), 415, "unsupported_media_type")
    ok = server.request("POST", COMPLETIONS, body, content_type="Application/JSON; charset=utf-8")
    assert ok[0] == 200, ok


def test_stalled_and_abandoned_uploads_cost_one_line_each(server):
    """Uploads that stop get 408 and the connection closed; clients that hang up mid-body are
    not internal errors. 60 of them cost at most 60 INFO lines, no traceback."""
    before, lines_before = server.metrics(), len(server.log_lines())
    n = 30
    stalled = [raw_post(server.port, COMPLETIONS, "", b'{"prompt": "' + SECRET.encode(), declared=5000)
               for _ in range(n)]
    gone = [raw_post(server.port, CHAT, "", b'{"messages": [', declared=5000) for _ in range(n)]
    time.sleep(0.2)
    for sock in gone:
        sock.close()
    t0 = time.monotonic()
    answers = []
    for sock in stalled:
        answers.append(read_all(sock, 10))  # ends when the server closes the connection
        sock.close()
    assert time.monotonic() - t0 < 10
    assert all(status_of(a) == 408 and b'"request_timeout"' in a for a in answers), answers[0][:300]
    server.wait_metric('edgespec_http_requests_total{path="/v1/chat/completions",code="499"}',
                       lambda v: v - before.get('edgespec_http_requests_total{path="/v1/chat/completions",'
                                                'code="499"}', 0) >= n)
    new_lines = server.log_lines()[lines_before:]
    assert len(new_lines) <= 2 * n, new_lines[:10]
    assert "Traceback" not in server.log.read_text() and SECRET not in server.log.read_text()
    assert server.request("GET", "/health")[0] == 200


def test_garbage_and_disconnects_mid_stream(server):
    """A malformed request line and clients that hang up while streaming: one line at most each."""
    lines_before = len(server.log_lines())
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"\x16\x03\x01 not http\r\n\r\n")
        assert read_all(sock, 5).startswith(b"HTTP/1.1 400")
    for _ in range(5):
        body = json.dumps({"prompt": SECRET, "max_tokens": 400, "ignore_eos": True, "stream": True}).encode()
        sock = raw_post(server.port, COMPLETIONS, "", body)
        buf = b""
        while b"data: " not in buf:
            buf += sock.recv(65536)
        sock.close()
    server.wait_metric("edgespec_requests_running", lambda v: v == 0)
    assert len(server.log_lines()) - lines_before <= 6
    assert "Traceback" not in server.log.read_text() and SECRET not in server.log.read_text()


# -- the API key off the command line --------------------------------------------------------------
def _cli(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([EDGESPEC, "serve", "-m", SMALL, "--port", "0", *args], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL,
                          env={k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None})


def _usage_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def test_api_key_file_refusals(tmp_path, model_path):
    model_path(SMALL)
    empty, blank = tmp_path / "empty", tmp_path / "blank"
    empty.write_text("")
    blank.write_text("  \nsecond-line-key\n")
    _usage_error(_cli("--api-key-file", str(tmp_path / "missing")), "--api-key-file", "No such file")
    _usage_error(_cli("--api-key-file", str(empty)), "--api-key-file", "empty")
    _usage_error(_cli("--api-key-file", str(blank)), "--api-key-file", "empty")
    _usage_error(_cli("--api-key-file", str(tmp_path)), "--api-key-file")
    key = tmp_path / "key"
    key.write_text("k1\n")
    _usage_error(_cli("--api-key", "k2", "--api-key-file", str(key)), "--api-key and --api-key-file")
    _usage_error(_cli("--api-key-file", str(key), env={"EDGESPEC_API_KEY": "k3"}),
                 "EDGESPEC_API_KEY and --api-key-file")


@pytest.mark.parametrize("how", ["file", "env"])
def test_api_key_from_a_file_or_the_environment(tmp_path, model_path, how):
    model_path(SMALL)
    key = "sk-from-" + how
    if how == "file":
        (tmp_path / "key").write_text(f"  {key}  \nignored\n")
        srv = start_server(tmp_path, "--draft", "none", "--api-key-file", str(tmp_path / "key"))
    else:
        srv = start_server(tmp_path, "--draft", "none", env={"EDGESPEC_API_KEY": key})
    try:
        assert key not in Path(f"/proc/{srv.proc.pid}/cmdline").read_bytes().decode(errors="replace")
        error_of(srv.request("GET", "/v1/models"), 401, "invalid_api_key")
        error_of(srv.request("GET", "/v1/models", headers={"Authorization": "Bearer ignored"}), 401)
        assert srv.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})[0] == 200
    finally:
        assert stop(srv) == 0


# -- signals end the server mid-stream -------------------------------------------------------------
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_signals_end_the_server_mid_stream(tmp_path, model_path, sig, code):
    """A running stream, a whole answer queued behind it and an upload still arriving: the
    stream ends cancelled with [DONE], the queued one comes back cancelled, the upload gets
    503, and the process is gone within 5 s."""
    model_path(SMALL)
    srv = start_server(tmp_path, "--draft", "none")
    long = {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "temperature": 0}
    stream = raw_post(srv.port, COMPLETIONS, "", json.dumps({**long, "stream": True}).encode())
    head = b""
    while b"data: " not in head:
        head += stream.recv(65536)
    queued = raw_post(srv.port, COMPLETIONS, "", json.dumps(long).encode())
    upload = raw_post(srv.port, COMPLETIONS, "", b'{"prompt": "', declared=1000)
    srv.wait_metric("edgespec_queue_length", lambda v: v == 1)
    replies = {}
    readers = [threading.Thread(target=lambda name=name, s=s: replies.__setitem__(name, read_all(s, 15)))
               for name, s in (("stream", stream), ("queued", queued), ("upload", upload))]
    for th in readers:
        th.start()
    exit_code, took = srv.signal_and_wait(sig, 5)
    for th in readers:
        th.join(20)
    assert exit_code == code and took < 5, (exit_code, took, srv.log.read_text())
    text = (head + replies["stream"]).decode(errors="replace")
    assert '"finish_reason":"cancelled"' in text and "data: [DONE]" in text, text[-500:]
    whole = replies["queued"]
    assert status_of(whole) == 200 and b'"finish_reason":"cancelled"' in whole, whole[-300:]
    assert status_of(replies["upload"]) == 503 and b'"shutting_down"' in replies["upload"], replies["upload"]
    assert "Traceback" not in srv.log.read_text(), srv.log.read_text()
    for s in (stream, queued, upload):
        s.close()


# -- the app in-process: what the library raises while tokenizing ----------------------------------
class _Tokenizing:
    """An engine stand-in whose tokenizer raises ``exc``."""

    class ctx:  # the attribute the handlers read
        n_ctx = CTX

    def __init__(self, exc: Exception):
        self.exc = exc

    def _prompt_tokens(self, prompt):
        raise self.exc

    chat_tokens = _prompt_tokens


@pytest.mark.parametrize("exc, status", [
    (InvalidRequest("the prompt holds a lone surrogate"), 400),
    (RuntimeError(f"a bug, quoting the prompt {SECRET}"), 500),
])
def test_library_errors_while_tokenizing(caplog, exc, status):
    """The library's InvalidRequest is a 400; anything else is our bug: a 500 and one ERROR line
    that names the exception's type and place but not its message (which may quote the prompt)."""
    from edgespec.server.app import ServerConfig, ServerState, create_app

    state = ServerState(ServerConfig(model_id="m"))
    state.engine = _Tokenizing(exc)
    body = json.dumps({"prompt": SECRET}).encode()
    scope = {"type": "http", "http_version": "1.1", "method": "POST", "scheme": "http", "path": COMPLETIONS,
             "raw_path": COMPLETIONS.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    sent = []

    async def go():
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        await create_app(state)(scope, receive, send)  # raises nothing: errors are answered

    with caplog.at_level(logging.INFO):
        asyncio.run(go())
    assert sent[0]["status"] == status
    text = b"".join(m.get("body", b"") for m in sent[1:]).decode()
    assert set(json.loads(text)["error"]) == {"message", "type", "param", "code"} and SECRET not in text
    records = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert all(SECRET not in r.getMessage() and not r.exc_info for r in records), records
    if status == 500:
        assert [r.levelno for r in records] == [logging.ERROR]
        assert "RuntimeError at test_server_hostile.py:" in records[0].getMessage()
    else:
        assert records == []
