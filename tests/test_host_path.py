"""The fast host path of ``fused_moe``: plans (``pipeline``), bound launches (the CUDA library's bound
entries among them) and the eager operator call.

A forward shape's first call on a workspace runs the checked stage functions; later calls run
its plan, whose launches must be exactly the checked run's, but where a plan fuses launches (the
tests of each fusion say which and check its output bit for bit). With every launch stubbed and
recorded (``moe_fp4.bench.hostcost.stubbed_launches``) that is checked on the CPU for the
cutlass stage sets (every argument of every library call) and for Triton (every kernel, grid
and argument); the reference and Triton-interpreter forwards are checked bitwise.
"""

from __future__ import annotations

import dataclasses
import gc
import warnings
import weakref

import pytest
import torch
from moe_cases import Case, make_experts, make_inputs
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from moe_fp4 import _native, _op, fused_moe, pipeline, stages
from moe_fp4.backends import cutlass
from moe_fp4.bench.hostcost import noop_library, stubbed_launches
from moe_fp4.moe import MoEProblem
from moe_fp4.pipeline import cached_workspace, run_pipeline
from moe_fp4.testing import assert_same_buffers

# H, I multiples of 32 (the CUTLASS GEMM's requirement); each case names what it covers.
CASES = [
    Case(3, 6, 2, 64, 32, note="a few tokens: one routing launch"),
    Case(150, 6, 2, 64, 32, note="300 slots: past one routing tile (CUDA: a block per tile; Triton: chunked)"),
    Case(4, 6, 3, 64, 32, on_input=True, note="router weights on the input: row_scale, plain-sum reduce"),
]
PATHS = [("cutlass", True, "w4a4"), ("cutlass", False, "w4a4"), ("cutlass", True, "w4a16"), ("triton", True, "w4a4")]
PATH_IDS = ["cutlass-sm90", "cutlass-sm100", "cutlass-sm90-w4a16", "triton"]


def _plain(v):
    return (v.data_ptr(), v.dtype, tuple(v.shape), v.stride()) if isinstance(v, torch.Tensor) else v


def launches(record: list) -> list:
    """The kernel launches of a ``stubbed_launches`` record (tensors by address, dtype, shape and strides;
    the library's size and plan queries and its weight preparation, once per experts, left out)."""
    out = []
    for item in record:
        if len(item) == 2:
            if not item[0].endswith(("_workspace_size", "_gemm_plan", "_prepare_weights")):
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


def fused_routing(launched: list) -> list:
    """A checked run's ``launched`` entries as a plan that routes and quantizes in one launch runs them: the
    routing and the first quantization replaced by ``moe_fp4_routing_quantize_values`` on their arguments
    (the same ids, rows, scales, routing outputs and values buffer), the rest unchanged."""
    (rname, rargs), (qname, qargs), *rest = launched
    assert (rname, qname) == ("moe_fp4_routing", "moe_fp4_quantize_rows"), (rname, qname)
    named = {**{p: v for (p, _), v in zip(_native.signature(qname), qargs, strict=True)},
             **{p: v for (p, _), v in zip(_native.signature(rname), rargs, strict=True)}}
    fused = "moe_fp4_routing_quantize_values"
    return [(fused, tuple(named[p] for p, _ in _native.signature(fused))), *rest]


