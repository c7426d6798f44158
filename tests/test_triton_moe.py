"""``fused_moe(..., backend="triton")`` against the reference backend.

Every call gets fresh random inputs, an output poisoned with NaN and, for the cached
workspaces, buffers poisoned with 0xFF (NaN in every float view, NaN scales, -6 codes), so
an element or byte a kernel forgets to write fails the comparison. The edge cases run in
Triton's CPU interpreter here; on a GPU the same tests run compiled, together with the
``gpu``-marked ones: the 640-case grid, CUDA-graph capture and replay, no host sync and no
allocation per call, and ``python -m moe_fp4 demo``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gpu_report import record
from moe_cases import EDGE_CASES, GRID, GRID_IDS, Case, grid_case, make_experts, make_inputs

import moe_fp4.backends.triton as tb
from moe_fp4 import NvFp4Experts, fused_moe
from moe_fp4.backends.registry import why_unavailable as registry_why_unavailable
from moe_fp4.moe import MoEProblem
from moe_fp4.pipeline import cached_workspace
from moe_fp4.testing import errors, poison, served_ids

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]

# Tolerances of the whole forward against the exact reference. Both compute the same
# bits up to float32 summation order in the two GEMMs. That order changes a 16-bit GEMM
# output by at most one unit in the last place (2^-8 relative for bf16), so the RMS
# relative error stays below 2^-8 ~ 4e-3 ... unless such a one-ulp change in GEMM1's output
# moves an element of the re-quantized intermediate across an E2M1 rounding boundary. That
# is rare (~1e-5 per element) and changes one row's y by at most about
# (block amax / 3) * max|w2| ~ max|ref| / sqrt(I), i.e. a few percent of the largest output.
RMS_TOL = 1e-2
MAX_TOL = 0.1


def poison_workspace(x, experts: NvFp4Experts, w, ids) -> None:
    """Create (if needed) and poison with 0xFF the cached workspace the call on these inputs uses."""
    problem = MoEProblem(x, experts, w.float(), ids.int(), False, None)
    poison(*cached_workspace(tb.stages_for_problem(problem), problem).tensors())


moe_errors = errors  # (norm-relative error, max error relative to max |ref|)


def run_and_compare(x, ex, w, ids, on_input=False, **kwargs) -> tuple[float, float]:
    """Triton (poisoned out and workspace) vs reference; asserts exact zeros where nothing is served."""
    poison_workspace(x, ex, w, ids)
    out = torch.full_like(x, float("nan"))
    got = fused_moe(x, ex, w, ids, backend="triton", apply_router_weight_on_input=on_input, out=out, **kwargs)
    ref = fused_moe(x, ex, w, served_ids(ids, ex.num_experts), backend="reference",
                    apply_router_weight_on_input=on_input)
    assert got.data_ptr() == out.data_ptr() and got.dtype == x.dtype
    assert not bool(got.isnan().any()), "unwritten or NaN output elements"
    unserved = ((ids < 0) | (ids >= ex.num_experts)).all(dim=1)
    assert bool((got[unserved] == 0).all()), "a token with no served expert must be exactly 0"
    rms, mx = moe_errors(got, ref)
    record("fused_moe", rms_rel=rms, max_rel=mx)
    assert rms <= RMS_TOL and mx <= MAX_TOL, (rms, mx)
    return rms, mx


@pytest.mark.parametrize("case", EDGE_CASES, ids=str)
def test_edge_cases_match_reference(device, case: Case):
    gen = torch.Generator().manual_seed(1000 + EDGE_CASES.index(case))
    ex = make_experts(case, gen, device)
    x, w, ids = make_inputs(case, gen, device)
    run_and_compare(x, ex, w, ids, case.on_input)


EXTRA_CASES = [
    (Case(4, 1100, 3, 32, 16), "E > 1024 (two expert chunks everywhere)"),
    (Case(45, 6, 6, 32, 16, routing="with_minus_one"), "M*topk > 256: the chunked routing path; topk == E"),
    (Case(2, 3, 3, 64, 64, dtype=torch.float16, split_gate_up=True, on_input=True),
     "fp16, split gate/up, weights on input, topk == E"),
]


@pytest.mark.parametrize("case,note", EXTRA_CASES, ids=[n for _, n in EXTRA_CASES])
def test_more_edges_match_reference(device, case: Case, note):
    gen = torch.Generator().manual_seed(7)
    ex = make_experts(case, gen, device)
    x, w, ids = make_inputs(case, gen, device)
    run_and_compare(x, ex, w, ids, case.on_input)


PINNED_CONFIGS = [
    ((16, 32, 64, False), "no-swap-small"),
    ((64, 16, 64, True), "swap-bm64"),
    ((32, 64, 128, False), "no-swap-bk128"),  # BK > K in both GEMMs
    ((16, 64, 64, True, 4, 2, 2), "split-k-2"),  # GEMM1 (K = 96) in two K ranges; GEMM2 (K = 48) cannot split
    ((16, 16, 64, False, 4, 2, 0, "float"), "float-dequant-auto-split"),
    ((16, 32, 64, True, 4, 3, 1, "bits-plain"), "bits-plain"),
]


@pytest.mark.parametrize("config", [c for c, _ in PINNED_CONFIGS], ids=[n for _, n in PINNED_CONFIGS])
def test_pinned_gemm_configs(device, config):
    """The result does not depend on the tile configuration (non-swapped, swapped, BK > K, split-K, dequant mode)."""
    case = Case(9, 5, 3, 96, 48, routing="with_minus_one")
    gen = torch.Generator().manual_seed(sum(config[:4]))
    ex = make_experts(case, gen, device)
    x, w, ids = make_inputs(case, gen, device)
    with tb.pinned_gemm_config(tb.kernels().GemmConfig(*config)):
        run_and_compare(x, ex, w, ids)


@pytest.mark.parametrize("m,e", [(3, 4), (100, 2)], ids=["decode", "prefill"])
def test_the_codes_table_of_10x_runs_the_whole_forward(device, monkeypatch, m, e):
    """The whole forward with the codes GEMM's table for compute capability 10.x (``GEMM_CONFIGS_SM100``, chosen
    by the capability, here patched: the CPU has none) against the reference: at decode (its 16 x 64 x 128 tile,
    K split) and past 96 rows per expert (its 128 x 64 x 128 prefill tile, I = 96 not a multiple of 64)."""
    from moe_fp4.triton_kernels import gemm as tg

    monkeypatch.setattr(tg, "_major", lambda device: 10)
    case = Case(m, e, 2, 64, 96, routing="with_minus_one" if m > 3 else "random")
    gen = torch.Generator().manual_seed(m + e)
    ex = make_experts(case, gen, device)
    x, w, ids = make_inputs(case, gen, device)
    cfg = tb.kernels().gemm_config(m * 2, e, False, 192, torch.device(device))
    assert cfg == tb.kernels().GEMM_CONFIGS_SM100[0 if m == 3 else -1][1]
    run_and_compare(x, ex, w, ids)


def test_ids_outside_range_without_validation(device):
    """validate=False: ids outside [-1, E) count as not served, never index memory."""
    case = Case(6, 4, 2, 64, 32)
    gen = torch.Generator().manual_seed(5)
    ex = make_experts(case, gen, device)
    x, w, ids = make_inputs(case, gen, device)
    ids[0] = 99
    ids[1, 0] = -7
    ids[2, 1] = 4
    run_and_compare(x, ex, w, ids, validate=False)


def test_expert_map(device):
    """Global ids through expert_map (-1 = not on this rank) equal the reference."""
    case = Case(6, 4, 2, 64, 32)
    gen = torch.Generator().manual_seed(6)
    ex = make_experts(case, gen, device)
    x, w, _ = make_inputs(case, gen, device)
    gids = torch.tensor([[0, 7], [3, 9], [8, 1], [2, 5], [6, 4], [9, 0]], dtype=torch.int64, device=device)
    emap = torch.tensor([-1, -1, 0, -1, 1, -1, 2, -1, 3, -1], device=device)
    got = fused_moe(x, ex, w, gids, expert_map=emap, backend="triton")
    want = fused_moe(x, ex, w, gids, expert_map=emap, backend="reference")
    assert got[0].abs().sum() == 0
    rms, mx = moe_errors(got, want)
    assert rms <= RMS_TOL and mx <= MAX_TOL


def test_consecutive_calls_share_a_workspace(device):
    """Different M in one row bucket, then back: each call is right (no stale routing or rows)."""
    case = Case(5, 8, 2, 64, 32)
    gen = torch.Generator().manual_seed(8)
    ex = make_experts(case, gen, device)
    for m in (5, 3, 7):
        x, w, ids = make_inputs(Case(m, 8, 2, 64, 32), gen, device)
        out = fused_moe(x, ex, w, ids, backend="triton")
        rms, mx = moe_errors(out, fused_moe(x, ex, w, ids, backend="reference"))
        assert rms <= RMS_TOL and mx <= MAX_TOL


def test_why_unavailable(monkeypatch):
    """On CPU only in the interpreter (and says so); on CUDA from compute capability 8.0."""
    why = tb.why_unavailable(torch.device("cuda"), (7, 5))
    assert why is not None and "8.0" in why
    assert tb.why_unavailable(torch.device("cuda"), (9, 0)) is None
    if tb.kernels().INTERPRET:
        assert tb.why_unavailable(torch.device("cpu"), None) is None
        assert registry_why_unavailable("triton", "cpu") is None
        monkeypatch.setenv("TRITON_INTERPRET", "0")  # the kernels were made for the interpreter
        why = tb.why_unavailable(torch.device("cpu"), None)
        assert "interpreter" in why and "TRITON_INTERPRET" in why


def test_pinned_config_needs_a_gemm_config():
    with pytest.raises(TypeError, match="config: expected a GemmConfig"):
        with tb.pinned_gemm_config((16, 16, 32, True)):
            pass


# --------------------------------------------------------------------------- GPU only

@pytest.mark.gpu
@pytest.mark.parametrize("dtype,e,nk,m,topk", GRID, ids=GRID_IDS)
def test_issue_grid_gpu(dtype, e, nk, m, topk):
    """The grid m x (n, k) x e x topk x dtype (640 cases, vLLM's NVFP4 MoE test grid), fresh inputs per case,
    with the codes operand: on 9.x the default is the values operand for every (n, k) of the grid, which
    ``test_triton_values.py``'s grid runs, so this one keeps the codes GEMM (every other GPU's) covered here;
    then the plan's calls, the last of them replayed, against the first."""
    ex, x, w, ids = grid_case(dtype, e, nk, m, topk)
    with tb.operand_form("codes"):
        run_and_compare(x, ex, w, ids)
        # The shape's plan (its first call here), then on copies of the inputs the call that learns its launches
        # and two replays (with the CUDA library): each bit for bit the plan's first call.
        first = fused_moe(x, ex, w, ids, backend="triton")
        for _ in range(3):
            assert torch.equal(fused_moe(x.clone(), ex, w.clone(), ids.clone(), backend="triton"), first)


