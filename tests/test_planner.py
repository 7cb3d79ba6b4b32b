"""The memory planner: estimates against llama.cpp's own numbers and a real load, and its choices.

Loads are kept few (2 shared cores): SmolLM2-135M, Gemma-3-270M and the 0.5B drafter for
llama.cpp's reported buffer sizes, and the 1.5B target once for reported sizes and resident
memory together.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import DRAFTER, GEMMA, SMALL, TARGET

from edgespec.llama import backend, probe
from edgespec.memory import planner
from edgespec.memory import candidates
from edgespec.memory.placements import VERIFY_ROWS
from edgespec.units import parse_bytes
from edgespec.errors import BudgetExceeded, InvalidRequest

EDGESPEC = str(Path(sys.executable).with_name("edgespec"))
MiB = 1 << 20
GiB = 1 << 30
X86 = frozenset({"AVX", "AVX2", "AVX512", "FMA", "F16C", "REPACK"})


def within(estimate: float, actual: float, tol: float = 0.10) -> bool:
    return abs(estimate - actual) <= tol * actual


def cpu_machine(**kw) -> planner.MachineInfo:
    """A fixed CPU-only machine so that plans do not depend on where the tests run."""
    base = {"ram_total": 16 * GiB, "ram_available": 12 * GiB, "physical_cores": 4, "logical_cores": 8,
            "usable_cpus": 8, "cpu_features": X86, "gpu_offload": False, "gpus": (), "unified_memory": False,
            "mmap_supported": True, "mlock_supported": True, "memlock_limit": None, "privileged": False}
    base.update(kw)
    return planner.MachineInfo(**base)


def gpu_machine(free: int, unified: bool = False, **kw) -> planner.MachineInfo:
    gpu = planner.GPUDevice("CUDA0", "test GPU", "igpu" if unified else "gpu", free, free + GiB)
    return cpu_machine(gpu_offload=True, gpus=(gpu,), unified_memory=unified, **kw)


# Apple silicon as llama.cpp reports it: one pool, a backend whose host memory no one has measured
METAL = cpu_machine(gpu_offload=True, unified_memory=True,
                    gpus=(planner.GPUDevice("Metal", "Apple M2", "gpu", 12 * GiB, 16 * GiB),))


@pytest.fixture(scope="module")
def fp(model_path):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = planner.estimate_model(model_path(name), name=name)
        return cache[name]
    return get


# =============================================================================================
# Model footprints from GGUF metadata
# =============================================================================================

def test_model_footprint_of_the_target(fp):
    t = fp(TARGET)
    assert (t.n_layer, t.n_embd, t.n_ff, t.n_head, t.n_head_kv, t.n_vocab) == (28, 1536, 8960, 12, 2, 151936)
    assert t.n_ctx_train == 32768 and not t.tied_output
    assert t.weights_bytes == t.embd_bytes + t.output_bytes + t.other_bytes + sum(t.layer_bytes)
    assert len(t.layer_bytes) == 28 and min(t.layer_bytes) > 0
    assert t.kv_bytes_per_token_layer()["f16"] == 2 * 2 * 128 * 2  # K and V, 2 heads of 128, 2 bytes
    per = t.kv_bytes_per_token_layer()
    assert per["q8_0"] == per["f16"] * 34 / 64 and per["q4_0"] == per["f16"] * 18 / 64
    # The weights llama.cpp repacks for AVX2 kernels (measured: CPU_REPACK 596.53 MiB).
    assert round(t.repack_bytes(X86) / MiB, 2) == 596.53
    assert t.repack_bytes(frozenset({"AVX2"})) == 0  # a build without REPACK


def test_footprint_of_a_tied_sliding_window_model(fp):
    g = fp(GEMMA)
    assert g.tied_output and g.head_bytes == g.embd_bytes and g.n_swa == 512
    assert (g.head_dim_k, g.head_dim_v) == (256, 256)  # key_length, not n_embd / n_head (160)


def test_estimate_model_of_a_tiny_file_and_of_one_without_block_count(tmp_path):
    from gguf_corpus import valid_spec

    f = planner.estimate_model(write_spec(tmp_path / "ok.gguf", valid_spec()))
    assert (f.n_layer, f.n_embd, f.n_head_kv, f.n_vocab, f.n_ctx_train) == (1, 32, 2, 8, 256)
    assert f.kv_bytes_per_token("f16") == 2 * 2 * 8 * 2  # 2 kv heads of 32 / 4 dims, K and V, f16
    spec = valid_spec()
    spec.kvs = [kv for kv in spec.kvs if kv.key != "llama.block_count"]
    with pytest.raises(InvalidRequest, match="block_count"):
        planner.estimate_model(write_spec(tmp_path / "bad.gguf", spec))


def write_spec(path, spec):
    from gguf_corpus import serialize

    path.write_bytes(serialize(spec)[0])
    return path


# =============================================================================================
# Context footprints: llama.cpp's reported sizes (recorded, then live)
# =============================================================================================

# (model, n_ctx, n_ubatch, n_outputs_max, flash_attn) -> llama.cpp's "CPU compute buffer size"
# in MiB, as llama-cpp-python 0.3.36 logged them on an AVX512 CPU (kv_unified, n_seq_max 1).
RECORDED_COMPUTE = [
    (TARGET, 2048, 512, 512, True, 302.75), (TARGET, 2048, 128, 512, True, 75.69),
    (TARGET, 2048, 256, 512, True, 151.38), (TARGET, 2048, 512, 1, True, 66.51),
    (TARGET, 2048, 64, 1, True, 8.31), (TARGET, 2048, 128, 65, True, 39.19),
    (TARGET, 2048, 256, 65, True, 39.94), (TARGET, 4097, 512, 1, True, 68.76),
    (TARGET, 300, 512, 1, True, 38.09), (TARGET, 8192, 512, 1, False, 224.01),
    (TARGET, 16384, 512, 512, False, 432.01), (TARGET, 16384, 64, 65, False, 54.0),
    (DRAFTER, 2048, 512, 1, True, 37.51), (DRAFTER, 2048, 256, 65, True, 40.87),
    (DRAFTER, 2048, 512, 512, True, 300.25), (DRAFTER, 16384, 512, 1, False, 489.26),
    (SMALL, 2048, 512, 1, True, 15.51), (SMALL, 2048, 64, 65, True, 12.81),
    (SMALL, 4097, 512, 1, True, 17.76), (SMALL, 8192, 512, 1, False, 166.38),
    (GEMMA, 2048, 512, 1, True, 21.77), (GEMMA, 8192, 512, 1, True, 33.77), (GEMMA, 2048, 512, 512, True, 514.5),
]


@pytest.mark.parametrize("name,n_ctx,ub,out_max,fa,mib", RECORDED_COMPUTE)
def test_compute_buffer_formula_matches_recorded_llama_cpp_sizes(fp, name, n_ctx, ub, out_max, fa, mib):
    c = planner.estimate_context(fp(name), n_ctx, ub, flash_attn=fa, n_outputs_max=out_max)
    assert within(c.compute_reserved / MiB, mib), (c.compute_reserved / MiB, mib)


def _check_reported(fp_, c: planner.ContextFootprint, rep: dict[str, int], mapped: int | None, repack: int):
    assert within(c.kv_bytes, rep["CPU KV"], 0.01), (c.kv_bytes, rep)
    assert within(c.compute_reserved, rep["CPU compute"]), (c.compute_reserved, rep)
    assert within(c.output_reported, rep["CPU output"]), (c.output_reported, rep)
    if mapped is not None:
        assert within(mapped, rep["CPU_Mapped model"], 0.01)
    assert within(repack, rep.get("CPU_REPACK model", 0), 0.01) or repack == rep.get("CPU_REPACK model", 0)


@pytest.mark.parametrize("name,n_ctx,ub,n_seq,kv", [
    (SMALL, 2048, 512, 1, "f16"),
    (SMALL, 4096, 128, 17, "q8_0"),
    (SMALL, 1000, 256, 1, "q4_0"),
    (GEMMA, 2048, 512, 17, "f16"),        # sliding-window layers, tied output, key_length 256
    (DRAFTER, 4096, 256, 17, "q8_0"),    # repacks 28 MiB of its weights on x86
])
def test_estimates_match_what_llama_cpp_reports(model_path, fp, name, n_ctx, ub, n_seq, kv):
    rep = probe.probe_context_buffers(model_path(name), n_ctx, n_ubatch=ub, n_seq_max=n_seq, kv_type=kv,
                                        flash_attn=True)
    f = fp(name)
    c = planner.estimate_context(f, n_ctx, ub, n_seq, kv, True)
    feats = planner.machine().cpu_features
    _check_reported(f, c, rep, f.weights_bytes, f.repack_bytes(feats))


def test_quantized_kv_needs_flash_attention(model_path, fp):
    with pytest.raises(InvalidRequest, match="flash attention"):
        planner.estimate_context(fp(SMALL), 2048, kv_type="q8_0", flash_attn=False)
    with pytest.raises(backend.BackendError):  # and llama.cpp indeed refuses it
        probe.probe_context_buffers(model_path(SMALL), 2048, kv_type="q8_0", flash_attn=False)


# =============================================================================================
# Resident memory of real loads
# =============================================================================================

_LOAD_SCRIPT = r"""
import gc, json, sys
import psutil
from edgespec.llama import backend, probe
from edgespec.memory.placements import VERIFY_ROWS
path, n_ctx, n_ubatch, n_seq, prefill, verify, mmap, fa, repack = sys.argv[1], *map(int, sys.argv[2:])
backend.ensure_initialized()
proc = psutil.Process()
gc.collect()
before = proc.memory_info().rss
with probe.capture_llama_log() as cap:
    model = backend.LlamaModel(path, backend.ModelParams(use_mmap=bool(mmap), repack=bool(repack)))
    ctx = backend.LlamaContext(model, backend.ContextParams(n_ctx=n_ctx, n_batch=512, n_ubatch=n_ubatch,
                                                            n_seq_max=n_seq, n_threads=2, n_outputs_max=VERIFY_ROWS,
                                                            flash_attn=bool(fa)))
