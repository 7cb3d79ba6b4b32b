"""Measurements on the GPU machine, run by run.sh: shape clones, then cost curves per placement.

    measure.py clones HEADERS_DIR MODELS_DIR [NAMES] make the 7B-, 1.5B- and 0.5B-shaped clones (or NAMES)
    measure.py curve CONFIG MODELS_DIR OUT.json     one placement's verification cost curve
    measure.py table RESULTS_DIR                    print a short table of every curve
    measure.py third MODEL.gguf                     GPU layers holding ~1/3 of the weights
    measure.py mixed CONFIG MODELS_DIR OUT.json     batch sizes in random order, against the curve
    measure.py sequence CONFIG MODELS_DIR SEQ.json OUT.json
                                                    a replay's target decodes, timed in its order

``curve`` runs in its own process per placement: a crash (or llama.cpp's once-per-process
reading of GGML_OP_OFFLOAD_MIN_BATCH) stays with that placement.  Every number comes from
edgespec's own backend (edgespec.llama.backend), as the engine would drive llama.cpp:

* verification cost: after 512 tokens of context, one decode of n tokens (every row's logits
  requested, as verification does), rolled back with seq_rm, repeated; the median in ms.
* chain cost: 32 single-token decodes one after another (a drafter drafting a chain).
"""
from __future__ import annotations

# On the GPU machine every model load segfaulted (in llama.cpp's print_info) when numpy had
# been imported before llama_cpp, and none did the other way round (diag.py, 2026-11-26):
# so llama_cpp is loaded first, before anything imports numpy.
import os  # isort: skip

# Curves are measured at llama.cpp's own op offload threshold unless the caller sets one
# (edgespec.llama would set its own, 2, on import).
os.environ.setdefault("GGML_OP_OFFLOAD_MIN_BATCH", "32")

import edgespec  # noqa: F401  isort: skip  (its import order of llama.cpp, numpy, onnxruntime)

import json
import logging
import re
import statistics
import sys
import time

import numpy as np

from edgespec.files.clone import CloneShape, write_clone
from edgespec.files.gguf import read_gguf_header
from edgespec.llama.kernels import op_offload_min_batch

log = logging.getLogger("measure")

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
CONTEXT = 512
THREADS = 8  # a laptop's CPU
CLONES = {  # name: (header, shape)
    "qwen7b": ("qwen2.5-coder-1.5b.hdr", CloneShape(layers=28, hidden=3584, ffn=18944,
                                                   heads=28, kv_heads=4)),
    "qwen1.5b": ("qwen2.5-coder-1.5b.hdr", CloneShape()),
    "qwen0.5b": ("qwen2.5-coder-0.5b.hdr", CloneShape()),
    # Qwen2.5-14B and -32B shapes: where a target on the GPU is slow enough for the 0.5B drafter
    "qwen14b": ("qwen2.5-coder-1.5b.hdr", CloneShape(layers=48, hidden=5120, ffn=13824, heads=40, kv_heads=8)),
    "qwen32b": ("qwen2.5-coder-1.5b.hdr", CloneShape(layers=64, hidden=5120, ffn=27648, heads=40, kv_heads=8)),
}
DEFAULT_CLONES = ("qwen7b", "qwen1.5b", "qwen0.5b")
ALL = 999  # every layer and the output layer on the GPU
THIRD = "third"  # the last layers holding about a third of the weights
# placement name: model, GPU layers, no_host, op_offload, batch sizes[, use_mmap[, CPU threads]]
CONFIGS = {
    "gpu-7b": ("qwen7b", ALL, False, True, SIZES),
    "gpu-1.5b": ("qwen1.5b", ALL, False, True, SIZES),
    "gpu-0.5b": ("qwen0.5b", ALL, False, True, SIZES),
    "gpu-14b": ("qwen14b", ALL, False, True, SIZES),
    "gpu-32b": ("qwen32b", ALL, False, True, SIZES),
    "offload-7b": ("qwen7b", THIRD, False, True, SIZES),
    # verified on the CPU: weights repacked for it (no_host), never copied to the GPU
    "cpu-7b": ("qwen7b", 0, True, False, SIZES),
    "cpu-1.5b": ("qwen1.5b", 0, True, False, SIZES),
    "cpu-0.5b": ("qwen0.5b", 0, True, False, (1, 2, 4, 8, 16)),
    # the cliff without op offload, for contrast (large batches would take minutes)
    "offload-7b-no-op-offload": ("qwen7b", THIRD, False, False, (1, 2, 4, 8, 16, 32, 64)),
    # what the planner gives the 7B when the 0.5B drafter shares that third of VRAM (engine_modes.py)
    "offload-7b-beside-drafter": ("qwen7b", 4, False, True, SIZES),
    # ... and beside a tree drafter of 256 sequences (150 MiB more; the search now holds 64,
    # the chain drafter's context, so 4 layers stand beside trees too)
    "offload-7b-beside-tree-drafter": ("qwen7b", 3, False, True, SIZES),
    # the same, the CPU-resident weights read into pinned host buffers (no mmap): op offload
    # copies them to the GPU by DMA instead of through the driver's staging of pageable pages
    "offload-7b-beside-drafter-pinned": ("qwen7b", 4, False, True, SIZES, False),
    "offload-7b-pinned": ("qwen7b", THIRD, False, True, SIZES, False),
    # wholly on the GPU with one CPU thread (it only looks up token embeddings): within the
    # process-to-process noise of 8 threads on the H100
    "gpu-7b-t1": ("qwen7b", ALL, False, True, SIZES, True, 1),
    "gpu-0.5b-t1": ("qwen0.5b", ALL, False, True, SIZES, True, 1),
}


