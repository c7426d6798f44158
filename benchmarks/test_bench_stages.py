"""Each stage of a backend's pipeline, captured and timed alone on its own inputs.

Stages: routing, quantize, gemm1, silu_mul_quantize, gemm2, reduce (``moe_fp4.bench.workload.STAGES``).
One ``run_pipeline`` of the backend's stages per layer and M, each stage checked against the
reference stage, produces every stage's inputs (``moe_fp4.bench.workload.StageChain``).
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
    from moe_fp4.bench.engine import stage_set
    from moe_fp4.bench.workload import describe_exception

    provider, stage = name.split("/")
    try:
        stage_set(provider)
    except Exception as exc:  # noqa: BLE001 - e.g. the backend's module cannot be imported here: say so
        pytest.skip(f"{provider} stages: {describe_exception(exc)}")
    path = bench.stage_path(model, M, provider, stage)
    row = bench.run(benchmark, path, {})
    assert row["check_ok"]
