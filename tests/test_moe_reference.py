"""The reference backend against an independent per-token implementation, plus fused_moe's contract."""

from __future__ import annotations

import numpy as np
import nvfp4_oracle as oracle
import pytest
import torch
from moe_cases import EDGE_CASES, Case, make_experts, make_inputs, served_slots

from moe_fp4 import NvFp4Experts, fused_moe, stages
from moe_fp4.buffers import RoutingData
from moe_fp4.moe import MoEProblem
from moe_fp4.pipeline import run_pipeline

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)


def _decode_np(packed: np.ndarray, scale_bytes: np.ndarray) -> np.ndarray:
    """e2m1 * scale in float64, from raw bytes (independent of moe_fp4.format)."""
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    scales = np.vectorize(oracle.e4m3_decode)(scale_bytes.astype(np.int64))
    return E2M1[codes] * np.repeat(scales, 16, axis=-1)


def per_token_moe(x, ex: NvFp4Experts, w, ids, on_input: bool, precision: str = "w4a4") -> torch.Tensor:
    """fused_moe's docstring pseudocode, one (token, slot) at a time, in numpy float64/float32.

    Matrix-vector sums are done in float64: every term has at most 12 (W4A4: (e2m1*sf_a) *
    (e2m1*sf_b)) or 17 (W4A16: a 16-bit value times e2m1*sf) significant bits and the test
    data keep all terms within a few dozen binades, so the float64 sums are exact and rounding
    them to float32 gives the ideal fp32 accumulation, independent of summation order. Hence
    the comparisons can be exact. W4A16 feeds the 16-bit rows unquantized and its alphas are
    the weights' global scales only.
    """
    f32 = np.float32
    dtype = x.dtype
    I = ex.intermediate_size
    w13 = _decode_np(ex.w13.numpy(), ex.w13_scale.view(torch.uint8).numpy())
    w2 = _decode_np(ex.w2.numpy(), ex.w2_scale.view(torch.uint8).numpy())
    gs13 = ex.w13_gs.numpy().reshape(ex.num_experts, -1)  # [E, 1] shared or [E, 2] (gate, up)
    w4a4 = precision == "w4a4"

    def operand(v: torch.Tensor, gs: torch.Tensor) -> np.ndarray:
        if not w4a4:
            return v.double().numpy()
        q, sc = oracle.quantize(v.float().numpy()[None], float(gs))
        return _decode_np(q, sc)[0]

    out = np.zeros((x.shape[0], ex.hidden_size), dtype=f32)
    for t, j, e, row in served_slots(x, w, ids, on_input):
        acc1 = (w13[e] @ operand(row, ex.a13_gs[e])).astype(f32)
        a13 = f32(ex.a13_gs[e]) if w4a4 else f32(1)
        alpha = np.concatenate(
            [np.full(I, f32(1) / (a13 * f32(gs13[e, 0]))), np.full(I, f32(1) / (a13 * f32(gs13[e, -1])))]
        ).astype(f32)
        h = torch.from_numpy(acc1 * alpha).to(dtype)
        g = h[:I].float()
        act = ((g / (1 + torch.exp(-g))).to(dtype).float() * h[I:].float()).to(dtype)
        acc2 = (w2[e] @ operand(act, ex.a2_gs[e])).astype(f32)
        alpha2 = f32(1) / ((f32(ex.a2_gs[e]) if w4a4 else f32(1)) * f32(ex.w2_gs[e]))
        y = torch.from_numpy(acc2 * alpha2).to(dtype).float().numpy()
        out[t] += y if on_input else f32(w[t, j]) * y
    return torch.from_numpy(out).to(dtype)


