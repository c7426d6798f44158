"""``moe-fp4 demo``: one Qwen3-30B-A3B-shaped MoE layer with random NVFP4 weights on the best backend.

Prints the backend, its relative error against the ``reference`` backend and the median
time per forward: on a GPU the forward's GPU time (a CUDA graph of it replayed, timed with
CUDA events) and beside it the host wall clock of one eager call, which also counts
validation, launch and synchronization; on a CPU the host wall clock. The exit status is 1
when the error is 1e-2 or more.
"""

from __future__ import annotations

import argparse
import time

import torch

QWEN3_30B_A3B = (128, 8, 2048, 768, 256)  # E, top-k, H, I, and the tokens M of the demo
CPU_SHAPE = (16, 4, 512, 256, 32)  # scaled down so that a CPU run takes seconds
TOLERANCE = 1e-2


def _shapes(device: torch.device, full: bool) -> tuple[int, int, int, int, int]:
    """(E, topk, H, I, M): Qwen3-30B-A3B's MoE layer on a GPU or with ``full``, scaled down on a CPU."""
    return QWEN3_30B_A3B if device.type == "cuda" or full else CPU_SHAPE


def _gpu_time(forward, device: torch.device):
    """GPU time of ``forward`` (which writes into one preallocated output): CUDA-graph replays
    bracketed by CUDA events with a cold L2 (:class:`moe_fp4.bench.timing.GpuTimer`, the method
    of the benchmarks), or eager calls if it cannot be captured. Returns (timing, how)."""
    from ..bench.timing import GpuTimer

    timer = GpuTimer(device)
    prepared = timer.prepare(forward)
    timing = timer.time(prepared)
    if prepared.mode == "graph":
        return timing, "CUDA-graph replay timed with CUDA events, cold L2"
    return timing, f"eager calls timed with CUDA events, cold L2: {prepared.note}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="auto", help="auto (default), cutlass, triton or reference")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    p.add_argument("--tokens", type=int, default=None, help="number of tokens M")
    p.add_argument("--full", action="store_true", help="use the full Qwen3-30B-A3B shape on CPU too (slow)")
    p.add_argument("--repeat", type=int, default=3, help="timed repetitions")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from ..backends.registry import select_backend
    from ..checkpoint.verify import resolve_device
    from ..experts import NvFp4Experts
    from ..moe import fused_moe

    device = resolve_device(args.device)
    shape = _shapes(device, args.full)
    E, topk, H, I, M = shape
    if args.tokens:
        M = args.tokens
    dtype = torch.bfloat16
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    print(f"Qwen3-30B-A3B-shaped MoE layer: E={E}, top-{topk}, H={H}, I={I}, M={M} tokens, {dtype}, on {device}"
          + ("" if shape == QWEN3_30B_A3B else " (scaled down on CPU so it takes seconds; --full for the real shape)"))
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

    def forward() -> torch.Tensor:
        out = fused_moe(x, experts, topk_weights, topk_ids, backend=name)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out

    out = forward()  # warm-up (compilation, autotuning)
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        out = forward()
        times.append(time.perf_counter() - t0)
    ref = fused_moe(x, experts, topk_weights, topk_ids, backend="reference")
    diff = out.float() - ref.float()
    rel = float(diff.norm() / ref.float().norm().clamp_min(1e-30))
    times.sort()
    print(f"relative error vs the reference backend: {rel:.3e} (max abs diff {float(diff.abs().max()):.3e})")
    if device.type == "cuda":
        static = torch.empty_like(x)
        gpu, how = _gpu_time(lambda: fused_moe(x, experts, topk_weights, topk_ids, backend=name, out=static,
                                               validate=False), device)
        print(f"time per forward: {gpu.median_us / 1e3:.3f} ms on the GPU ({how}, median of {gpu.reps})")
        if times:
            print(f"host wall clock of one eager call: {times[len(times) // 2] * 1e3:.3f} ms (median of {args.repeat}, "
                  "validation, launch and synchronization included)")
    elif times:
        print(f"time per forward: {times[len(times) // 2] * 1e3:.3f} ms (median of {args.repeat}, "
              "host wall clock incl. launch)")
    ok = rel < TOLERANCE
    print("OK" if ok else "MISMATCH: the backend disagrees with the reference")
    return 0 if ok else 1
