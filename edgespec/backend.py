"""The one module that talks to llama.cpp (through llama-cpp-python's low-level ctypes API).

It exposes exactly what a speculative engine needs and nothing more:

* ``LlamaModel``: weights and vocabulary (tokenize, token pieces, end-of-generation test,
  GGUF metadata, chat template), loaded only after the pure-Python GGUF validator accepted
  the file.
* ``LlamaContext``: a KV cache with several sequences; ``decode`` takes a batch whose tokens
  carry explicit positions, any number of sequence ids each and per-row logits flags, and
  returns only the flagged rows; ``seq_rm`` / ``seq_cp`` / ``seq_keep`` / ``clear`` edit the
  cache (llama_memory_*).

Everything else in edgespec imports this module, never ``llama_cpp``.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

import llama_cpp as lc
from edgespec import gguf
from edgespec.errors import BackendError, InvalidRequest

log = logging.getLogger(__name__)
_llama_log = logging.getLogger("edgespec.llama_cpp")

_init_lock = threading.Lock()
_initialized = False

# ggml log levels (DEBUG=1, INFO=2, WARN=3, ERROR=4, CONT=5) -> logging levels. llama.cpp
# warns about quirks of well-known model files on every load, so its warnings land at INFO.
_LEVELS = {1: logging.DEBUG, 2: logging.DEBUG, 3: logging.INFO, 4: logging.ERROR, 5: logging.DEBUG}


@lc.llama_log_callback
def _log_callback(level, text, _user_data):  # pragma: no cover - called from C
    try:
        msg = text.decode("utf-8", errors="replace").rstrip()
    except Exception:  # noqa: BLE001 - never raise into C
        return
    if msg:
        _llama_log.log(_LEVELS.get(int(level), logging.DEBUG), "%s", msg)


def _ensure_initialized() -> None:
    global _initialized
    with _init_lock:
        if not _initialized:
            lc.llama_log_set(_log_callback, ctypes.c_void_p(0))
            lc.llama_backend_init()
            _initialized = True


def default_threads() -> int:
    """Physical cores: hyper-threads slow matrix-vector decoding down rather than up."""
    import psutil

    return max(1, psutil.cpu_count(logical=False) or os.cpu_count() or 1)


def system_info() -> dict:
    """What the installed llama.cpp build can do (for `edgespec doctor`)."""
    _ensure_initialized()
    return {
        "llama_cpp_python": lc.__version__,
        "system_info": lc.llama_print_system_info().decode("utf-8", errors="replace").strip(),
        "gpu_offload": bool(lc.llama_supports_gpu_offload()),
        "mmap": bool(lc.llama_supports_mmap()),
        "mlock": bool(lc.llama_supports_mlock()),
        "max_devices": int(lc.llama_max_devices()),
        "devices": list_devices(),
    }


def _ggml_device_api():
    """ctypes signatures of ggml's device registry (llama-cpp-python does not bind them)."""
    from llama_cpp import _ggml

    lib = _ggml.libggml
    sig = {
        "ggml_backend_dev_count": ([], ctypes.c_size_t),
        "ggml_backend_dev_get": ([ctypes.c_size_t], ctypes.c_void_p),
        "ggml_backend_dev_name": ([ctypes.c_void_p], ctypes.c_char_p),
        "ggml_backend_dev_description": ([ctypes.c_void_p], ctypes.c_char_p),
        "ggml_backend_dev_type": ([ctypes.c_void_p], ctypes.c_int),
        "ggml_backend_dev_memory": ([ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                     ctypes.POINTER(ctypes.c_size_t)], None),
    }
    for name, (args, res) in sig.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


_DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}


def list_devices() -> list[dict]:
    """Compute devices the installed llama.cpp build sees (CPU, GPUs) with their memory."""
    _ensure_initialized()
    try:
        lib = _ggml_device_api()
    except (ImportError, AttributeError) as exc:
        log.debug("device registry unavailable: %s", exc)
        return []
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        out.append({
            "name": (lib.ggml_backend_dev_name(dev) or b"").decode(errors="replace"),
            "description": (lib.ggml_backend_dev_description(dev) or b"").decode(errors="replace"),
            "type": _DEVICE_TYPES.get(lib.ggml_backend_dev_type(dev), "other"),
            "memory_free": int(free.value),
            "memory_total": int(total.value),
        })
    return out


