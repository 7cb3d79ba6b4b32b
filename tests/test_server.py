"""The Python API (Engine: generate / stream / chat, queue, cancellation) and `edgespec serve`.

Server tests start the real command as a process on a loopback port with the real SmolLM2-135M
model and drive it with the official `openai` client and with raw HTTP. Every wait is bounded
by a count and a deadline; every server is terminated by its fixture.
"""
from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import SMALL
from server_harness import ServerProcess, stop
from edgespec.decode.request import make_request
from edgespec.engine import Engine, EngineConfig, RequestQueue
from edgespec.errors import BudgetExceeded, InvalidRequest, QueueFull
from edgespec.decode.events import DoneEvent, TokenEvent
from edgespec.decode.request import GenerationRequest
from edgespec.units import format_bytes, parse_bytes

EDGESPEC = str(Path(sys.executable).with_name("edgespec"))
CTX = 1024
# One llama.cpp thread everywhere: on a shared 2-core machine, spinning worker threads of
# several processes slow each other down by orders of magnitude.
THREADS = 1
# Drafts of up to 8 tokens, here and in the servers: auto calibrates batches of up to 9 (at one
# thread, batches of 10-33 tokens would add ~4 s); the server's behaviour does not depend on it.
DRAFT_MAX = 8
KEY = "sk-test-edgespec"


# -- units ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, value", [
    ("2GiB", 2 * 1024**3), ("2048M", 2 * 1024**3), ("2048MiB", 2 * 1024**3), ("2g", 2 * 1024**3),
    ("1.5GB", 1_500_000_000), ("4096", 4096), ("512 KiB", 512 * 1024), ("1kb", 1000), ("7B", 7),
    (" 3T ", 3 * 1024**4), (".5G", 512 * 1024**2), (123, 123),
])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["-1", "abc", "0", "", "1e9", "2XB", "1.5.5G", "G", "-2GiB", 0, -5, True, "nan"])
def test_parse_bytes_refuses(text):
    with pytest.raises(InvalidRequest):
        parse_bytes(text)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 1024**3) == "3.00 GiB"


# -- the request queue (no model) ----------------------------------------------------------------
def test_queue_is_fifo_and_bounded():
    q = RequestQueue(max_waiting=2)
    first = q.enter()
    assert q.wait(first)
    order, tickets = [], [q.enter(), q.enter()]
    with pytest.raises(QueueFull):
        q.enter()
    assert q.waiting == 2 and q.busy

    def run(i, t):
        assert q.wait(t)
        order.append(i)
        time.sleep(0.01)
        q.leave(t)

    threads = [threading.Thread(target=run, args=(i, t)) for i, t in reversed(list(enumerate(tickets)))]
    for th in threads:
        th.start()
    time.sleep(0.1)
    assert order == []  # nothing overtakes the running request
    q.leave(first)
    for th in threads:
        th.join(10)
    assert order == [0, 1] and not q.busy and q.waiting == 0


def test_queue_cancel_while_waiting_gives_the_place_back():
    q = RequestQueue(max_waiting=1)
    running = q.enter()
    assert q.wait(running)
    waiting, cancel = q.enter(), threading.Event()
    result = []
    th = threading.Thread(target=lambda: result.append(q.wait(waiting, cancel)))
    th.start()
    time.sleep(0.05)
    cancel.set()
    th.join(5)
    assert result == [False] and q.waiting == 0
    q.enter()  # the place is free again


def test_queue_refuses_a_second_stream_on_the_running_thread():
    q = RequestQueue()
    t = q.enter()
    assert q.wait(t)
    with pytest.raises(InvalidRequest, match="already in the middle"):
        q.wait(q.enter())
    q.leave(t)
    assert q.waiting == 0 and not q.busy