@pytest.mark.parametrize("case", EDGE_CASES, ids=str)
def test_reference_equals_per_token_oracle(case: Case):
    gen = torch.Generator().manual_seed(case.seed)
    ex = make_experts(case, gen)
    x, w, ids = make_inputs(case, gen)
    got = fused_moe(x, ex, w, ids, backend="reference", apply_router_weight_on_input=case.on_input)
    want = per_token_moe(x, ex, w, ids, case.on_input)
    assert got.dtype == case.dtype and got.shape == (case.m, case.h)
    # Exact: both sides follow the same roundings and sum exactly (see per_token_moe).
    assert torch.equal(got, want), float((got.float() - want.float()).abs().max())
    # The stage-by-stage composition (the contract the kernels implement) agrees exactly too.
    staged = run_pipeline(stages.STAGES, MoEProblem(x, ex, w, ids, case.on_input, None))
    assert torch.equal(got, staged)


def test_reference_is_close_to_unquantized_moe():
    # Sanity of the whole chain: against a float64 MoE on the dequantized weights with
    # unquantized activations, W4A4 with calibrated activation scales adds the NVFP4
    # quantization error of the two activations in series (~10% relative each on Gaussian
    # data; this seed measures 16%): expect 3-25%. An inverted weight global scale gives
    # ~750% here, a nibble swap ~140%.
    case = Case(32, 8, 2, 128, 64)
    gen = torch.Generator().manual_seed(5)
    x, w, ids = make_inputs(case, gen)
    w13 = (torch.randn(8, 128, 128, generator=gen) / 15).bfloat16()
    w2 = (torch.randn(8, 128, 64, generator=gen) / 15).bfloat16()
    h = torch.einsum("mk,enk->men", x.double(), w13.double())
    inter = torch.nn.functional.silu(h[..., :64]) * h[..., 64:]
    a13 = torch.full((8,), 2688.0 / float(x.abs().max()))
    a2 = torch.full((8,), 2688.0 / float(inter.abs().max()))
    ex = NvFp4Experts.quantize(w13, w2, a13_gs=a13, a2_gs=a2)
    got = fused_moe(x, ex, w, ids, backend="reference").double()
    d13, d2 = (t.double() for t in ex.dequantize())
    ref = torch.zeros_like(got)
    for t in range(case.m):
        for j in range(case.topk):
            e = int(ids[t, j])
            hh = d13[e] @ x[t].double()
            ref[t] += w[t, j].double() * (d2[e] @ (torch.nn.functional.silu(hh[:64]) * hh[64:]))
    rel = float((got - ref).norm() / ref.norm())
    assert 0.03 < rel < 0.25, rel


def test_expert_map_translates_global_ids():
    case = Case(6, 4, 2, 64, 32)
    gen = torch.Generator().manual_seed(11)
    ex = make_experts(case, gen)
    x = (torch.randn(6, 64, generator=gen) / 3).bfloat16()
    w = torch.rand(6, 2, generator=gen)
    gids = torch.tensor([[0, 7], [3, 9], [8, 1], [2, 5], [6, 4], [9, 0]], dtype=torch.int64)
    emap = torch.tensor([-1, -1, 0, -1, 1, -1, 2, -1, 3, -1])  # global 2,4,6,8 live here
    got = fused_moe(x, ex, w, gids, expert_map=emap, backend="reference")
    local = torch.where(emap[gids] >= 0, emap[gids], -1).int()
    want = fused_moe(x, ex, w, local, backend="reference")
    assert torch.equal(got, want)
    assert got[0].abs().sum() == 0  # token 0 routes to 0 and 7: neither is local


def test_zero_tokens_and_out_argument():
    case = Case(1, 4, 2, 64, 32)
    ex = make_experts(case, torch.Generator().manual_seed(0))
    empty = fused_moe(torch.zeros(0, 64, dtype=torch.bfloat16), ex, torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.int32))
    assert empty.shape == (0, 64) and empty.dtype == torch.bfloat16
    x, w, ids = make_inputs(Case(3, 4, 2, 64, 32), torch.Generator().manual_seed(1))
    out = torch.full((3, 64), float("nan"), dtype=torch.bfloat16)
    res = fused_moe(x, ex, w, ids, out=out)
    assert res.data_ptr() == out.data_ptr() and not torch.isnan(out).any()
    assert torch.equal(out, fused_moe(x, ex, w, ids))


