"""Shared MoE test cases and input builders (used by reference, Triton and CUDA tests)."""

from __future__ import annotations

import dataclasses
import functools
import zlib
from dataclasses import dataclass

import pytest
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


# --------------------------------------------------------------------------- the GPU backends


def gpu_backend(name: str, *values, id: str | None = None):  # noqa: A002 - pytest.param's own keyword
    """``pytest.param(name, *values)`` for a GPU backend, marked as where it runs: ``triton`` on any CUDA
    GPU (``gpu``), ``cutlass`` on compute capability 9.x (``gpu`` and ``sm90``: the sm_90a GEMM, the only
    GEMM of it that runs on this project's GPUs). Skipped elsewhere by conftest, never hidden on the H200."""
    marks = [pytest.mark.gpu] + ([pytest.mark.sm90] if name == "cutlass" else [])
    return pytest.param(name, *values, marks=marks, id=id or name)


GPU_BACKENDS = [gpu_backend("triton"), gpu_backend("cutlass")]


# --------------------------------------------------------------------------- the GPU grid

# vLLM's NVFP4 MoE test grid: m x (n = I, k = H) x e x topk x dtype, 640 cases (GPU only).
GRID_M = (1, 2, 64, 224, 1024)
GRID_NK = ((1024, 1024), (1024, 1536), (3072, 1024), (768, 2048))
GRID_E = (8, 40, 64, 256)
GRID_TOPK = (1, 2, 6, 8)
GRID_DTYPES = (torch.bfloat16, torch.float16)
# Weight-set dimensions outermost, so consecutive cases reuse one quantized weight set.
GRID = [(dt, e, nk, m, topk)
        for dt in GRID_DTYPES for e in GRID_E for nk in GRID_NK for m in GRID_M for topk in GRID_TOPK]
GRID_IDS = [f"{'bf16' if dt == torch.bfloat16 else 'fp16'}-e{e}-n{n}-k{k}-m{m}-top{topk}"
            for dt, e, (n, k), m, topk in GRID]


@functools.lru_cache(maxsize=1)
def grid_experts(dtype: torch.dtype, e: int, n: int, k: int) -> NvFp4Experts:
    """Weights randn/15 (as vLLM's test), quantized per expert on the GPU; calibrated-looking activation scales."""
    gen = torch.Generator(device="cuda").manual_seed(e * 7 + n + k)
    w13 = (torch.randn(e, 2 * n, k, generator=gen, device="cuda", dtype=dtype) / 15)
    w2 = (torch.randn(e, k, n, generator=gen, device="cuda", dtype=dtype) / 15)
    a13 = 2688.0 / (0.25 + torch.rand(e, generator=gen, device="cuda"))
    a2 = 2688.0 / (0.5 + torch.rand(e, generator=gen, device="cuda"))
    return NvFp4Experts.quantize(w13, w2, a13_gs=a13, a2_gs=a2)


def grid_case(dtype: torch.dtype, e: int, nk: tuple[int, int], m: int, topk: int):
    """(experts, hidden_states, topk_weights, topk_ids int32) of one grid case, fresh inputs per case."""
    n, k = nk
    ex = grid_experts(dtype, e, n, k)
    gen = torch.Generator(device="cuda").manual_seed(m * 131 + topk * 17 + e)
    x = (torch.randn(m, k, generator=gen, device="cuda") / 10).to(dtype)
    logits = torch.randn(m, e, generator=gen, device="cuda")
    w, ids = torch.softmax(logits, dim=-1).topk(topk, dim=-1)
    return ex, x, w, ids.to(torch.int32)


def gpu_experts(e: int, h: int, i: int, dtype: torch.dtype, split: bool, seed: int) -> NvFp4Experts:
    """Random experts made on the GPU (randn/15; up rows 3x larger when ``split``: gate != up scales)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=gen, device="cuda", dtype=dtype) / 15
    if split:
        w13[:, i:] *= 3.0
    w2 = torch.randn(e, h, i, generator=gen, device="cuda", dtype=dtype) / 15
    a13 = 2688.0 / (0.25 + torch.rand(e, generator=gen, device="cuda"))
    a2 = 2688.0 / (0.5 + torch.rand(e, generator=gen, device="cuda"))
    return NvFp4Experts.quantize(w13, w2, a13_gs=a13, a2_gs=a2, separate_gate_up_scales=split)


def served_slots(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, on_input: bool):
    """The per-token oracles' walk: ``(t, j, e, row)`` for every served slot in slot order, ``row``
    the token's row as both GEMMs see it (times the router weight, rounded, when ``on_input``)."""
    M, topk = ids.shape
    for t in range(M):
        for j in range(topk):
            e = int(ids[t, j])
            if e < 0:
                continue
            row = x[t]
            if on_input:
                row = (row.float() * float(w[t, j])).to(x.dtype)
            yield t, j, e, row


@functools.cache
def sm90_row_order_stages(precision: str, order: str):
    """An sm_90a stage set whose gathered row stage always runs one of the two values kernels, where the
    backend's plans choose by size (cutlass.quantizes_by_token): ``order`` "token"
    (``moe_fp4_quantize_values_by_token``) or "slot" (``moe_fp4_quantize_rows``, packed and scales NULL), so
    that the tests hold both to the reference at any size."""
    from moe_fp4.backends import cutlass
    from moe_fp4.pipeline import StageSet

    base = cutlass._Sm90W4A16Kernels if precision == "w4a16" else cutlass._Sm90Kernels
    chosen = base._quantize_rows_by_token if order == "token" else cutlass._Kernels._quantize_rows
    kernels = type(f"{order.title()}OrderKernels", (base,), {"_quantize_rows": chosen})()
    like = cutlass.STAGES_SM90_W4A16 if precision == "w4a16" else cutlass.STAGES_SM90
    forced = StageSet.from_kernels(order, kernels, activation_values=True, activation_codes=False,
                                   precision=precision)
    return dataclasses.replace(like, name=f"{like.name}-{order}-order", quantize_rows=forced.quantize_rows)
