"""Hyperparameters llama.cpp aborts on are refused before llama.cpp opens the file.

The corpus (tests/gguf_corpus.py HPARAM_MUTATIONS) is the small valid model with one bound of
llama.cpp's load_hparams or of an architecture's graph broken; each must end in one InvalidGGUF
naming the key, and every command that could load it must exit 1 with one `error:` line.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from gguf_corpus import HPARAM_ACCEPTED, HPARAM_MUTATIONS, build_hparam_corpus

from edgespec.errors import InvalidGGUF
from edgespec.files.gguf import model_info, read_gguf, read_gguf_header
from edgespec.files.modelfile import model_file
from edgespec.files.store import ModelStore

EDGESPEC = str(Path(sys.executable).with_name("edgespec"))
USER_MODELS = Path.home() / ".cache" / "edgespec" / "models"
SMOLLM = USER_MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    return build_hparam_corpus(tmp_path_factory.mktemp("hparams"))


@pytest.mark.model_free
@pytest.mark.parametrize("name", sorted(HPARAM_MUTATIONS))
def test_every_reader_refuses_naming_the_key(corpus, name):
    path, expected = corpus[name]
    for read in (read_gguf, read_gguf_header, model_info):
        with pytest.raises(InvalidGGUF) as e:
            read(path)
        assert expected in str(e.value) and "llama.cpp requires" in str(e.value)
        assert "\n" not in str(e.value)


@pytest.mark.model_free
@pytest.mark.parametrize("name", sorted(HPARAM_ACCEPTED))
def test_values_at_the_bounds_are_accepted(tmp_path, name):
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(HPARAM_ACCEPTED[name]())
    read_gguf(path)


@pytest.mark.model_free
def test_the_store_refuses_to_import(corpus, tmp_path):
    store = ModelStore(tmp_path / "home")
    with pytest.raises(InvalidGGUF, match="llama.block_count is 513"):
        store.import_model(corpus["block_count_513"][0], "hostile")
    assert not list((tmp_path / "home").rglob("*.gguf"))


@pytest.mark.model_free
@pytest.mark.skipif(not USER_MODELS.is_dir(), reason="no models pulled into ~/.cache/edgespec")
def test_real_models_still_validate():
    paths = sorted(USER_MODELS.glob("*.gguf"))
    assert paths
    for p in paths:
        assert model_file(p).info.n_layers


def _edgespec(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, EDGESPEC_HOME=str(tmp_path / "home"))
    return subprocess.run([EDGESPEC, *args], capture_output=True, text=True, env=env, timeout=120,
                          check=False)


def _assert_refused(r: subprocess.CompletedProcess, expected: str) -> None:
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])  # 134 / -6 would be llama.cpp's abort
    out = r.stdout + r.stderr
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], out[-2000:]
    assert "Traceback" not in out


@pytest.mark.model_free
@pytest.mark.parametrize("name", ["block_count_0", "expert_count_1000_none_used"])
@pytest.mark.parametrize("command", [["run", "-m", "{}", "hi"], ["models", "info", "{}"],
                                     ["plan", "-m", "{}"]])
def test_commands_exit_1_with_one_error_line(corpus, tmp_path, name, command):
    path, expected = corpus[name]
    _assert_refused(_edgespec(tmp_path, *[str(path) if a == "{}" else a for a in command]),
                    expected)


@pytest.mark.model_free
@pytest.mark.parametrize("command", [["models", "import", "{}"],
                                     ["serve", "-m", "{}", "--port", "0"]])
def test_import_and_serve_refuse(corpus, tmp_path, command):
    path, expected = corpus["block_count_513"]
    _assert_refused(_edgespec(tmp_path, *[str(path) if a == "{}" else a for a in command]),
                    expected)


@pytest.mark.model_free
@pytest.mark.skipif(not SMOLLM.is_file(), reason="smollm2-135m not pulled")
def test_a_hostile_draft_model_is_refused(corpus, tmp_path):
    path, expected = corpus["expert_used_over_count"]
    _assert_refused(_edgespec(tmp_path, "run", "-m", str(SMOLLM), "--draft-model", str(path), "hi"),
                    expected)


_LOAD_UNCHECKED = """
import sys
import edgespec.files.gguf as gguf
gguf.check_hparams = lambda path, metadata: None
from edgespec.llama.backend import LlamaModel
try:
    LlamaModel(sys.argv[1])
except Exception as e:
    print(type(e).__name__)
"""


@pytest.mark.parametrize("name", ["block_count_513", "expert_count_1000_none_used",
                                  "rope_scaling_unknown"])
def test_without_the_check_llama_cpp_aborts(corpus, name):
    """Negative control: the corpus files really abort llama.cpp when nothing refuses them."""
    env = dict(os.environ, GGML_NO_BACKTRACE="1")  # no gdb attach: seconds per case
    r = subprocess.run([sys.executable, "-c", _LOAD_UNCHECKED, str(corpus[name][0])],
                       capture_output=True, text=True, env=env, timeout=120,
                       check=False)
    assert r.returncode == -signal.SIGABRT, (r.returncode, r.stdout, r.stderr[-2000:])
