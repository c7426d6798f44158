"""A Triton forward's launches in one call of the CUDA library (``moe_fp4_launch_kernels``).

A plan of the Triton backend runs its six to eight launches inside a
:class:`~moe_fp4.triton_kernels._common.LaunchBatch` whose runner is :class:`LibraryRunner`:
each prepared launch is described once (:meth:`LibraryRunner.record`: the compiled kernel's
``CUfunction``, grid, block, shared memory and its parameters laid out as Triton's launcher lays
them out), and each forward passes only the free values (the inputs' and the output's addresses)
to one C call, which writes them into the descriptions and calls ``cuLaunchKernelEx`` for each.
That replaces, per launch, Triton's launcher (its Python wrapper and its argument parsing) with a
few C statements: the part of the eager host time of a Triton forward that the launches cost.

A description is made only where it is exactly Triton's own launch: every parameter of a type
the launcher passes by value (pointers, integers, floats), no scratch memory, one CTA per cluster,
no cooperative launch, and the parameter list the same as the kernel's own in count and sizes
(the ``.param`` list of its PTX entry), so a Triton whose launcher passes something else is
detected, not miscalled. Anything else keeps Triton's launcher (the batch runs what it has
collected first, so the order holds).
"""

from __future__ import annotations

import ctypes
import re
import struct
from ctypes import POINTER, c_int32, c_uint32, c_uint64, c_void_p

from .. import _native


class _KernelLaunch(ctypes.Structure):
    """``moe_fp4_kernel_launch`` of csrc/include/moe_fp4/moe_fp4.h."""

    _fields_ = [
        ("function", c_void_p),
        ("grid_x", c_uint32),
        ("grid_y", c_uint32),
        ("grid_z", c_uint32),
        ("block_x", c_uint32),
        ("shared_bytes", c_uint32),
        ("pdl", c_int32),
        ("num_params", c_int32),
        ("params", POINTER(c_void_p)),
        ("num_free", c_int32),
        ("free_param", POINTER(c_int32)),
        ("free_bytes", POINTER(c_int32)),
    ]


# Bytes of a parameter passed by value, by Triton signature type, and how a fixed value is encoded
# (little-endian, as the launcher's C types hold them: i1 as int8_t, fp16/bf16/fp32 as their bits).
_INT_BYTES = {"i1": 1, "i8": 1, "u1": 1, "u8": 1, "i16": 2, "u16": 2, "i32": 4, "u32": 4, "i64": 8, "u64": 8}
_FLOAT_FORMATS = {"fp16": "<e", "fp32": "<f", "f32": "<f", "fp64": "<d"}


def _float_bits(ty: str, value: float) -> int:
    if ty == "bf16":  # the launcher's pack_bf16: the top half of the float32 bits
        return struct.unpack("<I", struct.pack("<f", value))[0] >> 16
    raw = struct.pack(_FLOAT_FORMATS[ty], value)
    return int.from_bytes(raw, "little")


def _param_bytes(ty: str) -> int | None:
    """Bytes of the kernel parameter Triton's launcher passes for an argument of signature type ``ty``
    (None: a type this runner does not pass)."""
    if ty.startswith("*"):
        return 8
    if ty in _INT_BYTES:
        return _INT_BYTES[ty]
    return {"fp16": 2, "bf16": 2, "fp32": 4, "f32": 4, "fp64": 8}.get(ty)


def launcher_param_sizes(signature: list) -> list[int] | None:
    """The kernel parameters' sizes Triton 3.6's launcher passes for a kernel of this signature (its
    types in order): one per argument that is not a constexpr, then the two scratch pointers."""
    sizes = [_param_bytes(ty) if isinstance(ty, str) else None for ty in signature if ty != "constexpr"]
    return None if None in sizes else [*sizes, 8, 8]


_PTX_BYTES = {"8": 1, "16": 2, "32": 4, "64": 8}


def ptx_param_sizes(ptx: str) -> list[int] | None:
    """The bytes of each parameter of the (first) ``.entry`` of ``ptx``, in order, or None without one:
    ``.param .u64 .ptr ... p0`` is 8, ``.param .u32 p1`` 4, ``.param .align 2 .b8 p3[2]`` 2."""
    m = re.search(r"\.entry\s+[\w$]+\s*\((.*?)\)", ptx, re.S)
    if m is None:
        return None
    sizes = []
    for decl in m.group(1).split(","):
        if not decl.strip():
            continue
        p = re.match(r"\s*\.param\s+(?:\.align\s+\d+\s+)?\.[a-z]+(8|16|32|64)\b[^\[]*?(?:\[(\d+)\])?\s*$", decl)
        if p is None:
            return None
        sizes.append(_PTX_BYTES[p.group(1)] * int(p.group(2) or 1))
    return sizes


class _Record:
    """One launch's description and the storage its pointers point into (alive as long as it)."""

    __slots__ = ("address", "keep", "launch")

    def __init__(self, launch: _KernelLaunch, keep: tuple) -> None:
        self.launch, self.keep = launch, keep
        self.address = ctypes.addressof(launch)


