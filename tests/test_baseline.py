"""Fair baselines: the planner prices layouts against plain decoding at the same VRAM budget (the
target alone, as many layers on the GPU as the budget holds) and never chooses one expected
slower; a forced placement that is slower, or that splits a target the budget holds whole, is
noted; the bench's `plain` row is that best plain, run on its own load where the speculative
configurations' layout is another. And the bench keeps the drafter model for its `model`
configurations whatever `auto`'s calibration says.

Machines are described (an H200 host, a CPU-only one), so nothing depends on where the tests
run; models are read for their metadata only, none is loaded."""
from __future__ import annotations

import pytest
from conftest import DRAFTER, TARGET
from test_planner import GiB, MiB, X86, cpu_machine

from edgespec.bench.report import markdown
from edgespec.bench.runner import BenchSettings, load_plans, plain_config
from edgespec.bench.summary import IN_LAYOUT, OVERALL, PLAIN, Record, summarize
from edgespec.engine import EngineConfig
from edgespec.load import drafter as drafter_files
from edgespec.load import resolve
from edgespec.memory import planner
from edgespec.memory.speed import PassCosts, SpeedModel, read_bytes

pytestmark = pytest.mark.model_free

# The H200 machine the GPU results were measured on: 16 cores, ~125 GiB of RAM free, 139 GiB GPU.
H200 = planner.GPUDevice("CUDA0", "NVIDIA H200", "gpu", 139 * GiB, 140 * GiB)
H200_HOST = cpu_machine(ram_total=126 * GiB, ram_available=125 * GiB, physical_cores=16, logical_cores=16,
                        usable_cpus=16, cpu_features=X86, gpu_offload=True, gpus=(H200,))


@pytest.fixture(scope="module")
def pair(model_path):
    return (planner.estimate_model(model_path(TARGET), name=TARGET),
            planner.estimate_model(model_path(DRAFTER), name=DRAFTER))


def _plan(pair, vram, **kw) -> planner.Plan:
    t, d = pair
    return planner.make_plan(t, d, None, vram, None, machine_info=H200_HOST, threads=8, **kw)


# =============================================================================================
# The speed model
# =============================================================================================

def test_the_speed_model_prices_the_measured_h200_layouts(pair):
    """H200, real 1.5B + 0.5B, 8 threads: plain with the whole target on the GPU ran at 476-511
    tok/s; forced into `offload` at 1400 MiB (16 of 29 layers beside the drafter) plain ran at
    85.1 and speculation 1.69x that, 0.30x of the whole-GPU plain."""
    t, d = pair
    speed = SpeedModel(t, d, threads=8, op_offload_batch=2)
    whole, split = speed.plain(t.n_layer + 1), speed.plain(16)
    assert 400 < whole < 650
    assert 65 < split < 105
    spec = speed.speculative(16, "gpu", 63)
    assert 1.3 < spec / split < 2.5
    assert 0.2 < spec / whole < 0.45
    # A drafter beside the whole target on the GPU does not pay on open text: `auto` leaves it out.
    assert speed.speculative(t.n_layer + 1, "gpu", 63) == whole


def test_read_bytes_split_the_weights_as_llama_cpp_assigns_layers(pair):
    t, _ = pair
    total = sum(t.layer_bytes) + t.head_bytes + t.other_bytes
    for k in (0, 1, 16, t.n_layer + 1):
        gpu, cpu = read_bytes(t, k)
        assert gpu + cpu == total
    assert read_bytes(t, 0)[0] == 0 and read_bytes(t, 1)[0] == t.head_bytes
    assert read_bytes(t, t.n_layer + 1)[1] == t.other_bytes


# =============================================================================================
# The planner
# =============================================================================================

@pytest.mark.parametrize("vram_mib", [1400, 1500, 1600, 1700, 1800])
def test_the_planner_never_chooses_a_layout_slower_than_plain_at_the_budget(pair, vram_mib):
    """Between the target alone and target + drafter on the GPU, the memory ranking alone
    splits the target to make room for the drafter; priced, that is several times slower than
    the whole target on the GPU without it, so the planner keeps the whole target there."""
    t, _ = pair
    p = _plan(pair, vram_mib * MiB)
    assert p.plain_n_gpu_layers == t.n_layer + 1 and p.plain_placement == "gpu"
    assert p.expected_tokens_per_s >= p.plain_tokens_per_s * (1 - planner.BELOW_PLAIN)
    assert (p.placement, p.n_gpu_layers) == ("gpu", t.n_layer + 1) and p.plain_note is None
    ranked = _plan(pair, vram_mib * MiB, compare_plain=False)  # memory ranking only, as before
    if ranked.n_gpu_layers < t.n_layer + 1:
        assert ranked.drafter_placement == "gpu"