def test_all_minus_one_rows_are_zero():
    case = Case(4, 4, 2, 64, 32)
    gen = torch.Generator().manual_seed(2)
    ex = make_experts(case, gen)
    x, w, ids = make_inputs(case, gen)
    ids[1] = -1
    out = fused_moe(x, ex, w, ids)
    assert out[1].abs().sum() == 0 and out[0].abs().sum() > 0


# --------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def setup():
    case = Case(4, 4, 2, 64, 32)
    gen = torch.Generator().manual_seed(3)
    ex = make_experts(case, gen)
    x, w, ids = make_inputs(case, gen)
    return ex, x, w, ids


BAD_CALLS = [
    # (description, mutate(ex, x, w, ids) -> kwargs, exception, message pattern)
    ("hidden dtype", lambda ex, x, w, ids: dict(hidden_states=x.float()), TypeError,
     "hidden_states: expected dtype one of bfloat16, float16, got float32"),
    ("hidden rank", lambda ex, x, w, ids: dict(hidden_states=x[None]), ValueError, "hidden_states: expected a 2-D"),
    ("hidden size", lambda ex, x, w, ids: dict(hidden_states=x[:, :32].contiguous()), ValueError,
     r"hidden_states: expected shape \[M, 64\]"),
    ("non-contiguous", lambda ex, x, w, ids: dict(hidden_states=torch.cat([x, x], 1)[:, ::2]), ValueError,
     "hidden_states: expected a contiguous tensor"),
    ("hidden device", lambda ex, x, w, ids: dict(hidden_states=x.to("meta")), ValueError,
     "hidden_states: expected a tensor on cpu, got one on meta"),
    ("ids dtype", lambda ex, x, w, ids: dict(topk_ids=ids.float()), TypeError, "topk_ids: expected dtype one of int32, int64"),
    ("ids rows", lambda ex, x, w, ids: dict(topk_ids=ids[:3]), ValueError, r"topk_ids: expected shape \[4, topk\]"),
    ("weights shape", lambda ex, x, w, ids: dict(topk_weights=w[:, :1]), ValueError, r"topk_weights: expected shape \[4, 2\]"),
    ("weights dtype", lambda ex, x, w, ids: dict(topk_weights=w.double()), TypeError, "topk_weights: expected dtype"),
    ("id too large", lambda ex, x, w, ids: dict(topk_ids=torch.full_like(ids, 4)), ValueError,
     r"topk_ids: expected expert ids in \[-1, 4\).*got values in \[4, 4\]"),
    ("id below -1", lambda ex, x, w, ids: dict(topk_ids=torch.full_like(ids, -2)), ValueError, r"topk_ids: expected expert ids in \[-1, 4\)"),
    ("id far too large", lambda ex, x, w, ids: dict(topk_ids=torch.full_like(ids, 2**40, dtype=torch.int64)),
     ValueError, r"topk_ids: expected expert ids in \[-1, 4\).*got values in \[1099511627776, 1099511627776\]"),
    ("nan 16-bit weight", lambda ex, x, w, ids: dict(topk_weights=torch.full_like(w, float("nan")).bfloat16()),
     ValueError, "topk_weights: expected finite values"),
    ("nan hidden", lambda ex, x, w, ids: dict(hidden_states=torch.full_like(x, float("nan"))), ValueError,
     "hidden_states: expected finite values"),
    ("inf weight", lambda ex, x, w, ids: dict(topk_weights=torch.full_like(w, float("inf"))), ValueError,
     "topk_weights: expected finite values"),
    ("topk > E", lambda ex, x, w, ids: dict(topk_ids=torch.zeros(4, 5, dtype=torch.int32), topk_weights=torch.ones(4, 5)),
     ValueError, r"topk_ids: expected topk <= the number of experts \(4\), got topk = 5"),
    ("experts type", lambda ex, x, w, ids: dict(experts="w13"), TypeError, "experts: expected an NvFp4Experts, got str"),
    ("out shape", lambda ex, x, w, ids: dict(out=torch.empty(4, 32, dtype=torch.bfloat16)), ValueError, r"out: expected shape \[4, 64\]"),
    ("out dtype", lambda ex, x, w, ids: dict(out=torch.empty(4, 64, dtype=torch.float16)), TypeError, "out: expected dtype bfloat16"),
    ("backend name", lambda ex, x, w, ids: dict(backend="cuda"), ValueError, r"backend: expected one of \['auto', 'cutlass'"),
    ("backend type", lambda ex, x, w, ids: dict(backend=3), TypeError, "backend: expected a str"),
    ("flag type", lambda ex, x, w, ids: dict(apply_router_weight_on_input=1), TypeError, "apply_router_weight_on_input: expected a bool"),
    ("expert_map range", lambda ex, x, w, ids: dict(expert_map=torch.tensor([0, 1, 2, 7])), ValueError,
     r"expert_map: expected local expert ids in \[-1, 4\)"),
    ("expert_map rank", lambda ex, x, w, ids: dict(expert_map=torch.zeros(2, 2, dtype=torch.int32)), ValueError, "expert_map: expected a 1-D"),
]


