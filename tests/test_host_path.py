"""The fast host path of ``fused_moe``: plans (``pipeline``), bound launches (the CUDA library's bound
entries among them) and the eager operator call.

A forward shape's first call on a workspace runs the checked stage functions; later calls run
its plan, whose launches must be exactly the checked run's. With every launch stubbed and
recorded (``moe_fp4.bench.hostcost.stubbed_launches``) that is checked on the CPU for the
cutlass stage sets (every argument of every library call) and for Triton (every kernel, grid
and argument); the reference and Triton-interpreter forwards are checked bitwise.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch
from moe_cases import Case, make_experts, make_inputs
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from moe_fp4 import _op, fused_moe, pipeline, stages
from moe_fp4.backends import registry
from moe_fp4.bench.hostcost import noop_library, stubbed_launches
from moe_fp4.moe import MoEProblem
from moe_fp4.pipeline import cached_workspace, run_pipeline
from moe_fp4.testing import assert_same_buffers

# H, I multiples of 32 (the CUTLASS GEMM's requirement); each case names what it covers.
CASES = [
    Case(3, 6, 2, 64, 32, note="a few tokens: one routing launch"),
    Case(150, 6, 2, 64, 32, note="300 slots: the chunked routing (three launches)"),
    Case(4, 6, 3, 64, 32, on_input=True, note="router weights on the input: row_scale, plain-sum reduce"),
]
PATHS = [("cutlass", True, "w4a4"), ("cutlass", False, "w4a4"), ("cutlass", True, "w4a16"), ("triton", True, "w4a4")]
PATH_IDS = ["cutlass-sm90", "cutlass-sm100", "cutlass-sm90-w4a16", "triton"]


def _plain(v):
    return (v.data_ptr(), v.dtype, tuple(v.shape), v.stride()) if isinstance(v, torch.Tensor) else v


def launches(record: list) -> list:
    """The kernel launches of a ``stubbed_launches`` record (tensors by address, dtype, shape and strides;
    the library's size queries and its weight preparation, once per experts, left out)."""
    out = []
    for item in record:
        if len(item) == 2:
            if not item[0].endswith(("_workspace_size", "_prepare_weights")):
                out.append(item)
        else:
            name, grid, args, kwargs = item
            out.append((name, grid, tuple(map(_plain, args)), {k: _plain(v) for k, v in kwargs.items()}))
    return out


def _case_inputs(case: Case):
    gen = torch.Generator().manual_seed(case.seed)
    ex = make_experts(case, gen)
    x, w, ids = make_inputs(case, gen)
    return ex, x, w, ids


def _counting(monkeypatch) -> list:
    """A list that grows by one on every run of the checked stage functions (``pipeline._run_stages``)."""
    runs = []
    checked = pipeline._run_stages
    monkeypatch.setattr(pipeline, "_run_stages", lambda *a: runs.append(1) or checked(*a))
    return runs


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("backend, sm90, precision", PATHS, ids=PATH_IDS)
def test_a_plan_launches_exactly_what_the_checked_run_launched(case, backend, sm90, precision, monkeypatch):
    ex, x, w, ids = _case_inputs(case)
    out = torch.empty_like(x)
    runs = _counting(monkeypatch)
    record: list = []
    calls = []
    with stubbed_launches(record, sm90=sm90):
        # The W4A16 set's row stages are torch ops reading the routing, which no kernel writes here.
        mod = registry.get_backend_module(backend)
        stage_set = mod.stages_for(x.device, precision) if backend == "cutlass" else mod.STAGES
        for t in cached_workspace(stage_set, MoEProblem(x, ex, w, ids, case.on_input, out, precision)).tensors():
            t.zero_()
        for _ in range(3):  # the checked run, then the plan twice
            record.clear()
            fused_moe(x, ex, w, ids, backend=backend, out=out, validate=False, precision=precision,
                      apply_router_weight_on_input=case.on_input)
            calls.append(launches(record))
    assert len(runs) == 1
    assert calls[0] and calls[1] == calls[0] and calls[2] == calls[0]


def test_a_pinned_gemm_config_reaches_a_triton_plan():
    """A plan's GEMMs take the configuration pinned around the call, and the table's again after."""
    from moe_fp4.backends import triton as tb

    ex, x, w, ids = _case_inputs(Case(3, 6, 2, 256, 128, note="K = 256 and 128: two K steps of 64 or more"))
    record: list = []

    def gemms() -> list[tuple[int, int, bool]]:
        return [(r[3]["BM"], r[3]["BN"], r[3]["SPLIT"]) for r in record if r[0] == "grouped_gemm_kernel"]

    pinned = tb.kernels().GemmConfig(block_m=32, block_n=32, block_k=64, swap_ab=False, split_k=2)
    with stubbed_launches(record):
        fused_moe(x, ex, w, ids, backend="triton", validate=False)  # the checked run
        record.clear()
        fused_moe(x, ex, w, ids, backend="triton", validate=False)
        table = gemms()
        assert len(table) == 2 and (32, 32, True) not in table
        record.clear()
        with tb.pinned_gemm_config(pinned):
            fused_moe(x, ex, w, ids, backend="triton", validate=False)
        assert gemms() == [(32, 32, True)] * 2
        assert sum(r[0] == "split_k_reduce_kernel" for r in record) == 2
        record.clear()
        fused_moe(x, ex, w, ids, backend="triton", validate=False)
        assert gemms() == table


def test_a_bound_entry_passes_what_call_passes():
    record: list = []
    lib = noop_library(record)
    args = dict(topk_ids=11, num_slots=6, num_experts=4, expert_offsets=12, blockscale_offsets=13, slot_to_flat=14,
                flat_to_slot=15, workspace=None, workspace_bytes=0, device=-1, stream=None)
    lib.call("moe_fp4_routing", **args)
    bound = lib.bind("moe_fp4_routing", **{k: v for k, v in args.items() if k not in ("topk_ids", "stream")})
    assert bound.free == ("topk_ids", "stream")
    bound(11, None)
    assert len(record) == 2 and record[0] == record[1]
    with pytest.raises(TypeError, match=r"moe_fp4_routing: unexpected parameters \['experts'\]"):
        lib.bind("moe_fp4_routing", experts=4)
    with pytest.raises(TypeError, match=r"expected values of the free parameters \['topk_ids', 'stream'\], got 1"):
        bound(11)


# --------------------------------------------------------------------------- plans on real kernels


@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_reference_stages_on_a_workspace_equal_the_allocating_run(case):
    """The reference kernels have no ``bind``: a plan calls their methods (``bind_kernels``)."""
    ex, x, w, ids = _case_inputs(case)
    problem = MoEProblem(x, ex, w, ids, case.on_input, None)
    want = run_pipeline(stages.STAGES, problem)
    ws = cached_workspace(stages.STAGES, problem)
    for _ in range(3):  # the checked run, then the plan twice
        assert_same_buffers(run_pipeline(stages.STAGES, problem, ws), want, "reference on a workspace")
    assert len(ws.plans[ex]) == 1


@pytest.mark.interpreter
def test_the_triton_plan_equals_the_checked_run(device):
    """On the GPU when there is one, else in Triton's CPU interpreter."""
    case = CASES[2]
    ex, x, w, ids = _case_inputs(case)
    ex, x, w, ids = ex.to(device), x.to(device), w.to(device), ids.to(device)
    first = fused_moe(x, ex, w, ids, backend="triton", apply_router_weight_on_input=True)
    for _ in range(2):
        assert_same_buffers(fused_moe(x, ex, w, ids, backend="triton", apply_router_weight_on_input=True), first,
                            "triton plan")


# --------------------------------------------------------------------------- the plan cache


def _problem(case: Case = CASES[0]):
    ex, x, w, ids = _case_inputs(case)
    return MoEProblem(x, ex, w, ids, case.on_input, None)


def test_each_shape_has_its_plan_and_the_oldest_goes_first(monkeypatch):
    runs = _counting(monkeypatch)
    monkeypatch.setattr(pipeline, "MAX_PLANS", 2)
    p = _problem()
    ws = cached_workspace(stages.STAGES, p)
    shapes = [MoEProblem(p.hidden_states[:m], p.experts, p.topk_weights[:m], p.topk_ids[:m], False, None)
              for m in (3, 2, 1)]
    for q in shapes + shapes[1:]:
        run_pipeline(stages.STAGES, q, ws)
    assert len(runs) == 3  # M = 3, 2, 1 checked once each; M = 2 and 1 then run their plans
    assert [k[1] for k in ws.plans[p.experts]] == [2, 1]  # M = 3's plan was dropped
    run_pipeline(stages.STAGES, shapes[0], ws)
    assert len(runs) == 4


def test_a_mix_of_stage_sets_always_runs_the_checked_stages(monkeypatch):
    runs = _counting(monkeypatch)
    mixed = dataclasses.replace(stages.STAGES, grouped_gemm=stages.STAGES_W4A16.grouped_gemm)
    p = _problem()
    ws = cached_workspace(stages.STAGES, p)
    with pytest.raises(ValueError, match="expected values"):
        run_pipeline(mixed, p, ws)  # the checks still run: this GEMM needs Quantized.values
    relabelled = dataclasses.replace(stages.STAGES, moe_reduce=lambda *a, **k: stages.STAGES.moe_reduce(*a, **k))
    for _ in range(2):
        run_pipeline(relabelled, p, ws)
    assert len(runs) == 3 and not ws.plans.get(p.experts)


def test_replacing_a_global_scale_makes_a_new_plan(monkeypatch):
    runs = _counting(monkeypatch)
    p = _problem()
    ws = cached_workspace(stages.STAGES, p)
    before = run_pipeline(stages.STAGES, p, ws).clone()
    run_pipeline(stages.STAGES, p, ws)
    p.experts.a13_gs = p.experts.a13_gs * 2  # a new tensor: the plan's is stale
    after = run_pipeline(stages.STAGES, p, ws)
    assert len(runs) == 2 and not torch.equal(after, before)
    assert_same_buffers(after, run_pipeline(stages.STAGES, p), "after the new scale")


def test_plans_go_with_the_experts_and_a_dropped_workspace_is_freed_at_once(monkeypatch):
    monkeypatch.setattr(pipeline, "_WORKSPACES", {})
    p = _problem()
    ws = cached_workspace(stages.STAGES, p)
    for _ in range(2):
        run_pipeline(stages.STAGES, p, ws)
    experts = weakref.ref(p.experts)
    assert len(ws.plans) == 1
    gc.disable()  # freed by reference counting: no cycle through the plans
    try:
        del p
        assert experts() is None and len(ws.plans) == 0
        q = _problem()
        run_pipeline(stages.STAGES, q, ws)
        run_pipeline(stages.STAGES, q, ws)
        dropped = weakref.ref(ws)
        pipeline._WORKSPACES.clear()
        del ws
        assert dropped() is None, "a plan keeps its workspace alive"
    finally:
        gc.enable()


# --------------------------------------------------------------------------- the eager operator call


class _Passing(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Counting(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _op_args(p: MoEProblem, out=None):
    return (p.hidden_states, _op.tensors_of(p.experts), p.topk_weights, p.topk_ids, out)


def test_the_dispatcher_is_skipped_only_when_it_would_add_nothing():
    p = _problem()
    x, tensors, w, ids, _ = _op_args(p)
    assert _op._dispatcher_idle(x, tensors, w, ids, None)
    with _Passing():
        assert not _op._dispatcher_idle(x, tensors, w, ids, None)
    with _Counting():
        assert not _op._dispatcher_idle(x, tensors, w, ids, None)
    assert not _op._dispatcher_idle(torch.nn.Parameter(x, requires_grad=False), tensors, w, ids, None)
    wg = w.clone().requires_grad_(True)
    assert not _op._dispatcher_idle(x, tensors, wg, ids, None)  # the functional result would get a grad_fn
    assert _op._dispatcher_idle(x, tensors, wg, ids, torch.empty_like(x))  # out= records nothing
    with torch.no_grad():
        assert _op._dispatcher_idle(x, tensors, wg, ids, None)
    with torch.autograd.profiler.profile():
        assert not _op._dispatcher_idle(x, tensors, w, ids, None)


@pytest.mark.parametrize("with_out", [False, True], ids=["functional", "out"])
def test_the_direct_call_equals_the_operator_call(with_out):
    p = _problem(CASES[2])
    x, ex, w, ids = p.hidden_states, p.experts, p.topk_weights, p.topk_ids

    def call():
        out = torch.empty_like(x) if with_out else None
        got = fused_moe(x, ex, w, ids, backend="reference", apply_router_weight_on_input=True, out=out)
        assert got is out or not with_out
        return got

    direct = call()
    counting = _Counting()
    with counting:
        through_op = call()
    assert any("moe_fp4" in str(op) for op in counting.ops), "the mode saw no moe_fp4 operator"
    assert_same_buffers(direct, through_op, "direct vs operator")


def test_router_weights_that_require_grad_take_the_operator_as_before():
    p = _problem()
    wg = p.topk_weights.clone().requires_grad_(True)
    y = fused_moe(p.hidden_states, p.experts, wg, p.topk_ids, backend="reference")
    assert y.requires_grad and y.grad_fn is not None  # the operator's autograd fallback, as through the dispatcher


def test_a_bound_entry_holds_the_scratch_it_was_given():
    # A stage call without a workspace allocates its scratch; only the bound entry holds it, and it
    # must until the launch (compute-sanitizer's memcheck found the routing kernel writing it freed).
    from moe_fp4.backends import cutlass
    from moe_fp4.buffers import RoutingData

    made = []

    def scratch(name, nbytes):
        t = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        made.append(weakref.ref(t))
        return t

    with stubbed_launches():
        entry = cutlass._Kernels()._routing(RoutingData.empty(6, 5000, torch.device("cpu")), scratch)
        assert made and made[0]() is not None
        del entry
        assert made[0]() is None
