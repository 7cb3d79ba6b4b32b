"""Placement modes: the planner chooses gpu / offload / draft-gpu / cpu from described devices,
`--placement` forces one, and what each tells llama.cpp (no_host, op_offload) follows the mode.

Machines are described (a CUDA build with one GPU, a Jetson-like unified-memory board, a
CPU-only build) so the plans do not depend on where the tests run; the engine test loads a real
model on this machine."""
from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import DRAFTER, SMALL, TARGET
from test_planner import GiB, MiB, cpu_machine, gpu_machine

import edgespec.llama
from edgespec.engine import Engine, EngineConfig
from edgespec.errors import BudgetExceeded, InvalidRequest
from edgespec.llama.kernels import (
    OP_OFFLOAD_ENV,
    OP_OFFLOAD_MIN_BATCH,
    op_offload_min_batch,
)
from edgespec.memory import placements, planner
from edgespec.memory import candidates
from edgespec.memory.machine import _is_unified


@pytest.fixture(scope="module")
def pair(model_path):
    return (planner.estimate_model(model_path(TARGET), name=TARGET),
            planner.estimate_model(model_path(DRAFTER), name=DRAFTER))


def _plan(pair, vram: int, **kw) -> planner.Plan:
    t, d = pair
    return planner.make_plan(t, d, 8 * GiB, vram, 4096, machine_info=gpu_machine(16 * GiB), **kw)


def test_vram_decides_the_mode(pair):
    t, _ = pair
    whole = _plan(pair, 16 * GiB)
    assert (whole.placement, whole.n_gpu_layers, whole.drafter_placement) == ("gpu", t.n_layer + 1, "gpu")
    # Below the pair's size the whole target alone outruns any split beside the drafter
    # (planner's speed model; measured on an H200: 476 tok/s against 0.30x of that).
    alone = _plan(pair, 1500 * MiB)
    assert (alone.placement, alone.n_gpu_layers, alone.drafter_placement) == ("gpu", t.n_layer + 1, "none")
    split = _plan(pair, 1500 * MiB, placement="offload")
    assert split.placement == "offload" and 0 < split.n_gpu_layers <= t.n_layer
    assert split.drafter_placement == "gpu" and split.vram_bytes <= 1500 * MiB
    # A split target keeps its CPU weights in pinned host buffers, which op offload streams to
    # the GPU for large batches; they are not repacked.
    assert split.op_offload and not split.no_host and not split.repack
    drafter_only = _plan(pair, 800 * MiB, placement="draft-gpu")
    assert (drafter_only.placement, drafter_only.n_gpu_layers, drafter_only.drafter_placement) == \
        ("draft-gpu", 0, "gpu")
    # The target verified on the CPU: repacked weights, no batch shipped to the GPU.
    assert drafter_only.no_host and not drafter_only.op_offload and drafter_only.repack
    none = _plan(pair, 0)
    assert (none.placement, none.n_gpu_layers, none.drafter_placement) == ("cpu", 0, "cpu")
    assert [d.name for d in split.decisions][:4] == ["ram_budget", "vram_budget", "placement", "n_gpu_layers"]