for s in range(0, prefill, 512):
    n = min(512, prefill - s)
    ctx.decode_rows([100 + (s + i) % 1000 for i in range(n)], list(range(s, s + n)), [[0]] * n,
                    [False] * (n - 1) + [True])
ctx.decode_rows([5] * verify, list(range(prefill, prefill + verify)), [[0]] * verify, [True] * verify)
gc.collect()
print(json.dumps({"rss": proc.memory_info().rss - before, "reported": probe.reported_buffers(cap.lines)}))
"""


def _real_load(path, n_ctx: int, n_ubatch: int, n_seq: int, prefill: int, verify: int,
               mmap: bool = True, flash_attn: bool = False, repack: bool = True) -> dict:
    """RSS growth of loading a model the engine's way (LlamaModel, LlamaContext), prefilling one
    micro-batch and verifying ``verify`` rows (placements.VERIFY_ROWS allowed), in a fresh process:
    a process that loaded and freed models before keeps their freed heap and would under-count."""
    r = subprocess.run([sys.executable, "-c", _LOAD_SCRIPT, str(path), str(n_ctx), str(n_ubatch), str(n_seq),
                        str(prefill), str(verify), str(int(mmap)), str(int(flash_attn)), str(int(repack))], check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _plan_same_config(f, n_ctx, n_ubatch, draft_max, mmap=True):
    """The plan for exactly what _real_load does with its default (repacked) load."""
    # this host's CPU (its repacking) without its GPUs: _real_load keeps every layer on the CPU
    host_cpu = replace(planner.machine(), gpu_offload=False, gpus=(), unified_memory=False)
    p = planner.make_plan(f, None, 64 * GiB, None, n_ctx, machine_info=host_cpu, suffix=True,
                          draft_max=draft_max, kv_type="f16", n_ubatch=n_ubatch, mmap=mmap, repack=True)
    est = sum(x.bytes for x in p.parts if x.where == "RAM" and x.component.startswith("target"))
    return p, est


def test_resident_memory_of_a_small_model_matches_the_plan(model_path, fp):
    f = fp(SMALL)
    p, est = _plan_same_config(f, 512, 512, 16)
    # The plan is the worst case over the whole context (without flash attention the attention
    # scores grow with the cells in use), so the load fills the context before measuring (one
    # 495-token micro-batch: SmolLM2 evaluates ~90 tokens/s on one thread here).
    got = _real_load(model_path(SMALL), 512, 512, p.n_seq_max, 512 - 17, 17, flash_attn=p.flash_attn)
    assert within(est, got["rss"]), (est / MiB, got["rss"] / MiB)


def test_resident_memory_of_a_full_load_matches_the_plan(model_path, fp):
    """No mmap: the repacked tensors are read once, straight into the repacked buffer."""
    f = fp(DRAFTER)
    p, est = _plan_same_config(f, 2048, 256, 16, mmap=False)
    # (with qmatmul in the CPU backend nothing of the 0.5B is repacked: it takes Q4_K as stored)
    assert not p.use_mmap and p.repack == (f.repack_bytes(planner.machine().cpu_features) > 0)
    got = _real_load(model_path(DRAFTER), 2048, 256, p.n_seq_max, 256, 17, mmap=False, flash_attn=p.flash_attn)
    assert within(est, got["rss"]), (est / MiB, got["rss"] / MiB)
    rep = got["reported"]
    assert within(f.weights_bytes - f.repack_bytes(planner.machine().cpu_features), rep["CPU model"], 0.01)


def test_a_drafter_planned_without_repacking_is_loaded_without_it(model_path, fp):
    """A plan that drops repacking counts no repacked copy of the CPU drafter, and the drafter is
    loaded that way (mapped, not repacked), not with llama.cpp's default."""
    from edgespec.load.drafter import drafter_model_params

    t, dr = fp(TARGET), fp(DRAFTER)
    p = planner.make_plan(t, dr, 64 * GiB, None, 2048, machine_info=cpu_machine(), repack=False)
    assert p.drafter_placement == "cpu" and not p.drafter_repack and p.drafter_use_mmap
    assert not drafter_model_params(p).repack
    assert not any(x.component == "drafter repacked weights" for x in p.parts)
    est = sum(x.bytes for x in p.parts if x.where == "RAM" and x.component.startswith("drafter"))
    got = _real_load(model_path(DRAFTER), 2048, 64, 64, 64, 17, mmap=True, flash_attn=True, repack=False)
    assert within(est, got["rss"]), (est / MiB, got["rss"] / MiB)


