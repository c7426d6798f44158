"""``precision="w4a16"`` on the Triton backend (``STAGES_VALUES_W4A16``, issue #11 item 2).

The rows are not quantized: the row stages write them (and the SiLU-and-mul product) in the model's dtype,
and the values GEMM multiplies them with the K16 weights, bf16 rows with the weight tiles converted to bf16
(exact: ``e2m1 * e4m3`` has at most 6 significant bits). Checked here against the reference W4A16
(``stages.STAGES_W4A16``, ``reference.exact_moe(precision="w4a16")``): the GEMM within the fp32
summation bound, the whole forward within the W4A16 tolerance below, the plans' fusions bit for bit,
the shared weight layout and the refusals. In the CPU interpreter (whose bf16 dot is not a dot: the
kernel takes float32 operands there, ``_mma``) and, marked ``gpu``, on the H200.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from moe_cases import GRID, GRID_IDS, Case, grid_case, make_experts, make_inputs
from test_triton_stages import gemm_operands
from test_triton_values import VALUES_CASES, VALUES_GEMM_CASES

import moe_fp4.backends.triton as tb
from moe_fp4 import fused_moe, stages
from moe_fp4.buffers import K16Weights, Quantized, WeightOperand
from moe_fp4.moe import MoEProblem
from moe_fp4.pipeline import cached_workspace
from moe_fp4.testing import errors, poison, routed_ids

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]

# The whole W4A16 forward against the reference: both multiply the same 16-bit rows with the same
# e2m1 * scale weights, and only the fp32 summation order of the two GEMMs differs. That moves a 16-bit
# GEMM output by at most about one ulp (2^-8 relative in bf16), which the SiLU-and-mul and the second GEMM
# carry on with the same relative size, and the output's own rounding adds another: the norm-relative
# error stays near 2^-8 (4e-3). There is no re-quantization, so none of W4A4's E2M1 boundary crossings
# (tests/test_triton_moe.py allows 0.1 of the largest output for those): here a few ulps of the largest
# output, 2^-6.
RMS_TOL = 1e-2
MAX_TOL = 2.0**-6


def w4a16_gemm_bound(a: Quantized, w: WeightOperand, r, ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |got - ref| for the W4A16 GEMM: ``gamma_K * sum_k |a_k w_k|`` for any float32
    summation order (``u = 2^-22``, four times the unit roundoff, also covering tensor cores that truncate
    aligned addends; the products of a 16-bit row value (at most 11 significant bits) and ``e2m1 * e4m3``
    (at most 6) are exact), alpha's float32 product (``2u`` relative), and the 16-bit rounding of both
    sides (one ulp of the larger). ``sum |a w|`` is the reference GEMM of ``|a|`` and ``|w|`` (sign bits
    cleared), rounded to the rows' dtype (hence the ``1 + 2^-7``)."""
    u = 2.0**-22
    K = a.values.shape[1]
    gamma = K * u / (1 - K * u)
    terms = stages.STAGES_W4A16.grouped_gemm(dataclasses.replace(a, values=a.values.abs()),
                                             WeightOperand(w.packed & 0x77, w.scales, w.alpha.abs()), r,
                                             a.values.dtype)[: ref.shape[0]].float() * (1 + 2.0**-7)
    big = torch.maximum(ref.float().abs(), got.float().abs()).to(ref.dtype)
    ulp = torch.nextafter(big, torch.full_like(big, float("inf"))).float() - big.float()
    return gamma * terms + 2 * u * ref.float().abs() + ulp


