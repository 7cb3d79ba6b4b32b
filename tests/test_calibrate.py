"""Calibration of speculation costs: measured on the real context, cached per configuration."""
from __future__ import annotations

import json

from edgespec.drafters.auto import calibrate
from edgespec.llama.backend import ContextParams, LlamaContext


def _ctx(model, flash_attn, n_ctx=1024):
    return LlamaContext(model, ContextParams(n_ctx=n_ctx, n_seq_max=4, n_batch=64, flash_attn=flash_attn))


def test_measures_every_size_and_leaves_the_context_clean(small_model, tmp_path):
    # A small context: timed batches follow 190 tokens of scratch context instead of 512
    # (calibrate.measure_verify leaves room for two of the largest batch).
    ctx = _ctx(small_model, False, 256)
    try:
        ctx.decode([1, 2, 3], range(3), [[0]] * 3, [False, False, True])  # a live sequence 0
        # The default --draft-max 32: every size up to 33 timed for real (the merge of larger
        # ones is checked below without timing them).
        cm = calibrate.cost_model(ctx, None, tmp_path, largest=33)
        assert cm.batch_sizes == tuple(n for n in calibrate.BATCH_SIZES if n <= 33)
        assert all(t > 0 for t in cm.verify_s) and cm.draft_token_s == 0.0
        # Batches are timed after a scratch sequence of context, which is emptied after.
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

    def counted(ctx, sizes):
        measured.append(ctx.params.flash_attn)
        return real(ctx, sizes)

    monkeypatch.setattr(calibrate, "measure_verify", counted)
    # A small context: less scratch context to fill before timing (the key ignores n_ctx).
    off, on = _ctx(small_model, False, 256), _ctx(small_model, True, 256)
    try:
        first = calibrate.cost_model(off, None, tmp_path, largest=2)
        assert first.batch_sizes == (1, 2) and measured == [False]
        files = list((tmp_path / "calibration").glob("*.json"))
        assert len(files) == 1 and "nofa" in files[0].name and calibrate.VERSION in files[0].name
        # A doctored cache entry is what comes back: the second call measures nothing.
        data = json.loads(files[0].read_text())
        data["verify_s"] = [1.0] * len(data["verify_s"])
        files[0].write_text(json.dumps(data))
        assert calibrate.cost_model(off, None, tmp_path, largest=2).verify_s == (1.0,) * len(first.verify_s)
        assert measured == [False]
        calibrate.cost_model(on, None, tmp_path, largest=2)  # another kernel: measured and cached apart
        assert measured == [False, True]
        assert len(list((tmp_path / "calibration").glob("*.json"))) == 2
    finally:
        off.close()
        on.close()


def test_sizes_are_measured_up_to_the_largest_batch_and_merged_later(small_model, tmp_path, monkeypatch):
    """A configuration drafting at most 8 tokens times batches of up to 9; a later one drafting
    up to 16 measures only what the cache lacks, and the merged curve is cached."""
    asked = []
    monkeypatch.setattr(calibrate, "measure_verify",
                        lambda ctx, sizes: (asked.append(sizes), (sizes, tuple(0.01 * n for n in sizes)))[1])
    ctx = _ctx(small_model, False, 256)
    try:
        small = calibrate.verify_costs(ctx, tmp_path, largest=9)
        assert small.batch_sizes == (1, 2, 3, 4, 6, 8, 9) and asked == [small.batch_sizes]
        assert calibrate.verify_costs(ctx, tmp_path, largest=9) == small and len(asked) == 1
        assert calibrate.verify_costs(ctx, tmp_path, largest=4).batch_sizes == small.batch_sizes
        wider = calibrate.verify_costs(ctx, tmp_path, largest=17)
        assert asked[1] == (12, 15, 16, 17)
        assert wider.batch_sizes == (1, 2, 3, 4, 6, 8, 9, 12, 15, 16, 17)
        assert wider.verify_s == tuple(0.01 * n for n in wider.batch_sizes)
        assert calibrate.cached_verify(tmp_path, calibrate.context_key(ctx)) == wider
        calibrate.verify_costs(ctx, tmp_path)  # every size: only the rest, up to n_batch
        assert asked[2] == (24, 31, 32, 33, 48, 63, 64)
    finally:
        ctx.close()


def test_each_build_of_edgespecs_kernels_has_its_own_calibration(tmp_path, monkeypatch):
    """A verification's cost depends on the CPU kernels' build, so a cached curve is keyed by it:
    a new build of the kernels measures its own curve; the stock backend's key names none."""
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x")
    monkeypatch.setattr(calibrate, "qmatmul_loaded", lambda: False)
    stock = calibrate.calibration_key(f, calibrate.ModelParams(), 2, True)
    monkeypatch.setattr(calibrate, "qmatmul_loaded", lambda: True)
    keys = set()
    for build in ("1a2b3c4d", "5e6f7a8b"):
        monkeypatch.setattr(calibrate, "qmatmul_build", lambda build=build: build)
        key = calibrate.calibration_key(f, calibrate.ModelParams(), 2, True)
        assert f"-qmm{build}-" in key and key.replace(f"-qmm{build}", "") == stock
        keys.add(key)
    assert len(keys) == 2


def test_the_kernels_build_is_a_digest_of_the_loaded_backend():
    from edgespec.llama import backend

    build = backend.qmatmul_build()
    assert (build != "") is backend.qmatmul_loaded()
    assert len(build) in (0, 8) and all(c in "0123456789abcdef" for c in build)