def test_exact_plans_repack_the_drafter_but_not_the_target(fp):
    """Exact mode needs the target's kernels batch-invariant, not the drafter's: the drafter keeps
    its repacked kernels (a full load, no second copy), the target is mapped as it is."""
    from edgespec.load.drafter import drafter_model_params
    from edgespec.load.resolve import exact_plan

    t, dr = fp(TARGET), fp(DRAFTER)
    p = planner.make_plan(t, dr, 64 * GiB, None, 2048, machine_info=cpu_machine(), **exact_plan(cpu_machine()))
    assert p.drafter_placement == "cpu" and p.drafter_repack and not p.drafter_use_mmap
    assert drafter_model_params(p).repack
    assert not p.repack and p.use_mmap and not any(x.component == "target repacked weights" for x in p.parts)
    assert "exact mode" in next(d.why for d in p.decisions if d.name == "repack")


@pytest.fixture(scope="module")
def target_load(model_path, fp):
    """The one real load of the 1.5B target: reported buffers and RSS growth together."""
    f = fp(TARGET)
    p, est = _plan_same_config(f, 1024, 128, 16)
    got = _real_load(model_path(TARGET), 1024, 128, p.n_seq_max, 128, 17, flash_attn=p.flash_attn)
    return f, p, est, got


def test_target_estimates_match_llama_cpp_reports(target_load):
    f, p, _est, got = target_load
    rep = got["reported"]
    c = planner.estimate_context(f, 1024, 128, p.n_seq_max, "f16", p.flash_attn, n_outputs_max=VERIFY_ROWS)
    _check_reported(f, c, rep, f.weights_bytes, f.repack_bytes(planner.machine().cpu_features))
    assert p.llama_cpp_reports["target"]["compute"] == c.compute_reserved


