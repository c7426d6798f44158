"""Each Triton pipeline stage against its contract in ``moe_fp4.stages`` (the torch reference).

Routing, both quantizations and the reduction must be bit-exact, every byte of every output
buffer included (outputs are poisoned before each call, so an unwritten byte fails); the
GEMM is held to a rigorous floating-point bound. The small cases run in Triton's CPU
interpreter here and compiled on a GPU; ``gpu``-marked cases add model-sized shapes.
"""

from __future__ import annotations

import pytest
import torch
from gpu_report import record
from test_triton_numerics import every_code_and_scale

import moe_fp4.backends.triton as tb
from moe_fp4 import NvFp4Experts, stages
from moe_fp4.buffers import Quantized, RoutingData, WeightOperand
from moe_fp4.format import quantize_nvfp4, swizzle_scales_grouped
from moe_fp4.testing import assert_same_buffers, poisoned_like, routed_ids, served_ids

pytestmark = [
    pytest.mark.interpreter,
    # Triton's interpreter turns 1-element arrays into loop bounds (numpy < 2.4 only warns).
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]

ROUTING_FIELDS = ("expert_offsets", "blockscale_offsets", "slot_to_flat", "flat_to_slot")


def _poisoned_routing(n: int, e: int, device) -> RoutingData:
    # 0x7F7F7F7F: no valid offset or slot (0xFF bytes would read as -1, a valid "no slot").
    return poisoned_like(RoutingData.empty(n, e, device), byte=0x7F)


def _poisoned_quantized(n: int, k: int, e: int, device) -> Quantized:
    """0xFF everywhere: a NaN scale and -6 codes, so any byte left unwritten differs from the reference."""
    return poisoned_like(Quantized.empty(n, k, e, device))


def _grouped(offs: list[int], bso: list[int], device) -> RoutingData:
    """Routing of rows already grouped by expert (``offs``), for stages called without the gather."""
    n = offs[-1] if offs[-1] else 1
    i32 = torch.int32
    slots = torch.arange(n, dtype=i32, device=device)
    return RoutingData(torch.tensor(offs, dtype=i32, device=device), torch.tensor(bso, dtype=i32, device=device),
                       slots, slots.clone())


def assert_same_quantized(stage: str, got: Quantized, want: Quantized) -> None:
    """Packed codes and every scale byte identical (the count of differing bytes goes to the GPU report)."""
    record(stage, mismatched_bytes=int((got.packed != want.packed).sum())
           + int((got.scales.view(torch.uint8) != want.scales.view(torch.uint8)).sum()))
    assert_same_buffers(got, want, stage)


# --------------------------------------------------------------------------- routing

ROUTING_CASES = [
    (1, 1, 1, "random"),  # one token, one expert
    (1, 8, 128, "random"),  # decode, Qwen3-30B-A3B routing
    (5, 3, 17, "minus_one"),  # prime E, -1 ids
    (40, 6, 64, "skip"),  # an expert with no rows
    (33, 8, 8, "one_expert"),  # topk == E and one expert in every token
    (100, 8, 40, "out_of_range"),  # chunked path (n = 800), ids outside [-1, E)
    (257, 1, 3, "random"),  # chunked path just past the single-program limit
    (16, 4, 1500, "minus_one"),  # E > 1024, single program (two expert chunks)
    (300, 2, 1100, "minus_one"),  # E > 1024, chunked path
]


@pytest.mark.parametrize("m,topk,e,pattern", ROUTING_CASES, ids=[f"m{m}-k{k}-e{e}-{p}" for m, k, e, p in ROUTING_CASES])
def test_routing_matches_reference(device, m, topk, e, pattern):
    """Offsets and both permutations equal stages.routing exactly (deterministic slot order)."""
    gen = torch.Generator().manual_seed(m * 1000 + e)
    ids = routed_ids(m, topk, e, gen, pattern).to(device)
    out = _poisoned_routing(m * topk, e, device)
    got = tb.routing(ids, e, out=out)
    want = stages.routing(served_ids(ids, e), e)
    mismatched = sum(int((getattr(got, f) != getattr(want, f)).sum()) for f in ROUTING_FIELDS)
    record("routing", mismatched_entries=mismatched)
    for f in ROUTING_FIELDS:
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    # Without out=, fresh buffers are returned.
    fresh = tb.routing(ids, e)
    assert all(torch.equal(getattr(fresh, f), getattr(want, f)) for f in ROUTING_FIELDS)


@pytest.mark.parametrize("m,topk,e", [(64, 8, 128), (40, 13, 300)], ids=["qwen3-M64", "n520-E300"])
def test_single_program_routing_past_its_limit_matches_reference(device, monkeypatch, m, topk, e):
    """The single-program routing kernel is exact for any ``n`` its block holds, not only up to
    ``routing.SMALL_MAX`` (256): with the limit raised it routes 512 and 520 flat indices (M=64 of
    Qwen3, and a block of 1024 with E > 256) as the reference does. What a larger limit would cost
    on the GPU (one O(n^2) ranking program against three launches) is for the benchmark to show."""
    import importlib

    tr = importlib.import_module("moe_fp4.triton_kernels.routing")  # (the package's `routing` is the function)
    monkeypatch.setattr(tr, "SMALL_MAX", 1024)
    gen = torch.Generator().manual_seed(m * 7 + e)
    ids = routed_ids(m, topk, e, gen, "minus_one").to(device)
    assert tr.routing_scratch_numel(m * topk, e) == 0  # the single program: no chunk histogram
    got = tb.routing(ids, e, out=_poisoned_routing(m * topk, e, device))
    want = stages.routing(served_ids(ids, e), e)
    for f in ROUTING_FIELDS:
        assert torch.equal(getattr(got, f), getattr(want, f)), f


# --------------------------------------------------------------------------- quantization

