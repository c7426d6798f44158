"""Checkpoint loading on the tiny real checkpoints of tests/data/tiny_qwen3_moe.

The checkpoints were made by the real producers (compressed-tensors, llm-compressor,
ModelOpt) from one bf16 model, which is the independent reference here: every expected
value below is read straight from the safetensors files with ``safetensors.torch.load_file``,
or computed in float64 from the bf16 base weights, never through the loader. The measured
facts quoted ("README section N") are those of tests/data/tiny_qwen3_moe/README.md.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import moe_fp4
from moe_fp4 import NvFp4Experts, fused_moe
from moe_fp4.checkpoint import Checkpoint, MoEConfig, load_moe_block
from moe_fp4.format import unpack_e2m1
from moe_fp4.reference import dequantized_moe

DATA = Path(__file__).parent / "data" / "tiny_qwen3_moe"
CT = ("nvfp4_ct", "nvfp4_llmc")
MODELOPT = "nvfp4_modelopt"
QUANTIZED = CT + (MODELOPT,)
E, TOPK, H, I = 8, 2, 256, 128
LAYERS = (0, 1)


@functools.cache
def raw(name: str) -> dict[str, torch.Tensor]:
    return load_file(DATA / name / "model.safetensors")


def expert_tensor(name: str, layer: int, e: int, proj: str, suffix: str) -> torch.Tensor:
    return raw(name)[f"model.layers.{layer}.mlp.experts.{e}.{proj}.{suffix}"]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def swap_nibbles(t: torch.Tensor) -> torch.Tensor:
    return ((t >> 4) | (t << 4)).contiguous()


def with_fields(ex: NvFp4Experts, **changes: torch.Tensor) -> NvFp4Experts:
    return NvFp4Experts(**{k: changes.get(k, getattr(ex, k)) for k in NvFp4Experts._fields()})


# --------------------------------------------------------------------------- layout and config


@pytest.mark.parametrize("name", QUANTIZED + ("bf16",))
def test_moe_layers_and_config_key_drift(name):
    # config.json uses the transformers-5 key num_local_experts (README section 2).
    ckpt = Checkpoint(DATA / name)
    assert moe_fp4.list_moe_layers(DATA / name) == [0, 1] == ckpt.moe_layers
    assert ckpt.moe == MoEConfig(num_experts=E, top_k=TOPK, hidden_size=H, intermediate_size=I, norm_topk_prob=True)
    assert ckpt.prefix == "model.layers" and ckpt.other_prefixes == []


def test_formats_are_detected():
    assert Checkpoint(DATA / "nvfp4_ct").format.name == "compressed-tensors"
    assert Checkpoint(DATA / "nvfp4_llmc").format.name == "compressed-tensors"
    fmt = Checkpoint(DATA / MODELOPT).format
    assert fmt.name == "modelopt" and fmt.reciprocal and fmt.source == "hf_quant_config.json"
    with pytest.raises(ValueError, match="not a quantized checkpoint"):
        moe_fp4.load_experts(DATA / "bf16", 0)


# --------------------------------------------------------------------------- exactly as stored


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("name", QUANTIZED)
def test_codes_and_block_scales_exactly_as_stored(name, layer):
    ex = moe_fp4.load_experts(DATA / name, layer)
    packed = "weight" if name == MODELOPT else "weight_packed"
    assert ex.w13.shape == (E, 2 * I, H // 2) and ex.w2.shape == (E, H, I // 2)
    for e in range(E):
        gate, up, down = (expert_tensor(name, layer, e, p, packed) for p in ("gate_proj", "up_proj", "down_proj"))
        assert torch.equal(ex.w13[e, :I], gate) and torch.equal(ex.w13[e, I:], up) and torch.equal(ex.w2[e], down)
        scales = [expert_tensor(name, layer, e, p, "weight_scale").view(torch.uint8) for p in ("gate_proj", "up_proj")]
        assert torch.equal(ex.w13_scale[e].view(torch.uint8), torch.cat(scales))
        down_scale = expert_tensor(name, layer, e, "down_proj", "weight_scale")
        assert torch.equal(ex.w2_scale[e].view(torch.uint8), down_scale.view(torch.uint8))


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("name", CT)
def test_compressed_tensors_global_scales_are_taken_as_stored(name, layer):
    # compressed-tensors stores moe_fp4's quantize direction (2688/amax): no conversion at all.
    ex = moe_fp4.load_experts(DATA / name, layer)
    assert ex.w13_gs.shape == (E,)  # gate and up share a scale in every expert: kept as [E]
    for e in range(E):
        g = {p: {s: expert_tensor(name, layer, e, p, s) for s in ("weight_global_scale", "input_global_scale")}
             for p in ("gate_proj", "up_proj", "down_proj")}
        assert g["gate_proj"]["weight_global_scale"].shape == (1,)
        assert ex.w13_gs[e] == g["gate_proj"]["weight_global_scale"][0] == g["up_proj"]["weight_global_scale"][0]
        assert ex.w2_gs[e] == g["down_proj"]["weight_global_scale"][0]
        assert ex.a13_gs[e] == min(g["gate_proj"]["input_global_scale"][0], g["up_proj"]["input_global_scale"][0])
        assert ex.a2_gs[e] == g["down_proj"]["input_global_scale"][0]


@pytest.mark.parametrize("layer", LAYERS)
def test_modelopt_global_scales_are_reciprocals_of_the_stored_multipliers(layer):
    # ModelOpt stores amax/2688 (0-d); moe_fp4 takes one float32 reciprocal of it.
    ex = moe_fp4.load_experts(DATA / MODELOPT, layer)
    assert ex.w13_gs.shape == (E,)
    for e in range(E):
        s = {p: {k: expert_tensor(MODELOPT, layer, e, p, k) for k in ("weight_scale_2", "input_scale")}
             for p in ("gate_proj", "up_proj", "down_proj")}
        assert s["gate_proj"]["weight_scale_2"].shape == ()
        assert ex.w13_gs[e] == torch.reciprocal(s["gate_proj"]["weight_scale_2"])
        assert ex.w2_gs[e] == torch.reciprocal(s["down_proj"]["weight_scale_2"])
        in_gate, in_up = s["gate_proj"]["input_scale"], s["up_proj"]["input_scale"]
        assert ex.a13_gs[e] == torch.reciprocal(torch.maximum(in_gate, in_up))
        assert ex.a2_gs[e] == torch.reciprocal(s["down_proj"]["input_scale"])
        # One correctly rounded reciprocal: gs * stored is 1 within 2^-24 (checked in float64).
        assert abs(float(ex.w13_gs[e].double() * s["gate_proj"]["weight_scale_2"].double()) - 1) <= 2.0**-24


# --------------------------------------------------------------------------- against the bf16 base


@pytest.mark.parametrize("name", QUANTIZED)
def test_dequantized_weights_match_the_bf16_base(name):
    # README section 6: every decoded quantized layer is 0.093-0.096 (relative, Frobenius) from
    # the bf16 base; [0.085, 0.105] brackets that. Swapped nibbles give ~1.41, far outside.
    for layer in LAYERS:
        ex = moe_fp4.load_experts(DATA / name, layer)
        w13, w2 = ex.dequantize()
        bad13, _ = with_fields(ex, w13=swap_nibbles(ex.w13)).dequantize()
        for e in range(E):
            p = f"model.layers.{layer}.mlp.experts.{e}."
            base = raw("bf16")
            for got, want in ((w13[e, :I], base[p + "gate_proj.weight"]), (w13[e, I:], base[p + "up_proj.weight"]),
                              (w2[e], base[p + "down_proj.weight"])):
                assert 0.085 <= rel(got, want) <= 0.105
            assert rel(bad13[e, :I], base[p + "gate_proj.weight"]) > 1.0


def test_float64_dequantization_per_expert_and_whole():
    ex = moe_fp4.load_experts(DATA / MODELOPT, 1)
    w13, w2 = ex.dequantize(torch.float64)
    for e in (0, 5):
        one13, one2 = ex.dequantize(torch.float64, expert=e)
        assert torch.equal(one13, w13[e]) and torch.equal(one2, w2[e])
    # The float32 dequantization rounds once: within 2^-24 relative of the float64 one.
    f13, f2 = ex.dequantize()
    assert float(((f13.double() - w13).abs() / w13.abs().clamp_min(1e-30)).max()) <= 2.0**-24
    assert float(((f2.double() - w2).abs() / w2.abs().clamp_min(1e-30)).max()) <= 2.0**-24


def base_moe_fp64(layer: int, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The Qwen3-MoE block on the bf16 base weights, token by token, in float64."""
    base = raw("bf16")
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        xt = x[t].double()
        for j in range(topk_ids.shape[1]):
            p = f"model.layers.{layer}.mlp.experts.{int(topk_ids[t, j])}."
            gate = base[p + "gate_proj.weight"].double() @ xt
            up = base[p + "up_proj.weight"].double() @ xt
            act = gate * torch.sigmoid(gate) * up
            out[t] += float(topk_weights[t, j]) * (base[p + "down_proj.weight"].double() @ act)
    return out


