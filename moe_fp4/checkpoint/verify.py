"""Check every MoE layer of a checkpoint on every available backend (``moe-fp4 verify PATH``).

For each MoE layer: seeded random tokens (scaled into the checkpoint's calibrated input
range), routed by the layer's own router, go through each backend and through
:func:`~moe_fp4.reference.dequantized_moe` (float64, dequantized weights,
unquantized activations). Each :class:`LayerReport` gives, per backend, the relative error
against that float64 MoE, the worst element, and the relative difference from the
``reference`` backend; a layer passes when every backend is within both tolerances. Errors
in the checkpoint itself raise ``ValueError``; a named backend that cannot run raises
:class:`~moe_fp4.errors.BackendUnavailableError`.

Tolerances:

* ``TOL_FP64 = 0.25`` (relative, Frobenius) against the float64 MoE. An NVFP4 W4A4 MoE
  differs from it by the quantization of its two activations (the input and the SiLU
  intermediate, about 0.1 relative each, adding in quadrature): 0.157-0.164 on the tiny
  Qwen3-MoE checkpoints of tests/data for every layer, format and token count tried. The
  loader mistakes this catches are far above: swapped nibbles 1.4, experts out of order
  1.5, inverted weight global scales ~1e9, inverted activation global scales 1.0, gate and
  up exchanged 0.37 (measured on the same checkpoints).
* ``TOL_AGREE = 0.02`` between a backend and the ``reference`` backend, which computes the
  same W4A4 arithmetic exactly. Backends differ only by float32 accumulation order and the
  16-bit roundings that follow, which can move an intermediate value across an FP4
  rounding boundary: perturbing the GEMM accumulators by 2^-17 relative gives at most
  1.3e-3 on the tiny checkpoints. 0.02 leaves room for larger K, and stays 8x below the
  NVFP4 error itself, so a backend bug cannot hide in it.

Tokens: ``x ~ N(0, 1)`` per layer (seed ``seed + layer``), scaled so that
``max|x| = input_range * 2688 / max(a13_gs)``, a fraction of the smallest calibrated input
amax among the layer's experts. Gaussian tokens fill every channel, unlike real hidden
states, so at the full calibrated range the SiLU intermediate can exceed its calibrated
range and saturate (measured: the error against float64 rises to 0.3-0.4 at
``input_range = 1``); the default 0.25 stays clear of that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "TOL_AGREE",
    "TOL_FP64",
    "BackendResult",
    "LayerReport",
    "resolve_backends",
    "resolve_device",
    "verify_checkpoint",
    "verify_layer",
]

TOL_FP64 = 0.25
TOL_AGREE = 0.02


@dataclass(frozen=True)
class BackendResult:
    """One backend on one layer.

    rel_fp64:      ``||out - ref||_F / ||ref||_F`` against the float64 dequantized-weight MoE.
    worst:         ``max |out - ref| / max |ref|``, at ``worst_at = (token, column)``.
    rel_reference: ``||out - out_ref||_F / ||out_ref||_F`` against the ``reference`` backend
                   (None for the reference backend itself).
    """

    backend: str
    rel_fp64: float
    worst: float
    worst_at: tuple[int, int]
    rel_reference: float | None

    @property
    def ok(self) -> bool:
        return self.rel_fp64 <= TOL_FP64 and (self.rel_reference is None or self.rel_reference <= TOL_AGREE)


@dataclass(frozen=True)
class LayerReport:
    layer: int
    results: list[BackendResult]
    per_half_gate_up: bool  # gate and up carry different weight global scales

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (out.double() - ref.double()).norm()
    return float(diff / ref.double().norm().clamp_min(1e-300))


def _random_tokens(experts, tokens: int, seed: int, input_range: float, dtype: torch.dtype) -> torch.Tensor:
    """Seeded Gaussian tokens with ``max|x| = input_range * 2688 / max(a13_gs)`` (module docstring)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(tokens, experts.hidden_size, generator=gen, dtype=torch.float64)
    amax = 2688.0 / float(experts.a13_gs.max())
    return (x * (input_range * amax / x.abs().max())).to(dtype).to(experts.device)


def verify_layer(ckpt, layer: int, backends: list[str], *, tokens: int, seed: int, device: torch.device,
                 dtype: torch.dtype, input_range: float) -> LayerReport:
    """Run one MoE layer through ``backends`` (``"reference"`` first) and the float64 MoE."""
    from ..moe import fused_moe
    from ..reference import dequantized_moe

    block = ckpt.load_moe_block(layer, device)
    x = _random_tokens(block.experts, tokens, seed + layer, input_range, dtype)
    topk_weights, topk_ids = block.router(x)
    ref = dequantized_moe(x, block.experts, topk_weights, topk_ids)
    scale = float(ref.abs().max().clamp_min(1e-300))
    outputs: dict[str, torch.Tensor] = {}
    results = []
    for name in backends:
        out = fused_moe(x, block.experts, topk_weights, topk_ids, backend=name)
        outputs[name] = out
        err = (out.double() - ref).abs()
        flat = int(err.argmax())
        results.append(BackendResult(
            backend=name,
            rel_fp64=_rel(out, ref),
            worst=float(err.max()) / scale,
            worst_at=(flat // err.shape[1], flat % err.shape[1]),
            rel_reference=None if name == "reference" else _rel(out, outputs["reference"]),
        ))
    return LayerReport(layer, results, block.experts.gate_up_scales_differ)


def resolve_backends(requested: list[str] | None, device: torch.device, dtype: torch.dtype) -> list[str]:
    """``reference`` first, then the requested backends (default: every available one).

    Each entry of ``requested`` may hold several comma-separated names; ``"auto"`` is
    resolved. An unknown name raises ``ValueError``, one that cannot run here
    :class:`~moe_fp4.errors.BackendUnavailableError`, with the reason.
    """
    from ..backends.registry import available_backends, select_backend

    if requested:
        names = [n.strip() for r in requested for n in r.split(",") if n.strip()]
    else:
        names = available_backends(device)
    resolved = {select_backend(name, device, dtype) for name in names}
    return ["reference"] + sorted(resolved - {"reference"})


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``device``, or the CUDA device where there is one and the CPU otherwise when None."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def verify_checkpoint(path, *, backends: list[str] | None = None, tokens: int = 64, seed: int = 0,
                      device: torch.device | str | None = None, dtype: torch.dtype = torch.bfloat16,
                      layers: list[int] | None = None, input_range: float = 0.25, on_layer=None) -> list[LayerReport]:
    """Verify ``layers`` (default: every MoE layer) of the checkpoint at ``path``; see the module docstring.

    ``on_layer(report, done, total)`` is called after each layer (for tables and progress).
    """
    from .loader import Checkpoint

    ckpt = path if isinstance(path, Checkpoint) else Checkpoint(path)
    device = resolve_device(device)
    if not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens: expected a positive integer, got {tokens!r}")
    if not 0 < input_range <= 1:
        raise ValueError(
            f"input_range: expected a fraction of the calibrated input range in (0, 1], got {input_range!r}"
        )
    _ = ckpt.format  # an unquantized or non-NVFP4 checkpoint raises here, before any work
    names = resolve_backends(backends, device, dtype)
    todo = ckpt.moe_layers if layers is None else layers
    for layer in todo:
        ckpt._layout(layer)  # validate every requested layer up front
    reports = []
    for i, layer in enumerate(todo):
        reports.append(verify_layer(ckpt, layer, names, tokens=tokens, seed=seed, device=device, dtype=dtype,
                                    input_range=input_range))
        if on_layer is not None:
            on_layer(reports[-1], i + 1, len(todo))
    return reports
