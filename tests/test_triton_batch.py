"""A Triton forward's launches in one library call: ``LaunchBatch`` and ``_triton_batch.LibraryRunner``.

On CPU: the batch's order rules with stand-ins for compiled kernels (CUDA's device query patched):
direct launches are collected and run at the end in order; a launch the runner cannot take, or
one that goes through Triton's path, runs what was collected first; a block that raises drops
what it collected; a launch hook keeps the batch closed. The runner's descriptions of a kernel
(parameter slots, free positions, the check against the kernel's own parameter sizes) and the C
entry's checks of malformed descriptions. On the GPU (marked): batched launches equal Triton's
own, bit for bit, including a float argument, a side stream and an unaligned input in the
middle of a batch, and a whole Triton forward through a plan batches every launch.
"""

from __future__ import annotations

import ctypes
import struct
import types
import weakref

import pytest
import torch

pytest.importorskip("triton")

from moe_fp4 import _native  # noqa: E402
from moe_fp4.backends import _triton_batch  # noqa: E402
from moe_fp4.triton_kernels import _common  # noqa: E402
from moe_fp4.triton_kernels._common import FREE, INTERPRET, Launch, LaunchBatch  # noqa: E402

# --------------------------------------------------------------------------- the batch's rules (CPU)

class _Compiled:
    """A compiled kernel's stand-in: ``run(...)`` records the launch as Triton's launcher would make it."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log
        self.function, self.packed_metadata = 0, (4, 1, 0)
        self.run = lambda *args: log.append(("triton", name, args[9:]))


class _Runner:
    def __init__(self, log: list, refuse: set[str] = frozenset()) -> None:
        self.log, self.refuse = log, refuse

    def record(self, parts):
        _, compiled, _, _, _ = parts
        return None if compiled.name in self.refuse else compiled.name

    def run(self, records, free_values, device, stream):
        self.log.append(("batch", tuple(records), tuple(free_values)))


class _Jit:
    """A JITFunction's stand-in: ``kernel[grid](*args)`` records a launch through Triton's path."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log.append(("jit", self.name, args))


def _prepared(name: str, log: list, args: tuple) -> Launch:
    """A Launch as it is after its first launch: direct, its free arguments specialized as plain ints."""
    launch = Launch(_Jit(name, log), (1,), args, {})
    free = [i for i, a in enumerate(args) if a is FREE]
    launch._direct = (0, _Compiled(name, log), [0 if a is FREE else a for a in args])
    launch._spec = tuple(_common._spec(5) for _ in free)
    return launch


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)


def test_batched_launches_run_at_the_end_in_order(fake_cuda):
    log: list = []
    a, b = _prepared("a", log, (FREE, 1)), _prepared("b", log, (2, FREE))
    batch = LaunchBatch(_Runner(log))
    with batch:
        a(5)
        b(7)
        a(21)
        assert log == []  # nothing launched yet
    assert log == [("batch", ("a", "b", "a"), (5, 7, 21))]
    assert batch.batched_launches == 3 and a.fast_launches == 2 and b.fast_launches == 1
    a(5)  # no batch open: Triton's launcher, directly
    assert log[-1] == ("triton", "a", (5, 1))


def test_a_launch_outside_the_batch_runs_what_was_collected_first(fake_cuda):
    log: list = []
    a, refused = _prepared("a", log, (FREE,)), _prepared("r", log, (FREE,))
    unaligned = _prepared("u", log, (FREE,))
    with LaunchBatch(_Runner(log, refuse={"r"})):
        a(5)
        refused(7)  # the runner has no description: collected launches first, then Triton's launcher
        a(16)  # specializes differently (a multiple of 16): Triton's path, after what was collected
        unaligned(37)
    assert log == [("batch", ("a",), (5,)), ("triton", "r", (7,)), ("jit", "a", (16,)), ("batch", ("u",), (37,))]


def test_a_block_that_raises_drops_what_it_collected(fake_cuda):
    log: list = []
    a = _prepared("a", log, (FREE,))
    batch = LaunchBatch(_Runner(log))
    with pytest.raises(KeyError), batch:
        a(5)
        raise KeyError("stage failed")
    assert log == [] and _common._TLS.batch is None
    with batch:  # reusable, empty
        a(7)
    assert log == [("batch", ("a",), (7,))]


