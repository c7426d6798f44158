"""``precision="w4a4" | "w4a16"``: the W4A16 forward, its dispatch, and W4A4 left as it was.

CPU tests run the reference backend (and, where the CUDA library loads, the CPU side of the
cutlass backend's W4A16 stage set). The GPU tests at the end (marked ``gpu`` and ``sm90``)
check ``backend="cutlass"`` with ``precision="w4a16"`` on Hopper against the reference; they
are skipped without such a GPU.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
import torch._dynamo
from moe_cases import EDGE_CASES, Case, gpu_experts, make_experts, make_inputs, served_slots
from test_moe_reference import per_token_moe
from torch._subclasses import FakeTensorMode

from moe_fp4 import NvFp4Experts, _op, fused_moe, reference, stages
from moe_fp4.backends import registry
from moe_fp4.backends.registry import BACKENDS, PRECISIONS, BackendUnavailableError, explain_backend, select_backend
from moe_fp4.moe import MoEProblem
from moe_fp4.nn import ExpertParallelMoE, FusedMoE, SparseMoeBlock
from moe_fp4.pipeline import cached_workspace, run_pipeline
from moe_fp4.testing import errors, routed_ids

CUDA = torch.device("cuda", 0)
# Triton runs on CPU only in its interpreter, which conftest turns on where there is no GPU; on a GPU machine
# the registry refuses triton on CPU, and these tests expect that there.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _every_backend_runs_here(monkeypatch) -> None:
    """Take every backend as able to run on any device (as on a GPU with the library built, or Triton on CPU
    without the interpreter), so that the precision or the layer alone decides."""
    monkeypatch.setattr(registry, "why_unavailable", lambda name, device=None, dtype=None: None)


DATA_TINY = Path(__file__).parent / "data" / "tiny_qwen3_moe"
OP, OUT_OP = torch.ops.moe_fp4.fused_moe.default, torch.ops.moe_fp4.fused_moe_out.default
BLACKWELL_REASON = "the block-scaled FP4 tensor-core GEMM needs FP4 activations"


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def case_data(case: Case):
    gen = torch.Generator().manual_seed(case.seed)
    ex = make_experts(case, gen)
    return (ex, *make_inputs(case, gen))


def float64_moe(x, ex: NvFp4Experts, w, ids, on_input: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE of the dequantized weights in float64 without intermediate rounding, and an
    elementwise bound on how far W4A16's 16-bit roundings can move an output from it.

    Built from ``experts.dequantize(torch.float64)`` only. With ``u`` the unit roundoff of
    the dtype (bf16 ``2^-9``, fp16 ``2^-11``: half an ulp, "~2^-8 relative" for bf16 in ulps)
    W4A16 rounds ``h`` (gate ``g`` and up ``v``), ``silu(g)``, ``act = silu * v``, ``y`` and
    the output once each. First order, with ``|silu'| <= 1.1`` everywhere:

    * ``|d silu| <= 1.1 |g| u + |silu| u`` (the rounded ``g``, then silu's own rounding);
    * ``|d act| <= (1.1 |g| |v| + 3 |silu| |v|) u`` (that, the rounded ``v``, the product);
    * ``|d y| <= sum_k |d act_k| |W2[n, k]| + |y| u`` (the rounding of ``y``);
    * ``|d out| <= sum_j |w_j| |d y_j| + |out| u`` (weights applied on the output), or
      ``sum_j |d y_j| + |out| u``.

    The fp32 accumulations (exact float64 sums rounded to float32 in the reference), the
    float32 reciprocal of the global scales and the float32 silu add O(2^-24) relative
    terms; the caller allows 25% on top of this bound for them and for second-order terms.
    """
    I = ex.intermediate_size  # noqa: E741
    u = 2.0 ** -9 if x.dtype == torch.bfloat16 else 2.0 ** -11
    d13, d2 = ex.dequantize(torch.float64)
    out = torch.zeros((x.shape[0], ex.hidden_size), dtype=torch.float64)
    bound = torch.zeros_like(out)
    for t, j, e, row in served_slots(x, w, ids, on_input):  # the router weight on the input is semantics
        h = d13[e] @ row.double()
        g, v = h[:I], h[I:]
        s = torch.nn.functional.silu(g)
        y = d2[e] @ (s * v)
        d_act = (1.1 * g.abs() * v.abs() + 3 * s.abs() * v.abs()) * u
        d_y = d2[e].abs() @ d_act + y.abs() * u
        scale = 1.0 if on_input else float(w[t, j])
        out[t] += scale * y
        bound[t] += abs(scale) * d_y
    return out, bound + out.abs() * u


