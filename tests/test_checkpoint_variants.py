"""Checkpoint layouts the tiny checkpoints do not have, and malformed checkpoints.

Each test rewrites one of the tiny real checkpoints into ``tmp_path`` (safetensors.torch
``save_file``): sharded, fused 3-D experts, config key drift, gate != up global scales,
ignored modules, and every kind of bad input. Where a variant holds the same weights as
its source, the loaded experts must equal the source's exactly.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save, save_file
from test_checkpoint import DATA, MODELOPT, E, H, I, raw, tokens

import moe_fp4
from moe_fp4 import NvFp4Experts, fused_moe
from moe_fp4.checkpoint import Checkpoint, load_router
from moe_fp4.checkpoint._safetensors import TensorStore

CT = "nvfp4_ct"
F8 = torch.float8_e4m3fn


def make_variant(
    tmp_path: Path,
    src: str,
    edit: Callable[[dict[str, torch.Tensor]], None] | None = None,
    config: Callable[[dict], None] | None = None,
    hf_quant: Callable[[dict], None] | None = None,
) -> Path:
    """Copy ``tests/data/tiny_qwen3_moe/<src>`` to ``tmp_path/ckpt``, editing the tensors and configs in place."""
    dst = tmp_path / "ckpt"
    dst.mkdir(parents=True)
    tensors = {k: v.clone() for k, v in raw(src).items()}  # edits may work in place: spare the cache
    if edit is not None:
        edit(tensors)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for file, fn in (("config.json", config), ("hf_quant_config.json", hf_quant)):
        if (DATA / src / file).is_file():
            data = json.loads((DATA / src / file).read_text())
            if fn is not None:
                fn(data)
            (dst / file).write_text(json.dumps(data))
    return dst


def assert_same_experts(a: NvFp4Experts, b: NvFp4Experts) -> None:
    for k in NvFp4Experts._fields():
        x, y = getattr(a, k), getattr(b, k)
        if x.dtype == F8:
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        assert x.shape == y.shape and torch.equal(x, y), k


def expert_name(layer: int, e: int, proj: str, suffix: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{e}.{proj}.{suffix}"


# --------------------------------------------------------------------------- sharded


@pytest.mark.parametrize("src", [CT, MODELOPT])
def test_sharded_checkpoint_loads_like_the_single_file(tmp_path, src):
    single = make_variant(tmp_path, src)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for file in ("config.json", "hf_quant_config.json"):
        if (single / file).is_file():
            (sharded / file).write_text((single / file).read_text())
    names = sorted(raw(src))
    weight_map = {}
    for i in range(3):  # interleaved split: every layer spans all three shards
        shard = f"model-{i + 1:05d}-of-00003.safetensors"
        part = names[i::3]
        save_file({n: raw(src)[n].contiguous() for n in part}, str(sharded / shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for layer in (0, 1):
        assert_same_experts(moe_fp4.load_experts(sharded, layer), moe_fp4.load_experts(single, layer))
    assert moe_fp4.list_moe_layers(sharded) == [0, 1]

    # The index decides: a tensor mapped to a shard that lacks it, or a missing shard, is named.
    name = expert_name(0, 3, "up_proj", "weight_scale")
    wrong = next(shard for shard in sorted(set(weight_map.values())) if shard != weight_map[name])
    index = sharded / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {**weight_map, name: wrong}}))
    with pytest.raises(ValueError, match=f"{name}.*{wrong}.*does not hold it"):
        Checkpoint(sharded)
    index.write_text(json.dumps({"weight_map": {**weight_map, name: "model-00009-of-00009.safetensors"}}))
    with pytest.raises(ValueError, match="model-00009-of-00009.safetensors.*does not exist"):
        Checkpoint(sharded)
    index.write_text("{not json")
    with pytest.raises(ValueError, match="weight_map"):
        Checkpoint(sharded)


# --------------------------------------------------------------------------- fused 3-D experts


def fuse_layer(t: dict[str, torch.Tensor], layer: int, ws2_gate_up: str = "per-expert",
               input_scale: str = "layer") -> None:
    """Replace layer ``layer``'s per-expert ModelOpt tensors by fused 3-D ones, named as Qwen3.5/3.6-MoE exports do.

    ws2_gate_up: "per-expert" -> weight_scale_2 [E]; "per-half" -> [E, 2]; "layer" -> 0-d.
    input_scale: "layer" -> 0-d; "per-expert" -> [E].
    """
    def take(e: int, proj: str, suffix: str) -> torch.Tensor:
        return t.pop(expert_name(layer, e, proj, suffix))

    base = f"model.layers.{layer}.mlp.experts"
    per = {(proj, s): [take(e, proj, s) for e in range(E)]
           for proj in ("gate_proj", "up_proj", "down_proj")
           for s in ("weight", "weight_scale", "weight_scale_2", "input_scale")}
    for suffix, fused in (("weight", "gate_up_proj"), ("weight_scale", "gate_up_proj_weight_scale")):
        pairs = zip(per["gate_proj", suffix], per["up_proj", suffix])
        t[f"{base}.{fused}"] = torch.stack([torch.cat(gate_up) for gate_up in pairs])
    gate_ws2, up_ws2 = torch.stack(per["gate_proj", "weight_scale_2"]), torch.stack(per["up_proj", "weight_scale_2"])
    t[f"{base}.gate_up_proj_weight_scale_2"] = {"per-expert": gate_ws2, "per-half": torch.stack([gate_ws2, up_ws2], 1),
                                                "layer": gate_ws2.max()}[ws2_gate_up]
    t[f"{base}.down_proj"] = torch.stack(per["down_proj", "weight"])
    t[f"{base}.down_proj_weight_scale"] = torch.stack(per["down_proj", "weight_scale"])
    t[f"{base}.down_proj_weight_scale_2"] = torch.stack(per["down_proj", "weight_scale_2"])
    for proj, fused in (("gate_proj", "gate_up_proj"), ("down_proj", "down_proj")):
        values = torch.stack(per[proj, "input_scale"])
        t[f"{base}.{fused}_input_scale"] = values[0] if input_scale == "layer" else values


def test_fused_3d_experts_load_like_per_expert_tensors(tmp_path):
    # The tiny ModelOpt checkpoint's input scales are one value per layer (README section 7, in
    # tests/data/tiny_qwen3_moe/), so a 0-d fused input_scale holds the same information: the
    # experts must be identical.
    path = make_variant(tmp_path, MODELOPT, edit=lambda t: fuse_layer(t, 0))
    ckpt = Checkpoint(path)
    assert ckpt.moe_layers == [0, 1]
    assert_same_experts(ckpt.load_experts(0), moe_fp4.load_experts(DATA / MODELOPT, 0))
    assert_same_experts(ckpt.load_experts(1), moe_fp4.load_experts(DATA / MODELOPT, 1))


def test_fused_per_expert_input_scales_and_per_half_weight_scales(tmp_path):
    def edit(t):
        fuse_layer(t, 0, ws2_gate_up="per-half", input_scale="per-expert")
        # Make the scales per expert really differ, then check each lands on its expert.
        t["model.layers.0.mlp.experts.down_proj_input_scale"] *= torch.arange(1, E + 1)
    ex = moe_fp4.load_experts(make_variant(tmp_path, MODELOPT, edit=edit), 0)
    ref = moe_fp4.load_experts(DATA / MODELOPT, 0)
    assert ex.w13_gs.shape == (E,)  # [E, 2] with equal columns collapses to the shared form
    assert torch.equal(ex.w13_gs, ref.w13_gs)
    assert torch.equal(ex.a2_gs, torch.reciprocal(torch.reciprocal(ref.a2_gs) * torch.arange(1, E + 1)))


def test_fused_layer_scalar_weight_scale_is_broadcast(tmp_path):
    ex = moe_fp4.load_experts(make_variant(tmp_path, MODELOPT, edit=lambda t: fuse_layer(t, 1, ws2_gate_up="layer")), 1)
    assert ex.w13_gs.shape == (E,) and bool((ex.w13_gs == ex.w13_gs[0]).all())


def test_fused_and_per_expert_in_one_layer_is_an_error(tmp_path):
    def edit(t):
        keep = {k: v for k, v in t.items() if ".layers.0.mlp.experts.0." in k}
        fuse_layer(t, 0)
        t.update(keep)
    with pytest.raises(ValueError, match="both fused 3-D expert tensors and per-expert tensors"):
        moe_fp4.load_experts(make_variant(tmp_path, MODELOPT, edit=edit), 0)


def test_fused_experts_in_compressed_tensors_are_refused_clearly(tmp_path):
    def edit(t):  # no producer is known to write these; a guessed naming must not half-load
        experts = [k for k in t if k.startswith("model.layers.0.mlp.experts.")]
        packed = torch.stack([t[expert_name(0, e, "gate_proj", "weight_packed")] for e in range(E)])
        for k in experts:
            del t[k]
        t["model.layers.0.mlp.experts.gate_up_proj_weight_packed"] = packed
    with pytest.raises(ValueError, match="fused 3-D expert tensors are not a known layout of compressed-tensors"):
        moe_fp4.load_experts(make_variant(tmp_path, CT, edit=edit), 0)


# --------------------------------------------------------------------------- config key drift


def test_hub_config_keys_num_experts_and_rope_theta(tmp_path):
    def hub(cfg):  # the keys hub Qwen3-MoE configs use
        cfg["num_experts"] = cfg.pop("num_local_experts")
        cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    path = make_variant(tmp_path, CT, config=hub)
    assert Checkpoint(path).moe == Checkpoint(DATA / CT).moe
    assert_same_experts(moe_fp4.load_experts(path, 0), moe_fp4.load_experts(DATA / CT, 0))


def test_text_config_of_a_multimodal_model(tmp_path):
    def nest(cfg):
        text = {k: cfg.pop(k) for k in ("num_local_experts", "num_experts_per_tok", "hidden_size",
                                        "moe_intermediate_size", "intermediate_size", "norm_topk_prob")}
        cfg["text_config"] = text
    assert Checkpoint(make_variant(tmp_path, CT, config=nest)).moe == Checkpoint(DATA / CT).moe


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(num_experts=4), r"keys \['num_experts', 'num_local_experts'\] disagree"),
    (lambda c: c.pop("num_local_experts"),
     r"expected one of the keys \['num_experts', 'num_local_experts', 'n_routed_experts'\]"),
    (lambda c: c.update(num_experts_per_tok=0), "'num_experts_per_tok' to be a positive integer, got 0"),
    (lambda c: c.update(num_experts_per_tok=9), r"num_experts_per_tok \(9\) exceeds the number of experts \(8\)"),
])
def test_bad_config_keys(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        Checkpoint(make_variant(tmp_path, CT, config=change))


def test_fewer_experts_in_config_than_stored(tmp_path):
    path = make_variant(tmp_path, CT, config=lambda c: c.update(num_local_experts=4))
    with pytest.raises(ValueError, match=r"experts\.4: expert index 4 is out of range for num_experts = 4"):
        moe_fp4.load_experts(path, 0)


def test_norm_topk_prob_false_gives_an_unnormalised_router(tmp_path):
    router = load_router(make_variant(tmp_path, CT, config=lambda c: c.update(norm_topk_prob=False)), 0)
    assert router.renormalize is False
    w, _ = router(tokens(0))
    assert bool((w.sum(-1) < 1 - 1e-3).all())  # raw softmax mass of 2 of 8 experts


# --------------------------------------------------------------------------- gate != up


def halve_up_scales(src: str, layer: int, e: int) -> Callable[[dict[str, torch.Tensor]], None]:
    """Re-express expert ``e``'s up_proj with a global scale 2x smaller (CT; ModelOpt: multiplier 2x larger)
    and block scales halved: the same weights exactly, as long as halving the e4m3 scales is exact."""
    def edit(t):
        sf = t[expert_name(layer, e, "up_proj", "weight_scale")]
        half = (sf.float() / 2).to(F8)
        assert torch.equal(half.float() * 2, sf.float()), "halving these block scales is not exact"
        t[expert_name(layer, e, "up_proj", "weight_scale")] = half
        if src == MODELOPT:
            t[expert_name(layer, e, "up_proj", "weight_scale_2")] *= 2
        else:
            t[expert_name(layer, e, "up_proj", "weight_global_scale")] /= 2
    return edit


@pytest.mark.parametrize("src", [CT, MODELOPT])
def test_gate_and_up_with_different_global_scales_stay_exact(tmp_path, src):
    path = make_variant(tmp_path, src, edit=halve_up_scales(src, 0, 3))
    ex, ref = moe_fp4.load_experts(path, 0), moe_fp4.load_experts(DATA / src, 0)
    assert ex.w13_gs.shape == (E, 2) and ex.gate_up_scales_differ
    assert ex.w13_gs[3, 1] == ref.w13_gs[3] / 2 and torch.equal(ex.w13_gs[:, 0], ref.w13_gs)
    assert all(torch.equal(a, b) for a, b in zip(ex.dequantize(torch.float64), ref.dequantize(torch.float64)))
    # Same weights, so the same MoE, bit for bit: the power-of-two rescaling is exact in
    # the per-half alpha. Using the gate's scale for both halves would be off by 2x on up.
    router = load_router(DATA / src, 0)
    x = tokens(1, m=64)
    w, ids = router(x)
    assert bool((ids == 3).any())
    want = fused_moe(x, ref, w, ids, backend="reference")
    assert torch.equal(fused_moe(x, ex, w, ids, backend="reference"), want)
    gate_only = NvFp4Experts(**{k: getattr(ex, k) for k in NvFp4Experts._fields() if k != "w13_gs"},
                             w13_gs=ex.w13_gs[:, 0].contiguous())
    assert not torch.equal(fused_moe(x, gate_only, w, ids, backend="reference"), want)


def test_different_gate_and_up_input_scales_take_the_smaller_quantize_scale(tmp_path):
    name = expert_name(0, 2, "up_proj", "input_global_scale")
    path = make_variant(tmp_path, CT, edit=lambda t: t.update({name: t[name] / 4}))
    ex = moe_fp4.load_experts(path, 0)
    assert ex.a13_gs[2] == raw(CT)[name][0] / 4  # min(gate, up): the one that cannot overflow
    assert ex.a13_gs[1] == raw(CT)[expert_name(0, 1, "gate_proj", "input_global_scale")][0]


# --------------------------------------------------------------------------- ignored / partly quantized


def unquantize(t: dict[str, torch.Tensor], src: str, layer: int, e: int, proj: str) -> None:
    """Store one projection as a bf16 ``.weight`` (as a producer does for an ignored module)."""
    for suffix in ("weight_packed", "weight", "weight_scale", "weight_global_scale", "weight_scale_2",
                   "input_global_scale", "input_scale"):
        t.pop(expert_name(layer, e, proj, suffix), None)
    t[expert_name(layer, e, proj, "weight")] = raw("bf16")[expert_name(layer, e, proj, "weight")]


@pytest.mark.parametrize("src", [CT, MODELOPT])
def test_partly_quantized_layer_names_the_unquantized_tensor(tmp_path, src):
    path = make_variant(tmp_path, src, edit=lambda t: unquantize(t, src, 1, 5, "up_proj"))
    moe_fp4.load_experts(path, 0)  # the other layer is fine
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.5\.up_proj\.weight: stored unquantized \(BF16\)"):
        moe_fp4.load_experts(path, 1)


def test_ignored_experts_are_reported_as_unquantized(tmp_path):
    def edit(t):
        for e in range(E):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                unquantize(t, CT, 1, e, proj)
    def ignore(cfg):  # compressed-tensors ignore entries: names and re: patterns
        cfg["quantization_config"]["ignore"] += [r"re:model\.layers\.1\.mlp\.experts\..*"]
    path = make_variant(tmp_path, CT, edit=edit, config=ignore)
    assert moe_fp4.list_moe_layers(path) == [0, 1]
    moe_fp4.load_experts(path, 0)
    with pytest.raises(ValueError, match=r"experts\.0\.gate_proj: not NVFP4: .* listed as unquantized \(ignore entry"):
        moe_fp4.load_experts(path, 1)
    # The routers are in the ignore list of every real checkpoint and load as bf16.
    assert load_router(path, 1).gate_weight.dtype == torch.bfloat16


def test_modelopt_exclude_modules_parents_and_wildcards(tmp_path):
    def exclude(q, pattern):
        q["quantization"]["exclude_modules"].append(pattern)
    # A parent module's entry covers its children.
    path = make_variant(tmp_path / "a", MODELOPT, hf_quant=lambda q: exclude(q, "model.layers.0.mlp.experts"))
    with pytest.raises(ValueError, match=r"experts\.0\.gate_proj: not NVFP4: model\.layers\.0\.mlp\.experts is "
                                         r"listed as unquantized \(exclude_modules entry 'model\.layers\.0\.mlp\."
                                         r"experts' in hf_quant_config\.json"):
        moe_fp4.load_experts(path, 0)
    moe_fp4.load_experts(path, 1)
    # ModelOpt entries may hold * wildcards.
    path = make_variant(tmp_path / "b", MODELOPT, hf_quant=lambda q: exclude(q, "*.layers.1.mlp.experts.*.down_proj"))
    with pytest.raises(ValueError, match=r"experts\.0\.down_proj is listed as unquantized \(exclude_modules entry '\*"):
        moe_fp4.load_experts(path, 1)
    moe_fp4.load_experts(path, 0)


def test_modelopt_mixed_precision_needs_nvfp4_experts(tmp_path):
    def mixed(q, algo_for_experts):
        q["quantization"]["quant_algo"] = "MIXED_PRECISION"
        q["quantization"]["quantized_layers"] = {
            f"model.layers.{L}.mlp.experts.{e}.{p}": {"quant_algo": algo_for_experts if L == 1 else "NVFP4"}
            for L in (0, 1) for e in range(E) for p in ("gate_proj", "up_proj", "down_proj")}
    path = make_variant(tmp_path, MODELOPT, hf_quant=lambda q: mixed(q, "W4A16_NVFP4"))
    moe_fp4.load_experts(path, 0)
    with pytest.raises(ValueError, match=r"experts\.0\.gate_proj is quant_algo 'W4A16_NVFP4' .*needs NVFP4 \(W4A4\)"):
        moe_fp4.load_experts(path, 1)


# --------------------------------------------------------------------------- malformed tensors


GATE3 = expert_name(0, 3, "gate_proj", "")[:-1]


@pytest.mark.parametrize("src, suffix, change, message", [
    (CT, "weight_scale", None, r"{t}: missing from .* \(expected a F8_E4M3 \(float8_e4m3fn\) tensor of shape \[128, 16\]\)"),
    (CT, "input_global_scale", None, r"{t}: missing from"),
    (MODELOPT, "weight_scale_2", None, r"{t}: missing from .* of shape \[\] or \[1\]"),
    (CT, "weight_scale", lambda v: v.view(torch.uint8), r"{t}: expected dtype F8_E4M3 \(float8_e4m3fn\), got U8 \(in "),
    (CT, "weight_packed", lambda v: v.view(torch.int8), r"{t}: expected dtype U8 \(uint8\), got I8"),
    (CT, "weight_global_scale", lambda v: v.bfloat16(), r"{t}: expected dtype F32 \(float32\), got BF16"),
    (CT, "weight_packed", lambda v: v[:, :64], r"{t}: expected shape \[128, 128\], got \[128, 64\] \(in "),
    (CT, "weight_scale", lambda v: v.T, r"{t}: expected shape \[128, 16\], got \[16, 128\]"),
    (MODELOPT, "input_scale", lambda v: v.reshape(1).repeat(2), r"{t}: expected shape \[\] or \[1\], got \[2\]"),
    (CT, "weight_global_scale", lambda v: v * 0, r"{t}: expected finite positive global scales, got \[0\.0\]"),
    (MODELOPT, "input_scale", lambda v: v * float("nan"), r"{t}: expected finite positive global scales"),
    (CT, "weight_scale", lambda v: torch.full_like(v.view(torch.uint8), 0x7F).view(F8),
     r"{t}: expected finite float8_e4m3fn block scales, got NaN"),
    (MODELOPT, "weight_scale", lambda v: (-v.float()).to(F8), r"{t}: expected non-negative block scales"),
])
def test_malformed_tensors_raise_naming_the_tensor_and_the_file(tmp_path, src, suffix, change, message):
    target = f"{GATE3}.{suffix}"

    def edit(t):
        if change is None:
            del t[target]
        else:
            t[target] = change(t[target])
    path = make_variant(tmp_path, src, edit=edit)
    with pytest.raises(ValueError, match=message.format(t=target.replace(".", r"\."))) as exc:
        moe_fp4.load_experts(path, 0)
    assert str(path) in str(exc.value)


def test_router_weight_must_be_unquantized_and_shaped(tmp_path):
    name = "model.layers.0.mlp.gate.weight"
    with pytest.raises(ValueError, match=rf"{name}: expected dtype BF16 .* got U8 \(in .*model\.safetensors\)"):
        load_router(make_variant(tmp_path, CT, edit=lambda t: t.update({name: t[name].view(torch.uint8)})), 0)
    with pytest.raises(ValueError, match=rf"{name}: expected shape \[8, 256\], got \[8, 128\]"):
        load_router(make_variant(tmp_path / "b", CT, edit=lambda t: t.update({name: t[name][:, :128]})), 0)


# --------------------------------------------------------------------------- formats and folders


@pytest.mark.parametrize("change, message", [
    (lambda c: c["quantization_config"].update(quant_method="gptq"), "quant_method 'gptq' is not a known NVFP4 format"),
    (lambda c: (c["quantization_config"].update(format="float-quantized"),
                c["quantization_config"]["config_groups"]["group_0"].update(format="float-quantized")),
     r"compressed-tensors format \['float-quantized'\] is not NVFP4"),
    (lambda c: c["quantization_config"].update(quantization_status="frozen"), "quantization_status is 'frozen'"),
    (lambda c: c["quantization_config"]["config_groups"]["group_0"].update(input_activations=None),
     r"weights only .*W4A16"),
    (lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(group_size=32), "group_size: 32"),
    (lambda c: c.pop("quantization_config"), "not a quantized checkpoint"),
])
def test_unknown_or_unsupported_compressed_tensors_configs(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        moe_fp4.load_experts(make_variant(tmp_path, CT, config=change), 0)


@pytest.mark.parametrize("change, message", [
    (lambda q: q["quantization"].update(quant_algo="FP8"), "ModelOpt quant_algo 'FP8' is not NVFP4"),
    (lambda q: q["quantization"].update(group_size=32), "group_size 32"),
    (lambda q: q.pop("quantization"), "expected a 'quantization' object"),
])
def test_unknown_or_unsupported_modelopt_configs(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        moe_fp4.load_experts(make_variant(tmp_path, MODELOPT, hf_quant=change), 0)


def test_modelopt_inline_config_without_hf_quant_config(tmp_path):
    # ModelOpt >= 0.31 also writes quantization_config into config.json (quant_method "modelopt").
    path = make_variant(tmp_path, MODELOPT)
    (path / "hf_quant_config.json").unlink()
    assert Checkpoint(path).format.source == "config.json quantization_config"
    assert_same_experts(moe_fp4.load_experts(path, 1), moe_fp4.load_experts(DATA / MODELOPT, 1))


def test_bad_paths_and_files(tmp_path):
    with pytest.raises(TypeError, match="path: expected a checkpoint folder"):
        Checkpoint(3)
    with pytest.raises(ValueError, match="is not a directory"):
        Checkpoint(tmp_path / "nope")
    with pytest.raises(ValueError, match="with a config.json, found none"):
        Checkpoint(tmp_path)
    (tmp_path / "config.json").write_text((DATA / CT / "config.json").read_text())
    with pytest.raises(ValueError, match=r"holding \*\.safetensors files, found none"):
        Checkpoint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    with pytest.raises(ValueError, match="model.safetensors: expected a safetensors file, its JSON header does not"):
        Checkpoint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 8)
    with pytest.raises(ValueError, match="expected a safetensors file, got a header length"):
        Checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="config.json: expected a JSON object, got list"):
        Checkpoint(tmp_path)


def test_layer_argument_is_checked():
    ckpt = Checkpoint(DATA / CT)
    with pytest.raises(ValueError, match=r"layer: expected one of the MoE layers \[0, 1\] .*got 2"):
        ckpt.load_experts(2)
    with pytest.raises(TypeError, match="layer: expected an int, got str"):
        ckpt.load_experts("0")


def test_duplicate_tensor_across_unindexed_files(tmp_path):
    path = make_variant(tmp_path, CT)
    name = "model.layers.0.mlp.gate.weight"
    save_file({name: raw(CT)[name]}, str(path / "extra.safetensors"))
    with pytest.raises(ValueError, match=rf"{name}: stored twice"):
        Checkpoint(path)


def test_loads_onto_the_requested_device(device):
    block = moe_fp4.load_moe_block(DATA / CT, 0, device=device)
    assert block.experts.device.type == device.type and block.router.gate_weight.device.type == device.type
    x = tokens(0).to(device)
    assert block(x, backend="reference").shape == (x.shape[0], H)
    assert block.experts.intermediate_size == I


# --------------------------------------------------------------------------- the safetensors reader


@pytest.mark.parametrize("name", ["bf16", CT, MODELOPT])
def test_reader_matches_the_safetensors_library_bit_for_bit(name):
    store = TensorStore(DATA / name)
    assert sorted(store.names()) == sorted(raw(name))
    for key, want in raw(name).items():
        got = store.get(key)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), key


def valid_file() -> bytes:
    """A valid safetensors file: ``a`` F32 [2] at data bytes [0, 8], ``b`` U8 [4] at [8, 12]."""
    data = {"a": torch.tensor([1.5, -2.0]), "b": torch.arange(4, dtype=torch.uint8)}
    return save(data, metadata={"format": "pt"})


def split(raw: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def join(header: object, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


def header_edit(change: Callable[[dict], None], extra: bytes = b"") -> Callable[[bytes], bytes]:
    """Rewrite the header of a file with ``change`` (and append ``extra`` bytes of data)."""
    def edit(raw: bytes) -> bytes:
        header, data = split(raw)
        change(header)
        return join(header, data + extra)
    return edit


def set_entry(name: str, **fields: object) -> Callable[[dict], None]:
    return lambda h: h[name].update(fields)


@pytest.mark.parametrize("edit, message", [
    (lambda raw: raw[:5], r"expected a safetensors file, got 5 bytes \(too short for a header\)"),
    (lambda raw: raw[:-3], (r"tensor 'b' has data_offsets \[8, 12\], past the end of the data section \(9 bytes\): "
                            "the file is truncated")),
    (lambda raw: len(raw).to_bytes(8, "little") + raw[8:], r"got a header length of (\d+) bytes in a \1-byte file"),
    (lambda raw: b"\xff" * 8 + raw[8:], r"got a header length of \d+ bytes in a \d+-byte file"),
    (lambda raw: raw[:8] + b"(" + raw[9:], r"expected a safetensors file, its JSON header does not parse"),
    (lambda raw: raw[:8] + b"\xff" + raw[9:], r"its JSON header does not parse"),
    (lambda raw: join([1, 2], b""), r"expected a safetensors header object, got list"),
    (header_edit(lambda h: h.update(__metadata__={"format": 3})), r"expected __metadata__ to map names to strings"),
    (header_edit(lambda h: h.update(a=3)), r"tensor 'a' has the header entry 3; expected an object"),
    (header_edit(set_entry("b", dtype="XYZ")), r"tensor 'b' has dtype 'XYZ', which is not a safetensors dtype"),
    (header_edit(set_entry("a", shape="x")), r"tensor 'a' has shape 'x'; expected a list of non-negative integers"),
    (header_edit(set_entry("a", shape=[-2])), r"tensor 'a' has shape \[-2\]; expected a list of non-negative"),
    (header_edit(lambda h: h["a"].pop("data_offsets")), r"tensor 'a' has data_offsets None; expected \[begin, end\]"),
    (header_edit(set_entry("a", data_offsets=[8, 0])), r"tensor 'a' has data_offsets \[8, 0\]; expected \[begin, end\]"),
    (header_edit(set_entry("a", data_offsets=[0, 16])),
     r"tensor 'a' has data_offsets \[0, 16\], past the end of the data section \(12 bytes\)"),
    (header_edit(set_entry("a", shape=[3])),
     r"tensor 'a' has shape \[3\] of F32 \(12 bytes\) but data_offsets \[0, 8\] \(8 bytes\)"),
    (header_edit(set_entry("b", data_offsets=[4, 8])),  # overlaps a
     (r"tensor 'b' has data_offsets \[4, 8\] but tensor 'a' ends at byte 8; tensors must cover the data section "
      "back to back, without gaps or overlaps")),
    (header_edit(set_entry("b", data_offsets=[9, 13]), extra=b"\0"),  # a gap of one byte after a
     r"tensor 'b' has data_offsets \[9, 13\] but tensor 'a' ends at byte 8"),
    (header_edit(lambda h: (h["a"].update(data_offsets=[4, 12]), h["b"].update(data_offsets=[12, 16])),
                 extra=bytes(4)),
     r"tensor 'a' has data_offsets \[4, 12\] but the data section starts at byte 0"),
    (lambda raw: raw + bytes(4), r"the tensors cover 12 bytes of the 16-byte data section; the last 4 bytes belong"),
])
def test_malformed_safetensors_files_raise_naming_the_file_and_the_field(tmp_path, edit, message):
    file = tmp_path / "model.safetensors"
    file.write_bytes(edit(valid_file()))
    with pytest.raises(ValueError, match=message) as exc:
        TensorStore(tmp_path)
    assert str(exc.value).startswith(f"{file}: ")


def test_reader_reads_what_the_header_says_into_memory_of_its_own(tmp_path):
    file = tmp_path / "model.safetensors"
    file.write_bytes(valid_file())
    store = TensorStore(tmp_path)
    assert store.names() == ["a", "b"] and store.info("a").shape == (2,) and store.info("b").dtype == "U8"
    a = store.get("a")
    assert torch.equal(a, torch.tensor([1.5, -2.0])) and torch.equal(store.get("b"), torch.arange(4, dtype=torch.uint8))
    with open(file, "r+b") as f:  # overwrite a's bytes in place: the tensor already read must not change
        f.seek(len(file.read_bytes()) - 12)
        f.write(struct.pack("<2f", 7.0, 7.0))
    assert torch.equal(a, torch.tensor([1.5, -2.0]))
    with pytest.raises(ValueError, match=rf"c: expected this tensor in the checkpoint {tmp_path}, it is missing"):
        store.get("c")


def test_reader_handles_scalars_and_empty_tensors_and_refuses_sub_byte_dtypes(tmp_path):
    file = tmp_path / "model.safetensors"
    file.write_bytes(join({"s": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]},
                           "e": {"dtype": "BF16", "shape": [0, 3], "data_offsets": [4, 4]},
                           "f4": {"dtype": "F4", "shape": [4], "data_offsets": [4, 6]},
                           "__metadata__": {"format": "pt"}}, struct.pack("<f", 2.5) + bytes(2)))
    store = TensorStore(tmp_path)
    s, e = store.get("s"), store.get("e")
    assert s.shape == () and s.item() == 2.5 and e.shape == (0, 3) and e.dtype == torch.bfloat16
    assert store.info("f4").shape == (4,)  # indexed as the header says, but not read:
    with pytest.raises(ValueError, match=rf"{file}: tensor 'f4' has dtype F4, which moe_fp4 does not read"):
        store.get("f4")