def test_a_batch_inside_a_batch_runs_the_outer_launches_first(fake_cuda):
    log: list = []
    a, b, c = (_prepared(n, log, (FREE,)) for n in "abc")
    outer, inner = LaunchBatch(_Runner(log)), LaunchBatch(_Runner(log))
    with outer:
        a(5)
        with inner:
            b(7)
        c(9)
    assert log == [("batch", ("a",), (5,)), ("batch", ("b",), (7,)), ("batch", ("c",), (9,))]
    assert _common._TLS.batch is None


def test_a_launch_on_another_stream_is_not_batched(fake_cuda, monkeypatch):
    log: list = []
    a = _prepared("a", log, (FREE,))
    with LaunchBatch(_Runner(log)):
        a(5)
        monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
        a(7)  # the current stream changed: what was collected first, then Triton's launcher (on the new stream)
    assert log == [("batch", ("a",), (5,)), ("triton", "a", (7,))]


def test_collected_launches_hold_their_tensors_until_they_run(fake_cuda):
    log: list = []
    a = _prepared("a", log, (FREE,))
    a._spec = (_common._spec(torch.zeros(4)),)
    batch = LaunchBatch(_Runner(log))
    with batch:
        t = torch.zeros(4)
        ref = weakref.ref(t)
        a(t)
        del t
        assert ref() is not None  # (the caching allocator could hand its memory out before the launch)
    assert ref() is None


def test_a_launch_hook_keeps_the_batch_closed(fake_cuda, monkeypatch):
    log: list = []
    a = _prepared("a", log, (FREE,))
    monkeypatch.setattr(_common, "_unset", lambda hook: False)  # as if a profiler's hook were set
    with LaunchBatch(_Runner(log)):
        assert _common._TLS.batch is None
        a(5)
    assert log == [("jit", "a", (5,))]  # Triton's path (which calls the hooks)


# --------------------------------------------------------------------------- learning and replay (CPU)

@pytest.fixture
def fake_device(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)


def _tensor_launch(name: str, log: list, args: tuple, *free: torch.Tensor | int) -> Launch:
    """:func:`_prepared` with its free arguments specialized as ``free`` (tensors or ints) are."""
    launch = _prepared(name, log, args)
    launch._spec = tuple(_common._spec(v) for v in free)
    return launch


class _Block:
    """A plan-like block: ``a`` takes the first input flattened and a stride, ``b`` a constant buffer and
    the second input (free values as a plan's launchers pass them)."""

    def __init__(self, log: list, x: torch.Tensor, out: torch.Tensor) -> None:
        self.const = torch.zeros(8)
        self.a = _tensor_launch("a", log, (FREE, FREE, 3), x.reshape(-1), x.stride(0))
        self.b = _tensor_launch("b", log, (FREE, FREE), self.const, out)

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        self.a(x.reshape(-1), x.stride(0))
        self.b(self.const, out)


def test_a_learned_block_replays_with_the_new_inputs_free_values(fake_device):
    log: list = []
    x, out = torch.zeros(4, 8), torch.zeros(4, 8)
    block, batch = _Block(log, x, out), LaunchBatch(_Runner(log))
    assert not batch.replay((x, out), 0, 0)  # nothing learned yet
    with batch.learning((x, out)):
        block(x, out)
    learned = ("batch", ("a", "b"), (x.data_ptr(), 8, block.const.data_ptr(), out.data_ptr()))
    assert log == [learned]
    x2, out2 = torch.ones(4, 8), torch.ones(4, 8)
    assert batch.replay((x2, out2), 0, 0)
    # the inputs' addresses where the learned block had its inputs', the constant buffer and stride as learned
    assert log[-1] == ("batch", ("a", "b"), (x2.data_ptr(), 8, block.const.data_ptr(), out2.data_ptr()))
    assert batch.batched_launches == 4 and len(log) == 2


@pytest.mark.parametrize("change", ["dtype", "shape", "stride", "alignment", "device"])
def test_a_replay_refuses_inputs_unlike_the_learned_ones(fake_device, change):
    log: list = []
    x, out = torch.zeros(4, 8), torch.zeros(4, 8)
    block, batch = _Block(log, x, out), LaunchBatch(_Runner(log))
    with batch.learning((x, out)):
        block(x, out)
    device = 0
    if change == "dtype":
        x = x.double()
    elif change == "shape":
        x = torch.zeros(2, 16)
    elif change == "stride":
        x = torch.zeros(4, 16)[:, :8]
    elif change == "alignment":
        x = torch.zeros(33)[1:].view(4, 8)
    else:
        device = 1
    assert not batch.replay((x, out), device, 0) and len(log) == 1  # nothing ran


