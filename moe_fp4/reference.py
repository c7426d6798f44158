"""The references every backend and check is judged against.

* :func:`exact_moe`: the exact semantics of :func:`moe_fp4.fused_moe` (the ``reference``
  backend). ``precision="w4a4"``: activations quantized to NVFP4 per expert, exact dequantization (``e2m1 * scale``
  is exact in float32), GEMM sums in float64 rounded to float32 as an ideal fp32 accumulator
  would give, then exactly the roundings the docstring of ``fused_moe`` lists. Clear rather
  than fast: it loops over experts.
  ``precision="w4a16"`` (Marlin's semantics): the activations are not quantized, the GEMMs multiply the 16-bit rows with
  ``e2m1 * scale`` and the epilogue applies the weights' global scales only; the same
  float64 sums rounded to float32 and the same 16-bit roundings of ``h``, the SiLU-mul
  product and ``y``.
* :func:`dequantized_moe`: the MoE that the dequantized NVFP4 weights define, in float64,
  with unquantized activations and no intermediate rounding: what W4A16 kernels (Marlin,
  Humming) compute up to rounding, and what an NVFP4 W4A4 forward approximates (it differs
  by the activation quantization error of both GEMMs, about 10% relative).

Weights are dequantized by :meth:`moe_fp4.NvFp4Experts.dequantize`, the one place that
applies gate and up global scales per half.
"""

from __future__ import annotations

import torch

from ._checks import check_precision
from .experts import NvFp4Experts
from .format import _quantize_blocks, decode_scaled

__all__ = ["silu_mul", "exact_moe", "dequantized_moe"]


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """``silu(h[:, :I]) * h[:, I:]``: silu in float32 rounded to 16-bit, the product rounded to 16-bit."""
    I = h.shape[-1] // 2  # noqa: E741
    g = h[..., :I].float()
    s = (g / (1.0 + torch.exp(-g))).to(h.dtype)
    return (s.float() * h[..., I:].float()).to(h.dtype)


def exact_moe(
    hidden_states: torch.Tensor,
    experts: NvFp4Experts,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    apply_router_weight_on_input: bool = False,
    precision: str = "w4a4",
) -> torch.Tensor:
    """The exact forward of ``moe_fp4.fused_moe(..., precision=precision)`` for validated inputs.

    ``topk_weights`` float32 and ``topk_ids`` int ``[M, topk]`` (``-1`` contributes nothing);
    returns ``[M, H]`` in the dtype of ``hidden_states``. Per (token, slot) of expert ``e``:
    W4A4 multiplies the decoded NVFP4 quantization of each GEMM's rows (global scales
    ``a13_gs``/``a2_gs``), W4A16 the 16-bit rows themselves; ``h = dtype(float32(sum_k a[k] *
    W13[e, n, k]) * alpha13[e, half])`` with ``W = e2m1 * scale`` and ``alpha`` from
    :meth:`NvFp4Experts.alphas` of the precision, the SiLU-mul product rounded as
    :func:`silu_mul` rounds it, ``y = dtype(float32(sum act * W2) * alpha2[e])``, and the top-k
    sum in float32 in slot order. The sums run in float64: each product of a 16-bit value (at
    most 11 significant bits) and ``e2m1 * scale`` (at most 6) is exact, and so is their sum
    unless the terms of one row span more than ~53 - 17 - log2(K) binades, so the float32
    rounding is the one an ideal fp32 accumulator gives.
    """
    check_precision(precision)
    x, ex, w, on_input = hidden_states, experts, topk_weights, apply_router_weight_on_input
    dtype = x.dtype
    M, H = x.shape
    topk = topk_ids.shape[1]
    I = ex.intermediate_size  # noqa: E741
    alpha13, alpha2 = ex.alphas(precision)
    ids = topk_ids.long()

    def operand(rows: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
        if precision == "w4a16":
            return rows.double()
        q, sc = _quantize_blocks(rows, gs.reshape(()))
        return decode_scaled(q, sc).double()

    # Per (token, slot) expert output, kept in the output dtype as the semantics round it.
    y_all = torch.zeros((M, topk, H), dtype=dtype, device=x.device)
    for e in range(ex.num_experts):
        t, j = (ids == e).nonzero(as_tuple=True)
        if t.numel() == 0:
            continue
        rows = x[t]
        if on_input:
            rows = (rows.float() * w[t, j].unsqueeze(1)).to(dtype)
        acc1 = (operand(rows, ex.a13_gs[e]) @ decode_scaled(ex.w13[e], ex.w13_scale[e]).double().T).float()
        h = (acc1 * alpha13[e].repeat_interleave(I)).to(dtype)
        acc2 = (operand(silu_mul(h), ex.a2_gs[e]) @ decode_scaled(ex.w2[e], ex.w2_scale[e]).double().T).float()
        y_all[t, j] = (acc2 * alpha2[e]).to(dtype)
    return _reduce_slots(y_all, w, on_input)


def _reduce_slots(y_all: torch.Tensor, w: torch.Tensor, apply_router_weight_on_input: bool) -> torch.Tensor:
    """``[M, topk, H]`` expert outputs (zero where not served) -> ``[M, H]``: float32 sum in slot order,
    rounded once."""
    M, topk, H = y_all.shape
    out = torch.zeros((M, H), dtype=torch.float32, device=y_all.device)
    for j in range(topk):
        term = y_all[:, j].float()
        if not apply_router_weight_on_input:
            term = term * w[:, j].unsqueeze(1)
        out += term
    return out.to(y_all.dtype)


def dequantized_moe(
    hidden_states: torch.Tensor, experts: NvFp4Experts, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """float64 ``[M, H]``: ``sum_j w[t,j] * (silu(x W_gate^T) * (x W_up^T)) W_down^T`` over the routed experts.

    ``x`` is ``hidden_states`` in float64 (not quantized); ids of ``-1`` contribute nothing.
    Each routed expert is dequantized on its own, so memory stays at one expert's weights.
    """
    I = experts.intermediate_size  # noqa: E741
    ids = topk_ids.long()
    x = hidden_states.double()
    out = torch.zeros((x.shape[0], experts.hidden_size), dtype=torch.float64, device=x.device)
    for e in torch.unique(ids[ids >= 0]).tolist():
        t, j = (ids == e).nonzero(as_tuple=True)
        w13, w2 = experts.dequantize(torch.float64, expert=e)
        h = x[t] @ w13.T
        y = (torch.nn.functional.silu(h[:, :I]) * h[:, I:]) @ w2.T
        out.index_add_(0, t, y * topk_weights[t, j].double().unsqueeze(1))
    return out