def test_a_split_target_reads_its_cpu_weights_into_pinned_host_buffers(pair, monkeypatch):
    split = _plan(pair, 1500 * MiB, placement="offload")
    load = next(d for d in split.decisions if d.name == "load")
    assert split.placement == "offload" and not split.use_mmap
    assert load.value == "pinned host buffers (no mmap)" and "op offload" in load.why
    assert f"{op_offload_min_batch()}+ tokens" in load.why
    # Pinned or mapped with every page resident, the weights take the same RAM; a forced
    # mapping is planned as asked, with a warning.
    mapped = _plan(pair, 1500 * MiB, mmap=True, placement="offload")
    assert mapped.use_mmap and mapped.n_gpu_layers == split.n_gpu_layers
    assert mapped.ram_bytes == split.ram_bytes
    assert any("pageable" in w for w in mapped.warnings) and not any("pageable" in w for w in split.warnings)
    # Only a split target is pinned: wholly on the GPU it maps its file, on the CPU it is
    # read into repacked buffers, and a unified-memory board has no copy to speed up.
    assert _plan(pair, 16 * GiB).use_mmap
    cpu_target = next(d for d in _plan(pair, 800 * MiB, placement="draft-gpu").decisions if d.name == "load")
    assert "pinned" not in cpu_target.value
    t, d = pair
    board = gpu_machine(2 * GiB, unified=True, ram_total=8 * GiB, ram_available=6 * GiB)
    on_board = planner.make_plan(t, d, None, None, 4096, machine_info=board, placement="offload")
    assert 0 < on_board.n_gpu_layers <= t.n_layer and on_board.use_mmap
    # Measured on CUDA only, and not where CUDA is told not to pin.
    other = gpu_machine(16 * GiB)
    other = replace(other, gpus=(replace(other.gpus[0], name="Vulkan0"),))
    assert planner.make_plan(t, d, 8 * GiB, 1500 * MiB, 4096, machine_info=other).use_mmap
    monkeypatch.setenv("GGML_CUDA_NO_PINNED", "1")
    assert _plan(pair, 1500 * MiB).use_mmap


def test_a_target_loaded_as_asked_follows_the_planners_rules():
    # (op_offload, use_mmap) for n_gpu_layers of a 28-block model
    gpu, board = gpu_machine(16 * GiB), gpu_machine(6 * GiB, unified=True)
    assert placements.unplanned_target(0, 28, gpu, True) == (False, True)  # on the CPU: no batch leaves it
    assert placements.unplanned_target(10, 28, gpu, True) == (True, False)  # split: pinned
    assert placements.unplanned_target(99, 28, gpu, True) == (True, True)  # wholly on the GPU
    assert placements.unplanned_target(-1, 28, gpu, True) == (True, True)  # every layer the build can
    assert placements.unplanned_target(10, 28, cpu_machine(), True)[1]  # a CPU build maps
    assert placements.unplanned_target(10, 28, board, True) == (True, True)  # unified memory maps


def test_the_op_offload_threshold_is_read_as_llama_cpp_reads_it(monkeypatch):
    monkeypatch.delenv(OP_OFFLOAD_ENV, raising=False)
    assert op_offload_min_batch() == 32  # llama.cpp's default when unset
    for value, read in (("2", 2), (" 16", 16), ("8x", 8), ("x", 0), ("", 0)):
        monkeypatch.setenv(OP_OFFLOAD_ENV, value)
        assert op_offload_min_batch() == read, value


def test_edgespec_sets_the_op_offload_threshold_unless_the_user_did():
    """Set by `import edgespec`, before llama_cpp is imported (its CUDA backend reads it once);
    native peers get llama.cpp's own unless the user set one."""
    import os
    import subprocess
    import sys

    code = ("import sys, edgespec, os; from edgespec.bench.peers import _native_env; "
            f"print(os.environ['{OP_OFFLOAD_ENV}'], _native_env().get('{OP_OFFLOAD_ENV}'))")
    env = {k: v for k, v in os.environ.items() if k != OP_OFFLOAD_ENV}
    for given, ours, peers in ((None, str(OP_OFFLOAD_MIN_BATCH), "None"), ("", str(OP_OFFLOAD_MIN_BATCH), "None"),
                               ("64", "64", "64")):
        run_env = env if given is None else {**env, OP_OFFLOAD_ENV: given}
        out = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True, text=True, check=True)
        assert out.stdout.split() == [ours, peers], given
    from pathlib import Path

    source = (Path(edgespec.llama.__file__).parent / "__init__.py").read_text()
    assert source.index("set_op_offload_min_batch()") < source.index("import llama_cpp")


