"""Every placement mode on a real GPU: speculation keeps greedy answers, and the plan's VRAM is
what CUDA allocates.

Needs a llama.cpp build with a GPU and the shape clones that benchmarks/device/run.sh makes
(EDGESPEC_GPU_MODELS=DIR holding qwen1.5b.gguf and qwen0.5b.gguf); skipped elsewhere, with the
reason. Clones carry random weights, so their answers are arbitrary but deterministic: greedy
speculation must still reproduce plain greedy decoding of the same placement token for token,
except at measured near-ties (the same rule as tests/test_speculative.py), and a drafter that
accepts little still exercises drafting, verification and rollback on the GPU.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgespec.decode.loop import Decoder
from edgespec.decode.request import GenerationRequest
from edgespec.decode.sampling import SamplingParams
from edgespec.engine import Engine, EngineConfig
from edgespec.memory import placements
from near_ties import near_tie

pytestmark = pytest.mark.gpu

MODELS = Path(os.environ.get("EDGESPEC_GPU_MODELS", "/nonexistent"))
TARGET, DRAFTER = MODELS / "qwen1.5b.gguf", MODELS / "qwen0.5b.gguf"
PROMPTS = ["Write a Python function that merges two sorted lists.",
           "Repeat exactly: one two three four five six seven eight nine ten, one two three four five"]
TOKENS = 48
GiB = 1 << 30


def _gpu_reason() -> str | None:
    if not (TARGET.exists() and DRAFTER.exists()):
        return f"no shape clones in EDGESPEC_GPU_MODELS ({MODELS}); benchmarks/device/run.sh makes them"
    from edgespec.memory.machine import machine

    return placements.unavailable(machine()).get("gpu")


REASON = _gpu_reason()
skip_without_gpu = pytest.mark.skipif(REASON is not None, reason=REASON or "")
# The 1.5B clone split in the middle: about half its weights in VRAM beside the drafter.
MODES = {"gpu": None, "offload": int(1.2 * GiB), "draft-gpu": None, "overlap": None, "cpu": None}


def _answers(engine: Engine, decoder: Decoder) -> list[tuple[list[int], tuple[int, ...], dict]]:
    req = GenerationRequest(max_tokens=TOKENS, ignore_eos=True, sampling=SamplingParams(temperature=0.0))
    out = []
    for p in PROMPTS:
        engine.reset()
        prompt = engine.chat_tokens([{"role": "user", "content": p}])
        done = list(decoder.stream(prompt, req))[-1]
        out.append((prompt, done.token_ids, done.stats.spec.to_dict() if done.stats.spec else {}))
    return out


@skip_without_gpu
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("draft", ["model", "suffix", "auto", "auto-tree", "auto-default"])
def test_speculation_equals_plain_in_every_placement(mode, draft):
    """auto-default: the placement's draft shape (placements.draft_shape), trees of 63 nodes
    where it allows them; the others 8-token drafts (auto-tree: 7-node trees)."""
    default = draft == "auto-default"
    shape = (None, None) if default else (8, draft == "auto-tree")
    draft = draft.split("-")[0]
    cfg = EngineConfig(model=str(TARGET), n_ctx=1024, placement=mode, vram_budget=MODES[mode], n_threads=8,
                       draft=draft, draft_model=str(DRAFTER), draft_max=shape[0], draft_tree=shape[1])
    with Engine(cfg) as engine:
        assert engine.load_plan.plan.placement == mode
        tree = engine.load_plan.shape.tree
        if default:  # the placement's shape for where the drafter went, unless the plan says what it would cost
            plan = engine.load_plan.plan
            drafts = next(d for d in plan.decisions if d.name == "drafts")
            want = placements.draft_shape(mode, None, None, plan.drafter_placement == "gpu")
            assert engine.load_plan.shape == (placements.CHAINS if "would cost" in drafts.why else want), drafts
        if draft == "model":
            # Random weights are never confident enough to draft: draft anyway, so drafting,
            # verification and rollback all run on the GPU.
            engine.drafter.min_confidence = 0.0
        if draft == "auto" and engine.drafter.model is not None:
            # ... and make auto believe every drafted token, so it drafts with the model and
            # verifies what it drafted
            from edgespec.drafters.auto.policy import DepthAcceptance

            engine.drafter.model.min_confidence = 0.0
            engine.drafter.model_acceptance = DepthAcceptance(prior=1.0)
            cal = engine.drafter.confidence
            cal.num[:] = cal.den[:] = 1e6
            if tree:  # ... and draft a best-first tree at every step (7 nodes, or the largest)
                size = 63 if default else 7
                engine.drafter._tree_choice = lambda budget: (size, float("inf"))
        # The same engine with speculation off: a plain engine of the same placement would
        # hold a different number of target layers on the GPU (no drafter beside them), and
        # different kernels move the clone's near-flat logits (an offload run parted there
        # at a 0.03 gap that way, on 2026-11-26).
        plain = _answers(engine, Decoder(engine.model, engine.seq))
        spec = _answers(engine, engine.decoder)
        drafted = sum(s.get("drafted", 0) for _, _, s in spec)
        ties = []
        for (prompt, want, _), (_, got, _) in zip(plain, spec):
            if got != want:
                j = next(k for k, (a, b) in enumerate(zip(got, want)) if a != b)
                ties.append(near_tie(engine, prompt, want, got, j))
    if draft == "model" or (draft == "auto" and engine.drafter.model is not None):
        # suffix drafts need repeats, which a random model may not make
        assert drafted > 0, "nothing was drafted"
    for t in ties:
        assert 0 <= t["gap"] <= 2 * t["local_deviation"], f"{mode}/{draft}: not a near-tie: {t}"


@skip_without_gpu
@pytest.mark.parametrize("draft", ["suffix", "model"])
def test_sampling_from_the_gpus_largest_logits_draws_what_whole_rows_draw(draft):
    """On the gpu placement a sampled request's rows come back as their largest logits (the
    build's output top-k): plain and speculative sampling draw the same tokens from the same
    seed as with whole rows copied back."""
    req = GenerationRequest(max_tokens=TOKENS, ignore_eos=True, sampling=SamplingParams(temperature=0.8, seed=5))
    answers = {}
    for on in (True, False):
        cfg = EngineConfig(model=str(TARGET), n_ctx=1024, placement="gpu", n_threads=8, draft=draft,
                           draft_model=str(DRAFTER), draft_max=8, greedy_on_backend=on)
        with Engine(cfg) as engine:
            if draft == "model":
                engine.drafter.min_confidence = 0.0
            for name, decoder in (("plain", Decoder(engine.model, engine.seq)), ("spec", engine.decoder)):
                engine.reset()
                prompt = engine.chat_tokens([{"role": "user", "content": PROMPTS[1]}])
                done = list(decoder.stream(prompt, req))[-1]
                answers[name, on] = done.token_ids
                top = engine.seq.ctx._top
                assert (top is not None and top.k > 0) is on
            assert draft != "model" or done.stats.spec.drafted > 0
    assert answers["plain", True] == answers["plain", False]
    assert answers["spec", True] == answers["spec", False]


@skip_without_gpu
@pytest.mark.parametrize("mode", ["draft-gpu", "overlap"])
def test_exact_mode_beside_a_gpu_drafter(mode):
    """--exact with the drafter on the GPU and the target on this host's CPU: greedy speculation
    equals plain greedy with no tolerance. In a child process (tests/exact_run.py): llama.cpp
    reads its tiled-matmul switch once per process, and this one has decoded already."""
    runner = Path(__file__).with_name("exact_run.py")
    proc = subprocess.run([sys.executable, str(runner), "placement", mode, str(TARGET), str(DRAFTER),
                           json.dumps(PROMPTS), str(TOKENS)], check=False, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    assert r["drafter_on_gpu"] and r["drafted"] > 0, r
    assert r["spec"] == r["plain"]


@skip_without_gpu
@pytest.mark.parametrize("mode", ["gpu", "offload", "draft-gpu"])
@pytest.mark.parametrize("shape", ["chains of 8", "trees"])
def test_planned_vram_matches_what_cuda_allocates(mode, shape):
    """The plan's GPU buffers (weights, KV cache, compute) within 10% of llama.cpp's report,
    with short chains and with the long drafts' shape (63 tokens, trees: the drafter's tree
    search reserves a graph of one token per sequence, 256 of them, 150 MiB)."""
    from edgespec.llama.probe import capture_llama_log, reported_buffers
    from edgespec.memory.candidates import GPU_RUNTIME_BYTES

    draft_max, tree = (8, False) if shape != "trees" else (63, True)
    cfg = EngineConfig(model=str(TARGET), n_ctx=1024, placement=mode, vram_budget=MODES[mode], draft="model",
                       draft_model=str(DRAFTER), draft_max=draft_max, draft_tree=tree, n_threads=8)
    with capture_llama_log() as cap:
        with Engine(cfg) as engine:
            plan = engine.load_plan.plan
    # Device buffers only: "CUDA_Host" ones are pinned host memory (RAM).
    reported = sum(v for k, v in reported_buffers(cap.lines).items()
                   if k.startswith("CUDA") and not k.startswith("CUDA_Host"))
    # The graphs kept by size are allocated as their sizes are first decoded, not at load
    # (test_kept_graphs_stay_within_their_planned_vram).
    planned = plan.vram_bytes - GPU_RUNTIME_BYTES - _kept_graphs_part(plan)
    assert abs(planned - reported) <= 0.10 * reported, (mode, planned, reported)
    if mode == "offload":  # the target's CPU-resident weights pinned as planned, for op offload's
        # copies (the drafter, wholly on the GPU, maps its token embeddings: "CPU_Mapped model")
        pinned = reported_buffers(cap.lines).get("CUDA_Host model", 0)
        weights = next(p.bytes for p in plan.parts if p.component == "target weights")
        assert not plan.use_mmap and abs(weights - pinned) <= 0.10 * pinned, (weights, pinned)


@skip_without_gpu
def test_the_cuda_build_keeps_a_graph_per_batch_shape():
    """The llama.cpp this runs on carries edgespec's patch, as `make GPU=cuda` and run.sh build
    it (native/llama_cpp_patches.py): a CUDA graph per batch shape, which doctor reports. It
    fails on a stock build (run.sh's STOCK_LLAMA=1) by design: that is not what edgespec ships."""
    from edgespec.llama.backend import system_info
    from edgespec.llama.kernels import GRAPHS_PER_SHAPE

    info = system_info()["system_info"]
    assert f"{GRAPHS_PER_SHAPE} = 1" in info, f"a stock llama.cpp (make GPU=cuda builds the patched one): {info}"


@skip_without_gpu
@pytest.mark.parametrize("use_mmap", [True, False])
def test_split_target_without_a_plan_is_pinned(use_mmap):
    """`--n-gpu-layers N` without a budget or placement follows the planner's rule for a split
    target, whatever mapping was asked: its CPU-resident weights in pinned host buffers
    (llama.cpp's "CUDA_Host model"), none mapped from the file, op offload on; and it decodes."""
    from edgespec.llama.probe import capture_llama_log, reported_buffers

    cfg = EngineConfig(model=str(TARGET), n_ctx=1024, n_gpu_layers=14, n_threads=8, use_mmap=use_mmap)
    assert not cfg.planned
    with capture_llama_log() as cap, Engine(cfg) as engine:
        assert engine.ctx.params.op_offload
        answers = _answers(engine, Decoder(engine.model, engine.seq))
    buffers = reported_buffers(cap.lines)
    assert buffers.get("CUDA_Host model", 0) > 0 and "CPU_Mapped model" not in buffers, buffers
    assert all(len(tokens) == TOKENS for _, tokens, _ in answers)


# A request in a fresh interpreter: resident memory is a property of the process, and this one
# has loaded other models (tests/test_budget.py does the same on the CPU). edgespec first: it
# orders llama.cpp, numpy and onnxruntime (edgespec/llama/__init__.py).
RAM_RUN = """
import edgespec, json, sys
from edgespec.decode.request import GenerationRequest
from edgespec.decode.sampling import SamplingParams
from edgespec.engine import Engine, EngineConfig
mode, target, drafter, vram = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]) or None
cfg = EngineConfig(model=target, n_ctx=1024, placement=mode, vram_budget=vram, n_threads=8, draft="model",
                   draft_model=drafter)
with Engine(cfg) as engine:
    req = GenerationRequest(max_tokens=48, ignore_eos=True, sampling=SamplingParams(temperature=0.0))
    done = engine.chat([{"role": "user", "content": sys.argv[5]}], req)
    plan = engine.load_plan.plan
    print(json.dumps({"peak": done.stats.peak_rss_bytes, "plan_ram": plan.ram_bytes,
                      "parts": {p.component: p.bytes for p in plan.parts if p.where == "RAM"}}))
"""


@skip_without_gpu
@pytest.mark.parametrize("mode", list(MODES))
def test_a_request_stays_within_the_planned_ram(mode):
    """The plan's RAM holds a request's peak RSS on a GPU build, the CUDA runtime's host memory
    included (candidates.GPU_HOST_*), so a --ram-budget is a contract here as on a CPU build."""
    proc = subprocess.run([sys.executable, "-c", RAM_RUN, mode, str(TARGET), str(DRAFTER), str(MODES[mode] or 0),
                           PROMPTS[0]], check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "GPU runtime (host)" in r["parts"], r
    assert 0 < r["peak"] <= r["plan_ram"], r


def _kept_graphs_part(plan) -> int:
    return sum(p.bytes for p in plan.parts if p.component.startswith("target's graphs kept"))


def _process_vram() -> int:
    """This process's GPU memory in use, as the driver reports it."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         check=True, capture_output=True, text=True).stdout
    return sum(int(used) << 20 for pid, used in (line.split(",") for line in out.splitlines() if line.strip())
               if int(pid) == os.getpid())


@skip_without_gpu
def test_kept_graphs_stay_within_their_planned_vram():
    """Decoding every kept size, each twice between one-token steps and prompt chunks, grows the
    process's GPU memory by no more than the plan's part for the graphs kept by size (and the
    CUDA graphs captured for them, a few MiB)."""
    cfg = EngineConfig(model=str(TARGET), n_ctx=1024, placement="gpu", draft="suffix", draft_max=63, n_threads=8)
    with Engine(cfg) as engine:
        sizes, kept = engine.ctx.graph_sizes, _kept_graphs_part(engine.load_plan.plan)
        assert sizes and sizes[-1] == 65 and kept > 0, (sizes, kept)
        engine.seq.sync(engine.model.tokenize("x " * 200))
        before = _process_vram()
        for _ in range(2):
            for n in range(1, 66):  # every size up to the largest verification, padded to the kept ones
                base = len(engine.seq)
                engine.ctx.decode_rows([17] * 3, range(base, base + 3), [[0]] * 3, [False] * 3)  # no rows read
                engine.ctx.seq_rm(0, base, -1)
                rows = engine.ctx.decode_rows([17] * n, range(base, base + n), [[0]] * n, [True] * n)
                assert rows.greedy(n - 1) >= 0
                engine.ctx.seq_rm(0, base, -1)
                engine.seq.append(17)
            engine.seq.sync(engine.model.tokenize("y " * 150))  # a prompt chunk: the reserved scheduler's
        grown = _process_vram() - before
    assert grown <= kept + 64 * (1 << 20), (grown, kept)
