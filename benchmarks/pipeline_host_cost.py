"""Host cost of moe_fp4's pipeline framework alone: ``run_pipeline`` with kernels that do nothing.

    python benchmarks/pipeline_host_cost.py [--profile]

Runs on CPU tensors (no GPU needed) at the Qwen3-30B-A3B shape, M=1: what every backend's
forward pays in Python for the stage contract (argument checks, buffer views, the workspace
lookup) before any kernel launches. Not a GPU measurement: the eager host overhead of whole
calls on the H200 is in the benchmark report (``moe-fp4 bench``, "Eager host overhead").
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch

from moe_fp4 import NvFp4Experts
from moe_fp4.moe import MoEProblem
from moe_fp4.pipeline import StageSet, cached_workspace, run_pipeline


class NoopKernels:
    def routing(self, topk_ids, out, scratch): ...
    def quantize_rows(self, x, gs, routing, gather, row_scale, out, config): ...
    def silu_mul_quantize(self, h, gs, routing, out, config): ...
    def grouped_gemm(self, a, w, routing, out, scratch, config): ...
    def moe_reduce(self, y, routing, topk_weights, out): ...


def main(argv: list[str]) -> int:
    stages = StageSet.from_kernels("noop", NoopKernels(), reduce_dtypes=(torch.bfloat16,))
    E, H, I, M, topk = 128, 2048, 768, 1, 8  # noqa: E741
    g = torch.Generator().manual_seed(0)
    ex = NvFp4Experts.quantize((torch.randn(E, 2 * I, H, generator=g) / 15).bfloat16(),
                               (torch.randn(E, H, I, generator=g) / 15).bfloat16(), a13_gs=2688.0, a2_gs=2688.0)
    x = torch.randn(M, H, generator=g).bfloat16()
    w = torch.rand(M, topk, generator=g)
    ids = torch.randint(0, E, (M, topk), generator=g, dtype=torch.int32)

    def call():
        problem = MoEProblem(x, ex, w, ids, False, None)
        return run_pipeline(stages, problem, cached_workspace(stages, problem))

    for _ in range(20):
        call()
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    print(f"run_pipeline with no-op kernels: {(time.perf_counter() - t0) / n * 1e6:.1f} us per call")
    if "--profile" in argv:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(500):
            call()
        prof.disable()
        pstats.Stats(prof).sort_stats("cumtime").print_stats(20)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
