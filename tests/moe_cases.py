"""Shared MoE test cases and input builders (used by reference, Triton and CUDA tests)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from moe_fp4 import NvFp4Experts


@dataclass(frozen=True)
class Case:
    """One MoE configuration. ``routing`` picks how topk_ids are drawn (see make_inputs)."""

    m: int
    e: int
    topk: int
    h: int
    i: int
    dtype: torch.dtype = torch.bfloat16
    routing: str = "random"  # random | skip_expert | one_expert | all_experts | with_minus_one
    split_gate_up: bool = False
    on_input: bool = False
    note: str = ""

    def __str__(self) -> str:
        dt = "bf16" if self.dtype == torch.bfloat16 else "fp16"
        extra = "".join(
            f"-{s}" for s, on in (("split", self.split_gate_up), ("oninput", self.on_input)) if on
        )
        return f"m{self.m}-e{self.e}-k{self.topk}-h{self.h}-i{self.i}-{dt}-{self.routing}{extra}"

    @property
    def seed(self) -> int:
        """A seed fixed by the case's name (CRC-32: the same in every run, unlike ``hash``)."""
        return zlib.crc32(str(self).encode())


# Each case names the edge it covers.
EDGE_CASES = [
    Case(1, 4, 1, 64, 32, note="a single token, top-1"),
    Case(7, 8, 2, 64, 32, note="plain multi-token top-2"),
    Case(9, 8, 2, 64, 32, routing="skip_expert", note="an expert with no tokens"),
    Case(6, 8, 3, 64, 32, routing="one_expert", note="every token's first choice is one expert"),
    Case(4, 5, 5, 64, 32, routing="all_experts", note="topk == E, E not a multiple of 4"),
    Case(5, 17, 3, 64, 32, note="prime E, not a multiple of 16"),
    Case(8, 8, 3, 64, 32, routing="with_minus_one", note="-1 ids (expert parallelism)"),
    Case(5, 6, 2, 64, 32, split_gate_up=True, note="gate and up with different global scales"),
    Case(6, 8, 2, 64, 32, on_input=True, note="router weights applied on the input, topk > 1"),
    Case(5, 8, 2, 48, 48, dtype=torch.float16, note="fp16; H and I not multiples of 32 or 64"),
    Case(3, 3, 2, 160, 16, note="the smallest I; K = 160 is not a multiple of 64"),
]


def make_experts(case: Case, gen: torch.Generator, device: torch.device | str = "cpu") -> NvFp4Experts:
    """Random experts quantized to NVFP4 (weights ~ randn/15, as vLLM's tests use)."""
    w13 = torch.randn(case.e, 2 * case.i, case.h, generator=gen) / 15
    w2 = torch.randn(case.e, case.h, case.i, generator=gen) / 15
    if case.split_gate_up:
        w13[:, case.i :] *= 3.0  # up rows 3x larger: gate and up get different global scales
    # Activation scales per expert, different across experts (as a calibration gives).
    a13 = 2688.0 / (0.4 + torch.rand(case.e, generator=gen))
    a2 = 2688.0 / (0.05 + 0.2 * torch.rand(case.e, generator=gen))
    ex = NvFp4Experts.quantize(
        w13.to(case.dtype).to(device), w2.to(case.dtype).to(device),
        a13_gs=a13.to(device), a2_gs=a2.to(device), separate_gate_up_scales=case.split_gate_up,
    )
    if case.split_gate_up and ex.w13_gs.dim() == 2:
        # Guard the premise of the case: the two halves really have different scales.
        if torch.equal(ex.w13_gs[:, 0], ex.w13_gs[:, 1]):
            raise AssertionError("split_gate_up case produced equal gate/up scales")
    return ex


def make_inputs(case: Case, gen: torch.Generator, device: torch.device | str = "cpu"):
    """(hidden_states, topk_weights float32, topk_ids int32) for the case's routing pattern."""
    x = (torch.randn(case.m, case.h, generator=gen) / 10 * 3).to(case.dtype)
    logits = torch.randn(case.m, case.e, generator=gen)
    if case.routing == "skip_expert":
        logits[:, 3] = -1e9
    elif case.routing == "one_expert":
        logits[:, 1] = 1e9
    weights, ids = torch.softmax(logits, dim=-1).topk(case.topk, dim=-1)
    if case.routing == "with_minus_one":
        ids[::2, 0] = -1
        ids[1, -1] = -1
    if case.routing == "skip_expert" and (ids == 3).any():
        raise AssertionError("skip_expert routing still routed to expert 3")
    return x.to(device), weights.to(device), ids.to(torch.int32).to(device)