def test_target_resident_memory_matches_the_plan(target_load):
    f, p, est, got = target_load
    assert within(est, got["rss"]), (est / MiB, got["rss"] / MiB)
    # forced to what LlamaModel does today: both copies resident (with qmatmul there is no second)
    assert p.use_mmap and p.repack == (f.repack_bytes(planner.machine().cpu_features) > 0)


# =============================================================================================
# Budgets and choices
# =============================================================================================

@pytest.mark.parametrize("text,value", [("2GB", 2_000_000_000), ("2GiB", 2 * GiB), ("2048M", 2 * GiB),
                                        ("1073741824", GiB), ("512MiB", 512 * MiB), (4096, 4096)])
def test_budgets_parse(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["-1", "abc", "", "0", "2XB", "-2GiB"])
def test_bad_budgets_are_refused(text):
    with pytest.raises(InvalidRequest):
        parse_bytes(text)


def test_a_roomy_budget_keeps_everything(fp):
    p = planner.make_plan(fp(TARGET), fp(DRAFTER), 8 * GiB, None, None, machine_info=cpu_machine())
    assert (p.weights_mode, p.kv_type, p.n_ubatch, p.n_ctx, p.drafter_placement) == ("resident", "f16", 512, 4096, "cpu")
    assert p.suffix_cap_tokens == candidates.SUFFIX_DEFAULT_CAP and p.threads == 4
    # Repacking on: a full load reads the repacked tensors once instead of mapping them too.
    assert p.repack and not p.use_mmap
    assert p.ram_bytes <= 8 * GiB and {d.name for d in p.decisions} >= {
        "n_gpu_layers", "weights", "load", "repack", "mlock", "n_ctx", "kv_type", "n_ubatch", "drafter", "threads"}
    assert all(d.why for d in p.decisions)
    d = p.to_dict()
    assert json.loads(json.dumps(d))["engine"]["n_ubatch"] == 512 and d["reasons"]


