"""``benchmarks/tune_triton.py``: its plumbing on CPU (the GPU run is the lead's, once).

The smoke run goes through everything the H200 run does except the compile workers and
GPU timing: candidates, checks against the stage references, whole-forward check, table and
JSON. The launches the compile workers would make are built for every real layer shape
with kernel launches intercepted, so a shape or argument mistake there shows up here.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "tune_triton.py"

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]


@pytest.fixture(scope="module")
def tune():
    sys.path.insert(0, str(SCRIPT.parent))
    import tune_triton

    return tune_triton


def _numpy_breaks_the_interpreter() -> bool:
    import numpy

    major, minor = (int(v) for v in numpy.__version__.split(".")[:2])
    return (major, minor) >= (2, 4)


# The smoke run forces Triton's CPU interpreter, whose runtime loop bounds fail with numpy >= 2.4
# (triton#9171: numpy >= 2.4 no longer converts 1-element arrays to loop bounds). CI pins
# numpy < 2.4; a GPU image with a newer numpy (the H200's has 2.5.2) cannot run it, and runs
# the real tuning instead.
@pytest.mark.skipif(_numpy_breaks_the_interpreter(), reason="Triton's interpreter needs numpy < 2.4 (triton#9171)")
def test_smoke_run_checks_times_and_reports(tmp_path):
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--smoke"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "tune_triton.json").read_text())
    assert report["smoke"] and report["wrong"] == [] and report["skipped"] == []
    assert [r["ok"] for r in report["exactness"]] == [True]
    stages = collections.Counter((r["M"], r["stage"]) for r in report["stages"])
    assert set(stages) == {(m, s) for m in (1, 16) for s in ("quantize", "gemm1", "silu_mul_quantize", "gemm2")}
    assert all(n == 2 for n in stages.values())  # the table's configuration and one candidate each
    for r in report["stages"] + report["fused"]:
        assert r["status"] == "ok" and r["check_ok"] and r["us"] > 0, r
    assert sum(r["default"] for r in report["stages"]) == 8
    assert "fused_moe" in proc.stdout and "gemm1" in proc.stdout


def test_warm_up_launches_build_for_every_layer(tune, monkeypatch):
    """Every launch the compile workers would make is built with the real layer shapes (launches intercepted)."""
    import triton.runtime.interpreter as interpreter
    import triton.runtime.jit as jit

    from moe_fp4.bench.shapes import MODELS

    launched = collections.Counter()
    for cls in (interpreter.InterpretedFunction, jit.JITFunction):  # nothing runs (the tensors are uninitialised)
        def launch(self, grid):
            return lambda *a, **k: launched.update([self.fn.__name__])

        monkeypatch.setattr(cls, "__getitem__", launch)
    descs = tune._descriptors(list(MODELS.values()), tune.TOKENS, torch.device("cpu"), False)
    kinds = collections.Counter(d[0] for d in descs)
    assert set(kinds) == {"routing", "reduce", "quantize", "silu_mul_quantize", "gemm1", "gemm2", "exact"}
    assert len(descs) == len(set(descs))
    tk = tune._tk()
    for kind, model, M, fields in descs:
        if kind == "exact":
            tune._exactness_launch(tk, tk.GemmConfig(*fields), tune._exactness_operands(1, 2, "weights"),
                                   torch.device("cpu"))
        else:
            tune._launch_shapes(tk, kind, MODELS[model], M, fields, torch.device("cpu"))
    assert launched["grouped_gemm_kernel"] == kinds["gemm1"] + kinds["gemm2"] + kinds["exact"]
    assert launched["quantize_grouped_kernel"] == kinds["quantize"] + kinds["silu_mul_quantize"]


def test_candidates_are_valid_and_cover_each_regime(tune):
    tk = tune._tk()
    for table, make in ((tune.GEMM_CANDIDATES, tk.GemmConfig), (tune.QUANT_CANDIDATES, tk.QuantConfig)):
        regimes = collections.Counter(where for where, _ in table)
        assert set(regimes) == {tune.DECODE, tune.MID, tune.LARGE} and min(regimes.values()) >= 4
        names = [tune.config_name(make(*fields)) for _, fields in table]
        assert len(names) == len(set(zip(names, (w for w, _ in table))))  # no candidate twice in a regime


def test_values_sweep_times_the_fused_first_gemm_against_the_two_launches():
    """``benchmarks/sweep_triton_values.py``'s fused-GEMM row: its check passes on the case's routed rows,
    and a tile that cannot fuse gives no row (interpreter; the sweep itself runs on the H200)."""
    from moe_fp4.backends.triton import kernels
    from moe_fp4.bench.engine import measure
    from moe_fp4.bench.timing import WallTimer

    if torch.cuda.is_available():
        pytest.skip("the interpreter check; on a GPU the sweep itself runs")
    sweep, tk, case = _sweep(), kernels(), _smoke_case(4)
    path = sweep.fused_gemm1_path(case, tk.GemmConfig(16, 32, 64, True, 4, 3, 2), tk)  # split K: the reduce fuses
    row = measure(path, WallTimer(reps=1))
    assert row["status"] == "ok", row
    assert sweep.fused_gemm1_path(case, tk.GemmConfig(16, 16, 64, True), tk) is None


def test_values_sweep_reads_its_candidates_and_the_dense_list_is_valid():
    """``sweep_triton_values.py --fields``: GemmConfig field tuples (T/F for swap_ab, the dequant mode as
    it is, ints); its DENSE_CANDIDATES build valid dense configurations that do not split K."""
    from moe_fp4.backends.triton import kernels

    sweep, tk = _sweep(), kernels()
    got = sweep.parse_fields("128,256,64,F,8,3,1,bits,1024;16,64,128,T,4,4,0")
    assert got == [(128, 256, 64, False, 8, 3, 1, "bits", 1024), (16, 64, 128, True, 4, 4, 0)]
    assert tk.GemmConfig(*got[0]).dense_mib == 1024 and tk.GemmConfig(*got[1]).swap_ab
    assert all(tk.GemmConfig(*f).dense_mib > 0 and tk.GemmConfig(*f).split_k == 1 for f in sweep.DENSE_CANDIDATES)


def test_values_sweep_times_the_quantization_stages_checked_against_the_format_core():
    """``sweep_triton_values.py --quant``: both values quantization stages with a pinned QuantConfig, each
    checked byte for byte against the format core's (interpreter; the sweep itself runs on the H200)."""
    from moe_fp4.backends.triton import kernels
    from moe_fp4.bench.engine import measure
    from moe_fp4.bench.timing import WallTimer

    if torch.cuda.is_available():
        pytest.skip("the interpreter check; on a GPU the sweep itself runs")
    sweep, tk, case = _sweep(), kernels(), _smoke_case(6)
    for cfg in (tk.QuantConfig(4, 64, 1), tk.QuantConfig(4, 128, 1, whole_blocks=True)):
        paths = sweep.quant_paths(case, cfg, tk)
        assert [p.stage for p in paths] == ["quantize", "silu_mul_quantize"]
        for path in paths:
            row = measure(path, WallTimer(reps=1))
            assert row["status"] == "ok", row
    assert all(tk.QuantConfig(*f) for f in sweep.QUANT_CANDIDATES)
    assert any(tk.QuantConfig(*f).whole_blocks for f in sweep.QUANT_CANDIDATES)
    assert sweep.parse_fields("8,512,4,1024,T") == [(8, 512, 4, 1024, True)]
    # the sweep's rows and summary name a whole-block candidate apart from its 16-wide twin
    assert sweep.name(tk.QuantConfig(8, 512, 4, whole_blocks=True)) != sweep.name(tk.QuantConfig(8, 512, 4))


def _sweep():
    """``benchmarks/sweep_triton_values.py`` as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sweep_triton_values", ROOT / "benchmarks" / "sweep_triton_values.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    return sweep


def _smoke_case(M: int):
    """A five-expert layer's case on the CPU (the sweeps' checks run in the interpreter)."""
    from moe_fp4.bench.roofline import Ceilings
    from moe_fp4.bench.shapes import ModelShape
    from moe_fp4.bench.workload import Case, random_experts

    shape = ModelShape("smoke", E=5, topk=2, H=128, I=64)
    return Case(shape, random_experts(shape, torch.device("cpu"), seed=0), M,
                Ceilings(copy_tbps=4.25, stream_tbps=4.46, bf16_tflops=679.0), seed=0, check_tokens=64)