@pytest.fixture(scope="module")
def pair_7b(model_path, tmp_path_factory, pair):
    """A 7B-shaped Qwen2.5 target (the 1.5B's header, cloned; its data a sparse hole: the planner
    reads the header and the file's size) beside the real 0.5B drafter."""
    from test_clone import QWEN_7B

    from edgespec.files.clone import write_clone

    path = tmp_path_factory.mktemp("clone") / "qwen7b.gguf"
    result = write_clone(model_path(TARGET), path, QWEN_7B, header_only=True)
    with open(path, "r+b") as f:
        f.truncate(result.file_size + result.data_bytes)
    return planner.estimate_model(path, name="qwen7b"), pair[1]


def test_a_split_target_beside_the_drafter_stays_where_it_beats_plain(pair_7b):
    """The rule prices layouts; it does not ban them: a 7B with a third of its weights in VRAM
    beside the drafter verifies a draft for about one op-offloaded pass (replayed: 4.6-5.1x its
    own plain on Spec-Bench), well above plain decoding of the target alone with a few more
    layers in the same VRAM, whose CPU layers decode on the CPU."""
    t, d = pair_7b
    p = planner.make_plan(t, d, None, 2500 * MiB, None, machine_info=H200_HOST, threads=8)
    assert (p.placement, p.drafter_placement, p.plain_placement) == ("offload", "gpu", "offload")
    assert 0 < p.n_gpu_layers < p.plain_n_gpu_layers < t.n_layer + 1
    assert p.expected_tokens_per_s > 1.5 * p.plain_tokens_per_s and p.plain_note is None
    # With a CPU as fast as the link (fake curves) splitting for the drafter no longer pays.
    fast_cpu = PassCosts(cpu_s_per_byte=2e-3 / 1e9)
    q = planner.make_plan(t, d, None, 2500 * MiB, None, machine_info=H200_HOST, threads=8, pass_costs=fast_cpu)
    assert q.drafter_placement != "gpu" or q.n_gpu_layers == q.plain_n_gpu_layers
    assert q.expected_tokens_per_s >= q.plain_tokens_per_s * (1 - planner.BELOW_PLAIN)


def test_a_forced_split_of_a_target_the_budget_holds_whole_is_noted(pair):
    t, _ = pair
    p = _plan(pair, 1400 * MiB, placement="offload")
    assert p.placement == "offload" and p.n_gpu_layers < t.n_layer + 1  # forced: planned as asked
    assert "pointless" in p.plain_note and f"{t.n_layer + 1}/{t.n_layer + 1} layers" in p.plain_note
    assert p.expected_tokens_per_s < 0.5 * p.plain_tokens_per_s
    # Also without a drafter model: the split target alone is still slower than the whole one.
    alone = planner.make_plan(t, None, None, 1400 * MiB, None, machine_info=H200_HOST, placement="offload")
    assert "pointless" in alone.plain_note


@pytest.mark.parametrize("mode", ["draft-gpu", "cpu"])
def test_a_forced_placement_slower_than_plain_is_noted(pair, mode):
    p = _plan(pair, None, placement=mode)
    assert p.placement == mode and p.n_gpu_layers == 0
    assert "below plain" in p.plain_note and f"placement {mode}" in p.plain_note
    assert f"~{p.plain_tokens_per_s:.0f} tok/s" in p.plain_note


def test_forced_gpu_is_plain_layout_and_says_nothing(pair):
    p = _plan(pair, None, placement="gpu")
    assert p.plain_note is None and p.expected_tokens_per_s == pytest.approx(p.plain_tokens_per_s)


def test_no_comparison_without_a_gpu_or_in_exact_mode(pair):
    t, d = pair
    p = planner.make_plan(t, d, 8 * GiB, None, 4096, machine_info=cpu_machine())
    assert p.plain_tokens_per_s is None and p.plain_note is None and p.expected_tokens_per_s > 0
    exact = planner.make_plan(t, d, None, 1400 * MiB, None, machine_info=H200_HOST, cpu_target=True,
                              target_repack=False)
    assert exact.plain_tokens_per_s is None and exact.plain_note is None


def test_the_note_reaches_the_load_plan(store):
    """`plan` prints the LoadPlan's notes and `run` logs them."""
    cfg = EngineConfig(model=TARGET, draft="auto", placement="offload", vram_budget=1400 * MiB)
    lp = resolve(cfg, H200_HOST, store)
    assert any("pointless" in n for n in lp.notes) and lp.plan.plain_note in lp.plan.warnings
    chosen = resolve(EngineConfig(model=TARGET, draft="auto", vram_budget=1400 * MiB), H200_HOST, store)
    assert chosen.mode.name == "gpu" and not any("plain" in n for n in chosen.notes)


# =============================================================================================
# The bench's baseline
# =============================================================================================

def _settings(**kw) -> BenchSettings:
    return BenchSettings(EngineConfig(model=TARGET, **kw))