def tokens(seed: int, m: int = 48) -> torch.Tensor:
    # max |x| ~ 2.2: about a quarter of the calibrated input amax (6-8.7 across layers and
    # checkpoints), the range `moe-fp4 verify` uses (its docstring: no intermediate saturation).
    return (torch.randn(m, H, generator=torch.Generator().manual_seed(seed)) * 0.5).to(torch.bfloat16)


# The MoE block (W4A4) against the float64 MoE of the bf16 base: the weight error (0.094 per
# matrix, 0.16 through the block) and the activation error of both GEMMs (0.16) add to
# 0.22-0.24 measured here. [0.12, 0.30] brackets that with margin; swapped nibbles (>1),
# inverted global scales (>1e6) or exchanged gate/up halves (~0.4) all land outside.
BLOCK_ERR = (0.12, 0.30)


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("name", QUANTIZED)
def test_moe_block_against_float64_bf16_base(name, layer):
    block = load_moe_block(DATA / name, layer)
    assert torch.equal(block.router.gate_weight, raw("bf16")[f"model.layers.{layer}.mlp.gate.weight"])
    x = tokens(layer)
    w, ids = block.router(x)
    ref = base_moe_fp64(layer, x, w, ids)
    ex = block.experts

    def err(experts: NvFp4Experts) -> float:
        return rel(fused_moe(x, experts, w, ids, backend="reference"), ref)

    assert BLOCK_ERR[0] < rel(block(x, backend="reference"), ref) < BLOCK_ERR[1]
    # The same check demonstrably fails for the loader mistakes it guards against.
    assert err(with_fields(ex, w13=swap_nibbles(ex.w13), w2=swap_nibbles(ex.w2))) > BLOCK_ERR[1]
    assert err(with_fields(ex, w13_gs=1 / ex.w13_gs, w2_gs=1 / ex.w2_gs)) > BLOCK_ERR[1]
    flipped = {k: torch.cat([getattr(ex, k)[:, I:], getattr(ex, k)[:, :I]], 1).contiguous()
               for k in ("w13", "w13_scale")}
    assert err(with_fields(ex, **flipped)) > BLOCK_ERR[1]


