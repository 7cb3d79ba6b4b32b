"""Typed exceptions of the edgespec library.

Every error a user can cause is one of these, with a message that fits on one line and says
what to do; the CLI prints ``str(exc)`` and exits non-zero, the server maps them to HTTP codes.
"""
from __future__ import annotations


class EdgespecError(Exception):
    """Base of all errors edgespec raises on purpose."""


class ModelNotFound(EdgespecError):
    """A model name is not in the store and is not a path to a file."""


class InvalidGGUF(EdgespecError):
    """A file is not a well-formed GGUF file; raised before llama.cpp ever reads it."""

    def __init__(self, path: str, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: not a valid GGUF file: {problem}")


class IntegrityError(EdgespecError):
    """A downloaded or stored model does not have the size or sha256 its manifest pins."""


class StoreError(EdgespecError):
    """The model store could not fetch, assemble, import or remove a model."""


class InvalidRequest(EdgespecError):
    """Arguments of a generation request are out of range or inconsistent."""


class BudgetExceeded(EdgespecError):
    """A memory budget cannot be met by any placement."""


class IncompatibleModels(EdgespecError):
    """A drafter's vocabulary does not match its target's."""


class CloneError(EdgespecError):
    """A shape clone cannot be made: inconsistent shape options, or tensors it cannot rescale."""


class BackendError(EdgespecError):
    """llama.cpp refused an operation (load, decode, cache edit)."""


class QueueFull(EdgespecError):
    """An engine's request queue already holds as many waiting requests as it may."""


class UnsupportedModel(EdgespecError):
    """A model's architecture or weight format is outside what an operation supports."""


class UnknownProvider(InvalidRequest):
    """An ONNX execution provider name is not one edgespec knows (edgespec.onnx.session.PROVIDERS)."""