def test_bench_plain_is_the_best_plain_at_the_budget(store):
    """`--placement offload --vram-budget 1400MiB`: the speculative configurations share the
    split target, and plain is the target alone, whole on the GPU, on its own load."""
    t_layers = 29
    shared, alone = load_plans(_settings(placement="offload", vram_budget=1400 * MiB), ["plain", "auto"],
                               H200_HOST, store)
    assert shared.mode.name == "offload" and shared.model.n_gpu_layers < t_layers
    assert alone is not None and alone.draft is None and alone.mode.name == "gpu"
    assert alone.model.n_gpu_layers == t_layers and alone.config.vram_budget == 1400 * MiB
    # A drafter placement without a budget: plain gets the free VRAM, as the run did.
    shared, alone = load_plans(_settings(placement="draft-gpu"), ["plain", "suffix"], H200_HOST, store)
    assert shared.model.n_gpu_layers == 0 and alone.model.n_gpu_layers == t_layers
    # The whole target in the speculative layout already: one load, plain in it.
    shared, alone = load_plans(_settings(placement="gpu"), ["plain", "suffix"], H200_HOST, store)
    assert alone is None and shared.model.n_gpu_layers == t_layers
    # Nothing planned, or a CPU-only machine: plain in the same load, as ever.
    assert load_plans(_settings(), ["plain", "suffix"], H200_HOST, store)[1] is None
    assert load_plans(_settings(ram_budget=8 * GiB), ["plain", "suffix"], cpu_machine(), store)[1] is None


def test_plain_config_keeps_gpu_and_cpu_and_drops_drafter_placements():
    m = H200_HOST
    assert plain_config(EngineConfig(), m) is None
    for forced, kept in (("offload", None), ("draft-gpu", None), ("overlap", None), ("gpu", "gpu"), ("cpu", "cpu")):
        c = plain_config(EngineConfig(placement=forced, vram_budget=GiB), m)
        assert c.placement == kept and c.draft is None and c.vram_budget == GiB and c.planned


def test_ratios_are_over_the_best_plain_and_in_layout_is_secondary():
    def rec(cfg, tokens, secs):
        return Record(id="1", category="c", config=cfg, new_tokens=tokens, gen_s=secs, prefill_s=0.0, steps=tokens,
                      drafted=0, accepted=0, peak_rss_bytes=0, text="")
    records = [rec(PLAIN, 500, 1.0), rec(IN_LAYOUT, 85, 1.0), rec("auto", 144, 1.0)]
    s = summarize(records)
    assert list(s)[0] == PLAIN
    auto = s["auto"][OVERALL]
    assert auto["speedup"] == pytest.approx(144 / 500) and auto["speedup_in_layout"] == pytest.approx(144 / 85)
    assert s[IN_LAYOUT][OVERALL]["speedup"] == pytest.approx(85 / 500)
    assert summarize([rec(PLAIN, 10, 1.0), rec("auto", 20, 1.0)])["auto"][OVERALL]["speedup_in_layout"] is None
    settings = {"baseline": {"config": PLAIN, "separate_load": True, "in_layout": IN_LAYOUT, "placement": "gpu",
                             "n_gpu_layers": 29, "layout_n_gpu_layers": 16}}
    machine = {"cpu": "x", "physical_cores": 1, "threads": 1, "llama_cpp_python": "v", "edgespec": "v"}
    md = markdown({"machine": machine, "settings": settings, "records": [r.to_dict() for r in records]}, "t", "cmd")
    assert "the target alone with 29 target layers on the GPU" in md and "Secondary" in md


# =============================================================================================
# The `model` configuration beside `auto` on a GPU
# =============================================================================================

def test_bench_keeps_the_drafter_model_where_auto_calibrated_it_out(store, monkeypatch):
    """`bench --placement gpu --configs plain,suffix,model,auto` on an H200: the shared target is
    planned for `auto`, whose calibration there (a 2 ms target step, a 1.3 ms drafted token)
    says the drafter cannot pay, which left the drafter model out of the shared plan, and
    `model` was then skipped as "does not fit the RAM budget" on a host with 125 GiB free. The
    bench keeps it for `model` (`auto` still decides per step); `run --draft auto` leaves it out."""
    monkeypatch.setattr(drafter_files, "auto_skips_drafter",
                        lambda *a: "auto: the drafter model is not loaded: calibrated here, it cannot pay")
    configs = ["plain", "suffix", "model", "auto"]
    shared, alone = load_plans(_settings(placement="gpu"), configs, H200_HOST, store)
    assert shared.model_drafter_allowed and shared.plan.drafter_placement == "gpu" and alone is None
    run = resolve(EngineConfig(model=TARGET, draft="auto", placement="gpu"), H200_HOST, store)
    assert not run.model_drafter_allowed and any("cannot pay" in n for n in run.notes)
    # Without a `model` configuration the bench plans as `run` does.
    shared, _ = load_plans(_settings(placement="gpu"), ["plain", "auto"], H200_HOST, store)
    assert not shared.model_drafter_allowed