QUANT_CASES = [
    # (m, topk, e, k, dtype, pattern, row_scale)
    (5, 3, 7, 64, torch.bfloat16, "minus_one", False),
    (6, 2, 5, 160, torch.float16, "skip", True),  # K % 64 != 0: padded scale columns
    (4, 4, 4, 48, torch.bfloat16, "random", True),  # topk == E; C = 3 scale columns
    (3, 1, 2, 16, torch.float16, "random", False),  # the smallest K
    (9, 2, 3, 32, torch.bfloat16, "out_of_range", True),
]


def _activations(m: int, k: int, dtype, gen) -> torch.Tensor:
    """Rows with very different magnitudes (saturated, normal and subnormal block scales) and a zero row."""
    x = torch.randn(m, k, generator=gen) * 2.0 ** torch.randint(-20, 6, (m, 1), generator=gen).float()
    x[0] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("m,topk,e,k,dtype,pattern,row_scale", QUANT_CASES,
                         ids=[f"m{c[0]}-k{c[1]}-e{c[2]}-K{c[3]}-{c[5]}-{'w' if c[6] else 'nw'}" for c in QUANT_CASES])
def test_quantize_rows_bit_exact(device, m, topk, e, k, dtype, pattern, row_scale):
    """Gather (+ router weight) + per-expert quantization: packed rows and every scale byte equal the reference."""
    gen = torch.Generator().manual_seed(7 * m + k)
    ids = routed_ids(m, topk, e, gen, pattern).to(device)
    r = stages.routing(served_ids(ids, e), e)
    x = _activations(m, k, dtype, gen).to(device)
    gs = (2688.0 / (0.3 + torch.rand(e, generator=gen))).to(device)
    w = torch.rand(m * topk, generator=gen).to(device) if row_scale else None
    out = _poisoned_quantized(m * topk, k, e, device)
    got = tb.quantize_rows(x, gs, r, row_scale=w, out=out)
    assert got is out
    assert_same_quantized("quantize_rows", got, stages.quantize_rows(x, gs, r, row_scale=w))


QUANT_PINNED = [
    ((1, 64, 1, 128), "one row, 64 columns, 128-word zeroing blocks"),
    ((4, 128, 2, 256), "four rows"),
    ((16, 256, 4, 1024), "sixteen rows"),
    ((4, 128, 1, 256, True), "whole blocks per thread, four rows"),  # QuantConfig.whole_blocks
    ((2, 256, 1, 1024, True), "whole blocks per thread, a partial column block"),
]


@pytest.mark.parametrize("mode", ["gather", "silu"])
@pytest.mark.parametrize("config", [c for c, _ in QUANT_PINNED], ids=[n for _, n in QUANT_PINNED])
def test_quantize_configs_bit_exact(device, config, mode):
    """Pinned launch configurations (those of the GPU table among them, and whole blocks per thread, whose
    16-bit roundings are the hardware's on a GPU) give the same bytes as the reference.

    K = 160 (12 padded scale columns): several column blocks, a partial last one, and
    zeroing blocks that split the 128-row bands; one expert without rows.
    """
    gen = torch.Generator().manual_seed(sum(config))
    m, topk, e, k = 7, 3, 6, 160
    ids = routed_ids(m, topk, e, gen, "skip").to(device)
    r = stages.routing(ids, e)
    gs = (2688.0 / (0.3 + torch.rand(e, generator=gen))).to(device)
    cfg = tb.kernels().QuantConfig(*config)
    out = _poisoned_quantized(m * topk, k, e, device)
    if mode == "gather":
        x = _activations(m, k, torch.bfloat16, gen).to(device)
        w = torch.rand(m * topk, generator=gen).to(device)
        got = tb.quantize_rows(x, gs, r, row_scale=w, out=out, config=cfg)
        want = stages.quantize_rows(x, gs, r, row_scale=w)
    else:
        h = _gate_up_away_from_ties(m * topk, k, torch.bfloat16, gen).to(device)
        got = tb.silu_mul_quantize(h, gs, r, out=out, config=cfg)
        want = stages.silu_mul_quantize(h, gs, r)
    assert_same_quantized(f"quantize_{mode}", got, want)


def test_quantize_rows_without_gather(device):
    """Rows already grouped by expert (no slot_to_flat): quantized in place order."""
    gen = torch.Generator().manual_seed(11)
    e, n, k = 3, 10, 64
    i32 = torch.int32
    slots = torch.arange(n, dtype=i32, device=device)
    # expert 1 empty, row 9 past the end
    r = RoutingData(torch.tensor([0, 4, 4, 9], dtype=i32, device=device),
                    torch.tensor([0, 128, 128, 256], dtype=i32, device=device), slots, slots.clone())
    x = _activations(n, k, torch.bfloat16, gen).to(device)
    gs = torch.tensor([900.0, 1.0, 2000.0], device=device)
    got = tb.quantize_rows(x, gs, r, gather=False, out=_poisoned_quantized(n, k, e, device))
    assert_same_quantized("quantize_rows", got, stages.quantize_rows(x, gs, r, gather=False))


def _gate_up_away_from_ties(rows: int, i: int, dtype, gen) -> torch.Tensor:
    """``h [rows, 2I]`` whose gate values keep silu far from 16-bit rounding ties.

    The contract computes silu in float32 with ``exp``; torch's and numpy's (and CUDA's)
    ``expf`` differ in the last bit for about a third of inputs, which is within spec.
    Gate values whose float32 silu lies within 2^-20 (relative) of a 16-bit rounding
    boundary are redrawn, so every accurate exp gives the same 16-bit silu and the stage
    is then bit-exact. (The product with ``up`` is exact in float32 before its rounding.)
    """
    g = torch.randn(rows, i, generator=gen, dtype=torch.float64) * 3
    for _ in range(20):
        s = g / (1 + torch.exp(-g))
        lo = (s * (1 - 2.0**-20)).float().to(dtype)
        hi = (s * (1 + 2.0**-20)).float().to(dtype)
        near = lo != hi
        if not near.any():
            break
        g[near] = torch.randn(int(near.sum()), generator=gen, dtype=torch.float64) * 3
    assert not near.any()
    u = torch.randn(rows, i, generator=gen) * 2.0 ** torch.randint(-6, 4, (rows, 1), generator=gen).float()
    return torch.cat([g.float(), u], dim=1).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m,topk,e,i,pattern", [(5, 3, 7, 48, "minus_one"), (4, 2, 3, 80, "skip")])
