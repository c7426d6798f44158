"""What every timed output must pass before its time counts: comparators and tolerances.

Each timed path is checked against an independent reference twice: on the output of the
captured replay before timing, and on the output left by the last timed replay.

* moe_fp4's whole forward (W4A4: activations quantized as :func:`moe_fp4.fused_moe`
  specifies) against :func:`moe_fp4.reference.exact_moe`.
* The peers (W4A16: bf16 activations, NVFP4 weights) against
  :func:`moe_fp4.reference.dequantized_moe`, float64 math on the exactly dequantized
  weights. A W4A16 result is a different function from the W4A4 one (they differ by the
  activation quantization error, about 10% relative), so each is held to its own reference.
* Stages against the reference stages of :mod:`moe_fp4.stages`, on the stage's own inputs.

The comparisons are those of :mod:`moe_fp4.testing` (the project's one comparator), returned
as :class:`CheckResult` rows instead of raised.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..testing import assert_same_buffers, rel_err

__all__ = [
    "ACT_QUANT_REL_TOL",
    "BF16_ULP_REL_TOL",
    "FUSED_REL_TOL",
    "PEER_REL_TOL",
    "CheckResult",
    "check_rows",
    "exact",
    "spread_indices",
    "within",
]

# moe_fp4 vs its exact reference. A correct kernel differs only in the fp32 summation order,
# which flips the bf16 rounding of a few GEMM1 outputs by one ulp and, through the
# re-quantization of the intermediate, very rarely one E2M1 code: well below 1e-3. A wrong
# layout or scale gives ~1, and one expert of 128 left out at large M gives ~0.09 (1/16 of the
# tokens miss one of 8 equal terms: sqrt(1/16 * 1/8)). 1e-2 separates the two.
FUSED_REL_TOL = 1e-2

# Peers vs the float64 W4A16 reference. Healthy runs measured 4.4-5.0e-3 on an H200 (bf16
# activations and intermediate); a layout or scale bug gives ~1.
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


def within(what: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> CheckResult:
    """Norm-relative error (:func:`moe_fp4.testing.rel_err`) at most ``tol``; nan, inf or another shape fails."""
    if tuple(out.shape) != tuple(ref.shape):
        return CheckResult(False, f"{what}: shape {list(out.shape)}, expected {list(ref.shape)}")
    err = rel_err(out, ref)
    ok = err <= tol
    return CheckResult(ok, f"{what}: rel err {err:.3g} {'<=' if ok else '>'} {tol:.3g}", err, tol)


def exact(what: str, out: object, ref: object) -> CheckResult:
    """``out`` equal to ``ref`` in every tensor's shape, dtype and bytes (:func:`moe_fp4.testing.assert_same_buffers`).

    Both are tensors or buffers of :mod:`moe_fp4.buffers`; the detail names the first
    differing tensor and how many of its bytes differ.
    """
    try:
        assert_same_buffers(out, ref, what)
    except AssertionError as exc:
        return CheckResult(False, str(exc))
    names = [f.name for f in dataclasses.fields(ref) if getattr(ref, f.name) is not None] \
        if dataclasses.is_dataclass(ref) else []
    fields = f" ({', '.join(names)})" if names else ""
    return CheckResult(True, f"{what}: bit-exact{fields}")


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
