"""The MoE on dequantized weights in float64: what an NVFP4 MoE approximates.

Unlike the ``reference`` backend (which reproduces the kernels' W4A4 arithmetic, activation
quantization included), this computes the MoE that the checkpoint's dequantized weights
define, with unquantized activations and no intermediate rounding. An NVFP4 W4A4 backend
differs from it by the activation quantization error of both GEMMs (about 10% relative).
"""

from __future__ import annotations

import torch

from ..experts import NvFp4Experts
from ..format import decode_scaled

__all__ = ["dequantize_fp64", "dequantized_moe"]


def dequantize_fp64(experts: NvFp4Experts, expert: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w13 [E, 2I, H], w2 [E, H, I])`` in float64: ``e2m1 * scale / gs``, gate and up each with its own gs.

    With ``expert``, that expert's ``(w13 [2I, H], w2 [H, I])`` only.
    """
    sel = slice(None) if expert is None else expert
    gs13 = experts.w13_gs_per_half[sel].double().repeat_interleave(experts.intermediate_size, dim=-1)
    w13 = decode_scaled(experts.w13[sel], experts.w13_scale[sel]).double() / gs13.unsqueeze(-1)
    w2 = decode_scaled(experts.w2[sel], experts.w2_scale[sel]).double() / experts.w2_gs[sel].double()[..., None, None]
    return w13, w2


def dequantized_moe(
    hidden_states: torch.Tensor, experts: NvFp4Experts, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """float64 ``[M, H]``: ``sum_j w[t,j] * (silu(x W_gate^T) * (x W_up^T)) W_down^T`` over the routed experts.

    ``x`` is ``hidden_states`` in float64 (not quantized); ids of ``-1`` contribute nothing.
    Each routed expert is dequantized on its own, so memory stays at one expert's weights.
    """
    I = experts.intermediate_size
    x = hidden_states.double()
    per_slot = torch.zeros((x.shape[0], topk_ids.shape[1], x.shape[1]), dtype=torch.float64, device=x.device)
    for e in range(experts.num_experts):
        t, j = (topk_ids == e).nonzero(as_tuple=True)
        if t.numel() == 0:
            continue
        w13, w2 = dequantize_fp64(experts, e)
        h = x[t] @ w13.T
        act = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
        per_slot[t, j] = (act @ w2.T) * topk_weights[t, j].double().unsqueeze(1)
    return per_slot.sum(dim=1)
