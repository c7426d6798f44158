"""Property-based tests (hypothesis) of ``fused_moe``, its stages, determinism and batch invariance.

Reliability suite, items 1 and 6. Configurations are drawn by hypothesis (``strategies.py``:
E up to 300, primes often, one E > 1024 as an explicit example; topk up to min(E, 16); H, I
multiples of 16; skewed, uniform and edge routings; -1 and out-of-range ids; ``expert_map``;
gate != up global scales; bf16/fp16; router weights on the input; saturated and tiny
activations). Properties:

* the reference backend equals the independent per-token implementation exactly, and the
  stage composition ``run_pipeline(stages.STAGES, ...)`` equals the reference backend exactly;
* Triton (the CPU interpreter here, tiny shapes) is within the tolerances of test_triton_moe;
* the reference stages: quantization equals the format core's ``quantize_nvfp4`` per expert,
  every byte of the grouped buffers included, and the routing metadata has its invariants;
* every backend that runs here is bitwise reproducible and batch-invariant.

The ``ci`` profile (the default) is derandomized and keeps no example database, so every run
draws the same examples; ``MOE_FP4_HYPOTHESIS=explore`` draws new ones, ten times as many.
A failing example prints a one-line command that reproduces it. ``gpu``-marked variants run
the same properties with more examples on the triton and cutlass backends.
"""

from __future__ import annotations

import os
from itertools import accumulate

import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, note, settings
from hypothesis import strategies as st
from strategies import MoECase, MoEInputs, moe_cases, token_subsets
from test_moe_reference import per_token_moe

# The whole forward against the exact reference, from test_triton_moe: "Both compute the same
# bits up to float32 summation order in the two GEMMs. That order changes a 16-bit GEMM output
# by at most one unit in the last place (2^-8 relative for bf16), so the RMS relative error
# stays below 2^-8 ~ 4e-3 ... unless such a one-ulp change in GEMM1's output moves an element
# of the re-quantized intermediate across an E2M1 rounding boundary. That is rare (~1e-5 per
# element) and changes one row's y by at most about (block amax / 3) * max|w2| ~
# max|ref| / sqrt(I), i.e. a few percent of the largest output." (RMS 1e-2, max 0.1.)
from test_triton_moe import MAX_TOL, RMS_TOL

from moe_fp4 import available_backends, stages
from moe_fp4.buffers import Quantized, RoutingData
from moe_fp4.format import decode_scaled, grouped_scale_rows_bound, quantize_nvfp4, swizzle_scales, swizzled_shape
from moe_fp4.moe import MoEProblem
from moe_fp4.pipeline import StageSet, cached_workspace, run_pipeline
from moe_fp4.testing import assert_same_buffers, errors, poison, poisoned_like

_CI_PHASES = (Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink)
settings.register_profile("ci", derandomize=True, deadline=None, database=None, print_blob=False,
                          suppress_health_check=[HealthCheck.too_slow], phases=_CI_PHASES)