def _learns(block_fn, inputs, log, **kwargs) -> bool:
    batch = LaunchBatch(_Runner(log), **kwargs)
    with batch.learning(inputs):
        block_fn()
    return batch.replay(inputs, 0, 0)


def test_what_could_be_misread_is_not_learned(fake_device):
    log: list = []
    x, out = torch.zeros(4, 8), torch.zeros(4, 8)
    block = _Block(log, x, out)
    assert _learns(lambda: block(x, out), (x, out), log)
    # two inputs at one address: which would fill a free value?
    assert not _learns(lambda: block(x, x), (x, x), log)
    # a free tensor inside an input at another address (a view at an offset) is not a constant
    view = _tensor_launch("v", log, (FREE,), x[1:].reshape(-1))
    assert not _learns(lambda: view(x[1:].reshape(-1)), (x, out), log)
    # a launch that is not batched (the runner refuses it): the block flushes before its end
    refused = _tensor_launch("r", log, (FREE,), out)
    batch = LaunchBatch(_Runner(log, refuse={"r"}))
    with batch.learning((x, out)):
        block(x, out)
        refused(out)
    assert not batch.replay((x, out), 0, 0)
    # not steady: nothing learned; and a learned block is not replayed while it is not
    assert not _learns(lambda: block(x, out), (x, out), log, steady=lambda: False)
    state = {"steady": True}
    batch = LaunchBatch(_Runner(log), steady=lambda: state["steady"])
    with batch.learning((x, out)):
        block(x, out)
    state["steady"] = False
    assert not batch.replay((x, out), 0, 0)
    state["steady"] = True
    assert batch.replay((x, out), 0, 0)


def test_a_replay_waits_for_hooks_and_open_batches_and_a_raising_block_is_not_learned(fake_device, monkeypatch):
    log: list = []
    x, out = torch.zeros(4, 8), torch.zeros(4, 8)
    block, batch = _Block(log, x, out), LaunchBatch(_Runner(log))
    with pytest.raises(KeyError), batch.learning((x, out)):
        block(x, out)
        raise KeyError("stage failed")
    assert not batch.replay((x, out), 0, 0)
    with batch.learning((x, out)):
        block(x, out)
    with LaunchBatch(_Runner(log)):  # an open batch: a replay would run before what it collected
        assert not batch.replay((x, out), 0, 0)
    unset = _common._unset
    monkeypatch.setattr(_common, "_unset", lambda hook: False)  # a profiler's launch hook
    assert not batch.replay((x, out), 0, 0)
    monkeypatch.setattr(_common, "_unset", unset)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 1, raising=False)  # another current device
    assert not batch.replay((x, out), 0, 0)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    n = len(log)
    assert batch.replay((x, out), 0, 0) and len(log) == n + 1
    # a block whose learning fails keeps the replay learned before (valid for its inputs)
    other = torch.zeros(4, 8)
    with batch.learning((x, x)):
        block(x, x)
    assert batch.replay((other, out), 0, 0)


# --------------------------------------------------------------------------- the runner's descriptions (CPU)

def _runner() -> _triton_batch.LibraryRunner:
    r = _triton_batch.LibraryRunner.__new__(_triton_batch.LibraryRunner)
    r._lib, r._launch, r._last, r.why_not = None, None, (None, (), None), {}
    return r


_PTX_TYPES = {1: ".u8", 2: ".align 2 .b8 {}[2]", 4: ".u32", 8: ".u64 .ptr .global .align 1"}


def _ptx(sizes: list[int]) -> str:
    """An entry declaring parameters of these sizes, as Triton's PTX does."""
    decls = [f"\t.param {_PTX_TYPES[b].format(f'k_param_{i}')}" + ("" if b == 2 else f" k_param_{i}")
             for i, b in enumerate(sizes)]
    return ".visible .entry k(\n" + ",\n".join(decls) + "\n)\n{\n}"


def _compiled(signature: dict, ptx_sizes: list[int] | None = None, **metadata):
    md = dict(num_warps=4, num_ctas=1, shared=1024, launch_pdl=False, launch_cooperative_grid=False,
              global_scratch_size=0, profile_scratch_size=0)
    md.update(metadata)
    sizes = ptx_sizes if ptx_sizes is not None else _triton_batch.launcher_param_sizes(list(signature.values()))
    return types.SimpleNamespace(name="k", function=0x1234, metadata=types.SimpleNamespace(**md),
                                 src=types.SimpleNamespace(signature=signature), asm={"ptx": _ptx(sizes or [])})