# --------------------------------------------------------------------------- across producers


def test_compressed_tensors_folders_hold_identical_weights():
    # README section 3: nvfp4_ct and nvfp4_llmc differ only in input_global_scale.
    for layer in LAYERS:
        a, b = moe_fp4.load_experts(DATA / "nvfp4_ct", layer), moe_fp4.load_experts(DATA / "nvfp4_llmc", layer)
        for k in ("w13", "w2", "w13_gs", "w2_gs"):
            assert torch.equal(getattr(a, k), getattr(b, k))
        for k in ("w13_scale", "w2_scale"):
            assert torch.equal(getattr(a, k).view(torch.uint8), getattr(b, k).view(torch.uint8))


@pytest.mark.parametrize("ct", CT)
def test_compressed_tensors_and_modelopt_versions_agree(ct):
    for layer in LAYERS:
        a, b = moe_fp4.load_experts(DATA / ct, layer), moe_fp4.load_experts(DATA / MODELOPT, layer)
        # README section 6: 98.1-99.8% identical codes (rounding ties, global-scale precision).
        for k in ("w13", "w2"):
            assert float((unpack_e2m1(getattr(a, k)) == unpack_e2m1(getattr(b, k))).float().mean()) >= 0.98
        # compressed-tensors rounds its global scales to bf16 (2^-9 relative); measured max 0.45%.
        for k in ("w13_gs", "w2_gs"):
            assert float((getattr(a, k) / getattr(b, k) - 1).abs().max()) <= 0.01
        # Dequantized weights: 1-2% of codes one FP4 step apart plus the bf16 rounding of the
        # global scale give 0.029-0.035 (relative, Frobenius), a third of the quantization
        # error itself (0.095), so the two versions are one model. 0.05 bounds it.
        (a13, a2), (b13, b2) = a.dequantize(torch.float64), b.dequantize(torch.float64)
        assert rel(a13, b13) <= 0.05 and rel(a2, b2) <= 0.05
        # The MoE on those weights: the block compounds its three matrices' differences as it
        # does their quantization error (0.095 per matrix -> 0.16 through the block, see
        # BLOCK_ERR), so 0.035 -> ~0.06 (measured 0.054-0.061); 0.08 bounds it, half the
        # block's own quantization error.
        x = tokens(10 + layer)
        w, ids = Checkpoint(DATA / ct).load_router(layer)(x)
        assert rel(dequantized_moe(x, a, w, ids), dequantized_moe(x, b, w, ids)) <= 0.08
