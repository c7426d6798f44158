"""Host-side helpers shared by the kernel wrappers of ``moe_fp4.triton_kernels``."""

from __future__ import annotations

import torch
import triton

BLOCK_SIZE = 16  # elements per NVFP4 block scale

# Whether the @triton.jit functions of this package were created for Triton's CPU
# interpreter (TRITON_INTERPRET=1 when the package was imported). The interpreter gets
# numpy's exp and no inline assembly.
INTERPRET: bool = bool(triton.knobs.runtime.interpret)

# Options for the kernels that must reproduce the format core's (and torch's) roundings: no
# FMA contraction (with it, expf's last multiply fuses with silu's "1 +"), and libdevice
# without flush-to-zero, like torch's CUDA math.
EXACT = {"enable_fp_fusion": False, "enable_reflect_ftz": False}

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


class Launch:
    """``kernel[grid](*args, **constants)`` prepared for repeated launches (the launchers' hot path).

    ``args`` is the positional argument list with :data:`FREE` where each call supplies a value
    (``launch(*free_values)``, in order). The first launch goes through Triton's ``JITFunction``
    (which compiles, specializes and launches) and keeps the compiled kernel and the argument
    list Triton's binder made of the call. A later launch whose free values specialize as the
    first ones did (:func:`_spec`) on the same device, with no launch hooks set (a profiler's),
    calls the compiled kernel's launcher directly with that list: the same kernel, arguments,
    grid and current stream, without the binding, cache-key and global-value work of
    ``JITFunction.run`` (most of a Triton launch's host time), and with tensors passed as their
    addresses (the launcher would query the driver about each). The callers have checked the
    tensors' devices. Anything else, and the CPU
    interpreter, takes Triton's path. ``fast_launches`` counts the direct ones (tests);
    ``why_not_direct`` says why a launch never is. Not thread-safe: a plan's launches run under
    its workspace's lock.
    """

    __slots__ = ("_kernel", "_grid", "_grid3", "_args", "_constants", "_free", "_direct", "_spec", "fast_launches",
                 "why_not_direct")

    def __init__(self, kernel, grid: tuple[int, ...], args: tuple, constants: dict) -> None:
        self._kernel, self._grid, self._args, self._constants = kernel, grid, args, constants
        self._grid3 = tuple(grid) + (1,) * (3 - len(grid))
        self._free = tuple(i for i, a in enumerate(args) if a is FREE)
        self._direct: tuple | None = None  # (device, compiled kernel, argument values); () never
        self._spec: tuple | None = None
        self.fast_launches = 0
        self.why_not_direct: str | None = None  # why a prepared launch never launches directly (diagnostics)

    def _fill(self, free_values: tuple) -> list:
        values = list(self._args)
        for i, v in zip(self._free, free_values, strict=True):
            values[i] = v
        return values

    def __call__(self, *free_values) -> None:
        direct = self._direct
        if direct:
            device, compiled, values = direct
            runtime = triton.knobs.runtime
            if (_unset(runtime.launch_enter_hook) and _unset(runtime.launch_exit_hook)
                    and tuple(_spec(v) for v in free_values) == self._spec
                    and torch.cuda.current_device() == device):
                values = values.copy()  # (a launch keeps no reference to its inputs)
                for i, v in zip(self._free, free_values):
                    values[i] = v.data_ptr() if isinstance(v, torch.Tensor) else v
                g = self._grid3
                compiled.run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(device), compiled.function,
                             compiled.packed_metadata, None, None, None, *values)
                self.fast_launches += 1
                return
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