SIG = {"x": "*bf16", "n": "i32", "BLOCK": "constexpr", "a": "fp32", "flag": "i1", "big": "i64", "out": "*fp32"}
SIZES = [8, 4, 4, 1, 8, 8, 8, 8]  # the six parameters, then the two scratch pointers


def _storage_of(record) -> list[int]:
    launch = record.launch
    return [ctypes.c_uint64.from_address(launch.params[j]).value for j in range(launch.num_params)]


def test_a_description_lays_the_parameters_out_as_tritons_launcher():
    values = [0xAB00, 1000, 256, 2.0, True, -3, 0xCD00]
    assert _triton_batch.launcher_param_sizes(list(SIG.values())) == SIZES
    record = _runner().record((0, _compiled(SIG), (3, 2, 1), values, (0, 6)))
    launch = record.launch
    assert (launch.grid_x, launch.grid_y, launch.grid_z, launch.block_x, launch.shared_bytes) == (3, 2, 1, 128, 1024)
    assert launch.num_params == 9 and launch.num_free == 2  # 6 + 2 scratch pointers + the sink
    two = struct.unpack("<I", struct.pack("<f", 2.0))[0]
    assert _storage_of(record) == [0xAB00, 1000, two, 1, 2**64 - 3, 0xCD00, 0, 0, 0]
    assert list(launch.free_param[:2]) == [0, 5] and list(launch.free_bytes[:2]) == [8, 8]


def test_a_free_constexpr_argument_writes_to_the_sink_and_bf16_is_the_top_half():
    sig = {"x": "*bf16", "s": "constexpr", "h": "bf16"}
    record = _runner().record((0, _compiled(sig), (1, 1, 1), [16, 1, 1 / 3], (0, 1)))
    assert list(record.launch.free_param[:2]) == [0, 4]  # parameter 0, and the sink after the 4 parameters
    # Triton's pack_bf16: the float32's top half, truncated (1/3 = 0x3EAAAAAB, round to nearest would give 0x3EAB)
    assert _storage_of(record)[1] == 0x3EAA


@pytest.mark.parametrize("change, why", [
    (dict(num_ctas=2), "clusters"),
    (dict(launch_cooperative_grid=True), "cooperative"),
    (dict(global_scratch_size=64), "scratch"),
    (dict(profile_scratch_size=64), "scratch"),
])
def test_launches_it_cannot_reproduce_get_no_description(change, why):
    r = _runner()
    assert r.record((0, _compiled(SIG, **change), (1, 1, 1), [0, 1, 2, 2.0, 0, 0, 0], (0,))) is None
    assert why in r.why_not["k"]


def test_a_parameter_list_unlike_the_kernels_gets_no_description():
    r = _runner()  # the kernel declares one parameter fewer than Triton's launcher passes
    assert r.record((0, _compiled(SIG, ptx_sizes=SIZES[:-1]), (1, 1, 1), [0, 1, 2, 2.0, 0, 0, 0], (0,))) is None
    assert "PTX" in r.why_not["k"]
    assert r.record((0, _compiled(SIG, ptx_sizes=[4, *SIZES[1:]]), (1, 1, 1), [0, 1, 2, 2.0, 0, 0, 0], (0,))) is None
    assert r.record((0, _compiled(SIG), (1, 1, 1), [0, 1, 2, 2.0, 0, 0, 0], (3,))) is None  # a float the caller gives
    assert r.record((0, _compiled(SIG), (1, 1, 1), [0, 1, 2, 1e300, 0, 0, 0], (0,))) is None  # not a float32
    assert "range" in r.why_not["k"]
    assert r.record((0, _compiled(SIG), (1, 1, 1), [None, 1, 2, 2.0, 0, 0, 0], (0,))) is None  # a free None
    assert r.record((0, _compiled({"d": "tensordesc<bf16[16, 16]>"}), (1, 1, 1), [0], ())) is None


# --------------------------------------------------------------------------- the C entry's checks (CPU)

@pytest.fixture(scope="module")
def lib():
    try:
        return _native.library()
    except _native.LibraryUnavailable as exc:
        pytest.skip(str(exc))


