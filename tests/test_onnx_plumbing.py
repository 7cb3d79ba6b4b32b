"""The ONNX drafter's plumbing: --onnx-provider / --onnx-bits from the CLI to the session, the
provider fallback, the planner counting its memory, doctor's provider list, and `models rm`
removing conversions. Everything but the fallback test reads metadata only (no model loads)."""
from __future__ import annotations

import fcntl
import json
import logging
import os
from pathlib import Path

import pytest

from edgespec.drafters import KINDS, DraftConfig
from edgespec.drafters.factory import make_drafter
from edgespec.llama.backend import ContextParams, ModelParams
from edgespec.load import LoadPlan
from edgespec.engine import EngineConfig
from edgespec.errors import (
    BudgetExceeded,
    InvalidRequest,
    ModelNotFound,
    StoreError,
    UnknownProvider,
)
from edgespec.files.store import ModelStore
from edgespec.files.store_remove import converted_onnx_dirs
from edgespec.memory import planner
from edgespec.memory import candidates
from edgespec.memory.footprint import (
    ONNX_SIZE_RATIO,
    estimate_model,
    estimate_onnx_drafter,
)
from edgespec.memory.placements import CHAINS
from edgespec.onnx.convert import BITS, onnx_dir_for
from edgespec.onnx.providers import NAMES, check_provider, short_name

REPO = Path(__file__).resolve().parent.parent
TARGET = "qwen2.5-coder-1.5b"
DRAFTER = "qwen2.5-coder-0.5b"
SMALL = "smollm2-135m"


def _cli(*args: str, capsys) -> tuple[int, str, str]:
    from edgespec.cli import main

    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


# -- names ----------------------------------------------------------------------------------

def test_provider_names_and_refusals():
    assert NAMES == ("cpu", "cuda", "tensorrt", "dml", "openvino", "qnn", "coreml")
    assert short_name("CUDAExecutionProvider") == "cuda" and short_name("AzureExecutionProvider") is None
    assert all(check_provider(n) == n for n in NAMES)
    with pytest.raises(UnknownProvider, match="--onnx-provider must be one of cpu, cuda, .* not 'tpu'"):
        check_provider("tpu")
    assert issubclass(UnknownProvider, InvalidRequest)  # the CLI's one-line error, the server's 400
    for make in (EngineConfig, DraftConfig):
        assert make(onnx_provider="cuda", onnx_bits="4").onnx_provider == "cuda"
        with pytest.raises(UnknownProvider):
            make(onnx_provider="npu")
        with pytest.raises(InvalidRequest, match="--onnx-bits must be one of exact, 4"):
            make(onnx_bits="8")


def test_every_verb_with_draft_takes_the_onnx_options(capsys):
    for verb in ("run", "chat", "serve", "bench", "plan"):
        code, out, _ = _cli(verb, "--help", capsys=capsys)
        assert code == 0 and "--onnx-provider" in out and "--onnx-bits" in out, verb


@pytest.mark.parametrize("verb", [["run", "hi"], ["plan"], ["serve", "--port", "0"]])
def test_an_unknown_provider_is_one_line_before_anything_loads(verb, capsys):
    code, _, err = _cli(*verb, "--draft", "onnx", "--onnx-provider", "tpu", capsys=capsys)
    assert code == 1
    assert err.strip().splitlines() == [
        "error: --onnx-provider must be one of cpu, cuda, tensorrt, dml, openvino, qnn, coreml, not 'tpu'"]


def test_the_engine_passes_the_options_to_the_drafter(monkeypatch):
    """EngineConfig -> DraftConfig -> the onnx builder's arguments, without loading anything."""
    from edgespec import drafters
    from edgespec.drafters import factory

    class Built(Exception):
        pass

    seen = {}

    def fake(*args, **kw):
        seen.update(kw)
        raise Built

    monkeypatch.setattr(factory, "make_onnx_drafter", fake)
    config = EngineConfig(draft="onnx", onnx_provider="openvino", onnx_bits="4")
    plan = LoadPlan(config, Path("target.gguf"), ModelParams(), ContextParams(n_ctx=512), CHAINS, "onnx", None)
    ctx = type("Ctx", (), {"n_ctx": 512, "model": None})()
    with pytest.raises(Built):
        make_drafter(plan.draft_config(), None, None, target_ctx=ctx)
    assert (seen["provider"], seen["bits"], seen["n_ctx"]) == ("openvino", "4", 512)
    assert KINDS["onnx"].onnx_model and not any(k.onnx_model for n, k in KINDS.items() if n != "onnx")
    assert drafters.DraftConfig().onnx_provider == "cpu"


def test_bench_settings_reach_the_draft_config():
    from edgespec.bench.runner import BenchSettings, _engine_config, _Runners

    settings = BenchSettings(EngineConfig(onnx_provider="dml", onnx_bits="4"))
    config = _engine_config(settings.engine, ["plain", "onnx"])

    class _Engine:  # what _Runners reads of an engine built for these settings
        load_plan = LoadPlan(config, Path("target.gguf"), ModelParams(), ContextParams(n_ctx=256), CHAINS, None, None)
        ctx = type("Ctx", (), {"n_ctx": 256})()

    r = _Runners(_Engine(), settings)
    cfg = r._draft_config("onnx")
    assert (cfg.kind, cfg.onnx_provider, cfg.onnx_bits, cfg.n_ctx) == ("onnx", "dml", "4", 256)