def test_the_drafter_is_dropped_between_target_alone_and_target_plus_drafter(fp):
    m = cpu_machine()
    t, dr = fp(TARGET), fp(DRAFTER)
    alone = planner.make_plan(t, None, 8 * GiB, None, 4096, machine_info=m).ram_bytes
    both = planner.make_plan(t, dr, 8 * GiB, None, 4096, machine_info=m).ram_bytes
    assert both > alone + 400 * MiB
    mid = planner.make_plan(t, dr, alone + 50 * MiB, None, 4096, machine_info=m)
    assert mid.drafter_placement == "none" and mid.drafter is None and mid.suffix_drafter
    assert any("dropped" in w for w in mid.warnings)
    why = next(d.why for d in mid.decisions if d.name == "drafter")
    assert "smallest plan with" in why
    assert planner.make_plan(t, dr, both, None, 4096, machine_info=m).drafter_placement == "cpu"


def test_tight_ram_shrinks_ubatch_and_quantizes_kv_before_going_file_backed(fp):
    m = cpu_machine()
    t = fp(TARGET)
    roomy = planner.make_plan(t, None, 8 * GiB, None, 8192, machine_info=m)
    tight = planner.make_plan(t, None, roomy.ram_bytes - 100 * MiB, None, 8192, machine_info=m)
    assert tight.weights_mode == "resident"
    assert (tight.n_ubatch, tight.kv_type) != (512, "f16")
    assert tight.ram_bytes <= roomy.ram_bytes - 100 * MiB


