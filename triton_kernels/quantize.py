"""Grouped NVFP4 quantization of activations: stage 2 (gather + quantize) and stage 4 (SiLU-mul + quantize).

Both produce exactly the buffers of ``moe_fp4.stages.quantize_rows`` /
``silu_mul_quantize``: packed rows ``uint8 [n, K/2]`` (rows past ``expert_offsets[E]``
zero) and a grouped swizzled scale buffer ``[grouped_scale_rows_bound(n, E), Cp]`` in
which every byte that holds no scale is zero. One launch each: programs over blocks of
slots (and of columns) quantize, so padding rows cost no loads and no math, and programs
over the 128-row bands of the scale buffer zero the bytes that hold no scale; no separate
memset is needed. The launch configuration comes from :data:`QUANT_CONFIGS`.

Inputs are not validated here (``moe_fp4.backends.triton`` does that); all tensors must
be contiguous and on one device.
"""

from __future__ import annotations

import torch

from dataclasses import dataclass

import torch
import triton

from ..format import BLOCK_SIZE, grouped_scale_rows_bound, swizzled_shape
from ._common import EXACT, INTERPRET, expert_block
from .quantize_details._quantize import GATHER, ROWS, SILU_MUL, quantize_grouped_kernel

__all__ = ["QuantConfig", "QUANT_CONFIGS", "quant_config", "quantize_rows", "silu_mul_quantize", "quantized_buffers"]


@dataclass(frozen=True)
class QuantConfig:
    """One launch configuration of the quantization kernel.

    block_r: slots per program; block_k: columns per program (a multiple of 64);
    zero_words: int32 words of scale padding a zeroing program writes. Powers of two.
    """

    block_r: int
    block_k: int
    num_warps: int = 4
    zero_words: int = 1024

    def __post_init__(self) -> None:
        for name, low in (("block_r", 1), ("block_k", 64), ("num_warps", 1), ("zero_words", 128)):
            v = getattr(self, name)
            if not isinstance(v, int) or v < low or v & (v - 1):
                raise ValueError(f"QuantConfig.{name}: expected a power of two >= {low}, got {v!r}")


# (largest number of slots, config), first match wins; ``config=`` pins another
# (benchmarks/tune_triton.py times candidates on the H200). Few slots (decode): one row of
# 256 columns per program, so many programs share the latency; many: larger blocks.
QUANT_CONFIGS: tuple[tuple[float, QuantConfig], ...] = (
    (64, QuantConfig(block_r=1, block_k=256, num_warps=1)),
    (1024, QuantConfig(block_r=4, block_k=256, num_warps=4)),
    (4096, QuantConfig(block_r=16, block_k=256, num_warps=4)),
    (float("inf"), QuantConfig(block_r=8, block_k=512, num_warps=4)),  # best at 32768 slots on the H200
)
# The interpreter runs each program in Python: few, large ones.
_INTERPRETER_CONFIG = QuantConfig(block_r=16, block_k=1024, zero_words=8192)


def quant_config(n_slots: int) -> QuantConfig:
    """The table's configuration for ``n_slots`` rows."""
    if INTERPRET:
        return _INTERPRETER_CONFIG
    return next(cfg for bound, cfg in QUANT_CONFIGS if n_slots <= bound)


def quantized_buffers(n: int, K: int, num_experts: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh (uninitialised) ``(packed [n, K/2], scales float8_e4m3fn [rows_bound, Cp])`` for ``n`` rows."""
    _, cp = swizzled_shape(1, K // BLOCK_SIZE)
    packed = torch.empty((n, K // 2), dtype=torch.uint8, device=device)
    scales = torch.empty((grouped_scale_rows_bound(n, num_experts), cp), dtype=torch.float8_e4m3fn, device=device)
    return packed, scales


def _launch(mode, src, K, n, gs, expert_offsets, blockscale_offsets, slot_to_flat, topk, row_scale, out, config):
    E = expert_offsets.numel() - 1
    packed, scales = out if out is not None else quantized_buffers(n, K, E, src.device)
    _, cp = swizzled_shape(1, K // BLOCK_SIZE)
    rows = scales.shape[0]
    if n == 0 or rows == 0:
        return packed, scales
    cfg = config if config is not None else quant_config(n)
    n_k_blocks = triton.cdiv(cp * BLOCK_SIZE, cfg.block_k)
    n_row_programs = triton.cdiv(n, cfg.block_r) * n_k_blocks
    n_w_blocks = triton.cdiv(32 * cp, cfg.zero_words)
    dummy = expert_offsets  # stands in for unused pointer arguments
    quantize_grouped_kernel[(n_row_programs + rows // 128 * n_w_blocks,)](
        src, src.stride(0),
        dummy if slot_to_flat is None else slot_to_flat, dummy if row_scale is None else row_scale,
        gs, expert_offsets, blockscale_offsets,
        packed, scales.view(torch.uint8),
        n, topk, E, K, cp, n_row_programs, n_k_blocks, n_w_blocks,
        MODE=mode, HAS_ROW_SCALE=row_scale is not None, INTERPRET=INTERPRET,
        BLOCK_R=cfg.block_r, BLOCK_K=cfg.block_k, W_BLOCK=cfg.zero_words, E_BLOCK=expert_block(E),
        num_warps=cfg.num_warps, **EXACT,
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
    config: QuantConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 2 (``moe_fp4.stages.quantize_rows``): gather, optional router weight, per-expert quantization.

    ``out`` may give the ``(packed, scales)`` buffers to write (shapes as returned);
    ``config`` pins the launch.
    """
    if slot_to_flat is None:
        return _launch(ROWS, x, x.shape[1], x.shape[0], gs, expert_offsets, blockscale_offsets, None, 1, None, out,
                       config)
    return _launch(GATHER, x, x.shape[1], slot_to_flat.numel(), gs, expert_offsets, blockscale_offsets,
                   slot_to_flat, topk, row_scale, out, config)


def silu_mul_quantize(
    h: torch.Tensor,
    gs: torch.Tensor,
    expert_offsets: torch.Tensor,
    blockscale_offsets: torch.Tensor,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: QuantConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 4 (``moe_fp4.stages.silu_mul_quantize``): ``silu(h[:, :I]) * h[:, I:]``, then per-expert quantization.

    ``out`` and ``config`` as for :func:`quantize_rows`.
    """
    I = h.shape[1] // 2
    return _launch(SILU_MUL, h, I, h.shape[0], gs, expert_offsets, blockscale_offsets, None, 1, None, out, config)