def fused_silu(launched: list) -> list:
    """``launched`` as a plan whose first GEMM computes SiLU-and-mul in its epilogue runs it: the first GEMM
    and the SiLU-and-mul quantization replaced by ``moe_fp4_sm90_gemm_silu`` on their arguments (the GEMM's
    operands, configuration and workspace, the quantization's global scales and values buffer)."""
    i = next(j for j, (name, _) in enumerate(launched) if name == "moe_fp4_silu_mul_quantize")
    (gname, gargs), (sname, sargs) = launched[i - 1], launched[i]
    assert gname == "moe_fp4_sm90_grouped_gemm_ws", gname
    named = {**{p: v for (p, _), v in zip(_native.signature(gname), gargs, strict=True)},
             **{p: v for (p, _), v in zip(_native.signature(sname), sargs, strict=True)},
             "slices": 0, "cta_splits": 0, "gs_splits": 0}
    assert named["sections"] == 2, named["sections"]
    fused = "moe_fp4_sm90_gemm_silu"
    return [*launched[:i - 1], (fused, tuple(named[p] for p, _ in _native.signature(fused))), *launched[i + 1:]]


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("backend, sm90, precision", PATHS, ids=PATH_IDS)
def test_a_plan_launches_exactly_what_the_checked_run_launched(case, backend, sm90, precision, monkeypatch):
    """The plan's launches are the checked run's, but for a cutlass plan on sm_90a (either precision), which
    runs its first GEMM with SiLU-and-mul in the epilogue (where cutlass.fuses_silu) and, up to
    FUSED_ROUTING_MAX slots, routes and quantizes in one launch, on the same arguments."""
    ex, x, w, ids = _case_inputs(case)
    out = torch.empty_like(x)
    runs = _counting(monkeypatch)
    record: list = []
    calls = []
    with stubbed_launches(record, sm90=sm90):
        for _ in range(3):  # the checked run, then the plan twice
            record.clear()
            fused_moe(x, ex, w, ids, backend=backend, out=out, validate=False, precision=precision,
                      apply_router_weight_on_input=case.on_input)
            calls.append(launches(record))
    assert len(runs) == 1
    sm90_plan = (backend, sm90) == ("cutlass", True)
    want = fused_silu(calls[0]) if sm90_plan and cutlass.fuses_silu(ids.numel(), case.e) else calls[0]
    want = fused_routing(want) if sm90_plan and ids.numel() <= cutlass.FUSED_ROUTING_MAX else want
    assert calls[0] and calls[1] == want and calls[2] == want


def _live_storages() -> set:
    """The storages of every live tensor with one (the scan's isinstance touches deprecated torch objects:
    quiet; fake tensors left by compile tests have no data pointer: skipped)."""
    gc.collect()
    ptrs = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        for o in gc.get_objects():
            if isinstance(o, torch.Tensor) and not o.is_meta and o.numel() > 0:
                try:
                    ptrs.add(o.untyped_storage().data_ptr())
                except (RuntimeError, NotImplementedError):
                    pass
    return ptrs


@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("backend, sm90, precision", PATHS, ids=PATH_IDS)
def test_a_plan_keeps_no_tensor_of_a_call_alive(backend, sm90, precision, ids_dtype):
    """After a plan's call returns, nothing it allocated is alive but its output. CUDA graphs of
    ``torch.compile(mode="reduce-overhead")`` run the plan with the graph's memory pool and refuse a
    graph whose pool holds a tensor that is not an output: the fused routing and quantization launch
    kept its call's topk_ids (converted to int32 in the graph), which failed the reduce-overhead
    compile test of the cutlass backend on the H100 (tests/results/h100-2026-12-07-s42). int64 ids are
    converted per call (the kept tensor is then the conversion); int32 ones are the caller's."""
    ex, x, w, ids = _case_inputs(CASES[0])
    ids = ids.to(ids_dtype)
    with stubbed_launches(sm90=sm90):
        fused_moe(x, ex, w, ids, backend=backend, validate=False, precision=precision)  # the checked run
        before = _live_storages()
        for _ in range(2):  # the plan
            args = (x.clone(), w.clone(), ids.clone())
            fused_moe(args[0], ex, args[1], args[2], backend=backend, validate=False, precision=precision)
            del args
        left = _live_storages() - before
    assert not left, f"{len(left)} tensor(s) of a plan's call still alive after it"


