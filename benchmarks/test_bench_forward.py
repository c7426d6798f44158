"""The whole MoE forward: each moe_fp4 backend beside vLLM's Marlin NVFP4 MoE and the bf16 grouped-GEMM MoE.

Every row is checked against its reference before and after timing (see ``moe_fp4.bench.checks``).
``extra_info`` holds the CUDA-event numbers: ``us`` (median), ``p20_us``/``p80_us``, ``tflops``,
``weight_tbps``, ``pct_roofline`` and ``vs_marlin``/``vs_bf16`` (peer µs / row µs).
"""

from __future__ import annotations

import pytest
from _grid import grid

from moe_fp4.backends.registry import BACKENDS
from moe_fp4.bench.engine import PEERS

BACKEND_NAMES = tuple(b for b in BACKENDS if b != "reference")
PARAMS, IDS = grid(PEERS + BACKEND_NAMES)


@pytest.mark.gpu
@pytest.mark.parametrize("model, M, name", PARAMS, ids=IDS)
def test_bench_forward(benchmark, bench, model, M, name):
    import torch

    from moe_fp4.backends.registry import why_unavailable

    peer_us = bench.peer_us(model, M)
    if name in PEERS:
        path = bench.peer_path(model, M, name)
    else:
        path = bench.case(model, M).backend_path(name, why_unavailable(name, bench.device, torch.bfloat16))
    row = bench.run(benchmark, path, peer_us)
    assert row["check_ok"]
