"""Memory planner: what a target (and its drafter) will cost, and how to fit them in a budget.

Everything here is computed from GGUF metadata and tensor sizes alone: no model is loaded.
:func:`estimate_model` sizes a model's parts, :func:`estimate_context` a llama.cpp context over
it, :func:`machine` reads the RAM, cores and GPUs, and :func:`make_plan` chooses the placement
(GPU layers, drafter, KV cache type, context, micro-batch, mmap / full load / mlock, threads)
that fits a RAM and a VRAM budget, with the reason for each choice, or raises
:class:`~edgespec.errors.BudgetExceeded` with the smallest budget that would work.

How the numbers are obtained (llama-cpp-python 0.3.36; measured on qwen2.5-coder-1.5b/0.5b,
smollm2-135m and gemma3-270m; ``tests/test_planner.py`` checks them against llama.cpp's log):

* **Weights**: the bytes of each tensor (from its type and shape), grouped by ``blk.N.`` layer,
  token embeddings, output head and the rest. llama.cpp maps exactly these bytes.
* **Repacking**: on CPUs with AVX2 (x86) or NEON dot-product (ARM) kernels, llama.cpp copies
  eligible 2-D weights into an interleaved "CPU_REPACK" buffer (``use_extra_bufts``): Q4_0,
  Q4_K, IQ4_NL and MXFP4 with rows % 8 == 0 on x86 (Q2_K too with AVX512); on ARM also Q5_K,
  Q6_K and Q8_0. With mmap the mapped originals stay resident as well, so repacking costs
  its size twice over; a full load (no mmap) reads those tensors straight into the repacked
  buffer and costs nothing extra.
* **KV cache**: ``pad256(n_ctx) x sum over layers of (n_head_kv x (key_length + value_length))``
  elements, at 2 bytes (f16), 34/32 (q8_0) or 18/32 (q4_0). The cache is unified, so the
  number of sequences does not change it; llama.cpp's default ``swa_full`` keeps sliding-window
  layers full size too.
* **Compute buffer** (``F`` feed-forward length, ``E`` embedding, ``Q = n_head x key_length``,
  ``V`` vocabulary, ``ub = min(n_ubatch, n_batch, n_ctx)``, ``kv = pad256(n_ctx)``, ``m`` = 2
  attention masks for sliding-window models else 1), in bytes::

      layer  = ub x (4 x (3F + 3E + Q) + 2 m kv + 32)               flash attention
             = ub x max(4 x (3F + 3E + Q) + 4 m kv, (4 n_head + 4) kv + 4 x (5E + 1024))   without
      logits(n) = 4 n (V + 2E) + (6 ub E if n < ub else 0)
      reserved  = max(layer, logits(min(n_outputs_max, ub)))         what llama.cpp allocates
      touched   = max(layer, 4 n_out (V + 2E))                       what the engine's batches use

  llama.cpp sizes the buffer for the worst graph it may be asked to run: ``LlamaContext``
  allows ``n_outputs_max = n_batch`` rows of logits, so 512 rows x V floats are reserved
  (302.75 MiB for the 1.5B target) although prefill asks for one row and verification for at
  most ``draft_max + 1``. Untouched pages of that reservation are never resident; the plan
  budgets the touched part and reports the reserved one.
* **Output buffer**: ``max(n_seq_max, rows per decode) x V x 4`` bytes (llama.cpp grows it to
  the largest batch of logits requested; verification asks for ``draft_max + 1`` rows).
* **Runtime**: llama.cpp's vocabulary and the GGUF metadata edgespec keeps, about 243 bytes per
  token and merge (+51 per token score), a ggml work buffer of ``ub x max(F, E, Q) x 1.14 +
  1 MiB`` and a process baseline (Python, numpy, llama.cpp libraries) of 64 MiB.
* **Suffix drafter**: about 115 bytes per held token (history cap + the current context).
* **GPU** (no GPU build here, so these are not calibrated): ``n_gpu_layers = k`` puts the output
  head and the last ``k - 1`` blocks on the GPU with their KV cache; the token embeddings
  stay in RAM; a fixed 256 MiB is assumed for the GPU runtime (CUDA context, cuBLAS).
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from itertools import product

from edgespec import gguf as gguf_mod
from edgespec.errors import BudgetExceeded, InvalidRequest
from edgespec.units import format_bytes

MiB = 1 << 20

#: KV cache types: (bytes per block, elements per block) and ggml type id (type_k/type_v).
KV_TYPES: dict[str, tuple[int, int]] = {"f16": (2, 1), "q8_0": (34, 32), "q4_0": (18, 32)}
KV_TYPE_IDS = {"f16": 1, "q8_0": 8, "q4_0": 2}
ENGINE_N_BATCH = 512            # prefill batches of the engine (ContextParams.n_batch)
UBATCH_CHOICES = (512, 256, 128, 64)
DEFAULT_CTX = 4096              # EngineConfig.n_ctx
MIN_CTX = 256                   # llama.cpp pads the cache to 256 cells anyway
SUFFIX_DEFAULT_CAP = 1 << 18    # SuffixDrafter(max_history_tokens=...)
SUFFIX_CAPS = (SUFFIX_DEFAULT_CAP, 1 << 16, 1 << 14)
SUFFIX_BYTES_PER_TOKEN = 115    # native suffix index, measured
VOCAB_BYTES_PER_ENTRY = 243     # llama.cpp vocab + edgespec's GGUF metadata, per token and merge
SCORE_BYTES = 51                # ... and per token score (SentencePiece vocabularies)
PROCESS_BASE_BYTES = 64 * MiB   # Python, numpy, llama.cpp libraries before any model (CLI: ~51)
GPU_RUNTIME_BYTES = 256 * MiB   # CUDA/Metal context and library workspaces (assumed)
MODEL_TREE_SEQS = 64            # ModelDrafter with tree=True: MAX_TREE_NODES + 1 sequences
BUDGET_MARGIN_FRACTION = 0.05
BUDGET_MARGIN_MIN = 256 * MiB


fmt_bytes = format_bytes  # the planner's explanations use the one byte formatter


def parse_budget(text: str | int) -> int:
    """A byte size as a user writes it ("2GB", "2GiB", "2048M", "1073741824")."""
    from edgespec.units import parse_bytes

    return parse_bytes(text)


def _pad(n: int, to: int) -> int:
    return (n + to - 1) // to * to


# =============================================================================================
# Models
# =============================================================================================

_LAYER = re.compile(r"^blk\.(\d+)\.")


def repack_eligible(type_name: str, rows: int, features: Iterable[str]) -> bool:
    """Whether llama.cpp's CPU backend repacks a 2-D weight of this type with ``rows`` rows.

    Mirrors ggml-cpu's choice of interleaved kernels for the CPU features of the build.
    """
    f = set(features)
    if "REPACK" not in f:
        return False
    x86 = "AVX2" in f
    arm = "NEON" in f and ("DOTPROD" in f or "MATMUL_INT8" in f)
    t = type_name.upper()
    if x86:
        if t in ("Q4_0", "Q4_K", "IQ4_NL", "MXFP4") and rows % 8 == 0:
            return True
        if t == "Q2_K" and "AVX512" in f and rows % 8 == 0:
            return True
    if arm:
        if t in ("Q4_0", "IQ4_NL", "MXFP4", "Q8_0") and rows % 4 == 0:
            return True
        if t in ("Q4_K", "Q5_K", "Q6_K") and rows % 8 == 0:
            return True
    return False


@dataclass(frozen=True)
class ModelFootprint:
    """The bytes a model's parts need and the shapes that size its context, from its GGUF."""

    name: str
    path: str
    architecture: str
    file_size: int
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_vocab: int
    n_merges: int
    n_scores: int
    n_ctx_train: int
    n_swa: int
    tied_output: bool
    layer_bytes: tuple[int, ...]
    embd_bytes: int
    output_bytes: int          # output.weight; 0 when the output head reuses the embeddings
    other_bytes: int           # norms and everything outside blocks, embeddings and head
    kv_elems_per_token: tuple[int, ...]  # per layer: K + V elements per cached token
    # (layer or -1 for the head, ggml type name, rows, bytes) of each 2-D matmul weight
    matmul_weights: tuple[tuple[int, str, int, int], ...] = field(repr=False, default=())
    tokenizer_fingerprint: str = ""

    @property
    def weights_bytes(self) -> int:
        return sum(self.layer_bytes) + self.embd_bytes + self.output_bytes + self.other_bytes

    @property
    def head_bytes(self) -> int:
        """Bytes of the output projection (the embeddings when they are tied)."""
        return self.embd_bytes if self.tied_output else self.output_bytes

    @property
    def max_layer_bytes(self) -> int:
        return max(self.layer_bytes, default=0)

    @property
    def runtime_bytes(self) -> int:
        """llama.cpp's vocabulary structures and the GGUF metadata edgespec keeps."""
        return VOCAB_BYTES_PER_ENTRY * (self.n_vocab + self.n_merges) + SCORE_BYTES * self.n_scores

    def kv_bytes_per_token(self, kv_type: str = "f16", layers: Iterable[int] | None = None) -> int:
        """K + V bytes one cached token takes over ``layers`` (default: all)."""
        bpb, per = KV_TYPES[kv_type]
        idx = range(self.n_layer) if layers is None else layers
        return sum(self.kv_elems_per_token[i] * bpb // per for i in idx)

    def kv_bytes_per_token_layer(self) -> dict[str, float]:
        """Mean K + V bytes per token per layer, for each cache type."""
        return {t: self.kv_bytes_per_token(t) / max(self.n_layer, 1) for t in KV_TYPES}

    def repack_bytes(self, features: Iterable[str], layers: Iterable[int] | None = None,
                     head: bool = True) -> int:
        """Bytes llama.cpp copies into its CPU_REPACK buffer for the given CPU layers."""
        feats = frozenset(features)
        want = set(range(self.n_layer) if layers is None else layers)
        if head:
            want.add(-1)
        return sum(nb for il, t, rows, nb in self.matmul_weights
                   if il in want and repack_eligible(t, rows, feats))

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("matmul_weights")
        d["layer_bytes"] = list(self.layer_bytes)
        d["kv_elems_per_token"] = list(self.kv_elems_per_token)
        d["weights_bytes"] = self.weights_bytes
        d["head_bytes"] = self.head_bytes
        d["runtime_bytes"] = self.runtime_bytes
        d["kv_bytes_per_token_layer"] = self.kv_bytes_per_token_layer()
        return d


def _meta_int(md: dict, key: str, default: int | None = None, agg=max) -> int | None:
    v = md.get(key)
    if isinstance(v, bool):
        return default
    if isinstance(v, int):
        return v
    if isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return agg(v)
    return default


def estimate_model(gguf_file, name: str | None = None) -> ModelFootprint:
    """Sizes a model's parts from its GGUF header (a path or a ``GGUFFile``); loads nothing.

    Raises InvalidGGUF for a malformed file and InvalidRequest when the file lacks the
    metadata a transformer needs (block count, embedding length, head counts).
    """
    g = gguf_file if isinstance(gguf_file, gguf_mod.GGUFFile) else gguf_mod.read_gguf(gguf_file)
    md = g.metadata
    arch = md.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise InvalidRequest(f"{g.path}: no general.architecture: not a model file")

    def key(k):
        return f"{arch}.{k}"

    n_layer = _meta_int(md, key("block_count"))
    n_embd = _meta_int(md, key("embedding_length"))
    n_head = _meta_int(md, key("attention.head_count"))
    if not n_layer or not n_embd or not n_head:
        raise InvalidRequest(f"{g.path}: missing {arch} block_count / embedding_length / head_count: "
                             "cannot size this model")
    # Per-layer head counts (some models vary them) give one KV width per layer.
    hkv_raw = md.get(key("attention.head_count_kv"), n_head)
    if isinstance(hkv_raw, list):
        hkv = [int(x) for x in hkv_raw][:n_layer] + [int(hkv_raw[-1])] * max(0, n_layer - len(hkv_raw))
    else:
        hkv = [int(hkv_raw)] * n_layer
    head_dim = n_embd // n_head
    dk = _meta_int(md, key("attention.key_length"), head_dim)
    dv = _meta_int(md, key("attention.value_length"), head_dim)

    layer_bytes = [0] * n_layer
    embd = output = other = 0
    matmul: list[tuple[int, str, int, int]] = []
    ffn_rows = 0
    for t in g.tensors:
        m = _LAYER.match(t.name)
        if m and int(m.group(1)) < n_layer:
            il = int(m.group(1))
            layer_bytes[il] += t.nbytes
            if len(t.shape) == 2:
                matmul.append((il, t.type_name, t.shape[1], t.nbytes))
            if t.name.endswith("ffn_up.weight") and len(t.shape) >= 2:
                ffn_rows = max(ffn_rows, t.shape[1])
        elif t.name == "token_embd.weight":
            embd = t.nbytes
            embd_shape = t.shape
        elif t.name == "output.weight":
            output = t.nbytes
            if len(t.shape) == 2:
                matmul.append((-1, t.type_name, t.shape[1], t.nbytes))
        else:
            other += t.nbytes
    n_ff = _meta_int(md, key("feed_forward_length"), None) or ffn_rows or 4 * n_embd
    tokens = md.get("tokenizer.ggml.tokens")
    n_vocab = len(tokens) if isinstance(tokens, list) and tokens else 0
    if not n_vocab:
        n_vocab = (embd_shape[1] if embd else 0)
    merges = md.get("tokenizer.ggml.merges")
    scores = md.get("tokenizer.ggml.scores")
    return ModelFootprint(
        name=name or (md.get("general.name") if isinstance(md.get("general.name"), str) else None)
        or os.path.basename(g.path),
        path=g.path,
        architecture=arch,
        file_size=g.file_size,
        n_layer=n_layer,
        n_embd=n_embd,
        n_ff=n_ff,
        n_head=n_head,
        n_head_kv=max(hkv) if hkv else n_head,
        head_dim_k=dk,
        head_dim_v=dv,
        n_vocab=n_vocab,
        n_merges=len(merges) if isinstance(merges, list) else 0,
        n_scores=len(scores) if isinstance(scores, list) else 0,
        n_ctx_train=_meta_int(md, key("context_length"), 0) or 0,
        n_swa=_meta_int(md, key("attention.sliding_window"), 0) or 0,
        tied_output=output == 0,
        layer_bytes=tuple(layer_bytes),
        embd_bytes=embd,
        output_bytes=output,
        other_bytes=other,
        kv_elems_per_token=tuple(h * (dk + dv) for h in hkv),
        matmul_weights=tuple(matmul),
        tokenizer_fingerprint=gguf_mod.tokenizer_fingerprint(g),
    )


# =============================================================================================
# Contexts
# =============================================================================================

@dataclass(frozen=True)
class ContextFootprint:
    """Bytes of one llama.cpp context over a model (all layers on the CPU)."""

    n_ctx: int
    n_cells: int              # the KV cache's size: n_ctx padded to 256
    n_batch: int
    n_ubatch: int             # effective micro-batch: min(n_ubatch, n_batch, n_ctx)
    n_seq: int
    n_outputs: int            # most logits rows one decode returns (verification)
    n_outputs_max: int        # what the context allows (LlamaContext: n_batch)
    kv_type: str
    flash_attn: bool
    kv_bytes: int
    compute_layer: int        # peak of one transformer block's graph
    compute_reserved: int     # the compute buffer llama.cpp allocates and reports
    compute_bytes: int        # the part of it the engine's batches touch (resident)
    work_bytes: int           # ggml's CPU work buffer (quantized activations)
    output_reported: int      # output buffer at creation (n_seq rows)
    output_bytes: int         # output buffer after the largest verification

    @property
    def resident_bytes(self) -> int:
        return self.kv_bytes + self.compute_bytes + self.work_bytes + self.output_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d["resident_bytes"] = self.resident_bytes
        return d


def _layer_stage(fp: ModelFootprint, ub: int, n_kv: int, flash_attn: bool) -> int:
    masks = 2 if fp.n_swa else 1
    q = fp.n_head * fp.head_dim_k
    ffn = 4 * (3 * fp.n_ff + 3 * fp.n_embd + q)
    if flash_attn:
        return ub * (ffn + 2 * masks * n_kv + 32)
    attn = (4 * fp.n_head + 4) * n_kv + 4 * (5 * fp.n_embd + 1024)
    return ub * max(ffn + 4 * masks * n_kv, attn)


def _logits_stage(fp: ModelFootprint, n_out: int, ub: int) -> int:
    return 4 * n_out * (fp.n_vocab + 2 * fp.n_embd) + (6 * ub * fp.n_embd if n_out < ub else 0)


def estimate_context(footprint: ModelFootprint, n_ctx: int, n_ubatch: int = 512, n_seq: int = 1,
                     kv_type: str = "f16", flash_attn: bool = True, *, n_batch: int = ENGINE_N_BATCH,
                     n_outputs: int = 1, n_outputs_max: int | None = None) -> ContextFootprint:
    """Sizes a context: KV cache, compute buffer, work buffer and output (logits) buffer.

    ``n_outputs`` is the largest number of logits rows one decode asks for (the engine's
    verification batches: ``draft_max + 1``); ``n_outputs_max`` what the context allows
    (``LlamaContext`` sets it to ``n_batch``), which sizes llama.cpp's reservation.
    Raises InvalidRequest for an unknown cache type or a quantized cache without flash
    attention (llama.cpp refuses to create that context).
    """
    if kv_type not in KV_TYPES:
        raise InvalidRequest(f"KV cache type must be one of {', '.join(KV_TYPES)}, got {kv_type!r}")
    if kv_type != "f16" and not flash_attn:
        raise InvalidRequest(f"a {kv_type} KV cache needs flash attention (llama.cpp refuses it without)")
    if n_ctx < 1 or n_ubatch < 1 or n_seq < 1 or n_batch < 1:
        raise InvalidRequest("n_ctx, n_ubatch, n_seq and n_batch must be positive")
    cells = _pad(n_ctx, 256)
    batch = min(n_batch, n_ctx)
    ub = min(n_ubatch, batch)
    out_max = max(n_outputs_max if n_outputs_max is not None else n_batch, n_seq)
    n_out = min(max(n_outputs, 1), ub)
    layer = _layer_stage(footprint, ub, cells, flash_attn)
    reserved = max(layer, _logits_stage(footprint, min(out_max, ub), ub))
    touched = max(layer, 4 * n_out * (footprint.n_vocab + 2 * footprint.n_embd))
    q = footprint.n_head * footprint.head_dim_k
    work = int(ub * max(footprint.n_ff, footprint.n_embd, q) * 1.14) + MiB
    row = 4 * footprint.n_vocab
    return ContextFootprint(
        n_ctx=n_ctx, n_cells=cells, n_batch=batch, n_ubatch=ub, n_seq=n_seq, n_outputs=n_out,
        n_outputs_max=out_max, kv_type=kv_type, flash_attn=flash_attn,
        kv_bytes=cells * footprint.kv_bytes_per_token(kv_type),
        compute_layer=layer, compute_reserved=reserved, compute_bytes=min(touched, reserved),
        work_bytes=work, output_reported=n_seq * row, output_bytes=max(n_seq, n_out) * row,
    )


# =============================================================================================
# The machine
# =============================================================================================

@dataclass(frozen=True)
class GPUDevice:
    name: str
    description: str
    type: str                 # "gpu" or "igpu"
    memory_free: int
    memory_total: int


@dataclass(frozen=True)
class MachineInfo:
    """RAM, cores and accelerators as psutil and the installed llama.cpp build see them."""

    ram_total: int
    ram_available: int
    physical_cores: int
    logical_cores: int
    usable_cpus: int          # CPUs this process may run on (affinity, cgroup cpusets)
    cpu_features: frozenset = frozenset()
    gpu_offload: bool = False
    gpus: tuple[GPUDevice, ...] = ()
    unified_memory: bool = False   # GPU memory is the same RAM (Jetson, Apple silicon, iGPUs)
    mmap_supported: bool = True
    mlock_supported: bool = True
    memlock_limit: int | None = None   # RLIMIT_MEMLOCK in bytes; None: unlimited
    privileged: bool = False           # root may lock any amount

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cpu_features"] = sorted(self.cpu_features)
        return d


def _features(system_info: str) -> frozenset:
    return frozenset(m.group(1) for m in re.finditer(r"([A-Z0-9_]+) = 1", system_info))


def _is_unified(gpus: list[dict]) -> bool:
    if any(d.get("type") == "igpu" for d in gpus):
        return True
    if os.path.exists("/etc/nv_tegra_release"):
        return True
    try:
        with open("/proc/device-tree/model", "rb") as f:
            model = f.read().decode(errors="replace").lower()
        if "jetson" in model or "tegra" in model:
            return True
    except OSError:
        pass
    import platform

    return platform.system() == "Darwin" and platform.machine() == "arm64" and bool(gpus)


def machine() -> MachineInfo:
    """Reads this machine: RAM (available, not free), cores, llama.cpp's devices and limits."""
    import psutil

    from edgespec import backend

    vm = psutil.virtual_memory()
    info = backend.system_info()
    gpus = [d for d in info.get("devices", []) if d.get("type") in ("gpu", "igpu")]
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = psutil.cpu_count(logical=True) or 1
    limit: int | None = None
    try:
        import resource

        soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        limit = None if soft == resource.RLIM_INFINITY else int(soft)
    except (ImportError, OSError, ValueError):
        limit = 0
    return MachineInfo(
        ram_total=int(vm.total),
        # Unified-memory boards share RAM with the GPU: "available" (free + reclaimable
        # caches) is what can be had, "free" is not.
        ram_available=int(vm.available),
        physical_cores=int(psutil.cpu_count(logical=False) or os.cpu_count() or 1),
        logical_cores=int(psutil.cpu_count(logical=True) or os.cpu_count() or 1),
        usable_cpus=usable,
        cpu_features=_features(info.get("system_info", "")),
        gpu_offload=bool(info.get("gpu_offload")),
        gpus=tuple(GPUDevice(d["name"], d.get("description", ""), d["type"], int(d["memory_free"]),
                             int(d["memory_total"])) for d in gpus) if info.get("gpu_offload") else (),
        unified_memory=_is_unified(gpus),
        mmap_supported=bool(info.get("mmap", True)),
        mlock_supported=bool(info.get("mlock", False)),
        memlock_limit=limit,
        privileged=hasattr(os, "geteuid") and os.geteuid() == 0,
    )


def default_ram_budget(m: MachineInfo) -> int:
    """Available RAM minus a margin of 5% of the total (at least 256 MiB)."""
    return max(0, m.ram_available - max(BUDGET_MARGIN_MIN, int(BUDGET_MARGIN_FRACTION * m.ram_total)))


def default_vram_budget(m: MachineInfo) -> int:
    """Free memory of the first GPU minus 5% of its total (at least 256 MiB); 0 without one."""
    if not m.gpus:
        return 0
    g = m.gpus[0]
    return max(0, g.memory_free - max(BUDGET_MARGIN_MIN, int(BUDGET_MARGIN_FRACTION * g.memory_total)))


def default_threads(m: MachineInfo) -> int:
    return max(1, min(m.physical_cores, m.usable_cpus))


# =============================================================================================
# Plans
# =============================================================================================

@dataclass(frozen=True)
class Part:
    """One line of a plan: what, where, how many bytes, and why."""

    component: str
    where: str                # "RAM", "GPU0", "file" (page cache, outside the budget), "-"
    bytes: int
    note: str = ""


@dataclass(frozen=True)
class Decision:
    name: str
    value: object
    why: str


@dataclass
class Plan:
    """A placement of the target (and drafters) within the budgets, with its reasons."""

    target: str
    drafter: str | None
    n_ctx: int
    n_ctx_train: int
    n_batch: int
    n_ubatch: int
    n_seq_max: int
    kv_type: str
    flash_attn: bool
    n_gpu_layers: int
    weights_mode: str              # "resident" | "file-backed"
    use_mmap: bool
    repack: bool
    use_mlock: bool
    drafter_placement: str         # "gpu" | "cpu" | "none"
    drafter_n_gpu_layers: int
    drafter_use_mmap: bool
    suffix_drafter: bool
    suffix_cap_tokens: int
    threads: int
    threads_batch: int
    ram_budget: int
    vram_budget: int
    ram_bytes: int                 # planned resident RAM (parts on "RAM" summed)
    vram_bytes: int
    file_backed_bytes: int         # weights left in the mapped file (not resident)
    parts: list[Part] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    llama_cpp_reports: dict = field(default_factory=dict)  # what llama.cpp's log will say
    warnings: list[str] = field(default_factory=list)

    @property
    def reasons(self) -> list[str]:
        return [f"{d.name}: {d.value} - {d.why}" for d in self.decisions]

    def engine_settings(self) -> dict:
        """What the engine should be configured with (some knobs are not wired yet)."""
        return {
            "n_ctx": self.n_ctx, "n_threads": self.threads, "n_gpu_layers": self.n_gpu_layers,
            "use_mmap": self.use_mmap, "use_mlock": self.use_mlock,
            "draft": ("hybrid" if self.suffix_drafter else "model") if self.drafter_placement != "none"
            else ("suffix" if self.suffix_drafter else "none"),
            "draft_model": self.drafter if self.drafter_placement != "none" else None,
            # not in EngineConfig / ContextParams / ModelParams yet:
            "n_batch": self.n_batch, "n_ubatch": self.n_ubatch, "kv_type": self.kv_type,
            "type_k": KV_TYPE_IDS[self.kv_type], "type_v": KV_TYPE_IDS[self.kv_type],
            "flash_attn": self.flash_attn, "repack": self.repack, "weights_mode": self.weights_mode,
            "drafter_n_gpu_layers": self.drafter_n_gpu_layers, "drafter_use_mmap": self.drafter_use_mmap,
            "suffix_max_history_tokens": self.suffix_cap_tokens,
        }

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("parts", "decisions")}
        d["parts"] = [asdict(p) for p in self.parts]
        d["decisions"] = [{"name": x.name, "value": x.value, "why": x.why} for x in self.decisions]
        d["reasons"] = self.reasons
        d["engine"] = self.engine_settings()
        return d


