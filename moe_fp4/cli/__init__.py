"""``moe-fp4`` / ``python -m moe_fp4``: the command line (info, demo, verify, bench, generate).

Each subcommand is a module exposing ``add_arguments(parser)`` and ``run(args) -> int`` (the
exit status). Every such module is imported when the parser is built, so they keep their
top-level imports light; one that fails to import leaves its subcommand in place, saying why
when it runs. ``main`` turns a
``ValueError``, ``TypeError`` or ``RuntimeError`` (which includes
:class:`~moe_fp4.errors.BackendUnavailableError`) into a one-line message on stderr and the
exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["build_parser", "main"]

_COMMANDS = {
    "info": ("moe_fp4.cli.info", "devices, compute capabilities and which backend runs where"),
    "demo": ("moe_fp4.cli.demo",
             "one Qwen3-30B-A3B-shaped MoE layer on the best backend, checked against the reference"),
    "verify": ("moe_fp4.cli.verify", "check every MoE layer of a checkpoint on every backend"),
    "bench": ("moe_fp4.bench.cli", "time fused_moe per backend beside vLLM's Marlin and a bf16 grouped-GEMM MoE"),
    "generate": ("moe_fp4.cli.generate",
                 "greedy generation from an NVFP4 MoE checkpoint in transformers (needs transformers)"),
}


def _unavailable(name: str, exc: Exception) -> int:
    print(f"moe-fp4 {name}: unavailable ({exc})", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-fp4", description="Fused NVFP4 Mixture-of-Experts kernels.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in _COMMANDS.items():
        sp = sub.add_parser(name, help=help_text)
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            sp.set_defaults(func=lambda a, exc=exc, name=name: _unavailable(name, exc))
            continue
        mod.add_arguments(sp)
        sp.set_defaults(func=mod.run)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, RuntimeError) as exc:
        print(f"moe-fp4 {args.command}: error: {exc}", file=sys.stderr)
        return 2