def test_silu_mul_quantize_bit_exact(device, dtype, m, topk, e, i, pattern):
    """SiLU-and-mul + per-expert quantization equal the reference byte for byte (inputs away from silu ties)."""
    gen = torch.Generator().manual_seed(m * i)
    ids = routed_ids(m, topk, e, gen, pattern).to(device)
    r = stages.routing(ids, e)
    h = _gate_up_away_from_ties(m * topk, i, dtype, gen).to(device)
    gs = (2688.0 / (0.05 + torch.rand(e, generator=gen))).to(device)
    got = tb.silu_mul_quantize(h, gs, r, out=_poisoned_quantized(m * topk, i, e, device))
    assert_same_quantized("silu_mul_quantize", got, stages.silu_mul_quantize(h, gs, r))


# --------------------------------------------------------------------------- grouped GEMM


def gemm_error_bound(a: Quantized, w: WeightOperand, r: RoutingData, ref: torch.Tensor,
                     got: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |got - ref| for a float32 accumulation in any order.

    With ``T = sum_k |a_k b_k|`` (exact terms: e2m1*e4m3 products), any float32 summation
    order is within ``gamma_K * T`` of the exact sum, ``gamma_K = K u / (1 - K u)``. We take
    ``u = 2^-22``, four times the round-to-nearest unit, to also cover tensor-core
    accumulators that truncate aligned addends. alpha's float32 product adds ``2u`` relative
    and the final 16-bit roundings of both sides at most one unit in the last place of the
    larger of the two.
    """
    K = a.K
    u = 2.0**-22
    gamma = K * u / (1 - K * u)
    strip_signs = 0x77  # clear the sign bit of both nibbles: |e2m1| codes
    terms = stages.grouped_gemm(Quantized(a.packed & strip_signs, a.scales),
                                WeightOperand(w.packed & strip_signs, w.scales, w.alpha.abs()), r,
                                torch.bfloat16)[: ref.shape[0]].float() * (1 + 2.0**-7)
    big = torch.maximum(ref.float().abs(), got.float().abs()).to(ref.dtype)
    ulp = (torch.nextafter(big, torch.full_like(big, float("inf"))).float() - big.float())
    return gamma * terms + 2 * u * ref.float().abs() + ulp


def gemm_operands(m: int, topk: int, e: int, N: int, K: int, sections: int, dtype, device, *,  # noqa: N803
                  seed: int, values: bool = False) -> tuple[RoutingData, Quantized, WeightOperand]:
    """``(routing, a, w)`` of a random grouped GEMM: ``m`` tokens' rows quantized per expert (with their
    ``dtype`` values when ``values``) and ``N x K`` weights per expert in ``sections`` with different
    global scales per expert and section (alpha ``1 / (gs_a gs_w)``)."""
    gen = torch.Generator().manual_seed(seed)
    ids = routed_ids(m, topk, e, gen, "minus_one" if m > 3 else "random").to(device)
    r = stages.routing(ids, e)
    x = torch.randn(m, K, generator=gen).to(dtype).to(device)
    out = Quantized.empty(r.num_slots, K, e, device, values=dtype) if values else None
    a = stages.quantize_rows(x, torch.full((e,), 500.0, device=device), r, out=out)
    w = (torch.randn(e, N, K, generator=gen) / 15).to(device)
    ex_gs = torch.rand(e, sections, generator=gen).to(device) * 4000 + 100  # different per expert and section
    q = torch.empty((e, N, K // 2), dtype=torch.uint8, device=device)
    s = torch.empty((e, N, K // 16), dtype=torch.float8_e4m3fn, device=device)
    ns = N // sections
    for h in range(sections):
        rows = slice(h * ns, (h + 1) * ns)
        q[:, rows], s[:, rows] = quantize_nvfp4(w[:, rows], ex_gs[:, h].contiguous())
    return r, a, WeightOperand.build(q, s, (1.0 / (500.0 * ex_gs)).contiguous())


GEMM_CASES = [
    # (m, topk, e, N, K, sections, config or None, note)
    (5, 3, 4, 96, 160, 2, (16, 32, 64, True), "swap; K % BK != 0; gate/up sections of 48"),
    (9, 2, 3, 80, 64, 1, (16, 64, 128, False), "BK > K; N % BN != 0"),
    (40, 2, 3, 48, 48, 2, (32, 16, 64, True), "several row tiles per expert; sections straddle tiles; BK > K"),
    (3, 1, 5, 32, 1024, 1, None, "the table's config; long K"),
    (70, 2, 3, 96, 192, 2, (128, 64, 128, False, 8), "GEMM_CONFIGS_SM100's prefill tile; N % BN != 0"),
]


def test_the_codes_table_on_10x_and_11x_is_its_own(monkeypatch):
    """The codes GEMM takes ``GEMM_CONFIGS_SM100`` on compute capability 10.x and 11.x (no 128 x 128 tile, which
    Triton 3.6 compiles to a trap for sm_100: tests/test_triton_compile.py), ``GEMM_CONFIGS`` elsewhere; the
    values GEMM's tables do not change with it."""
    from moe_fp4.triton_kernels import gemm as tg

    tk = tb.kernels()
    cuda = torch.device("cuda")
    monkeypatch.setattr(tg, "_sm_count", lambda device: 148)
    for major, table in ((10, tk.GEMM_CONFIGS_SM100), (11, tk.GEMM_CONFIGS_SM100), (12, tk.GEMM_CONFIGS),
                         (9, tk.GEMM_CONFIGS), (8, tk.GEMM_CONFIGS)):
        monkeypatch.setattr(tg, "_major", lambda device, major=major: major)
        for bound, cfg in table:
            per_expert = 4096 if bound == float("inf") else bound
            assert tk.gemm_config(per_expert * 16, 16, False, 4096, cuda) == cfg, (major, bound)
    assert all((c.block_m, c.block_n) != (128, 128) for _, c in tk.GEMM_CONFIGS_SM100)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m,topk,e,N,K,sections,cfg,note", GEMM_CASES, ids=[c[-1] for c in GEMM_CASES])
