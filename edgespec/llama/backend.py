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

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as lc  # isort: skip  (before numpy: see edgespec/llama/__init__.py)
import numpy as np
import psutil
from llama_cpp import _ggml

from edgespec.files.modelfile import model_file
from edgespec.llama.kernels import KV_CACHE_TYPES
from edgespec.llama.batch import Batch
from edgespec.llama.rows import OUTPUT_ARGMAX, OUTPUT_TOPK, ArgmaxPicks, BackendGreedy, OutputTopK, Rows
from edgespec.errors import BackendError, InvalidRequest

log = logging.getLogger(__name__)
LLAMA_LOG = logging.getLogger("edgespec.llama_cpp")

_init_lock = threading.Lock()
_initialized = False

# ggml log levels (DEBUG=1, INFO=2, WARN=3, ERROR=4, CONT=5) -> logging levels. llama.cpp
# warns about quirks of well-known model files on every load, so its warnings land at INFO.
_LEVELS = {1: logging.DEBUG, 2: logging.DEBUG, 3: logging.INFO, 4: logging.ERROR, 5: logging.DEBUG}


@lc.llama_log_callback
def _log_callback(level, text, _user_data):  # pragma: no cover - called from C
    # An exception cannot cross into C: Python would only print it, and llama.cpp go on.
    try:
        msg = text.decode("utf-8", errors="replace").rstrip()
        if msg:
            LLAMA_LOG.log(_LEVELS.get(int(level), logging.DEBUG), "%s", msg)
    except KeyboardInterrupt:
        _lost_interrupt.set()  # raised again once llama.cpp returns (_raise_lost_interrupt)
    except Exception:  # noqa: BLE001 - never raise into C
        pass


_lost_interrupt = threading.Event()


def _raise_lost_interrupt() -> None:
    """Raises the KeyboardInterrupt that the log callback had to swallow, if any."""
    if _lost_interrupt.is_set():
        _lost_interrupt.clear()
        raise KeyboardInterrupt


@contextlib.contextmanager
def _sigint_deferred():
    """Holds Ctrl-C while llama.cpp loads or allocates, then delivers it to the caller's handler.

    Python's own handler raises KeyboardInterrupt inside llama.cpp's log callback, where it can
    only be printed, and the load went on (4 of 4 Ctrl-Cs while loading the 1.5B). Yields the
    Event that SIGINT sets (a load's progress callback reads it), or None where nothing changes:
    off the main thread (only it may set handlers), while SIGINT is ignored, or under a handler
    set outside Python (which could not be put back).
    """
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None)):
        yield None
        return
    interrupted = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.set())
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)
        if interrupted.is_set():
            signal.raise_signal(signal.SIGINT)  # to the caller's handler: KeyboardInterrupt by default
    _raise_lost_interrupt()


def _progress(interrupted: threading.Event | None):
    """A llama progress callback that aborts the load (returns False) once ``interrupted`` is set."""
    @lc.llama_progress_callback
    def progress(_fraction, _user_data):  # pragma: no cover - called from C
        return not (interrupted is not None and interrupted.is_set())
    return progress


def ensure_initialized() -> None:
    global _initialized
    with _init_lock:
        if not _initialized:
            lc.llama_log_set(_log_callback, ctypes.c_void_p(0))
            lc.llama_backend_init()
            _initialized = True


def default_threads() -> int:
    """Physical cores: hyper-threads slow matrix-vector decoding down rather than up."""
    return max(1, psutil.cpu_count(logical=False) or os.cpu_count() or 1)


SCALAR_PATH = 1  # QMM_SCALAR, QATTN_SCALAR (native/qmatmul): the path the patches never take


def _cpu_backend_file() -> Path | None:
    """The file of llama.cpp's CPU backend that llama_cpp loads."""
    lib = Path(os.environ.get("LLAMA_CPP_LIB_PATH") or Path(lc.__file__).parent / "lib")
    return next((lib / name for name in ("libggml-cpu.so.0", "libggml-cpu.so", "libggml-cpu.dylib")
                 if (lib / name).exists()), None)


