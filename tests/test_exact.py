"""Exact mode: batch-invariant kernels make greedy speculation return plain greedy's answer bit
for bit on the real Q4_K_M Qwen pair (where default kernels move batched logits by up to ~0.7).

The real runs happen in child processes (tests/exact_run.py): llama.cpp reads its tiled-matmul
switch once per process, and this one has decoded with default kernels already. The probe that
guards exact mode is also shown to fail where the kernels are not invariant.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DRAFTER, TARGET

from edgespec.bench.runner import BenchSettings, run_bench
from edgespec.drafters.auto.calibrate import calibration_key
from edgespec.engine import EngineConfig
from edgespec.errors import InvalidRequest
from edgespec.llama import invariant
from edgespec.llama.backend import ContextParams, LlamaContext, ModelParams

RUNNER = Path(__file__).with_name("exact_run.py")
# Code, where the model drafter's chains are accepted, and a copy, whose suffix drafts are long
# enough that verification crosses the kernels' 4- and 8-row batch thresholds (checked below).
# Any verification batch whose rows differ from one-token rows can part an answer; free-text
# prompts would add more batches of the same sizes at the 1.5B target's cost.
PROMPTS = [
    ("Add type hints to this function:\ndef add(a, b):\n    return a + b\n\n"
     "def scale(values, factor):\n    return [v * factor for v in values]\n"),
    ("Repeat the following text exactly: The quick brown fox jumps over the lazy dog. "
     "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog."),
]


def _child(*args: str, timeout: int = 600) -> dict:
    proc = subprocess.run([sys.executable, str(RUNNER), *args], check=False, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


# -- settings and refusals (no model) -------------------------------------------------------------
def test_exact_settings():
    assert invariant.model_params(ModelParams()).repack is False
    from edgespec.llama.backend import qmatmul_loaded

    kv = "f16" if qmatmul_loaded() else "q8_0"  # edgespec's attention keeps an f16 cache's rows
    c = invariant.context_params(ContextParams())
    assert (c.flash_attn, c.kv_type, c.op_offload) == (True, kv, False)
    assert invariant.context_params(ContextParams(kv_type="q4_0")).kv_type == kv  # the one it plans


@pytest.mark.parametrize("options, fragment", [
    ({"draft_tree": True}, "drafts chains"),
    ({"n_gpu_layers": 4}, "on the CPU"),
    ({"placement": "offload"}, "on the CPU"),
    ({"placement": "gpu"}, "on the CPU"),
    ({"flash_attn": False}, "flash attention"),
    ({"recheck_gap": 0.3}, "re-checks"),
])
def test_exact_refuses_what_it_cannot_keep(options, fragment):
    with pytest.raises(InvalidRequest, match=fragment):
        EngineConfig(exact=True, draft="auto", **options)
    EngineConfig(exact=True, draft="auto", placement="draft-gpu")  # the target stays on the CPU


def test_bench_refuses_trees_in_exact_mode():
    with pytest.raises(InvalidRequest, match="model-tree"):
        run_bench([], ["plain", "model-tree"], BenchSettings(EngineConfig(exact=True)))


def test_calibration_keys_tell_the_tiled_matmul_apart(tmp_path, monkeypatch):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x")
    monkeypatch.delenv(invariant.TILED_MM_ENV, raising=False)
    on = calibration_key(f, ModelParams(), 2, True)
    monkeypatch.setenv(invariant.TILED_MM_ENV, "0")
    assert invariant.tiled_matmul_requested() is False
    assert calibration_key(f, ModelParams(), 2, True) == on.replace("-fa-", "-notiled-fa-")
    monkeypatch.setenv(invariant.TILED_MM_ENV, "1")
    assert calibration_key(f, ModelParams(), 2, True) == on


# -- the real target ----------------------------------------------------------------------------
def test_probe_sees_default_kernels_depend_on_the_batch(store):
    """The guard can fail: repacked weights without flash attention give batched rows of their own."""
    from edgespec.llama.backend import LlamaModel

    model = LlamaModel(store.resolve(TARGET), ModelParams())
    ctx = LlamaContext(model, ContextParams(n_ctx=256, flash_attn=False))
    try:
        assert invariant.deviation(ctx) > 0.01
        with pytest.raises(invariant.NotBatchInvariant, match="differ from one-token decodes"):
            invariant.check(ctx)
        assert ctx.seq_pos_max(0) == -1  # the probe leaves its sequence empty
    finally:
        ctx.close()
        model.close()


def test_a_context_for_short_drafts_is_probed_with_the_rows_it_verifies(store):
    """A context sized for 2-token drafts is probed with the 3 rows it verifies, and those can
    differ too: the 0.5B's without flash attention (its KQ product differs from 2 rows on; the
    1.5B's 3 rows matched on an AVX-512 Xeon with edgespec's kernels, its 8 rows did not)."""
    from edgespec.llama.backend import LlamaModel

    model = LlamaModel(store.resolve(DRAFTER), ModelParams())
    ctx = LlamaContext(model, ContextParams(n_ctx=256, flash_attn=False, n_outputs_max=3))
    try:
        assert invariant.deviation(ctx) > 0.01
    finally:
        ctx.close()
        model.close()


def test_exact_speculation_equals_plain_bit_for_bit(store):
    """Every answer of every drafter is plain greedy's, character for character, with no tolerance
    (`bench --exact --share-prefill`: one load, each prompt evaluated once)."""
    result = _child("answers", json.dumps(PROMPTS), "48", "suffix", "model")
    plain = result["plain"]
    for draft in ("suffix", "model"):
        for i, (p, s) in enumerate(zip(plain, result[draft], strict=True)):
            assert (s["text"], s["tokens"]) == (p["text"], p["tokens"]), f"{draft}, prompt {i}"
        assert sum(s["accepted"] for s in result[draft]) > 0, f"{draft} never had a draft accepted"
    # The copy's verifications cross the kernels' batch thresholds (4 and 8 rows): the largest
    # draft holds at least the mean, rounded up, and is verified with the pending token.
    copy = result["suffix"][1]
    assert math.ceil(copy["drafted"] / copy["steps"]) + 1 >= 8, copy


def test_exact_mode_refuses_after_default_kernels_ran(store):
    """llama.cpp read the tiled-matmul switch at the process's first decode: the probe says so.
    With edgespec's qmatmul in the CPU backend the target's matmuls never take the tiled kernel,
    so exact mode holds even then."""
    from edgespec.llama.backend import qmatmul_loaded

    result = _child("late")
    if qmatmul_loaded():
        assert result["error"] is None, result
        return
    assert result["error"] == "NotBatchInvariant", result
    assert "before exact mode set it" in result["message"]


def test_plan_shows_the_exact_load(store):
    """`plan --exact` counts the load exact mode makes (no repacked copy, the cache type it plans,
    chains)."""
    from edgespec.llama.backend import qmatmul_loaded

    edgespec = Path(sys.executable).with_name("edgespec")
    proc = subprocess.run([str(edgespec), "plan", "-m", TARGET, "--exact", "--json"], check=False, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    kv = invariant.kv_type(qmatmul_loaded())
    assert (plan["repack"], plan["kv_type"], plan["flash_attn"], plan["draft_tree"]) == (False, kv, True, False)
    refused = subprocess.run([str(edgespec), "plan", "-m", TARGET, "--exact", "--draft-tree"], check=False,
                             capture_output=True,
                             text=True, timeout=120, env=dict(os.environ))
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert "drafts chains" in refused.stderr