def test_grouped_gemm_within_bound(device, out_dtype, m, topk, e, N, K, sections, cfg, note):
    """alpha * (A . B^T) per expert and section: within gemm_error_bound of the exact reference; tail rows untouched."""
    r, a, wt = gemm_operands(m, topk, e, N, K, sections, out_dtype, device, seed=N * K + m)
    config = tb.kernels().GemmConfig(*cfg) if cfg else None
    out = torch.full((m * topk, N), float("nan"), dtype=out_dtype, device=device)
    got = tb.grouped_gemm(a, wt, r, out_dtype, out=out, config=config)
    ref = stages.grouped_gemm(a, wt, r, out_dtype)
    valid = int(r.expert_offsets[-1])
    bound = gemm_error_bound(a, wt, r, ref[:valid], got[:valid])
    err = (got[:valid].float() - ref[:valid].float()).abs()
    record("grouped_gemm", error_over_bound=float((err / bound).max()) if valid else 0.0)
    assert got is out
    assert not got[:valid].isnan().any()
    assert bool((err <= bound).all()), float((err / bound).max())
    assert bool(got[valid:].isnan().all())  # rows past expert_offsets[E] are not written


# One-hot operands (code, scale byte) for the exhaustive GEMM check: the smallest nonzero
# magnitude (0.5 * 2^-9 = 2^-10, a subnormal fp16 operand), 1.0 and the largest, negative.
ONE_HOTS = [(1, 0x01), (2, 0x38), (15, 0x7E)]
EXHAUSTIVE_CONFIGS = [
    ((16, 16, 64, False), "mma"),
    ((16, 64, 64, True), "swap"),
    ((16, 32, 64, True, 4, 2, 1, "float"), "swap-float"),
]
# The values GEMM's (test_triton_values.py) also through its dense form: weights dequantized first.
VALUES_EXHAUSTIVE_CONFIGS = EXHAUSTIVE_CONFIGS + [((16, 16, 64, False, 4, 2, 1, "bits", 1), "dense")]


def _one_hot_rows(code: int, scale: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed [16, 8], scales [16, 1])``: row ``j`` is ``code`` at element ``j`` and zeros, under ``scale``."""
    codes = torch.zeros(16, 16, dtype=torch.uint8)
    codes[torch.arange(16), torch.arange(16)] = code
    return codes[:, 0::2] | (codes[:, 1::2] << 4), torch.full((16, 1), scale, dtype=torch.uint8)


@pytest.mark.parametrize("config,note", EXHAUSTIVE_CONFIGS, ids=[n for _, n in EXHAUSTIVE_CONFIGS])
@pytest.mark.parametrize("hot", ONE_HOTS, ids=["min", "one", "max-negative"])
@pytest.mark.parametrize("side", ["weights", "activations"])
def test_gemm_exact_for_every_code_and_scale(device, side, hot, config, note):
    """Every (code, scale) on one side times a one-hot row on the other: each output is one product, exactly.

    K = 16 (one scale block); all 16 codes under each of the 127 finite scales on ``side``,
    against 16 one-hot rows of ``hot``. Every output is a single product, so the float32
    accumulator holds it exactly and the kernel must equal the reference bit for bit
    (both round the same float32 to bf16). This covers subnormal fp16 operands in the
    operand multiply and in the MMA on a GPU (min x min is 2^-20).
    """
    every_q, every_s = every_code_and_scale()
    hot_q, hot_s = _one_hot_rows(*hot)
    (a_q, a_s), (b_q, b_s) = ((hot_q, hot_s), (every_q, every_s)) if side == "weights" else \
        ((every_q, every_s), (hot_q, hot_s))
    n = a_q.shape[0]
    a_sf, bso = swizzle_scales_grouped(a_s.view(torch.float8_e4m3fn), torch.tensor([0, n], dtype=torch.int32))
    a = Quantized(a_q.to(device), a_sf.to(device))
    wt = WeightOperand.build(b_q[None].contiguous().to(device), b_s.view(torch.float8_e4m3fn)[None].to(device),
                             torch.ones(1, 1, device=device))
    r = _grouped([0, n], bso.tolist(), device)
    got = tb.grouped_gemm(a, wt, r, torch.bfloat16, config=tb.kernels().GemmConfig(*config))
    want = stages.grouped_gemm(a, wt, r, torch.bfloat16)
    bad = (got.view(torch.int16) != want.view(torch.int16)).nonzero()
    record("grouped_gemm_exhaustive", mismatched_elements=bad.shape[0])
    assert bad.shape[0] == 0, [(r, c, float(got[r, c]), float(want[r, c])) for r, c in bad[:8].tolist()]


# --------------------------------------------------------------------------- reduce


@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "plain"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m,topk,e,h", [(9, 3, 5, 160), (70, 2, 4, 48), (1, 8, 8, 16)])
def test_moe_reduce_bit_exact(device, weighted, dtype, m, topk, e, h):
    """Un-permute + weighted top-k sum in float32, slot order: equal to the reference bit for bit."""
    gen = torch.Generator().manual_seed(m * h)
    ids = routed_ids(m, topk, e, gen, "minus_one").to(device)
    r = stages.routing(ids, e)
    y = (torch.randn(m * topk, h, generator=gen) * 10).to(dtype).to(device)
    w = torch.rand(m, topk, generator=gen).to(device) if weighted else None
    out = torch.full((m, h), float("nan"), dtype=dtype, device=device)
    got = tb.moe_reduce(y, r, w, m, dtype, out=out)
    ref = stages.moe_reduce(y, r, w, m, dtype)
    record("moe_reduce", mismatched_elements=int((got.view(torch.int16) != ref.view(torch.int16)).sum()))
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))


# (m, topk, e, N, K, config or None, router weights, K ranges, note): the second GEMM with split K, where a
# plan adds the K ranges in the top-k reduce's launch.
GEMM_REDUCE_CASES = [
    (1, 8, 128, 64, 256, (16, 32, 64, True, 4, 2, 4), True, 4, "decode: 4 K ranges, E = 128"),
    (5, 3, 7, 48, 192, (16, 16, 64, True, 4, 2, 4), False, 3, "-1 ids, experts without rows, 3 K ranges, plain sum"),
    (4, 3, 256, 32, 128, (16, 32, 64, True, 4, 2, 2, "float"), True, 2, "E = 256 (expert 255); the float operands"),
    (3, 2, 300, 32, 128, (16, 32, 64, False, 4, 2, 2), True, 2, "E > 256: the 1024-wide expert search"),
    (2, 1, 1, 32, 128, (16, 32, 64, True, 4, 2, 2, "bits-plain"), True, 2, "E = 1, top-1; no inline assembly"),
    (1, 8, 128, 32, 2048, None, True, 2, "the table's config: split 2 on this 4-SM CPU"),
]


def _stage_operands(tk, m, topk, e, N, K, sections, dtype, device, values):  # noqa: N803
    """``(routing, GEMM launcher operands up to the output)`` of :func:`gemm_operands`' GEMM, codes or values."""
    from moe_fp4.buffers import K16Weights

    r, a, wt = gemm_operands(m, topk, e, N, K, sections, dtype, device, seed=N * K + m + e, values=values)
    if values:
        wt = K16Weights(tk.k16_codes(wt.packed), wt.scales, wt.alpha)
        operands = (a.values.half(), None)
    else:
        operands = (a.packed, a.scales)
    return r, operands + (wt.packed, wt.scales, wt.alpha, r.expert_offsets, r.blockscale_offsets)


