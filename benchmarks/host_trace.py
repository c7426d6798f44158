"""Where an eager ``fused_moe`` call's host time goes on a GPU, per segment of the call.

    python benchmarks/host_trace.py [--backends cutlass,triton] [--tokens 1,64] [--reps 300]

The benchmark's "eager host overhead" is the wall time of a synchronized call minus its GPU time
(``moe_fp4.bench.overhead``); this splits the host side of such calls (Qwen3-30B-A3B layer,
random NVFP4 weights, the same synchronized call) into segments timed with ``perf_counter_ns``
around the plan's launches (``pipeline._Plan._launch``, patched in this process only):

* ``before launches``: ``fused_moe`` entry to the plan's first launch (checks, resolution, op,
  workspace, plan lookup, the workspace lock, the stream query and order);
* one row per bound launch (``routing`` ... ``moe_reduce``);
* ``after plan``: the last launch to ``fused_moe``'s return (with the Triton backend's
  ``LaunchBatch``, the batch's exit: its launches go out in one library call there);
* ``returned``: the whole call until it returns; ``synchronized``: until the GPU is done too.

Then a ``torch.profiler`` table of the same calls (CPU side: which runtime and driver calls take
the time). Medians over ``--reps`` calls, each after a synchronize, as the benchmark's are.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

import torch

from moe_fp4 import NvFp4Experts, fused_moe, pipeline

E, H, I, TOPK = 128, 2048, 768, 8  # noqa: E741
STAGES = ("routing", "quantize_rows", "gemm1", "silu_mul_quantize", "gemm2", "moe_reduce")


class _Marks:
    """Timestamps of one call, by segment name (ns)."""

    def __init__(self) -> None:
        self.t: list[tuple[str, int]] = []

    def mark(self, name: str) -> None:
        self.t.append((name, time.perf_counter_ns()))


MARKS = _Marks()


def _patch() -> None:
    """Time each launch of ``_Plan._launch`` into :data:`MARKS` (same calls, same order)."""
    def _launch(bound, problem, weights, on_input, out, stream):
        MARKS.mark("before launches")
        bound.routing(problem.topk_ids, stream)
        MARKS.mark("routing")
        bound.quantize_rows(problem.hidden_states, weights.reshape(-1) if on_input else None, stream)
        MARKS.mark("quantize_rows")
        bound.gemm1(stream)
        MARKS.mark("gemm1")
        bound.silu_mul_quantize(stream)
        MARKS.mark("silu_mul_quantize")
        bound.gemm2(stream)
        MARKS.mark("gemm2")
        bound.moe_reduce(None if on_input else weights, out, stream)
        MARKS.mark("moe_reduce")

    pipeline._Plan._launch = staticmethod(_launch)


def trace(backend: str, ex: NvFp4Experts, M: int, reps: int, device: str = "cuda",  # noqa: N803
          validate: bool = False) -> dict[str, float]:
    """Median µs per segment (module docstring) of ``reps`` synchronized eager calls."""
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, H, generator=g).bfloat16().to(device)
    w = torch.softmax(torch.randn(M, TOPK, generator=g), -1).to(device)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(M)]).to(torch.int32).to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out = torch.empty_like(x)

    def call() -> None:
        fused_moe(x, ex, w, ids, backend=backend, out=out, validate=validate)

    for _ in range(20):
        call()
    sync()
    seg: dict[str, list[float]] = {}
    for _ in range(reps):
        MARKS.t.clear()
        t0 = time.perf_counter_ns()
        call()
        t1 = time.perf_counter_ns()
        sync()
        t2 = time.perf_counter_ns()
        prev = t0
        for name, t in MARKS.t:
            seg.setdefault(name, []).append((t - prev) / 1e3)
            prev = t
        seg.setdefault("after plan", []).append((t1 - prev) / 1e3)
        seg.setdefault("returned", []).append((t1 - t0) / 1e3)
        seg.setdefault("synchronized", []).append((t2 - t0) / 1e3)
    return {k: statistics.median(v) for k, v in seg.items()}


def profile(backend: str, ex: NvFp4Experts, M: int, reps: int, validate: bool = False) -> str:  # noqa: N803
    x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
    w = torch.softmax(torch.randn(M, TOPK, device="cuda"), -1)
    ids = torch.randint(0, E, (M, TOPK), device="cuda", dtype=torch.int32)
    out = torch.empty_like(x)
    for _ in range(20):
        fused_moe(x, ex, w, ids, backend=backend, out=out, validate=validate)
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(reps):
            fused_moe(x, ex, w, ids, backend=backend, out=out, validate=validate)
            torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backends", default="cutlass,triton")
    p.add_argument("--tokens", default="1,64")
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--routing-small-max", type=int, metavar="N", help="routing.SMALL_MAX for this run (one "
                   "routing launch up to N flat indices; default 256)")
    p.add_argument("--validate", action="store_true", help="calls with validate=True (default: False, as the "
                   "benchmark's host figure; fused_moe's own default is True)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("host_trace.py needs a CUDA GPU")
    gen = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) / 15).bfloat16()
    w2 = (torch.randn(E, H, I, generator=gen) / 15).bfloat16()
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.routing_small_max:
        importlib.import_module("moe_fp4.triton_kernels.routing").SMALL_MAX = args.routing_small_max
    _patch()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for backend in args.backends.split(","):
        ex = NvFp4Experts.quantize(w13, w2, a13_gs=2688.0, a2_gs=2688.0).to("cuda")
        rows = {M: trace(backend, ex, M, args.reps, validate=args.validate) for M in tokens}
        print(f"\n{backend}: median µs per segment of a synchronized eager call (validate={args.validate})")
        print(f"  {'segment':20s}" + "".join(f"{f'M={M}':>9s}" for M in tokens))
        keys = list(dict.fromkeys(k for r in rows.values() for k in r))
        for k in keys:
            print(f"  {k:20s}" + "".join(f"{rows[M].get(k, float('nan')):9.1f}" for M in tokens))
        if not args.no_profile:
            for M in tokens:
                print(f"\n{backend} M={M}: torch.profiler, {min(args.reps, 100)} calls")
                print(profile(backend, ex, M, min(args.reps, 100), args.validate))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
