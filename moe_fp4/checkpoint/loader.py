"""Load the NVFP4 experts, the router and whole MoE blocks of a checkpoint folder.

Conventions:

* ``w13 = [gate; up]`` per expert (gate rows first), ``w2 = down``; packed bytes and
  row-major block scales are copied bit for bit.
* Global scales become moe_fp4's quantize direction (``2688/amax``, float32):
  compressed-tensors' ``weight_global_scale``/``input_global_scale`` as stored, ModelOpt's
  ``weight_scale_2``/``input_scale`` through one float32 reciprocal each.
* Gate and up weight global scales are compared per expert. When every expert's are equal,
  ``w13_gs`` is ``[E]``; otherwise ``[E, 2]`` (gate, up), applied exactly per half, never
  one of them for both.
* The kernels quantize each expert's input once for gate and up, so one ``a13_gs`` is
  needed where the checkpoint may store two: ``a13_gs = min(gate, up)`` in the quantize
  direction (ModelOpt: ``1/max(input_scale)``), the choice that cannot overflow the e4m3
  block scales for inputs within either calibrated range. The producers write equal gate
  and up input scales, so this is normally exact. ``a2_gs`` is down's.
* Input scales may be per expert or one per layer (fused ModelOpt exports write a 0-d
  tensor); either is broadcast to ``[E]``.
* Fused 3-D expert tensors (``experts.gate_up_proj [E, 2I, H/2]`` with gate rows first,
  ``experts.down_proj [E, H, I/2]``, and their ``_weight_scale``, ``_weight_scale_2``,
  ``_input_scale``: the ModelOpt naming of Qwen3.5/3.6-MoE exports, which keep the experts
  fused on disk) are read as well; ``weight_scale_2`` may be ``[]``, ``[E]`` or ``[E, 2]``
  (gate, up).

A layer whose experts are not NVFP4 W4A4, or only partly, and a tensor missing or of the
wrong dtype or shape raise ``ValueError`` naming the first offending tensor or module.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .._checks import dtype_name
from ..experts import NvFp4Experts, _check_block_scales
from ..format import BLOCK_SIZE
from ..moe import fused_moe
from ._safetensors import TORCH_DTYPES, TensorStore
from .formats import QuantFormat, detect_format, read_config
from .router import Router

__all__ = [
    "Checkpoint",
    "MoEBlock",
    "list_moe_layers",
    "load_experts",
    "load_moe_block",
    "load_router",
]

_FLOAT_DTYPES = ("BF16", "F16", "F32")
# <prefix>.layers.<L>.mlp.experts.<rest>: per expert "<e>.<proj>.<suffix>", fused "<proj>[_<suffix>]".
_EXPERTS_RE = re.compile(r"^(?P<prefix>(?:.+\.)?layers)\.(?P<layer>\d+)\.mlp\.experts\.(?P<rest>.+)$")
_PER_EXPERT_RE = re.compile(r"^(?P<expert>\d+)\.(?:gate_proj|up_proj|down_proj)\.")
_FUSED_RE = re.compile(r"^(?:gate_up_proj|down_proj)(?:_|$)")


@dataclass
class _LayerLayout:
    experts: set[int] = field(default_factory=set)  # expert indices of per-expert tensors
    fused: list[str] = field(default_factory=list)  # names of fused 3-D expert tensors


@dataclass(frozen=True)
class _Linear:
    """One projection of every expert: packed ``[E, N, K/2]``, scales ``[E, N, K/16]``,
    weight and input global scales ``[E]`` or ``[E, 2]`` (fused gate/up), quantize direction."""

    packed: torch.Tensor
    scale: torch.Tensor
    weight_gs: torch.Tensor
    input_gs: torch.Tensor


def _halves(gs: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate [E], up [E]) of a gate/up global scale that is ``[E]`` (shared) or ``[E, 2]``."""
    if gs.dim() == 2:
        return gs[:, 0].contiguous(), gs[:, 1].contiguous()
    return gs.expand(E), gs.expand(E)