def _gemm2_and_reduce(device, dtype, values, m, topk, e, N, K, cfg, weighted, ranges):  # noqa: N803
    """A second GEMM of :data:`GEMM_REDUCE_CASES`' kind and what its launches write: ``(routing, operands,
    config, router weights, y, out)``, ``y`` the GEMM's output (with its split-K reduce) and ``out`` the
    ``moe_reduce`` of it; the case's K ranges checked."""
    if values and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] != 9:
        pytest.skip("the Triton values operand is built for compute capability 9.x")
    tk = tb.kernels()
    r, operands = _stage_operands(tk, m, topk, e, N, K, 1, dtype, device, values)
    config = tk.GemmConfig(*cfg) if cfg else None
    resolved = tk.resolve_config(config, m * topk, e, values, N, device, K)
    assert tk.k_ranges(resolved, m * topk, e, N, K, device)[0] == ranges
    gen = torch.Generator().manual_seed(m * topk)
    w = (torch.rand(m, topk, generator=gen) * 2 - 0.5).to(device) if weighted else None
    y = torch.full((m * topk, N), float("nan"), dtype=dtype, device=device)
    tk.grouped_gemm_launcher(*operands, y, config)()
    out = torch.full((m, N), float("nan"), dtype=dtype, device=device)
    tk.moe_reduce(y, r.flat_to_slot, w, out)
    return r, operands, config, w, y, out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("values", [False, True], ids=["codes", "values"])
@pytest.mark.parametrize("m,topk,e,N,K,cfg,weighted,ranges,note", GEMM_REDUCE_CASES,
                         ids=[c[-1] for c in GEMM_REDUCE_CASES])
def test_gemm2_with_the_topk_reduce_writes_what_the_three_launches_write(device, dtype, values, m, topk, e, N, K,
                                                                          cfg, weighted, ranges, note):  # noqa: N803
    """``grouped_gemm_reduce_launcher`` where the GEMM splits K: the K ranges' sum, alpha, the rounding of each
    slot's row to the model's dtype and the weighted top-k sum in one launch, equal bit for bit to the GEMM
    with its split-K reduce and then ``moe_reduce``; the GEMM's ``y`` is not written."""
    tk = tb.kernels()
    r, operands, config, w, y, want = _gemm2_and_reduce(device, dtype, values, m, topk, e, N, K, cfg, weighted,
                                                        ranges)
    y.fill_(float("nan"))
    gemm, reduce = tk.grouped_gemm_reduce_launcher(*operands, y, r.flat_to_slot, weighted, m, config)
    got = torch.full((m, N), float("nan"), dtype=dtype, device=device)
    gemm()
    reduce(w, got)
    record("gemm_topk_reduce", mismatched_elements=int((got.view(torch.int16) != want.view(torch.int16)).sum()))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert bool(y.isnan().all())  # the slots' rows were never written