# -- the fallback, for real ------------------------------------------------------------------

def test_cuda_on_this_cpu_only_machine_drafts_on_the_cpu_with_one_warning(model_path, caplog):
    pytest.importorskip("onnx")
    from edgespec.engine import Engine

    if "CUDAExecutionProvider" in __import__("onnxruntime").get_available_providers():
        pytest.skip("this onnxruntime has CUDA: nothing falls back")
    model_path(DRAFTER)
    with caplog.at_level(logging.WARNING, logger="edgespec.onnx.session"):
        # The 0.5B as its own target: the fallback needs an ONNX drafter, not a bigger target.
        with Engine(EngineConfig(model=DRAFTER, n_ctx=512, n_threads=2, draft="onnx", draft_max=4,
                                 onnx_provider="cuda")) as engine:
            assert engine.drafter.lm.provider == "cpu"
            done = engine.generate("def fibonacci(n):\n    if n < 2:\n        return n\n    return",
                                   max_tokens=12, temperature=0)
    assert done.stats.generated_tokens == 12
    assert done.stats.spec.by_drafter["onnx"].drafted > 0
    assert [r.getMessage() for r in caplog.records] == [
        "onnx provider cuda is not installed in this onnxruntime; drafting on the CPU"]


# -- memory ----------------------------------------------------------------------------------

def _measured() -> dict[str, dict]:
    data = json.loads((REPO / "benchmarks" / "results" / "onnx-drafter.json").read_text())
    return {r["config"]: r for r in data["records"]}


def test_the_footprint_matches_the_measured_drafter(model_path, tmp_path):
    """Against benchmarks/results/onnx-drafter.json (2048 KV slots, 500 tokens, a whole process):
    the process baseline + the footprint is never below the measured peak RSS and at most 15%
    above it (the whole KV buffer is counted), and graph + KV buffer are what the drafter reported."""
    source = estimate_model(model_path(DRAFTER))
    measured = _measured()
    for bits, config in (("exact", "onnx-exact"), ("4", "onnx-4bit")):
        fp = estimate_onnx_drafter(source, None, bits)  # not converted here: estimated from the GGUF
        assert not fp.converted and fp.where == "RAM"
        assert fp.graph_bytes == int(source.file_size * ONNX_SIZE_RATIO[bits])
        assert fp.graph_bytes + fp.kv_bytes(2048) == pytest.approx(measured[config]["drafter_nbytes"], rel=0.01)
        peak = measured[config]["peak_rss_bytes"]
        assert peak <= candidates.PROCESS_BASE_BYTES + fp.resident_bytes(2048) <= 1.15 * peak
    # Converted: the files' sizes; on a GPU provider its parts are stated outside the RAM budget.
    d = tmp_path / "x.exact.onnx"
    d.mkdir()
    (d / "model.onnx").write_bytes(b"g" * 1000)
    (d / "weights.bin").write_bytes(b"w" * 5000)
    fp = estimate_onnx_drafter(source, d, "exact", "cuda")
    assert fp.converted and fp.graph_bytes == 6000 and fp.where == "GPU (cuda)"


def test_a_plan_with_draft_onnx_counts_the_drafter(model_path, capsys):
    model_path(DRAFTER)
    plans = {}
    for draft in ("onnx", "none"):
        code, out, err = _cli("plan", "-m", TARGET, "--draft", draft, "--ctx", "1024", "--ram-budget", "8GiB",
                              "--json", capsys=capsys)
        assert code == 0, err
        plans[draft] = json.loads(out)
    onnx = {p["component"]: p for p in plans["onnx"]["parts"] if p["component"].startswith("onnx drafter")}
    assert set(onnx) == {"onnx drafter graph (exact)", "onnx drafter KV buffer", "onnx drafter arena & runtime"}
    assert all(p["where"] == "RAM" for p in onnx.values())
    assert onnx["onnx drafter KV buffer"]["bytes"] == 2 * 24 * 2 * 1024 * 64 * 4
    # The drafter's bytes, and the verification batches drafting needs, on top of plain decoding.
    extra = plans["onnx"]["ram_bytes"] - plans["none"]["ram_bytes"]
    assert extra >= sum(p["bytes"] for p in onnx.values())
    code, out, _ = _cli("plan", "-m", TARGET, "--draft", "onnx", "--onnx-bits", "4", "--onnx-provider", "cuda",
                        "--ctx", "1024", "--ram-budget", "8GiB", "--json", capsys=capsys)
    four = json.loads(out)
    graph4 = next(p for p in four["parts"] if p["component"] == "onnx drafter graph (4)")
    assert graph4["bytes"] < onnx["onnx drafter graph (exact)"]["bytes"]
    assert "onnx provider cuda is not in this onnxruntime: planned on the CPU" in four["warnings"]


