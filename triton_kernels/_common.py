"""Host-side helpers shared by the kernel wrappers of ``moe_fp4.triton_kernels``."""

from __future__ import annotations

import os
import threading

import torch
import triton

from . import _gdc

BLOCK_SIZE = 16  # elements per NVFP4 block scale

# Whether the @triton.jit functions of this package were created for Triton's CPU
# interpreter (TRITON_INTERPRET=1 when the package was imported). The interpreter gets
# numpy's exp and no inline assembly.
INTERPRET: bool = bool(triton.knobs.runtime.interpret)

# Options for the kernels that must reproduce the format core's (and torch's) roundings: no
# FMA contraction (with it, expf's last multiply fuses with silu's "1 +"), and libdevice
# without flush-to-zero, like torch's CUDA math.
EXACT = {"enable_fp_fusion": False, "enable_reflect_ftz": False}

_PDL: dict[int, bool] = {}


def pdl_enabled(device: torch.device) -> bool:
    """Whether the pipeline's kernels on ``device`` launch with programmatic dependent launch
    (:mod:`._gdc`): a CUDA device of compute capability 9.0 or newer, compiled kernels (not the
    CPU interpreter), a Triton that has it, and ``MOE_FP4_PDL`` not ``0`` in the environment (read
    once per device, like the CUDA library's switch of the same name)."""
    if device.type != "cuda" or INTERPRET or not _gdc.AVAILABLE:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    on = _PDL.get(index)
    if on is None:
        on = _PDL[index] = (torch.cuda.get_device_capability(index)[0] >= 9
                            and os.environ.get("MOE_FP4_PDL", "1") != "0")
    return on


def pdl_constants(device: torch.device) -> dict:
    """The ``PDL`` constexpr and Triton's ``launch_pdl`` option of a pipeline launch on ``device``."""
    on = pdl_enabled(device)
    return {"PDL": on, "launch_pdl": on}


def pow2_at_least(n: int, floor: int = 1, cap: int | None = None) -> int:
    """The smallest power of two >= max(n, floor), capped at ``cap``."""
    p = triton.next_power_of_2(max(int(n), floor))
    return p if cap is None else min(p, cap)


def expert_block(num_experts: int) -> int:
    """Chunk size (a constexpr) for loops over experts: 256 up to 256 experts, else 1024.

    Two values only, so that different expert counts share compiled kernels.
    """
    return 256 if num_experts <= 256 else 1024


# --------------------------------------------------------------------------- prepared launches

FREE = object()  # marks an argument of a Launch template that each call supplies


def _unset(hook: object) -> bool:
    """Whether a Triton launch hook does nothing: None, or an empty ``HookChain`` (Triton 3.5 on)."""
    return hook is None or getattr(hook, "calls", None) == []


def _no_hooks() -> bool:
    """Whether no Triton launch hook is set (a profiler's: launches must then go through Triton's path)."""
    runtime = triton.knobs.runtime
    return _unset(runtime.launch_enter_hook) and _unset(runtime.launch_exit_hook)


