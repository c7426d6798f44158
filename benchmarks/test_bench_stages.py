"""Each stage of a backend's pipeline, captured and timed alone on its own inputs.

Stages: routing, quantize, gemm1, silu_mul_quantize, gemm2, reduce (``moe_fp4.stages``). The
earlier stages of the chain run eagerly (and are checked) to produce the timed stage's inputs.
GEMM rows also carry ``tflops``, ``weight_tbps`` and ``pct_roofline`` of that GEMM alone.
"""

from __future__ import annotations

import pytest
from _grid import grid

from moe_fp4.backends.registry import BACKENDS
from moe_fp4.bench.workload import STAGES

PARAMS, IDS = grid(tuple(f"{b}/{s}" for b in BACKENDS if b != "reference" for s in STAGES))


@pytest.mark.gpu
@pytest.mark.parametrize("model, M, name", PARAMS, ids=IDS)
def test_bench_stage(benchmark, bench, model, M, name):
    from moe_fp4.bench.engine import stage_module
    from moe_fp4.bench.workload import StageChain, describe_exception

    provider, stage = name.split("/")
    try:
        module = stage_module(provider)
    except Exception as exc:  # noqa: BLE001 - e.g. the CUDA library is not built: say so
        pytest.skip(f"{provider} stages: {describe_exception(exc)}")
    path = next(p for p in StageChain(bench.case(model, M), provider, module).paths() if p.stage == stage)
    row = bench.run(benchmark, path, {})
    assert row["check_ok"]
