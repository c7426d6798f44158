"""Per-kernel GPU time inside one eager ``fused_moe`` forward (torch.profiler, CUPTI), for diagnosis.

The benchmark (``moe-fp4 bench``) times each stage captured alone with a cold L2; this shows
the kernels of the whole forward back to back as the GPU runs them (warm L2, eager launches),
so a stage that is slow only inside the forward, or a kernel nobody expected, stands out.

    PYTHONPATH=. python benchmarks/kernel_breakdown.py --backend cutlass --tokens 1,16,256,4096

Prints, per M: each kernel's mean duration (µs per forward) and the sum, then the wall time of
the forward from the first kernel's start to the last one's end (overlap from programmatic
dependent launch makes it shorter than the sum).

With ``--ncu``, instead, one forward per M runs inside an NVTX range ``forward`` (after the same
warm-up), for Nsight Compute to profile exactly its kernels::

    ncu --nvtx --nvtx-include "forward/" --section SpeedOfLight --section WarpStateStats ... \
        python benchmarks/kernel_breakdown.py --ncu --tokens 16,16384

For stalls per source line (which load a warp waits on), build the library with line tables
(``cmake -S . -B "$MOE_FP4_BUILD_DIR" -DMOE_FP4_LINEINFO=ON``, then ``MOE_FP4_BUILD_DIR=...
pip install -e .``, whose configure keeps the cached option) and add ``--section SourceCounters
--import-source yes`` to ``ncu``. Inputs: the benchmark's (``moe_fp4.bench.ep.layer_inputs``).
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from moe_fp4 import fused_moe
from moe_fp4.bench.ep import layer_inputs
from moe_fp4.bench.shapes import MODELS
from moe_fp4.bench.workload import random_experts


def _short(name: str) -> str:
    """A kernel's name without its namespaces and functor arguments (template arguments kept for the GEMM)."""
    for key in ("routing_single_kernel", "routing_count", "routing_scan", "routing_scatter", "QuantizeValuesUnit",
                "QuantizeUnit", "ReduceUnit"):
        if key in name:
            return key + ("<SiluMul>" if "RowSourceE1" in name or "(moe_fp4::RowSource)1" in name else "")
    if "gemm_kernel" in name:
        return "gemm_kernel" + name[name.find("<"):name.find(">") + 1]
    return name[:100]


def breakdown(backend: str, tokens: int, model: str, iters: int, ncu: bool = False) -> None:
    shape = MODELS[model]
    experts = random_experts(shape, torch.device("cuda"), 0)
    x, w, ids = layer_inputs(shape, tokens, torch.device("cuda"), 0)
    out = torch.empty_like(x)
    for _ in range(3):
        fused_moe(x, experts, w, ids, backend=backend, out=out)
    torch.cuda.synchronize()
    if ncu:
        torch.cuda.nvtx.range_push("forward")
        fused_moe(x, experts, w, ids, backend=backend, out=out, validate=False)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        print(f"== {model} {backend} M={tokens}: one forward in the NVTX range 'forward'", flush=True)
        return
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fused_moe(x, experts, w, ids, backend=backend, out=out)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per = defaultdict(float)
    for e in events:
        per[_short(e.name)] += e.device_time / iters
    first = min(e.time_range.start for e in events)
    last = max(e.time_range.end for e in events)
    print(f"== {model} {backend} M={tokens}: {len(events) / iters:.1f} kernels per forward")
    for name, us in sorted(per.items(), key=lambda kv: -kv[1]):
        print(f"  {us:9.1f} us  {name}")
    print(f"  {sum(per.values()):9.1f} us  sum; first start to last end per forward: {(last - first) / iters:.1f} us")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="cutlass")
    p.add_argument("--tokens", default="1,16,256,4096")
    p.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(MODELS))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--ncu", action="store_true", help="one forward per M in an NVTX range, for Nsight Compute")
    args = p.parse_args()
    for m in (int(t) for t in args.tokens.split(",")):
        breakdown(args.backend, m, args.model, args.iters, args.ncu)


if __name__ == "__main__":
    main()
