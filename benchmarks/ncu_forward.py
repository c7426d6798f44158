"""One eager ``fused_moe`` forward inside an NVTX range, for Nsight Compute (diagnosis only).

    ncu --nvtx --nvtx-include "forward/" --section SpeedOfLight --section WarpStateStats ... \
        python benchmarks/ncu_forward.py --backend cutlass --model qwen3-30b-a3b --tokens 16384

The benchmark's inputs (``moe_fp4.bench.ep.layer_inputs``: x ~ N(0, 1), near-uniform top-k) on
random NVFP4 experts; three forwards outside the range warm every cache and compile what needs
it, so ``ncu`` profiles the kernels of exactly one forward (range ``forward``) per M.

For stalls per source line (which load a warp waits on), build the library with line tables
(``cmake -S . -B "$MOE_FP4_BUILD_DIR" -DMOE_FP4_LINEINFO=ON``, then ``MOE_FP4_BUILD_DIR=...
pip install -e .``, whose configure keeps the cached option) and add ``--section SourceCounters
--import-source yes`` to ``ncu``.
"""

from __future__ import annotations

import argparse

import torch

from moe_fp4 import fused_moe
from moe_fp4.bench.ep import layer_inputs
from moe_fp4.bench.shapes import MODELS
from moe_fp4.bench.workload import random_experts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="cutlass")
    p.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(MODELS))
    p.add_argument("--tokens", default="16384", help="comma-separated M, one range each")
    args = p.parse_args()
    device = torch.device("cuda")
    shape = MODELS[args.model]
    experts = random_experts(shape, device, 0)
    for m in (int(t) for t in args.tokens.split(",")):
        x, w, ids = layer_inputs(shape, m, device, 0)
        out = torch.empty_like(x)
        for _ in range(3):
            fused_moe(x, experts, w, ids, backend=args.backend, out=out, validate=False)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("forward")
        fused_moe(x, experts, w, ids, backend=args.backend, out=out, validate=False)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        print(f"{args.model} {args.backend} M={m}: one forward profiled", flush=True)


if __name__ == "__main__":
    main()