def test_make_request():
    r = make_request(max_tokens=5, stop="\n", temperature=0.5, seed=3, top_k=10)
    assert r.max_tokens == 5 and r.stop == ("\n",) and r.sampling.temperature == 0.5
    assert r.sampling.seed == 3 and r.sampling.top_k == 10
    assert make_request() == GenerationRequest()
    for bad in ({"temperature": "hot"}, {"max_tokens": 0}, {"top_p": 0}, {"stop": 3},
                {"colour": "red"}, {"max_tokens": True}, {"top_k": 1.5}):
        with pytest.raises(InvalidRequest):
            make_request(**bad)
    with pytest.raises(InvalidRequest):
        make_request(GenerationRequest(), max_tokens=3)


def test_host_check_and_model_names():
    from edgespec.server.app import ServerConfig, model_names

    cfg = ServerConfig(model_id="m", host="127.0.0.1", port=8080)
    for ok in ("127.0.0.1:8080", "localhost:8080", "LOCALHOST", "[::1]:8080", "127.0.0.1"):
        assert cfg.host_allowed(ok), ok
    for bad in ("evil.example:8080", "127.0.0.1.evil.example", None, "", "10.0.0.1"):
        assert not cfg.host_allowed(bad), bad
    assert ServerConfig(model_id="m", host="0.0.0.0").host_allowed("anything.example")
    extra = ServerConfig(model_id="m", host="0.0.0.0", allowed_hosts=("box.lan",))
    assert extra.host_allowed("box.lan:1") and not extra.host_allowed("evil.example")
    model_id, aliases = model_names("/x/y/Model-Q4.gguf", "/x/y/Model-Q4.gguf")
    assert model_id == "Model-Q4" and "/x/y/Model-Q4.gguf" in aliases and "Model-Q4.gguf" in aliases
    model_id, aliases = model_names("smollm2-135m", "/c/SmolLM2.gguf")
    assert model_id == "smollm2-135m" and "/c/SmolLM2.gguf" in aliases


def test_metrics_text_format():
    from edgespec.decode.events import GenerationStats
    from edgespec.server.app import Metrics
    from edgespec.decode.stats import DrafterCounts, SpecStats

    m = Metrics()
    spec = SpecStats(mode="suffix", steps=4, drafted=6, accepted=5,
                     by_drafter={"suf\"fix": DrafterCounts(steps=4, drafted=6, accepted=5)})
    stats = GenerationStats(prompt_tokens=5, generated_tokens=9, gen_s=2.0, finish_reason="stop", spec=spec)
    m.generation("chat", DoneEvent("x", (1,), stats))
    m.http_response("/v1/chat/completions", 200)
    m.http_response("/secret/../path", 404)
    text = m.render(None, "m")
    assert 'edgespec_requests_total{endpoint="chat",finish_reason="stop"} 1' in text
    assert 'edgespec_drafted_tokens_total{drafter="suf\\"fix"} 6' in text
    assert 'edgespec_accepted_tokens_total{drafter="suf\\"fix"} 5' in text
    assert "edgespec_generated_tokens_total 9" in text
    assert 'edgespec_http_requests_total{path="other",code="404"} 1' in text
    assert "edgespec_queue_length 0" in text
    for line in text.splitlines():  # every sample line: name{labels} number
        assert line.startswith("#") or re.fullmatch(r'[a-z_]+(\{.*\})? [0-9.e+-]+|[a-z_]+(\{.*\})? NaN', line), line


# -- the Python API with a real model ------------------------------------------------------------
@pytest.fixture(scope="module")
def small_path(model_path) -> str:
    return str(model_path(SMALL))


@pytest.fixture(scope="module")
def engine(small_path):
    with Engine(EngineConfig(model=small_path, n_ctx=CTX, n_threads=THREADS, draft="auto",
                             draft_max=DRAFT_MAX)) as eng:
        yield eng


