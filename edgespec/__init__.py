"""edgespec: on-device speculative decoding for GGUF models over llama.cpp."""
from __future__ import annotations

import edgespec.llama  # noqa: F401  isort: skip  (llama.cpp's libraries before numpy's: see there)
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