# (m, topk, e, N, K, config or None, router weights, K ranges, note): the second GEMM with the top-k reduce in
# its own launch (FUSE_TOPK_IN_GEMM), split or not: the split cases above, and unsplit ones.
GEMM_TOPK_IN_GEMM_CASES = GEMM_REDUCE_CASES + [
    (1, 8, 128, 64, 256, (16, 64, 256, True, 4, 3, 1), True, 1, "decode, unsplit (Qwen3 M = 1's second GEMM)"),
    (6, 3, 7, 80, 192, (16, 32, 64, True, 4, 2, 1), False, 1, "-1 ids, experts without rows, N % BN != 0, plain"),
    (40, 2, 3, 48, 128, (32, 16, 64, False, 4, 2, 1), True, 1, "several row tiles per expert and token blocks"),
]


def _twice_equal(launch, out: torch.Tensor, want: torch.Tensor, monkeypatch, *poison: torch.Tensor) -> list[str]:
    """Launches ``launch()`` twice, ``out`` and ``poison`` NaN-filled before each (the second launch finds the
    counters the first left), checks ``out`` against ``want`` bit for bit after each; returns the kernels
    launched."""
    from moe_fp4.triton_kernels import _common

    names: list[str] = []
    call = _common.Launch.__call__
    monkeypatch.setattr(_common.Launch, "__call__",
                        lambda self, *free: (names.append(self._kernel.__name__), call(self, *free))[1])
    for _ in range(2):
        for t in (out, *poison):
            t.fill_(float("nan"))
        launch()
        bad = int((out.view(torch.int16) != want.view(torch.int16)).sum())
        record("gemm_in_launch", mismatched_elements=bad)
        assert bad == 0
    monkeypatch.undo()
    return names


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("values", [False, True], ids=["codes", "values"])
@pytest.mark.parametrize("m,topk,e,N,K,cfg,weighted,ranges,note", GEMM_TOPK_IN_GEMM_CASES,
                         ids=[c[-1] for c in GEMM_TOPK_IN_GEMM_CASES])
def test_gemm2_with_the_topk_reduce_in_its_launch_writes_what_the_launches_write(device, dtype, values, m, topk, e, N,
                                                                                  K, cfg, weighted, ranges, note,
                                                                                  monkeypatch):  # noqa: N803
    """``grouped_gemm_reduce_launcher(in_gemm=True)``: one launch, the GEMM's, whose last K range of a tile adds
    the ranges and whose last row tile of a column tile takes the top-k reduce of those columns, equal bit for
    bit to the GEMM (with its split-K reduce) and then ``moe_reduce``, with ``y``'s served rows as the GEMM
    writes them; twice in a row (the counters are back to zero after a launch)."""
    tk = tb.kernels()
    r, operands, config, w, y_want, want = _gemm2_and_reduce(device, dtype, values, m, topk, e, N, K, cfg, weighted,
                                                             ranges)
    y = torch.full_like(y_want, float("nan"))
    gemm, reduce = tk.grouped_gemm_reduce_launcher(*operands, y, r.flat_to_slot, weighted, m, config, in_gemm=True)
    out = torch.empty_like(want)
    names = _twice_equal(lambda: (gemm(), reduce(w, out)), out, want, monkeypatch, y)
    assert names == ["grouped_gemm_kernel"] * 2, names
    served = r.flat_to_slot[r.flat_to_slot >= 0].long()
    assert torch.equal(y[served].view(torch.int16), y_want[served].view(torch.int16))


@pytest.fixture
def four_sms(monkeypatch):
    """The SM count pinned to the interpreter's 4: the split of an auto config depends on it, and the split tests'
    "auto-split" cases want the long-K rule's 2 ranges, not the occupancy rule's 4 (a GPU's 132 SMs)."""
    from moe_fp4.triton_kernels import gemm as tg

    monkeypatch.setattr(tg, "_sm_count", lambda device: 4)


@pytest.mark.parametrize("values", [False, True], ids=["codes", "values"])
@pytest.mark.parametrize("m,topk,e,N,K,sections,cfg,ranges", [
    (1, 8, 128, 64, 256, 2, (16, 32, 64, True, 4, 2, 4), 4),
    (5, 3, 7, 96, 1280, 2, (16, 16, 64, True, 4, 2, 0), 2),  # split_k_for's long-K rule (20 steps)
    (9, 2, 3, 80, 128, 1, (32, 16, 64, False, 4, 2, 2), 2),
], ids=["decode-4-ranges", "auto-split-gate-up", "no-swap-N-tail"])
def test_a_split_gemm_adds_its_k_ranges_in_its_own_launch(device, values, m, topk, e, N, K, sections, cfg, ranges,
                                                          monkeypatch, four_sms):  # noqa: N803
    """``grouped_gemm_launcher(fixup=True)``: the last K range of each tile adds the ranges (alpha per section),
    no ``split_k_reduce`` launch, the output equal bit for bit to the GEMM with its reduce; twice in a row."""
    if values and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] != 9:
        pytest.skip("the Triton values operand is built for compute capability 9.x")
    tk = tb.kernels()
    r, operands = _stage_operands(tk, m, topk, e, N, K, sections, torch.bfloat16, device, values)
    config = tk.GemmConfig(*cfg)
    assert tk.k_ranges(config, m * topk, e, N, K, device)[0] == ranges
    want = torch.full((m * topk, N), float("nan"), dtype=torch.bfloat16, device=device)
    tk.grouped_gemm_launcher(*operands, want, config)()
    out = torch.empty_like(want)
    names = _twice_equal(tk.grouped_gemm_launcher(*operands, out, config, fixup=True), out, want, monkeypatch)
    assert names == ["grouped_gemm_kernel"] * 2, names