@dataclass(frozen=True)
class _Cfg:
    resident: bool
    repack: bool
    kv_type: str
    n_ubatch: int
    n_ctx: int
    drafter: str          # "gpu" | "cpu" | "none"
    suffix_cap: int       # 0: no suffix drafter


@dataclass
class _Eval:
    cfg: _Cfg
    fits: bool
    ram: int
    vram: int
    penalty: float
    parts: list[Part]
    ngl: int
    drafter_ngl: int
    use_mmap: bool
    drafter_mmap: bool
    repack_active: bool
    target_ctx: ContextFootprint
    drafter_ctx: ContextFootprint | None
    repack_bytes: int
    file_bytes: int


class _Planner:
    def __init__(self, target: ModelFootprint, drafter: ModelFootprint | None, m: MachineInfo,
                 ram_budget: int, vram_budget: int, suffix: bool, draft_max: int, draft_tree: bool,
                 mmap: bool | None, repack: bool | None, flash_attn: bool):
        self.t, self.d, self.m = target, drafter, m
        self.ram_budget, self.vram_budget = ram_budget, vram_budget
        self.suffix, self.draft_max, self.draft_tree = suffix, draft_max, draft_tree
        self.force_mmap, self.force_repack, self.flash_attn = mmap, repack, flash_attn
        self.gpu = bool(m.gpus) and m.gpu_offload and vram_budget > 0
        self.feats = m.cpu_features
        self._repack_memo: dict[tuple, int] = {}

    def _repack(self, fp: ModelFootprint, n_cpu_blocks: int, head: bool) -> int:
        k = (id(fp), n_cpu_blocks, head)
        if k not in self._repack_memo:
            self._repack_memo[k] = fp.repack_bytes(self.feats, range(n_cpu_blocks), head=head)
        return self._repack_memo[k]

    # -- pieces -------------------------------------------------------------------------------
    def _drafting(self, cfg: _Cfg) -> bool:
        return cfg.suffix_cap > 0 or cfg.drafter != "none"

    def _target_ctx(self, cfg: _Cfg) -> ContextFootprint:
        drafting = self._drafting(cfg)
        return estimate_context(self.t, cfg.n_ctx, cfg.n_ubatch, 1 + self.draft_max if drafting else 1,
                                cfg.kv_type, self.flash_attn, n_outputs=self.draft_max + 1 if drafting else 1)

    def _drafter_ctx(self, cfg: _Cfg) -> ContextFootprint:
        seqs = MODEL_TREE_SEQS if self.draft_tree else 1
        return estimate_context(self.d, cfg.n_ctx, cfg.n_ubatch, seqs, cfg.kv_type, self.flash_attn,
                                n_outputs=seqs)

    def _gpu_need(self, fp: ModelFootprint, cf: ContextFootprint, k: int, runtime: bool) -> int:
        """VRAM for ``n_gpu_layers = k``: head + last k-1 blocks, their KV, compute buffer."""
        if k <= 0:
            return 0
        blocks = range(fp.n_layer - min(k - 1, fp.n_layer), fp.n_layer)
        weights = fp.head_bytes + sum(fp.layer_bytes[i] for i in blocks)
        kv = cf.n_cells * fp.kv_bytes_per_token(cf.kv_type, blocks)
        compute = 4 * cf.n_outputs * (fp.n_vocab + 2 * fp.n_embd)
        if len(blocks):
            compute = max(compute, cf.compute_layer)
        return weights + kv + compute + (GPU_RUNTIME_BYTES if runtime else 0)

    def _model_ram(self, fp: ModelFootprint, cf: ContextFootprint, k: int, resident: bool,
                   repack: bool, label: str) -> tuple[list[Part], bool, bool, int, int]:
        """RAM parts of one model with k layers on the GPU; returns parts, mmap, repack, repack bytes,
        file-backed bytes."""
        n_cpu_blocks = fp.n_layer - min(max(k - 1, 0), fp.n_layer)
        cpu_blocks = range(n_cpu_blocks)
        head_on_cpu = k == 0
        cpu_weights = fp.embd_bytes + fp.other_bytes + sum(fp.layer_bytes[i] for i in cpu_blocks) \
            + (fp.output_bytes if head_on_cpu else 0)
        parts: list[Part] = []
        file_bytes = 0
        rp = self._repack(fp, n_cpu_blocks, head_on_cpu) if repack and resident else 0
        if resident:
            if self.force_mmap is not None:
                use_mmap = self.force_mmap and self.m.mmap_supported
            else:
                use_mmap = self.m.mmap_supported and rp == 0
            if use_mmap:
                parts.append(Part(f"{label} weights", "RAM", cpu_weights,
                                  "mapped from the file, all pages resident"))
                if rp:
                    parts.append(Part(f"{label} repacked weights", "RAM", rp,
                                      "CPU_REPACK copy for the interleaved kernels; the mapped originals stay resident too"))
            else:
                parts.append(Part(f"{label} weights", "RAM", cpu_weights - rp,
                                  "read into memory (full load)" if rp else "read into memory (no mmap)"))
                if rp:
                    parts.append(Part(f"{label} repacked weights", "RAM", rp,
                                      "read straight into the CPU_REPACK buffer (no second copy without mmap)"))
        else:
            use_mmap = True
            row = fp.embd_bytes // max(fp.n_vocab, 1)
            head = fp.head_bytes if head_on_cpu else 0
            embd_rows = 0 if (fp.tied_output and head_on_cpu) else min(fp.embd_bytes, 2 * cf.n_ubatch * row)
            max_block = max((fp.layer_bytes[i] for i in cpu_blocks), default=0)
            ws = 2 * max_block + head + embd_rows + fp.other_bytes
            parts.append(Part(f"{label} weights (working set)", "RAM", ws,
                              f"2 x largest layer ({fmt_bytes(max_block)}) + output head ({fmt_bytes(head)})"
                              " + embedding rows of one batch; dropped from memory layer by layer"))
            file_bytes = cpu_weights
            parts.append(Part(f"{label} weights (in the file)", "file", cpu_weights,
                              "stay in the mapped file, read again each token (page cache, not budgeted)"))
        parts.append(Part(f"{label} vocabulary & metadata", "RAM", fp.runtime_bytes,
                          f"{fp.n_vocab} tokens, {fp.n_merges} merges"))
        cpu_kv = cf.n_cells * fp.kv_bytes_per_token(cf.kv_type, cpu_blocks)
        parts.append(Part(f"{label} KV cache", "RAM", cpu_kv,
                          f"{cf.kv_type}, {cf.n_cells} cells x {n_cpu_blocks} layers"))
        if k == 0:
            compute = cf.compute_bytes
        elif n_cpu_blocks:
            compute = cf.compute_layer
        else:
            compute = 8 * cf.n_ubatch * fp.n_embd  # the input embeddings only
        parts.append(Part(f"{label} compute buffer", "RAM", compute,
                          f"n_ubatch {cf.n_ubatch}; llama.cpp reserves {fmt_bytes(cf.compute_reserved)}"
                          f" for {cf.n_outputs_max} logits rows, the engine touches this much"))
        parts.append(Part(f"{label} work buffer", "RAM", cf.work_bytes if (k == 0 or n_cpu_blocks) else MiB,
                          "quantized activations for the CPU kernels"))
        parts.append(Part(f"{label} logits buffer", "RAM", cf.output_bytes,
                          f"{max(cf.n_seq, cf.n_outputs)} rows x {fp.n_vocab} floats"))
        return parts, use_mmap, bool(rp), rp, file_bytes

    # -- one configuration ----------------------------------------------------------------------
    def evaluate(self, cfg: _Cfg) -> _Eval:
        t = self.t
        tc = self._target_ctx(cfg)
        parts: list[Part] = [Part("process (Python, libraries)", "RAM", PROCESS_BASE_BYTES, "baseline")]
        # Target layers on the GPU: as many as the VRAM budget holds (head first, then the last
        # blocks, as llama.cpp assigns them).
        ngl = 0
        if self.gpu and cfg.resident:
            for k in range(t.n_layer + 1, 0, -1):
                if self._gpu_need(t, tc, k, True) <= self.vram_budget:
                    ngl = k
                    break
        vram = self._gpu_need(t, tc, ngl, True)
        gname = self.m.gpus[0].name if self.m.gpus else "GPU"
        if ngl:
            parts.append(Part("target layers on GPU", gname, vram,
                              f"{ngl}/{t.n_layer + 1} layers (head + {ngl - 1} blocks) with their KV cache "
                              f"and compute buffer, + {fmt_bytes(GPU_RUNTIME_BYTES)} runtime"))
        tparts, use_mmap, rp_on, rp_bytes, file_bytes = self._model_ram(
            t, tc, ngl, cfg.resident, cfg.repack, "target")
        parts += tparts
        dc = None
        dngl = 0
        d_mmap = False
        if cfg.drafter != "none" and self.d is not None:
            dc = self._drafter_ctx(cfg)
            if cfg.drafter == "gpu":
                dngl = self.d.n_layer + 1
                dv = self._gpu_need(self.d, dc, dngl, False)
                vram += dv
                parts.append(Part("drafter on GPU", gname, dv, "all layers, KV cache and compute buffer"))
            dparts, d_mmap, _, _, _ = self._model_ram(self.d, dc, dngl, True, cfg.repack, "drafter")
            parts += dparts
        if cfg.suffix_cap:
            parts.append(Part("suffix index", "RAM", SUFFIX_BYTES_PER_TOKEN * (cfg.suffix_cap + cfg.n_ctx),
                              f"history cap {cfg.suffix_cap} tokens + the current context, "
                              f"~{SUFFIX_BYTES_PER_TOKEN} B/token"))
        ram = sum(p.bytes for p in parts if p.where == "RAM")
        if self.m.unified_memory:
            ram += vram  # one pool: GPU allocations come out of the same RAM
        fits = ram <= self.ram_budget and vram <= max(self.vram_budget, 0)
        if cfg.drafter == "gpu" and ngl < t.n_layer + 1:
            fits = False  # the drafter gets the GPU only once the whole target is there
        penalty = self._penalty(cfg, ngl)
        return _Eval(cfg, fits, ram, vram, penalty, parts, ngl, dngl, use_mmap, d_mmap, rp_on, tc, dc,
                     rp_bytes, file_bytes)

    def _penalty(self, cfg: _Cfg, ngl: int) -> float:
        p = 0.0
        if not cfg.resident:
            p += 1000
        p += {"f16": 0, "q8_0": 10, "q4_0": 40}[cfg.kv_type]
        p += {512: 0, 256: 2, 128: 5, 64: 12}.get(cfg.n_ubatch, 12)
        if self.d is not None:
            p += {"gpu": 0, "cpu": 1 if self.gpu else 0, "none": 25}[cfg.drafter]
        if cfg.suffix_cap:
            p += SUFFIX_CAPS.index(cfg.suffix_cap)
        if not cfg.repack and self._repack(self.t, self.t.n_layer, True):
            p += 3
        if self.gpu:
            p += 200 * (1 - ngl / (self.t.n_layer + 1))
        return p


