"""NVFP4 MoE checkpoints in Hugging Face transformers (>= 5), the experts running in moe_fp4.

    from moe_fp4.integrations.transformers import load_model
    model = load_model("Qwen3-30B-A3B-NVFP4", device="cuda")        # compressed-tensors or ModelOpt
    out = model.generate(input_ids, max_new_tokens=32, do_sample=False)

**The seam.** transformers 5 decorates a model's fused experts module (``Qwen3MoeExperts``:
``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, ``forward(hidden_states [T, H],
top_k_index [T, k], top_k_weights [T, k])``) with ``use_experts_implementation``: its forward
is looked up by name, ``config._experts_implementation``, in
``transformers.integrations.moe.ExpertsInterface``. :func:`register` adds the name
``"moe_fp4"`` there. :func:`patch` gives each experts module a :class:`moe_fp4.nn.FusedMoE`
child (``<...>.mlp.experts.moe_fp4``) holding the checkpoint's NVFP4 tensors, deletes its
16-bit ``gate_up_proj``/``down_proj`` and selects ``"moe_fp4"``; the model's own router
(``mlp.gate``) and everything around the experts stay transformers'. Expert-parallel
sentinel ids (``== num_experts`` of the module, transformers' mark of an off-rank slot) are
mapped to ``-1``, which :func:`moe_fp4.fused_moe` skips.

**Loading** (:func:`load_model`). The model is built from the checkpoint's ``config.json``
without its ``quantization_config`` (so no transformers quantizer runs) with every parameter
on the meta device, then filled from the safetensors files (``safetensors.safe_open``):

* the experts of every MoE layer: :func:`moe_fp4.load_experts` (NVFP4 as stored, never
  dequantized);
* every other NVFP4 linear (attention projections, ...; compressed-tensors
  ``weight_packed``/``weight_scale``/``weight_global_scale``, ModelOpt ``weight`` (uint8)/
  ``weight_scale``/``weight_scale_2``): dequantized to the model dtype with its global scale,
  ``e2m1 * scale`` (exact in float32) divided by ``weight_global_scale`` (compressed-tensors)
  or multiplied by ``weight_scale_2`` (ModelOpt) in float64, rounded once to the dtype. Their
  input scales (and ModelOpt FP8 KV-cache ``k_scale``/``v_scale``) are not used: these linears
  and the KV cache run in the model dtype;
* everything else (router, embeddings, norms, ``lm_head``): as stored (cast to the model dtype
  when it differs).

A checkpoint tensor that no parameter takes, or a parameter that no tensor fills, raises
``ValueError`` naming it.

Building the empty model briefly replaces ``torch.nn.Module.register_parameter`` (as
accelerate's ``init_empty_weights`` does) so that parameters are created on the meta device
while buffers (rotary frequencies) are computed as usual; do not construct other modules in
other threads during :func:`load_model`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from .. import dequantize_nvfp4
from ..backends.registry import check_precision
from ..checkpoint import Checkpoint, list_moe_layers, load_experts
from ..nn import FusedMoE

__all__ = ["IMPLEMENTATION", "experts_forward", "load_model", "patch", "register"]

IMPLEMENTATION = "moe_fp4"
"""The name of moe_fp4's experts implementation in transformers' ``ExpertsInterface``."""

_CHILD = "moe_fp4"  # the FusedMoE submodule of a patched experts module
_INSTALL = "pip install 'moe_fp4[transformers]' (or: pip install 'transformers>=5,<6')"
_MODEL_DTYPES = (torch.bfloat16, torch.float16)
_EXPERTS_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts$")
# Per-linear tensors of the NVFP4 formats that a dequantized linear does not use.
_UNUSED_SUFFIXES = ("input_global_scale", "input_scale", "k_scale", "v_scale")
_BUILD_LOCK = threading.Lock()


def _transformers() -> ModuleType:
    """The transformers module, or an ImportError saying how to install it."""
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            f"moe_fp4.integrations.transformers needs Hugging Face transformers >= 5: {_INSTALL}"
        ) from exc
    return transformers


def _experts_interface() -> type | None:
    _transformers()
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        return None
    return ExpertsInterface


# --------------------------------------------------------------------------- the experts seam
def experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts forward signature, run by the module's :class:`~moe_fp4.nn.FusedMoE`.

    ``self`` is the model's experts module (e.g. ``Qwen3MoeExperts``) after :func:`patch`.
    Ids equal to ``self.num_experts`` (transformers' expert-parallel sentinel) become ``-1``.
    """
    if _CHILD not in self._modules:
        raise RuntimeError(
            f"experts_implementation {IMPLEMENTATION!r} is selected but this {type(self).__name__} has no moe_fp4 "
            "experts: load the model with moe_fp4.integrations.transformers.load_model(path) or call patch(model, path)"
        )
    moe = self._modules[_CHILD]
    sentinel = getattr(self, "num_experts", moe.num_experts)
    ids = top_k_index.masked_fill(top_k_index == sentinel, -1)
    return moe(hidden_states, top_k_weights, ids)