@dataclass(frozen=True)
class ModelParams:
    """How to load weights. ``n_gpu_layers=-1`` offloads every layer the build can."""

    n_gpu_layers: int = 0
    use_mmap: bool = True
    use_mlock: bool = False
    # CPU weight repacking for faster kernels: an extra anonymous copy of most weights. Off
    # when weights must stay file-backed (its copy would be resident whatever we do).
    repack: bool = True


@dataclass(frozen=True)
class ContextParams:
    """How to size a context. ``n_seq_max`` bounds the sequence ids a batch may use."""

    n_ctx: int = 4096
    n_batch: int = 512
    n_ubatch: int = 512
    n_seq_max: int = 1
    n_threads: int | None = None
    n_threads_batch: int | None = None
    flash_attn: bool | None = None  # None: llama.cpp decides per device (on for CPU)
    kv_type: str = "f16"  # f16 | q8_0 | q4_0 (a quantized V cache needs flash attention)
    # Most logits rows one decode may return; None: n_batch. llama.cpp reserves a compute
    # buffer of rows x vocabulary floats, so verification-sized values save hundreds of MB.
    n_outputs_max: int | None = None


KV_CACHE_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2}  # ggml type ids


def _load_mode(p: ModelParams) -> int:
    if p.use_mmap:
        return lc.LLAMA_LOAD_MODE_MMAP_MLOCK if p.use_mlock else lc.LLAMA_LOAD_MODE_MMAP
    return lc.LLAMA_LOAD_MODE_MLOCK if p.use_mlock else lc.LLAMA_LOAD_MODE_NONE


def _model_params(p: ModelParams):
    """The llama_model_params struct for ``p`` (shared by loads and memory probes)."""
    mp = lc.llama_model_default_params()
    mp.n_gpu_layers = p.n_gpu_layers
    mp.load_mode = _load_mode(p)
    mp.use_extra_bufts = bool(p.repack)
    return mp


def _context_params(p: ContextParams, threads: int):
    """The llama_context_params struct for ``p`` (shared by contexts and memory probes)."""
    if p.kv_type not in KV_CACHE_TYPES:
        raise InvalidRequest(f"kv_type must be one of {', '.join(KV_CACHE_TYPES)}, got {p.kv_type!r}")
    cp = lc.llama_context_default_params()
    cp.n_ctx = p.n_ctx
    cp.n_batch = p.n_batch
    cp.n_ubatch = min(p.n_ubatch, p.n_batch)
    cp.n_seq_max = p.n_seq_max
    cp.n_threads = threads
    cp.n_threads_batch = p.n_threads_batch or threads
    # Several sequences share one cache (a draft tree's branches), so it must be unified.
    cp.kv_unified = True
    # Verification reads the logits of many rows of one sequence; this build's default allows
    # one output row per sequence. llama.cpp asserts n_outputs_max >= n_seq_max.
    outputs = max(p.n_outputs_max or p.n_batch, p.n_seq_max)
    cp.n_outputs_max = outputs
    cp.n_outputs_max_per_seq = outputs
    cp.no_perf = True
    cp.type_k = cp.type_v = KV_CACHE_TYPES[p.kv_type]
    cp.flash_attn_type = {None: lc.LLAMA_FLASH_ATTN_TYPE_AUTO, True: lc.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                          False: lc.LLAMA_FLASH_ATTN_TYPE_DISABLED}[p.flash_attn]
    return cp