def _spec(value: object) -> object:
    """What Triton specializes a kernel on for one argument value: a tensor's dtype and 16-byte
    alignment, an integer's being 1, a multiple of 16 and 32-bit; anything else itself."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() & 15 == 0
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value == 1, value % 16 == 0, -(2**31) <= value < 2**31
    return type(value)


class LaunchBatch:
    """A forward's direct launches (:class:`Launch`), collected while the batch is open and then run
    by ``runner`` in one go, in order.

    ``runner`` (the CUDA library's ``moe_fp4_launch_kernels`` in moe_fp4) has two methods:
    ``record(parts)`` makes what it needs to run one prepared launch again from
    :meth:`Launch.direct_parts`, or None where it cannot (that launch then always goes through
    Triton's launcher); ``run(records, free_values, device, stream)`` runs them on that stream.
    ``with batch:`` opens it on this thread (unless a launch hook is set when it opens: a
    profiler attached then sees every launch) and runs what it collected at the end, or drops it
    if the block raised. A launch that is not batched (no description, another device or another
    current stream than the batch's) runs what was collected first, so the order holds; the
    tensors of collected launches are held until they run. Opening a batch inside an open one
    runs the outer one's launches first and reopens it at the end. Not thread-safe.

    **Replay.** A block that launches the same kernels with free values taken from the same
    inputs every time (a plan's forward) can be run without its Python: ``with
    batch.learning(inputs):`` opens the batch and learns, from that block, where each free
    value comes from, and :meth:`replay` then runs the learned launches with the free values of
    new ``inputs`` in one runner call. A free tensor whose address is one input's is taken
    from that input (the launchers pass the inputs or views of them at their start:
    ``reshape(-1)`` of a contiguous tensor); any other free value is a constant of the block
    (the plan's own buffers, sizes, strides). What is learned is refused (the block runs as
    before, nothing kept) where that reading could be wrong: two inputs at one address, a free
    tensor inside an input's storage at another address (a view at an offset), a launch that
    was not batched (the block flushed before its end), a launch hook, an open outer batch, or
    ``steady()`` false (``steady``: whether the launches are those every call makes, e.g. no
    configuration pinned). :meth:`replay` runs only with ``steady()`` true, no hook, no open
    batch, on the learned device, for inputs of the learned dtypes, shapes, strides and 16-byte
    alignment (what Triton specialized the kernels and the constant sizes and strides on);
    anything else returns False and the caller runs (and learns) the block again.
    """

    __slots__ = ("_device", "_free", "_keep", "_learn", "_outer", "_records", "_replay", "_runner", "_steady",
                 "_stream", "batched_launches")

    def __init__(self, runner, steady=None) -> None:
        self._runner = runner
        self._steady = steady  # () -> bool, or None: always steady
        self._records: list = []
        self._free: list = []
        self._keep: list = []  # the collected launches' free arguments (their tensors stay alive)
        self._device = self._stream = -1
        self._outer: LaunchBatch | None = None
        self._learn: _Learning | None = None  # the open block's learning (learning())
        self._replay: tuple | None = None  # (records, constants, fills, guards, device) of the last block learned
        self.batched_launches = 0  # launches run through the runner (tests)

    def learning(self, inputs: tuple) -> LaunchBatch:
        """The batch, to open with ``with``, learning a replay of the block from ``inputs`` (a tuple of
        tensors; see the class docstring)."""
        self._learn = _Learning(inputs) if self._steady is None or self._steady() else None
        return self

    def replay(self, inputs: tuple, device: int, stream: int) -> bool:
        """Runs the learned block with the free values of ``inputs`` on ``stream`` of ``device`` (the
        current stream of the current device); False, running nothing, where it cannot (see the class
        docstring)."""
        learned = self._replay
        if learned is None or learned[4] != device or _TLS.batch is not None or torch._C._cuda_getDevice() != device:
            return False
        if self._steady is not None and not self._steady():
            return False
        if not _no_hooks():
            return False
        records, free, fills, guards, _ = learned
        ptrs = []
        for t, (dtype, shape, stride, aligned) in zip(inputs, guards, strict=True):
            p = t.data_ptr()
            if t.dtype is not dtype or (p & 15 == 0) is not aligned or t.shape != shape or t.stride() != stride:
                return False
            ptrs.append(p)
        free = free.copy()
        for pos, i in fills:
            free[pos] = ptrs[i]
        self._runner.run(records, free, device, stream)
        self.batched_launches += len(records)
        return True

    def __enter__(self) -> LaunchBatch:
        self._outer = outer = _TLS.batch
        if outer is not None:
            outer.flush()
            self._learn = None  # (a replay would run without the outer batch's order)
        if _no_hooks():
            self._device = torch.cuda.current_device()
            self._stream = torch._C._cuda_getCurrentRawStream(self._device)
            _TLS.batch = self
        else:
            _TLS.batch = None
            self._learn = None
        return self

    def __exit__(self, kind, value, tb) -> None:
        learn, self._learn = self._learn, None
        if _TLS.batch is self and kind is None:
            records = self._records
            self.flush()
            if learn is not None and learn.ok and records:
                self._replay = (records, learn.free, learn.fills, learn.guards, self._device)
        _TLS.batch = self._outer
        self._outer = None
        self._records.clear()
        self._free.clear()
        self._keep.clear()

    def add(self, launch: Launch, free_ints: list, free_values: tuple) -> bool:
        """Collects ``launch`` with its free values (``free_ints``: as addresses and integers); False
        where it is not batched (then the caller launches it itself, after :meth:`flush`)."""
        record = launch._record
        if record is None:
            record = launch._record = self._runner.record(launch.direct_parts()) or False
        if record is False or torch._C._cuda_getCurrentRawStream(self._device) != self._stream:
            return False
        self._records.append(record)
        if self._learn is not None:
            self._learn.add(len(self._free), free_ints, free_values)
        self._free.extend(free_ints)
        self._keep.append(free_values)
        return True

    def flush(self) -> None:
        """Runs what was collected (in order) and empties the batch (inside a learning block, before its
        end: a launch that is not batched follows, and the block is not learned)."""
        self._learn = None
        if self._records:
            records, free = self._records, self._free
            self._records, self._free = [], []
            try:
                self._runner.run(records, free, self._device, self._stream)
            finally:
                self._keep.clear()
            self.batched_launches += len(records)


class _Learning:
    """What :meth:`LaunchBatch.learning` learns of a block: the free values in launch order as constants
    (``free``) and the positions an input fills (``fills``: ``(position, input index)``), the inputs'
    ``guards`` (dtype, shape, stride, 16-byte alignment); ``ok`` false once the block is refused."""

    __slots__ = ("fills", "free", "guards", "ok", "_by_address", "_storages")

    def __init__(self, inputs: tuple) -> None:
        self.free: list = []
        self.fills: list[tuple[int, int]] = []
        self.guards = tuple((t.dtype, t.shape, t.stride(), t.data_ptr() & 15 == 0) for t in inputs)
        self._by_address = {t.data_ptr(): i for i, t in enumerate(inputs)}
        self._storages = {t.untyped_storage().data_ptr() for t in inputs}
        self.ok = len(self._by_address) == len(inputs)  # two inputs at one address: which one fills?

    def add(self, start: int, free_ints: list, free_values: tuple) -> None:
        """The free values of one batched launch, the first at position ``start`` of the block's."""
        for j, (p, v) in enumerate(zip(free_ints, free_values)):
            if isinstance(v, torch.Tensor):
                i = self._by_address.get(p)
                if i is not None:
                    self.fills.append((start + j, i))
                elif v.untyped_storage().data_ptr() in self._storages:
                    self.ok = False  # inside an input at another address: not a constant
            self.free.append(p)


class _Batches(threading.local):
    batch: LaunchBatch | None = None


_TLS = _Batches()


class Launch:
    """``kernel[grid](*args, **constants)`` prepared for repeated launches (the launchers' hot path).

    ``args`` is the positional argument list with :data:`FREE` where each call supplies a value
    (``launch(*free_values)``, in order). The first launch goes through Triton's ``JITFunction``
    (which compiles, specializes and launches) and keeps the compiled kernel and the argument
    list Triton's binder made of the call. A later launch whose free values specialize as the
    first ones did (:func:`_spec`) on the same device, with no launch hooks set (a profiler's),
    is direct: inside an open :class:`LaunchBatch` it joins the batch, else it calls the compiled
    kernel's launcher with that list: the same kernel, arguments, grid and current stream,
    without the binding, cache-key and global-value work of ``JITFunction.run`` (most of a
    Triton launch's host time), and with tensors passed as their addresses (the launcher would
    query the driver about each). The callers have checked the tensors' devices. Anything else,
    and the CPU interpreter, takes Triton's path. ``fast_launches`` counts the direct ones
    (tests); ``why_not_direct`` says why a launch never is. Not thread-safe: a plan's launches
    run under its workspace's lock.
    """

    __slots__ = ("_args", "_constants", "_direct", "_free", "_grid", "_grid3", "_kernel", "_record", "_spec",
                 "fast_launches", "why_not_direct")

    def __init__(self, kernel, grid: tuple[int, ...], args: tuple, constants: dict) -> None:
        self._kernel, self._grid, self._args, self._constants = kernel, grid, args, constants
        self._grid3 = tuple(grid) + (1,) * (3 - len(grid))
        self._free = tuple(i for i, a in enumerate(args) if a is FREE)
        self._direct: tuple | None = None  # (device, compiled kernel, argument values); () never
        self._spec: tuple | None = None
        self._record = None  # a LaunchBatch runner's record of this launch; False: it has none
        self.fast_launches = 0
        self.why_not_direct: str | None = None  # why a prepared launch never launches directly (diagnostics)

    def _fill(self, free_values: tuple) -> list:
        values = list(self._args)
        for i, v in zip(self._free, free_values, strict=True):
            values[i] = v
        return values

    def direct_parts(self) -> tuple:
        """``(device, compiled kernel, grid (3 ints), argument values, free positions)`` of a prepared
        launch (the values: tensors as addresses; the free positions hold the first call's)."""
        device, compiled, values = self._direct
        return device, compiled, self._grid3, values, self._free

    def __call__(self, *free_values) -> None:
        direct = self._direct
        batch = _TLS.batch
        spec = None
        # (an open batch was opened on the current device, which a forward does not change)
        if direct and (batch._device if batch is not None else torch.cuda.current_device()) == direct[0]:
            ints = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in free_values]
            spec = tuple((v.dtype, p & 15 == 0) if isinstance(v, torch.Tensor) else _spec(v)
                         for v, p in zip(free_values, ints))  # _spec's, one data_ptr() per tensor
        if direct and spec == self._spec:
            device, compiled, values = direct
            if batch is not None:
                if batch._device == device and batch.add(self, ints, free_values):
                    self.fast_launches += 1
                    return
                batch.flush()
            if _no_hooks():
                values = values.copy()  # (a launch keeps no reference to its inputs)
                for i, v in zip(self._free, ints):
                    values[i] = v
                g = self._grid3
                compiled.run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(device), compiled.function,
                             compiled.packed_metadata, None, None, None, *values)
                self.fast_launches += 1
                return
        elif batch is not None:
            batch.flush()  # what was collected runs before this launch
        args = self._fill(free_values)
        compiled = self._kernel[self._grid](*args, **self._constants)
        if direct is None and not INTERPRET:
            self._prepare(compiled, args, free_values)

    def _prepare(self, compiled, args: list, free_values: tuple) -> None:
        """Keeps what a direct launch needs after Triton's first launch, if it exposes it (else never direct)."""
        try:
            device = torch.cuda.current_device()
            binder = self._kernel.device_caches[device][4]
            bound, _, _ = binder(*args, **self._constants)
            values = list(bound.values())
            if hasattr(compiled, "result"):
                compiled = compiled.result()
            compiled.function, compiled.packed_metadata  # noqa: B018 (both exist once it has run)
            if len(values) < len(args) or any(values[i] is not args[i] for i in self._free):
                self._direct, self.why_not_direct = (), "Triton's binder did not keep the arguments in order"
                return
        except Exception as exc:  # noqa: BLE001 (a stub, an interpreter or another Triton: keep Triton's path)
            self._direct, self.why_not_direct = (), f"{type(exc).__name__}: {exc}"
            return
        self._spec = tuple(_spec(v) for v in free_values)
        # Tensors go to the launcher as their addresses: it then neither calls data_ptr() nor asks the
        # driver what each pointer is (one cuPointerGetAttribute per tensor argument and launch).
        # The fixed ones stay alive in self._args.
        self._direct = (device, compiled, [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in values])