class _Made(TorchDispatchMode):
    """Records the storage of every tensor an operator makes on this thread (dispatch modes are per thread,
    as CUDA graph trees' routing of allocations into their pool is); the fused_moe operator's implementation
    runs under the mode too, so what it makes is seen."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, str] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.moe_fp4.fused_moe.default:
            with self:
                out = _op._fused_moe_impl(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.numel() > 0:
                self.storages.setdefault(o.untyped_storage().data_ptr(), str(func))
        return out


@pytest.mark.parametrize("backend, sm90, precision", PATHS, ids=PATH_IDS)
def test_a_first_call_keeps_nothing_it_made_on_the_calling_thread_alive(backend, sm90, precision):
    """A shape's first call (new experts, workspace and plan) leaves alive nothing it allocated on the calling
    thread but its output. CUDA graph trees (``torch.compile(mode="reduce-overhead")``) run a graph's warm-up
    with every allocation of the calling thread routed into the graphs' pool and refuse a graph whose pool
    holds a tensor that is not an output: a model compiled before its first call of a shape (transformers'
    compiled decode step) would put the workspace, the prepared weights and the plan's buffers there. They
    are made on a thread of their own (``pipeline.off_graph_pool``). On the old code, 15-24 of them were left."""
    ex, x, w, ids = _case_inputs(CASES[0])
    made = _Made()
    with stubbed_launches(sm90=sm90):
        with made:
            out = fused_moe(x, ex, w, ids, backend=backend, validate=False, precision=precision)
        alive = _live_storages() - {t.untyped_storage().data_ptr() for t in (out, x, w, ids)}
    left = {ptr: op for ptr, op in made.storages.items() if ptr in alive}
    assert made.storages, "the mode saw nothing"
    assert not left, f"{len(left)} tensor(s) made on the calling thread alive after the call: {sorted(left.values())}"


def test_off_graph_pool_runs_with_the_callers_state():
    """The function runs on another thread with the caller's inference mode and context variables, grad off,
    and its exception reaches the caller; nested, it runs where it is."""
    import contextvars
    import threading

    var = contextvars.ContextVar("moe_fp4_test_var", default=None)
    var.set("caller")
    caller = threading.get_ident()
    cpu = torch.device("cpu")

    def probe():
        nested = pipeline.off_graph_pool(cpu, threading.get_ident)
        return threading.get_ident(), nested, var.get(), torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    ident, nested, value, inference, grad = pipeline.off_graph_pool(cpu, probe)
    assert ident != caller and nested == ident and value == "caller" and not inference and not grad
    with torch.inference_mode():
        assert pipeline.off_graph_pool(cpu, probe)[3]

    def fail():
        raise ValueError("from the thread")

    with pytest.raises(ValueError, match="from the thread"):
        pipeline.off_graph_pool(cpu, fail)


@pytest.mark.parametrize("in_gemm", [False, True], ids=["reduce-launch", "split-k-in-gemm"])
def test_a_pinned_gemm_config_reaches_a_triton_plan(monkeypatch, in_gemm):
    """A plan's GEMMs take the configuration pinned around the call, and the table's again after; a split first
    GEMM adds its K ranges in its own launch with ``FUSE_SPLIT_K_IN_GEMM``, in a reduce launch without."""
    from moe_fp4.backends import triton as tb

    monkeypatch.setattr(tb, "FUSE_SPLIT_K_IN_GEMM", in_gemm)

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
        # GEMM1's K ranges added by its last ranges (FUSE_SPLIT_K_IN_GEMM) or by a launch of their own; GEMM2's with
        # the top-k reduce (FUSE_TOPK_REDUCE)
        fixup = [r[3].get("FIXUP", False) for r in record if r[0] == "grouped_gemm_kernel"]
        assert fixup == [in_gemm, False], fixup
        assert [r[0] for r in record if "reduce" in r[0]] == (
            ["split_k_topk_reduce_kernel"] if in_gemm else ["split_k_reduce_kernel", "split_k_topk_reduce_kernel"])
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


@pytest.mark.interpreter
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "FUSE_TOPK_REDUCE-off"])
@pytest.mark.parametrize("form", ["codes", "values"])
@pytest.mark.parametrize("case", [Case(2, 6, 4, 64, 128, routing="with_minus_one"),
                                  Case(3, 5, 2, 64, 128, dtype=torch.float16, on_input=True)], ids=str)
def test_a_triton_plan_adds_gemm2s_k_ranges_in_the_reduce(device, form, case, fuse, monkeypatch):
    """Where the second GEMM splits K, a plan's top-k reduce adds its K ranges (one launch fewer than the
    checked run, which launches the split-K reduce and then moe_reduce), with the checked run's output bit
    for bit; with FUSE_TOPK_REDUCE off, the checked run's launches. On the GPU when there is one (compute
    capability 9.x for the values form), else in Triton's CPU interpreter."""
    from moe_fp4.backends import triton as tb
    from moe_fp4.triton_kernels import _common

    if form == "values" and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] != 9:
        pytest.skip("the Triton values operand is built for compute capability 9.x")
    monkeypatch.setattr(tb, "FUSE_TOPK_REDUCE", fuse)
    launched: list[str] = []
    call = _common.Launch.__call__
    monkeypatch.setattr(_common.Launch, "__call__",
                        lambda self, *free: (launched.append(self._kernel.__name__), call(self, *free))[1])
    ex, x, w, ids = (t.to(device) for t in _case_inputs(case))
    split = tb.kernels().GemmConfig(16, 32, 64, swap_ab=True, split_k=2)  # GEMM2 (K = 128): 2 ranges; GEMM1 none
    with tb.operand_form(form), tb.pinned_gemm_config(split):
        first = fused_moe(x, ex, w, ids, backend="triton", apply_router_weight_on_input=case.on_input).clone()
        launched.clear()
        again = fused_moe(x, ex, w, ids, backend="triton", apply_router_weight_on_input=case.on_input)
    assert_same_buffers(again, first, "triton plan")
    assert ("split_k_topk_reduce_kernel" in launched) == fuse, launched
    assert ("split_k_reduce_kernel" in launched) != fuse and ("moe_reduce_kernel" in launched) != fuse, launched