def register() -> bool:
    """Add ``"moe_fp4"`` to transformers' ``ExpertsInterface``; False if this transformers has none.

    Idempotent. Raises ImportError (with the install command) when transformers is missing.
    """
    interface = _experts_interface()
    if interface is None:
        return False
    interface.register(IMPLEMENTATION, experts_forward)
    return True


def _require_interface() -> ModuleType:
    tf = _transformers()
    if not register():
        raise ImportError(
            f"transformers {tf.__version__} has no transformers.integrations.moe.ExpertsInterface, which moe_fp4 "
            f"plugs into: {_INSTALL}"
        )
    return tf


def _experts_modules(model: nn.Module) -> dict[int, tuple[str, nn.Module]]:
    """``{layer: (name, module)}`` of the model's fused experts modules (``...layers.<L>.mlp.experts``)."""
    found: dict[int, tuple[str, nn.Module]] = {}
    for name, module in model.named_modules():
        m = _EXPERTS_NAME.search(name)
        if not m or not (hasattr(module, "gate_up_proj") or isinstance(module._modules.get(_CHILD), FusedMoE)):
            continue
        layer = int(m[1])
        if layer in found:
            raise ValueError(f"model: two experts modules for layer {layer}: {found[layer][0]} and {name}")
        found[layer] = (name, module)
    return found


def _check_experts_module(name: str, module: nn.Module, moe: FusedMoE) -> None:
    for attr, want in (("has_gate", True), ("has_bias", False), ("is_transposed", False), ("is_concatenated", True)):
        if getattr(module, attr, want) != want:
            raise ValueError(f"{name}: {attr} = {getattr(module, attr)}; moe_fp4 runs gated, bias-free experts "
                             "with gate_up_proj [E, 2I, H] (gate rows first)")
    act = getattr(getattr(module, "config", None), "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{name}: hidden_act {act!r}; moe_fp4's experts compute SiLU(gate) * up")
    got = (getattr(module, "num_experts", None), getattr(module, "hidden_dim", None),
           getattr(module, "intermediate_dim", None))
    want = (moe.num_experts, moe.hidden_size, moe.intermediate_size)
    if any(g is not None and g != w for g, w in zip(got, want)):
        raise ValueError(f"{name}: the model's experts are (E, H, I) = {got}, the checkpoint's {want}")


def _default_device(module: nn.Module) -> torch.device:
    for t in module.parameters():
        if not t.is_meta:
            return t.device
    return torch.device("cpu")