# -- the server's answers are the library's, modulo numerics near-ties ---------------------------
# llama.cpp's logits depend on the batch a row is computed in, and the server's KV cache reuses
# prompt prefixes from whatever it served before, so its cache history differs from the
# library engine's. Equal greedy answers are then guaranteed only up to a near-tie: where the
# texts part, the library's own top-2 logits (fresh cache) must be closer than this.
TIE_EPS = 0.5


def _top2_gap(engine, prompt_tokens: list[int], answer: list[int], j: int) -> float:
    """Top-2 logit gap where the library chose answer[j], evaluated from a fresh cache."""
    engine.reset()
    logits = engine.seq.sync(list(prompt_tokens) + list(answer[:j]))[0].logits()
    engine.reset()
    top2 = sorted(logits.tolist())[-2:]
    return top2[1] - top2[0]


def assert_same_answer(engine, prompt_tokens: list[int], lib, text: str) -> None:
    """``text`` is the library's greedy answer ``lib``, or parts from it only at a near-tie."""
    if text == lib.text:
        return
    ids, done = list(lib.token_ids), b""
    encoded = text.encode()
    j = 0
    while j < len(ids) and encoded.startswith(done + engine.model.token_piece(ids[j])):
        done += engine.model.token_piece(ids[j])
        j += 1
    assert j < len(ids), (text, lib.text)  # the server's text runs on past the library's answer
    gap = _top2_gap(engine, prompt_tokens, ids, j)
    assert gap < TIE_EPS, (f"answers part at token {j} where the top-2 gap is {gap:.3f}", text, lib.text)


def test_generate_stream_and_chat(engine):
    result = engine.generate("The capital of France is", max_tokens=8, temperature=0)
    assert isinstance(result, DoneEvent) and result.finish_reason in ("stop", "length")
    assert 0 < len(result.token_ids) <= 8 and result.stats.generated_tokens == len(result.token_ids)
    events = list(engine.stream("The capital of France is", max_tokens=8, temperature=0))
    assert isinstance(events[-1], DoneEvent) and all(isinstance(e, TokenEvent) for e in events[:-1])
    assert "".join(e.text for e in events[:-1]) == events[-1].text == result.text
    assert [t for e in events[:-1] for t in e.token_ids] == list(result.token_ids)
    assert events[-1].stats.spec.steps > 0  # speculative decoding ran (draft="auto")
    answer = engine.chat([{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0)
    assert answer.text and answer.stats.prompt_tokens > 5
    # A request object works as well as keyword options.
    same = engine.chat([{"role": "user", "content": "Say hello."}],
                       GenerationRequest(max_tokens=8, sampling=make_request(temperature=0).sampling))
    assert same.text == answer.text


def test_bad_input_is_typed(engine):
    with pytest.raises(InvalidRequest):
        engine.generate("", max_tokens=4)
    with pytest.raises(InvalidRequest):
        engine.generate("hi", max_tokens=-1)
    with pytest.raises(InvalidRequest):
        engine.generate("hi", sampling_temp=1)
    with pytest.raises(InvalidRequest):
        engine.chat([{"role": "wizard", "content": "hi"}])
    with pytest.raises(InvalidRequest):
        engine.generate([1, 2, 10**9])


def test_cancel_from_another_thread(engine):
    cancel = threading.Event()
    seen = []
    timer = threading.Timer(0.3, cancel.set)
    timer.start()
    try:
        for ev in engine.stream("Once upon a time", cancel=cancel, max_tokens=CTX, ignore_eos=True,
                                temperature=0):
            seen.append(ev)
    finally:
        timer.cancel()
    done = seen[-1]
    assert done.finish_reason == "cancelled" and 0 < done.stats.generated_tokens < CTX - 10
    assert not engine.queue.busy


def test_threads_queue_and_get_their_own_answers(engine):
    prompts = [f"Count: {i}, {i + 1}," for i in range(4)]
    expected = {p: engine.generate(p, max_tokens=6, temperature=0).text for p in prompts}
    got, errors = {}, []

    def worker(p):
        try:
            got[p] = engine.generate(p, max_tokens=6, temperature=0).text
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(p,)) for p in prompts]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors and got == expected


