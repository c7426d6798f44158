"""Checkpoint configuration: the MoE shape keys and the two NVFP4 formats.

Two producers write NVFP4 MoE checkpoints:

* **compressed-tensors** (llm-compressor, RedHatAI): ``config.json`` ->
  ``quantization_config`` with ``quant_method "compressed-tensors"`` and format
  ``nvfp4-pack-quantized``. Per linear ``X``: ``X.weight_packed`` U8, ``X.weight_scale``
  F8_E4M3, ``X.weight_global_scale`` and ``X.input_global_scale`` F32 ``[1]``, stored in the
  quantize direction (``2688/amax``, values bf16-rounded). Unquantized modules are listed
  in ``ignore`` (names or ``re:`` patterns).
* **ModelOpt** (NVIDIA): ``hf_quant_config.json`` (or ``config.json`` ``quant_method
  "modelopt"``) with ``quant_algo "NVFP4"`` (or ``"MIXED_PRECISION"`` with a
  ``quantized_layers`` map). Per linear ``X``: ``X.weight`` U8, ``X.weight_scale`` F8_E4M3,
  ``X.weight_scale_2`` and ``X.input_scale`` F32 0-d, stored as **multipliers**
  (``amax/2688``): the reciprocals of moe_fp4's global scales. Unquantized modules are
  listed in ``exclude_modules`` (names or ``*`` wildcards).

The packed bytes and the row-major block scales are the same in both formats.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["MoEConfig", "QuantFormat", "detect_format", "read_config"]

CT = "compressed-tensors"
MODELOPT = "modelopt"
_CT_NVFP4 = "nvfp4-pack-quantized"


@dataclass(frozen=True)
class QuantFormat:
    """How one checkpoint names and scales its NVFP4 tensors.

    suffixes:   tensor-name suffix per role: ``packed`` (U8 codes), ``block_scale`` (F8_E4M3),
                ``weight_global`` and ``input_global`` (F32 per-tensor scales).
    reciprocal: True when the per-tensor scales are stored as ``amax/2688`` (multipliers),
                False when stored as moe_fp4's quantize-direction ``2688/amax``.
    fused_suffixes: for fused 3-D expert tensors (``experts.gate_up_proj``): the suffix
                appended with ``_`` to the fused name per role (``""`` = the bare name), or
                None when the format has no known fused layout.
    excluded:   patterns of modules left unquantized (``ignore`` / ``exclude_modules``).
    algos:      ModelOpt ``MIXED_PRECISION``: ``{module: quant_algo}``; empty otherwise.
    source:     the file the quantization settings came from, for error messages.
    """

    name: str
    suffixes: dict[str, str]
    reciprocal: bool
    fused_suffixes: dict[str, str] | None
    excluded: tuple[str, ...]
    source: str
    algos: dict[str, str] = field(default_factory=dict)

    def tensor_names(self, module: str) -> dict[str, str]:
        """Names of the four tensors of the per-expert linear ``module``."""
        return {role: f"{module}.{s}" for role, s in self.suffixes.items()}

    def fused_tensor_names(self, fused: str) -> dict[str, str]:
        """Names of the four tensors of a fused 3-D expert tensor family (e.g. ``...experts.gate_up_proj``)."""
        if self.fused_suffixes is None:
            raise ValueError(
                f"{fused}: fused 3-D expert tensors are not a known layout of {self.name} checkpoints "
                f"(known for ModelOpt: {fused}{{,_weight_scale,_weight_scale_2,_input_scale}}); "
                "store the experts per expert (experts.N.gate_proj, ...)"
            )
        return {role: fused + (f"_{s}" if s else "") for role, s in self.fused_suffixes.items()}

    def _matches(self, module: str, pattern: str) -> bool:
        if self.name == CT:
            return bool(re.match(pattern[3:], module)) if pattern.startswith("re:") else pattern == module
        return fnmatch.fnmatchcase(module, pattern)

    def unquantized_reason(self, module: str) -> str | None:
        """Why the config says ``module`` is not NVFP4 W4A4, or None when it is.

        compressed-tensors matches its ``ignore`` entries against the linear module's own
        name (exactly, or ``re.match`` for ``re:`` entries); ModelOpt matches
        ``exclude_modules`` (``*`` wildcards) against the module and its parent modules.
        """
        parts = module.split(".")
        owners = [module] if self.name == CT else [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
        for owner in owners:
            for pattern in self.excluded:
                if self._matches(owner, pattern):
                    what = "ignore" if self.name == CT else "exclude_modules"
                    return f"{owner} is listed as unquantized ({what} entry {pattern!r} in {self.source})"
        if self.algos:
            algo = next((self.algos[o] for o in owners if o in self.algos), None)
            if algo != "NVFP4":
                got = "not in quantized_layers" if algo is None else f"quant_algo {algo!r}"
                return f"{module} is {got} in {self.source}; moe_fp4 needs NVFP4 (W4A4)"
        return None


@dataclass(frozen=True)
class MoEConfig:
    """The MoE settings of ``config.json`` (its ``text_config`` for multimodal models).

    Key drift is accepted: the expert count is ``num_experts`` (hub Qwen3-MoE configs),
    ``num_local_experts`` (transformers 5) or ``n_routed_experts`` (they must agree where
    several are present). The expert size is ``moe_intermediate_size``, else
    ``intermediate_size``. ``norm_topk_prob`` defaults to False, as in transformers'
    ``Qwen3MoeConfig``.
    """

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    norm_topk_prob: bool


def _json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file}: expected JSON, it does not parse ({exc})") from None
    if not isinstance(data, dict):  # a malformed file (ValueError), not an argument of the wrong type
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}")  # noqa: TRY004
    return data


def _int_key(cfg: dict, keys: tuple[str, ...], file: Path) -> int:
    found = {k: cfg[k] for k in keys if cfg.get(k) is not None}
    if not found:
        raise ValueError(f"{file}: expected one of the keys {list(keys)}, found none")
    values = set(found.values())
    if len(values) > 1:
        raise ValueError(f"{file}: the keys {list(found)} disagree: {found}")
    (value,) = values
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{file}: expected {next(iter(found))!r} to be a positive integer, got {value!r}")
    return value


def read_config(folder: Path) -> tuple[dict, MoEConfig]:
    """``(config.json as a dict, its MoEConfig)``."""
    file = folder / "config.json"
    if not file.is_file():
        raise ValueError(f"path: expected a checkpoint folder with a config.json, found none in {folder}")
    config = _json(file)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    moe = MoEConfig(
        num_experts=_int_key(text, ("num_experts", "num_local_experts", "n_routed_experts"), file),
        top_k=_int_key(text, ("num_experts_per_tok",), file),
        hidden_size=_int_key(text, ("hidden_size",), file),
        # The experts' size; "intermediate_size" is the dense MLP's when both are present.
        intermediate_size=_int_key(
            text, ("moe_intermediate_size",) if "moe_intermediate_size" in text else ("intermediate_size",), file
        ),
        norm_topk_prob=bool(text.get("norm_topk_prob", False)),
    )
    if moe.top_k > moe.num_experts:
        raise ValueError(f"{file}: num_experts_per_tok ({moe.top_k}) exceeds the number of experts ({moe.num_experts})")
    return config, moe


def _compressed_tensors(qc: dict, file: Path) -> QuantFormat:
    groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
    formats = {qc.get("format")} | {g.get("format") for g in groups}
    if _CT_NVFP4 not in formats:
        got = sorted(str(f) for f in formats if f is not None)
        raise ValueError(f"{file}: compressed-tensors format {got} is not NVFP4 (expected {_CT_NVFP4!r})")
    if qc.get("quantization_status", "compressed") != "compressed":
        raise ValueError(
            f"{file}: quantization_status is {qc.get('quantization_status')!r}; expected 'compressed' "
            "(other states store fake-quantized 16-bit weights, not packed NVFP4)"
        )
    nvfp4 = [g for g in groups if g.get("format", qc.get("format")) == _CT_NVFP4]
    for g in nvfp4:
        w = g.get("weights") or {}
        if (w.get("num_bits"), w.get("type"), w.get("group_size")) != (4, "float", 16):
            raise ValueError(
                f"{file}: an {_CT_NVFP4} group has weights {{num_bits: {w.get('num_bits')}, type: {w.get('type')}, "
                f"group_size: {w.get('group_size')}}}; NVFP4 is {{4, float, 16}}"
            )
    if nvfp4 and all(not g.get("input_activations") for g in nvfp4):
        raise ValueError(
            f"{file}: the NVFP4 groups quantize weights only (no input_activations, W4A16); moe_fp4 runs W4A4 "
            "and needs each expert's input_global_scale"
        )
    ignore = qc.get("ignore") or []
    return QuantFormat(
        name=CT,
        suffixes={"packed": "weight_packed", "block_scale": "weight_scale",
                  "weight_global": "weight_global_scale", "input_global": "input_global_scale"},
        reciprocal=False,
        fused_suffixes=None,
        excluded=tuple(str(p) for p in ignore),
        source=f"{file.name} quantization_config",
    )


def _modelopt(q: dict, file: Path, where: str) -> QuantFormat:
    algo = q.get("quant_algo")
    algos: dict[str, str] = {}
    if algo == "MIXED_PRECISION":
        layers = q.get("quantized_layers") or {}
        algos = {str(k): str(v.get("quant_algo")) for k, v in layers.items() if isinstance(v, dict)}
        if "NVFP4" not in algos.values():
            raise ValueError(
                f"{file}: MIXED_PRECISION quantized_layers hold no NVFP4 module "
                f"(algorithms {sorted(set(algos.values()))})"
            )
    elif algo != "NVFP4":
        raise ValueError(f"{file}: ModelOpt quant_algo {algo!r} is not NVFP4 (expected 'NVFP4' or 'MIXED_PRECISION')")
    group = q.get("group_size", 16)
    if group != 16:
        raise ValueError(f"{file}: ModelOpt group_size {group!r}; NVFP4 uses 16")
    excluded = q.get("exclude_modules") or q.get("ignore") or []
    return QuantFormat(
        name=MODELOPT,
        suffixes={"packed": "weight", "block_scale": "weight_scale",
                  "weight_global": "weight_scale_2", "input_global": "input_scale"},
        reciprocal=True,
        # Qwen3.5/3.6-MoE exports keep the experts fused on disk:
        # experts.gate_up_proj{,_weight_scale,_weight_scale_2,_input_scale}.
        fused_suffixes={"packed": "", "block_scale": "weight_scale",
                        "weight_global": "weight_scale_2", "input_global": "input_scale"},
        excluded=tuple(str(p) for p in excluded),
        source=where,
        algos=algos,
    )


def detect_format(folder: Path, config: dict) -> QuantFormat:
    """The NVFP4 format of the checkpoint in ``folder`` (whose ``config.json`` is ``config``).

    ``hf_quant_config.json`` (ModelOpt) takes precedence over ``config.json``'s
    ``quantization_config``; anything that is not one of the two NVFP4 formats raises.
    """
    hf = folder / "hf_quant_config.json"
    if hf.is_file():
        data = _json(hf)
        q = data.get("quantization")
        if not isinstance(q, dict):
            raise ValueError(f"{hf}: expected a 'quantization' object, got {q!r}")
        return _modelopt(q, hf, hf.name)
    file = folder / "config.json"
    qc = config.get("quantization_config")
    if qc is None and isinstance(config.get("text_config"), dict):
        qc = config["text_config"].get("quantization_config")
    if qc is None:
        raise ValueError(
            f"{folder}: not a quantized checkpoint (config.json has no quantization_config and there is no "
            "hf_quant_config.json); moe_fp4 loads NVFP4 checkpoints (compressed-tensors or ModelOpt)"
        )
    if not isinstance(qc, dict):  # a malformed file (ValueError), not an argument of the wrong type
        got = type(qc).__name__
        raise ValueError(f"{file}: expected quantization_config to be an object, got {got}")  # noqa: TRY004
    method = qc.get("quant_method")
    if method == CT:
        return _compressed_tensors(qc, file)
    if method == MODELOPT:
        return _modelopt(qc, file, f"{file.name} quantization_config")
    raise ValueError(
        f"{file}: quantization_config.quant_method {method!r} is not a known NVFP4 format "
        f"(expected {CT!r} or {MODELOPT!r})"
    )
