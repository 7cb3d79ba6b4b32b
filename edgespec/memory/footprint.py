"""Footprints: what a model and a llama.cpp context over it cost, from GGUF metadata alone.

:func:`estimate_model` sizes a model's parts, :func:`estimate_context` a context over it; no
model is loaded.

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

  llama.cpp sizes the buffer for the worst graph it may be asked to run: a context allows
  ``n_outputs_max`` rows of logits (n_batch unless told: 512 rows x V floats, 302.75 MiB for the
  1.5B target). The engine's target context allows placements.VERIFY_ROWS (65), its largest
  verification; prefill asks for one row, a verification for ``draft_max + 1``. On a CPU build
  untouched pages of that reservation are never resident; the plan budgets the touched part and
  reports the reserved one. A CUDA build gives the CPU's compute buffer CUDA's pinned host buffer
  type (unless GGML_CUDA_NO_PINNED), resident in full, so a model wholly on the CPU there is
  budgeted at the reservation (planner._compute_part).
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

import functools
import os
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from edgespec.errors import InvalidRequest
from edgespec.files import gguf as gguf_mod
from edgespec.files.modelfile import ModelFile
from edgespec.llama.kernels import KV_CACHE_TYPES
from edgespec.onnx.providers import GPU_MEMORY

SUFFIX_BYTES_PER_TOKEN = 115  # the native suffix index, measured: bytes per held token
SUFFIX_HISTORY_TOKENS = 1 << 18  # tokens of earlier requests the suffix index keeps by default (~29 MiB)

MiB = 1 << 20
ENGINE_N_BATCH = 512            # prefill batches of the engine (ContextParams.n_batch)
VOCAB_BYTES_PER_ENTRY = 243     # llama.cpp vocab + edgespec's GGUF metadata, per token and merge
SCORE_BYTES = 51                # ... and per token score (SentencePiece vocabularies)


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
        if t == "Q4_K" and "QMATMUL" in f:  # native/qmatmul multiplies Q4_K as stored
            return False
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
        kv = KV_CACHE_TYPES[kv_type]
        idx = range(self.n_layer) if layers is None else layers
        return sum(self.kv_elems_per_token[i] * kv.block_bytes // kv.block_elems for i in idx)

    def kv_bytes_per_token_layer(self) -> dict[str, float]:
        """Mean K + V bytes per token per layer, for each cache type."""
        return {t: self.kv_bytes_per_token(t) / max(self.n_layer, 1) for t in KV_CACHE_TYPES}

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


@dataclass
class _TensorBytes:
    """The bytes of a model's tensors, grouped as ModelFootprint reports them."""

    layer_bytes: list[int]
    embd: int = 0
    output: int = 0
    other: int = 0
    matmul: list[tuple[int, str, int, int]] = field(default_factory=list)
    ffn_rows: int = 0
    embd_shape: tuple[int, ...] | None = None


def _architecture(g) -> str:
    """The model's ``general.architecture``; InvalidRequest when the file has none."""
    arch = g.metadata.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise InvalidRequest(f"{g.path}: no general.architecture: not a model file")
    return arch


def _block_shape(g, arch: str) -> tuple[int, int, int]:
    """Block count, embedding length and head count; InvalidRequest when one is missing."""
    md = g.metadata
    n_layer = _meta_int(md, f"{arch}.block_count")
    n_embd = _meta_int(md, f"{arch}.embedding_length")
    n_head = _meta_int(md, f"{arch}.attention.head_count")
    if not n_layer or not n_embd or not n_head:
        raise InvalidRequest(f"{g.path}: missing {arch} block_count / embedding_length / head_count: "
                             "cannot size this model")
    return n_layer, n_embd, n_head


def _kv_heads(hkv_raw, n_layer: int) -> list[int]:
    """One KV head count per layer, from a single count or a per-layer list (some models vary it)."""
    if isinstance(hkv_raw, list):
        return [int(x) for x in hkv_raw][:n_layer] + [int(hkv_raw[-1])] * max(0, n_layer - len(hkv_raw))
    return [int(hkv_raw)] * n_layer


