"""W4A4 against W4A16, per backend, timed against each other in one process.

    PYTHONPATH=. python benchmarks/precision_ab.py [--backends triton,cutlass] [--models qwen3-30b-a3b,...]
                                                   [--tokens 1,4,16,64,256,1024] [--rounds 3] [--out F.json]

``precision="w4a16"`` (Marlin's semantics: the activations are not quantized) against the default
``"w4a4"``, the whole forward of each backend that serves both on this GPU (``triton``: its values
operand, 9.x; ``cutlass``: the sm_90a GEMM): the benchmark's timing (CUDA-graph replays, the L2 flushed
before each, median), best median of ``--rounds`` rounds taken in turns. Each row also says how far
the backends' W4A16 outputs are from each other (norm-relative, and the largest difference over the
largest output) and, at ``M <= --check-max`` tokens, from the reference W4A16 (``exact_moe``).
"""

from __future__ import annotations

import argparse
import json

import torch

from moe_fp4 import fused_moe
from moe_fp4.bench.ep import layer_inputs
from moe_fp4.bench.shapes import MODELS
from moe_fp4.bench.timing import GpuTimer
from moe_fp4.bench.workload import random_experts
from moe_fp4.testing import errors

PRECISIONS = ("w4a4", "w4a16")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="triton,cutlass")
    p.add_argument("--models", default="qwen3-30b-a3b")
    p.add_argument("--tokens", default="1,4,16,64,256,1024")
    p.add_argument("--rounds", type=int, default=3, help="rounds of turns (default 3)")
    p.add_argument("--check-max", type=int, default=64, help="check against the reference W4A16 up to this M")
    p.add_argument("--out", help="also write the rows as JSON here")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    timer = GpuTimer(device, budget_s=0.02)
    rows = []
    for model in args.models.split(","):
        shape = MODELS[model]
        experts = random_experts(shape, device, seed=0)
        for M in (int(t) for t in args.tokens.split(",")):  # noqa: N806
            x, w, ids = layer_inputs(shape, M, device, seed=0)
            paths = [(b, prec) for b in backends for prec in PRECISIONS]
            outs, prepared = {}, {}
            for b, prec in paths:
                out = torch.empty_like(x)

                def call(b=b, prec=prec, out=out):
                    return fused_moe(x, experts, w, ids, backend=b, out=out, validate=False, precision=prec)

                call()
                prepared[b, prec] = timer.prepare(call)
                outs[b, prec] = out
            best = dict.fromkeys(paths, float("inf"))
            for _ in range(args.rounds):
                for path in paths:
                    best[path] = min(best[path], timer.time(prepared[path]).median_us)
            row = {"model": model, "M": M, **{f"{b}_{prec}_us": best[b, prec] for b, prec in paths}}
            w16 = [outs[b, "w4a16"] for b in backends]
            if len(w16) > 1:
                row["w4a16_between_backends"] = errors(w16[0], w16[1])
            if M <= args.check_max:
                ref = fused_moe(x, experts, w, ids, backend="reference", precision="w4a16")
                row["w4a16_to_reference"] = {b: errors(outs[b, "w4a16"], ref) for b in backends}
            rows.append(row)
            print(f"{model:16s} M={M:5d} " + " ".join(f"{b} {prec} {best[b, prec]:8.1f}" for b, prec in paths)
                  + "  " + " ".join(f"{k} {v}" for k, v in row.items() if k.startswith("w4a16_")), flush=True)
        experts = None  # (the next model's weights in its place)
        torch.cuda.empty_cache()
    if args.out:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "timing": timer.description,
                "rounds": args.rounds}
        with open(args.out, "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