def test_flash_attention_is_planned_as_asked(fp):
    m = cpu_machine()
    t = fp(TARGET)
    default = planner.make_plan(t, None, 8 * GiB, None, 4096, machine_info=m)
    on = planner.make_plan(t, None, 8 * GiB, None, 4096, machine_info=m, flash_attn=True)
    assert (default.flash_attn, on.flash_attn) == (False, True)
    assert next(d.why for d in on.decisions if d.name == "flash_attn") == "requested"
    assert on.engine_settings()["flash_attn"] is True
    # Without it only an f16 cache runs: a budget that quantizes the cache by default keeps f16.
    tight = planner.make_plan(t, None, default.ram_bytes - 100 * MiB, None, 8192, machine_info=m)
    assert tight.kv_type != "f16"
    off = planner.make_plan(t, None, default.ram_bytes - 100 * MiB, None, 8192, machine_info=m, flash_attn=False)
    assert (off.kv_type, off.flash_attn) == ("f16", False)
    with pytest.raises(InvalidRequest, match="needs flash attention"):
        planner.make_plan(t, None, 8 * GiB, None, 4096, machine_info=m, kv_type="q8_0", flash_attn=False)


def test_file_backed_below_the_weights_size(fp):
    t = fp(TARGET)
    p = planner.make_plan(t, fp(DRAFTER), int(t.weights_bytes * 0.8), None, 2048, machine_info=cpu_machine())
    assert p.weights_mode == "file-backed" and p.use_mmap and not p.repack
    assert p.drafter_placement == "none" and not p.use_mlock
    assert p.file_backed_bytes >= t.weights_bytes - t.embd_bytes
    ws = next(x for x in p.parts if x.component == "target weights (working set)")
    assert 2 * t.max_layer_bytes + t.head_bytes <= ws.bytes < t.weights_bytes / 2


def test_unreachable_budget_is_refused_with_the_smallest_budget(fp):
    t = fp(TARGET)
    m = cpu_machine()
    with pytest.raises(BudgetExceeded) as ei:
        planner.make_plan(t, fp(DRAFTER), 200 * MiB, None, 4096, machine_info=m)
    msg = str(ei.value)
    assert "\n" not in msg and "smallest plan needs" in msg and "--ram-budget" in msg
    assert "q4_0 KV cache" in msg and "no model drafter" in msg
    least = ei.value.smallest_budget
    assert planner.fmt_bytes(least) in msg
    # That budget indeed works, and a little less does not.
    assert planner.make_plan(t, fp(DRAFTER), least, None, 4096, machine_info=m).ram_bytes <= least
    with pytest.raises(BudgetExceeded):
        planner.make_plan(t, fp(DRAFTER), least - MiB, None, 4096, machine_info=m)


def test_refusal_suggests_a_smaller_context(fp):
    t = fp(TARGET)
    m = cpu_machine()
    small = planner.make_plan(t, None, 8 * GiB, None, 2048, machine_info=m, kv_type="q4_0", n_ubatch=64)
    with pytest.raises(BudgetExceeded, match=r"or use --ctx \d+"):
        planner.make_plan(t, None, 560 * MiB, None, 32768, machine_info=m)
    assert small.ram_bytes > 0


def test_context_above_the_trained_context_is_refused(fp):
    with pytest.raises(InvalidRequest, match="exceeds the trained context 8192"):
        planner.make_plan(fp(SMALL), None, 8 * GiB, None, 16384, machine_info=cpu_machine())


def test_auto_context_is_capped_to_fit(fp):
    t = fp(TARGET)
    m = cpu_machine()
    top = planner.make_plan(t, None, 8 * GiB, None, None, machine_info=m)
    assert top.n_ctx == 4096
    resident_min = planner.make_plan(t, None, 8 * GiB, None, 512, machine_info=m, kv_type="q4_0", n_ubatch=64)
    p = planner.make_plan(t, None, resident_min.ram_bytes + MiB, None, None, machine_info=m)
    assert p.weights_mode == "resident" and p.n_ctx < 4096
    assert "capped" in next(d.why for d in p.decisions if d.name == "n_ctx")