@dataclass(frozen=True)
class MoEBlock:
    """One MoE block of a checkpoint: its router and its NVFP4 experts.

    ``block(hidden_states)`` routes ``[M, H]`` bf16/fp16 hidden states and runs
    :func:`moe_fp4.fused_moe`; the result is ``[M, H]`` in the hidden-state dtype. This is
    the whole Qwen3-MoE block; models with a shared expert beside the routed ones
    (Qwen2-MoE, Qwen3.5-MoE) add its output on top, which this block does not compute.
    """

    layer: int
    router: Router
    experts: NvFp4Experts

    def __call__(self, hidden_states: torch.Tensor, *, backend: str = "auto", precision: str = "w4a4") -> torch.Tensor:
        topk_weights, topk_ids = self.router(hidden_states)
        return fused_moe(hidden_states, self.experts, topk_weights, topk_ids, backend=backend, precision=precision)


class Checkpoint:
    """A checkpoint folder, indexed: ``config.json``, the quantization format, tensor headers.

    Opening reads only JSON (the config files and the safetensors headers). Tensors are
    read when a layer is loaded. The module docstring states the loading conventions.

    Attributes:
        path:   the folder.
        config: ``config.json`` as a dict.
        moe:    its :class:`~moe_fp4.checkpoint.formats.MoEConfig` (E, top-k, H, I, renormalisation).
        prefix: the module path of the decoder layers holding MoE blocks (``model.layers``).
        other_prefixes: further module paths with MoE blocks (e.g. an MTP stack), not loaded.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path: expected a checkpoint folder (str or os.PathLike), got {type(path).__name__}")
        folder = Path(path)
        if not folder.is_dir():
            raise ValueError(f"path: expected a checkpoint folder, got {str(folder)!r}, which is not a directory")
        self.path = folder
        self.config, self.moe = read_config(folder)
        self.store = TensorStore(folder)
        self._format: QuantFormat | None = None
        stacks: dict[str, dict[int, _LayerLayout]] = {}
        for name in self.store.names():
            m = _EXPERTS_RE.match(name)
            if not m:
                continue
            layout = stacks.setdefault(m["prefix"], {}).setdefault(int(m["layer"]), _LayerLayout())
            if e := _PER_EXPERT_RE.match(m["rest"]):
                layout.experts.add(int(e["expert"]))
            elif _FUSED_RE.match(m["rest"]):
                layout.fused.append(name)
        ranked = sorted(stacks, key=lambda p: (-len(stacks[p]), p))
        self.prefix = ranked[0] if ranked else "model.layers"
        self.other_prefixes = ranked[1:]
        self._layers = stacks.get(self.prefix, {})

    def __repr__(self) -> str:
        m = self.moe
        return (f"Checkpoint({str(self.path)!r}, {len(self._layers)} MoE layers, E={m.num_experts}, "
                f"top-{m.top_k}, H={m.hidden_size}, I={m.intermediate_size})")

    # ------------------------------------------------------------------ metadata
    @property
    def format(self) -> QuantFormat:
        """The NVFP4 format (raises ``ValueError`` for an unquantized or non-NVFP4 checkpoint)."""
        if self._format is None:
            self._format = detect_format(self.path, self.config)
        return self._format

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the decoder layers that hold routed experts, ascending."""
        return sorted(self._layers)

    def _layout(self, layer: int) -> _LayerLayout:
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise TypeError(f"layer: expected an int, got {type(layer).__name__}")
        if layer not in self._layers:
            raise ValueError(f"layer: expected one of the MoE layers {self.moe_layers} of {self.path}, got {layer}")
        return self._layers[layer]

    # ------------------------------------------------------------------ tensors
    def _tensor(self, name: str, dtypes: tuple[str, ...], shapes: tuple[tuple[int, ...], ...]) -> torch.Tensor:
        """Read ``name`` after checking its header dtype (one of ``dtypes``) and shape (one of ``shapes``)."""
        want = " or ".join(str(list(s)) for s in shapes)
        kinds = " or ".join(f"{d} ({dtype_name(TORCH_DTYPES[d])})" for d in dtypes)
        if name not in self.store:
            raise ValueError(f"{name}: missing from {self.path} (expected a {kinds} tensor of shape {want})")
        info = self.store.info(name)
        if info.dtype not in dtypes:
            raise ValueError(f"{name}: expected dtype {kinds}, got {info.dtype}{self._where(name)}")
        if info.shape not in shapes:
            raise ValueError(f"{name}: expected shape {want}, got {list(info.shape)}{self._where(name)}")
        return self.store.get(name)

    def _where(self, name: str) -> str:
        """`` (in FILE)``: the file holding tensor ``name``, for error messages."""
        return f" (in {self.store.info(name).file})"

    def _global_scale(self, name: str, stored: torch.Tensor, E: int) -> torch.Tensor:
        """Stored per-tensor scale(s) -> quantize-direction float32, ``[E]`` or ``[E, 2]``."""
        values = stored.flatten()[:8].tolist()
        if not bool(torch.isfinite(stored).all()) or not bool((stored > 0).all()):
            raise ValueError(f"{name}: expected finite positive global scales, got {values}{self._where(name)}")
        gs = torch.reciprocal(stored) if self.format.reciprocal else stored
        if not bool(torch.isfinite(gs).all()):
            raise ValueError(f"{name}: its reciprocal overflows float32 (stored {values}){self._where(name)}")
        if gs.dim() == 2:
            return gs.contiguous()
        return gs.reshape(-1).expand(E).contiguous() if gs.numel() == 1 else gs.contiguous()

    def _read_linear(self, module: str, names: dict[str, str], packed_shape: tuple[int, ...],
                     global_shapes: tuple[tuple[int, ...], ...], E: int) -> _Linear:
        """The four NVFP4 tensors of one linear (or one fused expert family), validated."""
        reason = self.format.unquantized_reason(module)
        if reason:
            raise ValueError(f"{module}: not NVFP4: {reason}")
        for name in (names["packed"], f"{module}.weight"):
            if name in self.store and self.store.info(name).dtype in _FLOAT_DTYPES:
                raise ValueError(
                    f"{name}: stored unquantized ({self.store.info(name).dtype}); moe_fp4 needs every expert "
                    f"projection in NVFP4 ({self.format.name}: {names['packed']} U8), "
                    "so this layer is only partly quantized"
                )
        packed = self._tensor(names["packed"], ("U8",), (packed_shape,))
        K = packed_shape[-1] * 2
        scale = self._tensor(names["block_scale"], ("F8_E4M3",), (packed_shape[:-1] + (K // BLOCK_SIZE,),))
        try:
            _check_block_scales(names["block_scale"], scale)
        except ValueError as exc:
            raise ValueError(f"{exc}{self._where(names['block_scale'])}") from None
        wg = self._tensor(names["weight_global"], ("F32",), global_shapes)
        ig = self._tensor(names["input_global"], ("F32",), global_shapes)
        return _Linear(packed, scale, self._global_scale(names["weight_global"], wg, E),
                       self._global_scale(names["input_global"], ig, E))

    def _read_per_expert(self, base: str, layout: _LayerLayout) -> dict[str, _Linear]:
        m = self.moe
        E, H, I = m.num_experts, m.hidden_size, m.intermediate_size
        extra = sorted(e for e in layout.experts if e >= E)
        if extra:
            raise ValueError(
                f"{base}.{extra[0]}: expert index {extra[0]} is out of range for num_experts = {E} in config.json"
            )
        shapes = {"gate_proj": (I, H // 2), "up_proj": (I, H // 2), "down_proj": (H, I // 2)}
        out = {}
        for proj, packed_shape in shapes.items():
            per = [self._read_linear(f"{base}.{e}.{proj}", self.format.tensor_names(f"{base}.{e}.{proj}"),
                                     packed_shape, ((), (1,)), 1) for e in range(E)]
            out[proj] = _Linear(
                torch.stack([q.packed for q in per]),
                torch.stack([q.scale for q in per]),
                torch.cat([q.weight_gs for q in per]),
                torch.cat([q.input_gs for q in per]),
            )
        return out

    def _read_fused(self, base: str) -> dict[str, _Linear]:
        m = self.moe
        E, H, I = m.num_experts, m.hidden_size, m.intermediate_size
        scalar = ((), (1,), (E,))
        gate_up = self._read_linear(f"{base}.gate_up_proj", self.format.fused_tensor_names(f"{base}.gate_up_proj"),
                                    (E, 2 * I, H // 2), scalar + ((E, 2),), E)
        down = self._read_linear(f"{base}.down_proj", self.format.fused_tensor_names(f"{base}.down_proj"),
                                 (E, H, I // 2), scalar, E)
        wg_gate, wg_up = _halves(gate_up.weight_gs, E)
        ig_gate, ig_up = _halves(gate_up.input_gs, E)
        return {
            "gate_proj": _Linear(gate_up.packed[:, :I], gate_up.scale[:, :I], wg_gate, ig_gate),
            "up_proj": _Linear(gate_up.packed[:, I:], gate_up.scale[:, I:], wg_up, ig_up),
            "down_proj": down,
        }

    # ------------------------------------------------------------------ public loaders
    def load_experts(self, layer: int, device: torch.device | str = "cpu") -> NvFp4Experts:
        """The NVFP4 experts of MoE layer ``layer`` on ``device`` (conventions: module docstring)."""
        layout = self._layout(layer)
        base = f"{self.prefix}.{layer}.mlp.experts"
        if layout.fused and layout.experts:
            raise ValueError(
                f"{layout.fused[0]}: layer {layer} stores both fused 3-D expert tensors and per-expert tensors "
                f"({base}.{min(layout.experts)}.*); expected one layout"
            )
        p = self._read_fused(base) if layout.fused else self._read_per_expert(base, layout)
        gate, up, down = p["gate_proj"], p["up_proj"], p["down_proj"]
        same = torch.equal(gate.weight_gs, up.weight_gs)
        tensors = {
            "w13": torch.cat([gate.packed, up.packed], dim=1),
            "w13_scale": torch.cat([gate.scale, up.scale], dim=1),
            "w13_gs": gate.weight_gs if same else torch.stack([gate.weight_gs, up.weight_gs], dim=1),
            "w2": down.packed,
            "w2_scale": down.scale,
            "w2_gs": down.weight_gs,
            "a13_gs": torch.minimum(gate.input_gs, up.input_gs),
            "a2_gs": down.input_gs,
        }
        device = torch.device(device)
        # Copied to a GPU, the tensors are the experts' own (a backend may re-lay them out in place);
        # on the CPU they may alias what the reader returned.
        return NvFp4Experts(**{k: v.contiguous().to(device) for k, v in tensors.items()}, own=device.type != "cpu")

    def load_router(self, layer: int, device: torch.device | str = "cpu") -> Router:
        """The router of MoE layer ``layer``: ``mlp.gate.weight`` (16-bit or fp32), top-k and
        renormalisation from config.json."""
        self._layout(layer)
        m = self.moe
        name = f"{self.prefix}.{layer}.mlp.gate.weight"
        weight = self._tensor(name, _FLOAT_DTYPES, ((m.num_experts, m.hidden_size),))
        return Router(weight.to(torch.device(device)), m.top_k, m.norm_topk_prob)

    def load_moe_block(self, layer: int, device: torch.device | str = "cpu") -> MoEBlock:
        """Router and experts of MoE layer ``layer``: a runnable :class:`MoEBlock`."""
        return MoEBlock(layer, self.load_router(layer, device), self.load_experts(layer, device))


def _open(path: str | os.PathLike | Checkpoint) -> Checkpoint:
    return path if isinstance(path, Checkpoint) else Checkpoint(path)


def list_moe_layers(path: str | os.PathLike | Checkpoint) -> list[int]:
    """Indices of the decoder layers of the checkpoint at ``path`` that hold routed experts."""
    return _open(path).moe_layers


def load_experts(path: str | os.PathLike | Checkpoint, layer: int, device: torch.device | str = "cpu") -> NvFp4Experts:
    """The NVFP4 experts of MoE layer ``layer`` of the checkpoint at ``path`` (see :class:`Checkpoint`)."""
    return _open(path).load_experts(layer, device)


def load_router(path: str | os.PathLike | Checkpoint, layer: int, device: torch.device | str = "cpu") -> Router:
    """The Qwen3-MoE router of MoE layer ``layer`` of the checkpoint at ``path``."""
    return _open(path).load_router(layer, device)


def load_moe_block(path: str | os.PathLike | Checkpoint, layer: int, device: torch.device | str = "cpu") -> MoEBlock:
    """Router and NVFP4 experts of MoE layer ``layer`` of the checkpoint at ``path``."""
    return _open(path).load_moe_block(layer, device)