def test_queue_full_and_cancel_while_queued(small_path):
    with Engine(EngineConfig(model=small_path, n_ctx=256, n_threads=THREADS, max_queue=0)) as eng:
        stop = threading.Event()
        started = threading.Event()

        def long_run():
            for _ in eng.stream("Once upon a time", cancel=stop, max_tokens=200, ignore_eos=True):
                started.set()

        th = threading.Thread(target=long_run)
        th.start()
        assert started.wait(60)
        with pytest.raises(QueueFull):
            eng.submit(eng.text_tokens("hi"), GenerationRequest(max_tokens=2))
        stop.set()
        th.join(60)
        again = eng.generate("hi", max_tokens=2, ignore_eos=True)  # free again: runs, not QueueFull
        assert again.finish_reason == "length" and len(again.token_ids) == 2 and not eng.queue.busy
    with Engine(EngineConfig(model=small_path, n_ctx=256, n_threads=THREADS, max_queue=2)) as eng:
        stop, cancel_queued = threading.Event(), threading.Event()
        started = threading.Event()
        def long_run2():
            for _ in eng.stream("Once upon a time", cancel=stop, max_tokens=200, ignore_eos=True):
                started.set()

        th = threading.Thread(target=long_run2)
        th.start()
        assert started.wait(60)
        queued = eng.submit(eng.text_tokens("hi"), GenerationRequest(max_tokens=2), cancel_queued)
        box = []
        waiter = threading.Thread(target=lambda: box.extend(queued))
        waiter.start()
        deadline = time.monotonic() + 10
        while eng.queue.waiting != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        cancel_queued.set()
        waiter.join(10)
        assert [e.finish_reason for e in box] == ["cancelled"] and eng.queue.waiting == 0
        assert eng.queue.busy  # the running generation was not disturbed
        stop.set()
        th.join(60)
    with pytest.raises(InvalidRequest):  # closed engines refuse work
        eng.generate("hi", max_tokens=2)


# -- the server as a process ---------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(small_path: str, tmp_path_factory, *args: str, timeout: float = 120) -> ServerProcess:
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "stderr.txt"
    with open(log, "wb") as err:
        # By store name (the id clients use); requests may also name the model by its path.
        proc = subprocess.Popen([EDGESPEC, "serve", "--model", SMALL, "--port", str(port),
                                 "--ctx", str(CTX), "--threads", str(THREADS), "--draft-max", str(DRAFT_MAX),
                                 *args], stdout=subprocess.DEVNULL, stderr=err,
                                stdin=subprocess.DEVNULL)
    server = ServerProcess(proc, port, log)
    deadline = time.monotonic() + timeout
    for _ in range(int(timeout / 0.1)):
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}: {log.read_text()}")
        try:
            status, _, body = server.request("GET", "/health", timeout=5)
            if status == 200:
                return server
            assert status == 503, (status, body)  # loading
        except OSError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    stop(server)
    raise AssertionError(f"server not healthy within {timeout} s: {log.read_text()}")


@pytest.fixture(scope="module")
def server(small_path, tmp_path_factory):
    srv = _start(small_path, tmp_path_factory, "--max-queue", "16")
    yield srv
    code = stop(srv)
    assert code == 0, srv.log.read_text()  # SIGTERM is a clean shutdown