def test_exact_plans_keep_the_target_on_the_cpu(fp):
    """Exact mode (exact_plan) on a GPU machine: the drafter may take the GPU, the target not."""
    from edgespec.load.resolve import exact_plan

    t, dr = fp(TARGET), fp(DRAFTER)
    free = planner.make_plan(t, dr, 8 * GiB, None, 4096, machine_info=gpu_machine(16 * GiB))
    assert free.n_gpu_layers > 0  # without it the target goes to the GPU
    p = planner.make_plan(t, dr, 8 * GiB, None, 4096, machine_info=gpu_machine(16 * GiB),
                          **exact_plan(gpu_machine(16 * GiB)))
    assert p.placement in ("draft-gpu", "cpu") and p.n_gpu_layers == 0
    assert (p.repack, p.kv_type, p.flash_attn) == (False, "q8_0", True)


def test_gpu_offload_fills_vram_then_the_drafter_follows(fp):
    t, dr = fp(TARGET), fp(DRAFTER)
    big = planner.make_plan(t, dr, 8 * GiB, None, 4096, machine_info=gpu_machine(16 * GiB))
    assert big.n_gpu_layers == t.n_layer + 1 and big.drafter_placement == "gpu"
    assert big.vram_bytes <= big.vram_budget
    part = planner.make_plan(t, dr, 8 * GiB, 1000 * MiB, 4096, machine_info=gpu_machine(16 * GiB))
    assert 0 < part.n_gpu_layers < t.n_layer + 1 and part.drafter_placement in ("cpu", "none")
    assert part.vram_bytes <= 1000 * MiB
    # Fewer layers on the GPU leave more in RAM.
    assert part.ram_bytes > big.ram_bytes


def test_unified_memory_counts_gpu_bytes_against_ram(fp):
    t = fp(TARGET)
    p = planner.make_plan(t, None, 4 * GiB, None, 4096, machine_info=gpu_machine(8 * GiB, unified=True))
    assert p.n_gpu_layers == t.n_layer + 1
    assert p.ram_bytes >= p.vram_bytes + t.embd_bytes  # one pool
    assert "unified" in next(d.why for d in p.decisions if d.name == "vram_budget")


def test_a_gpu_build_counts_its_runtime_in_ram(fp):
    """The CUDA runtime's host memory is RAM on any machine whose build sees a CUDA GPU, whatever
    the plan places there (the device query made it), with a backend per llama.cpp context; a
    CPU build has none, and other backends are not counted (not measured)."""
    t, dr = fp(TARGET), fp(DRAFTER)

    def host(p: planner.Plan) -> int:
        return sum(x.bytes for x in p.parts if x.component == "GPU runtime (host)")

    assert host(planner.make_plan(t, dr, 8 * GiB, None, 4096, machine_info=cpu_machine())) == 0
    assert host(planner.make_plan(t, dr, 8 * GiB, None, 4096, machine_info=METAL)) == 0  # not measured
    base, each = candidates.GPU_HOST_RUNTIME_BYTES, candidates.GPU_HOST_PER_CONTEXT_BYTES
    for placement in ("gpu", "draft-gpu", "cpu"):
        both = planner.make_plan(t, dr, 8 * GiB, None, 4096, machine_info=gpu_machine(16 * GiB), placement=placement)
        alone = planner.make_plan(t, None, 8 * GiB, None, 4096, machine_info=gpu_machine(16 * GiB),
                                  placement=placement)
        assert both.drafter_placement != "none" and host(both) == base + 2 * each, placement
        assert host(alone) == base + each, placement
        assert both.ram_bytes == sum(x.bytes for x in both.parts if x.where == "RAM")


