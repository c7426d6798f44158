"""``moe-fp4 info``: versions, the backends, the CUDA library, and which backend runs on each device."""

from __future__ import annotations

import argparse
import platform

import torch


def _versions() -> str:
    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    try:
        import importlib.metadata as md

        parts.append(f"triton {md.version('triton')}")
    except Exception:  # noqa: BLE001 - only informational
        parts.append("triton not installed")
    return ", ".join(parts)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``info`` takes no arguments."""


def run(args: argparse.Namespace) -> int:
    from .. import __version__
    from ..backends.registry import BACKENDS, explain_backend

    print(f"moe_fp4 {__version__} ({_versions()})")
    print("backends:")
    for b in BACKENDS.values():
        print(f"  {b.name:9s} {b.summary}; compute capability {b.capability_text()}; precision {b.precision_text()}")
    try:
        from ..backends import cutlass

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