def make_clones(headers: str, models: str, names: str = ",".join(DEFAULT_CLONES)) -> None:
    os.makedirs(models, exist_ok=True)
    for name in names.split(","):
        header, shape = CLONES[name]
        out = os.path.join(models, name + ".gguf")
        if os.path.exists(out):
            continue
        t0 = time.perf_counter()
        r = write_clone(os.path.join(headers, header), out, shape, seed=1)
        log.info("%s: %.2f GB in %.1f s, shape %s", name, r.file_size / 1e9,
                 time.perf_counter() - t0, r.shape)


def third_of_weights(path: str) -> tuple[int, int, int]:
    """(n_gpu_layers, bytes they put on the GPU, all weight bytes) closest to a third.

    llama.cpp counts the output layer as layer n_layer and offloads from the end: with
    n_gpu_layers = k >= 1 the GPU holds the output layer and the last k - 1 blocks (seen on
    the GPU machine: k = 11 put 1745 MiB of a 7B-shaped clone there, the output matrix and
    10 blocks, not 11 blocks); token embeddings always stay on the CPU.
    """
    h = read_gguf_header(path)
    total = sum(t.nbytes for t in h.tensors)
    per_layer: dict[int, int] = {}
    output = 0
    for t in h.tensors:
        m = re.match(r"blk\.(\d+)\.", t.name)
        if m:
            per_layer[int(m.group(1))] = per_layer.get(int(m.group(1)), 0) + t.nbytes
        elif t.name.startswith("output"):  # output.weight and output_norm.weight
            output += t.nbytes
    best, acc = (1, output), output
    for k, layer in enumerate(sorted(per_layer, reverse=True), start=2):
        acc += per_layer[layer]
        if abs(acc - total / 3) < abs(best[1] - total / 3):
            best = (k, acc)
    return best[0], best[1], total


class _Buffers(logging.Handler):
    """llama.cpp's "<dev> <kind> buffer size = X MiB" lines, summed by name (bytes)."""

    pattern = re.compile(r"(\S+)\s+(\w+) buffer size =\s*([0-9.]+) MiB")

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.sizes: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        m = self.pattern.search(record.getMessage())
        if m:
            key = f"{m.group(1)} {m.group(2)}"
            self.sizes[key] = self.sizes.get(key, 0) + round(float(m.group(3)) * 2**20)


def _timed_decode(ctx, tokens: list[int], start: int) -> float:
    """ms of one decode of ``tokens`` at positions start.. with every row's logits."""
    n = len(tokens)
    t0 = time.perf_counter()
    rows = ctx.decode_rows(tokens, range(start, start + n), [[0]] * n, [True] * n)
    row = rows(n - 1)  # reading logits waits for the device: the decode is complete
    ms = (time.perf_counter() - t0) * 1e3
    if not np.isfinite(row).all():
        raise RuntimeError(f"non-finite logits after a batch of {n}")
    return ms