@pytest.mark.interpreter
@pytest.mark.parametrize("split", [2, 1], ids=["split", "unsplit"])
@pytest.mark.parametrize("form", ["codes", "values"])
@pytest.mark.parametrize("case", [Case(2, 6, 4, 128, 128, routing="with_minus_one"),
                                  Case(3, 5, 2, 128, 128, dtype=torch.float16, on_input=True)], ids=str)
def test_a_triton_plan_takes_the_reduces_into_its_gemms(device, form, case, split, monkeypatch):
    """With FUSE_SPLIT_K_IN_GEMM and FUSE_TOPK_IN_GEMM, a plan launches no reduce kernel: the first GEMM adds its
    own K ranges (where it splits) and the second takes its K ranges' sum and the top-k reduce, with the
    checked run's output bit for bit, twice. On the GPU when there is one (compute capability 9.x for the
    values form), else in Triton's CPU interpreter."""
    from moe_fp4.backends import triton as tb
    from moe_fp4.triton_kernels import _common

    if form == "values" and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] != 9:
        pytest.skip("the Triton values operand is built for compute capability 9.x")
    monkeypatch.setattr(pipeline, "_WORKSPACES", {})  # plans bound under these flags, not taken from the cache
    monkeypatch.setattr(tb, "FUSE_SPLIT_K_IN_GEMM", True)
    monkeypatch.setattr(tb, "FUSE_TOPK_IN_GEMM", True)
    launched: list[tuple[str, bool]] = []
    call = _common.Launch.__call__
    monkeypatch.setattr(_common.Launch, "__call__", lambda self, *free: (
        launched.append((self._kernel.__name__, self._constants.get("SPLIT", False))), call(self, *free))[1])
    ex, x, w, ids = (t.to(device) for t in _case_inputs(case))
    pinned = tb.kernels().GemmConfig(16, 32, 64, swap_ab=True, split_k=split)  # K = 128: 2 ranges in both GEMMs
    with tb.operand_form(form), tb.pinned_gemm_config(pinned):
        first = fused_moe(x, ex, w, ids, backend="triton", apply_router_weight_on_input=case.on_input).clone()
        for _ in range(2):
            launched.clear()
            again = fused_moe(x, ex, w, ids, backend="triton", apply_router_weight_on_input=case.on_input)
            assert_same_buffers(again, first, "triton plan")
            assert not [name for name, _ in launched if "reduce" in name], launched
            assert [s for name, s in launched if name == "grouped_gemm_kernel"] == [split > 1] * 2, launched


