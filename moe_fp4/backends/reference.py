"""The reference backend: the semantics of :func:`moe_fp4.fused_moe` in plain torch.

Exact dequantization (``e2m1 * scale`` is exact in float32), sums in float64 rounded to
float32 as an ideal fp32 accumulator would give, then exactly the roundings the
docstring of ``fused_moe`` lists. Clear rather than fast: it loops over experts.
Runs on CPU and CUDA.
"""

from __future__ import annotations

import torch

from ..format import _quantize_blocks, decode_scaled
from ..stages import silu_mul


def availability(device: torch.device, capability: tuple[int, int] | None) -> str | None:
    return None


def fused_moe(problem) -> torch.Tensor:
    x = problem.hidden_states
    ex = problem.experts
    dtype = x.dtype
    M, H = x.shape
    topk = problem.topk
    E, I = ex.num_experts, ex.intermediate_size
    alpha13, alpha2 = ex.alphas()
    ids = problem.topk_ids.long()
    w = problem.topk_weights
    # Per (token, slot) expert output, kept in the output dtype as the semantics round it.
    y_all = torch.zeros((M, topk, H), dtype=dtype, device=x.device)
    for e in range(E):
        t, j = (ids == e).nonzero(as_tuple=True)
        if t.numel() == 0:
            continue
        rows = x[t]
        if problem.apply_router_weight_on_input:
            rows = (rows.float() * w[t, j].unsqueeze(1)).to(dtype)
        qa, sa = _quantize_blocks(rows, ex.a13_gs[e].reshape(()))
        acc1 = (decode_scaled(qa, sa).double() @ decode_scaled(ex.w13[e], ex.w13_scale[e]).double().T).float()
        h = (acc1 * alpha13[e].repeat_interleave(I)).to(dtype)
        qb, sb = _quantize_blocks(silu_mul(h), ex.a2_gs[e].reshape(()))
        acc2 = (decode_scaled(qb, sb).double() @ decode_scaled(ex.w2[e], ex.w2_scale[e]).double().T).float()
        y_all[t, j] = (acc2 * alpha2[e]).to(dtype)
    out = torch.zeros((M, H), dtype=torch.float32, device=x.device)
    for j in range(topk):
        term = y_all[:, j].float()
        if not problem.apply_router_weight_on_input:
            term = term * w[:, j].unsqueeze(1)
        out += term
    result = problem.output()
    result.copy_(out.to(dtype))
    return result