def _desc(**fields) -> _triton_batch._KernelLaunch:
    storage = (ctypes.c_uint64 * 2)()
    params = (ctypes.c_void_p * 2)(ctypes.addressof(storage), ctypes.addressof(storage) + 8)
    free_param, free_bytes = (ctypes.c_int32 * 1)(0), (ctypes.c_int32 * 1)(8)
    d = _triton_batch._KernelLaunch(0x1000, 1, 1, 1, 128, 0, 0, 2, params, 1, free_param, free_bytes)
    d._keep = (storage, params, free_param, free_bytes)
    for k, v in fields.items():
        setattr(d, k, v)
    return d


@pytest.mark.parametrize("fields, num_free, message", [
    (dict(function=None), 1, "launches[0].function: expected a CUfunction, got NULL"),
    (dict(block_x=0), 1, "launches[0].block_x: expected 1..1024 threads, got 0"),
    (dict(num_params=-1), 1, "launches[0].num_params: expected a count >= 0, got -1"),
    (dict(num_free=-2), 1, "launches[0].num_free: expected a count >= 0, got -2"),
    (dict(), 2, "num_free: the launches take 1 free values, got 2"),
])
def test_malformed_descriptions_are_refused_before_any_launch(lib, fields, num_free, message):
    d = _desc(**fields)
    ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(d))
    values = (ctypes.c_uint64 * 2)(1, 2)
    status = lib.function("moe_fp4_launch_kernels")(ptrs, 1, values, num_free, 0, None)
    assert status == _native.INVALID_ARGUMENT
    assert lib.last_error() == message


def test_a_free_value_for_a_parameter_that_does_not_exist_is_refused(lib):
    d = _desc()
    d.free_param[0] = 2
    d.free_bytes[0] = 8
    ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(d))
    status = lib.function("moe_fp4_launch_kernels")(ptrs, 1, (ctypes.c_uint64 * 1)(1), 1, 0, None)
    assert status == _native.INVALID_ARGUMENT
    assert lib.last_error() == "launches[0].free_param[0]: expected a parameter in [0, 2), got 2"
    d.free_param[0], d.free_bytes[0] = 0, 3
    status = lib.function("moe_fp4_launch_kernels")(ptrs, 1, (ctypes.c_uint64 * 1)(1), 1, 0, None)
    assert lib.last_error() == "launches[0].free_bytes[0]: expected 1, 2, 4 or 8 bytes, got 3"


# --------------------------------------------------------------------------- on the GPU

if not INTERPRET:
    import triton
    from test_triton_launch import _axpy_kernel  # out = a * x + y (a float argument)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="batched launches exist only for compiled kernels (not the CPU interpreter)")
