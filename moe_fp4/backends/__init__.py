"""Backends of moe_fp4: ``cutlass``, ``triton`` and ``reference``, declared in :mod:`.registry`."""

from ..errors import BackendUnavailableError
from .registry import (
    BACKENDS,
    Backend,
    available_backends,
    backend_status,
    explain_backend,
    select_backend,
)

__all__ = [
    "BACKENDS",
    "Backend",
    "BackendUnavailableError",
    "available_backends",
    "backend_status",
    "explain_backend",
    "select_backend",
]