@pytest.fixture(scope="module")
def keyed(small_path, tmp_path_factory):
    srv = _start(small_path, tmp_path_factory, "--api-key", KEY, "--max-queue", "1")
    yield srv
    stop(srv)


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def _error(status_body: tuple[int, dict, bytes], status: int, code=None, param=None) -> dict:
    got, _, body = status_body
    assert got == status, (got, body)
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def test_openai_client_chat_and_completions(server, client, engine):
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model=SMALL, messages=messages, max_tokens=12, temperature=0)
    choice = chat.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert chat.usage.completion_tokens > 0 and chat.usage.total_tokens == (
        chat.usage.prompt_tokens + chat.usage.completion_tokens)
    spec = chat.model_extra["edgespec"]
    assert {"drafted", "accepted", "steps", "tokens_per_s"} <= set(spec) and spec["steps"] > 0
    # Greedy answers are the library's.
    lib = engine.chat(messages, max_tokens=12, temperature=0)
    chat_tokens = engine.chat_tokens(messages)
    assert_same_answer(engine, chat_tokens, lib, choice.message.content)
    assert chat.usage.prompt_tokens == lib.stats.prompt_tokens

    stream = client.chat.completions.create(model=SMALL, messages=messages, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert_same_answer(engine, chat_tokens, lib, text)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].usage.completion_tokens > 0 and not chunks[-1].choices
    assert len({c.id for c in chunks}) == 1

    prompt = "The three primary colours are"
    comp = client.completions.create(model=SMALL, prompt=prompt, max_tokens=10, temperature=0)
    lib = engine.generate(prompt, max_tokens=10, temperature=0)
    assert_same_answer(engine, engine.text_tokens(prompt), lib, comp.choices[0].text)
    assert comp.usage.completion_tokens > 0
    streamed = list(client.completions.create(model=SMALL, prompt=prompt, max_tokens=10, temperature=0,
                                              stream=True))
    assert_same_answer(engine, engine.text_tokens(prompt), lib, "".join(c.choices[0].text for c in streamed))
    assert streamed[-1].choices[0].finish_reason in ("stop", "length")
    assert streamed[-1].model_extra["edgespec"]["steps"] > 0

    # stop strings and a seeded sampled answer (same seed: same answer)
    stopped = client.completions.create(model=SMALL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0,
                                        stop=[" 6"])
    assert " 6" not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"
    a, b = (client.completions.create(model=SMALL, prompt=prompt, max_tokens=8, temperature=0.9,
                                      top_p=0.9, seed=7).choices[0].text for _ in range(2))
    assert a == b

    models = client.models.list()
    assert [m.id for m in models.data] == [SMALL]


