"""The exceptions of moe_fp4 (imported by every layer, importing nothing of moe_fp4).

Argument errors are plain ``TypeError`` / ``ValueError`` naming the argument (see
:mod:`moe_fp4._checks`); these classes are for what is not the caller's argument.
"""

from __future__ import annotations

__all__ = ["BackendUnavailableError", "LibraryUnavailable"]


class BackendUnavailableError(RuntimeError):
    """A backend that was asked for by name cannot run here; the message says why and what to do."""


class LibraryUnavailable(ImportError):
    """The CUDA library cannot be used here; the message says why and how to get it."""
