"""A read-only streaming kernel: the read-bandwidth ceiling of :func:`~moe_fp4.bench.timing.measure_ceilings`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096
_ITERS = 8


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    # Each program reads ITERS consecutive blocks and stores one partial sum, so the kernel
    # reads every byte once and writes almost nothing.
    base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in tl.static_range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def stream_read(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Read all of contiguous ``x`` (viewed as int32) once; returns the per-program partial sums."""
    words = x.view(torch.int32).reshape(-1)
    grid = triton.cdiv(words.numel(), _BLOCK * _ITERS)
    if out is None:
        out = torch.empty(grid, dtype=torch.int32, device=x.device)
    _read_kernel[(grid,)](words, out, words.numel(), BLOCK=_BLOCK, ITERS=_ITERS, num_warps=8)
    return out