class LlamaModel:
    """Weights and vocabulary of one GGUF model."""

    def __init__(self, path: str | os.PathLike, params: ModelParams = ModelParams()):
        self.path = str(path)
        # The validator reads the header first: llama.cpp must never see a malformed file.
        self.gguf = gguf.read_gguf(self.path)
        _ensure_initialized()
        self._model = lc.llama_model_load_from_file(self.path.encode(), _model_params(params))
        if not self._model:
            raise BackendError(f"llama.cpp could not load {self.path}")
        self.params = params
        self._vocab = lc.llama_model_get_vocab(self._model)
        self.n_vocab = int(lc.llama_vocab_n_tokens(self._vocab))
        self._pieces: list[bytes | None] = [None] * self.n_vocab
        self._eog = np.array([bool(lc.llama_vocab_is_eog(self._vocab, t)) for t in range(self.n_vocab)])

    # -- vocabulary ---------------------------------------------------------------------------
    @property
    def bos(self) -> int:
        return int(lc.llama_vocab_bos(self._vocab))

    @property
    def eos(self) -> int:
        return int(lc.llama_vocab_eos(self._vocab))

    @property
    def add_bos(self) -> bool:
        return bool(lc.llama_vocab_get_add_bos(self._vocab))

    def is_eog(self, token: int) -> bool:
        """End of generation: EOS, EOT, <|im_end|> and the like."""
        return bool(self._eog[token])

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Text -> token ids. ``parse_special`` turns "<|im_start|>" into its control token."""
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (lc.llama_token * cap)()
        n = lc.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (lc.llama_token * cap)()
            n = lc.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            raise BackendError("tokenization failed")
        return list(buf[:n])

    def token_piece(self, token: int) -> bytes:
        """Bytes of one token as it appears in generated text (control tokens render empty)."""
        if not 0 <= token < self.n_vocab:
            raise InvalidRequest(f"token id {token} out of range [0, {self.n_vocab})")
        piece = self._pieces[token]
        if piece is None:
            buf = ctypes.create_string_buffer(64)
            n = lc.llama_token_to_piece(self._vocab, token, buf, 64, 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = lc.llama_token_to_piece(self._vocab, token, buf, -n, 0, False)
            piece = buf.raw[:n]
            self._pieces[token] = piece
        return piece

    def token_text(self, token: int) -> str:
        """The vocabulary entry of a token as stored in the model (for vocabulary checks)."""
        return lc.llama_vocab_get_text(self._vocab, token).decode("utf-8", errors="replace")

    # -- metadata -----------------------------------------------------------------------------
    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as llama.cpp renders it, or None."""
        buf = ctypes.create_string_buffer(4096)
        n = lc.llama_model_meta_val_str(self._model, key.encode(), buf, 4096)
        return None if n < 0 else buf.value.decode("utf-8", errors="replace")

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template stored in the GGUF file, if any."""
        value = self.gguf.metadata.get("tokenizer.chat_template")
        return value if isinstance(value, str) and value else None

    @property
    def n_ctx_train(self) -> int:
        return int(lc.llama_model_n_ctx_train(self._model))

    @property
    def n_layer(self) -> int:
        return int(lc.llama_model_n_layer(self._model))

    @property
    def n_embd(self) -> int:
        return int(lc.llama_model_n_embd(self._model))

    @property
    def n_head(self) -> int:
        return int(lc.llama_model_n_head(self._model))

    @property
    def n_head_kv(self) -> int:
        return int(lc.llama_model_n_head_kv(self._model))

    @property
    def weights_bytes(self) -> int:
        """Bytes of all weight tensors, wherever they live."""
        return int(lc.llama_model_size(self._model))

    @property
    def description(self) -> str:
        buf = ctypes.create_string_buffer(256)
        lc.llama_model_desc(self._model, buf, 256)
        return buf.value.decode(errors="replace")

    def close(self) -> None:
        if getattr(self, "_model", None):
            lc.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


class LlamaContext:
    """A KV cache over a model, decoded in batches of explicitly placed tokens."""

    def __init__(self, model: LlamaModel, params: ContextParams = ContextParams()):
        if params.n_ctx < 16:
            raise InvalidRequest(f"context size {params.n_ctx} is too small (minimum 16)")
        if params.n_seq_max < 1:
            raise InvalidRequest("n_seq_max must be >= 1")
        self.model = model
        threads = params.n_threads or default_threads()
        cp = _context_params(params, threads)
        self._ctx = lc.llama_init_from_model(model._model, cp)
        if not self._ctx:
            raise BackendError(f"llama.cpp could not create a context of {params.n_ctx} tokens")
        self.params = params
        self.n_threads = threads
        self.n_ctx = int(lc.llama_n_ctx(self._ctx))
        self.n_batch = int(lc.llama_n_batch(self._ctx))
        self.n_seq_max = int(lc.llama_n_seq_max(self._ctx))
        self._mem = lc.llama_get_memory(self._ctx)
        self._batch = lc.llama_batch_init(self.n_batch, 0, self.n_seq_max)
        self._generation = 0  # bumps on every decode; stale lazy logits readers refuse to read

    # -- decoding -----------------------------------------------------------------------------
    def decode(self, tokens: Sequence[int], positions: Sequence[int],
               seq_ids: Sequence[Sequence[int]], logits: Sequence[bool]) -> np.ndarray:
        """Runs one forward pass over a batch and returns the flagged logits rows.

        Args:
            tokens: [n] token ids.
            positions: [n] position of each token in its sequence(s).
            seq_ids: [n] the sequences each token belongs to; a token listed in several
                sequences is attended by all of them (shared draft-tree prefixes).
            logits: [n] whether to return the logits of each row.
        Returns:
            float32 array [number of flagged rows, n_vocab], in batch order.
        Raises:
            InvalidRequest: inconsistent lengths, empty batch, more rows than ``n_batch``,
                a sequence id out of range or a bad token id.
            BackendError: llama.cpp could not find room in the KV cache or failed.
        """
        rows = self.decode_rows(tokens, positions, seq_ids, logits)
        flagged = [i for i in range(len(tokens)) if logits[i]]
        out = np.empty((len(flagged), self.model.n_vocab), dtype=np.float32)
        for k, i in enumerate(flagged):
            out[k] = rows(i)
        return out

    def decode_rows(self, tokens: Sequence[int], positions: Sequence[int],
                    seq_ids: Sequence[Sequence[int]], logits: Sequence[bool]):
        """Like ``decode`` but returns ``row(i) -> [n_vocab]`` reading flagged row ``i`` lazily.

        Verification flags every draft node yet usually needs only the rows on the accepted
        path; copying 150k floats per unneeded row would cost more than the check itself.
        The accessor is valid until the next decode on this context.
        """
        n = len(tokens)
        self._check_batch(tokens, positions, seq_ids, logits)
        b = self._batch
        b.n_tokens = n
        for i in range(n):
            b.token[i] = tokens[i]
            b.pos[i] = positions[i]
            ids = seq_ids[i]
            b.n_seq_id[i] = len(ids)
            for j, s in enumerate(ids):
                b.seq_id[i][j] = s
            b.logits[i] = 1 if logits[i] else 0
        rc = lc.llama_decode(self._ctx, b)
        if rc != 0:
            raise BackendError(f"llama_decode failed (code {rc}): "
                               + ("no room in the KV cache" if rc == 1 else "see debug log"))
        self._generation += 1
        generation, n_vocab, flags = self._generation, self.model.n_vocab, list(logits)

        def row(i: int) -> np.ndarray:
            if generation != self._generation:
                raise RuntimeError("logits read after a later decode overwrote them")
            if not (0 <= i < n and flags[i]):
                raise IndexError(f"row {i} was not flagged for logits")
            return np.ctypeslib.as_array(lc.llama_get_logits_ith(self._ctx, i), shape=(n_vocab,)).copy()

        return row

    def _check_batch(self, tokens, positions, seq_ids, logits) -> None:
        n = len(tokens)
        if n == 0:
            raise InvalidRequest("empty batch")
        if not (len(positions) == len(seq_ids) == len(logits) == n):
            raise InvalidRequest("tokens, positions, seq_ids and logits must have the same length")
        if n > self.n_batch:
            raise InvalidRequest(f"batch of {n} tokens exceeds n_batch={self.n_batch}")
        nv = self.model.n_vocab
        for i in range(n):
            if not 0 <= tokens[i] < nv:
                raise InvalidRequest(f"token id {tokens[i]} out of range [0, {nv})")
            if not 0 <= positions[i] < self.n_ctx:
                raise InvalidRequest(f"position {positions[i]} outside the context of {self.n_ctx}")
            ids = seq_ids[i]
            if not ids or any(not 0 <= s < self.n_seq_max for s in ids):
                raise InvalidRequest(f"row {i}: sequence ids must be in [0, {self.n_seq_max})")

    # -- KV cache edits -----------------------------------------------------------------------
    def seq_rm(self, seq: int, p0: int = 0, p1: int = -1) -> None:
        """Removes positions [p0, p1) of a sequence (p1 < 0: to the end; seq < 0: all)."""
        if not lc.llama_memory_seq_rm(self._mem, seq, p0, p1):
            raise BackendError(f"cannot remove positions [{p0}, {p1}) of sequence {seq}")

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        """Makes positions [p0, p1) of ``src`` also belong to ``dst`` (no copy of data)."""
        lc.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def seq_keep(self, seq: int) -> None:
        """Drops every cache entry that does not belong to ``seq``."""
        lc.llama_memory_seq_keep(self._mem, seq)

    def seq_pos_max(self, seq: int) -> int:
        """Largest position stored for a sequence, -1 when it is empty."""
        return int(lc.llama_memory_seq_pos_max(self._mem, seq))

    def clear(self) -> None:
        """Empties the whole cache."""
        lc.llama_memory_clear(self._mem, True)

    # -- memory -------------------------------------------------------------------------------
    def kv_bytes(self) -> int:
        """Bytes of the f16 K and V caches for the whole context."""
        m = self.model
        head_dim = m.n_embd // max(m.n_head, 1)
        return 2 * 2 * self.n_ctx * m.n_layer * m.n_head_kv * head_dim

    def memory_report(self) -> dict:
        """Bytes this context and its model hold, by part."""
        return {
            "weights": self.model.weights_bytes,
            "kv_cache": self.kv_bytes(),
            "logits_buffer": 4 * self.model.n_vocab * self.n_batch,
            "state": int(lc.llama_state_get_size(self._ctx)),
        }

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            lc.llama_batch_free(self._batch)
            lc.llama_free(self._ctx)
            self._ctx = None

    def __del__(self) -> None:  # pragma: no cover
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


# =============================================================================================
# -- peer: llama-cpp-python's own high-level API -----------------------------------------------
# =============================================================================================
# The benchmark harness (edgespec.bench.peers) compares edgespec with llama-cpp-python's own
# prompt-lookup speculative decoding, ``Llama(draft_model=LlamaPromptLookupDecoding(...))``.
# It lives here because this module is edgespec's only importer of ``llama_cpp``. Nothing else in
# edgespec uses it.
#
# Tokenization: ``Llama.create_completion`` given a *string* prompt tokenizes it itself with
# ``special=True`` (so "<|im_start|>" becomes its control token) and prepends the BOS when the
# model's GGUF asks for one, whether or not the text already begins with it; it may also append
# an EOS/SEP to the prompt for models whose vocabulary sets add_eos or a separator token. To feed
# the peer exactly the tokens edgespec feeds itself, the prompt is tokenized here with the same
# rule as ``Engine.chat_tokens`` (parse special tokens; add the BOS only when the text does not
# already start with it) and given to ``create_completion`` as a token list, which it uses
# verbatim (no BOS, no EOS added).

_peer_llamas: dict[tuple, object] = {}
_peer_lock = threading.Lock()


def _peer_llama(model_path: str, n_threads: int, n_ctx: int, num_pred_tokens: int):
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    key = (os.path.abspath(model_path), int(n_threads), int(n_ctx), int(num_pred_tokens))
    with _peer_lock:
        llm = _peer_llamas.get(key)
        if llm is None:
            gguf.read_gguf(model_path)  # the validator sees every file before llama.cpp does
            # logits_all=True: llama-cpp-python 0.3.36 raises "could not broadcast input array"
            # with a draft model unless every row's logits are kept.
            llm = lc.Llama(model_path=model_path,
                           draft_model=LlamaPromptLookupDecoding(num_pred_tokens=num_pred_tokens),
                           logits_all=True, n_ctx=n_ctx, n_threads=n_threads,
                           n_threads_batch=n_threads, verbose=False, flash_attn=True)
            _peer_llamas[key] = llm
        return llm


def close_peer_models() -> None:
    """Frees every llama-cpp-python model the peer loaded."""
    with _peer_lock:
        models = list(_peer_llamas.values())
        _peer_llamas.clear()
    for llm in models:
        try:
            llm.close()
        except Exception:  # best effort at shutdown
            log.debug("closing a peer model failed", exc_info=True)


def prompt_lookup_generate(model_path: str | os.PathLike, prompt_text: str, max_tokens: int,
                           n_threads: int, n_ctx: int, num_pred_tokens: int = 10) -> dict:
    """Greedy generation with llama-cpp-python's ``LlamaPromptLookupDecoding``.

    ``prompt_text`` is already chat-templated. Returns ``text``, ``new_tokens`` (generated tokens,
    a final end-of-generation token not counted, as in edgespec's own stats), ``gen_s`` (wall time
    from the first sampled token to the end, as edgespec's ``GenerationStats.gen_s``),
    ``prefill_s`` (call start to the first sampled token: tokenization, prompt evaluation and
    the first sample), ``prompt_tokens``, ``steps`` (target evaluations after the prefill, one per
    verified draft), ``drafted`` and ``accepted`` (draft tokens evaluated and matched) and
    ``finish_reason``. The model stays loaded for the next call with the same settings; every
    call evaluates its prompt from scratch (no prefix reuse between calls).
    """
    import time

    if max_tokens < 1:
        raise InvalidRequest("max_tokens must be at least 1")
    if not prompt_text:
        raise InvalidRequest("the prompt is empty")
    _ensure_initialized()
    llm = _peer_llama(str(model_path), n_threads, n_ctx, num_pred_tokens)
    vocab = llm._model.vocab
    bos = int(lc.llama_vocab_bos(vocab))
    bos_text = llm.detokenize([bos], special=True).decode("utf-8", errors="replace") if bos >= 0 else ""
    add_bos = bool(lc.llama_vocab_get_add_bos(vocab)) and not (bos_text and prompt_text.startswith(bos_text))
    prompt = llm.tokenize(prompt_text.encode("utf-8"), add_bos=add_bos, special=True)
    if len(prompt) + max_tokens > n_ctx:
        raise InvalidRequest(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceed n_ctx={n_ctx}")

    # Count by wrapping the instance's eval/sample (Llama.generate calls them through self):
    # each eval after the prefill verifies [last token, draft...]; a sample at position idx
    # checks the draft token at idx + 1 when one was evaluated there.
    counts = {"evals": 0, "drafted": 0, "accepted": 0, "sampled": 0, "eog": 0}
    t = {"first": None}
    orig_eval, orig_sample = llm.eval, llm.sample

    def eval_(tokens):
        if counts["evals"] > 0:
            counts["drafted"] += max(len(tokens) - 1, 0)
        counts["evals"] += 1
        return orig_eval(tokens)

    def sample(*args, **kwargs):
        tok = orig_sample(*args, **kwargs)
        idx = kwargs.get("idx")
        if t["first"] is None:
            t["first"] = time.perf_counter()
        counts["sampled"] += 1
        if idx is not None and idx + 1 < llm.n_tokens and tok == int(llm._input_ids[idx + 1]):
            counts["accepted"] += 1
        if lc.llama_vocab_is_eog(vocab, tok):
            counts["eog"] += 1
        return tok

    pieces: list[str] = []
    finish = ""
    llm.reset()  # no prefix reuse from the previous call: every prompt is evaluated in full
    llm.eval, llm.sample = eval_, sample
    try:
        t0 = time.perf_counter()
        for chunk in llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0, top_k=1,
                                           top_p=1.0, min_p=0.0, repeat_penalty=1.0, stream=True):
            choice = chunk["choices"][0]
            pieces.append(choice.get("text") or "")
            finish = choice.get("finish_reason") or finish
        t_end = time.perf_counter()
    finally:
        del llm.eval, llm.sample  # back to the class's methods
    t_first = t["first"] if t["first"] is not None else t_end
    return {
        "text": "".join(pieces),
        "new_tokens": counts["sampled"] - counts["eog"],
        "gen_s": t_end - t_first,
        "prefill_s": t_first - t0,
        "prompt_tokens": len(prompt),
        "steps": max(counts["evals"] - 1, 0),
        "drafted": counts["drafted"],
        "accepted": counts["accepted"],
        "finish_reason": finish,
    }


# =============================================================================================
# -- memory probe: llama.cpp's own buffer sizes, for the planner's calibration and tests -------
# =============================================================================================
# edgespec.planner estimates memory from GGUF metadata alone; these functions let a test (or a
# user checking a plan) compare its numbers with what llama.cpp itself allocates. llama.cpp
# reports every buffer it allocates in its log ("CPU KV buffer size = 56.00 MiB"); the log is
# routed to the "edgespec.llama_cpp" logger, so capturing it needs no change to llama.cpp.

import contextlib  # only the probe below uses it

_BUFFER_LINE = None  # compiled on first use


class _LogCapture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def capture_llama_log():
    """Collects llama.cpp's log lines while open: ``with capture_llama_log() as cap: ... cap.lines``.

    The lines are kept from the rest of the logging tree while captured, so a CLI running at
    WARNING does not print llama.cpp's debug chatter. Not meant for concurrent use.
    """
    handler = _LogCapture()
    saved = (_llama_log.level, _llama_log.propagate)
    _llama_log.setLevel(logging.DEBUG)
    _llama_log.propagate = False
    _llama_log.addHandler(handler)
    try:
        yield handler
    finally:
        _llama_log.removeHandler(handler)
        _llama_log.setLevel(saved[0])
        _llama_log.propagate = saved[1]


def reported_buffers(lines: Sequence[str]) -> dict[str, int]:
    """Sums llama.cpp's "<name> buffer size = X MiB" log lines by name, in bytes.

    Names look like "CPU_Mapped model", "CPU_REPACK model", "CPU KV", "CPU compute",
    "CPU output" (with the device name first, e.g. "CUDA0 KV"). A model with a sliding-window
    cache logs one KV line per cache; they are summed. Values are rounded to 0.01 MiB by
    llama.cpp.
    """
    global _BUFFER_LINE
    import re

    if _BUFFER_LINE is None:
        _BUFFER_LINE = re.compile(r"(\S+)\s+(\w+) buffer size =\s*([0-9.]+) MiB")
    out: dict[str, int] = {}
    for line in lines:
        m = _BUFFER_LINE.search(line)
        if m:
            key = f"{m.group(1)} {m.group(2)}"
            out[key] = out.get(key, 0) + round(float(m.group(3)) * 1024 * 1024)
    return out


def probe_context_buffers(path: str | os.PathLike, n_ctx: int, n_batch: int = 512, n_ubatch: int = 512,
                          n_seq_max: int = 1, kv_type: str = "f16", flash_attn: bool | None = None,
                          n_gpu_layers: int = 0, use_mmap: bool = True, repack: bool = True,
                          n_outputs_max: int | None = None) -> dict[str, int]:
    """Loads a model, creates one context and returns llama.cpp's reported buffer sizes (bytes).

    A dry run of context construction: the context is freed at once and nothing is decoded.
    The context is configured as ``LlamaContext`` configures its own (unified KV cache,
    ``n_outputs_max`` = ``n_batch`` unless given), plus the knobs ``ContextParams`` does not have
    yet: the KV cache type and the CPU weight repacking (``use_extra_bufts``). Keep the two in
    step. Raises BackendError when llama.cpp refuses the configuration (e.g. a quantized V
    cache without flash attention).
    """
    gguf.read_gguf(path)  # the validator sees every file before llama.cpp does
    _ensure_initialized()
    with capture_llama_log() as cap:
        mp = _model_params(ModelParams(n_gpu_layers=n_gpu_layers, use_mmap=use_mmap, repack=repack))
        model = lc.llama_model_load_from_file(os.fspath(path).encode(), mp)
        if not model:
            raise BackendError(f"llama.cpp could not load {path}")
        try:
            cp = _context_params(ContextParams(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch,
                                               n_seq_max=n_seq_max, kv_type=kv_type, flash_attn=flash_attn,
                                               n_outputs_max=n_outputs_max), default_threads())
            ctx = lc.llama_init_from_model(model, cp)
            if not ctx:
                raise BackendError(f"llama.cpp could not create a context of {n_ctx} tokens "
                                   f"(kv {kv_type}, flash attention {flash_attn})")
            lc.llama_free(ctx)
        finally:
            lc.llama_model_free(model)
    return reported_buffers(cap.lines)
