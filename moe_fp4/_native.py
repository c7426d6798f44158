"""ctypes loader of ``libmoe_fp4_cuda.so``, the C ABI of ``csrc/include/moe_fp4/moe_fp4.h``.

The library is looked up at ``$MOE_FP4_LIB`` or ``moe_fp4/_lib/libmoe_fp4_cuda.so`` and loaded
on first use (importing this module loads nothing). It links neither torch nor Python: every
entry takes raw pointers, sizes, dtype codes, a device ordinal and a CUDA stream, and returns
a status. :meth:`NativeLibrary.call` turns a failed status into an exception carrying the
library's message: ``ValueError`` for a failed precondition,
:class:`~moe_fp4.BackendUnavailableError` when the build has no code for the device, and
``RuntimeError`` for a CUDA or CUTLASS error.

:meth:`NativeLibrary.bind` converts some of an entry's arguments to their C types once and
returns a :class:`BoundEntry` that takes the others positionally: what a forward that repeats
(the same buffers, sizes and weights; new inputs, output and stream) calls, at about the cost
of the ctypes call itself.
"""

from __future__ import annotations

import ctypes
import os
from ctypes import POINTER, c_char_p, c_int, c_int32, c_int64, c_size_t, c_void_p
from pathlib import Path

from .errors import BackendUnavailableError, LibraryUnavailable

__all__ = [
    "ABI_VERSION",
    "BF16",
    "FP16",
    "FP32",
    "GEMM",
    "HOST",
    "INT32",
    "INT64",
    "PIPELINE",
    "ROUTING_QUANTIZE_MAX_SLOTS",
    "BoundEntry",
    "LibraryUnavailable",
    "NativeLibrary",
    "library",
    "library_path",
]

ENV_LIB = "MOE_FP4_LIB"
LIB_NAME = "libmoe_fp4_cuda.so"
ABI_VERSION = 11

# moe_fp4_status
OK, INVALID_ARGUMENT, UNSUPPORTED, CUDA_ERROR, INTERNAL = range(5)
# moe_fp4_dtype (the integer codes describe index tensors: moe_fp4_check_inputs)
BF16, FP16, FP32, INT32, INT64 = 0, 1, 2, 3, 4
# moe_fp4_component
PIPELINE, GEMM = 0, 1
# The device ordinal that runs a pipeline kernel's body on the host, on host memory.
HOST = -1
# Slots up to which moe_fp4_routing_quantize_values routes and quantizes in one launch.
ROUTING_QUANTIZE_MAX_SLOTS = 256

_P = c_void_p  # every pointer (device or host) travels as an address
_SIZE_OUT = POINTER(c_size_t)  # a size the entry writes (its result)