def patch(
    model: nn.Module,
    path: str | os.PathLike | Checkpoint,
    *,
    backend: str = "auto",
    device: torch.device | str | None = None,
    precision: str = "w4a4",
) -> nn.Module:
    """Give every fused experts module of ``model`` the NVFP4 experts of the checkpoint at ``path``.

    ``model`` is a transformers 5 model (e.g. ``AutoModelForCausalLM.from_config(config)``);
    its ``...layers.<L>.mlp.experts`` modules must be the checkpoint's MoE layers. Each gets a
    :class:`~moe_fp4.nn.FusedMoE` child ``moe_fp4`` (on ``device``, default: where the module's
    weights are, cpu for meta), loses its ``gate_up_proj``/``down_proj`` parameters, and the
    model's experts implementation becomes ``"moe_fp4"``. Nothing else of the model changes
    (routers, attention and the rest are the caller's). ``backend`` and ``precision`` are the
    experts' :func:`moe_fp4.fused_moe` arguments. Returns ``model``.
    """
    _require_interface()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a transformers model (torch.nn.Module), got {type(model).__name__}")
    if not hasattr(model, "set_experts_implementation"):
        raise TypeError(f"model: expected a transformers PreTrainedModel (with set_experts_implementation), "
                        f"got {type(model).__name__}")
    ckpt = path if isinstance(path, Checkpoint) else Checkpoint(path)
    targets = _experts_modules(model)
    layers = list_moe_layers(ckpt)
    if sorted(targets) != layers:
        raise ValueError(f"path: the checkpoint's MoE layers {layers} are not the model's experts modules "
                         f"{ {k: v[0] for k, v in sorted(targets.items())} }")
    for layer, (name, module) in sorted(targets.items()):
        dev = torch.device(device) if device is not None else _default_device(module)
        moe = FusedMoE.from_experts(load_experts(ckpt, layer, device=dev), backend=backend, precision=precision)
        _check_experts_module(name, module, moe)
        for p in ("gate_up_proj", "down_proj"):
            module._parameters.pop(p, None)
        module.add_module(_CHILD, moe)
    model.set_experts_implementation(IMPLEMENTATION)
    return model


# --------------------------------------------------------------------------- loading
@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Create every ``nn.Parameter`` on the meta device; buffers are created as usual."""
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    with _BUILD_LOCK:
        nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
        try:
            yield
        finally:
            nn.Module.register_parameter = original  # type: ignore[method-assign]


def _config(tf: ModuleType, folder: Path):
    """The checkpoint's config without its quantization_config (also removed from a text_config)."""
    file = folder / "config.json"
    if not file.is_file():
        raise ValueError(f"path: expected a checkpoint folder with a config.json, found none in {folder}")
    data = json.loads(file.read_text())
    data.pop("quantization_config", None)
    if isinstance(data.get("text_config"), dict):
        data["text_config"].pop("quantization_config", None)
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"{file}: no model_type; transformers cannot tell which model to build")
    return tf.AutoConfig.for_model(model_type, **data)


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"path: no safetensors files in {folder}")
    return files