def test_raw_http_errors(server, small_path):
    r = server.request
    chat = "/v1/chat/completions"
    _error(r("POST", chat, b"{not json"), 400, code="invalid_json")
    _error(r("POST", chat, b"[1, 2]"), 400, code="invalid_json")
    _error(r("POST", chat, {"messages": []}), 400, param="messages")
    _error(r("POST", chat, {"messages": "hi"}), 400, param="messages")
    _error(r("POST", chat, {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}), 400,
           param="temperature")
    _error(r("POST", chat, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}), 400,
           param="max_tokens")
    _error(r("POST", chat, {"messages": [{"role": "user", "content": "x"}], "top_p": 0}), 400, param="top_p")
    _error(r("POST", chat, {"messages": [{"role": "user", "content": "x"}], "n": 2}), 400, param="n")
    _error(r("POST", chat, {"messages": [{"role": "user", "content": "x"}], "stop": [3]}), 400, param="stop")
    _error(r("POST", chat, {"messages": [{"role": "wizard", "content": "x"}]}), 400)
    _error(r("POST", "/v1/completions", {"prompt": ""}), 400, param="prompt")
    _error(r("POST", "/v1/completions", {"prompt": "x " * 3000}), 400, code="context_length_exceeded")
    _error(r("POST", chat, {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}), 404,
           code="model_not_found")
    # the model may be named by its id or its path
    ok = r("POST", "/v1/completions", {"model": small_path, "prompt": "Hi", "max_tokens": 1})
    assert ok[0] == 200, ok
    _error(r("GET", "/v1/nothing"), 404)
    _error(r("GET", chat), 405)
    # bodies over 1 MiB: 413, by Content-Length and by the bytes actually sent (chunked)
    _error(r("POST", chat, b"{" + b" " * (1 << 20) + b"}"), 413, code="request_too_large")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("POST", chat, body=iter([b" " * (600 << 10), b" " * (600 << 10)]),
                     headers={"Content-Type": "application/json"}, encode_chunked=True)
        resp = conn.getresponse()
        _error((resp.status, {}, resp.read()), 413, code="request_too_large")
    finally:
        conn.close()
    # DNS rebinding: a Host header that does not name the server
    _error(r("GET", "/v1/models", headers={"Host": "evil.example:%d" % server.port}), 400, code="invalid_host")
    _error(r("GET", "/health", headers={"Host": "evil.example"}), 400, code="invalid_host")
    assert r("GET", "/v1/models", headers={"Host": "localhost:%d" % server.port})[0] == 200
    status, _, body = r("GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"


def test_api_key(keyed):
    openai = pytest.importorskip("openai")
    r = keyed.request
    _error(r("GET", "/v1/models"), 401, code="invalid_api_key")
    _error(r("GET", "/v1/models", headers={"Authorization": "Bearer wrong"}), 401, code="invalid_api_key")
    _error(r("POST", "/v1/completions", {"prompt": "hi"}, headers={"Authorization": KEY}), 401)
    assert r("GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})[0] == 200
    assert r("GET", "/health")[0] == 200  # no key needed
    assert r("GET", "/metrics")[0] == 200
    good = openai.OpenAI(base_url=keyed.base + "/v1", api_key=KEY, max_retries=0, timeout=120)
    comp = good.completions.create(model=SMALL, prompt="Hi", max_tokens=2, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert comp.choices[0].finish_reason == "length" and comp.usage.completion_tokens == 2
    assert comp.choices[0].text  # two tokens of the model's answer came back
    bad = openai.OpenAI(base_url=keyed.base + "/v1", api_key="nope", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


class _RawStream:
    """A streaming completion over a bare socket, to hang up on mid-stream."""

    def __init__(self, port: int, body: dict, key: str | None = None):
        data = json.dumps({**body, "stream": True}).encode()
        auth = f"Authorization: Bearer {key}\r\n" if key else ""
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{auth}"
                           f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode()
                          + data)
        self.buf = b""

    def read_until(self, marker: bytes, limit: int = 1 << 20) -> bytes:
        for _ in range(10_000):
            if marker in self.buf or len(self.buf) > limit:
                break
            chunk = self.sock.recv(65536)
            if not chunk:
                break
            self.buf += chunk
        assert marker in self.buf, self.buf[-500:]
        return self.buf

    def close(self) -> None:
        self.sock.close()


def test_queue_full_and_disconnect_frees_the_slot(keyed):
    auth = {"Authorization": f"Bearer {KEY}"}
    long = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}
    running = _RawStream(keyed.port, long, KEY)
    queued = None
    try:
        running.read_until(b"data: ")  # headers and the first token: it is generating
        assert keyed.wait_metric("edgespec_requests_running", lambda v: v == 1) == 1
        # A queued client that hangs up leaves the queue at once.
        queued = _RawStream(keyed.port, {"prompt": "Hi", "max_tokens": 4}, KEY)
        keyed.wait_metric("edgespec_queue_length", lambda v: v == 1)
        queued.close()
        keyed.wait_metric("edgespec_queue_length", lambda v: v == 0)
        # Fill the queue (max 1 waiting), then one more request gets 503.
        box = []
        waiter = threading.Thread(target=lambda: box.append(keyed.request(
            "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "temperature": 0}, headers=auth)))
        waiter.start()
        keyed.wait_metric("edgespec_queue_length", lambda v: v == 1)
        err = _error(keyed.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 3}, headers=auth),
                     503, code="queue_full")
        assert err["type"] == "server_error"
        assert keyed.metrics()['edgespec_requests_rejected_total{reason="queue_full"}'] >= 1
        # The long generation is not interrupted by the newcomers; hanging up on it frees the slot.
        assert keyed.metrics()["edgespec_requests_running"] == 1
        t0 = time.monotonic()
        running.close()
        waiter.join(60)
        assert box and box[0][0] == 200, box
        assert time.monotonic() - t0 < 60
        assert json.loads(box[0][2])["usage"]["completion_tokens"] >= 1
    finally:
        running.close()
        if queued is not None:
            queued.close()
    m = keyed.metrics()
    assert m['edgespec_requests_total{endpoint="completions",finish_reason="cancelled"}'] >= 1
    assert m["edgespec_generated_tokens_total"] < 1000  # the long one stopped early
    keyed.wait_metric("edgespec_requests_running", lambda v: v == 0)
    assert keyed.request("GET", "/health")[0] == 200


def test_concurrent_clients_get_their_own_complete_answers(server, engine):
    """8 clients x 2 requests (one streamed, one not), chat and completions, all at once."""
    openai = pytest.importorskip("openai")
    # Two requests per client are enough for each to send one streamed and one plain request,
    # and for every client's second request to queue behind the others' first.
    n_clients, per_client, max_tokens = 8, 2, 10
    subjects = ["cats", "rivers", "planets", "bread", "trains", "music", "winter", "numbers"]
    jobs = {}
    for i, subject in enumerate(subjects):
        if i % 2:
            messages = [{"role": "user", "content": f"Write one sentence about {subject}."}]
            lib = engine.chat(messages, max_tokens=max_tokens, temperature=0)
            jobs[i] = ("chat", messages, lib)
        else:
            prompt = f"A short fact about {subject}:"
            lib = engine.generate(prompt, max_tokens=max_tokens, temperature=0)
            jobs[i] = ("completion", prompt, lib)
    assert len({lib.text for _, _, lib in jobs.values()}) == n_clients  # answers tell requests apart
    before = server.metrics()
    results, errors = {}, []

    def client_loop(i: int) -> None:
        cli = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0, timeout=300)
        kind, payload, _ = jobs[i]
        try:
            for k in range(per_client):
                stream = (i + k) % 2 == 0
                if kind == "chat":
                    resp = cli.chat.completions.create(model=SMALL, messages=payload, max_tokens=max_tokens,
                                                       temperature=0, stream=stream)
                    if stream:
                        chunks = list(resp)
                        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                        finish, ids = chunks[-1].choices[0].finish_reason, {c.id for c in chunks}
                        n = chunks[-1].usage.completion_tokens
                    else:
                        text, finish, ids = resp.choices[0].message.content, resp.choices[0].finish_reason, {resp.id}
                        n = resp.usage.completion_tokens
                else:
                    resp = cli.completions.create(model=SMALL, prompt=payload, max_tokens=max_tokens,
                                                  temperature=0, stream=stream)
                    if stream:
                        chunks = list(resp)
                        text = "".join(c.choices[0].text for c in chunks)
                        finish, ids = chunks[-1].choices[0].finish_reason, {c.id for c in chunks}
                        n = chunks[-1].usage.completion_tokens
                    else:
                        text, finish, ids = resp.choices[0].text, resp.choices[0].finish_reason, {resp.id}
                        n = resp.usage.completion_tokens
                results[(i, k)] = (text, finish, ids, n)
        except Exception as exc:
            errors.append((i, repr(exc)))
        finally:
            cli.close()

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(n_clients)]
    t0 = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join(600)
    elapsed = time.monotonic() - t0
    assert not errors, errors
    assert len(results) == n_clients * per_client
    all_ids = set()
    for (i, k), (text, finish, ids, n) in results.items():
        kind, payload, lib = jobs[i]
        prompt_tokens = engine.chat_tokens(payload) if kind == "chat" else engine.text_tokens(payload)
        assert_same_answer(engine, prompt_tokens, lib, text)  # complete, and its own
        if text == lib.text:
            assert finish == lib.finish_reason and n == lib.stats.generated_tokens
        assert len(ids) == 1 and not ids & all_ids  # one id per response, never shared
        all_ids |= ids
    after = server.metrics()
    done = sum(v - before.get(k, 0) for k, v in after.items() if k.startswith("edgespec_requests_total{"))
    assert done == n_clients * per_client
    assert after["edgespec_queue_length"] == 0
    server.wait_metric("edgespec_requests_running", lambda v: v == 0)
    status, _, body = server.request("GET", "/health")
    assert status == 200
    print(f"load test: {n_clients * per_client} requests in {elapsed:.1f} s")


def test_metrics_after_traffic(server, client):
    client.completions.create(model=SMALL, prompt="Hello", max_tokens=3, temperature=0)
    status, headers, body = server.request("GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    text = body.decode()
    for name in ("edgespec_requests_total", "edgespec_generated_tokens_total", "edgespec_tokens_per_second",
                 "edgespec_drafted_tokens_total", "edgespec_accepted_tokens_total", "edgespec_queue_length",
                 "edgespec_http_requests_total"):
        assert f"# TYPE {name} " in text, name
    m = server.metrics()
    assert m['edgespec_drafted_tokens_total{drafter="suffix"}'] >= m['edgespec_accepted_tokens_total{drafter="suffix"}']
    assert m['edgespec_http_requests_total{path="/v1/completions",code="200"}'] >= 1


# -- startup: loading, refusals ------------------------------------------------------------------
def test_health_is_503_while_loading_and_load_errors_stop_the_server():
    from edgespec.server.app import ServerConfig, ServerState, bind_socket, serve

    gate = threading.Event()

    def factory():
        gate.wait(30)
        raise BudgetExceeded("model too large for the test budget")

    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    outcome = []

    def run():
        try:
            serve(ServerState(ServerConfig(model_id="m", port=port)), factory, sock)
            outcome.append(None)
        except Exception as exc:
            outcome.append(exc)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    srv = ServerProcess(None, port, Path("/dev/null"))
    try:
        for _ in range(100):
            try:
                status, _, body = srv.request("GET", "/health", timeout=5)
                break
            except OSError:
                time.sleep(0.05)
        assert status == 503 and json.loads(body)["status"] == "loading"
        _error(srv.request("POST", "/v1/completions", {"prompt": "hi"}), 503, code="model_loading")
    finally:
        gate.set()
        th.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], BudgetExceeded)


def _cli(*args, timeout=120):
    return subprocess.run([EDGESPEC, *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _one_line_error(proc, code: int, *fragments: str) -> None:
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("edgespec: ")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


@pytest.mark.parametrize("budget", ["-1", "abc", "0", "2XB"])
def test_serve_refuses_bad_ram_budget(small_path, budget):
    _one_line_error(_cli("serve", "-m", small_path, "--port", "0", "--ram-budget", budget), 2, "--ram-budget")


def test_serve_refuses_a_model_over_the_ram_budget(small_path):
    proc = _cli("serve", "-m", small_path, "--port", "0", "--ctx", str(CTX), "--draft", "none",
                "--ram-budget", "10MiB")
    _one_line_error(proc, 1, "raise --ram-budget", "10.00 MiB")


def test_serve_unknown_model_and_busy_port(tmp_path, small_path):
    proc = subprocess.run([EDGESPEC, "serve", "-m", "no-such-model", "--port", "0"], capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, EDGESPEC_HOME=str(tmp_path)))
    _one_line_error(proc, 1, "no-such-model")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        proc = _cli("serve", "-m", small_path, "--draft", "none", "--port", str(port))
    _one_line_error(proc, 1, "cannot listen on 127.0.0.1:%d" % port)