@pytest.fixture(scope="module")
def pair_7b(model_path, tmp_path_factory, pair):
    """A 7B-shaped Qwen2.5 target (the 1.5B's header, cloned) beside the real 0.5B drafter: its
    tensor data a sparse hole, since the planner reads only the header and the file's size."""
    from test_clone import QWEN_7B

    from edgespec.files.clone import write_clone

    path = tmp_path_factory.mktemp("clone") / "qwen7b.gguf"
    result = write_clone(model_path(TARGET), path, QWEN_7B, header_only=True)
    with open(path, "r+b") as f:
        f.truncate(result.file_size + result.data_bytes)
    return planner.estimate_model(path, name="qwen7b"), pair[1]


def test_drafts_default_to_long_trees_where_the_drafter_is_on_a_gpu(pair, pair_7b):
    """placements.draft_shape: the GPU placements draft up to 63 tokens and may draft trees,
    the cpu placement 32-token chains; what is asked is kept; the longer shape costs nothing:
    a 7B offloaded with a third of its weights in VRAM holds as many layers beside a tree
    drafter as beside a chain drafter (their contexts are one), and a longer shape that would
    cost anything is refused."""
    for vram, name in ((16 * GiB, "gpu"), (800 * MiB, "draft-gpu"), (0, "cpu")):
        p = _plan(pair, vram, **({"placement": name} if name == "draft-gpu" else {}))
        want = placements.TREES if name != "cpu" else placements.CHAINS
        assert (p.placement, p.draft_max, p.draft_tree, p.n_seq_max) == (name, want.draft_max, want.tree,
                                                                         1 + want.draft_max)
        assert f"up to {want.draft_max} tokens" in next(d.value for d in p.decisions if d.name == "drafts")
    assert _plan(pair, 16 * GiB, placement="overlap").draft_max == 32
    assert not placements.MODES["overlap"].long_drafts(True)
    assert _plan(pair, 16 * GiB, long_drafts=False).draft_max == 32  # kinds other than auto: chains
    asked = _plan(pair, 16 * GiB, draft_max=16, draft_tree=False)
    assert (asked.placement, asked.draft_max, asked.draft_tree) == ("gpu", 16, False)

    t, d = pair_7b
    third = t.file_size // 3 + 256 * MiB
    kw = {"machine_info": gpu_machine(80 * GiB)}
    trees = planner.make_plan(t, d, 32 * GiB, third, 4096, **kw)
    chains = planner.make_plan(t, d, 32 * GiB, third, 4096, draft_max=32, draft_tree=False, **kw)
    assert (trees.placement, trees.drafter_placement, trees.draft_max, trees.draft_tree) == ("offload", "gpu", 63, True)
    assert (chains.placement, chains.drafter_placement) == ("offload", "gpu")
    assert chains.n_gpu_layers == trees.n_gpu_layers == 4
    assert trees.vram_bytes <= third and trees.n_seq_max == 64

    # Under a tight RAM budget the longer shape (64 target rows of logits) would cost settings: chains stay.
    # (500 MiB for the models, beside the CUDA runtime's host memory with two contexts.)
    runtime = candidates.GPU_HOST_RUNTIME_BYTES + 2 * candidates.GPU_HOST_PER_CONTEXT_BYTES
    tight = planner.make_plan(*pair, 500 * MiB + runtime, 16 * GiB, 4096, machine_info=gpu_machine(16 * GiB),
                              placement="gpu")
    assert (tight.placement, tight.drafter_placement, tight.draft_max, tight.draft_tree) == ("gpu", "gpu", 32, False)
    assert "trees would cost n ubatch 128 instead of 512, suffix cap" in next(x.why for x in tight.decisions if x.name == "drafts")
    # A CPU target with no drafter model on the GPU verifies 64 rows at ~20 one-row steps: chains.
    assert placements.draft_shape("draft-gpu", None, None, drafter_on_gpu=False) == placements.CHAINS