# Every entry of csrc/include/moe_fp4/moe_fp4.h with its parameters, named and in order as
# the header declares them (tests/test_native.py parses the header and checks this table).
# Calls name their arguments (NativeLibrary.call, NativeLibrary.bind); only a bound entry's free
# parameters go by position, in this order.
_SIGNATURES: dict[str, tuple[type, tuple[tuple[str, type], ...]]] = {
    "moe_fp4_abi_version": (c_int, ()),
    "moe_fp4_last_error": (c_char_p, ()),
    "moe_fp4_compiled_archs": (c_char_p, (("component", c_int),)),
    "moe_fp4_serves": (c_int, (("component", c_int), ("major", c_int), ("minor", c_int))),
    "moe_fp4_routing_workspace_size": (
        c_int, (("num_slots", c_int64), ("num_experts", c_int32), ("bytes", _SIZE_OUT)),
    ),
    "moe_fp4_routing": (
        c_int,
        (("topk_ids", _P), ("num_slots", c_int64), ("num_experts", c_int32), ("expert_offsets", _P),
         ("blockscale_offsets", _P), ("slot_to_flat", _P), ("flat_to_slot", _P), ("workspace", _P),
         ("workspace_bytes", c_size_t), ("device", c_int), ("stream", _P)),
    ),
    "moe_fp4_quantize_rows": (
        c_int,
        (("x", _P), ("x_dtype", c_int), ("x_rows", c_int64), ("k", c_int64), ("slot_to_flat", _P), ("topk", c_int32),
         ("row_scale", _P), ("num_slots", c_int64), ("gs", _P), ("expert_offsets", _P), ("blockscale_offsets", _P),
         ("num_experts", c_int32), ("packed", _P), ("scales", _P), ("scale_rows", c_int64), ("values", _P),
         ("device", c_int), ("stream", _P)),
    ),
    "moe_fp4_quantize_values_by_token": (
        c_int,
        (("x", _P), ("x_dtype", c_int), ("x_rows", c_int64), ("k", c_int64), ("flat_to_slot", _P), ("topk", c_int32),
         ("row_scale", _P), ("num_slots", c_int64), ("gs", _P), ("expert_offsets", _P), ("num_experts", c_int32),
         ("values", _P), ("device", c_int), ("stream", _P)),
    ),
    "moe_fp4_routing_quantize_values": (
        c_int,
        (("topk_ids", _P), ("x", _P), ("x_dtype", c_int), ("x_rows", c_int64), ("k", c_int64), ("topk", c_int32),
         ("row_scale", _P), ("gs", _P), ("num_experts", c_int32), ("expert_offsets", _P), ("blockscale_offsets", _P),
         ("slot_to_flat", _P), ("flat_to_slot", _P), ("values", _P), ("device", c_int), ("stream", _P)),
    ),
    "moe_fp4_silu_mul_quantize": (
        c_int,
        (("h", _P), ("h_dtype", c_int), ("num_slots", c_int64), ("inter", c_int64), ("gs", _P),
         ("expert_offsets", _P), ("blockscale_offsets", _P), ("num_experts", c_int32), ("packed", _P),
         ("scales", _P), ("scale_rows", c_int64), ("values", _P), ("device", c_int), ("stream", _P)),
    ),
    "moe_fp4_moe_reduce": (
        c_int,
        (("y", _P), ("y_dtype", c_int), ("y_rows", c_int64), ("hidden", c_int64), ("flat_to_slot", _P),
         ("topk_weights", _P), ("num_tokens", c_int64), ("topk", c_int32), ("out", _P), ("out_dtype", c_int),
         ("device", c_int), ("stream", _P)),
    ),
    "moe_fp4_check_inputs": (
        c_int,
        (("x", _P), ("x_dtype", c_int), ("x_numel", c_int64), ("weights", _P), ("weights_numel", c_int64),
         ("ids", _P), ("ids_dtype", c_int), ("ids_numel", c_int64), ("expert_map", _P), ("map_dtype", c_int),
         ("map_numel", c_int64), ("result", _P), ("device", c_int), ("stream", _P)),
    ),
    "moe_fp4_grouped_gemm_workspace_size": (
        c_int,
        (("num_experts", c_int32), ("sections", c_int32), ("out_dtype", c_int), ("device", c_int),
         ("bytes", _SIZE_OUT)),
    ),
    "moe_fp4_grouped_gemm": (
        c_int,
        (("a", _P), ("a_scales", _P), ("a_rows", c_int64), ("a_scale_rows", c_int64), ("b", _P), ("b_scales", _P),
         ("alpha", _P), ("num_experts", c_int32), ("sections", c_int32), ("n", c_int64), ("k", c_int64),
         ("expert_offsets", _P), ("blockscale_offsets", _P), ("out", _P), ("out_dtype", c_int), ("workspace", _P),
         ("workspace_bytes", c_size_t), ("device", c_int), ("stream", _P)),
    ),
    "moe_fp4_sm90_prepared_sizes": (
        c_int,
        (("num_experts", c_int32), ("n", c_int64), ("k", c_int64), ("w_bytes", _SIZE_OUT),
         ("scale_bytes", _SIZE_OUT)),
    ),
    "moe_fp4_sm90_prepare_weights": (
        c_int,
        (("w", _P), ("scales", _P), ("num_experts", c_int32), ("n", c_int64), ("k", c_int64), ("sections", c_int32),
         ("w_out", _P), ("scales_out", _P), ("device", c_int), ("stream", _P)),
    ),
    "moe_fp4_sm90_restore_weights": (
        c_int,
        (("w", _P), ("scales", _P), ("num_experts", c_int32), ("n", c_int64), ("k", c_int64), ("sections", c_int32),
         ("w_out", _P), ("scales_out", _P), ("device", c_int), ("stream", _P)),
    ),
    "moe_fp4_sm90_gemm_tile_tokens": (
        c_int, (("a_rows", c_int64), ("num_experts", c_int32), ("tile_tokens", _P)),
    ),
    "moe_fp4_sm90_grouped_gemm": (
        c_int,
        (("a", _P), ("a_dtype", c_int), ("a_rows", c_int64), ("k", c_int64), ("w", _P), ("w_scales", _P),
         ("alpha", _P), ("num_experts", c_int32), ("sections", c_int32), ("n", c_int64), ("expert_offsets", _P),
         ("out", _P), ("tile_tokens", c_int32), ("device", c_int), ("stream", _P)),
    ),
    "moe_fp4_sm90_grouped_gemm_ws": (
        c_int,
        (("a", _P), ("a_dtype", c_int), ("a_rows", c_int64), ("k", c_int64), ("w", _P), ("w_scales", _P),
         ("alpha", _P), ("num_experts", c_int32), ("sections", c_int32), ("n", c_int64), ("expert_offsets", _P),
         ("out", _P), ("tile_tokens", c_int32), ("workspace", _P), ("workspace_bytes", c_size_t), ("device", c_int),
         ("stream", _P)),
    ),
    "moe_fp4_sm90_gemm_silu": (
        c_int,
        (("a", _P), ("a_dtype", c_int), ("a_rows", c_int64), ("k", c_int64), ("w", _P), ("w_scales", _P),
         ("alpha", _P), ("num_experts", c_int32), ("n", c_int64), ("expert_offsets", _P), ("gs", _P),
         ("values", _P), ("tile_tokens", c_int32), ("slices", c_int32), ("cta_splits", c_int32),
         ("gs_splits", c_int32), ("workspace", _P), ("workspace_bytes", c_size_t), ("device", c_int),
         ("stream", _P)),
    ),
    "moe_fp4_sm90_gemm_workspace_size": (
        c_int,
        (("a_rows", c_int64), ("num_experts", c_int32), ("n", c_int64), ("k", c_int64), ("tile_tokens", c_int32),
         ("sm_count", c_int32), ("bytes", _SIZE_OUT)),
    ),
    "moe_fp4_sm90_grouped_gemm_config": (
        c_int,
        (("a", _P), ("a_dtype", c_int), ("a_rows", c_int64), ("k", c_int64), ("w", _P), ("w_scales", _P),
         ("alpha", _P), ("num_experts", c_int32), ("sections", c_int32), ("n", c_int64), ("expert_offsets", _P),
         ("out", _P), ("tile_tokens", c_int32), ("slices", c_int32), ("cta_splits", c_int32),
         ("gs_splits", c_int32), ("workspace", _P), ("workspace_bytes", c_size_t), ("device", c_int),
         ("stream", _P)),
    ),
    "moe_fp4_sm90_gemm_plan": (
        c_int,
        (("a_rows", c_int64), ("num_experts", c_int32), ("n", c_int64), ("k", c_int64), ("sm_count", c_int32),
         ("with_workspace", c_int32), ("tile_tokens", _P), ("slices", _P), ("cta_splits", _P), ("gs_splits", _P)),
    ),
    "moe_fp4_gemm_scale_offsets": (
        c_int, (("arch", c_int), ("operand", c_int), ("rows", c_int64), ("k", c_int64), ("offsets", _P)),
    ),
    "moe_fp4_gemm_plan": (
        c_int,
        (("arch", c_int), ("out_dtype", c_int), ("num_experts", c_int32), ("sections", c_int32),
         ("sm_count", c_int), ("workspace_bytes", _SIZE_OUT)),
    ),
    "moe_fp4_gemm_group_args": (
        c_int,
        (("arch", c_int), ("expert_offsets", _P), ("blockscale_offsets", _P), ("num_experts", c_int32),
         ("sections", c_int32), ("n", c_int64), ("k", c_int64), ("a_rows", c_int64), ("a_scale_rows", c_int64),
         ("out", _P)),
    ),
    "moe_fp4_launch_kernels": (
        c_int,
        (("launches", _P), ("count", c_int32), ("free_values", _P), ("num_free", c_int32), ("device", c_int),
         ("stream", _P)),
    ),
}