@pytest.mark.interpreter
@pytest.mark.parametrize("case", [Case(2, 6, 4, 128, 128, routing="with_minus_one"),
                                  Case(3, 5, 2, 128, 128, dtype=torch.float16, on_input=True)], ids=str)
def test_a_triton_decode_plan_is_three_launches_with_the_silu_in_the_first_gemm(device, case, monkeypatch):
    """The values form with FUSE_SILU = "split" as well: the routing with the first quantization, the first GEMM
    (its K ranges' sum and the SiLU-and-mul quantization by its last programs), the second GEMM (with the top-k
    reduce): three launches, the checked run's output bit for bit, twice."""
    from moe_fp4.backends import triton as tb
    from moe_fp4.triton_kernels import _common

    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] != 9:
        pytest.skip("the Triton values operand is built for compute capability 9.x")
    monkeypatch.setattr(pipeline, "_WORKSPACES", {})
    for name, value in (("FUSE_SPLIT_K_IN_GEMM", True), ("FUSE_TOPK_IN_GEMM", True), ("FUSE_SILU", "split")):
        monkeypatch.setattr(tb, name, value)
    launched: list[str] = []
    call = _common.Launch.__call__
    monkeypatch.setattr(_common.Launch, "__call__",
                        lambda self, *free: (launched.append(self._kernel.__name__), call(self, *free))[1])
    ex, x, w, ids = (t.to(device) for t in _case_inputs(case))
    pinned = tb.kernels().GemmConfig(16, 32, 64, swap_ab=True, split_k=2)  # K = 128: 2 ranges in both GEMMs
    with tb.operand_form("values"), tb.pinned_gemm_config(pinned):
        first = fused_moe(x, ex, w, ids, backend="triton", apply_router_weight_on_input=case.on_input).clone()
        for _ in range(2):
            launched.clear()
            again = fused_moe(x, ex, w, ids, backend="triton", apply_router_weight_on_input=case.on_input)
            assert_same_buffers(again, first, "triton plan")
            assert launched == ["routing_quantize_kernel", "grouped_gemm_kernel", "grouped_gemm_kernel"], launched


@pytest.mark.interpreter
@pytest.mark.parametrize("split", [2, 1], ids=["split", "unsplit"])
@pytest.mark.parametrize("form", ["codes", "values"])
def test_a_triton_plan_with_the_reduces_in_its_gemms_writes_zeros_where_nothing_is_served(device, form, split,
                                                                                          monkeypatch):
    """Every id -1 (expert parallelism: no expert of this rank chosen): no row tile counts in, and the second
    GEMM's launch still writes the top-k reduce's zeros over the poisoned output, twice."""
    from moe_fp4.backends import triton as tb

    if form == "values" and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] != 9:
        pytest.skip("the Triton values operand is built for compute capability 9.x")
    monkeypatch.setattr(pipeline, "_WORKSPACES", {})
    monkeypatch.setattr(tb, "FUSE_SPLIT_K_IN_GEMM", True)
    monkeypatch.setattr(tb, "FUSE_TOPK_IN_GEMM", True)
    case = Case(2, 6, 4, 128, 128)
    ex, x, w, ids = (t.to(device) for t in _case_inputs(case))
    ids = torch.full_like(ids, -1)
    pinned = tb.kernels().GemmConfig(16, 32, 64, swap_ab=True, split_k=split)
    with tb.operand_form(form), tb.pinned_gemm_config(pinned):
        for _ in range(3):  # the checked run, then the plan twice
            out = torch.full_like(x, float("nan"))
            fused_moe(x, ex, w, ids, backend="triton", out=out)
            assert bool((out == 0).all()), out


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


# --------------------------------------------------------------------------- the argument checks' quick path


