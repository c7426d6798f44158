"""Stage 6: un-permute and the top-k weighted sum."""

from __future__ import annotations

import torch
import triton

from ._common import EXACT, INTERPRET, pow2_at_least
from .reduce_details._reduce import moe_reduce_kernel

__all__ = ["moe_reduce"]


def moe_reduce(y: torch.Tensor, flat_to_slot: torch.Tensor, topk_weights: torch.Tensor | None,
               out: torch.Tensor) -> None:
    """``out[t] = sum_j w[t, j] * y[flat_to_slot[t*topk+j]]`` (float32, j in order), rounded once.

    ``out [num_tokens, H]``; ``topk_weights`` (float32 ``[num_tokens, topk]``) None gives the
    plain sum; slots ``< 0`` contribute nothing.
    """
    num_tokens, H = out.shape
    if num_tokens == 0:
        return
    topk = flat_to_slot.numel() // num_tokens
    block_h = pow2_at_least(H, 16, 4096 if INTERPRET else 512)
    block_t = 64 if INTERPRET else 4
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(H, block_h))
    moe_reduce_kernel[grid](
        y, flat_to_slot, flat_to_slot if topk_weights is None else topk_weights, out,
        num_tokens, H, y.shape[0],
        TOPK=topk, HAS_WEIGHTS=topk_weights is not None, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4, **EXACT,
    )