def signature(name: str) -> tuple[tuple[str, type], ...]:
    """The named parameters of entry ``name``, in the header's order."""
    return _SIGNATURES[name][1]


def entries() -> dict[str, tuple[type, tuple[tuple[str, type], ...]]]:
    """Every entry this module declares: ``{name: (return type, ((parameter, ctypes type), ...))}``."""
    return dict(_SIGNATURES)


_DEFAULT_PATH = Path(__file__).resolve().parent / "_lib" / LIB_NAME


def library_path() -> Path:
    """Where the library is looked up: ``$MOE_FP4_LIB``, else ``moe_fp4/_lib/libmoe_fp4_cuda.so``."""
    env = os.environ.get(ENV_LIB)
    return Path(env) if env else _DEFAULT_PATH


class NativeLibrary:
    """One loaded ``libmoe_fp4_cuda.so`` with its entries declared.

    ``handle``: the loaded library, ``ctypes.CDLL(path)`` by default (a stand-in with the same
    entries, e.g. :func:`moe_fp4.bench.hostcost.noop_library`'s, measures the host path alone).
    """

    def __init__(self, path: Path, handle: object = None) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path)) if handle is None else handle
        for name, (restype, params) in _SIGNATURES.items():
            try:
                fn = getattr(self._lib, name)
            except AttributeError:
                raise LibraryUnavailable(f"library not usable: {path} lacks the entry {name} (rebuild it)") from None
            fn.restype, fn.argtypes = restype, [t for _, t in params]
        abi = self._lib.moe_fp4_abi_version()
        if abi != ABI_VERSION:
            raise LibraryUnavailable(
                f"library not usable: {path} has ABI version {abi}, this moe_fp4 needs {ABI_VERSION}"
            )

    def last_error(self) -> str:
        return self._lib.moe_fp4_last_error().decode(errors="replace")

    def call(self, name: str, **args) -> None:
        """Call entry ``name`` with its parameters by name; raise on a failed status (see the module docstring)."""
        params = [p for p, _ in signature(name)]
        if set(args) != set(params):
            missing, extra = sorted(set(params) - set(args)), sorted(set(args) - set(params))
            raise TypeError(f"{name}: expected the parameters {params}, missing {missing}, unexpected {extra}")
        self.bind(name, **args)()

    def bind(self, name: str, _keep: tuple = (), **static) -> BoundEntry:
        """Entry ``name`` with the parameters ``static`` (by name) converted to their C types now; the
        result takes the others positionally, in the header's order (:attr:`BoundEntry.free`).

        ``_keep``: tensors whose addresses ``static`` passes and that nothing else may keep alive
        (a scratch buffer allocated for this call): the entry holds them until it is dropped.
        """
        params = signature(name)
        extra = sorted(set(static) - {p for p, _ in params})
        if extra:
            raise TypeError(f"{name}: unexpected parameters {extra}; the header's are {[p for p, _ in params]}")
        args = [None if p not in static else static[p] if t is _SIZE_OUT else t(static[p]) for p, t in params]
        free = tuple(i for i, (p, _) in enumerate(params) if p not in static)
        return BoundEntry(self, name, getattr(self._lib, name), args, free, tuple(_keep))

    def function(self, name: str):
        """Entry ``name`` itself: the ctypes function, its C types declared, that returns the status
        (for a hot path that passes every argument and calls :meth:`check` on a failure itself;
        ~0.5 us cheaper per call than a :class:`BoundEntry`)."""
        signature(name)  # a KeyError for an entry the table does not declare
        return getattr(self._lib, name)

    def check(self, name: str, status: int) -> None:
        """Raise the exception for entry ``name``'s failed ``status`` (see the module docstring)."""
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

    def size_query(self, name: str, **args) -> int:
        """Call an entry whose one ``size_t*`` parameter is its result (``*_workspace_size``, ``gemm_plan``)."""
        (out,) = [p for p, t in signature(name) if t is _SIZE_OUT]
        result = c_size_t(0)
        self.call(name, **args, **{out: ctypes.byref(result)})
        return int(result.value)


