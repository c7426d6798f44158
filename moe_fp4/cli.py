"""``moe-fp4`` / ``python -m moe_fp4``: info, demo, verify, bench."""

from __future__ import annotations

import argparse
import importlib
import platform
import sys
import time

import torch

# Subcommands implemented in other modules: each exposes add_arguments(parser) and run(args) -> int.
# They are imported only when their subcommand runs (or to build their --help).
_PLUGINS = {
    "verify": ("moe_fp4.checkpoint.verify", "check every MoE layer of a checkpoint on every backend"),
    "bench": ("moe_fp4.bench.cli", "time fused_moe per backend beside vLLM's Marlin and a bf16 grouped-GEMM MoE"),
}


def _versions() -> str:
    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    try:
        import importlib.metadata as md

        parts.append(f"triton {md.version('triton')}")
    except Exception:  # noqa: BLE001 - only informational
        parts.append("triton not installed")
    return ", ".join(parts)


def cmd_info(args: argparse.Namespace) -> int:
    from . import __version__
    from .backends.registry import BACKENDS, explain_backend

    print(f"moe_fp4 {__version__} ({_versions()})")
    print("backends:")
    for b in BACKENDS.values():
        print(f"  {b.name:9s} {b.summary}; compute capability {b.capability_text()}")
    try:
        from .backends import cutlass  # noqa: F401  (describes the native library, if any)

        print(cutlass.library_summary())
    except Exception as exc:  # noqa: BLE001 - info must never crash
        print(f"CUDA library: {exc}")
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    for d in devices:
        print()
        print(explain_backend(d))
    return 0


def _demo_shapes(device: torch.device, full: bool) -> tuple[int, int, int, int, int]:
    """(E, topk, H, I, M): Qwen3-30B-A3B's MoE layer on a GPU, scaled down on CPU."""
    if device.type == "cuda" or full:
        return 128, 8, 2048, 768, 256
    return 16, 4, 512, 256, 32


def cmd_demo(args: argparse.Namespace) -> int:
    from .backends.registry import select_backend
    from .experts import NvFp4Experts
    from .moe import fused_moe

    device = torch.device(args.device) if args.device else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    )
    E, topk, H, I, M = _demo_shapes(device, args.full)
    if args.tokens:
        M = args.tokens
    dtype = torch.bfloat16
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    print(f"Qwen3-30B-A3B-shaped MoE layer: E={E}, top-{topk}, H={H}, I={I}, M={M} tokens, {dtype}, on {device}"
          + ("" if (E, H, I) == (128, 2048, 768) else " (scaled down on CPU so it takes seconds; --full for the real shape)"))
    w13 = (torch.randn(E, 2 * I, H, generator=gen) / 15).to(dtype).to(device)
    w2 = (torch.randn(E, H, I, generator=gen) / 15).to(dtype).to(device)
    x = (torch.randn(M, H, generator=gen) / 10).to(dtype).to(device)
    logits = torch.randn(M, E, generator=gen).to(device)
    topk_weights, topk_ids = torch.softmax(logits, dim=-1).topk(topk, dim=-1)
    # Activation global scales from the data, as a calibration would set them.
    a13_gs = torch.full((E,), 2688.0 / float(x.abs().max()), device=device)
    a2_gs = torch.full((E,), 2688.0 / 0.5, device=device)
    experts = NvFp4Experts.quantize(w13, w2, a13_gs=a13_gs, a2_gs=a2_gs)

    name = select_backend(args.backend, device, dtype)
    print(f"backend: {name} (asked for {args.backend!r}; `moe-fp4 info` explains the choice)")
    out = fused_moe(x, experts, topk_weights, topk_ids, backend=name)
    if device.type == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        out = fused_moe(x, experts, topk_weights, topk_ids, backend=name)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    ref = fused_moe(x, experts, topk_weights, topk_ids, backend="reference")
    diff = (out.float() - ref.float())
    rel = float(diff.norm() / ref.float().norm().clamp_min(1e-30))
    times.sort()
    med = times[len(times) // 2]
    print(f"relative error vs the reference backend: {rel:.3e} (max abs diff {float(diff.abs().max()):.3e})")
    print(f"time per forward: {med * 1e3:.3f} ms (median of {args.repeat}, host wall clock incl. launch)")
    ok = rel < 1e-2
    print("OK" if ok else "MISMATCH: the backend disagrees with the reference")
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-fp4", description="Fused NVFP4 Mixture-of-Experts kernels.")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="devices, compute capabilities and which backend runs where").set_defaults(func=cmd_info)
    d = sub.add_parser("demo", help="one Qwen3-30B-A3B-shaped MoE layer on the best backend, checked against the reference")
    d.add_argument("--backend", default="auto", help="auto (default), cutlass, triton or reference")
    d.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    d.add_argument("--tokens", type=int, default=None, help="number of tokens M")
    d.add_argument("--full", action="store_true", help="use the full Qwen3-30B-A3B shape on CPU too (slow)")
    d.add_argument("--repeat", type=int, default=3, help="timed repetitions")
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=cmd_demo)
    for name, (module, help_text) in _PLUGINS.items():
        sp = sub.add_parser(name, help=help_text)
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            sp.set_defaults(func=lambda a, exc=exc, name=name: _missing(name, exc))
            continue
        mod.add_arguments(sp)
        sp.set_defaults(func=mod.run)
    return p


def _missing(name: str, exc: Exception) -> int:
    print(f"moe-fp4 {name}: unavailable ({exc})", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, RuntimeError) as exc:
        print(f"moe-fp4 {args.command}: error: {exc}", file=sys.stderr)
        return 2
