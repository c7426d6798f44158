"""The reference backend: the semantics of :func:`moe_fp4.fused_moe` in plain torch.

It runs :func:`moe_fp4.reference.w4a4_moe` (``precision="w4a4"``) or
:func:`moe_fp4.reference.w4a16_moe` (``precision="w4a16"``): exact dequantization, float64
sums rounded to float32, exactly the roundings ``fused_moe`` documents, on CPU and CUDA.
"""

from __future__ import annotations

import torch

from ..reference import w4a4_moe, w4a16_moe

_FORWARDS = {"w4a4": w4a4_moe, "w4a16": w4a16_moe}


def why_unavailable(device: torch.device, capability: tuple[int, int] | None) -> str | None:
    """Always None: plain torch runs on every device."""
    return None


def fused_moe(problem) -> torch.Tensor:
    forward = _FORWARDS.get(problem.precision)
    if forward is None:
        raise ValueError(f"precision: expected 'w4a4' or 'w4a16', got {problem.precision!r}")
    result = problem.output()
    result.copy_(forward(problem.hidden_states, problem.experts, problem.topk_weights, problem.topk_ids,
                         problem.apply_router_weight_on_input))
    return result