def calibrated_case(seed: int, dtype=torch.bfloat16):
    """A layer whose activation global scales are calibrated on the inputs, as a real checkpoint's are."""
    case = Case(32, 8, 2, 128, 64, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    x, w, ids = make_inputs(case, gen)
    w13 = (torch.randn(8, 128, 128, generator=gen) / 15).to(dtype)
    w2 = (torch.randn(8, 128, 64, generator=gen) / 15).to(dtype)
    h = torch.einsum("mk,enk->men", x.double(), w13.double())
    inter = torch.nn.functional.silu(h[..., :64]) * h[..., 64:]
    a13 = torch.full((8,), 2688.0 / float(x.abs().max()))
    a2 = torch.full((8,), 2688.0 / float(inter.abs().max()))
    return NvFp4Experts.quantize(w13, w2, a13_gs=a13, a2_gs=a2), x, w, ids


# --------------------------------------------------------------------------- the reference W4A16 forward


@pytest.mark.parametrize("case", EDGE_CASES, ids=str)
def test_w4a16_reference_equals_per_token_oracle(case: Case):
    # EDGE_CASES covers -1 ids, an empty expert, topk == E, gate != up global scales, router
    # weights on the input, fp16 and bf16.
    ex, x, w, ids = case_data(case)
    got = fused_moe(x, ex, w, ids, backend="reference", apply_router_weight_on_input=case.on_input,
                    precision="w4a16")
    assert got.dtype == case.dtype and got.shape == (case.m, case.h)
    want = per_token_moe(x, ex, w, ids, case.on_input, "w4a16")
    assert same(got, want), float((got.float() - want.float()).abs().max())
    assert same(reference.exact_moe(x, ex, w, ids, case.on_input, "w4a16"), got)
    # The stage composition (stages.STAGES_W4A16 through run_pipeline) agrees bit for bit too,
    # with and without a workspace.
    problem = MoEProblem(x, ex, w, ids, case.on_input, None, "w4a16")
    assert same(run_pipeline(stages.STAGES_W4A16, problem), got)
    assert same(run_pipeline(stages.STAGES_W4A16, problem, cached_workspace(stages.STAGES_W4A16, problem)), got)
    if case.routing == "with_minus_one":
        assert bool((got[(ids < 0).all(1)] == 0).all())


@pytest.mark.parametrize("case", [c for c in EDGE_CASES if c.routing in ("random", "with_minus_one")], ids=str)
def test_w4a16_within_the_rounding_bound_of_float64(case: Case):
    ex, x, w, ids = case_data(case)
    got = fused_moe(x, ex, w, ids, backend="reference", apply_router_weight_on_input=case.on_input,
                    precision="w4a16")
    ref, bound = float64_moe(x, ex, w, ids, case.on_input)
    # 25% on top of the first-order bound (see float64_moe), and the smallest subnormal per
    # rounding for outputs near zero.
    eta = 2.0 ** -133 if case.dtype == torch.bfloat16 else 2.0 ** -24
    ratio = float(((got.double() - ref).abs() / (1.25 * bound + 8 * eta)).max())
    assert ratio <= 1.0, ratio
    rel, _ = errors(got, ref)
    assert rel < 2.0 ** -6, rel  # a few roundings of 2^-9 (bf16) each, not an activation quantization error


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4a16_is_closer_to_float64_than_w4a4(dtype):
    # Activation quantization is W4A4's dominant error: ~10% relative per NVFP4 quantization of
    # Gaussian-like rows, two in series (test_moe_reference measures 3-25%), where W4A16 only
    # rounds to 16 bits (bf16 ~2^-8 per rounding, far below 1%).
    ex, x, w, ids = calibrated_case(7, dtype)
    ref, _ = float64_moe(x, ex, w, ids, False)
    rel4, _ = errors(fused_moe(x, ex, w, ids, backend="reference", precision="w4a4"), ref)
    rel16, _ = errors(fused_moe(x, ex, w, ids, backend="reference", precision="w4a16"), ref)
    assert rel16 < 0.01, rel16
    assert rel4 > 0.03 and rel4 > 10 * rel16, (rel4, rel16)


def test_w4a16_uses_the_weight_global_scales_only():
    case = Case(6, 6, 2, 64, 32, split_gate_up=True)
    ex, x, w, ids = case_data(case)
    a13, a2 = ex.alphas("w4a16")
    assert same(a13, 1.0 / ex.w13_gs) and same(a2, 1.0 / ex.w2_gs)  # [E, 2] per half, [E]
    assert not torch.equal(a13[:, 0], a13[:, 1])
    want = fused_moe(x, ex, w, ids, backend="reference", precision="w4a16")
    # Other activation global scales change W4A4, never W4A16.
    other = NvFp4Experts(ex.w13, ex.w13_scale, ex.w13_gs, ex.w2, ex.w2_scale, ex.w2_gs, ex.a13_gs * 3, ex.a2_gs / 5)
    assert same(fused_moe(x, other, w, ids, backend="reference", precision="w4a16"), want)
    assert not same(fused_moe(x, other, w, ids, backend="reference"), fused_moe(x, ex, w, ids, backend="reference"))
    # The up half's global scale applies to the up half only: doubling it halves alpha13[:, up]
    # exactly (a power of two), hence the up half of h, act and y, each rounding included: the
    # result halves exactly. (Doubling the gate's would not: silu is not linear.)
    up2 = NvFp4Experts(ex.w13, ex.w13_scale, ex.w13_gs * torch.tensor([1.0, 2.0]), ex.w2, ex.w2_scale, ex.w2_gs,
                       ex.a13_gs, ex.a2_gs)
    halved = fused_moe(x, up2, w, ids, backend="reference", precision="w4a16")
    assert same((halved.float() * 2).to(halved.dtype), want)


def test_w4a16_expert_map_and_out_of_range_ids():
    case = Case(6, 4, 2, 64, 32)
    ex, x, _, _ = case_data(case)
    gen = torch.Generator().manual_seed(11)
    w = torch.rand(6, 2, generator=gen)
    gids = torch.tensor([[0, 7], [3, 9], [8, 1], [2, 5], [6, 4], [9, 0]], dtype=torch.int64)
    emap = torch.tensor([-1, -1, 0, -1, 1, -1, 2, -1, 3, -1])  # global 2, 4, 6, 8 live here
    got = fused_moe(x, ex, w, gids, expert_map=emap, backend="reference", precision="w4a16")
    local = torch.where(emap[gids] >= 0, emap[gids], -1).int()
    assert same(got, fused_moe(x, ex, w, local, backend="reference", precision="w4a16"))
    assert same(got, per_token_moe(x, ex, w, local, False, "w4a16"))
    assert got[0].abs().sum() == 0  # token 0 routes to 0 and 7: neither is local
    # validate=False: ids outside [-1, E) count as -1.
    bad = routed_ids(6, 2, 4, gen, "out_of_range")
    served = torch.where((bad >= 0) & (bad < 4), bad, -1)
    assert same(fused_moe(x, ex, w, bad, backend="reference", precision="w4a16", validate=False),
                fused_moe(x, ex, w, served, backend="reference", precision="w4a16"))
    with pytest.raises(ValueError, match=r"topk_ids: expected expert ids in \[-1, 4\)"):
        fused_moe(x, ex, w, bad, backend="reference", precision="w4a16")


def test_w4a16_zero_tokens_and_out():
    case = Case(3, 4, 2, 64, 32)
    ex, x, w, ids = case_data(case)
    empty = fused_moe(x[:0], ex, w[:0], ids[:0], backend="reference", precision="w4a16")
    assert empty.shape == (0, 64)
    out = torch.full_like(x, float("nan"))
    res = fused_moe(x, ex, w, ids, backend="reference", precision="w4a16", out=out)
    assert res is out and same(out, fused_moe(x, ex, w, ids, backend="reference", precision="w4a16"))


# --------------------------------------------------------------------------- W4A4 unchanged


@pytest.mark.parametrize("case", EDGE_CASES, ids=str)
def test_w4a4_default_is_unchanged(case: Case):
    ex, x, w, ids = case_data(case)
    on = case.on_input
    default = fused_moe(x, ex, w, ids, backend="reference", apply_router_weight_on_input=on)
    assert same(fused_moe(x, ex, w, ids, backend="reference", apply_router_weight_on_input=on, precision="w4a4"),
                default)
    assert same(reference.exact_moe(x, ex, w, ids, on), default)
    assert same(run_pipeline(stages.STAGES, MoEProblem(x, ex, w, ids, on, None)), default)
    # The operator called without the precision argument (its schema before precision existed).
    args = (x, *_op.tensors_of(ex), w, ids, "reference", on)
    assert same(OP(*args), default) and same(OP(*args, "w4a4"), default)


def test_problem_and_stage_set_precisions_must_agree():
    case = Case(3, 4, 2, 64, 32)
    ex, x, w, ids = case_data(case)
    assert MoEProblem(x, ex, w, ids, False, None).precision == "w4a4"
    with pytest.raises(ValueError, match=r"stages: 'reference' computes precision 'w4a4', the problem asks for "
                                         r"'w4a16'"):
        run_pipeline(stages.STAGES, MoEProblem(x, ex, w, ids, False, None, "w4a16"))
    with pytest.raises(ValueError, match=r"'reference-w4a16' computes precision 'w4a16'.* asks for 'w4a4'"):
        run_pipeline(stages.STAGES_W4A16, MoEProblem(x, ex, w, ids, False, None))
    with pytest.raises(ValueError, match="expected activation_values=True"):
        dataclasses.replace(stages.STAGES, precision="w4a16")
    with pytest.raises(ValueError, match="precision: expected 'w4a4' or 'w4a16', got 'fp8'"):
        dataclasses.replace(stages.STAGES, precision="fp8")


def test_w4a16_row_stages_write_values_only_and_zero_the_padding():
    gen = torch.Generator().manual_seed(3)
    e, m, topk, k = 5, 7, 3, 32
    ids = routed_ids(m, topk, e, gen, "minus_one")
    r = stages.routing(ids, e)
    x = torch.randn(m, k, generator=gen).bfloat16()
    rw = torch.rand(m * topk, generator=gen)
    a = stages.STAGES_W4A16.quantize_rows(x, torch.ones(e), r, row_scale=rw)
    valid = int(r.expert_offsets[-1])
    flat = r.slot_to_flat[:valid].long()
    assert same(a.values[:valid], (x[flat // topk].float() * rw[flat].unsqueeze(1)).bfloat16())
    assert bool((a.values[valid:] == 0).all())
    h = torch.randn(m * topk, 2 * k, generator=gen).bfloat16()
    h[valid:] = float("nan")  # rows past the served ones are never read as values
    b = stages.STAGES_W4A16.silu_mul_quantize(h, torch.ones(e), r)
    assert same(b.values[:valid], stages.silu_mul(h[:valid])) and bool((b.values[valid:] == 0).all())


# --------------------------------------------------------------------------- dispatch


def test_the_table_says_who_computes_what():
    assert PRECISIONS == ("w4a4", "w4a16")
    assert BACKENDS["reference"].precisions == PRECISIONS
    assert BACKENDS["triton"].precisions == PRECISIONS
    assert BACKENDS["cutlass"].precisions == PRECISIONS
    for cap, ok in (((9, 0), True), ((9, 5), True), ((10, 0), False), ((12, 0), False), ((12, 1), False)):
        why = BACKENDS["cutlass"].precision_unserved("w4a16", "cuda", cap)
        assert (why is None) == ok, (cap, why)
        if not ok:
            assert BLACKWELL_REASON in why and f"sm_{cap[0]}{cap[1]}" in why
        assert BACKENDS["cutlass"].precision_unserved("w4a4", "cuda", cap) is None
    # triton: both wherever it runs (W4A16 on the values GEMM: off Hopper its portable table)
    for cap in ((8, 0), (8, 9), (9, 0), (10, 0), (12, 0)):
        assert BACKENDS["triton"].precision_unserved("w4a16", "cuda", cap) is None, cap
    assert BACKENDS["triton"].precision_unserved("w4a16", "cpu", None) is None  # (the interpreter)
    assert BACKENDS["triton"].precision_text() == "w4a4, w4a16"
    assert BACKENDS["cutlass"].precision_text() == "w4a4, w4a16 (sm_90..<sm_100)"


def test_triton_w4a16_is_served_on_every_gpu_it_runs_on(monkeypatch):
    case = Case(3, 4, 2, 64, 64)
    ex, x, w, ids = case_data(case)
    if INTERPRETED:
        assert select_backend("triton", "cpu", torch.bfloat16, "w4a16") == "triton"
    else:
        with pytest.raises(BackendUnavailableError, match="runs on CPU only in Triton's interpreter"):
            select_backend("triton", "cpu", torch.bfloat16, "w4a16")
    for cap in ("8.0", "8.9", "9.0", "10.0", "12.0", "12.1"):  # no GPU here: the capability the table is read for
        monkeypatch.setenv("MOE_FP4_FORCE_CAPABILITY", cap)
        assert select_backend("triton", CUDA, torch.bfloat16, "w4a16") == "triton", cap
    monkeypatch.delenv("MOE_FP4_FORCE_CAPABILITY")
    # The layer's shape: the K16 weight layout needs H and I multiples of 64.
    small = Case(3, 4, 2, 64, 32)
    ex, x, w, ids = case_data(small)
    # Named, the registry refuses it (as ep_fused_moe does on every rank); the stages refuse it too. (Triton taken
    # as able to run on this CPU, interpreter or not: the layer is the reason.)
    _every_backend_runs_here(monkeypatch)
    with pytest.raises(ValueError, match=r"experts: backend='triton' does not compute precision='w4a16' for this "
                                         r"layer: the K16 weight layout needs .* multiples of 64, got H = 64, I = 32"):
        fused_moe(x, ex, w, ids, backend="triton", precision="w4a16")
    with pytest.raises(ValueError, match=r"experts: the Triton backend computes 'w4a16' on its values operand: the "
                                         r"K16 weight layout needs .* multiples of 64, got H = 64, I = 32"):
        registry.get_backend_module("triton").stages_for_problem(MoEProblem(x, ex, w, ids, False, None, "w4a16"))


def test_cutlass_w4a16_is_refused_on_blackwell_and_served_on_hopper(monkeypatch):
    monkeypatch.setenv("MOE_FP4_FORCE_CAPABILITY", "12.0")
    with pytest.raises(ValueError, match=r"backend='cutlass' does not compute precision='w4a16' on cuda:0: computes "
                                         r"w4a16 on compute capability sm_90..<sm_100 only, this device is sm_120: "
                                         r"on Blackwell \(SM100/SM120/SM121\) " + BLACKWELL_REASON):
        select_backend("cutlass", CUDA, torch.bfloat16, "w4a16")
    monkeypatch.setenv("MOE_FP4_FORCE_CAPABILITY", "9.0")
    assert registry.precision_unserved("cutlass", CUDA, "w4a16") is None
    # On a CPU the device is the reason, not the precision.
    with pytest.raises(BackendUnavailableError, match="backend='cutlass' cannot run on cpu: runs on cuda devices"):
        select_backend("cutlass", "cpu", torch.bfloat16, "w4a16")


def test_auto_picks_a_backend_that_computes_the_precision(monkeypatch):
    assert select_backend("auto", "cpu", torch.bfloat16, "w4a16") == "reference"
    assert registry.resolve_backend("auto", torch.device("cpu"), torch.bfloat16, "w4a16") == "reference"
    # (auto does not take triton on a CPU; named, it runs there in the interpreter)
    on_cpu = ["triton", "reference"] if INTERPRETED else ["reference"]
    assert moe_fp4_available("cpu", "w4a16") == on_cpu
    assert moe_fp4_available("cpu", "w4a4") == on_cpu
    # Every backend "available" (as on a GPU with the library built): the precision alone decides.
    _every_backend_runs_here(monkeypatch)
    monkeypatch.setenv("MOE_FP4_FORCE_CAPABILITY", "12.0")
    assert select_backend("auto", CUDA, torch.bfloat16) == "cutlass"
    assert select_backend("auto", CUDA, torch.bfloat16, "w4a16") == "triton"
    text = explain_backend(CUDA, precision="w4a16")
    assert "precision w4a16: NVFP4 weights, 16-bit activations" in text
    assert "cutlass   unavailable: does not compute precision='w4a16': computes w4a16 on compute capability" in text
    assert "triton    available" in text
    assert "auto -> triton after skipping cutlass (does not compute precision='w4a16'" in text
    assert "auto -> cutlass" in explain_backend(CUDA)
    # On 9.x the auto order is triton > reference (cutlass runs there when named): w4a16 takes
    # triton (its values operand); backend="cutlass" computes it too.
    monkeypatch.setenv("MOE_FP4_FORCE_CAPABILITY", "9.0")
    assert select_backend("auto", CUDA, torch.bfloat16, "w4a16") == "triton"
    assert select_backend("cutlass", CUDA, torch.bfloat16, "w4a16") == "cutlass"
    # On 8.x triton computes it (the values GEMM's portable table).
    monkeypatch.setenv("MOE_FP4_FORCE_CAPABILITY", "8.0")
    assert select_backend("auto", CUDA, torch.bfloat16, "w4a16") == "triton"
    # MOE_FP4_BACKEND names a backend: one that does not compute the precision raises.
    monkeypatch.setenv("MOE_FP4_FORCE_CAPABILITY", "12.0")
    monkeypatch.setenv("MOE_FP4_BACKEND", "cutlass")
    with pytest.raises(ValueError, match="backend='cutlass' does not compute precision='w4a16'"):
        select_backend("auto", CUDA, torch.bfloat16, "w4a16")


def moe_fp4_available(device, precision):
    import moe_fp4

    return moe_fp4.available_backends(device, precision)


@pytest.mark.parametrize("bad,exc,msg", [
    ("fp8", ValueError, "precision: expected 'w4a4' or 'w4a16', got 'fp8'"),
    ("W4A16", ValueError, "precision: expected 'w4a4' or 'w4a16', got 'W4A16'"),
    (None, TypeError, "precision: expected a str"),
    (16, TypeError, "precision: expected a str .*got int"),
])
def test_bad_precision_values_are_named(bad, exc, msg):
    case = Case(3, 4, 2, 64, 32)
    ex, x, w, ids = case_data(case)
    with pytest.raises(exc, match=msg):
        fused_moe(x, ex, w, ids, backend="reference", precision=bad)
    with pytest.raises(exc, match=msg):
        select_backend("auto", "cpu", torch.bfloat16, bad)
    with pytest.raises(exc, match=msg):
        explain_backend("cpu", precision=bad)
    with pytest.raises(exc, match=msg):
        FusedMoE(4, 64, 32, precision=bad)
    with pytest.raises(exc, match=msg):
        SparseMoeBlock(4, 64, 32, 2, precision=bad)


# --------------------------------------------------------------------------- modules, operator, compile


def test_fused_moe_module_w4a16_equals_the_function():
    case = Case(5, 6, 2, 64, 32, split_gate_up=True)
    ex, x, w, ids = case_data(case)
    want = fused_moe(x, ex, w, ids, backend="reference", precision="w4a16")
    moe = FusedMoE.from_experts(ex, backend="reference", precision="w4a16")
    assert moe.precision == "w4a16" and "precision='w4a16'" in repr(moe)
    assert same(moe(x, w, ids), want)
    assert same(moe(x.reshape(5, 1, 64), w.reshape(5, 1, 2), ids.reshape(5, 1, 2)), want.reshape(5, 1, 64))
    fresh = FusedMoE(6, 64, 32, separate_gate_up_scales=True, backend="reference", precision="w4a16")
    fresh.load_state_dict(moe.state_dict())
    assert same(fresh(x, w, ids), want)
    assert FusedMoE.from_experts(ex, backend="reference").precision == "w4a4"


def test_sparse_moe_block_w4a16():
    from moe_fp4 import load_moe_block

    path = DATA_TINY / "nvfp4_llmc"
    block = SparseMoeBlock.from_checkpoint(path, 0, backend="reference", precision="w4a16")
    assert block.experts.precision == "w4a16"
    x = (torch.randn(6, 256, generator=torch.Generator().manual_seed(13)) / 2).bfloat16()
    w, ids = block.route(x)
    want = fused_moe(x, block.experts.experts, w, ids, backend="reference", precision="w4a16")
    assert same(block(x), want)
    assert same(load_moe_block(path, 0)(x, backend="reference", precision="w4a16"), want)
    assert not same(want, fused_moe(x, block.experts.experts, w, ids, backend="reference"))


def test_expert_parallel_module_passes_precision(tmp_path, monkeypatch):
    import torch.distributed as dist

    from moe_fp4.distributed import shard_experts

    case = Case(5, 4, 2, 64, 32)
    ex, x, w, ids = case_data(case)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        local, emap = shard_experts(ex, 0, 1)
        for mode in ("all_to_all", "all_reduce"):
            moe = ExpertParallelMoE.from_shard(local, emap, mode=mode, backend="reference", precision="w4a16")
            assert moe.precision == "w4a16"
            assert same(moe(x, w, ids), fused_moe(x, ex, w, ids, backend="reference", precision="w4a16"))
        # The precision reaches the backend's check: triton's w4a16 needs H and I multiples of 64 (this layer's I is
        # 32), refused before any collective. (Triton taken as able to run on this CPU: the layer is the reason.)
        _every_backend_runs_here(monkeypatch)
        with pytest.raises(ValueError, match="backend='triton' does not compute precision='w4a16' for this layer"):
            ExpertParallelMoE.from_shard(local, emap, backend="triton", precision="w4a16")(x, w, ids)
    finally:
        dist.destroy_process_group()


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("on_input,out", [(False, False), (True, False), (False, True)],
                         ids=["plain", "on-input", "out"])
def test_compiled_w4a16_equals_eager_bitwise(fresh_dynamo, on_input, out):
    case = Case(5, 6, 2, 64, 32, split_gate_up=True)
    ex, x, w, ids = case_data(case)
    graphs = []

    def record(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    def f(x, w, ids, o):
        return fused_moe(x, ex, w, ids, backend="reference", apply_router_weight_on_input=on_input,
                         precision="w4a16", out=o)

    compiled = torch.compile(f, fullgraph=True, backend=record)
    for m in (5, 3):
        o = torch.full_like(x[:m], float("nan")) if out else None
        want = f(x[:m], w[:m], ids[:m], None)
        assert same(compiled(x[:m], w[:m], ids[:m], o), want), m
    op = OUT_OP if out else OP
    calls = [n for gm in graphs for n in gm.graph.nodes if n.op == "call_function" and n.target is op]
    assert calls and all(n.args[-1] == "w4a16" for n in calls)


def test_compiled_fused_moe_module_w4a16(fresh_dynamo):
    case = Case(6, 4, 2, 64, 32)
    ex, x, w, ids = case_data(case)
    moe = FusedMoE.from_experts(ex, backend="reference", precision="w4a16")
    assert same(torch.compile(moe, fullgraph=True)(x, w, ids), moe(x, w, ids))


def test_operator_takes_precision_last():
    case = Case(4, 4, 2, 64, 32)
    ex, x, w, ids = case_data(case)
    args = (x, *_op.tensors_of(ex), w, ids, "reference", True)
    want = fused_moe(x, ex, w, ids, backend="reference", apply_router_weight_on_input=True, precision="w4a16")
    assert same(OP(*args, "w4a16"), want)
    out = torch.full_like(x, float("nan"))
    assert OUT_OP(*args, out, "w4a16") is None and same(out, want)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        got = OP(mode.from_tensor(x), *args[1:], "w4a16")
        assert type(got).__name__ == "FakeTensor" and got.shape == x.shape and got.dtype == x.dtype
    utils = ("test_faketensor", "test_aot_dispatch_dynamic", "test_autograd_registration")
    torch.library.opcheck(OP, (*args, "w4a16"), test_utils=utils)
    torch.library.opcheck(OUT_OP, (*args, torch.empty_like(x), "w4a16"), test_utils=utils)


# --------------------------------------------------------------------------- cutlass's W4A16 stage set, CPU side


@pytest.fixture
def cutlass_host():
    """The cutlass backend module when its library loads here (its host oracle and weight re-layout run on CPU)."""
    from moe_fp4 import _native
    from moe_fp4.backends import cutlass

    try:
        _native.library()
    except _native.LibraryUnavailable as exc:
        pytest.skip(f"CUDA library: {exc}")
    return cutlass


def test_cutlass_w4a16_weights_share_the_prepared_layout(cutlass_host):
    cutlass = cutlass_host
    ex, *_ = case_data(Case(3, 6, 2, 64, 32, split_gate_up=True))
    w13, w2 = cutlass.STAGES_SM90_W4A16.weights(ex)
    p13, p2 = cutlass.STAGES_SM90.weights(ex)
    assert cutlass.STAGES_SM90_W4A16.weights(ex)[0] is w13  # cached on the experts
    for new, old in ((w13, p13), (w2, p2)):
        assert new.packed is old.packed and new.scales is old.scales  # one re-laid-out copy for both precisions
    a13, a2 = ex.alphas("w4a16")
    assert same(w13.alpha, a13) and same(w2.alpha, a2.reshape(-1, 1))
    assert same(p13.alpha, ex.alphas()[0])  # the W4A4 weights keep their alpha
    assert cutlass.STAGES_SM90_W4A16.precision == "w4a16" and cutlass.STAGES_SM90_W4A16.activation_values


@pytest.mark.parametrize("case", [c for c in EDGE_CASES if c.h % 32 == 0 and c.i % 32 == 0], ids=str)
def test_cutlass_w4a16_stage_set_composes_on_cpu(cutlass_host, case):
    # Everything of cutlass.STAGES_SM90_W4A16 but the two GPU-only stages (routing, the sm_90a GEMM),
    # which are replaced by the reference's: its row stages and the library's reduce (host oracle),
    # through the same run_pipeline and workspace, equal the reference W4A16 bit for bit.
    cutlass = cutlass_host
    ex, x, w, ids = case_data(case)
    ref = stages.STAGES_W4A16
    mixed = dataclasses.replace(cutlass.STAGES_SM90_W4A16, routing=ref.routing, grouped_gemm=ref.grouped_gemm,
                                prepare_weights=ref.prepare_weights, weights_key=ref.weights_key)
    problem = MoEProblem(x, ex, w, ids, case.on_input, None, "w4a16")
    got = run_pipeline(mixed, problem, cached_workspace(mixed, problem))
    assert same(got, fused_moe(x, ex, w, ids, backend="reference", apply_router_weight_on_input=case.on_input,
                               precision="w4a16"))


def test_cutlass_w4a16_needs_compute_capability_9(cutlass_host):
    cutlass = cutlass_host
    with pytest.raises(ValueError, match="computes 'w4a16' on compute capability 9.x only"):
        cutlass.stages_for(torch.device("cpu"), "w4a16")
    assert cutlass.stages_for(torch.device("cpu")) is cutlass.STAGES


# --------------------------------------------------------------------------- GPU: cutlass on Hopper

# The cutlass W4A16 forward against the exact reference: both multiply the same 16-bit rows
# with the same e2m1 * scale weights; only the fp32 summation order of the two GEMMs differs,
# which moves a 16-bit GEMM output by at most about one ulp (2^-8 relative in bf16), and that
# propagates through the SiLU-mul and the second GEMM. There is no re-quantization, so none of
# W4A4's E2M1 boundary crossings: tests/test_cutlass_sm90.py's bounds (set for W4A4) hold with
# margin.
RMS_TOL = 1e-2
MAX_TOL = 0.1

# The whole W4A16 forward on sm_90a against the reference (the 7-case grid) and its CUDA-graph
# capture: tests/test_cutlass_sm90.py, parametrized over both precisions.
_gpu_experts = gpu_experts


@pytest.mark.gpu
@pytest.mark.sm90
def test_cutlass_w4a16_gemm_stage_within_bound_sm90():
    """The sm_90a GEMM on unquantized rows against the reference W4A16 GEMM stage (float64 sums)."""
    from moe_fp4.backends import cutlass

    ex = _gpu_experts(128, 2048, 768, torch.bfloat16, True, seed=5)
    gen = torch.Generator().manual_seed(5)
    ids = routed_ids(64, 8, 128, gen).cuda()
    r = stages.routing(ids, 128)
    x = (torch.randn(64, 2048, generator=gen) / 3).bfloat16().cuda()
    a = cutlass.STAGES_SM90_W4A16.quantize_rows(x, ex.a13_gs, r)
    assert same(a.values, stages.STAGES_W4A16.quantize_rows(x, ex.a13_gs, r).values)
    w90, _ = cutlass.STAGES_SM90_W4A16.weights(ex)
    w_ref, _ = stages.STAGES_W4A16.weights(ex)
    got = cutlass.STAGES_SM90_W4A16.grouped_gemm(a, w90, r, torch.bfloat16)
    ref = stages.STAGES_W4A16.grouped_gemm(a, w_ref, r, torch.bfloat16)
    valid = int(r.expert_offsets[-1])
    # The GPU's fp32 sum in any order is within K * 2^-23 * alpha * sum_k |a_k w_k| of the exact
    # one (2^-23: room for a tensor core that truncates); the reference rounds the exact sum to
    # float32; each side then rounds to bf16 (half an ulp, 2^-9 relative, each). |a| and |w|
    # (sign bits cleared) through the reference GEMM give alpha * sum |a w| (rounded to bf16:
    # 1% slack covers it).
    abs_a = dataclasses.replace(a, values=a.values.abs())
    abs_w = dataclasses.replace(w_ref, packed=w_ref.packed & 0x77)
    mag = stages.STAGES_W4A16.grouped_gemm(abs_a, abs_w, r, torch.bfloat16)[:valid].float()
    g, want = got[:valid].float(), ref[:valid].float()
    bound = 1.01 * 2048 * 2.0 ** -23 * mag + 2.0 ** -8 * torch.maximum(g.abs(), want.abs())
    ratio = float(((g - want).abs() / (bound + 1e-30)).max())
    assert ratio <= 1.0, ratio


# CUDA-graph capture and no host sync of W4A16 on sm_90a: tests/test_cutlass_sm90.py
# (test_cuda_graph_and_no_host_sync, both precisions).


# --------------------------------------------------------------------------- transformers


def test_transformers_model_with_w4a16_experts():
    from test_transformers_integration import TOKENS, _have_experts_interface, float64_model, logits, rel

    if not _have_experts_interface():
        pytest.skip("needs transformers >= 5 with transformers.integrations.moe.ExpertsInterface")
    from moe_fp4.integrations.transformers import load_model

    name = "nvfp4_llmc"
    model = load_model(DATA_TINY / name, backend="reference", precision="w4a16")
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(m.precision == "w4a16" for m in experts)
    with torch.no_grad():
        got = model(TOKENS).logits
        ref = float64_model(name)(TOKENS).logits
    # Relative logit error against the float64 model on the dequantized weights, measured on the
    # three tiny checkpoints: W4A16 0.0067-0.0069 (bf16 roundings only), W4A4 0.031-0.037 (most
    # of it the activation quantization, see test_transformers_integration). 2-3x margins.
    rel16, rel4 = rel(got, ref), rel(logits(name), ref)
    assert rel16 < 0.02 and rel16 < 0.5 * rel4, (rel16, rel4)
    with pytest.raises(ValueError, match="precision: expected 'w4a4' or 'w4a16'"):
        load_model(DATA_TINY / name, precision="w4a8")