@functools.cache
def qmatmul_loaded() -> bool:
    """Whether llama.cpp's CPU backend here carries edgespec's kernels (native/qmatmul, installed
    by `make`) and takes them on this CPU: its Q4_K and Q6_K matmuls read the weights once for a
    small batch, and with flash attention over an f16 cache every row of a batch has the bits of
    a one-token decode. Read from the library's exported kernel entries."""
    path = _cpu_backend_file()
    if path is None:
        return False
    try:
        found = ctypes.CDLL(str(path))
    except OSError:
        return False
    # present and taken: on a CPU without AVX2 the patches leave llama.cpp's kernels
    return (hasattr(found, "qmm_best_path") and hasattr(found, "qattn_best_path")
            and found.qmm_best_path() != SCALAR_PATH and found.qattn_best_path() != SCALAR_PATH)


@functools.cache
def qmatmul_build() -> str:
    """A short digest of the CPU backend with edgespec's kernels ("" without them): what a cost
    measured on it is valid for, since each build of the kernels verifies at its own speed."""
    if not qmatmul_loaded():
        return ""
    return hashlib.sha256(_cpu_backend_file().read_bytes()).hexdigest()[:8]


def system_info() -> dict:
    """What the installed llama.cpp build can do (for `edgespec doctor`)."""
    ensure_initialized()
    return {
        "llama_cpp_python": lc.__version__,
        "qmatmul": qmatmul_loaded(),
        "system_info": lc.llama_print_system_info().decode("utf-8", errors="replace").strip(),
        "gpu_offload": bool(lc.llama_supports_gpu_offload()),
        "mmap": bool(lc.llama_supports_mmap()),
        "mlock": bool(lc.llama_supports_mlock()),
        "max_devices": int(lc.llama_max_devices()),
        "devices": list_devices(),
    }


def _ggml_device_api():
    """ctypes signatures of ggml's device registry (llama-cpp-python does not bind them)."""
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
    ensure_initialized()
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
    # CUDA builds keep CPU-resident weights in pinned host buffers, which are never repacked;
    # True bypasses them so the CPU gets repacked weights (a target verified on the CPU).
    no_host: bool = False


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
    # buffer of rows x vocabulary floats (512 rows of Qwen's 152k-token logits: 297 MiB), so
    # contexts sized for their verifications (edgespec.memory.placements.VERIFY_ROWS) save
    # hundreds of MB.
    n_outputs_max: int | None = None
    # GPU builds: a batch of at least edgespec.llama.kernels.op_offload_min_batch() tokens copies
    # CPU-resident weights to the GPU and multiplies there; False keeps every batch on the CPU.
    op_offload: bool = True
    # Greedy requests may have the backend pick sequence 0's tokens (edgespec.llama.rows):
    # the target with its output layer on a GPU (edgespec.memory.placements.greedy_on_backend).
    greedy_on_backend: bool = False
    # Batch sizes whose graphs llama.cpp keeps (edgespec's graphs-by-size patch), and to which
    # batches of one sequence are padded (padded_size); (): neither. LLAMA_GRAPH_SIZES in the
    # environment overrides it.
    graph_sizes: tuple[int, ...] = ()


# The most logits a row may come back as (output top-k): 8 bytes an entry, against 4 bytes a
# vocabulary entry for the whole row (608 KB for Qwen's 152k tokens).
TOP_K_MAX = 1024


def padded_size(n: int, sizes: Sequence[int]) -> int:
    """The batch size ``n`` tokens are decoded as: the smallest of ``sizes`` that holds them, else
    ``n``."""
    return min((s for s in sizes if s >= n), default=n)


def graph_sizes(asked: tuple[int, ...]) -> tuple[int, ...]:
    """The batch sizes a context keeps graphs for: LLAMA_GRAPH_SIZES where it is set (a comma
    list; 0 or nothing: none), else ``asked``."""
    value = os.environ.get("LLAMA_GRAPH_SIZES")
    if value is None:
        return tuple(asked)
    try:
        return tuple(sorted({int(s) for s in value.split(",") if s.strip() and int(s) > 0}))
    except ValueError:
        raise InvalidRequest(f"LLAMA_GRAPH_SIZES must be a comma list of batch sizes, got {value!r}") from None


