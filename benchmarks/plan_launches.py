"""The kernel launches of a Triton plan's forward (the nodes of its CUDA graph), counted on the CPU.

    PYTHONPATH=. python benchmarks/plan_launches.py [--models qwen3-30b-a3b,...] [--tokens 1,4,16,64]
                                                     [--sms 132] [--out FILE.md]

Every Triton kernel is a stub (``moe_fp4.bench.hostcost.stubbed_launches``): ``fused_moe(backend="triton")``
runs its checked stages once and then its plan, whose launches are listed, for the values operand (the
form a 9.x GPU takes) with the GPU's SM count (``--sms``; the H200 has 132), on which the GEMMs'
split-K choice depends. Variants: the plans as bound by default (``FUSE_TOPK_REDUCE`` on: the top-k reduce
adds a split second GEMM's K ranges), ``topk+silu-split`` (also ``FUSE_SILU = "split"``: a split first GEMM's
reduce takes the SiLU-and-mul quantization) and ``in-gemm`` (``FUSE_SPLIT_K_IN_GEMM`` and ``FUSE_TOPK_IN_GEMM``:
the GEMMs' own programs add their K ranges and take the top-k reduce, up to ``TOPK_IN_GEMM_MAX`` flat
indices) and ``in-gemm+silu-split`` (also ``FUSE_SILU = "split"``: a split first GEMM's last K ranges take the
SiLU-and-mul quantization too). Weights and inputs are zeros of the
layer's shapes: only the shapes choose the launches. Nothing runs on a GPU and nothing is timed: a
launch fewer is a graph node fewer; what it saves in time is for ``fusion_ab.py`` on a GPU to show.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys

import torch

import moe_fp4.backends.triton as tb
from moe_fp4 import NvFp4Experts, fused_moe
from moe_fp4.bench.hostcost import stubbed_launches
from moe_fp4.bench.shapes import MODELS

VARIANTS = {"default": {}, "topk+silu-split": {"FUSE_TOPK_REDUCE": True, "FUSE_SILU": "split"},
            "in-gemm": {"FUSE_SPLIT_K_IN_GEMM": True, "FUSE_TOPK_IN_GEMM": True},
            "in-gemm+silu-split": {"FUSE_SPLIT_K_IN_GEMM": True, "FUSE_TOPK_IN_GEMM": True, "FUSE_SILU": "split"}}


def zero_experts(shape) -> NvFp4Experts:
    """NVFP4 experts of ``shape`` whose codes are zeros (scales 1, global scales 1)."""
    E, H, I = shape.E, shape.H, shape.I  # noqa: E741
    u8, f8 = torch.uint8, torch.float8_e4m3fn
    ones = torch.ones(E)
    return NvFp4Experts(torch.zeros(E, 2 * I, H // 2, dtype=u8), torch.ones(E, 2 * I, H // 16).to(f8), ones,
                        torch.zeros(E, H, I // 2, dtype=u8), torch.ones(E, H, I // 16).to(f8), ones, ones, ones)


def plan_launches(experts: NvFp4Experts, shape, tokens: int) -> list[str]:
    """The kernel names of the plan's forward for ``tokens`` tokens (its second call)."""
    x = torch.zeros(tokens, shape.H, dtype=torch.bfloat16)
    w = torch.full((tokens, shape.topk), 1.0 / shape.topk)
    ids = (torch.arange(tokens * shape.topk, dtype=torch.int32) % shape.E).reshape(tokens, shape.topk)
    record: list = []
    with stubbed_launches(record), tb.operand_form("values"):
        fused_moe(x, experts, w, ids, backend="triton", validate=False)  # the checked run: binds the plan
        record.clear()
        fused_moe(x, experts, w, ids, backend="triton", validate=False)
    return [r[0] for r in record if len(r) == 4]


@contextlib.contextmanager
def switches(sms: int, **flags):
    gemm = importlib.import_module("moe_fp4.triton_kernels.gemm")
    saved = {name: getattr(tb, name) for name in flags}, gemm._sm_count
    for name, value in flags.items():
        setattr(tb, name, value)
    gemm._sm_count = lambda device: sms
    try:
        yield
    finally:
        for name, value in saved[0].items():
            setattr(tb, name, value)
        gemm._sm_count = saved[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="qwen3-30b-a3b,llama4-scout", help="comma-separated MODELS keys")
    p.add_argument("--tokens", default="1,4,16,64", help="comma-separated token counts")
    p.add_argument("--sms", type=int, default=132, help="the GPU's SM count (default 132, the H200's)")
    p.add_argument("--out", help="also write the table (Markdown) here")
    args = p.parse_args(argv)
    lines = [f"Launches of a Triton values plan's forward ({args.sms} SMs; counted on the CPU, stubbed, not run)",
             "", "| layer | M | " + " | ".join(VARIANTS) + " | default plan's kernels |",
             "|---|---:|" + "---:|" * len(VARIANTS) + "---|"]
    for model in args.models.split(","):
        shape = MODELS[model]
        for tokens in (int(t) for t in args.tokens.split(",")):
            counts, names = [], None
            for flags in VARIANTS.values():
                with switches(args.sms, **flags):
                    launched = plan_launches(zero_experts(shape), shape, tokens)  # (new experts: a new plan)
                counts.append(str(len(launched)))
                names = names or ", ".join(n.removesuffix("_kernel") for n in launched)
            lines.append(f"| {model} | {tokens} | " + " | ".join(counts) + f" | {names} |")
            print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