def _curve(ctx, rng: np.random.Generator, sizes, vocab: int) -> list[dict]:
    """Per batch size: one warm-up, then repeats until 5 or 2 s (at least 2); the median."""
    out = []
    for n in sizes:
        times = []
        for rep in range(6):
            tokens = rng.integers(0, vocab, n).tolist()
            ms = _timed_decode(ctx, tokens, CONTEXT)
            ctx.seq_rm(0, CONTEXT, -1)
            if rep:
                times.append(ms)
            if len(times) >= 2 and sum(times) > 2000:
                break
        out.append({"n": n, "ms": statistics.median(times), "ms_all": times})
        log.info("n=%d: %.2f ms", n, out[-1]["ms"])
    return out


def _chain(ctx, rng: np.random.Generator, vocab: int, steps: int = 32) -> float:
    """ms per token of ``steps`` single-token decodes, each after the previous (a chain)."""
    times = [_timed_decode(ctx, [int(rng.integers(0, vocab))], CONTEXT + i) for i in range(steps)]
    ctx.seq_rm(0, CONTEXT, -1)
    return statistics.median(times[1:])


def _params(config: str, path: str):
    from edgespec.llama.backend import ContextParams, ModelParams

    _, layers, no_host, op_offload, sizes, *extra = CONFIGS[config]
    use_mmap = extra[0] if len(extra) > 0 else True
    threads = extra[1] if len(extra) > 1 else THREADS
    info = {}
    if layers == THIRD:
        layers, gpu_bytes, total = third_of_weights(path)
        info = {"gpu_weight_bytes": gpu_bytes, "weight_bytes": total,
                "gpu_weight_fraction": gpu_bytes / total}
    mp = ModelParams(n_gpu_layers=layers, no_host=no_host, use_mmap=use_mmap)
    cp = ContextParams(n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=threads,
                       n_threads_batch=threads, n_outputs_max=512, op_offload=op_offload)
    return mp, cp, sizes, info


def _load(config: str, models: str):
    """The config's model and context after a 512-token prompt, and what loading them said."""
    from edgespec.llama.backend import LlamaContext, LlamaModel, list_devices

    path = os.path.join(models, CONFIGS[config][0] + ".gguf")
    mp, cp, sizes, info = _params(config, path)
    buffers = _Buffers()
    logging.getLogger("edgespec.llama_cpp").addHandler(buffers)
    logging.getLogger("edgespec.llama_cpp").setLevel(logging.DEBUG)
    t0 = time.perf_counter()
    model = LlamaModel(path, mp)
    ctx = LlamaContext(model, cp)
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.n_vocab, CONTEXT).tolist()
    t0 = time.perf_counter()
    ctx.decode(prompt, range(CONTEXT), [[0]] * CONTEXT, [False] * (CONTEXT - 1) + [True])
    prefill_ms = (time.perf_counter() - t0) * 1e3
    result = {"config": config, "model": CONFIGS[config][0], "model_params": vars_of(mp),
              "op_offload_min_batch": op_offload_min_batch(),
              "graph_opt": os.environ.get("GGML_CUDA_GRAPH_OPT", ""),
              "context_params": vars_of(cp), **info, "context": CONTEXT, "load_s": load_s,
              "prefill_512_ms": prefill_ms, "buffers": buffers.sizes, "devices": list_devices()}
    return model, ctx, rng, sizes, result


def measure_curve(config: str, models: str, out: str) -> None:
    model, ctx, rng, sizes, result = _load(config, models)
    result["chain_ms_per_token"] = chain = _chain(ctx, rng, model.n_vocab)
    log.info("%s: load %.1f s, prefill %.0f ms, chain %.2f ms/token", config, result["load_s"],
             result["prefill_512_ms"], chain)
    result["curve"] = []
    _write(out, result)  # a later crash still leaves what was measured
    result["curve"] = _curve(ctx, rng, sizes, model.n_vocab)
    _write(out, result)


def _mixed(ctx, rng: np.random.Generator, vocab: int, sizes, decodes: int = 120) -> dict:
    """ms per batch size when sizes come in a random order, as a verifier's do (CUDA graphs are
    kept while a batch's shape repeats): the median per size, then overall."""
    by_n: dict[int, list[float]] = {}
    for n in rng.choice(sizes, decodes).tolist():
        by_n.setdefault(n, []).append(_timed_decode(ctx, rng.integers(0, vocab, n).tolist(), CONTEXT))
        ctx.seq_rm(0, CONTEXT, -1)
    return {str(n): statistics.median(t) for n, t in sorted(by_n.items())}


