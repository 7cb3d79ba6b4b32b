"""onnxruntime execution providers by their short names, without importing onnxruntime.

``--onnx-provider`` takes a key of ``PROVIDERS``; EngineConfig and DraftConfig validate it here
(cheaply) and edgespec.onnx.session opens the session on it, falling back to the CPU.
"""
from __future__ import annotations

from edgespec.errors import InvalidRequest, UnknownProvider

PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "dml": "DmlExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "qnn": "QNNExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
}
NAMES = tuple(PROVIDERS)
BITS = ("exact", "4")  # the conversions: the GGUF's own blocks, or 4-bit
# Providers whose weights and KV buffer live in a discrete GPU's memory, not in RAM.
GPU_MEMORY = frozenset({"cuda", "tensorrt"})


def check_provider(name: str) -> str:
    """``name`` if it is a key of PROVIDERS; raises UnknownProvider otherwise."""
    if name not in PROVIDERS:
        raise UnknownProvider(f"--onnx-provider must be one of {', '.join(NAMES)}, not {name!r}")
    return name


def check_options(provider: str, bits: str) -> None:
    """Raises UnknownProvider / InvalidRequest for an unknown --onnx-provider / --onnx-bits."""
    check_provider(provider)
    if bits not in BITS:
        raise InvalidRequest(f"--onnx-bits must be one of {', '.join(BITS)}, not {bits!r}")


def short_name(full: str) -> str | None:
    """The short name of an onnxruntime provider (e.g. CUDAExecutionProvider -> cuda), or None."""
    for short, long in PROVIDERS.items():
        if long == full:
            return short
    return None


def present() -> list[str] | None:
    """onnxruntime's available providers (full names, its order), or None without onnxruntime."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    return list(ort.get_available_providers())


def used_provider(name: str) -> str:
    """The provider a session asked for ``name`` really runs on: ``name`` when this onnxruntime
    has it, else "cpu" (edgespec.onnx.session falls back to the CPU with one warning)."""
    return name if PROVIDERS[check_provider(name)] in (present() or ()) else "cpu"