@pytest.mark.parametrize("what,mutate,exc,pattern", BAD_CALLS, ids=[b[0] for b in BAD_CALLS])
def test_fused_moe_rejects_bad_input(setup, what, mutate, exc, pattern):
    ex, x, w, ids = setup
    kwargs = dict(hidden_states=x, experts=ex, topk_weights=w, topk_ids=ids)
    kwargs.update(mutate(ex, x, w, ids))
    with pytest.raises(exc, match=pattern):
        fused_moe(**kwargs)


def test_too_many_slots_are_refused_before_any_work(setup, monkeypatch):
    """The int32 bound on slots and grouped scale rows (2^31 - 1), lowered here so that a 4-token call
    crosses it: the call raises before routing (the GPU test in test_huge_m.py makes the real 2^31)."""
    from moe_fp4 import moe

    ex, x, w, ids = setup
    monkeypatch.setattr(moe, "_MAX_ROWS", 127)  # 4 tokens x 2 slots over 4 experts need 8 + 127*4 -> 640 rows
    monkeypatch.setattr(moe._op, "fused_moe", lambda *a, **k: pytest.fail("reached the backend"))
    with pytest.raises(ValueError, match=r"topk_ids: 4 tokens x 2 slots = 8 slots over 4 experts exceed the int32"):
        fused_moe(x, ex, w, ids)


def test_validate_false_treats_out_of_range_ids_as_not_served(setup):
    ex, x, w, ids = setup
    bad = ids.clone()
    bad[0] = 99
    bad[1, 0] = -7
    got = fused_moe(x, ex, w, bad, validate=False)
    masked = torch.where((bad >= 0) & (bad < 4), bad, -1)
    assert torch.equal(got, fused_moe(x, ex, w, masked))


def test_validation_passes_huge_finite_inputs(setup):
    # The fused check sums x in float64 and multiplies by the weights in float32: finite inputs
    # whose products overflow only send it to the exact per-argument checks, which pass them.
    ex, x, w, ids = setup
    huge_x = torch.full_like(x, 1e38)
    huge_w = torch.full_like(w, 1e30)
    fused_moe(huge_x, ex, huge_w, ids, backend="reference")
    fused_moe(x, ex, huge_w, ids, backend="reference", expert_map=torch.arange(4))


def test_stage_arguments_on_two_devices_name_the_argument():
    """A stage's tensors and buffers must share one device; the error names the first that does not."""
    ids = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32)
    r = stages.routing(ids, 3)
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    gs = torch.ones(3)
    with pytest.raises(ValueError, match=r"gs: expected a tensor on cpu \(the device of x\), got one on meta"):
        stages.quantize_rows(x, gs.to("meta"), r)
    meta_routing = RoutingData(*(t.to("meta") for t in (r.expert_offsets, r.blockscale_offsets, r.slot_to_flat,
                                                         r.flat_to_slot)))
    with pytest.raises(ValueError, match=r"routing: expected a tensor on cpu \(the device of x\), got one on meta"):
        stages.quantize_rows(x, gs, meta_routing)
