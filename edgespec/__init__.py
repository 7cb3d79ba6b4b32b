"""edgespec: on-device speculative decoding for GGUF models over llama.cpp."""
from __future__ import annotations

from edgespec.errors import (
    BackendError,
    BudgetExceeded,
    EdgespecError,
    IncompatibleModels,
    IntegrityError,
    InvalidGGUF,
    InvalidRequest,
    ModelNotFound,
    QueueFull,
    StoreError,
)

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "BudgetExceeded",
    "EdgespecError",
    "IncompatibleModels",
    "IntegrityError",
    "InvalidGGUF",
    "InvalidRequest",
    "ModelNotFound",
    "QueueFull",
    "StoreError",
    "__version__",
]
