"""Each Triton pipeline stage against its contract in ``moe_fp4.stages`` (the torch reference).

Routing, both quantizations and the reduction must be bit-exact, every byte of every output
buffer included (outputs are poisoned before each call, so an unwritten byte fails); the
GEMM is held to a rigorous floating-point bound. The small cases run in Triton's CPU
interpreter here and compiled on a GPU; ``gpu``-marked cases add model-sized shapes.
"""

from __future__ import annotations

import pytest
import torch

import moe_fp4.backends.triton as tb
from gpu_report import record
from moe_fp4 import NvFp4Experts, stages
from moe_fp4.format import grouped_scale_rows_bound, quantize_nvfp4, swizzle_scales_grouped
from test_triton_numerics import every_code_and_scale

pytestmark = [
    pytest.mark.interpreter,
    # Triton's interpreter turns 1-element arrays into loop bounds (numpy < 2.4 only warns).
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]

ROUTING_FIELDS = ("expert_offsets", "blockscale_offsets", "slot_to_flat", "flat_to_slot")


def routed_ids(m: int, topk: int, e: int, gen: torch.Generator, pattern: str = "random") -> torch.Tensor:
    """int32 ``[m, topk]`` distinct expert ids per token (like a top-k router), with edge patterns."""
    logits = torch.randn(m, e, generator=gen)
    if pattern == "skip":
        logits[:, 0] = -1e9
    elif pattern == "one_expert":
        logits[:, 1] = 1e9
    ids = logits.topk(topk, dim=-1).indices.to(torch.int32)
    if pattern == "minus_one":
        ids[::2, 0] = -1
    elif pattern == "out_of_range":  # only reachable with validate=False: must count as -1
        ids[::3, -1] = e + 7
        ids[1::3, 0] = -9
    return ids


def _sanitized(ids: torch.Tensor, e: int) -> torch.Tensor:
    return torch.where((ids >= 0) & (ids < e), ids, -1)


def _poisoned_routing(n: int, e: int, device) -> stages.RoutingData:
    sizes = (e + 1, e + 1, n, n)
    return stages.RoutingData(*(torch.full((s,), -12345, dtype=torch.int32, device=device) for s in sizes))


