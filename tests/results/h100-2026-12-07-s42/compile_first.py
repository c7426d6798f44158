"""Probe (s42c): torch.compile(mode="reduce-overhead") of fused_moe with no eager call first, in a fresh process.

The README asks for one eager call of each shape before a CUDA graph, so that the workspace the graph reuses is
allocated outside the graph's pool. A model compiled this way (transformers' generate compiles its decode step) may
make its first call of a shape compiled. This prints whether that works, per backend, against the eager result:

    PYTHONPATH=. python3 tests/results/h100-2026-12-07-s42/compile_first.py cutlass
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for test_compile's cases
from test_compile import make_experts, make_inputs  # noqa: E402

from moe_fp4 import fused_moe  # noqa: E402

backend = sys.argv[1]
ex = make_experts(24, "cuda")
x, w, ids = make_inputs(25, 8, device="cuda")


def f(x, w, ids):
    return fused_moe(x, ex, w, ids, backend=backend, validate=False)


try:
    compiled = torch.compile(f, mode="reduce-overhead", fullgraph=True)
    outs = [compiled(x, w, ids).clone() for _ in range(3)]  # warm-up run, capture, replay
    want = f(x, w, ids)
    same = all(torch.equal(o.view(torch.uint8), want.view(torch.uint8)) for o in outs)
    print(f"{backend}: compile-first {'equals eager' if same else 'DIFFERS from eager'}")
except Exception as e:  # the probe reports what happened; it asserts nothing
    print(f"{backend}: compile-first raised {type(e).__name__}: {str(e).splitlines()[0]}")
