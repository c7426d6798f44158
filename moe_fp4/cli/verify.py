"""``moe-fp4 verify PATH``: check every MoE layer of a checkpoint on every available backend.

Prints the checkpoint's settings, then one table row per layer and backend: the relative
error against the float64 MoE of the dequantized weights, the worst element, the relative
difference from the ``reference`` backend, and ``ok`` or ``MISMATCH``
(:mod:`moe_fp4.checkpoint.verify` states the method and the tolerances). The exit status is
0 when every layer passes and 1 on a mismatch; errors in the checkpoint itself exit with 2.
A progress bar is drawn on stderr when it is a terminal, or with ``--progress``.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..checkpoint.verify import BackendResult

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


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
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="hidden-state dtype")
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
    from .._progress import Progress
    from ..checkpoint import verify
    from ..checkpoint.loader import Checkpoint

    ckpt = Checkpoint(args.path)
    fmt = ckpt.format.name
    m = ckpt.moe
    layers = ckpt.moe_layers if args.layers is None else args.layers
    device = verify.resolve_device(args.device)
    dtype = DTYPES[args.dtype]
    backends = verify.resolve_backends(args.backend, device, dtype)
    renorm = "renormalised" if m.norm_topk_prob else "not renormalised"
    print(f"moe-fp4 verify {ckpt.path}")
    print(f"  format {fmt}; {len(ckpt.moe_layers)} MoE layers ({ckpt.prefix}); E={m.num_experts}, "
          f"top-{m.top_k} ({renorm}), H={m.hidden_size}, I={m.intermediate_size}")
    if ckpt.other_prefixes:
        print(f"  not checked: MoE blocks under {', '.join(ckpt.other_prefixes)}")
    print(f"  {device}, {args.dtype}, {args.tokens} random tokens per layer (seed {args.seed} + layer, "
          f"max |x| = {args.input_range} x the calibrated input amax)")
    print(f"  backends: {', '.join(backends)}")
    print(f"  pass: relative error vs the float64 MoE on the dequantized weights <= {verify.TOL_FP64}, "
          f"and vs the reference backend <= {verify.TOL_AGREE}")
    print()
    print(f"{'layer':>5}  {'backend':<9}  {'vs fp64':>7}  {'worst |diff|/max|ref|':<22}  {'vs reference':>12}  result",
          flush=True)

    progress = Progress(len(layers), "verify", enabled=True if args.progress else None, unit="layer")

    def on_layer(report: verify.LayerReport, done: int, total: int) -> None:
        for r in report.results:
            progress.write(_fmt_row(report.layer, r))
        if report.per_half_gate_up:
            progress.write(f"{'':>5}  (gate and up carry different weight global scales: applied per half)")
        progress.update(1, f"layer {report.layer}")

    progress.update(0)
    try:
        reports = verify.verify_checkpoint(ckpt, backends=backends, tokens=args.tokens, seed=args.seed,
                                           device=device, dtype=dtype, layers=layers, input_range=args.input_range,
                                           on_layer=on_layer)
    finally:
        progress.close()
    bad = [r.layer for r in reports if not r.ok]
    print()
    if bad:
        print(f"MISMATCH in {len(bad)} of {len(reports)} layers: {bad}. If the reference backend itself exceeds "
              f"{verify.TOL_FP64} against float64, the tokens may leave the calibrated range: "
              "try a smaller --input-range.")
        return 1
    print(f"OK: {len(reports)} layers, {len(backends)} backend(s) ({', '.join(backends)})")
    return 0