@pytest.mark.parametrize("m,topk,e,N,K,cfg,ranges", [
    (1, 8, 128, 64, 256, (16, 32, 64, True, 4, 2, 4), 4),
    (5, 3, 7, 96, 1280, (16, 32, 64, True, 4, 2, 0), 2),  # split_k_for's long-K rule (20 steps)
    (5, 3, 7, 96, 256, (16, 64, 64, True, 4, 2, 2), 2),  # 48 output columns in tiles of 32: a masked tail
    (9, 2, 3, 96, 256, (32, 64, 64, False, 4, 2, 2), 2),  # not swapped, a masked tail
], ids=["decode-4-ranges", "auto-split", "masked-tail", "no-swap"])
def test_a_split_gemm_takes_the_silu_quantization_in_its_own_launch(device, m, topk, e, N, K, cfg, ranges,
                                                                   monkeypatch, four_sms):  # noqa: N803
    """``grouped_gemm_launcher(fixup=True, silu=...)`` (the values GEMM of gate and up): the last K range of each
    gate/up tile adds the ranges and quantizes SiLU-and-mul, no reduce launch, the fp16 values equal bit for
    bit to the split GEMM whose reduce does that; twice in a row."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] != 9:
        pytest.skip("the Triton values operand is built for compute capability 9.x")
    tk = tb.kernels()
    r, operands = _stage_operands(tk, m, topk, e, N, K, 2, torch.bfloat16, device, True)
    config = tk.GemmConfig(*cfg)
    assert tk.k_ranges(config, m * topk, e, N, K, device)[0] == ranges and tk.silu_fusable(config, True, N, 2)
    silu = (torch.rand(e, generator=torch.Generator().manual_seed(e)).to(device) * 400 + 50, torch.bfloat16)
    want = torch.full((m * topk, N // 2), float("nan"), dtype=torch.float16, device=device)
    tk.grouped_gemm_launcher(*operands, want, config, silu=silu)()
    assert not bool(want[r.flat_to_slot[r.flat_to_slot >= 0].long()].isnan().any())
    out = torch.empty_like(want)
    names = _twice_equal(tk.grouped_gemm_launcher(*operands, out, config, silu=silu, fixup=True), out, want,
                         monkeypatch)
    assert names == ["grouped_gemm_kernel"] * 2, names


# --------------------------------------------------------------------------- bad input


def _small_problem(device):
    gen = torch.Generator().manual_seed(0)
    ids = routed_ids(4, 2, 3, gen).to(device)
    r = stages.routing(ids, 3)
    x = torch.randn(4, 32, generator=gen).bfloat16().to(device)
    gs = torch.full((3,), 100.0, device=device)
    return ids, r, x, gs


def test_stage_validation_errors(device):
    """Bad arguments raise ValueError/TypeError naming the argument, before any kernel runs."""
    ids, r, x, gs = _small_problem(device)
    with pytest.raises(TypeError, match="topk_ids: expected dtype int32, got int64"):
        tb.routing(ids.long(), 3)
    with pytest.raises(ValueError, match="num_experts: expected a positive int, got 0"):
        tb.routing(ids, 0)
    with pytest.raises(ValueError, match="out: expected routing over 3 experts, got 4"):
        tb.routing(ids, 3, out=RoutingData.empty(8, 4, device))
    with pytest.raises(TypeError, match="x: expected dtype"):
        tb.quantize_rows(x.float(), gs, r)
    with pytest.raises(ValueError, match="x: the quantized width must be a multiple of 16, got 24"):
        tb.quantize_rows(x[:, :24].contiguous(), gs, r)
    with pytest.raises(ValueError, match=r"gs: expected shape \[3\]"):
        tb.quantize_rows(x, gs[:2].contiguous(), r)
    with pytest.raises(TypeError, match="routing: expected a RoutingData, got tuple"):
        tb.quantize_rows(x, gs, (r.expert_offsets, r.blockscale_offsets))
    with pytest.raises(ValueError, match="routing: expected a multiple of x.shape"):
        tb.quantize_rows(x[:3].contiguous(), gs, r)
    with pytest.raises(ValueError, match="row_scale: expected None without gather"):
        tb.quantize_rows(torch.zeros(8, 32, dtype=torch.bfloat16, device=device), gs, r, gather=False,
                         row_scale=torch.ones(8, device=device))
    with pytest.raises(ValueError, match=r"row_scale: expected shape \[8\]"):
        tb.quantize_rows(x, gs, r, row_scale=torch.ones(4, device=device))
    short = _poisoned_quantized(8, 32, 3, device)
    with pytest.raises(ValueError, match="scales: expected a multiple of 128 rows"):
        Quantized(short.packed, short.scales[:-1])
    with pytest.raises(ValueError, match="out: expected at least"):
        tb.quantize_rows(x, gs, r, out=Quantized(short.packed, short.scales[:-128]))
    with pytest.raises(ValueError,
                       match=r"h: expected an even row length \(gate half, then up half\), got shape \[8, 33\]"):
        tb.silu_mul_quantize(torch.zeros(8, 33, dtype=torch.bfloat16, device=device), gs, r)
    with pytest.raises(ValueError, match=r"h: expected 8 rows \(the routing's slots\)"):
        tb.silu_mul_quantize(torch.zeros(4, 64, dtype=torch.bfloat16, device=device), gs, r)
    a = stages.quantize_rows(x, gs, r)
    b = torch.zeros((3, 64, 16), dtype=torch.uint8, device=device)
    wt = WeightOperand.build(b, torch.zeros((3, 64, 2), dtype=torch.float8_e4m3fn, device=device),
                             torch.ones(3, 2, device=device))
    with pytest.raises(ValueError, match=r"w.alpha: expected shape \[3, 2\]"):
        WeightOperand(wt.packed, wt.scales, torch.ones(3, device=device))
    with pytest.raises(ValueError, match="w.scales: expected shape"):
        WeightOperand(b[:2].contiguous(), wt.scales, wt.alpha)
    with pytest.raises(ValueError, match="w: expected K = 32"):
        tb.grouped_gemm(a, WeightOperand.build(torch.zeros((3, 64, 32), dtype=torch.uint8, device=device),
                                               torch.zeros((3, 64, 4), dtype=torch.float8_e4m3fn, device=device),
                                               wt.alpha), r, torch.bfloat16)
    with pytest.raises(ValueError,
                       match=r"a: expected at least 512 scale rows \(grouped_scale_rows_bound for 8 rows over 3 exp"):
        tb.grouped_gemm(Quantized(a.packed, a.scales[:128]), wt, r, torch.bfloat16)
    with pytest.raises(TypeError, match="a: expected a Quantized, got tuple"):
        tb.grouped_gemm((a.packed, a.scales), wt, r, torch.bfloat16)
    with pytest.raises(TypeError, match="out_dtype"):
        tb.grouped_gemm(a, wt, r, torch.float32)
    with pytest.raises(TypeError, match="config: expected a GemmConfig"):
        tb.grouped_gemm(a, wt, r, torch.bfloat16, config=(16, 16, 32, True))
    split = tb.kernels().GemmConfig(16, 16, 64, True, split_k=2)
    with pytest.raises(TypeError, match="config: expected a QuantConfig"):
        tb.quantize_rows(x, gs, r, config=split)
    with pytest.raises(ValueError, match="GemmConfig.split_k"):
        tb.kernels().GemmConfig(16, 16, 64, True, split_k=3)
    with pytest.raises(ValueError, match="GemmConfig.dequant"):
        tb.kernels().GemmConfig(16, 16, 64, True, dequant="fp8")
    with pytest.raises(ValueError, match="GemmConfig.block_k"):
        tb.kernels().GemmConfig(16, 16, 32, True)
    with pytest.raises(ValueError, match="QuantConfig.block_k"):
        tb.kernels().QuantConfig(1, 32)
    with pytest.raises(ValueError, match="QuantConfig.whole_blocks: expected a bool, got 1"):
        tb.kernels().QuantConfig(1, 512, 1, 1024, 1)
    with pytest.raises(ValueError, match="QuantConfig.num_warps"):
        tb.kernels().QuantConfig(1, 512, True)
    with pytest.raises(ValueError, match="GemmConfig.block_m"):
        tb.kernels().GemmConfig(8, 16, 32, True)
    y = torch.zeros(8, 32, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="routing: expected num_tokens \\* topk slots"):
        tb.moe_reduce(y, r, None, 3, torch.bfloat16)
    with pytest.raises(ValueError, match=r"topk_weights: expected shape \[4, 2\]"):
        tb.moe_reduce(y, r, torch.ones(4, 3, device=device), 4, torch.bfloat16)
    with pytest.raises(ValueError, match=r"y: expected at least 8 rows"):
        tb.moe_reduce(y[:7].contiguous(), r, None, 4, torch.bfloat16)


# --------------------------------------------------------------------------- model sizes (GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64, 1024, 4096])
def test_stages_at_model_size_gpu(device, m):
    """Qwen3-30B-A3B shapes (E=128, top-8, H=2048, I=768): each stage against the reference on the GPU."""
    E, topk, H, I = 128, 8, 2048, 768
    gen = torch.Generator().manual_seed(m)
    ids = routed_ids(m, topk, E, gen).to(device)
    r = tb.routing(ids, E)
    assert_same_buffers(r, stages.routing(ids, E), "routing")
    x = (torch.randn(m, H, generator=gen) / 3).bfloat16().to(device)
    gs = torch.full((E,), 2688.0 / 2.0, device=device)
    w = torch.rand(m * topk, generator=gen).to(device)
    a = tb.quantize_rows(x, gs, r, row_scale=w)
    assert_same_quantized("quantize_rows", a, stages.quantize_rows(x, gs, r, row_scale=w))
    cuda_gen = torch.Generator(device=device).manual_seed(m)
    w13 = torch.randn(E, 2 * I, H, generator=cuda_gen, device=device, dtype=torch.bfloat16) / 15
    w2 = torch.randn(E, H, I, generator=cuda_gen, device=device, dtype=torch.bfloat16) / 15
    ex = NvFp4Experts.quantize(w13, w2, a13_gs=gs, a2_gs=2688.0 / 0.5)
    w13_op, _ = tb.STAGES.weights(ex)
    h = tb.grouped_gemm(a, w13_op, r, torch.bfloat16)
    h_ref = stages.grouped_gemm(a, w13_op, r, torch.bfloat16)
    bound = gemm_error_bound(a, w13_op, r, h_ref, h)
    ratio = float(((h.float() - h_ref.float()).abs() / bound).max())
    record("grouped_gemm", error_over_bound=ratio)
    assert ratio <= 1.0
    steered = _gate_up_away_from_ties(m * topk, I, torch.bfloat16, gen).to(device)
    got = tb.silu_mul_quantize(steered, ex.a2_gs, r)
    assert_same_quantized("silu_mul_quantize", got, stages.silu_mul_quantize(steered, ex.a2_gs, r))
    # Informational: on the GEMM's own output, without steering away from silu's 16-bit ties,
    # bytes can only differ where libdevice's expf and torch's CUDA exp differ in the last bit.
    q2 = tb.silu_mul_quantize(h_ref, ex.a2_gs, r)
    q2_ref = stages.silu_mul_quantize(h_ref, ex.a2_gs, r)
    record("silu_mul_quantize_unsteered", mismatched_bytes=int((q2.packed != q2_ref.packed).sum())
           + int((q2.scales.view(torch.uint8) != q2_ref.scales.view(torch.uint8)).sum()))
    y = (torch.randn(m * topk, H, generator=gen)).bfloat16().to(device)
    out = tb.moe_reduce(y, r, w.reshape(m, topk), m, torch.bfloat16)
    assert torch.equal(out, stages.moe_reduce(y, r, w.reshape(m, topk), m, torch.bfloat16))