def w4a16_operands(m, topk, e, N, K, sections, dtype, device, seed):  # noqa: N803
    """``(routing, rows, weights, k16 weights)``: the routed rows of ``m`` random tokens, unquantized
    (``STAGES_W4A16.quantize_rows``: zero past ``expert_offsets[E]``), and random NVFP4 weights."""
    r, _, wt = gemm_operands(m, topk, e, N, K, sections, dtype, device, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = (torch.randn(m, K, generator=gen) * 3).to(dtype).to(device)
    a = stages.STAGES_W4A16.quantize_rows(x, torch.ones(e, device=device), r)
    return r, a, wt, K16Weights(tb.kernels().k16_codes(wt.packed), wt.scales, wt.alpha)


# The values GEMM's cases (tests/test_triton_values.py) but its dense chunking and several row tiles per expert:
# swap, K % BK != 0 and gate/up sections; BK > K and N % BN != 0; split-K; the float32 decode; the table's config;
# the dense GEMM, plain and swapped.
W4A16_GEMM_CASES = [c for c in VALUES_GEMM_CASES if not c[-1].startswith(("dense: chunks", "several row tiles",
                                                                          "dense, float32"))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m,topk,e,N,K,sections,cfg,note", W4A16_GEMM_CASES, ids=[c[-1] for c in W4A16_GEMM_CASES])
def test_values_gemm_on_16bit_rows_within_bound(device, dtype, m, topk, e, N, K, sections, cfg, note):
    """The values GEMM on unquantized rows of the model's dtype (bf16: the weight tiles converted to bf16)
    against the reference W4A16 GEMM stage (float64 sums rounded to float32), within the summation bound;
    rows past expert_offsets[E] untouched."""
    r, a, wt, k16 = w4a16_operands(m, topk, e, N, K, sections, dtype, device, seed=N * K + m + 7)
    out = torch.full((r.num_slots, N), float("nan"), dtype=dtype, device=device)
    config = tb.kernels().GemmConfig(*cfg) if cfg else None
    got = tb.STAGES_VALUES_W4A16.grouped_gemm(a, k16, r, dtype, out=out, config=config)
    ref = stages.STAGES_W4A16.grouped_gemm(a, wt, r, dtype)
    valid = int(r.expert_offsets[-1])
    bound = w4a16_gemm_bound(a, wt, r, ref[:valid], got[:valid])
    err = (got[:valid].float() - ref[:valid].float()).abs()
    assert got is out and not bool(got[:valid].isnan().any())
    assert bool((err <= bound).all()), float((err / bound).max())
    assert bool(got[valid:].isnan().all())


PORTABLE = [cfg for _, cfg in tb.kernels().GEMM_VALUES_PORTABLE_CONFIGS]
PORTABLE += [dataclasses.replace(PORTABLE[0], split_k=2)]  # the decode tile as a plan splits it (split_k=0: auto)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cfg", PORTABLE, ids=[f"{c.block_m}x{c.block_n}x{c.block_k}/{c.split_k}" for c in PORTABLE])
def test_values_gemm_portable_tiles_within_bound(device, dtype, cfg):
    """The values GEMM's tiles off Hopper (``GEMM_VALUES_PORTABLE_CONFIGS``, W4A16 on 8.x, 10.x, 12.x), each
    pinned, on unquantized rows against the reference W4A16 GEMM stage within the summation bound (gate/up
    sections, a K that is not a multiple of the 256-wide step, N not a multiple of the 128-wide tile)."""
    r, a, wt, k16 = w4a16_operands(9, 2, 3, 2 * 96, 320, 2, dtype, device, seed=cfg.block_m * cfg.block_k)
    out = torch.full((r.num_slots, 2 * 96), float("nan"), dtype=dtype, device=device)
    got = tb.STAGES_VALUES_W4A16.grouped_gemm(a, k16, r, dtype, out=out, config=cfg)
    ref = stages.STAGES_W4A16.grouped_gemm(a, wt, r, dtype)
    valid = int(r.expert_offsets[-1])
    err = (got[:valid].float() - ref[:valid].float()).abs()
    assert not bool(got[:valid].isnan().any())
    assert bool((err <= w4a16_gemm_bound(a, wt, r, ref[:valid], got[:valid])).all())


def test_the_values_table_off_hopper_is_the_portable_one(monkeypatch):
    """On a GPU other than 9.x the values GEMM takes ``GEMM_VALUES_PORTABLE_CONFIGS`` row by row (no dense GEMM,
    no narrow fallback), each tile within the shared memory of an sm_86/sm_89/sm_120 block by the compile test;
    on 9.x, and without a device, the Hopper table."""
    from moe_fp4.triton_kernels import gemm as tg

    tk = tb.kernels()
    cuda = torch.device("cuda")
    monkeypatch.setattr(tg, "_sm_count", lambda device: 84)
    monkeypatch.setattr(tg, "_major", lambda device: 8)
    assert len(tk.GEMM_VALUES_PORTABLE_CONFIGS) == 4
    for (bound, cfg), per_expert in zip(tk.GEMM_VALUES_PORTABLE_CONFIGS, (1, 20, 50, 4096)):
        assert per_expert <= bound
        assert tk.gemm_config(per_expert * 16, 16, True, 5120, cuda) == cfg
        assert tk.resolve_config(None, per_expert * 16, 16, True, 5120, cuda) == cfg
        assert cfg.dense_mib == 0
    assert tk.gemm_config(4096 * 16, 16, False, 5120, cuda) == tk.GEMM_CONFIGS[-1][1]  # the codes table: its own
    monkeypatch.setattr(tg, "_major", lambda device: 9)
    assert tk.gemm_config(4096 * 16, 16, True, 5120, cuda) == tk.GEMM_VALUES_CONFIGS[-1][1]


def test_bf16_rows_outside_fp16s_range_are_multiplied_as_they_are(device):
    """bf16 rows beyond fp16's range (1e6) and below its normal range (1e-6): fp16 would overflow or lose
    bits, so the GEMM must not take them through fp16; the weight tiles go to bf16 instead. Against the
    reference W4A16 GEMM within the summation bound, as above."""
    r, a, wt, k16 = w4a16_operands(6, 2, 3, 64, 128, 1, torch.bfloat16, device, seed=3)
    scale = torch.tensor([1e6, 1e-6, 1.0], device=device).repeat(a.values.shape[0])[: a.values.shape[0]]
    a = dataclasses.replace(a, values=(a.values.float() * scale[:, None]).bfloat16())
    got = tb.STAGES_VALUES_W4A16.grouped_gemm(a, k16, r, torch.bfloat16)
    ref = stages.STAGES_W4A16.grouped_gemm(a, wt, r, torch.bfloat16)
    valid = int(r.expert_offsets[-1])
    rows = a.values[:valid].float().abs()
    assert bool(rows.max() > 65504) and bool(((rows > 0) & (rows < 2.0**-14)).any())  # (the case is what it says)
    assert bool(got[:valid].isfinite().all())
    bound = w4a16_gemm_bound(a, wt, r, ref[:valid], got[:valid])
    err = (got[:valid].float() - ref[:valid].float()).abs()
    assert bool((err <= bound).all()), float((err / bound).max())


# --------------------------------------------------------------------------- the row stages (RAW)


def _poisoned_values(n, k, dtype, device):
    return torch.full((n, k), float("nan"), dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m,topk,e,k,row_scale", [(5, 3, 4, 192, True), (9, 2, 7, 64, False), (1, 8, 16, 128, False),
                                                  (7, 2, 5, 320, True)])
def test_w4a16_row_stages_write_what_the_torch_stages_write(device, dtype, m, topk, e, k, row_scale):
    """The quantization kernels' RAW form: the routed rows (times the router weight, rounded to the rows' dtype)
    and the SiLU-and-mul product, not quantized, bit for bit what ``stages.w4a16_rows`` and
    ``stages.w4a16_silu_mul`` write, zeros where no row is served (-1 ids, slots past expert_offsets[E]),
    into poisoned buffers; with the table's configuration and a pinned one."""
    tk = tb.kernels()
    gen = torch.Generator().manual_seed(m * k + e)
    ids = routed_ids(m, topk, e, gen, "minus_one").to(device)
    r = stages.routing(ids, e)
    x = (torch.randn(m, k, generator=gen) * 3).to(dtype).to(device)
    weights = torch.rand(m * topk, generator=gen).to(device) if row_scale else None
    gs = torch.ones(e, device=device)  # (unused)
    want = stages.STAGES_W4A16.quantize_rows(x, gs, r, row_scale=weights).values
    h = (torch.randn(r.num_slots, 2 * k, generator=gen) * 4).to(dtype).to(device)
    want_act = stages.STAGES_W4A16.silu_mul_quantize(h, gs, r).values
    for cfg in (None, tk.QuantConfig(4, 64)):
        got = _poisoned_values(r.num_slots, k, dtype, device)
        tk.quantize_rows_values_launcher(m, k, gs, r.expert_offsets, r.slot_to_flat, row_scale, got, cfg, raw=True)(
            x, weights)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        act = _poisoned_values(r.num_slots, k, dtype, device)
        tk.silu_mul_quantize_values_launcher(h, gs, r.expert_offsets, act, cfg, raw=True)()
        if device.type == "cuda":  # the same expf as torch's (libdevice): the same bits
            assert torch.equal(act.view(torch.int16), want_act.view(torch.int16))
        else:
            # The interpreter's exp is numpy's, torch's CPU exp another float32 implementation: they differ
            # by an ulp at times, which moves silu's 16-bit rounding by one ulp there, and the product by at
            # most two (a relative change of 2^-11 to 2^-10). Nothing else may differ.
            ulps = (act.view(torch.int16).int() - want_act.view(torch.int16).int()).abs()
            assert int(ulps.max()) <= 2 and float((ulps > 0).float().mean()) < 0.01, ulps.nonzero()
    assert bool((want[int(r.expert_offsets[-1]):] == 0).all())
    # The fused routing and first row stage (decode) writes the routing's four outputs and the same rows.
    if m * topk <= tk.FUSED_ROUTING_MAX:
        i32 = dict(dtype=torch.int32, device=device)
        n = m * topk
        bufs = [torch.full((e + 1,), -7, **i32), torch.full((e + 1,), -7, **i32), torch.full((n,), -7, **i32),
                torch.full((n,), -7, **i32)]
        rows = _poisoned_values(n, k, dtype, device)
        tk.routing_quantize_values_launcher(m, k, gs, *bufs, row_scale, rows, raw=True)(ids, x, weights)
        for got_t, want_t in zip(bufs, (r.expert_offsets, r.blockscale_offsets, r.slot_to_flat, r.flat_to_slot),
                                 strict=True):
            assert torch.equal(got_t, want_t)
        assert torch.equal(rows.view(torch.int16), want.view(torch.int16))


# The values form's whole-forward cases (multi-token top-2, -1 ids, gate != up global scales, router weights on
# the input, fp16) and topk == E.
W4A16_CASES = [*VALUES_CASES, Case(4, 4, 4, 64, 64, routing="all_experts", note="topk == E")]


@pytest.mark.parametrize("case", W4A16_CASES, ids=str)
def test_fused_moe_w4a16_matches_the_reference(device, case):
    """The whole forward against ``exact_moe(precision="w4a16")`` within the W4A16 tolerance (see
    RMS_TOL), and far from W4A4 (the activations are not quantized: W4A4 differs by ~10%); a second call
    (the shape's plan) equals the first bit for bit; tokens with every id -1 get zeros."""
    gen = torch.Generator().manual_seed(case.seed)
    ex = make_experts(case, gen, device)
    x, w, ids = make_inputs(case, gen, device)
    problem = MoEProblem(x, ex, w, ids, case.on_input, None, "w4a16")
    assert tb.stages_for_problem(problem) is tb.STAGES_VALUES_W4A16
    poison(*cached_workspace(tb.STAGES_VALUES_W4A16, problem).tensors())
    out = torch.full_like(x, float("nan"))
    got = fused_moe(x, ex, w, ids, backend="triton", apply_router_weight_on_input=case.on_input, out=out,
                    precision="w4a16")
    again = fused_moe(x, ex, w, ids, backend="triton", apply_router_weight_on_input=case.on_input, precision="w4a16")
    ref = fused_moe(x, ex, w, ids, backend="reference", apply_router_weight_on_input=case.on_input,
                    precision="w4a16")
    w4a4 = fused_moe(x, ex, w, ids, backend="reference", apply_router_weight_on_input=case.on_input)
    assert got is out and not bool(got.isnan().any())
    assert torch.equal(again, got)
    rms, mx = errors(got, ref)
    assert rms <= RMS_TOL and mx <= MAX_TOL, (rms, mx)
    assert errors(w4a4, ref)[0] > 4 * RMS_TOL  # (the reference W4A4 is another computation)
    if case.routing == "with_minus_one":
        assert bool((got[(ids < 0).all(1)] == 0).all())


@pytest.mark.parametrize("major", [8, 10, 12])
@pytest.mark.parametrize("m,e", [(3, 4), (100, 2)], ids=["decode", "prefill"])
def test_fused_moe_w4a16_on_the_portable_table_matches_the_reference(device, monkeypatch, major, m, e):
    """The whole W4A16 forward with the values GEMM's table off Hopper (``GEMM_VALUES_PORTABLE_CONFIGS``, chosen by
    the capability, here patched: the CPU has none) against ``exact_moe(precision="w4a16")`` within the W4A16
    tolerance: at decode (its 16 x 64 x 128 tile) and past 96 rows per expert (its 128 x 128 x 128 tile)."""
    from moe_fp4.triton_kernels import gemm as tg

    monkeypatch.setattr(tg, "_major", lambda device: major)
    case = Case(m, e, 2, 64, 128, routing="with_minus_one" if m > 3 else "random")
    gen = torch.Generator().manual_seed(m + e + major)
    ex = make_experts(case, gen, device)
    x, w, ids = make_inputs(case, gen, device)
    cfg = tb.kernels().gemm_config(m * 2, e, True, 256, torch.device(device))
    assert cfg == tb.kernels().GEMM_VALUES_PORTABLE_CONFIGS[0 if m == 3 else -1][1]
    got = fused_moe(x, ex, w, ids, backend="triton", precision="w4a16")
    ref = fused_moe(x, ex, w, ids, backend="reference", precision="w4a16")
    rms, mx = errors(got, ref)
    assert rms <= RMS_TOL and mx <= MAX_TOL, (rms, mx)


@pytest.mark.parametrize("fuse_silu", ["split", True])
@pytest.mark.parametrize("m,e,h,i", [(2, 6, 128, 128), (1, 2, 2048, 64)], ids=["unsplit", "split-K"])
def test_w4a16_plan_takes_the_reduces_into_its_gemms_and_nothing_that_quantizes(device, monkeypatch, fuse_silu, m, e,
                                                                                 h, i):
    """With every decode fusion switched on, a W4A16 plan (the calls after a shape's first, which runs the checked
    stage functions) takes the reduces into its GEMMs (the same bits as without) and none of the fusions that
    quantize: its SiLU-and-mul product stays unquantized (the output stays within the tolerance of the reference
    W4A16; a quantized intermediate puts it ~10% off). H = 2048 at M = 1 splits the first GEMM's K (two ranges
    in the interpreter's table), where ``FUSE_SILU = "split"`` would quantize in the GEMM's last K ranges."""
    case = Case(m, e, 2, h, i, routing="with_minus_one" if m > 1 else "random")
    gen = torch.Generator().manual_seed(11)
    ex = make_experts(case, gen, device)
    x, w, ids = make_inputs(case, gen, device)
    plain = [fused_moe(x, ex, w, ids, backend="triton", precision="w4a16") for _ in range(2)]
    assert torch.equal(plain[1], plain[0])
    ref = fused_moe(x, ex, w, ids, backend="reference", precision="w4a16")
    for name, value in (("FUSE_SILU", fuse_silu), ("FUSE_SPLIT_K_IN_GEMM", True), ("FUSE_TOPK_IN_GEMM", True)):
        monkeypatch.setattr(tb, name, value)
    monkeypatch.setattr(tb.kernels(), "FUSED_ROUTING_MAX", 256)
    ex2 = ex.to(device)  # (a copy: a plan per experts object, bound with the switches)
    fused = [fused_moe(x, ex2, w, ids, backend="triton", precision="w4a16") for _ in range(3)]
    for out in fused:
        assert torch.equal(out, plain[0])
    rms, mx = errors(fused[-1], ref)
    assert rms <= RMS_TOL and mx <= MAX_TOL, (rms, mx)


def test_w4a16_weights_share_the_k16_codes_and_take_their_own_alphas(device):
    """The W4A16 weights are the W4A4 values set's K16 codes and scales (one resident copy), with the W4A16
    alphas (``1 / gs_w``: no activation global scale): with H = I = 128 the K16 codes replace the canonical ones in
    place; with I = 192 (swizzled scales padded) they are a copy, one for both precisions."""
    for h, i in ((128, 128), (128, 192)):
        _weights_are_shared(device, Case(3, 4, 2, h, i, split_gate_up=True))


def _weights_are_shared(device, case):
    gen = torch.Generator().manual_seed(5)
    ex = make_experts(case, gen, device)
    w13, w2 = tb.STAGES_VALUES_W4A16.weights(ex)
    v13, v2 = tb.STAGES_VALUES.weights(ex)
    assert w13.packed.data_ptr() == v13.packed.data_ptr() and w2.packed.data_ptr() == v2.packed.data_ptr()
    assert w13.scales.data_ptr() == v13.scales.data_ptr()
    alpha13, alpha2 = ex.alphas("w4a16")
    assert torch.equal(w13.alpha, alpha13) and torch.equal(w2.alpha.reshape(-1), alpha2.reshape(-1))
    assert not torch.equal(v13.alpha, w13.alpha)


def test_w4a16_refusals(device):
    """The codes form pinned, H or I not multiples of 64: each a ValueError naming what was expected."""
    with tb.operand_form("codes"), pytest.raises(ValueError, match="operand_form 'codes' .* is pinned"):
        tb.stages_for(device, "w4a16")
    assert tb.stages_for(device, "w4a16") is tb.STAGES_VALUES_W4A16
    with tb.operand_form("values"):
        assert tb.stages_for(device, "w4a16") is tb.STAGES_VALUES_W4A16
    case = Case(3, 4, 2, 96, 64)
    gen = torch.Generator().manual_seed(2)
    ex = make_experts(case, gen, device)
    x, w, ids = make_inputs(case, gen, device)
    with pytest.raises(ValueError, match=r"multiples of 64, got H = 96, I = 64"):
        fused_moe(x, ex, w, ids, backend="triton", precision="w4a16")
    # The row stages' values hold the rows themselves: of the rows' dtype.
    r = stages.routing(ids, 4)
    wrong = Quantized.empty(r.num_slots, 96, 4, device, values=torch.float16)
    with pytest.raises(ValueError, match="out: expected values of dtype bfloat16 .* got float16"):
        tb.STAGES_VALUES_W4A16.quantize_rows(x, ex.a13_gs, r, out=wrong)
    with pytest.raises(ValueError, match="out: expected values of dtype bfloat16 .* got float16"):
        tb.STAGES_VALUES_W4A16.silu_mul_quantize(torch.zeros(r.num_slots, 192, dtype=torch.bfloat16, device=device),
                                                 ex.a13_gs, r, out=wrong)


def test_auto_takes_the_next_backend_where_triton_cannot_take_the_layer(device, monkeypatch):
    """``backend="auto"`` with W4A16 where the device's order puts ``triton`` first (a 9.x GPU; on this CPU the
    registry's order is patched to say so): a layer it can take runs on it, one whose I is not a multiple of 64
    on the next backend (``reference``), each the same bits as naming that backend, and ``explain_backend``
    says why for that layer; a pinned codes form refuses W4A16; MOE_FP4_BACKEND=triton keeps ``triton``, which then
    raises with the reason."""
    from moe_fp4.backends import registry

    order = registry.preference_order(torch.device(device), registry.capability_of(device))
    monkeypatch.setattr(registry, "preference_order", lambda *a: ["triton", *order])
    registry.clear_resolved_backends()
    try:
        for h, i, want in ((64, 64, "triton"), (64, 96, "reference")):
            case = Case(3, 4, 2, h, i)
            gen = torch.Generator().manual_seed(h + i)
            ex = make_experts(case, gen, device)
            x, w, ids = make_inputs(case, gen, device)
            assert registry.select_backend("auto", device, x.dtype, "w4a16", (h, i)) == want
            auto = fused_moe(x, ex, w, ids, precision="w4a16")
            named = fused_moe(x, ex, w, ids, backend=want, precision="w4a16")
            assert torch.equal(auto, named), (h, i, want)
            if want == "triton":
                # A pinned codes form refuses W4A16 whichever call came first (the resolution, cached per layer,
                # does not depend on the form), and the next unpinned call runs on triton again.
                for _ in range(2):
                    with tb.operand_form("codes"), pytest.raises(ValueError, match="operand_form 'codes'"):
                        fused_moe(x, ex, w, ids, precision="w4a16")
                assert torch.equal(fused_moe(x, ex, w, ids, precision="w4a16"), named)
        text = registry.explain_backend(device, x.dtype, "w4a16", layer=(64, 96))
        assert "triton    unavailable: does not compute precision='w4a16' for this layer" in text, text
        assert "auto -> reference after skipping triton" in text, text
        monkeypatch.setenv("MOE_FP4_BACKEND", "triton")
        with pytest.raises(ValueError, match="multiples of 64, got H = 64, I = 96"):
            fused_moe(x, ex, w, ids, precision="w4a16")
    finally:
        registry.clear_resolved_backends()


# --------------------------------------------------------------------------- on the H200


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,e,nk,m,topk", GRID[::8], ids=GRID_IDS[::8])
def test_w4a16_grid_gpu(dtype, e, nk, m, topk):
    """Every eighth case of the 640-case grid in W4A16 (poisoned workspace and output) against the reference
    W4A16 within its tolerance; a second call (the plan) equals the first bit for bit."""
    ex, x, w, ids = grid_case(dtype, e, nk, m, topk)
    poison(*cached_workspace(tb.STAGES_VALUES_W4A16, MoEProblem(x, ex, w, ids, False, None, "w4a16")).tensors())
    out = torch.full_like(x, float("nan"))
    got = fused_moe(x, ex, w, ids, backend="triton", out=out, precision="w4a16")
    again = fused_moe(x, ex, w, ids, backend="triton", precision="w4a16")
    ref = fused_moe(x, ex, w, ids, backend="reference", precision="w4a16")
    assert got is out and not bool(got.isnan().any())
    assert torch.equal(again, got)
    rms, mx = errors(got, ref)
    assert rms <= RMS_TOL and mx <= MAX_TOL, (rms, mx)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64, 4096])
def test_w4a16_cuda_graph_replays_the_eager_result_gpu(m):
    """Captured once after an eager call, a replay on new inputs equals an eager call on them, bit for bit
    (m = 4096: the table's dense GEMM)."""
    ex, x, w, ids = grid_case(torch.bfloat16, 64, (768, 2048), m, 8)
    x2 = torch.randn_like(x) / 10
    out = torch.empty_like(x)
    fused_moe(x, ex, w, ids, backend="triton", out=out, validate=False, precision="w4a16")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(x, ex, w, ids, backend="triton", out=out, validate=False, precision="w4a16")
    x.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    eager = fused_moe(x2, ex, w, ids, backend="triton", validate=False, precision="w4a16")
    assert torch.equal(out, eager)
