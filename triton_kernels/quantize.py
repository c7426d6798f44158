"""Grouped NVFP4 quantization of activations: stage 2 (gather + quantize) and stage 4 (SiLU-mul + quantize).

Both produce exactly the buffers of ``moe_fp4.stages.quantize_rows`` /
``silu_mul_quantize``: packed rows ``uint8 [n, K/2]`` (rows past ``expert_offsets[E]``
zero) and a grouped swizzled scale buffer ``[grouped_scale_rows_bound(n, E), Cp]`` in
which every byte that holds no scale is zero. One launch each; the grid covers the scale
buffer, so no separate memset is needed.

Inputs are not validated here (``moe_fp4.backends.triton`` does that); all tensors must
be contiguous and on one device.
"""

from __future__ import annotations

import torch

from ..format import BLOCK_SIZE, grouped_scale_rows_bound, swizzled_shape
from ._common import EXACT, INTERPRET, expert_block, pow2_at_least
from .quantize_details._quantize import GATHER, ROWS, SILU_MUL, quantize_grouped_kernel

__all__ = ["quantize_rows", "silu_mul_quantize", "quantized_buffers"]


def quantized_buffers(n: int, K: int, num_experts: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh (uninitialised) ``(packed [n, K/2], scales float8_e4m3fn [rows_bound, Cp])`` for ``n`` rows."""
    _, cp = swizzled_shape(1, K // BLOCK_SIZE)
    packed = torch.empty((n, K // 2), dtype=torch.uint8, device=device)
    scales = torch.empty((grouped_scale_rows_bound(n, num_experts), cp), dtype=torch.float8_e4m3fn, device=device)
    return packed, scales


def _launch(mode, src, K, n, gs, expert_offsets, blockscale_offsets, slot_to_flat, topk, row_scale, out):
    E = expert_offsets.numel() - 1
    packed, scales = out if out is not None else quantized_buffers(n, K, E, src.device)
    _, cp = swizzled_shape(1, K // BLOCK_SIZE)
    rows = scales.shape[0]
    if n == 0 or rows == 0:
        return packed, scales
    block_r = 128 if INTERPRET else 16  # divides 128; the interpreter prefers few programs
    block_k = pow2_at_least(cp * BLOCK_SIZE, 64, 256)
    dummy = expert_offsets  # stands in for unused pointer arguments
    quantize_grouped_kernel[(rows // block_r,)](
        src, src.stride(0),
        dummy if slot_to_flat is None else slot_to_flat, dummy if row_scale is None else row_scale,
        gs, expert_offsets, blockscale_offsets,
        packed, scales.view(torch.uint8),
        n, topk, E, K, cp,
        MODE=mode, HAS_ROW_SCALE=row_scale is not None, INTERPRET=INTERPRET,
        BLOCK_R=block_r, BLOCK_K=block_k, E_BLOCK=expert_block(E),
        num_warps=4, **EXACT,
    )
    return packed, scales


def quantize_rows(
    x: torch.Tensor,
    gs: torch.Tensor,
    expert_offsets: torch.Tensor,
    blockscale_offsets: torch.Tensor,
    slot_to_flat: torch.Tensor | None = None,
    topk: int = 1,
    row_scale: torch.Tensor | None = None,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 2 (``moe_fp4.stages.quantize_rows``): gather, optional router weight, per-expert quantization.

    ``out`` may give the ``(packed, scales)`` buffers to write (shapes as returned).
    """
    if slot_to_flat is None:
        return _launch(ROWS, x, x.shape[1], x.shape[0], gs, expert_offsets, blockscale_offsets, None, 1, None, out)
    return _launch(GATHER, x, x.shape[1], slot_to_flat.numel(), gs, expert_offsets, blockscale_offsets,
                   slot_to_flat, topk, row_scale, out)


def silu_mul_quantize(
    h: torch.Tensor,
    gs: torch.Tensor,
    expert_offsets: torch.Tensor,
    blockscale_offsets: torch.Tensor,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 4 (``moe_fp4.stages.silu_mul_quantize``): ``silu(h[:, :I]) * h[:, I:]``, then per-expert quantization."""
    I = h.shape[1] // 2
    return _launch(SILU_MUL, h, I, h.shape[0], gs, expert_offsets, blockscale_offsets, None, 1, None, out)
