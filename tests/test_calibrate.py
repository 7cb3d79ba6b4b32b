"""Calibration of speculation costs: measured on the real context, cached per configuration."""
from __future__ import annotations

import json

from edgespec.drafters.auto import calibrate
from edgespec.llama.backend import ContextParams, LlamaContext


def _ctx(model, flash_attn, n_ctx=1024):
    return LlamaContext(model, ContextParams(n_ctx=n_ctx, n_seq_max=4, n_batch=64, flash_attn=flash_attn))


def test_measures_every_size_and_leaves_the_context_clean(small_model, tmp_path):
    ctx = _ctx(small_model, False)
    try:
        ctx.decode([1, 2, 3], range(3), [[0]] * 3, [False, False, True])  # a live sequence 0
        cm = calibrate.cost_model(ctx, None, tmp_path)
        assert cm.batch_sizes == tuple(n for n in calibrate.BATCH_SIZES if n <= 64)
        assert all(t > 0 for t in cm.verify_s) and cm.draft_token_s == 0.0
        # Batches are timed after CONTEXT_TOKENS of a scratch sequence, which is emptied after.
        assert ctx.seq_pos_max(ctx.n_seq_max - 1) == -1
        assert ctx.seq_pos_max(0) == 2
        assert len(cm.verify_s) == len(cm.batch_sizes)  # (no timing comparison: load on a shared machine)
    finally:
        ctx.close()


def test_cache_is_reused_and_keyed_by_attention_kernel(small_model, tmp_path, monkeypatch):
    # The cache, not the sizes, is under test (every size is measured in the test above): each
    # real measurement here times two batch sizes, and every measurement is counted.
    measured = []
    real = calibrate.measure_verify

    def few_sizes(ctx):
        measured.append(ctx.params.flash_attn)
        return real(ctx, sizes=(1, 4))

    monkeypatch.setattr(calibrate, "measure_verify", few_sizes)
    # A small context: less scratch context to fill before timing (the key ignores n_ctx).
    off, on = _ctx(small_model, False, 256), _ctx(small_model, True, 256)
    try:
        first = calibrate.cost_model(off, None, tmp_path)
        assert first.batch_sizes == (1, 4) and measured == [False]
        files = list((tmp_path / "calibration").glob("*.json"))
        assert len(files) == 1 and "nofa" in files[0].name and calibrate.VERSION in files[0].name
        # A doctored cache entry is what comes back: the second call measures nothing.
        data = json.loads(files[0].read_text())
        data["verify_s"] = [1.0] * len(data["verify_s"])
        files[0].write_text(json.dumps(data))
        assert calibrate.cost_model(off, None, tmp_path).verify_s == (1.0,) * len(first.verify_s)
        assert measured == [False]
        calibrate.cost_model(on, None, tmp_path)  # another kernel: measured and cached apart
        assert measured == [False, True]
        assert len(list((tmp_path / "calibration").glob("*.json"))) == 2
    finally:
        off.close()
        on.close()