@contextlib.contextmanager
def _environ(name: str, value: str):
    """``name`` set to ``value`` in the process environment (which llama.cpp reads) meanwhile."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old



def _load_mode(p: ModelParams) -> int:
    if p.use_mmap:
        return lc.LLAMA_LOAD_MODE_MMAP_MLOCK if p.use_mlock else lc.LLAMA_LOAD_MODE_MMAP
    return lc.LLAMA_LOAD_MODE_MLOCK if p.use_mlock else lc.LLAMA_LOAD_MODE_NONE


def model_struct(p: ModelParams):
    """The llama_model_params struct for ``p`` (shared by loads and memory probes)."""
    mp = lc.llama_model_default_params()
    mp.n_gpu_layers = p.n_gpu_layers
    mp.load_mode = _load_mode(p)
    mp.use_extra_bufts = bool(p.repack)
    mp.no_host = bool(p.no_host)
    return mp


def output_rows(p: ContextParams) -> int:
    """The logits rows a context of ``p`` tells llama.cpp it allows (which asserts >= n_seq_max)."""
    return max(p.n_outputs_max or p.n_batch, p.n_seq_max)


def rows_allowed(n_outputs_max: int | None, n_batch: int, n_seq_max: int) -> int:
    """The logits rows one decode may flag on a context: ``n_outputs_max`` (None: all), no more
    than its ``n_batch`` tokens, no fewer than its sequences (output_rows)."""
    return max(min(n_outputs_max or n_batch, n_batch), n_seq_max)


def context_struct(p: ContextParams, threads: int):
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
    outputs = output_rows(p)
    cp.n_outputs_max = outputs
    cp.n_outputs_max_per_seq = outputs
    cp.no_perf = True
    cp.op_offload = bool(p.op_offload)
    cp.type_k = cp.type_v = KV_CACHE_TYPES[p.kv_type].ggml_id
    cp.flash_attn_type = {None: lc.LLAMA_FLASH_ATTN_TYPE_AUTO, True: lc.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                          False: lc.LLAMA_FLASH_ATTN_TYPE_DISABLED}[p.flash_attn]
    return cp


class LlamaModel:
    """Weights and vocabulary of one GGUF model."""

    def __init__(self, path: str | os.PathLike, params: ModelParams = ModelParams()):
        self.path = str(path)
        # The validator reads the header first: llama.cpp must never see a malformed file.
        self.file = model_file(self.path)
        self.gguf = self.file.gguf
        ensure_initialized()
        mp = model_struct(params)
        with _sigint_deferred() as interrupted:
            mp.progress_callback = _progress(interrupted)  # the struct keeps it alive
            self._model = lc.llama_model_load_from_file(os.fsencode(self.path), mp)
        if not self._model:
            if interrupted is not None and interrupted.is_set():  # a caller's handler that did not raise
                raise KeyboardInterrupt
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
        """Text -> token ids. ``parse_special`` turns "<|im_start|>" into its control token.

        Raises:
            InvalidRequest: ``text`` holds lone surrogates (JSON's "\\udcff" can carry them), which
                UTF-8 cannot encode.
        """
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequest(f"the text is not valid Unicode: {exc.reason} at position {exc.start} "
                                 f"({text[exc.start:exc.end]!r})") from None
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
        cp = context_struct(params, threads)
        self.graph_sizes = graph_sizes(params.graph_sizes)
        with _sigint_deferred(), _environ("LLAMA_GRAPH_SIZES", ",".join(map(str, self.graph_sizes))):
            self._ctx = lc.llama_init_from_model(model._model, cp)
        if not self._ctx:
            raise BackendError(f"llama.cpp could not create a context of {params.n_ctx} tokens")
        self.params = params
        self.n_threads = threads
        self.n_ctx = int(lc.llama_n_ctx(self._ctx))
        self.n_batch = int(lc.llama_n_batch(self._ctx))
        self.n_seq_max = int(lc.llama_n_seq_max(self._ctx))
        self.n_outputs_max = rows_allowed(params.n_outputs_max, self.n_batch, self.n_seq_max)
        self._mem = lc.llama_get_memory(self._ctx)
        self._batch = Batch(self.n_batch, self.n_seq_max)
        self._generation = 0  # bumps on every decode; stale lazy logits readers refuse to read
        self._greedy = ArgmaxPicks(self._ctx) if OUTPUT_ARGMAX else BackendGreedy(self._ctx)
        self._top = OutputTopK(self._ctx) if OUTPUT_TOPK else None

    def pick_on_backend(self, on: bool, every_row: bool = False) -> bool:
        """Whether flagged rows come back as the backend's greedy pick (a token id, see
        edgespec.llama.rows) rather than logits, where ``params.greedy_on_backend`` allows it;
        returns whether that is now the case. ``every_row``: the caller decodes many rows of
        several sequences (a verification), which only output argmax picks in one op."""
        return self._greedy.set(on and self.params.greedy_on_backend and (self._greedy.every_row or not every_row))

    def top_on_backend(self, k: int) -> bool:
        """Whether flagged rows come back as their ``k`` largest logits (edgespec.llama.rows; 0:
        as logits) where ``params.greedy_on_backend`` allows picks on the backend and the build
        can; returns whether that is now the case. Only while the backend picks no argmax, and
        for k up to TOP_K_MAX."""
        on = (0 < k <= TOP_K_MAX and self._top is not None and self.params.greedy_on_backend
              and not self._greedy.attached)
        if self._top is not None:
            self._top.set(min(k, self.model.n_vocab) if on else 0)  # llama.cpp takes no more
        return on

    @property
    def picking(self) -> bool:
        """Whether the next decode's flagged rows come back as the backend's picks."""
        return self._greedy.attached

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
            InvalidRequest: inconsistent lengths, empty batch, more rows than ``n_batch``, more
                flagged rows than ``n_outputs_max``, a sequence id out of range or a bad token id.
            BackendError: llama.cpp could not find room in the KV cache or failed.
        """
        if self._top is not None:
            self._top.set(0)  # whole rows, whatever the last request took
        rows = self.decode_rows(tokens, positions, seq_ids, logits)
        flagged = [i for i in range(len(tokens)) if logits[i]]
        out = np.empty((len(flagged), self.model.n_vocab), dtype=np.float32)
        for k, i in enumerate(flagged):
            out[k] = rows(i)
        return out

    def decode_rows(self, tokens: Sequence[int], positions: Sequence[int],
                    seq_ids: Sequence[Sequence[int]], logits: Sequence[bool], trims_after: bool = False) -> Rows:
        """Like ``decode`` but returns the flagged rows, read lazily (``Rows``).

        Verification flags every draft node yet usually needs only the rows on the accepted
        path; copying 150k floats per unneeded row would cost more than the check itself.
        The accessor is valid until the next decode on this context. ``trims_after``: the caller
        removes every cell past the batch before the next decode (a verification's commit or
        rollback), so a padded batch leaves its padding's cells to that: a cache edit scans every
        cell of the context, and this saves one a step.
        """
        rows = self._batch.fill(tokens, positions, seq_ids, logits, self.model.n_vocab, self.n_ctx)
        if rows > self.n_outputs_max:  # llama.cpp would abort (output_reserve's assertion)
            raise InvalidRequest(f"batch asks for {rows} logits rows; the context allows {self.n_outputs_max}")
        n, padding = len(tokens), None
        size = padded_size(n, self.graph_sizes) if n > 1 and self.graph_sizes else n
        if size > n and size <= self.n_batch and (not logits[-1] or rows + size - n <= self.n_outputs_max):
            padding = self._batch.pad(n, size, self.n_ctx)
        b = self._batch.struct
        b.n_tokens = n if padding is None else size
        rc = lc.llama_decode(self._ctx, b)
        if padding is not None and rc == 1:  # no room for the pad's cells: as asked, unpadded
            padding, b.n_tokens = None, n
            rc = lc.llama_decode(self._ctx, b)
        if rc == 0 and padding is not None and not trims_after:  # the cache holds what was asked
            self.seq_rm(*padding)
        _raise_lost_interrupt()
        if rc != 0:
            raise BackendError(f"llama_decode failed (code {rc}): "
                               + ("no room in the KV cache" if rc == 1 else "see debug log"))
        self._generation += 1
        generation = self._generation
        return Rows(self._ctx, self.model.n_vocab, list(logits), lambda: generation == self._generation,
                    self._greedy.read if self._greedy.attached else None,
                    self._top.read if self._top is not None and self._top.k and not self._greedy.attached else None)

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
        """Bytes of the K and V caches for the whole context, in the context's cache type."""
        m = self.model
        head_dim = m.n_embd // max(m.n_head, 1)
        elements = 2 * self.n_ctx * m.n_layer * m.n_head_kv * head_dim
        return KV_CACHE_TYPES[self.params.kv_type].nbytes(elements)

    def memory_report(self) -> dict:
        """Bytes this context and its model hold, by part."""
        return {
            "weights": self.model.weights_bytes,
            "kv_cache": self.kv_bytes(),
            "logits_buffer": 4 * self.model.n_vocab * self.n_outputs_max,
            "state": int(lc.llama_state_get_size(self._ctx)),
        }

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            self._greedy.close()
            lc.llama_free(self._ctx)
            self._ctx = None

    def __del__(self) -> None:  # pragma: no cover
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass
