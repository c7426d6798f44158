"""ctypes loader of ``libmoe_fp4_cuda.so``, the C ABI of ``csrc/include/moe_fp4/moe_fp4.h``.

The library is looked up at ``$MOE_FP4_LIB`` or ``moe_fp4/_lib/libmoe_fp4_cuda.so`` and loaded
on first use (importing this module loads nothing). It links neither torch nor Python: every
entry takes raw pointers, sizes, dtype codes, a device ordinal and a CUDA stream, and returns
a status. :meth:`NativeLibrary.call` turns a failed status into an exception carrying the
library's message: ``ValueError`` for a failed precondition,
:class:`~moe_fp4.BackendUnavailableError` when the build has no code for the device, and
``RuntimeError`` for a CUDA or CUTLASS error.
"""

from __future__ import annotations

import ctypes
import os
from ctypes import POINTER, c_char_p, c_int, c_int32, c_int64, c_size_t, c_void_p
from pathlib import Path

from .backends.registry import BackendUnavailableError

__all__ = [
    "ABI_VERSION",
    "BF16",
    "FP16",
    "FP32",
    "GEMM",
    "HOST",
    "PIPELINE",
    "LibraryUnavailable",
    "NativeLibrary",
    "library",
    "library_path",
]

ENV_LIB = "MOE_FP4_LIB"
LIB_NAME = "libmoe_fp4_cuda.so"
ABI_VERSION = 1

# moe_fp4_status
OK, INVALID_ARGUMENT, UNSUPPORTED, CUDA_ERROR, INTERNAL = range(5)
# moe_fp4_dtype
BF16, FP16, FP32 = 0, 1, 2
# moe_fp4_component
PIPELINE, GEMM = 0, 1
# The device ordinal that runs a pipeline kernel's body on the host, on host memory.
HOST = -1

_P = c_void_p  # every pointer (device or host) travels as an address
_SIGNATURES: dict[str, tuple[type, list[type]]] = {
    "moe_fp4_abi_version": (c_int, []),
    "moe_fp4_last_error": (c_char_p, []),
    "moe_fp4_compiled_archs": (c_char_p, [c_int]),
    "moe_fp4_serves": (c_int, [c_int, c_int, c_int]),
    "moe_fp4_routing_workspace_size": (c_int, [c_int64, c_int32, POINTER(c_size_t)]),
    "moe_fp4_routing": (c_int, [_P, c_int64, c_int32, _P, _P, _P, _P, _P, c_size_t, c_int, _P]),
    "moe_fp4_quantize_rows": (
        c_int,
        [_P, c_int, c_int64, c_int64, _P, c_int32, _P, c_int64, _P, _P, _P, c_int32, _P, _P, c_int64, c_int, _P],
    ),
    "moe_fp4_silu_mul_quantize": (
        c_int,
        [_P, c_int, c_int64, c_int64, _P, _P, _P, c_int32, _P, _P, c_int64, c_int, _P],
    ),
    "moe_fp4_moe_reduce": (c_int, [_P, c_int, c_int64, c_int64, _P, _P, c_int64, c_int32, _P, c_int, c_int, _P]),
    "moe_fp4_grouped_gemm_workspace_size": (c_int, [c_int32, c_int32, c_int, c_int, POINTER(c_size_t)]),
    "moe_fp4_grouped_gemm": (
        c_int,
        [_P, _P, c_int64, c_int64, _P, _P, _P, c_int32, c_int32, c_int64, c_int64, _P, _P, _P, c_int, _P, c_size_t,
         c_int, _P],
    ),
    "moe_fp4_gemm_scale_offsets": (c_int, [c_int, c_int, c_int64, c_int64, _P]),
    "moe_fp4_gemm_plan": (c_int, [c_int, c_int, c_int32, c_int32, c_int, POINTER(c_size_t)]),
    "moe_fp4_gemm_group_args": (c_int, [c_int, _P, _P, c_int32, c_int32, c_int64, c_int64, c_int64, c_int64, _P]),
}


class LibraryUnavailable(ImportError):
    """The CUDA library cannot be used here; the message says why and how to get it."""


_DEFAULT_PATH = Path(__file__).resolve().parent / "_lib" / LIB_NAME


def library_path() -> Path:
    """Where the library is looked up: ``$MOE_FP4_LIB``, else ``moe_fp4/_lib/libmoe_fp4_cuda.so``."""
    env = os.environ.get(ENV_LIB)
    return Path(env) if env else _DEFAULT_PATH


class NativeLibrary:
    """One loaded ``libmoe_fp4_cuda.so`` with its entries declared."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        for name, (restype, argtypes) in _SIGNATURES.items():
            try:
                fn = getattr(self._lib, name)
            except AttributeError:
                raise LibraryUnavailable(f"library not usable: {path} lacks the entry {name} (rebuild it)") from None
            fn.restype, fn.argtypes = restype, argtypes
        abi = self._lib.moe_fp4_abi_version()
        if abi != ABI_VERSION:
            raise LibraryUnavailable(f"library not usable: {path} has ABI version {abi}, this moe_fp4 needs {ABI_VERSION}")

    def last_error(self) -> str:
        return self._lib.moe_fp4_last_error().decode(errors="replace")

    def call(self, name: str, *args) -> None:
        """Call entry ``name``; raise on a failed status (see the module docstring)."""
        status = getattr(self._lib, name)(*args)
        if status == OK:
            return
        message = f"{name}: {self.last_error()}"
        if status == INVALID_ARGUMENT:
            raise ValueError(message)
        if status == UNSUPPORTED:
            raise BackendUnavailableError(message)
        raise RuntimeError(message)

    def archs(self, component: int) -> list[str]:
        """The targets this build holds code for (``["sm_100a", "sm_120f"]`` for :data:`GEMM`)."""
        text = self._lib.moe_fp4_compiled_archs(component).decode()
        return text.split(",") if text else []

    def serves(self, component: int, capability: tuple[int, int]) -> str | None:
        """None when the build has code of ``component`` for ``capability``, else the reason."""
        if self._lib.moe_fp4_serves(component, capability[0], capability[1]) == OK:
            return None
        return self.last_error()

    def size_query(self, name: str, *args) -> int:
        """Call a ``*_workspace_size`` entry (its last argument is the result)."""
        result = c_size_t(0)
        self.call(name, *args, ctypes.byref(result))
        return int(result.value)


_loaded: dict[Path, NativeLibrary] = {}


def library() -> NativeLibrary:
    """The library at :func:`library_path`, loaded once; raises :class:`LibraryUnavailable`."""
    path = library_path()
    if path in _loaded:
        return _loaded[path]
    if not path.is_file():
        how = f"{ENV_LIB} points to it" if os.environ.get(ENV_LIB) else "it is built when moe_fp4 is installed with nvcc on PATH"
        raise LibraryUnavailable(f"library not built: {path} does not exist ({how})")
    try:
        lib = NativeLibrary(path)
    except OSError as exc:
        raise LibraryUnavailable(f"library not loadable: {exc}") from None
    _loaded[path] = lib
    return lib
