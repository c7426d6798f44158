"""The host path of :func:`moe_fp4.fused_moe` without a GPU: every kernel launch stubbed.

:func:`stubbed_launches` lets ``backend="cutlass"`` and ``backend="triton"`` run their whole
Python path on CPU tensors (validation, dispatch, plans, argument marshalling, the ctypes
calls and Triton's launch wrappers) while no kernel runs, so that the host cost of each part
can be timed on any machine (``benchmarks/pipeline_host_cost.py``) and the launches a forward
makes can be recorded and compared (``tests/test_workspace_streams.py``). Outputs are garbage.

What is not the real path: the CUDA library's entries return OK at once (a C function of the
interpreter that returns 0, or with ``record`` a Python callback); Triton's own launcher
(``JITFunction.run``: argument binding, specialization, the driver call) is not run; CUDA-only
queries (the current stream, graph capture) take their CPU branch.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
from collections.abc import Iterator
from pathlib import Path

from .. import _native, pipeline
from .. import experts as experts_module
from .. import moe as moe_module
from ..backends import registry

__all__ = ["noop_library", "stubbed_launches"]

_TRITON_MODULES = ("routing", "quantize", "gemm", "reduce")  # moe_fp4.triton_kernels modules that launch
# A C function taking no arguments that returns 0 while the interpreter runs: called with an
# entry's arguments it ignores them (the C calling conventions leave them to the caller).
_RETURNS_ZERO = getattr(ctypes.pythonapi, "Py_IsFinalizing", None) or ctypes.pythonapi._Py_IsFinalizing


class _Handle:
    """Stands in for ``ctypes.CDLL`` of the library: the entries of :func:`moe_fp4._native.entries`."""

    def __init__(self, record: list | None) -> None:
        self._record = record

    def __getattr__(self, name: str):
        restype, params = _native.entries()[name]
        if name == "moe_fp4_abi_version":
            fn = ctypes.CFUNCTYPE(restype)(lambda: _native.ABI_VERSION)
        elif self._record is None:
            fn = ctypes.CFUNCTYPE(restype)(ctypes.cast(_RETURNS_ZERO, ctypes.c_void_p).value)
        else:
            record = self._record

            def entry(*args):
                record.append((name, args))
                return 0

            fn = ctypes.CFUNCTYPE(restype, *(t for _, t in params))(entry)
        setattr(self, name, fn)  # NativeLibrary sets restype and argtypes on it, as on the real entry
        return fn


def noop_library(record: list | None = None) -> _native.NativeLibrary:
    """A :class:`~moe_fp4._native.NativeLibrary` whose entries do nothing and return OK; with ``record``,
    each call appends ``(entry name, arguments as ctypes converted them)``."""
    return _native.NativeLibrary(Path("<no-op entries>"), _Handle(record))


class _StubKernel:
    """A Triton kernel whose launches do nothing (``kernel[grid](*args, **kwargs)``), or are recorded."""

    def __init__(self, name: str, record: list | None) -> None:
        self.name, self._record = name, record

    def __getitem__(self, grid):
        if self._record is None:
            return _no_launch
        return lambda *args, **kwargs: self._record.append((self.name, grid, args, kwargs))


def _no_launch(*args, **kwargs) -> None:
    return None


@contextlib.contextmanager
def stubbed_launches(record: list | None = None, *, sm90: bool = True) -> Iterator[None]:
    """Within the block ``fused_moe(..., backend="cutlass" | "triton")`` runs on CPU tensors, launching nothing.

    The CUDA library is :func:`noop_library` (``record``: its calls are appended); every
    Triton kernel of ``moe_fp4.triton_kernels`` is a stub (``record``: ``(kernel, grid, args,
    kwargs)`` appended; nothing to stub without triton), ``validate=True``'s ``moe_fp4_check_inputs``
    among the library's entries (it checks CPU tensors with ``moe._HOST_ORACLE`` set, answering
    "valid"); named backends resolve on any device
    and the cutlass stages skip their CUDA-device requirement; the cutlass backend takes its
    compute capability 9.x stage sets with ``sm90``, else the SM100/SM120 one. Workspaces (and
    so plans) made in the block are its own: after it, calls build real ones again. Weights an
    experts object prepares in the block (the sm_90a layout) are the stubbed library's, garbage,
    and copies (never re-laid out in place): such experts are for the block only.
    """
    from ..backends import cutlass, triton

    lib = noop_library(record)
    saved: list[tuple[object, str, object]] = []

    def patch(owner: object, name: str, value: object) -> None:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    try:
        package = triton.kernels().__name__
    except ImportError:  # no triton: the cutlass path alone
        package = None
    for module in _TRITON_MODULES if package else ():
        mod = importlib.import_module(f"{package}.{module}")
        for name, value in list(vars(mod).items()):
            if name.endswith("_kernel") and hasattr(value, "__getitem__") and hasattr(value, "fn"):
                patch(mod, name, _StubKernel(name, record))
    patch(_native, "library", lambda: lib)
    patch(moe_module, "_check_entry", None)  # validate's library entry: the stub's (where it checks these tensors)
    patch(experts_module, "IN_PLACE_LAYOUTS", False)  # the stubbed re-layout writes nothing: copies only
    patch(cutlass, "_require_cuda", lambda name, t, why: None)
    patch(cutlass, "_is_sm90", lambda device: sm90)
    patch(registry, "select_backend", lambda backend, device=None, dtype=None, precision="w4a4", layer=None: backend)
    patch(pipeline, "_WORKSPACES", {})
    registry.clear_resolved_backends()
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)
        registry.clear_resolved_backends()
