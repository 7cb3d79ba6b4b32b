"""An onnxruntime session over a converted drafter graph, with one preallocated KV buffer.

The KV buffer holds ``n_ctx`` slots per layer and is bound as both the past input and the
present output of every run, so GroupQueryAttention writes new entries in place and nothing is
copied between runs. Which slots count is told on every run (``past``, ``attention_bias``):
rolling back is passing a shorter ``past``; stale slots behind it are overwritten later.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import onnxruntime as ort
import psutil

from edgespec.errors import InvalidRequest
from edgespec.onnx.providers import PROVIDERS, check_provider

log = logging.getLogger(__name__)

_DEVICE = {"cuda": "cuda", "tensorrt": "cuda"}  # where a provider wants its KV buffer
MASKED = np.float32(-np.inf)


def available_providers() -> list[str]:
    """Short names (keys of PROVIDERS) of the execution providers this onnxruntime has."""
    have = set(ort.get_available_providers())
    return [short for short, full in PROVIDERS.items() if full in have]


def _options(n_threads: int | None) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.intra_op_num_threads = n_threads or psutil.cpu_count(logical=False) or 1
    so.inter_op_num_threads = 1
    # Spinning workers would keep the cores busy after a draft, while the target verifies.
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = 3
    return so


def open_session(model: Path, provider: str, n_threads: int | None) -> tuple[ort.InferenceSession, str]:
    """A session on ``provider``, or on the CPU (one warning) when it is absent or refuses the graph.

    Returns:
        (session, the provider short name actually used).
    Raises:
        UnknownProvider: ``provider`` is not a name in PROVIDERS.
    """
    check_provider(provider)
    so = _options(n_threads)
    if provider != "cpu":
        if provider not in available_providers():
            log.warning("onnx provider %s is not installed in this onnxruntime; drafting on the CPU",
                        provider)
        else:
            try:
                session = ort.InferenceSession(str(model), so, providers=[PROVIDERS[provider],
                                                                          PROVIDERS["cpu"]])
                if session.get_providers()[0] == PROVIDERS[provider]:
                    return session, provider
                log.warning("onnx provider %s did not take the graph; drafting on the CPU", provider)
            # onnxruntime's own errors (Fail, EPFail, InvalidGraph...) derive from Exception only
            except Exception as exc:  # noqa: BLE001
                log.warning("onnx provider %s refused the graph (%s); drafting on the CPU",
                            provider, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    return ort.InferenceSession(str(model), so, providers=[PROVIDERS["cpu"]]), "cpu"


class OnnxLM:
    """A converted drafter: ``forward`` decodes new tokens against the KV buffer's first slots.

    Args:
        directory: a converted model directory (model.onnx, weights.bin, edgespec.json).
        provider: a key of PROVIDERS; falls back to "cpu" as :func:`open_session` says.
        n_ctx: KV slots (the longest context plus draft).
    """

    def __init__(self, directory: str | os.PathLike, provider: str = "cpu", n_ctx: int = 4096,
                 n_threads: int | None = None):
        self.directory = Path(directory)
        self.meta = json.loads((self.directory / "edgespec.json").read_text(encoding="utf-8"))
        shape = self.meta["shape"]
        self.n_layer, self.n_vocab = shape["n_layer"], shape["n_vocab"]
        self.n_ctx = n_ctx
        self.session, self.provider = open_session(self.directory / "model.onnx", provider, n_threads)
        kv_shape = (1, shape["n_head_kv"], n_ctx, shape["n_embd"] // shape["n_head"])
        device = _DEVICE.get(self.provider, "cpu")
        self.kv = [ort.OrtValue.ortvalue_from_shape_and_type(kv_shape, np.float32, device, 0)
                   for _ in range(2 * self.n_layer)]
        self.kv_bytes = 2 * self.n_layer * int(np.prod(kv_shape)) * 4

    @property
    def nbytes(self) -> int:
        """Weights (the file onnxruntime loads) and the KV buffer."""
        return (self.directory / "weights.bin").stat().st_size + self.kv_bytes

    def forward(self, tokens, positions, past: int, bias: np.ndarray | None = None,
                rows=None) -> np.ndarray:
        """Decodes ``tokens`` into slots ``past..past+S-1``.

        Args:
            tokens, positions: [S] ids and their rotary positions.
            past: slots before these that count (what the KV buffer holds for this context).
            bias: [S, past + S] additive mask (0 or -inf); None: each token sees every slot
                before it (GroupQueryAttention adds the causal part itself).
            rows: which of the S tokens to return logits for; None: the last one.
        Returns:
            [len(rows), n_vocab] float32 logits.
        """
        s = len(tokens)
        total = past + s
        if total > self.n_ctx:
            raise InvalidRequest(f"ONNX drafter context full ({total} > {self.n_ctx} slots)")
        rows = np.asarray([s - 1] if rows is None else rows, np.int64)
        bias = np.zeros((s, total), np.float32) if bias is None else bias.astype(np.float32)
        io = self.session.io_binding()
        io.bind_cpu_input("input_ids", np.asarray(tokens, np.int64)[None])
        io.bind_cpu_input("position_ids", np.asarray(positions, np.int64)[None])
        io.bind_cpu_input("attention_bias", bias[None, None])
        io.bind_cpu_input("seqlens_k", np.array([total - 1], np.int32))
        io.bind_cpu_input("total_sequence_length", np.array(total, np.int32))
        io.bind_cpu_input("logit_rows", rows)
        io.bind_output("logits", "cpu")  # first: outputs come back in binding order
        for i in range(self.n_layer):
            for j, kind in enumerate(("key", "value")):
                io.bind_ortvalue_input(f"past_{kind}.{i}", self.kv[2 * i + j])
                io.bind_ortvalue_output(f"present_{kind}.{i}", self.kv[2 * i + j])
        self.session.run_with_iobinding(io)
        return io.get_outputs()[0].numpy()[0]

    def close(self) -> None:
        self.kv = []
        self.session = None