def _tensor_bytes(tensors, n_layer: int) -> _TensorBytes:
    """Groups tensor bytes by block, embeddings, output head and the rest; lists the 2-D matmuls."""
    w = _TensorBytes(layer_bytes=[0] * n_layer)
    for t in tensors:
        m = _LAYER.match(t.name)
        if m and int(m.group(1)) < n_layer:
            il = int(m.group(1))
            w.layer_bytes[il] += t.nbytes
            if len(t.shape) == 2:
                w.matmul.append((il, t.type_name, t.shape[1], t.nbytes))
            if t.name.endswith("ffn_up.weight") and len(t.shape) >= 2:
                w.ffn_rows = max(w.ffn_rows, t.shape[1])
        elif t.name == "token_embd.weight":
            w.embd = t.nbytes
            w.embd_shape = t.shape
        elif t.name == "output.weight":
            w.output = t.nbytes
            if len(t.shape) == 2:
                w.matmul.append((-1, t.type_name, t.shape[1], t.nbytes))
        else:
            w.other += t.nbytes
    return w


def _vocab_size(md: dict, w: _TensorBytes) -> int:
    """Tokenizer token count, else the embedding matrix's row count, else 0."""
    tokens = md.get("tokenizer.ggml.tokens")
    n_vocab = len(tokens) if isinstance(tokens, list) and tokens else 0
    if not n_vocab:
        n_vocab = (w.embd_shape[1] if w.embd else 0)
    return n_vocab


def _list_len(md: dict, key: str) -> int:
    """Length of a list-valued metadata key, 0 when absent or not a list."""
    v = md.get(key)
    return len(v) if isinstance(v, list) else 0


def estimate_model(gguf_file, name: str | None = None) -> ModelFootprint:
    """Sizes a model's parts from its GGUF header (a path or a ``GGUFFile``); loads nothing.

    Raises InvalidGGUF for a malformed file and InvalidRequest when the file lacks the
    metadata a transformer needs (block count, embedding length, head counts).
    """
    g = gguf_file if isinstance(gguf_file, gguf_mod.GGUFFile) else gguf_mod.read_gguf(gguf_file)
    md = g.metadata
    arch = _architecture(g)

    def key(k):
        return f"{arch}.{k}"

    n_layer, n_embd, n_head = _block_shape(g, arch)
    hkv = _kv_heads(md.get(key("attention.head_count_kv"), n_head), n_layer)
    head_dim = n_embd // n_head
    dk = _meta_int(md, key("attention.key_length"), head_dim)
    dv = _meta_int(md, key("attention.value_length"), head_dim)
    w = _tensor_bytes(g.tensors, n_layer)
    n_ff = _meta_int(md, key("feed_forward_length"), None) or w.ffn_rows or 4 * n_embd
    n_vocab = _vocab_size(md, w)
    general_name = md.get("general.name")
    return ModelFootprint(
        name=name or (general_name if isinstance(general_name, str) else None)
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
        n_merges=_list_len(md, "tokenizer.ggml.merges"),
        n_scores=_list_len(md, "tokenizer.ggml.scores"),
        n_ctx_train=_meta_int(md, key("context_length"), 0) or 0,
        n_swa=_meta_int(md, key("attention.sliding_window"), 0) or 0,
        tied_output=w.output == 0,
        layer_bytes=tuple(w.layer_bytes),
        embd_bytes=w.embd,
        output_bytes=w.output,
        other_bytes=w.other,
        kv_elems_per_token=tuple(h * (dk + dv) for h in hkv),
        matmul_weights=tuple(w.matmul),
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
    n_outputs_max: int        # what the context allows (the engine's target: VERIFY_ROWS)
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


def verify_graph_bytes(fp: ModelFootprint, cf: ContextFootprint, rows: int) -> int:
    """The compute buffer of one batch of ``rows`` tokens, every row's logits read (a
    verification), in a context ``cf`` of ``fp``."""
    return max(_layer_stage(fp, rows, cf.n_cells, cf.flash_attn), _logits_stage(fp, rows, rows))


def estimate_context(footprint: ModelFootprint, n_ctx: int, n_ubatch: int = 512, n_seq: int = 1,
                     kv_type: str = "f16", flash_attn: bool = True, *, n_batch: int = ENGINE_N_BATCH,
                     n_outputs: int = 1, n_outputs_max: int | None = None) -> ContextFootprint:
    """Sizes a context: KV cache, compute buffer, work buffer and output (logits) buffer.

    ``n_outputs`` is the largest number of logits rows one decode asks for (the engine's
    verification batches: ``draft_max + 1``); ``n_outputs_max`` what the context allows (None:
    ``n_batch``, as ``ContextParams`` leaves it), which sizes llama.cpp's reservation.
    Raises InvalidRequest for an unknown cache type or a quantized cache without flash
    attention (llama.cpp refuses to create that context).
    """
    if kv_type not in KV_CACHE_TYPES:
        raise InvalidRequest(f"KV cache type must be one of {', '.join(KV_CACHE_TYPES)}, got {kv_type!r}")
    if kv_type != "f16" and not flash_attn:
        raise InvalidRequest(f"a {kv_type} KV cache needs flash attention (llama.cpp refuses it without)")
    if n_ctx < 1 or n_ubatch < 1 or n_seq < 1 or n_batch < 1:
        raise InvalidRequest("n_ctx, n_ubatch, n_seq and n_batch must be positive")
    cells = _pad(n_ctx, 256)
    batch = min(n_batch, n_ctx)
    ub = min(n_ubatch, batch)
    out_max = max(n_outputs_max if n_outputs_max is not None else n_batch, n_seq)
    n_out = min(max(n_outputs, 1), ub)
    # llama.cpp reserves the larger of two graphs: a prompt batch (ub tokens rounded up to a
    # multiple of n_seq) and a generation step of one token per sequence (n_seq tokens and
    # logits rows). The second dominates a context with many sequences: 256 over 64-token
    # batches reserve 150 MiB for the 0.5B drafter (probed: 153,733 KiB), on the CPU and on
    # CUDA alike, which is why the tree search holds no more than 64 (ModelDrafter.SEQUENCES).
    layer = _layer_stage(footprint, -(-ub // n_seq) * n_seq, cells, flash_attn)
    step = max(_layer_stage(footprint, n_seq, cells, flash_attn), _logits_stage(footprint, n_seq, n_seq))
    reserved = max(layer, _logits_stage(footprint, min(out_max, ub), ub), step)
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
# The ONNX drafter (onnxruntime)
# =============================================================================================

# Measured (onnxruntime 1.32, CPU provider, qwen2.5-coder-0.5b, 2 threads, exact and 4-bit, 2048
# and 4096 KV slots): importing onnxruntime adds 31 MiB to a process; after a 500-token prefill in
# 256-row passes and a tree round, the CPU arena holds 201-208 MiB whatever the KV size, i.e.
# ~175 bytes per prefill row per feed-forward unit (4864 in the 0.5B).
ORT_RUNTIME_BYTES = 31 * MiB
ONNX_ARENA_BYTES_PER_ROW_FF = 175
ONNX_PREFILL_ROWS = 256    # edgespec.drafters.onnx.PREFILL_CHUNK (rows per catching-up pass)
ONNX_TREE_ROWS = 4         # edgespec.drafters.onnx round_size: rows scored per tree pass
# Converted size over the GGUF file size, measured on qwen2.5-coder-0.5b Q4_K_M: used only
# before the conversion exists (after it, the files' sizes are used).
ONNX_SIZE_RATIO = {"exact": 712_747_008 / 491_400_064, "4": 487_945_472 / 491_400_064}


@dataclass(frozen=True)
class OnnxDrafterFootprint:
    """Resident bytes of the ONNX drafter (edgespec.onnx.session.OnnxLM on onnxruntime).

    * **Graph**: ``model.onnx`` + ``weights.bin`` as converted (onnxruntime reads the external
      weights and prepacks the MatMulNBits blocks: resident once), or, before conversion, the
      GGUF file size x ``ONNX_SIZE_RATIO[bits]``.
    * **KV buffer**: ``2 x n_layer`` float32 buffers of ``n_head_kv x n_ctx x head_dim`` (one
      slot per context token, preallocated).
    * **Arena**: onnxruntime's CPU arena after the largest pass, a prefill chunk of
      ``ONNX_PREFILL_ROWS`` rows (measured: ``ONNX_ARENA_BYTES_PER_ROW_FF`` per row per
      feed-forward unit, independent of the KV size), plus the logits of a tree round, plus
      ``ORT_RUNTIME_BYTES`` for the library.
    The whole KV buffer is counted (it fills as the context grows); against the measured peak
    RSS of a 500-token context the estimate is 6-10% high, never low.
    * On ``cuda`` / ``tensorrt`` the graph, KV buffer and arena live in GPU memory.
    """

    name: str
    bits: str
    provider: str
    graph_bytes: int
    converted: bool            # graph_bytes from the converted files (else estimated)
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int

    @property
    def on_gpu(self) -> bool:

        return self.provider in GPU_MEMORY

    @property
    def where(self) -> str:
        """A plan's place for its parts: RAM, or the GPU of onnxruntime's provider (outside the
        RAM budget; onnxruntime's device is not the one llama.cpp reports, so it is stated only)."""
        return f"GPU ({self.provider})" if self.on_gpu else "RAM"

    def kv_bytes(self, n_ctx: int) -> int:
        return 2 * self.n_layer * self.n_head_kv * n_ctx * (self.n_embd // self.n_head) * 4

    def arena_bytes(self, n_ctx: int) -> int:
        rows = min(ONNX_PREFILL_ROWS, n_ctx)
        return rows * self.n_ff * ONNX_ARENA_BYTES_PER_ROW_FF + ONNX_TREE_ROWS * self.n_vocab * 4

    def resident_bytes(self, n_ctx: int) -> int:
        return sum(nbytes for _, nbytes, _ in self.parts(n_ctx))

    def parts(self, n_ctx: int) -> list[tuple[str, int, str]]:
        """(component, bytes, note) of the drafter with an ``n_ctx``-slot KV buffer."""
        where = f"onnxruntime {self.provider}"
        graph = ("model.onnx + weights.bin" if self.converted else
                 f"estimated: the GGUF file x {ONNX_SIZE_RATIO[self.bits]:.2f} (not converted yet)")
        hd = self.n_embd // self.n_head
        return [
            (f"onnx drafter graph ({self.bits})", self.graph_bytes, f"{where}: {graph}"),
            ("onnx drafter KV buffer", self.kv_bytes(n_ctx),
             f"float32, {n_ctx} slots x {self.n_layer} layers x {self.n_head_kv} heads x {hd} x K,V"),
            ("onnx drafter arena & runtime", self.arena_bytes(n_ctx) + ORT_RUNTIME_BYTES,
             f"onnxruntime's CPU arena after a {min(ONNX_PREFILL_ROWS, n_ctx)}-row prefill pass "
             f"(measured) + {ORT_RUNTIME_BYTES // MiB} MiB library"),
        ]

    def to_dict(self) -> dict:
        return asdict(self)


def estimate_onnx_drafter(source: ModelFootprint, directory: str | os.PathLike | None, bits: str,
                          provider: str = "cpu") -> OnnxDrafterFootprint:
    """Sizes the ONNX drafter converted from ``source`` with ``bits`` (from ``directory``'s files
    when it holds a conversion, else estimated from the GGUF); loads nothing."""
    if bits not in ONNX_SIZE_RATIO:
        raise InvalidRequest(f"--onnx-bits must be one of {', '.join(ONNX_SIZE_RATIO)}, not {bits!r}")
    files = [os.path.join(directory, f) for f in ("model.onnx", "weights.bin")] if directory else []
    converted = bool(files) and all(os.path.isfile(f) for f in files)
    graph = (sum(os.path.getsize(f) for f in files) if converted
             else int(source.file_size * ONNX_SIZE_RATIO[bits]))
    return OnnxDrafterFootprint(
        name=source.name, bits=bits, provider=provider, graph_bytes=graph, converted=converted,
        n_layer=source.n_layer, n_embd=source.n_embd, n_head=source.n_head, n_head_kv=source.n_head_kv,
        n_ff=source.n_ff, n_vocab=source.n_vocab)


@functools.lru_cache(maxsize=16)
def footprint_of(model: ModelFile) -> ModelFootprint:
    """The footprint of a model file (edgespec.files.modelfile), estimated once per file."""
    return estimate_model(model.gguf)