def _poisoned_quantized(n: int, k: int, e: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """0xFF everywhere: a NaN scale and -6 codes, so any byte left unwritten differs from the reference."""
    packed = torch.full((n, k // 2), 0xFF, dtype=torch.uint8, device=device)
    rows, cols = grouped_scale_rows_bound(n, e), (k // 16 + 3) // 4 * 4
    scales = torch.full((rows, cols), 0xFF, dtype=torch.uint8, device=device)
    return packed, scales.view(torch.float8_e4m3fn)


def assert_same_quantized(stage: str, got, want) -> None:
    """Packed codes and every scale byte identical (the count of differing bytes goes to the GPU report)."""
    (q, sf), (q_ref, sf_ref) = got, want
    sf, sf_ref = sf.view(torch.uint8), sf_ref.view(torch.uint8)
    record(stage, mismatched_bytes=int((q != q_ref).sum()) + int((sf != sf_ref).sum()))
    assert torch.equal(q, q_ref), (q != q_ref).nonzero()[:8].tolist()
    assert torch.equal(sf, sf_ref), (sf != sf_ref).nonzero()[:8].tolist()


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
    want = stages.routing(_sanitized(ids, e), e)
    mismatched = sum(int((getattr(got, f) != getattr(want, f)).sum()) for f in ROUTING_FIELDS)
    record("routing", mismatched_entries=mismatched)
    for f in ROUTING_FIELDS:
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    # Without out=, fresh buffers are returned.
    fresh = tb.routing(ids, e)
    assert all(torch.equal(getattr(fresh, f), getattr(want, f)) for f in ROUTING_FIELDS)


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
    r = stages.routing(_sanitized(ids, e), e)
    x = _activations(m, k, dtype, gen).to(device)
    gs = (2688.0 / (0.3 + torch.rand(e, generator=gen))).to(device)
    w = torch.rand(m * topk, generator=gen).to(device) if row_scale else None
    out = _poisoned_quantized(m * topk, k, e, device)
    q, sf = tb.quantize_rows(x, gs, r.expert_offsets, r.blockscale_offsets, r.slot_to_flat, topk, w, out=out)
    q_ref, sf_ref = stages.quantize_rows(x, gs, r.expert_offsets, r.blockscale_offsets, r.slot_to_flat, topk, w)
    assert_same_quantized("quantize_rows", (q, sf), (q_ref, sf_ref))


QUANT_PINNED = [
    ((1, 64, 1, 128), "one row, 64 columns, 128-word zeroing blocks"),
    ((4, 128, 2, 256), "four rows"),
    ((16, 256, 4, 1024), "sixteen rows"),
]


@pytest.mark.parametrize("mode", ["gather", "silu"])
@pytest.mark.parametrize("config", [c for c, _ in QUANT_PINNED], ids=[n for _, n in QUANT_PINNED])
def test_quantize_configs_bit_exact(device, config, mode):
    """Pinned launch configurations (those of the GPU table among them) give the same bytes as the reference.

    K = 160 (12 padded scale columns): several column blocks, a partial last one, and
    zeroing blocks that split the 128-row bands; one expert without rows.
    """
    gen = torch.Generator().manual_seed(sum(config))
    m, topk, e, k = 7, 3, 6, 160
    ids = routed_ids(m, topk, e, gen, "skip").to(device)
    r = stages.routing(ids, e)
    offs, bso = r.expert_offsets, r.blockscale_offsets
    gs = (2688.0 / (0.3 + torch.rand(e, generator=gen))).to(device)
    cfg = tb._kernels().QuantConfig(*config)
    out = _poisoned_quantized(m * topk, k, e, device)
    if mode == "gather":
        x = _activations(m, k, torch.bfloat16, gen).to(device)
        w = torch.rand(m * topk, generator=gen).to(device)
        got = tb.quantize_rows(x, gs, offs, bso, r.slot_to_flat, topk, w, out=out, config=cfg)
        want = stages.quantize_rows(x, gs, offs, bso, r.slot_to_flat, topk, w)
    else:
        h = _gate_up_away_from_ties(m * topk, k, torch.bfloat16, gen).to(device)
        got = tb.silu_mul_quantize(h, gs, offs, bso, out=out, config=cfg)
        want = stages.silu_mul_quantize(h, gs, offs, bso)
    assert_same_quantized(f"quantize_{mode}", got, want)


def test_quantize_rows_without_gather(device):
    """Rows already grouped by expert (no slot_to_flat): quantized in place order."""
    gen = torch.Generator().manual_seed(11)
    e, n, k = 3, 10, 64
    offs = torch.tensor([0, 4, 4, 9], dtype=torch.int32, device=device)  # expert 1 empty, row 9 past the end
    bso = torch.tensor([0, 128, 128, 256], dtype=torch.int32, device=device)
    x = _activations(n, k, torch.bfloat16, gen).to(device)
    gs = torch.tensor([900.0, 1.0, 2000.0], device=device)
    got = tb.quantize_rows(x, gs, offs, bso, out=_poisoned_quantized(n, k, e, device))
    assert_same_quantized("quantize_rows", got, stages.quantize_rows(x, gs, offs, bso))


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
    q, sf = tb.silu_mul_quantize(h, gs, r.expert_offsets, r.blockscale_offsets,
                                 out=_poisoned_quantized(m * topk, i, e, device))
    q_ref, sf_ref = stages.silu_mul_quantize(h, gs, r.expert_offsets, r.blockscale_offsets)
    assert_same_quantized("silu_mul_quantize", (q, sf), (q_ref, sf_ref))


# --------------------------------------------------------------------------- grouped GEMM


def gemm_error_bound(a, a_sf, b, b_sf, alpha, r, ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |got - ref| for a float32 accumulation in any order.

    With ``T = sum_k |a_k b_k|`` (exact terms: e2m1*e4m3 products), any float32 summation
    order is within ``gamma_K * T`` of the exact sum, ``gamma_K = K u / (1 - K u)``. We take
    ``u = 2^-22``, four times the round-to-nearest unit, to also cover tensor-core
    accumulators that truncate aligned addends. alpha's float32 product adds ``2u`` relative
    and the final 16-bit roundings of both sides at most one unit in the last place of the
    larger of the two.
    """
    K = a.shape[1] * 2
    u = 2.0**-22
    gamma = K * u / (1 - K * u)
    strip_signs = 0x77  # clear the sign bit of both nibbles: |e2m1| codes
    terms = stages.grouped_gemm(a & strip_signs, a_sf, b & strip_signs, b_sf, alpha.abs(), r.expert_offsets,
                                r.blockscale_offsets, torch.bfloat16)[: ref.shape[0]].float() * (1 + 2.0**-7)
    big = torch.maximum(ref.float().abs(), got.float().abs()).to(ref.dtype)
    ulp = (torch.nextafter(big, torch.full_like(big, float("inf"))).float() - big.float())
    return gamma * terms + 2 * u * ref.float().abs() + ulp


GEMM_CASES = [
    # (m, topk, e, N, K, sections, config or None, note)
    (5, 3, 4, 96, 160, 2, (16, 32, 64, True), "swap; K % BK != 0; gate/up sections of 48"),
    (9, 2, 3, 80, 64, 1, (16, 64, 128, False), "BK > K; N % BN != 0"),
    (40, 2, 3, 48, 48, 2, (32, 16, 64, True), "several row tiles per expert; sections straddle tiles; BK > K"),
    (3, 1, 5, 32, 1024, 1, None, "the table's config; long K"),
]


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m,topk,e,N,K,sections,cfg,note", GEMM_CASES, ids=[c[-1] for c in GEMM_CASES])
def test_grouped_gemm_within_bound(device, out_dtype, m, topk, e, N, K, sections, cfg, note):
    """alpha * (A . B^T) per expert and section: within gemm_error_bound of the exact reference; tail rows untouched."""
    gen = torch.Generator().manual_seed(N * K + m)
    ids = routed_ids(m, topk, e, gen, "minus_one" if m > 3 else "random").to(device)
    r = stages.routing(ids, e)
    x = torch.randn(m, K, generator=gen).to(out_dtype).to(device)
    a, a_sf = stages.quantize_rows(x, torch.full((e,), 500.0, device=device), r.expert_offsets,
                                   r.blockscale_offsets, r.slot_to_flat, topk)
    w = (torch.randn(e, N, K, generator=gen) / 15).to(device)
    ex_gs = torch.rand(e, sections, generator=gen).to(device) * 4000 + 100  # different per expert and section
    q = torch.empty((e, N, K // 2), dtype=torch.uint8, device=device)
    s = torch.empty((e, N, K // 16), dtype=torch.float8_e4m3fn, device=device)
    ns = N // sections
    for h in range(sections):
        rows = slice(h * ns, (h + 1) * ns)
        q[:, rows], s[:, rows] = quantize_nvfp4(w[:, rows], ex_gs[:, h].contiguous())
    b_sf = stages.prepare_weight_scales(s, sections)
    alpha = (1.0 / (500.0 * ex_gs)).contiguous()
    config = tb._kernels().GemmConfig(*cfg) if cfg else None
    out = torch.full((m * topk, N), float("nan"), dtype=out_dtype, device=device)
    offs, bso = r.expert_offsets, r.blockscale_offsets
    got = tb.grouped_gemm(a, a_sf, q, b_sf, alpha, offs, bso, out_dtype, out=out, config=config)
    ref = stages.grouped_gemm(a, a_sf, q, b_sf, alpha, offs, bso, out_dtype)
    valid = int(r.expert_offsets[-1])
    bound = gemm_error_bound(a, a_sf, q, b_sf, alpha, r, ref[:valid], got[:valid])
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
    offs = torch.tensor([0, n], dtype=torch.int32)
    a_sf, bso = swizzle_scales_grouped(a_s.view(torch.float8_e4m3fn), offs)
    b_sf = stages.prepare_weight_scales(b_s.view(torch.float8_e4m3fn)[None], 1)
    args = [t.to(device) for t in (a_q, a_sf, b_q[None].contiguous(), b_sf, torch.ones(1, 1), offs, bso)]
    got = tb.grouped_gemm(*args, torch.bfloat16, config=tb._kernels().GemmConfig(*config))
    want = stages.grouped_gemm(*args, torch.bfloat16)
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
    got = tb.moe_reduce(y, r.flat_to_slot, w, m, dtype, out=out)
    ref = stages.moe_reduce(y, r.flat_to_slot, w, m, dtype)
    record("moe_reduce", mismatched_elements=int((got.view(torch.int16) != ref.view(torch.int16)).sum()))
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))


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
    offs, bso = r.expert_offsets, r.blockscale_offsets
    with pytest.raises(TypeError, match="topk_ids"):
        tb.routing(ids.long(), 3)
    with pytest.raises(ValueError, match="num_experts"):
        tb.routing(ids, 0)
    with pytest.raises(TypeError, match="x: expected dtype"):
        tb.quantize_rows(x.float(), gs, offs, bso)
    with pytest.raises(ValueError, match="x: the quantized width must be a multiple of 16"):
        tb.quantize_rows(x[:, :24].contiguous(), gs, offs, bso)
    with pytest.raises(ValueError, match="gs"):
        tb.quantize_rows(x, gs[:2].contiguous(), offs, bso)
    with pytest.raises(ValueError, match="slot_to_flat"):
        tb.quantize_rows(x, gs, offs, bso, r.slot_to_flat[:5].contiguous(), 2)
    with pytest.raises(ValueError, match="row_scale"):
        tb.quantize_rows(x, gs, offs, bso, row_scale=torch.ones(4, device=device))
    with pytest.raises(ValueError, match="out\\[1\\]"):
        packed, scales = _poisoned_quantized(8, 32, 3, device)
        tb.quantize_rows(x, gs, offs, bso, r.slot_to_flat, 2, out=(packed, scales[:-128]))
    with pytest.raises(ValueError, match=r"h: expected an even row length \(gate half, then up half\), got shape \[8, 33\]"):
        tb.silu_mul_quantize(torch.zeros(8, 33, dtype=torch.bfloat16, device=device), gs, offs, bso)
    a, a_sf = stages.quantize_rows(x, gs, offs, bso, r.slot_to_flat, 2)
    b = torch.zeros((3, 64, 16), dtype=torch.uint8, device=device)
    b_sf = stages.prepare_weight_scales(torch.zeros((3, 64, 2), dtype=torch.float8_e4m3fn, device=device), 2)
    alpha = torch.ones(3, 2, device=device)
    with pytest.raises(ValueError, match="alpha"):
        tb.grouped_gemm(a, a_sf, b, b_sf, torch.ones(3, device=device), offs, bso, torch.bfloat16)
    with pytest.raises(ValueError, match="b: expected shape"):
        tb.grouped_gemm(a, a_sf, b[:, :, :8].contiguous(), b_sf, alpha, offs, bso, torch.bfloat16)
    with pytest.raises(ValueError, match="a_sf"):
        tb.grouped_gemm(a, a_sf[:128], b, b_sf, alpha, offs, bso, torch.bfloat16)
    with pytest.raises(TypeError, match="out_dtype"):
        tb.grouped_gemm(a, a_sf, b, b_sf, alpha, offs, bso, torch.float32)
    with pytest.raises(TypeError, match="config"):
        tb.grouped_gemm(a, a_sf, b, b_sf, alpha, offs, bso, torch.bfloat16, config=(16, 16, 32, True))
    split = tb._kernels().GemmConfig(16, 16, 64, True, split_k=2)
    with pytest.raises(ValueError, match="partials: expected at least"):
        tb.grouped_gemm(a, a_sf, b, b_sf, alpha, offs, bso, torch.bfloat16, config=split,
                        partials=torch.empty(1, device=device))
    with pytest.raises(TypeError, match="partials: expected dtype"):
        tb.grouped_gemm(a, a_sf, b, b_sf, alpha, offs, bso, torch.bfloat16,
                        partials=torch.empty(8, dtype=torch.int32, device=device))
    with pytest.raises(TypeError, match="config: expected a QuantConfig"):
        tb.quantize_rows(x, gs, offs, bso, config=split)
    with pytest.raises(ValueError, match="GemmConfig.split_k"):
        tb._kernels().GemmConfig(16, 16, 64, True, split_k=3)
    with pytest.raises(ValueError, match="GemmConfig.dequant"):
        tb._kernels().GemmConfig(16, 16, 64, True, dequant="fp8")
    with pytest.raises(ValueError, match="GemmConfig.block_k"):
        tb._kernels().GemmConfig(16, 16, 32, True)
    with pytest.raises(ValueError, match="QuantConfig.block_k"):
        tb._kernels().QuantConfig(1, 32)
    with pytest.raises(ValueError, match="GemmConfig.block_m"):
        tb._kernels().GemmConfig(8, 16, 32, True)
    y = torch.zeros(8, 32, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="flat_to_slot"):
        tb.moe_reduce(y, r.flat_to_slot[:7].contiguous(), None, 4, torch.bfloat16)
    with pytest.raises(ValueError, match="topk_weights"):
        tb.moe_reduce(y, r.flat_to_slot, torch.ones(4, 3, device=device), 4, torch.bfloat16)


# --------------------------------------------------------------------------- model sizes (GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64, 1024, 4096])
def test_stages_at_model_size_gpu(device, m):
    """Qwen3-30B-A3B shapes (E=128, top-8, H=2048, I=768): each stage against the reference on the GPU."""
    E, topk, H, I = 128, 8, 2048, 768
    gen = torch.Generator().manual_seed(m)
    ids = routed_ids(m, topk, E, gen).to(device)
    r = tb.routing(ids, E)
    want = stages.routing(ids, E)
    assert all(torch.equal(getattr(r, f), getattr(want, f)) for f in ROUTING_FIELDS)
    x = (torch.randn(m, H, generator=gen) / 3).bfloat16().to(device)
    gs = torch.full((E,), 2688.0 / 2.0, device=device)
    w = torch.rand(m * topk, generator=gen).to(device)
    q, sf = tb.quantize_rows(x, gs, r.expert_offsets, r.blockscale_offsets, r.slot_to_flat, topk, w)
    want = stages.quantize_rows(x, gs, r.expert_offsets, r.blockscale_offsets, r.slot_to_flat, topk, w)
    assert_same_quantized("quantize_rows", (q, sf), want)
    cuda_gen = torch.Generator(device=device).manual_seed(m)
    w13 = torch.randn(E, 2 * I, H, generator=cuda_gen, device=device, dtype=torch.bfloat16) / 15
    w2 = torch.randn(E, H, I, generator=cuda_gen, device=device, dtype=torch.bfloat16) / 15
    ex = NvFp4Experts.quantize(w13, w2, a13_gs=gs, a2_gs=2688.0 / 0.5)
    alpha13, _ = ex.alphas()
    b_sf = stages.prepare_weight_scales(ex.w13_scale, 2)
    h = tb.grouped_gemm(q, sf, ex.w13, b_sf, alpha13, r.expert_offsets, r.blockscale_offsets, torch.bfloat16)
    h_ref = stages.grouped_gemm(q, sf, ex.w13, b_sf, alpha13, r.expert_offsets, r.blockscale_offsets, torch.bfloat16)
    bound = gemm_error_bound(q, sf, ex.w13, b_sf, alpha13, r, h_ref, h)
    ratio = float(((h.float() - h_ref.float()).abs() / bound).max())
    record("grouped_gemm", error_over_bound=ratio)
    assert ratio <= 1.0
    steered = _gate_up_away_from_ties(m * topk, I, torch.bfloat16, gen).to(device)
    got = tb.silu_mul_quantize(steered, ex.a2_gs, r.expert_offsets, r.blockscale_offsets)
    assert_same_quantized("silu_mul_quantize", got, stages.silu_mul_quantize(steered, ex.a2_gs, r.expert_offsets,
                                                                             r.blockscale_offsets))
    # Informational: on the GEMM's own output, without steering away from silu's 16-bit ties,
    # bytes can only differ where libdevice's expf and torch's CUDA exp differ in the last bit.
    q2, sf2 = tb.silu_mul_quantize(h_ref, ex.a2_gs, r.expert_offsets, r.blockscale_offsets)
    q2_ref, sf2_ref = stages.silu_mul_quantize(h_ref, ex.a2_gs, r.expert_offsets, r.blockscale_offsets)
    record("silu_mul_quantize_unsteered", mismatched_bytes=int((q2 != q2_ref).sum())
           + int((sf2.view(torch.uint8) != sf2_ref.view(torch.uint8)).sum()))
    y = (torch.randn(m * topk, H, generator=gen)).bfloat16().to(device)
    out = tb.moe_reduce(y, r.flat_to_slot, w.reshape(m, topk), m, torch.bfloat16)
    assert torch.equal(out, stages.moe_reduce(y, r.flat_to_slot, w.reshape(m, topk), m, torch.bfloat16))
