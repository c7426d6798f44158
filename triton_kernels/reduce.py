"""Stage 6: un-permute and the top-k weighted sum."""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton

from ._common import EXACT, FREE, INTERPRET, Launch, pdl_constants, pow2_at_least
from .reduce_details._reduce import moe_reduce_kernel

__all__ = ["moe_reduce", "moe_reduce_launcher"]


def moe_reduce(y: torch.Tensor, flat_to_slot: torch.Tensor, topk_weights: torch.Tensor | None,
               out: torch.Tensor) -> None:
    """``out[t] = sum_j w[t, j] * y[flat_to_slot[t*topk+j]]`` (float32, j in order), rounded once.

    ``out [num_tokens, H]``; ``topk_weights`` (float32 ``[num_tokens, topk]``) None gives the
    plain sum; slots ``< 0`` contribute nothing.
    """
    moe_reduce_launcher(y, flat_to_slot, topk_weights is not None, *out.shape)(topk_weights, out)


def _no_launch(topk_weights: torch.Tensor | None, out: torch.Tensor) -> None:
    return None


def moe_reduce_launcher(y: torch.Tensor, flat_to_slot: torch.Tensor, weighted: bool, num_tokens: int,
                        H: int) -> Callable[[torch.Tensor | None, torch.Tensor], None]:  # noqa: N803
    """:func:`moe_reduce` of ``y`` into an ``out [num_tokens, H]``, prepared once: a function of
    ``(topk_weights, out)`` (``topk_weights`` given exactly when ``weighted``)."""
    if num_tokens == 0:
        return _no_launch
    topk = flat_to_slot.numel() // num_tokens
    block_h = pow2_at_least(H, 16, 4096 if INTERPRET else 512)
    block_t = 64 if INTERPRET else 4
    constants = dict(TOPK=topk, HAS_WEIGHTS=weighted, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4, **EXACT,
                     **pdl_constants(y.device))
    launch = Launch(moe_reduce_kernel, (triton.cdiv(num_tokens, block_t), triton.cdiv(H, block_h)),
                    (y, flat_to_slot, FREE, FREE, num_tokens, H, y.shape[0]), constants)

    def run(topk_weights: torch.Tensor | None, out: torch.Tensor) -> None:
        launch(topk_weights if weighted else flat_to_slot, out)

    return run