class BoundEntry:
    """One entry of a :class:`NativeLibrary` with some parameters bound (:meth:`NativeLibrary.bind`).

    Calling it passes the free parameters, positionally in the header's order, with the bound
    ones (already converted to their C types), and raises on a failed status as
    :meth:`NativeLibrary.call` does. ``free``: the names of the free parameters.
    """

    __slots__ = ("_args", "_fn", "_keep", "_lib", "_slots", "name")

    def __init__(self, lib: NativeLibrary, name: str, fn, args: list, slots: tuple[int, ...],
                 keep: tuple = ()) -> None:
        self._lib, self.name, self._fn, self._args, self._slots = lib, name, fn, args, slots
        self._keep = keep  # the buffers behind bound pointers: alive as long as the entry

    @property
    def free(self) -> tuple[str, ...]:
        params = signature(self.name)
        return tuple(params[i][0] for i in self._slots)

    def __call__(self, *values) -> None:
        if len(values) != len(self._slots):
            raise TypeError(f"{self.name}: expected values of the free parameters {list(self.free)}, "
                            f"got {len(values)} values")
        args = self._args.copy()
        for i, v in zip(self._slots, values):
            args[i] = v
        status = self._fn(*args)
        if status:
            self._lib.check(self.name, status)


_loaded: dict[Path, NativeLibrary] = {}


def library() -> NativeLibrary:
    """The library at :func:`library_path`, loaded once; raises :class:`LibraryUnavailable`."""
    path = library_path()
    if path in _loaded:
        return _loaded[path]
    if not path.is_file():
        how = (f"{ENV_LIB} points to it" if os.environ.get(ENV_LIB)
               else "it is built when moe_fp4 is installed with nvcc on PATH")
        raise LibraryUnavailable(f"library not built: {path} does not exist ({how})")
    try:
        lib = NativeLibrary(path)
    except OSError as exc:
        raise LibraryUnavailable(f"library not loadable: {exc}") from None
    _loaded[path] = lib
    return lib