settings.register_profile("explore", deadline=None, database=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
PROFILE = os.environ.get("MOE_FP4_HYPOTHESIS", "ci")
_SCALE = 1 if PROFILE == "ci" else 10


def budget(n: int, *, shrink: bool = True) -> settings:
    """``n`` examples under the active profile; ``shrink=False`` for tests whose examples take
    seconds (a failure then reports the drawn example as it is)."""
    base = settings.get_profile(PROFILE)
    phases = base.phases if shrink else tuple(p for p in base.phases if p != Phase.shrink)
    return settings(base, max_examples=n * _SCALE, phases=phases)


def gpu_budget(n: int, **kw) -> settings:
    """:func:`budget` for a GPU test: ``n`` examples, at most ``MOE_FP4_GPU_EXAMPLES`` when that is set
    (a GPU session with little device time; the committed results say which count ran)."""
    cap = os.environ.get("MOE_FP4_GPU_EXAMPLES")
    return budget(min(n, int(cap)) if cap else n, **kw)


def reproduce(check, *args) -> None:
    """Note (printed with a failing example) a one-line command that reruns ``check(*args)``."""
    env = "" if torch.cuda.is_available() else "TRITON_INTERPRET=1 "
    call = f"{check.__name__}({', '.join(map(repr, args))})"
    note(f"reproduce: {env}.venv/bin/python -c \"import sys; sys.path[:0] = ['tests']; "
         f"from test_properties import *; {call}\"")


# A case with E > 1024 (prime), 16 slots per token, an expert_map and -1 ids (H, I = 32 for the GPU variants).
LARGE_E = MoECase(m=6, e=1031, topk=16, h=16, i=16, pattern="skewed", drop=10, remote=20, seed=7)
LARGE_E_GPU = MoECase(m=6, e=1031, topk=16, h=32, i=32, pattern="skewed", drop=10, remote=20, seed=7)

# --------------------------------------------------------------------------- the whole forward


def check_reference_equals_per_token(case: MoECase) -> None:
    """``fused_moe(backend="reference")`` equals ``per_token_moe`` bit for bit (exact: see its docstring)."""
    inp = case.inputs()
    got = case.call(inp, "reference")
    want = per_token_moe(inp.x, inp.experts, inp.weights, inp.local_ids, case.on_input)
    assert_same_buffers(got, want, "reference backend vs per_token_moe")


def check_pipeline_equals_reference(case: MoECase) -> None:
    """The stage composition on the reference stages equals the reference backend bit for bit."""
    inp = case.inputs()
    problem = MoEProblem(inp.x, inp.experts, inp.weights, inp.stage_ids, case.on_input, None)
    assert_same_buffers(run_pipeline(stages.STAGES, problem), case.call(inp, "reference"),
                        "run_pipeline(stages.STAGES) vs reference backend")


def check_close_to_reference(case: MoECase, backend: str = "triton", device: str = "cpu") -> None:
    """``backend`` (into a NaN-filled ``out``) within RMS_TOL / MAX_TOL of the reference; tokens
    with no served expert exactly zero."""
    inp = case.inputs(device)
    got = case.call(inp, backend, out=torch.full_like(inp.x, float("nan")))
    ref = case.call(inp, "reference")
    assert not bool(got.isnan().any()), f"{backend}: unwritten or NaN output elements"
    unserved = (inp.local_ids < 0).all(dim=1)
    assert bool((got[unserved] == 0).all()), f"{backend}: a token with no served expert must be exactly 0"
    rms, mx = errors(got, ref)
    assert rms <= RMS_TOL and mx <= MAX_TOL, f"{backend}: rms {rms:.3g}, max {mx:.3g} against the reference"


@budget(40)
@given(moe_cases())
@example(LARGE_E)
@example(MoECase(m=0, e=3, topk=2, h=16, i=16))
def test_reference_equals_per_token(case: MoECase):
    reproduce(check_reference_equals_per_token, case)
    check_reference_equals_per_token(case)


@budget(40)
@given(moe_cases(min_m=1))
@example(LARGE_E)
def test_pipeline_equals_reference(case: MoECase):
    reproduce(check_pipeline_equals_reference, case)
    check_pipeline_equals_reference(case)


# Tiny shapes: an interpreted forward takes ~1 s at E <= 8 and grows with E.
TRITON_CPU_CASES = moe_cases(max_e=7, max_m=6, max_topk=4, sizes=(16, 32, 64))


@pytest.mark.interpreter
@budget(8, shrink=False)
@given(TRITON_CPU_CASES)
def test_triton_close_to_reference(case: MoECase):
    reproduce(check_close_to_reference, case)
    check_close_to_reference(case)


# --------------------------------------------------------------------------- stages


def _stage_set(backend: str, device: str) -> StageSet:
    if backend == "reference":
        return stages.STAGES
    if backend == "triton":
        from moe_fp4.backends import triton

        return triton.STAGES
    from moe_fp4.backends import cutlass

    return cutlass.stages_for(torch.device(device))


def _groups(ids: torch.Tensor, num_experts: int) -> list[list[int]]:
    """Per expert, the flat indices ``t * topk + j`` of the slots it serves, ascending (from the ids alone)."""
    groups: list[list[int]] = [[] for _ in range(num_experts)]
    for flat, e in enumerate(ids.flatten().tolist()):
        if 0 <= e < num_experts:
            groups[e].append(flat)
    return groups


def _poisoned_quantized(stage_set: StageSet, n: int, K: int, E: int, like: torch.Tensor) -> Quantized:  # noqa: N803
    values = like.dtype if stage_set.activation_values else None
    return poisoned_like(Quantized.empty(n, K, E, like.device, values=values))


def _format_core_grouped(rows_of: list[torch.Tensor], gs: torch.Tensor, n: int, K: int) -> tuple[torch.Tensor, ...]:  # noqa: N803
    """(packed, scale bytes, values) of the grouped buffers, built from ``quantize_nvfp4`` per expert:
    expert ``e``'s rows back to back, its swizzled scales at row ``sum_{d<e} ceil(m_d/128)*128``,
    zeros elsewhere; values = codes times block scale (``decode_scaled``, exact in 16 bits)."""
    E = len(rows_of)
    _, cp = swizzled_shape(1, K // 16)
    packed = torch.zeros((n, K // 2), dtype=torch.uint8)
    scales = torch.zeros((grouped_scale_rows_bound(n, E), cp), dtype=torch.uint8)
    values = torch.zeros((n, K), dtype=rows_of[0].dtype if rows_of else torch.bfloat16)
    row = scale_row = 0
    for e, rows in enumerate(rows_of):
        m = rows.shape[0]
        if m:
            q, s = quantize_nvfp4(rows, gs[e])
            packed[row : row + m] = q
            scales[scale_row : scale_row + -(-m // 128) * 128] = swizzle_scales(s).view(torch.uint8)
            values[row : row + m] = decode_scaled(q, s).to(values.dtype)
        row, scale_row = row + m, scale_row + -(-m // 128) * 128
    return packed, scales, values


def _assert_grouped(ss: StageSet, got: Quantized, want: tuple[torch.Tensor, ...], what: str) -> None:
    """Codes and scales equal ``want``'s; a stage set that writes no codes (sm_90a: its GEMM takes the
    values) is checked on its values instead, bitwise."""
    packed, scales, values = want
    if ss.activation_codes:
        assert_same_buffers((got.packed.cpu(), got.scales.view(torch.uint8).cpu()), (packed, scales), what)
    else:
        assert_same_buffers(got.values.cpu(), values, f"{what} values")


def check_quantize_rows(case: MoECase, backend: str = "reference", device: str = "cpu") -> None:
    """Gather (+ router weight) + per-expert quantization equal ``quantize_nvfp4`` of each expert's rows."""
    ss = _stage_set(backend, device)
    inp = case.inputs(device, with_experts=False)
    n, K = case.m * case.topk, case.h  # noqa: N806
    r = ss.routing(inp.stage_ids, case.e)
    gs = case.global_scales(0.4, 1.0, device)
    w = inp.weights.reshape(-1)
    got = ss.quantize_rows(inp.x, gs, r, row_scale=w if case.on_input else None,
                           out=_poisoned_quantized(ss, n, K, case.e, inp.x))
    x, w = inp.x.cpu(), w.cpu()
    rows_of = []
    for flat in _groups(inp.local_ids.cpu(), case.e):
        sel = torch.tensor(flat, dtype=torch.long)
        rows = x[sel // case.topk]
        rows_of.append((rows.float() * w[sel].unsqueeze(1)).to(x.dtype) if case.on_input else rows)
    _assert_grouped(ss, got, _format_core_grouped(rows_of, gs.cpu(), n, K), f"{backend} quantize_rows")


def _silu_mul(h: torch.Tensor) -> torch.Tensor:
    """The contract: silu in float32 rounded to 16-bit, times up in float32, rounded to 16-bit."""
    half = h.shape[1] // 2
    g = h[:, :half].float()
    return ((g / (1 + torch.exp(-g))).to(h.dtype).float() * h[:, half:].float()).to(h.dtype)


def check_silu_mul_quantize(case: MoECase, backend: str = "reference", device: str = "cpu") -> None:
    """SiLU-and-mul + per-expert quantization equal ``quantize_nvfp4`` of each expert's activations;
    rows past the served ones (NaN here) are ignored."""
    ss = _stage_set(backend, device)
    inp = case.inputs(device, with_experts=False)
    n, I = case.m * case.topk, case.i  # noqa: N806
    counts = [len(g) for g in _groups(inp.local_ids.cpu(), case.e)]
    bounds = list(accumulate(counts, initial=0))
    h = torch.randn(n, 2 * I, generator=case.generator(3)) * 2.0 ** min(case.x_log2, 2)
    h = h.to(case.torch_dtype)
    h[bounds[-1] :] = float("nan")
    gs = case.global_scales(0.05, 0.2, device)
    got = ss.silu_mul_quantize(h.to(device), gs, ss.routing(inp.stage_ids, case.e),
                               out=_poisoned_quantized(ss, n, I, case.e, h.to(device)))
    rows_of = [_silu_mul(h[a:b]) for a, b in zip(bounds, bounds[1:])]
    _assert_grouped(ss, got, _format_core_grouped(rows_of, gs.cpu(), n, I), f"{backend} silu_mul_quantize")


def check_routing(case: MoECase, backend: str = "reference", device: str = "cpu") -> None:
    """Routing metadata invariants, from the ids alone."""
    ss = _stage_set(backend, device)
    ids = case.inputs(device, with_experts=False).stage_ids
    n, E = ids.numel(), case.e  # noqa: N806
    r = ss.routing(ids, E, out=poisoned_like(RoutingData.empty(n, E, ids.device), byte=0x7F))
    flat = ids.flatten().tolist()
    groups = _groups(ids.cpu(), E)
    counts = [len(g) for g in groups]
    offs, bso, s2f, f2s = (t.tolist() for t in (r.expert_offsets, r.blockscale_offsets, r.slot_to_flat,
                                                r.flat_to_slot))
    assert offs == list(accumulate(counts, initial=0)), "expert_offsets: prefix sums of the served counts"
    assert bso == list(accumulate((-(-c // 128) * 128 for c in counts), initial=0)), \
        "blockscale_offsets: prefix sums of ceil(m_e/128)*128"
    valid = offs[-1]
    served = sorted(f for g in groups for f in g)
    assert sorted(s2f[:valid]) == served, "slot_to_flat: a permutation of the served flat indices"
    assert s2f[valid:] == [-1] * (n - valid), "slot_to_flat: -1 past expert_offsets[E]"
    assert all(f2s[s2f[s]] == s for s in range(valid)), "flat_to_slot: the inverse of slot_to_flat"
    assert all(f2s[f] == -1 for f in sorted(set(range(n)) - set(served))), "flat_to_slot: -1 where not served"
    for e in range(E):
        seg = s2f[offs[e] : offs[e + 1]]
        assert all(flat[f] == e for f in seg), f"slot_to_flat: expert {e}'s slots hold other ids"
        assert seg == sorted(seg), f"slot_to_flat: expert {e}'s slots not in ascending flat index"


# Up to 300 tokens so that one expert can take more than 128 rows (a second scale block).
ROUTING_CASES = moe_cases(max_m=300, sizes=(16,))


@budget(80)
@given(ROUTING_CASES)
@example(MoECase(m=150, e=3, topk=2, h=16, i=16, pattern="one_expert"))
@example(MoECase(m=40, e=1500, topk=16, h=16, i=16, pattern="minus_one", remote=9))
def test_routing_invariants(case: MoECase):
    reproduce(check_routing, case)
    check_routing(case)


@budget(40)
@given(moe_cases(sizes=(16, 32, 48, 64, 80, 128, 160)))
def test_quantize_rows_equals_format_core(case: MoECase):
    reproduce(check_quantize_rows, case)
    check_quantize_rows(case)


@budget(40)
@given(moe_cases())
def test_silu_mul_quantize_equals_format_core(case: MoECase):
    reproduce(check_silu_mul_quantize, case)
    check_silu_mul_quantize(case)


@pytest.mark.interpreter
@budget(10, shrink=False)
@given(ROUTING_CASES)
@example(MoECase(m=40, e=1500, topk=16, h=16, i=16, pattern="minus_one", remote=9))
def test_triton_routing_invariants(case: MoECase):
    # Up to 4800 slots and 300 experts: the chunked path (> 256 slots) and 1024-expert loop chunks.
    reproduce(check_routing, case, "triton")
    check_routing(case, "triton")


@pytest.mark.interpreter
@budget(6, shrink=False)
@given(moe_cases(max_e=7, max_m=8, max_topk=4, sizes=(16, 48)))
def test_triton_quantize_rows_equals_format_core(case: MoECase):
    reproduce(check_quantize_rows, case, "triton")
    check_quantize_rows(case, "triton")


# --------------------------------------------------------------------------- determinism, batch invariance


def _poison_workspace(backend: str, case: MoECase, inp: MoEInputs) -> None:
    """Fill the cached workspace the next call uses with 0xFF, so a stale read differs."""
    if backend != "reference":
        problem = MoEProblem(inp.x, inp.experts, inp.weights, inp.stage_ids, case.on_input, None)
        poison(*cached_workspace(_stage_set(backend, str(inp.x.device)), problem).tensors())


def check_deterministic_and_batch_invariant(case: MoECase, token: int, subset: list[int], backend: str = "reference",
                                            device: str = "cpu") -> None:
    """Two calls agree bitwise (the second on a poisoned workspace), and token ``token``'s row equals,
    bitwise, its row computed alone and within the sub-batch ``subset`` (in that order)."""
    inp = case.inputs(device)
    first = case.call(inp, backend)
    _poison_workspace(backend, case, inp)
    assert_same_buffers(case.call(inp, backend, out=torch.full_like(inp.x, float("nan"))), first,
                        f"{backend}: a second call")
    assert_same_buffers(case.call(inp.tokens([token]), backend), first[token : token + 1],
                        f"{backend}: token {token} alone")
    assert_same_buffers(case.call(inp.tokens(subset), backend), first[subset], f"{backend}: tokens {subset}")


def _with_subsets(cases: st.SearchStrategy[MoECase]) -> st.SearchStrategy:
    return cases.flatmap(lambda c: st.tuples(st.just(c), token_subsets(c)))


@budget(30)
@given(_with_subsets(moe_cases(min_m=1)))
@example((LARGE_E, (3, [5, 3, 0])))
def test_reference_deterministic_and_batch_invariant(drawn):
    case, (token, subset) = drawn
    reproduce(check_deterministic_and_batch_invariant, case, token, subset)
    check_deterministic_and_batch_invariant(case, token, subset)


# Across GEMM configurations: alone and in [8, 0] the table picks block_k 256 and split-K over 2
# ranges of K = 2048 (one program per tile on this "4-SM" CPU); the batch of 9 picks block_k 128, no split.
SPLIT_K = (MoECase(m=9, e=1, topk=1, h=2048, i=16, seed=3), (0, [8, 0]))


@pytest.mark.interpreter
@budget(3, shrink=False)
@given(_with_subsets(moe_cases(max_e=5, min_m=1, max_m=12, max_topk=3, sizes=(16, 32, 128))))
@example(SPLIT_K)
def test_triton_deterministic_and_batch_invariant(drawn):
    case, (token, subset) = drawn
    reproduce(check_deterministic_and_batch_invariant, case, token, subset, "triton")
    check_deterministic_and_batch_invariant(case, token, subset, "triton")


# --------------------------------------------------------------------------- GPU variants

GPU_BACKENDS = ["triton", "cutlass"]
# cutlass needs H and I multiples of 32; model-like widths too.
GPU_CASES = moe_cases(max_m=512, sizes=(32, 64, 96, 128, 256, 512), max_weights=2**24)


def _need(backend: str) -> None:
    if backend not in available_backends("cuda"):
        pytest.skip(f"{backend} does not run on this GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@gpu_budget(100)
@given(case=GPU_CASES)
@example(case=LARGE_E_GPU)
def test_backend_close_to_reference_gpu(backend: str, case: MoECase):
    _need(backend)
    reproduce(check_close_to_reference, case, backend, "cuda")
    check_close_to_reference(case, backend, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@gpu_budget(100)
@given(case=moe_cases(max_m=300, sizes=(32, 64, 128, 256)))
@example(case=LARGE_E_GPU)
def test_stages_gpu(backend: str, case: MoECase):
    _need(backend)
    reproduce(check_routing, case, backend, "cuda")
    check_routing(case, backend, "cuda")
    reproduce(check_quantize_rows, case, backend, "cuda")
    check_quantize_rows(case, backend, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@gpu_budget(60)
@given(drawn=_with_subsets(moe_cases(min_m=1, max_m=512, sizes=(32, 64, 128, 256), max_weights=2**24)))
def test_deterministic_and_batch_invariant_gpu(backend: str, drawn):
    _need(backend)
    case, (token, subset) = drawn
    reproduce(check_deterministic_and_batch_invariant, case, token, subset, backend, "cuda")
    check_deterministic_and_batch_invariant(case, token, subset, backend, "cuda")