def test_batched_launches_equal_tritons_own():
    runner = _triton_batch.runner()
    if runner is None:
        pytest.skip("the CUDA library is not available")
    dev = torch.device("cuda")
    n, block = 1000, 256
    y = torch.randn(n, device=dev)
    grid = (triton.cdiv(n, block),)
    launch = Launch(_axpy_kernel, grid, (FREE, y, FREE, n, 2.5), {"BLOCK": block})

    def ref(x):
        # The same kernel through Triton's own path: the comparison is bit for bit.
        out = torch.empty_like(x)
        _axpy_kernel[grid](x, y, out, n, 2.5, BLOCK=block)
        return out

    x0 = torch.randn(n, device=dev)
    launch(x0, torch.empty(n, device=dev))  # Triton's path; prepares
    batch = LaunchBatch(runner)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        # A busy side stream that then writes the inputs: launches on any other stream would read
        # them before they are written (and the NaN outputs would stay NaN or be wrong).
        torch.cuda._sleep(50_000_000)
        xs = [torch.randn(n, device=dev) for _ in range(3)]
        outs = [torch.full((n,), float("nan"), device=dev) for _ in range(4)]
        buf = torch.randn(n + 1, device=dev)
        with batch:
            launch(xs[0], outs[0])
            launch(xs[1], outs[1])
            launch(buf[1:], outs[2])  # unaligned: Triton's path, after the two collected
            launch(xs[2], outs[3])
    side.synchronize()
    assert batch.batched_launches == 3, runner.why_not
    for x, out in zip([xs[0], xs[1], buf[1:], xs[2]], outs):
        assert torch.equal(out, ref(x))


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="batched launches exist only for compiled kernels (not the CPU interpreter)")
def test_a_triton_forward_batches_every_launch_and_equals_the_unbatched_one(monkeypatch):
    from moe_cases import Case, make_experts, make_inputs

    from moe_fp4 import fused_moe, pipeline

    if _triton_batch.runner() is None:
        pytest.skip("the CUDA library is not available")
    case = Case(150, 8, 2, 256, 128)  # 300 slots: the chunked routing, so eight launches
    gen = torch.Generator().manual_seed(0)
    experts = make_experts(case, gen, "cuda")
    x, w, ids = (t.cuda() for t in make_inputs(case, gen))
    monkeypatch.setattr(pipeline, "REPLAY", False)  # (a replayed forward runs no flush: replays are tested below)
    first = fused_moe(x, experts, w, ids, backend="triton")  # the checked run, which makes the plan
    batched = [fused_moe(x, experts, w, ids, backend="triton") for _ in range(3)]
    counts = []
    real = LaunchBatch.flush

    def counting(self):
        counts.append(len(self._records))
        real(self)

    monkeypatch.setattr(LaunchBatch, "flush", counting)
    again = fused_moe(x, experts, w, ids, backend="triton")
    torch.cuda.synchronize()
    # every launch of the plan in one call: none refused, the chunked routing's three, quantize, the two
    # GEMMs, SiLU-mul-quantize and the reduce at least
    assert not _triton_batch.runner().why_not and counts and counts[-1] >= 8, (counts, _triton_batch.runner().why_not)
    for out in [*batched, again]:
        assert torch.equal(out, first)  # the same kernels on the same buffers: bit for bit


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="batched launches exist only for compiled kernels (not the CPU interpreter)")
@pytest.mark.parametrize("form", ["codes", "values"])
@pytest.mark.parametrize("m,on_input", [(150, False), (4, False), (4, True), (1, True)])
def test_a_replayed_triton_forward_equals_the_forward_through_its_stages(monkeypatch, form, m, on_input):
    """Replays (``pipeline.REPLAY``) of a plan with new inputs at new addresses, bit for bit the forward
    run through the plan's bound stages (the same kernels and buffers); inputs the replay refuses (an
    unaligned hidden-states view, M=1's other row stride) run the stages and equal them too."""
    from moe_cases import Case, make_experts, make_inputs

    from moe_fp4 import fused_moe, pipeline
    from moe_fp4.backends.triton import operand_form

    if _triton_batch.runner() is None:
        pytest.skip("the CUDA library is not available")
    # 300 slots: the chunked routing; 4 x 2 and 1 x 2: the values form's fused routing and quantization
    case = Case(m, 8, 2, 256, 128, on_input=on_input)
    gen = torch.Generator().manual_seed(1)
    experts = make_experts(case, gen, "cuda")
    replays: list[bool] = []
    real = LaunchBatch.replay

    def counted(self, *args):
        replays.append(real(self, *args))
        return replays[-1]

    monkeypatch.setattr(LaunchBatch, "replay", counted)

    def forward(x, w, ids, replay: bool):
        monkeypatch.setattr(pipeline, "REPLAY", replay)
        return fused_moe(x, experts, w, ids, backend="triton", apply_router_weight_on_input=on_input,
                         validate=False)

    with operand_form(form):
        x, w, ids = (t.cuda() for t in make_inputs(case, gen))
        forward(x, w, ids, True)  # the checked run, which makes the plan
        forward(x, w, ids, True)  # the plan's first run: Triton's launcher compiles its launches (not batched)
        forward(x, w, ids, True)  # learns
        for _ in range(3):
            x, w, ids = (t.cuda() for t in make_inputs(case, gen))
            replays.clear()
            got = forward(x, w, ids, True)
            assert replays == [True]
            assert torch.equal(got, forward(x, w, ids, False))
        buf = torch.empty(x.numel() + 1, dtype=x.dtype, device="cuda")
        unaligned = buf[1:].view_as(x)
        unaligned.copy_(x)
        replays.clear()
        assert torch.equal(forward(unaligned, w, ids, True), forward(x, w, ids, False))
        assert replays == [False]  # refused: the stages run (Triton's launcher for the new alignment)
        if m == 1:
            wide = torch.zeros(1, 2 * case.h, dtype=x.dtype, device="cuda")[:, : case.h]
            wide.copy_(x)
            assert wide.is_contiguous() and wide.stride(0) != x.stride(0)
            assert torch.equal(forward(wide, w, ids, True), forward(x, w, ids, False))
