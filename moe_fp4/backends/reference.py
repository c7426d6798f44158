"""The reference backend: the semantics of :func:`moe_fp4.fused_moe` in plain torch.

It runs :func:`moe_fp4.reference.exact_moe` for the problem's precision: exact dequantization, float64
sums rounded to float32, exactly the roundings ``fused_moe`` documents, on CPU and CUDA.
"""

from __future__ import annotations

import torch

from ..reference import exact_moe


def why_unavailable(device: torch.device, capability: tuple[int, int] | None) -> str | None:
    """Always None: plain torch runs on every device."""
    return None


def fused_moe(problem) -> torch.Tensor:
    result = problem.output()
    result.copy_(exact_moe(problem.hidden_states, problem.experts, problem.topk_weights, problem.topk_ids,
                           problem.apply_router_weight_on_input, problem.precision))
    return result
