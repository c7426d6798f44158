"""``moe-fp4 verify PATH``: check every MoE layer of a checkpoint on every available backend.

For each MoE layer: seeded random tokens (scaled into the checkpoint's calibrated input
range), routed by the layer's own router, go through each backend and through
:func:`~moe_fp4.checkpoint.reference.dequantized_moe` (float64, dequantized weights,
unquantized activations). A per-layer table gives, per backend, the relative error against
that float64 MoE, the worst element, and the relative difference from the ``reference``
backend. The exit status is 0 when every layer passes, 1 on a mismatch beyond tolerance
(errors in the checkpoint itself raise and give 2 through the CLI).

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

import argparse
import sys
from dataclasses import dataclass

import torch

__all__ = ["TOL_FP64", "TOL_AGREE", "BackendResult", "LayerReport", "add_arguments", "run", "verify_checkpoint"]

TOL_FP64 = 0.25
TOL_AGREE = 0.02
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


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
    from .reference import dequantized_moe

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


def _resolve_backends(requested: list[str] | None, device: torch.device, dtype: torch.dtype) -> list[str]:
    """``reference`` first, then the requested backends (default: every available one); raises if one cannot run."""
    from ..backends.registry import available_backends, select_backend

    if requested:
        names = [n.strip() for r in requested for n in r.split(",") if n.strip()]
    else:
        names = available_backends(device)
    # select_backend raises ValueError / BackendUnavailableError with the reason; it resolves "auto".
    resolved = {select_backend(name, device, dtype) for name in names}
    return ["reference"] + sorted(resolved - {"reference"})


def _device(device: torch.device | str | None) -> torch.device:
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
    device = _device(device)
    if not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens: expected a positive integer, got {tokens!r}")
    if not 0 < input_range <= 1:
        raise ValueError(
            f"input_range: expected a fraction of the calibrated input range in (0, 1], got {input_range!r}"
        )
    _ = ckpt.format  # an unquantized or non-NVFP4 checkpoint raises here, before any work
    names = _resolve_backends(backends, device, dtype)
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


# --------------------------------------------------------------------------- CLI


def _layers_arg(text: str) -> list[int]:
    """``"0,3,5-7"`` -> ``[0, 3, 5, 6, 7]``."""
    out: list[int] = []
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            lo, _, hi = part.partition("-")
            out.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer indices such as 0,3,5-7, got {text!r}") from None
    return out


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="checkpoint folder (config.json + *.safetensors; compressed-tensors or ModelOpt NVFP4)")
    p.add_argument("--backend", action="append", default=None, metavar="NAME",
                   help="backend(s) to check, repeatable or comma-separated (default: every available one); "
                        "the reference backend always runs")
    p.add_argument("--tokens", type=_positive_int, default=64, help="random tokens per layer (default 64)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random tokens (layer L uses seed + L)")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16", help="hidden-state dtype")
    p.add_argument("--layers", type=_layers_arg, default=None, help="only these MoE layers, e.g. 0,3,5-7")
    p.add_argument("--input-range", type=float, default=0.25,
                   help="max |token| as a fraction of the smallest calibrated input amax (default 0.25)")
    p.add_argument("--progress", action="store_true", help="show the progress bar even when stderr is not a terminal")


def _fmt_row(layer: int, r: BackendResult) -> str:
    agree = "-" if r.rel_reference is None else f"{r.rel_reference:.1e}"
    worst = f"{r.worst:.1e} at {r.worst_at}"
    status = "ok" if r.ok else "MISMATCH"
    return f"{layer:>5}  {r.backend:<9}  {r.rel_fp64:>7.4f}  {worst:<22}  {agree:>12}  {status}"


def run(args: argparse.Namespace) -> int:
    from ._progress import Progress
    from .loader import Checkpoint

    ckpt = Checkpoint(args.path)
    fmt = ckpt.format.name
    m = ckpt.moe
    layers = ckpt.moe_layers if args.layers is None else args.layers
    device = _device(args.device)
    dtype = _DTYPES[args.dtype]
    backends = _resolve_backends(args.backend, device, dtype)
    renorm = "renormalised" if m.norm_topk_prob else "not renormalised"
    print(f"moe-fp4 verify {ckpt.path}")
    print(f"  format {fmt}; {len(ckpt.moe_layers)} MoE layers ({ckpt.prefix}); E={m.num_experts}, "
          f"top-{m.top_k} ({renorm}), H={m.hidden_size}, I={m.intermediate_size}")
    if ckpt.other_prefixes:
        print(f"  not checked: MoE blocks under {', '.join(ckpt.other_prefixes)}")
    print(f"  {device}, {args.dtype}, {args.tokens} random tokens per layer (seed {args.seed} + layer, "
          f"max |x| = {args.input_range} x the calibrated input amax)")
    print(f"  backends: {', '.join(backends)}")
    print(f"  pass: relative error vs the float64 MoE on the dequantized weights <= {TOL_FP64}, "
          f"and vs the reference backend <= {TOL_AGREE}")
    print()
    print(f"{'layer':>5}  {'backend':<9}  {'vs fp64':>7}  {'worst |diff|/max|ref|':<22}  {'vs reference':>12}  result")
    sys.stdout.flush()
    progress = Progress(len(layers), "verify", enabled=True if args.progress else None)

    def on_layer(report: LayerReport, done: int, total: int) -> None:
        progress.clear()
        for r in report.results:
            print(_fmt_row(report.layer, r))
        if report.per_half_gate_up:
            print(f"{'':>5}  (gate and up carry different weight global scales: applied per half)")
        sys.stdout.flush()
        progress.update(done, f"layer {report.layer}")

    progress.update(0)
    try:
        reports = verify_checkpoint(ckpt, backends=backends, tokens=args.tokens, seed=args.seed, device=device,
                                    dtype=dtype, layers=layers, input_range=args.input_range, on_layer=on_layer)
    finally:
        progress.close()
    bad = [r.layer for r in reports if not r.ok]
    print()
    if bad:
        print(f"MISMATCH in {len(bad)} of {len(reports)} layers: {bad}. If the reference backend itself exceeds "
              f"{TOL_FP64} against float64, the tokens may leave the calibrated range: try a smaller --input-range.")
        return 1
    print(f"OK: {len(reports)} layers, {len(backends)} backend(s) ({', '.join(backends)})")
    return 0
