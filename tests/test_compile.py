"""``torch.ops.moe_fp4.fused_moe``: the opaque operator under torch.compile, fake tensors, opcheck, out=.

Every comparison is bitwise: the compiled graph holds the operator (the whole forward) and a
few exact tensor conversions around it, so any difference from eager is a bug.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch._dynamo
from torch._subclasses import FakeTensorMode

from moe_fp4 import NvFp4Experts, _op, fused_moe
from moe_fp4.backends import registry
from moe_fp4.nn import FusedMoE

E, H, I, TOPK = 4, 64, 32, 2
OP, OUT_OP = torch.ops.moe_fp4.fused_moe.default, torch.ops.moe_fp4.fused_moe_out.default
# What a compiled fused_moe may hold besides the operator: dtype/layout conversions and the
# expert_map translation, never a piece of the quantizer or of a GEMM.
TRACED_OK = {"to", "contiguous", "clamp", "long", "ge", "lt", "and_", "where", "getitem", "__and__", "__getitem__"}


def make_experts(seed: int, device: torch.device | str = "cpu") -> NvFp4Experts:
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / 8).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) / 8).bfloat16()
    return NvFp4Experts.quantize(w13.to(device), w2.to(device), a13_gs=2688.0 / 3.0, a2_gs=2688.0 / 0.5)


def make_inputs(seed: int, m: int, *, e: int = E, dtype: torch.dtype = torch.bfloat16,
                device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, H, generator=g) / 2).to(dtype)
    w, ids = torch.softmax(torch.randn(m, e, generator=g), -1).topk(TOPK, -1)
    return x.to(device), w.to(device), ids.to(device)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


class Recorder:
    """A torch.compile backend that keeps dynamo's graphs and hands them to inductor."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.graphs.append(gm)
        return compile_fx(gm, example_inputs)

    def calls(self) -> list:
        return [n.target for gm in self.graphs for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# --------------------------------------------------------------------------- resolution


def test_backend_resolution_is_marked_constant_as_assume_constant_result_marks():
    # registry sets the marker itself (the decorator would import torch._dynamo, and triton, with
    # moe_fp4): it must be exactly what this torch's decorator sets.
    marker = torch.compiler.assume_constant_result(lambda: None).__dict__
    assert marker, "torch.compiler.assume_constant_result no longer marks the function it is given"
    for name, value in marker.items():
        assert getattr(registry.resolve_backend, name, None) == value, name


# --------------------------------------------------------------------------- torch.compile, fullgraph


@pytest.mark.parametrize(
    "dtype,ids_dtype,on_input,mapped",
    [(torch.bfloat16, torch.int64, False, False), (torch.float16, torch.int32, True, False),
     (torch.bfloat16, torch.int64, False, True)],
    ids=["bf16", "fp16-on-input", "expert-map"],
)
def test_compiled_fullgraph_equals_eager_reference(dtype, ids_dtype, on_input, mapped):
    ex = make_experts(1)
    emap = torch.tensor([-1, 0, 1, -1, 2, 3]) if mapped else None

    def f(x, w, ids):
        return fused_moe(x, ex, w, ids, backend="reference", apply_router_weight_on_input=on_input, expert_map=emap)

    rec = Recorder()
    compiled = torch.compile(f, fullgraph=True, backend=rec)
    for seed, m in ((2, 5), (3, 7), (4, 9)):  # new M: one recompile with a dynamic M, same results
        x, w, ids = make_inputs(seed, m, e=6 if mapped else E, dtype=dtype)
        ids = ids.to(ids_dtype)
        assert same(compiled(x, w, ids), f(x, w, ids)), m
    calls = rec.calls()
    assert calls.count(OP) == len(rec.graphs) >= 1
    others = {getattr(c, "__name__", str(c)) for c in calls if c is not OP}
    assert others <= TRACED_OK, others


def test_compiled_triton_equals_eager(device):
    why = registry.why_unavailable("triton", device, torch.bfloat16)
    if why is not None:
        pytest.skip(f"triton: {why}")
    ex = make_experts(5, device)
    x, w, ids = make_inputs(6, 3, device=device)

    def f(x, w, ids):
        return fused_moe(x, ex, w, ids, backend="triton", validate=False)

    rec = Recorder()
    got = torch.compile(f, fullgraph=True, backend=rec)(x, w, ids)
    assert same(got, f(x, w, ids))
    assert OP in rec.calls()


def test_compiled_out_variant_writes_out():
    ex = make_experts(7)
    x, w, ids = make_inputs(8, 6)
    out = torch.full_like(x, float("nan"))

    def f(x, w, ids, out):
        return fused_moe(x, ex, w, ids, backend="reference", out=out)

    rec = Recorder()
    res = torch.compile(f, fullgraph=True, backend=rec)(x, w, ids, out)
    assert res is out and same(out, fused_moe(x, ex, w, ids, backend="reference"))
    assert OUT_OP in rec.calls() and OP not in rec.calls()


def test_values_are_not_validated_while_compiling():
    # validate=True syncs with the host: skipped under torch.compile as under CUDA-graph capture,
    # so out-of-range ids are treated as -1 there, as with validate=False.
    ex = make_experts(9)
    x, w, ids = make_inputs(10, 4)
    ids[0, 0] = 99
    with pytest.raises(ValueError, match="topk_ids: expected expert ids"):
        fused_moe(x, ex, w, ids, backend="reference")
    got = torch.compile(lambda x, w, i: fused_moe(x, ex, w, i, backend="reference"), fullgraph=True)(x, w, ids)
    assert same(got, fused_moe(x, ex, w, torch.where(ids < E, ids, -1), backend="reference"))


def test_a_backend_that_cannot_run_says_why_under_compile():
    ex = make_experts(11)
    x, w, ids = make_inputs(12, 2)
    # Dynamo reports any exception raised while it traces with fullgraph=True as one of its own
    # (here InternalTorchDynamoError): the registry's reason must be in its message.
    with pytest.raises(Exception, match=r"BackendUnavailableError: backend='cutlass' cannot run on cpu: runs on cuda"):
        torch.compile(lambda x, w, i: fused_moe(x, ex, w, i, backend="cutlass"), fullgraph=True)(x, w, ids)


def test_fused_moe_module_compiled_equals_eager_and_follows_in_place_changes():
    moe = FusedMoE.from_experts(make_experts(13), backend="reference")
    x, w, ids = make_inputs(14, 9)
    compiled = torch.compile(moe, fullgraph=True)
    before = moe(x, w, ids)
    assert same(compiled(x, w, ids), before)
    got = compiled(x.reshape(3, 3, H), w.reshape(3, 3, TOPK), ids.reshape(3, 3, TOPK))
    assert same(got, before.reshape(3, 3, H))
    moe.w2_gs.mul_(2.0)  # a new version of one buffer: the operator's view is rebuilt
    after = moe(x, w, ids)
    assert not same(after, before) and same(compiled(x, w, ids), after)


# --------------------------------------------------------------------------- the operator itself


def test_fake_implementation_gives_shape_and_dtype():
    ex = make_experts(15)
    x, w, ids = make_inputs(16, 5, dtype=torch.float16)
    args = (*_op.tensors_of(ex), w, ids.int(), "reference", False)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fx = mode.from_tensor(x)
        for got in (OP(fx, *args), fused_moe(fx, ex, w, ids, backend="reference", validate=False)):
            assert type(got).__name__ == "FakeTensor" and got.shape == (5, H) and got.dtype == torch.float16
    meta = [t.to("meta") if isinstance(t, torch.Tensor) else t for t in (x, *args)]
    got = OP(*meta)
    assert got.device.type == "meta" and got.shape == (5, H) and got.dtype == torch.float16
    out = torch.empty(5, H, dtype=torch.float16, device="meta")
    assert OUT_OP(*meta, out) is None


def test_opcheck():
    ex = make_experts(17)
    x, w, ids = make_inputs(18, 3)
    args = (x, *_op.tensors_of(ex), w, ids.int(), "reference", False)
    # test_schema is left out: its mutation check compares the inputs with allclose, which torch
    # does not implement for float8_e4m3fn (the block scales). test_out_variant_mutates_only_out
    # checks the same property.
    utils = ("test_faketensor", "test_aot_dispatch_dynamic", "test_autograd_registration")
    torch.library.opcheck(OP, args, test_utils=utils)
    torch.library.opcheck(OUT_OP, (*args, torch.empty_like(x)), test_utils=utils)


def test_out_variant_mutates_only_out():
    ex = make_experts(19)
    x, w, ids = make_inputs(20, 4)
    args = (x, *_op.tensors_of(ex), w, ids.int(), "reference", True)
    snapshot = [a.clone() for a in args if isinstance(a, torch.Tensor)]
    out = torch.full_like(x, float("nan"))
    assert OUT_OP(*args, out) is None
    assert same(out, OP(*args))
    assert all(same(a, b) for a, b in zip((a for a in args if isinstance(a, torch.Tensor)), snapshot))
    res = fused_moe(x, ex, w, ids, backend="reference", apply_router_weight_on_input=True, out=torch.empty_like(x))
    assert same(res, out)


def test_the_operator_keeps_one_view_per_set_of_tensors():
    ex = make_experts(21)
    x, w, ids = make_inputs(22, 3)
    fused_moe(x, ex, w, ids, backend="reference")
    assert _op.experts_for(_op.tensors_of(ex)) is ex  # the caller's object, registered by its first call

    other = make_experts(23)
    tensors = tuple(t.clone() for t in _op.tensors_of(other))  # never seen: a view is built, once
    view = _op.experts_for(tensors)
    assert view is _op.experts_for(tensors) and view is not other
    assert view.w13.data_ptr() == tensors[0].data_ptr()
    tensors[5].mul_(1.0)  # a new version of w2_gs: a new view
    newer = _op.experts_for(tensors)
    assert newer is not view and newer is _op.experts_for(tensors)

    alive = weakref.ref(newer)
    del view, newer, tensors
    gc.collect()
    assert alive() is None  # dropping the tensors drops their view: the cache keeps no weights alive


# --------------------------------------------------------------------------- GPU (H200)


def _cuda_forward(backend: str, seed: int, m: int):
    """``(f, x, w, ids, ex)``: ``f(x, w, ids)`` the unvalidated forward of ``backend`` over new CUDA experts
    (skips where the backend cannot run)."""
    dev = torch.device("cuda")
    why = registry.why_unavailable(backend, dev)
    if why is not None:
        pytest.skip(f"{backend} cannot run here: {why}")
    ex = make_experts(seed, dev)

    def f(x, w, ids):
        return fused_moe(x, ex, w, ids, backend=backend, validate=False)

    return (f, *make_inputs(seed + 1, m, device=dev), ex)


def _replays_eager(compiled, f, x, w, ids, seed: int) -> None:
    """Three calls of ``compiled`` (warm-up run, capture, replay) equal ``f`` bitwise, and so does a call on
    new values (seed ``seed``) through the graph."""
    got = [compiled(x, w, ids).clone() for _ in range(3)]
    want = f(x, w, ids)
    assert all(same(g, want) for g in got)
    x2, w2, ids2 = make_inputs(seed, x.shape[0], device=x.device)
    assert same(compiled(x2, w2, ids2).clone(), f(x2, w2, ids2))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cutlass"])
def test_reduce_overhead_compile_equals_eager(backend):
    f, x, w, ids, ex = _cuda_forward(backend, 24, 8)
    # Eager first: kernels, the workspace and the experts' view exist before capture, and the
    # experts' tensors are marked as static addresses (cudagraph trees would copy them otherwise).
    f(x, w, ids)
    for fn in (f, FusedMoE.from_experts(ex, backend=backend)):
        _replays_eager(torch.compile(fn, mode="reduce-overhead", fullgraph=True), f, x, w, ids, 26)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cutlass"])
def test_reduce_overhead_compile_before_any_eager_call(backend):
    """Compiled with ``mode="reduce-overhead"`` before any eager call (transformers compiles its decode step
    so), over an experts object and over a FusedMoE module: the first call of the shape is the graph's warm-up
    run, whose allocations CUDA graph trees route into the graphs' pool. The workspace, the experts' prepared
    weights and the plan are made off that pool (``pipeline.off_graph_pool``), and the experts' tensors were
    marked as static addresses when the object was made (``experts.mark_static``), so the graph is captured
    over them and replays what eager computes. New experts, and token counts whose workspace buckets (128 and
    256 slots) no other test here uses: nothing of either forward exists before its compile. On the H100
    before both changes the pool held 18 (cutlass) and 13 (triton) tensors; with the first alone, the copied
    experts' tensors were refused during capture (tests/results/h100-2026-12-07-s43)."""
    f, x, w, ids, ex = _cuda_forward(backend, 30, 40)
    assert all(getattr(t, "_dynamo_static_input_type", None) for t in ex.stored())
    _replays_eager(torch.compile(f, mode="reduce-overhead", fullgraph=True), f, x, w, ids, 32)
    g, x, w, ids, ex = _cuda_forward(backend, 33, 100)
    moe = FusedMoE.from_experts(ex, backend=backend)
    _replays_eager(torch.compile(moe, mode="reduce-overhead", fullgraph=True), g, x, w, ids, 35)


@pytest.mark.gpu
def test_out_without_validation_allocates_nothing():
    dev = torch.device("cuda")
    ex = make_experts(27, dev)
    x, w, ids = make_inputs(28, 8, device=dev)
    ids, out = ids.int(), torch.empty_like(x)
    for _ in range(2):
        fused_moe(x, ex, w, ids, backend="triton", out=out, validate=False)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats(dev)["allocation.all.allocated"]
    for _ in range(10):
        fused_moe(x, ex, w, ids, backend="triton", out=out, validate=False)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats(dev)["allocation.all.allocated"] == before