def _variants(x, w, ids, E):  # noqa: N803
    """Arguments of ``moe._check_arguments`` (as keyword dicts) that pass and that fail, one change each."""
    base = dict(hidden_states=x, topk_weights=w, topk_ids=ids, backend="reference", apply_router_weight_on_input=False,
                expert_map=None, out=None, precision="w4a4")
    changes = [
        {}, dict(out=torch.empty_like(x)), dict(topk_ids=ids.long()), dict(topk_weights=w.half()),
        dict(topk_weights=w.t().contiguous().t()), dict(topk_ids=ids.t().contiguous().t()),  # non-contiguous: allowed
        dict(expert_map=torch.arange(E, dtype=torch.int32)), dict(expert_map=torch.arange(2 * E)),
        dict(hidden_states=x.half(), out=torch.empty_like(x).half()), dict(precision="w4a16"),
        dict(apply_router_weight_on_input=True), dict(hidden_states=torch.nn.Parameter(x, requires_grad=False)),
        # each of these is refused
        dict(hidden_states=x.float()), dict(hidden_states=x[None]), dict(hidden_states=x[:, :16].contiguous()),
        dict(hidden_states=torch.cat([x, x], 1)[:, ::2]), dict(hidden_states=x.to("meta")), dict(hidden_states="x"),
        dict(topk_ids=ids.float()), dict(topk_ids=ids[:1]), dict(topk_ids=ids[:, :0]), dict(topk_ids=ids[None]),
        dict(topk_ids=ids.to("meta")), dict(topk_weights=w[:, :1]), dict(topk_weights=w.double()),
        dict(topk_weights=w.to("meta")), dict(topk_weights=None), dict(apply_router_weight_on_input=1),
        dict(backend=3), dict(precision="w8a8"), dict(precision=4), dict(expert_map=torch.zeros(2, 2)),
        dict(expert_map=torch.arange(E).float()), dict(expert_map=torch.arange(1)), dict(expert_map=[0, 1]),
        dict(topk_ids=torch.zeros(x.shape[0], E + 1, dtype=torch.int32), topk_weights=torch.ones(x.shape[0], E + 1)),
        dict(out=torch.empty(x.shape[0], 16, dtype=x.dtype)), dict(out=torch.empty_like(x).half()),
        dict(out=torch.empty_like(x).t().contiguous().t()[:, :]), dict(out=torch.empty(x.shape[1], x.shape[0]).t()),
        dict(out=torch.empty_like(x).to("meta")), dict(out=x.tolist()),
    ]
    return [{**base, **c} for c in changes]


def test_the_quick_argument_checks_pass_only_what_every_check_passes():
    """``moe._plain_arguments`` (one read of each attribute) may answer only where ``moe._check_arguments``
    (each check with its message) passes, with the same sizes; where it refuses, the checks run."""
    from moe_fp4 import moe

    ex, x, w, ids = _case_inputs(CASES[0])
    w13 = ex.stored()[0]
    E, H = w13.shape[0], w13.shape[2] * 2  # noqa: N806
    passed = refused = 0
    for kwargs in _variants(x, w, ids, E):
        args = [kwargs[k] for k in ("hidden_states", "topk_weights", "topk_ids", "backend",
                                    "apply_router_weight_on_input", "expert_map", "out", "precision")]
        quick = moe._plain_arguments(*args, w13.device, E, H)
        try:
            M, topk, id_limit = moe._check_arguments(*args, w13.device, E, H)  # noqa: N806
        except (TypeError, ValueError):
            assert quick is None, kwargs
            refused += 1
            continue
        passed += 1
        if quick is not None:
            assert quick == (M, topk, kwargs["hidden_states"].dtype), kwargs
    assert passed == 12 and refused == len(_variants(x, w, ids, E)) - 12
    plain = _variants(x, w, ids, E)[1]  # an eager call with out=: the quick checks answer
    assert moe._plain_arguments(*plain.values(), w13.device, E, H) == (x.shape[0], ids.shape[1], x.dtype)