def _qwen_layer(dtype=torch.bfloat16):
    e, h, i = 128, 2048, 768
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, generator=gen, device="cuda", dtype=dtype) / 15
    w2 = torch.randn(e, h, i, generator=gen, device="cuda", dtype=dtype) / 15
    return NvFp4Experts.quantize(w13, w2, a13_gs=2688.0 / 0.5, a2_gs=2688.0 / 1.0), gen


def _random_inputs(m: int, ex: NvFp4Experts, topk: int, gen, dtype=torch.bfloat16):
    x = (torch.randn(m, ex.hidden_size, generator=gen, device="cuda") / 10).to(dtype)
    w, ids = torch.softmax(torch.randn(m, ex.num_experts, generator=gen, device="cuda"), -1).topk(topk, -1)
    return x, w, ids.to(torch.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64, 512])
def test_cuda_graph_capture_and_replay_gpu(m):
    """Capture fused_moe once; replay on new inputs copied into the captured buffers; each replay is right."""
    ex, gen = _qwen_layer()
    x, w, ids = _random_inputs(m, ex, 8, gen)
    out = torch.empty_like(x)
    fused_moe(x, ex, w, ids, backend="triton", out=out)  # compile and create the workspace
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(x, ex, w, ids, backend="triton", out=out, validate=False)
    previous = None
    for _ in range(3):
        nx, nw, nids = _random_inputs(m, ex, 8, gen)
        x.copy_(nx)
        w.copy_(nw)
        ids.copy_(nids)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = fused_moe(nx, ex, nw, nids, backend="reference")
        rms, mx = moe_errors(out, ref)
        record("cuda_graph_replay", rms_rel=rms, max_rel=mx)
        assert rms <= RMS_TOL and mx <= MAX_TOL
        assert previous is None or not torch.equal(out, previous)  # the replay used the new inputs
        previous = out.clone()


@pytest.mark.gpu
@pytest.mark.parametrize("m,on_input", [(1, False), (16, True), (600, False)])
def test_no_host_sync_and_no_allocation_gpu(m, on_input):
    """validate=False: no synchronizing CUDA call, and (with out=) not a single new allocation per call."""
    ex, gen = _qwen_layer()
    x, w, ids = _random_inputs(m, ex, 8, gen)
    out = torch.empty_like(x)
    fused_moe(x, ex, w, ids, backend="triton", out=out, apply_router_weight_on_input=on_input)  # warm up
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            fused_moe(x, ex, w, ids, backend="triton", out=out, validate=False, apply_router_weight_on_input=on_input)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before


@pytest.mark.gpu
def test_demo_picks_triton_gpu():
    """`python -m moe_fp4 demo` on a Hopper/Ampere GPU picks triton and agrees with the reference."""
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "moe_fp4", "demo"], capture_output=True, text=True, env=env,
                          cwd=root, timeout=600)
    record("demo", exit_status=proc.returncode)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cap = torch.cuda.get_device_capability()
    if cap[0] in (8, 9):
        assert "backend: triton" in proc.stdout, proc.stdout
    assert "OK" in proc.stdout