class LibraryRunner:
    """The :class:`~moe_fp4.triton_kernels._common.LaunchBatch` runner over ``moe_fp4_launch_kernels``.

    ``why_not`` maps a kernel's name to why its launches are not batched (diagnostics, tests).
    """

    def __init__(self, lib: _native.NativeLibrary) -> None:
        self._lib = lib
        self._launch = lib.function("moe_fp4_launch_kernels")
        self._last: tuple = (None, (), None)  # the last run's list, its records and their address array (reused)
        self.why_not: dict[str, str] = {}

    def _refuse(self, compiled, why: str) -> None:
        self.why_not[str(getattr(compiled, "name", "?"))] = why

    def record(self, parts: tuple) -> _Record | None:
        """The description of one prepared launch (:meth:`Launch.direct_parts`), or None where this
        runner does not reproduce Triton's launch exactly (the reason in :attr:`why_not`)."""
        _, compiled, grid, values, free = parts
        md = compiled.metadata
        signature = list(getattr(getattr(compiled, "src", None), "signature", {}).values())
        if len(signature) != len(values):
            return self._refuse(compiled, f"{len(signature)} signature entries for {len(values)} arguments")
        if getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_cooperative_grid", False):
            return self._refuse(compiled, "clusters or a cooperative launch")
        if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
            return self._refuse(compiled, "global or profile scratch memory")
        sizes = launcher_param_sizes(signature)
        if sizes is None:
            return self._refuse(compiled, f"a signature type it does not pass: {signature}")
        if ptx_param_sizes(getattr(compiled, "asm", {}).get("ptx", "")) != sizes:
            return self._refuse(compiled, "the kernel's parameters (its PTX entry) are not the ones built")
        if any(values[i] is None for i in free):
            return self._refuse(compiled, "a free argument is None")
        slots: list[int] = []  # each parameter's value in an 8-byte slot (its low bytes)
        index_of: dict[int, int] = {}  # argument position -> parameter index
        for i, (ty, v) in enumerate(zip(signature, values)):
            if ty == "constexpr":
                continue
            index_of[i] = len(slots)
            if ty.startswith("*"):
                slots.append(0 if v is None else int(v))
            elif ty in _INT_BYTES:
                slots.append(int(v) & ((1 << (8 * _INT_BYTES[ty])) - 1))
            else:  # a float
                if i in free:
                    return self._refuse(compiled, f"argument {i} is a float the caller supplies")
                try:
                    slots.append(_float_bits(ty, float(v)))
                except (OverflowError, struct.error):  # Triton's launcher would cast it to inf
                    return self._refuse(compiled, f"argument {i} ({v!r}) is outside {ty}'s range")
        slots += [0, 0]  # Triton's launcher passes the global and the profile scratch pointers last
        function = int(compiled.function)
        sink = len(slots)  # a free value of a specialized (constexpr) argument is written here, unused
        storage = (c_uint64 * (len(slots) + 1))(*slots, 0)
        base = ctypes.addressof(storage)
        params = (c_void_p * (len(slots) + 1))(*[base + 8 * j for j in range(len(slots) + 1)])
        free_param = (c_int32 * max(len(free), 1))(*[index_of.get(i, sink) for i in free])
        free_bytes = (c_int32 * max(len(free), 1))(*[sizes[index_of[i]] if i in index_of else 8 for i in free])
        launch = _KernelLaunch(function, grid[0], grid[1], grid[2], 32 * md.num_warps, md.shared,
                               1 if getattr(md, "launch_pdl", False) else 0, len(slots) + 1, params, len(free),
                               free_param, free_bytes)
        return _Record(launch, (storage, params, free_param, free_bytes))

    def run(self, records: list, free_values: list, device: int, stream: int) -> None:
        n = len(records)
        source, last, addresses = self._last
        # (a replay passes the same list every time: LaunchBatch.replay; a flush a new one)
        if source is not records:
            if len(last) != n or any(a is not b for a, b in zip(last, records)):
                last = tuple(records)  # (holds the records: their storage outlives the array)
                addresses = (c_void_p * n)(*[r.address for r in records])
            self._last = (records, last, addresses)
        # (ctypes' unsigned types take a negative integer as its two's complement, as C's conversion would)
        status = self._launch(addresses, n, (c_uint64 * max(len(free_values), 1))(*free_values), len(free_values),
                              device, stream)
        if status:
            self._lib.check("moe_fp4_launch_kernels", status)


_runner: LibraryRunner | None | bool = None


def runner() -> LibraryRunner | None:
    """The runner over the CUDA library, or None where the library is not available (then the Triton
    backend's launches go through Triton's launcher one by one)."""
    global _runner
    if _runner is None:
        try:
            _runner = LibraryRunner(_native.library())
        except _native.LibraryUnavailable:
            _runner = False
    return _runner or None
