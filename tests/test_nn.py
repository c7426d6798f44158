"""moe_fp4.nn: FusedMoE and SparseMoeBlock as torch modules (CPU, reference backend).

Every comparison is bitwise: the modules only hold tensors and call fused_moe, so any
difference from the functional API (or from the checkpoint's MoEBlock) is a bug.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_fp4 import NvFp4Experts, fused_moe, load_experts, load_moe_block
from moe_fp4.nn import FusedMoE, SparseMoeBlock

DATA = Path(__file__).parent / "data" / "tiny_qwen3_moe"
FIELDS = ("w13", "w13_scale", "w13_gs", "w2", "w2_scale", "w2_gs", "a13_gs", "a2_gs")
E, H, I, TOPK = 4, 64, 32, 2  # small random layers
B = "reference"


def random_experts(seed: int, *, separate: bool = False) -> NvFp4Experts:
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / 8).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) / 8).bfloat16()
    return NvFp4Experts.quantize(w13, w2, a13_gs=2688.0 / 3.0, a2_gs=2688.0 / 0.5, separate_gate_up_scales=separate)


def routing(seed: int, m: int, e: int = E, k: int = TOPK, h: int = H) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, h, generator=g) / 2).bfloat16()
    w, ids = torch.softmax(torch.randn(m, e, generator=g), -1).topk(k, -1)
    return x, w, ids


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# --------------------------------------------------------------------------- FusedMoE


@pytest.mark.parametrize("on_input", [False, True])
def test_fused_moe_module_equals_function(on_input):
    ex = random_experts(1)
    x, w, ids = routing(2, 9)
    ids[0, 1] = -1  # not served here
    moe = FusedMoE.from_experts(ex, backend=B, apply_router_weight_on_input=on_input)
    want = fused_moe(x, ex, w, ids, backend=B, apply_router_weight_on_input=on_input)
    assert same(moe(x, w, ids), want)
    # Leading dimensions are flattened and restored.
    got = moe(x.reshape(3, 3, H), w.reshape(3, 3, TOPK), ids.reshape(3, 3, TOPK))
    assert same(got, want.reshape(3, 3, H))


def test_buffers_are_the_experts_tensors():
    ex = random_experts(3, separate=True)
    moe = FusedMoE.from_experts(ex, backend=B)
    assert [n for n, _ in moe.named_buffers()] == list(FIELDS)
    for n in FIELDS:
        assert getattr(moe, n) is getattr(ex, n)
    assert moe.experts is ex  # the view is the given object until a buffer changes
    assert (moe.num_experts, moe.hidden_size, moe.intermediate_size) == (E, H, I)
    assert "per-half" in repr(moe)


@pytest.mark.parametrize("separate", [False, True])
def test_state_dict_round_trip_is_bitwise(separate):
    ex = random_experts(4, separate=separate)
    src = FusedMoE.from_experts(ex, backend=B)
    x, w, ids = routing(5, 7)
    # A fresh module's w13_gs is [E]; an [E, 2] state dict (gate != up scales) replaces it.
    fresh = FusedMoE(E, H, I, backend=B)
    fresh.load_state_dict(src.state_dict())
    assert fresh.w13_gs.shape == ex.w13_gs.shape
    assert same(fresh(x, w, ids), src(x, w, ids))


def test_cache_follows_in_place_changes_and_replacements():
    a, b = random_experts(6), random_experts(7)
    x, w, ids = routing(8, 5)
    moe = FusedMoE.from_experts(a, backend=B)
    out_a = moe(x, w, ids)
    state_a = {k: v.clone() for k, v in moe.state_dict().items()}
    # load_state_dict copies in place (into a's tensors, which the module shares): the view
    # must still be rebuilt.
    moe.load_state_dict(FusedMoE.from_experts(b).state_dict())
    assert same(moe(x, w, ids), fused_moe(x, b, w, ids, backend=B))
    assert moe.experts is not a
    moe.load_state_dict(state_a)
    assert same(moe(x, w, ids), out_a)
    moe.w2_gs.mul_(2.0)  # an in-place change of one buffer halves the down projection
    assert not same(moe(x, w, ids), out_a)
    moe.w2_gs = state_a["w2_gs"].clone()  # replacing a buffer
    assert same(moe(x, w, ids), out_a)


def test_module_casts_keep_the_format_dtypes():
    ex = random_experts(9)
    x, w, ids = routing(10, 4)
    moe = FusedMoE.from_experts(ex, backend=B)
    want = moe(x, w, ids)
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.float(), lambda m: m.to("cpu")):
        cast(moe)
        assert [getattr(moe, n).dtype for n in FIELDS] == [getattr(ex, n).dtype for n in FIELDS]
        assert same(moe(x, w, ids), want)


def test_from_checkpoint_equals_load_experts():
    path = DATA / "nvfp4_ct"
    moe = FusedMoE.from_checkpoint(path, 1, backend=B)
    ex = load_experts(path, 1)
    x, w, ids = routing(11, 6, e=8, h=256)
    assert same(moe(x, w, ids), fused_moe(x, ex, w, ids, backend=B))


# --------------------------------------------------------------------------- SparseMoeBlock


@pytest.mark.parametrize("name", ["nvfp4_ct", "nvfp4_modelopt"])
@pytest.mark.parametrize("layer", [0, 1])
def test_sparse_moe_block_equals_checkpoint_block(name, layer):
    path = DATA / name
    block = SparseMoeBlock.from_checkpoint(path, layer, backend=B)
    ref = load_moe_block(path, layer)
    x = (torch.randn(2, 5, 256, generator=torch.Generator().manual_seed(12 + layer)) / 2).bfloat16()
    want = ref(x.reshape(10, 256), backend=B)
    assert same(block(x), want.reshape(2, 5, 256))
    assert block.top_k == 2 and block.norm_topk_prob is True
    assert torch.equal(block.gate.weight, ref.router.gate_weight)


def test_sparse_moe_block_state_dict_round_trip():
    src = SparseMoeBlock.from_checkpoint(DATA / "nvfp4_llmc", 0, backend=B)
    fresh = SparseMoeBlock(8, 256, 128, 2, norm_topk_prob=True, backend=B)
    fresh.load_state_dict(src.state_dict())
    x = (torch.randn(6, 256, generator=torch.Generator().manual_seed(13)) / 2).bfloat16()
    assert same(fresh(x), src(x))


# --------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    ("make", "exc", "name"),
    [
        (lambda: FusedMoE(0, H, I), ValueError, "num_experts"),
        (lambda: FusedMoE(E, 72, I), ValueError, "hidden_size"),
        (lambda: FusedMoE(E, H, 8), ValueError, "intermediate_size"),
        (lambda: FusedMoE(E, H, I, backend=3), TypeError, "backend"),
        (lambda: FusedMoE(E, H, I, apply_router_weight_on_input="yes"), TypeError, "apply_router_weight_on_input"),
        (lambda: FusedMoE.from_experts("experts"), TypeError, "experts"),
        (lambda: SparseMoeBlock(E, H, I, 0), ValueError, "top_k"),
        (lambda: SparseMoeBlock(E, H, I, 2, norm_topk_prob=1), TypeError, "norm_topk_prob"),
        (lambda: SparseMoeBlock(E, H, I, 2, router_dtype=torch.int8), TypeError, "router_dtype"),
    ],
)
def test_bad_construction(make, exc, name):
    with pytest.raises(exc, match=name):
        make()


def test_bad_forward_inputs():
    moe = FusedMoE.from_experts(random_experts(14), backend=B)
    x, w, ids = routing(15, 4)
    with pytest.raises(TypeError, match="hidden_states"):
        moe(x.tolist(), w, ids)
    with pytest.raises(TypeError, match="topk_ids"):
        moe(x, w, ids.tolist())
    with pytest.raises(ValueError, match="hidden_states"):
        moe(x[:, :32], w, ids)
    with pytest.raises(ValueError, match="topk_weights"):
        moe(x, w[:3], ids)
    with pytest.raises(ValueError, match="topk_ids"):
        moe(x, w, ids.reshape(2, 2, TOPK))
    with pytest.raises(ValueError, match="topk_ids"):
        moe(x, w, ids + E)  # out of range: fused_moe's own validation
    with pytest.raises(TypeError, match="hidden_states"):
        moe(x.float(), w, ids)
    block = SparseMoeBlock(E, H, I, TOPK, backend=B)
    with pytest.raises(ValueError, match="hidden_states"):
        block(x[:, :16])
    with pytest.raises(RuntimeError, match="meta"):
        FusedMoE(E, H, I, device="meta")(x, w, ids)