def test_a_budget_that_fits_plain_decoding_but_not_the_onnx_drafter_is_refused(model_path):
    from edgespec.files.modelfile import model_file
    from edgespec.load.drafter import onnx_footprint

    store = ModelStore()
    target = estimate_model(model_path(TARGET))
    onnx = onnx_footprint(EngineConfig(draft="onnx"), model_file(model_path(TARGET)), store, [])
    assert onnx is not None and onnx.name == DRAFTER
    m = planner.machine()
    base = planner.make_plan(target, None, 8 << 30, n_ctx=1024, suffix=False, machine_info=m)
    with_onnx = planner.make_plan(target, None, 8 << 30, n_ctx=1024, suffix=False, machine_info=m,
                                  external_drafter=onnx)
    assert with_onnx.ram_bytes - base.ram_bytes >= onnx.resident_bytes(1024)
    budget = onnx.resident_bytes(1024) + candidates.PROCESS_BASE_BYTES  # the drafter alone, no room for the target
    planner.make_plan(target, None, budget, n_ctx=1024, suffix=False, machine_info=m)  # fits (file-backed)
    with pytest.raises(BudgetExceeded):
        planner.make_plan(target, None, budget, n_ctx=1024, suffix=False, machine_info=m, external_drafter=onnx)


# -- doctor ----------------------------------------------------------------------------------

def test_doctor_lists_the_providers_and_their_names(monkeypatch, capsys):
    from edgespec.cli import doctor

    from edgespec.onnx import providers

    d = doctor.onnx_providers()
    assert {"name": "CPUExecutionProvider", "onnx_provider": "cpu"} in d["providers"]
    assert "cpu" in d["usable"] and d["names"] == list(NAMES)
    monkeypatch.setattr(providers, "present", lambda: ["TensorrtExecutionProvider", "CUDAExecutionProvider",
                                                       "AzureExecutionProvider", "CPUExecutionProvider"])
    d = doctor.onnx_providers()
    assert d["usable"] == ["tensorrt", "cuda", "cpu"]
    assert {"name": "AzureExecutionProvider", "onnx_provider": None} in d["providers"]
    code, out, _ = _cli("doctor", capsys=capsys)
    assert code == 0 and "CUDAExecutionProvider -> cuda" in out and "tensorrt, cuda, cpu" in out


# -- models rm -------------------------------------------------------------------------------

def _fake_conversion(directory: Path) -> Path:
    directory.mkdir(parents=True)
    for name in ("model.onnx", "weights.bin", "edgespec.json"):
        (directory / name).write_bytes(b"x")
    return directory


def test_the_store_finds_exactly_the_directories_convert_writes(tmp_path):
    store = ModelStore(tmp_path)
    gguf = tmp_path / "models" / "m-q4.gguf"
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF")
    made = [_fake_conversion(onnx_dir_for(store, gguf, bits)) for bits in BITS]
    decoys = [_fake_conversion(tmp_path / "models" / n) for n in ("m-q4.v2.exact.onnx", "m-q40.exact.onnx",
                                                                   "other.exact.onnx")]
    (tmp_path / "models" / "m-q4.x.onnx").write_bytes(b"a file, not a conversion")
    assert converted_onnx_dirs(gguf) == sorted(made)
    assert not set(decoys) & set(converted_onnx_dirs(gguf))


def test_rm_removes_the_conversions_of_an_imported_model(model_path, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    store = ModelStore(tmp_path)
    gguf = store.import_model(model_path(SMALL), name="mine")
    made = [_fake_conversion(onnx_dir_for(store, gguf, bits)) for bits in BITS]
    keep = _fake_conversion(gguf.with_name("mine2.exact.onnx"))
    assert store.onnx_conversions("mine") == sorted(made)
    # A conversion in progress holds its lock: rm refuses, and removes nothing.
    store.tmp_dir.mkdir(parents=True, exist_ok=True)
    with open(store.tmp_dir / f"{made[0].name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with pytest.raises(StoreError, match="being converted to ONNX"):
            store.remove("mine")
    assert gguf.exists() and all(d.exists() for d in made)
    code, out, err = _cli("models", "rm", "mine", capsys=capsys)
    assert code == 0, err
    assert not gguf.exists() and not any(d.exists() for d in made) and keep.exists()
    lines = out.strip().splitlines()
    assert lines[0] == f"removed mine: {gguf}"
    assert sorted(lines[1:]) == sorted(f"removed ONNX drafter of mine: {d}" for d in made)


def test_rm_of_a_builtin_removes_its_conversions_even_when_the_gguf_is_gone(model_path, tmp_path):
    store = ModelStore(tmp_path)
    src = model_path(SMALL)
    dest = store.models_dir / src.name
    dest.parent.mkdir(parents=True)
    os.link(src, dest)
    made = _fake_conversion(onnx_dir_for(store, dest, "4"))
    assert store.remove(SMALL) == dest
    assert not dest.exists() and not made.exists()
    leftover = _fake_conversion(onnx_dir_for(store, dest, "exact"))  # its GGUF already removed
    store.remove(SMALL)
    assert not leftover.exists()
    with pytest.raises(ModelNotFound):
        store.remove(SMALL)