def _ctx_options(n_ctx: int | None, n_ctx_train: int) -> list[int]:
    if n_ctx is not None:
        return [n_ctx]
    top = min(DEFAULT_CTX, n_ctx_train) if n_ctx_train else DEFAULT_CTX
    out = [top]
    while out[-1] // 2 >= 512:
        out.append(out[-1] // 2)
    return out


def _describe(cfg: _Cfg, has_drafter: bool) -> str:
    bits = ["resident weights" if cfg.resident else "file-backed weights", f"{cfg.kv_type} KV cache",
            f"n_ubatch {cfg.n_ubatch}"]
    if has_drafter:
        bits.append("no model drafter" if cfg.drafter == "none" else f"drafter on {cfg.drafter.upper()}")
    if cfg.suffix_cap:
        bits.append(f"suffix cap {cfg.suffix_cap} tokens")
    return ", ".join(bits)


def make_plan(target: ModelFootprint, drafter: ModelFootprint | None = None, ram_budget: int | None = None,
              vram_budget: int | None = None, n_ctx: int | None = None, *, machine_info: MachineInfo | None = None,
              suffix: bool = True, draft_max: int = 32, draft_tree: bool = False, mlock: bool = False,
              kv_type: str | None = None, n_ubatch: int | None = None, mmap: bool | None = None,
              repack: bool | None = None, threads: int | None = None) -> Plan:
    """Chooses a placement for ``target`` (+ ``drafter`` and the suffix drafter) within the budgets.

    Args:
        target, drafter: footprints from :func:`estimate_model`; ``drafter=None``: no model drafter.
        ram_budget, vram_budget: bytes; None: what is available minus a margin.
        n_ctx: context tokens; None: the engine default (4096, at most the trained context),
            halved while it does not fit (down to 512).
        suffix: whether the suffix drafter runs (budgets its index).
        kv_type, n_ubatch, mmap, repack: force a choice instead of letting the planner pick.
        mlock: lock the weights in RAM (only when possible; otherwise stated and off).
    Raises:
        InvalidRequest: a context above the trained context, or out-of-range arguments.
        BudgetExceeded: no placement fits; the message names the smallest budget that would.
    """
    m = machine_info or machine()
    if n_ctx is not None:
        if n_ctx < 16:
            raise InvalidRequest(f"context size {n_ctx} is too small (minimum 16)")
        if target.n_ctx_train and n_ctx > target.n_ctx_train:
            raise InvalidRequest(f"context {n_ctx} exceeds the trained context {target.n_ctx_train} of "
                                 f"{target.name}; use --ctx {target.n_ctx_train} or less")
    if kv_type is not None and kv_type not in KV_TYPES:
        raise InvalidRequest(f"KV cache type must be one of {', '.join(KV_TYPES)}, got {kv_type!r}")
    if n_ubatch is not None and not 1 <= n_ubatch <= ENGINE_N_BATCH:
        raise InvalidRequest(f"n_ubatch must be in [1, {ENGINE_N_BATCH}], got {n_ubatch}")
    if not 1 <= draft_max <= 64:
        raise InvalidRequest(f"draft_max must be in [1, 64], got {draft_max}")
    ram_given = ram_budget is not None
    vram_given = vram_budget is not None
    if ram_budget is None:
        ram_budget = default_ram_budget(m)
    if vram_budget is None:
        vram_budget = ram_budget if m.unified_memory and m.gpus else default_vram_budget(m)
    if ram_budget <= 0:
        raise BudgetExceeded(f"no RAM budget: {fmt_bytes(m.ram_available)} available, less than the "
                             "safety margin; pass --ram-budget")
    flash_attn = True  # llama.cpp enables it on the CPU and on CUDA/Metal; quantized V needs it
    pl = _Planner(target, drafter, m, ram_budget, vram_budget, suffix, draft_max, draft_tree, mmap, repack,
                  flash_attn)

    can_repack = target.repack_bytes(m.cpu_features) > 0 or (
        drafter is not None and drafter.repack_bytes(m.cpu_features) > 0)
    repack_opts = [repack] if repack is not None else ([True, False] if can_repack else [False])
    resident_opts = [True, False] if m.mmap_supported and mmap is not False else [True]
    kv_opts = [kv_type] if kv_type else list(KV_TYPES)
    ub_opts = [n_ubatch] if n_ubatch else list(UBATCH_CHOICES)
    ctx_opts = _ctx_options(n_ctx, target.n_ctx_train)
    drafter_opts = (["gpu", "cpu", "none"] if pl.gpu else ["cpu", "none"]) if drafter is not None else ["none"]
    suffix_opts = list(SUFFIX_CAPS) if suffix else [0]

    evals: list[_Eval] = []
    for resident, rp, kv, ub, ctx, dr, sc in product(resident_opts, repack_opts, kv_opts, ub_opts, ctx_opts,
                                                     drafter_opts, suffix_opts):
        if not resident and (rp or dr != "none"):
            continue  # file-backed weights: no repacked copy, no drafter model
        cfg = _Cfg(resident, rp, kv, ub, ctx, dr, sc)
        e = pl.evaluate(cfg)
        e.penalty += 30 * ctx_opts.index(ctx)
        evals.append(e)
    fitting = [e for e in evals if e.fits]
    if not fitting:
        msg, smallest = _refusal(pl, evals, target, drafter, n_ctx, ctx_opts, ram_given)
        err = BudgetExceeded(msg)
        err.smallest_budget = smallest  # bytes: the least RAM budget any plan at this context fits in
        raise err
    best = min(fitting, key=lambda e: (e.penalty, e.ram))
    return _build_plan(pl, best, evals, target, drafter, m, ram_given, vram_given, n_ctx, mlock, threads)


def _refusal(pl: _Planner, evals: list[_Eval], target: ModelFootprint, drafter: ModelFootprint | None,
             n_ctx: int | None, ctx_opts: list[int], ram_given: bool) -> tuple[str, int]:
    ctx = ctx_opts[0] if n_ctx is not None else ctx_opts[-1]
    at_ctx = [e for e in evals if e.cfg.n_ctx == ctx]
    low = min(at_ctx, key=lambda e: (e.ram, e.penalty))
    # The largest context that the budget holds with the leanest settings.
    lean = low.cfg
    fit_ctx = 0
    lo, hi = 1, ctx // 256  # in units of 256 tokens
    while lo <= hi:
        mid = (lo + hi) // 2
        if pl.evaluate(replace(lean, n_ctx=mid * 256)).fits:
            fit_ctx, lo = mid * 256, mid + 1
        else:
            hi = mid - 1
    where = "--ram-budget" if ram_given else "free memory (or pass --ram-budget)"
    msg = (f"RAM budget {fmt_bytes(pl.ram_budget)} is too small for {target.name} with a {ctx}-token context: "
           f"the smallest plan needs {fmt_bytes(low.ram)} ({_describe(lean, drafter is not None)}); "
           f"raise {where} to at least {fmt_bytes(low.ram)}")
    if fit_ctx and fit_ctx < ctx:
        msg += f" or use --ctx {fit_ctx}"
    elif not fit_ctx:
        smallest = pl.evaluate(replace(lean, n_ctx=256))
        msg += f" (even --ctx 256 needs {fmt_bytes(smallest.ram)})"
    return msg, low.ram


def _build_plan(pl: _Planner, e: _Eval, evals: list[_Eval], target: ModelFootprint,
                drafter: ModelFootprint | None, m: MachineInfo, ram_given: bool, vram_given: bool,
                n_ctx: int | None, mlock: bool, threads: int | None) -> Plan:
    cfg = e.cfg
    by_cfg = {x.cfg: x for x in evals}
    dec: list[Decision] = []
    warnings: list[str] = []

    def alt(**kw) -> str:
        other = by_cfg.get(replace(cfg, **kw)) or pl.evaluate(replace(cfg, **kw))
        s = f"would need {fmt_bytes(other.ram)} of RAM with the rest of this plan"
        if other.vram:
            s += f" and {fmt_bytes(other.vram)} of VRAM"
        return s + f" (budget {fmt_bytes(pl.ram_budget)})"

    # Budgets
    if ram_given:
        dec.append(Decision("ram_budget", fmt_bytes(pl.ram_budget), "given"))
    else:
        dec.append(Decision("ram_budget", fmt_bytes(pl.ram_budget),
                            f"{fmt_bytes(m.ram_available)} available (free + reclaimable cache) of "
                            f"{fmt_bytes(m.ram_total)}, minus a margin of 5% of the total (at least 256 MiB)"))
    if m.gpus:
        why = "given" if vram_given else (
            "unified memory: the GPU draws on the same RAM, so the RAM budget bounds both" if m.unified_memory
            else f"{fmt_bytes(m.gpus[0].memory_free)} free on {m.gpus[0].name} minus a margin")
        dec.append(Decision("vram_budget", fmt_bytes(pl.vram_budget), why))

    # GPU layers
    if not m.gpu_offload or not m.gpus:
        why = "this llama.cpp build has no GPU offload (CPU-only)" if not m.gpu_offload else \
            "llama.cpp reports no GPU device"
        if vram_given:
            warnings.append("--vram-budget ignored: " + why)
        dec.append(Decision("n_gpu_layers", 0, why))
    elif not cfg.resident:
        dec.append(Decision("n_gpu_layers", 0, "file-backed weights stay on the CPU"))
    elif e.ngl == target.n_layer + 1:
        dec.append(Decision("n_gpu_layers", e.ngl, f"all {target.n_layer} blocks and the output head fit in "
                            f"{fmt_bytes(pl.vram_budget)} of VRAM ({fmt_bytes(e.vram)} planned)"))
    else:
        nxt = pl._gpu_need(target, e.target_ctx, e.ngl + 1, True)
        dec.append(Decision("n_gpu_layers", e.ngl,
                            f"one more layer would need {fmt_bytes(nxt)} of VRAM, over the budget "
                            f"{fmt_bytes(pl.vram_budget)}; the other layers run on the CPU"))

    # Weights mode, mmap, repack
    weights = target.weights_bytes
    if cfg.resident:
        dec.append(Decision("weights", "resident",
                            f"the weights ({fmt_bytes(weights)}) fit in RAM with the rest of the plan"))
    else:
        res_min = min((x.ram for x in evals if x.cfg.resident and x.cfg.n_ctx == cfg.n_ctx), default=0)
        dec.append(Decision("weights", "file-backed",
                            f"fully resident weights would need at least {fmt_bytes(res_min)} of RAM with the "
                            f"leanest settings (budget {fmt_bytes(pl.ram_budget)}): the weights stay in the "
                            "mapped file and only a working set of about two layers plus the output head is "
                            "kept resident; decoding will be bound by storage reads"))
    rp_all = target.repack_bytes(m.cpu_features)
    if e.use_mmap:
        why = "weights are mapped from the file: shared with the page cache, loaded on demand"
        if not cfg.resident:
            why = "file-backed weights need the mapping (pages are dropped and re-read)"
        elif e.repack_active:
            why = f"forced: note that mmap + repacking keeps both copies resident (+{fmt_bytes(e.repack_bytes)})"
        dec.append(Decision("load", "mmap", why))
    elif not m.mmap_supported:
        dec.append(Decision("load", "full load", "this llama.cpp build cannot mmap"))
    elif e.repack_active:
        dec.append(Decision("load", "full load (no mmap)",
                            f"llama.cpp repacks {fmt_bytes(e.repack_bytes)} of the weights for this CPU; with mmap "
                            "the mapped originals would stay resident as well (+"
                            f"{fmt_bytes(e.repack_bytes)}), a full load reads them straight into the repacked buffer"))
    else:
        dec.append(Decision("load", "full load (no mmap)", "forced"))
    if rp_all == 0:
        dec.append(Decision("repack", False, "no weight of this model has an interleaved kernel on this CPU "
                            f"({'REPACK' in m.cpu_features and 'build supports repacking' or 'build without repacking'})"))
    elif cfg.repack:
        dec.append(Decision("repack", True, f"{fmt_bytes(e.repack_bytes)} of weights use the faster interleaved "
                            "CPU kernels (llama.cpp's CPU_REPACK buffer, use_extra_bufts)"))
    else:
        why = ("file-backed weights must stay in the file: a repacked copy would be anonymous memory"
               if not cfg.resident else
               f"disabled; with it the plan {alt(repack=True)}" if pl.force_repack is None else "forced off")
        dec.append(Decision("repack", False, why + f" (repacking costs {fmt_bytes(rp_all)})"))

    # mlock
    use_mlock = False
    if not mlock:
        dec.append(Decision("mlock", False, "not requested"))
    elif not cfg.resident:
        dec.append(Decision("mlock", False, "requested, but file-backed weights must stay evictable"))
        warnings.append("mlock ignored: file-backed weights")
    elif not m.mlock_supported:
        dec.append(Decision("mlock", False, "requested, but this llama.cpp build cannot lock memory"))
        warnings.append("mlock ignored: not supported by the llama.cpp build")
    else:
        locked = sum(p.bytes for p in e.parts if p.where == "RAM" and "weights" in p.component)
        if m.privileged or m.memlock_limit is None or m.memlock_limit >= locked:
            use_mlock = True
            dec.append(Decision("mlock", True, f"requested; locks {fmt_bytes(locked)} of weights "
                                "(the limit allows it)"))
        else:
            dec.append(Decision("mlock", False, f"requested, but RLIMIT_MEMLOCK is {fmt_bytes(m.memlock_limit)} < "
                                f"{fmt_bytes(locked)} of weights; raise it (ulimit -l) to lock"))
            warnings.append("mlock ignored: RLIMIT_MEMLOCK too low")

    # Context
    tc = e.target_ctx
    if n_ctx is not None:
        dec.append(Decision("n_ctx", cfg.n_ctx, f"requested (trained context {target.n_ctx_train})"))
    else:
        top = _ctx_options(None, target.n_ctx_train)[0]
        if cfg.n_ctx == top:
            dec.append(Decision("n_ctx", cfg.n_ctx, f"engine default (trained context {target.n_ctx_train})"))
        else:
            dec.append(Decision("n_ctx", cfg.n_ctx, f"capped: a {top}-token context {alt(n_ctx=top)}"))
    # KV cache type
    if cfg.kv_type == "f16":
        dec.append(Decision("kv_type", "f16", f"full precision fits ({fmt_bytes(tc.kv_bytes)} for "
                            f"{tc.n_cells} cells)"))
    elif cfg.kv_type != "f16" and len({x.cfg.kv_type for x in evals}) > 1:
        dec.append(Decision("kv_type", cfg.kv_type, f"{fmt_bytes(tc.kv_bytes)}; an f16 cache {alt(kv_type='f16')}"
                            "; quantized caches need flash attention (on)"))
    else:
        dec.append(Decision("kv_type", cfg.kv_type, "requested; quantized caches need flash attention (on)"))
    dec.append(Decision("flash_attn", True, "llama.cpp's default on CPU and GPUs; required by quantized V caches"))
    # Micro-batch
    if cfg.n_ubatch == UBATCH_CHOICES[0] or len({x.cfg.n_ubatch for x in evals}) == 1:
        dec.append(Decision("n_ubatch", tc.n_ubatch,
                            f"prefill in batches of {tc.n_batch}; compute buffer {fmt_bytes(tc.compute_bytes)} "
                            f"touched, {fmt_bytes(tc.compute_reserved)} reserved by llama.cpp"))
    else:
        dec.append(Decision("n_ubatch", tc.n_ubatch,
                            f"smaller micro-batches shrink the compute buffer to {fmt_bytes(tc.compute_bytes)}; "
                            f"n_ubatch 512 {alt(n_ubatch=512)}; only prefill gets slower"))
    # Drafters
    dname = drafter.name if drafter is not None else None
    if drafter is None:
        dec.append(Decision("drafter", "none", "no drafter model for this target (or not requested)"))
    elif cfg.drafter == "gpu":
        dec.append(Decision("drafter", "GPU", f"{dname} fits in VRAM next to the whole target"))
    elif cfg.drafter == "cpu":
        why = f"{dname} runs on the CPU next to the target (target + drafter fit the RAM budget)"
        if pl.gpu:
            why += "; it does not fit in VRAM next to the target"
        dec.append(Decision("drafter", "CPU", why))
    else:
        with_d = [x.ram for x in evals if x.cfg.drafter != "none" and x.cfg.n_ctx == cfg.n_ctx]
        need = f"the smallest plan with {dname} needs {fmt_bytes(min(with_d))} of RAM" if with_d else \
            f"{dname} cannot be placed"
        if not cfg.resident:
            why = f"the target's weights are file-backed, so a drafter model is out of reach ({need})"
        else:
            why = f"{need} (budget {fmt_bytes(pl.ram_budget)})"
        dec.append(Decision("drafter", "none (suffix drafter only)" if cfg.suffix_cap else "none", why))
        warnings.append(f"drafter {dname} dropped: it does not fit the budget")
    if cfg.suffix_cap:
        if cfg.suffix_cap == SUFFIX_DEFAULT_CAP:
            dec.append(Decision("suffix_cap", cfg.suffix_cap, "default history of earlier requests (~"
                                f"{fmt_bytes(SUFFIX_BYTES_PER_TOKEN * cfg.suffix_cap)})"))
        else:
            dec.append(Decision("suffix_cap", cfg.suffix_cap, f"reduced: the default cap {alt(suffix_cap=SUFFIX_DEFAULT_CAP)}"))
    # Threads
    n_thr = threads or default_threads(m)
    why = (f"physical cores ({m.physical_cores} of {m.logical_cores} logical): token generation is memory-bound "
           "and hyper-threads only add contention")
    if m.usable_cpus < m.physical_cores and not threads:
        why = f"the {m.usable_cpus} CPUs this process may use (affinity), fewer than the {m.physical_cores} physical cores"
    if threads:
        why = "requested"
    if drafter is not None and cfg.drafter == "cpu":
        why += "; the drafter takes turns with the target, so both use all of them"
    dec.append(Decision("threads", n_thr, why))

    dc = e.drafter_ctx
    reports = {
        "target": {
            "model": target.weights_bytes - (e.repack_bytes if not e.use_mmap else 0),
            "repack": e.repack_bytes, "kv": tc.kv_bytes, "compute": tc.compute_reserved,
            "output": tc.output_reported,
        },
    }
    if dc is not None:
        reports["drafter"] = {"kv": dc.kv_bytes, "compute": dc.compute_reserved, "output": dc.output_reported}
    ram = e.ram
    return Plan(
        target=target.name, drafter=dname if cfg.drafter != "none" else None, n_ctx=cfg.n_ctx,
        n_ctx_train=target.n_ctx_train, n_batch=tc.n_batch, n_ubatch=tc.n_ubatch, n_seq_max=tc.n_seq,
        kv_type=cfg.kv_type, flash_attn=True, n_gpu_layers=e.ngl,
        weights_mode="resident" if cfg.resident else "file-backed", use_mmap=e.use_mmap,
        repack=cfg.repack and e.repack_active, use_mlock=use_mlock, drafter_placement=cfg.drafter,
        drafter_n_gpu_layers=e.drafter_ngl, drafter_use_mmap=e.drafter_mmap, suffix_drafter=bool(cfg.suffix_cap), suffix_cap_tokens=cfg.suffix_cap,
        threads=n_thr, threads_batch=n_thr, ram_budget=pl.ram_budget, vram_budget=pl.vram_budget,
        ram_bytes=ram, vram_bytes=e.vram, file_backed_bytes=e.file_bytes, parts=e.parts, decisions=dec,
        llama_cpp_reports=reports, warnings=warnings,
    )
