"""A real `edgespec serve` process for the server tests: start it, talk raw HTTP to it, read its
metrics and log, signal and stop it. Every wait is bounded."""
from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from conftest import SMALL

EDGESPEC = str(Path(sys.executable).with_name("edgespec"))
CTX = 1024
THREADS = 1  # one llama.cpp thread: several spinning processes on 2 cores slow each other down


class ServerProcess:
    """A running `edgespec serve`, its port and its stderr log."""

    def __init__(self, proc: subprocess.Popen, port: int, log: Path):
        self.proc, self.port, self.log = proc, port, log
        self.base = f"http://127.0.0.1:{port}"

    def request(self, method: str, path: str, body=None, headers: dict | None = None,
                content_type: str | None = "application/json", timeout: float = 120) -> tuple[int, dict, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
            hdrs = {**({"Content-Type": content_type} if content_type else {}), **(headers or {})}
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            conn.close()

    def metrics(self) -> dict[str, float]:
        status, _, body = self.request("GET", "/metrics")
        assert status == 200
        out = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def wait_metric(self, name: str, pred, timeout: float = 30) -> float:
        value = None
        for _ in range(int(timeout / 0.05)):
            value = self.metrics().get(name, 0.0)
            if pred(value):
                return value
            time.sleep(0.05)
        raise AssertionError((name, value))

    def log_lines(self) -> list[str]:
        """The log's lines after the server said it is ready."""
        lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
        ready = next(i for i, ln in enumerate(lines) if ln.startswith("edgespec: ready: "))
        return lines[ready + 1:]

    def signal_and_wait(self, sig: int, limit: float) -> tuple[int, float]:
        """Sends ``sig``; the exit status and the seconds it took (fails past ``limit``)."""
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        try:
            code = self.proc.wait(limit)
        except subprocess.TimeoutExpired:
            stop(self)
            raise AssertionError(f"the server outlived {sig!r} by {limit} s: {self.log.read_text()}") from None
        return code, time.monotonic() - t0


def start_server(log_dir: Path, *args: str, env: dict | None = None, timeout: float = 120) -> ServerProcess:
    """`edgespec serve -m smollm2-135m --port 0 ...`, healthy (the port is read from its log)."""
    log = log_dir / f"stderr-{time.monotonic_ns()}.txt"
    with open(log, "wb") as err:
        proc = subprocess.Popen([EDGESPEC, "serve", "--model", SMALL, "--port", "0", "--ctx", str(CTX),
                                 "--threads", str(THREADS), *args],
                                stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL,
                                env={**os.environ, "EDGESPEC_LOG": "INFO", **(env or {})})
    server = None
    for _ in range(int(timeout / 0.1)):
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}: {log.read_text()}")
        text = log.read_text(errors="replace")
        if server is None and "edgespec: serving " in text:
            port = int(text.split("edgespec: serving ", 1)[1].split(" (", 1)[0].rsplit(":", 1)[1])
            server = ServerProcess(proc, port, log)
        if server is not None and "edgespec: ready: " in text:
            assert server.request("GET", "/health", timeout=10)[0] == 200
            return server
        time.sleep(0.1)
    proc.kill()
    proc.wait(10)
    raise AssertionError(f"server not ready within {timeout} s: {log.read_text()}")


def stop(server: ServerProcess) -> int:
    if server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(30)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(10)
    return server.proc.returncode


def raw_post(port: int, path: str, head_extra: str, body: bytes, declared: int | None = None) -> socket.socket:
    """A POST over a bare socket, sending ``body`` (maybe less than ``declared``) and no more."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    length = len(body) if declared is None else declared
    sock.sendall((f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                  f"{head_extra}Content-Length: {length}\r\n\r\n").encode() + body)
    return sock


def read_all(sock: socket.socket, timeout: float) -> bytes:
    """Everything until the server closes the connection or ``timeout`` passes."""
    sock.settimeout(timeout)
    buf = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, ConnectionError):
            break
        if not chunk:
            break
        buf += chunk
    return buf


def status_of(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/1.1 ") else 0
