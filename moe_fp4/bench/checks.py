"""What every timed output must pass before its time counts: references, comparators, tolerances.

Each timed path is checked against an independent reference twice: on the output of the
captured replay before timing, and on the output left by the last timed replay.

* moe_fp4's whole forward (W4A4: activations quantized as :func:`moe_fp4.fused_moe`
  specifies) against the ``reference`` backend.
* The peers (W4A16: bf16 activations, NVFP4 weights) against :func:`w4a16_reference`, float64
  math on the exactly dequantized weights. A W4A16 result is a different function from the
  W4A4 one, so each is held to its own reference (peers README, "Limits").
* Stages against the stage references of :mod:`moe_fp4.stages`, on the stage's own inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..format import decode_scaled

__all__ = [
    "FUSED_REL_TOL",
    "PEER_REL_TOL",
    "BF16_ULP_REL_TOL",
    "ACT_QUANT_REL_TOL",
    "CheckResult",
    "rel_err",
    "within",
    "exact",
    "check_rows",
    "spread_indices",
    "w4a16_reference",
]

# moe_fp4 vs its exact reference. A correct kernel differs only in the fp32 summation order,
# which flips the bf16 rounding of a few GEMM1 outputs by one ulp and, through the
# re-quantization of the intermediate, very rarely one E2M1 code: well below 1e-3. A wrong
# layout or scale gives ~1, and one expert of 128 left out at large M gives ~0.09 (1/16 of the
# tokens miss one of 8 equal terms: sqrt(1/16 * 1/8)). 1e-2 separates the two.
FUSED_REL_TOL = 1e-2

# Peers vs the float64 W4A16 reference: the peer kit's own bar. Healthy runs measured
# 4.4-5.0e-3 on an H200 (bf16 activations and intermediate); a layout or scale bug gives ~1.
PEER_REL_TOL = 2e-2

# A 16-bit output that differs from the reference's rounding of the same value by at most one
# bf16 ulp (2^-8 relative, as the significand has 8 bits) has a norm-relative error of at most
# 2^-8. That is the bound for the grouped GEMMs (fp32 accumulation in another order, the same
# fp32 alpha, one rounding) and for the top-k reduction (an fp32 sum, one rounding).
BF16_ULP_REL_TOL = 2.0**-8

# Decoded values of the re-quantized intermediate. The kernel's silu may use a fast exp, so its
# bf16 silu can differ by one ulp; an element then crosses an E2M1 rounding boundary only when
# it lies within 2^-8 of one, i.e. for a small fraction of elements, each moving by one grid
# step. 1e-2 allows that and still catches any wrong block scale, code or row (errors ~1).
ACT_QUANT_REL_TOL = 1e-2


@dataclass(frozen=True)
class CheckResult:
    """Outcome of one check. ``rel_err``/``tol`` are None for exact (bitwise) checks."""

    ok: bool
    detail: str
    rel_err: float | None = None
    tol: float | None = None

    def to_dict(self) -> dict:
        return {"check_ok": self.ok, "check": self.detail, "rel_err": self.rel_err, "tol": self.tol}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64; 0 if both are zero, inf if only ``ref`` is, nan if ``out`` has nan."""
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"out: expected shape {list(ref.shape)} (the reference's), got {list(out.shape)}")
    o, r = out.double(), ref.double()
    num = float((o - r).norm())
    den = float(r.norm())
    if den == 0:
        return 0.0 if num == 0 else float("inf")
    return num / den


def within(what: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> CheckResult:
    """Norm-relative error of ``out`` against ``ref`` at most ``tol`` (nan, inf or another shape fails)."""
    if tuple(out.shape) != tuple(ref.shape):
        return CheckResult(False, f"{what}: shape {list(out.shape)}, expected {list(ref.shape)}")
    err = rel_err(out, ref)
    ok = err <= tol
    return CheckResult(ok, f"{what}: rel err {err:.3g} {'<=' if ok else '>'} {tol:.3g}", err, tol)


def exact(what: str, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> CheckResult:
    """Every ``(out, ref)`` pair identical in shape, dtype and bytes."""
    for name, (out, ref) in pairs.items():
        if out.dtype != ref.dtype or tuple(out.shape) != tuple(ref.shape):
            return CheckResult(False, f"{what}: {name} is {out.dtype} {list(out.shape)}, "
                                      f"expected {ref.dtype} {list(ref.shape)}")
        a = out.contiguous().view(torch.uint8) if out.element_size() == 1 else out
        b = ref.contiguous().view(torch.uint8) if ref.element_size() == 1 else ref
        if not torch.equal(a, b):
            diff = int((a != b).sum())
            return CheckResult(False, f"{what}: {name} differs from the reference in {diff} of {a.numel()} entries")
    return CheckResult(True, f"{what}: bit-exact ({', '.join(pairs)})")


def spread_indices(n: int, count: int) -> list[int]:
    """``min(n, count)`` distinct indices spread evenly over ``0..n-1``, always with the first and the last."""
    if n <= count:
        return list(range(n))
    if count == 1:
        return [0]
    return sorted({round(i * (n - 1) / (count - 1)) for i in range(count)})


def check_rows(num_tokens: int, cap: int, device: torch.device) -> torch.Tensor:
    """Token rows whose outputs are checked: all of them up to ``cap``, else ``cap`` spread rows.

    An MoE forward's output rows are independent: a token's activations are quantized per row
    with the expert's fixed global scale, its experts see only that row, and the top-k sum is per
    token. So the reference run on ``x[rows]`` with the same routing gives exactly the rows
    ``out[rows]`` of the full run; spreading them over ``[0, M)`` with the last token included
    covers the late tiles of every kernel while the reference cost stays bounded.
    """
    if cap < 1:
        raise ValueError(f"cap: expected at least one checked token, got {cap}")
    return torch.tensor(spread_indices(num_tokens, cap), dtype=torch.long, device=device)


def w4a16_reference(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, experts) -> torch.Tensor:
    """The W4A16 MoE (what the peers compute) in float64: bf16 ``x``, exactly dequantized weights.

    ``out[t] = sum_j w[t,j] * W2_e @ (silu(g) * u)``, ``[g | u] = W13_e @ x[t]``, ``e = topk_ids[t, j]``
    (``-1`` ids contribute nothing), with ``W = e2m1 * scale / gs`` per half of w13.
    Returns float64 ``[T, H]``.
    """
    ids = topk_ids.long()
    I = experts.intermediate_size  # noqa: E741
    gs13 = experts.w13_gs_per_half.double()
    gs2 = experts.w2_gs.double()
    out = torch.zeros((x.shape[0], experts.hidden_size), dtype=torch.float64, device=x.device)
    xd = x.double()
    for e in torch.unique(ids[ids >= 0]).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        w13 = decode_scaled(experts.w13[e], experts.w13_scale[e]).double()
        w13[:I] /= gs13[e, 0]
        w13[I:] /= gs13[e, 1]
        w2 = decode_scaled(experts.w2[e], experts.w2_scale[e]).double() / gs2[e]
        h = xd[tok] @ w13.T
        y = (F.silu(h[:, :I]) * h[:, I:]) @ w2.T
        out.index_add_(0, tok, y * topk_weights[tok, slot].double().unsqueeze(1))
    return out
