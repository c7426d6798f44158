"""Stage 1: routing metadata from ``topk_ids`` (``moe_fp4.stages.routing``), without a host sync.

Outputs (all int32, on the device of the ids): ``expert_offsets [E+1]``,
``blockscale_offsets [E+1]``, ``slot_to_flat [n]`` and ``flat_to_slot [n]`` with
``n = M * topk``. Within an expert, slots follow the flat index, so results are
deterministic. Ids outside ``[0, E)`` (``-1`` or anything else) are not routed.
Up to ``SMALL_MAX`` flat indices take one launch; beyond, three (count, scan, scatter).
"""

from __future__ import annotations

import torch
import triton

from ..stages import RoutingData
from ._common import expert_block, pow2_at_least
from .routing_details._routing import (
    routing_count_kernel,
    routing_scan_kernel,
    routing_scatter_kernel,
    routing_small_kernel,
)

__all__ = ["SMALL_MAX", "CHUNK", "routing", "routing_buffers", "routing_scratch_shape"]

SMALL_MAX = 256  # flat indices handled by the single-program kernel
CHUNK = 128  # flat indices per program in the chunked path
J_BLOCK = 32  # other flat indices compared per step when ranking


def routing_buffers(n: int, num_experts: int, device: torch.device) -> RoutingData:
    """Fresh (uninitialised) output buffers for ``n`` flat indices."""
    i32 = torch.int32
    return RoutingData(
        torch.empty(num_experts + 1, dtype=i32, device=device),
        torch.empty(num_experts + 1, dtype=i32, device=device),
        torch.empty(n, dtype=i32, device=device),
        torch.empty(n, dtype=i32, device=device),
    )


def routing_scratch_shape(n: int, num_experts: int) -> tuple[int, int]:
    """Shape of the int32 scratch the chunked path needs (per-chunk expert counts)."""
    return (triton.cdiv(n, CHUNK), num_experts) if n > SMALL_MAX else (0, num_experts)


def routing(
    topk_ids: torch.Tensor,
    num_experts: int,
    *,
    out: RoutingData | None = None,
    scratch: torch.Tensor | None = None,
) -> RoutingData:
    """Routing metadata for contiguous int32 ``topk_ids [M, topk]``.

    ``out`` may give the output buffers and ``scratch`` an int32 tensor of at least
    :func:`routing_scratch_shape` elements (both are allocated otherwise).
    """
    n, E = topk_ids.numel(), num_experts
    r = out if out is not None else routing_buffers(n, E, topk_ids.device)
    ids = topk_ids.reshape(-1)
    e_block = expert_block(E)
    if n <= SMALL_MAX:
        routing_small_kernel[(1,)](
            ids, r.expert_offsets, r.blockscale_offsets, r.slot_to_flat, r.flat_to_slot, n, E,
            BLOCK=pow2_at_least(n, 16), E_BLOCK=e_block, J_BLOCK=J_BLOCK, num_warps=4,
        )
        return r
    n_chunks = triton.cdiv(n, CHUNK)
    if scratch is None:
        scratch = torch.empty(n_chunks * E, dtype=torch.int32, device=topk_ids.device)
    routing_count_kernel[(n_chunks,)](ids, scratch, n, E, CHUNK=CHUNK, E_BLOCK=e_block, num_warps=4)
    routing_scan_kernel[(1,)](
        scratch, r.expert_offsets, r.blockscale_offsets, n_chunks, E,
        C_BLOCK=pow2_at_least(n_chunks, 1, max(1, 16384 // e_block)), E_BLOCK=e_block, num_warps=8,
    )
    routing_scatter_kernel[(n_chunks,)](
        ids, scratch, r.expert_offsets, r.slot_to_flat, r.flat_to_slot, n, E, CHUNK=CHUNK, J_BLOCK=J_BLOCK, num_warps=4,
    )
    return r