def test_forced_modes_place_as_named(pair):
    t, _ = pair
    for name in placements.NAMES:
        p = _plan(pair, 16 * GiB, placement=name)
        assert p.placement == name, name
        assert "forced" in next(d.why for d in p.decisions if d.name == "placement")
    assert _plan(pair, 16 * GiB, placement="offload").n_gpu_layers <= t.n_layer  # a block stays on the CPU
    assert _plan(pair, 16 * GiB, placement="cpu").vram_bytes == 0


def test_a_forced_mode_over_the_vram_budget_is_refused_in_one_line(pair):
    with pytest.raises(BudgetExceeded) as e:
        _plan(pair, 900 * MiB, placement="gpu")
    msg = str(e.value)
    assert "\n" not in msg and "placement gpu" in msg and "VRAM" in msg and "--vram-budget" in msg
    with pytest.raises(BudgetExceeded, match="not one target layer"):
        _plan(pair, 300 * MiB, placement="offload")


def test_gpu_modes_on_a_cpu_build_are_refused_and_cpu_is_not(pair):
    t, d = pair
    for name in ("gpu", "offload", "draft-gpu", "overlap"):
        with pytest.raises(placements.PlacementUnavailable, match="CPU-only"):
            planner.make_plan(t, d, 8 * GiB, None, 4096, machine_info=cpu_machine(), placement=name)
    p = planner.make_plan(t, d, 8 * GiB, None, 4096, machine_info=cpu_machine(), placement="cpu")
    assert p.placement == "cpu" and not p.no_host and not p.op_offload  # nothing to bypass on a CPU build
    assert placements.unavailable(cpu_machine()).keys() == {"gpu", "offload", "draft-gpu", "overlap"}
    assert placements.unavailable(gpu_machine(GiB)) == {}
    with pytest.raises(InvalidRequest, match="unknown placement"):
        placements.mode("npu")


def test_unified_memory_is_one_pool(pair):
    t, d = pair
    board = gpu_machine(6 * GiB, unified=True, ram_total=8 * GiB, ram_available=6 * GiB)
    p = planner.make_plan(t, d, None, None, 4096, machine_info=board)
    assert p.placement == "gpu" and p.vram_budget == p.ram_budget  # available RAM bounds both
    assert p.ram_bytes >= p.vram_bytes  # GPU allocations come out of RAM
    with pytest.raises(BudgetExceeded):
        planner.make_plan(t, d, 1200 * MiB, None, 4096, machine_info=board, placement="gpu")


def test_unified_memory_is_recognised_from_the_device():
    assert _is_unified([{"type": "igpu", "memory_total": GiB}], 64 * GiB)
    # A CUDA device reporting the board's RAM as its memory (Jetson Orin: 7.4 of 7.6 GiB).
    assert _is_unified([{"type": "gpu", "memory_total": int(7.4 * GiB)}], int(7.6 * GiB))
    assert not _is_unified([{"type": "gpu", "memory_total": 80 * GiB}], 128 * GiB)


def test_engine_refuses_a_gpu_placement_on_this_cpu_build_before_loading():
    with pytest.raises(placements.PlacementUnavailable, match="needs a GPU"):
        Engine(EngineConfig(model=SMALL, n_ctx=256, placement="gpu"))
    with pytest.raises(InvalidRequest, match="unknown placement"):
        EngineConfig(model=SMALL, placement="tpu")


def test_engine_in_the_cpu_placement_loads_what_the_plan_says(model_path):
    with Engine(EngineConfig(model=SMALL, n_ctx=256, placement="cpu", draft="suffix")) as engine:
        plan = engine.load_plan.plan
        assert plan.placement == "cpu" and plan.n_gpu_layers == 0
        assert engine.model.params.no_host == plan.no_host
        assert engine.ctx.params.op_offload == plan.op_offload
        # logits rows for the largest verification (64 drafted), not llama.cpp's n_batch (512)
        assert engine.ctx.n_outputs_max == placements.VERIFY_ROWS == 65
        assert engine.generate("Hello", max_tokens=4).stats.generated_tokens == 4


