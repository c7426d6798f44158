"""``triton_kernels._common.Launch``: the prepared launches of the Triton launchers.

On CPU: the template's free positions are filled in order and every launch goes through
``kernel[grid](...)`` when there is no compiled kernel to call directly (a stub, the
interpreter). On the GPU (marked): after the first launch a direct launch computes what
Triton's own path computes, and the guards send a launch back to Triton's path when a free
argument specializes differently (an unaligned tensor) or a launch hook is set, and a launch
on a side stream takes that stream.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moe_fp4.triton_kernels._common import FREE, INTERPRET, Launch  # noqa: E402


class _Recorder:
    """A stand-in for a JITFunction: ``kernel[grid](*args, **kwargs)`` records and returns None."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


def test_free_positions_are_filled_in_order_and_each_launch_goes_through_the_kernel():
    kernel = _Recorder()
    fixed = object()
    launch = Launch(kernel, (3, 2), (FREE, fixed, FREE, 7), {"BLOCK": 16, "num_warps": 4})
    launch("a", "b")
    launch("c", "d")
    assert kernel.calls == [((3, 2), ("a", fixed, "b", 7), {"BLOCK": 16, "num_warps": 4}),
                            ((3, 2), ("c", fixed, "d", 7), {"BLOCK": 16, "num_warps": 4})]
    assert launch.fast_launches == 0  # nothing compiled to call directly
    with pytest.raises(ValueError):
        launch("only one")  # a call supplies exactly the free values


if not INTERPRET:
    import triton
    import triton.language as tl

    @triton.jit
    def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, a, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        y = tl.load(y_ptr + offs, mask=mask)
        tl.store(out_ptr + offs, a * x + y, mask=mask)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="direct launches exist only for compiled kernels (not the CPU interpreter)")
def test_direct_launches_equal_tritons_and_fall_back_when_a_guard_trips():
    dev = torch.device("cuda")
    n, block = 1000, 256
    y = torch.randn(n, device=dev)
    launch = Launch(_axpy_kernel, (triton.cdiv(n, block),), (FREE, y, FREE, n, 2.0), {"BLOCK": block})

    def check(x, out):
        # float32 a*x + y: one rounding of the product and one of the sum in both (no FMA differences
        # matter: the comparison is with the same kernel through Triton's path, bit for bit).
        ref = torch.empty_like(out)
        _axpy_kernel[(triton.cdiv(n, block),)](x, y, ref, n, 2.0, BLOCK=block)
        torch.cuda.synchronize()
        assert torch.equal(out, ref)

    x, out = torch.randn(n, device=dev), torch.empty(n, device=dev)
    launch(x, out)  # Triton's path; prepares
    check(x, out)
    assert launch.fast_launches == 0 and launch.why_not_direct is None
    for _ in range(3):
        x, out = torch.randn(n, device=dev), torch.full((n,), float("nan"), device=dev)
        launch(x, out)
        check(x, out)
    assert launch.fast_launches == 3

    # A side stream: the direct launch takes the current stream, as Triton's path does.
    side = torch.cuda.Stream()
    x, out = torch.randn(n, device=dev), torch.full((n,), float("nan"), device=dev)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        launch(x, out)
    side.synchronize()
    check(x, out)
    assert launch.fast_launches == 4

    # An unaligned view specializes differently: Triton's path (which compiles that variant).
    buf = torch.randn(n + 1, device=dev)
    out = torch.full((n,), float("nan"), device=dev)
    launch(buf[1:], out)
    check(buf[1:], out)
    assert launch.fast_launches == 4

    # A launch hook (a profiler's) set: Triton's path, which calls it.
    seen = []

    def hook(metadata) -> None:
        seen.append(metadata)

    hooks = triton.knobs.runtime.launch_enter_hook
    add = getattr(hooks, "add", None)  # a HookChain from Triton 3.5 on, else a plain attribute
    if add is not None:
        add(hook)
    else:
        triton.knobs.runtime.launch_enter_hook = hook
    try:
        x, out = torch.randn(n, device=dev), torch.full((n,), float("nan"), device=dev)
        launch(x, out)
    finally:
        if add is not None:
            hooks.remove(hook)
        else:
            triton.knobs.runtime.launch_enter_hook = None
    check(x, out)
    assert launch.fast_launches == 4 and len(seen) == 1
    launch(x, out)  # no hook again: direct
    assert launch.fast_launches == 5
