"""One resident copy of a layer's weights: ``NvFp4Experts.in_layout`` re-lays them out in place.

On the host oracle (CPU tensors) with the sm_90a layout the cutlass backend uses on compute
capability 9.x (``cutlass.sm90_layout``: w13 and w2 each with its own functions): the experts' own
tensors then hold that layout, byte for byte what ``cutlass.sm90_weights`` makes of the
canonical ones, and every canonical reader (the attributes, ``canonical_tensors``, ``to``,
``dequantize``, the reference backend, ``FusedMoE.state_dict``) sees the canonical bytes it
saw before, exactly (the re-layout is a bijection on valid weights but for the codes of
zero-scale blocks, which are kept aside). Comparisons are exact: nothing here computes.
When the canonical tensors were handed out first, or ``keep_canonical`` is set, the layout is
a copy and the storage is left canonical. Writing into re-laid-out tensors is detected, and a
second view over them is refused or resolved to their owner.
"""

from __future__ import annotations

import pytest
import torch
from test_native import native_library
from test_sm90_restore import random_weights

from moe_fp4 import NvFp4Experts, _op, fused_moe
from moe_fp4.backends import cutlass
from moe_fp4.experts import _in_place_owner
from moe_fp4.nn import FusedMoE

F8 = torch.float8_e4m3fn
E, H, I = 3, 64, 48  # noqa: E741  (I = 48: the w2 rows have a tail chunk of 3 k16 steps)


@pytest.fixture(scope="module", autouse=True)
def lib():
    return native_library()


def make_experts(seed: int = 0) -> NvFp4Experts:
    """Random valid experts (scales include zero, every subnormal, 448; a zero-scale block with nonzero codes)."""
    c13, s13 = random_weights(E, 2 * I, H, seed)
    c2, s2 = random_weights(E, H, I, seed + 1)
    gs = torch.full((E,), 2.0)
    return NvFp4Experts(c13, s13.view(F8), gs.clone(), c2, s2.view(F8), gs.clone(), gs.clone(), gs.clone(), own=True)


def relay(ex: NvFp4Experts):
    return cutlass.sm90_layout(ex)


def snapshot(ex: NvFp4Experts) -> list[torch.Tensor]:
    """Copies of the stored weights' bytes (canonical before a re-layout; reading them hands nothing out)."""
    w13, s13, _, w2, s2, *_ = ex.stored()
    return [w13.clone(), s13.view(torch.uint8).clone(), w2.clone(), s2.view(torch.uint8).clone()]


def canonical_bytes(ex: NvFp4Experts) -> list[torch.Tensor]:
    c = ex.canonical_tensors()
    return [c["w13"].clone(), c["w13_scale"].view(torch.uint8).clone(), c["w2"].clone(),
            c["w2_scale"].view(torch.uint8).clone()]