def test_engine_and_bench_build_the_drafter_where_the_plan_put_it(model_path, store):
    """One rule (LoadPlan.draft_config) for the engine and the bench: the drafter model loads
    with the plan's parameters, not llama.cpp's defaults."""
    from edgespec.bench.runner import BenchSettings, _Runners
    from edgespec.load import resolve

    model_path(DRAFTER)
    config = EngineConfig(model=str(model_path(TARGET)), n_ctx=1024, draft="model", draft_max=8, draft_tree=False,
                          n_seq_max=9, ram_budget=8 * GiB, placement="cpu")
    p = resolve(config, planner.machine(), store)
    cfg = p.draft_config()
    assert cfg.model_params == p.drafter.model_params is not None and cfg.allow_model
    assert cfg.suffix_history_tokens == p.drafter.suffix_cap_tokens

    class _PlannedEngine:  # what _Runners reads of an engine
        load_plan = p
        ctx = type("Ctx", (), {"n_ctx": 1024})()
    assert _Runners(_PlannedEngine(), BenchSettings())._draft_config("model").model_params == p.drafter.model_params


def test_overlap_is_draft_gpu_with_drafting_ahead_and_only_when_asked(pair):
    t, d = pair
    m = gpu_machine(8 * GiB)
    forced = planner.make_plan(t, d, 8 * GiB, 8 * GiB, 4096, machine_info=m, placement="overlap")
    dovetail = planner.make_plan(t, d, 8 * GiB, 8 * GiB, 4096, machine_info=m, placement="draft-gpu")
    assert forced.placement == "overlap" and placements.MODES["overlap"].overlap
    assert (forced.n_gpu_layers, forced.drafter_placement, forced.no_host, forced.op_offload) == \
        (dovetail.n_gpu_layers, dovetail.drafter_placement, dovetail.no_host, dovetail.op_offload)
    assert planner.make_plan(t, d, 8 * GiB, 8 * GiB, 4096, machine_info=m).placement != "overlap"


def test_a_drafter_wholly_on_the_cpu_never_ships_its_batches_to_the_gpu(model_path):
    """With edgespec's op offload threshold of 2 tokens a GPU build would otherwise copy a CPU
    drafter's weights to the GPU for every tree round of 2+ nodes."""
    from edgespec.drafters.model import ModelDrafter
    from edgespec.llama.backend import LlamaModel, ModelParams

    drafter = ModelDrafter(LlamaModel(model_path(SMALL), ModelParams(n_gpu_layers=0)), n_ctx=256, owns_model=True)
    try:
        assert drafter.ctx.params.op_offload is False
    finally:
        drafter.close()


def test_only_a_drafted_target_wholly_on_the_gpu_of_a_patched_build_keeps_graphs_by_size(monkeypatch):
    from edgespec.memory import placements as pl
    monkeypatch.setattr(pl, "OUTPUT_ARGMAX", True)
    assert pl.graph_sizes(29, 28, 33, True) == pl.graph_sizes(-1, 28, 33, True) == (1, 2, 3, 5, 9, 17, 25, 33)
    assert pl.graph_sizes(29, 28, 30, True) == (1, 2, 3, 5, 9, 17, 25, 33)  # up to the size that holds 30
    assert pl.graph_sizes(29, 28, 65, True) == pl.GRAPH_SIZES
    assert pl.graph_sizes(28, 28, 33, True) == ()  # the output layer stays on the CPU: a split target
    assert pl.graph_sizes(29, 28, 1, True) == ()   # plain decoding keeps one size
    assert pl.graph_sizes(-1, 28, 33, False) == ()  # a CPU build
    monkeypatch.setattr(pl, "OUTPUT_ARGMAX", False)
    assert pl.graph_sizes(29, 28, 33, True) == ()  # a stock build keeps no graphs to pad for
