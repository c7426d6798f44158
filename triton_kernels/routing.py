"""Stage 1: routing metadata from ``topk_ids``, without a host sync.

Outputs (int32, on the device of the ids): ``expert_offsets [E+1]``,
``blockscale_offsets [E+1]``, ``slot_to_flat [n]`` and ``flat_to_slot [n]`` with
``n = M * topk``. Within an expert, slots follow the flat index, so results are
deterministic. Ids outside ``[0, E)`` (``-1`` or anything else) are not routed.
Up to ``SMALL_MAX`` flat indices take one launch; beyond, three (count, scan, scatter).
:func:`routing_launcher` prepares the launches for given outputs once (a function of the ids).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton

from ._common import FREE, Launch, expert_block, pdl_constants, pow2_at_least
from .routing_details._routing import (
    routing_count_kernel,
    routing_scan_kernel,
    routing_scatter_kernel,
    routing_small_kernel,
)

__all__ = ["SMALL_MAX", "CHUNK", "routing", "routing_launcher", "routing_scratch_numel"]

SMALL_MAX = 256  # flat indices handled by the single-program kernel
CHUNK = 128  # flat indices per program in the chunked path
J_BLOCK = 32  # other flat indices compared per step when ranking


def routing_scratch_numel(n: int, num_experts: int) -> int:
    """int32 elements of scratch the chunked path needs (per-chunk expert counts; 0 for one launch)."""
    return triton.cdiv(n, CHUNK) * num_experts if n > SMALL_MAX else 0


def routing(
    topk_ids: torch.Tensor,
    expert_offsets: torch.Tensor,
    blockscale_offsets: torch.Tensor,
    slot_to_flat: torch.Tensor,
    flat_to_slot: torch.Tensor,
    scratch: torch.Tensor | None,
) -> None:
    """Routing metadata of contiguous int32 ``topk_ids [M, topk]`` into the four outputs.

    ``scratch``: int32, at least :func:`routing_scratch_numel` elements (None when that is 0).
    """
    routing_launcher(topk_ids.numel(), expert_offsets, blockscale_offsets, slot_to_flat, flat_to_slot,
                     scratch)(topk_ids)


def routing_launcher(
    n: int,
    expert_offsets: torch.Tensor,
    blockscale_offsets: torch.Tensor,
    slot_to_flat: torch.Tensor,
    flat_to_slot: torch.Tensor,
    scratch: torch.Tensor | None,
) -> Callable[[torch.Tensor], None]:
    """The launches of :func:`routing` for ``n`` flat indices into these outputs, as a function of
    ``topk_ids`` (``n`` of them)."""
    E = expert_offsets.numel() - 1
    e_block = expert_block(E)
    pdl = pdl_constants(expert_offsets.device)
    if n <= SMALL_MAX:
        small = Launch(routing_small_kernel, (1,), (FREE, expert_offsets, blockscale_offsets, slot_to_flat,
                                                     flat_to_slot, n, E),
                       dict(BLOCK=pow2_at_least(n, 16), E_BLOCK=e_block, J_BLOCK=J_BLOCK, num_warps=4, **pdl))

        def launch_small(topk_ids: torch.Tensor) -> None:
            small(topk_ids.reshape(-1))

        return launch_small
    n_chunks = triton.cdiv(n, CHUNK)
    c_block = pow2_at_least(n_chunks, 1, max(1, 16384 // e_block))
    count = Launch(routing_count_kernel, (n_chunks,), (FREE, scratch, n, E),
                   dict(CHUNK=CHUNK, E_BLOCK=e_block, num_warps=4, **pdl))
    scan = Launch(routing_scan_kernel, (1,), (scratch, expert_offsets, blockscale_offsets, n_chunks, E),
                  dict(C_BLOCK=c_block, E_BLOCK=e_block, num_warps=8, **pdl))
    scatter = Launch(routing_scatter_kernel, (n_chunks,), (FREE, scratch, expert_offsets, slot_to_flat, flat_to_slot,
                                                           n, E),
                     dict(CHUNK=CHUNK, J_BLOCK=J_BLOCK, num_warps=4, **pdl))

    def launch_chunked(topk_ids: torch.Tensor) -> None:
        ids = topk_ids.reshape(-1)
        count(ids)
        scan()
        scatter(ids)

    return launch_chunked