def _steps(ctx, rng: np.random.Generator, vocab: int, catch_up: int = 2, chain: int = 4,
           steps: int = 30) -> list[float]:
    """A drafter's step: a ``catch_up``-token decode (the target's tokens), then a ``chain`` of
    single tokens; the median ms of each chain token by its place after the catch-up."""
    times: list[list[float]] = [[] for _ in range(chain)]
    for _ in range(steps):
        pos = CONTEXT
        _timed_decode(ctx, rng.integers(0, vocab, catch_up).tolist(), pos)
        pos += catch_up
        for i in range(chain):
            times[i].append(_timed_decode(ctx, [int(rng.integers(0, vocab))], pos + i))
        ctx.seq_rm(0, CONTEXT, -1)
    return [statistics.median(t[1:]) for t in times]


def measure_mixed(config: str, models: str, out: str) -> None:
    """The same process measures sizes 1-9 one size at a time (as ``curve``), then in a random
    order, then a drafter's steps (a 2-token catch-up, then a 4-token chain)."""
    model, ctx, rng, _, result = _load(config, models)
    sizes = list(range(1, 10))
    result["chain_ms_per_token"] = _chain(ctx, rng, model.n_vocab)
    result["curve"] = _curve(ctx, rng, sizes, model.n_vocab)
    result["mixed_ms"] = _mixed(ctx, rng, model.n_vocab, sizes)
    result["step_chain_ms"] = _steps(ctx, rng, model.n_vocab)
    log.info("%s: curve %s; mixed %s; chain after a catch-up %s", config,
             [round(p["ms"], 2) for p in result["curve"]],
             {n: round(v, 2) for n, v in result["mixed_ms"].items()},
             [round(v, 2) for v in result["step_chain_ms"]])
    _write(out, result)


def measure_sequence(config: str, models: str, sequences: str, out: str) -> None:
    """Times the target decodes a replay booked (benchmarks/replay/target_sequence.py), each
    prompt's in its order: n-token batches with every row's logits, one position further each
    (rolled back to it), after an untimed 16-token batch standing for the prompt's prefill."""
    model, ctx, rng, _, result = _load(config, models)
    with open(sequences) as f:
        seq = json.load(f)
    result["sequences"] = os.path.basename(sequences)
    result["measured_s"] = {}
    for key, prompts in seq["sizes"].items():
        totals = []
        for sizes in prompts:
            _timed_decode(ctx, rng.integers(0, model.n_vocab, 16).tolist(), CONTEXT)
            ctx.seq_rm(0, CONTEXT, -1)
            total = 0.0
            for i, n in enumerate(sizes):
                total += _timed_decode(ctx, rng.integers(0, model.n_vocab, n).tolist(), CONTEXT + i) * 1e-3
                ctx.seq_rm(0, CONTEXT + i + 1, -1)
            ctx.seq_rm(0, CONTEXT, -1)
            totals.append(total)
        result["measured_s"][key] = totals
        log.info("%s %s: measured %.3f s, booked %.3f s, at the curve %.3f s", config, key, sum(totals),
                 sum(seq["booked_s"][key]), sum(seq["curve_s"][key]))
    _write(out, result)


def vars_of(params) -> dict:
    return {k: getattr(params, k) for k in params.__dataclass_fields__}


def _write(path: str, data: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(path + ".tmp", path)


def table(results: str) -> None:
    """One line per placement: chain ms/token and ms per batch of n."""
    print("placement".ljust(38) + "chain " + " ".join(f"{n:>7}" for n in SIZES))
    for name in sorted(os.listdir(results)):
        if not (name.startswith("curve-") and name.endswith(".json")):
            continue
        with open(os.path.join(results, name)) as f:
            r = json.load(f)
        by_n = {p["n"]: p["ms"] for p in r["curve"]}
        cells = " ".join(f"{by_n[n]:7.1f}" if n in by_n else "      -" for n in SIZES)
        label = r["config"] + (f" ob{r['op_offload_min_batch']}" if r.get("op_offload_min_batch", 32) != 32 else "")
        print(f"{label:<38}{r['chain_ms_per_token']:5.1f} {cells}")


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("edgespec.llama_cpp").propagate = False  # llama.cpp's chatter
    cmd, args = argv[0], argv[1:]
    if cmd == "clones":
        make_clones(*args)
    elif cmd == "curve":
        measure_curve(*args)
    elif cmd == "mixed":
        measure_mixed(*args)
    elif cmd == "sequence":
        measure_sequence(*args)
    elif cmd == "table":
        table(*args)
    elif cmd == "third":
        print(third_of_weights(*args)[0])
    else:
        raise SystemExit(f"unknown command {cmd!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