@pytest.mark.parametrize("backend, sm90", [("cutlass", True), ("triton", True)], ids=["cutlass-sm90", "triton"])
def test_a_planned_shape_still_checks_every_argument_of_every_call(backend, sm90):
    """Nothing of a call's tensors is cached: after the shape's plan exists, a tensor changed in place
    (strides, dtype, shape: the same object) or replaced is refused with its message."""
    ex, x, w, ids = _case_inputs(CASES[0])
    with stubbed_launches(sm90=sm90):
        args = [x.clone(), ex, w.clone(), ids.clone()]
        out = torch.empty_like(x)
        for _ in range(2):  # the checked run, then the plan
            fused_moe(*args, backend=backend, out=out, validate=False)
        M, H = x.shape  # noqa: N806
        changes = [
            (0, lambda t: t.as_strided_((M, H), (1, M)), ValueError, "hidden_states: expected a contiguous tensor"),
            (0, lambda t: setattr(t, "data", t.data.half()), TypeError, None),  # out is bf16: hidden dtype mismatch
            (2, lambda t: setattr(t, "data", t.data.double()), TypeError, "topk_weights: expected dtype"),
            (3, lambda t: t.resize_(M - 1, t.shape[1]), ValueError, rf"topk_ids: expected shape \[{M}, topk\]"),
            (2, lambda t: t.resize_(M, 1), ValueError, rf"topk_weights: expected shape \[{M}, 2\]"),
        ]
        for position, change, exc, pattern in changes:
            changed = list(args)
            changed[position] = args[position].clone()
            change(changed[position])
            with pytest.raises(exc, match=pattern or "out: expected dtype float16, got bfloat16"):
                fused_moe(*changed, backend=backend, out=out, validate=False)
        for bad_out, exc, pattern in [(torch.empty_like(x).half(), TypeError, "out: expected dtype bfloat16"),
                                      (torch.empty(H, M, dtype=x.dtype).t(), ValueError, "out: expected a contiguous"),
                                      (torch.empty(M, H + 32, dtype=x.dtype), ValueError, r"out: expected shape")]:
            with pytest.raises(exc, match=pattern):
                fused_moe(*args, backend=backend, out=bad_out, validate=False)
        assert fused_moe(*args, backend=backend, out=out, validate=False) is out  # and the plan still runs


def test_a_moe_problem_is_the_frozen_dataclass_it_was():
    """``MoEProblem``'s own ``__init__`` (stores into the instance dict) keeps the dataclass's behaviour."""
    p = _problem()
    q = MoEProblem(p.hidden_states, p.experts, p.topk_weights, p.topk_ids, False, None)
    assert [f.name for f in dataclasses.fields(MoEProblem)] == list(vars(q))
    assert q == p and q.precision == "w4a4" and q.num_tokens == p.hidden_states.shape[0]
    assert repr(q).startswith("MoEProblem(hidden_states=tensor(")
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.out = None
    r = dataclasses.replace(q, precision="w4a16", apply_router_weight_on_input=True)
    assert (r.precision, r.apply_router_weight_on_input, r.topk_ids) == ("w4a16", True, q.topk_ids)
    kw = MoEProblem(hidden_states=p.hidden_states, experts=p.experts, topk_weights=p.topk_weights,
                    topk_ids=p.topk_ids, apply_router_weight_on_input=False, out=None, precision="w4a4")
    assert kw == q


def test_validate_calls_the_stubbed_check_entry_with_the_tensors_of_the_call(monkeypatch):
    """``validate=True`` through ``moe_fp4_check_inputs`` (the path of a GPU's call, here the stubbed library
    on CPU tensors with the host-oracle device): one call, with the call's tensors, sizes and codes."""
    from moe_fp4 import _native, moe

    ex, x, w, ids = _case_inputs(CASES[0])
    record: list = []
    before = moe._check_entry
    with stubbed_launches(record):
        monkeypatch.setattr(moe, "_HOST_ORACLE", True)
        for _ in range(2):
            record.clear()
            fused_moe(x, ex, w, ids, backend="triton", validate=True)
            checks = [r[1] for r in record if r[0] == "moe_fp4_check_inputs"]
            assert len(checks) == 1
            assert checks[0][:11] == (x.data_ptr(), _native.BF16, x.numel(), w.data_ptr(), w.numel(), ids.data_ptr(),
                                      _native.INT32, ids.numel(), None, 0, 0)
            assert checks[0][12:] == (_native.HOST, None)
    assert moe._check_entry is before  # the stub's entry does not outlive the block