def sm90_bytes(codes: torch.Tensor, scales: torch.Tensor, sections: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The sm_90a layout of these weights (``sections = 2``: w13, gate and up rows interleaved)."""
    w = cutlass.sm90_weights(codes, scales, torch.ones(codes.shape[0], sections))
    return w.packed, w.scales


def test_in_place_replaces_the_storage_and_canonical_readers_see_the_same_bytes():
    ex = make_experts()
    before = snapshot(ex)
    stored = ex.stored()
    ptrs = [t.data_ptr() for t in stored]
    got = relay(ex)
    assert ex.layout == "sm90"
    # The same tensor objects: what the operator, module buffers and graphs hold keeps its address.
    assert got[0] is stored[0] and got[1] is stored[1] and got[2] is stored[3] and got[3] is stored[4]
    assert [t.data_ptr() for t in ex.stored()] == ptrs
    for (codes, scales), (c, s), sections in (((before[0], before[1]), (got[0], got[1]), 2),
                                              ((before[2], before[3]), (got[2], got[3]), 1)):
        want_c, want_s = sm90_bytes(codes, scales.view(F8), sections)
        assert torch.equal(c, want_c) and torch.equal(s.view(torch.uint8), want_s)
    # Canonical readers: byte for byte what they read before, the zero-scale blocks' codes included.
    assert all(torch.equal(a, b) for a, b in zip(canonical_bytes(ex), before, strict=True))
    assert torch.equal(ex.w13, before[0]) and torch.equal(ex.w2_scale.view(torch.uint8), before[3])
    moved = ex.to("cpu")
    assert moved.layout is None and torch.equal(moved.w13, before[0]) and torch.equal(moved.w2, before[2])
    again = relay(ex)  # asked again: as it is
    assert again[0] is stored[0] and again[3] is stored[4]


def test_dequantize_and_the_reference_forward_are_unchanged_bitwise():
    ex = make_experts(3)
    x = torch.randn(5, H).bfloat16()
    ids = torch.tensor([[0, 2], [1, 1], [2, 0], [0, 1], [2, 2]], dtype=torch.int32)
    w = torch.rand(5, 2)
    want = fused_moe(x, make_experts(3), w, ids, backend="reference")
    deq = make_experts(3).dequantize()
    relay(ex)
    got = fused_moe(x, ex, w, ids, backend="reference")
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(ex.dequantize(), deq, strict=True))


def test_canonical_tensors_handed_out_first_make_the_layout_a_copy():
    ex = make_experts(5)
    w13 = ex.w13  # a reader may hold the canonical storage now (a kernel, a graph): never rewritten
    snapshot = w13.clone()
    got = relay(ex)
    assert ex.layout is None and got[0] is not w13 and torch.equal(w13, snapshot)
    assert torch.equal(got[0], sm90_bytes(snapshot, ex.w13_scale, 2)[0])
    assert relay(ex)[0] is got[0]  # cached

    kept = make_experts(5)
    kept.keep_canonical = True
    relay(kept)
    assert kept.layout is None


def test_only_owned_tensors_that_no_other_experts_object_reads_are_relaid_in_place():
    theirs = make_experts(15)
    mine = NvFp4Experts(*theirs.stored())  # not owned (the default): the caller may read its tensors again
    before = snapshot(theirs)
    relay(mine)
    assert mine.layout is None
    relay(theirs)  # owned, but `mine` is over the same storage: a copy, or `mine` would read garbage
    assert theirs.layout is None
    assert all(torch.equal(a, b) for a, b in zip(canonical_bytes(mine), before, strict=True))
    del mine
    fresh = make_experts(16)
    copy = fresh.to("cpu")  # a copy on the same device: its own tensors
    assert copy.stored()[0].data_ptr() != fresh.stored()[0].data_ptr()
    saved = canonical_bytes(copy)
    relay(fresh)
    assert fresh.layout == "sm90"
    assert all(torch.equal(a, b) for a, b in zip(canonical_bytes(copy), saved, strict=True))


def test_a_second_view_over_relaid_tensors_is_refused_or_resolved_to_the_owner():
    ex = make_experts(7)
    relay(ex)
    with pytest.raises(ValueError, match=r"w13: this storage holds the 'sm90' layout"):
        NvFp4Experts(*ex.stored())
    _op.clear_cache()
    assert _op.experts_for(ex.stored()) is ex


def test_writing_into_relaid_tensors_is_detected():
    ex = make_experts(9)
    relay(ex)
    ex.stored()[3].add_(0)  # an in-place write (a new version) of w2
    with pytest.raises(RuntimeError, match="written in place after they were re-laid out"):
        relay(ex)
    with pytest.raises(RuntimeError, match="written in place"):
        ex.canonical_tensors()
    # The storage holds what was written, no longer the owner's layout: a new view validates it as it is.
    assert _in_place_owner(ex.stored()[0]) is None


def test_fused_moe_module_saves_and_loads_canonical_state():
    ex = make_experts(11)
    before = snapshot(ex)
    module = FusedMoE.from_experts(ex, backend="reference")
    relay(module.experts)
    assert module.experts is ex and ex.layout == "sm90"
    state = module.state_dict()
    assert torch.equal(state["w13"], before[0]) and torch.equal(state["w2_scale"].view(torch.uint8), before[3])
    # The module's buffers still hold the sm_90a layout (state_dict copied nothing into them).
    assert module.w13 is ex.stored()[0]

    other = FusedMoE.from_experts(make_experts(12), backend="reference")
    relay(other.experts)
    other.load_state_dict(state)  # loaded into canonical buffers, not into the GEMM's layout
    assert other.experts.layout is None
    assert all(torch.equal(a, b) for a, b in zip(canonical_bytes(other.experts), before, strict=True))


def test_moving_a_module_moves_canonical_weights():
    ex = make_experts(13)
    module = FusedMoE.from_experts(ex, backend="reference")
    relay(module.experts)
    module.to("meta")  # any device change: the bytes would be meaningless without their owner's layout
    assert module._cache is None and module.w13.is_meta
    assert ex.layout == "sm90"  # the old view keeps its own (still valid) tensors


def test_the_bench_counts_one_copy_for_the_sm90_layout():
    from moe_fp4.bench.memory import resident_memory

    ex = make_experts(17)
    ex.w13  # noqa: B018 (handed out, as the bench's peers do: the measurement prepares a fresh copy)
    got = resident_memory(ex, {"cutlass": cutlass.STAGES_SM90}, {})
    row = got["paths"]["cutlass"]
    # The sm_90a layout has the NVFP4 bytes' size; the fresh copy also holds its alphas (E x 3 floats).
    assert row["in_place"] and 1.0 <= row["x_nvfp4"] < 1.01, row
    assert ex.layout is None  # the measured object itself is left as it was


def _swizzle_experts(seed: int) -> NvFp4Experts:
    """Experts whose scales swizzle without padding (I and H multiples of 128, H/16 and I/16 of 4)."""
    e, h, i = 2, 128, 128
    c13, s13 = random_weights(e, 2 * i, h, seed)
    c2, s2 = random_weights(e, h, i, seed + 1)
    gs = torch.full((e,), 2.0)
    return NvFp4Experts(c13, s13.view(F8), gs.clone(), c2, s2.view(F8), gs.clone(), gs.clone(), gs.clone(), own=True)


def test_the_swizzled_scales_of_the_triton_gemm_replace_the_logical_ones():
    from moe_fp4.buffers import WeightOperand

    ex = _swizzle_experts(21)
    before = snapshot(ex)
    versions = [t._version for t in ex.stored()]
    stored = ex.stored()
    want = WeightOperand.build(before[0], before[1].view(F8), torch.ones(2, 2)), \
        WeightOperand.build(before[2], before[3].view(F8), torch.ones(2, 1))
    got = WeightOperand.from_experts(ex)
    assert ex.layout == "swizzled-scales"
    # The codes are the experts' own tensors (untouched), the scales their storage, swizzled.
    assert got[0].packed is stored[0] and got[1].packed is stored[3]
    assert got[0].scales.data_ptr() == stored[1].data_ptr() and got[1].scales.data_ptr() == stored[4].data_ptr()
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.scales.view(torch.uint8), w.scales.view(torch.uint8))
    # No new version (the operator's and FusedMoE's keys hold), and canonical readers see the same bytes.
    assert [t._version for t in ex.stored()] == versions
    assert all(torch.equal(a, b) for a, b in zip(canonical_bytes(ex), before, strict=True))
    assert ex.w13 is stored[0]  # the codes are canonical: no copy


def test_triton_on_swizzled_in_place_experts_equals_the_copy_and_the_module_keeps_its_view():
    from moe_fp4 import available_backends
    from moe_fp4.bench.memory import resident_memory

    if "triton" not in available_backends("cpu"):
        pytest.skip("triton's CPU interpreter is not on")
    from moe_fp4.backends import triton as tb

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 128, generator=gen).bfloat16()
    ids = torch.tensor([[0, 1], [1, 1], [0, 0]], dtype=torch.int32)
    w = torch.rand(3, 2, generator=gen)
    copy = _swizzle_experts(23)
    copy.keep_canonical = True
    want = fused_moe(x, copy, w, ids, backend="triton")
    module = FusedMoE.from_experts(_swizzle_experts(23), backend="triton")
    got = module(x, w, ids)
    view = module.experts
    assert view.layout == "swizzled-scales" and copy.layout is None
    assert torch.equal(got, want)
    assert torch.equal(module(x, w, ids), got)  # again, through its plan: the same bytes
    assert module.experts is view  # same tensors, same versions: the same view
    row = resident_memory(copy, {"triton": tb.STAGES}, {})["paths"]["triton"]
    assert row["in_place"] and 1.0 <= row["x_nvfp4"] < 1.01, row


@pytest.mark.gpu
# triton on a 9.x GPU: the values operand ("auto"), whose weights are in the K16 layout.
@pytest.mark.parametrize("backend,layout", [("cutlass", "sm90"), ("triton", "triton-k16")])
def test_on_the_gpu_one_copy_is_held_and_computes_what_the_copy_computes(backend, layout):
    from moe_fp4 import available_backends
    from moe_fp4.backends import triton as tb
    from moe_fp4.bench.memory import resident_memory
    from moe_fp4.bench.shapes import ModelShape
    from moe_fp4.bench.workload import random_experts

    if backend not in available_backends("cuda"):
        pytest.skip(f"{backend} does not run on this GPU")
    if backend == "cutlass" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the cutlass backend's own layout is its sm_90a GEMM's (compute capability 9.x)")
    dev = torch.device("cuda")
    E_, H_, I_, topk = 16, 512, 256, 4
    ex = random_experts(ModelShape("small", E_, topk, H_, I_), dev, seed=1)
    copy = ex.to(dev)
    copy.keep_canonical = True
    gen = torch.Generator(device=dev).manual_seed(2)
    x = torch.randn(37, H_, device=dev, generator=gen).bfloat16()
    ids = torch.randint(0, E_, (37, topk), device=dev, generator=gen, dtype=torch.int32)
    w = torch.rand(37, topk, device=dev, generator=gen)
    want_ref = fused_moe(x, copy, w, ids, backend="reference")

    got = fused_moe(x, ex, w, ids, backend=backend)
    assert ex.layout == layout and copy.layout is None
    # The same kernels on the same bytes (in place or a copy): bitwise equal; again through the plan.
    assert torch.equal(got, fused_moe(x, copy, w, ids, backend=backend))
    assert torch.equal(fused_moe(x, ex, w, ids, backend=backend), got)
    assert torch.equal(fused_moe(x, ex, w, ids, backend="reference"), want_ref)  # restored canonical weights
    stages = cutlass.stages_for(dev) if backend == "cutlass" else tb.stages_for(dev)
    for layer in (ex, copy):  # re-laid out, and canonical with its tensors handed out: a fresh copy either way
        row = resident_memory(layer, {backend: stages}, {})["paths"][backend]
        assert row["in_place"] and row["x_nvfp4"] <= 1.1


def test_a_relayout_failing_part_way_is_undone():
    ex = make_experts(31)
    before = snapshot(ex)
    calls = []

    def flaky(codes, scales, out_codes, out_scales):  # w2's: w13 done, w2 fails (e.g. out of memory)
        calls.append(codes.shape)
        raise MemoryError("injected")

    # The sm_90a functions for w13 (gate and up interleaved), so the undo restores w13 with its own.
    with pytest.raises(MemoryError, match="injected"):
        ex.in_layout("sm90", (cutlass._SM90_RELAYOUT[0], flaky), cutlass._SM90_RESTORE)
    assert ex.layout is None and len(calls) == 1
    assert all(torch.equal(a, b) for a, b in zip(snapshot(ex), before, strict=True))  # w13 put back, codes kept
    relay(ex)  # and it can be laid out again
    assert ex.layout == "sm90"
    assert all(torch.equal(a, b) for a, b in zip(canonical_bytes(ex), before, strict=True))


def test_a_state_dict_taken_before_the_first_forward_is_never_rewritten():
    module = FusedMoE.from_experts(make_experts(33), backend="reference")
    state = module.state_dict()  # aliases of the buffers
    saved = {k: v.clone() for k, v in state.items()}
    relay(module.experts)
    assert module.experts.layout is None  # handed out: a copy
    assert all(torch.equal(state[k], saved[k]) for k in saved)


def test_new_global_scales_keep_the_weights_layout():
    ex = make_experts(35)
    before = snapshot(ex)
    module = FusedMoE.from_experts(ex, backend="reference")
    relay(module.experts)
    module.a13_gs = module.a13_gs * 2  # a new global-scale buffer (calibration)
    view = module.experts
    assert view is not ex and view.layout == "sm90" and view.stored()[0] is ex.stored()[0]
    assert torch.equal(view.a13_gs, ex.a13_gs * 2)
    state = module.state_dict()  # still canonical
    assert torch.equal(state["w13"], before[0]) and torch.equal(state["w2_scale"].view(torch.uint8), before[3])
    x = torch.randn(4, H).bfloat16()
    ids = torch.tensor([[0, 1], [2, 2], [1, 0], [0, 2]], dtype=torch.int32)
    w = torch.rand(4, 2)
    fresh = make_experts(35)
    fresh.a13_gs = fresh.a13_gs * 2
    assert torch.equal(module(x, w, ids), fused_moe(x, fresh, w, ids, backend="reference"))
    module.w13_gs.mul_(1)  # an in-place write of a scale: a new view again, the layout carried over
    assert module.experts.layout == "sm90"


def test_one_expert_is_restored_alone_and_shard_experts_keeps_no_copy(monkeypatch):
    from moe_fp4.distributed import shard_experts

    ex = make_experts(37)
    want = make_experts(37).dequantize(expert=1)
    relay(ex)
    shapes = []

    def counting(real):
        def restore(codes, scales):
            shapes.append(tuple(codes.shape))
            return real(codes, scales)
        return restore

    counted = tuple(counting(real) for real in cutlass._SM90_RESTORE)  # (w13's, w2's)
    monkeypatch.setattr(ex, "_layout", (ex._layout[0], counted, *ex._layout[2:]))
    got = ex.dequantize(expert=1)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert shapes and all(s[0] == 1 for s in shapes)  # one expert's slices, not the layer
    local, _ = shard_experts(ex, 0, 3)
    assert ex._canonical_copy is None and local.num_experts == 1
    assert torch.equal(local.w13, make_experts(37).w13[:1])


def test_inference_tensors_are_never_relaid_in_place():
    with torch.inference_mode():
        ex = make_experts(39)
    relay(ex)
    assert ex.layout is None  # their writes could not be detected


def test_copies_and_pickles_carry_canonical_weights():
    import copy

    ex = make_experts(41)
    before = snapshot(ex)
    relay(ex)
    for other in (copy.deepcopy(ex), torch.load(_saved(ex), weights_only=False)):
        assert other.layout is None
        assert all(torch.equal(a, b) for a, b in zip(snapshot(other), before, strict=True))
    original = make_experts(43)
    kept = snapshot(original)
    shallow = copy.copy(original)  # the same tensors: while both live, no re-layout in place
    relay(shallow)
    assert shallow.layout is None
    assert all(torch.equal(a, b) for a, b in zip(snapshot(original), kept, strict=True))

    module = FusedMoE.from_experts(make_experts(45), backend="reference")
    want = snapshot(module.experts)
    relay(module.experts)
    for other in (copy.deepcopy(module), torch.load(_saved(module), weights_only=False)):
        assert other._cache is None and torch.equal(other.w13, want[0])
        assert torch.equal(other.w2_scale.view(torch.uint8), want[3])
        assert other.experts.layout is None
    assert module.experts.layout == "sm90"  # the original keeps its own


def _saved(obj):
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def test_the_alias_registry_forgets_dropped_experts():
    import gc

    from moe_fp4 import experts as experts_module

    gc.collect()
    before = len(experts_module._ALIASES)
    made = [make_experts(50 + k) for k in range(5)]
    assert len(experts_module._ALIASES) == before + 10  # w13 and w2 of each
    del made
    gc.collect()
    assert len(experts_module._ALIASES) == before