def test_a_cuda_build_pins_the_compute_buffer_of_a_model_on_the_cpu(fp, monkeypatch):
    """llama.cpp gives a context's CPU compute buffer the GPU's host buffer type whenever the
    build sees a GPU; CUDA pins it, all of it resident: a model wholly on the CPU counts the whole
    reservation there (a unified board too), and only the pages the engine touches on a CPU
    build, under GGML_CUDA_NO_PINNED, or beside a GPU no one has measured (Metal)."""
    t = fp(TARGET)

    def compute(m: planner.MachineInfo) -> planner.Part:
        # Plain decoding touches one row of logits of the 65 its context reserves; at n_ubatch 64
        # the reservation is those rows, not one block's activations.
        p = planner.make_plan(t, None, 8 * GiB, None, 4096, machine_info=m, placement="cpu", suffix=False,
                              n_ubatch=64)
        return next(x for x in p.parts if x.component == "target compute buffer")

    touched = compute(cpu_machine())
    assert "touches" in touched.note
    for m in (gpu_machine(16 * GiB), gpu_machine(4 * GiB, unified=True)):
        assert compute(m).bytes > touched.bytes and "pinned" in compute(m).note
    assert compute(METAL).bytes == touched.bytes
    monkeypatch.setenv("GGML_CUDA_NO_PINNED", "1")
    assert compute(gpu_machine(16 * GiB)).bytes == touched.bytes


def test_vram_budget_on_a_cpu_build_is_noted(fp):
    p = planner.make_plan(fp(SMALL), None, GiB, GiB, 2048, machine_info=cpu_machine())
    assert p.n_gpu_layers == 0 and any("--vram-budget ignored" in w for w in p.warnings)


def test_mlock_only_when_asked_and_possible(fp):
    t = fp(SMALL)
    assert not planner.make_plan(t, None, GiB, None, 2048, machine_info=cpu_machine()).use_mlock
    ok = planner.make_plan(t, None, GiB, None, 2048, machine_info=cpu_machine(), mlock=True)
    assert ok.use_mlock
    low = planner.make_plan(t, None, GiB, None, 2048, mlock=True,
                            machine_info=cpu_machine(memlock_limit=8 * MiB))
    assert not low.use_mlock and "RLIMIT_MEMLOCK" in next(d.why for d in low.decisions if d.name == "mlock")
    root = planner.make_plan(t, None, GiB, None, 2048, mlock=True,
                             machine_info=cpu_machine(memlock_limit=8 * MiB, privileged=True))
    assert root.use_mlock


def test_threads_are_physical_cores_within_the_affinity(fp):
    t = fp(SMALL)
    assert planner.make_plan(t, None, GiB, None, 2048, machine_info=cpu_machine()).threads == 4
    assert planner.make_plan(t, None, GiB, None, 2048, machine_info=cpu_machine(usable_cpus=2)).threads == 2


def test_machine_reads_this_host():
    m = planner.machine()
    assert m.ram_total >= m.ram_available > 0 and m.physical_cores >= 1 and m.usable_cpus >= 1
    assert planner.default_ram_budget(m) < m.ram_available


# =============================================================================================
# The command
# =============================================================================================

def _cli(*args):
    return subprocess.run([EDGESPEC, "plan", *args], check=False, capture_output=True, text=True, timeout=120)


def test_plan_json():
    r = _cli("--model", TARGET, "--draft", DRAFTER, "--ram-budget", "2GiB", "--ctx", "4096", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["target"] == TARGET and d["ram_bytes"] <= 2 * GiB and d["n_ctx"] == 4096
    assert {p["where"] for p in d["parts"]} <= {"RAM", "file", "CUDA0"} and d["reasons"]


def test_plan_table():
    r = _cli("--model", SMALL, "--ram-budget", "512MiB")
    assert r.returncode == 0, r.stderr
    assert "What goes where" in r.stdout and "Decisions" in r.stdout and "KV cache" in r.stdout


@pytest.mark.parametrize("args,fragment", [
    (["--ram-budget", "abc"], "not a byte size"),
    (["--ram-budget=-1"], "not a byte size"),
    (["--vram-budget", "lots"], "not a byte size"),
    (["--model", SMALL, "--ctx", "100000"], "exceeds the model's trained context"),
    (["--model", TARGET, "--ram-budget", "100MiB"], "smallest plan needs"),
    (["--model", SMALL, "--kv-type", "q2"], "--kv-type"),
    (["--model", SMALL, "--kv-type", "q8_0", "--no-flash-attn"], "needs flash attention"),
    (["--model", SMALL, "--exact", "--no-flash-attn"], "exact mode runs flash attention"),
])
def test_plan_errors_are_one_line(args, fragment):
    r = _cli(*args)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], r.stderr