class _Tensors:
    """Name -> (file, dtype string) over the checkpoint's safetensors files; reads on demand."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        self._files = {}
        self.where: dict[str, Path] = {}
        self.dtype: dict[str, str] = {}
        for file in _safetensors_files(folder):
            f = self._files[file] = safe_open(str(file), framework="pt", device="cpu")
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                self.where[name] = file
                self.dtype[name] = f.get_slice(name).get_dtype()

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> torch.Tensor:
        return self._files[self.where[name]].get_tensor(name)


def _nvfp4_linears(tensors: _Tensors) -> dict[str, tuple[str, str, str, bool]]:
    """``{module: (packed, block_scale, global_scale, divide)}`` of the NVFP4 linears; ``divide``:
    the global scale is compressed-tensors' divisor (else ModelOpt's multiplier)."""
    out = {}
    for name, dtype in tensors.dtype.items():
        module, _, suffix = name.rpartition(".")
        if suffix == "weight_packed":
            out[module] = (name, f"{module}.weight_scale", f"{module}.weight_global_scale", True)
        elif suffix == "weight" and dtype == "U8":
            out[module] = (name, f"{module}.weight_scale", f"{module}.weight_scale_2", False)
    for module, (_, scale, gs, _) in out.items():
        for need in (scale, gs):
            if need not in tensors:
                raise ValueError(f"{need}: missing; {module} is stored as NVFP4 and needs it to be dequantized")
    return out


def _dequantize(tensors: _Tensors, packed: str, scale: str, gs: str, divide: bool, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    g = tensors.get(gs)
    if g.numel() != 1 or g.dtype != torch.float32 or not bool(torch.isfinite(g).all()) or not bool((g > 0).all()):
        raise ValueError(f"{gs}: expected one finite positive float32 global scale, got {g.dtype} {list(g.shape)}")
    scaled = dequantize_nvfp4(tensors.get(packed).to(device), tensors.get(scale).to(device), 1.0)  # e2m1 * scale, exact
    g64 = g.to(device, torch.float64).reshape(())
    return (scaled.double() / g64 if divide else scaled.double() * g64).to(dtype)


def _assign(model: nn.Module, name: str, value: torch.Tensor, device: torch.device) -> None:
    owner, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        module = None
    current = None
    if module is not None:
        current = module._parameters.get(attr)
        if current is None and attr not in module._non_persistent_buffers_set:
            current = module._buffers.get(attr)
    if current is None:
        raise ValueError(f"{name}: a checkpoint tensor that no parameter or buffer of the "
                         f"{type(model).__name__} built from config.json takes")
    if tuple(value.shape) != tuple(current.shape):
        raise ValueError(f"{name}: checkpoint shape {list(value.shape)}, model shape {list(current.shape)}")
    value = value.to(device, current.dtype if current.is_floating_point() else value.dtype)
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[attr] = value


def _load_tensors(model: nn.Module, folder: Path, skip: tuple[str, ...], dtype: torch.dtype,
                  device: torch.device) -> None:
    tensors = _Tensors(folder)
    linears = _nvfp4_linears(tensors)
    consumed = set()
    for module, (packed, scale, gs, divide) in linears.items():
        if module.startswith(skip):
            continue
        _assign(model, f"{module}.weight", _dequantize(tensors, packed, scale, gs, divide, dtype, device), device)
        consumed |= {packed, scale, gs}
    for name in tensors.where:
        if name in consumed or name.startswith(skip) or name.rpartition(".")[2] in _UNUSED_SUFFIXES:
            continue
        if tensors.dtype[name] in ("U8", "F8_E4M3"):
            raise ValueError(f"{name}: a {tensors.dtype[name]} tensor outside an NVFP4 linear; moe_fp4 cannot load it")
        _assign(model, name, tensors.get(name), device)


def _meta_leftovers(model: nn.Module) -> list[str]:
    return [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]


def load_model(
    path: str | os.PathLike,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    backend: str = "auto",
    precision: str = "w4a4",
) -> nn.Module:
    """A transformers model of the NVFP4 (compressed-tensors or ModelOpt) checkpoint at ``path``,
    its experts running in moe_fp4 (module docstring: what is loaded how).

    ``dtype`` (bf16 or fp16) is the model's: activations, the dequantized linears, the rest.
    ``backend`` and ``precision`` are the experts' :func:`moe_fp4.fused_moe` arguments
    (``precision="w4a16"``: 16-bit activations into the experts). The model is in eval mode
    with gradients off; its ``generation_config`` is the checkpoint's when it has one.
    """
    tf = _require_interface()
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a checkpoint folder (str or os.PathLike), got {type(path).__name__}")
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"path: expected a checkpoint folder, got {str(folder)!r}, which is not a directory")
    if dtype not in _MODEL_DTYPES:
        raise TypeError(
            f"dtype: expected torch.bfloat16 or torch.float16 (the activation dtypes of fused_moe), got {dtype}"
        )
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a str, got {type(backend).__name__}")
    check_precision(precision)
    device = torch.device(device)
    ckpt = Checkpoint(folder)
    _ = ckpt.format  # raises for a checkpoint that is not NVFP4
    config = _config(tf, folder)
    from transformers.initialization import no_init_weights

    with _parameters_on_meta(), no_init_weights():
        model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation=IMPLEMENTATION)
    patch(model, ckpt, backend=backend, device=device, precision=precision)
    skip = tuple(f"{name}." for name, _ in _experts_modules(model).values())
    _load_tensors(model, folder, skip, dtype, device)
    if _meta_leftovers(model):
        model.tie_weights()
    missing = _meta_leftovers(model)
    if missing:
        raise ValueError(f"path: {folder} has no tensor for {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    if (folder / "generation_config.json").is_file():
        model.generation_config = tf.GenerationConfig.from_pretrained(folder)
    return model
